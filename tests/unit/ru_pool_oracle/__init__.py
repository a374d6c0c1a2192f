"""The ru-pool block index, its tenant ledgers and its sweep pass as they were before issue 38 (one Entry
object per block, ledgers of (model tag, hash) tuples, a sweep that copies each tag's keys): the oracle the
randomized equivalence test (test_ru_pool_index_equivalence.py) and bench/bench_pool_index.py compare the
compact index with. Copied verbatim but for the imports; not used by the service."""
