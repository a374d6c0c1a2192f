"""One simulated fleet serving a trace in one routing mode (the model: kite_cli/simulate/__init__.py).

A discrete-event loop over simulated time. What decides is KITE's own pure code, driven the way the
services drive it:
- routing: `kite_shared.routing.choose` over a `routing.Candidates` kept current per worker change (as
  kite_fingerprinter/router.py's LiveWorkers keeps it), fed as the router feeds it (session binding
  with its TTL, the ru-pool lookup with `include_workers` unless the session's worker has nothing
  queued, the blocks in flight (`routing.InFlight`), the round-robin counter, the queue-group fallback
  when the chosen worker refuses);
- the ru-pool: one `kite_ru_pool.core.PoolCore` with its real hot tier (`HotLRU`), written through to
  an unbounded warm tier, fed the workers' BlockStored/BlockRemoved events and looked up by the router
  and the workers, as kite_ru_pool/service.py does (writes: `admit_put`, `reserve_quota`, `put_hot`; the
  index's `note_stored`; reads: `lookup`, `hot_get`; worker_events: `stored`, `removed`);
- each worker's local cache: the transformers engine's `kite_worker.engines.reference.block_cache.BlockCache` (LRU under
  a byte budget, stored/removed events drained by the caller), and the worker's load-or-recompute
  decision: `kite_worker.pool_loader.CostModel.plan`, seeded with this machine's tier bandwidths;
- the arbitrator: `kite_arbitrator.core.ArbitratorCore` with the built-in rules, observing each worker's
  `WorkerTelemetry` every telemetry interval and evaluated on a timer; its decisions are applied as the
  services apply them (gateway admission, router weights, worker write policy, standby).
Only the service times are modelled (CostModelConfig), and a worker is a FIFO prefill server whose
requests then decode concurrently (continuous batching): the prefill is what a worker's compute is busy
with, so it is what queues.
"""

from __future__ import annotations

import dataclasses
import heapq
import random
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from functools import lru_cache

from kite_arbitrator.core import ArbitratorCore
from kite_arbitrator.rules import load_rules
from kite_ru_pool.core import PoolCore
from kite_ru_pool.index import HOT, WARM
from kite_shared.messages import WorkerTelemetry
from kite_shared.routing import (Candidates, InFlight, RouteRequest, RoutingKnobs, WorkerState, choose,
                                 known_held, session_sticks)
from kite_shared.tiers.keys import BlockKey, model_tag
from kite_worker.engines.reference.block_cache import BlockCache
from kite_worker.pool_loader import CostModel, TierEstimate

from kite_cli.simulate.config import FleetConfig
from kite_cli.simulate.sharding import KEY_KINDS, LoadLedger
from kite_cli.simulate.trace import Request, Trace

# Event kinds, in the order they run when they fall on the same instant: work finishing before new
# arrivals see the fleet, telemetry before the arbitrator reads it.
_PREFILL_DONE, _DECODE_DONE, _TELEMETRY, _ARBITRATE = 0, 1, 2, 3


class _TensorStub:
    """What BlockCache stores per block: only its size is ever read (numel() * element_size())."""

    __slots__ = ("_numel",)

    def __init__(self, num_bytes: int) -> None:
        self._numel = num_bytes // 2

    def numel(self) -> int:
        return self._numel

    def element_size(self) -> int:
        return 2


class HotUnit:
    """What the pool's hot tier stores per block: only len() is read. One shared instance, so 10^7
    simulated 369 KB units cost nothing."""

    __slots__ = ("size",)

    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size


@dataclass(slots=True)
class _Job:
    request: Request
    worker: int
    tenant: int
    local: int = 0  # leading prompt blocks from the worker's own cache
    hot: int = 0  # ... then loaded from the pool's memory
    warm: int = 0  # ... then loaded from warm
    service_s: float = 0.0  # prefill (compute + loads)
    queued_at: float = 0.0
    backlog_tokens: int = 0  # prompt tokens expected to be computed, counted in the worker's backlog


@dataclass(slots=True)
class _Worker:
    worker_id: str
    cache: BlockCache
    queue: deque = field(default_factory=deque)
    prefilling: _Job | None = None
    num_decoding: int = 0
    running_tokens: int = 0  # prompt + output tokens of requests prefilling or decoding
    backlog_tokens: int = 0  # prompt tokens admitted and expected to be computed (queued or prefilling)
    busy_s: float = 0.0  # prefill seconds served
    num_served: int = 0
    seq: int = 0  # BlockStored / BlockRemoved numbering
    write_policy: str = "write_through"
    standby: bool = False
    window_prompt_tokens: int = 0  # since the last telemetry: local hit rate
    window_reused_tokens: int = 0
    requests_accepted: int = 0


@dataclass
class ModeResult:
    """Raw figures of one mode (report.py turns them into the printed and JSON report)."""

    mode: str
    num_requests: int = 0
    num_served: int = 0
    num_shed: int = 0  # refused by the arbitrator's admission decision (gateway 503)
    num_refused: int = 0  # every worker asked had a full queue (503 overloaded)
    num_queue_group: int = 0  # the chosen worker refused: sent to another through the queue group
    prompt_blocks: int = 0
    local_blocks: int = 0
    hot_blocks: int = 0
    warm_blocks: int = 0
    computed_blocks: int = 0
    prompt_tokens: int = 0
    computed_tokens: int = 0
    followups: int = 0  # turns after a session's first (served)
    followups_same_worker: int = 0  # ... served by the worker of the session's previous turn
    ttft_s: list[float] = field(default_factory=list)
    queue_wait_s: list[float] = field(default_factory=list)
    lookup_s: list[float] = field(default_factory=list)  # router's pool lookup (include_workers)
    choose_s: list[float] = field(default_factory=list)  # routing.choose
    route_s: list[float] = field(default_factory=list)  # lookup + choose, per decision
    route_cpu_s: list[float] = field(default_factory=list)  # ... its CPU time (thread_time)
    full_route_s: list[float] = field(default_factory=list)  # decisions that looked the pool up
    full_route_cpu_s: list[float] = field(default_factory=list)
    reasons: Counter = field(default_factory=Counter)
    busy_s: list[float] = field(default_factory=list)  # per worker
    served: list[int] = field(default_factory=list)  # per worker
    max_queue: int = 0
    # the ru-pool core's own time: puts (admit, quota, hot, write-through), the workers' block events,
    # the workers' lookups and hot reads (the router's lookups are in lookup_s)
    pool_puts: int = 0
    pool_put_s: float = 0.0
    pool_event_hashes: int = 0
    pool_event_s: float = 0.0
    pool_reads: int = 0
    pool_read_s: float = 0.0
    # the same pool work (the router's lookups included) and the messages that carried it, charged to the
    # key that would place them on an index shard: the tenant, or the chain segment (sharding.py)
    loads: dict[str, LoadLedger] = field(default_factory=lambda: {kind: LoadLedger() for kind in KEY_KINDS})
    evaluate_s: list[float] = field(default_factory=list)  # ArbitratorCore.evaluate wall time
    evaluate_cpu_s: list[float] = field(default_factory=list)  # ... its CPU time
    telemetry_s: float = 0.0  # building and observing WorkerTelemetry, total
    decisions: Counter = field(default_factory=Counter)
    shed_s: float = 0.0  # simulated seconds admission was closed
    pool_blocks: int = 0
    pool_hot_blocks: int = 0
    pool_worker_entries: int = 0
    pool_counters: dict = field(default_factory=dict)
    sim_end_s: float = 0.0
    arrival_rate: float = 0.0  # the trace's requests/s (its end trails off: the last sessions' later turns)
    wall_s: float = 0.0


class FleetSim:
    def __init__(self, trace: Trace, cfg: FleetConfig, mode: str, seed: int = 0) -> None:
        self.trace = trace
        self.requests = trace.requests
        self.cfg = cfg
        self.mode = mode
        cost = cfg.cost
        self.bs = trace.config.block_size
        self.fp = trace.model_fingerprint
        self.tag = model_tag(self.fp)
        self.block_bytes = cost.block_bytes
        self.unit = HotUnit(cost.block_bytes)
        self.stub = _TensorStub(cost.block_bytes)
        # The ru-pool as its service builds it (defaults of KITE_POOL_*, KITE_WARM_TTL_S, KITE_COLD_TTL_S):
        # warm (Redis) on, cold off, no tenant quotas.
        self.core = PoolCore(cfg.pool_hot_bytes, archive_after_s=604800.0, warm_ttl_s=3600.0,
                             cold_ttl_s=2592000.0, sweep_interval_s=30.0, has_warm=True, has_cold=False)
        self.workers = [_Worker(f"worker-{i:04d}", BlockCache(cfg.worker_cache_bytes))
                        for i in range(cfg.num_workers)]
        self.index_of = {w.worker_id: i for i, w in enumerate(self.workers)}
        self.prefill_s_per_token = 1.0 / cost.prefill_tokens_per_s
        self.states = [WorkerState(w.worker_id, reads_pool=cfg.pool_read, prefill_s_per_token=self.prefill_s_per_token)
                       for w in self.workers]
        # the router's candidates as kite_fingerprinter/router.py's LiveWorkers keeps them: updated per
        # worker on a change, standby workers out
        self.view = Candidates(self.states)
        self.num_standby = 0
        # session id -> (worker, expires, the previous turn's prompt blocks), as kite_fingerprinter/router.py binds them
        self.sessions: dict[str, tuple[str, float, int]] = {}
        self.inflight = InFlight(cfg.inflight_s)  # blocks sent to workers to compute, as the router keeps them
        self.rr = 0
        self.rng = random.Random(seed)  # the queue group's pick
        # The worker's load-or-recompute model, seeded with this machine's measured bandwidths; plan()
        # is pure, so memoizing it on the tier letters changes nothing but its cost.
        self.cost_model = CostModel(block_size=self.bs, block_bytes=cost.block_bytes,
                                    prefill_seconds_per_token=1.0 / cost.prefill_tokens_per_s)
        self.cost_model.tiers["h"] = TierEstimate(latency_s=0.002, bytes_per_s=cost.hot_load_mb_s * 1e6)
        self.cost_model.tiers["w"] = TierEstimate(latency_s=0.001, bytes_per_s=cost.warm_load_mb_s * 1e6)
        self.plan = lru_cache(maxsize=1 << 16)(self.cost_model.plan)
        self.fetch_seconds = lru_cache(maxsize=1 << 16)(self.cost_model.fetch_seconds)
        # the router's fleet speeds: the workers' prefill, and a block's load from warm (the tier that
        # holds every block here) as the workers' loader estimates it
        self.knobs = RoutingKnobs(prefill_s_per_token=self.prefill_s_per_token,
                                  pool_load_s_per_token=self.fetch_seconds(b"w") / self.bs)
        rules, version = load_rules(None)
        self.arbitrator = ArbitratorCore(rules=rules, rules_version=version, min_hold_s=cfg.min_hold_s,
                                         stale_s=cfg.stale_s, ttft_slo_s=cfg.ttft_slo_s, started_at=0.0)
        self.arbitrator.set_rules(rules, version, 0.0)
        self.admit = True
        self.shed_since: float | None = None
        self.events: list = []
        self.event_seq = 0
        self.last_worker = [-1] * trace.num_sessions
        self.result = ModeResult(mode)
        self.tenant_keys = [tag.encode() for tag in trace.tenant_tags]
        self.segment_blocks = cfg.shard_segment_blocks
        self.by_tenant, self.by_segment = self.result.loads["tenant"], self.result.loads["segment"]

    # --- events ----------------------------------------------------------------------------------
    def _at(self, when: float, kind: int, worker: int = -1, job: _Job | None = None) -> None:
        self.event_seq += 1
        heapq.heappush(self.events, (when, kind, self.event_seq, worker, job))

    def run(self) -> ModeResult:
        started = time.perf_counter()
        requests = self.requests
        res = self.result
        res.num_requests = len(requests)
        self._at(0.0, _TELEMETRY)
        self._at(0.0, _ARBITRATE)
        events = self.events
        pop = heapq.heappop
        now = 0.0
        i = 0
        busy = 0  # requests admitted and not finished: ticks stop once the trace is done and this is 0
        while i < len(requests) or busy:
            if events and (i >= len(requests) or events[0][0] <= requests[i].arrival_s):
                now, kind, _, w, job = pop(events)
                if kind == _PREFILL_DONE:
                    self._prefill_done(w, now)
                elif kind == _DECODE_DONE:
                    self._decode_done(w, job, now)
                    busy -= 1
                elif kind == _TELEMETRY:
                    self._telemetry(now)
                    self._at(now + self.cfg.telemetry_interval_s, _TELEMETRY)
                else:
                    self._arbitrate(now)
                    self._at(now + self.cfg.arbitrator_interval_s, _ARBITRATE)
                continue
            r = requests[i]
            i += 1
            now = r.arrival_s
            busy += self._arrive(r, now)
        if self.shed_since is not None:
            res.shed_s += now - self.shed_since
        res.sim_end_s = now
        res.arrival_rate = self.trace.rate
        res.busy_s = [w.busy_s for w in self.workers]
        res.served = [w.num_served for w in self.workers]
        res.pool_blocks = self.core.index.num_blocks()
        res.pool_hot_blocks = len(self.core.io.hot)
        res.pool_worker_entries = sum(self.core.workers.num_blocks().values())
        res.pool_counters = dataclasses.asdict(self.core.counters)
        res.wall_s = time.perf_counter() - started
        return res

    # --- gateway + fingerprinter ------------------------------------------------------------------
    def _arrive(self, r: Request, now: float) -> int:
        """Admission (the arbitrator's decision, applied by the gateway), then routing and the worker's
        admission; returns 1 when a worker took the request."""
        res = self.result
        if not self.admit:
            res.num_shed += 1
            return 0
        tenant = self.trace.session_tenant[r.session]
        worker_id, pool_blocks, held = self._route(r, now)
        w = self.index_of[worker_id] if worker_id else -1
        if w < 0 or len(self.workers[w].queue) >= self.cfg.max_queued:
            # Router.dispatch: the chosen worker refused (or there was none): the queue group, where
            # any subscribed worker may take it.
            res.num_queue_group += 1
            active = [i for i, x in enumerate(self.workers)
                      if not x.standby and len(x.queue) < self.cfg.max_queued]
            if not active:
                res.num_refused += 1
                return 0
            w = self.rng.choice(active)
        sid = r.session_id
        worker = self.workers[w]
        num_prompt = r.prompt_tokens // self.bs
        self.sessions[sid] = (worker.worker_id, now + self.cfg.session_ttl_s, num_prompt)
        if len(self.sessions) > 100_000:  # Router._accepted bounds its map the same way
            self.sessions = {k: v for k, v in self.sessions.items() if v[1] > now}
        chain = self.trace.chains[r.session][:num_prompt]
        if held is not None and self.mode == "cache_aware" and self.cfg.inflight_s > 0:
            # Router._reserve: what the worker computes (past what it holds, computes already or loads)
            self.inflight.sent(worker.worker_id, chain,
                               max(held.get(worker.worker_id, 0), pool_blocks if self.cfg.pool_read else 0), now)
        # What the engines count in their backlog at admission: the prompt less the blocks they expect to
        # reuse (their own cache, or the pool's as far as the router's lookup said).
        reused = worker.cache.longest_prefix(chain)
        if self.cfg.pool_read:
            reused = max(reused, pool_blocks)
        job = _Job(r, w, tenant, queued_at=now, backlog_tokens=max(0, r.prompt_tokens - reused * self.bs))
        worker.queue.append(job)
        worker.backlog_tokens += job.backlog_tokens
        worker.requests_accepted += 1
        if len(worker.queue) > res.max_queue:
            res.max_queue = len(worker.queue)
        if worker.prefilling is None:
            self._start(w, now)
        else:
            self._state(w)
        return 1

    def _route(self, r: Request, now: float) -> tuple[str, int, dict[str, int] | None]:
        """kite_fingerprinter/router.py `Router._choose`, minus NATS: the worker id ("" for none), the pool's
        leading blocks (-1 when it was not asked) and the leading blocks each worker holds or is computing
        as far as the router knows (None when it knows nothing: the pool was not asked)."""
        res = self.result
        candidates = self.candidates
        if not candidates:
            return "", -1, None
        session_worker, session_blocks, sticks = "", 0, False
        bound = self.sessions.get(r.session_id)
        if bound is not None and bound[1] > now and not self.workers[self.index_of[bound[0]]].standby:
            session_worker, session_blocks = bound[0], bound[2]
            sticks = session_sticks(self.states[self.index_of[session_worker]])
        local_blocks, pool_blocks = None, -1
        lookup = self.mode == "cache_aware" and not sticks and len(candidates) > 1
        if lookup:  # the request's block_hashes, a list the router already has
            chain = self.trace.chains[r.session][:r.prompt_tokens // self.bs]
        cpu_started = time.thread_time()  # CPU time too: wall time on a shared machine includes waits
        started = time.perf_counter()
        if lookup:
            reply = self.core.reads.lookup(self.fp, chain, include_workers=True)
            local_blocks, pool_blocks = dict(reply.workers), reply.pool
            looked = time.perf_counter()
            res.lookup_s.append(looked - started)
            self._charge_read(self.trace.session_tenant[r.session], chain, 0, len(chain), looked - started, 0)
        else:
            looked = started
        self.rr += 1
        inflight, computing = {}, {}
        if local_blocks is not None and len(self.inflight):
            inflight, computing = self.inflight.leading(chain, local_blocks, now)
        choice = choose(candidates, RouteRequest(prompt_tokens=r.prompt_tokens, block_size=self.bs,
                                                 session_worker=session_worker, session_blocks=session_blocks,
                                                 local_blocks=local_blocks, pool_blocks=max(0, pool_blocks),
                                                 inflight_blocks=inflight, computing_blocks=computing),
                        self.knobs, self.mode, rr_counter=self.rr)
        done = time.perf_counter()
        cpu = time.thread_time() - cpu_started
        res.route_cpu_s.append(cpu)
        res.choose_s.append(done - looked)
        res.route_s.append(done - started)
        if local_blocks is not None:  # a full cache-aware decision: lookup of every worker + cost
            res.full_route_s.append(done - started)
            res.full_route_cpu_s.append(cpu)
        held = known_held(local_blocks, inflight, session_worker, session_blocks, sticks)
        if choice is None:
            return "", pool_blocks, held
        res.reasons[choice.reason] += 1
        return choice.worker_id, pool_blocks, held

    @property
    def candidates(self) -> Candidates:
        """LiveWorkers.view(): workers publish telemetry at once on a change, so the router's view is the
        current state (and no request is pending since the last snapshot)."""
        return self.view

    def _state(self, w: int) -> None:
        worker = self.workers[w]
        self.states[w] = WorkerState(
            worker.worker_id, num_running=(worker.prefilling is not None) + worker.num_decoding,
            queue_depth=len(worker.queue), running_tokens=worker.running_tokens,
            backlog_tokens=worker.backlog_tokens, reads_pool=self.cfg.pool_read,
            requests_accepted=worker.requests_accepted,
            prefill_s_per_token=self.prefill_s_per_token)
        if not worker.standby:
            self.view.put(self.states[w])

    # --- worker ----------------------------------------------------------------------------------
    def _start(self, w: int, now: float) -> None:
        """The next queued request starts its prefill: local prefix, then the pool's blocks the cost
        model says to load, then compute the rest."""
        worker = self.workers[w]
        job = worker.queue.popleft()
        r = job.request
        bs = self.bs
        num_prompt = r.prompt_tokens // bs
        chain = self.trace.chains[r.session]
        prompt = chain[:num_prompt]
        cache = worker.cache
        local = cache.longest_prefix(prompt)
        if local:
            cache.get_prefix(prompt[:local])  # marks them most recently used, as the engine does
            if worker.write_policy == "selective":
                # selective: a block is saved when a second request uses it (the vLLM connector)
                for depth in range(local):
                    self._put(job.tenant, prompt, depth, now, only_missing=True)
        load_s = 0.0
        if self.cfg.pool_read and local < num_prompt:
            started = time.perf_counter()
            found = self.core.reads.lookup(self.fp, prompt[local:], HOT | WARM, include_workers=False)
            if found.pool:
                k = self.plan(found.tiers)
                if k:
                    letters = found.tiers[:k]
                    load_s = self.fetch_seconds(letters)
                    job.hot = letters.count(b"h")
                    job.warm = k - job.hot
                    if job.hot:
                        # blocks only the pool's memory is cheapest for come through pool.get
                        tenant_tag = self.trace.tenant_tags[job.tenant]
                        for depth in range(local, local + k):
                            if letters[depth - local] == 104:  # b"h"
                                self.core.reads.hot_get(BlockKey(self.tag, prompt[depth], tenant_tag), now)
            elapsed = time.perf_counter() - started  # plan and fetch_seconds are memoized
            self.result.pool_read_s += elapsed
            self.result.pool_reads += 1
            self._charge_read(job.tenant, prompt, local, num_prompt, elapsed, job.hot)
        job.local = local
        computed_tokens = max(1, r.prompt_tokens - (local + job.hot + job.warm) * bs)
        job.service_s = computed_tokens / self.cfg.cost.prefill_tokens_per_s + load_s
        res = self.result
        res.queue_wait_s.append(now - job.queued_at)
        res.prompt_blocks += num_prompt
        res.local_blocks += local
        res.hot_blocks += job.hot
        res.warm_blocks += job.warm
        res.computed_blocks += num_prompt - local - job.hot - job.warm
        res.prompt_tokens += r.prompt_tokens
        res.computed_tokens += computed_tokens
        worker.window_prompt_tokens += r.prompt_tokens
        worker.window_reused_tokens += r.prompt_tokens - computed_tokens
        worker.prefilling = job
        worker.running_tokens += r.prompt_tokens + r.output_tokens
        self._state(w)
        self._at(now + job.service_s, _PREFILL_DONE, w, job)

    def _prefill_done(self, w: int, now: float) -> None:
        worker = self.workers[w]
        job = worker.prefilling
        r = job.request
        res = self.result
        res.ttft_s.append(now - r.arrival_s)
        worker.backlog_tokens -= job.backlog_tokens
        chain = self.trace.chains[r.session]
        num_prompt = r.prompt_tokens // self.bs
        # loaded and computed blocks enter the local cache; computed ones go to the pool
        self._store(worker, job, chain, job.local, num_prompt, job.local + job.hot + job.warm, now)
        worker.busy_s += job.service_s
        worker.num_served += 1
        worker.prefilling = None
        worker.num_decoding += 1
        res.num_served += 1
        if r.turn:
            res.followups += 1
            res.followups_same_worker += self.last_worker[r.session] == w
        self.last_worker[r.session] = w
        self._at(now + r.output_tokens / self.cfg.cost.decode_tokens_per_s, _DECODE_DONE, w, job)
        if worker.queue:
            self._start(w, now)
        else:
            self._state(w)

    def _decode_done(self, w: int, job: _Job, now: float) -> None:
        worker = self.workers[w]
        r = job.request
        num_prompt = r.prompt_tokens // self.bs
        # KITE_WORKER_CACHE_GENERATED: the answer's full blocks are kept (and saved) for the next turn
        self._store(worker, job, self.trace.chains[r.session], num_prompt, r.num_blocks, num_prompt, now)
        worker.num_decoding -= 1
        worker.running_tokens -= r.prompt_tokens + r.output_tokens
        self._state(w)

    def _store(self, worker: _Worker, job: _Job, chain: list[bytes], start: int, end: int,
               first_computed: int, now: float) -> None:
        """Blocks [start, end) of the chain enter the worker's cache; [first_computed, end) were
        computed here and are put into the pool under the worker's write policy. Then the cache's
        events go to the pool's index, as BlockStored / BlockRemoved messages would."""
        if start >= end:
            return
        cache, stub = worker.cache, self.stub
        put = cache.put
        for depth in range(start, end):
            put(chain[depth], stub)
        if worker.write_policy == "write_through":
            for depth in range(max(start, first_computed), end):
                self._put(job.tenant, chain, depth, now)
        events = cache.take_events()
        segment_of = {chain[d]: chain[d - d % self.segment_blocks] for d in range(start, end)}
        # one message per run of same-kind events, in order (a block evicted and stored again within
        # one batch must end up stored)
        run_kind, run = events[0].kind if events else "", []
        for ev in events:
            if ev.kind != run_kind:
                self._publish(worker, job.tenant, segment_of, run_kind, run, now)
                run_kind, run = ev.kind, []
            run.append(ev.block_hash)
        if run:
            self._publish(worker, job.tenant, segment_of, run_kind, run, now)

    def _publish(self, worker: _Worker, tenant: int, segment_of: dict[bytes, bytes], kind: str,
                 hashes: list[bytes], now: float) -> None:
        """One BlockStored / BlockRemoved message, charged to `tenant` (whose request caused it); sharded by
        segment, one message per segment among `hashes` (`segment_of`). An evicted block's segment is not
        known here: it is charged by the first two bytes of its hash (65,536 keys that spread over shards as
        its segments would, without a ledger entry per evicted block)."""
        worker.seq += 1
        started = time.perf_counter()
        if kind == "stored":
            self.core.worker_events.stored(worker.worker_id, self.fp, hashes, worker.seq, now)
        else:
            self.core.worker_events.removed(worker.worker_id, self.fp, hashes, False, worker.seq, now)
        elapsed = time.perf_counter() - started
        res = self.result
        res.pool_event_s += elapsed
        res.pool_event_hashes += len(hashes)
        self.by_tenant.event(self.tenant_keys[tenant], elapsed)
        segments = {segment_of.get(h) or h[:2] for h in hashes}
        for key in segments:
            self.by_segment.event(key, elapsed / len(segments))

    def _put(self, tenant: int, chain: list[bytes], depth: int, now: float, only_missing: bool = False) -> None:
        """kite_ru_pool/service.py `put_bytes` once the unit is verified: admit, quota, hot, write-through.

        The service's objects, not shared ones: the service decodes each unit, so its tenant tag is a
        new string, `BlockKey.of` makes a new model tag string, `len(data)` a new int and each clock()
        reading a new float, and the index keeps all of them. Making them the same way here (`+ 0`,
        `encode().decode()`) is what makes the index's measured memory per block the service's."""
        writes, index = self.core.writes, self.core.index
        started = time.perf_counter()
        key = BlockKey.of(self.fp, chain[depth], self.trace.tenant_tags[tenant].encode().decode())
        if only_missing and index.tiers_of(key):
            return
        self.result.pool_puts += 1
        if writes.admit_put(key) == "store":
            size = self.block_bytes + 0
            if writes.reserve_quota(key, size) is not None:
                for action in writes.put_hot(key, self.unit, now + 0.0, depth):
                    index.note_stored(action.key, action.tier, size, now)  # the demotion's write succeeded
                index.note_stored(key, WARM, size, now + 0.0, depth=depth)  # the write-through succeeded
        elapsed = time.perf_counter() - started
        self.result.pool_put_s += elapsed
        self.by_tenant.put(self.tenant_keys[tenant], elapsed)
        self.by_segment.put(chain[depth - depth % self.segment_blocks], elapsed)

    def _charge_read(self, tenant: int, chain: list[bytes], start: int, end: int, seconds: float,
                     num_hot: int) -> None:
        """A lookup of chain[start:end] (and a get when `num_hot` blocks come from the pool's memory):
        one message to the tenant's shard, or one to each segment's shard it spans (at once)."""
        self.by_tenant.read(self.tenant_keys[tenant], seconds, 1 + (num_hot > 0))
        k = self.segment_blocks
        starts = range(start - start % k, end, k)
        if not starts:
            return
        for s in starts:
            self.by_segment.read(chain[s], seconds / len(starts))
        if num_hot:
            self.by_segment.read(chain[start - start % k], 0.0)

    # --- control plane ---------------------------------------------------------------------------
    def _telemetry(self, now: float) -> None:
        started = time.perf_counter()
        cost = self.cfg.cost
        observe = self.arbitrator.observe
        for w in self.workers:
            window = w.window_prompt_tokens
            observe(WorkerTelemetry(
                instance_id=w.worker_id, sent_at=now, queue_depth=len(w.queue),
                num_running=(w.prefilling is not None) + w.num_decoding, max_running=self.cfg.max_running,
                running_tokens=w.running_tokens, prefill_backlog_tokens=w.backlog_tokens,
                cache_bytes=w.cache.num_bytes, cache_capacity_bytes=w.cache.capacity_bytes,
                local_hit_rate=w.window_reused_tokens / window if window else 0.0, prompt_tokens_window=window,
                prefill_tokens_per_s=cost.prefill_tokens_per_s, decode_tokens_per_s=cost.decode_tokens_per_s,
                standby=w.standby, write_policy=w.write_policy, pool_read=self.cfg.pool_read,
                requests_accepted=w.requests_accepted), now)
            w.window_prompt_tokens = w.window_reused_tokens = 0
        self.result.telemetry_s += time.perf_counter() - started

    def _arbitrate(self, now: float) -> None:
        cpu_started = time.thread_time()
        started = time.perf_counter()
        decisions = self.arbitrator.evaluate(now)
        self.result.evaluate_s.append(time.perf_counter() - started)
        self.result.evaluate_cpu_s.append(time.thread_time() - cpu_started)
        self.arbitrator.take_log()  # the service writes it out; here it would only grow
        for d in decisions:
            self.result.decisions[f"{d.action}:{d.rule}"] += 1
            if d.action == "admission":
                if self.admit and not d.admit:
                    self.shed_since = now
                elif not self.admit and d.admit and self.shed_since is not None:
                    self.result.shed_s += now - self.shed_since
                    self.shed_since = None
                self.admit = d.admit
            elif d.action == "routing" and d.weights is not None:
                self.knobs = dataclasses.replace(self.knobs, affinity_weight=d.weights.affinity,
                                                 load_weight=d.weights.load)
            elif d.action == "write_policy" and d.write_policy:
                for w in (self.workers if d.target == "*" else
                          [self.workers[self.index_of[d.target]]] if d.target in self.index_of else []):
                    w.write_policy = d.write_policy
            elif d.action == "warm_capacity" and d.standby is not None and d.target in self.index_of:
                self.workers[self.index_of[d.target]].standby = d.standby
                self.num_standby = sum(w.standby for w in self.workers)
                if d.standby:
                    self.view.remove(d.target)
                else:
                    self.view.put(self.states[self.index_of[d.target]])
