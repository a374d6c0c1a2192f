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

Then the tiers (skip with --no-tiers), side by side per codec in each of --rounds rounds, on a real
redis-server and a real S3-compatible server (moto's, in its own process), both started here: every full
block of those prompts becomes a recyclable unit of that codec (HMAC under a cluster key, a model
fingerprint of its own per codec, as a lossy namespace would have) and is read back as a worker reads it:
- warm: `RedisTier.get_units` (MGETs, each unit verified), then decoded to the model's dtype;
- cold: `S3Tier.get_units` (every block at once, the batch verified), decoded;
  figures: wire MB/s (unit bytes read per second) and KV MB/s (the fp16 bytes of the KV delivered per
  second: what a smaller codec buys);
- hit TTFT: one prompt's prefix (its full blocks) fetched from warm, verified, decoded, put in the model's
  cache, then the remaining tokens computed up to the first token; against recomputing the whole prompt
  (no reuse) on the same model in the same round. In-process, on the reference engine: the services'
  hops, the same for every codec, are not in it.

Then the pool's transcoding (a codec per tier: KITE_KV_CODEC_COLD=int8 under lossless hot and warm): every
block as an fp16 unit, transcoded the way the ru-pool does when it archives it (`kv_codec.transcode`: verify,
re-encode, sign), one unit at a time on one thread; and the worker's decode of the result.

    .venv/bin/python bench/bench_kv_codecs.py [--prompts 12] [--tokens 32] [--rounds 3] [--no-tiers] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

import torch
from transformers import DynamicCache

from kite_cli.bench import workloads
from kite_cli.local_servers import free_port, start_redis, wait_for_port
from kite_shared import kv_codec, recyclable_unit
from kite_shared.recyclable_unit import RecyclableUnit
from kite_shared.security import ru_key
from kite_shared.tiers.cold import S3Tier
from kite_shared.tiers.keys import BlockKey
from kite_shared.tiers.warm import RedisTier
from kite_worker import codec_guard, codec_tensors
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


def full_blocks(cache: DynamicCache) -> list[torch.Tensor]:
    """The cache's full blocks, each [layers, 2, heads, BLOCK, head dim] (a unit's tensor)."""
    keys = torch.stack([layer.keys[0] for layer in cache.layers])  # [layers, heads, tokens, head dim]
    values = torch.stack([layer.values[0] for layer in cache.layers])
    kv = torch.stack([keys, values], dim=1)
    return [kv[:, :, :, start:start + BLOCK].contiguous() for start in range(0, kv.shape[3] // BLOCK * BLOCK, BLOCK)]


def units_of(blocks: list[torch.Tensor], codec: str, fp: str, key: bytes) -> list[tuple[bytes, bytes]]:
    """(block hash, encoded unit) per block; hashes chained like a prompt's."""
    out, parent = [], b"\x00" * 32
    for index, block in enumerate(blocks):
        block_hash = hashlib.sha256(parent + fp.encode() + index.to_bytes(8, "big")).digest()
        unit = RecyclableUnit(block_hash=block_hash, parent_hash=parent, model_fingerprint=fp, block_index=index,
                              num_tokens=BLOCK, codec=codec, shape=tuple(block.shape),
                              payload=codec_tensors.encode(block, codec))
        out.append((block_hash, unit.encode(key=key)))
        parent = block_hash
    return out


def decoded(found, dtype: torch.dtype) -> list[torch.Tensor]:
    if any(f is None for f in found):
        raise SystemExit("a unit was not read back: the benchmark is invalid")
    return [codec_tensors.decode(unit.payload, unit.codec, unit.shape, dtype) for unit, _ in found]


@torch.inference_mode()
def first_token_after(model, blocks: list[torch.Tensor], tail: list[int]) -> int:
    """The greedy first token with `blocks` as the prompt's cached prefix and `tail` computed."""
    cache = DynamicCache()
    kv = torch.cat(blocks, dim=3)  # [layers, 2, heads, tokens, head dim]
    for layer_idx in range(kv.shape[0]):
        cache.update(kv[layer_idx, 0][None], kv[layer_idx, 1][None], layer_idx)
    return int(model(input_ids=torch.tensor([tail]), past_key_values=cache, use_cache=True).logits[0, -1].argmax())


@torch.inference_mode()
def first_token_recomputed(model, ids: list[int]) -> int:
    return int(model(input_ids=torch.tensor([ids]), use_cache=True).logits[0, -1].argmax())


def start_s3() -> tuple[subprocess.Popen, str]:
    port = free_port()
    moto = Path(sys.executable).parent / "moto_server"
    cmd = [str(moto)] if moto.exists() else [sys.executable, "-m", "moto.server"]
    proc = subprocess.Popen(cmd + ["-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    wait_for_port(port, proc, 30, "moto_server")
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
    return proc, f"http://127.0.0.1:{port}"


async def measure_tiers(model, codecs: list[str], blocks: list[torch.Tensor], ttft_prompt: list[int],
                        ttft_blocks: list[torch.Tensor], rounds: int, dtype: torch.dtype) -> dict:
    redis_srv = start_redis()
    s3_proc, s3_url = start_s3()
    key = ru_key()
    warm = RedisTier(redis_srv.url + "/0", timeout_s=5.0)
    s3 = S3Tier(s3_url, "kite-codecs", f"bench-{uuid.uuid4().hex[:6]}/", threads=16)
    warm.ru_key = s3.ru_key = key
    fp16_bytes = sum(kv_codec.payload_bytes("fp16", tuple(b.shape)) for b in blocks)
    times = {codec: {"warm": [], "cold": [], "ttft": [], "same_first_token": 0} for codec in codecs}
    times["recompute"] = {"ttft": []}
    stored = {}
    try:
        await s3.ensure_bucket()
        for codec in codecs:
            fp = hashlib.sha256(f"codec-bench/{codec}/{uuid.uuid4()}".encode()).hexdigest()
            chain = units_of(blocks, codec, fp, key)
            ttft_fp = hashlib.sha256(fp.encode()).hexdigest()
            ttft_chain = units_of(ttft_blocks, codec, ttft_fp, key)
            for owner, units in ((fp, chain), (ttft_fp, ttft_chain)):
                for block_hash, data in units:
                    if not await warm.put(BlockKey.of(owner, block_hash), data):
                        raise SystemExit("Redis refused a unit")
            if not all(await asyncio.gather(*(s3.put(BlockKey.of(fp, h), d) for h, d in chain))):
                raise SystemExit("the S3 server refused a unit")
            stored[codec] = (fp, [h for h, _ in chain], ttft_fp, [h for h, _ in ttft_chain],
                             sum(len(d) for _, d in chain))
        tail = ttft_prompt[len(ttft_blocks) * BLOCK:]
        expected_first = first_token_recomputed(model, ttft_prompt)
        for round_index in range(rounds):
            order = codecs if round_index % 2 == 0 else codecs[::-1]  # drift falls on every codec alike
            for codec in order:
                fp, hashes, ttft_fp, ttft_hashes, _ = stored[codec]
                started = time.perf_counter()
                decoded(await warm.get_units(fp, hashes), dtype)
                times[codec]["warm"].append(time.perf_counter() - started)
                started = time.perf_counter()
                decoded(await s3.get_units(fp, hashes), dtype)
                times[codec]["cold"].append(time.perf_counter() - started)
                started = time.perf_counter()
                first = first_token_after(model, decoded(await warm.get_units(ttft_fp, ttft_hashes), dtype), tail)
                times[codec]["ttft"].append(time.perf_counter() - started)
                times[codec]["same_first_token"] += first == expected_first
            started = time.perf_counter()
            first_token_recomputed(model, ttft_prompt)
            times["recompute"]["ttft"].append(time.perf_counter() - started)
    finally:
        await warm.close()
        redis_srv.stop()
        s3_proc.terminate()
        s3_proc.wait(10)
    results = {}
    for codec in codecs:
        wire = stored[codec][4]
        warm_s, cold_s = statistics.median(times[codec]["warm"]), statistics.median(times[codec]["cold"])
        results[codec] = {"wire_bytes": wire, "warm_wire_mb_s": wire / warm_s / 1e6,
                          "warm_kv_mb_s": fp16_bytes / warm_s / 1e6, "cold_wire_mb_s": wire / cold_s / 1e6,
                          "cold_kv_mb_s": fp16_bytes / cold_s / 1e6,
                          "hit_ttft_ms": 1e3 * statistics.median(times[codec]["ttft"]),
                          "same_first_token": times[codec]["same_first_token"] == rounds}
    results["recompute"] = {"hit_ttft_ms": 1e3 * statistics.median(times["recompute"]["ttft"])}
    return results


def measure_transcoding(blocks: list[torch.Tensor], codecs: list[str], key: bytes) -> dict:
    """Per lossy codec: median ms per unit of the pool's transcoding from fp16, and of decoding the result."""
    fp = hashlib.sha256(b"codec-bench/transcode").hexdigest()
    exact = units_of(blocks, "fp16", fp, key)
    results = {}
    for codec in codecs:
        transcode_s, decode_s = [], []
        for _, data in exact:
            started = time.perf_counter()
            lossy = kv_codec.transcode(data, codec, key)
            transcode_s.append(time.perf_counter() - started)
            unit = recyclable_unit.decode(lossy, key=key)
            started = time.perf_counter()
            codec_tensors.decode(unit.payload, codec, unit.shape, torch.float32)
            decode_s.append(time.perf_counter() - started)
        results[codec] = {"transcode_ms": 1e3 * statistics.median(transcode_s),
                          "decode_ms": 1e3 * statistics.median(decode_s),
                          "unit_bytes": len(lossy), "fp16_unit_bytes": len(exact[0][1])}
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the tier measurements (medians)")
    parser.add_argument("--no-tiers", action="store_true", help="only the quality guard's figures")
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    cfg = load(ModelConfig)
    local = prepare(cfg)
    tokenizer, model = load_tokenizer(local), load_causal_lm(local, cfg)
    hf = model.config
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    block_shape = (hf.num_hidden_layers, 2, hf.num_key_value_heads, BLOCK, head_dim)
    codecs = ["fp16", "bf16", "int8", "fp8_e4m3"]
    started = time.perf_counter()
    chosen = prompts(tokenizer, args.prompts)
    all_blocks: list[torch.Tensor] = []
    for ids in chosen:
        with torch.inference_mode():
            all_blocks += full_blocks(model(input_ids=torch.tensor([ids[:-1]]), use_cache=True).past_key_values)
    # The worker's guard compares the same way (kite_worker.codec_guard), over its own prompts.
    qualities = {"as computed → fp16": codec_guard.compare(model, chosen, None, ["fp16"], args.tokens, BLOCK)["fp16"],
                 **codec_guard.compare(model, chosen, "fp16", codecs[1:], args.tokens, BLOCK)}
    lengths = [len(ids) for ids in chosen]
    print(f"{len(chosen)} prompts of {min(lengths)}-{max(lengths)} tokens, {args.tokens} greedy tokens each, "
          f"SmolLM2-135M-Instruct (transformers, {cfg.dtype}), {BLOCK}-token blocks; "
          f"{time.perf_counter() - started:.0f} s")
    print(f"{'codec':20} {'bytes/token':>11} {'vs fp16':>8} {'agreement':>10} {'identical':>10} "
          f"{'first-token KL mean / max':>26}")
    fp16_bytes = kv_codec.payload_bytes("fp16", block_shape) / BLOCK
    print(f"{'fp16 (lossless)':20} {fp16_bytes:11,.0f} {1.0:8.2f}x")
    results = {}
    for name, quality in qualities.items():
        per_token = kv_codec.payload_bytes(quality.codec, block_shape) / BLOCK
        results[name] = {"bytes_per_token": per_token, "agreement": quality.agreement,
                         "identical": quality.num_identical, "kl_mean": quality.kl_mean, "kl_max": quality.kl_max}
        print(f"{name:20} {per_token:11,.0f} {fp16_bytes / per_token:8.2f}x {100 * quality.agreement:9.1f}% "
              f"{quality.num_identical:>4} of {len(chosen):<3} {quality.kl_mean:12.2e} / {quality.kl_max:.2e}")
    transcoding = measure_transcoding(all_blocks, codecs[2:], ru_key())
    print(f"\nthe pool's transcoding of an fp16 unit ({transcoding['int8']['fp16_unit_bytes']:,} bytes) on its way to "
          f"a lossy tier, one thread; the worker's decode of the result (medians over {len(all_blocks)} blocks)")
    print(f"{'codec':10} {'unit bytes':>11} {'transcode ms':>13} {'decode ms':>10}")
    for codec, t in transcoding.items():
        print(f"{codec:10} {t['unit_bytes']:11,} {t['transcode_ms']:13.2f} {t['decode_ms']:10.2f}")
        results[codec] = {**results.get(codec, {}), "transcoding": t}
    if not args.no_tiers:
        longest = max(chosen, key=len)
        with torch.inference_mode():
            prefix_blocks = full_blocks(model(input_ids=torch.tensor([longest[:-1]]), use_cache=True).past_key_values)
        dtype = next(model.parameters()).dtype
        tiers = asyncio.run(measure_tiers(model, codecs, all_blocks, longest, prefix_blocks, args.rounds, dtype))
        print(f"\ntiers: {len(all_blocks)} blocks ({len(all_blocks) * BLOCK} tokens) per fetch, "
              f"verified and decoded to {str(dtype).removeprefix('torch.')}; hit TTFT: a {len(longest)}-token "
              f"prompt, {len(prefix_blocks)} blocks from warm; medians of {args.rounds} rounds")
        print(f"{'codec':10} {'MB fetched':>10} {'warm wire':>10} {'warm KV':>9} {'cold wire':>10} {'cold KV':>9} "
              f"{'hit TTFT':>9} {'1st token = recompute':>22}  (MB/s; ms)")
        for codec in codecs:
            t = tiers[codec]
            print(f"{codec:10} {t['wire_bytes'] / 1e6:10.1f} {t['warm_wire_mb_s']:10,.0f} {t['warm_kv_mb_s']:9,.0f} "
                  f"{t['cold_wire_mb_s']:10,.0f} {t['cold_kv_mb_s']:9,.0f} {t['hit_ttft_ms']:9.1f} "
                  f"{'yes' if t['same_first_token'] else 'no':>22}")
        print(f"{'recompute':10} {'':10} {'':10} {'':9} {'':10} {'':9} {tiers['recompute']['hit_ttft_ms']:9.1f}")
        for codec in codecs:
            results[codec] = {**results.get(codec, {}), "tiers": tiers[codec]}
        results["recompute"] = tiers["recompute"]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
