"""Gateway's heartbeat view: liveness window, draining, models."""

from __future__ import annotations

from kite_gateway.fleet import Fleet
from kite_shared.messages import Heartbeat


def beat(instance: str, service: str = "worker", draining: bool = False) -> Heartbeat:
    return Heartbeat(service=service, instance_id=instance, started_at=0, sent_at=0, model="m",
                     max_context_tokens=8192, draining=draining)


def test_worker_is_dead_after_the_window_and_draining_takes_no_new_work():
    fleet = Fleet(dead_after_s=3.0)
    fleet.observe(beat("w1"), now=100.0)
    fleet.observe(beat("w2", draining=True), now=100.0)
    assert [b.instance_id for b in fleet.alive("worker", now=102.0)] == ["w1"]
    assert fleet.is_alive("worker", "w2", now=102.0)  # still finishing its streams
    assert fleet.alive("worker", now=103.5) == [] and not fleet.is_alive("worker", "w1", now=103.5)
    assert fleet.models(now=101.0) == {"m": 8192}
    fleet.observe(beat("w1"), now=104.0)
    assert fleet.is_alive("worker", "w1", now=104.5)


def test_adapters_are_listed_by_their_name_and_under_their_base():
    fleet = Fleet(dead_after_s=3.0)
    fleet.observe(beat("w1").model_copy(update={"adapters": ["alpha", "beta"]}), now=100.0)
    assert fleet.models(now=101.0) == {"m": 8192, "alpha": 8192, "m:alpha": 8192, "beta": 8192, "m:beta": 8192}


def test_a_model_fingerprint_is_known_only_while_every_live_fingerprinter_agrees():
    fleet = Fleet(dead_after_s=3.0)
    assert fleet.model_fingerprint("m", now=100.0) is None  # no fingerprinter yet
    old = beat("f1", service="fingerprinter").model_copy(update={"model_fingerprints": {"m": "aa" * 32}})
    fleet.observe(old, now=100.0)
    assert fleet.model_fingerprint("m", now=101.0) == "aa" * 32
    assert fleet.model_fingerprint("other", now=101.0) is None
    fleet.observe(old.model_copy(update={"instance_id": "f2", "model_fingerprints": {"m": "bb" * 32}}), now=101.0)
    assert fleet.model_fingerprint("m", now=102.0) is None  # a rolling update: two models under one name
    assert fleet.model_fingerprint("m", now=103.5) == "bb" * 32  # f1 has gone
