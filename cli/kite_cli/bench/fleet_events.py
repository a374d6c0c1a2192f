"""Fleet events under load (`kite bench fleet`, issue 38): a worker killed mid-run and a fresh one joining in
its place, then a rolling restart of every worker, while the hot-prompt workload (vllm_peer's shared system
prompt, a new question per request) runs throughout at `concurrency`.

  kill and join  A worker's whole process group (its front end and vLLM's engine core) is killed with
                 SIGKILL while requests stream from it, as when its host dies: every request must still
                 complete (the gateway migrates what was streaming, KITE_GATEWAY_MAX_MIGRATIONS) with the
                 reference's greedy answer. After `settle_s` a fresh worker is started on the dead one's
                 cores, its engine cache empty: the share of its first `join_requests` requests' prompt
                 tokens that came from the pool or its own cache (usage's cached_tokens) is what a joining
                 worker reuses.
  rolling restart Each worker in turn is stopped with SIGTERM (it drains) and a fresh one started on its
                 cores, the next once the gateway counts it live; cached tokens / prompt tokens over every
                 request sent meanwhile.

Answers are compared, question by question, with what the peer fleet (plain vLLM) answers to the same
questions. The peer fleet goes through the kill only (`kill_peer`, last: vllm-router is started with a
fixed list of servers, so no server joins it): how many of its requests fail.
"""

from __future__ import annotations

import itertools
import os
import signal
import statistics
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

from kite_cli.bench.vllm_peer import SYSTEM_PROMPT, Client, Reply, questions
from kite_cli.stack import LocalStack, ServiceProcess

FIRST_QUESTION = 50_000  # questions of the events' loads: none of the hot-prompt levels' (their offsets are lower)
WORKER_START_S = 900.0  # a vLLM worker starting on cores busy with the load


@dataclass
class Sent:
    """One request of a load, as its client saw it."""

    question: int  # index into vllm_peer.questions(): the same index asks every system the same question
    sent_at: float  # monotonic seconds
    reply: Reply | None  # None when it failed
    error: str  # why it failed; "" when answered


class Load:
    """The hot-prompt workload sent throughout an event: `concurrency` users, each asking the next question
    once its previous answer is in, until `stop`. A failed request is kept as failed (the event's result),
    and the user goes on."""

    def __init__(self, client: Client, concurrency: int, first_question: int) -> None:
        self.client = client
        self._next = itertools.count(first_question)
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self.sent: list[Sent] = []
        self._users = [threading.Thread(target=self._user, daemon=True) for _ in range(concurrency)]
        for user in self._users:
            user.start()

    def _user(self) -> None:
        while not self._stopping.is_set():
            with self._lock:
                index = next(self._next)
            question = questions(1, index)[0]
            sent_at = time.monotonic()
            try:
                reply = self.client.chat([{"role": "system", "content": SYSTEM_PROMPT},
                                          {"role": "user", "content": question}])
            except Exception as exc:  # noqa: BLE001 - a failed request is what this load measures
                self.sent.append(Sent(index, sent_at, None, f"{type(exc).__name__}: {exc}"))
            else:
                self.sent.append(Sent(index, sent_at, reply, ""))

    def stop(self) -> list[Sent]:
        self._stopping.set()
        for user in self._users:
            user.join()
        return sorted(self.sent, key=lambda s: s.sent_at)

    def served_by(self, worker_id: str) -> int:
        return sum(1 for s in list(self.sent) if s.reply is not None and s.reply.worker == worker_id)


def worker_index(proc: ServiceProcess) -> int:
    """0-based: worker-3 is index 2 (LocalStack.worker_cores shares cores out by it)."""
    return int(proc.instance_id.rsplit("-", 1)[1]) - 1


def replace_worker(stack: LocalStack, old: ServiceProcess) -> ServiceProcess:
    """A fresh worker on `old`'s cores (its threads and binding), once the gateway no longer counts `old`."""
    count = len(stack.workers())
    stack.wait_workers(count, WORKER_START_S)
    return stack.start_worker(stack.worker_cores(worker_index(old), {}))


def kill_worker(proc: ServiceProcess) -> None:
    """SIGKILL to the worker's process group (its own session: the front end and vLLM's engine core)."""
    proc.stop_requested = True
    kill_group(proc.process)


def kill_group(process: subprocess.Popen) -> None:
    """SIGKILL to `process`'s group (started in its own session) and wait for `process` itself."""
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def reuse(sent: list[Sent]) -> float:
    """Cached prompt tokens / prompt tokens over the answered requests."""
    prompt = sum(s.reply.prompt_tokens for s in sent if s.reply is not None)
    return sum(s.reply.cached_tokens for s in sent if s.reply is not None) / prompt if prompt else float("nan")


def summary(sent: list[Sent]) -> dict:
    return {"requests": len(sent), "failed": sum(s.reply is None for s in sent),
            "errors": sorted({s.error for s in sent if s.reply is None}),
            "cached_share": reuse(sent),
            "answers": {s.question: s.reply.answer for s in sent if s.reply is not None}}


def kill_and_join(stack: LocalStack, client: Client, concurrency: int, migrations: Callable[[], float],
                  settle_s: float = 10.0, join_requests: int = 20, join_timeout_s: float = 300.0) -> dict:
    migrated_before = migrations()
    load = Load(client, concurrency, FIRST_QUESTION)
    try:
        time.sleep(settle_s / 2)  # every worker streaming
        victim = stack.workers()[0]
        kill_worker(victim)
        time.sleep(settle_s)  # the fleet without it: its streams migrate, the router forgets it
        joined = replace_worker(stack, victim)
        joined_at = time.monotonic()
        stack.wait_workers(len(stack.workers()), WORKER_START_S)
        live_at = time.monotonic()
        deadline = live_at + join_timeout_s
        while load.served_by(joined.instance_id) < join_requests and time.monotonic() < deadline:
            time.sleep(0.5)
    finally:
        sent = load.stop()
    first = [s for s in sent if s.reply is not None and s.reply.worker == joined.instance_id][:join_requests]
    return {"killed": victim.instance_id, "joined": joined.instance_id, **summary(sent),
            "migrations": migrations() - migrated_before,
            "join_start_s": live_at - joined_at,  # from its start to the gateway counting it live
            "joined_requests": len(first), "joined_cached_share": reuse(first),
            "joined_ttft_p50_s": statistics.median(s.reply.ttft_s for s in first) if first else float("nan")}


def kill_peer(server: subprocess.Popen, client: Client, concurrency: int, settle_s: float = 10.0) -> dict:
    """The same kill on the peer fleet: one plain vLLM server's process group (API server and engine core),
    SIGKILL while requests stream through vllm-router, then `settle_s` more of the load. Not replaced: the
    router is started with a fixed list of servers. Run last, after the reference answers."""
    load = Load(client, concurrency, FIRST_QUESTION + 200_000)
    try:
        time.sleep(settle_s / 2)
        kill_group(server)
        time.sleep(settle_s)
    finally:
        sent = load.stop()
    return summary(sent)


def rolling_restart(stack: LocalStack, client: Client, concurrency: int, settle_s: float = 3.0) -> dict:
    load = Load(client, concurrency, FIRST_QUESTION + 100_000)
    restarted = []
    started = time.monotonic()
    try:
        time.sleep(settle_s)
        for old in list(stack.workers()):
            stack.stop_process(old)  # SIGTERM: it drains
            new = replace_worker(stack, old)
            stack.wait_workers(len(stack.workers()), WORKER_START_S)
            restarted.append((old.instance_id, new.instance_id))
        time.sleep(settle_s)
    finally:
        sent = load.stop()
    return {"restarted": restarted, "duration_s": time.monotonic() - started, **summary(sent)}


def reference_answers(peer: Client, results: dict[str, dict], concurrency: int) -> dict[int, str]:
    """The peer fleet's greedy answers to every question the events' loads asked."""
    asked = sorted({q for r in results.values() for q in r["answers"]})
    with ThreadPoolExecutor(concurrency) as pool:
        replies = pool.map(lambda q: peer.chat([{"role": "system", "content": SYSTEM_PROMPT},
                                                {"role": "user", "content": questions(1, q)[0]}]), asked)
        return {q: r.answer for q, r in zip(asked, replies)}


def same_as_reference(answers: dict[int, str], reference: dict[int, str]) -> str:
    return f"{sum(reference.get(q) == a for q, a in answers.items())}/{len(answers)}"


def report(results: dict[str, dict], reference: dict[int, str], peer_name: str) -> None:
    """`results`: KITE's events by name, and "peer_kill" (kill_peer's) when it ran."""
    print("\nfleet events under the hot-prompt load (KITE's answers against " + peer_name + "'s)")
    if "kill_and_join" in results:
        r = results["kill_and_join"]
        print(f"  kill {r['killed']} (SIGKILL, front end and engine): {r['requests']} requests, {r['failed']} "
              f"failed, {r['migrations']:.0f} migrated, identical answers "
              f"{same_as_reference(r['answers'], reference)}; cached {r['cached_share']:.1%} of prompt tokens")
        print(f"  join {r['joined']} (fresh, started in its place, live {r['join_start_s']:.0f} s after its "
              f"start): its first {r['joined_requests']} requests took {r['joined_cached_share']:.1%} of their "
              f"prompt tokens from the pool or its cache; TTFT p50 {r['joined_ttft_p50_s']:.3f} s")
        for error in r["errors"]:
            print(f"    failed: {error}")
    if "peer_kill" in results:
        r = results["peer_kill"]
        print(f"  {peer_name}: one vLLM server killed the same way: {r['requests']} requests, {r['failed']} failed")
        for error in r["errors"]:
            print(f"    failed: {error}")
    if "rolling_restart" in results:
        r = results["rolling_restart"]
        order = ", ".join(f"{old} -> {new}" for old, new in r["restarted"])
        print(f"  rolling restart ({order}; {r['duration_s']:.0f} s): {r['requests']} requests, {r['failed']} "
              f"failed, cached {r['cached_share']:.1%} of prompt tokens, identical answers "
              f"{same_as_reference(r['answers'], reference)}")
        for error in r["errors"]:
            print(f"    failed: {error}")
