"""The routing cores made flat in fleet size (issue 38) decide exactly as the code before them
(tests/routing_oracles.py), on seeded random fleets: `routing.choose` over a `Candidates` kept by puts and
removes, `LiveWorkers`' incremental candidates, and `WorkerCaches.prefix_lengths` over its inverted index.
Small value ranges make ties common (equal loads, equal rounded costs, equal request counts)."""

from __future__ import annotations

import random

import pytest

from kite_fingerprinter.router import LiveWorkers
from kite_ru_pool.worker_caches import WorkerCaches
from kite_shared.messages import Heartbeat, WorkerTelemetry
from kite_shared.routing import Candidates, RouteRequest, RoutingKnobs, WorkerState, choose
from tests import routing_oracles as oracle

BS = 16
MODES = ("cache_aware",) * 6 + ("least_loaded", "round_robin")
KNOBS = [RoutingKnobs(), RoutingKnobs(load_weight=0.5), RoutingKnobs(load_weight=1e-7),
         RoutingKnobs(load_weight=0.0), RoutingKnobs(affinity_weight=0.0), RoutingKnobs(affinity_weight=3.0,
                                                                                        load_weight=2.0),
         RoutingKnobs(balance_abs=2)]


def random_state(rng: random.Random, worker_id: str) -> WorkerState:
    return WorkerState(worker_id, num_running=rng.choice((0, 0, 1, 2)), queue_depth=rng.choice((0, 0, 1, 3, 40)),
                       running_tokens=rng.choice((0, 0, 16, 32, 320, 1000)),
                       backlog_tokens=rng.choice((0, 0, 16, 48)), pending_tokens=rng.choice((0, 0, 8)),
                       pending_requests=rng.choice((0, 0, 1)), reads_pool=rng.random() < 0.8,
                       prefill_s_per_token=rng.choice((1 / 425, 1 / 425, 1 / 400, 1e-4)),
                       requests_accepted=rng.choice((0, 0, 3, 7)))


def random_request(rng: random.Random, ids: list[str]) -> RouteRequest:
    local = None
    if rng.random() < 0.9:
        holders = rng.sample(ids, min(len(ids), rng.choice((0, 1, 2, 5)))) if ids else []
        local = {w: rng.choice((0, 1, 2, 10, 20)) for w in holders}
        if rng.random() < 0.1:
            local["not-a-candidate"] = 5
    session = rng.choice(("", "", "", rng.choice(ids) if ids else "", "gone"))
    return RouteRequest(prompt_tokens=rng.choice((16, 160, 320, 333)), block_size=BS, session_worker=session,
                        session_blocks=rng.choice((0, 4, 19)) if session else 0,
                        local_blocks=local, pool_blocks=rng.choice((0, 0, 5, 20)))


def assert_same(candidates: Candidates, states: list[WorkerState], req: RouteRequest, knobs: RoutingKnobs,
                mode: str, rr: int) -> str | None:
    want = oracle.choose(states, req, knobs, mode, rr)
    got = choose(candidates, req, knobs, mode, rr)
    if want is None:
        assert got is None
        return None
    assert (got.worker_id, got.reason) == (want.worker_id, want.reason), (req, knobs, mode)
    return got.reason


@pytest.mark.parametrize("seed", range(4))
def test_choose_over_candidates_decides_as_costing_every_worker(seed):
    rng = random.Random(seed)
    reasons = set()
    for _ in range(50):  # fleets
        num = rng.choice((0, 1, 2, 3, 8, 30, 100))
        ids = [f"w{i:03d}" for i in range(num)]
        states = {w: random_state(rng, w) for w in ids if rng.random() < 0.9}
        candidates = Candidates(list(states.values()))
        for step in range(60):  # decisions, with workers changing, leaving and joining between them
            for _ in range(rng.choice((0, 1, 3, 30))):
                if not ids:
                    break
                w = rng.choice(ids)
                if rng.random() < 0.15:
                    states.pop(w, None)
                    candidates.remove(w)
                else:
                    states[w] = random_state(rng, w)
                    candidates.put(states[w])
            assert sorted(states) == [s.worker_id for s in candidates]
            req = random_request(rng, ids)
            reasons.add(assert_same(candidates, list(states.values()), req, rng.choice(KNOBS), rng.choice(MODES),
                                    step))
    assert {None, "cache_aware", "balance", "session", "least_loaded", "round_robin"} <= reasons


def test_a_plain_sequence_decides_as_candidates():
    rng = random.Random(7)
    for _ in range(300):
        ids = [f"w{i}" for i in range(rng.choice((1, 5, 20)))]
        states = [random_state(rng, w) for w in ids]
        req = random_request(rng, ids)
        a, b = choose(states, req), choose(Candidates(states), req)
        assert (a.worker_id, a.reason) == (b.worker_id, b.reason)


def test_ties_between_idle_non_holders_go_to_the_name():
    states = [WorkerState(f"w{i}") for i in (5, 3, 9)]
    choice = choose(Candidates(states), RouteRequest(320, BS, local_blocks={}))
    assert (choice.worker_id, choice.reason) == ("w3", "cache_aware")
    assert set(choice.costs) == {"w3"}  # the others at its load come after it in name order


def test_only_holders_and_the_least_loaded_non_holders_are_costed():
    states = [WorkerState(f"w{i:02d}", num_running=1, running_tokens=100 + 16 * i) for i in range(50)]
    choice = choose(Candidates(states), RouteRequest(320, BS, local_blocks={"w30": 3, "w40": 0}))
    assert set(choice.costs) == {"w30", "w00"}
    assert choice.worker_id == oracle.choose(states, RouteRequest(320, BS, local_blocks={"w30": 3})).worker_id


def telemetry(rng: random.Random, worker_id: str, sent_at: float, admitted: list[str] = ()) -> WorkerTelemetry:
    return WorkerTelemetry(instance_id=worker_id, sent_at=sent_at, num_running=rng.choice((0, 1, 2)),
                           admitted_request_ids=list(admitted),
                           queue_depth=rng.choice((0, 0, 1, 40)), running_tokens=rng.choice((0, 32, 500)),
                           prefill_backlog_tokens=rng.choice((0, 16)), draining=rng.random() < 0.05,
                           standby=rng.random() < 0.05, healthy=rng.random() > 0.05,
                           pool_read=rng.random() < 0.8, prefill_tokens_per_s=rng.choice((0.0, 425.0, 9000.0)),
                           requests_accepted=rng.choice((0, 5, 9)))


@pytest.mark.parametrize("seed", range(4))
def test_live_workers_keep_the_candidates_the_rebuild_finds(seed):
    rng = random.Random(100 + seed)
    live = LiveWorkers(timeout_s=5.0)
    ids = [f"worker-{i}" for i in range(rng.choice((3, 12, 40)))]
    now = 0.0
    for step in range(1500):
        now += rng.choice((0.0, 0.01, 0.3, 1.0, 2.5))
        if rng.random() < 0.02:
            now -= 7.0  # a clock that goes back: the set is rebuilt
        w = rng.choice(ids)
        event = rng.random()
        if event < 0.35:
            live.telemetry(telemetry(rng, w, 1000.0 + now, [f"r{k}" for k in range(max(0, step - 4), step)]), now)
        elif event < 0.55:
            live.heartbeat(Heartbeat(service="worker", instance_id=w, started_at=0, sent_at=1000.0 + now,
                                     draining=rng.random() < 0.05, num_running=rng.choice((0, 1)),
                                     num_queued=rng.choice((0, 2))), now)
        elif event < 0.8:
            live.sent(w, f"r{step}", rng.choice((16, 300)), 1000.0 + now - rng.choice((0.0, 0.5)))
        elif event < 0.83:
            live.forget(w)
        asked = now + rng.choice((0.0, 0.0, 1.0, 4.99, 5.0, 5.01, 9.0))
        want = oracle.candidates(live, asked)
        got = live.view(asked)
        assert sorted(want, key=lambda s: s.worker_id) == list(got)
        assert live.candidates(asked) == list(got)
        assert_same(got, want, random_request(rng, ids), rng.choice(KNOBS), rng.choice(MODES), step)


@pytest.mark.parametrize("seed", range(4))
def test_prefix_lengths_from_the_inverted_index_equal_probing_every_worker(seed):
    rng = random.Random(200 + seed)
    caches = WorkerCaches()
    tags = ["t1", "t2"]
    pool = [bytes([i]) * 32 for i in range(24)]
    chains = [pool[:12], pool[4:20], pool[::2], pool[20:] + pool[:6], []]
    workers = [f"w{i}" for i in range(rng.choice((2, 6, 30)))]
    seq = {w: 0 for w in workers}
    for step in range(1500):
        w, tag = rng.choice(workers), rng.choice(tags)
        seq[w] += 1
        event = rng.random()
        if event < 0.5:
            start = rng.randrange(len(pool))
            caches.stored(w, tag, pool[start:start + rng.choice((1, 3, 12))], seq[w], float(step))
        elif event < 0.8:
            caches.removed(w, tag, rng.sample(pool, rng.choice((1, 2, 5))), False, seq[w], float(step))
        elif event < 0.85:
            caches.removed(w, "", [], True, seq[w], float(step))
        elif event < 0.88:
            caches.forget(w)
        elif event < 0.9:
            caches.forget_tags([tag])
        elif event < 0.93:
            caches.restore(w, {tag: rng.sample(pool, rng.choice((0, 4, 12)))}, seq[w], float(step))
        for chain_tag in tags:
            chain = rng.choice(chains)
            want = {k: v for k, v in oracle.prefix_lengths(caches.held, chain_tag, chain).items() if v}
            assert caches.prefix_lengths(chain_tag, chain) == want
    # the snapshot a replica takes rebuilds the same index
    copy = WorkerCaches()
    page, _ = caches.export("", 1 << 30)
    for worker_id, last, seen, models, _ in page:
        copy.restore(worker_id, models, last, seen)
    for tag in tags:
        for chain in chains:
            assert copy.prefix_lengths(tag, chain) == caches.prefix_lengths(tag, chain)
