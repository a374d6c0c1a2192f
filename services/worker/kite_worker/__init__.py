"""KITE worker: runs the model, reuses cached prefix KV (Upcycle), streams tokens, hands new blocks on.

    __main__.py      the entrypoint: config, the engine, the handler table
    service.py       admission, cancellation, stream events out, the drain (engine-agnostic)
    control.py       telemetry out, arbitrator decisions in
    engines/         the engine contract (engines/base.py), the factory KITE_ENGINE picks with, and one
                     package per engine: engines/vllm/, engines/reference/
and what both engines use: write_policy.py (which new blocks go to the ru-pool), shadow.py (shadow
verification), pool_loader.py (loading prefix blocks from the pool's tiers), codec_tensors.py (KV codecs on
torch tensors), codec_guard.py (lossy KV storage measured before the engine starts).
"""
