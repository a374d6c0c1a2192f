"""The cache-aware routing policy (kite_shared.routing), table-driven."""

from __future__ import annotations

import pytest

from kite_shared.routing import (InFlight, RouteRequest, RoutingKnobs, WorkerState, choose, cost, imbalanced,
                                 known_held, session_sticks)

W = WorkerState
BS = 16

CASES = [
    # (name, workers, request, knobs, mode, expected worker, expected reason)
    ("no workers", [], RouteRequest(320, BS), RoutingKnobs(), "cache_aware", None, None),
    ("no pool answer -> least loaded",
     [W("a", num_running=2), W("b", num_running=1)], RouteRequest(320, BS), RoutingKnobs(), "cache_aware",
     "b", "least_loaded"),
    ("least loaded ties broken by tokens",
     [W("a", num_running=1, running_tokens=900), W("b", num_running=1, running_tokens=100)],
     RouteRequest(320, BS), RoutingKnobs(), "cache_aware", "b", "least_loaded"),
    ("local prefix wins",
     [W("a"), W("b")], RouteRequest(320, BS, local_blocks={"b": 18}, pool_blocks=0), RoutingKnobs(),
     "cache_aware", "b", "cache_aware"),
    ("local prefix beats a small queue",
     [W("a"), W("b", num_running=1, backlog_tokens=64)],
     RouteRequest(320, BS, local_blocks={"b": 18}), RoutingKnobs(), "cache_aware", "b", "cache_aware"),
    ("a long queue outweighs the prefix",
     [W("a"), W("b", num_running=3, backlog_tokens=4000)],
     RouteRequest(320, BS, local_blocks={"b": 18}), RoutingKnobs(), "cache_aware", "a", "cache_aware"),
    ("decoding requests are no queue: the holder wins, whatever it holds in KV",
     [W("a"), W("b", num_running=3, running_tokens=4000)],
     RouteRequest(320, BS, local_blocks={"b": 18}), RoutingKnobs(), "cache_aware", "b", "cache_aware"),
    ("a faster worker's queue drains sooner",
     [W("a", backlog_tokens=400, prefill_s_per_token=0.01), W("b", backlog_tokens=1000, prefill_s_per_token=0.001)],
     RouteRequest(320, BS, local_blocks={}), RoutingKnobs(), "cache_aware", "b", "cache_aware"),
    ("affinity weight 0 -> pure queue",
     [W("a"), W("b", num_running=1, backlog_tokens=32)],
     RouteRequest(320, BS, local_blocks={"b": 18}), RoutingKnobs(affinity_weight=0.0), "cache_aware",
     "a", "cache_aware"),
    ("a pool block costs its load, a local one nothing",
     [W("a"), W("b")], RouteRequest(320, BS, local_blocks={"b": 10}, pool_blocks=10), RoutingKnobs(),
     "cache_aware", "b", "cache_aware"),
    ("loading from the pool beats waiting behind a queue",
     [W("a"), W("b", backlog_tokens=48)], RouteRequest(320, BS, local_blocks={"b": 20}, pool_blocks=20),
     RoutingKnobs(), "cache_aware", "a", "cache_aware"),
    ("no pool credit for a worker that does not read the pool",
     [W("a", reads_pool=False), W("b", backlog_tokens=64)], RouteRequest(320, BS, local_blocks={}, pool_blocks=20),
     RoutingKnobs(), "cache_aware", "b", "cache_aware"),
    ("pending requests since telemetry count as load",
     [W("a", pending_tokens=640, pending_requests=2), W("b")],
     RouteRequest(320, BS, local_blocks={}), RoutingKnobs(), "cache_aware", "b", "cache_aware"),
    ("session affinity",
     [W("a"), W("b")], RouteRequest(320, BS, session_worker="a", local_blocks={"b": 18}), RoutingKnobs(),
     "cache_aware", "a", "session"),
    ("session affinity with work ahead and no pool answer",
     [W("a", backlog_tokens=2000), W("b")], RouteRequest(320, BS, session_worker="a", session_blocks=18),
     RoutingKnobs(), "cache_aware", "a", "session"),
    ("a session yields when its history loads from the pool elsewhere sooner than its worker's queue drains",
     [W("a", backlog_tokens=2000), W("b")],
     RouteRequest(320, BS, session_worker="a", session_blocks=18, local_blocks={}, pool_blocks=18),
     RoutingKnobs(), "cache_aware", "b", "cache_aware"),
    ("a session stays behind a short queue: its previous turn's blocks are held there",
     [W("a", backlog_tokens=16), W("b")],
     RouteRequest(320, BS, session_worker="a", session_blocks=18, local_blocks={}, pool_blocks=0),
     RoutingKnobs(), "cache_aware", "a", "cache_aware"),
    ("session worker gone -> cost",
     [W("a"), W("b")], RouteRequest(320, BS, session_worker="c", local_blocks={"b": 18}), RoutingKnobs(),
     "cache_aware", "b", "cache_aware"),
    ("imbalance beats session and prefix (SGLang thresholds)",
     [W("a", queue_depth=40), W("b", queue_depth=2)],
     RouteRequest(320, BS, session_worker="a", local_blocks={"a": 18}), RoutingKnobs(), "cache_aware",
     "b", "balance"),
    ("difference of 32 is not imbalance",
     [W("a", queue_depth=34), W("b", queue_depth=2)],
     RouteRequest(320, BS, local_blocks={"a": 18}), RoutingKnobs(load_weight=0.0), "cache_aware", "a",
     "cache_aware"),
    ("round robin ignores the cache",
     [W("b"), W("a")], RouteRequest(320, BS, local_blocks={"b": 18}), RoutingKnobs(), "round_robin", "a",
     "round_robin"),
    ("least_loaded mode",
     [W("a", queue_depth=1), W("b")], RouteRequest(320, BS, local_blocks={"a": 18}), RoutingKnobs(),
     "least_loaded", "b", "least_loaded"),
    ("a worker computing the prefix now is a holder, its uncomputed share of it no queue",
     [W("a"), W("b", pending_tokens=320, pending_requests=1)],
     RouteRequest(336, BS, local_blocks={}, inflight_blocks={"b": 20}, computing_blocks={"b": 20}), RoutingKnobs(), "cache_aware", "b",
     "cache_aware"),
    ("in flight, but its other work outweighs computing the prefix elsewhere",
     [W("a"), W("b", backlog_tokens=400, pending_tokens=320, pending_requests=1)],
     RouteRequest(336, BS, local_blocks={}, inflight_blocks={"b": 20}, computing_blocks={"b": 20}), RoutingKnobs(), "cache_aware", "a",
     "cache_aware"),
    ("equal cost -> name order",
     [W("b"), W("a")], RouteRequest(320, BS, local_blocks={}), RoutingKnobs(), "cache_aware", "a",
     "cache_aware"),
]


@pytest.mark.parametrize("name,workers,req,knobs,mode,expected,reason", CASES, ids=[c[0] for c in CASES])
def test_choose(name, workers, req, knobs, mode, expected, reason):
    choice = choose(workers, req, knobs, mode)
    if expected is None:
        assert choice is None
    else:
        assert (choice.worker_id, choice.reason) == (expected, reason)


def test_round_robin_cycles():
    workers = [W("a"), W("b"), W("c")]
    picked = [choose(workers, RouteRequest(16, BS), mode="round_robin", rr_counter=i).worker_id
              for i in range(6)]
    assert picked == ["a", "b", "c", "a", "b", "c"]


P, L = 0.002, 0.0005  # seconds a token takes to compute, and to load from the pool
KNOBS = RoutingKnobs(prefill_s_per_token=P, pool_load_s_per_token=L)


@pytest.mark.parametrize("local,pool,queue_tokens,knobs,expected", [
    (0, 0, 0, KNOBS, 320 * P),  # 320 tokens to compute
    (20, 0, 0, KNOBS, 0.0),
    (10, 10, 0, KNOBS, 160 * P),  # the pool holds no more than the local 10: 10 blocks to compute
    (10, 20, 0, KNOBS, 160 * L),  # 10 blocks to load
    (0, 20, 160, KNOBS, 320 * L + 160 * P),  # + 160 tokens of queue at the worker's speed
    (0, 20, 0, RoutingKnobs(prefill_s_per_token=P, pool_load_s_per_token=10 * P), 320 * P),  # loading is slower
    (0, 0, 160, RoutingKnobs(prefill_s_per_token=P, load_weight=2.0, affinity_weight=0.5), 160 * P + 320 * P),
])
def test_cost_formula(local, pool, queue_tokens, knobs, expected):
    req = RouteRequest(320, BS, local_blocks={"w": local}, pool_blocks=pool)
    w = W("w", backlog_tokens=queue_tokens, running_tokens=999, prefill_s_per_token=P)  # decoding: no queue
    assert cost(w, req, knobs) == pytest.approx(expected)


@pytest.mark.parametrize("local,inflight,computing,queued,uncomputed,expected_tokens", [
    (0, 20, 20, 0, 320, 0),  # all 20 blocks in flight there and not computed yet: no prefill, no queue
    (0, 20, 20, 160, 320, 160),  # its other queued work still counts
    (0, 10, 10, 0, 320, 160 + 320 - 160),  # 10 to compute; of its 20 uncomputed blocks 10 are this prefix's
    (0, 20, 20, 0, 64, 0 + 64 - 64),  # only what is still uncomputed comes off the queue
    (12, 20, 8, 0, 320, 0 + 320 - 128),  # the 12 it holds were never queued; the 8 in flight are
    (20, 20, 20, 0, 320, 0 + 320 - 320),  # the index names it a holder of blocks it is still computing
    (20, 0, 0, 0, 320, 0 + 320),  # held, none sent to it to compute: all of its backlog is a queue
])
def test_cost_formula_in_flight(local, inflight, computing, queued, uncomputed, expected_tokens):
    req = RouteRequest(320, BS, local_blocks={"w": local}, inflight_blocks={"w": inflight},
                       computing_blocks={"w": computing})
    # `queued` is other work, not this prefix's: in the backlog beside the prefix's uncomputed tokens
    w = W("w", backlog_tokens=queued + uncomputed // 2, pending_tokens=uncomputed - uncomputed // 2,
          prefill_s_per_token=P)
    assert cost(w, req, KNOBS) == pytest.approx(expected_tokens * P)


def test_a_bound_session_is_costed_only_with_work_ahead():
    assert session_sticks(W("a", running_tokens=5000, num_running=4))  # decoding is no queue
    assert not session_sticks(W("a", backlog_tokens=1))
    assert not session_sticks(W("a", pending_tokens=1))
    # costed, the bound worker holds the previous turn's blocks whatever the pool's index says
    req = RouteRequest(320, BS, session_worker="a", session_blocks=18, local_blocks={"a": 2})
    assert cost(W("a", prefill_s_per_token=P), req, KNOBS) == pytest.approx(32 * P)


def test_in_flight_blocks_lead_from_what_a_worker_holds_and_expire_in_order():
    hashes = [bytes([i]) * 8 for i in range(6)]
    inflight = InFlight(ttl_s=10.0)
    inflight.sent("a", hashes, first=0, now=0.0)  # a computes all six
    inflight.sent("b", hashes, first=2, now=5.0)  # b holds the first two (or loads them), computes the rest
    assert inflight.leading(hashes, {}, now=1.0) == ({"a": 6}, {"a": 6})  # b's run does not start at block 0
    assert inflight.leading(hashes, {"b": 2}, now=6.0) == ({"a": 6, "b": 6}, {"a": 6, "b": 4})
    assert inflight.leading(hashes[:3] + [b"other" * 2], {"b": 2}, now=6.0) == ({"a": 3, "b": 3}, {"a": 3, "b": 1})
    # the index names a a holder already (vLLM announces blocks as it schedules them): still computing
    assert inflight.leading(hashes, {"a": 6, "b": 2}, now=6.0) == ({"a": 6, "b": 6}, {"a": 6, "b": 4})
    assert inflight.leading(hashes, {"b": 2}, now=10.0) == ({"b": 6}, {"b": 4})  # a's entries expired at 10
    assert len(inflight) == 4
    inflight.sent("b", hashes, first=4, now=12.0)  # sent again: these two stay until 22
    assert inflight.leading(hashes, {"b": 2}, now=14.0) == ({"b": 6}, {"b": 4})
    assert inflight.leading(hashes, {"b": 4}, now=16.0) == ({"b": 6}, {"b": 2})  # blocks 2-3 expired at 15
    assert inflight.leading(hashes, {"b": 2}, now=16.0) == ({}, {})
    assert len(inflight) == 2
    inflight.forget("b")
    assert len(inflight) == 0 and inflight.leading(hashes, {}, now=17.0) == ({}, {})


def test_a_fresh_prefix_sent_at_once_goes_to_the_worker_computing_it():
    """Eight requests sharing 56 new blocks, each with one block of its own, on two idle workers: without
    the in-flight credit the second goes to the other worker (which computes the prefix again); with it,
    all eight go to the first, whose pending work grows by what each will compute (the router's `sent`)."""
    prefix = [bytes([1, i]) for i in range(56)]
    inflight = InFlight(ttl_s=10.0)
    workers = {"a": W("a"), "b": W("b")}
    picked = []
    for r in range(8):
        hashes = prefix + [bytes([2, r])]
        held, computing = inflight.leading(hashes, {}, now=0.0)
        choice = choose(list(workers.values()), RouteRequest(57 * BS, BS, local_blocks={}, inflight_blocks=held,
                                                             computing_blocks=computing))
        picked.append(choice.worker_id)
        w = workers[choice.worker_id]
        to_compute = (57 - held.get(w.worker_id, 0)) * BS
        workers[w.worker_id] = W(w.worker_id, pending_tokens=w.pending_tokens + to_compute,
                                 pending_requests=w.pending_requests + 1)
        inflight.sent(choice.worker_id, hashes, first=0, now=0.0)
    assert picked == ["a"] * 8
    without = choose([W("a", pending_tokens=57 * BS, pending_requests=1), W("b")],
                     RouteRequest(57 * BS, BS, local_blocks={}))
    assert without.worker_id == "b"


def test_imbalance_needs_both_thresholds():
    assert imbalanced([W("a", queue_depth=33), W("b")], RoutingKnobs())
    assert not imbalanced([W("a", queue_depth=32), W("b")], RoutingKnobs())


def test_what_the_router_knows_each_worker_holds():
    assert known_held(None, {}) is None  # no pool answer, no session: nothing known
    assert known_held(None, {}, "a", 7, sticky=True) == {"a": 7}
    assert known_held(None, {}, "a", 7, sticky=False) is None  # costed, but the pool did not answer
    assert known_held({"a": 2, "b": 5}, {"b": 3, "c": 4}, "a", 7) == {"a": 7, "b": 5, "c": 4}
    assert known_held({"a": 9}, {}, "a", 7) == {"a": 9}
