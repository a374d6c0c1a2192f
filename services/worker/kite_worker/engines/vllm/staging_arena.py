"""Pool blocks staged for vLLM's model runner: one shared-memory file of fixed slots, mapped once.

Boundary: memory only (a file on a memory-backed folder, mapped shared); no NATS, no torch. Three
processes map the same file: the KV agent (vLLM's engine-core process) writes verified blocks into slots,
the model runner copies slots into its paged KV tensors, and the worker's front end clears every slot at a
quarantine. Which block is in which slot, and which slots are pinned, is the agent's business; a slot only
carries the hash of the block it holds, so that a reader can tell.

Why one mapped file and not a file per block (the design before 2026-12-02): a staged file cost a write
into the page cache, a rename, the model runner's read into fresh memory (a copy plus first-touch page
faults on 26 MB per 1,000-token prefix of the default model) and an unlink. Here a block costs one copy in
(agent) and the copy into the paged KV (model runner) from pages both already have mapped.

Layout: a header page (magic, payload bytes per slot, number of slots), then `num_slots` slots of
[tag | payload], each `slot_stride` bytes. A slot's tag is the 32-byte block hash it holds, all zeros when
empty. A writer zeroes the tag, copies the payload, then writes the tag; a reader checks the tag before
and after it copies, so a slot cleared or rewritten meanwhile reads as not loadable (vLLM computes that
block) and never as another block's KV.
"""

from __future__ import annotations

import mmap
import os
import struct
from pathlib import Path

ARENA_FILE = "staged.arena"
TAG_BYTES = 32  # a KITE block hash
_MAGIC = b"KITESTG1"
_HEADER = struct.Struct("<8sQQ")  # magic, payload bytes per slot, number of slots
_HEADER_BYTES = 4096  # slots start page-aligned
_TAG_FIELD = 64  # the tag's field, a cache line: payloads stay 64-byte aligned
_EMPTY = bytes(TAG_BYTES)


class StagingArena:
    """Fixed-size slots of staged blocks in a shared mapping (see the module docstring)."""

    def __init__(self, path: Path, payload_bytes: int, num_slots: int, mapping: mmap.mmap) -> None:
        self.path = path
        self.payload_bytes = payload_bytes
        self.num_slots = num_slots
        self.slot_stride = _slot_stride(payload_bytes)
        self._map = mapping
        self._view = memoryview(mapping)

    @classmethod
    def create(cls, path: Path, payload_bytes: int, num_slots: int) -> "StagingArena":
        """A new, empty arena at `path` (replacing one there), its memory reserved now: a write into a
        mapped page that a full tmpfs cannot back would kill the process (SIGBUS), so a folder without
        room fails here, with OSError."""
        if payload_bytes <= 0 or num_slots <= 0:
            raise ValueError(f"an arena needs slots of some size: {num_slots} x {payload_bytes} bytes")
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        size = _HEADER_BYTES + num_slots * _slot_stride(payload_bytes)
        with open(tmp, "w+b") as f:
            try:
                os.posix_fallocate(f.fileno(), 0, size)  # zeros: every tag empty
            except OSError as exc:
                tmp.unlink(missing_ok=True)
                raise OSError(exc.errno, f"no room for a staging arena of {size >> 20} MiB in {path.parent}: "
                                         f"{exc.strerror}") from exc
            f.write(_HEADER.pack(_MAGIC, payload_bytes, num_slots))
            f.flush()
            mapping = mmap.mmap(f.fileno(), 0)
        os.replace(tmp, path)  # a process opening the path sees a whole header or no file
        return cls(path, payload_bytes, num_slots, mapping)

    @classmethod
    def open(cls, path: Path, payload_bytes: int | None = None) -> "StagingArena":
        """Map an existing arena; with `payload_bytes`, refuse one whose slots are of another size
        (another model or storage dtype would read as garbage). Raises OSError or ValueError."""
        with open(path, "r+b") as f:
            mapping = mmap.mmap(f.fileno(), 0)
        magic, size, num_slots = _HEADER.unpack_from(mapping, 0)
        if magic != _MAGIC:
            mapping.close()
            raise ValueError(f"{path} is not a KITE staging arena")
        if payload_bytes is not None and size != payload_bytes:
            mapping.close()
            raise ValueError(f"{path} holds slots of {size} bytes, expected {payload_bytes}")
        arena = cls(path, size, num_slots, mapping)
        if len(mapping) < _HEADER_BYTES + num_slots * arena.slot_stride:
            arena.close()
            raise ValueError(f"{path} is shorter than its {num_slots} slots")
        return arena

    def _tag_at(self, slot: int) -> int:
        if not 0 <= slot < self.num_slots:
            raise IndexError(f"slot {slot} of {self.num_slots}")
        return _HEADER_BYTES + slot * self.slot_stride

    def write(self, slot: int, block_hash: bytes, payload) -> None:
        """Put a block's bytes (any buffer of `payload_bytes`) in `slot`: one copy."""
        if len(block_hash) != TAG_BYTES or block_hash == _EMPTY:  # all zeros: the empty tag (never a block hash)
            raise ValueError(f"a block hash is {TAG_BYTES} bytes, not all zero: got {bytes(block_hash).hex()}")
        data = memoryview(payload).cast("B")
        if data.nbytes != self.payload_bytes:
            raise ValueError(f"a slot holds {self.payload_bytes} bytes, got {data.nbytes}")
        tag = self._tag_at(slot)
        self._view[tag:tag + TAG_BYTES] = _EMPTY  # never the old tag over new bytes
        start = tag + _TAG_FIELD
        self._view[start:start + self.payload_bytes] = data
        self._view[tag:tag + TAG_BYTES] = block_hash

    def holds(self, slot: int, block_hash: bytes) -> bool:
        tag = self._tag_at(slot)
        return self._view[tag:tag + TAG_BYTES] == block_hash

    def payload(self, slot: int) -> memoryview:
        """The slot's bytes, not copied: valid while the slot holds what `holds` said."""
        start = self._tag_at(slot) + _TAG_FIELD
        return self._view[start:start + self.payload_bytes]

    def clear(self, slot: int) -> None:
        tag = self._tag_at(slot)
        self._view[tag:tag + TAG_BYTES] = _EMPTY

    def clear_all(self) -> None:
        """Every slot empty (a quarantine: nothing staged may be loaded any more)."""
        for slot in range(self.num_slots):
            self.clear(slot)

    def close(self) -> None:
        self._view.release()
        try:
            self._map.close()
        except BufferError:  # a tensor still views a slot: the mapping goes with the process
            pass


def _slot_stride(payload_bytes: int) -> int:
    """A slot: the tag's field, then the payload rounded up to whole tag fields (64-byte alignment)."""
    return _TAG_FIELD + -(-payload_bytes // _TAG_FIELD) * _TAG_FIELD
