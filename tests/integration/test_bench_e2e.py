"""`kite bench` end to end on a tiny workload against the shared stack: files written, reuse on == off."""

from __future__ import annotations

import json

from kite_cli.bench import runner


def test_bench_writes_results_and_reuse_does_not_change_outputs(kite_stack, tmp_path, capsys):
    out = tmp_path / "bench"
    code = runner.main(["--url", kite_stack.http_url, "--workload", "system-prompt", "multi-turn",
                        "--systems", "kite-reuse-on,kite-reuse-off,vllm", "--requests", "3",
                        "--shared-tokens", "64", "--question-tokens", "8", "--sessions", "2", "--turns", "2",
                        "--first-tokens", "24", "--turn-tokens", "8", "--output-tokens", "4",
                        "--concurrency", "1,2", "--out", str(out), "--no-progress"])
    printed = capsys.readouterr().out
    assert code == 0, printed
    result = json.loads((out / "results.json").read_text())
    assert result["failures"] == []
    assert result["skipped"]["vllm"].startswith("skipped")
    names = [w["name"] for w in result["workloads"]]
    assert names == ["system-prompt", "multi-turn"]
    for wl in result["workloads"]:
        assert {(r["system"], r["concurrency"]) for r in wl["runs"]} == {
            ("kite-reuse-on", 1), ("kite-reuse-off", 1), ("kite-reuse-on", 2), ("kite-reuse-off", 2)}
        assert wl["equality"]["compared"] == 2 * wl["num_requests"]
        assert wl["equality"]["mismatches"] == []
        for run in wl["runs"]:
            assert run["errors"] == 0 and run["ok"] == wl["num_requests"]
            assert len(run["raw"]) == wl["num_requests"] and run["ttft_p50"] > 0
            if run["system"] == "kite-reuse-off":
                assert run["prompt_tokens_reused"] == 0
        assert wl["pool_tiers"] is None  # the fixture's ru-pool serves no /metrics: reported as n/a
    sp = result["workloads"][0]
    on = next(r for r in sp["runs"] if r["system"] == "kite-reuse-on" and r["concurrency"] == 1)
    assert on["prompt_tokens_reused"] >= 2 * 64  # the 2nd and 3rd user reuse the shared system prompt
    md = (out / "results.md").read_text()
    assert "## system-prompt" in md and "| kite-reuse-on | 1 |" in md and "PASS" in md
    assert "n/a (ru-pool /metrics not reachable)" in md
    for png in result["plots"]:
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(result["plots"]) == 6
