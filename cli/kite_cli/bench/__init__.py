"""`kite bench`: KITE (reuse on and off) against plain transformers and llama.cpp on reuse-heavy workloads.

See docs/benchmarks.md. `main(argv)` is what `kite bench ...` calls.
"""

from __future__ import annotations


def main(argv: list[str] | None = None) -> int:
    from kite_cli.bench.runner import main as _main

    return _main(argv)
