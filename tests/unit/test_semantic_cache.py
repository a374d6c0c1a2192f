"""The semantic cache's decisions: the guard, the learned threshold under its bound, per-entry thresholds,
exploration, namespaces and calibrations (tenants never share either), eviction order and events. Vectors are made by hand: the
core never embeds."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kite_shared.semantic_cache import CacheEvent, Calibration, Namespace, SemanticCache, differs_in_meaning

ACME = Namespace("acme", "ab" * 32, "max_tokens=64")
GLOBEX = Namespace("globex", "ab" * 32, "max_tokens=64")


def at(similarity: float) -> np.ndarray:
    """A unit vector whose cosine with e0 is `similarity`."""
    return np.array([similarity, math.sqrt(max(0.0, 1 - similarity * similarity)), 0.0], dtype=np.float32)


E0 = np.array([1.0, 0.0, 0.0], dtype=np.float32)


def learned(cache: SemanticCache, low: float, tenant: str = "acme") -> SemanticCache:
    """40 same answers observed from `low` up to 0.99 for `tenant`: at delta 0.1 its threshold is `low`."""
    for s in np.linspace(low, 0.99, 40):
        cache.calibration_of(tenant).observe(float(s), True)
    assert cache.calibration_of(tenant).threshold() == pytest.approx(low)
    return cache


@pytest.mark.parametrize("a, b", [
    ("Is it safe to eat raw chicken?", "Is it unsafe to eat raw chicken?"),
    ("Can dogs eat chocolate?", "Can't dogs eat chocolate?"),
    ("Should I water cacti every day?", "Should I not water cacti every day?"),
    ("Which metals are magnetic?", "Which metals are non-magnetic?"),
    ("What are the pros of remote work?", "What are the cons of remote work?"),
    ("Is it legal to drive without a license?", "Is it illegal to drive without a license?"),
    ("Convert 5 miles to kilometers.", "Convert 8 miles to kilometers."),
    ("List three tips for studying.", "List 3 tips for studying."),  # a number word is a number
    ("What is the capital of France?", "What is the capital of Spain?"),
])
def test_reversed_or_changed_questions_are_told_apart(a, b):
    assert differs_in_meaning(a, b) and differs_in_meaning(b, a)


@pytest.mark.parametrize("a, b", [
    ("What is the capital of France?", "Which city is the capital of France?"),
    ("what is the capital of italy", "What is the capital of Italy?"),  # a name in lower case is the same name
    ("How many days are in a leap year?", "How many days does a leap year have?"),
    ("Can dogs eat chocolate?", "Are dogs able to eat chocolate?"),
])
def test_paraphrases_pass_the_guard(a, b):
    assert not differs_in_meaning(a, b)


def test_wilson_bound_and_the_lowest_threshold_that_keeps_it():
    calibration = Calibration(delta=0.1, confidence=0.8, min_observations=5)
    assert calibration.threshold() == math.inf  # nothing observed: no hits
    assert calibration.upper_bound(0, 10) == pytest.approx(0.0662, abs=1e-4)
    for s in (0.95, 0.94, 0.93, 0.92, 0.91, 0.90, 0.89, 0.88):
        calibration.observe(s, True)
    assert calibration.threshold() == 0.88  # 8 same answers, bound 0.082
    calibration.observe(0.87, False)
    assert calibration.threshold() == 0.88  # a wrong answer below: the threshold stays above it
    calibration.observe(0.96, False)  # a wrong answer at the top: 1 of 9 above 0.88 is over the bound
    assert calibration.threshold() == math.inf


def test_no_hit_before_the_threshold_is_learned_then_hits_above_it():
    cache = SemanticCache.create_simulated(delta=0.1, confidence=0.8, min_observations=5, explore_fraction=0.0)
    entry = cache.insert(ACME, "What is the capital of France?", E0, "Paris")
    for s in (0.99, 0.98, 0.97, 0.96, 0.95, 0.94, 0.93, 0.92):
        lookup = cache.lookup(ACME, "Which city is the capital of France?", at(s))
        assert lookup.outcome == "explore" and lookup.entry is entry and lookup.similarity == pytest.approx(s, abs=1e-6)
        cache.record(lookup, same_answer=True)
    assert cache.calibration_of("acme").threshold() == pytest.approx(0.92, abs=1e-6)
    hit = cache.lookup(ACME, "Which city is the capital of France?", at(0.95))
    assert hit.outcome == "hit" and hit.entry.answer == "Paris" and entry.num_hits == 1
    assert cache.lookup(ACME, "Which city is the capital of France?", at(0.9)).outcome == "explore"
    assert cache.lookup(ACME, "Tell me a joke", at(0.3)).outcome == "miss"
    assert cache.lookup(ACME, "What is the capital of Spain?", at(0.99)).outcome == "guarded"
    assert (cache.num_hits, cache.num_explored, cache.num_misses, cache.num_guarded) == (1, 9, 1, 1)


def test_an_entry_that_misled_never_answers_at_that_similarity_again():
    cache = learned(SemanticCache.create_simulated(delta=0.1, confidence=0.8, explore_fraction=0.0), low=0.9)
    entry = cache.insert(ACME, "What should I pack for a trip?", E0, "A bag")
    cache.take_events()
    assert cache.lookup(ACME, "What should I pack for a trip?", at(0.96)).outcome == "hit"
    cache.explore_fraction = 1.0  # the next one is computed: it had another answer
    lookup = cache.lookup(ACME, "What should I pack for a trip?", at(0.97))
    cache.record(lookup, same_answer=False)
    cache.explore_fraction = 0.0
    assert entry.wrong_above == pytest.approx(0.97, abs=1e-6)
    events = cache.take_events()
    assert [(e.kind, e.entry.entry_id) for e in events] == [("observed", entry.entry_id), ("updated", entry.entry_id)]
    assert (events[0].similarity, events[0].same_answer, events[0].tenant) == \
        (pytest.approx(0.97, abs=1e-6), False, "acme")
    assert cache.calibration_of("acme").threshold() == pytest.approx(0.9)  # 1 wrong of 41: the bound still holds
    assert cache.lookup(ACME, "What should I pack for a trip?", at(0.97)).outcome == "explore"
    assert cache.lookup(ACME, "What should I pack for a trip?", at(0.98)).outcome == "hit"


def test_tenants_never_share_an_answer():
    cache = learned(SemanticCache.create_simulated(delta=0.1, confidence=0.8, explore_fraction=0.0), low=0.5)
    cache.insert(ACME, "What is our refund policy?", E0, "acme's policy")
    assert cache.lookup(ACME, "What is our refund policy?", E0).outcome == "hit"
    globex = cache.lookup(GLOBEX, "What is our refund policy?", E0)  # the same question, another tenant
    assert globex.outcome == "miss" and globex.entry is None


def test_one_tenants_labels_never_set_another_tenants_threshold():
    """Labels agreeing at low similarity (one-token answers, or planted) lower only their own tenant's
    threshold: another tenant's near entry is still explored, not answered."""
    cache = learned(SemanticCache.create_simulated(delta=0.1, confidence=0.8, min_observations=5,
                                                   explore_fraction=0.0), low=0.55)
    cache.insert(ACME, "Classify: the food was great", E0, "positive")
    assert cache.lookup(ACME, "Classify: the room was dirty", at(0.6)).outcome == "hit"
    cache.insert(GLOBEX, "How do I bake a cake?", E0, "Mix flour, eggs and sugar, then bake.")
    baking = cache.lookup(GLOBEX, "How do I bake bread?", at(0.8))
    assert baking.outcome == "explore" and baking.threshold == math.inf
    assert cache.calibration_of("globex").num_observations == 0

def test_entries_beyond_the_limit_go_least_recently_used_first():
    cache = learned(SemanticCache.create_simulated(delta=0.1, confidence=0.8, explore_fraction=0.0, max_entries=2),
                    low=0.5)
    vectors = [np.eye(3, dtype=np.float32)[i] for i in range(3)]
    first = cache.insert(ACME, "first question", vectors[0], "1")
    second = cache.insert(ACME, "second question", vectors[1], "2")
    assert cache.lookup(ACME, "first question", vectors[0]).outcome == "hit"  # first is now the most recent
    third = cache.insert(ACME, "third question", vectors[2], "3")
    events = cache.take_events()
    assert [(e.kind, e.entry.entry_id) for e in events] == [
        ("inserted", first.entry_id), ("inserted", second.entry_id), ("inserted", third.entry_id),
        ("evicted", second.entry_id)]
    assert cache.num_entries(ACME) == 2


def test_only_explored_lookups_are_labelled_and_embeddings_must_be_vectors():
    cache = SemanticCache.create_simulated()
    miss = cache.lookup(ACME, "anything", E0)
    with pytest.raises(ValueError, match="explored"):
        cache.record(miss, True)
    with pytest.raises(ValueError, match="non-zero"):
        cache.insert(ACME, "x", np.zeros(3), "y")


def test_a_replica_applying_the_events_decides_as_the_original_and_queues_nothing():
    original = SemanticCache.create_simulated(delta=0.2, confidence=0.8, min_observations=5, explore_fraction=0.0)
    replica = SemanticCache.create_simulated(delta=0.2, confidence=0.8, min_observations=5, explore_fraction=0.0)
    entry = original.insert(ACME, "What is the capital of France?", E0, "Paris", details={"finish_reason": "stop"},
                            entry_id=41)
    for s in (0.99, 0.98, 0.97, 0.96, 0.95):
        original.record(original.lookup(ACME, "Which city is the capital of France?", at(s)), same_answer=True)
    original.record(original.lookup(ACME, "Which city is the capital of France?", at(0.94)), same_answer=False)
    events = original.take_events()
    assert [e.kind for e in events] == ["inserted"] + ["observed"] * 6 + ["updated"]
    for event in events + events[:1] + events[-1:]:  # an insertion or an update seen twice changes nothing
        replica.apply(event)
    assert replica.take_events() == []
    assert replica.num_entries(ACME) == 1 and replica.calibration_of("acme").num_observations == 6
    assert replica.calibration_of("acme").threshold() == original.calibration_of("acme").threshold() == \
        pytest.approx(0.95, abs=1e-6)
    assert replica.calibration_of("globex").num_observations == 0
    assert replica.lookup(ACME, "", E0).entry.wrong_above == pytest.approx(0.94, abs=1e-6)
    for s, outcome in ((0.93, "explore"), (0.945, "explore"), (0.96, "hit"), (0.98, "hit")):
        mine, theirs = (c.lookup(ACME, "Which city is the capital of France?", at(s)) for c in (original, replica))
        assert (mine.outcome, mine.entry.entry_id) == (theirs.outcome, theirs.entry.entry_id) == (outcome, 41)
    assert replica.lookup(ACME, "Which city is the capital of France?", at(0.98)).entry.details == {"finish_reason": "stop"}
    assert replica.insert(ACME, "A new question", at(0.1), "new").entry_id == 42  # ids continue past adopted ones
    with pytest.raises(ValueError, match="exists"):
        replica.insert(ACME, "again", E0, "x", entry_id=41)
    replica.apply(CacheEvent("evicted", entry))
    assert replica.num_entries(ACME) == 1 and replica.lookup(ACME, "What is the capital of France?", E0).entry.entry_id == 42
