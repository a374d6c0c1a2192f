"""kite bench workloads: deterministic for a seed, shaped as each workload promises."""

from __future__ import annotations

import pytest

from kite_cli.bench import workloads


def _texts(wl: workloads.Workload) -> list:
    return [(s.session_id, s.system, [t.user for t in s.turns]) for s in wl.sessions]


@pytest.mark.parametrize("name", workloads.WORKLOADS)
def test_same_seed_same_workload_other_seed_other_workload(name):
    kwargs = dict(requests=5, shared_tokens=120, question_tokens=12, sessions=3, turns=3, first_tokens=40,
                  turn_tokens=10, documents=3, doc_tokens=30, prompt_tokens=50)
    a = workloads.build(name, 7, **kwargs)
    b = workloads.build(name, 7, **kwargs)
    c = workloads.build(name, 8, **kwargs)
    assert _texts(a) == _texts(b)
    assert _texts(a) != _texts(c)
    assert a.name == name and a.num_requests == sum(len(s.turns) for s in a.sessions)


def test_system_prompt_shares_one_long_system_prompt_and_distinct_questions():
    wl = workloads.system_prompt(0, requests=6, shared_tokens=300, question_tokens=16)
    systems = {s.system for s in wl.sessions}
    assert len(systems) == 1
    assert len(next(iter(systems)).split()) >= 300
    questions = [s.turns[0].user for s in wl.sessions]
    assert len(set(questions)) == 6


def test_multi_turn_history_grows_with_answers():
    wl = workloads.multi_turn(0, sessions=2, turns=3, first_tokens=30, turn_tokens=8)
    assert wl.num_requests == 6
    s = wl.sessions[0]
    m0 = workloads.messages_for(s, 0, [])
    m2 = workloads.messages_for(s, 2, ["answer one", "answer two"])
    assert [m["role"] for m in m0] == ["system", "user"]
    assert [m["role"] for m in m2] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert m2[:2] == m0 and m2[2]["content"] == "answer one" and m2[4]["content"] == "answer two"


def test_rag_shuffle_reorders_the_same_documents():
    wl = workloads.rag_shuffle(0, requests=8, documents=3, doc_tokens=20)
    contexts = [s.turns[0].user.split("\n\nQuestion")[0] for s in wl.sessions]
    docs = [sorted(c.split("\n\n")) for c in contexts]
    assert all(d == docs[0] for d in docs)  # same documents
    assert len(set(contexts)) > 1  # in different orders


def test_unique_shares_nothing_but_the_instruction():
    wl = workloads.unique(0, requests=4, prompt_tokens=40)
    bodies = [s.turns[0].user for s in wl.sessions]
    assert len({b.split(". ", 1)[1][:40] for b in bodies}) == 4
    assert all(s.system is None for s in wl.sessions)


def test_make_text_fits_a_token_budget():
    import random

    count = lambda text: len(text) // 4  # a stand-in tokenizer: 4 characters per token
    text = workloads.make_text(random.Random(1), 100, count)
    assert count(text) <= 100
    longer = workloads.make_text(random.Random(1), 100)
    assert len(longer.split()) == 100
    assert workloads.make_text(random.Random(1), 0) == ""


def test_unknown_workload_is_refused():
    with pytest.raises(ValueError):
        workloads.build("nope", 0, requests=1, shared_tokens=1, question_tokens=1, sessions=1, turns=1,
                        first_tokens=1, turn_tokens=1, documents=1, doc_tokens=1, prompt_tokens=1)


def test_the_vllm_peer_comparison_is_a_kite_bench_mode(capsys):
    from kite_cli import bench
    from kite_cli.bench.systems import vllm_skip_reason

    with pytest.raises(SystemExit) as done:
        bench.main(["vllm-peer", "--help"])
    assert done.value.code == 0
    assert "usage: kite bench vllm-peer" in capsys.readouterr().out
    assert "kite bench vllm-peer" in vllm_skip_reason()
