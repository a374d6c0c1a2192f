"""Talk to the arbitrator's admin subject (kite.v1.arbitrator.admin): status, reload, routing mode, quarantine.

    kite arbitrator [--nats URL] status | reload | routing-mode MODE | clear-quarantine FINGERPRINT

`clear-quarantine` lifts the quarantine of a namespace (the hex model fingerprint that `status` and
`kite pool stats` show) once its cause is found: its blocks are served again as they are recomputed.

The NATS server: --nats, else KITE_NATS_URL when set, else the running `kite run` stack's, else
nats://127.0.0.1:4222 (as for `kite pool`).
"""

from __future__ import annotations

import argparse
import asyncio
import json

from kite_cli.stack import admin_nats_url
from kite_shared import subjects
from kite_shared.config import CommonConfig, load
from kite_shared.service import connect_nats
from kite_shared.messages import ArbitratorAdminReply, ArbitratorAdminRequest


async def admin_request(nats_url: str, op: str, routing_mode: str = "", timeout_s: float = 5.0,
                        model_fingerprint: str = "") -> ArbitratorAdminReply:
    """One request; NATS credentials and TLS from the KITE_NATS_* variables, as for the services."""
    nc = await connect_nats(nats_url, "kite-arbitrator-admin", load(CommonConfig),
                            connect_timeout=min(timeout_s, 5.0), allow_reconnect=False)
    try:
        request = ArbitratorAdminRequest(op=op, routing_mode=routing_mode, model_fingerprint=model_fingerprint)
        msg = await nc.request(subjects.ARBITRATOR_ADMIN, request.encode(), timeout=timeout_s)
        return ArbitratorAdminReply.decode(msg.data)
    finally:
        await nc.close()


def admin(nats_url: str, op: str, routing_mode: str = "", timeout_s: float = 5.0,
          model_fingerprint: str = "") -> ArbitratorAdminReply:
    """Blocking form, for scripts and tests."""
    return asyncio.run(admin_request(nats_url, op, routing_mode, timeout_s, model_fingerprint))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kite arbitrator", description=__doc__.splitlines()[0])
    parser.add_argument("--nats", default=None, help="NATS URL (default: KITE_NATS_URL when set, else the "
                        "running `kite run` stack's, else nats://127.0.0.1:4222)")
    parser.add_argument("op", choices=["status", "reload", "routing-mode", "clear-quarantine"])
    parser.add_argument("value", nargs="?", default="", help="routing-mode: the mode; clear-quarantine: the "
                        "namespace's model fingerprint")
    args = parser.parse_args(argv)
    op = {"routing-mode": "set_routing_mode", "clear-quarantine": "clear_quarantine"}.get(args.op, args.op)
    if op == "clear_quarantine" and not args.value:
        parser.error("clear-quarantine needs the namespace's model fingerprint")
    reply = admin(admin_nats_url(args.nats)[0], op, args.value if op == "set_routing_mode" else "",
                  model_fingerprint=args.value if op == "clear_quarantine" else "")
    print(json.dumps(reply.model_dump(mode="json"), indent=2, default=str))
    return 0 if reply.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
