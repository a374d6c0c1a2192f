"""`kite pool pin|unpin|evict --prompt / --messages`: the hashes the CLI selects are the ones the
fingerprinter core gives the same request as the gateway would send it (same chat template, tokenizer,
model fingerprint, block size and tenant cache salt). Uses the real tokenizer (no model run)."""

from __future__ import annotations

import json

import pytest

from kite_cli import pool_admin
from kite_fingerprinter.__main__ import build_core
from kite_gateway.openai_protocol import ChatCompletionRequest, CompletionRequest
from kite_shared.config import FingerprinterConfig, ModelConfig, load
from kite_shared.fingerprint import block_hash_chain
from kite_shared.messages import GenerateRequest, SamplingParams
from kite_shared.security import tenant_cache_salt

MESSAGES = [{"role": "developer", "content": "You are a terse assistant. " * 20},
            {"role": "user", "content": [{"type": "text", "text": "What is the capital of France?"}]}]
PROMPT = "Once upon a time, in a land far away, " * 30


@pytest.fixture(scope="module")
def core():
    return build_core(load(ModelConfig), load(FingerprinterConfig))


def gateway_request(core, body: dict, tenant: str) -> GenerateRequest:
    """What the gateway's HTTP API sends the fingerprinter for `body` from `tenant` (http_api.py)."""
    if "messages" in body:
        chat = ChatCompletionRequest.model_validate(body)
        return GenerateRequest(request_id="r", model=chat.model,
                               messages=[m.to_message() for m in chat.messages],
                               sampling=chat.sampling(chat.resolved_max_tokens),
                               cache_salt=tenant_cache_salt(tenant, chat.cache_salt), tenant=tenant,
                               stream_subject="s")
    completion = CompletionRequest.model_validate(body)
    return GenerateRequest(request_id="r", model=completion.model, prompt=completion.prompts()[0],
                           sampling=completion.sampling(completion.max_tokens),
                           cache_salt=tenant_cache_salt(tenant, completion.cache_salt), tenant=tenant,
                           stream_subject="s")


def test_messages_select_the_hashes_a_chat_request_gets(core, tmp_path):
    body = {"model": core.model_name, "messages": MESSAGES, "cache_salt": "mine", "max_tokens": 8}
    expected = core.tokenize(gateway_request(core, body, "acme"))
    assert len(expected.block_hashes) >= 2
    path = tmp_path / "messages.json"
    path.write_text(json.dumps(MESSAGES))
    for op in ("pin", "unpin", "evict"):
        args = pool_admin._parser().parse_args(
            [op, "--messages", str(path), "--tenant", "acme", "--cache-salt", "mine"])
        req = pool_admin.build_request(args, core=lambda: core)
        assert req.op == op and req.tenant == "acme"
        assert req.model_fingerprint == expected.model_fingerprint == core.identity.fingerprint_hex
        assert req.block_hashes == expected.block_hashes
    # A whole request body works too (its "messages" are used).
    path.write_text(json.dumps(body))
    args = pool_admin._parser().parse_args(["evict", "--messages", str(path), "--tenant", "acme",
                                            "--cache-salt", "mine"])
    assert pool_admin.build_request(args, core=lambda: core).block_hashes == expected.block_hashes


def test_prompt_selects_the_hashes_a_completion_request_gets(core):
    body = {"model": core.model_name, "prompt": PROMPT, "max_tokens": 8}
    expected = core.tokenize(gateway_request(core, body, "anonymous"))
    fingerprint, hashes = pool_admin.prompt_block_hashes(core, prompt=PROMPT)  # default tenant: anonymous
    assert (fingerprint, hashes) == (expected.model_fingerprint, expected.block_hashes)
    # Independently of Fingerprinter.tokenize: the tokenizer's ids chained from the model root.
    ids = core.tokenizer(PROMPT)["input_ids"]
    assert hashes == block_hash_chain(ids, core.block_size, core.identity.root,
                                      tenant_cache_salt("anonymous", ""))
    assert len(hashes) == len(ids) // core.block_size > 0


def test_tenant_and_salt_select_different_blocks(core):
    base = pool_admin.prompt_block_hashes(core, prompt=PROMPT, tenant="acme")[1]
    assert pool_admin.prompt_block_hashes(core, prompt=PROMPT, tenant="globex")[1][0] != base[0]
    assert pool_admin.prompt_block_hashes(core, prompt=PROMPT, tenant="acme", cache_salt="x")[1][0] != base[0]
    assert pool_admin.prompt_block_hashes(core, prompt=PROMPT, tenant="acme")[1] == base


def test_raw_hashes_still_work_and_bad_selections_are_refused(core, tmp_path):
    h = "ab" * 32
    req = pool_admin.build_request(pool_admin._parser().parse_args(["evict", "--model", "cd" * 32, h]))
    assert (req.op, req.model_fingerprint, req.block_hashes, req.tenant) == ("evict", "cd" * 32,
                                                                             [bytes.fromhex(h)], "")
    refused = [
        ["evict", h],  # hashes need --model
        ["pin", "--model", "cd" * 32],  # nothing selected
        ["pin", "--model", "cd" * 32, "--cache-salt", "s", h],  # a salt only applies to prompts
        ["evict", "--prompt", PROMPT, h],  # both selectors
        ["evict", "--prompt", PROMPT, "--model", "cd" * 32],  # another model than configured
        ["evict", "--prompt", "hi"],  # shorter than one block
    ]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{"role": "wizard", "content": "x"}]))
    refused.append(["pin", "--messages", str(bad)])
    for argv in refused:
        with pytest.raises(ValueError):
            pool_admin.build_request(pool_admin._parser().parse_args(argv), core=lambda: core)
    with pytest.raises(SystemExit):  # argparse: --prompt and --messages exclude each other
        pool_admin._parser().parse_args(["pin", "--prompt", "a", "--messages", str(bad)])
