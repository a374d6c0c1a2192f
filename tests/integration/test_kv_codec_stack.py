"""A lossy KV codec (KITE_KV_CODEC) with real processes, the real model and a real redis-server:

- at the default floor (99% greedy agreement) a worker measures int8 and refuses to start, saying the
  measured share; float16 storage of the float32 model is measured the same way;
- with the floor lowered, a stack stores int8 units under a fingerprint of their own (the codec is in
  the execution path: never the lossless namespace), and a worker that never computed a prompt loads its
  prefix from the pool through the codec;
- a codec per tier (KITE_KV_CODEC_COLD=int8 below lossless hot and warm): warm holds the units as
  computed, the ru-pool transcodes them into int8 when it archives them to cold, and a fresh worker loads
  its prefix from cold through the codec.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import redis

from kite_shared import model_store, recyclable_unit
from kite_shared.config import ModelConfig, load
from kite_shared.security import ru_key
from tests.helpers import wait_until
from tests.integration.test_pool_reuse import cached, chat, replace_worker, wait_for_warm_blocks


def refused_worker(settings: dict[str, str], measured: str) -> tuple[float, str]:
    """A transformers worker started with `settings` that its storage guard refuses (the guard runs before
    the engine starts: NATS is never reached): (the share it measured, in %, its stderr). `measured`: the
    guard's words for the choice, as a regular expression."""
    env = {**os.environ, "KITE_ENGINE": "transformers", "KITE_NATS_URL": "nats://127.0.0.1:1", **settings}
    if "KITE_KV_CODEC_MIN_AGREEMENT" not in settings:
        env.pop("KITE_KV_CODEC_MIN_AGREEMENT", None)
    worker = subprocess.run([sys.executable, "-m", "kite_worker"], env=env, capture_output=True, text=True,
                            timeout=300)
    assert worker.returncode != 0
    share = re.search(measured + r": (\d+\.\d)% of greedy tokens equal to the KV as computed in float32",
                      worker.stderr)
    assert share, worker.stderr[-2000:]
    return float(share.group(1)), worker.stderr


def test_a_codec_below_the_agreement_floor_is_refused_at_start():
    share, stderr = refused_worker({"KITE_KV_CODEC": "int8"}, r"KV codec int8 \(hot, warm and cold tiers\)")
    assert share < 99.0 and "below KITE_KV_CODEC_MIN_AGREEMENT=0.99" in stderr


def test_float16_storage_of_a_float32_model_is_a_lossy_choice_the_guard_measures():
    """Exact by default (issue 36): float16 storage is opt-in and measured like a codec. A floor above 100%
    shows the guard runs and refuses with the figure; the default floor's verdict is the figure's."""
    _, stderr = refused_worker({"KITE_KV_STORAGE_DTYPE": "float16", "KITE_KV_CODEC_MIN_AGREEMENT": "1.01"},
                               r"KV storage in float16 \(KITE_KV_STORAGE_DTYPE, every tier\)")
    assert "below KITE_KV_CODEC_MIN_AGREEMENT=1.01" in stderr
    assert "unset KITE_KV_STORAGE_DTYPE to store the compute dtype, exactly" in stderr


def test_lossy_units_live_in_their_own_namespace_and_load_through_the_codec(fresh_stack_factory):
    stack = fresh_stack_factory(num_workers=1, env={"KITE_KV_CODEC": "int8", "KITE_KV_CODEC_MIN_AGREEMENT": "0.5"})
    assert stack.redis is not None, "this test needs redis-server installed"
    # the guard measured it and let it pass
    assert "KV codec int8 (hot, warm and cold tiers):" in stack.tail(stack.workers()[0], 200_000)
    first = chat(stack, "Which block does the pool keep first?")
    assert cached(first) == 0
    wait_for_warm_blocks(stack, minimum=first["usage"]["prompt_tokens"] // 16)

    cfg = load(ModelConfig, {"KITE_ENGINE": "transformers", "KITE_KV_CODEC": "int8"})
    local = model_store.prepare(cfg)
    lossy = model_store.identity(local, cfg).fingerprint_hex
    lossless = model_store.identity(local, load(ModelConfig, {"KITE_ENGINE": "transformers"})).fingerprint_hex
    warm = redis.Redis.from_url(stack.redis.url)
    units = [recyclable_unit.decode(warm.get(name), key=ru_key()) for name in warm.scan_iter("kite:ru:*")]
    assert units and {u.codec for u in units} == {"int8"}
    assert {u.model_fingerprint for u in units} == {lossy} and lossy != lossless

    replace_worker(stack)  # a worker that never computed the prompt: its prefix comes from the pool
    second = chat(stack, "Which block does the pool keep last?")
    assert cached(second) >= 16 * 10
    assert second["choices"][0]["message"]["content"]  # a lossy prefix still answers (not necessarily alike)


def test_a_lossy_cold_tier_holds_int8_units_that_a_fresh_worker_loads(fresh_stack_factory):
    settings = {"KITE_KV_CODEC_COLD": "int8", "KITE_KV_CODEC_MIN_AGREEMENT": "0.5",
                # nothing stays in the pool's memory, and warm blocks are archived to cold after a second
                "KITE_POOL_HOT_BYTES": "0", "KITE_POOL_ARCHIVE_AFTER_S": "1", "KITE_POOL_SWEEP_INTERVAL_S": "0.5"}
    stack = fresh_stack_factory(num_workers=1, env=settings)
    assert stack.redis is not None, "this test needs redis-server installed"
    assert "KV codec int8 (cold tier):" in stack.tail(stack.workers()[0], 200_000)
    first = chat(stack, "Which block does the pool keep first?")
    num_blocks = first["usage"]["prompt_tokens"] // 16
    warm = redis.Redis.from_url(stack.redis.url)
    # (That warm holds the units as computed until then is tests/integration/test_ru_pool_tier_codecs.py's:
    # here archival is too quick to look.)
    cold_dir = Path(stack.options.env["KITE_COLD_DIR"])
    wait_until(lambda: len(list(cold_dir.rglob("*.kru"))) >= num_blocks and not any(warm.scan_iter("kite:ru:*")),
               60, f"the pool to archive the {num_blocks} blocks to cold (none left in warm)", interval_s=0.5)
    in_cold = [recyclable_unit.decode(path.read_bytes(), key=ru_key()) for path in cold_dir.rglob("*.kru")]
    assert {(u.codec, u.cold_codec) for u in in_cold} == {("int8", "int8")}  # transcoded by the pool
    cfg = load(ModelConfig, {"KITE_ENGINE": "transformers", **settings})
    namespace = model_store.identity(model_store.prepare(cfg), cfg).fingerprint_hex
    all_int8 = load(ModelConfig, {"KITE_ENGINE": "transformers", "KITE_KV_CODEC": "int8"})
    assert {u.model_fingerprint for u in in_cold} == {namespace}
    assert namespace != model_store.identity(model_store.prepare(all_int8), all_int8).fingerprint_hex

    replace_worker(stack)  # a worker that never computed the prompt: its prefix comes from cold
    second = chat(stack, "Which block does the pool keep last?")
    assert cached(second) >= 16 * 10
    assert second["choices"][0]["message"]["content"]
