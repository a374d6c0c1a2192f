"""The ru-pool's layering (docs/ru-pool.md, "Code"): a put, a lookup and a get walk down once, handlers ->
the coordinating layer -> the lower layers, and nothing below calls back up.

Each part's public methods are wrapped with a recorder that notes every entry into a layer (a call from a
part of another layer) with the layer it came from; the pool is core.PoolCore's, with its real hot tier
in memory and a real cold tier in a local folder, answering through the handler table without a bus. The
modules' imports are checked too: the lower layers import nothing of the parts above them, and no two
modules import each other, directly or not.
"""

from __future__ import annotations

import ast
import contextvars
import inspect
from pathlib import Path

import pytest

import kite_ru_pool
from kite_ru_pool.admin import PoolAdmin
from kite_ru_pool.core import PoolCore
from kite_ru_pool.handlers import PoolHandlers
from kite_ru_pool.index import COLD, HOT
from kite_shared.messages import PoolGetRequest, PoolLookupRequest, TierHits
from kite_shared.security import ANONYMOUS_TENANT_TAG
from kite_shared.tiers.client import TierClient
from kite_shared.tiers.cold import LocalDirTier
from kite_shared.tiers.keys import BlockKey
from tests.helpers import unit_chain

KEY = b"k" * 32
FP = "66" * 32
TINY = (1, 2, 1, 16, 1)  # [layers, key/value, kv heads, tokens, head dim]: 64 bytes of fp16
NOW = 1000.0

LOWER = {"index", "tenants", "tier_io", "worker_caches", "records"}
# Who may enter which layer: the handlers only the coordinating layer, the coordinating layer the lower
# ones, and the index its tenants' ledgers (kept in step with its entries). Nothing else, and never up.
ALLOWED = {("handlers", "coordinator")} | {("coordinator", lower) for lower in LOWER} | {("index", "tenants")}

_STACK: contextvars.ContextVar[tuple[str, ...]] = contextvars.ContextVar("ru_pool_layers", default=())


class Recorder:
    """Wraps the public methods of the parts it is given; `entries` lists (from layer, to layer, method)
    for every call that crosses into another layer, in order (background tasks inherit the layers active
    when they were started)."""

    def __init__(self) -> None:
        self.entries: list[tuple[str | None, str, str]] = []

    def wrap(self, part: object, layer: str) -> None:
        for name in dir(type(part)):
            method = getattr(part, name)
            if not name.startswith("_") and inspect.ismethod(method):
                setattr(part, name, self._wrapped(method, layer, f"{type(part).__name__}.{name}"))

    def _enter(self, layer: str, name: str) -> contextvars.Token:
        stack = _STACK.get()
        caller = stack[-1] if stack else None
        if caller != layer:
            self.entries.append((caller, layer, name))
        return _STACK.set(stack + (layer,))

    def _wrapped(self, method, layer: str, name: str):
        if inspect.iscoroutinefunction(method):
            async def call_async(*args, **kwargs):
                token = self._enter(layer, name)
                try:
                    return await method(*args, **kwargs)
                finally:
                    _STACK.reset(token)
            return call_async

        def call(*args, **kwargs):
            token = self._enter(layer, name)
            try:
                return method(*args, **kwargs)
            finally:
                _STACK.reset(token)
        return call

    def take(self) -> list[tuple[str | None, str, str]]:
        entries, self.entries = self.entries, []
        return entries


class Bus:
    max_payload = 1 << 20


@pytest.fixture
async def make_pool(tmp_path: Path):
    """make_pool(n): a pool whose hot tier holds n units, over a cold tier in a folder, its parts wrapped."""
    cold = LocalDirTier(tmp_path / "cold")
    cold.ru_key = KEY
    tiers = TierClient(None, cold)
    cores = []

    def make(hot_units: int) -> tuple[PoolCore, PoolHandlers, Recorder]:
        unit_bytes = len(unit_chain(FP, 1, key=KEY, shape=TINY)[0][1])
        core = PoolCore(hot_bytes=hot_units * unit_bytes, archive_after_s=100.0, warm_ttl_s=60.0,
                        cold_ttl_s=0.0, sweep_interval_s=1.0, has_warm=False, has_cold=True, tiers=tiers,
                        ru_key=KEY, clock=lambda: NOW)
        cores.append(core)
        admin = PoolAdmin(core)
        handlers = PoolHandlers(core, admin, Bus(), None, "host", lambda: NOW)
        recorder = Recorder()
        recorder.wrap(handlers, "handlers")
        for part in (core.worker_hits, core.reads, core.writes, core.catalog, core.worker_events, core.maintenance,
                     admin):
            recorder.wrap(part, "coordinator")
        recorder.wrap(core.index, "index")
        recorder.wrap(core.tenants, "tenants")
        for part in (core.io, core.io.hot, cold):
            recorder.wrap(part, "tier_io")
        recorder.wrap(core.workers, "worker_caches")
        for part in (core.namespaces, core.changes):
            recorder.wrap(part, "records")
        return core, handlers, recorder
    yield make
    for core in cores:
        await core.background.drain()
    await tiers.close()


def assert_walks_down_once(entries: list[tuple[str | None, str, str]], handler: str, coordinator: str) -> None:
    """Entered from outside at `handler`, which enters the coordinating layer once, at `coordinator`;
    every other entry goes from the coordinating layer to a lower one (or from the index to its tenants):
    no layer is entered from below, none is entered again from above."""
    assert entries[:2] == [(None, "handlers", handler), ("handlers", "coordinator", coordinator)], entries[:2]
    rest = entries[2:]
    assert all((caller, layer) in ALLOWED for caller, layer, _ in rest), \
        [e for e in rest if (e[0], e[1]) not in ALLOWED]
    assert not [e for e in rest if e[1] in ("handlers", "coordinator")]  # no re-entry
    assert all(caller == "coordinator" or (caller, layer) == ("index", "tenants") for caller, layer, _ in rest)


async def test_a_lookup_asks_each_lower_layer_once(make_pool):
    core, handlers, recorder = make_pool(4)
    hashes = [h for h, _ in unit_chain(FP, 3, key=KEY, shape=TINY)]
    core.writes.put_hot(BlockKey.of(FP, hashes[0]), b"x" * 10, NOW)
    core.worker_events.stored("w1", FP, hashes[:2], seq=1, now=NOW)
    recorder.take()
    reply = await handlers.lookup(PoolLookupRequest(model_fingerprint=FP, block_hashes=hashes))
    assert (reply.hot, reply.pool, reply.workers) == (1, 1, {"w1": 2})
    assert recorder.take() == [
        (None, "handlers", "PoolHandlers.lookup"),
        ("handlers", "coordinator", "PoolReads.lookup"),
        ("coordinator", "tier_io", "TierIO.up_mask"),
        ("coordinator", "index", "BlockIndex.is_tag_invalidated"),
        ("coordinator", "index", "BlockIndex.prefixes"),
        ("coordinator", "worker_caches", "WorkerCaches.prefix_lengths"),
    ]


async def test_a_put_walks_down_once_and_its_demotion_after_the_reply_too(make_pool):
    core, handlers, recorder = make_pool(2)
    blocks = unit_chain(FP, 3, key=KEY, shape=TINY)
    for _, unit in blocks[:2]:
        await handlers.put(unit)
    recorder.take()
    await handlers.put(blocks[2][1])  # hot holds two: the first block is evicted, demoted to cold
    entries = recorder.take()
    assert_walks_down_once(entries, "PoolHandlers.put", "PoolWrites.put_bytes")
    called = {name for _, _, name in entries}
    assert {"TierIO.verify_put", "BlockIndex.tiers_of", "Tenants.quota_victims", "HotLRU.put",
            "BlockIndex.note_stored", "HotLRU.take_events", "BlockIndex.note_evicted"} <= called
    await core.background.drain()  # the demotion: written to cold by the coordinating layer, noted in the index
    entries = recorder.take()
    assert entries and all(caller == "coordinator" or (caller, layer) == ("index", "tenants")
                           for caller, layer, _ in entries), entries
    assert {"TierIO.stored_form", "LocalDirTier.put", "BlockIndex.note_stored"} <= {n for _, _, n in entries}
    assert core.index.tiers_of(BlockKey.of(FP, blocks[0][0])) == COLD
    assert [core.index.tiers_of(BlockKey.of(FP, h)) for h, _ in blocks[1:]] == [HOT, HOT]


async def test_a_get_walks_down_once_through_hot_and_cold(make_pool):
    core, handlers, recorder = make_pool(3)
    blocks = unit_chain(FP, 3, key=KEY, shape=TINY)
    first = BlockKey.of(FP, blocks[0][0])
    assert await core.io.cold.put(first, blocks[0][1])  # as archival (or another replica) left it
    core.index.note_stored(first, COLD, len(blocks[0][1]), NOW)
    for _, unit in blocks[1:]:
        await handlers.put(unit)
    recorder.take()
    reply = await handlers.get(PoolGetRequest(model_fingerprint=FP, block_hashes=[h for h, _ in blocks]))
    assert reply.units == [u for _, u in blocks] and reply.tiers == b"chh" and reply.complete
    entries = recorder.take()
    assert_walks_down_once(entries, "PoolHandlers.get", "PoolReads.get_blocks")
    called = [name for _, _, name in entries]
    # the cold read, noted in the index and promoted into hot, the hot hits, the namespace's audit
    for name in ("HotLRU.get", "BlockIndex.entry", "LocalDirTier.get_unit", "BlockIndex.note_stored",
                 "HotLRU.put", "BlockIndex.note_hit", "NamespaceAudit.served"):
        assert name in called, (name, called)
    assert core.index.tiers_of(first) == COLD | HOT


async def test_a_workers_tier_hits_walk_down_once_and_their_promotion_after_the_reply_too(make_pool):
    core, handlers, recorder = make_pool(3)
    blocks = unit_chain(FP, 2, key=KEY, shape=TINY)
    for h, unit in blocks:  # in cold only, as archival left them; a worker read them there itself
        assert await core.io.cold.put(BlockKey.of(FP, h), unit)
        core.index.note_stored(BlockKey.of(FP, h), COLD, len(unit), NOW)
    recorder.take()
    await handlers.tier_hits(TierHits(model_fingerprint=FP, tenant_tag=ANONYMOUS_TENANT_TAG,
                                      block_hashes=[h for h, _ in blocks], tiers=b"cc"))
    assert_walks_down_once(recorder.take(), "PoolHandlers.tier_hits", "WorkerHits.reported")
    await core.background.drain()  # the reads and promotions: by the coordinating layer, down only
    entries = recorder.take()
    assert entries and all(caller == "coordinator" or (caller, layer) == ("index", "tenants")
                           for caller, layer, _ in entries), entries
    assert {"LocalDirTier.get_unit", "BlockIndex.note_stored", "HotLRU.put"} <= {n for _, _, n in entries}
    assert [core.index.tiers_of(BlockKey.of(FP, h)) for h, _ in blocks] == [COLD | HOT] * 2


def _imports(path: Path) -> set[str]:
    """The kite_ru_pool modules a module imports."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("kite_ru_pool."):
            names.add(node.module.split(".")[1])
    return names


def test_lower_layers_import_nothing_above_them_and_modules_form_no_cycle():
    package = Path(kite_ru_pool.__file__).parent
    graph = {p.stem: _imports(p) for p in package.glob("*.py") if p.stem not in ("__init__", "__main__")}
    lower = {"index", "tenants", "tier_io", "worker_caches", "counters", "namespaces", "background",
             "index_changes", "lifecycle", "gc_freeze"}
    for module in lower:
        assert graph[module] <= lower, (module, graph[module] - lower)

    for module in graph:
        reached, todo = set(), list(graph[module])
        while todo:
            dep = todo.pop()
            assert dep != module, f"{module} imports itself through {sorted(reached)}"
            if dep not in reached:
                reached.add(dep)
                todo.extend(graph[dep])


def test_the_recorder_sees_a_call_back_up():
    """The check above is not vacuous: a lower part calling the coordinating layer shows up as such."""
    recorder = Recorder()

    class Up:
        def decide(self) -> None:
            pass

    class Down:
        def __init__(self, up: Up) -> None:
            self.up = up

        def work(self) -> None:
            self.up.decide()

    up = Up()
    down = Down(up)
    recorder.wrap(up, "coordinator")
    recorder.wrap(down, "index")
    down.work()
    entries = recorder.take()
    assert entries == [(None, "index", "Down.work"), ("index", "coordinator", "Up.decide")]
    assert ("index", "coordinator") not in ALLOWED
