"""OpenAI-compatible request bodies (validated) and response bodies (built from KITE stream events).

Unknown request fields are ignored, as vLLM does, so clients written for newer API versions keep working;
known fields are validated strictly. Parameters KITE cannot honour (logprobs, penalties, tools) are refused
with a clear 400 instead of being silently ignored.

Extension fields (send them with the openai client's `extra_body`):
    kite: {"reuse": false}   compute this request without Upcycle reuse (for comparisons)
    kite: {"ignore_eos": true}  keep generating past end-of-sequence, up to max_tokens
    kite: {"session_id": "..."} route the requests of one conversation to the same worker (its KV is there)
    kite: {"semantic_cache": true}  may be answered from the semantic response cache (tenants enabled by
                             KITE_SEMANTIC_CACHE_TENANTS; temperature 0, one choice): see http_api
    cache_salt: str          narrows KV sharing to requests carrying the same salt
"""

from __future__ import annotations

import time
from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator

from kite_shared.messages import ChatMessage, SamplingParams, StreamEnd

MAX_STOP_STRINGS = 4
# Parameters KITE refuses (see `unsupported`) are declared in /openapi.json with the only values it
# accepts, so a client generated from the schema never sends what is then refused; validation itself
# stays in `unsupported`, whose messages say why.
_ONLY_ZERO = {"const": 0}
_ONLY_FALSE = {"const": False}


def _json_integer(value: object) -> object:
    """JSON's idea of an integer: 3 and 3.0 are (JSON Schema says so), true and "3" are not."""
    if isinstance(value, bool):
        raise ValueError("Input should be a valid integer, not a boolean")
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


# Bodies validate strictly (a JSON boolean is not a number, "3" is not 3: what /openapi.json says is what is
# accepted); an integer field takes JSON's integers, 3.0 included. (The bounds come before the validator:
# after it, pydantic would publish them as `ge` instead of `minimum`.)
JsonInt = Annotated[int, BeforeValidator(_json_integer)]
# A prompt token id: the services carry them as uint32 (the gRPC API's type); the vocabulary is checked later.
TokenId = Annotated[int, Field(ge=0, le=2**32 - 1), BeforeValidator(_json_integer)]
# Counts (n, max_tokens): a context window is far below 2**53 - 1, the largest integer JSON holds exactly.
AtLeastOne = Annotated[int, Field(ge=1, le=2**53 - 1), BeforeValidator(_json_integer)]
# The integers every JSON parser holds exactly (IEEE doubles): /openapi.json writes bounds as floats,
# which cannot say 2**63 - 1, so wider bounds would publish a range the API does not accept.
Seed = Annotated[int, Field(ge=-(2**53 - 1), le=2**53 - 1), BeforeValidator(_json_integer)]
PromptText = Annotated[str, Field(min_length=1)]
# Prompt arrays are never empty (nothing to complete): declared, so /openapi.json says so too.
TokenIds = Annotated[list[TokenId], Field(min_length=1)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Body):
    include_usage: bool = False


class KiteOptions(_Body):
    reuse: bool = True
    ignore_eos: bool = False  # generate exactly max_tokens tokens (benchmarks, tests)
    session_id: str = Field(default="", max_length=256)  # requests of one session go to one worker
    semantic_cache: bool = False  # may be answered from the semantic response cache (opt-in)


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessageIn(_Body):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def to_message(self) -> ChatMessage:
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        # SmolLM2's template (like most) knows "system", not OpenAI's newer "developer" alias.
        return ChatMessage(role="system" if self.role == "developer" else self.role, content=text)


class _SamplingBody(_Body):
    model: str = Field(min_length=1)
    max_tokens: AtLeastOne | None = None
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    n: AtLeastOne = 1
    seed: Seed | None = None
    stop: str | list[str] | None = Field(default=None, json_schema_extra={"maxItems": MAX_STOP_STRINGS})
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0, json_schema_extra=_ONLY_ZERO)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0, json_schema_extra=_ONLY_ZERO)
    user: str | None = None
    cache_salt: str = Field(default="", max_length=256)
    kite: KiteOptions = Field(default_factory=KiteOptions)

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list) and len(v) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop sequences are allowed")
        return v

    def unsupported(self) -> tuple[str, str] | None:
        """(param, message) of a parameter KITE cannot honour, if any."""
        if self.presence_penalty or self.frequency_penalty:
            param = "presence_penalty" if self.presence_penalty else "frequency_penalty"
            return param, f"{param} is not supported by KITE; send 0 or omit it"
        return None

    def sampling(self, max_tokens: int | None) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        seed = None if self.seed is None else self.seed % 2**63
        return SamplingParams(max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p,
                              seed=seed, stop=stop, ignore_eos=self.kite.ignore_eos)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(_SamplingBody):
    messages: list[ChatMessageIn] = Field(min_length=1)
    max_completion_tokens: AtLeastOne | None = None
    logprobs: bool = Field(default=False, json_schema_extra=_ONLY_FALSE)
    tools: list[dict] | None = Field(default=None, json_schema_extra={"maxItems": 0})

    def unsupported(self) -> tuple[str, str] | None:
        if self.logprobs:
            return "logprobs", "logprobs are not supported by KITE"
        if self.tools:
            return "tools", "tool calling is not supported by KITE"
        return super().unsupported()

    @property
    def resolved_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_SamplingBody):
    # An empty text is no prompt (the model would complete nothing): refused here, as vLLM does.
    prompt: (PromptText | TokenIds | Annotated[list[PromptText], Field(min_length=1)]
             | Annotated[list[TokenIds], Field(min_length=1)])
    echo: bool = Field(default=False, json_schema_extra=_ONLY_FALSE)
    logprobs: JsonInt | None = Field(default=None, json_schema_extra={"type": "null"})
    suffix: str | None = Field(default=None, json_schema_extra={"maxLength": 0})
    best_of: JsonInt | None = Field(default=None, json_schema_extra={"enum": [None, 1]})

    @field_validator("prompt", mode="before")
    @classmethod
    def _not_empty(cls, v: object) -> object:
        # Before the union is tried: otherwise the error would be that [] is not a string.
        if v in ("", []) or (isinstance(v, list) and ([] in v or "" in v)):
            raise ValueError("a prompt (and every prompt of a batch) needs at least one token or character")
        return v

    def unsupported(self) -> tuple[str, str] | None:
        if self.logprobs is not None:
            return "logprobs", "logprobs are not supported by KITE"
        if self.echo:
            return "echo", "echo is not supported by KITE"
        if self.suffix:
            return "suffix", "suffix is not supported by KITE"
        if self.best_of not in (None, 1):
            return "best_of", "best_of is not supported by KITE"
        return super().unsupported()

    def prompts(self) -> list[str | list[int]]:
        """The prompts to complete: one string, one token list, or a batch of either."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(x, int) for x in p):
            return [p]  # type: ignore[list-item]
        return list(p)  # type: ignore[arg-type]


class ErrorObject(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """Every error the API answers (documented in /openapi.json): OpenAI's error object."""

    error: ErrorObject


def usage_body(ends: list[StreamEnd]) -> dict:
    """OpenAI usage over all choices: the prompt is counted once per distinct prompt."""
    prompt = sum(e.usage.prompt_tokens for e in ends[:1]) if ends else 0
    completion = sum(e.usage.completion_tokens for e in ends)
    cached = max((e.usage.cached_tokens for e in ends), default=0)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def batch_usage_body(ends_per_prompt: list[list[StreamEnd]]) -> dict:
    parts = [usage_body(ends) for ends in ends_per_prompt]
    prompt = sum(p["prompt_tokens"] for p in parts)
    completion = sum(p["completion_tokens"] for p in parts)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(p["prompt_tokens_details"]["cached_tokens"]
                                                           for p in parts)}}


def now() -> int:
    return int(time.time())
