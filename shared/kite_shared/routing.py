"""Cache-aware routing policy: which worker should compute this request. Pure (no I/O, no clock).

The algorithm (starting points: Dynamo's KV router cost and SGLang's cache-aware router, as they were on
2026-11-29; the defaults below are theirs):

1. Candidates: workers that are live (a heartbeat or telemetry within KITE_ROUTER_WORKER_TIMEOUT_S,
   5 s), not draining, not standby, healthy. No candidate -> no decision (the caller falls back to the
   NATS queue group, where any subscribed worker may take it).
2. Session affinity: when the client sent a session id (`kite.session_id`) that is bound to a candidate,
   that worker is chosen unless the fleet is imbalanced (step 3). A chat's turns then land where its KV
   is even when the pool's index has not heard of the previous turn's blocks yet.
3. Balance guard (SGLang): with load = running + queued requests, if max - min > `balance_abs` (32) and
   max > `balance_rel` * min (1.0001), route to the least-loaded worker: a hot prefix must not pile every
   request onto one worker.
4. Cache-aware cost (Dynamo): for each candidate w, in blocks of `block_size` tokens:
       overlap_credit(w) = local(w) + pool_hit_weight * max(pool - local(w), 0)
       prefill(w)        = max(prompt_blocks - overlap_credit(w), 0)
       load(w)           = (running_tokens(w) + backlog_tokens(w)) / block_size + pending_blocks(w)
       cost(w)           = affinity_weight * prefill(w) + load_weight * load(w)
   `local(w)` is how many leading prompt blocks w's local cache holds (the ru-pool index's `workers` map,
   fed by the workers' BlockStored/BlockRemoved events); `pool` is how many the pool's tiers hold (a pool
   block still has to be fetched: Dynamo weights host-tier hits 0.75, so `pool_hit_weight` = 0.75);
   A worker that does not read from the pool (KITE_WORKER_POOL_READ=off) gets no pool credit.
   `pending_blocks` is what this router sent to w since w's last telemetry (telemetry is ~1 s old, a burst
   must not all go to the same worker). affinity_weight = Dynamo's prefill_load_scale (1.0), load_weight
   1.0 (Dynamo adds decode blocks unweighted; llm-d weights prefix and load 1:1). The arbitrator may
   change both weights at run time. Lowest cost wins; ties go to the fewer requests, then the name.
5. Fallback: no pool answer (timeout, no ru-pool) -> least-loaded (fewest requests, then fewest running
   tokens), after session affinity. Modes `least_loaded` and `round_robin` skip steps 2-4 (round robin
   exists to measure what cache awareness buys, bench/bench_routing.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence


@dataclass(frozen=True)
class WorkerState:
    worker_id: str
    num_running: int = 0
    queue_depth: int = 0
    running_tokens: int = 0
    backlog_tokens: int = 0  # admitted prompt tokens not computed yet
    pending_tokens: int = 0  # prompt tokens this router sent since the worker's last telemetry
    pending_requests: int = 0
    reads_pool: bool = True  # loads missing prefix blocks from the ru-pool (KITE_WORKER_POOL_READ)

    @property
    def requests(self) -> int:
        return self.num_running + self.queue_depth + self.pending_requests


@dataclass(frozen=True)
class RoutingKnobs:
    affinity_weight: float = 1.0  # Dynamo prefill_load_scale
    load_weight: float = 1.0  # Dynamo decode-blocks term
    pool_hit_weight: float = 0.75  # Dynamo host-tier (G2) hit weight
    balance_abs: int = 32  # SGLang balance_abs_threshold
    balance_rel: float = 1.0001  # SGLang balance_rel_threshold


@dataclass(frozen=True)
class RouteRequest:
    prompt_tokens: int
    block_size: int
    session_worker: str = ""  # worker bound to the request's session id, if any
    local_blocks: Mapping[str, int] | None = None  # pool lookup `workers`; None = no pool answer
    pool_blocks: int = 0  # pool lookup `pool`


@dataclass(frozen=True)
class RouteChoice:
    worker_id: str
    reason: str  # "session", "balance", "cache_aware", "least_loaded", "round_robin"
    costs: dict[str, float] = field(default_factory=dict)


def _least_loaded(workers: Sequence[WorkerState]) -> WorkerState:
    return min(workers, key=lambda w: (w.requests, w.running_tokens + w.backlog_tokens + w.pending_tokens,
                                       w.worker_id))


def imbalanced(workers: Sequence[WorkerState], knobs: RoutingKnobs) -> bool:
    loads = [w.requests for w in workers]
    hi, lo = max(loads), min(loads)
    return hi - lo > knobs.balance_abs and hi > knobs.balance_rel * lo


def cost(w: WorkerState, req: RouteRequest, knobs: RoutingKnobs) -> float:
    bs = max(1, req.block_size)
    prompt_blocks = req.prompt_tokens / bs
    local = (req.local_blocks or {}).get(w.worker_id, 0)
    pool_weight = knobs.pool_hit_weight if w.reads_pool else 0.0  # a pool block helps only a reader
    credit = local + pool_weight * max(req.pool_blocks - local, 0)
    prefill = max(prompt_blocks - credit, 0.0)
    load = (w.running_tokens + w.backlog_tokens + w.pending_tokens) / bs
    return knobs.affinity_weight * prefill + knobs.load_weight * load


def choose(workers: Sequence[WorkerState], req: RouteRequest, knobs: RoutingKnobs = RoutingKnobs(),
           mode: str = "cache_aware", rr_counter: int = 0) -> RouteChoice | None:
    """The worker for `req` among `workers` (the candidates), or None when there is none."""
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
    if req.session_worker in by_id:
        return RouteChoice(req.session_worker, "session")
    if req.local_blocks is None:
        return RouteChoice(_least_loaded(workers).worker_id, "least_loaded")
    costs = {w.worker_id: cost(w, req, knobs) for w in workers}
    best = min(workers, key=lambda w: (round(costs[w.worker_id], 6), w.requests, w.worker_id))
    return RouteChoice(best.worker_id, "cache_aware", costs)
