"""ru-pool block index (kite_ru_pool.index) alone: the tenant ledger kept in step, and the longest
prefixes per tier against their definition. Lookups through the pool's parts: test_ru_pool_reads.py;
invalidation: test_ru_pool_catalog.py; dedupe: test_ru_pool_writes.py."""

from kite_ru_pool.index import COLD, HOT, WARM, BlockIndex
from kite_ru_pool.tenants import Tenants
from kite_shared.tiers.keys import BlockKey, model_tag

FP = "11" * 32
CHAIN = [bytes([i]) * 32 for i in range(1, 9)]  # 8 blocks


def test_the_index_alone_keeps_the_tenant_ledgers_in_step_and_answers_prefixes():
    tenants = Tenants()
    index = BlockIndex(tenants)
    k0, k1 = (BlockKey.of(FP, CHAIN[i], "t1") for i in range(2))
    index.note_stored(k0, WARM, 100, now=1.0)
    index.note_stored(k0, COLD, 120, now=2.0)  # the same block, another tier (and a corrected size)
    index.note_stored(k1, HOT, 50, now=2.0)
    assert (len(tenants.ledgers["t1"].blocks), tenants.ledgers["t1"].num_bytes) == (2, 170)
    assert index.prefixes(model_tag(FP), CHAIN, HOT | WARM | COLD) == (0, 1, 1, 2, b"wh")
    assert index.prefixes(model_tag(FP), CHAIN, HOT) == (0, 0, 0, 0, b"")
    assert index.note_missing(k1, HOT) == k1  # the owner as the index knows it
    assert index.note_missing(BlockKey.of(FP, CHAIN[5]), HOT) is None
    assert (len(tenants.ledgers["t1"].blocks), tenants.ledgers["t1"].num_bytes) == (1, 120)
    assert index.forget_tags(None) == ([model_tag(FP)], 1)
    assert tenants.ledgers["t1"].num_bytes == 0 and index.pending_purges == {"*"}


def _prefixes_by_definition(index: BlockIndex, tag: str, chain: list[bytes], up: int):
    """prefixes() as its docstring says, block by block (the index's own walk is a tuned version)."""
    def tiers(h: bytes) -> int:
        e = index.models.get(tag, {}).get(h)
        return 0 if e is None else e.tiers & up

    def prefix(keep) -> int:
        n = 0
        while n < len(chain) and keep(tiers(chain[n])):
            n += 1
        return n

    pool = prefix(bool)
    letters = bytes((b"h" if t & HOT else b"w" if t & WARM else b"c")[0] for t in map(tiers, chain[:pool]))
    return (prefix(lambda t: t & HOT), prefix(lambda t: t & WARM), prefix(lambda t: t & COLD), pool, letters)


def test_prefixes_match_their_definition_for_every_mix_of_tiers_gaps_and_tiers_up():
    import random
    rng = random.Random(14)
    chain = [i.to_bytes(32, "big") for i in range(12)]
    for _ in range(300):
        index = BlockIndex(Tenants())
        for h in chain:
            tiers = rng.choice([0, 0, HOT, WARM, COLD, HOT | WARM, WARM | COLD, HOT | COLD, HOT | WARM | COLD])
            if tiers or rng.random() < 0.5:  # no entry at all, or one whose tiers are gone (a demotion pending)
                index.note_stored(BlockKey.of(FP, h), tiers or WARM, 100, now=0.0)
                index.models[model_tag(FP)][h].tiers = tiers
        for up in range(8):
            assert index.prefixes(model_tag(FP), chain, up) == _prefixes_by_definition(index, model_tag(FP), chain, up)
    assert BlockIndex(Tenants()).prefixes(model_tag(FP), chain, HOT | WARM | COLD) == (0, 0, 0, 0, b"")
