"""The worker on vLLM (KITE_ENGINE=vllm, the default): vLLM's v1 engine, with KITE's KV connector giving its
paged KV cache the ru-pool's tiers.

    engine.py         VllmEngine: the contract (kite_worker.engines.base.Engine), requests in and stream
                      events out on the worker's event loop
    model.py          VllmModel: vLLM's AsyncLLM configured for KITE, its processes, its LoRA adapters
    kv_connector.py   the KV connector vLLM loads in its engine-core and model-runner processes
    kv_agent.py       the connector's I/O: ru-pool lookups and fetches into staging, saves out
    kv_plan.py        which blocks a request loads and saves, step by step (pure)
    staging_arena.py  the shared-memory slots staged blocks cross processes in
    paged_layout.py   whole blocks in and out of vLLM's paged KV tensors

This package's __init__ imports nothing: vLLM imports kv_connector.py in its own processes, which need
neither the front end nor vLLM's engine arguments. Imports nothing from kite_worker.engines.reference.
"""
