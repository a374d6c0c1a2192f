"""The staging arena: slots written by one mapping are read by another, and a cleared or rewritten slot
never reads as the block a loader expected."""

from __future__ import annotations

import pytest

from kite_worker.engines.vllm.staging_arena import ARENA_FILE, StagingArena

A, B = bytes([1]) * 32, bytes([2]) * 32


def test_a_block_written_by_the_agent_is_read_by_another_mapping_without_a_copy(tmp_path):
    writer = StagingArena.create(tmp_path / ARENA_FILE, payload_bytes=100, num_slots=3)
    reader = StagingArena.open(tmp_path / ARENA_FILE, payload_bytes=100)  # the model runner's own mapping
    assert reader.num_slots == 3 and not any(reader.holds(slot, A) for slot in range(3))
    writer.write(2, A, bytes(range(100)))
    assert reader.holds(2, A) and not reader.holds(2, B) and not reader.holds(1, A)
    view = reader.payload(2)
    assert bytes(view) == bytes(range(100))
    writer.write(2, B, b"\x07" * 100)  # the same slot reused for another block: the old view sees it
    assert not reader.holds(2, A) and bytes(view) == b"\x07" * 100
    assert reader.payload(2).obj is view.obj  # both views of the one mapping


def test_clearing_every_slot_at_a_quarantine_leaves_nothing_loadable(tmp_path):
    agent = StagingArena.create(tmp_path / ARENA_FILE, payload_bytes=64, num_slots=2)
    agent.write(0, A, b"a" * 64)
    agent.write(1, B, b"b" * 64)
    front_end = StagingArena.open(tmp_path / ARENA_FILE)  # geometry read from the header
    assert front_end.payload_bytes == 64 and front_end.num_slots == 2
    front_end.clear_all()
    front_end.close()
    assert not agent.holds(0, A) and not agent.holds(1, B)


def test_slots_of_another_size_or_not_an_arena_are_refused(tmp_path):
    StagingArena.create(tmp_path / ARENA_FILE, payload_bytes=64, num_slots=2)
    with pytest.raises(ValueError, match="64 bytes, expected 128"):
        StagingArena.open(tmp_path / ARENA_FILE, payload_bytes=128)
    (tmp_path / "other").write_bytes(b"\0" * 8192)
    with pytest.raises(ValueError, match="not a KITE staging arena"):
        StagingArena.open(tmp_path / "other")
    with pytest.raises(FileNotFoundError):
        StagingArena.open(tmp_path / "missing")


def test_writes_of_the_wrong_size_or_hash_or_slot_are_refused(tmp_path):
    arena = StagingArena.create(tmp_path / ARENA_FILE, payload_bytes=64, num_slots=1)
    with pytest.raises(ValueError, match="holds 64 bytes"):
        arena.write(0, A, b"x" * 63)
    with pytest.raises(ValueError, match="32 bytes"):
        arena.write(0, A[:16], b"x" * 64)
    with pytest.raises(ValueError, match="not all zero"):
        arena.write(0, bytes(32), b"x" * 64)
    with pytest.raises(IndexError):
        arena.write(1, A, b"x" * 64)
    assert not arena.holds(0, A)  # nothing half-written


def test_payloads_are_aligned_for_any_dtype(tmp_path):
    arena = StagingArena.create(tmp_path / ARENA_FILE, payload_bytes=70, num_slots=3)
    assert arena.slot_stride % 64 == 0
    assert all(arena.payload(slot).nbytes == 70 for slot in range(3))
