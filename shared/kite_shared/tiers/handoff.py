"""Same-host hand-off of block bytes: a reader on the ru-pool's host reads units from files in a
memory-backed folder (a tmpfs such as /dev/shm), and the pool's `get` reply names the files instead of
carrying the bytes (issue 15).

Why: a NATS reply is capped at max_payload (8 MiB by default) and every byte crosses the pool process,
the nats-server and the reader through sockets: 122-144 MB/s for hot blocks on the 2-core CI machine.
Through files in memory the bus keeps the control (the request, the reply with file names) and the bytes
go through the page cache. Readers on other hosts get them from the block stream (block_stream) or inline.

Two kinds of files, both in the pool's own folder:
- **Hot files** (`HotFiles`): the pool's hot tier keeps each unit in a file of its own, written once (on
  a thread, right after the unit enters hot) and mapped into the pool's memory in place of the unit's
  bytes (the tier's bytes *are* the file's pages: nothing is held twice). A same-host get lends the paths of the files (`PoolGetReply.files_lent`): the reader maps
  them and leaves them; nothing is written on the read path. A file's life is its unit's life in hot: it
  is removed when the last reference to the unit's bytes goes (`weakref.finalize` on the mapping), so an
  eviction, a delete, a clear or a replacement removes it without each of them knowing about files. A
  reader that maps a file before it is removed keeps whole, immutable bytes (files are written under a
  temporary name and renamed into place, never rewritten); one that comes after finds no file: a miss.
- **Reply files** (`HandoffFolder.write_all`): units the pool does not hold in hot files (hot refused
  them, the tmpfs is full, or their file is still being written) are written for one reply; the reader
  removes them after mapping them, and the pool's `sweep` removes those nobody read (a reader killed
  between reply and read) after `max_age_s`.

Readers map files (`map_units`) rather than read them: the mapping is copy-on-write (MAP_PRIVATE), so the
unit's payload is writable memory that torch can use as it is (`torch.frombuffer`), pages are shared with
the pool's until written, and nothing is copied on the way. Measured on this 2-core machine, 128 units of
369 KB: mapping and verifying (format v6: BLAKE3 checksum + HMAC) 3,400 MB/s; reading into a new bytearray
and verifying 1,400 MB/s (the fresh pages' faults, not the copy, cost most).

Readers keep their mappings of lent hot files between fetches (`KeptMappings`): a hot file's bytes never
change, so the next fetch of the same unit needs no new mapping. Mapping afresh costs page-table work on
every fetch (mmap, the first touch's faults, munmap when the units are dropped): 128 units of 369 KB on
this 2-core machine, fetched and verified 40 times in a row, 18.4 ms a fetch mapped afresh against 12.1 ms
with the mappings kept (2026-12-03; docs/benchmarks.md). Every use is still verified by the caller.

Who is on the same host: `host_id()`, the kernel's boot id (shared by the containers of one host). A
reader in a container that does not share the pool's folder fails its first read (the folder is not
there): `PoolClient` then asks for inline replies for good, so the fallback costs one extra round trip,
once. Integrity is unchanged: readers verify each unit's payload tag and HMAC exactly as they do inline bytes,
so a torn, truncated or altered file is a miss.
"""

from __future__ import annotations

import itertools
import logging
import mmap
import os
import shutil
import socket
import tempfile
import threading
import time
import weakref
from collections import OrderedDict
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

    def write_all(self, units: list[bytes | memoryview]) -> list[str]:
        """One reply file per unit, in order; the reader removes them. Blocking: run it off the event
        loop."""
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

    def next_path(self, suffix: str) -> Path:
        """A name no file of this folder ever had (names are never reused, so a reader holding an old
        name can only find that file or nothing)."""
        return self.path / f"{next(self._names)}{suffix}"

    def sweep(self, now: float | None = None) -> int:
        """Remove files older than max_age_s (their reader is gone); returns how many."""
        cutoff = (time.time() if now is None else now) - self.max_age_s
        removed = 0
        for entry in os.scandir(self.path):
            if not entry.name.endswith(".ru"):
                continue  # a hot file: it lives as long as its unit in hot (HotFiles)
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


class HotFiles:
    """The pool's side of hot files (module docstring): `write` puts a unit's bytes into a file of the
    hand-off folder (blocking: a thread's work), `map` turns that file into the bytes the hot tier holds,
    and `lent_path` says which file a unit held that way lives in."""

    def __init__(self, folder: HandoffFolder) -> None:
        self.folder = folder
        self._paths: weakref.WeakKeyDictionary[mmap.mmap, str] = weakref.WeakKeyDictionary()
        self._full_warned = False
        self.num_kept = 0  # units written to hot files
        self.num_refused = 0  # units kept in process memory instead (the tmpfs could not take them)

    def write(self, data: bytes | memoryview) -> str | None:
        """The path of a new file holding `data`, or None when the folder cannot take it (a full or
        missing tmpfs). Blocking (measured: about 0.2 ms for a 369 KB unit on an idle tmpfs, 1 ms on a
        loaded 2-core machine): run it off the event loop. Touches only the file system and counters."""
        final = self.folder.next_path(".hot")
        tmp = final.with_suffix(".tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, final)  # a reader sees the whole unit or no file
        except OSError as exc:  # ENOSPC, a removed folder
            for path in (tmp, final):
                path.unlink(missing_ok=True)
            self.num_refused += 1
            if not self._full_warned:
                self._full_warned = True
                log.warning("hot files: cannot write to %s (%r); keeping units in process memory, "
                            "same-host readers get copies", self.folder.path, exc)
            return None
        self.num_kept += 1
        return str(final)

    def map(self, path: str) -> memoryview | None:
        """The file's bytes as a read-only view, the file living as long as the mapping (module
        docstring); None when it cannot be mapped (removed meanwhile, empty). On the event loop: the
        registry of lent paths is not shared with threads."""
        try:
            with open(path, "rb") as f:
                mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as exc:  # ValueError: an empty file
            log.warning("hot file %s not mapped (%r); its unit stays in process memory", path, exc)
            _unlink_quietly(path)
            return None
        # The file goes when the mapping goes: when the hot tier and every in-flight use of the unit
        # have let go of it (CPython frees it at once then).
        weakref.finalize(mapping, _unlink_quietly, path)
        self._paths[mapping] = path
        return memoryview(mapping)

    def lent_path(self, data: bytes | memoryview) -> str | None:
        """The hot file holding these bytes (a view `map` returned), or None."""
        if isinstance(data, memoryview) and isinstance(data.obj, mmap.mmap):
            return self._paths.get(data.obj)
        return None


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:  # the folder was removed already (the pool stopping)
        pass


class FilesGone(OSError):
    """Lent hot files that were removed before the reader mapped them (their units left the pool's hot
    tier): a miss from there on, not a reason to stop using files."""


SWEEP_CHECKS_PER_FETCH = 64  # kept files a fetch looks for (KeptMappings.drop_removed): about 0.2 ms


class KeptMappings:
    """A reader's mappings of the pool's lent hot files, kept for the next fetch of the same units.

    Why it is safe: a hot file is written under a temporary name, renamed into place and never rewritten,
    and no name in a pool's folder is used twice (`HandoffFolder.next_path`), so a mapping kept under a
    path holds that file's bytes for good. The pool still decides what is served (it lends only the paths
    of units it holds), and the caller verifies every unit of every fetch. Fetches of the same unit share
    its mapping, so a consumer must not write the bytes in place (none does: the vLLM agent copies them
    into its staging arena, the transformers engine into each sequence's cache); a unit the caller
    rejects (`forget`, as for such a write) is never served from here again.
    What it costs: while the pool's file lives, page tables only (the pages are the pool's). Once the
    pool removes a file (its unit left hot), a kept mapping would hold the pages alone, so each fetch
    looks whether up to `SWEEP_CHECKS_PER_FETCH` kept files still exist (one stat each, least recently
    fetched first; a new pass over all of them starts at most once per `recheck_s`) and lets go of the
    removed ones, and `max_bytes` bounds what is kept at all (the least recently fetched go first). A pass
    is spread over fetches because one over a full 1 GiB of SmolLM2 units (2,900 files) took 7-9 ms here,
    most of a 128-block fetch's time.
    Thread-safe: `map_units` runs on threads."""

    def __init__(self, max_bytes: int, recheck_s: float = 1.0) -> None:
        self.max_bytes = max_bytes
        self.recheck_s = recheck_s
        self.lock = threading.Lock()  # held by map_units for a whole fetch
        self._mappings: OrderedDict[str, mmap.mmap] = OrderedDict()  # path -> mapping, least recent first
        self._paths: dict[int, str] = {}  # id(mapping) -> path, for `forget`
        self._checked_at = time.monotonic()  # when the current pass over the kept files started
        self._to_check: list[str] = []  # what the current pass has still to look at, the next one last
        self.num_bytes = 0  # bytes of the files kept mapped
        self.num_hits = 0  # lent files served from a kept mapping
        self.num_mapped = 0  # lent files mapped afresh

    def __len__(self) -> int:
        return len(self._mappings)

    def take(self, path: str) -> mmap.mmap | None:
        """The kept mapping of `path`, now the most recent, or None. The caller holds `lock`."""
        mapping = self._mappings.get(path)
        if mapping is not None:
            self._mappings.move_to_end(path)
            self.num_hits += 1
        return mapping

    def keep(self, path: str, mapping: mmap.mmap) -> None:
        """Keep a fresh mapping of `path`, letting the least recent go past `max_bytes`. The caller holds
        `lock`."""
        self.num_mapped += 1
        if len(mapping) > self.max_bytes:
            return
        self._mappings[path] = mapping
        self._paths[id(mapping)] = path
        self.num_bytes += len(mapping)
        while self.num_bytes > self.max_bytes:
            self._drop(next(iter(self._mappings)))

    def drop_removed(self, now: float | None = None, max_checks: int | None = None) -> int:
        """Look whether up to `max_checks` (default `SWEEP_CHECKS_PER_FETCH`) kept files still exist and
        let go of the mappings of those the pool has removed; how many. The caller holds `lock`."""
        now = time.monotonic() if now is None else now
        if not self._to_check:
            if now - self._checked_at < self.recheck_s:
                return 0
            self._checked_at = now
            self._to_check = list(reversed(self._mappings))  # popped from the end: least recent first
        dropped = 0
        for _ in range(min(SWEEP_CHECKS_PER_FETCH if max_checks is None else max_checks, len(self._to_check))):
            path = self._to_check.pop()
            if path in self._mappings and not os.path.exists(path):
                self._drop(path)
                dropped += 1
        return dropped

    def forget(self, unit: object) -> bool:
        """Never serve again the mapping `unit` (a view `map_units` returned) came from; whether one was
        kept."""
        if not (isinstance(unit, memoryview) and isinstance(unit.obj, mmap.mmap)):
            return False
        with self.lock:
            path = self._paths.get(id(unit.obj))
            if path is None or self._mappings.get(path) is not unit.obj:
                return False
            self._drop(path)
            return True

    def _drop(self, path: str) -> None:
        mapping = self._mappings.pop(path)
        del self._paths[id(mapping)]
        self.num_bytes -= len(mapping)
        # Unmapped here if no view of it is left, else when the last view goes.


def map_units(paths: list[str], remove: bool, kept: KeptMappings | None = None) -> list[memoryview]:
    """Map these unit files, in order, copy-on-write: writable views (of memory sharing the files' pages
    until written; a view keeps its mapping open).
    `remove`: reply files, which the reader removes once mapped (the mapping keeps the pages); lent hot
    files stay, and with `kept` their mappings are taken from there and kept there for the next fetch.
    Stops at the first lent file that is gone (a `FilesGone` when it is the first).
    Raises OSError when the files cannot be reached at all (another mount namespace: the caller falls
    back to inline replies); reply files not mapped are still removed where possible.
    Blocking, but cheap (no bytes are read until used)."""
    if kept is not None and not remove:
        with kept.lock:
            kept.drop_removed()
            return _map_all(paths, False, kept)
    return _map_all(paths, remove, None)


def _map_all(paths: list[str], remove: bool, kept: KeptMappings | None) -> list[memoryview]:
    out: list[memoryview] = []
    try:
        for path in paths:
            if kept is not None and (mapping := kept.take(path)) is not None:
                out.append(memoryview(mapping))
                continue
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                if remove or not os.path.isdir(os.path.dirname(path)):
                    raise  # a reply file must be there; no folder at all: not this reader's filesystem
                if not out:
                    raise FilesGone(f"hot file {path} left the pool's hot tier before it was read") from None
                break
            try:
                size = os.fstat(fd).st_size
                # An empty file cannot be mapped; as empty bytes it fails verification like any damage.
                mapping = (mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
                           if size else None)
            finally:
                os.close(fd)
            if mapping is None:
                out.append(memoryview(bytearray()))
            else:
                if kept is not None:
                    kept.keep(path, mapping)
                out.append(memoryview(mapping))
            if remove:
                os.unlink(path)
    finally:
        if remove:
            for path in paths[len(out):]:
                try:
                    os.unlink(path)
                except OSError:
                    pass  # invisible from here (another mount namespace): the pool's sweep removes it
    return out
