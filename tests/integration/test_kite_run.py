"""`kite run` as a user runs it: its HTTP port comes from the KITE_GATEWAY_HTTP_PORT setting, it prints
where it serves, and `kite pool stats` in another terminal finds it without flags (through the state file
it keeps under ~/.cache/kite while it runs). Killed with SIGKILL (a supervisor's timeout, an OOM kill),
it leaves no process behind: every service gets SIGTERM from the kernel (PR_SET_PDEATHSIG) and, with its
bus gone, stops at once instead of waiting out NATS timeouts or finishing answers nobody can receive."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import psutil

from kite_cli.local_servers import free_port
from kite_cli.stack import read_state
from kite_shared.config import ModelConfig, load

LEFTOVER_LIMIT_S = 5.0  # issue 13: no KITE process remains 5 s after `kill -9` of `kite run`


def running(proc: psutil.Process) -> bool:
    """Still running: not gone, and not a zombie (an exited process its new parent, the machine's init,
    has not reaped yet; some container inits reap late)."""
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_sigkill_of_kite_run_leaves_no_process_behind(tmp_path):
    port = free_port()
    home = tmp_path / "home"  # kite run's data (warm tier, state file) stays out of the user's ~/.cache/kite
    env = {**os.environ, "KITE_ENGINE": "transformers",  # the same services; a start in seconds, not minutes
           "HOME": str(home), "KITE_MODEL_CACHE_DIR": str(load(ModelConfig).cache_dir),  # converted already
           "KITE_GATEWAY_HTTP_PORT": str(port)}  # a setting, not a flag
    env.pop("KITE_NATS_URL", None)
    state_file = home / ".cache" / "kite" / "kite-run.json"
    with (tmp_path / "kite-run.log").open("wb") as log:
        run = subprocess.Popen([sys.executable, "-m", "kite_cli.main", "run", "--grpc-port", str(free_port())],
                               env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while True:
            assert run.poll() is None, (tmp_path / "kite-run.log").read_text()
            assert time.monotonic() < deadline, "kite run did not get healthy"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        state = read_state(state_file)
        assert state is not None and state.pid == run.pid and state.http_url == f"http://127.0.0.1:{port}"
        # Another terminal: `kite pool stats`, no flags, no KITE_NATS_URL (the ru-pool may still be starting).
        deadline = time.monotonic() + 60
        while True:
            stats = subprocess.run([sys.executable, "-m", "kite_cli.main", "pool", "--timeout", "5", "stats"],
                                   env=env, capture_output=True, text=True, timeout=60)
            if stats.returncode == 0 or time.monotonic() > deadline:
                break
            time.sleep(1)
        assert stats.returncode == 0, stats.stderr
        assert "kite run" in stats.stderr and state.nats_url in stats.stderr
        assert json.loads(stats.stdout)["ok"] is True
        # What it printed once healthy: where it serves, gRPC and NATS included.
        deadline = time.monotonic() + 10
        while "Press Ctrl-C" not in (banner := (tmp_path / "kite-run.log").read_text()):
            assert time.monotonic() < deadline, banner
            time.sleep(0.2)
        assert state.http_url in banner and state.nats_url in banner and state.grpc_target in banner
        started = psutil.Process(run.pid).children(recursive=True)
        names = {" ".join(p.cmdline()[-2:]) for p in started}
        assert {"-m kite_worker", "-m kite_ru_pool", "-m kite_gateway"} <= names, names
        run.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        _, alive = psutil.wait_procs(started, timeout=LEFTOVER_LIMIT_S)
        alive = [p for p in alive if running(p)]
        assert not alive, f"alive {time.monotonic() - killed:.1f} s after kill -9: {[p.cmdline() for p in alive]}"
        run.wait()
        assert state_file.exists() and read_state(state_file) is None  # left behind, but seen as stale
    finally:
        if run.poll() is None:
            run.kill()
        run.wait()
