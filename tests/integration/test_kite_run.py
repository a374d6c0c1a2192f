"""`kite run` as a user runs it: killed with SIGKILL (a supervisor's timeout, an OOM kill), it leaves no
process behind: every service gets SIGTERM from the kernel (PR_SET_PDEATHSIG) and, with its bus gone,
stops at once instead of waiting out NATS timeouts or finishing answers nobody can receive."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import psutil

from kite_cli.local_servers import free_port

LEFTOVER_LIMIT_S = 5.0  # issue 13: no KITE process remains 5 s after `kill -9` of `kite run`


def test_sigkill_of_kite_run_leaves_no_process_behind(tmp_path):
    port = free_port()
    env = {**os.environ, "KITE_ENGINE": "transformers"}  # the same services; a start in seconds, not minutes
    with (tmp_path / "kite-run.log").open("wb") as log:
        run = subprocess.Popen([sys.executable, "-m", "kite_cli.main", "run", "--http-port", str(port),
                                "--grpc-port", str(free_port())], env=env, stdout=log, stderr=subprocess.STDOUT,
                               start_new_session=True)
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
        started = psutil.Process(run.pid).children(recursive=True)
        names = {" ".join(p.cmdline()[-2:]) for p in started}
        assert {"-m kite_worker", "-m kite_ru_pool", "-m kite_gateway"} <= names, names
        run.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        _, alive = psutil.wait_procs(started, timeout=LEFTOVER_LIMIT_S)
        assert not alive, f"alive {time.monotonic() - killed:.1f} s after kill -9: {[p.cmdline() for p in alive]}"
    finally:
        if run.poll() is None:
            run.kill()
        run.wait()
