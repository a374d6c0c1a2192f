"""The engine contract: what the worker service needs of an engine (as vLLM's kv_connector/v1/base.py is
the contract of its KV connectors).

Two engines implement it, each in a package of its own that imports nothing from the other:
`kite_worker.engines.vllm` (vLLM's v1 engine; its KV connector reads and writes the ru-pool inside vLLM's
processes) and `kite_worker.engines.reference` (the transformers engine the tests run: one thread
interleaves requests step by step; its pool reads and writes happen in the worker's process). KITE_ENGINE
names one and `kite_worker.engines.create_engine` builds it. The worker service (kite_worker.service)
drives it through `Engine` alone and never asks which engine runs: what differs between the two is a
method or a property below.

A request's life, as the service drives it:
    reserve(request)   validate it and take a queue place, at once: the gateway hears "accepted" or a
                       refusal (RequestRejected) immediately, before anything is computed;
    submit(reserved)   run it: the engine first loads what of its prefix the ru-pool holds, its own way;
    hooks.emit         its stream events: TokenChunk..., then one StreamEnd or StreamError, numbered
                       from 0 (`seq`), for the request's stream subject;
    cancel(id)         the client went away: the stream ends with finish_reason "cancelled".

Units: tokens are counts of token ids, times are seconds (time.monotonic for instants), sizes are bytes.

Boundary: no NATS here. An engine reaches the rest of the worker only through the EngineHooks it gets at
`start` (the service's callbacks, the ru-pool client, the write policy); it never imports the service.
What both engines need lives beside this module (kite_worker.engines.admission: the checks every request
passes) or in the worker package (shadow, write_policy, pool_loader, codec_tensors).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Mapping, Protocol

from kite_shared.adapters import Adapter
from kite_shared.config import ModelConfig, WorkerConfig
from kite_shared.messages import Message, TokenizedRequest
from kite_shared.model_store import LocalModel, ModelIdentity
from kite_shared.tiers.pool_client import PoolClient
from kite_worker.shadow import ShadowOutcome, ShadowVerifier
from kite_worker.write_policy import WritePolicyFilter

Round = Callable[[], Awaitable[None]]  # one round of a loop the runtime runs until shutdown


class RequestRejected(ValueError):
    """A request this worker cannot run as sent; `code` is the error code the asker gets (ErrorInfo.code):
    model_mismatch, fingerprint_mismatch, model_not_found, invalid_prompt, context_length_exceeded,
    overloaded, shutting_down."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class EngineHooks:
    """What the worker service hands an engine at `start`: where its outputs go, and the ru-pool."""

    # A stream event for a subject. Any thread; the events of one stream are emitted in order.
    emit: Callable[[str, Message], None]
    # A shadow check's outcome (kite_worker.shadow). Any thread.
    on_shadow: Callable[[ShadowOutcome], None]
    # The ru-pool: lookups, gets, puts and cache events, for the pool reads and writes this process makes.
    pool: PoolClient
    # The Upcycle write policy in force: which new blocks go to the pool (the arbitrator changes it).
    writes: WritePolicyFilter


@dataclass(frozen=True)
class EngineLoad:
    """An engine's figures for one telemetry message (kite_worker.control.WorkerLoad)."""

    running_tokens: int  # KV positions (prompt + generated tokens) of the requests generating now
    prefill_backlog_tokens: int  # prompt tokens admitted and still to compute
    cache_bytes: int  # KV held: the reference engine's block cache; on vLLM, the generating requests' KV
    cache_capacity_bytes: int  # the budget of that KV
    prompt_tokens_reused: int  # since start: prompt tokens whose KV was reused (local or pool)
    prompt_tokens_computed: int  # since start: prompt tokens computed
    prefill_seconds_per_token: float  # measured, a moving average; 0: not measured yet
    decode_seconds_per_token: float  # measured per generated token, a moving average; 0: not yet


class Engine(Protocol):
    """An engine as the worker service drives it. Calls come from the service's event loop; emit and
    on_shadow may come back from any thread."""

    # The sampler of shadow checks (kite_worker.shadow); None without shadow verification. The service
    # reads its counters for metrics.
    shadow: ShadowVerifier | None
    # Seconds from admission to first token, one per request, appended by the engine as first tokens come
    # out; the service takes them (popleft) for its metrics and telemetry.
    ttft_samples: deque[float]

    @classmethod
    def create(cls, local: LocalModel, identity: ModelIdentity, adapters: dict[str, Adapter],
               model_cfg: ModelConfig, worker_cfg: WorkerConfig, instance_id: str,
               shadow: ShadowVerifier | None) -> Engine:
        """The engine with its model loaded (vLLM: its processes started), before the worker joins NATS;
        `adapters` are the configured ones (KITE_ADAPTERS), `identity` the base's. Raises ConfigError for
        a setting it cannot serve with."""

    # --- lifecycle -----------------------------------------------------------------------------------------

    async def start(self, hooks: EngineHooks) -> None:
        """Start generating, its outputs going to `hooks`; the configured adapters' weights are loaded
        now (one the engine cannot load is dropped from `adapters`, logged). Before any other call but
        the read-only ones (adapters, num_queued, num_running, load)."""

    def rounds(self) -> tuple[tuple[Round, str], ...]:
        """Loops the engine needs run on the event loop until shutdown, each (round, name for the logs):
        a round waits for its own work (the reference engine's hand-over of new blocks and cache events
        to the ru-pool; none on vLLM, whose connector does that inside vLLM's processes)."""

    @property
    def alive(self) -> bool:
        """The engine can still generate (its thread runs, or vLLM has not errored)."""

    def idle(self) -> bool:
        """No request is reserved, waiting or running."""

    async def close(self, bus_connected: bool) -> None:
        """Stop for good, once idle: its threads and tasks end, what it queued for the ru-pool is handed
        over, its connections and processes are released. `bus_connected` False: nothing it could still
        send would reach anyone, so it ends at once where it can (vLLM's processes are killed)."""

    # --- requests ------------------------------------------------------------------------------------------

    def reserve(self, request: TokenizedRequest) -> Any:
        """Check `request` (kite_worker.engines.admission: model, block size, context, block hashes
        recomputed) and take a queue place; returns the engine's record of it, which the service only
        hands back to `submit`. Raises RequestRejected."""

    def submit(self, reserved: Any) -> None:
        """Run a reserved request. Returns at once: what of its prefix the ru-pool holds is loaded first
        (the reference engine's PoolLoader on this event loop; on vLLM a lookup here, then its KV
        connector), on a task or thread of the engine's, under the caller's trace context."""

    def cancel(self, request_id: str) -> None:
        """End a request early (its client went away): its stream ends "cancelled". Unknown ids: nothing."""

    def cancel_all(self) -> None:
        """cancel() every request: the bus is gone and nobody could receive their streams."""

    # --- load ------------------------------------------------------------------------------------------------

    @property
    def num_queued(self) -> int:
        """Requests admitted and not generating yet; cheap (polled every 100 ms)."""

    @property
    def num_running(self) -> int:
        """Requests generating now; cheap."""

    @property
    def max_running(self) -> int:
        """Requests that can generate at once (KITE_WORKER_MAX_RUNNING; vLLM: KITE_VLLM_MAX_NUM_SEQS)."""

    def load(self) -> EngineLoad:
        """The figures of one telemetry message."""

    # --- the ru-pool -----------------------------------------------------------------------------------------

    @property
    def pool_read(self) -> bool:
        """Whether missing prefix blocks are loaded from the ru-pool (KITE_WORKER_POOL_READ with reuse on).
        New blocks go to the pool as `hooks.writes` says (KITE_WORKER_POOL_WRITE): the reference engine
        filters them and puts them from this process; vLLM's connector saves the leading ones the policy
        lets through."""

    # --- adapters (docs/adapters.md) ---------------------------------------------------------------------------

    @property
    def adapters(self) -> Mapping[str, Adapter]:
        """The LoRA adapters served now, by name: the one record of them (only load_adapter and
        unload_adapter change it). A request naming another adapter is refused ("model_not_found")."""

    async def load_adapter(self, adapter: Adapter) -> None:
        """Serve `adapter` from now on (its weights loaded between two engine steps); raises
        AdapterRefused when this engine cannot (its layers, its rank, a request of an earlier adapter of
        that name still running)."""

    async def unload_adapter(self, name: str) -> None:
        """Refuse new requests of adapter `name` from now on; its requests still running finish with its
        weights, which go once they end."""

    # --- shadow verification and quarantine (docs/verification.md) -----------------------------------------------

    @property
    def num_shadow_checks_waiting(self) -> int:
        """Shadow checks queued or being recomputed (0 without shadow verification). A sampled request
        that reused KV is recomputed from scratch while the engine is idle and the outcome goes to
        `hooks.on_shadow`."""

    def quarantine(self, model_fingerprint: str, quarantined: bool) -> None:
        """The arbitrator (un)quarantined a namespace (its model fingerprint, hex); idempotent (decisions
        repeat). Quarantined: its requests reuse nothing, and the KV this worker holds that may be
        another's (the reference engine: the namespace's local blocks; vLLM: its whole prefix cache) and
        the pool blocks staged for loading are dropped."""
