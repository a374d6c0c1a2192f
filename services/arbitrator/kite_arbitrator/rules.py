"""The arbitrator's declarative rules: YAML schema (pydantic), validation, condition evaluation. Pure.

A rules file (docs/arbitrator.md; the built-in default is kite_arbitrator/default_rules.yaml):

    version: 1
    defaults:        {write_policy: write_through, admission: open, routing_weights: {affinity: 1, load: 1}}
    safe_policy:     {write_policy: selective, admission: open, routing_weights: {affinity: 1, load: 1}}
    rules:
      - name: shed-when-ttft-slo-at-risk
        scope: fleet                  # fleet: signals over the whole fleet; worker: one worker's signals
        priority: 100                 # for each action, the matching rule with the highest priority wins
        when: {ttft_over_slo: {gt: 1.0}}   # every comparison must hold (gt, gte, lt, lte, eq, ne)
        for_s: 0                      # ...continuously for this long
        then: {admission: shed, retry_after_s: 1}

Actions: `write_policy` (worker scope), `admission` + `retry_after_s`, `routing_weights`,
`activate_standby` (N standby workers), `scale_in` (N idle workers to standby) (fleet scope).
Unknown keys, unknown signals, actions in the wrong scope and duplicate names are errors, reported with
the rule's name, so a bad file is rejected whole (the arbitrator keeps the previous rules).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from kite_shared.messages import RoutingWeights, WritePolicy

WORKER_SIGNALS = {
    "queue_depth": "requests admitted and waiting for a slot",
    "num_running": "requests generating",
    "utilization": "(running + queued) / max running",
    "running_tokens": "KV positions held by running requests",
    "prefill_backlog_tokens": "admitted prompt tokens not computed yet",
    # Each engine reports what it can see: vLLM does not say how much of its paged cache its prefix cache
    # keeps, so a vLLM worker counts the KV of its generating requests (kite_worker/engines/vllm/engine.py).
    "cache_fill": "vLLM: KV of requests past their first token / KITE_VLLM_KV_CACHE_GIB (0 when idle, "
                  "whatever the prefix cache keeps); reference engine: local block cache bytes / "
                  "KITE_WORKER_CACHE_BYTES (an LRU: near 1 once warm)",
    "memory_used_fraction": "host memory in use (1 - MemAvailable / MemTotal): memory pressure",
    "local_hit_rate": "reused / prompt tokens over the telemetry window",
    "prefill_tokens_per_s": "measured prefill speed",
    "decode_tokens_per_s": "measured decode speed",
    "ttft_p50_s": "time to first token, median over the window",
    "ttft_p99_s": "time to first token, p99 over the window",
    "predicted_ttft_s": "prefill backlog / prefill speed: TTFT of a request admitted now",
    "ttft_over_slo": "predicted_ttft_s / KITE_ARBITRATOR_TTFT_SLO_S",
    "healthy": "1 when the engine runs and the worker is not draining",
    "standby": "1 for a warm standby worker",
}
FLEET_SIGNALS = {
    "active_workers": "workers with fresh telemetry taking traffic",
    "standby_workers": "warm standby workers with fresh telemetry",
    "total_queue_depth": "sum of queue depths over active workers",
    "mean_queue_depth": "total_queue_depth / active_workers",
    "utilization": "sum(running + queued) / sum(max running) over active workers",
    "predicted_ttft_s": "lowest predicted TTFT over active workers (where the router can send a request)",
    "ttft_over_slo": "predicted_ttft_s / KITE_ARBITRATOR_TTFT_SLO_S",
    "ttft_p99_s": "highest TTFT p99 over active workers",
    "max_cache_fill": "highest cache_fill over workers (what it measures depends on the engine)",
    "mean_local_hit_rate": "mean local hit rate over active workers",
    "request_rate": "API requests per second, summed over gateways",
    "error_rate": "highest fraction of 5xx answers over gateways",
    "pool_replicas": "ru-pool replicas with fresh telemetry",
    "pool_hot_fill": "highest hot tier bytes / capacity over ru-pool replicas",
    "pool_hit_rate": "ru-pool hit rate over every tier, mean over replicas",
    "pool_tiers_down": "most tiers down as seen by one ru-pool replica",
    "routed_hit_rate": "prompt blocks the chosen worker held or could load / prompt blocks, over "
                       "cache-aware routing decisions (fingerprinters, weighted by request rate)",
    "fingerprinter_refused_rate": "highest fraction of requests a fingerprinter refused (bad request, no "
                                  "worker, worker timeout)",
}


class Comparison(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    gt: float | None = None
    gte: float | None = None
    lt: float | None = None
    lte: float | None = None
    eq: float | None = None
    ne: float | None = None

    @model_validator(mode="after")
    def _one(self) -> "Comparison":
        if all(v is None for v in self.model_dump().values()):
            raise ValueError("a comparison needs at least one of gt, gte, lt, lte, eq, ne")
        return self

    def explain(self, name: str, value: float) -> str | None:
        """None when `value` fails a bound, else a description of what held."""
        ops = {"gt": (">", lambda a, b: a > b), "gte": (">=", lambda a, b: a >= b),
               "lt": ("<", lambda a, b: a < b), "lte": ("<=", lambda a, b: a <= b),
               "eq": ("==", lambda a, b: a == b), "ne": ("!=", lambda a, b: a != b)}
        parts = []
        for key, bound in self.model_dump().items():
            if bound is None:
                continue
            symbol, test = ops[key]
            if not test(value, bound):
                return None
            parts.append(f"{name}={value:.4g} {symbol} {bound:g}")
        return ", ".join(parts)


class Action(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    write_policy: WritePolicy | None = None
    admission: Literal["open", "shed"] | None = None
    retry_after_s: int = Field(default=1, ge=1, le=3600)
    routing_weights: RoutingWeights | None = None
    activate_standby: int | None = Field(default=None, ge=1)
    scale_in: int | None = Field(default=None, ge=1)

    def kinds(self) -> list[str]:
        return [k for k in ("write_policy", "admission", "routing_weights", "activate_standby", "scale_in")
                if getattr(self, k) is not None]


class Rule(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str = Field(min_length=1)
    scope: Literal["fleet", "worker"] = "fleet"
    priority: int = 0
    when: dict[str, Comparison] = Field(default_factory=dict)
    for_s: float = Field(default=0.0, ge=0)
    then: Action

    @model_validator(mode="after")
    def _check(self) -> "Rule":
        known = WORKER_SIGNALS if self.scope == "worker" else FLEET_SIGNALS
        unknown = sorted(set(self.when) - set(known))
        if unknown:
            raise ValueError(f"rule {self.name!r}: unknown {self.scope} signal(s) {unknown}; known: {sorted(known)}")
        kinds = self.then.kinds()
        if not kinds:
            raise ValueError(f"rule {self.name!r}: `then` has no action")
        if self.scope == "worker" and set(kinds) - {"write_policy"}:
            raise ValueError(f"rule {self.name!r}: a worker-scope rule can only set write_policy")
        if self.scope == "fleet" and "write_policy" in kinds:
            raise ValueError(f"rule {self.name!r}: write_policy is a worker-scope action")
        return self

    def matches(self, signals: dict[str, float]) -> str | None:
        """A description of the matched conditions, or None."""
        parts = []
        for name, comparison in self.when.items():
            held = comparison.explain(name, float(signals.get(name, 0.0)))
            if held is None:
                return None
            parts.append(held)
        return ", ".join(parts) or "always"


class Policy(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    write_policy: WritePolicy = "write_through"
    admission: Literal["open", "shed"] = "open"
    retry_after_s: int = Field(default=1, ge=1, le=3600)
    routing_weights: RoutingWeights = Field(default_factory=RoutingWeights)


class RuleSet(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    version: Literal[1] = 1
    defaults: Policy = Field(default_factory=Policy)
    safe_policy: Policy = Field(default_factory=lambda: Policy(write_policy="selective"))
    rules: list[Rule] = Field(default_factory=list)

    @model_validator(mode="after")
    def _unique(self) -> "RuleSet":
        names = [r.name for r in self.rules]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"duplicate rule names {dupes}")
        return self

    def ordered(self, scope: str) -> list[Rule]:
        return sorted((r for r in self.rules if r.scope == scope), key=lambda r: -r.priority)


class RulesError(ValueError):
    """A rules file that cannot be used; the message says where and why."""


DEFAULT_RULES_PATH = Path(__file__).with_name("default_rules.yaml")


def parse_rules(text: str, source: str = "<rules>") -> tuple[RuleSet, str]:
    """(rules, version) where version is a short SHA-256 of the text; RulesError on any problem."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise RulesError(f"{source}: not valid YAML: {exc}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise RulesError(f"{source}: the top level must be a mapping")
    try:
        rules = RuleSet.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'file'}: {e['msg']}" for e in exc.errors())
        raise RulesError(f"{source}: {problems}") from None
    return rules, hashlib.sha256(text.encode()).hexdigest()[:12]


def load_rules(path: str | Path | None) -> tuple[RuleSet, str]:
    source = Path(path) if path else DEFAULT_RULES_PATH
    try:
        text = source.read_text()
    except OSError as exc:
        raise RulesError(f"{source}: cannot read: {exc}") from None
    return parse_rules(text, str(source))
