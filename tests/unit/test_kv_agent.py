"""The KV agent's staging store (no NATS: the agent is not started): pins, and files removed under it."""

from __future__ import annotations

import torch

from kite_shared.fingerprint import BlockHash
from kite_worker.kv_agent import STAGED_LOAD_GLOB, AgentOptions, KVAgent, staged_load_path

HASHES = [BlockHash(bytes([i]) * 32) for i in range(3)]


def agent(tmp_path) -> KVAgent:
    return KVAgent(AgentOptions(worker_id="w", model_fingerprint="ab" * 32, block_size=4, unit_shape=(2, 2, 1, 4, 8),
                                storage_dtype=torch.float16, staging_dir=tmp_path, pool_read=True, pool_write=True))


def stage(kv: KVAgent, hashes) -> None:
    """As a completed fetch leaves them: a file per block, known to the store with no pin."""
    for block_hash in hashes:
        staged_load_path(kv.options.staging_dir, block_hash).write_bytes(b"\0" * kv.block_bytes)
        kv._staged[bytes(block_hash)] = 0


def test_a_staged_prefix_is_pinned_up_to_the_first_block_not_staged(tmp_path):
    kv = agent(tmp_path)
    stage(kv, HASHES[:2])
    assert kv.fetch(HASHES, "acme", "ab" * 32).result() == 2  # not connected: only what is staged already
    assert kv._staged == {bytes(HASHES[0]): 1, bytes(HASHES[1]): 1}
    kv.unpin(HASHES[:2])
    assert kv._staged == {bytes(HASHES[0]): 0, bytes(HASHES[1]): 0}


def test_files_removed_at_a_quarantine_are_not_reported_as_staged(tmp_path):
    kv = agent(tmp_path)
    stage(kv, HASHES)
    for staged in tmp_path.glob(STAGED_LOAD_GLOB):  # what the worker's front end does at a quarantine
        staged.unlink()
    assert kv.fetch(HASHES, "acme", "ab" * 32).result() == 0  # fetched again from the pool, never a missing file
    assert bytes(HASHES[0]) not in kv._staged


def test_a_pending_fetch_answers_none_until_done_and_never_waits():
    from concurrent.futures import Future

    from kite_worker.kv_agent import PendingFetch

    future: Future = Future()
    fetch = PendingFetch(2, future, timeout_s=60)
    assert fetch.result() is None  # running: vLLM skips the request this step
    future.set_result(3)
    assert fetch.result() == 5 and fetch.result() == 5  # staged before + fetched
    failed: Future = Future()
    failed.set_exception(TimeoutError("tier"))
    assert PendingFetch(1, failed, timeout_s=60).result() == 1  # a tier error: the rest is computed
    slow: Future = Future()
    late = PendingFetch(1, slow, timeout_s=0)
    assert late.result() == 1 and slow.cancelled()  # past its deadline: cancelled, computed instead
    seen = []
    done_later: Future = Future()
    PendingFetch(0, done_later, timeout_s=60).on_done(seen.append)
    assert seen == []
    done_later.set_result(4)
    assert seen == [4]
    PendingFetch(2, None, timeout_s=60).on_done(seen.append)  # all staged already
    assert seen == [4, 2]
