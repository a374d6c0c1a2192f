"""kite_cli/simulate/sharding.py: how many index shards a pool needs, from the work charged to each key."""

from __future__ import annotations

import pytest

from kite_cli.simulate.sharding import KeyLoad, LoadLedger, ServiceCosts, plan, shard_of

COSTS = ServiceCosts(lookup_us=100.0, put_us=1000.0, event_us=10.0)
KEYS = [f"{t:016x}".encode() for t in range(40)]


def _load(lookups: int, puts: int, events: int = 0) -> KeyLoad:
    return KeyLoad(num_lookups=lookups, num_puts=puts, num_events=events)


def _busiest(loads: dict, n: int, window_s: float) -> float:
    busy = [0.0] * n
    for key, load in loads.items():
        busy[shard_of(key, n)] += sum(load.busy_s(COSTS)) / window_s
    return max(busy)


def test_service_costs_are_charged_per_message_kind():
    load = KeyLoad(read_s=0.5, write_s=0.25, num_lookups=10, num_puts=3, num_events=7)
    assert load.busy_s(COSTS) == pytest.approx((0.5 + 10 * 100e-6, 0.25 + 3 * 1000e-6 + 7 * 10e-6))
    assert load.num_messages == 20


def test_the_ledger_accumulates_per_key():
    ledger = LoadLedger()
    ledger.read(b"a", 0.5, 2)
    ledger.put(b"a", 0.25)
    ledger.event(b"b", 0.125)
    assert ledger[b"a"] == KeyLoad(read_s=0.5, write_s=0.25, num_lookups=2, num_puts=1)
    assert ledger.totals() == KeyLoad(read_s=0.5, write_s=0.375, num_lookups=2, num_puts=1, num_events=1)


def test_the_least_shard_count_that_keeps_every_shard_under_the_target():
    loads = {k: _load(lookups=1000, puts=200) for k in KEYS}  # 0.3 CPU-s each over 1 s: 12 in all
    out = plan(loads, window_s=1.0, costs=COSTS, target_busy=0.9)
    n = out["shards_needed"]
    assert out["busy_one_process"] == pytest.approx(12.0)
    assert n is not None and n >= 14  # 12 / 0.9, and hashing is never better than perfect balance
    assert _busiest(loads, n, 1.0) <= 0.9 < _busiest(loads, n - 1, 1.0)
    assert out["by_shards"][-1]["shards"] == n
    assert out["by_shards"][-1]["max_busy"] == pytest.approx(_busiest(loads, n, 1.0), abs=1e-4)


def test_a_key_hotter_than_a_shard_gets_replicas_for_its_reads():
    loads = {KEYS[0]: _load(lookups=20_000, puts=100)} | {k: _load(lookups=10, puts=1) for k in KEYS[1:]}
    out = plan(loads, window_s=1.0, costs=COSTS, target_busy=0.5)
    assert out["shards_needed"] is None  # 2.1 CPU-s/s on one key: no shard holds it
    hot = out["hottest_key"]
    assert hot["busy"] == pytest.approx(2.1) and hot["write_busy"] == pytest.approx(0.1)
    assert hot["replicas_needed"] == 5  # its 2.0 of reads over replicas that each apply its 0.1 of writes


def test_writes_beyond_a_shard_need_a_finer_key():
    loads = {KEYS[0]: _load(lookups=0, puts=800)} | {k: _load(lookups=10, puts=1) for k in KEYS[1:]}
    out = plan(loads, window_s=1.0, costs=COSTS, target_busy=0.5)
    assert out["shards_needed"] is None and out["hottest_key"]["replicas_needed"] is None


def test_a_faster_fleet_is_the_same_work_in_less_time():
    loads = {k: _load(lookups=1000, puts=200) for k in KEYS}
    slow = plan(loads, window_s=100.0, costs=COSTS, target_busy=0.9)
    fast = plan(loads, window_s=100.0, costs=COSTS, target_busy=0.9, rate_scale=100.0)
    assert slow["shards_needed"] == 1 and slow["busy_one_process"] == pytest.approx(0.12)
    assert fast["busy_one_process"] == pytest.approx(12.0)
    assert fast["shards_needed"] == plan(loads, window_s=1.0, costs=COSTS, target_busy=0.9)["shards_needed"]
