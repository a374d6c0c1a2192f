"""The arbitrator's decision core: telemetry in, decisions out. Pure (no NATS, the clock is passed in).

Every evaluation (on each telemetry message and every KITE_ARBITRATOR_EVAL_INTERVAL_S):
1. Staleness: telemetry older than `stale_s` is ignored. With no fresh worker telemetry at all (after the
   first `stale_s` of the arbitrator's life), the static safe policy of the rules file applies, once,
   logged with reason "telemetry stale"; fresh telemetry ends it.
2. Signals: per worker (WORKER_SIGNALS) and over the fleet (FLEET_SIGNALS), see rules.py.
3. For each action, the highest-priority rule whose conditions hold (continuously for its `for_s`) wins;
   else the file's defaults. Fleet actions: admission, routing weights, warm capacity (activate N
   standby workers / return N idle workers to standby). Worker action: the Upcycle write policy.
4. Hysteresis: a (kind, target) whose decision changed less than `min_hold_s` ago keeps it (the change is
   retried at the next evaluation). Entering and leaving the safe policy, and admin overrides, bypass
   the hold: they are safety and operator actions.
Each change is a telemetry.Decision with a reason (rule name + the conditions that held) and a
structured log entry (`log` list, drained by the service).

Cost (issue 38): an evaluation does not rescan the fleet. The fleet's signals come from a per-worker view
updated on each observe (worker_view.py); the per-worker rules are judged only for the workers that can
decide differently than at their last judgment: new telemetry, a warm-capacity change pending or ended, a
rule's `for_s` or a held change's `min_hold_s` running out (a heap of wake-up times). Everything is judged
again after stale telemetry, new rules or parameters, time going back, or `current` changed from outside
(its size differs from the last evaluation's). The decisions are those of a full rescan, bit for bit:
tests/unit/test_arbitrator_incremental.py checks them against the previous core on seeded traces.
Assumes worker ids other than "*" (the fleet rules' target) and a clock that moves forward (going back
costs one rebuild).
"""

from __future__ import annotations

import heapq
import itertools
import math
import operator
import os
import statistics
from dataclasses import dataclass, field

from kite_shared.messages import (AnyTelemetry, Decision, FingerprinterTelemetry, GatewayTelemetry,
                                  PoolTelemetry, WorkerTelemetry)
from kite_arbitrator.rules import Rule, RuleSet
from kite_arbitrator.worker_view import WorkerView

# a standby/active change is assumed lost if the worker's telemetry has not confirmed it by then
_WARM_CONFIRM_S = 5.0

# The WorkerTelemetry fields each worker signal is computed from (worker_signals): new telemetry makes a
# worker's rules worth judging again only when a field some worker rule reads has changed.
SIGNAL_FIELDS = {
    "queue_depth": ("queue_depth",), "num_running": ("num_running",),
    "utilization": ("num_running", "queue_depth", "max_running"), "running_tokens": ("running_tokens",),
    "prefill_backlog_tokens": ("prefill_backlog_tokens",), "cache_fill": ("cache_bytes", "cache_capacity_bytes"),
    "memory_used_fraction": ("memory_used_fraction",), "local_hit_rate": ("local_hit_rate",),
    "prefill_tokens_per_s": ("prefill_tokens_per_s",), "decode_tokens_per_s": ("decode_tokens_per_s",),
    "ttft_p50_s": ("ttft_p50_s",), "ttft_p99_s": ("ttft_p99_s",),
    "predicted_ttft_s": ("prefill_backlog_tokens", "prefill_tokens_per_s"),
    "ttft_over_slo": ("prefill_backlog_tokens", "prefill_tokens_per_s"), "healthy": ("healthy",),
    "standby": ("standby",),
}


def _service_signals(gateways: dict, pools: dict, fingerprinters: dict) -> dict[str, float]:
    """The fleet signals of the gateways, pool replicas and fingerprinters (few, so always recomputed)."""
    replicas = list(pools.values())  # ru-pool replicas share warm and cold; each has its own hot tier
    routers = list(fingerprinters.values())
    routed_rate = sum(f.request_rate for f in routers)
    return {
        "request_rate": sum(g.request_rate for g in gateways.values()),
        "error_rate": max((g.error_rate for g in gateways.values()), default=0.0),
        "pool_replicas": len(replicas),
        "pool_hot_fill": max((p.hot_fill for p in replicas), default=0.0),
        "pool_hit_rate": statistics.fmean([p.hit_rate for p in replicas]) if replicas else 0.0,
        "pool_tiers_down": max((sum(1 for t in p.tiers.values() if not t.up) for p in replicas), default=0),
        "routed_hit_rate": (sum(f.routed_hit_rate * f.request_rate for f in routers) / routed_rate
                            if routed_rate else 0.0),
        "fingerprinter_refused_rate": max((f.refused_rate for f in routers), default=0.0),
    }


@dataclass
class _Seen:
    message: object
    at: float  # arbitrator clock when received


@dataclass
class ArbitratorCore:
    rules: RuleSet
    rules_version: str = ""
    min_hold_s: float = 1.0
    stale_s: float = 3.0
    ttft_slo_s: float = 2.0
    min_active_workers: int = 1
    started_at: float = 0.0
    workers: dict[str, _Seen] = field(default_factory=dict)
    gateways: dict[str, _Seen] = field(default_factory=dict)
    pools: dict[str, _Seen] = field(default_factory=dict)
    fingerprinters: dict[str, _Seen] = field(default_factory=dict)
    current: dict[tuple[str, str], tuple[Decision, float]] = field(default_factory=dict)
    log: list[dict] = field(default_factory=list)  # structured decision log, drained by the service
    stale: bool = False
    routing_mode_override: str = ""
    activation_latencies: dict[str, float] = field(default_factory=dict)  # worker -> its last activation's
    _activations_seen: dict[str, str] = field(default_factory=dict)  # worker -> that activation's decision id
    _since: dict[tuple[str, str], float] = field(default_factory=dict)  # (rule, target) -> true since
    _warm_pending: dict[str, tuple[bool, float]] = field(default_factory=dict)  # worker -> (standby, at)
    _ids: itertools.count = field(default_factory=lambda: itertools.count(1))
    _nonce: str = field(default_factory=lambda: os.urandom(3).hex())
    num_judged: int = 0  # per-worker rule judgments over the core's life (a full rescan: fresh workers each time)
    _view: WorkerView = field(default_factory=WorkerView)
    _dirty: set[str] = field(default_factory=set)  # workers to judge at the next evaluation
    _wakes: list[tuple[float, str]] = field(default_factory=list)  # (time, worker): judge again then
    _wake_at: dict[str, float] = field(default_factory=dict)  # worker -> its earliest pending wake-up
    _judge_all: bool = True  # the next evaluation judges every fresh worker
    _seen_rules: RuleSet | None = None  # `rules` at the last evaluation (identity: RuleSet equality is deep)
    _seen_params: tuple = ()  # (min_hold_s, ttft_slo_s) at the last evaluation
    _num_current: int = 0  # len(current) after the last evaluation
    _inputs: dict[str, tuple] = field(default_factory=dict)  # worker -> what its rules read, last telemetry
    _inputs_of: tuple = (None, None)  # (rules, getter of the fields the worker rules read)

    # --- inputs ----------------------------------------------------------------------------------
    def observe(self, message: AnyTelemetry, now: float) -> None:
        """Take one telemetry message into the view (an arbitrator's own telemetry is not an input)."""
        if isinstance(message, WorkerTelemetry):
            wid = message.instance_id
            if message.draining:
                self.workers.pop(wid, None)
                self._view.drop(wid)
                return
            self.workers[wid] = _Seen(message, now)
            # Judged again at the next evaluation only when what its rules read changed, or when it was
            # not fresh at the last evaluation (its rules were not judged while it was stale).
            inputs = self._rule_inputs(message)
            if not self._view.is_fresh(wid) or self._inputs.get(wid) != inputs:
                self._dirty.add(wid)
            self._inputs[wid] = inputs
            self._view.observe(wid, message, now)
            pending = self._warm_pending.get(message.instance_id)
            if pending is not None and pending[0] == message.standby:
                del self._warm_pending[message.instance_id]
                self._dirty.add(wid)
            # Each activation once: a worker reports its last one in every telemetry message.
            if message.activation_latency_s is not None and \
                    self._activations_seen.get(message.instance_id) != message.activation_decision_id:
                self._activations_seen[message.instance_id] = message.activation_decision_id
                self.activation_latencies[message.instance_id] = message.activation_latency_s
                self._log(now, "activation_measured", target=message.instance_id,
                          decision_id=message.activation_decision_id,
                          latency_s=round(message.activation_latency_s, 4))
        elif isinstance(message, GatewayTelemetry):
            self.gateways[message.instance_id] = _Seen(message, now)
        elif isinstance(message, PoolTelemetry):
            self.pools[message.instance_id] = _Seen(message, now)
        elif isinstance(message, FingerprinterTelemetry):
            self.fingerprinters[message.instance_id] = _Seen(message, now)

    def num_sources(self, now: float) -> int:
        """Service instances whose telemetry is fresh (ArbitratorTelemetry.num_sources)."""
        return sum(len(self._fresh(seen, now)) for seen in
                   (self.workers, self.gateways, self.pools, self.fingerprinters))

    def set_rules(self, rules: RuleSet, version: str, now: float) -> None:
        self.rules, self.rules_version = rules, version
        self._since.clear()
        self._judge_all = True
        self._log(now, "rules_loaded", version=version, rules=[r.name for r in rules.rules])

    def set_routing_mode(self, mode: str, now: float) -> list[Decision]:
        self.routing_mode_override = mode
        return self.evaluate(now, force=("routing", "*"))

    # --- signals ---------------------------------------------------------------------------------
    def _fresh(self, seen: dict[str, _Seen], now: float) -> dict[str, object]:
        return {k: s.message for k, s in seen.items() if now - s.at <= self.stale_s}

    def worker_signals(self, t: WorkerTelemetry) -> dict[str, float]:
        predicted = t.prefill_backlog_tokens / t.prefill_tokens_per_s if t.prefill_tokens_per_s > 0 else 0.0
        return {
            "queue_depth": t.queue_depth, "num_running": t.num_running,
            "utilization": (t.num_running + t.queue_depth) / max(1, t.max_running),
            "running_tokens": t.running_tokens, "prefill_backlog_tokens": t.prefill_backlog_tokens,
            "cache_fill": t.cache_bytes / t.cache_capacity_bytes if t.cache_capacity_bytes else 0.0,
            "memory_used_fraction": t.memory_used_fraction,
            "local_hit_rate": t.local_hit_rate, "prefill_tokens_per_s": t.prefill_tokens_per_s,
            "decode_tokens_per_s": t.decode_tokens_per_s, "ttft_p50_s": t.ttft_p50_s,
            "ttft_p99_s": t.ttft_p99_s, "predicted_ttft_s": predicted,
            "ttft_over_slo": predicted / self.ttft_slo_s, "healthy": float(t.healthy),
            "standby": float(t.standby),
        }

    def fleet_signals(self, workers: dict[str, WorkerTelemetry], gateways: dict, pools: dict,
                      fingerprinters: dict | None = None) -> dict[str, float]:
        active = [w for w in workers.values() if not w.standby and w.healthy]
        per = {w.instance_id: self.worker_signals(w) for w in active}
        predicted = min((s["predicted_ttft_s"] for s in per.values()), default=0.0)
        queue = sum(w.queue_depth for w in active)
        slots = sum(max(1, w.max_running) for w in active)
        return {
            "active_workers": len(active),
            "standby_workers": sum(1 for w in workers.values() if w.standby and w.healthy),
            "total_queue_depth": queue,
            "mean_queue_depth": queue / len(active) if active else 0.0,
            "utilization": sum(w.num_running + w.queue_depth for w in active) / slots if slots else 0.0,
            "predicted_ttft_s": predicted, "ttft_over_slo": predicted / self.ttft_slo_s,
            "ttft_p99_s": max((w.ttft_p99_s for w in active), default=0.0),
            "max_cache_fill": max((self.worker_signals(w)["cache_fill"] for w in workers.values()), default=0.0),
            "mean_local_hit_rate": statistics.fmean([w.local_hit_rate for w in active]) if active else 0.0,
            **_service_signals(gateways, pools, fingerprinters or {}),
        }

    def _winner(self, rules: list[Rule], action: str, signals: dict[str, float], target: str,
                now: float) -> tuple[Rule, str] | None:
        winner = None  # every rule's `for_s` clock is updated, not only up to the winner
        for rule in rules:
            if getattr(rule.then, action) is None:
                continue
            held = rule.matches(signals)
            key = (rule.name, target)
            if held is None:
                self._since.pop(key, None)
                continue
            since = self._since.setdefault(key, now)
            if winner is None and now - since >= rule.for_s:
                winner = rule, held if not rule.for_s else f"{held} for {now - since:.0f} s"
        return winner

    # --- evaluation --------------------------------------------------------------------------------
    def evaluate(self, now: float, force: tuple[str, str] | None = None) -> list[Decision]:
        """The decisions that change at `now` (see the module docstring); O(changed workers * log n)."""
        params = (self.min_hold_s, self.ttft_slo_s)
        if self.rules is not self._seen_rules or params != self._seen_params or \
                len(self.current) != self._num_current:
            self._seen_rules, self._seen_params = self.rules, params
            self._judge_all = True
        try:
            return self._evaluate(now, force)
        finally:
            self._num_current = len(self.current)

    def _evaluate(self, now: float, force: tuple[str, str] | None) -> list[Decision]:
        gateways = self._fresh(self.gateways, now)
        pools = self._fresh(self.pools, now)
        fingerprinters = self._fresh(self.fingerprinters, now)
        view = self._view
        if view.advance(now, self.stale_s, self.workers, 60 * self.stale_s):
            self._judge_all = True
        out: list[Decision] = []
        if not view.num_fresh and (self.workers or now - self.started_at >= self.stale_s):
            if not self.stale:
                self.stale = True
                self._log(now, "stale", reason="no fresh worker telemetry: static safe policy")
                safe = self.rules.safe_policy
                reason = f"telemetry stale (none fresher than {self.stale_s:g} s): static safe policy"
                for key in [k for k in self.current if k[0] == "write_policy"]:
                    del self.current[key]
                out += self._set("write_policy", "*", dict(write_policy=safe.write_policy), reason,
                                 "safe_policy", now, bypass_hold=True)
                out += self._set("admission", "*", dict(admit=safe.admission == "open",
                                                        retry_after_s=safe.retry_after_s), reason,
                                 "safe_policy", now, bypass_hold=True)
                out += self._set("routing", "*", dict(weights=safe.routing_weights,
                                                      routing_mode=self.routing_mode_override), reason,
                                 "safe_policy", now, bypass_hold=True)
            elif force == ("routing", "*"):
                out += self._set("routing", "*", dict(weights=self.rules.safe_policy.routing_weights,
                                                      routing_mode=self.routing_mode_override),
                                 "admin override of the routing mode", "admin", now, bypass_hold=True)
            return out
        was_stale, self.stale = self.stale, False
        if was_stale:
            self._log(now, "fresh", reason="worker telemetry is fresh again: rules apply")
            self.current.pop(("write_policy", "*"), None)
            self._judge_all = True
        fleet = self._fleet(gateways, pools, fingerprinters, {})
        fleet_rules = self.rules.ordered("fleet")
        defaults = self.rules.defaults

        # Warm capacity first: admission and routing then count a worker being activated (or put on
        # standby) as it will be, so the arbitrator does not shed load it has just added capacity for.
        out += self._warm_capacity(fleet, fleet_rules, now)
        if self._warm_pending:
            fleet = self._fleet(gateways, pools, fingerprinters, self._overrides())

        win = self._winner(fleet_rules, "admission", fleet, "*", now)
        admission = win[0].then.admission if win else defaults.admission
        retry = win[0].then.retry_after_s if win else defaults.retry_after_s
        reason = self._reason(win, "default admission")
        out += self._set("admission", "*", dict(admit=admission == "open", retry_after_s=retry,
                                                predicted_ttft_s=round(fleet["predicted_ttft_s"], 4)),
                         reason, win[0].name if win else "default", now, bypass_hold=was_stale)

        win = self._winner(fleet_rules, "routing_weights", fleet, "*", now)
        weights = win[0].then.routing_weights if win else defaults.routing_weights
        out += self._set("routing", "*", dict(weights=weights, routing_mode=self.routing_mode_override),
                         self._reason(win, "default routing weights") if force != ("routing", "*")
                         else "admin override of the routing mode",
                         "admin" if force == ("routing", "*") else win[0].name if win else "default", now,
                         bypass_hold=was_stale or force == ("routing", "*"))

        worker_rules = self.rules.ordered("worker")
        for wid in self._to_judge(now):
            t = self.workers[wid].message
            if wid in self._warm_pending:
                t = t.model_copy(update={"standby": self._warm_pending[wid][0]})
            signals = self.worker_signals(t)
            win = self._winner(worker_rules, "write_policy", signals, wid, now)
            policy = win[0].then.write_policy if win else defaults.write_policy
            out += self._set("write_policy", wid, dict(write_policy=policy),
                             self._reason(win, "default write policy"), win[0].name if win else "default",
                             now, bypass_hold=was_stale)
            self._schedule(wid, worker_rules, win, policy)
        return out

    # --- incremental bookkeeping -----------------------------------------------------------------------
    def _rule_inputs(self, t: WorkerTelemetry) -> tuple:
        """The telemetry fields the worker rules read (equal values: equal judgments)."""
        rules, getter = self._inputs_of
        if rules is not self.rules:
            names = sorted({f for r in self.rules.rules if r.scope == "worker" for s in r.when
                            for f in SIGNAL_FIELDS[s]})
            getter = operator.attrgetter(*names, "instance_id") if names else (lambda _: ())
            self._inputs_of = self.rules, getter
        return getter(t)

    def _to_judge(self, now: float) -> list[str]:
        """The fresh workers whose write policy may change at `now`, sorted (the order of a full rescan)."""
        view = self._view
        if self._judge_all:
            self._judge_all = False
            self._dirty.clear()
            wanted = view.fresh_ids()
        else:
            wanted = self._dirty
            self._dirty = set()
            wakes, wake_at = self._wakes, self._wake_at
            while wakes and wakes[0][0] <= now:
                at, wid = heapq.heappop(wakes)
                if wake_at.get(wid) == at:
                    del wake_at[wid]
                    wanted.add(wid)
            wanted = [wid for wid in wanted if view.is_fresh(wid)]
        self.num_judged += len(wanted)
        return sorted(wanted)

    def _schedule(self, wid: str, rules: list[Rule], win: tuple[Rule, str] | None, policy: str) -> None:
        """Wake `wid` up when its judgment can change with no new telemetry: a held rule above the winner
        reaching its `for_s`, or a change held back by `min_hold_s` becoming due. Early is harmless (the
        judgment is then what it was), late is not: the times are taken a little early."""
        wake = math.inf
        for rule in rules:
            if win is not None and rule is win[0]:
                break
            if rule.then.write_policy is None:
                continue
            since = self._since.get((rule.name, wid))
            if since is not None:  # held, not for long enough yet
                wake = min(wake, since + rule.for_s)
        decided = self.current.get(("write_policy", wid))
        if decided is not None and decided[0].write_policy != policy:
            wake = min(wake, decided[1] + self.min_hold_s)
        if wake == math.inf:
            return
        wake -= 1e-9 * max(1.0, abs(wake))
        if wake < self._wake_at.get(wid, math.inf):
            self._wake_at[wid] = wake
            heapq.heappush(self._wakes, (wake, wid))

    def _overrides(self) -> dict[str, bool]:
        return {wid: standby for wid, (standby, _) in self._warm_pending.items()}

    def _fleet(self, gateways: dict, pools: dict, fingerprinters: dict,
               overrides: dict[str, bool]) -> dict[str, float]:
        """`fleet_signals` over the fresh workers, with `overrides` (worker -> standby), from the view."""
        if self._view.num_odd:  # a NaN or -0.0 makes min/max/fmean depend on the order: rescan
            workers = {wid: s.message for wid, s in self.workers.items() if self._view.is_fresh(wid)}
            workers = {wid: (t.model_copy(update={"standby": overrides[wid]}) if wid in overrides else t)
                       for wid, t in workers.items()}
            return self.fleet_signals(workers, gateways, pools, fingerprinters)
        w = self._view.signals(overrides)
        predicted = w["predicted_ttft_s"]
        return {
            "active_workers": w["active_workers"],
            "standby_workers": w["standby_workers"],
            "total_queue_depth": w["total_queue_depth"],
            "mean_queue_depth": w["mean_queue_depth"],
            "utilization": w["utilization"],
            "predicted_ttft_s": predicted, "ttft_over_slo": predicted / self.ttft_slo_s,
            "ttft_p99_s": w["ttft_p99_s"],
            "max_cache_fill": w["max_cache_fill"],
            "mean_local_hit_rate": w["mean_local_hit_rate"],
            **_service_signals(gateways, pools, fingerprinters or {}),
        }

    def _warm_capacity(self, fleet: dict[str, float], rules: list[Rule], now: float) -> list[Decision]:
        for wid, (_, at) in list(self._warm_pending.items()):
            if now - at > _WARM_CONFIRM_S:
                del self._warm_pending[wid]
                self._dirty.add(wid)  # its standby signal is its telemetry's again

        out: list[Decision] = []
        win = self._winner(rules, "activate_standby", fleet, "*", now)
        if win is not None:
            idle = self._view.first_standby(win[0].then.activate_standby, self._overrides())
            for wid in idle:
                out += self._warm(wid, False, self._reason(win, ""), win[0].name, now)
        win = self._winner(rules, "scale_in", fleet, "*", now)
        if win is not None:
            overrides = self._overrides()
            room = max(0, self._view.num_active_with(overrides) - self.min_active_workers)
            for wid in self._view.first_idle(min(room, win[0].then.scale_in), overrides):
                out += self._warm(wid, True, self._reason(win, ""), win[0].name, now)
        return out

    def _warm(self, wid: str, standby: bool, reason: str, rule: str, now: float) -> list[Decision]:
        key = ("warm_capacity", wid)
        if key in self.current and now - self.current[key][1] < self.min_hold_s:
            return []  # hysteresis: no flip back within the hold
        decision = self._decision("warm_capacity", wid, dict(standby=standby), reason, rule, now)
        self.current[key] = (decision, now)
        self._warm_pending[wid] = (standby, now)
        self._dirty.add(wid)  # its standby signal changes
        self._log(now, "decision", **self._entry(decision, None))
        return [decision]

    # --- helpers -------------------------------------------------------------------------------------
    @staticmethod
    def _reason(win: tuple[Rule, str] | None, default: str) -> str:
        if win is None:
            return f"{default} (no rule matched)"
        rule, held = win
        return f"rule {rule.name} (priority {rule.priority}): {held}"

    def _decision(self, kind: str, target: str, values: dict, reason: str, rule: str, now: float) -> Decision:
        return Decision(decision_id=f"{self._nonce}-{next(self._ids)}", action=kind, target=target,
                        reason=reason, rule=rule, issued_at=now, **values)

    _COMPARED = {"write_policy": ("write_policy",), "admission": ("admit", "retry_after_s"),
                 "routing": ("weights", "routing_mode"), "warm_capacity": ("standby",)}

    def _set(self, kind: str, target: str, values: dict, reason: str, rule: str, now: float,
             bypass_hold: bool = False) -> list[Decision]:
        key = (kind, target)
        prev = self.current.get(key)
        if prev is not None:
            same = all(getattr(prev[0], f) == values.get(f, getattr(prev[0], f)) for f in self._COMPARED[kind])
            if same:
                return []
            if not bypass_hold and now - prev[1] < self.min_hold_s:
                return []  # hysteresis: retried at the next evaluation
        decision = self._decision(kind, target, values, reason, rule, now)
        self.current[key] = (decision, now)
        self._log(now, "decision", **self._entry(decision, prev[0] if prev else None))
        return [decision]

    def _entry(self, d: Decision, prev: Decision | None) -> dict:
        def value(x: Decision | None) -> object:
            if x is None:
                return None
            return {"write_policy": x.write_policy, "admission": "open" if x.admit else "shed",
                    "routing": {"weights": x.weights.model_dump() if x.weights else None,
                                "mode": x.routing_mode or "setting"},
                    "warm_capacity": "standby" if x.standby else "active"}[x.action]
        return {"decision_id": d.decision_id, "action": d.action, "target": d.target, "rule": d.rule,
                "reason": d.reason, "from": value(prev), "to": value(d)}

    def _log(self, now: float, event: str, **fields) -> None:
        self.log.append({"at": round(now, 3), "event": event, **fields})

    def take_log(self) -> list[dict]:
        entries, self.log = self.log, []
        return entries

    def current_decisions(self) -> list[Decision]:
        return [d for d, _ in self.current.values() if d.action != "warm_capacity"]
