"""The incremental arbitrator core (issue 38) decides exactly what the full-rescan core it replaced decided.

Seeded random traces of telemetry (workers joining, draining, going stale and coming back, standby flips,
memory pressure crossing the worker rules' thresholds, gateways, pools, fingerprinters), evaluations,
rules reloads, routing-mode overrides and a follower's `current.clear()` go through both cores; every
evaluation's decisions, the decision log and the cores' state must be identical. The oracle is
tests/unit/reference_cores.py (the core as it was). Also: `CostModel.plan` against the quadratic original.
"""

from __future__ import annotations

import random

import pytest

from kite_arbitrator.core import ArbitratorCore
from kite_arbitrator.rules import load_rules, parse_rules
from kite_shared.messages import (FingerprinterTelemetry, GatewayTelemetry, PoolTelemetry, TierStats,
                                  WorkerTelemetry)
from kite_worker.pool_loader import CostModel, TierEstimate
from tests.unit.reference_cores import ReferenceArbitratorCore, reference_plan

# Every action and scope, `for_s` on fleet and worker rules, and worker rules on signals that change often
# (queue, standby, TTFT) as well as memory pressure.
RULES = """
version: 1
defaults: {write_policy: write_through, admission: open, routing_weights: {affinity: 1, load: 1}}
safe_policy: {write_policy: selective, admission: open}
rules:
  - {name: shed, scope: fleet, priority: 100, when: {ttft_over_slo: {gt: 1.0}}, then: {admission: shed, retry_after_s: 2}}
  - {name: activate-slo, scope: fleet, priority: 95, when: {ttft_over_slo: {gt: 0.5}, standby_workers: {gte: 1}},
     then: {activate_standby: 2}}
  - {name: activate-busy, scope: fleet, priority: 90, when: {utilization: {gte: 0.8}, standby_workers: {gte: 1}},
     for_s: 1.5, then: {activate_standby: 1}}
  - {name: scale-in, scope: fleet, priority: 10, when: {utilization: {lte: 0.3}, active_workers: {gte: 2}},
     for_s: 2, then: {scale_in: 2}}
  - {name: load-heavy, scope: fleet, priority: 50, when: {mean_queue_depth: {gt: 1.5}},
     then: {routing_weights: {affinity: 0.5, load: 2.0}}}
  - {name: hits-low, scope: fleet, priority: 40, when: {mean_local_hit_rate: {lt: 0.3}, max_cache_fill: {gt: 0.5}},
     then: {routing_weights: {affinity: 2.0, load: 1.0}}}
  - {name: p99-high, scope: fleet, priority: 30, when: {ttft_p99_s: {gt: 1.5}, pool_hit_rate: {lt: 0.9}},
     for_s: 1, then: {routing_weights: {affinity: 1.0, load: 3.0}}}
  - {name: mem-off, scope: worker, priority: 100, when: {memory_used_fraction: {gte: 0.95}}, for_s: 1,
     then: {write_policy: "off"}}
  - {name: mem-selective, scope: worker, priority: 50, when: {memory_used_fraction: {gte: 0.85}},
     then: {write_policy: selective}}
  - {name: standby-off, scope: worker, priority: 70, when: {standby: {eq: 1}}, then: {write_policy: "off"}}
  - {name: queued-selective, scope: worker, priority: 60, when: {queue_depth: {gte: 3}, ttft_over_slo: {gt: 0.4}},
     for_s: 2.5, then: {write_policy: selective}}
"""


def _worker(rng: random.Random, wid: str, now: float) -> WorkerTelemetry:
    return WorkerTelemetry(
        instance_id=wid, sent_at=now, queue_depth=rng.choice([0, 0, 0, 1, 2, 3, 5]),
        num_running=rng.choice([0, 0, 1, 2, 4]), max_running=rng.choice([1, 4, 4, 8]),
        prefill_backlog_tokens=rng.choice([0, 0, 500, 1000, 3000, 9000]),
        prefill_tokens_per_s=rng.choice([0.0, 1000.0, 1000.0, 2500.0]),
        cache_bytes=rng.choice([0, 100, 600]), cache_capacity_bytes=rng.choice([0, 1000]),
        memory_used_fraction=rng.choice([0.2, 0.5, 0.86, 0.9, 0.96, 0.99]),
        local_hit_rate=rng.choice([0.0, 0.1, 1 / 3, 0.7, rng.random()]),
        ttft_p99_s=rng.choice([0.0, 0.4, 1.6, 3.0, rng.random() * 4]),
        healthy=rng.random() > 0.05, standby=rng.random() < 0.25, draining=rng.random() < 0.03,
        requests_accepted=rng.choice([0, 0, 3, 10, 11]),
        activation_decision_id=rng.choice(["", "x-1", "x-2"]),
        activation_latency_s=rng.choice([None, None, 0.5]))


_FIELDS = ["queue_depth", "num_running", "max_running", "prefill_backlog_tokens", "prefill_tokens_per_s",
           "cache_bytes", "cache_capacity_bytes", "memory_used_fraction", "local_hit_rate", "ttft_p99_s",
           "healthy", "standby", "draining", "requests_accepted", "activation_decision_id"]


def _other(rng: random.Random, now: float):
    kind = rng.randrange(3)
    if kind == 0:
        return GatewayTelemetry(instance_id=f"g{rng.randrange(2)}", sent_at=now, request_rate=rng.random() * 50,
                                error_rate=rng.choice([0.0, 0.1]))
    if kind == 1:
        return PoolTelemetry(instance_id=f"p{rng.randrange(2)}", sent_at=now, hot_fill=rng.random(),
                             hit_rate=rng.choice([0.5, 0.95]),
                             tiers={"hot": TierStats(up=rng.random() > 0.2), "warm": TierStats(up=True)})
    return FingerprinterTelemetry(instance_id=f"f{rng.randrange(2)}", sent_at=now,
                                  request_rate=rng.random() * 20, refused_rate=rng.choice([0.0, 0.2]),
                                  routed_hit_rate=rng.random())


def _state(c) -> tuple:
    return (sorted(c.current.items(), key=lambda kv: kv[0]), sorted(c._since.items()),
            sorted(c._warm_pending.items()), sorted(c.workers), c.stale, sorted(c.activation_latencies.items()))


def _run_trace(seed: int) -> tuple[int, int, int]:
    rng = random.Random(seed)
    rules, version = parse_rules(RULES) if seed % 4 else load_rules(None)
    other_rules, other_version = load_rules(None) if seed % 4 else parse_rules(RULES)
    kw = dict(rules_version=version, min_hold_s=rng.choice([0.0, 0.5, 1.0, 2.0]), stale_s=3.0,
              ttft_slo_s=2.0, min_active_workers=rng.choice([1, 2]), started_at=0.0)
    new, old = ArbitratorCore(rules=rules, **kw), ReferenceArbitratorCore(rules=rules, **kw)
    old._nonce = new._nonce
    ids = [f"w{i:02d}" for i in range(rng.choice([3, 8, 25, 60]))]
    now = 0.0
    num_decisions = num_evaluations = 0
    last: dict[str, WorkerTelemetry] = {}
    for _ in range(rng.choice([300, 600])):
        r = rng.random()
        if r < 0.55:
            wid = rng.choice(ids)
            message = _worker(rng, wid, now)
            if wid in last and rng.random() < 0.6:  # mostly one field changed, as real telemetry does
                name = rng.choice(_FIELDS)
                message = last[wid].model_copy(update={name: getattr(message, name), "sent_at": now})
            last[wid] = message
            new.observe(message, now), old.observe(message, now)
        elif r < 0.62:
            message = _other(rng, now)
            new.observe(message, now), old.observe(message, now)
        elif r < 0.93:
            got, want = new.evaluate(now), old.evaluate(now)
            assert got == want, f"seed {seed} at {now}"
            num_decisions += len(got)
            num_evaluations += 1
        elif r < 0.95:
            mode = rng.choice(["", "round_robin", "cache_aware"])
            assert new.set_routing_mode(mode, now) == old.set_routing_mode(mode, now)
        elif r < 0.96:
            rules, version, other_rules, other_version = other_rules, other_version, rules, version
            new.set_rules(rules, version, now), old.set_rules(rules, version, now)
        elif r < 0.97:
            new.current.clear(), old.current.clear()  # a replica that stops leading
        assert new.take_log() == old.take_log()
        assert _state(new) == _state(old)
        # Mostly small steps (several evaluations per telemetry interval), sometimes past stale_s,
        # past the forget delay (60 * stale_s), or, rarely, back in time.
        step = rng.random()
        now += (0.0 if step < 0.15 else rng.random() * 0.5 if step < 0.93 else rng.random() * 6
                if step < 0.985 else 200.0 if step < 0.995 else -rng.random() * 2)
    assert num_decisions > 0
    return num_decisions, num_evaluations, new.num_judged


@pytest.mark.parametrize("seed", range(30))
def test_incremental_core_decides_as_the_full_rescan(seed):
    _run_trace(seed)


def test_traces_exercise_every_kind_of_decision():
    """The traces above would prove little if they never reached the interesting decisions."""
    seen = set()
    for seed in range(30):
        rng = random.Random(seed)
        rules, version = parse_rules(RULES)
        c = ArbitratorCore(rules=rules, rules_version=version, min_hold_s=0.5, started_at=0.0)
        now = 0.0
        ids = [f"w{i:02d}" for i in range(8)]
        for _ in range(200):
            c.observe(_worker(rng, rng.choice(ids), now), now)
            for d in c.evaluate(now):
                seen.add((d.action, d.rule))
            now += rng.random() * 0.5
    wanted = {("admission", "shed"), ("warm_capacity", "activate-slo"), ("warm_capacity", "scale-in"),
              ("routing", "load-heavy"), ("write_policy", "mem-off"), ("write_policy", "mem-selective"),
              ("write_policy", "standby-off"), ("write_policy", "queued-selective")}
    assert wanted <= seen, wanted - seen


def test_an_evaluation_judges_only_the_workers_that_changed():
    rules, version = load_rules(None)
    c = ArbitratorCore(rules=rules, rules_version=version, started_at=0.0)
    for i in range(500):
        c.observe(WorkerTelemetry(instance_id=f"w{i:03d}", max_running=4), 0.0)
    c.evaluate(0.0)
    assert c.num_judged == 500  # the first evaluation judges everyone
    c.observe(WorkerTelemetry(instance_id="w007", max_running=4, memory_used_fraction=0.9), 1.5)
    decisions = c.evaluate(1.5)
    assert c.num_judged == 501
    assert [(d.action, d.target, d.write_policy) for d in decisions] == [("write_policy", "w007", "selective")]


def _cost_model(rng: random.Random) -> CostModel:
    cost = CostModel(block_size=rng.choice([16, 32]), block_bytes=rng.choice([368_640, 1 << 20]),
                     prefill_seconds_per_token=rng.choice([1e-5, 1e-4, 3e-4, 0.003]))
    cost.tiers["h"] = TierEstimate(latency_s=rng.random() * 0.01, bytes_per_s=rng.uniform(1e8, 5e9))
    cost.tiers["c"] = TierEstimate(latency_s=rng.random() * 0.05, bytes_per_s=rng.uniform(1e7, 1e9))
    if rng.random() < 0.5:
        cost.tier_block_bytes = {"w": rng.choice([92_160, 184_320]), "c": 92_160}
    return cost


@pytest.mark.parametrize("seed", range(30))
def test_linear_plan_equals_the_quadratic_one(seed):
    rng = random.Random(seed)
    cost = _cost_model(rng)
    for _ in range(40):
        n = rng.choice([0, 1, 2, 5, 40, 300])
        weights = rng.choice([(1, 1, 1), (5, 1, 1), (1, 1, 5), (0, 1, 0)])
        letters = bytes(rng.choices(b"hwc", weights=weights, k=n))
        assert cost.plan(letters) == reference_plan(cost, letters), letters


@pytest.mark.parametrize("seed", range(10))
def test_prefix_fetch_times_are_the_same_floats(seed):
    """The linear pass sums each prefix's tiers in fetch_seconds' order: bit-identical, not merely close."""
    rng = random.Random(seed)
    cost = _cost_model(rng)
    letters = bytes(rng.choices(b"hwc", k=200))
    assert list(cost.prefix_fetch_seconds(letters)) == [cost.fetch_seconds(letters[:k])
                                                         for k in range(1, len(letters) + 1)]


def test_signal_fields_name_every_input_of_every_worker_signal():
    """A worker is judged again only when a field in SIGNAL_FIELDS of a rule's signal changed: a field
    missing there would silently freeze that rule."""
    from kite_arbitrator.core import SIGNAL_FIELDS
    from kite_arbitrator.rules import WORKER_SIGNALS
    assert set(SIGNAL_FIELDS) == set(WORKER_SIGNALS)
    rules, version = load_rules(None)
    c = ArbitratorCore(rules=rules, rules_version=version)
    rng = random.Random(7)
    for _ in range(200):
        a, b = _worker(rng, "w", 0.0), _worker(rng, "w", 0.0)
        for name, fields in SIGNAL_FIELDS.items():
            mixed = b.model_copy(update={f: getattr(a, f) for f in fields})
            assert c.worker_signals(mixed)[name] == c.worker_signals(a)[name], name
