"""Weight digests: a changed weight file changes the digest (and so every block hash); caching is keyed
by file stats so an edit is never masked by a stale cache. The layout and device facts that enter the
fingerprint are read from the config and the host."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from kite_shared import model_store
from kite_shared.config import ConfigError, ModelConfig, load
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


def _local(**config) -> model_store.LocalModel:
    base = {"num_attention_heads": 9, "hidden_size": 576, "num_hidden_layers": 30, "num_key_value_heads": 3,
            "rope_theta": 100000.0, "rms_norm_eps": 1e-5}
    return model_store.LocalModel(name="m", path=Path("."), weights_digest="ab", quantization="",
                                  hf_config={**base, **config})


def test_layout_reads_every_numerics_fact_from_the_config():
    layout = _local().kv_layout(16)
    assert (layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.rope_theta, layout.rope_scaling,
            layout.norm_eps, layout.block_size) == (30, 3, 64, 100000.0, "", 1e-5, 16)
    # transformers 5 writes plain rope as {"rope_type": "default", "rope_theta": ...}: still no scaling
    plain = _local(rope_parameters={"rope_type": "default", "rope_theta": 5e5}).kv_layout(16)
    assert (plain.rope_theta, plain.rope_scaling) == (5e5, "")
    scaled = _local(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5}).kv_layout(16)
    assert scaled.rope_scaling == '{"factor": 2.0, "rope_type": "linear"}'
    assert _local(rms_norm_eps=1e-6).kv_layout(16).norm_eps == 1e-6


def test_the_served_length_is_the_checkpoints_unless_set_shorter_and_kv_bytes_follow_the_dtype():
    local = _local(max_position_embeddings=8192)
    assert local.max_context_tokens == local.checkpoint_context_tokens == 8192
    assert model_store.LocalModel(**{**local.__dict__, "max_model_len": 4096}).max_context_tokens == 4096
    assert local.kv_bytes_per_token("float32") == 46_080 and local.kv_bytes_per_token("bfloat16") == 23_040


def test_a_length_beyond_the_checkpoints_window_is_refused_at_prepare(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"max_position_embeddings": 2048}')
    (model / "model.safetensors").write_bytes(b"weights")
    cfg = load(ModelConfig, environ={}, engine="transformers", path=str(model), cache_dir=tmp_path / "cache")
    assert model_store.prepare(cfg).max_context_tokens == 2048
    with pytest.raises(ConfigError, match="KITE_MAX_MODEL_LEN=4096: longer than the model's context window, 2048"):
        model_store.prepare(load(ModelConfig, environ={}, engine="transformers", path=str(model),
                                 cache_dir=tmp_path / "cache", max_model_len=4096))


def test_a_config_without_norm_epsilon_is_refused():
    config = dict(_local().hf_config)
    del config["rms_norm_eps"]
    local = model_store.LocalModel(name="m", path=Path("."), weights_digest="ab", quantization="",
                                   hf_config=config)
    with pytest.raises(model_store.ModelNotFoundError, match="epsilon"):
        local.kv_layout(16)


def test_device_class_is_detected_or_taken_from_the_config():
    detected = model_store.detect_device_class(cuda=False)
    assert detected.startswith("cpu-")
    auto = load(ModelConfig, environ={}, engine="transformers")
    assert model_store.execution_path(auto).device_class == detected
    explicit = load(ModelConfig, environ={}, engine="transformers", device_class="cuda-sm90")
    assert model_store.execution_path(explicit).device_class == "cuda-sm90"
    assert model_store.identity(_local(), explicit).root != model_store.identity(_local(), auto).root


def test_a_worker_refuses_a_device_class_it_does_not_have():
    model_store.check_worker_device(load(ModelConfig, environ={}, engine="transformers"))
    detected = model_store.detect_device_class(cuda=False)
    model_store.check_worker_device(load(ModelConfig, environ={}, engine="transformers", device_class=detected))
    with pytest.raises(model_store.ModelNotFoundError, match="KITE_DEVICE_CLASS=cuda-sm90"):
        model_store.check_worker_device(load(ModelConfig, environ={}, engine="transformers",
                                             device_class="cuda-sm90"))


def test_auto_without_a_gpu_beside_the_cuda_build_stops_naming_the_setting(monkeypatch):
    # A GPU deployment's fingerprinter on a CPU node: it cannot know the workers' class, so it says which
    # setting names it (deploy/k8s/components/gpu-worker sets it) instead of hashing under a guess.
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(model_store.ModelNotFoundError,
                       match=r"KITE_DEVICE_CLASS=auto, but this host has the CUDA vLLM build and no CUDA device"):
        model_store.detect_device_class(cuda=True)
