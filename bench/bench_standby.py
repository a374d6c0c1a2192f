"""Standby worker activation, end to end on a real stack: overload seen → decision → active → first request.

Starts a stack (nats-server, the services as processes, the real model; the transformers engine unless
--engine says otherwise) with one active worker and one started with KITE_WORKER_STANDBY=on. Its
arbitrator runs a copy of the default rules in which `scale-in-when-idle` waits --scale-in-after-s (3 s)
instead of 300 s, so one stack gives several activations: offer load until the arbitrator activates the
standby worker and that worker has accepted a request, stop the load, wait until the arbitrator returns
an idle worker to standby, and repeat (--rounds, default 5). The load is open-loop (--rate requests per second at
fixed intervals, random --prompt-tokens prompts, 2 tokens out), so how soon a request reaches the new
worker depends on the rate and the system, not on clients waiting for their previous answers.

An observer with its own NATS connection, on its own thread, stamps every message it receives with
time.time() (one clock for every figure):
- `kite.v1.telemetry.>`: worker (and gateway, pool, fingerprinter) telemetry;
- `kite.v1.arbitrator.decisions`: the `warm_capacity` decision that activates the standby worker;
- `_INBOX.>`: request replies, among them each worker's Admission (accepted, worker_id): the moment a
  worker accepts a request.

Per activation:
- (a) overload → decision: from the worker telemetry message after which an `activate_standby` rule holds
  (fleet signals computed with the arbitrator's own code from the latest fresh telemetry of each
  service), to the decision. It includes the rule's `for_s` (0 in the default rules).
- (b) decision → active: to the target worker's first telemetry with standby false.
- (c) decision → first accepted request: to the target's first Admission(accepted). This is what the
  ≤ 417 ms target is about (docs/arbitrator.md); PASS means every round met it. Beside it: the worker's
  own figure (telemetry activation_latency_s: decision issued_at → accepted, its clock) and overload →
  first accepted ((a) + (c)).
- (c) split at the client: the first request that the X-Kite-Worker header says the target served, sent
  how long after the decision (waiting for the next arrival: up to 1 / --rate, since requests sent
  before the router heard of the activation went to the other worker), and sent → accepted (gateway,
  fingerprinter, router, worker).

    .venv/bin/python bench/bench_standby.py [--rounds 5] [--rate 8] [--engine transformers] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import random
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import yaml

from kite_arbitrator.core import ArbitratorCore
from kite_arbitrator.rules import DEFAULT_RULES_PATH, Rule, RuleSet, load_rules
from kite_cli.bench.stats import percentile
from kite_cli.stack import LocalStack, StackOptions
from kite_shared import subjects
from kite_shared.config import ArbitratorConfig, CommonConfig, load
from kite_shared.messages import (TELEMETRY, Admission, Decision, FingerprinterTelemetry, GatewayTelemetry,
                                  MessageError, PoolTelemetry, WorkerTelemetry)
from kite_shared.service import connect_nats

MODEL = "smollm2-135m-instruct"
TARGET_MS = 417.0
# An Admission is a few dozen bytes; inbox replies above this (pool gets carry KV blocks) are not
# unpacked, so the observer's thread stays quick under load.
_MAX_ADMISSION_BYTES = 4096
_METRICS = (("overload_to_decision_ms", "(a) overload → decision"),
            ("decision_to_active_ms", "(b) decision → active"),
            ("decision_to_accepted_ms", "(c) decision → first accepted"),
            ("worker_reported_ms", "(c) as the worker measured it"),
            ("overload_to_accepted_ms", "overload → first accepted"),
            ("decision_to_first_sent_ms", "decision → its first request sent"),
            ("first_sent_to_accepted_ms", "that request sent → accepted"))


@dataclass
class Seen:
    at: float  # time.time() when the observer received it
    message: object


@dataclass
class Sent:
    sent_at: float
    done_at: float
    status: int
    worker: str  # X-Kite-Worker


@dataclass
class Activation:
    target: str
    rule: str
    decision_id: str
    decided_at: float  # the decision's receipt
    issued_at: float  # the arbitrator's stamp on it
    overload_at: float | None = None  # receipt of the telemetry after which an activate rule held
    overload_rule: str = ""
    active_at: float | None = None
    accepted_at: float | None = None
    reported_latency_s: float | None = None
    first_sent_at: float | None = None  # client send time of the first request the target served
    served: dict[str, int] = field(default_factory=dict)  # X-Kite-Worker -> requests, this round
    statuses: dict[int, int] = field(default_factory=dict)

    @staticmethod
    def _ms(start: float | None, end: float | None) -> float | None:
        return None if start is None or end is None else round(1000 * (end - start), 2)

    def figures(self) -> dict[str, float | None]:
        return {
            "overload_to_decision_ms": self._ms(self.overload_at, self.decided_at),
            "decision_to_active_ms": self._ms(self.decided_at, self.active_at),
            "decision_to_accepted_ms": self._ms(self.decided_at, self.accepted_at),
            "worker_reported_ms": None if self.reported_latency_s is None
            else round(1000 * self.reported_latency_s, 2),
            "overload_to_accepted_ms": self._ms(self.overload_at, self.accepted_at),
            "decision_to_first_sent_ms": self._ms(self.decided_at, self.first_sent_at),
            "first_sent_to_accepted_ms": self._ms(self.first_sent_at, self.accepted_at),
        }


def activate_rules(rules: RuleSet) -> list[Rule]:
    return [r for r in rules.ordered("fleet") if r.then.activate_standby]


def measure(events: list[Seen], since: float, core: ArbitratorCore) -> Activation | None:
    """The first activation decided at or after `since`, with what led to it and what followed; None
    while no activation decision has been seen. Pure: `core` only computes signals."""
    rules = activate_rules(core.rules)
    latest: dict[type, dict[str, Seen]] = {WorkerTelemetry: {}, GatewayTelemetry: {}, PoolTelemetry: {},
                                           FingerprinterTelemetry: {}}
    overload: tuple[float, str] | None = None
    found: Activation | None = None
    for seen in sorted(events, key=lambda s: s.at):
        m = seen.message
        if found is None:
            if type(m) in latest:
                if isinstance(m, WorkerTelemetry) and m.draining:
                    latest[WorkerTelemetry].pop(m.instance_id, None)
                else:
                    latest[type(m)][m.instance_id] = seen
                if isinstance(m, WorkerTelemetry) and seen.at >= since and overload is None:
                    # the arbitrator ignores telemetry older than its stale_s: so does this view
                    fresh = {kind: {k: s.message for k, s in by_id.items() if seen.at - s.at <= core.stale_s}
                             for kind, by_id in latest.items()}
                    signals = core.fleet_signals(fresh[WorkerTelemetry], fresh[GatewayTelemetry],
                                                 fresh[PoolTelemetry], fresh[FingerprinterTelemetry])
                    held = next((r for r in rules if r.matches(signals) is not None), None)
                    if held is not None:
                        overload = (seen.at, held.name)
            elif isinstance(m, Decision) and seen.at >= since and m.action == "warm_capacity" \
                    and m.standby is False and not m.refresh:
                found = Activation(target=m.target, rule=m.rule, decision_id=m.decision_id,
                                   decided_at=seen.at, issued_at=m.issued_at)
                if overload is not None:
                    found.overload_at, found.overload_rule = overload
            continue
        if isinstance(m, WorkerTelemetry) and m.instance_id == found.target:
            if found.active_at is None and not m.standby:
                found.active_at = seen.at
            if m.activation_decision_id == found.decision_id and found.reported_latency_s is None:
                found.reported_latency_s = m.activation_latency_s
        elif isinstance(m, Admission) and m.accepted and m.worker_id == found.target and found.accepted_at is None:
            found.accepted_at = seen.at
    return found


def attach_requests(activation: Activation, requests: list[Sent]) -> None:
    """What the clients saw: statuses, requests per X-Kite-Worker, the first request the target served."""
    for r in requests:
        activation.statuses[r.status] = activation.statuses.get(r.status, 0) + 1
        if r.status == 200:
            activation.served[r.worker] = activation.served.get(r.worker, 0) + 1
    # the header names every worker that served a request, comma-separated
    mine = [r.sent_at for r in requests if r.status == 200 and activation.target in r.worker.split(",")]
    activation.first_sent_at = min(mine, default=None)


def summarize(samples: list[dict[str, float | None]]) -> dict[str, dict[str, float | None]]:
    """p50 and max of each figure over the samples that have it."""
    out = {}
    for key, _ in _METRICS:
        values = [s[key] for s in samples if s.get(key) is not None]
        out[key] = {"p50": None if not values else round(percentile(values, 50), 2),
                    "max": max(values, default=None), "n": len(values)}
    return out


def verdict(samples: list[dict[str, float | None]], key: str, target_ms: float = TARGET_MS) -> bool:
    """Every round measured `key` within the target (a round that never got there fails)."""
    return bool(samples) and all(s.get(key) is not None and s[key] <= target_ms for s in samples)


def render_table(activations: list[Activation], target_ms: float = TARGET_MS) -> str:
    def cell(v: float | None) -> str:
        return "-" if v is None else f"{v:.1f}"
    samples = [a.figures() for a in activations]
    head = ["round", "target", "rule"] + [f"{label} (ms)" for _, label in _METRICS] + [f"≤ {target_ms:g} ms"]
    lines = ["| " + " | ".join(head) + " |", "|---|---|---|" + "---:|" * len(_METRICS) + "---|"]
    for i, (a, s) in enumerate(zip(activations, samples), start=1):
        ok = s["decision_to_accepted_ms"] is not None and s["decision_to_accepted_ms"] <= target_ms
        lines.append(f"| {i} | {a.target} | {a.rule} | "
                     + " | ".join(cell(s[k]) for k, _ in _METRICS) + f" | {'yes' if ok else 'NO'} |")
    summary = summarize(samples)
    for stat in ("p50", "max"):
        lines.append(f"| {stat} | | | " + " | ".join(cell(summary[k][stat]) for k, _ in _METRICS) + " | |")
    return "\n".join(lines)


def bench_rules(scale_in_after_s: float) -> str:
    """The default rules with every scale-in rule's `for_s` shortened (the activation rules unchanged)."""
    doc = yaml.safe_load(DEFAULT_RULES_PATH.read_text())
    num_changed = 0
    for rule in doc["rules"]:
        if rule.get("then", {}).get("scale_in"):
            rule["for_s"] = scale_in_after_s
            num_changed += 1
    if not num_changed:
        raise SystemExit(f"{DEFAULT_RULES_PATH} has no scale_in rule: nothing returns a worker to standby")
    return yaml.safe_dump(doc, sort_keys=False)


# --- I/O -------------------------------------------------------------------------------------------


class Observer:
    """Every telemetry message, decision and worker Admission, stamped on receipt (own thread and loop,
    so the load generator's event loop cannot delay the stamps)."""

    def __init__(self, nats_url: str) -> None:
        self.nats_url = nats_url
        self._events: list[Seen] = []
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="observer", daemon=True)

    def __enter__(self) -> "Observer":
        self._thread.start()
        if not self._ready.wait(30) or self._error:
            raise RuntimeError(f"the observer could not connect to {self.nats_url}: {self._error}")
        return self

    def __exit__(self, *exc) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)

    def events(self, after: float = 0.0) -> list[Seen]:
        with self._lock:
            return [s for s in self._events if s.at >= after]

    def _add(self, at: float, message: object) -> None:
        with self._lock:
            self._events.append(Seen(at, message))

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as exc:  # reported by __enter__ when it happens before connecting
            self._error = exc
            self._ready.set()

    async def _main(self) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()

        async def closed_on_purpose() -> None:  # the services' "disconnected" warning is not news here
            pass

        nc = await connect_nats(self.nats_url, "kite-bench-standby", load(CommonConfig), allow_reconnect=False,
                                disconnected_cb=closed_on_purpose)

        async def on_telemetry(msg) -> None:
            at = time.time()
            try:
                self._add(at, TELEMETRY.decode(msg.data))
            except (MessageError, ValueError):
                pass  # another schema or kind: the arbitrator ignores it as well

        async def on_decision(msg) -> None:
            at = time.time()
            try:
                self._add(at, Decision.decode(msg.data))
            except (MessageError, ValueError):
                pass

        async def on_reply(msg) -> None:
            at = time.time()
            if len(msg.data) > _MAX_ADMISSION_BYTES:
                return
            try:
                admission = Admission.decode(msg.data)
            except (MessageError, ValueError):
                return  # another reply (pool lookups, pongs, admin)
            if admission.worker_id:
                self._add(at, admission)

        await nc.subscribe(subjects.TELEMETRY_WILDCARD, cb=on_telemetry)
        await nc.subscribe(subjects.DECISIONS, cb=on_decision)
        await nc.subscribe("_INBOX.>", cb=on_reply)
        await nc.flush()
        self._ready.set()
        await self._stop.wait()
        await nc.close()


def latest_workers(events: list[Seen], within_s: float = 3.0) -> dict[str, WorkerTelemetry]:
    now = time.time()
    out: dict[str, WorkerTelemetry] = {}
    for s in events:
        if isinstance(s.message, WorkerTelemetry) and now - s.at <= within_s:
            out[s.message.instance_id] = s.message
    return out


def wait_until(predicate, timeout_s: float, what: str, interval_s: float = 0.1):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    raise TimeoutError(f"timed out after {timeout_s:g} s waiting for {what}")


def one_standby_one_active(observer: Observer) -> bool:
    workers = latest_workers(observer.events())
    idle = all(w.num_running == 0 and w.queue_depth == 0 for w in workers.values())
    return len(workers) == 2 and sum(w.standby for w in workers.values()) == 1 and idle


async def _request(client: httpx.AsyncClient, url: str, rng: random.Random, prompt_tokens: int) -> Sent:
    sent_at = time.time()
    try:
        r = await client.post(url + "/v1/completions", json={
            "model": MODEL, "prompt": [rng.randrange(1000, 30000) for _ in range(prompt_tokens)],
            "max_tokens": 2, "temperature": 0})
        return Sent(sent_at, time.time(), r.status_code, r.headers.get("x-kite-worker", ""))
    except httpx.HTTPError:
        return Sent(sent_at, time.time(), 0, "")


async def offer_load(url: str, rate: float, prompt_tokens: int, seed: int, done) -> list[Sent]:
    """Requests at fixed intervals until done() (polled between sends), then waits for the answers."""
    rng = random.Random(seed)
    loop = asyncio.get_running_loop()
    tasks: list[asyncio.Task] = []
    async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=None)) as client:
        next_at = loop.time()
        while not done():
            tasks.append(asyncio.create_task(_request(client, url, rng, prompt_tokens)))
            next_at += 1.0 / rate
            await asyncio.sleep(max(0.0, next_at - loop.time()))
        return list(await asyncio.gather(*tasks))


def run_round(stack: LocalStack, observer: Observer, core: ArbitratorCore, args, index: int) -> Activation | None:
    since = time.time()
    deadline = since + args.round_timeout_s
    # every service sends telemetry at least every second: this much history holds each one's latest
    history_from = since - 10.0

    def done() -> bool:
        # stop at the first accept: every request sent is still answered (X-Kite-Worker), and the less
        # backlog is left, the sooner the arbitrator returns a worker to standby for the next round
        found = measure(observer.events(history_from), since, core)
        return time.time() > deadline or (found is not None and found.accepted_at is not None)

    requests = asyncio.run(offer_load(stack.http_url, args.rate, args.prompt_tokens, seed=index, done=done))
    time.sleep(0.5)  # the last telemetry and replies reach the observer
    activation = measure(observer.events(history_from), since, core)
    if activation is not None:
        attach_requests(activation, requests)
    return activation


def conditions(load_at_start: tuple[float, float, float]) -> dict:
    """When and how loaded: other work on the same cores stretches every figure."""
    return {"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"), "cpus": os.cpu_count(),
            "load_average_1m_at_start": round(load_at_start[0], 2),
            "load_average_1m_at_end": round(os.getloadavg()[0], 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="activations to measure (at least 3)")
    parser.add_argument("--rate", type=float, default=8.0, help="requests per second while loading")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--engine", default="transformers", help="KITE_ENGINE of both workers")
    parser.add_argument("--scale-in-after-s", type=float, default=3.0,
                        help="idle time before the arbitrator returns a worker to standby (default rules: 300)")
    parser.add_argument("--round-timeout-s", type=float, default=120.0)
    parser.add_argument("--json", type=Path, help="write the figures there")
    args = parser.parse_args()
    if args.rounds < 3:
        parser.error("--rounds must be at least 3")

    load_at_start = os.getloadavg()
    log_dir = Path(tempfile.mkdtemp(prefix="kite-bench-standby-"))
    rules_path = log_dir / "rules.yaml"
    rules_path.write_text(bench_rules(args.scale_in_after_s))
    rules, _ = load_rules(rules_path)
    slo_s = 10.0  # KITE_ARBITRATOR_TTFT_SLO_S's default, set explicitly: the observer needs the same value
    core = ArbitratorCore(rules=rules, ttft_slo_s=slo_s, stale_s=load(ArbitratorConfig).stale_s)
    env = {"KITE_ENGINE": args.engine, "KITE_ARBITRATOR_RULES_FILE": str(rules_path),
           "KITE_ARBITRATOR_TTFT_SLO_S": str(slo_s),
           # random prompts would otherwise leave their blocks in ~/.cache/kite/cold
           "KITE_COLD_DIR": str(log_dir / "cold")}
    activations: list[Activation] = []
    with LocalStack(StackOptions(num_workers=1, env=env, log_dir=log_dir)) as stack:
        stack.start_worker({"KITE_WORKER_STANDBY": "on"})
        with Observer(stack.nats.url) as observer:
            # a vLLM worker compiles for minutes; the transformers one loads in seconds
            wait_until(lambda: one_standby_one_active(observer), 900, "one active and one standby worker")
            with httpx.Client(timeout=300) as client:  # the active worker's first forward passes are slow
                for i in range(3):
                    client.post(stack.http_url + "/v1/completions", json={
                        "model": MODEL, "prompt": f"Warm up {i}.", "max_tokens": 2, "temperature": 0})
            for index in range(args.rounds):
                wait_until(lambda: one_standby_one_active(observer), 600,
                           f"a worker back on standby before round {index + 1}")
                time.sleep(1.5)  # the arbitrator holds a standby/active change KITE_ARBITRATOR_MIN_HOLD_S (1 s)
                activation = run_round(stack, observer, core, args, index)
                if activation is None:
                    print(f"round {index + 1}: no activation within {args.round_timeout_s:g} s "
                          f"(logs in {log_dir})")
                    break
                activations.append(activation)
                f = activation.figures()
                print(f"round {index + 1}: {activation.target} by {activation.rule}: decision → first accepted "
                      f"{f['decision_to_accepted_ms']} ms; served {activation.served}, statuses "
                      f"{activation.statuses}", flush=True)

    samples = [a.figures() for a in activations]
    meta = conditions(load_at_start) | {
        "engine": args.engine, "rate_per_s": args.rate, "prompt_tokens": args.prompt_tokens, "rounds": args.rounds,
        "scale_in_after_s": args.scale_in_after_s, "logs": str(log_dir)}
    complete = len(activations) == args.rounds
    passed = complete and verdict(samples, "decision_to_accepted_ms")
    end_to_end = complete and verdict(samples, "overload_to_accepted_ms")
    print(f"\nstandby activation, {args.engine} engine, {args.rate:g} requests/s of {args.prompt_tokens}-token "
          f"prompts, {meta['date']}, load average {meta['load_average_1m_at_start']} → "
          f"{meta['load_average_1m_at_end']} on {meta['cpus']} CPUs")
    print(render_table(activations))
    print(f"target: decision → first accepted request ≤ {TARGET_MS:g} ms in every round: "
          f"{'PASS' if passed else 'FAIL'} ({len(activations)}/{args.rounds} rounds measured); "
          f"overload → first accepted ≤ {TARGET_MS:g} ms: {'PASS' if end_to_end else 'FAIL'}")
    if args.json:
        args.json.write_text(json.dumps({
            "target_ms": TARGET_MS, "pass": passed, "end_to_end_pass": end_to_end, "conditions": meta,
            "samples": [asdict(a) | {"figures": a.figures()} for a in activations],
            "summary": summarize(samples)}, indent=2, default=str))
        print(f"figures written to {args.json}")
    raise SystemExit(0 if passed else 1)


if __name__ == "__main__":
    main()
