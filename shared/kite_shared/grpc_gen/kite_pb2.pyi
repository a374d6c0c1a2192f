from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Message(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class ChatMessages(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[Message]
    def __init__(self, messages: _Optional[_Iterable[_Union[Message, _Mapping]]] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("model", "messages", "prompt", "prompt_token_ids", "max_tokens", "temperature", "top_p", "seed", "stop", "disable_reuse", "cache_salt", "semantic_cache")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    DISABLE_REUSE_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    SEMANTIC_CACHE_FIELD_NUMBER: _ClassVar[int]
    model: str
    messages: ChatMessages
    prompt: str
    prompt_token_ids: TokenIds
    max_tokens: int
    temperature: float
    top_p: float
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    disable_reuse: bool
    cache_salt: str
    semantic_cache: bool
    def __init__(self, model: _Optional[str] = ..., messages: _Optional[_Union[ChatMessages, _Mapping]] = ..., prompt: _Optional[str] = ..., prompt_token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., disable_reuse: _Optional[bool] = ..., cache_salt: _Optional[str] = ..., semantic_cache: _Optional[bool] = ...) -> None: ...

class Chunk(_message.Message):
    __slots__ = ("text", "token_ids")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class End(_message.Message):
    __slots__ = ("finish_reason", "usage", "semantic_cache")
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    SEMANTIC_CACHE_FIELD_NUMBER: _ClassVar[int]
    finish_reason: str
    usage: Usage
    semantic_cache: SemanticCacheReport
    def __init__(self, finish_reason: _Optional[str] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., semantic_cache: _Optional[_Union[SemanticCacheReport, _Mapping]] = ...) -> None: ...

class SemanticCacheReport(_message.Message):
    __slots__ = ("outcome", "reason", "similarity", "threshold")
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    SIMILARITY_FIELD_NUMBER: _ClassVar[int]
    THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    outcome: str
    reason: str
    similarity: float
    threshold: float
    def __init__(self, outcome: _Optional[str] = ..., reason: _Optional[str] = ..., similarity: _Optional[float] = ..., threshold: _Optional[float] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("chunk", "end")
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    chunk: Chunk
    end: End
    def __init__(self, chunk: _Optional[_Union[Chunk, _Mapping]] = ..., end: _Optional[_Union[End, _Mapping]] = ...) -> None: ...

class HealthRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HealthResponse(_message.Message):
    __slots__ = ("status", "live_workers", "detail")
    class Status(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        UNKNOWN: _ClassVar[HealthResponse.Status]
        SERVING: _ClassVar[HealthResponse.Status]
        NOT_SERVING: _ClassVar[HealthResponse.Status]
    UNKNOWN: HealthResponse.Status
    SERVING: HealthResponse.Status
    NOT_SERVING: HealthResponse.Status
    STATUS_FIELD_NUMBER: _ClassVar[int]
    LIVE_WORKERS_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    status: HealthResponse.Status
    live_workers: int
    detail: str
    def __init__(self, status: _Optional[_Union[HealthResponse.Status, str]] = ..., live_workers: _Optional[int] = ..., detail: _Optional[str] = ...) -> None: ...
