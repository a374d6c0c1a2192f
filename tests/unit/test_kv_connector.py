"""The connector's reading of vLLM's KV cache events (real vLLM event classes), as the ru-pool's index
will be told: what this worker's vLLM cache stored and evicted, in KITE block hashes."""

from __future__ import annotations

from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

from kite_shared.fingerprint import BlockHash
from kite_worker.engines.vllm.kv_connector import apply_kv_events
from kite_worker.engines.vllm.kv_plan import LocalBlockMirror

KITE = [BlockHash(bytes([i + 1]) * 32) for i in range(4)]
FP = "ab" * 32


def stored(*hashes: int) -> BlockStored:
    return BlockStored(block_hashes=list(hashes), parent_block_hash=None, token_ids=[], block_size=32,
                       lora_id=None, medium="CPU", lora_name=None)


def test_stores_evictions_and_clears_keep_their_order_in_kite_hashes():
    mirror = LocalBlockMirror()
    mirror.learn([11, 12, 13], KITE[:3], FP)
    apply_kv_events(mirror, [stored(11, 12, 77), BlockRemoved(block_hashes=[12], medium="CPU"),
                             AllBlocksCleared(), stored(13)])
    assert mirror.take_events() == [
        ("stored", FP, [KITE[0], KITE[1]]), ("removed", FP, [KITE[1]]), ("cleared", "", []),
        ("stored", FP, [KITE[2]])]


def test_blocks_without_a_kite_hash_are_held_but_not_announced():
    mirror = LocalBlockMirror()
    mirror.learn([11], KITE[:1], FP)
    apply_kv_events(mirror, [stored(21, 22), BlockRemoved(block_hashes=[23], medium="CPU")])
    assert mirror.take_events() == []
    assert mirror.held == {21, 22}
