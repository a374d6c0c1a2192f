"""Benchmark workloads: deterministic chat sessions built from a seed (no data set, nothing downloaded).

A workload is a list of sessions; a session is a list of user turns sent one after another, each turn's
prompt being the session's messages so far (the system's own answers are appended between turns).
Single-shot workloads have one turn per session.

- system-prompt: many users, one shared long system prompt, short distinct questions.
- multi-turn: concurrent sessions whose history grows turn by turn (answers appended).
- rag-shuffle: the same documents in a varying order, then a question.
- unique: nothing shared between requests.

Lengths are in tokens when a `count_tokens` callable is given (the text is trimmed to fit), otherwise
approximate (one word per token, which overestimates words slightly for this vocabulary).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Callable

WORKLOADS = ("system-prompt", "multi-turn", "rag-shuffle", "unique")

CountTokens = Callable[[str], int]

_NOUNS = ("river", "engine", "garden", "market", "signal", "harbor", "ledger", "forest", "bridge", "circuit",
          "library", "station", "orchard", "compass", "lantern", "valley", "factory", "mirror", "village",
          "archive", "tower", "meadow", "canal", "workshop", "theater", "kitchen", "glacier", "satellite",
          "museum", "island", "bakery", "tunnel", "quarry", "academy", "observatory", "pipeline", "vineyard",
          "warehouse", "cathedral", "laboratory", "password", "invoice", "contract", "schedule", "network",
          "battery", "window", "ticket", "parcel", "report")
_VERBS = ("measures", "protects", "connects", "records", "repairs", "observes", "delivers", "explains",
          "balances", "collects", "shapes", "guides", "follows", "supports", "changes", "lights", "opens",
          "counts", "builds", "checks", "stores", "carries", "describes", "shares", "reviews")
_ADJECTIVES = ("quiet", "bright", "ancient", "narrow", "careful", "distant", "modern", "heavy", "gentle",
               "rapid", "hidden", "public", "local", "formal", "simple", "golden", "northern", "private",
               "steady", "curious", "broken", "silver", "useful", "early", "frequent")
_ADVERBS = ("slowly", "always", "rarely", "carefully", "often", "quickly", "quietly", "openly", "never",
            "usually")
_QUESTION_WORDS = ("How", "Why", "When", "Where", "What")
_TOPICS = ("refund policy", "opening hours", "delivery times", "warranty terms", "account security",
           "pricing tiers", "support channels", "data retention", "shipping limits", "return process")


@dataclass(frozen=True)
class Turn:
    user: str  # the user message of this turn


@dataclass
class Session:
    session_id: str
    system: str | None  # system message, or None
    turns: list[Turn]


@dataclass
class Workload:
    name: str
    seed: int
    sessions: list[Session]
    params: dict = field(default_factory=dict)

    @property
    def num_requests(self) -> int:
        return sum(len(s.turns) for s in self.sessions)


def _sentence(rng: random.Random) -> str:
    words = [rng.choice(_ADJECTIVES).capitalize(), rng.choice(_NOUNS), rng.choice(_ADVERBS),
             rng.choice(_VERBS), "the", rng.choice(_ADJECTIVES), rng.choice(_NOUNS)]
    if rng.random() < 0.5:
        words += ["near", "the", rng.choice(_NOUNS)]
    return " ".join(words) + "."


def make_text(rng: random.Random, num_tokens: int, count_tokens: CountTokens | None = None) -> str:
    """Deterministic prose of about `num_tokens` tokens (at most, when `count_tokens` is given)."""
    if num_tokens <= 0:
        return ""
    sentences: list[str] = []
    words = 0
    while words < num_tokens:  # each word is at least one token: enough material
        s = _sentence(rng)
        sentences.append(s)
        words += len(s.split())
    text = " ".join(sentences)
    if count_tokens is None:
        return " ".join(text.split()[:num_tokens])
    tokens = text.split()
    lo, hi = 1, len(tokens)  # largest word prefix whose token count fits
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if count_tokens(" ".join(tokens[:mid])) <= num_tokens:
            lo = mid
        else:
            hi = mid - 1
    return " ".join(tokens[:lo])


def make_question(rng: random.Random, index: int, num_tokens: int, count_tokens: CountTokens | None = None) -> str:
    head = f"Question {index}: {rng.choice(_QUESTION_WORDS)} does the {rng.choice(_NOUNS)} " \
           f"{rng.choice(_VERBS).rstrip('s')} the {rng.choice(_ADJECTIVES)} {rng.choice(_NOUNS)}?"
    extra = max(0, num_tokens - len(head.split()) * 2)  # question words are ~2 tokens on average
    tail = make_text(rng, extra, count_tokens) if extra else ""
    return f"{head} Context: {tail}" if tail else head


def system_prompt(seed: int, requests: int = 16, shared_tokens: int = 1000, question_tokens: int = 24,
                  count_tokens: CountTokens | None = None) -> Workload:
    rng = random.Random(f"system-prompt/{seed}")
    system = ("You are the support assistant of the Kite company. Follow the handbook below and answer in "
              "one or two sentences.\nHANDBOOK:\n" + make_text(rng, shared_tokens, count_tokens))
    sessions = [Session(f"user-{i}", system, [Turn(make_question(rng, i, question_tokens, count_tokens))])
                for i in range(requests)]
    return Workload("system-prompt", seed, sessions,
                    {"requests": requests, "shared_tokens": shared_tokens, "question_tokens": question_tokens})


def multi_turn(seed: int, sessions: int = 4, turns: int = 4, first_tokens: int = 200, turn_tokens: int = 40,
               count_tokens: CountTokens | None = None) -> Workload:
    rng = random.Random(f"multi-turn/{seed}")
    out = []
    for s in range(sessions):
        topic = rng.choice(_TOPICS)
        first = f"I have a question about the {topic}. Here is my situation: " + \
            make_text(rng, first_tokens, count_tokens)
        follow = [Turn(f"Follow-up {t}: " + make_text(rng, turn_tokens, count_tokens) + " What should I do?")
                  for t in range(1, turns)]
        out.append(Session(f"session-{s}", "You are a helpful assistant.", [Turn(first)] + follow))
    return Workload("multi-turn", seed, out, {"sessions": sessions, "turns": turns, "first_tokens": first_tokens,
                                              "turn_tokens": turn_tokens})


def rag_shuffle(seed: int, requests: int = 16, documents: int = 4, doc_tokens: int = 250,
                question_tokens: int = 24, count_tokens: CountTokens | None = None) -> Workload:
    rng = random.Random(f"rag-shuffle/{seed}")
    docs = [f"[Document {d + 1}] " + make_text(rng, doc_tokens, count_tokens) for d in range(documents)]
    sessions = []
    for i in range(requests):
        order = list(range(documents))
        rng.shuffle(order)
        context = "\n\n".join(docs[d] for d in order)
        question = make_question(rng, i, question_tokens, count_tokens)
        sessions.append(Session(f"rag-{i}", "Answer using only the documents.",
                                [Turn(f"{context}\n\n{question}")]))
    return Workload("rag-shuffle", seed, sessions, {"requests": requests, "documents": documents,
                                                    "doc_tokens": doc_tokens, "question_tokens": question_tokens})


def unique(seed: int, requests: int = 16, prompt_tokens: int = 256,
           count_tokens: CountTokens | None = None) -> Workload:
    rng = random.Random(f"unique/{seed}")
    sessions = [Session(f"unique-{i}", None, [Turn(f"Request {i}. " + make_text(rng, prompt_tokens, count_tokens)
                                                   + " Summarize this in one sentence.")])
                for i in range(requests)]
    return Workload("unique", seed, sessions, {"requests": requests, "prompt_tokens": prompt_tokens})


def build(name: str, seed: int, *, requests: int, shared_tokens: int, question_tokens: int, sessions: int,
          turns: int, first_tokens: int, turn_tokens: int, documents: int, doc_tokens: int, prompt_tokens: int,
          count_tokens: CountTokens | None = None) -> Workload:
    if name == "system-prompt":
        return system_prompt(seed, requests, shared_tokens, question_tokens, count_tokens)
    if name == "multi-turn":
        return multi_turn(seed, sessions, turns, first_tokens, turn_tokens, count_tokens)
    if name == "rag-shuffle":
        return rag_shuffle(seed, requests, documents, doc_tokens, question_tokens, count_tokens)
    if name == "unique":
        return unique(seed, requests, prompt_tokens, count_tokens)
    raise ValueError(f"unknown workload {name!r}; expected one of {', '.join(WORKLOADS)}")


def messages_for(session: Session, turn_index: int, answers: list[str]) -> list[dict]:
    """Chat messages of turn `turn_index` given the answers to the earlier turns."""
    msgs: list[dict] = [{"role": "system", "content": session.system}] if session.system is not None else []
    for t in range(turn_index):
        msgs.append({"role": "user", "content": session.turns[t].user})
        msgs.append({"role": "assistant", "content": answers[t]})
    msgs.append({"role": "user", "content": session.turns[turn_index].user})
    return msgs
