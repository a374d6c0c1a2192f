"""The pure parts of `kite bench fleet`'s scenarios (cli/kite_cli/bench/fleet_scenarios.py): how a chat's
history grows, what reuse and the fresh prefix's ideal are computed from. The scenarios themselves send
requests to running fleets and are run by hand (docs/benchmarks.md)."""

from __future__ import annotations

import pytest

from kite_cli.bench import fleet_scenarios
from kite_cli.bench.vllm_peer import Reply


class ScriptedClient:
    """Answers every chat with the next scripted (prompt_tokens, cached_tokens) and records the messages."""

    def __init__(self, usage: list[tuple[int, int]], worker: str = "w1") -> None:
        self.usage = list(usage)
        self.sent: list[tuple[list[dict], str]] = []
        self.worker = worker

    def chat(self, messages: list[dict], session_id: str = "") -> Reply:
        self.sent.append(([dict(m) for m in messages], session_id))
        prompt, cached = self.usage.pop(0)
        return Reply(ttft_s=0.1 * len(self.sent), answer=f"answer {len(self.sent)}", prompt_tokens=prompt,
                     completion_tokens=16, cached_tokens=cached, worker=self.worker)


def test_a_session_sends_its_history_with_each_turn_and_one_session_id():
    client = ScriptedClient([(1000, 0), (1030, 992), (1060, 1024)])
    replies = fleet_scenarios.run_session(client, session=3, num_turns=3, tag="kite")
    assert [r.answer for r in replies] == ["answer 1", "answer 2", "answer 3"]
    (first, sid1), (second, sid2), (third, sid3) = client.sent
    assert sid1 == sid2 == sid3 == "kite-3"
    assert [m["role"] for m in third] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert third[2]["content"] == "answer 1" and third[4]["content"] == "answer 2"
    assert first[0]["content"] == fleet_scenarios.document(fleet_scenarios.SESSION_DOCUMENTS + 3)


def test_history_reuse_is_cached_over_the_previous_prompt_and_answer():
    client = ScriptedClient([(1000, 0), (1030, 992), (1060, 1024)] * 2)
    result = fleet_scenarios.multi_turn(client, num_sessions=2, num_turns=3, concurrency=1, tag="t")
    assert result["history_reuse_mean"] == pytest.approx((992 / 1016 + 1024 / 1046) / 2)
    assert result["history_reuse_min"] == pytest.approx(992 / 1016)
    assert result["sessions_on_several_workers"] == 0
    assert result["answers"] == [["answer 1", "answer 2", "answer 3"], ["answer 4", "answer 5", "answer 6"]]


def test_the_fresh_prefix_ideal_computes_the_shared_prefix_once():
    # 4 requests of 1,850 prompt tokens sharing 1,824 block-aligned tokens: ideal = 7,400 - 3 x 1,824.
    client = ScriptedClient([(1850, 0), (1850, 0), (1850, 1824), (1850, 1824), (1852, 1824)])
    kite = fleet_scenarios.fresh_prefix(client, num_requests=4)
    assert (kite["prompt_tokens"], kite["computed_tokens"], kite["probe_cached_tokens"]) == (7400, 3752, 1824)
    assert kite["per_worker_requests"] == {"w1": 4}
    router = dict(kite, probe_cached_tokens=0, computed_tokens=7400)  # a probe that missed every holder
    assert fleet_scenarios.fresh_prefix_ideal({"kite": kite, "router": router}) == 7400 - 3 * 1824


def test_same_answers_compares_turn_by_turn():
    assert fleet_scenarios.same_answers([["a", "b"], ["c"]], [["a", "x"], ["c"]]) == "2/3"
