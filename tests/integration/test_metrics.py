"""/metrics on every service shows its kite_* metrics changing as requests flow (issue 8), and every
service publishes telemetry that reflects the traffic (issue 13)."""

from __future__ import annotations

import asyncio

import httpx
import nats
from prometheus_client.parser import text_string_to_metric_families

from kite_shared import subjects
from kite_shared.messages import TELEMETRY
from tests.helpers import wait_until
from tests.integration.conftest import MODEL


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    text = httpx.get(url, timeout=10).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples
            if s.name.startswith("kite_")}


def total(samples: dict, name: str, **labels) -> float:
    return sum(v for (n, lbls), v in samples.items()
               if n == name and all(dict(lbls).get(k) == want for k, want in labels.items()))


def test_every_service_exports_metrics_that_move_with_traffic(fresh_stack_factory):
    stack = fresh_stack_factory(num_workers=1, metrics=True)
    urls = {p.name: f"http://127.0.0.1:{p.metrics_port}/metrics" for p in stack.processes if p.metrics_port}
    urls["gateway"] = stack.http_url + "/metrics"
    assert set(urls) == {"gateway", "fingerprinter", "worker", "ru-pool", "arbitrator"}
    before = {name: scrape(url) for name, url in urls.items()}
    system = {"role": "system", "content": "Metrics test. " * 40}
    for question in ("First question?", "Second question?"):
        r = httpx.post(stack.http_url + "/v1/chat/completions", timeout=120, json={
            "model": MODEL, "temperature": 0, "max_tokens": 5,
            "messages": [system, {"role": "user", "content": question}]})
        assert r.status_code == 200, r.text

    expectations = {
        "gateway": [("kite_requests_total", {"endpoint": "/v1/chat/completions", "status": "200"}),
                    ("kite_ttft_seconds_count", {}),
                    ("kite_gateway_prompt_tokens_total", {"source": "reused"})],
        "fingerprinter": [("kite_cf_compute_seconds_count", {}), ("kite_tokenize_seconds_count", {})],
        "worker": [("kite_prompt_tokens_total", {"source": "computed"}),
                   ("kite_prompt_tokens_total", {"source": "reused"}),
                   ("kite_generated_tokens_total", {}), ("kite_worker_ttft_seconds_count", {}),
                   # new blocks: written into warm by the worker itself (KITE_WORKER_POOL_WRITE_PATH=direct) ...
                   ("kite_tier_bytes_total", {"tier": "warm"})],
        # ... and indexed by the pool from the worker's notice
        "ru-pool": [("kite_endpoint_messages_total", {"endpoint": subjects.POOL_UNITS_WRITTEN})],
        "arbitrator": [("kite_arbitrator_messages_total", {"kind": "heartbeat"})],
    }
    def stuck() -> list:  # the expected metrics that did not grow yet
        after = {name: scrape(url) for name, url in urls.items()}
        return [(svc, name, labels) for svc, checks in expectations.items() for name, labels in checks
                if total(after[svc], name, **labels) <= total(before[svc], name, **labels)]

    # Worker and pool metrics are refreshed about once a second.
    assert wait_until(stuck, 10, "every expected metric to grow", done=lambda stuck: stuck == [], interval_s=0.5) == []

    telemetry = asyncio.run(latest_telemetry(stack.nats.url, seconds=2.5))
    assert set(telemetry) == {"worker_telemetry", "pool_telemetry", "gateway_telemetry",
                              "fingerprinter_telemetry", "arbitrator_telemetry"}, set(telemetry)
    fingerprinter, arbitrator = telemetry["fingerprinter_telemetry"], telemetry["arbitrator_telemetry"]
    assert fingerprinter.request_rate > 0 and fingerprinter.tokenize_p50_s > 0
    assert fingerprinter.dispatch_p99_s >= fingerprinter.dispatch_p50_s > 0
    assert fingerprinter.num_live_workers == 1 and fingerprinter.refused_rate == 0.0
    assert arbitrator.rules_version and not arbitrator.stale
    assert arbitrator.num_sources >= 4  # worker, ru-pool, gateway, fingerprinter
    assert telemetry["gateway_telemetry"].request_rate > 0


async def latest_telemetry(nats_url: str, seconds: float) -> dict:
    """The last telemetry message of each kind published within `seconds`."""
    latest = {}

    async def on_message(msg) -> None:
        message = TELEMETRY.decode(msg.data)
        latest[message.KIND] = message

    nc = await nats.connect(nats_url)
    try:
        await nc.subscribe(subjects.TELEMETRY_WILDCARD, cb=on_message)
        await asyncio.sleep(seconds)
    finally:
        await nc.close()
    return latest


def test_a_client_that_leaves_a_non_streaming_request_stops_its_generation(fresh_stack_factory):
    stack = fresh_stack_factory(num_workers=1, metrics=True)
    worker = next(f"http://127.0.0.1:{p.metrics_port}/metrics" for p in stack.processes if p.name == "worker")
    try:  # thousands of tokens: minutes of work, unless the client's leaving stops it
        httpx.post(stack.http_url + "/v1/chat/completions", timeout=3, json={
            "model": MODEL, "max_tokens": 4000, "kite": {"ignore_eos": True},
            "messages": [{"role": "user", "content": "Count to a million."}]})
        raise AssertionError("a 4,000-token answer came back within 3 s")
    except httpx.ReadTimeout:
        pass
    wait_until(lambda: total(scrape(worker), "kite_worker_running_requests"), 20,
               "the worker to stop generating for a client that had left", done=lambda running: running == 0,
               interval_s=0.5)
