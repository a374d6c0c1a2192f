"""`kite pool pin|evict --prompt / --messages` against the real `python -m kite_ru_pool` process, a real
nats-server and a real Redis (warm), with a local-folder cold tier: blocks stored for a prompt's
fingerprint are pinned and evicted by prompt, from hot, warm, cold and the index, with the tenant's
accounting exact afterwards; the evicted blocks do not come back after a restart. Tokenizer only, no
model run."""

from __future__ import annotations

import asyncio
import json
import os
import uuid

import nats
import pytest
import redis

from kite_cli import pool_admin
from kite_fingerprinter.__main__ import build_core
from kite_shared.config import FingerprinterConfig, ModelConfig, load
from kite_shared.messages import PoolAdminReply, PoolAdminRequest
from kite_shared.recyclable_unit import RecyclableUnit
from kite_shared.security import ru_key, tenant_tag
from kite_shared.tiers.keys import BlockKey, object_key, redis_key
from kite_shared.tiers.pool_client import PoolClient
from tests.helpers import wait_until_async
from tests.integration.test_ru_pool_process import start_pool, stop, wait_ready

PROMPT = "The quick brown fox jumps over the lazy dog near the riverbank. " * 12
MESSAGES = [{"role": "system", "content": "You answer in one word. " * 15},
            {"role": "user", "content": "Name a colour."}]
PREFIX = "kite/"
REDIS_DB = 12


def units(fp: str, hashes: list[bytes], tenant: str) -> list[bytes]:
    out, parent = [], bytes(32)
    for i, h in enumerate(hashes):
        unit = RecyclableUnit(block_hash=h, parent_hash=parent, model_fingerprint=fp, block_index=i,
                              num_tokens=16, codec="fp16", shape=(2, 2, 1, 16, 4), payload=bytes([i]) * 512,
                              tenant_tag=tenant_tag(tenant))
        out.append(unit.encode(key=ru_key()))
        parent = h
    return out


async def admin(nc, **kw) -> PoolAdminReply:
    return await PoolClient(nc).admin(PoolAdminRequest(**kw), timeout_s=5.0)


async def cli(capsys, argv: list[str]) -> tuple[int, dict]:
    """`kite pool ...` as an operator runs it (its own NATS connection and fingerprinter core)."""
    capsys.readouterr()
    rc = await asyncio.to_thread(pool_admin.main, argv)
    return rc, json.loads(capsys.readouterr().out)


async def wait_lookup(client: PoolClient, fp: str, hashes: list[bytes], **want: int):
    return await wait_until_async(lambda: client.lookup(fp, hashes), 10, f"a lookup answering {want}",
                                  done=lambda r: all(getattr(r, k) == v for k, v in want.items()))


async def test_pin_and_evict_by_prompt_and_messages(nats_server, redis_server, tmp_path, capsys):
    core = build_core(load(ModelConfig), load(FingerprinterConfig))
    fp = core.identity.fingerprint_hex
    tenant = f"acme-{uuid.uuid4().hex[:6]}"
    tag = tenant_tag(tenant)
    messages_file = tmp_path / "messages.json"
    messages_file.write_text(json.dumps(MESSAGES))
    _, a = pool_admin.prompt_block_hashes(core, prompt=PROMPT, tenant=tenant)
    _, b = pool_admin.prompt_block_hashes(core, messages=pool_admin.read_messages(json.dumps(MESSAGES)),
                                          tenant=tenant)
    assert len(a) >= 3 and len(b) >= 2 and not set(a) & set(b)
    a_units, b_units = units(fp, a, tenant), units(fp, b, tenant)
    a_keys = [BlockKey.of(fp, h, tag) for h in a]
    b_keys = [BlockKey.of(fp, h, tag) for h in b]

    # Prompt A's blocks are in cold before the pool starts (its rebuild indexes them); a get promotes
    # them: after that they are in hot, warm and cold.
    cold_dir = tmp_path / "cold"
    for key, data in zip(a_keys, a_units):
        path = cold_dir / object_key(PREFIX, key)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    r_cli = redis.Redis.from_url(f"{redis_server.url}/{REDIS_DB}")
    r_cli.flushdb()
    env = dict(os.environ, KITE_NATS_URL=nats_server.url, KITE_REDIS_URL=f"{redis_server.url}/{REDIS_DB}",
               KITE_S3_ENDPOINT="", KITE_COLD_DIR=str(cold_dir), KITE_S3_PREFIX=PREFIX,
               KITE_POOL_SWEEP_INTERVAL_S="0.2", KITE_LOG_LEVEL="INFO")
    url = ["--nats-url", nats_server.url, "--timeout", "10"]
    nc = await nats.connect(nats_server.url)
    client = PoolClient(nc, lookup_timeout_s=2.0)
    proc = start_pool(env)
    try:
        await wait_ready(nc, proc)
        await wait_lookup(client, fp, a, cold=len(a), pool=len(a))
        assert await client.get(fp, a, tenant=tenant) == a_units
        for data in b_units:
            await client.put(data)
        await wait_lookup(client, fp, a, hot=len(a), warm=len(a), cold=len(a))
        await wait_lookup(client, fp, b, hot=len(b), warm=len(b), pool=len(b))
        usage = (await admin(nc, op="stats", tenant=tenant)).tenants[tag]
        assert (usage.blocks, usage.bytes) == (len(a) + len(b), sum(map(len, a_units + b_units)))

        # Pin B by its messages: warm keeps it without expiry.
        rc, reply = await cli(capsys, url + ["pin", "--messages", str(messages_file), "--tenant", tenant])
        assert rc == 0 and reply["ok"] and reply["affected"] == len(b), reply
        assert [r_cli.pttl(redis_key(k)) for k in b_keys] == [-1] * len(b)

        # Evict A by its prompt: gone from hot, warm, cold and the index; B untouched.
        rc, reply = await cli(capsys, url + ["evict", "--prompt", PROMPT, "--tenant", tenant])
        assert rc == 0 and reply["ok"] and reply["affected"] == len(a), reply
        r = await client.lookup(fp, a)
        assert (r.hot, r.warm, r.cold, r.pool) == (0, 0, 0, 0)
        assert await client.get(fp, a, tenant=tenant) == []
        assert r_cli.exists(*(redis_key(k) for k in a_keys)) == 0
        assert not any((cold_dir / object_key(PREFIX, k)).exists() for k in a_keys)
        r = await client.lookup(fp, b)
        assert (r.hot, r.warm, r.pool) == (len(b), len(b), len(b))
        usage = (await admin(nc, op="stats", tenant=tenant)).tenants[tag]
        assert (usage.blocks, usage.bytes) == (len(b), sum(map(len, b_units)))
        # Another tenant's prompt names other blocks: evicting it leaves this tenant's alone.
        rc, reply = await cli(capsys, url + ["evict", "--messages", str(messages_file), "--tenant", "other"])
        assert rc == 0 and reply["affected"] == 0
        assert (await client.lookup(fp, b)).pool == len(b)

        # Evict B (pinned) by its messages: pins go too.
        rc, reply = await cli(capsys, url + ["evict", "--messages", str(messages_file), "--tenant", tenant])
        assert rc == 0 and reply["ok"] and reply["affected"] == len(b), reply
        assert (await client.lookup(fp, b)).pool == 0
        assert r_cli.exists(*(redis_key(k) for k in b_keys)) == 0
        usage = (await admin(nc, op="stats", tenant=tenant)).tenants[tag]
        assert (usage.blocks, usage.bytes) == (0, 0)

        # The next request computes A's first block and stores it again: a plain put, counted again.
        await client.put(a_units[0])
        await wait_lookup(client, fp, a, hot=1, warm=1, pool=1)
        usage = (await admin(nc, op="stats", tenant=tenant)).tenants[tag]
        assert (usage.blocks, usage.bytes) == (1, len(a_units[0]))
        stop(proc)

        # A restart rebuilds the index from warm and cold: nothing evicted comes back.
        proc = start_pool(env)
        await wait_ready(nc, proc)
        r = await client.lookup(fp, a)
        assert (r.warm, r.cold, r.pool) == (1, 0, 1)
        assert (await client.lookup(fp, b)).pool == 0
        stop(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
        await nc.close()
        r_cli.close()


@pytest.fixture(autouse=True)
def _no_nats_env(monkeypatch):
    """The CLI reads KITE_NATS_* like the services; this test names the URL on the command line."""
    for name in ("KITE_NATS_USER", "KITE_NATS_PASSWORD", "KITE_NATS_TOKEN"):
        monkeypatch.delenv(name, raising=False)
