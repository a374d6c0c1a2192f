"""The fingerprinter's router against a real nats-server, with workers and the ru-pool played by
subscribers on their real subjects: what each worker receives, and when the pool is asked."""

from __future__ import annotations

import asyncio
import time
from typing import Callable

import nats

from kite_fingerprinter.router import Router
from kite_shared import subjects
from kite_shared.config import FingerprinterConfig, load
from kite_shared.messages import Admission, PoolLookupReply, SamplingParams, TokenizedRequest
from kite_shared.messages import WorkerTelemetry


def tokenized(request_id: str) -> TokenizedRequest:
    return TokenizedRequest(
        request_id=request_id, model="m", prompt_token_ids=list(range(40)), reuse=True,
        sampling=SamplingParams(max_tokens=4), model_fingerprint="ab" * 32, block_size=16,
        block_hashes=[bytes([i]) * 32 for i in range(2)], stream_subject="s", created_at=time.time())


async def play_fleet(nc, worker_ids: list[str], pool_reply: Callable[[], PoolLookupReply]
                     ) -> tuple[dict[str, list[TokenizedRequest]], list[bytes]]:
    """Workers that admit what they get and the ru-pool's lookup (answering `pool_reply()`), played by
    subscribers on their real subjects: what each worker received, and each lookup asked."""
    received: dict[str, list[TokenizedRequest]] = {w: [] for w in worker_ids}
    lookups: list[bytes] = []

    async def pool_lookup(msg):
        lookups.append(msg.data)
        await msg.respond(pool_reply().encode())

    def worker(worker_id: str):
        async def on_generate(msg):
            received[worker_id].append(TokenizedRequest.decode(msg.data))
            await msg.respond(Admission(accepted=True, worker_id=worker_id).encode())
        return on_generate

    await nc.subscribe(subjects.POOL_LOOKUP, cb=pool_lookup)
    for worker_id in worker_ids:
        await nc.subscribe(subjects.worker_generate(worker_id), cb=worker(worker_id))
    return received, lookups


async def test_the_pools_holding_seen_while_routing_travels_to_the_worker(nats_server):
    nc = await nats.connect(nats_server.url)
    received, lookups = await play_fleet(nc, ["w1", "w2"], lambda: PoolLookupReply(pool=2, workers={"w1": 1}))
    router = Router(nc, load(FingerprinterConfig, router_mode="cache_aware"), worker_timeout_s=2.0)
    try:
        for worker_id in received:
            router.live.telemetry(WorkerTelemetry(instance_id=worker_id, max_running=8), time.monotonic())
        admission = await router.dispatch(tokenized("a"))
        assert admission.accepted and len(lookups) == 1
        # the router's lookup answer rides along, so the worker need not ask the pool again
        assert [r.pool_blocks for r in received["w1"] + received["w2"]] == [2]

        router.live.forget("w2")  # one candidate: nothing to choose, the pool is not asked
        await router.dispatch(tokenized("b"))
        assert len(lookups) == 1
        assert [r.pool_blocks for r in received["w1"] if r.request_id == "b"] == [-1]
    finally:
        await nc.close()


async def test_requests_sharing_a_prefix_nobody_holds_yet_go_where_it_is_being_computed(nats_server):
    """Four requests with the same two new blocks, dispatched at once (their pool lookups and admissions
    overlap) before any telemetry or index update: the first worker is computing them, so the others
    follow it (KITE_ROUTER_INFLIGHT_S); with the setting at 0 the second goes to the idle worker, which
    computes them again."""
    nc = await nats.connect(nats_server.url)
    received: list[tuple[str, str]] = []

    async def pool_lookup(msg):
        await msg.respond(PoolLookupReply(pool=0, workers={}).encode())

    def worker(worker_id: str):
        async def on_generate(msg):
            received.append((worker_id, TokenizedRequest.decode(msg.data).request_id))
            await msg.respond(Admission(accepted=True, worker_id=worker_id).encode())
        return on_generate

    await nc.subscribe(subjects.POOL_LOOKUP, cb=pool_lookup)
    for worker_id in ("w1", "w2"):
        await nc.subscribe(subjects.worker_generate(worker_id), cb=worker(worker_id))
    try:
        for inflight_s, expected in ((10.0, ["w1"] * 4), (0.0, ["w1", "w2", "w1", "w2"])):
            received.clear()
            router = Router(nc, load(FingerprinterConfig, router_mode="cache_aware", router_inflight_s=inflight_s),
                            worker_timeout_s=2.0)
            for worker_id in ("w1", "w2"):
                router.live.telemetry(WorkerTelemetry(instance_id=worker_id, max_running=8), time.monotonic())
            admissions = await asyncio.gather(*(router.dispatch(tokenized(f"r{r}")) for r in range(4)))
            assert all(a.accepted for a in admissions)
            assert sorted(w for w, _ in received) == sorted(expected), inflight_s
    finally:
        await nc.close()


async def test_without_a_pool_answer_blocks_in_flight_still_count(nats_server):
    """No ru-pool answers the lookup: the first request goes to the least-loaded worker, and the next one
    sharing its blocks follows it (the router's own record), not least-loaded."""
    nc = await nats.connect(nats_server.url)
    received: list[str] = []

    def worker(worker_id: str):
        async def on_generate(msg):
            received.append(worker_id)
            await msg.respond(Admission(accepted=True, worker_id=worker_id).encode())
        return on_generate

    for worker_id in ("w1", "w2"):
        await nc.subscribe(subjects.worker_generate(worker_id), cb=worker(worker_id))
    router = Router(nc, load(FingerprinterConfig, router_mode="cache_aware", router_lookup_timeout_s=0.01),
                    worker_timeout_s=2.0)
    try:
        for worker_id in ("w1", "w2"):
            router.live.telemetry(WorkerTelemetry(instance_id=worker_id, max_running=8), time.monotonic())
        for r in range(2):
            assert (await router.dispatch(tokenized(f"r{r}"))).accepted
        assert received == ["w1", "w1"]
    finally:
        await nc.close()


async def test_a_sessions_turn_stays_with_its_worker_until_waiting_there_costs_more_than_moving(nats_server):
    """A session's turn goes to the worker that served its previous turn without asking the pool while
    nothing is queued there; with work ahead it is costed: it stays behind a short queue (its history is
    held there, the pool's index not told yet) and moves when the history loads from the pool elsewhere
    sooner than that worker's queue drains."""
    nc = await nats.connect(nats_server.url)
    pool_holds = {"blocks": 0}
    received, lookups = await play_fleet(nc, ["w1", "w2"], lambda: PoolLookupReply(pool=pool_holds["blocks"]))
    router = Router(nc, load(FingerprinterConfig, router_mode="cache_aware"), worker_timeout_s=2.0)

    def ids(worker_id: str) -> list[str]:
        return [r.request_id for r in received[worker_id]]

    def report(worker_id: str, backlog: int, admitted: list[str]) -> None:
        router.live.telemetry(WorkerTelemetry(instance_id=worker_id, max_running=8, prefill_tokens_per_s=425.0,
                                              prefill_backlog_tokens=backlog, admitted_request_ids=admitted),
                              time.monotonic())

    try:
        report("w1", 0, [])
        report("w2", 0, [])
        assert (await router.dispatch(tokenized("turn-1"), session_id="s")).accepted
        bound = "w1" if ids("w1") else "w2"
        other = "w2" if bound == "w1" else "w1"
        assert len(lookups) == 1
        report(bound, 0, ["turn-1"])

        await router.dispatch(tokenized("turn-2"), session_id="s")  # nothing queued there: no lookup
        assert ids(bound) == ["turn-1", "turn-2"] and len(lookups) == 1

        report(bound, 8, ["turn-2"])  # 8 tokens ahead, the pool holds nothing: stays
        await router.dispatch(tokenized("turn-3"), session_id="s")
        assert ids(bound) == ["turn-1", "turn-2", "turn-3"] and len(lookups) == 2

        report(bound, 4000, ["turn-3"])  # ~9 s ahead; the pool holds the 2 blocks: moves
        pool_holds["blocks"] = 2
        await router.dispatch(tokenized("turn-4"), session_id="s")
        assert ids(other) == ["turn-4"] and len(lookups) == 3

        report(other, 0, ["turn-4"])  # bound there now
        await router.dispatch(tokenized("turn-5"), session_id="s")
        assert ids(other) == ["turn-4", "turn-5"] and len(lookups) == 3
    finally:
        await nc.close()
