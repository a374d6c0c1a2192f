"""The adapter contract: every declared fact is checked against the base and a mismatch names its field;
an adapter's identity is its content; model names resolve like vLLM's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kite_shared import adapters
from kite_shared.adapters import AdapterRefused, load_adapter
from kite_shared.config import ModelConfig, load
from kite_shared.model_store import LocalModel, identity

CONFIG = {"num_attention_heads": 9, "hidden_size": 576, "num_hidden_layers": 30, "num_key_value_heads": 3,
          "rope_theta": 100000.0, "rms_norm_eps": 1e-5, "vocab_size": 49152}
LOCAL = LocalModel(name="base-model", path=Path("."), weights_digest="ab" * 32, quantization="", hf_config=CONFIG)
CFG = load(ModelConfig, environ={}, engine="transformers", block_size=16)
BASE = identity(LOCAL, CFG)


def make_folder(folder: Path, weights: bytes = b"\x01" * 64, local: LocalModel = LOCAL, block_size: int = 16,
                **peft) -> Path:
    """An adapter folder with placeholder weights (the contract never reads them), declared for `local`."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8, **peft}))
    (folder / "adapter_model.safetensors").write_bytes(weights)
    adapters.declare(folder, local, block_size)
    return folder


def edit_declaration(folder: Path, path: list[str], value) -> None:
    declaration = json.loads((folder / adapters.DECLARATION_FILE).read_text())
    node = declaration
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    (folder / adapters.DECLARATION_FILE).write_text(json.dumps(declaration))


def test_a_declared_adapter_loads_with_its_own_identity(tmp_path):
    adapter = load_adapter("support", make_folder(tmp_path / "a"), BASE, LOCAL, 16)
    assert adapter.rank == 8 and adapter.identity.model.adapter_digest == adapter.digest
    assert adapter.identity.root != BASE.root
    assert adapter.identity.execution == BASE.execution
    again = load_adapter("support-copy", make_folder(tmp_path / "b"), BASE, LOCAL, 16)
    assert again.identity.root == adapter.identity.root  # same content, same blocks, whatever the name
    other = load_adapter("other", make_folder(tmp_path / "c", weights=b"\x02" * 64), BASE, LOCAL, 16)
    assert other.identity.root != adapter.identity.root
    alpha = load_adapter("alpha", make_folder(tmp_path / "d", lora_alpha=32), BASE, LOCAL, 16)
    assert alpha.identity.root != adapter.identity.root  # the peft config changes outputs too


@pytest.mark.parametrize("path, value, field", [
    (["base", "weights_digest"], "cd" * 32, "base.weights_digest"),
    (["base", "vocab_size"], 32000, "base.vocab_size"),
    (["base", "kv_layout", "num_layers"], 24, "base.kv_layout.num_layers"),
    (["base", "kv_layout", "num_kv_heads"], 9, "base.kv_layout.num_kv_heads"),
    (["base", "kv_layout", "head_dim"], 128, "base.kv_layout.head_dim"),
    (["base", "kv_layout", "block_size"], 32, "base.kv_layout.block_size"),
    (["base", "norm_eps"], 1e-6, "base.norm_eps"),
    (["base", "rope_theta"], 10000.0, "base.rope_theta"),
    (["base", "rope_scaling"], '{"factor": 2.0, "rope_type": "linear"}', "base.rope_scaling"),
    (["format"], "kite.adapter.v0", "format"),
])
def test_a_mismatch_is_refused_naming_the_field(tmp_path, path, value, field):
    folder = make_folder(tmp_path / "a")
    edit_declaration(folder, path, value)
    with pytest.raises(AdapterRefused) as refused:
        load_adapter("support", folder, BASE, LOCAL, 16)
    assert refused.value.field == field and field in str(refused.value) and "support" in str(refused.value)


def test_weights_digest_is_optional_but_the_numerics_are_not(tmp_path):
    folder = make_folder(tmp_path / "a")
    declaration = json.loads((folder / adapters.DECLARATION_FILE).read_text())
    del declaration["base"]["weights_digest"]
    (folder / adapters.DECLARATION_FILE).write_text(json.dumps(declaration))
    load_adapter("support", folder, BASE, LOCAL, 16)
    del declaration["base"]["rope_theta"]
    (folder / adapters.DECLARATION_FILE).write_text(json.dumps(declaration))
    with pytest.raises(AdapterRefused, match="base.rope_theta: missing"):
        load_adapter("support", folder, BASE, LOCAL, 16)


@pytest.mark.parametrize("damage, field", [
    (lambda f: (f / adapters.DECLARATION_FILE).unlink(), adapters.DECLARATION_FILE),
    (lambda f: (f / adapters.DECLARATION_FILE).write_text("{not json"), adapters.DECLARATION_FILE),
    (lambda f: (f / "adapter_config.json").write_text(json.dumps({"peft_type": "IA3"})),
     "adapter_config.peft_type"),
    (lambda f: (f / "adapter_model.safetensors").unlink(), "weights"),
])
def test_a_broken_folder_is_refused(tmp_path, damage, field):
    folder = make_folder(tmp_path / "a")
    damage(folder)
    with pytest.raises(AdapterRefused) as refused:
        load_adapter("support", folder, BASE, LOCAL, 16)
    assert refused.value.field == field


@pytest.mark.parametrize("name", ["", "a:b", "base-model"])
def test_names_that_would_be_ambiguous_are_refused(tmp_path, name):
    with pytest.raises(AdapterRefused, match="name"):
        load_adapter(name, make_folder(tmp_path / "a"), BASE, LOCAL, 16)


def test_the_configured_adapters_load_and_a_refused_one_leaves_the_rest(tmp_path, caplog):
    good = make_folder(tmp_path / "good")
    bad = make_folder(tmp_path / "bad")
    edit_declaration(bad, ["base", "rope_theta"], 500000.0)
    cfg = load(ModelConfig, environ={}, engine="transformers", block_size=16, adapters=f"good={good},bad={bad}")
    loaded = adapters.load_configured(cfg, LOCAL, BASE)
    assert list(loaded) == ["good"]
    assert "base.rope_theta" in caplog.text
    # vLLM's blocks are 32 tokens: an adapter declared for the 16-token layout is another KV layout.
    on_vllm = load(ModelConfig, environ={}, engine="vllm", block_size=32, adapters=f"good={good}")
    assert adapters.load_configured(on_vllm, LOCAL, identity(LOCAL, on_vllm)) == {}
    assert "base.kv_layout.block_size: declared 16, the loaded base has 32" in caplog.text
    for_vllm = make_folder(tmp_path / "for-vllm", block_size=32)
    on_vllm = load(ModelConfig, environ={}, engine="vllm", block_size=32, adapters=f"good={for_vllm}")
    assert list(adapters.load_configured(on_vllm, LOCAL, identity(LOCAL, on_vllm))) == ["good"]


def test_an_adapter_above_the_rank_limit_is_refused_on_both_engines(tmp_path):
    wide = make_folder(tmp_path / "wide", r=32)
    cfg = load(ModelConfig, environ={}, engine="transformers", block_size=16, max_lora_rank=16)
    with pytest.raises(AdapterRefused) as refused:
        adapters.loader(cfg, LOCAL, BASE)("wide", str(wide))
    assert refused.value.field == "rank" and "KITE_MAX_LORA_RANK=16" in str(refused.value)
    assert adapters.loader(load(ModelConfig, environ={}, engine="transformers", block_size=16, max_lora_rank=32),
                           LOCAL, BASE)("wide", str(wide)).rank == 32
    with pytest.raises(ValueError, match="KITE_MAX_LORA_RANK=12: vLLM takes one of"):
        load(ModelConfig, environ={}, engine="vllm", max_lora_rank=12)


def test_setting_and_model_names_parse():
    assert adapters.parse_adapter_setting(" a=/x , b=/y ") == {"a": "/x", "b": "/y"}
    assert adapters.parse_adapter_setting("") == {}
    for bad in ("a", "a=", "=/x", "a=/x,a=/y"):
        with pytest.raises(ValueError):
            adapters.parse_adapter_setting(bad)
    assert adapters.split_model_name("base-model", "base-model") == ""
    assert adapters.split_model_name("base-model:support", "base-model") == "support"
    assert adapters.split_model_name("support", "base-model") == "support"


def test_the_cli_declares_for_the_configured_base_and_checks_like_a_worker(tmp_path, capsys):
    from kite_cli.adapter_admin import main

    folder = make_folder(tmp_path / "a")  # declared for LOCAL, not for the configured base
    assert main(["check", str(folder)]) == 1
    assert "base.weights_digest" in capsys.readouterr().err
    assert main(["declare", str(folder)]) == 0
    assert main(["check", str(folder), "--name", "support"]) == 0
    assert "support: compatible with" in capsys.readouterr().out
    edit_declaration(folder, ["base", "rope_theta"], 10000.0)
    assert main(["check", str(folder)]) == 1
    assert "base.rope_theta" in capsys.readouterr().err
