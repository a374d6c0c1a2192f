"""The real `python -m kite_ru_pool` process: serves over NATS, exposes /metrics, survives a restart
(Redis and S3 stay up) with its index rebuilt, and drains on SIGTERM."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import urllib.request
import uuid

import nats

from kite_cli.local_servers import free_port
from kite_shared.messages import Ping, PoolAdminReply, Pong
from kite_shared import subjects
from kite_shared.tiers.pool_client import PoolClient
from tests.helpers import new_fp, pool_stats_async, unit_chain, wait_until_async


def start_pool(env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "kite_ru_pool"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


async def wait_ready(nc, proc: subprocess.Popen, timeout_s: float = 20.0) -> None:
    """Until the process answers stats with its index rebuilt; a process that exits fails with its stderr."""
    async def stats() -> PoolAdminReply:
        assert proc.poll() is None, proc.stderr.read().decode()
        return await pool_stats_async(nc, timeout_s=0.5)

    await wait_until_async(stats, timeout_s, "the ru-pool process ready (index rebuilt)", interval_s=0.1,
                           done=lambda s: s.counters.get("rebuilding") == 0,
                           ignore=(nats.errors.Error, asyncio.TimeoutError, OSError))


def stop(proc: subprocess.Popen) -> str:
    proc.send_signal(signal.SIGTERM)
    try:
        _, err = proc.communicate(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
        raise AssertionError("ru-pool did not stop on SIGTERM")
    assert proc.returncode == 0, err.decode()
    return err.decode()


async def test_process_serves_restarts_with_its_index_and_exports_metrics(nats_server, redis_server,
                                                                          s3_server):
    metrics_port = free_port()
    env = dict(os.environ, KITE_NATS_URL=nats_server.url, KITE_REDIS_URL=f"{redis_server.url}/15",
               KITE_S3_ENDPOINT=s3_server.url, KITE_S3_BUCKET="kite-proc",
               KITE_S3_PREFIX=f"proc-{uuid.uuid4().hex[:6]}/", KITE_METRICS_PORT=str(metrics_port),
               KITE_POOL_SWEEP_INTERVAL_S="0.2", KITE_LOG_LEVEL="INFO")
    fp = new_fp()
    blocks = unit_chain(fp, 5)
    hashes = [h for h, _ in blocks]
    nc = await nats.connect(nats_server.url)
    client = PoolClient(nc, lookup_timeout_s=2.0)
    proc = start_pool(env)
    try:
        await wait_ready(nc, proc)
        pong = Pong.decode((await nc.request(subjects.ping("ru-pool"), Ping().encode(), timeout=2)).data)
        assert pong.service == "ru-pool"
        for _, data in blocks:
            await client.put(data)
        r = await wait_until_async(lambda: client.lookup(fp, hashes), 10, "the 5 blocks in warm",
                                   done=lambda r: r.warm >= 5)
        assert r.hot == 5
        body = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
        assert "kite_pool_lookup_seconds_count" in body
        assert "kite_pool_event_loop_lag_seconds_count" in body  # the loop-lag probe runs (issue 4)
        assert 'kite_tier_bytes_total{direction="write",tier="warm"}' in body
        # Full collections are timed, the two that freeze the startup heap (kite_shared.service) first.
        full_collections = re.search(r"^kite_gc_full_collection_seconds_count (\S+)$", body, re.M)
        assert full_collections and float(full_collections.group(1)) >= 2, body
        log = stop(proc)
        assert "ru-pool stopped" in log
        assert "ru-pool before setup: froze" in log and "ru-pool after setup: froze" in log
        assert "GC collected and froze" in log  # after the index rebuild (kite_ru_pool.gc_freeze)

        proc = start_pool(env)  # Redis and S3 stayed up: the index comes back from them
        await wait_ready(nc, proc)
        r = await client.lookup(fp, hashes)
        assert (r.hot, r.warm, r.pool) == (0, 5, 5)
        assert await client.get(fp, hashes) == [d for _, d in blocks]
        stop(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
        await nc.close()
