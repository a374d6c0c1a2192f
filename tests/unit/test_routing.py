"""The cache-aware routing policy (kite_shared.routing), table-driven."""

from __future__ import annotations

import pytest

from kite_shared.routing import RouteRequest, RoutingKnobs, WorkerState, choose, cost, imbalanced

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
    ("local prefix beats a small load",
     [W("a"), W("b", num_running=1, running_tokens=64)],
     RouteRequest(320, BS, local_blocks={"b": 18}), RoutingKnobs(), "cache_aware", "b", "cache_aware"),
    ("heavy load outweighs the prefix",
     [W("a"), W("b", num_running=3, running_tokens=4000)],
     RouteRequest(320, BS, local_blocks={"b": 18}), RoutingKnobs(), "cache_aware", "a", "cache_aware"),
    ("affinity weight 0 -> pure load",
     [W("a"), W("b", num_running=1, running_tokens=32)],
     RouteRequest(320, BS, local_blocks={"b": 18}), RoutingKnobs(affinity_weight=0.0), "cache_aware",
     "a", "cache_aware"),
    ("pool hit weighted 0.75 < local hit",
     [W("a"), W("b")], RouteRequest(320, BS, local_blocks={"b": 10}, pool_blocks=10), RoutingKnobs(),
     "cache_aware", "b", "cache_aware"),
    ("pool credit reduces everyone's prefill alike",
     [W("a"), W("b", running_tokens=16)], RouteRequest(320, BS, local_blocks={}, pool_blocks=20),
     RoutingKnobs(), "cache_aware", "a", "cache_aware"),
    ("no pool credit for a worker that does not read the pool",
     [W("a", reads_pool=False), W("b", running_tokens=64)], RouteRequest(320, BS, local_blocks={}, pool_blocks=20),
     RoutingKnobs(), "cache_aware", "b", "cache_aware"),
    ("pending requests since telemetry count as load",
     [W("a", pending_tokens=640, pending_requests=2), W("b")],
     RouteRequest(320, BS, local_blocks={}), RoutingKnobs(), "cache_aware", "b", "cache_aware"),
    ("session affinity",
     [W("a"), W("b")], RouteRequest(320, BS, session_worker="a", local_blocks={"b": 18}), RoutingKnobs(),
     "cache_aware", "a", "session"),
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


@pytest.mark.parametrize("local,pool,load_tokens,expected", [
    (0, 0, 0, 20.0),  # 320 tokens = 20 blocks to compute
    (20, 0, 0, 0.0),
    (10, 10, 0, 10 - 0.0),  # pool holds no more than the local 10: credit 10
    (10, 20, 0, 20 - 10 - 0.75 * 10),
    (0, 20, 160, 20 - 15 + 10),  # + 10 blocks of load
])
def test_cost_formula(local, pool, load_tokens, expected):
    req = RouteRequest(320, BS, local_blocks={"w": local}, pool_blocks=pool)
    assert cost(W("w", running_tokens=load_tokens), req, RoutingKnobs()) == pytest.approx(expected)


def test_imbalance_needs_both_thresholds():
    assert imbalanced([W("a", queue_depth=33), W("b")], RoutingKnobs())
    assert not imbalanced([W("a", queue_depth=32), W("b")], RoutingKnobs())
