"""`kite adapter ...`: LoRA adapters (docs/adapters.md): their declaration, and loading them at run time.

    kite adapter declare FOLDER   write FOLDER/kite-adapter.json for the configured base model (KITE_MODEL_*,
                                  KITE_BLOCK_SIZE): the facts a worker checks before it serves the adapter;
                                  refused (exit 1) when the adapter's own files do not fit that base
    kite adapter check FOLDER     check FOLDER against the configured base as a worker would at start; prints
                                  the adapter's digest, or the field that does not match (exit 1)
    kite adapter load NAME FOLDER [--nats-url URL] [--wait S]
    kite adapter unload NAME [--nats-url URL] [--wait S]
                                  ask every fingerprinter and worker on the bus to serve (or stop serving)
                                  the adapter; each checks the declaration itself and answers. FOLDER is the
                                  path as those processes see it. Prints one JSON answer per process; exit 0
                                  when at least one fingerprinter and one worker answered and none refused,
                                  1 when one refused, 2 when none answered. A load that succeeded is kept in
                                  the JetStream bucket kite_adapters, which processes that start later load
                                  (kite_shared/adapter_store.py); an unload removes it from there.

Run declare and check with the configuration the workers have: a declaration written for another base is
refused. The NATS server of load and unload is found as for `kite pool` (--nats-url, KITE_NATS_URL, the
running `kite run` stack's).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

from kite_cli.stack import admin_nats_url
from kite_shared import adapters, model_store, subjects
from kite_shared.adapter_store import AdapterStore
from kite_shared.config import CommonConfig, ModelConfig, load
from kite_shared.messages import AdapterAdminReply, AdapterAdminRequest, MessageError
from kite_shared.service import connect_nats


async def ask_everyone(nats_url: str, request: AdapterAdminRequest, wait_s: float) -> list[AdapterAdminReply]:
    """Publish `request` with a reply inbox and gather every answer that comes within `wait_s`; then keep
    the fleet's adapter set for processes that start later (a load only when everyone loaded it)."""
    nc = await connect_nats(nats_url, "kite-adapter-admin", load(CommonConfig), allow_reconnect=False)
    replies: list[AdapterAdminReply] = []
    try:
        replies = await _gather(nc, request, wait_s)
        if request.op == "unload":
            await AdapterStore(nc).remove(request.name)
        elif succeeded(replies):
            await AdapterStore(nc).save(request.name, request.path)
    finally:
        await nc.close()
    return replies


def succeeded(replies: list[AdapterAdminReply]) -> bool:
    """Every process that answered agreed, and at least one fingerprinter and one worker did."""
    return all(r.ok for r in replies) and {r.service for r in replies} >= {"fingerprinter", "worker"}


async def _gather(nc, request: AdapterAdminRequest, wait_s: float) -> list[AdapterAdminReply]:
    replies: list[AdapterAdminReply] = []
    inbox = nc.new_inbox()
    subscription = await nc.subscribe(inbox)
    await nc.publish(subjects.ADAPTER_ADMIN, request.encode(), reply=inbox)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    while (left := deadline - loop.time()) > 0:
        try:
            msg = await subscription.next_msg(timeout=left)
        except asyncio.TimeoutError:
            break
        try:
            replies.append(AdapterAdminReply.decode(msg.data))
        except MessageError as exc:
            print(f"kite adapter: an answer could not be read: {exc}", file=sys.stderr)
    await subscription.unsubscribe()
    return replies


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kite adapter", description="LoRA adapters: declarations, and loading them at run time")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, text in (("declare", "write FOLDER/kite-adapter.json for the configured base model"),
                       ("check", "check FOLDER against the configured base model")):
        cmd = sub.add_parser(name, help=text)
        cmd.add_argument("folder", type=Path, help="a peft LoRA folder (adapter_config.json + weights)")
        cmd.add_argument("--name", default="adapter", help="the name it would be served under (check)")
    for name, text in (("load", "serve the adapter in FOLDER as NAME on every fingerprinter and worker"),
                       ("unload", "stop serving the adapter NAME")):
        cmd = sub.add_parser(name, help=text)
        cmd.add_argument("name")
        if name == "load":
            cmd.add_argument("folder", help="the peft folder, as the services see it")
        cmd.add_argument("--nats-url", default=None)
        cmd.add_argument("--wait", type=float, default=3.0, help="seconds to gather answers (default 3)")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.command in ("load", "unload"):
        request = AdapterAdminRequest(op=args.command, name=args.name, path=getattr(args, "folder", ""))
        replies = asyncio.run(ask_everyone(admin_nats_url(args.nats_url)[0], request, args.wait))
        for reply in replies:
            print(json.dumps(reply.model_dump(mode="json"), sort_keys=True))
        if not replies:
            print("kite adapter: no fingerprinter or worker answered", file=sys.stderr)
            return 2
        return 0 if succeeded(replies) else 1
    cfg = load(ModelConfig)
    local = model_store.prepare(cfg)
    try:
        if args.command == "declare":
            print(adapters.declare(args.folder, local, cfg.block_size))
            return 0
        adapter = adapters.load_adapter(args.name, args.folder, model_store.identity(local, cfg), local,
                                        cfg.block_size)
    except adapters.AdapterRefused as exc:
        print(exc, file=sys.stderr)
        return 1
    print(f"{adapter.name}: compatible with {local.name}; digest {adapter.digest}, rank {adapter.rank}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
