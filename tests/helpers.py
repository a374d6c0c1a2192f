"""The tests' shared helpers, defined here once: waiting for a condition, asking the ru-pool for its stats over
NATS, and chains of signed blocks whose hashes come from the production fingerprint code.

tests/unit/test_test_helpers_once.py fails when a test module defines its own function under one of these
names (or the names the copies had before), so a new test imports from here instead of writing another
polling loop with its own message.
"""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import math
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any, Awaitable, Callable, TypeVar

import nats

from kite_shared import subjects
from kite_shared.fingerprint import block_hash_chain
from kite_shared.messages import PoolAdminReply, PoolAdminRequest
from kite_shared.recyclable_unit import RecyclableUnit
from kite_shared.security import ru_key, tenant_tag

T = TypeVar("T")

BLOCK_TOKENS = 16  # tokens per block of the chains below, as KITE_BLOCK_SIZE's default
CHAIN_SHAPE = (2, 2, 1, BLOCK_TOKENS, 4)  # [layers, key/value, kv heads, tokens, head dim]


# --- waiting -------------------------------------------------------------------------------------------------
class _Wait:
    """What wait_until and wait_until_async share: the deadline, the verdict on each probe, the message."""

    def __init__(self, timeout_s: float, what: str, done: Callable[[Any], Any],
                 context: Callable[[], object] | None, describe: Callable[[Any], object] = repr) -> None:
        self.timeout_s, self.what, self.done, self.context = timeout_s, what, done, context
        self.describe = describe
        self.deadline = time.monotonic() + timeout_s
        self.expired = False

    def start_round(self) -> None:
        # Taken before the probe: a probe that starts in time gets its verdict, however long it takes.
        self.expired = time.monotonic() >= self.deadline

    def over(self, value: Any, failed: bool) -> bool:
        """Whether `value` ends the wait; AssertionError when it does not and the deadline has passed."""
        if not failed and self.done(value):
            return True
        if self.expired:
            seen = repr(value) if failed else self.describe(value)
            message = f"timed out after {self.timeout_s:g} s waiting for {self.what}; last value seen: {seen}"
            if self.context is not None:
                message += f"\n{self.context()}"
            raise AssertionError(message)
        return False


def wait_until(probe: Callable[[], T], timeout_s: float, what: str, *, done: Callable[[T], Any] = bool,
               interval_s: float = 0.1, ignore: tuple[type[BaseException], ...] = (),
               context: Callable[[], object] | None = None, describe: Callable[[T], object] = repr) -> T:
    """Call `probe` every `interval_s` until `done(value)` holds, and return that value.

    `probe` runs at least once, and once more at or after the deadline, so a slow probe never times out a
    condition that held. An exception of a type in `ignore` counts as "not yet" (a service still starting);
    any other propagates. On timeout: AssertionError naming `what`, the last value (or ignored exception)
    seen and, when given, `context()` (process logs, say), so a red test says what it was waiting for.
    `describe(value)` is how the last value is shown (default repr: pass one where the repr says little,
    as a response's, whose body says more).

    A condition that must hold "for long enough" keeps that state in the probe (a closure); a check that
    must fail at once (a process that exited, a wrong answer on the way) is an assert inside the probe.
    tests/unit/test_test_helpers_once.py fails on a hand-written deadline loop outside this file.
    """
    wait = _Wait(timeout_s, what, done, context, describe)
    while True:
        wait.start_round()
        try:
            value, failed = probe(), False
        except ignore as exc:
            value, failed = exc, True
        if wait.over(value, failed):
            return value
        time.sleep(interval_s)


async def wait_until_async(probe: Callable[[], T | Awaitable[T]], timeout_s: float, what: str, *,
                           done: Callable[[T], Any] = bool, interval_s: float = 0.05,
                           ignore: tuple[type[BaseException], ...] = (),
                           context: Callable[[], object] | None = None,
                           describe: Callable[[T], object] = repr) -> T:
    """`wait_until` on the running event loop: `probe` may return an awaitable (an `async def` or a lambda
    around a request), which is awaited; the loop sleeps with asyncio.sleep, so callbacks keep running."""
    wait = _Wait(timeout_s, what, done, context, describe)
    while True:
        wait.start_round()
        value: Any
        failed = False
        try:
            value = probe()
            if inspect.isawaitable(value):
                value = await value
        except ignore as exc:
            value, failed = exc, True
        if wait.over(value, failed):
            return value
        await asyncio.sleep(interval_s)


def wait_for_log(path: Path, text: str, proc: subprocess.Popen, timeout_s: float = 30.0) -> str:
    """Until `text` is in the log file at `path` of the running `proc`; returns the log. A process that exits
    first fails with its log; a timeout shows the log's end."""
    def logged() -> bool:
        log = path.read_text(errors="replace")
        assert text in log or proc.poll() is None, log
        return text in log

    wait_until(logged, timeout_s, f"{text!r} in {path}", interval_s=0.05,
               context=lambda: path.read_text(errors="replace")[-3000:])
    return path.read_text(errors="replace")


# --- the ru-pool's stats over NATS ---------------------------------------------------------------------------
async def pool_stats_async(nc: nats.NATS, replica: str | None = None, timeout_s: float = 5.0) -> PoolAdminReply:
    """The ru-pool's `stats` admin reply: from whichever replica the queue group picks, or from `replica` on
    its own subject (subjects.pool_replica). No answer within `timeout_s`: nats' TimeoutError."""
    subject = subjects.POOL_ADMIN if replica is None else subjects.pool_replica(replica, "admin")
    msg = await nc.request(subject, PoolAdminRequest(op="stats").encode(), timeout=timeout_s)
    return PoolAdminReply.decode(msg.data)


def pool_stats(nats_url: str, replica: str | None = None, timeout_s: float = 5.0) -> PoolAdminReply:
    """`pool_stats_async` from synchronous code, on a connection and event loop of its own (not set as the
    current loop: pytest-asyncio's session loop stays as it is). Errors as nats raises them (connection
    refused, timeout): callers that poll a restarting pool pass them to wait_until's `ignore`."""
    async def ask() -> PoolAdminReply:
        nc = await nats.connect(nats_url, connect_timeout=min(timeout_s, 5.0), max_reconnect_attempts=0,
                                allow_reconnect=False)
        try:
            return await pool_stats_async(nc, replica, timeout_s)
        finally:
            await nc.close()

    loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(ask())
    finally:
        loop.close()


# --- hash chains ----------------------------------------------------------------------------------------------
def new_fp() -> str:
    """A fresh model fingerprint (hex of a 32-byte root), so tests sharing a pool never share blocks."""
    return hashlib.sha256(uuid.uuid4().bytes).hexdigest()


def chain_tokens(num_blocks: int) -> list[int]:
    """The token ids of the chains below: the same for every chain, so equal prefixes hash equal."""
    return list(range(num_blocks * BLOCK_TOKENS))


def chain_hashes(fp: str, num_blocks: int, cache_salt: str = "") -> list[bytes]:
    """Block hashes of `chain_tokens(num_blocks)` under the model fingerprint `fp`, computed as workers do
    (kite_shared.fingerprint.block_hash_chain; a fingerprint is the hex of its root, ModelIdentity)."""
    return [bytes(h) for h in block_hash_chain(chain_tokens(num_blocks), BLOCK_TOKENS, bytes.fromhex(fp),
                                               cache_salt)]


def default_payload(shape: tuple[int, ...]) -> Callable[[int], bytes]:
    """fp16-sized bytes that differ per block index."""
    num_bytes = math.prod(shape) * 2
    return lambda i: bytes((i * 13 + j) % 251 for j in range(num_bytes))


def unit_chain(fp: str, num_blocks: int, *, key: bytes | None = None, tenant: str | None = None,
               shape: tuple[int, ...] = CHAIN_SHAPE, payload: Callable[[int], bytes] | None = None,
               **unit_fields: Any) -> list[tuple[bytes, bytes]]:
    """(block hash, encoded unit signed with `key`, by default this process's ru_key()) for a chain of
    `num_blocks` fp16 blocks of `fp`.

    Hashes and parents are chain_hashes' (block 0's parent is the root, as workers store it). With a
    `tenant`, its name is block 0's cache salt and its tag the units' tenant tag, so two tenants' chains
    differ as production's do; without, the salt is "" and the tag RecyclableUnit's default (anonymous).
    `payload(i)` gives block i's bytes (default: default_payload(shape)); `unit_fields` go to every
    RecyclableUnit (warm_codec, cold_codec, ...).
    """
    payload = payload or default_payload(shape)
    key = ru_key() if key is None else key
    if tenant is not None:
        unit_fields["tenant_tag"] = tenant_tag(tenant)
    parent = bytes.fromhex(fp)
    out = []
    for i, block_hash in enumerate(chain_hashes(fp, num_blocks, tenant or "")):
        unit = RecyclableUnit(block_hash=block_hash, parent_hash=parent, model_fingerprint=fp, block_index=i,
                              num_tokens=BLOCK_TOKENS, codec="fp16", shape=shape, payload=payload(i),
                              **unit_fields)
        out.append((block_hash, unit.encode(key=key)))
        parent = block_hash
    return out
