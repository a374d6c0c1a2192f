"""The table of subjects (kite_shared.subjects.TABLE): it names every subject the module defines, each
subject (and each instance of a per-instance pattern) finds exactly its own row, each message type of the
table decodes what it encodes, the error replies carry their error, and the docs agree with it. What an
endpoint built from the table answers over a real bus: tests/integration/test_service_framework.py."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kite_shared import subjects
from kite_shared.messages import (
    AdapterAdminReply, AdapterAdminRequest, Admission, ArbitratorAdminReply, ArbitratorAdminRequest,
    ArbitratorTelemetry, BlockRemoved, BlockStored, Cancel, ChatMessage, Decision, ErrorInfo, FingerprinterTelemetry,
    GatewayTelemetry, GenerateRequest, Heartbeat, IndexChange, Message, ModelFingerprintChanged, OneOf, Ping,
    PoolAdminReply, PoolAdminRequest, PoolGetReply, PoolGetRequest, PoolIndexChanges, PoolLookupReply,
    PoolLookupRequest, PoolTelemetry, Pong, RoutingWeights, SamplingParams, ShadowCheckResult, StreamBatch, StreamEnd,
    StreamError, TierHits, TierStats, TokenChunk, TokenizedRequest, UnitsWritten, Usage, WorkerCache,
    WorkerCachesReply, WorkerCachesRequest, WorkerTelemetry,
)

ROOT = Path(__file__).resolve().parents[2]
HASH = bytes(range(32))
FINGERPRINT = "ab" * 32

# One message of every type the table names, its fields filled beyond their defaults where they have any.
SAMPLES: dict[type[Message], Message] = {m.__class__: m for m in (
    GenerateRequest(request_id="r1", model="m", messages=[ChatMessage(role="user", content="hi")],
                    sampling=SamplingParams(max_tokens=4, temperature=0.0, stop=["\n"]), tenant="acme",
                    stream_subject=subjects.stream("g", "r1"), resume_token_ids=[5], session_id="s"),
    TokenizedRequest(request_id="r1", model="m", prompt_token_ids=[1, 2, 3], sampling=SamplingParams(max_tokens=4),
                     reuse=True, model_fingerprint=FINGERPRINT, block_size=16, block_hashes=[HASH],
                     stream_subject=subjects.stream("g", "r1"), created_at=1.5, pool_blocks=1),
    Admission(accepted=True, worker_id="w1", prompt_tokens=3),
    Cancel(request_id="r1"),
    TokenChunk(request_id="r1", seq=0, token_ids=[7], text="a"),
    StreamBatch(request_ids=["r1", "r2"], events=[b"an encoded event", b"another"]),
    StreamEnd(request_id="r1", seq=1, finish_reason="stop", usage=Usage(prompt_tokens=3, completion_tokens=1,
                                                                         cached_tokens=2)),
    StreamError(request_id="r1", seq=1, error=ErrorInfo(code="overloaded", message="busy")),
    PoolLookupRequest(model_fingerprint=FINGERPRINT, block_hashes=[HASH], include_workers=False),
    PoolLookupReply(hot=1, pool=1, tiers=b"h", workers={"w1": 1}),
    PoolGetRequest(model_fingerprint=FINGERPRINT, block_hashes=[HASH], max_bytes=10, host_id="h", stream=True),
    PoolGetReply(units=[b"unit"], tiers=b"h", complete=False),
    PoolAdminRequest(op="pin", model_fingerprint=FINGERPRINT, block_hashes=[HASH], tenant="acme"),
    PoolAdminReply(ok=True, affected=1, tiers={"hot": TierStats(blocks=1, bytes=10)}, counters={"puts": 1}),
    BlockStored(worker_id="w1", model_fingerprint=FINGERPRINT, block_hashes=[HASH], seq=1),
    TierHits(worker_id="w1", model_fingerprint=FINGERPRINT, tenant_tag="0" * 16, block_hashes=[HASH], tiers=b"c"),
    UnitsWritten(worker_id="w1", model_fingerprint=FINGERPRINT, tenant_tag="0" * 16, block_hashes=[HASH],
                 sizes=[1_474_973], depths=[3]),
    BlockRemoved(worker_id="w1", all_blocks=True, seq=2),
    PoolIndexChanges(instance_id="p1", nonce="n", seq=1, changes=[IndexChange(
        op="stored", tier="warm", model_tag="t", block_hashes=[HASH], sizes=[10], depths=[0], last_hits=[1.0])]),
    WorkerCachesRequest(instance_id="p2", after_worker_id="w0"),
    WorkerCachesReply(instance_id="p1", workers=[WorkerCache(worker_id="w1", seq=3, models={"t": [HASH]})],
                      current_fingerprints={"m": FINGERPRINT}),
    ModelFingerprintChanged(model_name="m", model_fingerprint=FINGERPRINT, previous_fingerprint="cd" * 32),
    Heartbeat(service="worker", instance_id="w1", started_at=1.0, sent_at=2.0, model="m", num_running=1),
    Ping(),
    Pong(service="worker", instance_id="w1", uptime_s=3.0),
    WorkerTelemetry(instance_id="w1", queue_depth=2, local_hit_rate=0.5),
    PoolTelemetry(instance_id="p1", tiers={"hot": TierStats(blocks=1)}, hot_fill=0.1),
    GatewayTelemetry(instance_id="g1", request_rate=2.0),
    FingerprinterTelemetry(instance_id="f1", routing_mode="cache_aware"),
    ArbitratorTelemetry(instance_id="a1", leader=True),
    Decision(decision_id="d1", action="routing", reason="test", weights=RoutingWeights(affinity=2.0)),
    ShadowCheckResult(instance_id="w1", model_fingerprint=FINGERPRINT, namespace="m", request_id="r1",
                      num_reused_tokens=16, divergence=1e-9, tolerance=1e-6, diverged=False),
    ArbitratorAdminRequest(op="set_routing_mode", routing_mode="round_robin"),
    ArbitratorAdminReply(ok=True, rules_version="v1", current=[Decision(decision_id="d1", action="admission",
                                                                        reason="test")]),
    AdapterAdminRequest(op="load", name="a", path="/adapters/a"),
    AdapterAdminReply(service="worker", instance_id="w1", ok=True, adapters=["a"]),
)}


def message_types(carried: object) -> tuple[type[Message], ...]:
    if carried is None or carried is bytes:
        return ()
    return carried.classes if isinstance(carried, OneOf) else (carried,)


def instance(pattern: str) -> str:
    return ".".join("probe" if token.startswith("<") else token for token in pattern.split("."))


def test_the_table_names_every_subject_the_module_defines():
    defined = {name: value for name, value in vars(subjects).items()
               if not name.startswith("_") and isinstance(value, str) and value.startswith(subjects.PREFIX + ".")}
    rows = {spec.subject for spec in subjects.TABLE}
    assert {name for name, subject in defined.items() if subject not in rows} == set()
    assert len(rows) == len(subjects.TABLE)  # no subject twice


def test_every_subject_the_functions_make_finds_its_own_row():
    row = subjects.spec_of
    for service in subjects.SERVICES:
        assert row(subjects.heartbeat(service)).subject == f"{subjects.PREFIX}.heartbeat.<service>"
        assert row(subjects.ping(service)).queue_for(subjects.ping(service)) == service
        assert row(subjects.telemetry(service)).subject == subjects.telemetry(service)
    assert row(subjects.telemetry("worker")).carries is WorkerTelemetry
    assert row(subjects.worker_generate("host.example")).subject == f"{subjects.PREFIX}.worker.<worker>.generate"
    assert row(subjects.stream("g", "r")).subject == f"{subjects.PREFIX}.stream.<gateway>.<request>"
    for op in subjects.POOL_REPLICA_OPS:
        assert row(subjects.pool_replica("pool.host", op)).subject == f"{subjects.PREFIX}.pool.replica.<instance>.{op}"
    assert row(subjects.HEARTBEAT_WILDCARD).carries is Heartbeat


def test_each_row_is_the_only_one_its_subjects_find_and_anything_else_finds_none():
    for spec in subjects.TABLE:
        assert subjects.spec_of(instance(spec.subject)) is spec, spec.subject
    for unknown in ("kite.v1.nowhere", "kite.v1.worker.a.b.generate", "kite.v1.heartbeat.*", "kite.v2.fingerprint"):
        with pytest.raises(ValueError, match="not in kite_shared.subjects.TABLE"):
            subjects.spec_of(unknown)


def test_each_message_type_of_the_table_decodes_what_it_encodes():
    named = {cls for spec in subjects.TABLE for cls in message_types(spec.carries) + message_types(spec.reply)}
    assert named - SAMPLES.keys() == set(), "add a sample of each new message type"
    for spec in subjects.TABLE:
        for cls in message_types(spec.carries):
            sample = SAMPLES[cls]
            assert spec.decode(sample.encode()) == sample, (spec.subject, cls)
        if spec.reply is not None:
            assert spec.reply.decode(SAMPLES[spec.reply].encode()) == SAMPLES[spec.reply]
    assert subjects.spec_of(subjects.POOL_PUT).decode(b"an encoded unit") == b"an encoded unit"


def test_an_error_reply_carries_its_error_and_decodes_as_the_subjects_reply():
    error = ErrorInfo(code="invalid_message", message="not msgpack", param="x")
    refusing = [spec for spec in subjects.TABLE if spec.refusal is not None]
    assert {spec.reply for spec in refusing} == set(subjects.REFUSALS)
    for spec in refusing:
        reply = spec.reply.decode(spec.refusal(error).encode())
        assert isinstance(reply, spec.reply)
        assert reply.error == (error.message if spec.reply is ArbitratorAdminReply else error)
        assert getattr(reply, "ok", False) is False and getattr(reply, "accepted", False) is False
    # No error field (Pong), or one naming the responder (AdapterAdminReply: the endpoint gives it).
    assert {spec.reply for spec in subjects.TABLE if spec.reply and spec.refusal is None} == {Pong, AdapterAdminReply}


def test_docs_subjects_md_is_generated_from_the_table():
    assert (ROOT / "docs" / "subjects.md").read_text() == subjects.markdown_reference(), "run: make subjects-doc"


def test_every_subject_the_docs_name_is_in_the_table():
    """A subject quoted in README.md or docs/*.md (`kite.v1.pool.lookup`, `kite.v1.worker.<id>.generate`,
    `kite.v1.telemetry.<service>`, `kite.v1.pool.replica.<instance>.{put,lookup,get,admin}`) is one the table
    has: a placeholder or wildcard on either side stands for any one token. (`kite.v1.Kite` is the gRPC
    service, not a subject.)"""
    def wild(token: str) -> bool:
        return token.startswith("<") or token in ("*", ">")

    def in_table(quoted: str) -> bool:
        tokens = quoted.split(".")
        return any(len(row) == len(tokens) and all(a == b or wild(a) or wild(b) for a, b in zip(row, tokens))
                   for row in (spec.subject.split(".") for spec in subjects.TABLE))

    missing = []
    for doc in (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))):
        for quoted in re.findall(r"kite\.v1\.(?![A-Z])[\w.<>*{},-]*[\w>*}]", doc.read_text()):
            braces = re.search(r"\{([^}]*)\}", quoted)
            names = [quoted[:braces.start()] + choice + quoted[braces.end():]
                     for choice in braces.group(1).split(",")] if braces else [quoted]
            missing += [f"{doc.name}: {quoted}" for name in names if not in_table(name)]
    assert missing == []
