"""`kite pool ...`: administer the ru-pool over NATS (stats, clear, pin, unpin, purge).

    kite pool stats [--tenant NAME]
    kite pool clear [--model FINGERPRINT] [--tenant NAME]
    kite pool pin --model FINGERPRINT [--tenant NAME] HASH_HEX [HASH_HEX ...]
    kite pool unpin --model FINGERPRINT [--tenant NAME] HASH_HEX [HASH_HEX ...]
    kite pool purge --model FINGERPRINT

Prints the pool's reply as JSON; exit status 0 on success, 1 when the pool refused, 2 when no pool
answered (or bad arguments). Tenants appear in replies by tenant tag (kite_shared.security.tenant_tag):
the pool never stores tenant names. NATS credentials and TLS come from the KITE_NATS_* variables, as for
the services.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Sequence

from kite_shared.config import CommonConfig, load
from kite_shared.messages import PoolAdminRequest


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kite pool", description="Administer the ru-pool.")
    p.add_argument("--nats-url", default=None, help="NATS URL (default: KITE_NATS_URL)")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for the pool")
    sub = p.add_subparsers(dest="op", required=True)
    stats = sub.add_parser("stats", help="blocks, bytes and hit rate per tier, counters, tenant usage")
    stats.add_argument("--tenant", default="", help="show only this tenant's usage and quota")
    clear = sub.add_parser("clear", help="delete all blocks, or those of one model and/or tenant, from "
                                         "every tier")
    clear.add_argument("--model", default="", help="model fingerprint (hex); default: every model")
    clear.add_argument("--tenant", default="", help="tenant name; default: every tenant")
    for name, text in (("pin", "never evict or expire these blocks"), ("unpin", "let them age again")):
        sp = sub.add_parser(name, help=text)
        sp.add_argument("--model", required=True, help="model fingerprint (hex)")
        sp.add_argument("--tenant", default="", help="tenant whose blocks these are (default: anonymous)")
        sp.add_argument("hashes", nargs="+", help="block hashes (64 hex digits each), a chain prefix")
    purge = sub.add_parser("purge", help="delete a model's blocks everywhere and never serve it again")
    purge.add_argument("--model", required=True, help="model fingerprint (hex)")
    return p


def build_request(args: argparse.Namespace) -> PoolAdminRequest:
    hashes = []
    for text in getattr(args, "hashes", []) or []:
        try:
            h = bytes.fromhex(text)
        except ValueError:
            raise ValueError(f"not a hex block hash: {text!r}") from None
        if len(h) != 32:
            raise ValueError(f"a block hash is 32 bytes (64 hex digits), got {len(h)}: {text!r}")
        hashes.append(h)
    return PoolAdminRequest(op=args.op, model_fingerprint=getattr(args, "model", "") or "",
                            block_hashes=hashes, tenant=getattr(args, "tenant", "") or "")


async def _quiet(exc: Exception) -> None:
    """nats.py prints a traceback per failed attempt by default; the one-line message below suffices."""


async def _run(url: str, req: PoolAdminRequest, timeout_s: float, common: CommonConfig) -> int:
    # Imported here, so `--help` works without the NATS client loaded.
    from kite_shared.security import redact_url
    from kite_shared.service import connect_nats
    from kite_shared.tiers.pool_client import PoolClient

    try:
        nc = await connect_nats(url, "kite-pool-admin", common, connect_timeout=min(timeout_s, 5.0),
                                max_reconnect_attempts=1, reconnect_time_wait=0.2,
                                allow_reconnect=False, error_cb=_quiet)
    except Exception as exc:  # nats.py raises its own and OS errors for an unreachable server
        print(f"kite pool: cannot reach NATS at {redact_url(url)}: {type(exc).__name__}", file=sys.stderr)
        return 2
    try:
        reply = await PoolClient(nc).admin(req, timeout_s=timeout_s)
    finally:
        await nc.close()
    if reply is None:
        print("kite pool: no ru-pool answered (is it running on this NATS?)", file=sys.stderr)
        return 2
    print(json.dumps(reply.model_dump(mode="json"), indent=2, sort_keys=True))
    return 0 if reply.ok else 1


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        req = build_request(args)
    except ValueError as exc:
        print(f"kite pool: {exc}", file=sys.stderr)
        return 2
    common = load(CommonConfig)
    return asyncio.run(_run(args.nats_url or common.nats_url, req, args.timeout, common))


if __name__ == "__main__":
    sys.exit(main())
