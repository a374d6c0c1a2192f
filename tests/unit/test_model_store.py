"""Weight digests: a changed weight file changes the digest (and so every block hash); caching is keyed
by file stats so an edit is never masked by a stale cache."""

from __future__ import annotations

import json
import os

from kite_shared.model_store import _cached_user_digest, weights_digest


def _checkpoint(folder, payload: bytes) -> None:
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"num_hidden_layers": 1}))
    (folder / "model.safetensors").write_bytes(payload)


def test_digest_covers_weight_content_only(tmp_path):
    a = tmp_path / "a"
    _checkpoint(a, b"\x00" * 1000)
    base = weights_digest(a)
    (a / "README.md").write_text("docs do not change the weights")
    assert weights_digest(a) == base
    _checkpoint(a, b"\x00" * 999 + b"\x01")
    assert weights_digest(a) != base


def test_cached_digest_is_recomputed_when_a_file_changes(tmp_path):
    model, cache = tmp_path / "model", tmp_path / "cache"
    _checkpoint(model, b"\x00" * 1000)
    first = _cached_user_digest(model, cache)
    assert _cached_user_digest(model, cache) == first
    _checkpoint(model, b"\x01" * 1000)
    stat = (model / "model.safetensors").stat()
    os.utime(model / "model.safetensors", ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    assert _cached_user_digest(model, cache) != first
