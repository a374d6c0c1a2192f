"""Cold tier: objects in an S3-compatible store (boto3, blocking calls in a thread pool), or, when no S3
endpoint is configured, files in a local folder with the same object layout.

Layout: <prefix>ru/v2/<model_tag>/<tenant_tag>/<block_hash_hex>.kru (kite_shared.tiers.keys). Credentials come from
boto3's own sources (AWS_* environment, shared config/profile, instance role) and are never logged.
"""

from __future__ import annotations

import asyncio
import logging
import os
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, TypeVar

import boto3
from botocore.config import Config as BotoConfig
from botocore.exceptions import ClientError

from kite_shared.tiers.base import RemoteTier, StoredBlock
from kite_shared.tiers.keys import BlockKey, object_key, object_prefix, parse_object_key

log = logging.getLogger(__name__)
T = TypeVar("T")
_NOT_FOUND = {"404", "NoSuchKey", "NotFound"}


class _ThreadedTier(RemoteTier):
    def __init__(self, timeout_s: float, backoff_max_s: float, initial_backoff_s: float,
                 threads: int) -> None:
        super().__init__(timeout_s, backoff_max_s, initial_backoff_s)
        # Own pool: slow S3 calls must not occupy the loop's default executor other code relies on.
        self._executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix=f"kite-{self.name}")

    async def _run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, lambda: fn(*args, **kwargs))

    async def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


class S3Tier(_ThreadedTier):
    """Reads are ranged GETs into one buffer allocated at the object's size: a unit up to `part_bytes`
    is one GET; a larger one (a 16-token block of a 7B model is 8 MiB) is read as parts on concurrent
    connections, as s3transfer does, because one S3 connection delivers about 100 MB/s. Every part after
    the first names the first part's ETag (If-Match), so a unit replaced between parts reads as a miss,
    never as a splice of two versions."""

    name = "cold"

    def __init__(self, endpoint: str, bucket: str, prefix: str = "kite/", region: str = "us-east-1",
                 timeout_s: float = 5.0, backoff_max_s: float = 30.0, initial_backoff_s: float = 0.5,
                 threads: int = 16, part_bytes: int = 8 << 20) -> None:
        super().__init__(timeout_s, backoff_max_s, initial_backoff_s, threads)
        self.part_bytes = part_bytes
        self.endpoint = endpoint
        self.bucket = bucket
        self.prefix = prefix
        self.region = region
        # Two clients, because botocore's read timeout is per client and a thread stays blocked until it
        # fires (the tier's deadline only stops waiting for the thread): reads end at the tier's timeout,
        # writes, deletes and listings at its background timeout (see kite_shared.tiers.base).
        session = boto3.session.Session()
        self._s3 = self._client(session, timeout_s, threads)
        self._s3_background = self._client(session, self.background_timeout_s, threads)

    def _client(self, session: boto3.session.Session, read_timeout_s: float, threads: int) -> Any:
        # One attempt per call: the tier's backoff handles failures, botocore retries would hide them.
        # total_max_attempts counts the first attempt; botocore's `max_attempts` counts retries only
        # (max_attempts=1 meant a second attempt after a jittered sleep of up to 1 s).
        return session.client(
            "s3", endpoint_url=self.endpoint or None, region_name=self.region,
            config=BotoConfig(connect_timeout=self.timeout_s, read_timeout=read_timeout_s,
                              retries={"total_max_attempts": 1, "mode": "standard"},
                              max_pool_connections=threads))

    def describe(self) -> str:
        return f"s3 {self.endpoint} bucket {self.bucket} prefix {self.prefix!r}"

    async def ensure_bucket(self) -> bool:
        """Create the bucket when it does not exist (convenient for MinIO/moto); False on failure."""
        return await self._op("ensure_bucket", lambda: self._run(self._ensure_bucket), False)

    def _ensure_bucket(self) -> bool:
        try:
            self._s3.head_bucket(Bucket=self.bucket)
            return True
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") not in _NOT_FOUND:
                raise
        kwargs: dict[str, Any] = {"Bucket": self.bucket}
        if self.region != "us-east-1":
            kwargs["CreateBucketConfiguration"] = {"LocationConstraint": self.region}
        self._s3.create_bucket(**kwargs)
        log.info("cold tier: created bucket %s", self.bucket)
        return True

    async def _get(self, key: BlockKey) -> bytearray | None:
        name = object_key(self.prefix, key)
        first = await self._run(self._get_first_part, name)
        if first is None:
            return None
        buffer, etag = first
        view = memoryview(buffer)
        rest = range(self.part_bytes, len(buffer), self.part_bytes)
        parts = await asyncio.gather(*(self._run(self._read_part, name, etag, view[start:start + self.part_bytes],
                                                 start) for start in rest))
        return buffer if all(parts) else None

    def _get_first_part(self, name: str) -> tuple[bytearray, str] | None:
        """(a buffer of the object's size holding its first part, the object's ETag), or None if absent."""
        try:
            reply = self._s3.get_object(Bucket=self.bucket, Key=name, Range=f"bytes=0-{self.part_bytes - 1}")
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in _NOT_FOUND | {"InvalidRange"}:  # absent, or empty
                return None
            raise
        content_range = reply.get("ContentRange")  # "bytes 0-8388607/10485760"; absent if Range was ignored
        size = int(content_range.rsplit("/", 1)[1]) if content_range else reply["ContentLength"]
        buffer = bytearray(size)
        _read_exactly(reply["Body"], memoryview(buffer)[:reply["ContentLength"]])
        return buffer, reply["ETag"]

    def _read_part(self, name: str, etag: str, into: memoryview, start: int) -> bool:
        """Fill `into` with the object's bytes from `start`; False if the object changed since its first
        part (or is gone)."""
        try:
            reply = self._s3.get_object(Bucket=self.bucket, Key=name, IfMatch=etag,
                                        Range=f"bytes={start}-{start + into.nbytes - 1}")
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in _NOT_FOUND | {"PreconditionFailed", "412"}:
                log.info("cold tier: %s changed while read in parts; a miss", name)
                return False
            raise
        if reply["ContentLength"] != into.nbytes:
            log.warning("cold tier: %s part at %d is %d bytes, expected %d; a miss", name, start,
                        reply["ContentLength"], into.nbytes)
            return False
        _read_exactly(reply["Body"], into)
        return True

    async def _put(self, key: BlockKey, data: bytes | memoryview, pinned: bool) -> None:
        # botocore takes bytes or a file, not a view (a hot file's unit demoted or archived from the pool).
        body = data if isinstance(data, bytes) else bytes(data)
        await self._run(self._s3_background.put_object, Bucket=self.bucket, Key=object_key(self.prefix, key),
                        Body=body)

    async def _delete(self, keys: list[BlockKey]) -> int:
        return await self._run(self._delete_sync, keys)

    def _delete_sync(self, keys: list[BlockKey]) -> int:
        deleted = 0
        for start in range(0, len(keys), 1000):  # DeleteObjects takes at most 1000 keys
            batch = [{"Key": object_key(self.prefix, k)} for k in keys[start:start + 1000]]
            reply = self._s3_background.delete_objects(Bucket=self.bucket, Delete={"Objects": batch,
                                                                                   "Quiet": True})
            errors = reply.get("Errors", [])
            if errors:
                log.warning("cold tier: %d of %d deletes failed, first: %s", len(errors), len(batch),
                            errors[0].get("Message"))
            deleted += len(batch) - len(errors)
        return deleted

    async def _exists(self, key: BlockKey) -> bool:
        return await self._run(self._exists_sync, object_key(self.prefix, key))

    def _exists_sync(self, name: str) -> bool:
        try:
            self._s3.head_object(Bucket=self.bucket, Key=name)
            return True
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in _NOT_FOUND:
                return False
            raise

    async def _ping(self) -> None:
        await self._run(self._s3.head_bucket, Bucket=self.bucket)

    async def _list_page(self, model_tag: str | None, cursor: object | None
                         ) -> tuple[list[StoredBlock], object | None]:
        kwargs: dict[str, Any] = {"Bucket": self.bucket, "Prefix": object_prefix(self.prefix, model_tag),
                                  "MaxKeys": 1000}
        if cursor is not None:
            kwargs["ContinuationToken"] = cursor
        reply = await self._run(self._s3_background.list_objects_v2, **kwargs)
        now = time.time()
        items = []
        for obj in reply.get("Contents", []):
            key = parse_object_key(self.prefix, obj["Key"])
            if key is not None:
                items.append(StoredBlock(key, int(obj["Size"]), max(0.0, now - obj["LastModified"].timestamp())))
        return items, (reply.get("NextContinuationToken") if reply.get("IsTruncated") else None)


def _read_exactly(body, into: memoryview) -> None:
    """Read a response body straight into `into` (no intermediate bytes); a short body raises."""
    try:
        filled = 0
        while filled < into.nbytes:
            count = body.readinto(into[filled:])
            if count == 0:
                raise OSError(f"response body ended after {filled} of {into.nbytes} bytes")
            filled += count
    finally:
        body.close()


class LocalDirTier(_ThreadedTier):
    """The cold tier in a local folder; a hit touches the file's mtime so idle time survives restarts."""

    name = "cold"

    def __init__(self, root: Path | str, prefix: str = "kite/", timeout_s: float = 5.0,
                 backoff_max_s: float = 30.0, initial_backoff_s: float = 0.5, threads: int = 4) -> None:
        super().__init__(timeout_s, backoff_max_s, initial_backoff_s, threads)
        self.root = Path(root).expanduser()
        self.prefix = prefix

    def describe(self) -> str:
        return f"local folder {self.root} prefix {self.prefix!r}"

    def _path(self, key: BlockKey) -> Path:
        return self.root / object_key(self.prefix, key)

    async def ensure_bucket(self) -> bool:
        async def do() -> bool:
            await self._run(lambda: self.root.mkdir(parents=True, exist_ok=True))
            return True
        return await self._op("ensure_dir", do, False)

    async def _get(self, key: BlockKey) -> bytes | None:
        return await self._run(self._get_sync, self._path(key))

    @staticmethod
    def _get_sync(path: Path) -> bytes | None:
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        try:
            os.utime(path)
        except FileNotFoundError:  # deleted concurrently; the bytes read are still whole
            pass
        return data

    async def _put(self, key: BlockKey, data: bytes, pinned: bool) -> None:
        await self._run(self._put_sync, self._path(key), data)

    @staticmethod
    def _put_sync(path: Path, data: bytes) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        # Write then rename, so a reader never sees half a unit (a crash leaves only a temp file).
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    async def _delete(self, keys: list[BlockKey]) -> int:
        return await self._run(self._delete_sync, [self._path(k) for k in keys])

    @staticmethod
    def _delete_sync(paths: list[Path]) -> int:
        deleted = 0
        for path in paths:
            try:
                path.unlink()
                deleted += 1
            except FileNotFoundError:
                pass
        return deleted

    async def _exists(self, key: BlockKey) -> bool:
        return await self._run(self._path(key).is_file)

    async def _ping(self) -> None:
        await self._run(self._ping_sync)

    def _ping_sync(self) -> None:
        if not self.root.is_dir():
            raise FileNotFoundError(f"cold folder {self.root} is missing")

    async def _list_page(self, model_tag: str | None, cursor: object | None
                         ) -> tuple[list[StoredBlock], object | None]:
        return await self._run(self._list_all, model_tag), None

    def _list_all(self, model_tag: str | None) -> list[StoredBlock]:
        base = self.root / object_prefix(self.prefix, model_tag)
        now = time.time()
        items = []
        if not base.is_dir():
            return items
        for dirpath, _, files in os.walk(base):
            for fname in files:
                path = Path(dirpath) / fname
                key = parse_object_key(self.prefix, path.relative_to(self.root).as_posix())
                if key is None:
                    continue
                try:
                    st = path.stat()
                except FileNotFoundError:
                    continue
                items.append(StoredBlock(key, st.st_size, max(0.0, now - st.st_mtime)))
        return items
