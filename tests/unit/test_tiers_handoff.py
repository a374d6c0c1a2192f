"""Same-host hand-off files (kite_shared.tiers.handoff): reply files written in order, mapped once and
removed, stale ones swept; hot files that live exactly as long as the unit's bytes and are lent, not
removed, by readers."""

from __future__ import annotations

import gc
import mmap
import os
import subprocess
import sys

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
