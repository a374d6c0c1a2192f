"""How often does the semantic response cache answer, and how often wrongly? (issue 17)

The evaluation set (bench/data/semantic_cache_pairs.jsonl, written for KITE) holds pairs of a cached prompt
and a prompt asked later: paraphrases (the same answer) and negations, changed numbers, changed names and
unrelated prompts (another answer). Two prompts have the same answer when they are the same text or a
paraphrase pair; everything else is another answer.

Every cached prompt is an entry of one namespace. Each asked prompt is looked up against all of them and
judged by its nearest entry. Compared side by side, on the same embeddings (all-MiniLM-L6-v2):
- a fixed threshold at 0.8 cosine (GPTCache's and RedisVL's way), with and without KITE's guard;
- KITE's cache (kite_shared.semantic_cache): the guard plus the threshold learned under the bound delta.
  It learns only from what it computes: in k-fold cross-validation it streams the asked prompts of k-1
  folds (each lookup explored is labelled with the truth, as the gateway labels it with the computed
  answer), then the held-out fold, still learning, and only the held-out folds are counted.
Printed: hit rate (hits / asked), error rate (wrong hits / hits), hits per kind of pair.

    .venv/bin/python bench/eval_semantic_cache.py [--delta 0.02] [--confidence 0.8] [--folds 5] [--seeds 5]
"""

from __future__ import annotations

import argparse
import json
import random
from collections import Counter
from pathlib import Path

import numpy as np

from kite_shared.embedder import Embedder
from kite_shared.semantic_cache import Namespace, SemanticCache, differs_in_meaning

PAIRS = Path(__file__).parent / "data" / "semantic_cache_pairs.jsonl"
NAMESPACE = Namespace("eval", "0" * 64, "max_tokens=64")


def normalised(text: str) -> str:
    return " ".join(text.lower().split())


def answer_ids(pairs: list[dict]) -> dict[str, int]:
    """Prompt text -> an id shared by every prompt with the same answer (union-find over paraphrases)."""
    parent: dict[str, str] = {}

    def find(x: str) -> str:
        parent.setdefault(x, x)
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for pair in pairs:
        a, b = find(normalised(pair["cached"])), find(normalised(pair["asked"]))
        if pair["same_answer"]:
            parent[a] = b
    roots: dict[str, int] = {}
    return {text: roots.setdefault(find(text), len(roots)) for text in list(parent)}


class Tally:
    def __init__(self) -> None:
        self.asked = self.hits = self.wrong = 0
        self.hits_by_kind: Counter = Counter()
        self.wrong_by_kind: Counter = Counter()

    def add(self, kind: str, hit: bool, correct: bool) -> None:
        self.asked += 1
        if hit:
            self.hits += 1
            self.hits_by_kind[kind] += 1
            if not correct:
                self.wrong += 1
                self.wrong_by_kind[kind] += 1

    def line(self) -> str:
        error = f"{100 * self.wrong / self.hits:5.1f}%" if self.hits else "   - "
        kinds = ", ".join(f"{kind} {self.hits_by_kind[kind]}" + (f" ({self.wrong_by_kind[kind]} wrong)"
                                                                  if self.wrong_by_kind[kind] else "")
                          for kind in ("paraphrase", "negation", "number", "entity", "unrelated"))
        return (f"hit rate {100 * self.hits / self.asked:5.1f}%  error rate {error}  "
                f"({self.hits} hits, {self.wrong} wrong, of {self.asked})  hits by kind: {kinds}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--delta", type=float, default=0.02)
    parser.add_argument("--confidence", type=float, default=0.8)
    parser.add_argument("--fixed-threshold", type=float, default=0.8)
    parser.add_argument("--folds", type=int, default=5)
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--json", default="")
    args = parser.parse_args()

    pairs = [json.loads(line) for line in PAIRS.read_text().splitlines() if line.strip()]
    truth = answer_ids(pairs)
    texts = sorted({p["cached"] for p in pairs} | {p["asked"] for p in pairs})
    vectors = dict(zip(texts, Embedder().embed(texts)))
    cached = sorted({p["cached"] for p in pairs})
    matrix = np.stack([vectors[t] for t in cached])

    def nearest(prompt: str) -> tuple[str, float]:
        similarities = matrix @ vectors[prompt]
        best = int(np.argmax(similarities))
        return cached[best], float(similarities[best])

    def same(a: str, b: str) -> bool:
        return truth[normalised(a)] == truth[normalised(b)]

    print(f"{len(pairs)} pairs ({dict(Counter(p['kind'] for p in pairs))}), {len(cached)} cached prompts; "
          f"all-MiniLM-L6-v2 embeddings")
    similarity_by_kind: dict[str, list[float]] = {}
    for pair in pairs:
        similarity_by_kind.setdefault(pair["kind"], []).append(float(vectors[pair["cached"]] @ vectors[pair["asked"]]))
    for kind, values in similarity_by_kind.items():
        print(f"  cosine within {kind:10} pairs: min {min(values):.3f}  median {np.median(values):.3f}  "
              f"max {max(values):.3f}")

    fixed, fixed_guarded = Tally(), Tally()
    for pair in pairs:
        entry, similarity = nearest(pair["asked"])
        hit = similarity >= args.fixed_threshold
        fixed.add(pair["kind"], hit, same(entry, pair["asked"]))
        fixed_guarded.add(pair["kind"], hit and not differs_in_meaning(pair["asked"], entry),
                          same(entry, pair["asked"]))

    learned = Tally()
    thresholds = []
    for seed in range(args.seeds):
        order = list(range(len(pairs)))
        random.Random(seed).shuffle(order)
        folds = [order[i::args.folds] for i in range(args.folds)]
        for held_out in range(args.folds):
            cache = SemanticCache(delta=args.delta, confidence=args.confidence, seed=seed)
            for text in cached:
                cache.insert(NAMESPACE, text, vectors[text], answer=text)
            learning = [i for f, fold in enumerate(folds) if f != held_out for i in fold]
            for counted, indices in ((False, learning), (True, folds[held_out])):
                for i in indices:
                    pair = pairs[i]
                    lookup = cache.lookup(NAMESPACE, pair["asked"], vectors[pair["asked"]])
                    correct = lookup.entry is not None and same(lookup.entry.prompt, pair["asked"])
                    if lookup.outcome == "explore":
                        cache.record(lookup, correct)
                    if counted:
                        learned.add(pair["kind"], lookup.outcome == "hit", correct)
            thresholds.append(cache.calibration_of(NAMESPACE.tenant).threshold())

    print(f"\nfixed threshold {args.fixed_threshold} cosine, no guard:   {fixed.line()}")
    print(f"fixed threshold {args.fixed_threshold} cosine, KITE's guard: {fixed_guarded.line()}")
    print(f"KITE, delta {args.delta:.0%} at confidence {args.confidence}, learned ({args.folds}-fold, "
          f"{args.seeds} shuffles; held-out folds): {learned.line()}")
    finite = [t for t in thresholds if np.isfinite(t)]
    print(f"  learned threshold (the one tenant's) after each run: {len(finite)} of {len(thresholds)} found"
          + (f", {min(finite):.3f}-{max(finite):.3f}" if finite else ""))
    if args.json:
        Path(args.json).write_text(json.dumps({
            "fixed": vars(fixed) | {"hits_by_kind": dict(fixed.hits_by_kind), "wrong_by_kind": dict(fixed.wrong_by_kind)},
            "fixed_guarded": {"asked": fixed_guarded.asked, "hits": fixed_guarded.hits, "wrong": fixed_guarded.wrong},
            "learned": {"asked": learned.asked, "hits": learned.hits, "wrong": learned.wrong,
                        "hits_by_kind": dict(learned.hits_by_kind), "wrong_by_kind": dict(learned.wrong_by_kind)},
            "thresholds": thresholds}, indent=2, default=str))


if __name__ == "__main__":
    main()
