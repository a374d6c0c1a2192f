"""tests/fault_proxy.py against a local echo server: pass-through, added latency, blackhole, refuse, and
recovery from each."""

from __future__ import annotations

import socket
import socketserver
import threading
import time

import pytest

from tests.fault_proxy import FaultProxy


class _Echo(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        while data := self.request.recv(65536):
            self.request.sendall(data)


@pytest.fixture()
def echo_proxy():
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _Echo)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    proxy = FaultProxy("127.0.0.1", server.server_address[1])
    yield proxy
    proxy.close()
    server.shutdown()
    server.server_close()


def _connect(proxy: FaultProxy, timeout_s: float = 5.0) -> socket.socket:
    return socket.create_connection(("127.0.0.1", proxy.port), timeout=timeout_s)


def _roundtrip(sock: socket.socket, payload: bytes = b"ping") -> bytes:
    sock.sendall(payload)
    received = b""
    while len(received) < len(payload):
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("closed")
        received += chunk
    return received


def test_pass_through_forwards_both_ways(echo_proxy):
    with _connect(echo_proxy) as sock:
        assert _roundtrip(sock) == b"ping"
        big = bytes(range(256)) * 4096  # 1 MiB: many chunks each way
        assert _roundtrip(sock, big) == big
    stats = echo_proxy.stats()
    assert stats.connections == 1 and stats.forwarded_bytes >= 2 * (4 + len(big))


def test_slow_adds_latency_to_open_and_new_connections(echo_proxy):
    with _connect(echo_proxy) as before:
        assert _roundtrip(before) == b"ping"
        echo_proxy.slow(0.3)
        started = time.monotonic()
        assert _roundtrip(before) == b"ping"  # one chunk each way: two delays
        assert time.monotonic() - started >= 0.6
        with _connect(echo_proxy) as new:
            started = time.monotonic()
            assert _roundtrip(new) == b"ping"
            assert time.monotonic() - started >= 0.6
        echo_proxy.pass_through()
        started = time.monotonic()
        assert _roundtrip(before) == b"ping"
        assert time.monotonic() - started < 0.3
    assert echo_proxy.stats().delayed_chunks >= 4


def test_blackhole_answers_nothing_then_resets_what_it_swallowed(echo_proxy):
    with _connect(echo_proxy) as idle, _connect(echo_proxy) as busy:
        assert _roundtrip(idle) == b"ping" and _roundtrip(busy) == b"ping"
        echo_proxy.blackhole()
        busy.settimeout(0.5)
        busy.sendall(b"lost")
        with pytest.raises(socket.timeout):
            busy.recv(100)
        with _connect(echo_proxy) as new:  # accepted, never answered
            new.settimeout(0.5)
            new.sendall(b"lost too")
            with pytest.raises(socket.timeout):
                new.recv(100)
            assert echo_proxy.stats().dropped_bytes >= len(b"lost") + len(b"lost too")
            echo_proxy.pass_through()
            new.settimeout(5)
            with pytest.raises(ConnectionError):
                _roundtrip(new)  # its stream lost bytes: reset when the blackhole ended
        busy.settimeout(5)
        with pytest.raises(ConnectionError):
            _roundtrip(busy)
        assert _roundtrip(idle) == b"ping"  # lost nothing: still usable
    with _connect(echo_proxy) as fresh:
        assert _roundtrip(fresh) == b"ping"


def test_refuse_resets_open_and_new_connections_until_pass_through(echo_proxy):
    with _connect(echo_proxy) as before:
        assert _roundtrip(before) == b"ping"
        echo_proxy.refuse()
        with pytest.raises(ConnectionError):
            _roundtrip(before)
    with pytest.raises(ConnectionError):  # the kernel accepts; the proxy resets at once (the reset may
        with _connect(echo_proxy) as new:  # already reach connect(), or only the first send/recv)
            _roundtrip(new)
    assert echo_proxy.stats().refused >= 2
    echo_proxy.pass_through()
    with _connect(echo_proxy) as after:
        assert _roundtrip(after) == b"ping"


def test_a_dead_target_is_a_reset_for_the_client():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    with FaultProxy("127.0.0.1", port) as proxy, pytest.raises(ConnectionError):
        with _connect(proxy) as sock:
            _roundtrip(sock)
