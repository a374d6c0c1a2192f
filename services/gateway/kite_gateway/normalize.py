"""Where an API request becomes what the services compute (GenerationParams), for the HTTP and the gRPC API
alike: one set of parameter rules (the pydantic bodies of `openai_protocol`), one derivation of the tenant's
cache salt (kite_shared.security.tenant_cache_salt), one place to change either.

    HTTP  JSON body -> ChatCompletionRequest / CompletionRequest (FastAPI + openai_protocol) -+
    gRPC  kite.v1.GenerateRequest -> grpc_body() -> the same pydantic bodies ----------------+-> chat_params /
                                                                                                completion_params

A gRPC request that breaks a rule is an `InvalidArgument` whose message starts with the field's name in
the proto (`messages[0].role: ...`), as the HTTP API names the JSON field in its 400.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from kite_shared.grpc_gen import kite_pb2
from kite_shared.security import tenant_cache_salt
from kite_gateway.generation import GenerationParams
from kite_gateway.openai_protocol import ChatCompletionRequest, CompletionRequest


class InvalidArgument(ValueError):
    """A request field KITE refuses before asking any service; the message names the field."""


def chat_params(body: ChatCompletionRequest, tenant: str) -> GenerationParams:
    """One choice of a chat completion (the caller fans out `n`)."""
    return GenerationParams(model=body.model, sampling=body.sampling(body.resolved_max_tokens),
                            messages=[m.to_message() for m in body.messages], reuse=body.kite.reuse,
                            cache_salt=tenant_cache_salt(tenant, body.cache_salt), tenant=tenant,
                            session_id=body.kite.session_id)


def completion_params(body: CompletionRequest, tenant: str) -> list[GenerationParams]:
    """One choice per prompt of a completion request (the caller fans out `n`)."""
    salt = tenant_cache_salt(tenant, body.cache_salt)
    out = []
    for prompt in body.prompts():
        text, ids = (prompt, None) if isinstance(prompt, str) else (None, list(prompt))
        out.append(GenerationParams(model=body.model, sampling=body.sampling(body.max_tokens), prompt=text,
                                    prompt_token_ids=ids, reuse=body.kite.reuse, cache_salt=salt,
                                    tenant=tenant, session_id=body.kite.session_id))
    return out


def grpc_params(request: kite_pb2.GenerateRequest, tenant: str) -> GenerationParams:
    """The services' view of a gRPC GenerateRequest (InvalidArgument when a field breaks a rule)."""
    body = grpc_body(request)
    params = chat_params(body, tenant) if isinstance(body, ChatCompletionRequest) else \
        completion_params(body, tenant)[0]
    if request.HasField("seed"):
        # An exact int64 here (the HTTP body bounds seeds to what a JSON double holds); workers seed a
        # non-negative generator, so negatives fold as they do over HTTP.
        params.sampling = params.sampling.model_copy(update={"seed": request.seed % 2**63})
    return params


def grpc_body(request: kite_pb2.GenerateRequest) -> ChatCompletionRequest | CompletionRequest:
    """The HTTP body a gRPC request means, validated by the same rules."""
    which = request.WhichOneof("input")
    if which is None:
        if not request.model:
            raise InvalidArgument("model: required")
        raise InvalidArgument("one of messages, prompt or prompt_token_ids is required")
    fields: dict[str, Any] = {"model": request.model, "stop": list(request.stop),
                              "cache_salt": request.cache_salt, "kite": {"reuse": not request.disable_reuse}}
    for name in ("max_tokens", "temperature", "top_p"):
        if request.HasField(name):
            fields[name] = getattr(request, name)
    if which == "messages":
        fields["messages"] = [{"role": m.role, "content": m.content} for m in request.messages.messages]
        return _validated(ChatCompletionRequest, fields, {})
    if which == "prompt":
        fields["prompt"] = request.prompt
        return _validated(CompletionRequest, fields, {})
    fields["prompt"] = list(request.prompt_token_ids.ids)
    return _validated(CompletionRequest, fields, {"prompt": "prompt_token_ids"})


def _validated(model: type, fields: dict[str, Any], proto_names: dict[str, str]):
    try:
        return model.model_validate(fields)
    except ValidationError as exc:
        error = exc.errors()[0]
        raise InvalidArgument(f"{_field_path(error['loc'], proto_names)}: {error['msg']}") from None


def _field_path(loc: tuple, proto_names: dict[str, str]) -> str:
    """("messages", 0, "role") -> "messages[0].role"."""
    path = proto_names.get(loc[0], str(loc[0]))
    for previous, part in zip(loc, loc[1:]):
        if isinstance(part, int):
            path += f"[{part}]"
        elif isinstance(previous, int):
            path += f".{part}"
        else:
            break  # the name of a union's branch ("str", "list[int]"): nothing the caller sent
    return path
