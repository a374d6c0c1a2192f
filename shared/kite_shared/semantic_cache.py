"""Answers reused by meaning: the decision core of KITE's semantic response cache (opt-in).

Pure: no I/O, no model. Callers embed prompts (kite_shared.embedder), keep entries where they are shared
(the warm tier), and tell the core what a computed answer turned out to be. Events for the store are
drained by the caller (`take_events()`); a replica (another gateway's copy of the same entries) takes the
events others stored with `apply()`, which changes the state as the original operation did but queues
nothing, so no event is stored twice.

The algorithm, for one request whose answer is a function of its prompt (temperature 0, one model
fingerprint, one set of sampling parameters: the `namespace`, which also holds the tenant, so nothing is
ever shared across tenants, entries nor statistics):
1. Nearest neighbour. The entry of the namespace whose prompt embedding has the highest cosine
   similarity `s` with the request's (an HNSW index per namespace, usearch; the exact cosine of the entry
   it finds is what the next steps use). Below `min_similarity` the request is a plain miss.
2. Guard. A question and its reversal embed almost alike ("Is X safe?" / "Is X unsafe?": 0.83-0.9997 in
   GPTCache #694), so similarity alone cannot tell them apart. The two prompts are compared word by word
   (`differs_in_meaning`): a negation word ("not", "never", "n't", ...) present in one and not the other,
   a word in one that the other has with a negating prefix ("safe" / "unsafe", "legal" / "illegal"), a
   pair of common opposites ("good" / "bad", "pros" / "cons", from `_OPPOSITES`), a different multiset
   of numbers (digits or number words), or a capitalised name one has and the other lacks: each is a miss
   whatever `s` is ("guarded").
3. Threshold (vCache's idea, ICLR 2026: per-entry thresholds learned online so that the share of wrong
   cached answers stays below a chosen `delta`). Every answer computed for a request that had a
   neighbour is an observation `(s, same answer?)`. The tenant's threshold `t` (one calibration per
   tenant, shared by its namespaces) is the lowest similarity such that, among the observations at or
   above it, the upper confidence bound (Wilson, one-sided, at `confidence`) of the share of different
   answers is at most `delta` and at least `min_observations` were seen. Each entry then raises its own
   threshold above the highest similarity at which a request near it turned out to have a different
   answer (`CacheEntry.wrong_above`): an entry that once misled never misleads at that similarity again. The request is a hit when `s >= max(t, entry's)`.
   Why per tenant: the bound holds over the traffic that taught it. Pooled across tenants, one tenant's
   labels would set another's error rate: prompts whose answers agree at low similarity (one-token
   answers, say) would lower the threshold for a tenant whose answers do not, whether by accident or on
   purpose. The price is a warm-up per tenant.
4. Exploration. Until the threshold exists every request with a neighbour is computed and labelled; after
   it, a hit is still computed instead with probability `explore_fraction`, so labels keep arriving and a
   threshold that drifted (new kinds of prompts) is found out. An explored request whose answer differs
   is inserted as an entry of its own.

"Same answer" is decided by the caller (for greedy decoding: the same text after whitespace and case are
normalised, or, more leniently, answer embeddings above a cosine the operator sets); the bound holds for
whichever definition the labels follow.

Knobs: `delta` (the bound, default 0.02), `confidence` (of the bound, default 0.8: with 0.95 a bound of
2% needs about 130 same-answer observations above a threshold before the first hit), `min_similarity`
(0.5), `min_observations` (20), `explore_fraction` (0.05), `max_entries` per namespace (LRU beyond it).
"""

from __future__ import annotations

import bisect
import math
import random
import re
from collections import OrderedDict
from dataclasses import dataclass, field
from statistics import NormalDist
from typing import Literal, NamedTuple

import numpy as np
from usearch.index import Index

Outcome = Literal["hit", "explore", "miss", "guarded"]


class Namespace(NamedTuple):
    """What must be equal for two requests to share an answer."""

    tenant: str
    model_fingerprint: str  # hex: the base model or an adapter
    sampling_key: str  # the sampling parameters that shape the answer, canonically encoded (max_tokens, stop...)


@dataclass
class CacheEntry:
    entry_id: int
    namespace: Namespace
    prompt: str  # the prompt text as embedded (the guard compares it with a request's)
    answer: str
    vector: np.ndarray  # unit-norm float32 embedding of `prompt`
    details: dict = field(default_factory=dict)  # the caller's, stored with the answer (finish reason, usage)
    # Highest similarity at which a request near this entry had another answer (-inf: none seen). The
    # entry never answers a request at or below it.
    wrong_above: float = -math.inf
    num_hits: int = 0


@dataclass(frozen=True)
class Lookup:
    outcome: Outcome
    entry: CacheEntry | None  # the nearest neighbour (None on a miss without one)
    similarity: float  # with the nearest neighbour (-inf without one)
    threshold: float  # the threshold applied (inf while none is learned)


@dataclass(frozen=True)
class CacheEvent:
    """For the store: an entry added, one whose threshold changed, one evicted, or a labelled observation
    (an explored request's similarity to `entry` and whether its answer was the same)."""

    kind: Literal["inserted", "updated", "evicted", "observed"]
    entry: CacheEntry | None  # None only for an observation read back from a store (it names no entry)
    similarity: float = math.nan  # "observed" only
    same_answer: bool = False  # "observed" only
    tenant: str = ""  # "observed" only: whose calibration it teaches


class Calibration:
    """Observations `(similarity, same answer?)` and the lowest threshold whose error bound holds."""

    def __init__(self, delta: float, confidence: float, min_observations: int) -> None:
        if not 0 < delta < 1 or not 0.5 <= confidence < 1:
            raise ValueError(f"delta in (0, 1) and confidence in [0.5, 1), got {delta}, {confidence}")
        self.delta = delta
        self.z = NormalDist().inv_cdf(confidence)
        self.min_observations = min_observations
        self._similarities: list[float] = []  # ascending
        self._wrong: list[bool] = []  # parallel
        self._threshold: float | None = math.inf

    @property
    def num_observations(self) -> int:
        return len(self._similarities)

    def observe(self, similarity: float, same_answer: bool) -> None:
        i = bisect.bisect(self._similarities, similarity)
        self._similarities.insert(i, similarity)
        self._wrong.insert(i, not same_answer)
        self._threshold = None  # recomputed when next asked

    def threshold(self) -> float:
        if self._threshold is None:
            self._threshold = self._lowest_threshold()
        return self._threshold

    def _lowest_threshold(self) -> float:
        best = math.inf
        num_seen = num_wrong = 0
        for i in range(len(self._similarities) - 1, -1, -1):  # from the most similar down
            num_seen += 1
            num_wrong += self._wrong[i]
            if i > 0 and self._similarities[i - 1] == self._similarities[i]:
                continue  # a threshold sits between distinct similarities
            if num_seen >= self.min_observations and self.upper_bound(num_wrong, num_seen) <= self.delta:
                best = self._similarities[i]
        return best

    def upper_bound(self, num_wrong: int, num_seen: int) -> float:
        """One-sided Wilson score upper bound of a share `num_wrong / num_seen`."""
        z2 = self.z * self.z
        p = num_wrong / num_seen
        centre = p + z2 / (2 * num_seen)
        margin = self.z * math.sqrt(p * (1 - p) / num_seen + z2 / (4 * num_seen * num_seen))
        return (centre + margin) / (1 + z2 / num_seen)


class SemanticCache:
    """Entries per namespace, a calibration per tenant (shared by the tenant's namespaces: its labels
    accumulate faster than per namespace; never by two tenants, see step 3)."""

    def __init__(self, delta: float = 0.02, confidence: float = 0.8, min_similarity: float = 0.5,
                 min_observations: int = 20, explore_fraction: float = 0.05, max_entries: int = 10_000,
                 seed: int | None = None) -> None:
        self.delta = delta
        self.confidence = confidence
        self.min_observations = min_observations
        self._calibrations: dict[str, Calibration] = {}  # by tenant
        Calibration(delta, confidence, min_observations)  # raises on bad knobs here, not at a first lookup
        self.min_similarity = min_similarity
        self.explore_fraction = explore_fraction
        self.max_entries = max_entries
        self._rng = random.Random(seed)
        self._entries: dict[Namespace, OrderedDict[int, CacheEntry]] = {}  # LRU order
        self._indexes: dict[Namespace, Index] = {}  # HNSW over the entries' vectors, by entry id
        self._next_id = 1
        self._events: list[CacheEvent] = []
        self.num_hits = self.num_misses = self.num_explored = self.num_guarded = 0

    @classmethod
    def create_simulated(cls, **knobs) -> "SemanticCache":
        """A cache with a fixed random seed, for tests and the evaluation."""
        return cls(seed=0, **knobs)

    # --- the request path ---------------------------------------------------------------------------------

    def lookup(self, namespace: Namespace, prompt: str, vector: np.ndarray) -> Lookup:
        entry, similarity = self._nearest(namespace, vector)
        threshold = self.calibration_of(namespace.tenant).threshold()
        if entry is None or similarity < self.min_similarity:
            self.num_misses += 1
            return Lookup("miss", entry, similarity, threshold)
        if differs_in_meaning(prompt, entry.prompt):
            self.num_guarded += 1
            return Lookup("guarded", entry, similarity, threshold)
        applied = max(threshold, math.nextafter(entry.wrong_above, math.inf))
        if similarity >= applied and self._rng.random() >= self.explore_fraction:
            self.num_hits += 1
            entry.num_hits += 1
            self._entries[namespace].move_to_end(entry.entry_id)
            return Lookup("hit", entry, similarity, applied)
        self.num_explored += 1
        return Lookup("explore", entry, similarity, applied)

    def record(self, lookup: Lookup, same_answer: bool) -> None:
        """The answer computed for an explored request was (not) the nearest entry's."""
        if lookup.outcome != "explore" or lookup.entry is None:
            raise ValueError(f"only an explored lookup is labelled, not a {lookup.outcome}")
        tenant = lookup.entry.namespace.tenant
        self.calibration_of(tenant).observe(lookup.similarity, same_answer)
        self._events.append(CacheEvent("observed", lookup.entry, lookup.similarity, same_answer, tenant))
        entry = lookup.entry
        if not same_answer and lookup.similarity > entry.wrong_above:
            entry.wrong_above = lookup.similarity
            self._events.append(CacheEvent("updated", entry))

    def insert(self, namespace: Namespace, prompt: str, vector: np.ndarray, answer: str,
               details: dict | None = None, entry_id: int | None = None) -> CacheEntry:
        """A computed answer becomes an entry. `entry_id`: one the caller allocated where replicas share
        entries (it must be unique across them); by default the next local one."""
        if entry_id is None:
            entry_id = self._next_id
        elif self._find(namespace, entry_id) is not None:
            raise ValueError(f"entry {entry_id} exists already")
        entry = CacheEntry(entry_id, namespace, prompt, answer, unit(vector), dict(details or {}))
        self._add(entry)
        return entry

    def apply(self, event: CacheEvent) -> None:
        """Another replica's event: the same change, nothing queued. Idempotent (an entry already here is
        kept, a threshold only rises), except "observed", which each replica must apply once."""
        entry = event.entry
        if event.kind == "observed":
            self.calibration_of(event.tenant).observe(event.similarity, event.same_answer)
        elif event.kind == "inserted":
            if self._find(entry.namespace, entry.entry_id) is None:
                self._add(entry, queue_events=False)
        elif event.kind == "updated":
            mine = self._find(entry.namespace, entry.entry_id)
            if mine is not None:
                mine.wrong_above = max(mine.wrong_above, entry.wrong_above)
        elif event.kind == "evicted":
            self._remove(entry.namespace, entry.entry_id)
        else:
            raise ValueError(f"unknown cache event {event.kind!r}")

    def _add(self, entry: CacheEntry, queue_events: bool = True) -> None:
        namespace = entry.namespace
        entries = self._entries.setdefault(namespace, OrderedDict())
        index = self._indexes.get(namespace)
        if index is None:
            index = self._indexes[namespace] = Index(ndim=entry.vector.shape[0], metric="ip", dtype="f32")
        elif entry.vector.shape[0] != index.ndim:
            raise ValueError(f"an embedding of {entry.vector.shape[0]} dimensions in an index of {index.ndim}")
        self._next_id = max(self._next_id, entry.entry_id + 1)
        entries[entry.entry_id] = entry
        index.add(entry.entry_id, entry.vector)
        if queue_events:
            self._events.append(CacheEvent("inserted", entry))
        while len(entries) > self.max_entries:
            _, evicted = entries.popitem(last=False)
            index.remove(evicted.entry_id)
            if queue_events:
                self._events.append(CacheEvent("evicted", evicted))

    def _find(self, namespace: Namespace, entry_id: int) -> CacheEntry | None:
        return self._entries.get(namespace, {}).get(entry_id)

    def _remove(self, namespace: Namespace, entry_id: int) -> None:
        if self._entries.get(namespace, {}).pop(entry_id, None) is not None:
            self._indexes[namespace].remove(entry_id)

    def calibration_of(self, tenant: str) -> Calibration:
        calibration = self._calibrations.get(tenant)
        if calibration is None:
            calibration = self._calibrations[tenant] = Calibration(self.delta, self.confidence,
                                                                   self.min_observations)
        return calibration

    def take_events(self) -> list[CacheEvent]:
        events, self._events = self._events, []
        return events

    def num_entries(self, namespace: Namespace) -> int:
        return len(self._entries.get(namespace, ()))

    def _nearest(self, namespace: Namespace, vector: np.ndarray) -> tuple[CacheEntry | None, float]:
        entries = self._entries.get(namespace)
        if not entries:
            return None, -math.inf
        query = unit(vector)
        found = self._indexes[namespace].search(query, 1)
        if len(found.keys) == 0:
            return None, -math.inf
        entry = entries[int(found.keys[0])]
        return entry, float(entry.vector @ query)  # the exact cosine decides, not the index's estimate


def unit(vector: np.ndarray) -> np.ndarray:
    vector = np.asarray(vector, dtype=np.float32)
    norm = float(np.linalg.norm(vector))
    if norm == 0.0 or not math.isfinite(norm):
        raise ValueError("an embedding must be a finite, non-zero vector")
    return vector / norm


# --- the guard -------------------------------------------------------------------------------------------

_NEGATIONS = frozenset("not no non never none nothing nobody neither nor cannot without".split())
_NEGATING_PREFIXES = ("un", "in", "im", "il", "ir", "dis", "non")
# Common opposites that carry a question's polarity; either word of a pair in one prompt and the other
# word in the other prompt reverses it. Written with the evaluation set (bench/data), so that set measures
# this list's recall optimistically; the learned threshold is what bounds errors beyond it.
_OPPOSITES = [
    ("good", "bad"), ("better", "worse"), ("best", "worst"), ("safe", "dangerous"), ("pros", "cons"),
    ("advantages", "disadvantages"), ("true", "false"), ("increase", "decrease"), ("increases", "decreases"),
    ("more", "less"), ("most", "least"), ("high", "low"), ("higher", "lower"), ("allowed", "forbidden"),
    ("permitted", "prohibited"), ("good", "poor"), ("like", "dislike"), ("love", "hate"), ("always", "never"),
    ("before", "after"), ("above", "below"), ("maximum", "minimum"), ("max", "min"), ("add", "remove"),
    ("start", "stop"), ("open", "close"), ("enable", "disable"), ("include", "exclude"), ("accept", "reject"),
    ("win", "lose"), ("buy", "sell"), ("hot", "cold"), ("fast", "slow"), ("easy", "hard"), ("cheap", "expensive"),
    ("strong", "weak"), ("success", "failure"), ("benefits", "risks"), ("benefits", "drawbacks"),
    ("strengths", "weaknesses"), ("right", "wrong"), ("valid", "invalid"), ("legal", "illegal"),
    ("up", "down"), ("first", "last"), ("early", "late"), ("rich", "poor"), ("healthy", "harmful"),
]
_OPPOSITE_OF: dict[str, set[str]] = {}
for _a, _b in _OPPOSITES:
    _OPPOSITE_OF.setdefault(_a, set()).add(_b)
    _OPPOSITE_OF.setdefault(_b, set()).add(_a)
_NUMBER_WORDS = frozenset(
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen "
    "seventeen eighteen nineteen twenty thirty forty fifty sixty seventy eighty ninety hundred thousand "
    "million billion trillion half quarter double twice triple first second third fourth fifth sixth "
    "seventh eighth ninth tenth dozen".split())
_WORD = re.compile(r"[A-Za-z]+(?:'[A-Za-z]+)?|\d+(?:[.,]\d+)*")
_CONTRACTED_NOT = re.compile(r"n't$|n’t$", re.IGNORECASE)


def differs_in_meaning(a: str, b: str) -> bool:
    """Whether two prompts that may embed alike ask different things (see the module docstring, step 2)."""
    words_a, words_b = _words(a), _words(b)
    lower_a, lower_b = [w.lower() for w in words_a], [w.lower() for w in words_b]
    if _negation_count(lower_a) != _negation_count(lower_b):
        return True
    set_a, set_b = set(lower_a), set(lower_b)
    for mine, theirs in ((set_a, set_b), (set_b, set_a)):
        for word in mine - theirs:
            if any(word.startswith(p) and len(word) - len(p) >= 4 and word[len(p):] in theirs - mine
                   for p in _NEGATING_PREFIXES):  # a stem of 4 letters at least: "into" is not "to" negated
                return True
            if _OPPOSITE_OF.get(word, set()) & (theirs - mine):
                return True
    if sorted(_numbers(lower_a)) != sorted(_numbers(lower_b)):
        return True
    return _names(words_a) - set_b != set() or _names(words_b) - set_a != set()


def _words(text: str) -> list[str]:
    """Words and numbers; a possessive is its noun ("Australia's" -> "Australia")."""
    return [w[:-2] if w.lower().endswith("'s") else w for w in _WORD.findall(text.replace("’", "'"))]


def _negation_count(lower: list[str]) -> int:
    return sum(1 for w in lower if w in _NEGATIONS or _CONTRACTED_NOT.search(w))


def _numbers(lower: list[str]) -> list[str]:
    return [w.replace(",", "") for w in lower if w[0].isdigit() or w in _NUMBER_WORDS]


def _names(words: list[str]) -> set[str]:
    """Capitalised words other than a sentence's first (lowercased): names, places, products."""
    names = set()
    for i, word in enumerate(words):
        if i > 0 and word[:1].isupper() and word.lower() not in ("i",):
            names.add(word.lower())
    return names
