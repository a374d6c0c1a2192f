"""Turn a GenerateRequest into a TokenizedRequest: exact token ids, resolved max_tokens, block hashes.

The chat template is applied here and only here, so the worker computes exactly the ids the fingerprint
describes. Pure logic over a tokenizer object: no NATS.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from kite_shared.adapters import Adapter, split_model_name
from kite_shared.fingerprint import block_hash_chain
from kite_shared.messages import ErrorInfo, GenerateRequest, TokenizedRequest
from kite_shared.model_store import ModelIdentity


class RequestError(ValueError):
    def __init__(self, info: ErrorInfo) -> None:
        super().__init__(info.message)
        self.info = info


@dataclass
class Fingerprinter:
    tokenizer: object
    identity: ModelIdentity
    model_name: str
    block_size: int
    max_context_tokens: int
    default_max_tokens: int
    adapters: dict[str, Adapter] = field(default_factory=dict)  # LoRA adapters by name (KITE_ADAPTERS)
    last_cf_seconds: float = 0.0  # hash-chain time of the last request (tokenization excluded)

    def tokenize(self, request: GenerateRequest) -> TokenizedRequest:
        adapter = split_model_name(request.model, self.model_name)
        if adapter and adapter not in self.adapters:
            raise RequestError(ErrorInfo(code="model_not_found", param="model",
                                         message=f"The model '{request.model}' does not exist"))
        identity = self.adapters[adapter].identity if adapter else self.identity
        prompt = self._prompt_ids(request)
        if not prompt:
            raise RequestError(ErrorInfo(code="invalid_prompt", param="prompt", message="The prompt is empty"))
        room = self.max_context_tokens - len(prompt)
        max_tokens = request.sampling.max_tokens
        if room <= 0 or (max_tokens is not None and max_tokens > room):
            asked = len(prompt) + (max_tokens or 0)
            raise RequestError(ErrorInfo(
                code="context_length_exceeded", param="messages" if request.messages else "prompt",
                message=(f"This model's maximum context length is {self.max_context_tokens} tokens. "
                         f"However, you requested {asked} tokens ({len(prompt)} in the prompt, "
                         f"{max_tokens or 0} for the completion). Please reduce the prompt or "
                         "completion length.")))
        if max_tokens is None:
            max_tokens = min(self.default_max_tokens, room)
        resumed = list(request.resume_token_ids)
        if resumed:  # request migration: continue the answer an earlier worker began
            self._check_vocab(resumed, "resume_token_ids")
            if len(resumed) >= max_tokens:
                raise RequestError(ErrorInfo(code="invalid_prompt", param="resume_token_ids",
                                             message="resume_token_ids already reach max_tokens"))
            prompt = prompt + resumed
            max_tokens -= len(resumed)
        started = time.perf_counter()
        hashes = block_hash_chain(prompt, self.block_size, identity.root, request.cache_salt)
        self.last_cf_seconds = time.perf_counter() - started
        return TokenizedRequest(
            request_id=request.request_id, model=request.model, prompt_token_ids=prompt,
            sampling=request.sampling.model_copy(update={"max_tokens": max_tokens}),
            reuse=request.reuse, cache_salt=request.cache_salt, tenant=request.tenant,
            model_fingerprint=identity.fingerprint_hex, adapter=adapter, block_size=self.block_size,
            block_hashes=[bytes(h) for h in hashes], stream_subject=request.stream_subject,
            stream_batch_subject=request.stream_batch_subject,
            created_at=request.created_at, num_resumed_tokens=len(resumed),
            session_id=request.session_id)

    def _prompt_ids(self, request: GenerateRequest) -> list[int]:
        if request.messages is not None:
            try:
                ids = self.tokenizer.apply_chat_template(
                    [m.model_dump() for m in request.messages], add_generation_prompt=True,
                    tokenize=True, return_dict=False)
            except Exception as exc:  # jinja raises TemplateError subclasses and ValueError
                raise RequestError(ErrorInfo(code="invalid_messages", param="messages",
                                             message=f"The chat template rejected the messages: {exc}"))
            return list(ids)
        if request.prompt is not None:
            return list(self.tokenizer(request.prompt)["input_ids"])
        if request.prompt_token_ids is not None:
            self._check_vocab(request.prompt_token_ids, "prompt")
            return list(request.prompt_token_ids)
        raise RequestError(ErrorInfo(code="invalid_prompt", param="prompt", message="No prompt given"))

    def _check_vocab(self, ids: list[int], param: str) -> None:
        vocab = len(self.tokenizer)
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise RequestError(ErrorInfo(code="invalid_prompt", param=param,
                                         message=f"Token id {bad[0]} is outside the vocabulary (0..{vocab - 1})"))
