"""The fingerprinter's handler and telemetry: each request is counted once, refusals by the core (unknown
model) and by workers both count as refused, and tokenize/dispatch times are reported. The router's
network side is replaced by a function (its real behaviour: tests/integration/test_fingerprinter_router.py)."""

from __future__ import annotations

import asyncio
import dataclasses
from types import SimpleNamespace

import pytest

from kite_fingerprinter.__main__ import build_core
from kite_fingerprinter.core import RequestError
from kite_fingerprinter.service import FingerprinterService
from kite_shared import model_store
from kite_shared.adapters import load_adapter
from kite_shared.config import FingerprinterConfig, ModelConfig, load
from kite_shared.endpoints import Refusal
from kite_shared.messages import Admission, ChatMessage, ErrorInfo, GenerateRequest, SamplingParams
from tests.unit.test_adapters import make_folder

WINDOW_S = 30.0


@pytest.fixture(scope="module")
def core():
    return build_core(load(ModelConfig), load(FingerprinterConfig))


def request(model: str, text: str) -> GenerateRequest:
    return GenerateRequest(request_id=f"r-{text}", model=model, sampling=SamplingParams(max_tokens=4),
                           messages=[ChatMessage(role="user", content=text)], stream_subject="s")


def test_telemetry_counts_each_request_once_and_both_kinds_of_refusal(core):
    cfg = load(FingerprinterConfig, telemetry_window_s=WINDOW_S)
    service = FingerprinterService(SimpleNamespace(nc=None, instance_id="fp-1"), core, cfg)
    dispatched = []

    async def dispatch(tokenized, session_id, headers=None) -> Admission:
        dispatched.append(tokenized.request_id)
        if tokenized.request_id == "r-busy":
            return Admission(accepted=False, error=ErrorInfo(code="no_worker", message="none"))
        return Admission(accepted=True, worker_id="w1")

    service.router.dispatch = dispatch

    async def scenario() -> None:
        assert (await service.admit(request(core.model_name, "hello"))).accepted
        assert not (await service.admit(request(core.model_name, "busy"))).accepted
        with pytest.raises(Refusal) as refused:
            await service.admit(request("no-such-model", "x"))
        assert refused.value.error.code == "model_not_found"

    asyncio.run(scenario())
    assert dispatched == ["r-hello", "r-busy"]
    t = service.telemetry()
    assert t.instance_id == "fp-1"
    assert t.request_rate == round(3 / WINDOW_S, 3)
    assert t.refused_rate == round(2 / 3, 4)
    assert 0 < t.tokenize_p50_s <= t.tokenize_p99_s < 1.0
    assert 0 < t.dispatch_p50_s <= t.dispatch_p99_s < 1.0
    assert t.routing_mode == cfg.router_mode and t.num_live_workers == 0


def test_an_adapter_is_served_by_its_name_and_under_its_base_with_its_own_fingerprint(core, tmp_path):
    local = model_store.prepare(load(ModelConfig))
    adapter = load_adapter("alpha", make_folder(tmp_path / "alpha", local=local, block_size=core.block_size), core.identity, local,
                           core.block_size)
    with_adapter = dataclasses.replace(core, adapters={"alpha": adapter})
    base = with_adapter.tokenize(request(core.model_name, "hello"))
    by_name = with_adapter.tokenize(request("alpha", "hello"))
    by_base = with_adapter.tokenize(request(f"{core.model_name}:alpha", "hello"))
    assert (base.adapter, by_name.adapter, by_base.adapter) == ("", "alpha", "alpha")
    assert by_name.model_fingerprint == by_base.model_fingerprint == adapter.identity.fingerprint_hex
    assert base.model_fingerprint == core.identity.fingerprint_hex != adapter.identity.fingerprint_hex
    assert by_name.prompt_token_ids == base.prompt_token_ids
    assert not set(by_name.block_hashes) & set(base.block_hashes)
    with pytest.raises(RequestError) as refused:
        with_adapter.tokenize(request(f"{core.model_name}:gamma", "hello"))
    assert refused.value.info.code == "model_not_found"
