"""The checks every request passes before either engine admits it: which model identity it runs under (the
base's, or its adapter's) and that its block hashes are the ones this worker computes.

Boundary: pure, over kite_shared's fingerprints; both engines call it from `reserve`
(kite_worker.engines.base).
"""

from __future__ import annotations

from typing import Mapping

from kite_shared.adapters import Adapter
from kite_shared.fingerprint import BlockHash, block_hash_chain
from kite_shared.messages import TokenizedRequest
from kite_shared.model_store import ModelIdentity
from kite_worker.engines.base import RequestRejected


def identity_of(request: TokenizedRequest, base: ModelIdentity, adapters: Mapping[str, Adapter]) -> ModelIdentity:
    """The identity a request runs under: its adapter's, or the base's; raises RequestRejected when this
    worker does not serve its adapter (it was unloaded, or never loaded here)."""
    if not request.adapter:
        return base
    if request.adapter not in adapters:
        raise RequestRejected("model_not_found", f"this worker does not serve the adapter {request.adapter!r}")
    return adapters[request.adapter].identity


def validate_request(request: TokenizedRequest, identity: ModelIdentity, block_size: int,
                     max_context_tokens: int) -> list[BlockHash]:
    """The request's block hashes, recomputed here; raises RequestRejected when the request cannot run.

    A worker never trusts the fingerprinter's hashes blindly: a wrong hash would poison the cache for
    everyone, and recomputing the chain costs well under a millisecond."""
    if request.model_fingerprint != identity.fingerprint_hex:
        raise RequestRejected(
            "model_mismatch", "the fingerprinter and this worker disagree on the model fingerprint")
    if request.block_size != block_size:
        raise RequestRejected("model_mismatch", "block size differs between fingerprinter and worker")
    prompt = request.prompt_token_ids
    if not prompt:
        raise RequestRejected("invalid_prompt", "the prompt has no tokens")
    if len(prompt) + (request.sampling.max_tokens or 0) > max_context_tokens:
        raise RequestRejected("context_length_exceeded", "prompt plus max_tokens exceed the context")
    hashes = block_hash_chain(prompt, block_size, identity.root, request.cache_salt)
    if [bytes(h) for h in hashes] != list(request.block_hashes):
        raise RequestRejected("fingerprint_mismatch", "block hashes do not match the prompt tokens")
    return hashes
