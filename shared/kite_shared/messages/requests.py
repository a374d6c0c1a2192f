"""The request path: gateway -> fingerprinter -> worker, and the stream of tokens back to the gateway.

    gateway       -> fingerprinter   GenerateRequest    -> Admission
    fingerprinter -> a worker        TokenizedRequest   -> Admission
    gateway       -> every worker    Cancel
    worker        -> the gateway     STREAM_EVENT (TokenChunk..., StreamEnd | StreamError), or StreamBatch
                                     of several requests' events when the gateway named a batch subject

Which subject carries each: kite_shared.subjects.TABLE.
"""

from __future__ import annotations

import time
from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kite_shared.messages.base import Message, OneOf
from kite_shared.security import ANONYMOUS_TENANT

# --- request path ----------------------------------------------------------------------------------


class ChatMessage(BaseModel):
    model_config = ConfigDict(frozen=True)
    role: str
    content: str


class SamplingParams(BaseModel):
    model_config = ConfigDict(frozen=True)
    max_tokens: int | None = None  # tokens to generate at most; None = gateway default / context left
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # nucleus mass in (0, 1]
    seed: int | None = None  # makes sampling reproducible; ignored when greedy
    stop: list[str] = Field(default_factory=list)  # generation ends before any of these strings
    ignore_eos: bool = False  # keep generating past the model's end-of-sequence token


class ErrorInfo(BaseModel):
    """An error a service reports instead of doing the work; the gateway maps `code` to an HTTP status."""

    model_config = ConfigDict(frozen=True)
    code: str  # machine-readable, e.g. "context_length_exceeded", "no_worker", "overloaded"
    message: str  # human-readable, safe to show to the client (never holds secrets)
    param: str | None = None  # the request field at fault, if any


class GenerateRequest(Message):
    """gateway -> fingerprinter: one completion to produce (one choice; `n` is fanned out by the gateway)."""

    KIND: ClassVar[str] = "generate_request"
    request_id: str  # unique per choice; also the last token of the stream subject
    model: str  # model id as the client sent it
    messages: list[ChatMessage] | None = None  # chat request: the template is applied by the fingerprinter
    prompt: str | None = None  # completion request given as text
    prompt_token_ids: list[int] | None = None  # completion request given as token ids
    sampling: SamplingParams
    reuse: bool = True  # per-request Upcycle switch (deployment switch is KITE_REUSE)
    cache_salt: str = ""  # tenant isolation salt, mixed into the first block hash
    # The authenticated tenant (decided by the gateway, never by the client): names the owner of the
    # blocks this request stores, for the pool's per-tenant accounting, quotas and clears.
    tenant: str = Field(default=ANONYMOUS_TENANT, min_length=1, max_length=128)
    stream_subject: str  # where the worker sends TokenChunk / StreamEnd / StreamError
    # Where a worker may send this request's events in StreamBatch messages instead, every one of them
    # (so they stay in order); "" (an older gateway): one message per event on stream_subject.
    stream_batch_subject: str = ""
    created_at: float = Field(default_factory=time.time)  # unix seconds, when the gateway received it
    # Request migration: tokens already generated (and sent to the client) by a worker that died. The
    # fingerprinter appends them to the templated prompt and lowers max_tokens by their count, so the new
    # worker continues the same answer (and its block hashes, hence reuse, cover them).
    resume_token_ids: list[int] = Field(default_factory=list)
    # Routing (issue 5): requests of one session (the client's `kite.session_id`) stick to one worker.
    session_id: str = Field(default="", max_length=256)


class TokenizedRequest(Message):
    """fingerprinter -> worker: a request with its exact token ids and computation fingerprint."""

    KIND: ClassVar[str] = "tokenized_request"
    request_id: str
    model: str
    prompt_token_ids: list[int]  # exactly what the worker computes (chat template already applied)
    sampling: SamplingParams  # max_tokens is always resolved here
    reuse: bool
    cache_salt: str = ""  # mixed into block 0's hash; the worker recomputes the chain to verify it
    tenant: str = Field(default=ANONYMOUS_TENANT, min_length=1, max_length=128)  # GenerateRequest.tenant
    model_fingerprint: str  # hex digest of the model-state + execution-path fingerprint
    adapter: str = ""  # the LoRA adapter the request runs with (its KITE_ADAPTERS name); "" for the base
    block_size: int  # tokens per block the hashes cover
    block_hashes: list[bytes]  # hash chain over the full prompt blocks, 32 bytes each
    stream_subject: str
    stream_batch_subject: str = ""  # GenerateRequest.stream_batch_subject
    created_at: float  # unix seconds, when the gateway received the request
    # The last `num_resumed_tokens` of prompt_token_ids were generated by an earlier worker (migration):
    # the worker primes its detokenizer and stop-string matcher with them, so text continues seamlessly.
    num_resumed_tokens: int = Field(default=0, ge=0)
    session_id: str = ""  # the client's session id (routing affinity), informative for the worker
    # Leading blocks of block_hashes the ru-pool held when the router looked them up (-1: it did not look):
    # the worker then need not ask again before deciding what to load.
    pool_blocks: int = Field(default=-1, ge=-1)


class Admission(Message):
    """Reply to GenerateRequest and TokenizedRequest: accepted (streaming will follow) or refused."""

    KIND: ClassVar[str] = "admission"
    accepted: bool
    worker_id: str = ""  # instance that will stream the answer
    prompt_tokens: int = 0  # prompt length in tokens
    error: ErrorInfo | None = None  # set when not accepted


class Cancel(Message):
    """gateway -> workers: the client went away; stop generating and free the slot."""

    KIND: ClassVar[str] = "cancel"
    request_id: str


# --- stream events (worker -> gateway, on the per-request stream subject) ------------------------------


class Usage(BaseModel):
    model_config = ConfigDict(frozen=True)
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # prompt tokens whose KV was reused instead of computed


class TokenChunk(Message):
    KIND: ClassVar[str] = "token_chunk"
    request_id: str
    seq: int  # 0, 1, 2, ... per request, so the gateway can spot loss or duplication
    token_ids: list[int]  # tokens this chunk adds
    text: str  # text these tokens add (may be "" while a multi-byte character or stop string is pending)


class StreamEnd(Message):
    KIND: ClassVar[str] = "stream_end"
    request_id: str
    seq: int
    finish_reason: Literal["stop", "length", "cancelled"]
    text: str = ""  # text released at the end (held back while it could have begun a stop string)
    token_ids: list[int] = Field(default_factory=list)  # the last generated token, unless it was EOS
    usage: Usage
    ttft_s: float = 0.0  # seconds from worker admission to first token


class StreamError(Message):
    KIND: ClassVar[str] = "stream_error"
    request_id: str
    seq: int
    error: ErrorInfo


StreamEvent = TokenChunk | StreamEnd | StreamError
STREAM_EVENT: OneOf[StreamEvent] = OneOf("stream event", TokenChunk, StreamEnd, StreamError)


class StreamBatch(Message):
    """worker -> a gateway: the stream events for that gateway's requests that were ready at the same moment
    (one engine step's tokens of every running request), in the order they were made. One message instead
    of one per event: each costs the worker, nats-server and the gateway about the same CPU whatever it
    carries (issue 38)."""

    KIND: ClassVar[str] = "stream_batch"
    request_ids: list[str]  # the request of each event
    events: list[bytes]  # each a STREAM_EVENT's encoding, as stream_subject would have carried it

    @model_validator(mode="after")
    def _one_request_per_event(self) -> "StreamBatch":
        if len(self.request_ids) != len(self.events):
            raise ValueError(f"{len(self.request_ids)} request ids for {len(self.events)} events")
        return self
