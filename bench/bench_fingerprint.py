"""Cost of the computation fingerprint (block hash chain) for a 2,048-token prompt, tokenization excluded.

    .venv/bin/python bench/bench_fingerprint.py
"""

from __future__ import annotations

import random
import statistics
import time

from kite_shared.fingerprint import ExecutionPathFingerprint, KVLayout, ModelFingerprint, block_hash_chain, root_hash


def main(num_tokens: int = 2048, repeats: int = 2000) -> None:
    layout = KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, rope_theta=1e5, rope_scaling="", norm_eps=1e-5,
                      block_size=16)
    root = root_hash(ModelFingerprint("ab" * 32, "", "float32", "", layout),
                     ExecutionPathFingerprint("sdpa", "float16", "transformers", "cpu-avx512"))
    tokens = [random.randrange(49152) for _ in range(num_tokens)]
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        block_hash_chain(tokens, 16, root, cache_salt="tenant")
        samples.append(time.perf_counter() - started)
    samples.sort()
    print(f"CF for {num_tokens} tokens ({num_tokens // 16} blocks), {repeats} runs: "
          f"p50 {statistics.median(samples) * 1e3:.3f} ms, p99 {samples[int(0.99 * repeats)] * 1e3:.3f} ms, "
          f"max {samples[-1] * 1e3:.3f} ms (target < 1 ms)")


if __name__ == "__main__":
    main()
