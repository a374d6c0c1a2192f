"""`kite bench`: KITE (reuse on and off) against plain transformers and llama.cpp on reuse-heavy workloads;
`kite bench vllm-peer`: KITE-on-vLLM against plain vLLM with the same engine flags (vllm_peer.py);
`kite bench fleet`: KITE with N workers against N plain vLLM servers behind vllm-router (fleet.py).

See docs/benchmarks.md. `main(argv)` is what `kite bench ...` calls.
"""

from __future__ import annotations


def main(argv: list[str] | None = None) -> int:
    if argv and argv[0] == "vllm-peer":
        from kite_cli.bench.vllm_peer import main as peer_main

        return peer_main(argv[1:])
    if argv and argv[0] == "fleet":
        from kite_cli.bench.fleet import main as fleet_main

        return fleet_main(argv[1:])
    from kite_cli.bench.runner import main as _main

    return _main(argv)
