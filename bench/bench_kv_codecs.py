"""What a lossy KV codec costs in answers, on the real default model (issue 17's quality guard).

For each prompt of a fixed set (from the `system-prompt` and `rag-shuffle` workloads of `kite bench`, seed 0),
the reference engine's model (transformers, SmolLM2-135M-Instruct) computes the KV of every token but the
last; the full 16-token blocks of that KV are then stored and read back through each codec
(kite_shared/kv_codec.py), the way a unit in a tier would be, and the model continues greedily from the
last prompt token for --tokens tokens. Compared with the same continuation from the lossless default
(fp16, what the pool stores today):
- greedy agreement: the share of generated tokens equal to the lossless run's, position by position;
- identical: continuations that equal the lossless run's entirely;
- first-token KL: KL(lossless || codec) of the first generated token's distribution (nats);
- bytes per token of the payload.
fp16 itself is also compared with the KV as computed (fp32), the error every reuse already accepts.

    .venv/bin/python bench/bench_kv_codecs.py [--prompts 12] [--tokens 32] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from transformers import DynamicCache

from kite_cli.bench import workloads
from kite_shared import kv_codec
from kite_shared.config import ModelConfig, load
from kite_shared.model_store import load_causal_lm, load_tokenizer, prepare

BLOCK = 16


def prompts(tokenizer, count: int) -> list[list[int]]:
    """Token ids of `count` chat prompts: half from system-prompt (a 400-token handbook and a question),
    half from rag-shuffle (four 120-token documents and a question), seed 0."""
    sessions = (workloads.system_prompt(0, requests=count - count // 2, shared_tokens=400).sessions
                + workloads.rag_shuffle(0, requests=count // 2, doc_tokens=120).sessions)
    found = []
    for session in sessions:
        ids = tokenizer.apply_chat_template(workloads.messages_for(session, 0, []), add_generation_prompt=True,
                                            tokenize=True)
        found.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return found


def through_codec(cache: DynamicCache, codec: str | None) -> DynamicCache:
    """A copy of `cache` whose full blocks went through `codec` (None: as computed)."""
    copy = DynamicCache()
    for layer_idx, layer in enumerate(cache.layers):
        keys, values = layer.keys.clone(), layer.values.clone()  # [1, heads, tokens, head dim]
        if codec is not None:
            num_full = keys.shape[2] // BLOCK * BLOCK
            for start in range(0, num_full, BLOCK):
                part = torch.stack([keys[:, :, start:start + BLOCK], values[:, :, start:start + BLOCK]], dim=1)
                shape = tuple(part.shape)  # [1 layer, 2, heads, BLOCK, head dim]
                decoded = kv_codec.decode(kv_codec.encode(part, codec), codec, shape, keys.dtype)
                keys[:, :, start:start + BLOCK] = decoded[:, 0]
                values[:, :, start:start + BLOCK] = decoded[:, 1]
        copy.update(keys, values, layer_idx)
    return copy


@torch.inference_mode()
def continue_greedily(model, cache: DynamicCache, last_token: int, num_tokens: int) -> tuple[list[int], torch.Tensor]:
    """(greedy tokens, log-probabilities of the first one's distribution)."""
    token = torch.tensor([[last_token]])
    generated, first = [], None
    for _ in range(num_tokens):
        logits = model(input_ids=token, past_key_values=cache, use_cache=True).logits[0, -1].float()
        if first is None:
            first = torch.log_softmax(logits, dim=-1)
        token = logits.argmax().view(1, 1)
        generated.append(int(token))
    return generated, first


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    cfg = load(ModelConfig)
    local = prepare(cfg)
    tokenizer, model = load_tokenizer(local), load_causal_lm(local, cfg)
    hf = model.config
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    block_shape = (hf.num_hidden_layers, 2, hf.num_key_value_heads, BLOCK, head_dim)
    codecs = ["fp16", "bf16", "int8", "fp8_e4m3"]
    rows = {name: {"agreement": [], "identical": 0, "kl": []} for name in ["as computed → fp16"] + codecs[1:]}
    started = time.perf_counter()
    chosen = prompts(tokenizer, args.prompts)
    for ids in chosen:
        with torch.inference_mode():
            cache = model(input_ids=torch.tensor([ids[:-1]]), use_cache=True).past_key_values
        exact, exact_first = continue_greedily(model, through_codec(cache, None), ids[-1], args.tokens)
        lossless, lossless_first = continue_greedily(model, through_codec(cache, "fp16"), ids[-1], args.tokens)
        comparisons = [("as computed → fp16", exact, exact_first, lossless, lossless_first)]
        for codec in codecs[1:]:
            tokens, first = continue_greedily(model, through_codec(cache, codec), ids[-1], args.tokens)
            comparisons.append((codec, lossless, lossless_first, tokens, first))
        for name, reference, reference_first, tokens, first in comparisons:
            rows[name]["agreement"].append(sum(a == b for a, b in zip(reference, tokens)) / len(reference))
            rows[name]["identical"] += reference == tokens
            rows[name]["kl"].append(float(torch.sum(reference_first.exp() * (reference_first - first))))
    lengths = [len(ids) for ids in chosen]
    print(f"{len(chosen)} prompts of {min(lengths)}-{max(lengths)} tokens, {args.tokens} greedy tokens each, "
          f"SmolLM2-135M-Instruct (transformers, {cfg.dtype}), {BLOCK}-token blocks; "
          f"{time.perf_counter() - started:.0f} s")
    print(f"{'codec':20} {'bytes/token':>11} {'vs fp16':>8} {'agreement':>10} {'identical':>10} "
          f"{'first-token KL mean / max':>26}")
    fp16_bytes = kv_codec.payload_bytes("fp16", block_shape) / BLOCK
    print(f"{'fp16 (lossless)':20} {fp16_bytes:11,.0f} {1.0:8.2f}x")
    results = {}
    for name, row in rows.items():
        codec = "fp16" if name.startswith("as computed") else name
        per_token = kv_codec.payload_bytes(codec, block_shape) / BLOCK
        agreement = statistics.mean(row["agreement"])
        results[name] = {"bytes_per_token": per_token, "agreement": agreement, "identical": row["identical"],
                         "kl_mean": statistics.mean(row["kl"]), "kl_max": max(row["kl"])}
        print(f"{name:20} {per_token:11,.0f} {fp16_bytes / per_token:8.2f}x {100 * agreement:9.1f}% "
              f"{row['identical']:>4} of {len(chosen):<3} {statistics.mean(row['kl']):12.2e} / {max(row['kl']):.2e}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
