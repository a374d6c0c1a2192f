"""`kite pool ...`: administer the ru-pool over NATS (stats, clear, pin, unpin, evict, purge).

    kite pool stats [--tenant NAME]
    kite pool clear [--model FINGERPRINT] [--tenant NAME]
    kite pool pin   --model FINGERPRINT [--tenant NAME] HASH_HEX [HASH_HEX ...]
    kite pool pin   (--prompt TEXT | --messages FILE.json) [--tenant NAME] [--cache-salt SALT]
    kite pool unpin ... (the same selectors as pin)
    kite pool evict ... (the same selectors as pin): delete the blocks from hot, warm, cold and the index
    kite pool purge --model FINGERPRINT

--prompt / --messages select the blocks a request with that prompt (a completion's text, or a chat's
OpenAI `messages` list: a JSON list, or an object with a "messages" key) would have: they are
fingerprinted here by the fingerprinter's own code (`kite_fingerprinter.__main__.build_core`: the same
chat template, tokenizer, model fingerprint and block size, from the same KITE_MODEL_* / KITE_BLOCK_SIZE
/ KITE_ENGINE settings as the fingerprinter, so run this where those match), with the cache salt the
gateway derives for the tenant (`kite_shared.security.tenant_cache_salt(tenant, cache_salt)`; the tenant
defaults to anonymous, as with auth off). `--model`, if given too, must equal the computed fingerprint.

The NATS server: --nats-url, else KITE_NATS_URL when set, else the one of the stack `kite run` runs on
this machine (it records it in ~/.cache/kite/kite-run.json while it runs), else nats://127.0.0.1:4222.

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
from typing import TYPE_CHECKING, Callable, Sequence

from kite_cli.stack import admin_nats_url
from kite_shared.config import CommonConfig, load
from kite_shared.messages import ChatMessage, GenerateRequest, PoolAdminRequest, SamplingParams
from kite_shared.security import ANONYMOUS_TENANT, tenant_cache_salt

if TYPE_CHECKING:
    from kite_fingerprinter.core import Fingerprinter


SELECTOR_OPS = ("pin", "unpin", "evict")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kite pool", description="Administer the ru-pool.")
    p.add_argument("--nats-url", default=None, help="NATS URL (default: KITE_NATS_URL when set, else the "
                   "running `kite run` stack's, else nats://127.0.0.1:4222)")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for the pool")
    sub = p.add_subparsers(dest="op", required=True)
    stats = sub.add_parser("stats", help="blocks, bytes and hit rate per tier, counters, tenant usage")
    stats.add_argument("--tenant", default="", help="show only this tenant's usage and quota")
    clear = sub.add_parser("clear", help="delete all blocks, or those of one model and/or tenant, from "
                                         "every tier")
    clear.add_argument("--model", default="", help="model fingerprint (hex); default: every model")
    clear.add_argument("--tenant", default="", help="tenant name; default: every tenant")
    for name, text in (("pin", "never evict or expire these blocks"), ("unpin", "let them age again"),
                       ("evict", "delete these blocks from every tier and the index (pins included): "
                                 "the pool serves them no more")):
        sp = sub.add_parser(name, help=text, description=f"{text}. Select the blocks by hashes (with "
                            "--model) or by the prompt a request would send (--prompt or --messages).")
        sp.add_argument("--model", default="", help="model fingerprint (hex); required with hashes, "
                        "computed from the model configuration with --prompt / --messages")
        sp.add_argument("--tenant", default="", help="tenant whose blocks these are (default: anonymous)")
        sp.add_argument("--cache-salt", default="", help="the client cache_salt the requests carry (with "
                        "--prompt / --messages; combined with the tenant as the gateway does)")
        which = sp.add_mutually_exclusive_group()
        which.add_argument("--prompt", default=None, help="the prompt text of a completion request")
        which.add_argument("--messages", default=None, metavar="FILE.json",
                           help="a chat request's OpenAI `messages` (a JSON list, or an object with a "
                                "\"messages\" key); '-' reads standard input")
        sp.add_argument("hashes", nargs="*", help="block hashes (64 hex digits each), a chain prefix")
    purge = sub.add_parser("purge", help="delete a model's blocks everywhere and never serve it again")
    purge.add_argument("--model", required=True, help="model fingerprint (hex)")
    return p


def read_messages(text: str) -> list[ChatMessage]:
    """An OpenAI `messages` list (or a request body holding one) as the gateway turns it into
    GenerateRequest.messages: validated by its own schema (`ChatMessageIn.to_message`)."""
    from pydantic import TypeAdapter, ValidationError

    from kite_gateway.openai_protocol import ChatMessageIn

    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--messages: not JSON: {exc}") from None
    if isinstance(data, dict):
        data = data.get("messages")
    if not isinstance(data, list) or not data:
        raise ValueError("--messages: expected a non-empty JSON list of messages, or an object with one "
                         "under \"messages\"")
    try:
        parsed = TypeAdapter(list[ChatMessageIn]).validate_python(data)
    except ValidationError as exc:
        raise ValueError(f"--messages: {exc}") from None
    return [m.to_message() for m in parsed]


def prompt_block_hashes(core: Fingerprinter, *, prompt: str | None = None,
                        messages: list[ChatMessage] | None = None, tenant: str = "",
                        cache_salt: str = "") -> tuple[str, list[bytes]]:
    """(model fingerprint hex, block hashes) of the request the gateway would send the fingerprinter for
    this prompt or these messages from `tenant` (default anonymous) with client salt `cache_salt`,
    computed by the fingerprinter core itself (`Fingerprinter.tokenize`)."""
    if (prompt is None) == (messages is None):
        raise ValueError("give exactly one of prompt and messages")
    tenant = tenant or ANONYMOUS_TENANT
    request = GenerateRequest(
        request_id="kite-pool-admin", model=core.model_name, prompt=prompt, messages=messages,
        sampling=SamplingParams(max_tokens=1), cache_salt=tenant_cache_salt(tenant, cache_salt),
        tenant=tenant, stream_subject="kite-pool-admin")
    from kite_fingerprinter.core import RequestError

    try:
        tokenized = core.tokenize(request)
    except RequestError as exc:
        raise ValueError(f"the fingerprinter would refuse this request: {exc.info.message}") from None
    return tokenized.model_fingerprint, list(tokenized.block_hashes)


def _fingerprinter_core() -> Fingerprinter:
    """The fingerprinter service's core, built by its own code from this environment's settings."""
    from kite_fingerprinter.__main__ import build_core
    from kite_shared.config import ConfigError, FingerprinterConfig, ModelConfig
    from kite_shared.model_store import ModelNotFoundError

    try:
        return build_core(load(ModelConfig), load(FingerprinterConfig))
    except (ConfigError, ModelNotFoundError) as exc:
        raise ValueError(f"cannot load the fingerprinter's model: {exc}") from None


def build_request(args: argparse.Namespace, core: Callable[[], Fingerprinter] = _fingerprinter_core
                  ) -> PoolAdminRequest:
    """The admin request for parsed `args`; `core` makes the fingerprinter core (only called for
    --prompt / --messages)."""
    hashes = []
    for text in getattr(args, "hashes", []) or []:
        try:
            h = bytes.fromhex(text)
        except ValueError:
            raise ValueError(f"not a hex block hash: {text!r}") from None
        if len(h) != 32:
            raise ValueError(f"a block hash is 32 bytes (64 hex digits), got {len(h)}: {text!r}")
        hashes.append(h)
    model = getattr(args, "model", "") or ""
    if args.op in SELECTOR_OPS:
        prompt, messages_file = args.prompt, args.messages
        if prompt is not None or messages_file is not None:
            if hashes:
                raise ValueError(f"{args.op}: give block hashes or --prompt / --messages, not both")
            if messages_file is not None:
                with (sys.stdin if messages_file == "-" else open(messages_file, encoding="utf-8")) as f:
                    messages = read_messages(f.read())
            else:
                messages = None
            fingerprint, hashes = prompt_block_hashes(core(), prompt=prompt, messages=messages,
                                                      tenant=args.tenant, cache_salt=args.cache_salt)
            if model and model != fingerprint:
                raise ValueError(f"--model {model} differs from the fingerprint this configuration gives "
                                 f"({fingerprint}): check KITE_MODEL_* / KITE_ENGINE / KITE_BLOCK_SIZE")
            if not hashes:
                raise ValueError("the prompt is shorter than one block: it has no block hashes")
            model = fingerprint
            print(f"kite pool: {len(hashes)} blocks of model {model}", file=sys.stderr)
        elif not hashes:
            raise ValueError(f"{args.op}: give block hashes, --prompt or --messages")
        elif args.cache_salt:
            raise ValueError("--cache-salt applies to --prompt / --messages only")
        if not model:
            raise ValueError(f"{args.op} with block hashes needs --model")
    return PoolAdminRequest(op=args.op, model_fingerprint=model, block_hashes=hashes,
                            tenant=getattr(args, "tenant", "") or "")


async def _quiet(exc: Exception) -> None:
    """nats.py prints a traceback per failed attempt by default; the one-line message below suffices."""


async def _run(url: str, req: PoolAdminRequest, timeout_s: float, common: CommonConfig,
               source: str = "") -> int:
    # Imported here, so `--help` works without the NATS client loaded.
    from kite_shared.security import redact_url
    from kite_shared.service import connect_nats
    from kite_shared.tiers.pool_client import PoolClient

    try:
        nc = await connect_nats(url, "kite-pool-admin", common, connect_timeout=min(timeout_s, 5.0),
                                max_reconnect_attempts=1, reconnect_time_wait=0.2,
                                allow_reconnect=False, error_cb=_quiet)
    except Exception as exc:  # nats.py raises its own and OS errors for an unreachable server
        where = f" ({source})" if source else ""
        print(f"kite pool: cannot reach NATS at {redact_url(url)}{where}: {type(exc).__name__}; is the stack "
              "running? (`kite run` is found by itself; elsewhere give --nats-url or KITE_NATS_URL)",
              file=sys.stderr)
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
    except (ValueError, OSError) as exc:
        print(f"kite pool: {exc}", file=sys.stderr)
        return 2
    common = load(CommonConfig)
    url, source = admin_nats_url(args.nats_url)
    if "kite run" in source:
        print(f"kite pool: NATS {url}, of {source}", file=sys.stderr)
    return asyncio.run(_run(url, req, args.timeout, common, source))


if __name__ == "__main__":
    sys.exit(main())
