"""The reference engine's generation loop: admits requests, interleaves them step by step, emits stream events.

Runs the model on one dedicated thread (torch releases the GIL, so the asyncio thread keeps serving NATS).
Each iteration gives every running sequence one step: a prefill chunk or one decode token. Up to
`max_running` sequences run at once; the rest wait in FIFO order, up to `max_queued`, beyond which
`submit` refuses with code "overloaded" so the gateway can answer 503 at once instead of queueing into
a timeout. There is no batched forward pass across sequences (a known limitation on CPU: throughput
comes from more worker replicas); interleaving keeps every stream moving and bounds time to first token
for short prompts behind long ones.

Admission is two-step: `reserve` validates a request and takes a queue place at once (so the gateway
hears "accepted" or "overloaded" immediately); the reference engine (engine.py) may then load prefix
blocks from the ru-pool onto the Sequence, and `enqueue` hands it to the engine thread.

Shadow verification (kite_worker.shadow): a sampled request that reused KV keeps its first-token logits
and is queued as a check after its prefill; once no request has waited or run for `shadow_idle_s`, the
loop recomputes the oldest check a small chunk at a time (a request arriving meanwhile waits at most one
chunk) and hands the outcome to `on_shadow(outcome)`. A quarantined model fingerprint (`quarantine`) drops
its local blocks and its requests run without reuse.

Boundary: knows the model (model.py) and the callbacks given at `start` (`emit(subject, message)` for
stream events, `on_new_blocks(blocks)` for the ru-pool, `on_cache_events(events)` for the pool's index,
`on_shadow`); no NATS here: the reference engine (engine.py) wires it to the worker, and the model tests
drive it with plain callbacks.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from concurrent.futures import Future
from typing import Any, Callable

from kite_shared.messages import (ErrorInfo, Message, StreamEnd, StreamError, TokenChunk,
                                  TokenizedRequest, Usage)
from kite_worker.engines.base import RequestRejected
from kite_worker.engines.reference.block_cache import CacheEvent
from kite_worker.engines.reference.model import NewBlock, ReferenceModel, Sequence
from kite_worker.shadow import ShadowCheck, ShadowOutcome, ShadowVerifier

log = logging.getLogger(__name__)

EmitFn = Callable[[str, Message], None]
BlocksFn = Callable[[list[NewBlock]], None]
CacheEventsFn = Callable[[list[CacheEvent]], None]
ShadowFn = Callable[[ShadowOutcome], None]


def _backlog(seq: Sequence) -> int:
    """Prompt tokens `seq` has still to compute: the expectation until its cached prefix is injected."""
    if not seq.prefilling:
        return 0
    return seq.expected_computed_tokens if seq.cache is None else len(seq.prompt_ids) - seq.num_computed


class _Stream:
    """Per-request event numbering (the gateway checks seq for loss and duplication)."""

    def __init__(self, seq: Sequence) -> None:
        self.seq = seq
        self.next_event = 0

    def number(self) -> int:
        n = self.next_event
        self.next_event += 1
        return n


class Scheduler:
    def __init__(self, model: ReferenceModel, max_running: int, max_queued: int,
                 shadow: ShadowVerifier | None = None, shadow_chunk_tokens: int = 32,
                 shadow_idle_s: float = 0.2) -> None:
        self.model = model
        self.shadow = shadow
        self._on_shadow: ShadowFn | None = None
        self.shadow_chunk_tokens = shadow_chunk_tokens
        # Shadow work starts only after this long without a request: a client that sends its next request
        # as soon as the last answer arrives (a pipeline, an agent) would otherwise land in a chunk.
        self.shadow_idle_s = shadow_idle_s
        self._busy_at = 0.0  # monotonic: when a request last waited or ran
        self._shadow_seq: tuple[ShadowCheck, Sequence] | None = None  # the check being recomputed
        self._quarantine_changes: list[tuple[str, bool]] = []  # for the engine thread to apply
        self._engine_calls: list[tuple[Callable[[], Any], Future]] = []  # call_on_engine_thread
        self.max_running = max_running
        self.max_queued = max_queued
        self._emit: EmitFn | None = None
        self._on_new_blocks: BlocksFn | None = None
        self._on_cache_events: CacheEventsFn | None = None
        self._reserved: dict[str, _Stream] = {}  # admitted, waiting for their pool blocks
        self._waiting: deque[_Stream] = deque()
        self._running: list[_Stream] = []
        self._cancelled: set[str] = set()
        self._lock = threading.Condition()
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name="kite-engine", daemon=True)
        self.ttft_samples: deque[float] = deque(maxlen=1000)  # seconds, admission to first token

    # --- called from the asyncio thread -------------------------------------------------------------

    def start(self, emit: EmitFn, on_new_blocks: BlocksFn, on_cache_events: CacheEventsFn | None = None,
              on_shadow: ShadowFn | None = None) -> None:
        """Start the engine thread, its outputs going to these callbacks (called from that thread)."""
        self._emit = emit
        self._on_new_blocks = on_new_blocks
        self._on_cache_events = on_cache_events
        self._on_shadow = on_shadow
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_queued(self) -> int:
        return len(self._waiting) + len(self._reserved)

    def load_snapshot(self) -> tuple[int, int]:
        """(KV positions of running requests, prompt tokens admitted but not computed yet), for telemetry."""
        with self._lock:
            running = sum(len(s.seq.prompt_ids) + len(s.seq.generated) for s in self._running)
            backlog = sum(_backlog(s.seq) for s in (*self._running, *self._waiting, *self._reserved.values()))
        return running, backlog

    def reserve(self, request: TokenizedRequest) -> Sequence:
        """Validate a request and take a queue place, or raise RequestRejected (bad, "overloaded")."""
        seq = self.model.new_sequence(request)
        with self._lock:
            if self._stopped:
                raise RequestRejected("shutting_down", "this worker is draining")
            if len(self._running) >= self.max_running and self.num_queued >= self.max_queued:
                raise RequestRejected("overloaded", "worker queue is full")
            self._reserved[seq.request_id] = _Stream(seq)
            self._busy_at = time.monotonic()
        seq.keep_logits = seq.reuse and self.shadow is not None and self.shadow.draw()
        return seq

    def enqueue(self, seq: Sequence) -> None:
        """Hand a reserved request to the engine thread (its pool blocks, if any, are on the Sequence)."""
        with self._lock:
            self._waiting.append(self._reserved.pop(seq.request_id))
            self._lock.notify()

    def submit(self, request: TokenizedRequest) -> None:
        """reserve + enqueue, for callers that load nothing from the pool."""
        self.enqueue(self.reserve(request))

    def cancel(self, request_id: str) -> None:
        with self._lock:
            if request_id in self._reserved or any(
                    s.seq.request_id == request_id for s in (*self._waiting, *self._running)):
                self._cancelled.add(request_id)
                self._lock.notify()

    def cancel_all(self) -> None:
        with self._lock:
            self._cancelled.update(self._reserved)
            self._cancelled.update(s.seq.request_id for s in (*self._waiting, *self._running))
            self._lock.notify()

    @property
    def num_shadow_checks_waiting(self) -> int:
        """Checks queued or being recomputed (0 without shadow verification)."""
        if self.shadow is None:
            return 0
        return self.shadow.num_pending + (self._shadow_seq is not None)

    def quarantine(self, model_fingerprint: str, quarantined: bool) -> None:
        """From now on requests of this fingerprint reuse nothing (or again, when lifted); its local blocks
        are dropped by the engine thread before its next step."""
        with self._lock:
            if quarantined:
                self.model.quarantined.add(model_fingerprint)
            else:
                self.model.quarantined.discard(model_fingerprint)
            self._quarantine_changes.append((model_fingerprint, quarantined))
            self._lock.notify()

    def call_on_engine_thread(self, fn: Callable[[], Any]) -> Future:
        """Run `fn` on the engine thread between two steps (it may change the model: adapters); its
        result or exception comes back through the future."""
        future: Future = Future()
        with self._lock:
            if self._stopped or not self.alive:
                future.set_exception(RuntimeError("the engine is not running"))
                return future
            self._engine_calls.append((fn, future))
            self._lock.notify()
        return future

    def uses_adapter(self, name: str) -> bool:
        """Whether a request of this adapter is reserved, waiting or running."""
        with self._lock:
            return any(s.seq.request.adapter == name
                       for s in (*self._reserved.values(), *self._waiting, *self._running))

    def idle(self) -> bool:
        with self._lock:
            return not self._waiting and not self._running and not self._reserved

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            self._lock.notify()

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    # --- the engine thread --------------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._lock:
                while not self._waiting and not self._running and not self._stopped \
                        and not self._quarantine_changes and not self._engine_calls:
                    if not self._shadow_work():
                        self._lock.wait()
                        continue
                    idle_for = self.shadow_idle_s - (time.monotonic() - self._busy_at)
                    if idle_for <= 0 and not self._reserved:
                        break
                    self._lock.wait(idle_for if idle_for > 0 else self.shadow_idle_s)
                if self._stopped and not self._waiting and not self._running:
                    for _, future in self._engine_calls:
                        future.set_exception(RuntimeError("the engine stopped"))
                    return
                while self._waiting and len(self._running) < self.max_running:
                    self._running.append(self._waiting.popleft())
                running = list(self._running)
                # A cancel for a request still reserved (loading pool blocks) waits until it runs.
                cancelled = {s.seq.request_id for s in running} & self._cancelled
                self._cancelled -= cancelled
                changes, self._quarantine_changes = self._quarantine_changes, []
                calls, self._engine_calls = self._engine_calls, []
            for fn, future in calls:
                try:
                    future.set_result(fn())
                except BaseException as exc:
                    future.set_exception(exc)
            for model_fingerprint, quarantined in changes:
                if quarantined:
                    dropped = self.model.block_cache.drop_model(model_fingerprint)
                    log.warning("namespace %s quarantined: %d local blocks dropped, its requests reuse "
                                "nothing", model_fingerprint[:16], dropped)
            for stream in running:
                if stream.seq.request_id in cancelled:
                    self._finish(stream, "cancelled")
                    continue
                try:
                    self._step(stream)
                except Exception as exc:
                    log.exception("request %s failed", stream.seq.request_id)
                    self._fail(stream, ErrorInfo(code="internal_error", message=f"worker error: {exc}"))
            if running:
                self._busy_at = time.monotonic()
            elif self._shadow_work() and time.monotonic() - self._busy_at >= self.shadow_idle_s \
                    and not self._reserved:
                self._shadow_step()
            events = self.model.block_cache.take_events()
            if events and self._on_cache_events is not None:
                self._on_cache_events(events)

    # --- shadow verification (the engine thread, only while no request runs) -------------------------

    def _shadow_work(self) -> bool:
        return self.shadow is not None and (self._shadow_seq is not None or self.shadow.has_pending())

    def _shadow_step(self) -> None:
        """One chunk of the current check's recomputation; judge it once its prompt is done."""
        if self._shadow_seq is None:
            check = self.shadow.take()
            if check.model_fingerprint in self.model.quarantined:
                return  # the namespace is already judged: its blocks are gone
            try:
                self._shadow_seq = (check, self.model.shadow_sequence(check.request))
            except RequestRejected as exc:
                log.info("shadow check of %s skipped: %s", check.request.request_id, exc)
                return
        check, seq = self._shadow_seq
        try:
            if self.model.prefill_step(seq, self.shadow_chunk_tokens) is None:
                return
            outcome = self.shadow.judge(check, seq.first_token_logits)
        except Exception:
            log.exception("shadow check of %s failed", check.request.request_id)
            self._shadow_seq = None
            return
        self._shadow_seq = None
        if self._on_shadow is not None:
            self._on_shadow(outcome)

    def _step(self, stream: _Stream) -> None:
        seq = stream.seq
        if seq.prefilling:
            token = self.model.prefill_step(seq)
            if token is None:
                return
            self.ttft_samples.append(time.monotonic() - seq.admitted_at)
            finished = self._accept(stream, token)
            if seq.keep_logits and seq.num_cached_tokens > 0:
                self.shadow.offer(ShadowCheck(seq.request, seq.identity.fingerprint_hex, seq.num_cached_tokens,
                                              reused_logits=seq.first_token_logits))
            # After the first token is on its way: packaging never delays time to first token.
            new_blocks = self.model.store_prompt_blocks(seq)
            if new_blocks:
                self._on_new_blocks(new_blocks)
        else:
            finished = self._accept(stream, self.model.decode_step(seq))
        if finished:
            self._finish(stream, seq.finish_reason or "stop")

    def _accept(self, stream: _Stream, token: int) -> bool:
        seq = stream.seq
        text, finished = self.model.accept_token(seq, token)
        if finished:
            # The last text and token travel in StreamEnd, so the stream closes in one message.
            seq.final_text = text
            seq.final_token_ids = [token] if seq.generated and seq.generated[-1] == token else []
            return True
        self._emit(seq.request.stream_subject, TokenChunk(
            request_id=seq.request_id, seq=stream.number(), token_ids=[token], text=text))
        return False

    def _finish(self, stream: _Stream, reason: str) -> None:
        seq = stream.seq
        self._remove(stream)
        if reason != "cancelled":
            new_blocks = self.model.store_generated_blocks(seq)
            if new_blocks:
                self._on_new_blocks(new_blocks)
        seq.cache = None  # free the KV now, not when the Sequence object is collected
        ttft = (seq.first_token_at - seq.admitted_at) if seq.first_token_at else 0.0
        self._emit(seq.request.stream_subject, StreamEnd(
            request_id=seq.request_id, seq=stream.number(), finish_reason=reason,  # type: ignore[arg-type]
            text=seq.final_text, token_ids=seq.final_token_ids,
            usage=Usage(prompt_tokens=len(seq.prompt_ids), completion_tokens=len(seq.generated),
                        cached_tokens=seq.num_cached_tokens),
            ttft_s=ttft))

    def _fail(self, stream: _Stream, error: ErrorInfo) -> None:
        self._remove(stream)
        stream.seq.cache = None
        self._emit(stream.seq.request.stream_subject,
                   StreamError(request_id=stream.seq.request_id, seq=stream.number(), error=error))

    def _remove(self, stream: _Stream) -> None:
        with self._lock:
            if stream in self._running:
                self._running.remove(stream)
