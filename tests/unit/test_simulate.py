"""`kite simulate` (kite_cli/simulate): the trace, the fleet driving the real cores, the report, on a small
fleet (8 workers, ~10^4 blocks) in seconds."""

from __future__ import annotations

import dataclasses
import json
import sys

import pytest

from kite_cli.simulate import SimConfig, run
from kite_cli.simulate.config import FleetConfig, TraceConfig
from kite_cli.simulate.fleet import FleetSim
from kite_cli.simulate.report import SizeWalker, percentile
from kite_cli.simulate.trace import generate

NUM_WORKERS = 8
TRACE = TraceConfig(seed=7, target_blocks=10_000)
FLEET = FleetConfig(num_workers=NUM_WORKERS)
CAPACITY = NUM_WORKERS * FLEET.cost.prefill_tokens_per_s


@pytest.fixture(scope="module")
def trace():
    return generate(TRACE, CAPACITY)


@pytest.fixture(scope="module")
def results(trace):
    return {mode: FleetSim(trace, FLEET, mode, seed=TRACE.seed).run()
            for mode in ("cache_aware", "round_robin", "least_loaded")}


# --- the trace -------------------------------------------------------------------------------------
def test_trace_reaches_the_target_and_counts_distinct_blocks(trace):
    every = {h for chain in trace.chains for h in chain}
    assert trace.num_distinct_blocks == len(every) >= TRACE.target_blocks
    # stopping after the session that crossed the target: never a whole session more than needed
    assert trace.num_distinct_blocks - TRACE.target_blocks < len(max(trace.chains, key=len))
    assert trace.num_hashed_blocks == sum(len(c) for c in trace.chains)


def test_trace_shape(trace):
    cfg = trace.config
    assert [r.arrival_s for r in trace.requests] == sorted(r.arrival_s for r in trace.requests)
    by_session: dict[int, list] = {}
    for r in trace.requests:
        by_session.setdefault(r.session, []).append(r)
        assert r.prompt_tokens + r.output_tokens <= cfg.max_context_tokens
        assert r.num_blocks == (r.prompt_tokens + r.output_tokens) // cfg.block_size
    assert len(by_session) == trace.num_sessions
    for s, turns in by_session.items():
        turns.sort(key=lambda r: r.turn)
        assert [r.turn for r in turns] == list(range(len(turns)))
        # each turn resends the whole history: its prompt starts with the previous prompt and answer
        for prev, cur in zip(turns, turns[1:]):
            assert cur.prompt_tokens > prev.prompt_tokens + prev.output_tokens
            assert cur.arrival_s >= prev.arrival_s
        assert turns[-1].num_blocks == len(trace.chains[s])


def test_blocks_are_shared_within_a_tenant_only(trace):
    """Hashes come from the fingerprinter's chain with the tenant's cache salt: two sessions of one
    tenant share their system prompt's blocks, two tenants share nothing."""
    first_of: dict[int, int] = {}
    shared_same_tenant = False
    for s, t in enumerate(trace.session_tenant):
        if t in first_of:
            other = trace.chains[first_of[t]]
            shared_same_tenant |= trace.chains[s][0] is other[0]  # interned: one object per block
            assert trace.chains[s][:16] == other[:16]  # system prompts are at least 256 tokens
        else:
            first_of[t] = s
    assert shared_same_tenant
    tenants = list(first_of)
    heads = {t: set(trace.chains[first_of[t]]) for t in tenants}
    for a, b in zip(tenants, tenants[1:]):
        assert not heads[a] & heads[b]


def test_same_seed_same_trace_other_seed_other_trace(trace):
    again = generate(TRACE, CAPACITY)
    assert again.chains == trace.chains
    assert [dataclasses.astuple(r) for r in again.requests] == [dataclasses.astuple(r) for r in trace.requests]
    other = generate(dataclasses.replace(TRACE, seed=8), CAPACITY)
    assert other.chains[0] != trace.chains[0]


def test_request_limit(trace):
    short = generate(dataclasses.replace(TRACE, num_requests=10), CAPACITY)
    assert len(short.requests) == 10
    assert short.num_distinct_blocks < TRACE.target_blocks


# --- the fleet -------------------------------------------------------------------------------------
def test_every_prompt_block_is_accounted_for(results, trace):
    for r in results.values():
        assert r.local_blocks + r.hot_blocks + r.warm_blocks + r.computed_blocks == r.prompt_blocks
        assert r.num_served + r.num_shed + r.num_refused == r.num_requests == len(trace.requests)
        assert sum(r.served) == r.num_served
        assert len(r.ttft_s) == r.num_served


def test_the_pool_indexes_every_distinct_block(results, trace):
    """Write-through to an unbounded warm tier: every block computed once is in the index, whatever
    the routing; the pool's hot tier holds at most its budget."""
    for r in results.values():
        assert r.pool_blocks == trace.num_distinct_blocks
        assert r.pool_hot_blocks <= FLEET.pool_hot_bytes // FLEET.cost.block_bytes
        assert r.pool_counters["puts"] == trace.num_distinct_blocks


def test_pool_work_charged_to_placement_keys_adds_up(results, trace):
    """Every pool message and core second of a run is charged to a key of each kind (what sharding splits):
    the tenant's, or each chain segment's (a lookup asks every segment it spans)."""
    for r in results.values():
        by_tenant, by_segment = r.loads["tenant"].totals(), r.loads["segment"].totals()
        assert set(r.loads["tenant"]) <= {tag.encode() for tag in trace.tenant_tags}
        for t in (by_tenant, by_segment):
            assert t.num_puts == r.pool_puts
            assert t.read_s == pytest.approx(r.pool_read_s + sum(r.lookup_s))
            assert t.write_s == pytest.approx(r.pool_put_s + r.pool_event_s)
        assert by_tenant.num_lookups >= r.pool_reads + len(r.lookup_s)  # hot gets come on top
        assert by_segment.num_lookups >= by_tenant.num_lookups  # long prompts span several segments
        assert 0 < by_tenant.num_events <= by_segment.num_events


def test_a_sessions_turns_stay_on_their_worker_unless_work_is_ahead_there(results):
    """A turn goes to its session's worker when nothing is queued there ("session"); otherwise it is
    costed with the others ("cache_aware") and moves when loading its history elsewhere is sooner."""
    ca = results["cache_aware"]
    assert ca.followups > 0 and ca.num_queue_group == 0
    assert 0 < ca.reasons["session"] < ca.followups  # in this trace some turns find a queue at their worker
    assert ca.reasons["session"] + ca.reasons["cache_aware"] == ca.num_requests
    assert ca.reasons["session"] <= ca.followups_same_worker < ca.followups
    assert ca.followups_same_worker > ca.followups / 2
    # round robin ignores sessions: the next turn lands elsewhere most of the time
    assert results["round_robin"].followups_same_worker < results["round_robin"].followups / 2


def test_cache_aware_reuses_more_locally_than_round_robin_and_least_loaded(results):
    ca, rr, ll = (results[m] for m in ("cache_aware", "round_robin", "least_loaded"))
    assert ca.local_blocks > 2 * rr.local_blocks
    assert ca.local_blocks > 2 * ll.local_blocks
    assert ca.computed_blocks <= rr.computed_blocks
    # what local caches miss, the pool still serves: every mode computes far less than the prompts
    for r in (ca, rr, ll):
        assert r.computed_blocks < r.prompt_blocks / 2


def test_same_seed_same_results(trace, results):
    again = FleetSim(trace, FLEET, "cache_aware", seed=TRACE.seed).run()
    first = results["cache_aware"]
    for name in ("num_served", "num_shed", "local_blocks", "hot_blocks", "warm_blocks", "computed_blocks",
                 "ttft_s", "served", "busy_s", "pool_blocks", "followups_same_worker"):
        assert getattr(again, name) == getattr(first, name), name


def test_without_a_local_cache_reuse_comes_from_the_pool(trace):
    r = FleetSim(trace, dataclasses.replace(FLEET, worker_cache_bytes=0), "cache_aware").run()
    assert r.local_blocks == 0
    assert r.hot_blocks + r.warm_blocks > r.computed_blocks
    no_pool = FleetSim(trace, dataclasses.replace(FLEET, pool_read=False), "cache_aware").run()
    assert no_pool.hot_blocks == no_pool.warm_blocks == 0


def test_admission_sheds_an_overloaded_fleet(trace):
    """Ten times the arrival rate on two workers: predicted TTFT passes the objective on every worker,
    the arbitrator closes admission (its built-in rule) and the gateway sheds."""
    fast = dataclasses.replace(trace, requests=[dataclasses.replace(r, arrival_s=r.arrival_s / 10)
                                                for r in trace.requests])
    r = FleetSim(fast, dataclasses.replace(FLEET, num_workers=2), "cache_aware").run()
    assert r.num_shed > 0
    assert r.decisions["admission:shed-when-ttft-slo-at-risk"] >= 1
    assert r.shed_s > 0


# --- the report ------------------------------------------------------------------------------------
def test_size_walker_counts_shared_objects_once():
    shared = b"h" * 32
    own = [b"a" * 32, b"b" * 32]
    graph = {"index": {shared: (1.5, own[0])}, "ledger": {(shared, own[1])}}
    expected = (sys.getsizeof(graph) + sys.getsizeof(graph["index"]) + sys.getsizeof(graph["ledger"])
                + 2 * sys.getsizeof(b"x" * 32) + sys.getsizeof(shared)
                + sys.getsizeof((1.5, own[0])) + sys.getsizeof(1.5) + sys.getsizeof((shared, own[1]))
                + sum(sys.getsizeof(k) for k in graph))
    del own
    assert SizeWalker().walk(graph) == expected


def test_percentile():
    assert percentile([], 0.5) == 0.0
    assert percentile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert percentile(list(range(101)), 0.99) == 99


def test_run_and_command_line(tmp_path, capsys):
    from kite_cli.main import main

    out = tmp_path / "sim.json"
    assert main(["simulate", "--workers", "4", "--blocks", "3000", "--seed", "3", "--compare-workers", "2",
                 "--compare-blocks", "1000", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "pool index memory" in printed and "cache_aware" in printed and "pool index by segment" in printed
    report = json.loads(out.read_text())
    full, compared = report["runs"]
    assert [m["mode"] for m in full["modes"]] == ["cache_aware"]

    def indexed_all(m: dict) -> bool:
        """Every block of the trace is in the pool's index, but for requests the arbitrator shed (a worker
        prefilling an 8k-token document predicts a TTFT over the SLO on 2-4 workers)."""
        return m["index_blocks_match_trace"] or m["shed_by_admission"] > 0

    assert indexed_all(full["modes"][0])
    assert [m["mode"] for m in compared["modes"]] == ["cache_aware", "round_robin", "least_loaded"]
    assert compared["workers"] == 2 and compared["distinct_blocks"] >= 1000
    assert all(m["requests"] == compared["requests"] == report["compare_trace"]["requests"]
               and indexed_all(m) for m in compared["modes"])
    assert any(m["index_blocks_match_trace"] for m in compared["modes"])  # round robin shed none here
    assert report["pool_memory"]["bytes_per_block"] > 0
    assert report["pool_sweep"]["slices"] >= 1
    sharding = full["modes"][0]["pool_sharding"]
    assert set(sharding) == {"tenant", "segment"}
    assert [p["rate_scale"] for p in sharding["tenant"]] == [1.0, 100.0, 1000.0]
    assert report["trace"]["distinct_blocks"] >= 3000


def test_run_compares_over_the_full_trace_when_asked():
    cfg = SimConfig(trace=dataclasses.replace(TRACE, target_blocks=2000), fleet=FLEET,
                    compare_workers=NUM_WORKERS, compare_blocks=2000, measure_memory=False, sweep=False)
    report = run(cfg, progress=lambda _: None)
    assert len(report["runs"]) == 1
    assert [m["mode"] for m in report["runs"][0]["modes"]] == ["cache_aware", "round_robin", "least_loaded"]
    assert "pool_memory" not in report
