"""The fingerprinter's router against a real nats-server, with workers and the ru-pool played by
subscribers on their real subjects: what each worker receives, and when the pool is asked."""

from __future__ import annotations

import time

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


async def test_the_pools_holding_seen_while_routing_travels_to_the_worker(nats_server):
    nc = await nats.connect(nats_server.url)
    received: dict[str, list[TokenizedRequest]] = {"w1": [], "w2": []}
    lookups = []

    async def pool_lookup(msg):
        lookups.append(msg.data)
        await msg.respond(PoolLookupReply(pool=2, workers={"w1": 1}).encode())

    def worker(worker_id: str):
        async def on_generate(msg):
            received[worker_id].append(TokenizedRequest.decode(msg.data))
            await msg.respond(Admission(accepted=True, worker_id=worker_id).encode())
        return on_generate

    await nc.subscribe(subjects.POOL_LOOKUP, cb=pool_lookup)
    for worker_id in received:
        await nc.subscribe(subjects.worker_generate(worker_id), cb=worker(worker_id))
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
