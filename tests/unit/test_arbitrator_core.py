"""The arbitrator's pure decision core and rules: synthetic telemetry streams in, decisions out."""

from __future__ import annotations

from pathlib import Path

import pytest

from kite_arbitrator.core import ArbitratorCore
from kite_arbitrator.rules import DEFAULT_RULES_PATH, RulesError, load_rules, parse_rules
from kite_shared.messages import (TELEMETRY, ArbitratorTelemetry, Decision, FingerprinterTelemetry,
                                  GatewayTelemetry, PoolTelemetry, TierStats, WorkerTelemetry)

RULES = """
version: 1
defaults: {write_policy: write_through, admission: open, routing_weights: {affinity: 1, load: 1}}
safe_policy: {write_policy: selective, admission: open}
rules:
  - {name: shed, scope: fleet, priority: 100, when: {ttft_over_slo: {gt: 1.0}}, then: {admission: shed, retry_after_s: 2}}
  - {name: activate, scope: fleet, priority: 90, when: {utilization: {gte: 1.0}, standby_workers: {gte: 1}},
     then: {activate_standby: 1}}
  - {name: scale-in, scope: fleet, priority: 10, when: {utilization: {lte: 0}, active_workers: {gte: 2}},
     for_s: 10, then: {scale_in: 1}}
  - {name: load-heavy, scope: fleet, priority: 50, when: {mean_queue_depth: {gt: 2}},
     then: {routing_weights: {affinity: 0.5, load: 2.0}}}
  - {name: mem-off, scope: worker, priority: 100, when: {memory_used_fraction: {gte: 0.95}}, then: {write_policy: "off"}}
  - {name: mem-selective, scope: worker, priority: 50, when: {memory_used_fraction: {gte: 0.85}},
     then: {write_policy: selective}}
"""


def core(**kw) -> ArbitratorCore:
    rules, version = parse_rules(RULES)
    return ArbitratorCore(rules=rules, rules_version=version, min_hold_s=kw.pop("min_hold_s", 1.0),
                          stale_s=3.0, ttft_slo_s=2.0, **kw)


def wt(name: str, **kw) -> WorkerTelemetry:
    kw.setdefault("max_running", 4)
    kw.setdefault("prefill_tokens_per_s", 1000.0)
    return WorkerTelemetry(instance_id=name, **kw)


def kinds(decisions: list[Decision]) -> list[tuple]:
    out = []
    for d in decisions:
        value = {"write_policy": d.write_policy, "admission": d.admit, "routing": d.weights and
                 (d.weights.affinity, d.weights.load), "warm_capacity": d.standby}[d.action]
        out.append((d.action, d.target, value))
    return out


def test_first_evaluation_announces_defaults():
    c = core()
    c.observe(wt("w1"), 0.0)
    got = kinds(c.evaluate(0.0))
    assert ("admission", "*", True) in got and ("routing", "*", (1.0, 1.0)) in got
    assert ("write_policy", "w1", "write_through") in got
    assert c.evaluate(0.1) == []  # nothing changed, nothing published


def test_admission_sheds_when_predicted_ttft_exceeds_slo_and_reopens_after_hold():
    c = core()
    c.observe(wt("w1"), 0.0)
    c.evaluate(0.0)
    c.observe(wt("w1", prefill_backlog_tokens=5000), 2.0)  # 5 s predicted > 2 s SLO
    shed = [d for d in c.evaluate(2.0) if d.action == "admission"]
    assert len(shed) == 1 and not shed[0].admit and shed[0].retry_after_s == 2
    assert "rule shed" in shed[0].reason and "ttft_over_slo=2.5 > 1" in shed[0].reason
    c.observe(wt("w1"), 2.5)  # backlog gone within the hold: stays shed
    assert [d for d in c.evaluate(2.5) if d.action == "admission"] == []
    reopened = [d for d in c.evaluate(3.1) if d.action == "admission"]
    assert len(reopened) == 1 and reopened[0].admit and "no rule matched" in reopened[0].reason


def test_hysteresis_min_hold():
    c = core(min_hold_s=5.0)
    c.observe(wt("w1"), 0.0)
    c.evaluate(0.0)
    for t in (10.0, 10.5, 11.0, 14.9):  # flapping signal inside the hold
        c.observe(wt("w1", prefill_backlog_tokens=5000 if t in (10.0, 11.0) else 0), t)
        c.evaluate(t)
    changes = [e for e in c.take_log() if e["event"] == "decision" and e["action"] == "admission"]
    assert [e["to"] for e in changes] == ["open", "shed"]  # no flip back within 5 s


def test_worker_write_policy_by_memory_pressure():
    c = core(min_hold_s=0.0)
    c.observe(wt("w1", memory_used_fraction=0.5), 0.0)
    c.observe(wt("w2", memory_used_fraction=0.9), 0.0)
    c.observe(wt("w3", memory_used_fraction=0.97), 0.0)
    got = {d.target: d.write_policy for d in c.evaluate(0.0) if d.action == "write_policy"}
    assert got == {"w1": "write_through", "w2": "selective", "w3": "off"}


def test_routing_weights_follow_queues():
    c = core(min_hold_s=0.0)
    c.observe(wt("w1", queue_depth=3, num_running=4), 0.0)
    c.observe(wt("w2", queue_depth=4, num_running=4), 0.0)
    routing = [d for d in c.evaluate(0.0) if d.action == "routing"]
    assert (routing[0].weights.affinity, routing[0].weights.load) == (0.5, 2.0)


def test_standby_activated_when_busy_once():
    c = core()
    c.observe(wt("w1", num_running=4, queue_depth=2), 0.0)
    c.observe(wt("w2", standby=True), 0.0)
    warm = [d for d in c.evaluate(0.0) if d.action == "warm_capacity"]
    assert [(d.target, d.standby) for d in warm] == [("w2", False)]
    assert "rule activate" in warm[0].reason
    # its telemetry still says standby (decision in flight): not activated twice
    c.observe(wt("w2", standby=True), 0.2)
    assert [d for d in c.evaluate(0.2) if d.action == "warm_capacity"] == []
    c.observe(wt("w2", activation_decision_id=warm[0].decision_id, activation_latency_s=0.12), 0.5)
    assert c.activation_latencies == {"w2": 0.12}


def test_scale_in_after_idle_for_s_never_below_min_active():
    c = core(min_active_workers=1)
    decisions = []
    for t in range(0, 12):
        c.observe(wt("w1", requests_accepted=5), float(t))
        c.observe(wt("w2", requests_accepted=1), float(t))
        decisions += [(t, d) for d in c.evaluate(float(t)) if d.action == "warm_capacity"]
    assert [(t, d.target, d.standby) for t, d in decisions] == [(10, "w2", True)]
    assert "for 10 s" in decisions[0][1].reason
    c.observe(wt("w2", standby=True), 12.0)
    c.observe(wt("w1"), 12.0)
    assert [d for d in c.evaluate(30.0) if d.action == "warm_capacity"] == []  # only 1 active left


def test_stale_telemetry_falls_back_to_safe_policy_once_and_recovers():
    c = core()
    c.observe(wt("w1"), 0.0)
    c.evaluate(0.0)
    got = c.evaluate(4.0)  # last telemetry 4 s old > stale 3 s
    assert ("write_policy", "*", "selective") in kinds(got)
    assert all(d.rule == "safe_policy" and "stale" in d.reason for d in got)
    assert c.stale and c.evaluate(4.5) == []
    assert any(e["event"] == "stale" for e in c.take_log())
    c.observe(wt("w1"), 5.0)
    back = kinds(c.evaluate(5.0))
    assert ("write_policy", "w1", "write_through") in back and not c.stale


def test_no_telemetry_at_start_is_stale_only_after_stale_s():
    c = core(started_at=0.0)
    c.evaluate(1.0)
    assert not c.stale
    assert c.evaluate(3.5) and c.stale


def test_admin_routing_mode_override_bypasses_hold():
    c = core(min_hold_s=60)
    c.observe(wt("w1"), 0.0)
    c.evaluate(0.0)
    d = [x for x in c.set_routing_mode("round_robin", 0.1) if x.action == "routing"]
    assert d and d[0].routing_mode == "round_robin" and d[0].rule == "admin"


def test_fleet_signals_include_gateway_and_pool():
    c = core()
    c.observe(GatewayTelemetry(instance_id="g", request_rate=3.0, error_rate=0.1), 0.0)
    c.observe(PoolTelemetry(instance_id="p", hot_fill=0.4, hit_rate=0.6), 0.0)
    c.observe(wt("w1"), 0.0)
    signals = c.fleet_signals(c._fresh(c.workers, 0.0), c._fresh(c.gateways, 0.0), c._fresh(c.pools, 0.0))
    assert signals["request_rate"] == 3.0 and signals["pool_hot_fill"] == 0.4 and signals["active_workers"] == 1


def test_telemetry_round_trip():
    t = wt("w1", queue_depth=2, ttft_p99_s=0.5, standby=True)
    assert TELEMETRY.decode(t.encode()) == t


# --- rules files ------------------------------------------------------------------------------------

@pytest.mark.parametrize("text,needle", [
    ("rules: [{name: a, when: {nope: {gt: 1}}, then: {admission: shed}}]", "unknown fleet signal"),
    ("rules: [{name: a, then: {}}]", "has no action"),
    ("rules: [{name: a, scope: worker, then: {admission: shed}}]", "can only set write_policy"),
    ("rules: [{name: a, then: {write_policy: off}}]", "write_policy"),
    ("rules: [{name: a, when: {utilization: {}}, then: {admission: shed}}]", "at least one"),
    ("rules: [{name: a, then: {admission: maybe}}]", "admission"),
    ("rules: [{name: a, then: {admission: shed}}, {name: a, then: {admission: open}}]", "duplicate"),
    ("version: 2", "version"),
    ("rules: [unclosed", "not valid YAML"),
    ("- just a list", "mapping"),
    ("rules: [{name: a, then: {admission: shed}, extra: 1}]", "extra"),
])
def test_bad_rules_are_rejected_with_a_clear_error(text, needle):
    with pytest.raises(RulesError) as err:
        parse_rules(text, "test.yaml")
    assert needle in str(err.value) and "test.yaml" in str(err.value)


def test_default_rules_file_is_valid_and_documented():
    rules, version = load_rules(None)
    assert len(version) == 12 and rules.rules
    doc = (Path(__file__).parents[2] / "docs" / "arbitrator.md").read_text()
    for rule in rules.rules:
        assert rule.name in doc
    assert DEFAULT_RULES_PATH.name == "default_rules.yaml"


def test_rules_reload_replaces_rules_and_bad_file_keeps_previous(tmp_path):
    c = core()
    c.observe(wt("w1", prefill_backlog_tokens=5000), 0.0)
    assert not [d for d in c.evaluate(0.0) if d.action == "admission"][0].admit
    rules, version = parse_rules("rules: []")
    c.set_rules(rules, version, 2.0)
    assert [d for d in c.evaluate(2.0) if d.action == "admission"][0].admit
    with pytest.raises(RulesError):
        parse_rules("rules: [{name: x}]")
    assert c.rules_version == version


def test_activating_standby_capacity_instead_of_shedding():
    rules, version = load_rules(None)  # the default rules: activation at half the SLO, shedding above it
    c = ArbitratorCore(rules=rules, rules_version=version, ttft_slo_s=2.0)
    c.observe(wt("w1", queue_depth=3, num_running=4, prefill_backlog_tokens=9000), 0.0)
    c.observe(wt("w2", standby=True), 0.0)
    got = kinds(c.evaluate(0.0))
    assert ("warm_capacity", "w2", False) in got and ("admission", "*", True) in got
    # without standby capacity the same load is shed
    c2 = ArbitratorCore(rules=rules, rules_version=version, ttft_slo_s=2.0)
    c2.observe(wt("w1", queue_depth=3, num_running=4, prefill_backlog_tokens=9000), 0.0)
    assert ("admission", "*", False) in kinds(c2.evaluate(0.0))


def test_fleet_signals_include_what_fingerprinters_report():
    c = core()
    c.observe(wt("w1"), 0.0)
    c.observe(FingerprinterTelemetry(instance_id="f1", request_rate=3.0, routed_hit_rate=0.9, refused_rate=0.0), 0.0)
    c.observe(FingerprinterTelemetry(instance_id="f2", request_rate=1.0, routed_hit_rate=0.5, refused_rate=0.2), 0.0)
    c.observe(ArbitratorTelemetry(instance_id="a2"), 0.0)  # another arbitrator's report is not a source
    signals = c.fleet_signals(c._fresh(c.workers, 0.0), {}, {}, c._fresh(c.fingerprinters, 0.0))
    assert signals["routed_hit_rate"] == (3.0 * 0.9 + 1.0 * 0.5) / 4.0
    assert signals["fingerprinter_refused_rate"] == 0.2
    assert c.num_sources(0.0) == 3
    assert c.num_sources(0.0 + c.stale_s + 1) == 0


def test_every_activation_of_a_worker_is_measured_once():
    c = core()
    c.observe(wt("w2", activation_decision_id="d-1", activation_latency_s=0.12), 0.0)
    c.observe(wt("w2", activation_decision_id="d-1", activation_latency_s=0.12), 0.5)  # repeated in telemetry
    c.observe(wt("w2", activation_decision_id="d-7", activation_latency_s=0.05), 9.0)  # a later activation
    assert c.activation_latencies == {"w2": 0.05}
    measured = [e for e in c.take_log() if e.get("event") == "activation_measured"]
    assert [(e["decision_id"], e["latency_s"]) for e in measured] == [("d-1", 0.12), ("d-7", 0.05)]


def test_pool_signals_cover_every_replica():
    c = core()
    c.observe(wt("w1"), 0.0)
    c.observe(PoolTelemetry(instance_id="p1", hot_fill=0.2, hit_rate=0.6), 0.0)
    c.observe(PoolTelemetry(instance_id="p2", hot_fill=0.9, hit_rate=0.4,
                            tiers={"warm": TierStats(up=False), "hot": TierStats()}), 0.0)
    signals = c.fleet_signals(c._fresh(c.workers, 0.0), {}, c._fresh(c.pools, 0.0))
    assert (signals["pool_replicas"], signals["pool_hot_fill"], signals["pool_tiers_down"]) == (2, 0.9, 1)
    assert signals["pool_hit_rate"] == 0.5
