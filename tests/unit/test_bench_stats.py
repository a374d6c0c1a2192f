"""kite bench statistics, ratios, equality check, Prometheus parsing and Markdown rendering (no servers)."""

from __future__ import annotations

import pytest

from kite_cli.bench import report, runner
from kite_cli.bench.stats import (RequestResult, hit_rate_timeline, percentile, ratio, ratios, summarize)
from kite_cli.bench.systems import parse_tier_metrics


def _r(i, ttft=0.5, e2e=1.5, prompt=100, out=11, cached=0, text="x", error=None, start=0.0):
    return RequestResult(f"s-{i}/0", start, start + e2e, ttft, prompt, out, cached, text, error)


def test_percentile_interpolates_like_numpy():
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    assert percentile([1, 2, 3, 4], 50) == pytest.approx(2.5)
    assert percentile(list(range(101)), 99) == pytest.approx(99.0)
    assert percentile([10, 0], 100) == 10


def test_summary_counts_tokens_rates_and_errors():
    results = [_r(0, cached=0), _r(1, cached=80, ttft=0.1), _r(2, error="HTTP 503: busy", out=0, prompt=0)]
    s = summarize(results, wall_s=2.0)
    assert (s.requests, s.ok, s.errors) == (3, 2, 1)
    assert s.prompt_tokens == 200 and s.prompt_tokens_reused == 80 and s.prompt_tokens_computed == 120
    assert s.hit_rate == pytest.approx(0.4)
    assert s.requests_with_hit == 1
    assert s.requests_per_s == pytest.approx(1.0)
    assert s.output_tokens_per_s == pytest.approx(11.0)
    assert s.ttft_p50 == pytest.approx(0.3)
    assert s.tpot_p50 == pytest.approx(0.12)  # median of (1.5 - 0.5) / 10 and (1.5 - 0.1) / 10
    assert s.error_messages == ["HTTP 503: busy"]


def test_tpot_needs_two_tokens():
    assert _r(0, out=1).tpot is None
    assert _r(0, ttft=None).tpot is None


def test_ratios_say_where_kite_is_ahead():
    fast = summarize([_r(0, ttft=0.1, e2e=1.0)], 1.0)
    slow = summarize([_r(0, ttft=1.0, e2e=2.0)], 2.0)
    r = ratios(fast, slow)
    assert r["ttft_p50"]["ratio"] == pytest.approx(0.1) and r["ttft_p50"]["kite_ahead"] is True
    assert r["requests_per_s"]["ratio"] == pytest.approx(2.0) and r["requests_per_s"]["kite_ahead"] is True
    behind = ratios(slow, fast)
    assert behind["e2e_p50"]["kite_ahead"] is False
    assert ratio(1.0, 0) is None and ratio(None, 1.0) is None


def test_hit_rate_timeline_is_cumulative_in_completion_order():
    results = [_r(0, cached=0, start=0.0, e2e=1.0), _r(1, cached=50, start=0.5, e2e=1.0),
               _r(2, error="boom", start=0.1)]
    points = hit_rate_timeline(results)
    assert [p[0] for p in points] == [1.0, 1.5]
    assert points[1][1] == pytest.approx(0.5) and points[1][2] == pytest.approx(0.25)


def _run(system, conc, texts, errors=()):
    raw = [_r(i, text=t, error=("e" if i in errors else None)).to_dict() for i, t in enumerate(texts)]
    return {"system": system, "concurrency": conc, "raw": raw}


def test_equality_check_compares_reuse_on_with_off_at_the_same_concurrency():
    runs = [_run(runner.KITE_ON, 1, ["a", "b", "c"]), _run(runner.KITE_OFF, 1, ["a", "b", "c"]),
            _run(runner.KITE_ON, 4, ["a", "X", "c"], errors=(2,)), _run(runner.KITE_OFF, 4, ["a", "b", "c"])]
    eq = runner.check_equality(runs)
    assert eq["compared"] == 5
    assert [(m["request_id"], m["concurrency"]) for m in eq["mismatches"]] == [("s-1/0", 4)]


def test_peer_agreement_is_against_reuse_off():
    runs = [_run(runner.KITE_OFF, 1, ["a", "b"]), _run(runner.TRANSFORMERS, 1, ["a", "z"])]
    assert runner.peer_agreement(runs) == {"transformers": {"compared": 2, "same": 1}}


def test_parse_tier_metrics_reads_counters_only():
    text = """# HELP kite_tier_hits_total Block reads answered by a tier.
# TYPE kite_tier_hits_total counter
kite_tier_hits_total{tier="hot"} 3.0
kite_tier_hits_created{tier="hot"} 1.7e+09
kite_tier_bytes_total{direction="read",tier="warm"} 1024.0
kite_tier_promotions_total 2.0
kite_pool_lookup_seconds_count 5.0
"""
    assert parse_tier_metrics(text) == {"hits/hot": 3.0, "bytes/read,warm": 1024.0, "promotions": 2.0}


def test_markdown_tables_and_formatting():
    assert report.fmt(None) == "n/a" and report.fmt(0.12345) == "0.123" and report.fmt(7) == "7"
    assert report.fmt(0.00001234) == "1.23e-05"
    assert report.fmt_pct(0.5) == "50.0%" and report.fmt_pct(None) == "n/a"
    s = summarize([_r(0, cached=50)], 1.0).to_dict()
    table = report.summary_table([{"system": "kite-reuse-on", "concurrency": 1, **s}])
    lines = table.splitlines()
    assert lines[0].startswith("| system | conc. |") and len(lines) == 3
    assert "| kite-reuse-on | 1 | 1 | 0 |" in lines[2] and "50.0%" in lines[2]
    fast = summarize([_r(0, ttft=0.1, e2e=1.0)], 1.0)
    slow = summarize([_r(0, ttft=1.0, e2e=2.0)], 2.0)
    rt = report.ratio_table([{"kite": "kite-reuse-on c=1", "peer": "llama.cpp c=1", "ratios": ratios(slow, fast)}])
    row = rt.splitlines()[2]
    assert row.startswith("| kite-reuse-on c=1 / llama.cpp c=1 | 10.000 * |")
    assert report.tier_lines(None).startswith("n/a")
    assert report.tier_lines({"hits/hot": 0.0}) == "all kite_tier_* counters unchanged (0)"
    assert report.tier_lines({"hits/hot": 2.0, "misses/hot": 0.0}) == "hits/hot=2"


def test_arguments_are_checked():
    args = runner.parse_args(["--workload", "all", "--concurrency", "4,1,4", "--systems", "kite-reuse-on"])
    assert args.workload == list(runner.workloads.WORKLOADS)
    assert args.concurrency == [1, 4] and args.systems == ["kite-reuse-on"]
    for bad in (["--systems", "tgi"], ["--concurrency", "0"], ["--concurrency", "x"], ["--output-tokens", "0"]):
        with pytest.raises(SystemExit):
            runner.parse_args(bad)
