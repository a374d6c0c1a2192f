"""The fingerprinter's router: which worker gets a tokenized request (policy: kite_shared.routing).

- Live workers come from worker heartbeats and telemetry (kite.v1.telemetry.worker). A worker silent for
  KITE_ROUTER_WORKER_TIMEOUT_S (5 s) leaves the routing set; its next message brings it back. Draining and
  standby workers are not candidates; only workers that sent telemetry are (a worker publishes it at
  once on start, so a worker of an older build without telemetry still gets work through the queue group).
- Per request: ask the ru-pool which leading blocks each worker and the pool hold (`kite.v1.pool.lookup`,
  KITE_ROUTER_LOOKUP_TIMEOUT_S), pick a worker (`routing.choose`), send the TokenizedRequest to its own
  subject `kite.v1.worker.<id>.generate`. No candidate, or the chosen worker has no subscriber / refuses
  as overloaded or draining: the request goes to the queue group (`kite.v1.worker.generate`) instead.
- Arbitrator `routing` decisions set the weights (affinity vs load) and may switch the mode
  (cache_aware, least_loaded, round_robin, queue_group); "" returns to KITE_ROUTER_MODE.
- Sessions: a session's turn goes to the worker that served its previous turn while nothing is queued
  there; otherwise the pool is asked and the bound worker, credited with the previous turn's blocks, is
  costed against the others (`routing.session_sticks`).
"""

from __future__ import annotations

import dataclasses
import heapq
import logging
import time
from dataclasses import dataclass, field

from nats.aio.client import Client as NATS
from nats.errors import NoRespondersError, TimeoutError as NatsTimeoutError
from prometheus_client import Counter

from kite_shared import subjects
from kite_shared.config import FingerprinterConfig
from kite_shared.endpoints import Endpoint
from kite_shared.messages import (ROUTING_MODES, Admission, Decision, ErrorInfo, Heartbeat, MessageError,
                                  TokenizedRequest, WorkerTelemetry)
from kite_shared.routing import (DEFAULT_PREFILL_S_PER_TOKEN, Candidates, InFlight, RouteRequest, RoutingKnobs,
                                 WorkerState, choose, known_held, session_sticks)
from kite_shared.tiers.pool_client import PoolClient
from kite_shared.window import TimeWindow

log = logging.getLogger(__name__)

ROUTED = Counter("kite_router_decisions_total", "Requests routed, by reason", ["reason"])
_PENDING_MAX_AGE_S = 5.0
_REFUSALS_TO_RETRY = ("overloaded", "shutting_down")


@dataclass
class _Worker:
    worker_id: str
    seen: float  # monotonic
    telemetry: WorkerTelemetry | None = None
    draining: bool = False
    num_running: int = 0
    num_queued: int = 0
    pending: dict[str, _Pending] = field(default_factory=dict)  # by request id: sent, not in its telemetry yet


@dataclass(frozen=True)
class _Pending:
    sent_at: float  # unix time the router chose the worker
    tokens: int  # its prompt tokens, less blocks the worker computes for another request


class LiveWorkers:
    """Which workers may be routed to, and their load. Pure state (clocks passed in).

    The candidates are kept as a `routing.Candidates`, updated when a worker's heartbeat, telemetry or a
    request sent to it changes its state, and when it falls silent (a heap by last-heard time, read at
    each decision, takes out those silent for `timeout_s`), so a decision does not rebuild every worker's
    state (issue 38: 4.9 ms at 1,000 workers). `now` is expected not to go back; when it does, the set is
    rebuilt from every worker's record, so the answer is the same either way."""

    def __init__(self, timeout_s: float, prefill_s_per_token: float = DEFAULT_PREFILL_S_PER_TOKEN) -> None:
        self.timeout_s = timeout_s
        self.fallback_prefill_s_per_token = prefill_s_per_token  # a worker's until it reports its own
        self._workers: dict[str, _Worker] = {}
        # workers that reported a prefill speed, and the sum of their seconds per token (the fleet's mean)
        self._num_speeds = 0
        self._sum_s_per_token = 0.0
        self._candidates = Candidates()
        self._by_seen: list[tuple[float, str]] = []  # (seen, worker): entries older than its seen are stale
        self._now = float("-inf")  # the latest `now` a view was asked for

    def heartbeat(self, beat: Heartbeat, now: float) -> None:
        w = self._workers.setdefault(beat.instance_id, _Worker(beat.instance_id, now))
        w.seen, w.draining = now, beat.draining
        w.num_running, w.num_queued = beat.num_running, beat.num_queued
        self._heard(w)
        self._changed(w)

    def telemetry(self, t: WorkerTelemetry, now: float) -> None:
        w = self._workers.setdefault(t.instance_id, _Worker(t.instance_id, now))
        self._count_speed(w.telemetry, -1)
        self._count_speed(t, 1)
        w.seen, w.telemetry, w.draining = now, t, t.draining
        w.num_running, w.num_queued = t.num_running, t.queue_depth
        # In this snapshot: the requests it names as admitted since its previous one (a lost message leaves
        # them until they are _PENDING_MAX_AGE_S old).
        for request_id in t.admitted_request_ids:
            w.pending.pop(request_id, None)
        if w.pending:
            w.pending = {r: p for r, p in w.pending.items() if p.sent_at > t.sent_at - _PENDING_MAX_AGE_S}
        self._heard(w)
        self._changed(w)

    def sent(self, worker_id: str, request_id: str, tokens: int, at: float) -> None:
        """The router sends `worker_id` a request with `tokens` to compute, at unix time `at`: its load
        until the worker's telemetry names it (WorkerTelemetry.admitted_request_ids)."""
        w = self._workers.get(worker_id)
        if w is not None:
            w.pending[request_id] = _Pending(at, tokens)
            self._changed(w)

    def refused(self, worker_id: str, request_id: str) -> None:
        w = self._workers.get(worker_id)
        if w is not None and w.pending.pop(request_id, None) is not None:
            self._changed(w)

    def forget(self, worker_id: str) -> None:
        w = self._workers.pop(worker_id, None)
        if w is not None:
            self._count_speed(w.telemetry, -1)
        self._candidates.remove(worker_id)

    def mean_prefill_s_per_token(self) -> float:
        """The known workers' mean measured seconds per prompt token (the fallback while none reported)."""
        if self._num_speeds <= 0:
            return self.fallback_prefill_s_per_token
        return self._sum_s_per_token / self._num_speeds

    def _count_speed(self, t: WorkerTelemetry | None, sign: int) -> None:
        if t is not None and t.prefill_tokens_per_s > 0:
            self._num_speeds += sign
            self._sum_s_per_token += sign / t.prefill_tokens_per_s

    def view(self, now: float) -> Candidates:
        """The candidates at `now`, kept current (callers must not change it)."""
        if now < self._now:
            self._rebuild(now)
        self._now = now
        heap, workers = self._by_seen, self._workers
        while heap:
            seen, worker_id = heap[0]
            w = workers.get(worker_id)
            if w is not None and w.seen == seen:
                if not now - seen > self.timeout_s:
                    break  # the least recently heard worker is live: so are all the others
                self._candidates.remove(worker_id)
            heapq.heappop(heap)
        return self._candidates

    def candidates(self, now: float) -> list[WorkerState]:
        """The candidates at `now` as a list, in worker id order."""
        return list(self.view(now))

    def _heard(self, w: _Worker) -> None:
        heapq.heappush(self._by_seen, (w.seen, w.worker_id))
        if len(self._by_seen) > 4 * len(self._workers) + 64:  # mostly stale entries
            self._by_seen = [(x.seen, x.worker_id) for x in self._workers.values()]
            heapq.heapify(self._by_seen)

    def _changed(self, w: _Worker) -> None:
        """`w`'s record changed: its candidate state follows (liveness judged at the latest view's time)."""
        state = self._state(w, self._now)
        if state is None:
            self._candidates.remove(w.worker_id)
        else:
            self._candidates.put(state)

    def _state(self, w: _Worker, now: float) -> WorkerState | None:
        """`w` as a candidate, or None when it is not one at `now`."""
        t = w.telemetry
        if now - w.seen > self.timeout_s or w.draining or t is None or t.standby or not t.healthy:
            return None
        return WorkerState(
            worker_id=w.worker_id, num_running=w.num_running, queue_depth=w.num_queued,
            running_tokens=t.running_tokens, backlog_tokens=t.prefill_backlog_tokens,
            pending_tokens=sum(p.tokens for p in w.pending.values()), pending_requests=len(w.pending),
            reads_pool=t.pool_read, requests_accepted=t.requests_accepted + len(w.pending),
            prefill_s_per_token=(1 / t.prefill_tokens_per_s if t.prefill_tokens_per_s > 0
                                 else self.fallback_prefill_s_per_token))

    def _rebuild(self, now: float) -> None:
        self._candidates = Candidates([s for w in self._workers.values() if (s := self._state(w, now)) is not None])
        self._by_seen = [(w.seen, w.worker_id) for w in self._workers.values()]
        heapq.heapify(self._by_seen)


@dataclass(frozen=True)
class _Session:
    """Where a session's previous turn went (`kite.session_id`)."""

    worker_id: str
    expires: float  # monotonic
    num_blocks: int  # the previous turn's prompt blocks: the next turn's leading blocks, held there


@dataclass(frozen=True)
class _Route:
    """One routing decision, kept until the worker's admission says who took the request."""

    worker_id: str  # "" for the NATS queue group
    reason: str
    pool_blocks: int = -1  # the pool's leading blocks, -1 when it was not asked
    held: dict[str, int] | None = None  # leading blocks each worker holds or is computing; None: not looked up
    computing: dict[str, int] = field(default_factory=dict)  # of those, how many it computes for others


class Router:
    def __init__(self, nc: NATS, cfg: FingerprinterConfig, worker_timeout_s: float,
                 pool: PoolClient | None = None) -> None:
        self.nc = nc
        self.cfg = cfg
        self.worker_timeout_s = worker_timeout_s  # admission wait (KITE_ADMIT_TIMEOUT_S)
        self.pool = pool or PoolClient(nc)
        self.live = LiveWorkers(cfg.router_worker_timeout_s, cfg.router_prefill_s_per_token)
        self.knobs = RoutingKnobs(affinity_weight=cfg.router_affinity_weight, load_weight=cfg.router_load_weight,
                                  prefill_s_per_token=cfg.router_prefill_s_per_token,
                                  pool_load_s_per_token=cfg.router_pool_load_s_per_token)
        self.mode_override = ""
        self._sessions: dict[str, _Session] = {}
        self.inflight = InFlight(cfg.router_inflight_s)  # blocks sent to workers to compute, not yet indexed
        self._rr = 0
        # Cache-aware decisions over the telemetry window: prompt blocks, and those the chosen worker
        # held or could load from the pool (FingerprinterTelemetry.routed_hit_rate).
        self.routed_prompt_blocks = TimeWindow(cfg.telemetry_window_s)
        self.routed_cached_blocks = TimeWindow(cfg.telemetry_window_s)

    @property
    def mode(self) -> str:
        return self.mode_override or self.cfg.router_mode

    def endpoints(self) -> list[Endpoint]:
        """What the router listens to: the workers' liveness and load, the arbitrator's decisions."""
        return [Endpoint(subjects.heartbeat("worker"), self.on_heartbeat),
                Endpoint(subjects.telemetry("worker"), self.on_telemetry),
                Endpoint(subjects.DECISIONS, self.on_decision)]

    def num_live_workers(self) -> int:
        return len(self.live.view(time.monotonic()))

    def routed_hit_rate(self, now: float) -> float:
        prompt = self.routed_prompt_blocks.total(now)
        return self.routed_cached_blocks.total(now) / prompt if prompt else 0.0

    async def on_heartbeat(self, beat: Heartbeat) -> None:
        self.live.heartbeat(beat, time.monotonic())

    async def on_telemetry(self, t: WorkerTelemetry) -> None:
        self.live.telemetry(t, time.monotonic())

    async def on_decision(self, d: Decision) -> None:
        if d.action != "routing":
            return
        if d.weights is not None:
            knobs = dataclasses.replace(self.knobs, affinity_weight=d.weights.affinity, load_weight=d.weights.load)
            if knobs != self.knobs:
                log.info("routing weights affinity=%g load=%g (decision %s: %s)", knobs.affinity_weight,
                         knobs.load_weight, d.decision_id, d.reason)
                self.knobs = knobs
        mode = d.routing_mode if d.routing_mode in ROUTING_MODES else ""
        if mode != self.mode_override:
            log.info("routing mode %s (decision %s: %s)", mode or self.cfg.router_mode, d.decision_id, d.reason)
            self.mode_override = mode

    # --- dispatch -----------------------------------------------------------------------------------
    async def dispatch(self, request: TokenizedRequest, session_id: str = "",
                       headers: dict | None = None) -> Admission:
        """Send `request` to the chosen worker (or the queue group) and return its admission."""
        now = time.monotonic()
        route = await self._choose(request, session_id, now)
        worker_id, reason, pool_blocks = route.worker_id, route.reason, route.pool_blocks
        if pool_blocks >= 0:
            request = request.model_copy(update={"pool_blocks": pool_blocks})
        if worker_id:
            # Before the admission's round trip, so that the decisions taken meanwhile see this one's load
            # and blocks in flight (a burst decides while the first admissions are on their way). A
            # refusal takes the load back; its blocks stay in flight until KITE_ROUTER_INFLIGHT_S.
            self._reserve(worker_id, request, route, now)
            admission = await self._ask(subjects.worker_generate(worker_id), request, headers)
            if admission is None:  # nobody on its subject: it died or went to standby
                self.live.forget(worker_id)
                self.inflight.forget(worker_id)
            elif admission.accepted or (admission.error and admission.error.code not in _REFUSALS_TO_RETRY):
                ROUTED.labels(reason).inc()
                if admission.accepted:
                    self._bind_session(session_id, admission.worker_id or worker_id, request, now)
                else:
                    self.live.refused(worker_id, request.request_id)
                return admission
            else:
                self.live.refused(worker_id, request.request_id)
        ROUTED.labels("queue_group").inc()
        admission = await self._ask(subjects.WORKER_GENERATE, request, headers)
        if admission is None:
            return Admission(accepted=False, error=ErrorInfo(code="no_worker", message="No worker is available"))
        if admission.accepted:
            self._reserve(admission.worker_id, request, route, time.monotonic())  # any reservation above was refused
            self._bind_session(session_id, admission.worker_id, request, now)
        return admission

    async def _choose(self, request: TokenizedRequest, session_id: str, now: float) -> _Route:
        if self.mode == "queue_group":
            return _Route("", "queue_group")
        candidates = self.live.view(now)
        if not candidates:
            return _Route("", "queue_group")
        session_worker, session_blocks, sticks = "", 0, False
        if session_id:
            bound = self._sessions.get(session_id)
            state = candidates.get(bound.worker_id) if bound is not None and bound.expires > now else None
            if state is not None:
                session_worker, session_blocks, sticks = bound.worker_id, bound.num_blocks, session_sticks(state)
        local_blocks, pool_blocks = None, -1  # -1: the pool was not asked
        if self.mode == "cache_aware" and not sticks and len(candidates) > 1:
            if not request.block_hashes or not request.reuse:
                local_blocks = {}
            else:
                reply = await self.pool.lookup(request.model_fingerprint, request.block_hashes,
                                               include_workers=True, timeout_s=self.cfg.router_lookup_timeout_s)
                if reply is not None and not reply.invalidated:
                    local_blocks, pool_blocks = dict(reply.workers), reply.pool
                elif reply is None and self.inflight.leading(request.block_hashes, {}, now)[0]:
                    local_blocks = {}  # no answer in time: what this router sent to be computed still counts
                candidates = self.live.view(time.monotonic())  # with the reservations made meanwhile
        inflight, computing = {}, {}
        if local_blocks is not None and request.block_hashes and len(self.inflight):
            inflight, computing = self.inflight.leading(request.block_hashes, local_blocks, now)
        self._rr += 1
        knobs = self.knobs
        if knobs.prefill_s_per_token != (fleet_s := self.live.mean_prefill_s_per_token()):
            knobs = self.knobs = dataclasses.replace(knobs, prefill_s_per_token=fleet_s)
        choice = choose(candidates, RouteRequest(prompt_tokens=len(request.prompt_token_ids),
                                                 block_size=request.block_size, session_worker=session_worker,
                                                 session_blocks=session_blocks, local_blocks=local_blocks,
                                                 pool_blocks=max(0, pool_blocks), inflight_blocks=inflight,
                                                 computing_blocks=computing),
                        knobs, self.mode, rr_counter=self._rr)
        held = known_held(local_blocks, inflight, session_worker, session_blocks, sticks)
        if choice is None:
            return _Route("", "queue_group", pool_blocks, held, computing)
        log.debug("route %s -> %s (%s) costs=%s", request.request_id, choice.worker_id, choice.reason, choice.costs)
        if local_blocks is not None and request.block_hashes:
            chosen = candidates.get(choice.worker_id)
            cached = max(local_blocks.get(choice.worker_id, 0), inflight.get(choice.worker_id, 0))
            if chosen.reads_pool:
                cached = max(cached, pool_blocks)
            self.routed_prompt_blocks.add(now, len(request.block_hashes))
            self.routed_cached_blocks.add(now, cached)
        return _Route(choice.worker_id, choice.reason, pool_blocks, held, computing)

    def _reserve(self, worker_id: str, request: TokenizedRequest, route: _Route, now: float) -> None:
        """`worker_id` gets `request`. What it will compute (past the blocks it holds, is computing already
        for others, or loads) is in flight there, and is its pending load until the worker's telemetry
        names the request: the prompt tokens it adds to the worker's prefill queue, as the telemetry's
        `prefill_backlog_tokens` counts them from then on."""
        first = 0
        if request.block_hashes and request.reuse:
            if route.held is not None:  # else the pool did not answer: all of it, as far as the router knows
                state = self.live.view(time.monotonic()).get(worker_id)  # not `now`: an older time rebuilds it
                first = max(route.held.get(worker_id, 0),
                            route.pool_blocks if state is None or state.reads_pool else 0)
            if self.inflight.ttl_s > 0 and self.mode == "cache_aware":
                self.inflight.sent(worker_id, request.block_hashes, first, now)
        shared = route.computing.get(worker_id, 0)
        skipped = max(first, shared) * request.block_size
        self.live.sent(worker_id, request.request_id, max(0, len(request.prompt_token_ids) - skipped), time.time())

    def _bind_session(self, session_id: str, worker_id: str, request: TokenizedRequest, now: float) -> None:
        if session_id:
            self._sessions[session_id] = _Session(worker_id, now + self.cfg.router_session_ttl_s,
                                                  len(request.block_hashes))
            if len(self._sessions) > 100_000:  # bound memory: drop expired bindings
                self._sessions = {k: v for k, v in self._sessions.items() if v.expires > now}

    async def _ask(self, subject: str, request: TokenizedRequest, headers: dict | None) -> Admission | None:
        """The worker's admission; None when nobody listens on `subject`."""
        try:
            reply = await self.nc.request(subject, request.encode(), timeout=self.worker_timeout_s,
                                          headers=headers or None)
        except NoRespondersError:
            return None
        except NatsTimeoutError:
            return Admission(accepted=False, error=ErrorInfo(
                code="worker_timeout", message="No worker accepted the request in time"))
        try:
            return Admission.decode(reply.data)
        except MessageError as exc:
            log.error("worker sent an invalid admission: %s", exc)
            return Admission(accepted=False, error=ErrorInfo(code="internal_error", message="invalid worker reply"))
