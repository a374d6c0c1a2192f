"""The synthetic multi-tenant trace of `kite simulate` (the model: kite_cli/simulate/__init__.py).

A session is: a tenant, that tenant's system prompt, 0..max_docs retrieved documents, then turns of
question + answer. Turn i's prompt is the whole history before it plus its question, so the token
sequence of the session's last turn (prompt + answer) contains every earlier turn's sequence as a
prefix, and one hash chain over it (kite_shared.fingerprint.block_hash_chain, the fingerprinter's own
code, with the tenant's cache salt) names every block of every turn: a turn uses the first
`len(its tokens) // block_size` hashes. Hashes are interned, so a block shared by many sessions is one
bytes object, as it would be one key in the pool's index.

Everything random comes from numpy generators seeded by (seed, purpose, ...): the same seed gives the
same token ids, hashes and arrival times, and a tenant's system prompt or a document is the same tokens
in every session that uses it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from kite_shared import security
from kite_shared.fingerprint import (ExecutionPathFingerprint, KVLayout, ModelFingerprint, block_hash_chain,
                                     root_hash)
from kite_cli.simulate.config import TraceConfig

# Streams of the seeded generators, so adding a draw to one purpose never shifts another's numbers.
_SESSIONS, _SYSTEM, _DOCUMENT, _ARRIVALS = 1, 2, 3, 4


def model_root(block_size: int) -> tuple[bytes, str]:
    """(root hash, model fingerprint hex) of a SmolLM2-135M-shaped model on vLLM-CPU: the hashes are
    real computation fingerprints, just of a model nobody loads."""
    model = ModelFingerprint(weights_digest="kite-simulate", adapter_digest="", dtype="float32",
                             quantization="", layout=KVLayout(num_layers=30, num_kv_heads=3, head_dim=64,
                                                              rope_theta=100000.0, rope_scaling="",
                                                              norm_eps=1e-5, block_size=block_size))
    root = root_hash(model, ExecutionPathFingerprint(attn_impl="sim", kv_storage_dtype="float32",
                                                     engine="kite-simulate", device_class="sim"))
    return root, root.hex()


@dataclass(slots=True)
class Request:
    arrival_s: float
    session: int  # index into Trace.chains / Trace.session_tenant
    turn: int  # 0 for a session's first request
    prompt_tokens: int
    output_tokens: int
    num_blocks: int  # full blocks of prompt + answer: the first num_blocks of the session's chain

    @property
    def session_id(self) -> str:
        return f"s{self.session}"


@dataclass
class Trace:
    config: TraceConfig
    model_fingerprint: str
    requests: list[Request]  # by arrival time
    chains: list[list[bytes]]  # per session: block hashes of its last turn's prompt + answer
    session_tenant: list[int]
    tenant_names: list[str]
    tenant_tags: list[str]  # kite_shared.security.tenant_tag, what the pool's storage keys name
    num_distinct_blocks: int  # distinct hashes over every request's prompt + answer
    rate: float  # requests/s of the arrivals
    num_hashed_blocks: int  # blocks the chains hashed (the fingerprinter would hash each prompt again)
    hash_seconds: float  # wall time of block_hash_chain over the sessions
    generate_seconds: float  # wall time of the whole generation

    @property
    def num_sessions(self) -> int:
        return len(self.chains)

    def prompt_blocks(self, r: Request) -> int:
        return r.prompt_tokens // self.config.block_size


def _zipf_cdf(n: int, exponent: float) -> np.ndarray:
    weights = 1.0 / np.arange(1, n + 1, dtype=np.float64) ** exponent
    cdf = np.cumsum(weights)
    return cdf / cdf[-1]


def _uniform(rng: np.random.Generator, bounds: tuple[int, int]) -> int:
    lo, hi = bounds
    return int(rng.integers(lo, hi + 1))


def generate(cfg: TraceConfig, capacity_tokens_per_s: float) -> Trace:
    """Sessions until the trace holds `cfg.target_blocks` distinct blocks (or `cfg.num_requests`
    requests); arrivals at `cfg.rate`, or at `cfg.load` x `capacity_tokens_per_s` / mean prompt tokens
    when the rate is 0 (the offered load if no prefix were reused)."""
    started = time.perf_counter()
    root, fingerprint = model_root(cfg.block_size)
    bs = cfg.block_size
    rng = np.random.default_rng([cfg.seed, _SESSIONS])
    tenant_cdf = _zipf_cdf(cfg.num_tenants, cfg.tenant_exponent)
    doc_cdf = _zipf_cdf(cfg.num_documents, cfg.doc_exponent)
    tenant_names = [f"tenant-{t:04d}" for t in range(cfg.num_tenants)]
    salts = [security.tenant_cache_salt(name) for name in tenant_names]
    system_prompts: dict[int, np.ndarray] = {}

    def system_prompt(t: int) -> np.ndarray:
        tokens = system_prompts.get(t)
        if tokens is None:
            g = np.random.default_rng([cfg.seed, _SYSTEM, t])
            tokens = system_prompts[t] = g.integers(0, cfg.vocab_size, _uniform(g, cfg.system_tokens),
                                                     dtype=np.int64)
        return tokens

    def document(t: int, d: int) -> np.ndarray:
        # Not cached: a tail document is seen once, and drawing 4,096 ids costs microseconds.
        g = np.random.default_rng([cfg.seed, _DOCUMENT, t, d])
        return g.integers(0, cfg.vocab_size, _uniform(g, cfg.doc_tokens), dtype=np.int64)

    interned: dict[bytes, bytes] = {}
    chains: list[list[bytes]] = []
    session_tenant: list[int] = []
    # per session: [(offset from the session's start, prompt tokens, output tokens, blocks)]
    turns_of: list[list[tuple[float, int, int, int]]] = []
    num_requests = 0
    hashed = 0
    hash_seconds = 0.0
    p_next_turn = 1.0 - 1.0 / max(1.0, cfg.turns_mean)
    longest_turn = cfg.question_tokens[1] + cfg.answer_tokens[1]
    while len(interned) < cfg.target_blocks and not (cfg.num_requests and num_requests >= cfg.num_requests):
        t = int(np.searchsorted(tenant_cdf, rng.random()))
        parts = [system_prompt(t)]
        history = len(parts[0])
        if rng.random() < cfg.doc_fraction:
            for _ in range(int(rng.integers(1, cfg.max_docs + 1))):
                doc = document(t, int(np.searchsorted(doc_cdf, rng.random())))
                # the first turn must fit the context window, whatever its question and answer
                if history + len(doc) + longest_turn <= cfg.max_context_tokens:
                    parts.append(doc)
                    history += len(doc)
        turns = []
        offset = 0.0
        while True:
            q = rng.integers(0, cfg.vocab_size, _uniform(rng, cfg.question_tokens), dtype=np.int64)
            a = rng.integers(0, cfg.vocab_size, _uniform(rng, cfg.answer_tokens), dtype=np.int64)
            if turns and history + len(q) + len(a) > cfg.max_context_tokens:
                break  # the conversation outgrew the context window: the session ends
            prompt = history + len(q)
            history = prompt + len(a)
            parts += (q, a)
            turns.append((offset, prompt, len(a), history // bs))
            num_requests += 1
            if rng.random() >= p_next_turn or (cfg.num_requests and num_requests >= cfg.num_requests):
                break
            offset += float(rng.exponential(cfg.think_time_s))
        t0 = time.perf_counter()
        chain = block_hash_chain(np.concatenate(parts), bs, root, salts[t])
        hash_seconds += time.perf_counter() - t0
        hashed += len(chain)
        setdefault = interned.setdefault
        chains.append([setdefault(h, h) for h in chain])
        session_tenant.append(t)
        turns_of.append(turns)

    num_distinct = len(interned)
    del interned
    mean_prompt = (sum(p for turns in turns_of for _, p, _, _ in turns) / max(1, num_requests))
    rate = cfg.rate or cfg.load * capacity_tokens_per_s / max(1.0, mean_prompt)
    session_rate = rate * len(turns_of) / max(1, num_requests)
    arrivals = np.cumsum(np.random.default_rng([cfg.seed, _ARRIVALS]).exponential(1.0 / session_rate,
                                                                                  len(turns_of)))
    requests = [Request(float(arrivals[s]) + offset, s, i, prompt, out, blocks)
                for s, turns in enumerate(turns_of)
                for i, (offset, prompt, out, blocks) in enumerate(turns)]
    requests.sort(key=lambda r: (r.arrival_s, r.session, r.turn))
    return Trace(config=cfg, model_fingerprint=fingerprint, requests=requests, chains=chains,
                 session_tenant=session_tenant, tenant_names=tenant_names,
                 tenant_tags=[security.tenant_tag(n) for n in tenant_names], num_distinct_blocks=num_distinct,
                 rate=rate, num_hashed_blocks=hashed, hash_seconds=hash_seconds,
                 generate_seconds=time.perf_counter() - started)
