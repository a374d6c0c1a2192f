"""The vLLM connector's bookkeeping (kite_worker.engines.vllm.kv_plan): which paged blocks load and save, step by step.

Scenarios replay what vLLM's scheduler reports (block tables, computed and scheduled token counts) and
assert the exact copies, with hashes from KITE's own chain."""

from __future__ import annotations

from kite_shared.fingerprint import BlockHash, block_hash_chain
from kite_worker.engines.vllm.kv_plan import BlockCopy, KVPlanner, LocalBlockMirror, RequestParams

ROOT = BlockHash(bytes(range(32)))
BASE_FP = bytes(ROOT).hex()
ADAPTER_ROOT = BlockHash(bytes(range(32, 64)))
ADAPTER_FP = bytes(ADAPTER_ROOT).hex()
B = 4  # tokens per block in these scenarios
PROMPT = list(range(100, 118))  # 18 tokens: 4 full blocks + 2
SALT = "tenant-salt"


def params(**kw) -> RequestParams:
    base = dict(cache_salt=SALT, tenant="acme", load=True, save=True, save_generated=True)
    base.update(kw)
    return RequestParams(**base)


def hashes_of(tokens: list[int]) -> list[BlockHash]:
    return block_hash_chain(tokens, B, ROOT, SALT)


def test_params_survive_their_wire_form():
    p = params(max_save_blocks=3, pool_blocks=2, model_fingerprint=ADAPTER_FP)
    assert RequestParams.decode(p.encode()) == p
    assert RequestParams.decode({"load": True}).pool_blocks == -1  # an older front end: unknown
    assert RequestParams.decode(None) is None


def test_wanted_starts_after_the_local_hit_and_never_covers_the_last_prompt_token():
    planner = KVPlanner(B, ROOT)
    planner.track("r", params(), PROMPT)
    # (18 - 1) // 4 = 4 reusable blocks; vLLM's own cache already has the first one
    assert planner.wanted("r", num_local_tokens=4) == hashes_of(PROMPT)[1:4]
    planner.track("q", params(load=False), PROMPT)
    assert planner.wanted("q", 0) == []
    short = list(range(8))  # exactly 2 blocks: only the first may be reused, the last token is computed
    planner.track("s", params(), short)
    assert planner.wanted("s", 0) == hashes_of(short)[:1]


def test_wanted_stops_where_the_pool_held_blocks_at_admission():
    planner = KVPlanner(B, ROOT)
    planner.track("r", params(pool_blocks=3), PROMPT)
    assert planner.wanted("r", num_local_tokens=0) == hashes_of(PROMPT)[:3]
    assert planner.wanted("r", num_local_tokens=4) == hashes_of(PROMPT)[1:3]
    # vLLM holds as much as the pool: nothing to ask the pool for (the common shared-prefix miss)
    planner.track("q", params(pool_blocks=1), PROMPT)
    assert planner.wanted("q", num_local_tokens=4) == []
    planner.track("e", params(pool_blocks=0), PROMPT)
    assert planner.wanted("e", 0) == []


def test_a_load_is_copied_into_the_allocated_blocks_and_those_blocks_are_never_saved():
    planner = KVPlanner(B, ROOT)
    planner.track("r", params(), PROMPT)
    planner.set_loadable("r", first_block=1, num_blocks=3)
    assert planner.num_matched_tokens("r", num_local_tokens=4) == 12
    planner.allocated("r", num_external_tokens=12)
    hashes = hashes_of(PROMPT)
    step = planner.plan_step("r", [70, 71, 72, 73, 74], True, num_computed_tokens=16,
                             num_scheduled_tokens=2, all_token_ids=PROMPT)
    assert step.loads == [BlockCopy(71, hashes[1], 1), BlockCopy(72, hashes[2], 2), BlockCopy(73, hashes[3], 3)]
    # block 0 was vLLM's local hit and never saved by this worker: saved now; loaded blocks are not
    assert step.saves == [BlockCopy(70, hashes[0], 0)]


def test_matched_tokens_follow_a_local_hit_that_grew_since_the_fetch():
    planner = KVPlanner(B, ROOT)
    planner.track("r", params(), PROMPT)
    planner.set_loadable("r", first_block=1, num_blocks=3)
    assert planner.num_matched_tokens("r", 8) == 8  # blocks 2 and 3 remain to load
    assert planner.num_matched_tokens("r", 0) == 0  # staged blocks must start right after the hit


def test_saves_follow_the_computation_block_by_block_through_decode():
    planner = KVPlanner(B, ROOT)
    planner.track("r", params(load=False), PROMPT)
    tokens = list(PROMPT)
    first = planner.plan_step("r", [10, 11, 12, 13, 14], True, 0, 18, tokens)
    hashes = hashes_of(PROMPT)
    assert [c.block_index for c in first.saves] == [0, 1, 2, 3]
    assert [c.block_id for c in first.saves] == [10, 11, 12, 13]
    assert first.saves[3].block_hash == hashes[3]
    # decode: tokens 18 and 19 complete block 4 once the sampled token is known
    tokens.append(500)  # sampled by the prefill step
    assert planner.plan_step("r", None, False, 18, 1, tokens).saves == []
    tokens.append(501)
    step = planner.plan_step("r", None, False, 19, 1, tokens)
    assert step.saves == [BlockCopy(14, hashes_of(tokens)[4], 4)]
    info = planner.saved_info("r", step.saves[0])
    assert info.parent_hash == hashes[3] and info.block_index == 4 and info.tenant == "acme"
    assert planner.saved_info("r", first.saves[0]).parent_hash == ROOT


def test_a_block_whose_last_token_is_not_known_yet_waits_for_a_later_step():
    planner = KVPlanner(B, ROOT)
    planner.track("r", params(load=False), PROMPT[:16])
    tokens = PROMPT[:16]
    # async scheduling: the step computes position 16 and 17 but the request knows 16 tokens only
    step = planner.plan_step("r", [1, 2, 3, 4, 5], True, 0, 16, tokens)
    assert len(step.saves) == 4
    later = planner.plan_step("r", None, False, 16, 3, tokens)  # 19 computed, tokens 16.. unknown
    assert later.saves == []
    tokens = tokens + [7, 8, 9, 10]
    assert [c.block_index for c in planner.plan_step("r", None, False, 19, 1, tokens).saves] == [4]


def test_prompt_only_and_write_policy_limits():
    planner = KVPlanner(B, ROOT)
    planner.track("p", params(load=False, save_generated=False), PROMPT)
    saves = planner.plan_step("p", list(range(10)), True, 0, 18, PROMPT + [1, 2, 3, 4, 5, 6]).saves
    assert [c.block_index for c in saves] == [0, 1, 2, 3]
    planner.track("w", params(load=False, max_save_blocks=2, cache_salt="other"), PROMPT)
    assert [c.block_index for c in planner.plan_step("w", list(range(10)), True, 0, 18, PROMPT).saves] == [0, 1]
    planner.track("off", params(load=False, save=False, cache_salt="third"), PROMPT)
    assert planner.plan_step("off", list(range(10)), True, 0, 18, PROMPT).saves == []


def test_a_block_is_saved_once_per_worker_even_across_requests():
    planner = KVPlanner(B, ROOT)
    planner.track("a", params(load=False), PROMPT)
    assert len(planner.plan_step("a", [1, 2, 3, 4, 5], True, 0, 18, PROMPT).saves) == 4
    planner.finished("a")
    planner.track("b", params(load=False), PROMPT)
    assert planner.plan_step("b", [1, 2, 3, 4, 9], True, 16, 2, PROMPT).saves == []


def test_selective_policy_saves_a_local_hit_on_its_second_sighting():
    planner = KVPlanner(B, ROOT)
    planner.track("first", params(load=False, max_save_blocks=0), PROMPT)
    assert planner.plan_step("first", [1, 2, 3, 4, 5], True, 0, 18, PROMPT).saves == []
    planner.finished("first")
    planner.track("second", params(load=False, max_save_blocks=4), PROMPT)
    step = planner.plan_step("second", [1, 2, 3, 4, 6], True, 16, 2, PROMPT)  # vLLM's local hit: 16 tokens
    assert [(c.block_id, c.block_index) for c in step.saves] == [(1, 0), (2, 1), (3, 2), (4, 3)]


def test_a_resumed_request_replaces_its_block_table():
    planner = KVPlanner(B, ROOT)
    planner.track("r", params(load=False, save=False), PROMPT)
    planner.plan_step("r", [1, 2], True, 0, 8, PROMPT)
    planner.plan_step("r", [3], False, 8, 4, PROMPT)
    assert planner.requests["r"].block_ids == [1, 2, 3]
    planner.plan_step("r", [7, 8, 9], True, 0, 12, PROMPT)  # preempted, then resumed with new blocks
    assert planner.requests["r"].block_ids == [7, 8, 9]


def test_untracked_requests_have_no_plan():
    planner = KVPlanner(B, ROOT)
    assert planner.num_matched_tokens("x", 0) == 0
    step = planner.plan_step("x", [1], True, 0, 4, [1, 2, 3, 4])
    assert step.loads == [] and step.saves == []


def test_an_adapters_request_hashes_and_saves_under_the_adapters_root():
    planner = KVPlanner(B, ROOT)
    planner.track("base", params(), PROMPT)
    planner.track("lora", params(model_fingerprint=ADAPTER_FP), PROMPT)
    lora_chain = block_hash_chain(PROMPT, B, ADAPTER_ROOT, SALT)
    assert planner.requests["base"].hashes == hashes_of(PROMPT)
    assert planner.requests["lora"].hashes == lora_chain and lora_chain[0] != hashes_of(PROMPT)[0]
    planner.plan_step("base", [1, 2, 3, 4, 5], True, 0, 18, PROMPT)
    step = planner.plan_step("lora", [6, 7, 8, 9, 10], True, 0, 18, PROMPT)
    assert step.saves == [BlockCopy(6 + i, lora_chain[i], i) for i in range(4)]  # the base's saves do not count
    first, second = (planner.saved_info("lora", copy) for copy in step.saves[:2])
    assert (first.parent_hash, first.model_fingerprint) == (ADAPTER_ROOT, ADAPTER_FP)
    assert second.parent_hash == lora_chain[0]
    assert planner.saved_info("base", BlockCopy(1, hashes_of(PROMPT)[0], 0)).model_fingerprint == BASE_FP


def test_the_mirror_announces_a_held_block_once_its_kite_hash_is_known_in_either_order():
    mirror = LocalBlockMirror()
    kite = [BlockHash(bytes([i]) * 32) for i in range(4)]
    mirror.learn([101, 102], kite[:2], BASE_FP)  # a tracked request names its blocks before vLLM caches them
    assert mirror.take_events() == []
    mirror.stored([101, 102, 103])  # 103: computed by a request the connector never tracked
    assert mirror.take_events() == [("stored", BASE_FP, kite[:2])]
    mirror.learn([103, 101], [kite[2], kite[0]], BASE_FP)  # named later; 101 is already announced
    assert mirror.take_events() == [("stored", BASE_FP, [kite[2]])]
    mirror.removed([102, 104])  # 104 was never announced
    mirror.stored([102])
    assert mirror.take_events() == [("removed", BASE_FP, [kite[1]]), ("stored", BASE_FP, [kite[1]])]
    mirror.cleared()
    mirror.stored([101])
    assert mirror.take_events() == [("cleared", "", []), ("stored", BASE_FP, [kite[0]])]
    assert mirror.held == {101}


def test_the_mirror_announces_each_adapters_blocks_in_its_own_namespace():
    mirror = LocalBlockMirror()
    kite = [BlockHash(bytes([i]) * 32) for i in range(4)]
    mirror.learn([1, 2], kite[:2], BASE_FP)
    mirror.learn([3, 4], kite[2:], ADAPTER_FP)  # vLLM hashes an adapter's blocks apart (its lora keys)
    mirror.stored([1, 3, 2, 4])
    assert mirror.take_events() == [("stored", BASE_FP, [kite[0]]), ("stored", ADAPTER_FP, [kite[2]]),
                                    ("stored", BASE_FP, [kite[1]]), ("stored", ADAPTER_FP, [kite[3]])]
    mirror.removed([4, 3, 1])
    assert mirror.take_events() == [("removed", ADAPTER_FP, [kite[3], kite[2]]), ("removed", BASE_FP, [kite[0]])]


def test_the_mirror_forgets_the_oldest_pairings_first():
    mirror = LocalBlockMirror(max_pairs=2)
    kite = [BlockHash(bytes([i]) * 32) for i in range(3)]
    mirror.learn([1, 2], kite[:2], BASE_FP)
    mirror.learn([1], kite[:1], BASE_FP)  # renewed: 2 is now the oldest
    mirror.learn([3], kite[2:], BASE_FP)
    mirror.stored([1, 2, 3])
    assert mirror.take_events() == [("stored", BASE_FP, [kite[0], kite[2]])]
