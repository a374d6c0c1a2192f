"""The arbitrator's quarantine book: a divergence quarantines its namespace once; only an operator lifts it;
followers adopt the leader's decisions."""

from __future__ import annotations

from kite_shared.messages import ShadowCheckResult
from kite_arbitrator.quarantine import QuarantineBook

FP = "ab" * 32


def result(diverged: bool, fingerprint: str = FP, divergence: float = 0.0) -> ShadowCheckResult:
    return ShadowCheckResult(instance_id="worker-1", model_fingerprint=fingerprint, namespace="m:alpha",
                             request_id="r", num_reused_tokens=64, divergence=divergence or (3.0 if diverged else 1e-7),
                             tolerance=1e-4, diverged=diverged)


def test_a_divergence_quarantines_its_namespace_once():
    book = QuarantineBook(divergences_to_quarantine=2)
    assert book.observe(result(False)) == []
    assert book.observe(result(True)) == []  # one of two
    [decision] = book.observe(result(True))
    assert (decision.action, decision.target, decision.quarantined, decision.namespace) == \
        ("quarantine", FP, True, "m:alpha")
    assert "2 shadow check(s)" in decision.reason and "worker-1" in decision.reason
    assert book.observe(result(True)) == []  # in force already
    assert book.current() == [decision]
    record = book.records[FP]
    assert (record.num_checks, record.num_divergences, record.max_divergence) == (4, 3, 3.0)
    assert book.observe(result(True, fingerprint="cd" * 32)) == []  # another namespace counts apart


def test_only_an_operator_lifts_it_and_counting_starts_anew():
    book = QuarantineBook()
    book.observe(result(True))
    [lifted] = book.clear(FP)
    assert (lifted.quarantined, lifted.target, lifted.rule) == (False, FP, "admin")
    assert book.current() == [] and book.clear(FP) == []
    assert book.records[FP].num_divergences == 0
    assert book.observe(result(True))[0].quarantined  # diverging again quarantines again


def test_a_follower_adopts_the_leaders_quarantines():
    leader, follower = QuarantineBook(), QuarantineBook()
    [decision] = leader.observe(result(True))
    follower.adopt(decision)
    assert follower.current() == [decision]
    follower.adopt(leader.clear(FP)[0])
    assert follower.current() == []
