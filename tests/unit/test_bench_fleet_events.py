"""The pure parts of `kite bench fleet`'s fleet events (cli/kite_cli/bench/fleet_events.py): the load that
runs throughout an event, what its reuse and answers are computed from. The events themselves kill and start
workers of a running fleet and are run by hand (docs/benchmarks.md)."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from kite_cli.bench import fleet_events
from kite_cli.bench.fleet_events import Sent
from kite_cli.bench.vllm_peer import SYSTEM_PROMPT, Reply, questions
from kite_cli.stack import ServiceProcess
from tests.helpers import wait_until


def reply(prompt: int, cached: int, worker: str = "worker-1", answer: str = "a") -> Reply:
    return Reply(ttft_s=0.1, answer=answer, prompt_tokens=prompt, completion_tokens=16, cached_tokens=cached,
                 worker=worker)


class FlakyClient:
    """Answers each question by its text; fails every third request, as a fleet losing a worker may."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.count = 0
        self.asked: list[list[dict]] = []

    def chat(self, messages: list[dict], session_id: str = "") -> Reply:
        with self.lock:
            self.count += 1
            count = self.count
            self.asked.append(messages)
        time.sleep(0.001)
        if count % 3 == 0:
            raise RuntimeError("stream error: worker gone")
        return reply(1000, 992, answer="answer to " + messages[1]["content"])


def test_the_load_asks_each_question_once_keeps_failures_and_stops():
    client = FlakyClient()
    load = fleet_events.Load(client, concurrency=3, first_question=700)
    while len(load.sent) < 30:
        time.sleep(0.01)
    sent = load.stop()
    assert len(sent) == client.count  # every request sent is accounted for once stopped
    indices = [s.question for s in sent]
    assert sorted(indices) == list(range(700, 700 + len(sent)))
    assert all(m[0] == {"role": "system", "content": SYSTEM_PROMPT} for m in client.asked)
    for s in sent:
        if s.reply is None:
            assert s.error == "RuntimeError: stream error: worker gone"
        else:
            assert s.reply.answer == "answer to " + questions(1, s.question)[0]
    assert [s.sent_at for s in sent] == sorted(s.sent_at for s in sent)
    result = fleet_events.summary(sent)
    assert result["failed"] == client.count // 3
    assert result["errors"] == ["RuntimeError: stream error: worker gone"]
    assert result["cached_share"] == pytest.approx(0.992)


def test_reuse_counts_answered_requests_only():
    sent = [Sent(1, 0.0, reply(1000, 1000), ""), Sent(2, 0.1, None, "gone"), Sent(3, 0.2, reply(1000, 600), "")]
    assert fleet_events.reuse(sent) == pytest.approx(0.8)
    assert math.isnan(fleet_events.reuse([Sent(2, 0.1, None, "gone")]))  # nothing answered: no share


def test_answers_are_compared_question_by_question():
    answers = {5: "x", 6: "y", 7: "z"}
    assert fleet_events.same_as_reference(answers, {5: "x", 6: "y", 7: "Z"}) == "2/3"
    assert fleet_events.same_as_reference(answers, {5: "x"}) == "1/3"  # a question the reference lacks differs


def test_a_workers_index_is_its_instance_number_from_zero_as_worker_cores_counts():
    proc = ServiceProcess("worker", process=None, log_path=Path("/tmp/logs/worker-3.log"))
    assert fleet_events.worker_index(proc) == 2


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def test_the_peer_kill_kills_the_servers_whole_process_group_under_load():
    # A stand-in server whose child (as vLLM's engine core is the API server's) must die with it.
    server = subprocess.Popen(["sh", "-c", "sleep 600 & wait"], start_new_session=True)
    client = FlakyClient()
    result = fleet_events.kill_peer(server, client, concurrency=2, settle_s=0.2)
    assert server.returncode == -signal.SIGKILL
    wait_until(lambda: not group_alive(server.pid), 10, "the server's child gone (reaped once killed)")
    assert result["requests"] == client.count > 0
    assert result["failed"] == client.count // 3
