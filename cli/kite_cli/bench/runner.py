"""`kite bench`: run workloads against KITE (reuse on and off) and its peers, write JSON, Markdown and PNGs.

    kite bench --workload system-prompt                 # starts its own stack, writes results/<timestamp>/
    kite bench --workload all --url http://127.0.0.1:8000 --systems kite-reuse-on,kite-reuse-off

Exit status: 0 when every KITE request succeeded and greedy outputs with reuse on equal those with reuse
off; 1 otherwise (the report says which); 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import shlex
import subprocess
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

from kite_cli.bench import report, workloads
from kite_cli.bench.stats import RequestResult, hit_rate_timeline, ratios, summarize
from kite_cli.bench.systems import Outcome

KITE_ON = "kite-reuse-on"
KITE_OFF = "kite-reuse-off"
TRANSFORMERS = "transformers"
LLAMACPP = "llama.cpp"
VLLM = "vllm"
ALL_SYSTEMS = (KITE_ON, KITE_OFF, TRANSFORMERS, LLAMACPP, VLLM)

DESCRIPTIONS = {
    "system-prompt": "Many users, one shared long system prompt, short distinct questions.",
    "multi-turn": "Concurrent chat sessions; each turn resends the history with the system's own answers appended.",
    "rag-shuffle": "The same documents in a different order per request, then a question.",
    "unique": "Nothing shared between requests.",
}

SystemCall = Callable[[list[dict], int], Outcome]


# --- running ---------------------------------------------------------------------------------------------

def run_workload(call: SystemCall, workload: workloads.Workload, concurrency: int, max_tokens: int,
                 progress=None) -> tuple[list[RequestResult], float]:
    """Send every session's turns (in order within a session) with `concurrency` sessions at a time."""
    results: list[RequestResult] = []
    lock = threading.Lock()
    t0 = time.perf_counter()

    def one_session(session: workloads.Session) -> None:
        answers: list[str] = []
        for t in range(len(session.turns)):
            messages = workloads.messages_for(session, t, answers)
            start = time.perf_counter() - t0
            try:
                out = call(messages, max_tokens)
            except Exception as exc:  # a system bug must not stop the bench
                out = Outcome(None, 0, 0, 0, "", f"{type(exc).__name__}: {exc}")
            end = time.perf_counter() - t0
            res = RequestResult(f"{session.session_id}/{t}", start, end, out.ttft, out.prompt_tokens,
                                out.completion_tokens, out.cached_tokens, out.text, out.error, out.retries)
            with lock:
                results.append(res)
                if progress is not None:
                    progress.update(1)
            answers.append(out.text)
            if out.error is not None:  # the history cannot go on without an answer
                for rest in range(t + 1, len(session.turns)):
                    with lock:
                        results.append(RequestResult(f"{session.session_id}/{rest}", end, end, None, 0, 0, 0, "",
                                                     "skipped: an earlier turn of this session failed"))
                        if progress is not None:
                            progress.update(1)
                return

    with ThreadPoolExecutor(max_workers=max(1, concurrency)) as pool:
        list(pool.map(one_session, workload.sessions))
    wall = time.perf_counter() - t0
    results.sort(key=lambda r: r.start)
    return results, wall


def _progress(total: int, desc: str, enabled: bool):
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc=desc, unit="req", file=sys.stderr, dynamic_ncols=True, leave=True)


def run_entry(system: str, concurrency: int, results: list[RequestResult], wall: float, **extra) -> dict:
    s = summarize(results, wall)
    extra.setdefault("load_average_after", load_average())
    return {"system": system, "concurrency": concurrency, **extra, **s.to_dict(),
            "hit_timeline": hit_rate_timeline(results), "raw": [r.to_dict() for r in results]}


def check_equality(runs: list[dict]) -> dict:
    """Greedy texts of KITE reuse-on vs reuse-off at the same concurrency, request by request."""
    compared, mismatches = 0, []
    by_key = {(r["system"], r["concurrency"]): r for r in runs}
    for (system, conc), on in sorted(by_key.items()):
        if system != KITE_ON or (KITE_OFF, conc) not in by_key:
            continue
        off_texts = {x["request_id"]: x for x in by_key[(KITE_OFF, conc)]["raw"] if x["error"] is None}
        for x in on["raw"]:
            y = off_texts.get(x["request_id"])
            if x["error"] is not None or y is None:
                continue
            compared += 1
            if x["text"] != y["text"]:
                mismatches.append({"request_id": x["request_id"], "concurrency": conc, "on": x["text"],
                                   "off": y["text"]})
    return {"compared": compared, "mismatches": mismatches}


def peer_agreement(runs: list[dict]) -> dict:
    offs = sorted((r for r in runs if r["system"] == KITE_OFF), key=lambda r: r["concurrency"])
    if not offs:
        return {}
    ref = {x["request_id"]: x["text"] for x in offs[0]["raw"] if x["error"] is None}
    out = {}
    for run in runs:
        if run["system"] in (TRANSFORMERS, LLAMACPP):
            pairs = [(x["text"], ref[x["request_id"]]) for x in run["raw"]
                     if x["error"] is None and x["request_id"] in ref]
            out[run["system"]] = {"compared": len(pairs), "same": sum(a == b for a, b in pairs)}
    return out


def comparisons(runs: list[dict]) -> list[dict]:
    from kite_cli.bench.stats import Summary

    def summary(run: dict) -> Summary:
        return Summary(**{k: run[k] for k in Summary.__dataclass_fields__})

    by_key = {(r["system"], r["concurrency"]): r for r in runs}
    out = []
    for (system, conc), run in sorted(by_key.items()):
        if system == KITE_ON and (KITE_OFF, conc) in by_key:
            out.append({"kite": f"{KITE_ON} c={conc}", "peer": f"{KITE_OFF} c={conc}",
                        "ratios": ratios(summary(run), summary(by_key[(KITE_OFF, conc)]))})
    for kite in (KITE_ON, KITE_OFF):
        mine = sorted((r for r in runs if r["system"] == kite), key=lambda r: r["concurrency"])
        if not mine:
            continue
        base = mine[0]  # lowest concurrency: closest to the peers, which run one request at a time
        for peer in (TRANSFORMERS, LLAMACPP):
            for run in runs:
                if run["system"] == peer:
                    out.append({"kite": f"{kite} c={base['concurrency']}", "peer": f"{peer} c={run['concurrency']}",
                                "ratios": ratios(summary(base), summary(run))})
    return out


# --- environment -----------------------------------------------------------------------------------------

def machine_description() -> dict:
    model = ""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=5).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                model = line.split(":", 1)[1].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    mem_gib = None
    try:
        with open("/proc/meminfo") as f:
            mem_gib = round(int(f.readline().split()[1]) / 2**20, 1)
    except OSError:
        pass
    import shutil

    return {"nproc": os.cpu_count(), "gpu": shutil.which("nvidia-smi") is not None, "cpu_model": model or platform.processor() or "unknown",
            "memory_gib": mem_gib, "platform": platform.platform(), "python": platform.python_version()}


def load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _stack_class():
    from kite_cli.local_servers import free_port
    from kite_cli.stack import LocalStack

    class BenchStack(LocalStack):
        """A LocalStack whose ru-pool serves Prometheus /metrics (for the kite_tier_* counters)."""

        def __init__(self, options) -> None:
            super().__init__(options)
            self.pool_metrics_port = free_port()

        def start_service(self, name, extra_env=None, instance_id=None):
            if name == "ru-pool":
                extra_env = {**(extra_env or {}), "KITE_METRICS_PORT": str(self.pool_metrics_port)}
            return super().start_service(name, extra_env, instance_id)

        def wait_healthy(self, timeout_s: float) -> None:
            # Fail at once when every worker died (LocalStack tolerates dead workers, tests kill some).
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                workers = [p for p in self.processes if p.name == "worker"]
                if workers and all(p.process.poll() is not None for p in workers):
                    raise RuntimeError(f"every worker exited; see {workers[0].log_path}:\n{self.tail(workers[0])}")
                try:
                    return super().wait_healthy(min(2.0, max(0.1, deadline - time.monotonic())))
                except TimeoutError:
                    continue
            raise TimeoutError(f"the stack was not healthy within {timeout_s} s; logs in {self.log_dir}")

        @property
        def pool_metrics_url(self) -> str:
            return f"http://127.0.0.1:{self.pool_metrics_port}/metrics"

    return BenchStack


# --- main ------------------------------------------------------------------------------------------------

def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="kite bench", description="Benchmark KITE (reuse on/off) against peers "
                                "on reuse-heavy workloads; writes JSON, Markdown and PNG plots.")
    p.add_argument("--workload", nargs="+", default=["system-prompt"], choices=workloads.WORKLOADS + ("all",),
                   help="workload(s) to run (default: system-prompt)")
    p.add_argument("--systems", default=",".join(ALL_SYSTEMS),
                   help=f"comma-separated subset of {','.join(ALL_SYSTEMS)} (default: all)")
    p.add_argument("--concurrency", default="1,4",
                   help="comma-separated client concurrency levels for KITE (peers run at 1); default 1,4")
    p.add_argument("--output-tokens", type=int, default=16, help="max output tokens per request (default 16)")
    p.add_argument("--requests", type=int, default=8,
                   help="requests of system-prompt, rag-shuffle and unique (default 8)")
    p.add_argument("--shared-tokens", type=int, default=1000, help="system-prompt: shared prompt length (1000)")
    p.add_argument("--question-tokens", type=int, default=24, help="question length (24)")
    p.add_argument("--sessions", type=int, default=4, help="multi-turn: sessions (4)")
    p.add_argument("--turns", type=int, default=4, help="multi-turn: turns per session (4)")
    p.add_argument("--first-tokens", type=int, default=200, help="multi-turn: first user message length (200)")
    p.add_argument("--turn-tokens", type=int, default=40, help="multi-turn: later user message length (40)")
    p.add_argument("--documents", type=int, default=4, help="rag-shuffle: documents (4)")
    p.add_argument("--doc-tokens", type=int, default=250, help="rag-shuffle: tokens per document (250)")
    p.add_argument("--prompt-tokens", type=int, default=256, help="unique: prompt length (256)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--url", help="a running KITE gateway (default: start a local stack for the run)")
    # A client-side key, like any OpenAI client's: not a KITE service setting, so not in the registry.
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                   help="API key for a gateway with auth on (default: $OPENAI_API_KEY)")
    p.add_argument("--pool-metrics-url", help="ru-pool Prometheus /metrics URL, for per-tier counters "
                   "(default with --url: none, reported as n/a)")
    p.add_argument("--workers", type=int, default=1, help="workers of the stack the bench starts (1)")
    p.add_argument("--out", type=Path, help="results folder (default results/<timestamp>/)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    args = p.parse_args(argv)
    if "all" in args.workload:
        args.workload = list(workloads.WORKLOADS)
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = [s for s in args.systems if s not in ALL_SYSTEMS]
    if unknown:
        p.error(f"unknown system(s) {', '.join(unknown)}; choose from {', '.join(ALL_SYSTEMS)}")
    try:
        args.concurrency = sorted({int(c) for c in args.concurrency.split(",") if c.strip()})
    except ValueError:
        p.error("--concurrency: comma-separated integers, e.g. 1,4")
    if not args.concurrency or min(args.concurrency) < 1:
        p.error("--concurrency: at least one level, each >= 1")
    if args.output_tokens < 1:
        p.error("--output-tokens must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    started = _dt.datetime.now()
    stamp = started.strftime("%Y%m%d-%H%M%S")
    out_dir = args.out or Path("results") / stamp
    out_dir.mkdir(parents=True, exist_ok=True)
    show = not args.no_progress
    log = (lambda msg: print(msg, file=sys.stderr, flush=True))
    t_begin = time.perf_counter()

    from kite_cli.bench.systems import (KiteSystem, LlamaCppSystem, TransformersSystem, llamacpp_unavailable_reason,
                                        load_reference_tokenizer, scrape_tier_metrics, vllm_skip_reason)

    tokenizer = load_reference_tokenizer()

    def count_tokens(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    skipped: dict[str, str] = {}
    if VLLM in args.systems:
        skipped[VLLM] = vllm_skip_reason()
    llama = None
    if LLAMACPP in args.systems:
        reason = llamacpp_unavailable_reason()
        if reason:
            skipped[LLAMACPP] = "skipped: " + reason
    kite_systems = [s for s in (KITE_ON, KITE_OFF) if s in args.systems]

    stack = None
    pool_metrics_url = args.pool_metrics_url
    url = args.url
    load_before = load_average()
    meta_stack = "external (--url)" if url else "started by the bench"
    failures: list[str] = []
    result: dict = {}
    try:
        if kite_systems and not url:
            from kite_cli.stack import StackOptions

            log(f"starting a KITE stack (logs in {out_dir / 'stack-logs'}) ...")
            t = time.perf_counter()
            stack = _stack_class()(StackOptions(num_workers=args.workers, log_dir=(out_dir / "stack-logs").resolve()))
            stack.start()
            url = stack.http_url
            pool_metrics_url = pool_metrics_url or stack.pool_metrics_url
            log(f"stack healthy at {url} after {time.perf_counter() - t:.1f} s")
        model_name = None
        if kite_systems:
            warm = KiteSystem(url, reuse=False, salt=f"bench-warmup-{uuid.uuid4().hex[:8]}",
                              api_key=args.api_key)
            model_name = warm.model
            warm([{"role": "user", "content": "Hello"}], 2)

        transformers_sys = None
        if TRANSFORMERS in args.systems:
            log("loading the transformers baseline ...")
            transformers_sys = TransformersSystem()
            transformers_sys([{"role": "user", "content": "Hello"}], 2)
        if LLAMACPP in args.systems and LLAMACPP not in skipped:
            log("loading llama.cpp ...")
            try:
                llama = LlamaCppSystem(tokenizer)
            except Exception as exc:
                skipped[LLAMACPP] = f"skipped: llama.cpp failed to load the GGUF ({type(exc).__name__}: {exc})"

        run_id = uuid.uuid4().hex[:8]
        wl_results = []
        for name in args.workload:
            wl = workloads.build(name, args.seed, requests=args.requests, shared_tokens=args.shared_tokens,
                                 question_tokens=args.question_tokens, sessions=args.sessions, turns=args.turns,
                                 first_tokens=args.first_tokens, turn_tokens=args.turn_tokens,
                                 documents=args.documents, doc_tokens=args.doc_tokens,
                                 prompt_tokens=args.prompt_tokens, count_tokens=count_tokens)
            runs = []
            pool_tiers = None
            for conc in args.concurrency:
                for system in kite_systems:
                    salt = f"bench-{run_id}-{name}-{system}-c{conc}"
                    call = KiteSystem(url, reuse=(system == KITE_ON), salt=salt, api_key=args.api_key)
                    before = scrape_tier_metrics(pool_metrics_url) if system == KITE_ON else None
                    bar = _progress(wl.num_requests, f"{name} {system} c={conc}", show)
                    results, wall = run_workload(call, wl, conc, args.output_tokens, bar)
                    if bar is not None:
                        bar.close()
                    after = scrape_tier_metrics(pool_metrics_url) if system == KITE_ON else None
                    entry = run_entry(system, conc, results, wall, cache_salt=salt)
                    if before is not None and after is not None:
                        entry["pool_tiers"] = {k: after.get(k, 0.0) - before.get(k, 0.0)
                                               for k in sorted(set(after) | set(before))}
                        pool_tiers = {k: (pool_tiers or {}).get(k, 0.0) + v for k, v in entry["pool_tiers"].items()}
                    runs.append(entry)
            for system, impl in ((TRANSFORMERS, transformers_sys), (LLAMACPP, llama)):
                if impl is None:
                    continue
                if system == LLAMACPP:
                    impl.reset()
                bar = _progress(wl.num_requests, f"{name} {system} c=1", show)
                results, wall = run_workload(impl, wl, 1, args.output_tokens, bar)
                if bar is not None:
                    bar.close()
                runs.append(run_entry(system, 1, results, wall))
            equality = check_equality(runs)
            for m in equality["mismatches"]:
                failures.append(f"{name}: reuse-on output differs from reuse-off for {m['request_id']} "
                                f"(c={m['concurrency']})")
            for run in runs:
                if run["system"] in (KITE_ON, KITE_OFF) and run["errors"]:
                    failures.append(f"{name}: {run['errors']} failed requests in {run['system']} "
                                    f"c={run['concurrency']}")
            wl_results.append({"name": name, "description": DESCRIPTIONS[name], "params": wl.params,
                               "num_requests": wl.num_requests, "runs": runs, "comparisons": comparisons(runs),
                               "equality": equality if kite_systems == [KITE_ON, KITE_OFF] else None,
                               "peer_agreement": peer_agreement(runs), "pool_tiers": pool_tiers})
            write_outputs(out_dir, _result(args, argv, started, url, meta_stack, model_name, load_before,
                                           skipped, wl_results, failures, llama, t_begin), plots=False)
        result = _result(args, argv, started, url, meta_stack, model_name, load_before, skipped, wl_results,
                         failures, llama, t_begin)
    finally:
        if stack is not None:
            log("stopping the stack ...")
            stack.stop()
    result["meta"]["total_seconds"] = round(time.perf_counter() - t_begin, 1)
    write_outputs(out_dir, result, plots=not args.no_plots)
    print(report.render(result))
    print(f"results in {out_dir}/ (results.json, results.md{', PNG plots' if not args.no_plots else ''})")
    if failures:
        print("FAILED:\n  " + "\n  ".join(failures), file=sys.stderr)
        return 1
    return 0


def _result(args, argv, started, url, meta_stack, model_name, load_before, skipped, wl_results, failures,
            llama, t_begin) -> dict:
    machine = machine_description()
    cmd = "kite bench " + " ".join(shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))
    return {
        "meta": {"timestamp": started.isoformat(timespec="seconds"), "command": cmd.strip(),
                 "machine": f"{machine['nproc']} CPUs ({machine['cpu_model']}), {machine['memory_gib']} GiB RAM, "
                            + ("GPU present" if machine["gpu"] else "no GPU"),
                 "machine_details": machine, "kite_url": url, "stack": meta_stack, "model": model_name,
                 "seed": args.seed, "output_tokens": args.output_tokens, "concurrency": args.concurrency,
                 "systems": args.systems, "load_average_before": load_before, "load_average_after": load_average(),
                 "llama_cpp_version": getattr(llama, "version", None),
                 "elapsed_seconds": round(time.perf_counter() - t_begin, 1)},
        "skipped": skipped,
        "workloads": wl_results,
        "failures": failures,
        "plots": [],
    }


def write_outputs(out_dir: Path, result: dict, plots: bool) -> None:
    if plots:
        from kite_cli.bench import plots as _plots

        result["plots"] = _plots.write_all(result, out_dir)
    (out_dir / "results.json").write_text(json.dumps(result, indent=1))
    (out_dir / "results.md").write_text(report.render(result))
