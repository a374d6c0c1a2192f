"""`kite adapter ...`: the compatibility declaration of a LoRA adapter (docs/adapters.md).

    kite adapter declare FOLDER   write FOLDER/kite-adapter.json for the configured base model (KITE_MODEL_*,
                                  KITE_BLOCK_SIZE): the facts a worker checks before it serves the adapter
    kite adapter check FOLDER     check FOLDER against the configured base as a worker would at start; prints
                                  the adapter's digest, or the field that does not match (exit 1)

Run both with the configuration the workers have: a declaration written for another base is refused.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kite_shared import adapters, model_store
from kite_shared.config import ModelConfig, load


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kite adapter", description="LoRA adapter declarations")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, text in (("declare", "write FOLDER/kite-adapter.json for the configured base model"),
                       ("check", "check FOLDER against the configured base model")):
        cmd = sub.add_parser(name, help=text)
        cmd.add_argument("folder", type=Path, help="a peft LoRA folder (adapter_config.json + weights)")
        cmd.add_argument("--name", default="adapter", help="the name it would be served under (check)")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    cfg = load(ModelConfig)
    local = model_store.prepare(cfg)
    if args.command == "declare":
        print(adapters.declare(args.folder, local, cfg.block_size))
        return 0
    try:
        adapter = adapters.load_adapter(args.name, args.folder, model_store.identity(local, cfg), local,
                                        cfg.block_size)
    except adapters.AdapterRefused as exc:
        print(exc, file=sys.stderr)
        return 1
    print(f"{adapter.name}: compatible with {local.name}; digest {adapter.digest}, rank {adapter.rank}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
