"""The config registry: parsing, per-service configs, and the generated reference kept in step."""

from __future__ import annotations

import ast
import collections
import dataclasses
import re
import subprocess
from pathlib import Path

import pytest

from kite_shared import config
from kite_shared.config import ConfigError, GatewayConfig, ModelConfig, TierConfig, WorkerConfig, load

ROOT = Path(__file__).resolve().parents[2]


def test_defaults_and_overrides_parse():
    cfg = load(WorkerConfig, {"KITE_REUSE": "off", "KITE_WORKER_CACHE_BYTES": "1024"})
    assert cfg.reuse is False and cfg.cache_bytes == 1024
    assert load(GatewayConfig, {}).http_port == 8000


@pytest.mark.parametrize("env", [{"KITE_REUSE": "maybe"}, {"KITE_WORKER_MAX_RUNNING": "0"},
                                 {"KITE_WORKER_CACHE_BYTES": "lots"}])
def test_bad_values_raise_config_error_naming_the_variable(env):
    with pytest.raises(ConfigError, match=next(iter(env))):
        load(WorkerConfig, env)


def test_redis_cluster_setting_is_off_by_default_and_parsed():
    assert load(TierConfig, {}).redis_cluster is False
    for raw, value in (("on", True), ("yes", True), ("1", True), ("off", False), ("0", False)):
        assert load(TierConfig, {"KITE_REDIS_CLUSTER": raw}).redis_cluster is value
    with pytest.raises(ConfigError, match="KITE_REDIS_CLUSTER"):
        load(TierConfig, {"KITE_REDIS_CLUSTER": "sharded"})
    assert config.setting("KITE_REDIS_CLUSTER").services == config.setting("KITE_REDIS_URL").services


def test_tier_client_builds_a_cluster_client_only_when_asked():
    """No I/O: redis-py connects on first use. AUTH and TLS still come from the URL in cluster mode."""
    from redis.asyncio import Redis
    from redis.asyncio.cluster import RedisCluster
    from redis.asyncio.connection import SSLConnection

    from kite_shared.tiers.client import TierClient

    env = {"KITE_REDIS_URL": "rediss://kite:s3cret@redis.example:6380/0"}
    plain = TierClient.from_config(load(TierConfig, env), with_cold=False, ru_key=b"k" * 32).warm
    assert not plain.cluster and isinstance(plain._redis, Redis)
    warm = TierClient.from_config(load(TierConfig, {**env, "KITE_REDIS_CLUSTER": "on"}), with_cold=False,
                                  ru_key=b"k" * 32).warm
    assert warm.cluster and isinstance(warm._redis, RedisCluster)
    kwargs = warm._redis.get_connection_kwargs()
    assert kwargs["connection_class"] is SSLConnection
    assert (kwargs["username"], kwargs["password"]) == ("kite", "s3cret")
    assert [(n.host, n.port) for n in warm._redis.startup_nodes] == [("redis.example", 6380)]


def test_model_config_rejects_unknown_dtype():
    with pytest.raises(ConfigError):
        load(ModelConfig, {"KITE_KV_STORAGE_DTYPE": "int3"})


def test_kv_is_stored_in_the_compute_dtype_by_default_and_a_narrower_dtype_is_lossy():
    exact = load(ModelConfig, {})
    assert (exact.dtype, exact.kv_storage_dtype, exact.lossy_storage) == ("float32", "float32", False)
    assert load(ModelConfig, {"KITE_MODEL_DTYPE": "bfloat16"}).kv_storage_dtype == "bfloat16"
    assert load(ModelConfig, {"KITE_KV_STORAGE_DTYPE": "float16"}).lossy_storage
    assert load(ModelConfig, {"KITE_MODEL_DTYPE": "bfloat16", "KITE_KV_STORAGE_DTYPE": "float16"}).lossy_storage
    # wider than the compute dtype holds every value: exact, only larger
    assert not load(ModelConfig, {"KITE_MODEL_DTYPE": "bfloat16", "KITE_KV_STORAGE_DTYPE": "float32"}).lossy_storage


def test_a_kv_codec_is_lossless_by_default_and_only_a_known_lossy_one_otherwise():
    assert load(ModelConfig, {}).kv_codec == ""
    assert load(ModelConfig, {"KITE_KV_CODEC": "int8"}).kv_codec == "int8"
    with pytest.raises(ConfigError, match="KITE_KV_CODEC"):
        load(ModelConfig, {"KITE_KV_CODEC": "fp16"})  # lossless storage is KITE_KV_STORAGE_DTYPE's


def test_tier_codecs_come_from_the_three_settings_and_a_bad_policy_names_them():
    cfg = load(ModelConfig, {"KITE_KV_CODEC_COLD": "int8"})
    assert (cfg.tier_codecs.hot, cfg.tier_codecs.warm, cfg.tier_codecs.cold) == ("", "", "int8")
    with pytest.raises(ConfigError, match="KITE_KV_CODEC_WARM='fp16'"):
        load(ModelConfig, {"KITE_KV_CODEC_WARM": "fp16"})
    with pytest.raises(ConfigError, match="cold tier cannot store fp8_e4m3 units below a warm tier of int8"):
        load(ModelConfig, {"KITE_KV_CODEC_WARM": "int8", "KITE_KV_CODEC_COLD": "fp8_e4m3"})


def test_every_config_field_reads_a_registered_variable():
    for cls in (c for c in vars(config).values() if dataclasses.is_dataclass(c) and c.__name__.endswith("Config")):
        for field in dataclasses.fields(cls):
            assert field.metadata["env"] in {s.env for s in config.SETTINGS}, (cls.__name__, field.name)


def test_every_variable_is_declared_once():
    """config.py names each variable in one env(...) declaration; the configs that also read it inherit that
    field or take it with same_as, so the name is not repeated."""
    tree = ast.parse((ROOT / "shared" / "kite_shared" / "config.py").read_text())
    declared = collections.Counter(ast.literal_eval(node.args[0]) for node in ast.walk(tree)
                                   if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "env")
    assert {name for name, count in declared.items() if count > 1} == set()
    assert set(declared) == {s.env for s in config.SETTINGS}


def test_a_variable_is_read_by_the_services_of_the_configs_with_a_field_for_it():
    classes = {c for c in vars(config).values() if dataclasses.is_dataclass(c) and c.__name__.endswith("Config")}
    assert classes == set(config.READ_BY)
    assert config.setting("KITE_NATS_URL").services == ("all",)
    assert config.setting("KITE_MODEL_NAME").services == ("gateway", "fingerprinter", "worker")  # same_as
    assert config.setting("KITE_TELEMETRY_WINDOW_S").services == ("gateway", "fingerprinter", "worker", "arbitrator")
    assert config.setting("KITE_TIER_TIMEOUT_S").services == ("gateway", "worker", "ru-pool")


def test_secret_settings_stay_out_of_every_config_repr_that_reads_them():
    secrets = {s.env for s in config.SETTINGS if s.secret}
    for cls in config.READ_BY:
        fields = {f.name: f.metadata["env"] for f in dataclasses.fields(cls)}
        hidden = {name: "do-not-print-me" for name, env in fields.items() if env in secrets}
        if hidden:
            assert "do-not-print-me" not in repr(load(cls, {}, **hidden)), cls.__name__


def test_docs_config_md_is_generated_from_the_registry():
    assert (ROOT / "docs" / "config.md").read_text() == config.markdown_reference(), \
        "run: make config-doc"


def test_no_code_reads_kite_variables_outside_the_registry():
    out = subprocess.run(["git", "grep", "-nE", r"environ(\.get)?\(?\[?[\"']KITE_", "--", "*.py"],
                         cwd=ROOT, capture_output=True, text=True).stdout
    offenders = [line for line in out.splitlines() if not line.startswith(("shared/kite_shared/config.py", "tests/"))]
    assert offenders == []
    names = set(re.findall(r"KITE_[A-Z0-9_]+", out))
    assert names <= {s.env for s in config.SETTINGS}
