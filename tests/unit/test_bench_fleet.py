"""The pure parts of `kite bench fleet` (cli/kite_cli/bench/fleet.py) and the vllm-peer machinery it shares:
arguments, the alternating schedule, CPU and request accounting, metric scraping. The benchmark itself starts
engines and is run by hand (docs/benchmarks.md)."""

from __future__ import annotations

import os

import pytest

from kite_cli.bench import fleet
from kite_cli.bench.vllm_peer import (Reply, System, alternating_rounds, delta, idle_cpu, per_worker_ttft,
                                      pooled, round_order)


def test_fleet_is_a_kite_bench_mode(capsys):
    from kite_cli import bench

    with pytest.raises(SystemExit) as done:
        bench.main(["fleet", "--help"])
    assert done.value.code == 0
    assert "usage: kite bench fleet" in capsys.readouterr().out


def test_arguments_default_to_the_issue_setup_and_share_the_cores_out():
    args = fleet.parse_args([])
    assert (args.workers, args.users, args.rounds, args.concurrency) == (2, 24, 3, [4, 8, 16])
    assert (args.sessions, args.turns, args.session_concurrency, args.fresh_requests) == (8, 4, 4, 8)
    assert (args.kv_gib, args.documents, args.policies) == (0.4, 36, ["cache_aware", "round_robin", "kv_aware"])
    assert args.threads >= 1
    args = fleet.parse_args(["--workers", "3", "--threads", "2", "--policies", "round_robin", "--no-working-set"])
    assert (args.workers, args.threads, args.policies, args.no_working_set) == (3, 2, ["round_robin"], True)
    assert fleet.default_threads(2, 2) == 1
    assert fleet.default_threads(2, 16) == 8
    assert fleet.default_threads(4, 2) == 1  # never zero threads
    with pytest.raises(SystemExit):
        fleet.parse_args(["--workers", "0"])
    with pytest.raises(SystemExit):
        fleet.parse_args(["--policies", "consistent_hash"])


def test_rounds_alternate_so_each_system_goes_first_as_often_as_last():
    names = ["kite", "router-cache_aware", "router-round_robin"]
    assert round_order(names, 0) == names
    assert round_order(names, 1) == list(reversed(names))
    assert round_order(names, 2) == names
    firsts = [round_order(names, r)[0] for r in range(4)]
    lasts = [round_order(names, r)[-1] for r in range(4)]
    assert firsts.count("kite") == lasts.count("kite") == 2


def test_idle_cpu_leaves_out_the_groups_the_loaded_system_shares():
    cpu = {"kite": {"gateway": 1.0, "worker engine core": 5.0},
           "router-a": {"router-a": 0.5, "vllm engine core": 7.0},
           "router-b": {"router-b": 0.25, "vllm engine core": 7.0}}
    systems = {name: System(client=None, cpu=lambda n=name: dict(cpu[n])) for name in cpu}
    # the routers share the vLLM servers: while router-a is loaded, its engines are not idle peers
    assert idle_cpu(systems, "router-a") == {"gateway": 1.0, "worker engine core": 5.0, "router-b": 0.25}
    assert idle_cpu(systems, "kite") == {"router-a": 0.5, "vllm engine core": 7.0, "router-b": 0.25}
    assert delta({"a": 1.0, "b": 2.0}, {"a": 1.5, "b": 2.0, "c": 3.0}) == {"a": 0.5, "b": 0.0, "c": 3.0}


class _FakeClient:
    """What run_level needs of a Client: `ask` and `served` (no network)."""

    def __init__(self, worker: str, ttft: float) -> None:
        self.worker, self.ttft, self.served = worker, ttft, []

    def ask(self, question: str, system: str = "") -> tuple[float, str, int]:
        self.served.append(Reply(ttft_s=self.ttft, answer=f"answer to {question}", prompt_tokens=9,
                                 completion_tokens=4, cached_tokens=7, worker=self.worker))
        return self.ttft, f"answer to {question}", 7


def test_alternating_rounds_run_every_level_on_every_system_in_the_schedule_and_pool_them():
    ran: list[str] = []
    clients = {"kite": _FakeClient("worker-1", 0.3), "router": _FakeClient("", 0.2)}
    cpu_now = {"kite": 0.0, "router": 0.0}

    def cpu_of(name: str):
        def read() -> dict[str, float]:
            return {name: cpu_now[name]}
        return read

    def ask_and_burn(name: str):
        real = clients[name].ask

        def ask(question: str, system: str = "") -> tuple[float, str, int]:
            ran.append(name)
            cpu_now[name] += 0.01
            return real(question, system)
        return ask

    for name in clients:
        clients[name].ask = ask_and_burn(name)
    systems = {name: System(clients[name], cpu_of(name),
                            per_worker=lambda n=name: {"w": float(len(clients[n].served))}) for name in clients}
    out = alternating_rounds(systems, num_rounds=2, concurrency=[1, 2], users=3)
    # round 0: kite then router at each level; round 1: router first (each level: a warm-up + 3 questions)
    blocks = [ran[i] for i in range(0, len(ran), 4)]
    assert blocks == ["kite", "router", "kite", "router", "router", "kite", "router", "kite"]
    kite = out["kite"]
    assert [(lv["round"], lv["concurrency"]) for lv in kite["rounds"]] == [(0, 1), (0, 2), (1, 1), (1, 2)]
    assert kite["rounds"][0]["cpu_s"] == {"kite": pytest.approx(0.04)}
    assert kite["rounds"][0]["idle_peer_cpu_s"] == pytest.approx(0.0)  # the router did nothing meanwhile
    assert kite["rounds"][0]["per_worker_requests"] == {"w": 4.0}
    assert kite["rounds"][0]["per_worker_ttft_p50_s"] == {"worker-1": 0.3}
    assert out["router"]["rounds"][0]["per_worker_ttft_p50_s"] == {}  # plain vLLM names no worker
    assert [lv["requests"] for lv in kite["levels"]] == [6, 6]
    assert kite["levels"][0]["ttft_p50_s"] == pytest.approx(0.3)
    assert kite["levels"][0]["mean_cached_tokens"] == 7


def test_pooled_levels_take_percentiles_of_every_request_and_rate_over_total_wall():
    levels = [{"concurrency": 4, "requests": 2, "wall_s": 1.0, "ttfts_s": [0.1, 0.2], "mean_cached_tokens": 10},
              {"concurrency": 4, "requests": 2, "wall_s": 3.0, "ttfts_s": [0.3, 0.9], "mean_cached_tokens": 20}]
    out = pooled(levels)
    assert out["req_per_s"] == pytest.approx(1.0)
    assert out["ttft_p50_s"] == pytest.approx(0.25)
    assert out["ttft_p90_s"] == pytest.approx(0.3)  # index int(0.9 * 3) = 2 of [0.1, 0.2, 0.3, 0.9]
    assert out["mean_cached_tokens"] == 15
    replies = [Reply(ttft_s=ttft, answer="", prompt_tokens=9, completion_tokens=4, cached_tokens=0, worker=worker)
               for worker, ttft in (("w1", 0.1), ("w2", 0.5), ("w1", 0.3), ("", 9.0))]
    assert per_worker_ttft(replies) == {"w1": pytest.approx(0.2), "w2": 0.5}


def test_cpu_per_request_and_the_control_plane_leave_the_engine_cores_apart():
    per = fleet.cpu_per_request({"gateway": 0.5, "worker engine core": 10.0, "nats-server": 0.25}, 50)
    assert per == {"gateway": 10.0, "nats-server": 5.0, "worker engine core": 200.0}
    assert fleet.control_plane(per) == 15.0
    assert fleet.cpu_per_request({"gateway": 1.0}, 0) == {}
    levels = [{"cpu_s": {"gateway": 1.0}}, {"cpu_s": {"gateway": 0.5, "ru-pool": 2.0}}]
    assert fleet.sum_cpu(levels) == {"gateway": 1.5, "ru-pool": 2.0}


def test_prometheus_samples_are_summed_over_labels_or_split_by_one():
    text = "\n".join([
        "# HELP vllm:request_success_total Count of successfully processed requests.",
        'vllm:request_success_total{engine="0",finished_reason="length",model_name="m"} 12.0',
        'vllm:request_success_total{engine="0",finished_reason="stop",model_name="m"} 3.0',
        "vllm:request_success_total_created 1.7e9",
        'kite_router_decisions_total{reason="cache_aware"} 40.0',
        'kite_router_decisions_total{reason="balance"} 2.0',
        "plain_metric 5",
        'vllm_router_processed_requests_total{route="/v1/chat/completions",worker="http://127.0.0.1:8001"} 4',
        'vllm_router_processed_requests_total{route="/v1/completions",worker="http://127.0.0.1:8001/"} 1',
        'vllm_router_processed_requests_total{route="/v1/chat/completions",worker="http://127.0.0.1:8002"} 6'])
    assert fleet.sum_samples(text, "vllm:request_success_total") == 15.0
    assert fleet.sum_samples(text, "plain_metric") == 5.0
    assert fleet.sum_samples(text, "absent") == 0.0
    assert fleet.samples_by_label(text, "kite_router_decisions_total", "reason") == \
        {"cache_aware": 40.0, "balance": 2.0}
    assert fleet.samples_by_url(text, "vllm_router_processed_requests_total") == \
        {"http://127.0.0.1:8001": 5.0, "http://127.0.0.1:8002": 6.0}


def test_each_worker_gets_its_own_cores_the_same_in_both_fleets():
    assert fleet.core_sets(2, 1, 2) == ["0", "1"]
    assert fleet.core_sets(2, 2, 4) == ["0,1", "2,3"]
    assert fleet.core_sets(3, 1, 2) == ["0", "1", "0"]  # more workers than cores: wrap round
    args = fleet.parse_args(["--workers", "2", "--threads", "1"])
    envs = fleet.worker_envs(args)
    assert [e["VLLM_CPU_OMP_THREADS_BIND"] for e in envs] == fleet.core_sets(2, 1, os.cpu_count())
    assert fleet.worker_envs(fleet.parse_args(["--cpu-bind", "auto"])) == [{"VLLM_CPU_OMP_THREADS_BIND": "auto"}] * 2


def test_background_cpu_is_what_a_system_used_while_the_others_ran():
    results = {
        "kite": {"rounds": [{"cpu_s": {"gateway": 1.0, "ru-pool": 1.0}, "wall_s": 10.0, "idle_peer_cpu": {}}]},
        "router": {"rounds": [
            {"cpu_s": {"router": 0.1}, "wall_s": 4.0, "idle_peer_cpu": {"gateway": 0.2, "ru-pool": 0.4, "x": 9.0}},
            {"cpu_s": {"router": 0.1}, "wall_s": 6.0, "idle_peer_cpu": {"gateway": 0.3, "ru-pool": 0.6}}]}}
    # 0.5 and 1.0 CPU seconds over the router's 10 s of turns; "x" belongs to no KITE group
    assert fleet.background_cpu(results, "kite", ["router"]) == {"gateway": pytest.approx(0.05),
                                                                 "ru-pool": pytest.approx(0.1)}
    assert fleet.background_cpu(results, "kite", []) == {}
