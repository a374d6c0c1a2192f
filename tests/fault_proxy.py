"""A TCP fault proxy for tests: put it between a service and Redis / S3 / NATS and make that server slow,
silent or dead at runtime, without touching the server or the service.

    proxy = FaultProxy("127.0.0.1", redis.port)   # listens on 127.0.0.1:proxy.port, starts at once
    ... point the client at proxy.port ...
    proxy.slow(2.0)        # every chunk, either direction, is forwarded 2 s late
    proxy.blackhole()      # connections stay open, nothing is answered (bytes are dropped)
    proxy.refuse()         # every connection is reset, now and on connect
    proxy.pass_through()   # back to normal
    proxy.close()

Modes apply to connections already open (at their next chunk) as well as new ones. A connection that
lost bytes to the blackhole is reset when the blackhole ends (its protocol stream is broken; clients
reconnect), as one cut by a real partition would be after its TCP timeout. `refuse` accepts and resets
(RST) rather than closing the listening socket, so the port stays this proxy's: to a client it is a
server that crashes on every connection.

The proxy runs its own asyncio loop in a daemon thread, so sync and async tests use it alike; the mode
setters are thread-safe and return once the mode is in force. Counters (`stats()`) let a test check that
its traffic really went through the fault.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import threading
from dataclasses import dataclass

PASS, SLOW, BLACKHOLE, REFUSE = "pass", "slow", "blackhole", "refuse"
CHUNK_BYTES = 64 * 1024


@dataclass
class ProxyStats:
    connections: int = 0  # accepted, in any mode
    refused: int = 0  # connections reset by `refuse` (at accept or when the mode was set)
    delayed_chunks: int = 0  # chunks forwarded late by `slow`
    dropped_bytes: int = 0  # bytes swallowed by `blackhole`
    forwarded_bytes: int = 0


class _Connection:
    def __init__(self, client: asyncio.StreamWriter) -> None:
        self.client = client
        self.upstream: asyncio.StreamWriter | None = None
        self.blackholed = False  # lost bytes to the blackhole: reset when it ends

    def reset(self) -> None:
        for writer in (self.client, self.upstream):
            if writer is not None:
                _abort(writer)

    def close(self) -> None:
        for writer in (self.client, self.upstream):
            if writer is not None and not writer.transport.is_closing():
                writer.close()


def _abort(writer: asyncio.StreamWriter) -> None:
    """Close with RST (SO_LINGER 0), as a crashed peer would, not with an orderly FIN."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
    writer.transport.abort()


class FaultProxy:
    def __init__(self, target_host: str, target_port: int, listen_host: str = "127.0.0.1") -> None:
        self.target = (target_host, target_port)
        self.mode = PASS
        self.latency_s = 0.0
        self._stats = ProxyStats()
        self._connections: set[_Connection] = set()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="fault-proxy", daemon=True)
        self._thread.start()
        self._server = self._call(asyncio.start_server(self._handle, listen_host, 0))
        self.host = listen_host
        self.port: int = self._server.sockets[0].getsockname()[1]

    # --- control (any thread) -----------------------------------------------------------------------
    def pass_through(self) -> None:
        self._set(PASS)

    def slow(self, latency_s: float) -> None:
        """Forward every chunk (a read of up to 64 KiB, either direction) `latency_s` late."""
        self._set(SLOW, latency_s)

    def blackhole(self) -> None:
        self._set(BLACKHOLE)

    def refuse(self) -> None:
        self._set(REFUSE)

    def stats(self) -> ProxyStats:
        return self._call(self._copy_stats())

    def close(self) -> None:
        if not self._loop.is_running():
            return
        self._call(self._shutdown())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        self._loop.close()

    def __enter__(self) -> "FaultProxy":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(10)

    def _set(self, mode: str, latency_s: float = 0.0) -> None:
        self._call(self._apply(mode, latency_s))

    # --- the loop's side ----------------------------------------------------------------------------
    async def _copy_stats(self) -> ProxyStats:
        return ProxyStats(**vars(self._stats))

    async def _apply(self, mode: str, latency_s: float) -> None:
        previous, self.mode, self.latency_s = self.mode, mode, latency_s
        for conn in list(self._connections):
            if mode == REFUSE:
                conn.reset()
                self._stats.refused += 1
            elif previous == BLACKHOLE and mode != BLACKHOLE and conn.blackholed:
                conn.reset()

    async def _shutdown(self) -> None:
        self._server.close()
        for conn in list(self._connections):
            conn.reset()
        await self._server.wait_closed()
        # Connection handlers still winding down: end them before the loop stops.
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._stats.connections += 1
        if self.mode == REFUSE:
            self._stats.refused += 1
            _abort(writer)
            return
        conn = _Connection(writer)
        self._connections.add(conn)
        try:
            if self.mode == BLACKHOLE:
                # Nothing upstream yet: swallow what the client sends until the blackhole ends.
                conn.blackholed = True
                await self._pump(reader, None, conn)
                return
            try:
                up_reader, conn.upstream = await asyncio.open_connection(*self.target)
            except OSError:
                conn.reset()  # the target itself is down: the client sees a reset, as it would directly
                return
            await asyncio.gather(self._pump(reader, conn.upstream, conn),
                                 self._pump(up_reader, writer, conn))
        finally:
            self._connections.discard(conn)
            conn.close()

    async def _pump(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter | None,
                    conn: _Connection) -> None:
        try:
            while True:
                data = await src.read(CHUNK_BYTES)
                if not data:
                    break
                if self.mode == SLOW:
                    self._stats.delayed_chunks += 1
                    await asyncio.sleep(self.latency_s)
                if self.mode == BLACKHOLE or dst is None:
                    conn.blackholed = True
                    self._stats.dropped_bytes += len(data)
                    continue
                dst.write(data)
                await dst.drain()
                self._stats.forwarded_bytes += len(data)
        except (ConnectionError, OSError):
            conn.reset()  # a reset on one side is passed on to the other
            return
        if dst is not None and not dst.transport.is_closing() and dst.can_write_eof():
            try:
                dst.write_eof()  # an orderly close is passed on as one (half-close)
            except OSError:
                pass
