"""bench/bench_standby.py's pure parts: measuring one activation from stamped messages, the client-side
split, the summary, the verdict and the rules it runs (no servers)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from kite_arbitrator.core import ArbitratorCore
from kite_arbitrator.rules import load_rules, parse_rules
from kite_shared.messages import Admission, Decision, WorkerTelemetry


def _load_bench():
    path = Path(__file__).resolve().parents[2] / "bench" / "bench_standby.py"
    spec = importlib.util.spec_from_file_location("bench_standby", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their annotations through sys.modules
    spec.loader.exec_module(module)
    return module


bench = _load_bench()
T0 = 1_000.0


def _core() -> ArbitratorCore:
    rules, _ = load_rules(None)
    return ArbitratorCore(rules=rules, ttft_slo_s=10.0, stale_s=3.0)


def _worker(wid: str, *, running: int = 0, standby: bool = False, **fields) -> WorkerTelemetry:
    return WorkerTelemetry(instance_id=wid, num_running=running, max_running=4, standby=standby, **fields)


def _activate(target: str = "worker-2", *, standby: bool = False, refresh: bool = False) -> Decision:
    return Decision(decision_id="d-7", action="warm_capacity", target=target, reason="busy",
                    rule="activate-standby-when-busy", issued_at=T0 + 0.0015, standby=standby, refresh=refresh)


def _timeline() -> list:
    S = bench.Seen
    return [
        S(T0 - 1.0, _worker("worker-1")),
        S(T0 - 0.9, _worker("worker-2", standby=True)),
        S(T0 + 0.5, _worker("worker-1", running=3)),  # not yet: utilization 0.75
        S(T0 + 1.0, _worker("worker-1", running=4)),  # every slot busy: the activate rule holds
        S(T0 + 1.002, _activate()),
        S(T0 + 1.003, _worker("worker-2")),  # reports active
        S(T0 + 1.004, Admission(accepted=True, worker_id="worker-1")),  # the other worker: not it
        S(T0 + 1.090, Admission(accepted=True, worker_id="worker-2")),
        S(T0 + 1.095, Admission(accepted=True, worker_id="worker-2")),  # the fingerprinter's relay
        S(T0 + 1.150, _worker("worker-2", running=1, activation_decision_id="d-7", activation_latency_s=0.0885)),
    ]


def test_measures_each_leg_of_an_activation_from_the_stamps():
    a = bench.measure(_timeline(), since=T0, core=_core())
    assert (a.target, a.rule, a.decision_id, a.overload_rule) == (
        "worker-2", "activate-standby-when-busy", "d-7", "activate-standby-when-busy")
    f = a.figures()
    assert f["overload_to_decision_ms"] == pytest.approx(2.0)
    assert f["decision_to_active_ms"] == pytest.approx(1.0)
    assert f["decision_to_accepted_ms"] == pytest.approx(88.0)
    assert f["worker_reported_ms"] == pytest.approx(88.5)
    assert f["overload_to_accepted_ms"] == pytest.approx(90.0)


def test_the_order_of_the_stamps_not_of_the_list_counts():
    a = bench.measure(list(reversed(_timeline())), since=T0, core=_core())
    assert a.figures()["decision_to_accepted_ms"] == pytest.approx(88.0)


def test_no_activation_yet_or_only_earlier_refreshed_or_scale_in_decisions_give_none():
    S = bench.Seen
    core = _core()
    assert bench.measure(_timeline()[:4], since=T0, core=core) is None
    earlier = [S(T0 - 5, _activate()), S(T0 + 1, _activate(refresh=True)), S(T0 + 2, _activate(standby=True))]
    assert bench.measure(earlier, since=T0, core=core) is None


def test_overload_before_the_round_or_from_stale_telemetry_is_not_the_trigger():
    S = bench.Seen
    core = _core()
    # worker-1 busy before the round started: the condition must appear after `since`
    events = [S(T0 - 0.5, _worker("worker-2", standby=True)), S(T0 - 0.2, _worker("worker-1", running=4)),
              S(T0 + 0.3, _activate())]
    assert bench.measure(events, since=T0, core=core).overload_at is None
    # the standby worker's telemetry is older than stale_s: no standby worker, no activate rule holds
    events = [S(T0 - 5, _worker("worker-2", standby=True)), S(T0 + 0.1, _worker("worker-1", running=4)),
              S(T0 + 0.3, _activate())]
    assert bench.measure(events, since=T0, core=core).overload_at is None


def test_the_client_side_names_the_first_request_the_target_served():
    a = bench.measure(_timeline(), since=T0, core=_core())
    requests = [bench.Sent(T0 + 0.9, T0 + 1.5, 200, "worker-1"), bench.Sent(T0 + 1.05, T0 + 1.3, 503, ""),
                bench.Sent(T0 + 1.080, T0 + 1.4, 200, "worker-1,worker-2"),  # served by both
                bench.Sent(T0 + 1.100, T0 + 1.2, 200, "worker-2")]
    bench.attach_requests(a, requests)
    f = a.figures()
    assert f["decision_to_first_sent_ms"] == pytest.approx(78.0)
    assert f["first_sent_to_accepted_ms"] == pytest.approx(10.0)
    assert a.served == {"worker-1": 1, "worker-1,worker-2": 1, "worker-2": 1}
    assert a.statuses == {200: 3, 503: 1}


def test_summary_and_verdict():
    samples = [{"decision_to_accepted_ms": v, "overload_to_decision_ms": None} for v in (40.0, 100.0, 90.0)]
    s = bench.summarize(samples)
    assert s["decision_to_accepted_ms"] == {"p50": 90.0, "max": 100.0, "n": 3}
    assert s["overload_to_decision_ms"] == {"p50": None, "max": None, "n": 0}
    assert bench.summarize([{"decision_to_accepted_ms": 1.0}, {"decision_to_accepted_ms": 2.0}])[
        "decision_to_accepted_ms"]["p50"] == 1.5
    assert bench.verdict(samples, "decision_to_accepted_ms")
    assert not bench.verdict(samples + [{"decision_to_accepted_ms": 417.5}], "decision_to_accepted_ms")
    assert not bench.verdict(samples + [{"decision_to_accepted_ms": None}], "decision_to_accepted_ms")
    assert not bench.verdict([], "decision_to_accepted_ms")


def test_table_has_a_row_per_round_then_p50_and_max():
    a = bench.measure(_timeline(), since=T0, core=_core())
    table = bench.render_table([a, a], target_ms=50.0).splitlines()
    assert len(table) == 2 + 2 + 2
    assert table[2].startswith("| 1 | worker-2 |") and table[2].endswith("| NO |")
    assert table[4].startswith("| p50 |") and table[5].startswith("| max |")


def test_bench_rules_shorten_only_scale_in():
    rules, _ = parse_rules(bench.bench_rules(3.0))
    default, _ = load_rules(None)
    by_name = {r.name: r for r in rules.rules}
    assert by_name["scale-in-when-idle"].for_s == 3.0
    assert [(r.name, r.for_s, r.when) for r in rules.rules if r.name != "scale-in-when-idle"] == \
        [(r.name, r.for_s, r.when) for r in default.rules if r.name != "scale-in-when-idle"]
    assert [r.name for r in bench.activate_rules(rules)] == [
        "activate-standby-when-slo-at-risk", "activate-standby-when-busy"]
