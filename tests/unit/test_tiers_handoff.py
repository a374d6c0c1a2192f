"""Same-host hand-off files (kite_shared.tiers.handoff): written in order, taken once, stale ones swept."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kite_shared.tiers import handoff


def test_units_are_taken_in_order_and_removed(tmp_path):
    folder = handoff.HandoffFolder(tmp_path)
    paths = folder.write_all([b"a" * 10, b"b" * 20])
    assert handoff.take_all(paths) == [b"a" * 10, b"b" * 20]
    assert list(folder.path.iterdir()) == []
    assert (folder.num_files_written, folder.num_bytes_written) == (2, 30)


def test_a_missing_file_raises_and_the_rest_are_removed(tmp_path):
    folder = handoff.HandoffFolder(tmp_path)
    paths = folder.write_all([b"a", b"b", b"c"])
    os.unlink(paths[1])
    with pytest.raises(FileNotFoundError):
        handoff.take_all(paths)
    assert list(folder.path.iterdir()) == []


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
