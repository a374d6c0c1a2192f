"""The interface every remote tier (warm, cold) shares, and the policy that keeps tiers off request paths.

Every operation is bounded by a per-tier timeout and guarded by `TierHealth`: an error or timeout marks
the tier down and the operation returns its "miss" value (None / False) instead of raising; while down,
operations return the miss value at once, without I/O, until the backoff allows one probe. Listing (used
by index rebuilds and purges, never by request paths) raises `TierUnavailable` so a rebuild knows it is
incomplete.

Two deadlines. Reads (get, exists, ping) end at the tier's timeout: a request may be waiting on them.
Writes, deletes and listings end at the longer `background_timeout_s`: no request waits on them (only the
ru-pool writes, in the background), and one cut short marks the tier down for nothing and can lose the
block (a write-through that neither warm nor cold took is gone). On a loaded 2-core machine a Redis SET of
369 KB has taken longer than the 0.25 s read timeout.

Reads that feed KV into a model go through `get_verified` / `get_unit`, which decode the unit with the
expected block hash and model fingerprint, and check its HMAC when the tier has `ru_key` (the cluster RU
key; `TierClient.from_config` always sets it). A unit that fails is counted, deleted from the tier and
reported as a miss: corrupted or forged bytes are never loaded.
"""

from __future__ import annotations

import abc
import asyncio
import logging
import os
import re
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import AsyncIterator, Awaitable, Callable, TypeVar

from kite_shared import recyclable_unit
from kite_shared.security import ANONYMOUS_TENANT_TAG
from kite_shared.tiers import metrics
from kite_shared.tiers.health import TierHealth
from kite_shared.tiers.keys import BlockKey

log = logging.getLogger(__name__)
R = TypeVar("R")
_URL_USERINFO = re.compile(r"(\w+://)[^/\s@]+@")

# Batched reads verify their units from this thread, off the event loop, once the whole batch is read
# (`check_units`: a share per core). Measured on this 2-core machine, 128 warm blocks of 369 KB, against
# one bare MGET of all 128 keys, side by side in five runs on 2026-12-04: MGETs of 16 keys, then the
# batch verified a share per core from here, 0.77-0.88x; each MGET's part verified on this one thread
# while the next was received (the design before), 0.75-0.80x. On two cores the parts' verification
# overlapped nothing: Redis sends on one core and the loop receives on the other, so the verification
# thread only took turns with them, and with the loop for the GIL. One thread: `check_units` blocks its
# caller until every share is done, and must not be called from a share's thread.
_VERIFIER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kite-verify")


def _check(data: bytes, block_hash: bytes, model_fingerprint: str, ru_key: bytes | None, tenant_tag: str
           ) -> recyclable_unit.RecyclableUnit | recyclable_unit.RUError:
    """The unit if `data` is the intact unit asked for, else the reason it is not (pure: any thread)."""
    try:
        return recyclable_unit.decode(data, expected_hash=bytes(block_hash), expected_model=model_fingerprint,
                                      key=ru_key, expected_tenant_tag=tenant_tag)
    except recyclable_unit.RUError as exc:
        return exc


# A batch is verified in two steps: every header on the calling thread (format, identity, the header's
# MAC: Python, holding the GIL), then every payload's tag, a contiguous share per core (most of the cost,
# the GIL released), so a forged header costs no hashing and the threads hashing payloads seldom wait for
# the GIL. Measured on this 2-vCPU machine, 128 units of 369 KB, ten rounds side by side (2026-12-04):
# 4.4-6.0 GB/s (mean 4.9), against 3.7-7.2 (mean 4.8, steadier with two steps: it won 7 of 10) for whole
# units decoded a share per thread, and 3.9-4.3 on one thread. The caller's thread verifies the first
# share.
_NUM_CORES = os.cpu_count() or 1
_SHARE_VERIFIERS = ThreadPoolExecutor(max_workers=max(1, _NUM_CORES - 1), thread_name_prefix="kite-verify-share")


def check_units(values: list[bytes | None], block_hashes: list[bytes], model_fingerprint: str,
                ru_key: bytes | None, tenant_tag: str
                ) -> list[recyclable_unit.RecyclableUnit | recyclable_unit.RUError | None]:
    """Each of `values` verified as the unit of the block hash at its index (None stays None), the
    payloads on all cores; blocks the calling thread until every share is done. Never call it from a
    share's thread."""
    outcomes: list[recyclable_unit.RecyclableUnit | recyclable_unit.RUError | None] = []
    pending: list[int] = []  # indices of the units whose header passed, in the order of `checks`
    checks: list[recyclable_unit.PayloadCheck] = []
    for data, block_hash in zip(values, block_hashes):
        if data is None:
            outcomes.append(None)
            continue
        try:
            unit, payload_check = recyclable_unit.decode_header(
                data, expected_hash=bytes(block_hash), expected_model=model_fingerprint, key=ru_key,
                expected_tenant_tag=tenant_tag)
        except recyclable_unit.RUError as exc:
            outcomes.append(exc)
            continue
        pending.append(len(outcomes))
        checks.append(payload_check)
        outcomes.append(unit)
    num_shares = max(1, min(len(checks), _NUM_CORES))
    bounds = [len(checks) * i // num_shares for i in range(num_shares + 1)]
    others = [_SHARE_VERIFIERS.submit(_payload_failures, checks[a:b]) for a, b in zip(bounds[1:-1], bounds[2:])]
    failures = _payload_failures(checks[:bounds[1]])
    for share in others:
        failures += share.result()
    for index, failure in zip(pending, failures):
        if failure is not None:
            outcomes[index] = failure
    return outcomes


def _payload_failures(checks: list[recyclable_unit.PayloadCheck]) -> list[recyclable_unit.RUChecksumError | None]:
    return [payload_check.failure() for payload_check in checks]


def _describe(exc: BaseException) -> str:
    """The client error's own message for a log line (redis-py's repr drops it: "certificate verify
    failed" and "WRONGPASS" matter), with any URL credentials masked, cut to 200 characters."""
    text = _URL_USERINFO.sub(r"\1***@", str(exc)) or "no detail"
    return text if len(text) <= 200 else text[:197] + "..."


class TierUnavailable(RuntimeError):
    """A listing could not complete because the tier is down or failed mid-way."""


@dataclass(frozen=True)
class StoredBlock:
    """One entry found by listing a tier."""

    key: BlockKey
    size: int  # bytes of the encoded unit
    idle_s: float | None  # seconds since the last write or hit, when the tier can tell
    pinned: bool = False  # warm only: stored without expiry


class RemoteTier(abc.ABC):
    """A tier behind the network or the disk; subclasses implement the underscored primitives."""

    name: str = "remote"

    def __init__(self, timeout_s: float, backoff_max_s: float = 30.0, initial_backoff_s: float = 0.5,
                 background_timeout_s: float | None = None) -> None:
        self.timeout_s = timeout_s  # seconds: reads, which a request may wait on
        # seconds: writes, deletes and listings, which no request waits on
        self.background_timeout_s = background_timeout_s or max(10 * timeout_s, 5.0)
        self.health = TierHealth(self.name, initial_backoff_s, backoff_max_s)
        self.integrity_failures = 0
        self.ru_key: bytes | None = None  # cluster RU key: set, units without a valid MAC are misses
        self.hits = 0
        self.misses = 0
        self._on_recover: list[Callable[[], None]] = []

    @property
    def up(self) -> bool:
        return self.health.up

    def on_recover(self, callback: Callable[[], None]) -> None:
        """Call `callback` (synchronously, keep it cheap) each time the tier comes back up."""
        self._on_recover.append(callback)

    # --- primitives -------------------------------------------------------------------------------
    @abc.abstractmethod
    async def _get(self, key: BlockKey) -> bytes | None: ...

    @abc.abstractmethod
    async def _put(self, key: BlockKey, data: bytes, pinned: bool) -> None: ...

    @abc.abstractmethod
    async def _delete(self, keys: list[BlockKey]) -> int: ...

    @abc.abstractmethod
    async def _exists(self, key: BlockKey) -> bool: ...

    @abc.abstractmethod
    async def _list_page(self, model_tag: str | None, cursor: object | None
                         ) -> tuple[list[StoredBlock], object | None]:
        """One page of entries and the cursor of the next page (None when done)."""

    @abc.abstractmethod
    async def _ping(self) -> None: ...

    async def close(self) -> None:  # noqa: B027 - optional hook
        pass

    # --- guarded operations -----------------------------------------------------------------------
    async def _op(self, what: str, fn: Callable[[], Awaitable[R]], miss: R,
                  timeout_s: float | None = None) -> R:
        if not self.health.should_try():
            return miss
        try:
            result = await asyncio.wait_for(fn(), timeout_s or self.timeout_s)
        except asyncio.CancelledError:
            self.health.release_probe()
            raise
        except Exception as exc:  # any client error means the same thing here: treat as down
            if self.health.failure():
                log.warning("%s tier down (%s failed: %s: %s); answering misses, retry in %.1f s",
                            self.name, what, type(exc).__name__, _describe(exc), self.health.backoff_s)
            else:
                log.debug("%s tier still down (%s failed: %s: %s); next retry in %.1f s",
                          self.name, what, type(exc).__name__, _describe(exc), self.health.backoff_s)
            return miss
        if self.health.success():
            log.info("%s tier back up", self.name)
            for callback in self._on_recover:
                try:
                    callback()
                except Exception:
                    log.exception("%s tier recovery callback failed", self.name)
        return result

    async def get(self, key: BlockKey) -> bytes | None:
        """Raw bytes (unverified) or None: absent, down, timed out."""
        return await self._op("get", lambda: self._get(key), None)

    async def put(self, key: BlockKey, data: bytes, pinned: bool = False) -> bool:
        async def do() -> bool:
            await self._put(key, data, pinned)
            return True
        ok = await self._op("put", do, False, self.background_timeout_s)
        if ok:
            metrics.TIER_BYTES.labels(self.name, "write").inc(len(data))
        return ok

    async def delete(self, key: BlockKey) -> bool:
        return await self.delete_many([key]) > 0

    async def delete_many(self, keys: list[BlockKey]) -> int:
        if not keys:
            return 0
        return await self._op("delete", lambda: self._delete(keys), 0, self.background_timeout_s)

    async def exists(self, key: BlockKey) -> bool:
        return await self._op("exists", lambda: self._exists(key), False)

    async def ping(self) -> bool:
        """Probe the tier (respecting the backoff); True when it answered."""
        async def do() -> bool:
            await self._ping()
            return True
        return await self._op("ping", do, False)

    async def iter_keys(self, model_tag: str | None = None) -> AsyncIterator[StoredBlock]:
        """Every stored block (of one model tag, or all). Raises TierUnavailable if it cannot finish."""
        cursor: object | None = None
        while True:
            page = await self._op("list", lambda: self._list_page(model_tag, cursor), None,
                                  self.background_timeout_s)
            if page is None:
                raise TierUnavailable(f"{self.name} tier listing failed or tier is down")
            items, cursor = page
            for item in items:
                yield item
            if cursor is None:
                return

    # --- verified reads ---------------------------------------------------------------------------
    async def get_unit(self, model_fingerprint: str, block_hash: bytes,
                       tenant_tag: str = ANONYMOUS_TENANT_TAG
                       ) -> tuple[recyclable_unit.RecyclableUnit, bytes] | None:
        """The verified unit and its encoded bytes, or None (absent, down, or failed verification:
        then counted in kite_tier_integrity_failures_total and deleted)."""
        started = time.perf_counter()
        key = BlockKey.of(model_fingerprint, block_hash, tenant_tag)
        found = await self._verified(key, await self.get(key), model_fingerprint, block_hash, tenant_tag)
        if found is not None:
            metrics.TIER_FETCH_SECONDS.labels(self.name).observe(time.perf_counter() - started)
        return found

    async def get_units(self, model_fingerprint: str, block_hashes: list[bytes],
                        tenant_tag: str = ANONYMOUS_TENANT_TAG
                        ) -> list[tuple[recyclable_unit.RecyclableUnit, bytes] | None]:
        """`get_unit` for many blocks in one batched read (few round trips where the tier allows it: see
        `_read_batches`), with one timeout for the batch: the tier's timeout plus a quarter of it per
        block, so a batch is never failed for the time its own size takes, and one slow batch marks the
        tier down once (the blocks read by then still count). What was read is then verified together, a
        share per core, off the event loop (`check_units` from `_VERIFIER`), and only then are the hits
        touched (`_touch_later`), so that work never competes with the reader's verification."""
        if not block_hashes:
            return []
        keys = [BlockKey.of(model_fingerprint, h, tenant_tag) for h in block_hashes]
        batch_timeout_s = self.timeout_s * (1 + len(keys) / 4)
        raw: list[bytes | None] = [None] * len(keys)  # what the batch did not read stays a miss

        async def read() -> bool:
            async for start, values in self._read_batches(keys):
                raw[start:start + len(values)] = values
            return True

        await self._op("get", read, False, batch_timeout_s)
        outcomes = await asyncio.get_running_loop().run_in_executor(
            _VERIFIER, check_units, raw, block_hashes, model_fingerprint, self.ru_key, tenant_tag)
        found = [await self._account(key, data, outcome) for key, data, outcome in zip(keys, raw, outcomes)]
        hits = [key for key, unit in zip(keys, found) if unit is not None]
        if hits:
            self._touch_later(hits)
        return found

    def _touch_later(self, keys: list[BlockKey]) -> None:
        """Record, off the reader's path, that these blocks were just read by a batch (a tier that expires
        idle blocks resets their expiry). Default: nothing."""

    async def _read_batches(self, keys: list[BlockKey]) -> AsyncIterator[tuple[int, list[bytes | None]]]:
        """Raw bytes of many keys, in parts as they arrive: (index of the part's first key, its values).
        Tiers with a batched read override this (default: one part, of concurrent gets)."""
        yield 0, list(await asyncio.gather(*(self._get(key) for key in keys)))

    async def _verified(self, key: BlockKey, data: bytes | None, model_fingerprint: str, block_hash: bytes,
                        tenant_tag: str) -> tuple[recyclable_unit.RecyclableUnit, bytes] | None:
        outcome = None if data is None else _check(data, block_hash, model_fingerprint, self.ru_key, tenant_tag)
        return await self._account(key, data, outcome)

    async def _account(self, key: BlockKey, data: bytes | None,
                       outcome: recyclable_unit.RecyclableUnit | recyclable_unit.RUError | None
                       ) -> tuple[recyclable_unit.RecyclableUnit, bytes] | None:
        """Count a read whose verification gave `outcome` (None: nothing read); a unit that failed is
        deleted from the tier. The unit and its bytes on a hit, else None."""
        if data is None or outcome is None:
            self.misses += 1
            metrics.TIER_MISSES.labels(self.name).inc()
            return None
        if isinstance(outcome, recyclable_unit.RUError):
            self.integrity_failures += 1
            self.misses += 1
            metrics.TIER_INTEGRITY_FAILURES.labels(self.name).inc()
            metrics.TIER_MISSES.labels(self.name).inc()
            log.warning("%s tier: block %s failed verification (%s: %s); deleted, treated as a miss",
                        self.name, key.short(), type(outcome).__name__, outcome)
            await self.delete(key)
            return None
        self.hits += 1
        metrics.TIER_HITS.labels(self.name).inc()
        metrics.TIER_BYTES.labels(self.name, "read").inc(len(data))
        return outcome, data

    async def get_verified(self, model_fingerprint: str, block_hash: bytes,
                           tenant_tag: str = ANONYMOUS_TENANT_TAG) -> bytes | None:
        """Encoded bytes of the block after verification, or None (see get_unit)."""
        found = await self.get_unit(model_fingerprint, block_hash, tenant_tag)
        return None if found is None else found[1]
