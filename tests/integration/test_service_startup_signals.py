"""SIGTERM or SIGINT before a service is connected to NATS ends it at once, with status 0 and a log line
saying why (kite_shared.service.exit_on_signal_until_connected): connecting retries for ever (a wrong
password, no server yet), and Kubernetes or compose must not have to wait out the grace period and
SIGKILL it. The graceful drain after startup is tested with the running services (test_ru_pool_process,
test_faults, test_nats_credentials); here, its end: a service whose bus is gone (its nats-server stopped
with the launcher that died) stops at once instead of sitting out nats-py's drain and flush timeouts."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kite_cli.local_servers import free_port, start_nats
from kite_shared.config import CommonConfig, load
from kite_shared.service import ServiceRuntime
from tests.helpers import wait_for_log

PASSWORD = "pw-Startup-4c1d9e07"
WRONG_PASSWORD = "pw-Wrong-8a2f6b13"


def service_env(url: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KITE_")}
    env.update(KITE_NATS_URL=url, KITE_LOG_LEVEL="INFO", **extra)
    return env


def signal_when_started(argv: list[str], env: dict[str, str], log_path: Path, started: str, wait_s: float,
                        sig: signal.Signals = signal.SIGTERM) -> str:
    """Start `argv`; once its log shows `started`, wait `wait_s` and send `sig`. It must exit 0 within 3 s.
    Returns its log."""
    with log_path.open("wb") as err:
        proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=err)
    try:
        wait_for_log(log_path, started, proc)
        time.sleep(wait_s)
        proc.send_signal(sig)
        sent = time.monotonic()
        try:
            rc = proc.wait(3)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"still running 3 s after {sig.name}:\n"
                                 f"{log_path.read_text(errors='replace')[-3000:]}") from None
        assert time.monotonic() - sent < 3
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log = log_path.read_text(errors="replace")
    assert rc == 0, log[-3000:]
    return log


@pytest.fixture()
def nats_with_password(tmp_path):
    port = free_port()
    server = start_nats(port=port, extra_config=f'authorization {{ user: kite, password: "{PASSWORD}" }}',
                        log_file=tmp_path / f"nats-{port}.log")
    yield server
    server.stop()


RU_POOL = [sys.executable, "-m", "kite_ru_pool"]


def test_sigterm_while_nats_refuses_the_password(nats_with_password, tmp_path):
    env = service_env(nats_with_password.url, KITE_NATS_USER="kite", KITE_NATS_PASSWORD=WRONG_PASSWORD)
    # Once the log shows it is in nats-py's connect loop.
    log = signal_when_started(RU_POOL, env, tmp_path / "ru-pool.log", "Authorization Violation", 1.0)
    # The last error is the refusal, or (a timing race: the server closes the refused connection) the
    # reset of the next attempt; either way the stop line says which, and the refusal was logged.
    assert "ru-pool stopping before NATS connected (SIGTERM; last NATS error: " in log
    assert "NATS error: nats: 'Authorization Violation'" in log
    assert '"level": "ERROR"' in log and "check KITE_NATS_USER/KITE_NATS_PASSWORD" in log  # a permanent error
    assert "ru-pool ready" not in log and "draining" not in log
    assert WRONG_PASSWORD not in log and PASSWORD not in log


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_while_no_nats_server_listens(tmp_path, sig):
    port = free_port()  # nothing listens there
    log = signal_when_started(RU_POOL, service_env(f"nats://127.0.0.1:{port}"), tmp_path / "ru-pool.log",
                              "NATS error", 1.0, sig)
    assert f"ru-pool stopping before NATS connected ({sig.name}; last NATS error: " in log
    assert f"{port}" in log.rsplit("stopping before NATS connected", 1)[1]  # the refused address
    # Retried every 0.5 s, but an unchanged error is logged with backoff (1st, 2nd, 4th, ... time).
    assert log.count("NATS error: ") <= 4, log


def test_sigterm_while_loading_before_run_service(tmp_path):
    """An entrypoint that loads something slow (the worker's model) before run_service calls
    exit_on_signal_until_connected first; here the slow load is a sleep."""
    code = ("import time\n"
            "from kite_shared.service import exit_on_signal_until_connected\n"
            "exit_on_signal_until_connected('worker')\n"
            "import sys; print('loading', file=sys.stderr, flush=True)\n"
            "time.sleep(60)\n")
    log = signal_when_started([sys.executable, "-c", code], service_env("nats://127.0.0.1:1"),
                              tmp_path / "loader.log", "loading", 0.5)
    assert "worker stopping before NATS connected (SIGTERM): nothing to drain" in log


def test_sigterm_after_the_bus_went_away_stops_at_once(tmp_path):
    server = start_nats(port=free_port(), log_file=tmp_path / "nats.log")
    log_path = tmp_path / "ru-pool.log"
    with log_path.open("wb") as err:
        proc = subprocess.Popen(RU_POOL, env=service_env(server.url), stdout=subprocess.DEVNULL, stderr=err)
    try:
        wait_for_log(log_path, "ru-pool ready", proc)
        server.stop()
        wait_for_log(log_path, "NATS disconnected", proc)
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(3)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        server.stop()
    log = log_path.read_text(errors="replace")
    assert rc == 0 and "ru-pool stopped" in log, log[-3000:]


async def test_a_drain_stops_waiting_when_the_bus_goes_away(tmp_path):
    server = start_nats(port=free_port(), log_file=tmp_path / "nats.log")
    runtime = ServiceRuntime("test", load(CommonConfig, nats_url=server.url))
    try:
        await runtime.start()
        handling = asyncio.Event()

        async def slow_handler(msg) -> None:
            handling.set()
            await asyncio.sleep(30)

        await runtime.nc.subscribe("kite.test.slow", cb=slow_handler)
        await runtime.nc.publish("kite.test.slow", b"x")
        await asyncio.wait_for(handling.wait(), 5)
        shutdown = asyncio.create_task(runtime.shutdown())
        await asyncio.sleep(0.5)
        assert not shutdown.done()  # a drain waits for the message being handled
        server.stop()
        lost = time.monotonic()
        await asyncio.wait_for(shutdown, 5)
        assert time.monotonic() - lost < 2 and runtime.nc.is_closed
    finally:
        server.stop()
        if runtime.nc is not None and not runtime.nc.is_closed:
            await runtime.nc.close()
