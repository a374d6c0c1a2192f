"""Issue 14's acceptance on the whole stack: two ru-pool replicas and two arbitrators, SIGKILL one of each
(the lease holders) during a load of concurrent chat requests: no request fails, every greedy answer is
the one computed without reuse, pool hits resume within 5 s, the other arbitrator leads within its lease;
then a third pool replica joins and takes a share of the pool's queue-group work, nothing restarted.

Real processes (LocalStack): nats-server with JetStream (the leases), a real redis-server (the warm tier,
started by the stack), two transformers workers (the reference engine: it starts in seconds), the real
model.

Hits that need the pool. A worker reuses blocks from its own cache, and blocks it once loaded from the
pool stay staged in its loader (64 MiB) and skip the pool afterwards; a load that asked for the same
prompts again and again would show hits whether or not any pool replica lived. So:
  * the workers' caches hold CACHE_BLOCKS blocks (about three prompts) and keep no generated blocks;
  * every load request is the first of its kind: prompt j of round r carries the cache salt of round r,
    so its blocks are its own (the salt is hashed into every block; the greedy answer does not depend on
    it, so the reuse-off reference of prompt j holds for every round). Before the load each (r, j) is
    computed once ("priming": its blocks go to the pool, hot in one replica and written to Redis), and
    the rounds are then asked in priming order, so by the time round r is asked the workers' small caches
    have long dropped its blocks;
  * a FULL hit (cached_tokens covering every full block of the prompt) therefore needs the pool: the
    blocks past the round's shared system prompt were never loaded into this worker, only the pool's
    lookup (answered by a replica: which tier holds them) and then a direct Redis read or a pool `get`
    bring them. A request whose lookup went to the killed replica, or timed out, is computed instead:
    same answer, fewer cached tokens.
The test fails without the pool: with BOTH pool replicas killed (tried once by hand) not one request after
the kill was a full hit (0 of 25; cached_tokens 192, the round's system prompt from the worker's own
cache, or 0), while answers stayed right and none failed.

Printed figures, three runs on the 2-core machine (load average 5-6 from other suites): the first request
sent after the kill was a full hit (sent 0.0 s after it, answered 3.2-4.0 s after: the load's p50
latency is 3.0-3.4 s), 25 of 25 requests after the kill full hits, as the 12 before it; arbitrator
takeover 1.6-2.1 s (lease 1.5 s); ru-pool-3 serving 1.7-2.0 s after its start, then answering 18-19 of
32 lookups and 41-48 of 88 puts next to the survivor. The test takes about 2 minutes.
"""

from __future__ import annotations

import asyncio
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import nats
import pytest

from kite_shared import subjects
from kite_shared.config import ModelConfig, load
from kite_shared.messages import ArbitratorTelemetry, PoolAdminReply
from tests.helpers import pool_stats_async, wait_until
from tests.integration.conftest import MODEL

pytestmark = pytest.mark.timeout(420)

LEASE_S = 1.5  # both leases (KITE_POOL_LEASE_S, KITE_ARBITRATOR_LEASE_S)
TELEMETRY_S = 0.5
# A leader that dies is replaced once its lease entry ages out: the lease, one renewal (a third of it),
# and a telemetry interval to say so, plus delivery on a loaded 2-core machine (as in the replica tests).
TAKEOVER_BOUND_S = LEASE_S + LEASE_S / 3 + TELEMETRY_S + 1.5
HITS_RESUME_S = 5.0  # the acceptance bound: hits resume within 5 s of the kill
BLOCK_TOKENS = load(ModelConfig).block_size
# One block of SmolLM2-135M's KV in float32, stored by default: 30 layers x (K, V) x 3 KV heads x block x 64 dims x 4 B.
BLOCK_BYTES = 30 * 2 * 3 * BLOCK_TOKENS * 64 * 4
CACHE_BLOCKS = 24
CONCURRENCY = 4
# Salted rounds of the 8 prompts: each request of the load is the first of its kind. Enough that the load
# outlasts the kill by well over HITS_RESUME_S: with 5 rounds, once pool reads got faster (issue 15),
# the load ended 5.6 s after the kill with 1 request sent after the 5 s mark.
ROUNDS = 8
KILL_AFTER = 12  # load requests answered before the kills
MAX_TOKENS = 8

SYSTEM = ("You are the replica failover test assistant of a serving fleet. "
          + " ".join(f"Rule {i}: when replica {i} dies, its peers keep every request and every block."
                     for i in range(9)))
TOPICS = ["the capital of France", "the colour of the sky at noon", "how bees make honey",
          "why ice floats on water", "what a prime number is", "how a bicycle stays upright",
          "why leaves turn red in autumn", "what makes bread rise"]
QUESTIONS = [f"Question {i}: explain {topic} to a curious child of ten, in plain words. Keep it short and "
             f"friendly, and start with one clear sentence about {topic}, then add one surprising detail "
             f"about {topic} that the child can repeat to a friend at school tomorrow."
             for i, topic in enumerate(TOPICS)]


@dataclass
class Answer:
    prompt: int
    salt: str
    started: float
    ended: float
    status: int
    text: str = ""
    prompt_tokens: int = 0
    cached: int = 0
    worker: str = ""
    error: str = ""

    @property
    def full_hit(self) -> bool:
        """Every full block of the prompt was reused (the last prompt token is always computed)."""
        full = min(self.prompt_tokens // BLOCK_TOKENS * BLOCK_TOKENS, self.prompt_tokens - 1)
        return self.status == 200 and self.prompt_tokens > 0 and self.cached >= full


def chat(client: httpx.Client, prompt: int, reuse: bool = True, salt: str = "",
         max_tokens: int = MAX_TOKENS) -> Answer:
    body = {"model": MODEL, "temperature": 0, "max_tokens": max_tokens, "kite": {"reuse": reuse},
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTIONS[prompt]}]}
    if salt:
        body["cache_salt"] = salt
    started = time.monotonic()
    try:
        r = client.post("/v1/chat/completions", json=body)
    except httpx.HTTPError as exc:
        return Answer(prompt, salt, started, time.monotonic(), 0, error=repr(exc))
    answer = Answer(prompt, salt, started, time.monotonic(), r.status_code, worker=r.headers.get("X-Kite-Worker", ""))
    if r.status_code != 200:
        answer.error = r.text[:300]
        return answer
    data = r.json()
    answer.text = data["choices"][0]["message"]["content"]
    answer.prompt_tokens = data["usage"]["prompt_tokens"]
    answer.cached = (data["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return answer


class Bus:
    """A NATS connection on its own event-loop thread: who leads among the arbitrators (their telemetry,
    with the time each replica first said it leads) and the ru-pool replicas' own `stats`."""

    def __init__(self, url: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.arbitrators: dict[str, tuple[bool, float]] = {}  # instance -> (leads, when), its last telemetry
        self.leading_since: dict[str, float] = {}  # instance -> first telemetry saying it leads
        self.nc = self.run(nats.connect(url))
        self.run(self.nc.subscribe(subjects.telemetry("arbitrator"), cb=self._on_arbitrator))

    def run(self, coro, timeout_s: float = 30.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    async def _on_arbitrator(self, msg) -> None:
        t = ArbitratorTelemetry.decode(msg.data)
        self.arbitrators[t.instance_id] = (t.leader, time.monotonic())
        if t.leader:
            self.leading_since.setdefault(t.instance_id, time.monotonic())
        else:
            self.leading_since.pop(t.instance_id, None)

    def arbitrator_leaders(self, fresh_s: float = 4 * TELEMETRY_S) -> list[str]:
        """The arbitrators whose telemetry of the last `fresh_s` says they lead (a killed one says nothing
        more: its last word was that it led)."""
        now = time.monotonic()
        return sorted(name for name, (leads, at) in self.arbitrators.items() if leads and now - at < fresh_s)

    def stats_of(self, replica: str, timeout_s: float = 5.0) -> PoolAdminReply | None:
        """One replica's own view (subjects.pool_replica); None while it does not answer."""
        async def ask() -> PoolAdminReply | None:
            try:
                return await pool_stats_async(self.nc, replica, timeout_s)
            except Exception:
                return None
        return self.run(ask(), timeout_s + 5)

    def close(self) -> None:
        try:
            self.run(self.nc.close())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(5)


def warm_blocks(bus: Bus, replica: str) -> int:
    stats = bus.stats_of(replica)
    return stats.tiers["warm"].blocks if stats is not None and "warm" in stats.tiers else -1


def pool_ready(bus: Bus, replicas: list[str], count: int) -> bool:
    """Every replica answers, has rebuilt its index, serves the queue group and counts `count` replicas."""
    for replica in replicas:
        stats = bus.stats_of(replica, timeout_s=2.0)
        if stats is None:
            return False
        c = stats.counters
        if c.get("rebuilding") != 0 or c.get("serving") != 1 or c.get("replicas") != count:
            return False
    return True


def test_sigkill_of_a_pool_replica_and_the_leading_arbitrator_under_load(fresh_stack_factory):
    test_started = time.monotonic()
    stack = fresh_stack_factory(num_workers=2, pool_replicas=2, arbitrators=2, env={
        "KITE_WORKER_NUM_THREADS": "1",  # two workers on two cores
        "KITE_WORKER_CACHE_BYTES": str(CACHE_BLOCKS * BLOCK_BYTES),
        "KITE_WORKER_CACHE_GENERATED": "off",
        "KITE_POOL_LEASE_S": str(LEASE_S), "KITE_ARBITRATOR_LEASE_S": str(LEASE_S),
        "KITE_TELEMETRY_INTERVAL_S": str(TELEMETRY_S), "KITE_LOG_LEVEL": "INFO"})
    assert stack.redis is not None, "this test needs redis-server installed (the warm tier)"
    pools = [p.instance_id for p in stack.pool_replicas()]
    arbitrators = [p.instance_id for p in stack.arbitrators()]
    assert pools == ["ru-pool-1", "ru-pool-2"] and arbitrators == ["arbitrator-1", "arbitrator-2"]
    bus = Bus(stack.nats.url)
    client = httpx.Client(base_url=stack.http_url, timeout=120,
                          limits=httpx.Limits(max_connections=CONCURRENCY + 2))
    figures: dict[str, object] = {}
    try:
        stack.wait_workers(2)
        wait_until(lambda: pool_ready(bus, pools, 2), 60, "both pool replicas serving")
        wait_until(lambda: len(bus.arbitrators) == 2 and len(bus.arbitrator_leaders()) == 1, 60,
                   "both arbitrators' telemetry, one leading")
        figures["stack start s"] = round(time.monotonic() - test_started, 1)
        phase = time.monotonic()

        # Warm-up: the shared system prompt and two questions, reuse on: the pool holds their blocks in warm.
        warmup = [chat(client, j) for j in (0, 1, 0)]
        assert all(a.status == 200 for a in warmup), warmup
        shared_blocks = warmup[1].cached // BLOCK_TOKENS  # the system prompt's blocks, reused by question 1
        assert shared_blocks >= 4, warmup[1]
        wait_until(lambda: warm_blocks(bus, pools[0]) >= warmup[0].prompt_tokens // BLOCK_TOKENS, 30,
                   "the warm-up's blocks in Redis")

        # References: greedy answers computed without reuse.
        with ThreadPoolExecutor(2) as pool:
            refs = list(pool.map(lambda j: chat(client, j, reuse=False), range(len(QUESTIONS))))
        assert all(a.status == 200 and a.cached == 0 for a in refs), refs
        reference = [a.text for a in refs]
        # Mostly distinct answers: an answer given to the wrong request would show.
        assert len(set(reference)) >= len(reference) - 2, reference

        figures["warm-up and references s"] = round(time.monotonic() - phase, 1)

        # Priming: every (round, prompt) once, in order; its blocks reach the pool.
        work = [(f"round-{r}", j) for r in range(ROUNDS) for j in range(len(QUESTIONS))]
        primed_at = time.monotonic()
        with ThreadPoolExecutor(CONCURRENCY) as pool:  # one answer token: only the prompt's blocks matter
            primes = list(pool.map(lambda item: chat(client, item[1], salt=item[0], max_tokens=1), work))
        bad = [a for a in primes if a.status != 200]
        assert not bad, bad[:3]
        figures["priming s"] = round(time.monotonic() - primed_at, 1)
        # Every primed prompt's own blocks (past the round's system prompt) in warm.
        expected = sum(a.prompt_tokens // BLOCK_TOKENS - shared_blocks for a in primes)
        wait_until(lambda: warm_blocks(bus, pools[0]) >= expected, 30, f"the primed blocks ({expected}) in Redis")

        # The load: CONCURRENCY threads ask every (round, prompt) once more, in priming order; after
        # KILL_AFTER answers the leaders of both leases die by SIGKILL.
        pool_leaders = [r for r in pools if bus.stats_of(r).counters["leader"]]
        assert len(pool_leaders) == 1, pool_leaders
        pool_victim, pool_survivor = pool_leaders[0], next(r for r in pools if r != pool_leaders[0])
        arb_victim = bus.arbitrator_leaders()[0]
        arb_survivor = next(a for a in arbitrators if a != arb_victim)
        lookups_before = bus.stats_of(pool_survivor).counters["lookups"]
        answers: list[Answer] = []
        lock = threading.Lock()
        killed = threading.Event()
        kill: dict[str, float] = {}

        def one(item: tuple[str, int]) -> Answer:
            answer = chat(client, item[1], salt=item[0])
            with lock:
                answers.append(answer)
                due = len(answers) >= KILL_AFTER and not killed.is_set()
                if due:
                    killed.set()
            if due:
                stack.kill(pool_victim)  # SIGKILL, waited for
                kill["at"] = time.monotonic()
                stack.kill(arb_victim)
                kill["arbitrator at"] = time.monotonic()
            return answer

        load_started = time.monotonic()
        with ThreadPoolExecutor(CONCURRENCY) as pool:
            list(pool.map(one, work))
        load_s = time.monotonic() - load_started
        assert killed.is_set() and "at" in kill, f"{len(answers)} answers: fewer than KILL_AFTER"
        killed_at = kill["at"]
        before = [a for a in answers if a.ended < killed_at]
        after = sorted((a for a in answers if a.started >= killed_at), key=lambda a: a.started)
        late = [a for a in after if a.started >= killed_at + HITS_RESUME_S]
        first_hit = next((a for a in after if a.full_hit), None)
        figures["load"] = f"{len(answers)} requests in {load_s:.1f} s, {CONCURRENCY} at a time"
        figures["latency p50 s"] = round(statistics.median(a.ended - a.started for a in answers), 2)
        figures["full hits before the kill"] = f"{sum(a.full_hit for a in before)}/{len(before)}"
        figures["in flight at the kill (cached tokens)"] = [a.cached for a in answers
                                                            if a.ended >= killed_at > a.started]
        figures[f"full hits started within {HITS_RESUME_S:.0f} s after"] = \
            f"{sum(a.full_hit for a in after if a not in late)}/{len(after) - len(late)}"
        figures["full hits started later"] = f"{sum(a.full_hit for a in late)}/{len(late)}"
        if first_hit is not None:  # hits resumed: the first request sent after the kill that was a full hit
            figures["kill -> first full hit sent s"] = round(first_hit.started - killed_at, 2)
            figures["kill -> first full hit answered s"] = round(first_hit.ended - killed_at, 2)
        # (start relative to the kill, cached tokens) of every request after it
        figures["after the kill"] = [(round(a.started - killed_at, 1), a.cached) for a in after]

        # Takeover: the other arbitrator leads within the lease bound; the other pool replica holds its lease.
        wait_until(lambda: arb_survivor in bus.leading_since, TAKEOVER_BOUND_S + 5, f"{arb_survivor} leading")
        takeover_s = bus.leading_since[arb_survivor] - kill["arbitrator at"]
        figures["arbitrator takeover s"] = round(takeover_s, 2)
        assert takeover_s <= TAKEOVER_BOUND_S, (takeover_s, TAKEOVER_BOUND_S)
        assert bus.arbitrator_leaders() == [arb_survivor], bus.arbitrators
        wait_until(lambda: (bus.stats_of(pool_survivor) or PoolAdminReply(ok=False)).counters.get("leader") == 1,
                   TAKEOVER_BOUND_S + 5, f"{pool_survivor} holding the pool lease")

        # 0 failed requests, every answer the reference.
        failed = [a for a in answers if a.status != 200]
        assert not failed, f"{len(failed)} of {len(answers)} load requests failed: {failed[:3]}"
        wrong = [a for a in answers if a.text != reference[a.prompt]]
        assert not wrong, f"{len(wrong)} answers differ from the reuse-off reference: " + "; ".join(
            f"prompt {a.prompt} {a.salt}: {a.text!r} != {reference[a.prompt]!r}" for a in wrong[:3])

        # Pool hits before the kill, and again within 5 s of it; after that, requests hit.
        assert len(after) >= 8 and len(late) >= 4, (len(after), len(late), "the load ended too soon: more ROUNDS")
        assert sum(a.full_hit for a in before) >= len(before) / 2, "pool hits were not the rule before the kill"
        assert first_hit is not None, "no full hit after the kill"
        # Resumed: the first request sent after the kill that was a full hit was sent within 5 s of it (its
        # answer comes a request's latency later: seconds on a loaded 2-core machine, reuse or not).
        assert first_hit.started - killed_at <= HITS_RESUME_S, "hits did not resume within 5 s of the kill"
        assert all(a.cached > 0 for a in late), [(a.prompt, a.salt, a.cached) for a in late if a.cached == 0]
        # Full (pool) hits are the rule again (a lookup may time out on a loaded machine, as before the kill).
        assert sum(a.full_hit for a in late) >= 0.75 * len(late), "pool hits did not resume"
        survivor = bus.stats_of(pool_survivor).counters
        assert survivor["lookups"] > lookups_before  # the survivor answered the lookups after the kill

        # A third replica joins: it takes a share of the queue group's work, nothing else restarts.
        pids = {p.instance_id: p.process.pid for p in stack.processes if p.process.poll() is None}
        joined = stack.start_pool_replica().instance_id
        assert joined == "ru-pool-3"
        join_started = time.monotonic()
        wait_until(lambda: pool_ready(bus, [pool_survivor, joined], 2), 60, f"{joined} serving")
        figures["join -> serving s"] = round(time.monotonic() - join_started, 2)
        counts = lambda: {r: bus.stats_of(r).counters for r in (pool_survivor, joined)}  # noqa: E731
        start_counts = counts()
        with ThreadPoolExecutor(CONCURRENCY) as pool:
            more = list(pool.map(lambda j: chat(client, j % len(QUESTIONS), salt=f"joined-{j // len(QUESTIONS)}"),
                                 range(2 * len(QUESTIONS))))
        assert all(a.status == 200 and a.text == reference[a.prompt] for a in more), more
        end_counts = counts()
        shares = {r: {k: end_counts[r][k] - start_counts[r][k] for k in ("lookups", "puts")}
                  for r in end_counts}
        figures["queue-group work after the join"] = shares
        assert sum(shares[joined].values()) > 0 and sum(shares[pool_survivor].values()) > 0, shares
        assert shares[joined]["lookups"] > 0, shares
        assert {p.instance_id: p.process.pid for p in stack.processes
                if p.process.poll() is None and p.instance_id != joined} == pids  # no restart
        figures["test s"] = round(time.monotonic() - test_started, 1)
    finally:
        print("\nreplica failover figures: " + "; ".join(f"{k}: {v}" for k, v in figures.items()))
        client.close()
        bus.close()
