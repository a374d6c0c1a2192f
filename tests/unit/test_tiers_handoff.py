"""Same-host hand-off files (kite_shared.tiers.handoff): reply files written in order, mapped once and
removed, stale ones swept; hot files that live exactly as long as the unit's bytes and are lent, not
removed, by readers."""

from __future__ import annotations

import gc
import mmap
import os
import subprocess
import sys
import time

import pytest

from kite_shared.tiers import handoff


def keep(hot: handoff.HotFiles, data: bytes) -> bytes | memoryview:
    """What the pool does with a unit entering hot (tier_io._into_hot_file, there on a thread)."""
    path = hot.write(data)
    view = None if path is None else hot.map(path)
    return data if view is None else view


def test_reply_files_are_mapped_in_order_and_removed(tmp_path):
    folder = handoff.HandoffFolder(tmp_path)
    paths = folder.write_all([b"a" * 10, b"b" * 20])
    units = handoff.map_units(paths, remove=True)
    assert [bytes(u) for u in units] == [b"a" * 10, b"b" * 20]
    assert list(folder.path.iterdir()) == []  # removed; the mappings keep the bytes
    assert (folder.num_files_written, folder.num_bytes_written) == (2, 30)


def test_a_mapped_unit_is_private_writable_memory(tmp_path):
    """The reader may hand the bytes to torch as they are: writing them never reaches the file."""
    folder = handoff.HandoffFolder(tmp_path)
    hot = handoff.HotFiles(folder)
    view = keep(hot, b"abc")
    (unit,) = handoff.map_units([hot.lent_path(view)], remove=False)
    unit[0] = ord("z")
    assert bytes(unit) == b"zbc" and bytes(view) == b"abc"


def test_a_missing_reply_file_raises_and_the_rest_are_removed(tmp_path):
    folder = handoff.HandoffFolder(tmp_path)
    paths = folder.write_all([b"a", b"b", b"c"])
    os.unlink(paths[1])
    with pytest.raises(FileNotFoundError):
        handoff.map_units(paths, remove=True)
    assert list(folder.path.iterdir()) == []


def test_an_empty_file_is_empty_bytes_not_an_error(tmp_path):
    folder = handoff.HandoffFolder(tmp_path)
    assert handoff.map_units(folder.write_all([b""]), remove=True) == [b""]


def test_a_hot_file_lives_as_long_as_its_bytes(tmp_path):
    folder = handoff.HandoffFolder(tmp_path)
    hot = handoff.HotFiles(folder)
    view = keep(hot, b"unit" * 100)
    path = hot.lent_path(view)
    assert bytes(view) == b"unit" * 100 and isinstance(view.obj, mmap.mmap)
    with open(path, "rb") as f:
        assert f.read() == b"unit" * 100
    assert hot.lent_path(b"unit" * 100) is None  # plain bytes are not in a file
    (mapped,) = handoff.map_units([path], remove=False)  # lent: the reader leaves it
    assert os.path.exists(path)
    del view
    gc.collect()
    assert not os.path.exists(path)  # the hot tier let go: the file went with it
    assert bytes(mapped) == b"unit" * 100  # a reader that mapped it first keeps whole bytes
    assert (hot.num_kept, hot.num_refused) == (1, 0)


def test_lent_files_gone_before_the_read_are_a_miss_not_an_error(tmp_path):
    folder = handoff.HandoffFolder(tmp_path)
    hot = handoff.HotFiles(folder)
    views = [keep(hot, b"x" * 10), keep(hot, b"y" * 10), keep(hot, b"z" * 10)]
    paths = [hot.lent_path(v) for v in views]
    del views[1]  # evicted between the reply and the read
    gc.collect()
    assert [bytes(u) for u in handoff.map_units(paths, remove=False)] == [b"x" * 10]  # stops at the gap
    with pytest.raises(handoff.FilesGone):
        handoff.map_units(paths[1:], remove=False)
    with pytest.raises(FileNotFoundError) as raised:  # no folder at all: another filesystem, not a miss
        handoff.map_units([str(tmp_path / "elsewhere" / "0.hot")], remove=False)
    assert not isinstance(raised.value, handoff.FilesGone)


def test_a_tmpfs_that_cannot_take_the_unit_keeps_it_in_memory(tmp_path):
    folder = handoff.HandoffFolder(tmp_path)
    hot = handoff.HotFiles(folder)
    folder.remove()  # the folder vanished (as a full tmpfs, the write fails)
    data = b"unit" * 10
    assert keep(hot, data) is data
    assert hot.lent_path(data) is None and (hot.num_kept, hot.num_refused) == (0, 1)


def test_sweep_leaves_hot_files(tmp_path):
    folder = handoff.HandoffFolder(tmp_path, max_age_s=30.0)
    hot = handoff.HotFiles(folder)
    view = keep(hot, b"hot")
    os.utime(hot.lent_path(view), (1000.0, 1000.0))
    assert folder.sweep(now=1050.0) == 0 and os.path.exists(hot.lent_path(view))


def test_sweep_removes_only_files_older_than_the_max_age(tmp_path):
    folder = handoff.HandoffFolder(tmp_path, max_age_s=30.0)
    old, new = folder.write_all([b"old", b"new"])
    os.utime(old, (1000.0, 1000.0))
    os.utime(new, (1040.0, 1040.0))
    assert folder.sweep(now=1050.0) == 1
    assert [p.name for p in folder.path.iterdir()] == [os.path.basename(new)]


def test_a_new_folder_frees_the_folders_of_pools_that_are_gone(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    gone = tmp_path / f"{dead.stdout.strip()}-abc"
    gone.mkdir()
    (gone / "0.ru").write_bytes(b"x")
    alive = tmp_path / f"{os.getpid()}-def"
    alive.mkdir()
    folder = handoff.HandoffFolder(tmp_path)
    assert not gone.exists() and alive.exists()
    assert folder.path.parent == tmp_path and folder.path.name.startswith(f"{os.getpid()}-")
    folder.remove()
    assert not folder.path.exists()


def test_an_empty_root_means_no_handoff(tmp_path):
    assert handoff.open_folder("") is None
    blocked = tmp_path / "file"
    blocked.write_bytes(b"")
    assert handoff.open_folder(str(blocked / "sub")) is None  # not a folder: off, with a warning


def test_host_id_is_stable():
    assert handoff.host_id() == handoff.host_id() != ""


def hot_units(tmp_path, *contents: bytes) -> tuple[handoff.HotFiles, list, list[str]]:
    """A pool's hot files holding `contents`: (the files, the pool's views, their lent paths)."""
    hot = handoff.HotFiles(handoff.HandoffFolder(tmp_path))
    views = [keep(hot, data) for data in contents]
    return hot, views, [hot.lent_path(v) for v in views]


def test_lent_files_fetched_again_come_from_the_kept_mappings(tmp_path):
    _, views, paths = hot_units(tmp_path, b"a" * 10, b"b" * 20)
    kept = handoff.KeptMappings(max_bytes=1 << 20)
    first = handoff.map_units(paths, remove=False, kept=kept)
    again = handoff.map_units(paths, remove=False, kept=kept)
    assert [bytes(u) for u in again] == [b"a" * 10, b"b" * 20]
    assert [u.obj for u in again] == [u.obj for u in first]  # the same mappings, nothing mapped twice
    assert (kept.num_mapped, kept.num_hits, len(kept), kept.num_bytes) == (2, 2, 2, 30)
    again[0][0] = ord("z")  # copy-on-write still: the pool's file is untouched
    assert bytes(views[0]) == b"a" * 10


def test_kept_mappings_are_bounded_least_recently_fetched_first_out(tmp_path):
    _, _, paths = hot_units(tmp_path, b"1" * 10, b"2" * 10, b"3" * 10, b"4" * 100)
    kept = handoff.KeptMappings(max_bytes=25)
    handoff.map_units(paths[:2], remove=False, kept=kept)
    handoff.map_units(paths[:1], remove=False, kept=kept)  # the first is now the most recent
    handoff.map_units(paths[2:3], remove=False, kept=kept)  # 30 bytes > 25: the second goes
    assert (len(kept), kept.num_bytes, kept.num_hits) == (2, 20, 1)
    assert bytes(handoff.map_units(paths[1:2], remove=False, kept=kept)[0]) == b"2" * 10  # mapped afresh
    assert kept.num_mapped == 4
    assert bytes(handoff.map_units(paths[3:], remove=False, kept=kept)[0]) == b"4" * 100  # too large to keep
    assert kept.num_bytes <= 25 and paths[3] not in kept._mappings


def test_mappings_of_files_the_pool_removed_are_let_go_at_the_next_look(tmp_path):
    _, views, paths = hot_units(tmp_path, b"x" * 10, b"y" * 10)
    kept = handoff.KeptMappings(max_bytes=1 << 20, recheck_s=60.0)
    handoff.map_units(paths, remove=False, kept=kept)
    del views[1]  # the pool evicted the second unit: its file is removed
    gc.collect()
    assert not os.path.exists(paths[1])
    assert kept.drop_removed(now=time.monotonic()) == 0 and len(kept) == 2  # not a minute since the last look
    assert kept.drop_removed(now=time.monotonic() + 61.0) == 1
    assert len(kept) == 1 and kept.num_bytes == 10
    with pytest.raises(handoff.FilesGone):  # lent again (it cannot be: the pool holds no such unit) it is a miss
        handoff.map_units(paths[1:], remove=False, kept=kept)


def test_a_rejected_unit_is_never_served_from_its_kept_mapping_again(tmp_path):
    _, _, paths = hot_units(tmp_path, b"x" * 10)
    kept = handoff.KeptMappings(max_bytes=1 << 20)
    (unit,) = handoff.map_units(paths, remove=False, kept=kept)
    unit[0] = ord("!")  # say a consumer wrote into it: it no longer verifies
    assert kept.forget(unit) and not kept.forget(unit) and len(kept) == 0
    assert not kept.forget(memoryview(b"x" * 10))  # not a mapping
    (fresh,) = handoff.map_units(paths, remove=False, kept=kept)
    assert bytes(fresh) == b"x" * 10 and fresh.obj is not unit.obj  # the file's bytes, mapped afresh


def test_reply_files_are_never_kept(tmp_path):
    folder = handoff.HandoffFolder(tmp_path)
    kept = handoff.KeptMappings(max_bytes=1 << 20)
    units = handoff.map_units(folder.write_all([b"r" * 10]), remove=True, kept=kept)
    assert [bytes(u) for u in units] == [b"r" * 10] and len(kept) == 0 and kept.num_mapped == 0


def test_a_fetch_looks_for_a_bounded_number_of_removed_files_least_recently_fetched_first(tmp_path):
    _, views, paths = hot_units(tmp_path, b"1" * 10, b"2" * 10, b"3" * 10)
    kept = handoff.KeptMappings(max_bytes=1 << 20, recheck_s=60.0)
    handoff.map_units(paths, remove=False, kept=kept)
    handoff.map_units(paths[:1], remove=False, kept=kept)  # recency now 2, 3, 1
    views.clear()  # the pool removed all three
    gc.collect()
    later = time.monotonic() + 61.0
    assert kept.drop_removed(now=later, max_checks=2) == 2
    assert list(kept._mappings) == [paths[0]]  # the two least recently fetched went first
    assert kept.drop_removed(now=later, max_checks=2) == 1  # the pass goes on without waiting
    assert len(kept) == 0 and kept.num_bytes == 0
    assert kept.drop_removed(now=later, max_checks=2) == 0  # the next pass waits for recheck_s
