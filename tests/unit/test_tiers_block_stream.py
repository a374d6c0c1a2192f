"""The cross-host block stream (kite_shared.tiers.block_stream) over real loopback TCP: one transfer per
ticket, in order; unknown, expired and reused tickets get nothing; a transfer cut short is a prefix; TLS
verified with the cluster's CA."""

from __future__ import annotations

import asyncio
import ssl
import struct

import pytest

from kite_shared.tiers import block_stream
from tests.tls_certs import TestCA

UNITS = [b"a" * 10, b"b" * 300_000, memoryview(b"c" * 7)]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
async def server():
    clock = Clock()
    srv = block_stream.BlockStreamServer(ticket_ttl_s=10.0, clock=clock)
    await srv.start("127.0.0.1:0")
    srv.clock_for_tests = clock
    yield srv
    await srv.stop()


async def test_a_ticket_brings_its_units_in_order_once(server):
    assert server.address.startswith("127.0.0.1:") and not server.tls
    ticket = server.offer(UNITS)
    assert len(ticket) == block_stream.TICKET_BYTES and server.num_offers_held == 1
    assert await block_stream.fetch(server.address, ticket) == [bytes(u) for u in UNITS]
    assert server.num_offers_held == 0 and server.num_transfers == 1
    assert server.num_bytes_sent == sum(map(len, UNITS))
    assert await block_stream.fetch(server.address, ticket) == []  # one transfer per ticket
    assert server.num_unknown_tickets == 1


async def test_unknown_and_expired_tickets_get_nothing_and_expired_offers_are_freed(server):
    assert await block_stream.fetch(server.address, b"\x00" * block_stream.TICKET_BYTES) == []
    stale = server.offer(UNITS)
    server.clock_for_tests.now = 11.0
    assert await block_stream.fetch(server.address, stale) == []
    server.offer(UNITS)  # offering sweeps what expired
    kept = server.offer(UNITS)
    server.clock_for_tests.now = 25.0
    server.offer([b"x"])
    assert server.num_offers_held == 1 and await block_stream.fetch(server.address, kept) == []


async def test_a_transfer_cut_short_is_the_prefix_received():
    async def cut(reader, writer):  # sends one whole unit, then half of the next, then goes away
        await reader.readexactly(block_stream.TICKET_BYTES)
        writer.write(struct.pack(">I", 3) + b"abc" + struct.pack(">I", 10) + b"hal")
        await writer.drain()
        writer.close()

    srv = await asyncio.start_server(cut, "127.0.0.1", 0)
    try:
        port = srv.sockets[0].getsockname()[1]
        assert await block_stream.fetch(f"127.0.0.1:{port}", b"t" * 16) == [b"abc"]
    finally:
        srv.close()
        await srv.wait_closed()


async def test_an_unreachable_stream_raises_oserror():
    probe = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = probe.sockets[0].getsockname()[1]
    probe.close()
    await probe.wait_closed()
    with pytest.raises(OSError):
        await block_stream.fetch(f"127.0.0.1:{port}", b"t" * 16)


async def test_tls_is_verified_with_the_cluster_ca(tmp_path):
    ca = TestCA(tmp_path)
    cert = ca.issue("pool", server=True)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(str(cert.cert), str(cert.key))
    srv = block_stream.BlockStreamServer()
    await srv.start("127.0.0.1:0", ssl_context=context)
    try:
        assert srv.tls
        trusting = ssl.create_default_context(cafile=str(ca.pem))
        assert await block_stream.fetch(srv.address, srv.offer(UNITS), trusting) == [bytes(u) for u in UNITS]
        other = tmp_path / "other"
        other.mkdir()
        stranger = ssl.create_default_context(cafile=str(TestCA(other).pem))
        with pytest.raises(ssl.SSLCertVerificationError):
            await block_stream.fetch(srv.address, srv.offer(UNITS), stranger)
    finally:
        await srv.stop()


def test_the_advertised_address_is_the_route_towards_the_bus():
    assert block_stream._reachable_ip("", "10.1.2.3") == "10.1.2.3"  # bound to one address: that one
    assert block_stream._reachable_ip("127.0.0.1", "0.0.0.0") == "127.0.0.1"


async def test_silent_and_surplus_connections_are_closed(server, monkeypatch):
    monkeypatch.setattr(block_stream, "TICKET_WAIT_S", 0.2)
    monkeypatch.setattr(block_stream, "MAX_CONNECTIONS", 1)
    host, port = block_stream._split(server.address)
    _, silent = await asyncio.open_connection(host, port)  # connects, never sends a ticket
    await asyncio.sleep(0.05)
    assert await block_stream.fetch(server.address, server.offer(UNITS)) == []  # the one slot is taken
    assert server.num_refused == 1
    await asyncio.sleep(0.3)  # the silent one is dropped after TICKET_WAIT_S
    assert await block_stream.fetch(server.address, server.offer(UNITS)) == [bytes(u) for u in UNITS]
    silent.close()
