"""Same-host hand-off of block bytes: the ru-pool writes the units a reader asked for into files in a
memory-backed folder, and its `get` reply names the files instead of carrying the bytes (issue 15).

Why: a NATS reply is capped at max_payload (8 MiB by default) and every byte crosses the pool process,
the nats-server and the reader through sockets. Measured on the 2-core CI machine, 32 hot blocks of
SmolLM2 (23.6 MB in fp16) took 240-430 ms through NATS; a tmpfs write and read of the same bytes take
about 20 ms. The bus keeps the control (the request, the reply with file names); the bytes go through
memory. Cross-host readers keep getting the bytes inline.

Who is on the same host: `host_id()`, the kernel's boot id (shared by the containers of one host). A
reader in a container that does not share the pool's folder fails its first read: `PoolClient` then
asks for inline replies for good, so the fallback costs one extra round trip, once. Integrity is
unchanged: readers verify each unit's checksum and HMAC exactly as they do inline bytes.

A file belongs to its reader once the reply is sent; the reader removes it after reading. Files nobody
read (a reader killed between reply and read) are removed by the pool's `sweep` after `max_age_s`.
"""

from __future__ import annotations

import itertools
import logging
import os
import shutil
import socket
import tempfile
import time
from pathlib import Path

import psutil

log = logging.getLogger(__name__)

_BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


def host_id() -> str:
    """This host's identity for hand-off purposes: the boot id on Linux, else the host name."""
    try:
        return _BOOT_ID.read_text().strip()
    except OSError:
        return socket.gethostname()


class HandoffFolder:
    """The pool's side: a folder of its own under `root` (a tmpfs such as /dev/shm), named after its pid,
    so that a pool killed without cleaning up is recognised by the next one and its files freed."""

    def __init__(self, root: Path, max_age_s: float = 30.0) -> None:
        root = Path(root)
        root.mkdir(parents=True, exist_ok=True)
        _remove_dead_owners(root)
        self.path = Path(tempfile.mkdtemp(prefix=f"{os.getpid()}-", dir=root))
        self.max_age_s = max_age_s
        self._names = itertools.count()
        self.num_files_written = 0
        self.num_bytes_written = 0

    def write_all(self, units: list[bytes]) -> list[str]:
        """One file per unit, in order. Blocking: run it off the event loop."""
        paths = []
        for data in units:
            path = self.path / f"{next(self._names)}.ru"
            # Not a rename-into-place: no reader knows the name before the reply that follows this write.
            with open(path, "wb") as f:
                f.write(data)
            paths.append(str(path))
        self.num_files_written += len(units)
        self.num_bytes_written += sum(map(len, units))
        return paths

    def sweep(self, now: float | None = None) -> int:
        """Remove files older than max_age_s (their reader is gone); returns how many."""
        cutoff = (time.time() if now is None else now) - self.max_age_s
        removed = 0
        for entry in os.scandir(self.path):
            try:
                if entry.stat().st_mtime < cutoff:
                    os.unlink(entry.path)
                    removed += 1
            except FileNotFoundError:  # its reader took it meanwhile
                continue
        if removed:
            log.info("removed %d hand-off files nobody read", removed)
        return removed

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


def _remove_dead_owners(root: Path) -> None:
    for entry in os.scandir(root):
        pid = entry.name.split("-", 1)[0]
        if entry.is_dir() and pid.isdigit() and not psutil.pid_exists(int(pid)):
            log.info("removing hand-off folder %s of a pool that is gone", entry.path)
            shutil.rmtree(entry.path, ignore_errors=True)


def open_folder(root: str) -> HandoffFolder | None:
    """A folder under `root`, or None (hand-off off) when `root` is empty or cannot be written."""
    if not root:
        return None
    try:
        return HandoffFolder(Path(root))
    except OSError as exc:
        log.warning("same-host hand-off off: cannot use %s (%s); blocks travel inside NATS replies", root, exc)
        return None


def take_all(paths: list[str]) -> list[bytes]:
    """Read and remove the reader's files, in order. Raises OSError when a file cannot be read (the
    caller falls back to inline replies); the files not read are still removed where possible.
    Blocking: run it off the event loop."""
    out = []
    try:
        for path in paths:
            with open(path, "rb") as f:
                out.append(f.read())
            os.unlink(path)
    finally:
        for path in paths[len(out):]:
            try:
                os.unlink(path)
            except OSError:
                pass  # invisible from here (another mount namespace): the pool's sweep removes it
    return out
