"""The adapter contract: every declared fact is checked against the base and a mismatch names its field;
the adapter's own files (target modules, tensor shapes, rank, layers) are checked against the base's
config.json; an adapter's identity is its content; model names resolve like vLLM's."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from kite_shared import adapters
from kite_shared.adapters import AdapterRefused, load_adapter
from kite_shared.config import ModelConfig, load
from kite_shared.model_store import LocalModel, identity

# SmolLM2-135M's shapes (the default model), so an adapter made here fits the configured base too.
CONFIG = {"model_type": "llama", "num_attention_heads": 9, "hidden_size": 576, "num_hidden_layers": 30,
          "num_key_value_heads": 3, "intermediate_size": 1536, "rope_theta": 100000.0, "rms_norm_eps": 1e-5,
          "vocab_size": 49152}
LOCAL = LocalModel(name="base-model", path=Path("."), weights_digest="ab" * 32, quantization="", hf_config=CONFIG)
CFG = load(ModelConfig, environ={}, engine="transformers", block_size=16)
BASE = identity(LOCAL, CFG)
PREFIX = "base_model.model.model.layers"


def lora_tensors(hf_config: dict, r: int = 8, modules: tuple[str, ...] = ("q_proj", "v_proj"),
                 layers: tuple[int, ...] = (0, -1), seed: int = 1) -> dict[str, np.ndarray]:
    """LoRA tensors named as peft saves them, shaped for `hf_config`'s base, filled with `seed`."""
    base = adapters.base_modules("test", hf_config)
    tensors = {}
    for layer in layers:
        index = layer if layer >= 0 else base.num_layers + layer
        for m in modules:
            in_features, out_features = base.per_layer[m]
            parent = "mlp" if m in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            key = f"{PREFIX}.{index}.{parent}.{m}"
            tensors[f"{key}.lora_A.weight"] = np.full((r, in_features), seed, dtype=np.float16)
            tensors[f"{key}.lora_B.weight"] = np.full((out_features, r), seed, dtype=np.float16)
    return tensors


def make_folder(folder: Path, seed: int = 1, local: LocalModel = LOCAL, block_size: int = 16,
                tensors: dict[str, np.ndarray] | None = None, **peft) -> Path:
    """An adapter folder (q_proj and v_proj of the first and last layer unless `tensors` says otherwise),
    declared for `local`."""
    folder.mkdir(parents=True, exist_ok=True)
    config = {"peft_type": "LORA", "r": 8, "target_modules": ["q_proj", "v_proj"], **peft}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    save_file(lora_tensors(local.hf_config, r=config["r"], seed=seed) if tensors is None else tensors,
              str(folder / "adapter_model.safetensors"))
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
    other = load_adapter("other", make_folder(tmp_path / "c", seed=2), BASE, LOCAL, 16)
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


# --- the adapter's own files against the base ----------------------------------------------------------

def refused_field(folder: Path, local: LocalModel = LOCAL) -> str:
    with pytest.raises(AdapterRefused) as refused:
        load_adapter("support", folder, BASE, local, 16)
    assert refused.value.field in str(refused.value)
    return refused.value.field


def declared_then(folder: Path, config: dict | None = None, tensors: dict[str, np.ndarray] | None = None) -> Path:
    """A folder declared while it fit, then given another adapter_config.json or other tensors: what a
    declaration written on the server before the files changed, or for another adapter, looks like."""
    make_folder(folder)
    if config is not None:
        (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", **config}))
    if tensors is not None:
        save_file(tensors, str(folder / "adapter_model.safetensors"))
    return folder


def test_a_target_module_the_base_lacks_is_refused(tmp_path):
    folder = declared_then(tmp_path / "a", {"r": 8, "target_modules": ["q_proj", "query_key_value"]})
    assert refused_field(folder) == "adapter_config.target_modules"
    folder = declared_then(tmp_path / "b", {"r": 8, "target_modules": r".*\.attention\.(query|value)"})
    assert refused_field(folder) == "adapter_config.target_modules"
    # peft's other forms name modules the base has: a full name, a pattern over full names, all-linear
    for i, targets in enumerate((["model.layers.0.self_attn.q_proj", "v_proj"], r".*\.(q_proj|v_proj)",
                                 "all-linear", None)):
        load_adapter("support", declared_then(tmp_path / f"ok{i}", {"r": 8, "target_modules": targets}),
                     BASE, LOCAL, 16)


def test_a_tensor_the_base_has_no_module_for_is_refused(tmp_path):
    tensors = lora_tensors(CONFIG)
    tensors[f"{PREFIX}.0.self_attn.qkv_proj.lora_A.weight"] = np.zeros((8, 576), dtype=np.float16)
    assert refused_field(declared_then(tmp_path / "a", tensors=tensors)) == "weights.module"
    tensors = lora_tensors(CONFIG)
    del tensors[f"{PREFIX}.0.self_attn.v_proj.lora_B.weight"]
    assert refused_field(declared_then(tmp_path / "b", tensors=tensors)) == "weights.module"
    assert refused_field(declared_then(tmp_path / "c", tensors={"x": np.zeros(2)})) == "weights"


@pytest.mark.parametrize("tensor, shape", [
    ("v_proj.lora_B", (576, 8)),  # q_proj's output: 9 heads, not v_proj's 3 KV heads
    ("q_proj.lora_A", (8, 512)),  # another hidden size
    ("q_proj.lora_A", (8, 576, 1)),
])
def test_a_tensor_of_another_shape_than_the_bases_layer_is_refused(tmp_path, tensor, shape):
    tensors = lora_tensors(CONFIG)
    tensors[f"{PREFIX}.29.self_attn.{tensor}.weight"] = np.zeros(shape, dtype=np.float16)
    folder = declared_then(tmp_path / "a", tensors=tensors)
    assert refused_field(folder) == "weights.shape"
    with pytest.raises(AdapterRefused, match=rf"layers\.29\.self_attn\.{tensor}\.weight has shape"):
        load_adapter("support", folder, BASE, LOCAL, 16)


def test_a_rank_the_tensors_do_not_have_is_refused(tmp_path):
    assert refused_field(declared_then(tmp_path / "a", {"r": 16, "target_modules": ["q_proj", "v_proj"]})) \
        == "adapter_config.r"
    assert refused_field(declared_then(tmp_path / "b", {"r": 0})) == "adapter_config.r"
    # peft's rank_pattern gives modules their own rank; the adapter's rank is the largest
    tensors = {**lora_tensors(CONFIG, modules=("q_proj",)), **lora_tensors(CONFIG, r=4, modules=("v_proj",))}
    folder = declared_then(tmp_path / "c", {"r": 8, "rank_pattern": {"v_proj": 4}}, tensors)
    assert load_adapter("support", folder, BASE, LOCAL, 16).rank == 8
    folder = declared_then(tmp_path / "d", {"r": 8, "rank_pattern": {"v_proj": 16}}, tensors)
    assert refused_field(folder) == "adapter_config.r"
    folder = declared_then(tmp_path / "e", {"r": 8, "rank_pattern": {"v_proj": "four"}}, tensors)
    assert refused_field(folder) == "adapter_config.rank_pattern"


def test_layers_beyond_the_bases_are_refused(tmp_path):
    tensors = lora_tensors(CONFIG, layers=(0, 30))  # a 32-layer model's adapter on a 30-layer base
    assert refused_field(declared_then(tmp_path / "a", tensors=tensors)) == "weights.layers"


def test_the_base_the_adapter_names_is_compared_only_when_both_name_a_hub_repository(tmp_path):
    instruct = LocalModel(name="base-model", path=Path("."), weights_digest="ab" * 32, quantization="",
                          hf_config={**CONFIG, "_name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct"})
    for i, (trained_on, field) in enumerate((
            ("HuggingFaceTB/SmolLM2-135M", "adapter_config.base_model_name_or_path"),  # base, not instruct
            ("someone/smollm2-135m-instruct", None),  # a mirror: the same repository name
            ("/home/me/models/SmolLM2-135M", None),  # a path on the training machine says nothing
            (None, None))):
        folder = declared_then(tmp_path / str(i), {"r": 8, "base_model_name_or_path": trained_on})
        if field is None:
            load_adapter("support", folder, BASE, instruct, 16)
        else:
            assert refused_field(folder, instruct) == field
    # a base whose config.json names no repository (the default model's converted checkpoint): nothing to compare
    load_adapter("support", make_folder(tmp_path / "x", base_model_name_or_path="HuggingFaceTB/SmolLM2-135M"),
                 BASE, LOCAL, 16)


def test_a_base_whose_shapes_kite_cannot_derive_serves_no_adapter(tmp_path):
    folder = make_folder(tmp_path / "a")
    phi = LocalModel(name="base-model", path=Path("."), weights_digest="ab" * 32, quantization="",
                     hf_config={**CONFIG, "model_type": "phi3"})
    assert refused_field(folder, phi) == "base.model_type"
    incomplete = LocalModel(name="base-model", path=Path("."), weights_digest="ab" * 32, quantization="",
                            hf_config={k: v for k, v in CONFIG.items() if k != "intermediate_size"})
    assert refused_field(folder, incomplete) == "base.intermediate_size"


def test_declare_refuses_an_adapter_that_does_not_fit_and_writes_nothing(tmp_path, capsys):
    from kite_cli.adapter_admin import main

    folder = tmp_path / "a"
    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8}))
    save_file(lora_tensors(CONFIG, layers=(31,)), str(folder / "adapter_model.safetensors"))
    with pytest.raises(AdapterRefused, match="weights.layers"):
        adapters.declare(folder, LOCAL, 16)
    assert main(["declare", str(folder)]) == 1
    assert "weights.layers" in capsys.readouterr().err
    assert not (folder / adapters.DECLARATION_FILE).exists()


@pytest.mark.parametrize("model_type", adapters.LLAMA_STYLE_MODEL_TYPES)
def test_the_derived_shapes_are_the_modules_transformers_builds_and_peft_saves(tmp_path, model_type):
    """base_modules against the model transformers builds from a config (on the meta device: no weights),
    and a real peft adapter on every module it can target, saved and checked."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    sizes = {"hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4, "num_key_value_heads": 2,
             "head_dim": 24, "num_hidden_layers": 2, "vocab_size": 128}  # head_dim is not hidden / heads
    config = AutoConfig.for_model(model_type, **sizes, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                  tie_word_embeddings=False)
    base = adapters.base_modules("test", {"model_type": model_type, **sizes})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    built = {name: (m.in_features, m.out_features) if isinstance(m, torch.nn.Linear)
             else (m.num_embeddings, m.embedding_dim)
             for name, m in model.named_modules() if isinstance(m, (torch.nn.Linear, torch.nn.Embedding))}
    expected = {**{f"model.layers.{i}.{parent}.{m}": base.per_layer[m] for i in range(2)
                   for m, parent in (("q_proj", "self_attn"), ("k_proj", "self_attn"), ("v_proj", "self_attn"),
                                     ("o_proj", "self_attn"), ("gate_proj", "mlp"), ("up_proj", "mlp"),
                                     ("down_proj", "mlp"))},
                "model.embed_tokens": base.per_model["embed_tokens"], "lm_head": base.per_model["lm_head"]}
    assert built == expected and sorted(base.full_names()) == sorted(expected)

    model = AutoModelForCausalLM.from_config(config)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head",
               "embed_tokens"]
    with pytest.warns(UserWarning, match="save_embedding_layers"):  # peft saves the embedding beside its LoRA
        get_peft_model(model, LoraConfig(r=4, target_modules=targets, rank_pattern={"down_proj": 2})) \
            .save_pretrained(tmp_path)
    peft_config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert adapters.check_own_files("test", tmp_path, peft_config, {"model_type": model_type, **sizes}) == 4
    with pytest.raises(AdapterRefused) as refused:
        adapters.check_own_files("test", tmp_path, peft_config, {"model_type": model_type, **sizes,
                                                                "num_key_value_heads": 4})
    assert refused.value.field == "weights.shape"
