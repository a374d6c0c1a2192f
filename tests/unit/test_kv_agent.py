"""The KV agent's staging store (no NATS: the agent is not started): slots of the staging arena, pins,
LRU reuse of unpinned slots, and slots cleared under it at a quarantine."""

from __future__ import annotations

import asyncio
import dataclasses

import torch

from kite_shared.fingerprint import BlockHash
from kite_worker.engines.vllm.kv_agent import AgentOptions, KVAgent, _FetchTicket
from kite_worker.engines.vllm.staging_arena import ARENA_FILE, StagingArena

HASHES = [BlockHash(bytes([i]) * 32) for i in range(1, 5)]  # an all-zero tag is an empty slot
UNIT_SHAPE = (2, 2, 1, 4, 8)  # 256 bytes in fp16


def agent(tmp_path, num_slots: int = 8) -> KVAgent:
    return KVAgent(AgentOptions(worker_id="w", model_fingerprint="ab" * 32, block_size=4, unit_shape=UNIT_SHAPE,
                                storage_dtype=torch.float16, staging_dir=tmp_path, pool_read=True, pool_write=True,
                                staging_bytes=num_slots * 256))


class PoolAnswers:
    """What the pool loader returns for the hashes it is asked (each value the hash's first byte)."""

    def __init__(self) -> None:
        self.asked: list[list[bytes]] = []

    async def load(self, hashes, num_local, tenant, model_fingerprint):
        self.asked.append([bytes(h) for h in hashes])
        return [(h, torch.full(UNIT_SHAPE, float(bytes(h)[0]), dtype=torch.float16)) for h in hashes]


def fetch_from_pool(kv: KVAgent, hashes, ticket: _FetchTicket | None = None) -> int:
    """What the agent's loop runs for a fetch: the blocks staged (and pinned)."""
    kv.loader = PoolAnswers()
    return asyncio.run(kv._fetch(list(hashes), "acme", "ab" * 32, ticket or _FetchTicket()))


def staged_values(kv: KVAgent, block_hash) -> float:
    """The block as the model runner reads it from its own mapping of the arena."""
    runner = StagingArena.open(kv.options.staging_dir / ARENA_FILE, kv.block_bytes)
    slot = kv.staged_slot(block_hash)
    assert runner.holds(slot, bytes(block_hash))
    return torch.frombuffer(runner.payload(slot), dtype=torch.float16).unique().tolist()


def test_fetched_blocks_are_staged_in_slots_the_model_runner_reads_and_pinned(tmp_path):
    kv = agent(tmp_path)
    assert fetch_from_pool(kv, HASHES[:2]) == 2
    assert {key: staged.pins for key, staged in kv._staged.items()} == {bytes(HASHES[0]): 1, bytes(HASHES[1]): 1}
    assert staged_values(kv, HASHES[0]) == [1.0] and staged_values(kv, HASHES[1]) == [2.0]
    assert kv.num_blocks_fetched == 2


def test_a_staged_prefix_is_pinned_up_to_the_first_block_not_staged(tmp_path):
    kv = agent(tmp_path)
    fetch_from_pool(kv, HASHES[:2])
    kv.unpin(HASHES[:2])
    assert kv.fetch(HASHES, "acme", "ab" * 32).result() == 2  # not connected: only what is staged already
    assert {key: staged.pins for key, staged in kv._staged.items()} == {bytes(HASHES[0]): 1, bytes(HASHES[1]): 1}
    kv.unpin(HASHES[:2])
    assert all(staged.pins == 0 for staged in kv._staged.values())


def test_slots_are_reused_least_recently_used_first_and_pinned_ones_never(tmp_path):
    kv = agent(tmp_path, num_slots=2)
    fetch_from_pool(kv, HASHES[:2])
    kv.unpin(HASHES[:1])  # block 0 unpinned, block 1 still needed by a load
    assert fetch_from_pool(kv, HASHES[2:4]) == 1  # one slot free to reuse: block 3 is computed
    assert list(kv._staged) == [bytes(HASHES[1]), bytes(HASHES[2])]
    assert staged_values(kv, HASHES[1]) == [2.0] and staged_values(kv, HASHES[2]) == [3.0]
    kv.unpin(HASHES[1:3])
    assert kv.fetch(HASHES[1:2], "acme", "ab" * 32).result() == 1  # block 1 now most recently used
    kv.unpin(HASHES[1:2])
    fetch_from_pool(kv, HASHES[3:4])
    assert list(kv._staged) == [bytes(HASHES[1]), bytes(HASHES[3])]  # block 2 was the least recent


def test_a_block_staged_by_a_fetch_beside_this_one_is_pinned_not_copied_again(tmp_path):
    kv = agent(tmp_path)
    fetch_from_pool(kv, HASHES[:1])
    slot = kv.staged_slot(HASHES[0])
    assert fetch_from_pool(kv, HASHES[:1]) == 1
    assert kv.staged_slot(HASHES[0]) == slot and kv._staged[bytes(HASHES[0])].pins == 2


def test_a_fetch_abandoned_at_its_deadline_leaves_no_pin_behind(tmp_path):
    # Its result is never read, so nobody would unpin what it staged: the slots would be lost for good.
    kv = agent(tmp_path, num_slots=2)
    ticket = _FetchTicket()
    assert fetch_from_pool(kv, HASHES[:2], ticket) == 2  # it finished after the scheduler gave up on it
    kv._abandon(ticket)
    assert all(staged.pins == 0 for staged in kv._staged.values())
    assert fetch_from_pool(kv, HASHES[2:4]) == 2  # both slots reusable
    late = _FetchTicket()
    kv._abandon(late)  # abandoned before it staged anything: it stages nothing
    assert fetch_from_pool(kv, HASHES[:1], late) == 0
    assert {key: staged.pins for key, staged in kv._staged.items()} == {bytes(HASHES[2]): 1, bytes(HASHES[3]): 1}


def test_slots_cleared_at_a_quarantine_are_not_reported_as_staged(tmp_path):
    kv = agent(tmp_path)
    fetch_from_pool(kv, HASHES[:3])
    kv.unpin(HASHES[:3])
    front_end = StagingArena.open(tmp_path / ARENA_FILE)  # what the worker's front end does at a quarantine
    front_end.clear_all()
    assert kv.fetch(HASHES, "acme", "ab" * 32).result() == 0  # fetched again from the pool, never stale bytes
    assert bytes(HASHES[0]) not in kv._staged
    assert fetch_from_pool(kv, HASHES[:3]) == 3  # blocks 1 and 2 too: their cleared slots are replaced
    assert staged_values(kv, HASHES[2]) == [3.0]


def test_a_pending_fetch_answers_none_until_done_and_never_waits():
    from concurrent.futures import Future

    from kite_worker.engines.vllm.kv_agent import PendingFetch

    future: Future = Future()
    fetch = PendingFetch(2, future, timeout_s=60)
    assert fetch.result() is None  # running: vLLM skips the request this step
    future.set_result(3)
    assert fetch.result() == 5 and fetch.result() == 5  # staged before + fetched
    failed: Future = Future()
    failed.set_exception(TimeoutError("tier"))
    assert PendingFetch(1, failed, timeout_s=60).result() == 1  # a tier error: the rest is computed
    slow: Future = Future()
    abandoned = []
    late = PendingFetch(1, slow, timeout_s=0, abandon=lambda: abandoned.append(True))
    assert late.result() == 1 and slow.cancelled()  # past its deadline: cancelled, computed instead
    assert abandoned == [True]  # and the agent told to drop what it pins for it
    seen = []
    done_later: Future = Future()
    PendingFetch(0, done_later, timeout_s=60).on_done(seen.append)
    assert seen == []
    done_later.set_result(4)
    assert seen == [4]
    PendingFetch(2, None, timeout_s=60).on_done(seen.append)  # all staged already
    assert seen == [4, 2]


def test_a_saved_block_becomes_a_unit_of_the_configured_codec(tmp_path):
    from kite_shared import kv_codec, recyclable_unit
    from kite_shared.tier_codecs import TierCodecs
    from kite_worker import codec_tensors
    from kite_worker.engines.vllm.kv_agent import ConnectorOptions
    from kite_worker.engines.vllm.kv_plan import SavedBlockInfo

    block = torch.randn(UNIT_SHAPE).half()
    saved = tmp_path / "saved.bin"
    info = SavedBlockInfo(block_hash=HASHES[0], parent_hash=BlockHash(b"\x00" * 32), block_index=0, tenant="acme",
                          model_fingerprint="ab" * 32)
    for codec in ("", "int8"):
        kv = agent(tmp_path)
        kv.options = dataclasses.replace(kv.options, tier_codecs=TierCodecs.from_settings(codec, cold="int8"))
        saved.write_bytes(block.contiguous().view(torch.uint8).numpy().tobytes())
        unit = recyclable_unit.decode(kv._encode(info, saved), expected_hash=bytes(HASHES[0]), key=kv._ru_key)
        assert unit.codec == (codec or "fp16") and unit.cold_codec == "int8"
        assert len(unit.payload) == kv_codec.payload_bytes(unit.codec, UNIT_SHAPE)
        restored = codec_tensors.decode(unit.payload, unit.codec, UNIT_SHAPE, torch.float32)
        assert torch.allclose(restored, block.float(), atol=0 if not codec else float(block.abs().max()) / 100)
    # The worker's front end hands the codec to the connector in vLLM's kv_connector_extra_config.
    for tier_codecs in (TierCodecs.from_settings("int8"), TierCodecs.from_settings("", cold="fp8_e4m3")):
        extra = ConnectorOptions.extra_config("ab" * 32, "w", tmp_path, "float16", True, True, 1 << 20,
                                              keep_mapped_bytes=3 << 20, tier_codecs=tier_codecs)
        options = ConnectorOptions.from_extra_config(extra)
        assert options.tier_codecs == tier_codecs and options.keep_mapped_bytes == 3 << 20
