"""The arbitrator service: the NATS side of the arbitrator (docs/arbitrator.md).

Boundary: what to decide lives in `core.ArbitratorCore` (pure) and `rules.py` (the YAML schema); this
module only decodes telemetry and admin requests, hands them to the core, publishes the decisions it
returns, re-reads the rules file and writes the decision log. The entrypoint (`__main__.py`) only wires
config, the connection and this class.

Telemetry triggers an evaluation at once, or, when one is already scheduled, joins it: evaluations keep a
pause of three times their own duration between them, so a large fleet's telemetry (1,000 messages a
second) cannot keep the arbitrator busy evaluating (decision latency = telemetry received -> decision
published, measured here and reported by the admin `status` op and
`kite_arbitrator_decision_latency_seconds`); a timer evaluates every KITE_ARBITRATOR_EVAL_INTERVAL_S too
(staleness, `for_s` conditions). The rules file is re-read when it changes (checked every second) or on
the admin op `reload`; a bad file is rejected, logged, and the previous rules stay. Every decision is
re-announced every 5 s with `refresh=True`, so a service that restarts converges without the arbitrator
keeping per-subscriber state.

Replicas: any number may run; one leads (kite_shared.lease: a JetStream key-value lease of
KITE_ARBITRATOR_LEASE_S). Every replica takes in heartbeats and telemetry, so its view is warm; only the
leader evaluates, publishes decisions and serves the admin subject. A follower adopts the leader's routing
mode override from the decisions it sees, so a takeover keeps it. When the leader drains it releases the
lease and another replica leads at its next renewal (a third of the lease); when it dies, within the lease
plus a third. A new leader publishes every decision at once (its decisions start empty).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from collections import deque
from pathlib import Path

from prometheus_client import Counter as MetricCounter, Histogram

from kite_shared import subjects
from kite_shared.config import ArbitratorConfig
from kite_shared.endpoints import Endpoint, Refusal
from kite_shared.lease import LeaderLease
from kite_shared.messages import (ROUTING_MODES, AnyTelemetry, ArbitratorAdminReply,
                                  ArbitratorAdminRequest, ArbitratorTelemetry, Decision, ErrorInfo, Heartbeat,
                                  ShadowCheckResult)
from kite_shared.service import ServiceRuntime
from kite_shared.window import TimeWindow
from kite_arbitrator.core import ArbitratorCore
from kite_arbitrator.quarantine import QuarantineBook
from kite_arbitrator.quarantine_store import QuarantineStore
from kite_arbitrator.rules import DEFAULT_RULES_PATH, RulesError, load_rules, parse_rules

log = logging.getLogger("kite_arbitrator")
decision_log = logging.getLogger("kite_arbitrator.decisions")

RECEIVED = MetricCounter("kite_arbitrator_messages_total", "Messages the arbitrator received, by kind",
                         ["kind"])
DECISIONS = MetricCounter("kite_arbitrator_decisions_total", "Decisions published, by kind", ["kind"])
LATENCY = Histogram("kite_arbitrator_decision_latency_seconds", "Telemetry received -> decision published",
                    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.017, 0.025, 0.05, 0.1))
RELOADS = MetricCounter("kite_arbitrator_rules_reloads_total", "Rules file loads, by outcome", ["outcome"])

REFRESH_INTERVAL_S = 5.0
# Telemetry-driven evaluations spend at most 1 / (1 + this) of a core: after an evaluation of d seconds
# the next waits 3 d (kite_arbitrator.service.ArbitratorService._evaluate_after_telemetry).
EVALUATION_PAUSE_FACTOR = 3.0
RULES_POLL_S = 1.0


class ArbitratorService:
    def __init__(self, rt: ServiceRuntime, cfg: ArbitratorConfig) -> None:
        self.rt = rt
        self.cfg = cfg
        self.rules_path = Path(cfg.rules_file) if cfg.rules_file else DEFAULT_RULES_PATH
        try:
            rules, version = load_rules(self.rules_path)
        except RulesError as exc:  # no previous rules yet: the built-in ones
            log.error("rules rejected, using the built-in default rules: %s", exc)
            RELOADS.labels("rejected").inc()
            rules, version = load_rules(None)
        self._rules_stamp = self._stamp()
        self.core = ArbitratorCore(rules=rules, rules_version=version, min_hold_s=cfg.min_hold_s,
                                   stale_s=cfg.stale_s, ttft_slo_s=cfg.ttft_slo_s,
                                   min_active_workers=cfg.min_active_workers, started_at=time.time())
        self.core.set_rules(rules, version, time.time())
        self.quarantine = QuarantineBook(cfg.quarantine_divergences)
        self.quarantine_store = QuarantineStore(rt.nc)
        self.live: dict[str, Heartbeat] = {}
        self.latencies: deque[float] = deque(maxlen=10_000)  # seconds, telemetry -> decision published
        # Over the telemetry window (ArbitratorTelemetry): one sample per decision published, in ms.
        self.recent_latencies_ms = TimeWindow(cfg.telemetry_window_s)
        self.lease = LeaderLease(rt.nc, "arbitrator", rt.instance_id, cfg.lease_s)
        self.leader = False
        self._admin_subscriptions: list = []
        self._evaluation: asyncio.Future | None = None  # the evaluation telemetry scheduled, if any
        self._next_evaluation_at = 0.0  # perf_counter: evaluations keep a pause after each other

    async def start(self) -> None:
        await self.rt.serve(
            Endpoint(subjects.HEARTBEAT_WILDCARD, self.on_heartbeat),
            Endpoint(subjects.TELEMETRY_WILDCARD, self.on_telemetry),
            Endpoint(subjects.DECISIONS, self.on_decision),
            Endpoint(subjects.SHADOW_RESULTS, self.on_shadow_result))
        await self._keep_lease()  # lead at once when no other replica does
        self.rt.every(self.lease.renew_interval_s, self._keep_lease, "arbitrator leader lease")
        self.rt.every(self.cfg.eval_interval_s, self._evaluate, "periodic evaluation")
        self.rt.every(RULES_POLL_S, self._reload_if_changed, "rules file check")
        self.rt.every(REFRESH_INTERVAL_S, self._refresh, "decision refresh")
        self.rt.publish_every(self.cfg.telemetry_interval_s, subjects.telemetry("arbitrator"), self.telemetry)
        self.rt.on_drain(self._resign)
        self._write_log()

    # --- leadership ---------------------------------------------------------------------------------
    async def _keep_lease(self) -> None:
        leader = await self.lease.hold()
        if leader == self.leader:
            return
        self.leader = leader
        if leader:
            log.info("leading the arbitrators (lease %.1f s)", self.cfg.lease_s)
            self._admin_subscriptions = await self.rt.serve(Endpoint(subjects.ARBITRATOR_ADMIN, self.admin))
            for decision in await self.quarantine_store.load():  # kept across every replica's restart
                self.quarantine.adopt(decision)
            await self._quarantine_due()  # what crossed the threshold while nobody led
            await self._evaluate()
            await self._publish(self.quarantine.current())
        else:
            log.warning("another arbitrator leads now: following")
            for subscription in self._admin_subscriptions:
                await subscription.unsubscribe()
            self._admin_subscriptions = []
            self.core.current.clear()  # should this replica lead again, it announces everything anew

    async def _resign(self) -> None:
        self.leader = False
        await self.lease.resign()

    async def on_decision(self, d: Decision) -> None:
        """A follower keeps the leader's routing mode override and quarantines, so a takeover keeps them."""
        if self.leader:
            return
        if d.action == "routing":
            self.core.routing_mode_override = d.routing_mode
        self.quarantine.adopt(d)

    async def on_shadow_result(self, result: ShadowCheckResult) -> None:
        """Every replica counts shadow checks (a new leader knows the history); the leader quarantines."""
        RECEIVED.labels(result.KIND).inc()
        self.quarantine.observe(result)
        if self.leader:
            await self._quarantine_due()

    async def _quarantine_due(self) -> None:
        for decision in self.quarantine.due():
            log.error("quarantining namespace %s (%s): %s", decision.namespace, decision.target[:16],
                      decision.reason)
            await self._publish([decision])
            await self.quarantine_store.save(decision)

    async def on_heartbeat(self, beat: Heartbeat) -> None:
        if beat.instance_id not in self.live:
            log.info("new %s instance %s", beat.service, beat.instance_id)
        self.live[beat.instance_id] = beat
        RECEIVED.labels("heartbeat").inc()

    async def on_telemetry(self, telemetry: AnyTelemetry) -> None:
        received = time.perf_counter()
        RECEIVED.labels(telemetry.KIND).inc()
        if isinstance(telemetry, ArbitratorTelemetry):
            return  # an arbitrator's own report: nothing to decide on
        self.core.observe(telemetry, time.time())
        if not self.leader:
            return
        if self._evaluation is not None and not self._evaluation.done():
            return  # one is scheduled: it will see this message too
        self._evaluation = asyncio.ensure_future(self._evaluate_after_telemetry(received))

    async def _evaluate_after_telemetry(self, received: float) -> None:
        """Evaluate for the telemetry received at `received` (perf_counter), and for any that arrives before
        this evaluation runs. An evaluation walks every worker (16 ms at 1,000 workers, measured by
        `kite simulate`) and a fleet sends that many messages a second, so evaluating on each would need
        16 CPU-seconds a second: evaluations wait EVALUATION_PAUSE_FACTOR times the last one's duration
        after it (a fraction of a millisecond for a small fleet, so decisions still follow at once)."""
        await asyncio.sleep(max(0.0, self._next_evaluation_at - time.perf_counter()))
        started = time.perf_counter()
        published = await self._publish(self.core.evaluate(time.time()))
        finished = time.perf_counter()
        self._next_evaluation_at = finished + EVALUATION_PAUSE_FACTOR * (finished - started)
        if published:
            seconds = finished - received
            self.latencies.append(seconds)
            self.recent_latencies_ms.add(time.monotonic(), 1000 * seconds)
            LATENCY.observe(seconds)

    def telemetry(self) -> ArbitratorTelemetry:
        now = time.monotonic()
        return ArbitratorTelemetry(
            instance_id=self.rt.instance_id, rules_version=self.core.rules_version,
            num_decisions=self.recent_latencies_ms.count(now),
            decision_latency_p50_ms=round(self.recent_latencies_ms.percentile(now, 0.5), 3),
            decision_latency_p99_ms=round(self.recent_latencies_ms.percentile(now, 0.99), 3),
            num_sources=self.core.num_sources(time.time()), stale=self.core.stale, leader=self.leader)

    async def _publish(self, decisions) -> int:
        for d in decisions:
            try:
                await self.rt.nc.publish(subjects.DECISIONS, d.encode())
                DECISIONS.labels(d.action).inc()
            except Exception as exc:  # reconnecting: the periodic refresh re-announces it
                log.warning("decision %s not published: %s", d.decision_id, exc)
        self._write_log()
        return len(decisions)

    def _write_log(self) -> None:
        for entry in self.core.take_log():  # the structured decision log: one JSON object per change
            decision_log.info("%s", json.dumps(entry, sort_keys=True, default=str))

    async def _evaluate(self) -> None:
        if self.leader:
            await self._publish(self.core.evaluate(time.time()))

    async def _refresh(self) -> None:
        if not self.leader:
            return
        for d in self.core.current_decisions() + self.quarantine.current():
            await self.rt.nc.publish(subjects.DECISIONS, d.model_copy(update={"refresh": True}).encode())

    # --- rules ------------------------------------------------------------------------------------
    def _stamp(self) -> str:
        try:
            return hashlib.sha256(self.rules_path.read_bytes()).hexdigest()
        except OSError:
            return ""

    def reload(self) -> tuple[bool, str]:
        """Load the rules file; (ok, message). A bad file changes nothing."""
        self._rules_stamp = self._stamp()
        try:
            rules, version = parse_rules(self.rules_path.read_text(), str(self.rules_path))
        except (RulesError, OSError) as exc:
            RELOADS.labels("rejected").inc()
            message = f"rules rejected, keeping version {self.core.rules_version}: {exc}"
            log.error("%s", message)
            decision_log.info("%s", json.dumps({"at": round(time.time(), 3), "event": "rules_rejected",
                                                "error": str(exc), "kept": self.core.rules_version}))
            return False, message
        RELOADS.labels("loaded").inc()
        if version != self.core.rules_version:
            self.core.set_rules(rules, version, time.time())
            log.info("rules %s loaded from %s (%d rules)", version, self.rules_path, len(rules.rules))
        return True, f"rules {version} active"

    async def _reload_if_changed(self) -> None:
        if self._stamp() != self._rules_stamp:
            self.reload()
            await self._evaluate()

    # --- admin --------------------------------------------------------------------------------------
    async def admin(self, req: ArbitratorAdminRequest) -> ArbitratorAdminReply:
        ok, error = True, ""
        if req.op == "reload":
            ok, message = self.reload()
            error = "" if ok else message
            await self._publish(self.core.evaluate(time.time()))
        elif req.op == "set_routing_mode":
            if req.routing_mode and req.routing_mode not in ROUTING_MODES:
                raise Refusal(ErrorInfo(code="invalid_routing_mode", param="routing_mode",
                                        message=f"unknown routing mode {req.routing_mode!r}; "
                                                f"one of {', '.join(ROUTING_MODES)}"))
            await self._publish(self.core.set_routing_mode(req.routing_mode, time.time()))
        elif req.op == "clear_quarantine":
            cleared = self.quarantine.clear(req.model_fingerprint)
            if not cleared:
                raise Refusal(ErrorInfo(code="not_quarantined", param="model_fingerprint",
                                        message=f"no quarantine in force for {req.model_fingerprint!r}"))
            log.warning("quarantine of %s lifted by an operator", cleared[0].namespace)
            await self._publish(cleared)
            await self.quarantine_store.remove(req.model_fingerprint)
        samples = sorted(self.latencies)

        def pct(q: float) -> float:
            return round(1000 * samples[min(len(samples) - 1, int(q * len(samples)))], 3) if samples else 0.0
        return ArbitratorAdminReply(
            ok=ok, error=error, rules_version=self.core.rules_version, rules_source=str(self.rules_path),
            current=[d for d, _ in self.core.current.values()] + self.quarantine.current(),
            decision_latency_p50_ms=pct(0.5),
            decision_latency_p99_ms=pct(0.99), decision_latency_samples=len(samples),
            activation_latencies_s=dict(self.core.activation_latencies), stale=self.core.stale)
