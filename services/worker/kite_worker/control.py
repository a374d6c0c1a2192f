"""The worker's control plane (issue 5): telemetry out, arbitrator decisions in.

- Telemetry (`kite_shared.messages.WorkerTelemetry` on kite.v1.telemetry.worker) every
  KITE_TELEMETRY_INTERVAL_S, and sooner on a significant change: within 100 ms when queue depth, running
  requests or the standby flag change while requests are in flight; at once when an idle worker admits a
  request (an idle worker's shape changes only then, so it wakes for nothing else); at once when asked
  (`publish_soon`: an activation, a decision, the drain); and right before a stream's last event, whose
  publisher awaits `publish` (routers see the freed slot before the client can send its next turn).
- Decisions (kite.v1.arbitrator.decisions) for this worker or "*": `write_policy` sets the Upcycle write
  policy (kite_worker.write_policy); `warm_capacity` activates a standby worker (KITE_WORKER_STANDBY: model
  loaded, not taking requests) or scales one in (requests in flight finish). Activation latency = decision
  issued -> first request accepted, reported in telemetry and logged. `quarantine` (its target a model
  fingerprint) stops reuse of that namespace on this worker until lifted.

Boundary: the worker service is seen only through the `Worker` protocol below (its load figures; take or
stop taking requests), the bus only through the runtime (instance id, draining, publish). This module never
imports kite_worker.service; the service owns a WorkerControl and tells it `accepted()`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Protocol

from kite_shared import subjects
from kite_shared.messages import Decision, WorkerTelemetry
from kite_shared.service import ServiceRuntime
from kite_shared.window import TimeWindow
from kite_worker.write_policy import WritePolicyFilter

log = logging.getLogger(__name__)

_CHANGE_POLL_S = 0.1
# Telemetry goes out on every change of a busy worker's shape (several a request): the host's memory,
# which moves slowly, is read from /proc at most this often.
_MEMORY_READ_S = 1.0


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


@dataclass(frozen=True)
class WorkerLoad:
    """The worker service's figures for one telemetry message."""

    queue_depth: int
    num_running: int
    max_running: int
    running_tokens: int
    prefill_backlog_tokens: int
    cache_bytes: int
    cache_capacity_bytes: int
    prompt_tokens_reused: int  # since the worker started
    prompt_tokens_computed: int  # since the worker started
    prefill_seconds_per_token: float  # 0 = not measured yet
    decode_seconds_per_token: float
    healthy: bool  # the engine runs
    pool_read: bool  # missing prefix blocks are loaded from the ru-pool
    new_ttft_samples: tuple[float, ...] = ()  # seconds to first token, of requests since the last report


class Worker(Protocol):
    """What the control plane asks of the worker service (kite_worker.service.WorkerService)."""

    def occupancy(self) -> tuple[int, int]:
        """(queued, running) requests; cheap: polled every 100 ms while requests are in flight."""

    def load(self) -> WorkerLoad:
        """The figures of one telemetry message (hands over the TTFT samples gathered since the last)."""

    async def join(self) -> None:
        """Take requests (subscribe to the generate subjects)."""

    async def leave(self) -> None:
        """Stop taking requests; those in flight finish."""

    def quarantine(self, model_fingerprint: str, quarantined: bool) -> None:
        """Reuse nothing of this namespace (model fingerprint) and drop its local blocks; or reuse again."""


class WorkerControl:
    def __init__(self, rt: ServiceRuntime, worker: Worker, writes: WritePolicyFilter, standby: bool,
                 interval_s: float, window_s: float) -> None:
        self.rt = rt
        self.worker = worker
        self.writes = writes
        self.standby = standby
        self.interval_s = interval_s
        self.window_s = window_s
        self._ttft = TimeWindow(window_s)  # seconds to first token, one sample per request
        self._hits: deque[tuple[float, int, int]] = deque()  # (monotonic, reused, computed) snapshots
        self._accepted = 0
        self._admitted_ids: deque[str] = deque(maxlen=1000)  # since the last telemetry message
        self._activation: tuple[str, float] | None = None  # (decision id, issued_at) awaiting a request
        self._activation_id = ""
        self._activation_latency: float | None = None
        self._wanted = asyncio.Event()  # publish at once
        self._wanted.set()  # the first message goes out when the loop starts
        self._last_shape: tuple | None = None
        self._last_sent = 0.0
        self._memory_used = (0.0, -_MEMORY_READ_S)  # (fraction, monotonic when read)

    async def start(self) -> None:
        """Take requests, unless standing by (KITE_WORKER_STANDBY) until a decision activates this worker."""
        if self.standby:
            log.info("standing by: model loaded, not taking requests until activated")
        else:
            await self.worker.join()

    def accepted(self, request_id: str) -> None:
        """A request was admitted (the first one after an activation measures its latency)."""
        self._accepted += 1
        self._admitted_ids.append(request_id)
        if self._idle_when_sent():
            self.publish_soon()  # the loop waits for nothing else while idle (publish_when_due)
        if self._activation is not None:
            decision_id, issued_at = self._activation
            self._activation = None
            self._activation_id = decision_id
            self._activation_latency = max(0.0, time.time() - issued_at)
            log.info("activation %s -> first accepted request: %.1f ms", decision_id,
                     1000 * self._activation_latency)
            self.publish_soon()

    # --- decisions ------------------------------------------------------------------------------------
    async def on_decision(self, d: Decision) -> None:
        """Handler of kite.v1.arbitrator.decisions (an event: no reply)."""
        if d.action == "quarantine" and d.quarantined is not None:  # its target is a namespace
            self.worker.quarantine(d.target, d.quarantined)
            return
        if d.target not in ("*", self.rt.instance_id):
            return
        if d.action == "write_policy" and d.write_policy and d.write_policy != self.writes.policy:
            log.info("write policy %s -> %s (decision %s: %s)", self.writes.policy, d.write_policy,
                     d.decision_id, d.reason)
            self.writes.set_policy(d.write_policy)
        elif d.action == "warm_capacity" and d.standby is not None and d.standby != self.standby \
                and not d.refresh and not self.rt.draining:
            if d.standby:
                log.info("scale-in to standby (decision %s: %s)", d.decision_id, d.reason)
                await self.worker.leave()
            else:
                log.info("activated (decision %s: %s)", d.decision_id, d.reason)
                self._activation = (d.decision_id, d.issued_at)
                await self.worker.join()
            self.standby = d.standby
            self.publish_soon()

    # --- telemetry ----------------------------------------------------------------------------------
    def snapshot(self) -> WorkerTelemetry:
        load = self.worker.load()
        now = time.monotonic()
        for seconds in load.new_ttft_samples:
            self._ttft.add(now, seconds)
        self._hits.append((now, load.prompt_tokens_reused, load.prompt_tokens_computed))
        while self._hits and now - self._hits[0][0] > self.window_s:
            self._hits.popleft()
        _, reused0, computed0 = self._hits[0]
        reused = load.prompt_tokens_reused - reused0
        total = reused + load.prompt_tokens_computed - computed0
        return WorkerTelemetry(
            instance_id=self.rt.instance_id, queue_depth=load.queue_depth, num_running=load.num_running,
            max_running=load.max_running, running_tokens=load.running_tokens,
            prefill_backlog_tokens=load.prefill_backlog_tokens,
            cache_bytes=load.cache_bytes, cache_capacity_bytes=load.cache_capacity_bytes,
            memory_used_fraction=self._memory_used_fraction(now),
            local_hit_rate=round(reused / total, 4) if total else 0.0, prompt_tokens_window=total,
            prefill_tokens_per_s=round(1 / load.prefill_seconds_per_token, 1)
            if load.prefill_seconds_per_token > 0 else 0.0,
            decode_tokens_per_s=round(1 / load.decode_seconds_per_token, 1)
            if load.decode_seconds_per_token > 0 else 0.0,
            ttft_p50_s=round(self._ttft.percentile(now, 0.5), 4),
            ttft_p99_s=round(self._ttft.percentile(now, 0.99), 4), ttft_samples=self._ttft.count(now), healthy=load.healthy and not self.rt.draining,
            standby=self.standby, draining=self.rt.draining, write_policy=self.writes.policy,
            pool_read=load.pool_read,
            requests_accepted=self._accepted, admitted_request_ids=self._take_admitted_ids(),
            activation_decision_id=self._activation_id,
            activation_latency_s=self._activation_latency)

    def _take_admitted_ids(self) -> list[str]:
        ids = list(self._admitted_ids)
        self._admitted_ids.clear()
        return ids

    def _memory_used_fraction(self, now: float) -> float:
        fraction, read_at = self._memory_used
        if now - read_at >= _MEMORY_READ_S:
            fraction = memory_used_fraction()
            self._memory_used = (fraction, now)
        return fraction

    def publish_soon(self) -> None:
        """Have the telemetry loop publish at once (it is woken, not waited for)."""
        self._wanted.set()

    async def publish(self) -> None:
        """Publish telemetry now. Raises what publishing raises: the caller reports it (the runtime's loop)."""
        self._wanted.clear()
        self._last_shape = self._shape()  # before the snapshot: a failing one is retried at the next change
        self._last_sent = time.monotonic()
        await self.rt.nc.publish(subjects.telemetry("worker"), self.snapshot().encode())

    async def publish_when_due(self) -> None:
        """One round of the telemetry loop, which the runtime runs until shutdown (rt.every with no pause:
        this round waits by itself): wait until a message is due, then publish it."""
        while not self._due():
            # Busy, the shape is polled; idle, only an admission changes it, and `accepted` wakes this
            # loop: an idle worker wakes once an interval (each wake-up costs its event loop CPU).
            wait_s = (self.interval_s - (time.monotonic() - self._last_sent) if self._idle_when_sent()
                      else _CHANGE_POLL_S)
            try:
                async with asyncio.timeout(max(0.0, wait_s)):
                    await self._wanted.wait()
            except TimeoutError:
                pass
        await self.publish()

    def _idle_when_sent(self) -> bool:
        """No request queued or running at the last message."""
        return self._last_shape is not None and self._last_shape[:2] == (0, 0)

    def _due(self) -> bool:
        return (self._wanted.is_set() or self._shape() != self._last_shape
                or time.monotonic() - self._last_sent >= self.interval_s)

    def _shape(self) -> tuple:
        return (*self.worker.occupancy(), self.standby)
