"""The config registry: parsing, per-service configs, and the generated reference kept in step."""

from __future__ import annotations

import dataclasses
import re
import subprocess
from pathlib import Path

import pytest

from kite_shared import config
from kite_shared.config import ConfigError, GatewayConfig, ModelConfig, WorkerConfig, load

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


def test_model_config_rejects_unknown_dtype():
    with pytest.raises(ConfigError):
        load(ModelConfig, {"KITE_KV_STORAGE_DTYPE": "int3"})


def test_every_config_field_reads_a_registered_variable():
    for cls in (c for c in vars(config).values() if dataclasses.is_dataclass(c) and c.__name__.endswith("Config")):
        for field in dataclasses.fields(cls):
            assert field.metadata["env"] in {s.env for s in config.SETTINGS}, (cls.__name__, field.name)


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
