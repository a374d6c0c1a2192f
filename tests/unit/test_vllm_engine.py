"""The vLLM front end's pure parts: the prefix mirror admission counts on, stale staging cleanup."""

from __future__ import annotations

import os
import subprocess
import sys

from kite_shared.fingerprint import BlockHash
from kite_worker.vllm_engine import PrefixMirror, remove_stale_staging


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


# --- the output mapping, against a stand-in for vLLM's AsyncLLM ------------------------------------------

import asyncio  # noqa: E402
from types import SimpleNamespace  # noqa: E402

import pytest  # noqa: E402

from kite_shared.fingerprint import block_hash_chain  # noqa: E402
from kite_shared.messages import SamplingParams, StreamEnd, StreamError, TokenChunk, TokenizedRequest  # noqa: E402
from kite_worker.engine import RequestRejected  # noqa: E402
from kite_worker.kv_plan import PARAMS_KEY  # noqa: E402
from kite_worker.vllm_engine import KVCacheStats, VllmOptions, VllmScheduler  # noqa: E402

ROOT = h(7)
EOS = 2


class ScriptedLLM:
    """Yields scripted delta outputs the way AsyncLLM.generate does; records what it was asked."""

    def __init__(self, deltas: list[tuple[list[int], str, str | None]], cached: int = 0, fail: bool = False):
        self.deltas, self.cached, self.fail = deltas, cached, fail
        self.calls: list[tuple] = []
        self.errored = False

    async def generate(self, prompt, params, request_id):
        self.calls.append((prompt, params, request_id))
        for i, (ids, text, finish) in enumerate(self.deltas):
            await asyncio.sleep(0)
            if self.fail and i == 1:
                raise RuntimeError("engine died")
            yield SimpleNamespace(num_cached_tokens=self.cached, finished=finish is not None, outputs=[
                SimpleNamespace(token_ids=ids, text=text, finish_reason=finish, stop_reason=None)])


class Endless(ScriptedLLM):
    """Generates until cancelled."""

    async def generate(self, prompt, params, request_id):
        while True:
            await asyncio.sleep(0.01)
            yield SimpleNamespace(num_cached_tokens=0, finished=False, outputs=[
                SimpleNamespace(token_ids=[5], text="a", finish_reason=None, stop_reason=None)])


def make_scheduler(llm, reuse: bool = True, max_queued: int = 4, pool_blocks=None):
    options = VllmOptions(reuse=reuse, pool_read=True, pool_write=True, cache_generated=True, kv_cache_gib=1.0,
                          enforce_eager=True, max_num_seqs=2, staging_dir=None)
    engine = SimpleNamespace(
        identity=SimpleNamespace(fingerprint_hex=ROOT.hex(), root=ROOT), block_size=4, max_context_tokens=64,
        options=options, llm=llm, local=SimpleNamespace(hf_config={"eos_token_id": EOS}),
        block_cache=KVCacheStats(capacity_bytes=1 << 20, bytes_per_token=1024),
        num_prompt_tokens_reused=0, num_prompt_tokens_computed=0,
        prefill_seconds_per_token=0.003, decode_seconds_per_token=0.0)
    events = []
    return VllmScheduler(engine, max_queued, emit=lambda subject, m: events.append(m), pool_blocks=pool_blocks), events


def request(request_id: str = "r", prompt=tuple(range(10, 19)), reuse: bool = True, **sampling) -> TokenizedRequest:
    ids = list(prompt)
    return TokenizedRequest(
        request_id=request_id, model="m", prompt_token_ids=ids, reuse=reuse,
        sampling=SamplingParams(max_tokens=8, temperature=0, **sampling), model_fingerprint=ROOT.hex(),
        block_size=4, block_hashes=[bytes(x) for x in block_hash_chain(ids, 4, ROOT)], stream_subject="s",
        created_at=0, tenant="acme")


async def serve(scheduler, req) -> None:
    scheduler.enqueue(scheduler.reserve(req))
    while not scheduler.idle():
        await asyncio.sleep(0)


async def test_deltas_stream_as_chunks_and_the_finishing_delta_closes_the_stream_without_eos():
    llm = ScriptedLLM([([5], "Hi", None), ([6], " there", None), ([7, EOS], ".", "stop")], cached=4)
    scheduler, events = make_scheduler(llm)
    await serve(scheduler, request())
    assert [type(e) for e in events] == [TokenChunk, TokenChunk, StreamEnd]
    assert [e.seq for e in events] == [0, 1, 2]
    end = events[-1]
    assert (end.text, end.token_ids, end.finish_reason) == (".", [7], "stop")
    assert end.usage.completion_tokens == 3 and end.usage.cached_tokens == 4 and end.usage.prompt_tokens == 9
    prompt, params, _ = llm.calls[0]
    assert prompt["prompt_token_ids"] == list(range(10, 19))
    assert params.temperature == 0 and params.max_tokens == 8 and not params.skip_reading_prefix_cache
    kite = params.extra_args["kv_transfer_params"][PARAMS_KEY]
    assert kite["tenant"] == "acme" and kite["load"] and kite["save"]


async def test_reuse_off_skips_vllms_prefix_cache_and_the_connector():
    llm = ScriptedLLM([([5], "x", "length")])
    scheduler, events = make_scheduler(llm)
    await serve(scheduler, request(reuse=False))
    params = llm.calls[0][1]
    assert params.skip_reading_prefix_cache and params.extra_args is None
    assert events[-1].finish_reason == "length"


async def test_an_engine_error_is_a_stream_error_and_frees_the_slot():
    scheduler, events = make_scheduler(ScriptedLLM([([5], "a", None), ([6], "b", None)], fail=True))
    await serve(scheduler, request())
    assert isinstance(events[-1], StreamError) and events[-1].error.code == "internal_error"
    assert scheduler.idle()


async def test_cancel_ends_the_stream_as_cancelled():
    scheduler, events = make_scheduler(Endless([]))
    seq = scheduler.reserve(request())
    scheduler.enqueue(seq)
    await asyncio.sleep(0.05)
    scheduler.cancel("r")
    while not scheduler.idle():
        await asyncio.sleep(0.01)
    assert isinstance(events[-1], StreamEnd) and events[-1].finish_reason == "cancelled"


async def test_admission_refuses_bad_requests_and_a_full_queue():
    scheduler, _ = make_scheduler(ScriptedLLM([]), max_queued=1)
    bad = request().model_copy(update={"block_hashes": [b"\0" * 32, b"\0" * 32]})
    with pytest.raises(RequestRejected, match="block hashes"):
        scheduler.reserve(bad)
    for i in range(3):  # 2 running + 1 queued
        scheduler.reserve(request(f"r{i}"))
    with pytest.raises(RequestRejected) as refused:
        scheduler.reserve(request("r3"))
    assert refused.value.code == "overloaded"


async def test_backlog_counts_only_what_vllm_is_expected_to_compute():
    scheduler, _ = make_scheduler(ScriptedLLM([]))
    scheduler.reserve(request("a"))  # 9 tokens, nothing seen before: all computed
    scheduler.reserve(request("b"))  # same prompt: its 2 full blocks are expected to be hits
    assert scheduler.load_snapshot() == (0, 9 + 1)


async def test_the_pools_holding_is_asked_on_the_front_end_and_handed_to_the_connector():
    asked = []

    async def pool_blocks(req: TokenizedRequest) -> int:
        asked.append(req.request_id)
        return 1

    llm = ScriptedLLM([([5], "x", "length")])
    scheduler, _ = make_scheduler(llm, pool_blocks=pool_blocks)
    await serve(scheduler, request("a"))
    assert asked == ["a"]
    assert llm.calls[0][1].extra_args["kv_transfer_params"][PARAMS_KEY]["pool_blocks"] == 1
    # The same prompt again: vLLM is expected to hold both reusable blocks, so the pool is not asked and
    # the connector is told it was not (-1: it asks only if vLLM's cache lost them after all).
    await serve(scheduler, request("b"))
    assert asked == ["a"]
    assert llm.calls[1][1].extra_args["kv_transfer_params"][PARAMS_KEY]["pool_blocks"] == -1
    await serve(scheduler, request("c", reuse=False))  # no reuse: neither asked nor passed
    assert asked == ["a"] and llm.calls[2][1].extra_args is None


async def test_cancel_all_ends_every_stream_as_cancelled():
    scheduler, events = make_scheduler(Endless([]))
    for request_id in ("a", "b"):
        scheduler.enqueue(scheduler.reserve(request(request_id)))
    scheduler.reserve(request("never-started"))
    await asyncio.sleep(0.05)
    scheduler.cancel_all()
    while not scheduler.idle():
        await asyncio.sleep(0.01)
    ends = {e.request_id: e.finish_reason for e in events if isinstance(e, StreamEnd)}
    assert ends == {"a": "cancelled", "b": "cancelled"}
