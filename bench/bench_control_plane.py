"""Control-plane CPU per request (issue 38): what KITE's own processes spend to serve one request.

The workload is issue 38's: `make run`'s stack (every service, auth off) on vLLM, one worker by default, a
~1,000-token shared system prompt (`kite_cli.bench.vllm_peer.SYSTEM_PROMPT`, already in the worker's cache
when timing starts) with a distinct question per request, 16 tokens out, greedy, `--requests` at
`--concurrency`. CPU seconds are read from /proc for each process group (gateway, fingerprinter, ru-pool,
arbitrator, the workers' front ends, nats-server, redis-server; vLLM's engine-core processes are reported
apart and are not control plane):

  idle ms/s     CPU a second over `--idle-s` with no request (timers, heartbeats, telemetry);
  ms/request    CPU during the load divided by the requests served (what the issue's target counts);
  beyond idle   the same less the idle rate over the load's wall time: the cost of the requests themselves.

`--count-messages` also counts the NATS messages of each subject (a `>` subscriber: it adds its own load)
in both windows, per second idle and per request under load.
`--profile DIR` also samples each control-plane process with py-spy during the load (collapsed stacks,
DIR/<group>-<pid>.txt, and each worker's vLLM engine core on every busy thread) and prints each one's hottest
functions by samples where they were on the CPU.

    python bench/bench_control_plane.py [--workers 1] [--requests 33] [--concurrency 4] [--idle-s 10]
                                        [--eager] [--write-path direct|pool] [--count-messages]
                                        [--profile DIR]
                                        [--json out.json]   (make bench-control-plane)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import threading
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import nats
import psutil

from kite_cli.bench.fleet import kite_cpu
from kite_cli.bench.vllm_peer import MODEL, Client, delta, kite_stack, questions

ENGINE_GROUP = "worker engine core"  # vLLM's own processes: model work, not control plane


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--requests", type=int, default=33)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--idle-s", type=float, default=10.0, help="seconds of no load to measure idle CPU")
    parser.add_argument("--eager", action="store_true", help="the engine without torch.compile (faster start)")
    parser.add_argument("--kv-gib", type=float, default=0.4)
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--threads", type=int, default=0, help="model threads per worker (0: vLLM's default)")
    parser.add_argument("--write-policy", default="write_through", choices=("write_through", "selective", "off"),
                        help="KITE_WORKER_WRITE_POLICY (the default saves every new block to the pool)")
    parser.add_argument("--write-path", default="direct", choices=("direct", "pool"),
                        help="KITE_WORKER_POOL_WRITE_PATH (the default writes new blocks into warm from the worker)")
    parser.add_argument("--code", type=Path,
                        help="run the services from this checkout (e.g. a `git worktree` of an older commit) "
                             "instead of the installed packages, to compare two versions alternately")
    parser.add_argument("--count-messages", action="store_true", help="count NATS messages by subject")
    parser.add_argument("--profile", type=Path, help="sample each control-plane process with py-spy into DIR")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if args.profile and py_spy() is None:
        parser.error("--profile samples with py-spy, which is not installed (pip install py-spy==0.4.3)")
    return args


def py_spy() -> str | None:
    beside = Path(sys.executable).parent / "py-spy"
    return str(beside) if beside.exists() else shutil.which("py-spy")


def code_path(checkout: Path | None) -> dict[str, str]:
    """PYTHONPATH that makes the services import `checkout`'s packages first."""
    if checkout is None:
        return {}
    roots = [checkout / "shared", *sorted(p for p in (checkout / "services").iterdir() if p.is_dir())]
    return {"PYTHONPATH": os.pathsep.join(str(r.resolve()) for r in roots)}


def profiled_pids(stack) -> dict[str, int]:
    """Each control-plane Python process by a file-name-safe label, and each worker's vLLM engine-core
    process ("engine-core-<pid>"): its CPU per request is not control plane, but the KV connector's I/O
    runs there, so its profile says what KITE adds to the model work."""
    pids = {f"{p.name}-{p.process.pid}": p.process.pid for p in stack.processes if p.process.poll() is None}
    for p in stack.processes:
        if p.name == "worker" and p.process.poll() is None:
            try:
                children = psutil.Process(p.process.pid).children(recursive=True)
            except psutil.Error:
                continue
            pids.update({f"engine-core-{c.pid}": c.pid for c in children})
    return pids


class MessageCounter:
    """A `>` subscriber on its own thread and event loop; `take()` returns the counts since the last one.
    Subjects that end in an id (inboxes, per-worker subjects) are counted under their prefix."""

    def __init__(self, url: str) -> None:
        self.counts: Counter[str] = Counter()
        self._loop = asyncio.new_event_loop()
        threading.Thread(target=self._loop.run_forever, daemon=True).start()
        self._call(self._subscribe(url))

    def _call(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout=30)

    async def _subscribe(self, url: str) -> None:
        self._nc = await nats.connect(url)
        await self._nc.subscribe(">", cb=self._count)
        await self._nc.flush()

    async def _count(self, msg) -> None:
        parts = msg.subject.split(".")
        key = "_INBOX" if parts[0] == "_INBOX" else ".".join(parts[:4])
        self.counts[key] += 1

    def take(self) -> Counter[str]:
        return self._call(self._take())

    def close(self) -> None:
        """Before the stack stops: its nats-server going away would otherwise be logged as an error."""
        self._call(self._nc.close())

    async def _take(self) -> Counter[str]:
        await self._nc.flush()
        taken, self.counts = self.counts, Counter()
        return taken


def print_messages(idle: Counter[str], idle_s: float, load: Counter[str], num_requests: int) -> dict:
    print(f"\n{'NATS subject':<44}{'idle /s':>9}{'/request':>10}")
    rows = {}
    for subject in sorted(set(idle) | set(load), key=lambda s: -(load[s] + idle[s])):
        rows[subject] = {"idle_per_s": idle[subject] / idle_s, "per_request": load[subject] / num_requests}
        print(f"{subject:<44}{rows[subject]['idle_per_s']:>9.1f}{rows[subject]['per_request']:>10.1f}")
    print(f"{'all':<44}{sum(idle.values()) / idle_s:>9.1f}{sum(load.values()) / num_requests:>10.1f}")
    return rows


def start_profilers(stack, out_dir: Path, duration_s: int) -> list[tuple[str, subprocess.Popen, Path]]:
    binary = py_spy()
    out_dir.mkdir(parents=True, exist_ok=True)
    running = []
    for label, pid in profiled_pids(stack).items():
        path = out_dir / f"{label}.txt"
        # --gil: only samples of the thread holding the GIL, i.e. running Python (not waiting in epoll). An
        # engine core is sampled on every busy thread: its model work runs in torch's kernels without the GIL.
        which = [] if label.startswith("engine-core-") else ["--gil"]
        proc = subprocess.Popen([binary, "record", "--pid", str(pid), "--format", "raw", "--rate", "200", *which,
                                 "--duration", str(duration_s), "--nonblocking", "--output", str(path)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        running.append((label, proc, path))
    time.sleep(1.0)  # attached before the load starts
    return running


def hottest(path: Path, top: int = 12) -> tuple[list[tuple[str, int, float]], list[tuple[str, int, float]], int]:
    """From a collapsed-stack file: (function, samples, share) of the most frequent innermost frames, of
    KITE's own functions counting every sample they were on the stack for, and the number of samples."""
    own: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        n = int(count)
        frames = stack.split(";")
        own[frames[-1]] += n
        for frame in set(frames):
            if "kite_" in frame:
                inclusive[frame] += n
        total += n
    if not total:
        return [], [], 0
    return ([(f, n, n / total) for f, n in own.most_common(top)],
            [(f, n, n / total) for f, n in inclusive.most_common(top)], total)


def run_load(client: Client, num_requests: int, concurrency: int) -> tuple[float, list[str]]:
    qs = questions(num_requests, offset=1000)
    started = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        answers = [answer for _, answer, _ in pool.map(client.ask, qs)]
    return time.perf_counter() - started, answers


def report(idle: dict[str, float], idle_s: float, load: dict[str, float], wall_s: float,
           num_requests: int) -> dict:
    rows = {}
    for name in sorted(load, key=lambda n: -load[n]):
        idle_rate = idle.get(name, 0.0) / idle_s
        rows[name] = {"idle_ms_per_s": 1000 * idle_rate, "ms_per_request": 1000 * load[name] / num_requests,
                      "beyond_idle_ms_per_request": 1000 * (load[name] - idle_rate * wall_s) / num_requests}
    plane = [r for n, r in rows.items() if n != ENGINE_GROUP]
    totals = {key: sum(r[key] for r in plane) for key in ("idle_ms_per_s", "ms_per_request",
                                                          "beyond_idle_ms_per_request")}
    print(f"\n{'process group':<22}{'idle ms/s':>11}{'ms/request':>12}{'beyond idle':>13}")
    for name, r in rows.items():
        print(f"{name:<22}{r['idle_ms_per_s']:>11.1f}{r['ms_per_request']:>12.1f}"
              f"{r['beyond_idle_ms_per_request']:>13.1f}")
    print(f"{'control plane (sum)':<22}{totals['idle_ms_per_s']:>11.1f}{totals['ms_per_request']:>12.1f}"
          f"{totals['beyond_idle_ms_per_request']:>13.1f}")
    return {"groups": rows, "control_plane": totals}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    log_dir = Path(tempfile.mkdtemp(prefix="kite-bench-cp-"))
    stack = kite_stack(args, log_dir, num_workers=args.workers,
                       services=("fingerprinter", "ru-pool", "arbitrator", "gateway"),
                       env={"KITE_WORKER_WRITE_POLICY": args.write_policy,
                            "KITE_WORKER_POOL_WRITE_PATH": args.write_path, **code_path(args.code)})
    try:
        client = Client(stack.http_url, MODEL)
        client.warm_up()
        client.ask("Warm-up: hello")  # the shared prompt is in the worker's cache before timing
        time.sleep(3.0)  # the warm-up's saves and telemetry settle
        counter = MessageCounter(stack.nats.url) if args.count_messages else None
        before = kite_cpu(stack)
        if counter:
            counter.take()
        time.sleep(args.idle_s)
        idle = delta(before, kite_cpu(stack))
        idle_messages = counter.take() if counter else None
        profilers = []
        if args.profile:
            profilers = start_profilers(stack, args.profile, duration_s=3600)
        before = kite_cpu(stack)
        wall_s, answers = run_load(client, args.requests, args.concurrency)
        load = delta(before, kite_cpu(stack))
        load_messages = counter.take() if counter else None
        if counter:
            counter.close()
        for _, proc, _ in profilers:
            proc.send_signal(2)  # py-spy writes what it sampled on SIGINT
        for label, proc, path in profilers:
            _, err = proc.communicate(timeout=60)
            if not path.exists():
                print(f"py-spy {label}: no profile ({err.decode(errors='replace').strip()[-300:]})")
        print(f"{args.requests} requests at {args.concurrency} concurrent in {wall_s:.1f} s "
              f"({args.requests / wall_s:.2f} req/s), {args.workers} worker(s); idle measured over {args.idle_s:g} s")
        result = report(idle, args.idle_s, load, wall_s, args.requests)
        result.update(requests=args.requests, concurrency=args.concurrency, wall_s=wall_s,
                      workers=args.workers, distinct_answers=len(set(answers)))
        if counter:
            result["messages"] = print_messages(idle_messages, args.idle_s, load_messages, args.requests)
        for label, _, path in profilers:
            if path.exists():
                own, inclusive, total = hottest(path)
                print(f"\n{label}: {total} samples running Python; innermost frames")
                for frame, n, share in own:
                    print(f"  {share:6.1%} {n:6d}  {frame[:150]}")
                print("  KITE functions on the stack")
                for frame, n, share in inclusive:
                    print(f"  {share:6.1%} {n:6d}  {frame[:150]}")
        if args.json:
            args.json.write_text(json.dumps(result, indent=2))
        return 0
    finally:
        stack.stop()


if __name__ == "__main__":
    sys.exit(main())
