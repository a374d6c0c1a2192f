"""A worker's report of its direct warm and cold hits (kite_shared.tiers.hit_report): the pure batch (bounds,
dedupe, when a send is due, messages of bounded size), the reporter on an asyncio loop (sends at the
block threshold without waiting for the interval, after the interval otherwise, counts what it could not
report), and the PoolLoader reporting exactly the blocks it read from warm or cold itself."""

from __future__ import annotations

import asyncio

import pytest
import torch

from kite_shared.messages import TierHits
from kite_shared.recyclable_unit import RecyclableUnit
from kite_shared.security import tenant_tag
from kite_shared.tiers import metrics
from kite_shared.tiers.hit_report import FLUSH_BLOCKS, FLUSH_INTERVAL_S, MAX_PENDING, HitBatch, HitReporter
from kite_worker.pool_loader import CostModel, PoolLoader

FP = "ab" * 32
FP2 = "cd" * 32
TAG = "0123456789abcdef"


def hashes(n: int, start: int = 0) -> list[bytes]:
    return [i.to_bytes(32, "big") for i in range(start, start + n)]


def unreported() -> float:
    return metrics.TIER_HITS_UNREPORTED._value.get()


def test_the_defaults_are_the_documented_bounds():
    assert (MAX_PENDING, FLUSH_BLOCKS, FLUSH_INTERVAL_S) == (8192, 512, 0.2)


def test_a_send_is_due_at_the_block_threshold_or_once_the_oldest_hit_waited_the_interval():
    batch = HitBatch(max_pending=100, flush_blocks=10, flush_interval_s=0.2)
    assert batch.wait_s(5.0) is None  # nothing pending: nothing to send
    batch.add(FP, TAG, hashes(3), b"wwc", now=10.0)
    assert batch.wait_s(10.0) == pytest.approx(0.2)
    batch.add(FP, TAG, hashes(3, 3), b"ccc", now=10.15)  # later hits do not push the deadline back
    assert batch.wait_s(10.15) == pytest.approx(0.05)
    assert batch.wait_s(10.3) == 0.0
    batch.take()
    batch.add(FP, TAG, hashes(10), b"w" * 10, now=20.0)
    assert batch.wait_s(20.0) == 0.0  # ten blocks: at once


def test_a_block_is_pending_once_and_keeps_its_first_tier():
    batch = HitBatch()
    batch.add(FP, TAG, hashes(2), b"wc", now=0.0)
    batch.add(FP, TAG, hashes(3), b"ccc", now=0.0)
    batch.add(FP, "f" * 16, hashes(1), b"w", now=0.0)  # another tenant's block: its own
    assert batch.num_pending == 4
    sent = {(m.model_fingerprint, m.tenant_tag): m for m in batch.take(worker_id="w1")}
    assert sent[(FP, TAG)].block_hashes == hashes(3) and sent[(FP, TAG)].tiers == b"wcc"
    assert sent[(FP, "f" * 16)].block_hashes == hashes(1) and sent[(FP, "f" * 16)].worker_id == "w1"
    assert batch.num_pending == 0 and batch.take() == [] and batch.wait_s(0.0) is None


def test_beyond_the_bound_hits_are_dropped_and_counted():
    batch = HitBatch(max_pending=5, flush_blocks=2)
    assert batch.add(FP, TAG, hashes(4), b"wwww", now=0.0) == 0
    assert batch.add(FP2, TAG, hashes(3), b"ccc", now=0.0) == 2  # one fits
    assert batch.add(FP, TAG, hashes(1), b"w", now=0.0) == 0  # pending already: not a drop
    assert (batch.num_pending, batch.num_dropped) == (5, 2)
    messages = batch.take()
    # at most flush_blocks blocks a message, one fingerprint and tenant each
    assert [(m.model_fingerprint, len(m.block_hashes)) for m in messages] == [(FP, 2), (FP, 2), (FP2, 1)]
    assert batch.add(FP2, TAG, hashes(3), b"ccc", now=1.0) == 0  # room again after a send


def test_letters_must_match_hashes():
    with pytest.raises(ValueError):
        HitBatch().add(FP, TAG, hashes(2), b"w", now=0.0)


class Bus:
    """What the reporter publishes through (PoolClient.tier_hits in a worker)."""

    def __init__(self, up: bool = True) -> None:
        self.up = up
        self.sent: list[TierHits] = []
        self.arrived = asyncio.Event()

    async def send(self, hits: TierHits) -> bool:
        if self.up:
            self.sent.append(hits)
            self.arrived.set()
        return self.up


async def test_the_reporter_sends_a_full_batch_without_waiting_for_the_interval():
    bus = Bus()
    reporter = HitReporter(bus.send, "w1", HitBatch(flush_blocks=4, flush_interval_s=3600.0))
    reporter.record(FP, TAG, hashes(3), b"www")
    for _ in range(5):
        await asyncio.sleep(0)
    assert bus.sent == []  # three of four: waiting for the interval (an hour here)
    reporter.record(FP, TAG, hashes(2, 3), b"cc")
    await asyncio.wait_for(bus.arrived.wait(), 5.0)
    assert [h for m in bus.sent for h in m.block_hashes] == hashes(5) and reporter.num_sent == 5
    assert reporter.batch.num_pending == 0 and reporter._timer is None  # the interval's timer went with it


async def test_the_reporter_sends_a_partial_batch_after_the_interval():
    bus = Bus()
    reporter = HitReporter(bus.send, "w1", HitBatch(flush_blocks=512, flush_interval_s=0.01))
    reporter.record(FP, TAG, hashes(2), b"wc")
    await asyncio.wait_for(bus.arrived.wait(), 5.0)
    assert bus.sent == [TierHits(worker_id="w1", model_fingerprint=FP, tenant_tag=TAG, block_hashes=hashes(2),
                                 tiers=b"wc")]
    bus.arrived.clear()
    reporter.record(FP, TAG, hashes(1, 7), b"c")  # a new batch gets its own timer
    await asyncio.wait_for(bus.arrived.wait(), 5.0)
    assert len(bus.sent) == 2 and bus.sent[1].block_hashes == hashes(1, 7)


async def test_what_the_reporter_cannot_report_is_counted_and_record_never_raises():
    before = unreported()
    reporter = HitReporter(Bus(up=False).send, batch=HitBatch(max_pending=3, flush_interval_s=3600.0))
    reporter.record(FP, TAG, hashes(5), b"wwwww")  # two beyond the bound
    assert unreported() - before == 2
    await reporter.flush()  # the bus refuses the three that fit
    assert unreported() - before == 5 and reporter.num_sent == 0

    async def broken(hits: TierHits) -> bool:
        raise RuntimeError("a bug in the sender")
    reporter = HitReporter(broken, batch=HitBatch(flush_blocks=1))
    reporter.record(FP, TAG, hashes(1), b"c")  # due at once: sent by a task of its own
    assert reporter._sending is not None
    await reporter._sending
    assert unreported() - before == 6 and reporter.batch.num_pending == 0 and reporter._sending is None


# --- the loader reports what it read from warm or cold itself -------------------------------------------------

SHAPE = (1, 2, 1, 16, 4)


def unit(block_hash: bytes) -> RecyclableUnit:
    return RecyclableUnit(block_hash=block_hash, parent_hash=b"\0" * 32, model_fingerprint=FP, block_index=0,
                          num_tokens=16, codec="fp16", shape=SHAPE, payload=bytes(256))


class Tier:
    """A tier the loader reads directly, holding `held` (verified units, as the tier client returns them)."""

    def __init__(self, held: list[bytes]) -> None:
        self.held = set(held)
        self.owners: list[str] = []

    async def get_units(self, model_fingerprint: str, block_hashes: list[bytes], owner: str):
        self.owners.append(owner)
        return [(unit(h), bytes(300)) if h in self.held else None for h in block_hashes]


class Tiers:
    def __init__(self, warm: Tier, cold: Tier) -> None:
        self.warm, self.cold = warm, cold


class Pool:
    """The pool's client as the loader uses it: a get of hot blocks, and the reports."""

    worker_id = "w1"

    def __init__(self) -> None:
        self.reports: list[TierHits] = []

    async def get(self, model_fingerprint, block_hashes, tenant):
        return [unit(h).encode() for h in block_hashes]

    async def tier_hits(self, hits: TierHits) -> bool:
        self.reports.append(hits)
        return True


@pytest.mark.parametrize("report_hits", [True, False])
async def test_the_loader_reports_the_blocks_it_read_from_warm_or_cold_and_where_it_found_them(report_hits):
    h = hashes(5)
    # The lookup said h, w, w, c, c; block 2 had left warm for cold meanwhile; block 4 is nowhere now.
    pool, tiers = Pool(), Tiers(Tier([h[1]]), Tier([h[2], h[3]]))
    cost = CostModel(block_size=16, block_bytes=300, prefill_seconds_per_token=1.0)
    loader = PoolLoader(pool, tiers, cost, FP, SHAPE, torch.float16, None, report_hits=report_hits)
    units = await loader._fetch(h, b"hwwcc", "acme", FP)
    assert [u is not None for u in units] == [True, True, True, True, False]
    await loader.flush_hits()
    if not report_hits:
        assert loader.hits is None and pool.reports == []
        return
    (report,) = pool.reports
    assert (report.worker_id, report.model_fingerprint, report.tenant_tag) == ("w1", FP, tenant_tag("acme"))
    # the hot block came through the pool (which promotes nothing for it); the rest where each was found
    assert sorted(zip(report.block_hashes, report.tiers)) == [(h[1], ord("w")), (h[2], ord("c")), (h[3], ord("c"))]


def test_a_loader_without_direct_reads_reports_nothing():
    cost = CostModel(block_size=16, block_bytes=300)
    assert PoolLoader(Pool(), None, cost, FP, SHAPE, torch.float16, None).hits is None
    assert PoolLoader(None, Tiers(Tier([]), Tier([])), cost, FP, SHAPE, torch.float16, None).hits is None
