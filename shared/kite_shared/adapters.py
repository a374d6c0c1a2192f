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
from dataclasses import dataclass
from pathlib import Path

from typing import Awaitable, Callable

from kite_shared.config import ModelConfig
from kite_shared.fingerprint import root_hash
from kite_shared.messages import AdapterAdminReply, AdapterAdminRequest, ErrorInfo
from kite_shared.model_store import LocalModel, ModelIdentity, file_digest

log = logging.getLogger(__name__)

DECLARATION_FILE = "kite-adapter.json"
DECLARATION_FORMAT = "kite.adapter.v1"
PEFT_CONFIG_FILE = "adapter_config.json"
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
    """Write `folder`'s declaration for the base `local`; returns its path."""
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
    peft_config = _read_json(name, folder / PEFT_CONFIG_FILE, "adapter_config.json")
    if peft_config.get("peft_type") != "LORA":
        raise AdapterRefused(name, "adapter_config.peft_type",
                             f"only LoRA adapters are served, not {peft_config.get('peft_type')!r}")
    declaration = _read_json(name, folder / DECLARATION_FILE, DECLARATION_FILE)
    if declaration.get("format") != DECLARATION_FORMAT:
        raise AdapterRefused(name, "format", f"expected {DECLARATION_FORMAT!r}, found {declaration.get('format')!r}")
    check_declaration(name, declaration.get("base"), base_facts(local, block_size))
    digest = adapter_digest(folder)
    identity = dataclasses.replace(base, model=dataclasses.replace(base.model, adapter_digest=digest))
    identity = dataclasses.replace(identity, root=root_hash(identity.model, identity.execution))
    return Adapter(name=name, path=folder, digest=digest, rank=int(peft_config.get("r", 0)), identity=identity)


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
