"""Talk to the arbitrator's admin subject (kite.v1.arbitrator.admin): status, reload, routing mode.

    python -m kite_cli.arbitrator_admin [--nats URL] status | reload | routing-mode MODE

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


async def admin_request(nats_url: str, op: str, routing_mode: str = "", timeout_s: float = 5.0) -> ArbitratorAdminReply:
    """One request; NATS credentials and TLS from the KITE_NATS_* variables, as for the services."""
    nc = await connect_nats(nats_url, "kite-arbitrator-admin", load(CommonConfig),
                            connect_timeout=min(timeout_s, 5.0), allow_reconnect=False)
    try:
        msg = await nc.request(subjects.ARBITRATOR_ADMIN,
                               ArbitratorAdminRequest(op=op, routing_mode=routing_mode).encode(), timeout=timeout_s)
        return ArbitratorAdminReply.decode(msg.data)
    finally:
        await nc.close()


def admin(nats_url: str, op: str, routing_mode: str = "", timeout_s: float = 5.0) -> ArbitratorAdminReply:
    """Blocking form, for scripts and tests."""
    return asyncio.run(admin_request(nats_url, op, routing_mode, timeout_s))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nats", default=None, help="NATS URL (default: KITE_NATS_URL when set, else the "
                        "running `kite run` stack's, else nats://127.0.0.1:4222)")
    parser.add_argument("op", choices=["status", "reload", "routing-mode"])
    parser.add_argument("mode", nargs="?", default="")
    args = parser.parse_args()
    op = "set_routing_mode" if args.op == "routing-mode" else args.op
    reply = admin(admin_nats_url(args.nats)[0], op, args.mode)
    print(json.dumps(reply.model_dump(mode="json"), indent=2, default=str))


if __name__ == "__main__":
    main()
