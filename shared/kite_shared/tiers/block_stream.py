"""Cross-host block bytes: the ru-pool streams the units of a get over a TCP connection of their own
instead of inside NATS replies (issue 15).

Why: a reader on another host cannot map the pool's files (kite_shared.tiers.handoff), and NATS is a poor
pipe for bulk bytes: a reply is capped at max_payload (8 MiB on KITE's nats-server, 1 MiB by default),
every byte goes pool -> nats-server -> reader through two sockets and two parsers, and a large reply holds
the reader's NATS connection (its lookups and events wait behind it). Measured on the 2-core CI machine,
128 hot blocks of 369 KB: 290-364 MB/s inline over NATS (bench/bench_data_plane.py has this path's own
figure beside it).

Protocol (NATS keeps the control):
1. The reader's `PoolGetRequest` says `stream=True`. The pool finds the units as for any get and, instead of
   putting them in the reply, `offer`s them under a ticket (16 random bytes, good for one transfer within
   `ticket_ttl_s`) and replies with its data address, the ticket and whether the port speaks TLS.
2. The reader connects to that address, sends the ticket, and reads: per unit a big-endian uint32 length
   and the unit's bytes; a length of 0 ends the transfer. An unknown or expired ticket gets the end at
   once (the reader then has nothing: a miss, and it asks again inline).

The ticket is a capability handed out only over NATS (authenticated by the cluster's NATS credentials):
whoever cannot ask the pool cannot take a transfer. A connection must send its ticket within
TICKET_WAIT_S, and at most MAX_CONNECTIONS are served at once (more are closed: that get is a miss), so
idle or surplus connections cannot pile up. The bytes are integrity-protected as on every path
(readers verify each unit's payload tag and HMAC); confidentiality needs TLS (`KITE_POOL_DATA_TLS_CERT` /
`_KEY` on the pool; readers verify it with the NATS CA or the system's). A transfer that breaks midway is
a shorter prefix for the reader, verified unit by unit, never a wrong block.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import socket
import ssl
import struct
import time
from dataclasses import dataclass

log = logging.getLogger(__name__)

TICKET_BYTES = 16
_LENGTH = struct.Struct(">I")
MAX_UNIT_BYTES = 1 << 30  # a length above this is a broken stream, not a unit
TICKET_WAIT_S = 2.0  # a reader sends its ticket as soon as it connects; a silent connection is dropped
MAX_CONNECTIONS = 64  # transfers at once; more are closed at once (the reader's get is then a miss)


@dataclass
class _Offer:
    units: list[bytes | memoryview]
    expires_at: float


class BlockStreamServer:
    """The pool's side: a TCP server that hands each offered set of units to the one connection that
    brings its ticket. `address` is what readers connect to (`advertise`, or this host's address that
    reaches `route_to` plus the bound port)."""

    def __init__(self, ticket_ttl_s: float = 10.0, clock=time.monotonic) -> None:
        self.ticket_ttl_s = ticket_ttl_s
        self.clock = clock
        self.address = ""
        self.tls = False
        self._server: asyncio.AbstractServer | None = None
        self._offers: dict[bytes, _Offer] = {}
        self.num_transfers = 0
        self.num_bytes_sent = 0
        self.num_unknown_tickets = 0
        self.num_refused = 0  # connections closed because MAX_CONNECTIONS were open
        self._open = 0

    async def start(self, listen: str, advertise: str = "", route_to: str = "",
                    ssl_context: ssl.SSLContext | None = None) -> None:
        """Listen on `listen` ("host:port"; port 0: any free one)."""
        host, port = _split(listen)
        self._server = await asyncio.start_server(self._serve, host or None, port, ssl=ssl_context)
        bound_port = self._server.sockets[0].getsockname()[1]
        self.tls = ssl_context is not None
        self.address = advertise or f"{_reachable_ip(route_to, host)}:{bound_port}"
        log.info("block stream on %s (advertised %s%s)", listen, self.address, ", TLS" if self.tls else "")

    async def stop(self) -> None:
        """Stop listening and drop the offers; transfers under way end when their reader has its units
        (not waited for: a stop must not wait on a slow reader)."""
        if self._server is not None:
            self._server.close()
        self._offers.clear()

    def offer(self, units: list[bytes | memoryview]) -> bytes:
        """A ticket for one transfer of these units (held until taken or expired)."""
        now = self.clock()
        for ticket in [t for t, o in self._offers.items() if o.expires_at <= now]:
            del self._offers[ticket]  # a reader that never came: free what it would have taken
        ticket = secrets.token_bytes(TICKET_BYTES)
        self._offers[ticket] = _Offer(units, now + self.ticket_ttl_s)
        return ticket

    @property
    def num_offers_held(self) -> int:
        return len(self._offers)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._open >= MAX_CONNECTIONS:
            self.num_refused += 1
            writer.close()
            return
        self._open += 1
        try:
            ticket = await asyncio.wait_for(reader.readexactly(TICKET_BYTES), TICKET_WAIT_S)
            offer = self._offers.pop(ticket, None)
            if offer is None or offer.expires_at <= self.clock():
                self.num_unknown_tickets += 1
                log.warning("block stream: unknown or expired ticket from %s", writer.get_extra_info("peername"))
                offer = _Offer([], 0.0)
            for data in offer.units:
                writer.write(_LENGTH.pack(len(data)))
                writer.write(data)
                await writer.drain()  # one unit in flight at a time: memory stays bounded
                self.num_bytes_sent += len(data)
            writer.write(_LENGTH.pack(0))
            await writer.drain()
            self.num_transfers += 1
        except (OSError, asyncio.IncompleteReadError, asyncio.TimeoutError) as exc:
            log.info("block stream transfer to %s ended early: %r", writer.get_extra_info("peername"), exc)
        finally:
            self._open -= 1
            writer.close()


async def fetch(address: str, ticket: bytes, ssl_context: ssl.SSLContext | None = None) -> list[bytes]:
    """The reader's side: the units offered under `ticket`, in order. A connection that breaks midway
    gives the units received so far (a shorter prefix); one that cannot be made raises OSError."""
    host, port = _split(address)
    reader, writer = await asyncio.open_connection(host, port, ssl=ssl_context,
                                                   server_hostname=host if ssl_context else None)
    units: list[bytes] = []
    try:
        writer.write(ticket)
        await writer.drain()
        while True:
            (length,) = _LENGTH.unpack(await reader.readexactly(_LENGTH.size))
            if length == 0:
                break
            if length > MAX_UNIT_BYTES:
                log.warning("block stream from %s announced %d bytes; stopped", address, length)
                break
            units.append(await reader.readexactly(length))
    except (asyncio.IncompleteReadError, ConnectionError) as exc:
        log.warning("block stream from %s broke after %d units: %r", address, len(units), exc)
    finally:
        writer.close()
    return units


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def _reachable_ip(route_to: str, bound_host: str) -> str:
    """The address other hosts reach this one at: the bound one if specific, else the local address of
    the route towards `route_to` (the NATS server: whoever shares the bus can route here), else the host
    name. (A UDP connect only picks the route; it sends nothing.)"""
    if bound_host and bound_host not in ("0.0.0.0", "::"):
        return bound_host
    if route_to:
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
                probe.connect((route_to, 9))
                return probe.getsockname()[0]
        except OSError:
            pass
    return socket.gethostname()
