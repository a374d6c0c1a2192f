"""LoRA adapters: their identity, and the compatibility contract with the base model they run on.

An adapter is a folder as peft saves it (`adapter_config.json` + `adapter_model.safetensors`) plus KITE's
declaration, `kite-adapter.json`, which states the base the adapter was trained for:

    {"format": "kite.adapter.v1",
     "base": {"weights_digest": "<hex; optional>",
              "vocab_size": 49152,
              "kv_layout": {"num_layers": 30, "num_kv_heads": 3, "head_dim": 64, "block_size": 16},
              "norm_eps": 1e-05,
              "rope_theta": 100000.0,
              "rope_scaling": ""}}

`kite adapter declare FOLDER` writes it from the configured base. Every field except `weights_digest` is
required; each is compared with the loaded base before the adapter serves a request, and a mismatch refuses
the adapter with an error naming the field (`AdapterRefused`), never a silent wrong answer: KV computed under
another layout, epsilon, rope or vocabulary is not the KV this base would compute. With `weights_digest`
the adapter is also bound to the exact base weights.

A declaration written where the adapter is served states that base's facts whatever the adapter was
trained on, so the adapter's own files are checked too (`check_own_files`), against the base's config.json
and the safetensors header (no weights loaded): its target modules exist in the base, every LoRA tensor
has the shape of the base's layer and a layer index the base has, and `r` is the tensors' rank.

An adapter's identity is its content digest (adapter config + weight files): it enters the model-state
fingerprint, so blocks of two adapters (or of an adapter and the base) never share a hash, while blocks of
one adapter are shared by every worker that serves it.

Models are named like vLLM and the OpenAI API do: the adapter's own name, or "<base>:<adapter>".

Adapters are configured at start (KITE_ADAPTERS, `load_configured`) or loaded and unloaded at run time
(`kite adapter load|unload`: an AdapterAdminRequest that every fingerprinter and worker answers through
`answer_admin`, each checking the contract itself).

Pure logic over files and messages: no NATS, no torch.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Awaitable, Callable

from safetensors import SafetensorError, safe_open

from kite_shared.config import ModelConfig
from kite_shared.fingerprint import root_hash
from kite_shared.messages import AdapterAdminReply, AdapterAdminRequest, ErrorInfo
from kite_shared.model_store import LocalModel, ModelIdentity, file_digest

log = logging.getLogger(__name__)

DECLARATION_FILE = "kite-adapter.json"
DECLARATION_FORMAT = "kite.adapter.v1"
PEFT_CONFIG_FILE = "adapter_config.json"
PEFT_WEIGHTS_FILE = "adapter_model.safetensors"
ADAPTER_WEIGHT_SUFFIXES = (".safetensors", ".bin")


class AdapterRefused(ValueError):
    """The adapter cannot serve on this base; `field` names the first fact that does not match."""

    def __init__(self, name: str, field: str, message: str) -> None:
        super().__init__(f"adapter {name!r} refused: {field}: {message}")
        self.name = name
        self.field = field


@dataclass(frozen=True)
class Adapter:
    """An adapter that passed the contract check against this process's base model."""

    name: str  # served as `name` and as "<base>:<name>"
    path: Path  # the peft folder
    digest: str  # hex SHA-256 over the adapter's config and weights
    rank: int  # LoRA rank r (vLLM's max_lora_rank must cover it)
    identity: ModelIdentity  # the base identity with this adapter's digest


def base_facts(local: LocalModel, block_size: int) -> dict:
    """The `base` section a declaration for `local` must carry (what `kite adapter declare` writes)."""
    layout = local.kv_layout(block_size)
    return {
        "weights_digest": local.weights_digest,
        "vocab_size": int(local.hf_config["vocab_size"]),
        "kv_layout": {"num_layers": layout.num_layers, "num_kv_heads": layout.num_kv_heads,
                      "head_dim": layout.head_dim, "block_size": layout.block_size},
        "norm_eps": layout.norm_eps,
        "rope_theta": layout.rope_theta,
        "rope_scaling": layout.rope_scaling,
    }


def declare(folder: Path, local: LocalModel, block_size: int) -> Path:
    """Write `folder`'s declaration for the base `local`; returns its path. Raises AdapterRefused, writing
    nothing, when the adapter's own files do not fit that base."""
    check_own_files(Path(folder).name, Path(folder), _read_peft_config(Path(folder).name, Path(folder)),
                    local.hf_config)
    path = Path(folder) / DECLARATION_FILE
    path.write_text(json.dumps({"format": DECLARATION_FORMAT, "base": base_facts(local, block_size)},
                               indent=2, sort_keys=True) + "\n")
    return path


def load_adapter(name: str, folder: str | Path, base: ModelIdentity, local: LocalModel,
                 block_size: int) -> Adapter:
    """Check `folder` against the loaded base and return the adapter; raises AdapterRefused."""
    folder = Path(folder).expanduser().resolve()
    if not name or ":" in name or name == local.name:
        raise AdapterRefused(name, "name", f"must be non-empty, without ':', and not the base's name {local.name!r}")
    peft_config = _read_peft_config(name, folder)
    declaration = _read_json(name, folder / DECLARATION_FILE, DECLARATION_FILE)
    if declaration.get("format") != DECLARATION_FORMAT:
        raise AdapterRefused(name, "format", f"expected {DECLARATION_FORMAT!r}, found {declaration.get('format')!r}")
    check_declaration(name, declaration.get("base"), base_facts(local, block_size))
    rank = check_own_files(name, folder, peft_config, local.hf_config)
    digest = adapter_digest(folder)
    identity = dataclasses.replace(base, model=dataclasses.replace(base.model, adapter_digest=digest))
    identity = dataclasses.replace(identity, root=root_hash(identity.model, identity.execution))
    return Adapter(name=name, path=folder, digest=digest, rank=rank, identity=identity)


def _read_peft_config(name: str, folder: Path) -> dict:
    peft_config = _read_json(name, folder / PEFT_CONFIG_FILE, "adapter_config.json")
    if peft_config.get("peft_type") != "LORA":
        raise AdapterRefused(name, "adapter_config.peft_type",
                             f"only LoRA adapters are served, not {peft_config.get('peft_type')!r}")
    return peft_config


def check_declaration(name: str, declared: object, actual: dict) -> None:
    """Compare a declaration's `base` section with the loaded base's facts, field by field."""
    if not isinstance(declared, dict):
        raise AdapterRefused(name, "base", "the declaration has no 'base' section")
    for field, expected in actual.items():
        if field not in declared:
            if field == "weights_digest":
                continue  # optional: bind to the exact weights only when declared
            raise AdapterRefused(name, f"base.{field}", "missing from the declaration")
        if isinstance(expected, dict):
            inner = declared[field]
            if not isinstance(inner, dict):
                raise AdapterRefused(name, f"base.{field}", "expected an object")
            for key, value in expected.items():
                _compare(name, f"base.{field}.{key}", inner.get(key), value)
        else:
            _compare(name, f"base.{field}", declared[field], expected)


# --- the adapter's own files against the base ---------------------------------------------------------

# Bases whose decoder layers are Llama's (q/k/v/o_proj under self_attn, gate/up/down_proj under mlp), so
# that config.json alone gives every LoRA target's shape; tests/unit/test_adapters.py checks each against
# the modules transformers builds from such a config.
LLAMA_STYLE_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2")
_LAYER_MODULES = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
                  "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
_MODEL_MODULES = {"embed_tokens": "model.embed_tokens", "lm_head": "lm_head"}
# peft's keys: <module>.lora_A.weight [r, in], <module>.lora_B.weight [out, r]; an embedding's
# lora_embedding_A [r, vocab] and lora_embedding_B [hidden, r]; base_layer.weight when it saves the module.
_PEFT_TENSOR = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\."
                          r"(?P<kind>lora_A|lora_B|lora_embedding_A|lora_embedding_B|base_layer)(?:\.weight)?$")
_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/(?P<repo>[\w.-]+)$")


@dataclass(frozen=True)
class BaseModules:
    """The modules of a base a LoRA can target, from its config.json: (in_features, out_features) by name
    (an embedding's are (vocabulary, hidden size)), and how many decoder layers have the per-layer ones."""

    model_type: str
    per_layer: dict[str, tuple[int, int]]
    per_model: dict[str, tuple[int, int]]
    num_layers: int

    def full_names(self) -> list[str]:
        """Every targetable module's name as transformers names it (what a target_modules regex matches)."""
        return [f"model.layers.{i}.{_LAYER_MODULES[m]}.{m}" for i in range(self.num_layers)
                for m in self.per_layer] + [_MODEL_MODULES[m] for m in self.per_model]


def base_modules(name: str, hf_config: dict[str, Any]) -> BaseModules:
    """The targetable modules of the base `hf_config` describes; AdapterRefused for an architecture whose
    shapes KITE cannot derive (it would serve an adapter it cannot check)."""
    model_type = hf_config.get("model_type")
    if model_type not in LLAMA_STYLE_MODEL_TYPES:
        raise AdapterRefused(name, "base.model_type", "an adapter's modules and shapes are checked against "
                             f"{', '.join(LLAMA_STYLE_MODEL_TYPES)} bases; this base's model_type is {model_type!r}")
    def size(key: str) -> int:
        if not _positive_int(value := hf_config.get(key)):
            raise AdapterRefused(name, f"base.{key}", f"config.json has {value!r}, not a positive integer")
        return value

    hidden, heads, inter, vocab = (size(k) for k in ("hidden_size", "num_attention_heads", "intermediate_size",
                                                      "vocab_size"))
    kv_heads = size("num_key_value_heads") if hf_config.get("num_key_value_heads") else heads
    head_dim = size("head_dim") if hf_config.get("head_dim") else hidden // heads
    return BaseModules(
        model_type=model_type,
        per_layer={"q_proj": (hidden, heads * head_dim), "k_proj": (hidden, kv_heads * head_dim),
                   "v_proj": (hidden, kv_heads * head_dim), "o_proj": (heads * head_dim, hidden),
                   "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)},
        per_model={"embed_tokens": (vocab, hidden), "lm_head": (hidden, vocab)},
        num_layers=size("num_hidden_layers"))


def check_own_files(name: str, folder: Path, peft_config: dict, hf_config: dict[str, Any]) -> int:
    """Check the adapter's adapter_config.json and the tensor shapes in its safetensors header against the
    base's config.json; returns the largest LoRA rank of its tensors. Raises AdapterRefused naming the field."""
    base = base_modules(name, hf_config)
    r = peft_config.get("r")
    if not _positive_int(r):
        raise AdapterRefused(name, "adapter_config.r", f"expected a positive integer, found {r!r}")
    rank_pattern = peft_config.get("rank_pattern") or {}
    if not isinstance(rank_pattern, dict) or not all(_is_pattern(k) and _positive_int(v)
                                                     for k, v in rank_pattern.items()):
        raise AdapterRefused(name, "adapter_config.rank_pattern",
                             f"expected module patterns with positive ranks, found {rank_pattern!r}")
    _check_targets(name, peft_config.get("target_modules"), base)
    _check_base_name(name, peft_config.get("base_model_name_or_path"), hf_config.get("_name_or_path"))
    kinds: dict[str, set[str]] = {}
    ranks: list[int] = []
    for key, shape in sorted(_tensor_shapes(name, folder / PEFT_WEIGHTS_FILE).items()):
        found = _PEFT_TENSOR.match(key)
        if found is None:
            continue  # not LoRA's A or B (a DoRA magnitude, a modules_to_save copy): not checked
        module, kind = found["module"], found["kind"]
        in_features, out_features = _module_features(name, key, module, base)
        if kind == "base_layer":  # the base's own module, saved beside the LoRA (an embedding is [vocab, hidden])
            embedding = module.endswith("embed_tokens")
            expected = [in_features, out_features] if embedding else [out_features, in_features]
            if shape != expected:
                raise AdapterRefused(name, "weights.shape", f"{key} has shape {shape}; the base's is {expected}")
            continue
        kinds.setdefault(module, set()).add(kind[-1])
        rank = next((v for k, v in rank_pattern.items() if re.match(rf"(.*\.)?({k})$", module)), r)
        is_a = kind.endswith("A")
        if len(shape) != 2 or shape[1 if is_a else 0] != (in_features if is_a else out_features):
            expected = [rank, in_features] if is_a else [out_features, rank]
            short = module.rsplit(".", 1)[-1]
            raise AdapterRefused(name, "weights.shape", f"{key} has shape {shape}; the base's {short} "
                                 f"({in_features} in, {out_features} out) needs {expected}")
        found_rank = shape[0 if is_a else 1]
        if found_rank != rank:
            raise AdapterRefused(name, "adapter_config.r", f"{key} has rank {found_rank}, adapter_config.json "
                                 f"gives this module rank {rank}")
        ranks.append(found_rank)
    if not ranks:
        raise AdapterRefused(name, "weights", f"{folder / PEFT_WEIGHTS_FILE} holds no LoRA tensor")
    unpaired = sorted(m for m, k in kinds.items() if k != {"A", "B"})
    if unpaired:
        raise AdapterRefused(name, "weights.module", f"{unpaired[0]} has only one of LoRA's A and B")
    return max(ranks)


def _positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _is_pattern(text: object) -> bool:
    try:
        return isinstance(text, str) and re.compile(text) is not None
    except re.error:
        return False


def _module_features(name: str, key: str, module: str, base: BaseModules) -> tuple[int, int]:
    """(in, out) of the base module a tensor belongs to; AdapterRefused when the base has no such module."""
    suffix = module.rsplit(".", 1)[-1]
    layer = _LAYER_INDEX.search(module)
    if suffix in base.per_layer and layer is not None:
        if int(layer[1]) >= base.num_layers:
            raise AdapterRefused(name, "weights.layers", f"{key} is for layer {layer[1]}; the base has "
                                                          f"{base.num_layers} layers (0-{base.num_layers - 1})")
        return base.per_layer[suffix]
    if suffix in base.per_model and layer is None:
        return base.per_model[suffix]
    raise AdapterRefused(name, "weights.module", f"{key}: a {base.model_type} base has no module {module!r}")


def _check_targets(name: str, targets: object, base: BaseModules) -> None:
    """target_modules as peft reads it: a list of module names (matched by their last part), or one
    regular expression over full module names."""
    field = "adapter_config.target_modules"
    known = sorted([*base.per_layer, *base.per_model])
    if targets is None or targets == "all-linear":
        return  # peft chose the modules (by model type, or every linear one): the tensors are checked
    if isinstance(targets, str):
        try:
            pattern = re.compile(targets)
        except re.error as exc:
            raise AdapterRefused(name, field, f"{targets!r} is not a regular expression: {exc}") from None
        if not any(pattern.fullmatch(n) for n in base.full_names()):
            raise AdapterRefused(name, field, f"{targets!r} matches no module of this base ({', '.join(known)})")
        return
    if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
        raise AdapterRefused(name, field, f"expected a list of module names or a pattern, found {targets!r}")
    missing = [t for t in targets if t.rsplit(".", 1)[-1] not in known]
    if missing:
        raise AdapterRefused(name, field, f"{', '.join(missing)}: not a module of this {base.model_type} base "
                                          f"(it has {', '.join(known)})")


def _check_base_name(name: str, trained_on: object, base_name: object) -> None:
    """Compare the base the adapter names with the served one's, only where both name a Hub repository:
    a path on the training machine says nothing here, and the declared weights digest is the strong check.
    The owner is left out (a mirror holds the same weights); another repository name (a base model and its
    instruct tune have the same shapes) is another model."""
    trained, served = (_HUB_ID.match(v) if isinstance(v, str) else None for v in (trained_on, base_name))
    if trained and served and trained["repo"].lower() != served["repo"].lower():
        raise AdapterRefused(name, "adapter_config.base_model_name_or_path",
                             f"trained on {trained_on!r}; the loaded base is {base_name!r}")


def _tensor_shapes(name: str, path: Path) -> dict[str, list[int]]:
    """Every tensor's shape from the safetensors header, without reading the tensors."""
    try:
        with safe_open(path, framework="numpy") as f:
            return {key: list(f.get_slice(key).get_shape()) for key in f.keys()}
    except FileNotFoundError:
        raise AdapterRefused(name, "weights", f"{path} does not exist (peft's save_pretrained writes it; "
                                              "a pickled adapter_model.bin is not read)") from None
    except (OSError, SafetensorError) as exc:
        raise AdapterRefused(name, "weights", f"{path} cannot be read: {exc}") from None


def _compare(name: str, field: str, declared: object, expected: object) -> None:
    same = (isinstance(expected, float) and isinstance(declared, (int, float))
            and not isinstance(declared, bool) and float(declared) == expected) or declared == expected
    if not same:
        raise AdapterRefused(name, field, f"declared {declared!r}, the loaded base has {expected!r}")


def adapter_digest(folder: Path) -> str:
    """SHA-256 over the peft config (rank, alpha and target modules change outputs) and the weight files."""
    h = hashlib.sha256()
    config = json.loads((folder / PEFT_CONFIG_FILE).read_text())
    h.update(json.dumps(config, sort_keys=True).encode() + b"\0")
    weights = sorted(p for p in folder.iterdir() if p.is_file() and p.name.endswith(ADAPTER_WEIGHT_SUFFIXES))
    if not weights:
        raise AdapterRefused(folder.name, "weights", f"no adapter weight file in {folder}")
    for p in weights:
        h.update(p.name.encode() + b"\0" + bytes.fromhex(file_digest(p)))
    return h.hexdigest()


def _read_json(name: str, path: Path, what: str) -> dict:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise AdapterRefused(name, what, f"{path} does not exist") from None
    except (OSError, ValueError) as exc:
        raise AdapterRefused(name, what, f"{path} cannot be read: {exc}") from None
    if not isinstance(data, dict):
        raise AdapterRefused(name, what, "expected a JSON object")
    return data


def load_configured(cfg: ModelConfig, local: LocalModel, base: ModelIdentity) -> dict[str, Adapter]:
    """The adapters KITE_ADAPTERS names that pass the contract, by name. A refused adapter is logged with
    the field at fault and left out: the base and the other adapters keep serving."""
    loaded: dict[str, Adapter] = {}
    for name, path in parse_adapter_setting(cfg.adapters).items():
        try:
            loaded[name] = loader(cfg, local, base)(name, path)
        except AdapterRefused as exc:
            log.error("%s", exc)
    return loaded


def loader(cfg: ModelConfig, local: LocalModel, base: ModelIdentity) -> Callable[[str, str], Adapter]:
    """`load(name, path)` for this process's base: the contract check, and the rank limit."""

    def load(name: str, path: str) -> Adapter:
        adapter = load_adapter(name, path, base, local, cfg.block_size)
        # Fingerprinters and workers both check this, so neither side offers what the other cannot serve.
        if adapter.rank > cfg.max_lora_rank:
            raise AdapterRefused(name, "rank", f"LoRA rank {adapter.rank} exceeds KITE_MAX_LORA_RANK="
                                               f"{cfg.max_lora_rank}")
        return adapter

    return load


async def answer_admin(req: AdapterAdminRequest, served: dict[str, Adapter], load: Callable[[str, str], Adapter],
                       service: str, instance_id: str,
                       apply: Callable[[str, Adapter | None], Awaitable[None]]) -> AdapterAdminReply:
    """One fingerprinter's or worker's answer to `kite adapter load|unload`. `served` is what it serves, by
    name; `apply(name, adapter)` makes the change take effect in the process (adapter None: unload)
    before `served` says so, and may raise AdapterRefused."""

    def reply(ok: bool, error: ErrorInfo | None = None, fingerprint: str = "") -> AdapterAdminReply:
        return AdapterAdminReply(service=service, instance_id=instance_id, ok=ok, error=error,
                                 adapters=sorted(served), model_fingerprint=fingerprint)

    try:
        if req.op == "unload":
            if req.name not in served:
                return reply(False, ErrorInfo(code="model_not_found", param="name",
                                              message=f"no adapter {req.name!r} is served here"))
            await apply(req.name, None)
            del served[req.name]
            log.info("adapter %s unloaded", req.name)
            return reply(True)
        if req.name in served:
            raise AdapterRefused(req.name, "name", "an adapter of this name is served already: unload it first")
        adapter = load(req.name, req.path)
        await apply(req.name, adapter)
    except AdapterRefused as exc:
        log.error("%s", exc)
        return reply(False, ErrorInfo(code="adapter_refused", param=exc.field, message=str(exc)))
    served[req.name] = adapter
    log.info("adapter %s loaded from %s (digest %s)", adapter.name, adapter.path, adapter.digest[:16])
    return reply(True, fingerprint=adapter.identity.fingerprint_hex)


def parse_adapter_setting(value: str) -> dict[str, str]:
    """KITE_ADAPTERS ("name=/path,other=/path") as {name: path}."""
    adapters: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in value.split(","))):
        name, sep, path = item.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise ValueError(f"KITE_ADAPTERS item {item!r}: expected name=/path/to/adapter")
        if name.strip() in adapters:
            raise ValueError(f"KITE_ADAPTERS names {name.strip()!r} twice")
        adapters[name.strip()] = path.strip()
    return adapters


def split_model_name(model: str, base_name: str) -> str:
    """The adapter a request's `model` names: "" for the base, the adapter's name for "<adapter>" or
    "<base>:<adapter>" (the caller checks that the adapter exists)."""
    if model == base_name:
        return ""
    prefix = base_name + ":"
    return model[len(prefix):] if model.startswith(prefix) else model
