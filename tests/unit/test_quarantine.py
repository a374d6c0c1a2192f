"""The arbitrator's quarantine book: a divergence quarantines its namespace once, decided by the leader only;
only an operator lifts it; followers adopt the leader's decisions and lifts, and one that takes over
quarantines what crossed the threshold meanwhile, never what was lifted."""

from __future__ import annotations

from kite_shared.messages import ShadowCheckResult
from kite_arbitrator.quarantine import QuarantineBook

FP = "ab" * 32


def result(diverged: bool, fingerprint: str = FP, divergence: float = 0.0) -> ShadowCheckResult:
    return ShadowCheckResult(instance_id="worker-1", model_fingerprint=fingerprint, namespace="m:alpha",
                             request_id="r", num_reused_tokens=64, divergence=divergence or (3.0 if diverged else 1e-7),
                             tolerance=1e-4, diverged=diverged)


def observed(book: QuarantineBook, *results: ShadowCheckResult) -> list:
    """What a leader does on each result: count it, then decide."""
    decisions = []
    for r in results:
        book.observe(r)
        decisions += book.due()
    return decisions


def test_a_divergence_quarantines_its_namespace_once():
    book = QuarantineBook(divergences_to_quarantine=2)
    assert observed(book, result(False)) == []
    assert observed(book, result(True)) == []  # one of two
    [decision] = observed(book, result(True))
    assert (decision.action, decision.target, decision.quarantined, decision.namespace) == \
        ("quarantine", FP, True, "m:alpha")
    assert "2 shadow check(s)" in decision.reason and "worker-1" in decision.reason
    assert observed(book, result(True)) == []  # in force already
    assert book.current() == [decision]
    record = book.records[FP]
    assert (record.num_checks, record.num_divergences, record.max_divergence) == (4, 3, 3.0)
    assert observed(book, result(True, fingerprint="cd" * 32)) == []  # another namespace counts apart


def test_only_an_operator_lifts_it_and_counting_starts_anew():
    book = QuarantineBook()
    observed(book, result(True))
    [lifted] = book.clear(FP)
    assert (lifted.quarantined, lifted.target, lifted.rule) == (False, FP, "admin")
    assert book.current() == [] and book.clear(FP) == []
    assert book.records[FP].num_divergences == 0
    assert observed(book, result(True))[0].quarantined  # diverging again quarantines again


def test_a_follower_counts_but_holds_only_what_the_leader_decided():
    leader, follower = QuarantineBook(), QuarantineBook()
    for book in (leader, follower):
        book.observe(result(True))
    [decision] = leader.due()
    assert follower.current() == []  # it decided nothing of its own
    follower.adopt(decision)
    assert follower.current() == [decision]
    follower.adopt(leader.clear(FP)[0])
    assert follower.current() == []
    assert follower.due() == []  # taking over now would not bring the lifted quarantine back


def test_a_replica_taking_over_quarantines_what_crossed_the_threshold_meanwhile():
    follower = QuarantineBook(divergences_to_quarantine=2)
    follower.observe(result(True, divergence=2.5))
    follower.observe(result(True, divergence=4.0))  # the leader was gone: nobody decided
    assert follower.current() == []
    [decision] = follower.due()  # on taking over
    assert (decision.target, decision.quarantined) == (FP, True) and "last KL 4" in decision.reason
    assert follower.current() == [decision] and follower.due() == []
