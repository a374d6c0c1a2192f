"""The quality guard of lossy KV storage (issue 17; issue 36 made storage exact by default): a worker measures
each lossy choice at start and refuses to start when reused blocks stored so would change too many answers.
The lossy choices: a KITE_KV_STORAGE_DTYPE narrower than the compute dtype (float16 under a float32 model)
and each tier's lossy codec (KITE_KV_CODEC, or a tier's: KITE_KV_CODEC_WARM, _COLD). With neither, stored KV
is the computed KV bit for bit and there is nothing to measure.

The measurement, on the reference engine's model (transformers, whatever KITE_ENGINE serves with: vLLM's
kernels are not needed to see what rounding does to the numbers): for each prompt of a fixed set, the model
computes the KV of every token but the last; the full blocks of that KV are passed through what storage
does to them (the storage dtype's rounding, then the tier's codec: kite_shared.kv_codec) and, separately,
kept as computed; the model continues greedily from the last prompt token from each. Agreement is the share
of generated tokens equal position by position; the first-token KL divergence (as computed || stored) is
measured beside it. Below KITE_KV_CODEC_MIN_AGREEMENT (default 99%) the worker refuses to start and says the
measured share. bench/bench_kv_codecs.py runs the same comparison (these functions) over its own prompt
set and prints the table in docs/benchmarks.md.

Cost: one model load and, per prompt, a prefill and a short greedy run per choice plus one as computed:
about 30 s for the default model on two cores, paid only when something lossy is configured.
"""

from __future__ import annotations

import logging
import statistics
import time
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from kite_shared.config import ConfigError, ModelConfig
from kite_shared.model_store import LocalModel, load_causal_lm, load_tokenizer
from kite_shared.recyclable_unit import TORCH_DTYPE_TO_CODEC
from kite_shared.tier_codecs import TIERS
from kite_worker import codec_tensors

log = logging.getLogger(__name__)

GUARD_TOKENS = 24  # greedy tokens compared per prompt
# Varied, fixed prompts: facts, instructions, a document to answer from, arithmetic, code. Each is long
# enough (with the handbook) for a dozen full blocks, which is where stored KV matters.
_HANDBOOK = " ".join(
    f"Rule {i}: a request of kind {i} is answered within {i + 2} hours by team {chr(65 + i % 26)}, "
    f"logged with priority {i % 5}, and closed only after the customer confirms." for i in range(12))
GUARD_QUESTIONS = (
    "Which team answers a request of kind 7, and within how many hours?",
    "Summarise the rules above in two sentences for a new employee.",
    "Write a short, polite reply to a customer whose request of kind 3 is late.",
    "What is 17 times 23? Explain the steps.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "List three risks of closing a request before the customer confirms.",
    "Translate 'the request was closed yesterday' into French and German.",
    "Which priority do requests of kind 9 get, and why might that be?",
)


@dataclass(frozen=True)
class CodecQuality:
    codec: str
    agreement: float  # share of greedy tokens equal to the lossless run's
    num_identical: int  # continuations equal to the lossless run's entirely
    num_prompts: int
    kl_mean: float  # first-token KL(lossless || codec), nats
    kl_max: float


CodecPath = str | tuple[str, ...] | None  # codecs a block goes through, in order (a name: one; None: none)


def through_codec(cache: DynamicCache, path: CodecPath, block_size: int) -> DynamicCache:
    """A copy of `cache` whose full blocks went through each codec of `path` in turn, as a stored block
    does (its storage dtype, then a tier's lossy codec); None: the KV as computed."""
    codecs = () if path is None else (path,) if isinstance(path, str) else path
    copy = DynamicCache()
    for layer_idx, layer in enumerate(cache.layers):
        keys, values = layer.keys.clone(), layer.values.clone()  # [1, heads, tokens, head dim]
        for codec in codecs:
            for start in range(0, keys.shape[2] // block_size * block_size, block_size):
                end = start + block_size
                part = torch.stack([keys[:, :, start:end], values[:, :, start:end]], dim=1)
                decoded = codec_tensors.decode(codec_tensors.encode(part, codec), codec, tuple(part.shape), keys.dtype)
                decoded = decoded.to(keys.device)  # decoded in host memory; the cache may be on a GPU
                keys[:, :, start:end], values[:, :, start:end] = decoded[:, 0], decoded[:, 1]
        copy.update(keys, values, layer_idx)
    return copy


def model_device(model) -> torch.device:
    """Where `model` computes: its inputs go there (the guard runs on whatever device the model was put on)."""
    return next(model.parameters()).device


@torch.inference_mode()
def continue_greedily(model, cache: DynamicCache, last_token: int, num_tokens: int) -> tuple[list[int], torch.Tensor]:
    """(greedy tokens, log-probabilities of the first one's distribution)."""
    token = torch.tensor([[last_token]], device=model_device(model))
    generated, first = [], None
    for _ in range(num_tokens):
        logits = model(input_ids=token, past_key_values=cache, use_cache=True).logits[0, -1].float()
        if first is None:
            first = torch.log_softmax(logits, dim=-1)
        token = logits.argmax().view(1, 1)
        generated.append(int(token))
    return generated, first


@torch.inference_mode()
def compare(model, prompts: list[list[int]], reference: CodecPath, codecs: list[str] | dict[str, CodecPath], num_tokens: int,
            block_size: int) -> dict[str, CodecQuality]:
    """Each codec's continuations against `reference`'s (a CodecPath; None: the KV as computed). `codecs`: names,
    or {name: the CodecPath its blocks take}."""
    codecs = codecs if isinstance(codecs, dict) else {codec: codec for codec in codecs}
    seen: dict[str, list[tuple[float, bool, float]]] = {codec: [] for codec in codecs}
    for ids in prompts:
        cache = model(input_ids=torch.tensor([ids[:-1]], device=model_device(model)), use_cache=True).past_key_values
        expected, expected_first = continue_greedily(model, through_codec(cache, reference, block_size), ids[-1],
                                                     num_tokens)
        for codec, path in codecs.items():
            tokens, first = continue_greedily(model, through_codec(cache, path, block_size), ids[-1], num_tokens)
            seen[codec].append((sum(a == b for a, b in zip(expected, tokens)) / len(expected), expected == tokens,
                                float(torch.sum(expected_first.exp() * (expected_first - first)))))
    return {codec: CodecQuality(codec, statistics.mean(a for a, _, _ in rows), sum(same for _, same, _ in rows),
                                len(rows), statistics.mean(k for _, _, k in rows), max(k for _, _, k in rows))
            for codec, rows in seen.items()}


def guard_prompts(tokenizer) -> list[list[int]]:
    """The guard's prompts as token ids: each question after the handbook, in the model's chat template."""
    prompts = []
    for question in GUARD_QUESTIONS:
        ids = tokenizer.apply_chat_template([{"role": "system", "content": "HANDBOOK: " + _HANDBOOK},
                                             {"role": "user", "content": question}],
                                            add_generation_prompt=True, tokenize=True)
        prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return prompts


def lossy_paths(cfg: ModelConfig) -> dict[str, tuple[str, ...]]:
    """Each lossy choice of `cfg` -> the codecs a block reused under it went through: a narrower storage
    dtype (its own rounding), and each lossy tier codec (after that rounding). Empty: reuse is exact."""
    rounding = (TORCH_DTYPE_TO_CODEC[cfg.kv_storage_dtype],) if cfg.lossy_storage else ()
    paths = {rounding[0]: rounding} if rounding else {}
    paths.update({codec: rounding + (codec,) for codec in cfg.tier_codecs.lossy})
    return paths


def check(local: LocalModel, cfg: ModelConfig, min_agreement: float) -> dict[str, CodecQuality]:
    """Measure each lossy choice (a KITE_KV_STORAGE_DTYPE narrower than the compute dtype, the tiers' lossy
    codecs: KITE_KV_CODEC, _WARM, _COLD) against the KV as computed; ConfigError (with the figure) when one
    is below the floor. Nothing to measure (an empty dict) when reuse is exact."""
    paths = lossy_paths(cfg)
    if not paths:
        return {}
    started = time.monotonic()
    tokenizer, model = load_tokenizer(local), load_causal_lm(local, cfg)
    qualities = compare(model, guard_prompts(tokenizer), None, paths, GUARD_TOKENS, cfg.block_size)
    del model
    elapsed = time.monotonic() - started
    for name, quality in qualities.items():
        if name in cfg.tier_codecs.lossy:
            tiers = [t for t in TIERS if getattr(cfg.tier_codecs, t) == name]
            what = f"KV codec {name} ({tiers[0] if len(tiers) == 1 else ', '.join(tiers[:-1]) + ' and ' + tiers[-1]}"
            what += " tier" if len(tiers) == 1 else " tiers"
            what += f", over {cfg.kv_storage_dtype} storage)" if cfg.lossy_storage else ")"
            remedy = "or make that tier lossless"
        else:
            what = f"KV storage in {cfg.kv_storage_dtype} (KITE_KV_STORAGE_DTYPE, every tier)"
            remedy = "or unset KITE_KV_STORAGE_DTYPE to store the compute dtype, exactly"
        summary = (f"{what}: {100 * quality.agreement:.1f}% of greedy tokens equal to the KV as computed in "
                   f"{cfg.dtype} ({quality.num_identical} of {quality.num_prompts} continuations identical, "
                   f"first-token KL mean {quality.kl_mean:.1e}), measured in {elapsed:.0f} s")
        if quality.agreement < min_agreement:
            raise ConfigError(f"{summary}: below KITE_KV_CODEC_MIN_AGREEMENT={min_agreement:g}; refusing to store "
                              f"KV so (lower the floor to accept these answers, {remedy})")
        log.warning("%s: at or above the floor %g; reused KV is lossy (answers may differ from "
                    "recomputation)", summary, min_agreement)
    return qualities
