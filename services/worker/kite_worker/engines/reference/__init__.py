"""The reference engine (KITE_ENGINE=transformers): a transformers model with Upcycle reuse, run in the worker's
process; the engine the equivalence and integration tests run, and the one for machines without vLLM.

    engine.py       ReferenceEngine: the contract (kite_worker.engines.base.Engine); the pool reads
                    (kite_worker.pool_loader) and writes (pool_outbox.py) happen here
    scheduler.py    the generation loop on one thread, interleaving requests step by step
    model.py        ReferenceModel: inject cached prefix KV, compute only the rest, keep new blocks
    block_cache.py  the worker-local LRU of KV blocks, and its events for the ru-pool's index
    kv_blocks.py    blocks <-> transformers' DynamicCache
    detokenize.py   token ids -> streamed text, stop strings
    sampling.py     the next token: greedy, or temperature and top-p
    pool_outbox.py  new blocks and cache events to the ru-pool

Imports nothing from kite_worker.engines.vllm.
"""
