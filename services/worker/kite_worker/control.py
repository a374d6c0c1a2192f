"""The worker's control plane (issue 5): telemetry out, arbitrator decisions in, generate subscriptions.

- Telemetry (`kite_shared.messages.WorkerTelemetry` on kite.v1.telemetry.worker) every
  KITE_TELEMETRY_INTERVAL_S, and at once (at most every 100 ms) when queue depth, running requests or the
  standby flag change.
- Generate subscriptions: the queue-group subject (any worker) and this worker's own subject
  (`subjects.worker_generate(instance)`, where the fingerprinter's router sends). A standby worker
  (KITE_WORKER_STANDBY) has neither until a `warm_capacity` decision activates it; a scale-in decision
  removes them again (requests in flight finish). Activation latency = decision issued -> first request
  accepted, reported in telemetry and logged.
- Upcycle write policy for ru-pool puts (`WritePolicyFilter`): write_through (every new block), selective
  (only blocks seen in two requests' prompts: a block computed once is held back and handed over when a
  second request asks for it), off (nothing). Set by KITE_WORKER_WRITE_POLICY, then by `write_policy`
  decisions for this worker or "*".
"""

from __future__ import annotations

import asyncio
import logging
import statistics
import threading
import time
from collections import OrderedDict, deque
from typing import TYPE_CHECKING, Callable

from nats.aio.msg import Msg

from kite_shared import subjects
from kite_shared.messages import TokenizedRequest, decode_or_log
from kite_shared.messages import WRITE_POLICIES, Decision, WorkerTelemetry

if TYPE_CHECKING:
    from kite_worker.service import WorkerService
    from kite_worker.engine import NewBlock

log = logging.getLogger(__name__)

_CHANGE_POLL_S = 0.1
_SEEN_BLOCKS = 65536  # block hashes remembered for the selective policy
_HELD_BLOCKS = 4096  # computed-once blocks held back (they share tensors with the local cache)


def memory_used_fraction() -> float:
    """1 - MemAvailable / MemTotal from /proc/meminfo; 0 where it cannot be read."""
    try:
        info = {}
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                info[key] = int(rest.split()[0])
        return round(1 - info["MemAvailable"] / info["MemTotal"], 4)
    except (OSError, KeyError, ValueError, ZeroDivisionError):
        return 0.0


class WritePolicyFilter:
    """Which newly computed blocks go to the ru-pool. Thread-safe: `filter` runs on the engine thread,
    `seen` on the asyncio thread."""

    def __init__(self, policy: str) -> None:
        self.policy = policy
        self._lock = threading.Lock()
        self._seen: OrderedDict[bytes, int] = OrderedDict()  # block hash -> requests whose prompt had it
        self._held: OrderedDict[bytes, "NewBlock"] = OrderedDict()

    def set_policy(self, policy: str) -> None:
        if policy not in WRITE_POLICIES:
            raise ValueError(f"unknown write policy {policy!r}")
        with self._lock:
            self.policy = policy
            if policy != "selective":
                self._held.clear()

    def seen(self, block_hashes: list[bytes]) -> list["NewBlock"]:
        """A request's prompt blocks; returns held-back blocks that are now seen twice (to write)."""
        release = []
        with self._lock:
            for h in block_hashes:
                n = self._seen.pop(h, 0) + 1
                self._seen[h] = n
                if n >= 2 and h in self._held:
                    release.append(self._held.pop(h))
            while len(self._seen) > _SEEN_BLOCKS:
                self._seen.popitem(last=False)
        return release if self.policy == "selective" else []

    def num_leading_to_write(self, block_hashes: list[bytes]) -> int:
        """For engines that save blocks themselves (vLLM's connector): how many of a prompt's leading
        blocks the policy lets through; -1 for all (and the generated ones)."""
        with self._lock:
            if self.policy == "write_through":
                return -1
            if self.policy == "off":
                return 0
            count = 0
            for h in block_hashes:
                if self._seen.get(h, 0) < 2:
                    break
                count += 1
            return count

    def filter(self, blocks: list["NewBlock"]) -> list["NewBlock"]:
        with self._lock:
            if self.policy == "write_through":
                return blocks
            if self.policy == "off":
                return []
            out = []
            for b in blocks:
                h = bytes(b.block_hash)
                if self._seen.get(h, 0) >= 2:
                    out.append(b)
                else:
                    self._held[h] = b
                    while len(self._held) > _HELD_BLOCKS:
                        self._held.popitem(last=False)
            return out


class WorkerControl:
    def __init__(self, service: "WorkerService", standby: bool, write_policy: str, interval_s: float,
                 window_s: float, on_request: Callable[[Msg], object]) -> None:
        self.service = service
        self.rt = service.rt
        self.standby = standby
        self.writes = WritePolicyFilter(write_policy)
        self.interval_s = interval_s
        self.window_s = window_s
        self._on_request = on_request
        self._subs: list = []
        self._tasks: list[asyncio.Task] = []
        self._ttft: deque[tuple[float, float]] = deque()  # (monotonic, seconds)
        self._hits: deque[tuple[float, int, int]] = deque()  # (monotonic, reused, computed) snapshots
        self._accepted = 0
        self._activation: tuple[str, float] | None = None  # (decision id, issued_at) awaiting a request
        self._activation_id = ""
        self._activation_latency: float | None = None
        self._last_shape: tuple | None = None
        self._last_sent = 0.0

    async def start(self) -> None:
        await self.rt.nc.subscribe(subjects.DECISIONS, cb=self._on_decision)
        if not self.standby:
            await self.join()
        else:
            log.info("standing by: model loaded, not taking requests until activated")
        self._tasks.append(asyncio.create_task(self._loop()))

    async def join(self) -> None:
        """Take requests: the queue group and this worker's own subject."""
        if self._subs:
            return
        self._subs = [
            await self.rt.nc.subscribe(subjects.WORKER_GENERATE, queue=subjects.WORKER_QUEUE, cb=self._on_request),
            await self.rt.nc.subscribe(subjects.worker_generate(self.rt.instance_id), cb=self._on_request),
        ]

    async def leave(self) -> None:
        """Stop taking requests (drain, scale-in); in-flight ones finish."""
        subs, self._subs = self._subs, []
        for sub in subs:
            try:
                await sub.unsubscribe()
            except Exception as exc:
                log.debug("unsubscribe failed: %s", exc)

    async def stop(self) -> None:
        await self.leave()
        for task in self._tasks:
            task.cancel()

    # --- hooks called by WorkerService --------------------------------------------------------------
    def accepted(self, request: TokenizedRequest) -> list["NewBlock"]:
        """A request was admitted: activation latency, and blocks the selective policy now releases."""
        self._accepted += 1
        if self._activation is not None:
            decision_id, issued_at = self._activation
            self._activation = None
            self._activation_id = decision_id
            self._activation_latency = max(0.0, time.time() - issued_at)
            log.info("activation %s -> first accepted request: %.1f ms", decision_id,
                     1000 * self._activation_latency)
            self._last_shape = None  # publish now
        return self.writes.seen([bytes(h) for h in request.block_hashes])

    def ttft(self, seconds: float) -> None:
        self._ttft.append((time.monotonic(), seconds))

    # --- decisions ------------------------------------------------------------------------------------
    async def _on_decision(self, msg: Msg) -> None:
        d = decode_or_log(Decision.decode, msg.data, log, "bad decision")
        if d is None or d.target not in ("*", self.rt.instance_id):
            return
        if d.action == "write_policy" and d.write_policy and d.write_policy != self.writes.policy:
            log.info("write policy %s -> %s (decision %s: %s)", self.writes.policy, d.write_policy,
                     d.decision_id, d.reason)
            self.writes.set_policy(d.write_policy)
        elif d.action == "warm_capacity" and d.standby is not None and d.standby != self.standby \
                and not d.refresh and not self.rt.draining:
            if d.standby:
                log.info("scale-in to standby (decision %s: %s)", d.decision_id, d.reason)
                await self.leave()
            else:
                log.info("activated (decision %s: %s)", d.decision_id, d.reason)
                self._activation = (d.decision_id, d.issued_at)
                await self.join()
            self.standby = d.standby
            await self.publish()

    # --- telemetry ----------------------------------------------------------------------------------
    def snapshot(self) -> WorkerTelemetry:
        svc = self.service
        engine = svc.loaded.engine
        sched = svc.scheduler
        svc._update_metrics()  # drains TTFT samples into the histogram and into self.ttft
        now = time.monotonic()
        self._hits.append((now, engine.num_prompt_tokens_reused, engine.num_prompt_tokens_computed))
        while self._hits and now - self._hits[0][0] > self.window_s:
            self._hits.popleft()
        while self._ttft and now - self._ttft[0][0] > self.window_s:
            self._ttft.popleft()
        _, reused0, computed0 = self._hits[0]
        reused = engine.num_prompt_tokens_reused - reused0
        total = reused + engine.num_prompt_tokens_computed - computed0
        samples = sorted(s for _, s in self._ttft)
        running_tokens, backlog = sched.load_snapshot()
        cache = engine.block_cache
        return WorkerTelemetry(
            instance_id=self.rt.instance_id, queue_depth=sched.num_queued, num_running=sched.num_running,
            max_running=sched.max_running, running_tokens=running_tokens, prefill_backlog_tokens=backlog,
            cache_bytes=cache.num_bytes, cache_capacity_bytes=cache.capacity_bytes,
            memory_used_fraction=memory_used_fraction(),
            local_hit_rate=round(reused / total, 4) if total else 0.0, prompt_tokens_window=total,
            prefill_tokens_per_s=round(1 / engine.prefill_seconds_per_token, 1)
            if engine.prefill_seconds_per_token > 0 else 0.0,
            decode_tokens_per_s=round(1 / engine.decode_seconds_per_token, 1)
            if engine.decode_seconds_per_token > 0 else 0.0,
            ttft_p50_s=round(statistics.median(samples), 4) if samples else 0.0,
            ttft_p99_s=round(samples[min(len(samples) - 1, int(0.99 * len(samples)))], 4) if samples else 0.0,
            ttft_samples=len(samples), healthy=sched.alive and not self.rt.draining,
            standby=self.standby, draining=self.rt.draining, write_policy=self.writes.policy,
            pool_read=svc.pool_read,
            requests_accepted=self._accepted, activation_decision_id=self._activation_id,
            activation_latency_s=self._activation_latency)

    def publish_soon(self) -> None:
        """Publish now (a request finished): scheduled before the stream's last event goes out."""
        task = asyncio.ensure_future(self.publish())
        self._tasks.append(task)
        task.add_done_callback(self._tasks.remove)

    async def publish(self) -> None:
        try:
            t = self.snapshot()
            self._last_shape = (t.queue_depth, t.num_running, t.standby)
            self._last_sent = time.monotonic()
            await self.rt.nc.publish(subjects.telemetry("worker"), t.encode())
        except Exception as exc:  # reconnecting: the next one goes out
            log.debug("telemetry not sent: %s", exc)

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(_CHANGE_POLL_S)
            sched = self.service.scheduler
            shape = (sched.num_queued, sched.num_running, self.standby)
            if shape != self._last_shape or time.monotonic() - self._last_sent >= self.interval_s:
                await self.publish()
