"""The routing code as it was before issue 38's incremental search (the cost, the session rule and the
worker state since follow the current code), kept as oracles: the seeded equivalence tests
(tests/unit/test_routing_equivalence.py) check that the incremental code decides exactly as these do, and
bench/bench_routing_scale.py times both side by side. Not used by any service."""

from __future__ import annotations

from typing import Sequence

from kite_shared.routing import RouteChoice, RouteRequest, RoutingKnobs, WorkerState, cost, session_sticks


def _least_loaded(workers: Sequence[WorkerState]) -> WorkerState:
    return min(workers, key=lambda w: (w.requests, w.running_tokens + w.backlog_tokens + w.pending_tokens,
                                       w.worker_id))


def imbalanced(workers: Sequence[WorkerState], knobs: RoutingKnobs) -> bool:
    loads = [w.requests for w in workers]
    hi, lo = max(loads), min(loads)
    return hi - lo > knobs.balance_abs and hi > knobs.balance_rel * lo


def choose(workers: Sequence[WorkerState], req: RouteRequest, knobs: RoutingKnobs = RoutingKnobs(),
           mode: str = "cache_aware", rr_counter: int = 0) -> RouteChoice | None:
    """kite_shared.routing.choose before issue 38: sorts and costs every candidate."""
    if not workers:
        return None
    workers = sorted(workers, key=lambda w: w.worker_id)
    if mode == "round_robin":
        return RouteChoice(workers[rr_counter % len(workers)].worker_id, "round_robin")
    if mode == "least_loaded":
        return RouteChoice(_least_loaded(workers).worker_id, "least_loaded")
    if imbalanced(workers, knobs):
        return RouteChoice(_least_loaded(workers).worker_id, "balance")
    by_id = {w.worker_id: w for w in workers}
    if req.session_worker in by_id and (req.local_blocks is None or session_sticks(by_id[req.session_worker])):
        return RouteChoice(req.session_worker, "session")
    if req.local_blocks is None:
        return RouteChoice(_least_loaded(workers).worker_id, "least_loaded")
    costs = {w.worker_id: cost(w, req, knobs) for w in workers}
    best = min(workers, key=lambda w: (round(costs[w.worker_id], 6), w.requests, w.requests_accepted, w.worker_id))
    return RouteChoice(best.worker_id, "cache_aware", costs)


def candidates(live, now: float) -> list[WorkerState]:
    """kite_fingerprinter.router.LiveWorkers.candidates before issue 38: a WorkerState rebuilt for every
    live worker, per decision (`live` is a LiveWorkers; its per-worker records are read as they were)."""
    out = []
    for w in live._workers.values():
        t = w.telemetry
        if now - w.seen > live.timeout_s or w.draining or t is None or t.standby or not t.healthy:
            continue
        out.append(WorkerState(
            worker_id=w.worker_id, num_running=w.num_running, queue_depth=w.num_queued,
            running_tokens=t.running_tokens, backlog_tokens=t.prefill_backlog_tokens,
            pending_tokens=sum(p.tokens for p in w.pending.values()), pending_requests=len(w.pending),
            reads_pool=t.pool_read, requests_accepted=t.requests_accepted + len(w.pending),
            prefill_s_per_token=(1 / t.prefill_tokens_per_s if t.prefill_tokens_per_s > 0
                                 else live.fallback_prefill_s_per_token)))
    return out


def prefix_lengths(held: dict[str, dict[str, set[bytes]]], tag: str, chain: Sequence[bytes]) -> dict[str, int]:
    """kite_ru_pool.worker_caches.WorkerCaches.prefix_lengths before issue 38 (over its `held`): probes
    every known worker's set and answers a count for each, zeros included."""
    workers: dict[str, int] = {}
    for worker_id, by_tag in held.items():
        cached = by_tag.get(tag)
        count = 0
        if cached:
            for h in chain:
                if h not in cached:
                    break
                count += 1
        workers[worker_id] = count
    return workers
