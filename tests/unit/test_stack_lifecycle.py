"""LocalStack's start watch and bounded stop, and `kite run`'s watch once serving, on real (tiny) processes
in place of the services: a worker that exits by itself while a start waits is reported once and the wait
goes on while another worker runs; none left fails it; a worker the stack stops is no event; the stop event
interrupts it; `wait_workers` waits for the gateway to count every worker. `stop` kills, with its process
group, a service that ignores SIGTERM once its time is up."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import psutil
import pytest

from kite_cli import main as kite_main
from kite_cli.stack import LocalStack, ServiceProcess, StackOptions, StartInterrupted
from tests.helpers import wait_until

SLEEP = "import time; time.sleep(60)"


class Stack(LocalStack):
    """A stack with no servers, whose processes the test starts; what it reports is kept."""

    def __init__(self, tmp_path) -> None:
        super().__init__(StackOptions(log_dir=tmp_path, services=()))
        self.reports: list[str] = []

    def report(self, message: str) -> None:
        self.reports.append(message)

    def spawn(self, name: str, instance_id: str, code: str = SLEEP) -> ServiceProcess:
        log_path = self.log_dir / f"{instance_id}.log"
        with log_path.open("ab") as log:
            process = subprocess.Popen([sys.executable, "-c", code], stdout=log, stderr=subprocess.STDOUT,
                                       start_new_session=True)
        proc = ServiceProcess(name, process, log_path)
        self.processes.append(proc)
        return proc


def exits_after(delay_s: float, status: int, says: str) -> str:
    return f"import time; time.sleep({delay_s}); print({says!r}); raise SystemExit({status})"


@pytest.fixture()
def stack(tmp_path):
    stack = Stack(tmp_path)
    yield stack
    stack.stop(timeout_s=2)


def test_a_worker_that_exits_while_waiting_is_reported_once_and_the_wait_goes_on(stack):
    stack.spawn("worker", "worker-1", exits_after(0.3, 3, "cannot load the model"))
    stack.spawn("worker", "worker-2")
    stack.spawn("gateway", "gateway")
    stack.wait_started(settle_s=1.5)
    assert len(stack.reports) == 1
    assert stack.reports[0].startswith("worker-1 exited with code 3; see ")
    assert stack.reports[0].endswith("cannot load the model")
    assert [p.instance_id for p in stack.workers()] == ["worker-2"]


def test_no_worker_left_fails_the_wait(stack):
    stack.spawn("worker", "worker-1", exits_after(0.2, 1, "bad setting"))
    stack.spawn("worker", "worker-2", exits_after(0.4, 1, "bad setting"))
    with pytest.raises(RuntimeError, match=r"no worker is left \(worker-1, worker-2 exited while starting"):
        stack.wait_started(settle_s=5)
    assert [r.split()[0] for r in stack.reports] == ["worker-1", "worker-2"]


def test_workers_dead_before_the_wait_or_stopped_by_the_stack_are_no_event(stack):
    dead = stack.spawn("worker", "worker-1", "raise SystemExit(1)")
    dead.process.wait()
    stopped = stack.spawn("worker", "worker-2")
    stack.spawn("worker", "worker-3")
    threading.Timer(0.2, stack.stop_process, (stopped,)).start()
    stack.wait_started(settle_s=1.0)
    assert stopped.process.poll() is not None and stack.reports == []


def test_another_service_that_exits_fails_the_wait_with_its_log(stack):
    stack.spawn("worker", "worker-1")
    stack.spawn("ru-pool", "ru-pool", exits_after(0.2, 2, "port in use"))
    with pytest.raises(RuntimeError, match=r"ru-pool exited with code 2; see .*\n.*port in use"):
        stack.wait_started(settle_s=5)


def test_the_stop_event_interrupts_the_wait(stack):
    stack.spawn("worker", "worker-1")
    stop = threading.Event()
    threading.Timer(0.3, stop.set).start()
    started = time.monotonic()
    with pytest.raises(StartInterrupted):
        stack.wait_healthy(timeout_s=30, stop=stop)  # nothing answers /health
    assert time.monotonic() - started < 3


class _Health(BaseHTTPRequestHandler):
    """A gateway's /health: 503 until `workers` is set, then 200 with that count."""

    workers: list[int] = []

    def do_GET(self) -> None:
        body = json.dumps({"status": "ok", "workers": self.workers[-1]} if self.workers else {"error": {}})
        self.send_response(200 if self.workers else 503)
        self.end_headers()
        self.wfile.write(body.encode())

    def log_message(self, *args) -> None:
        pass


@pytest.fixture()
def health(stack):
    server = ThreadingHTTPServer((stack.options.host, stack.http_port), _Health)
    _Health.workers = []
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield _Health.workers
    server.shutdown()
    server.server_close()


def test_wait_workers_waits_for_the_gateway_to_count_them_all(stack, health):
    stack.spawn("worker", "worker-1")
    assert stack.live_workers() is None  # 503: not healthy yet
    threading.Timer(0.2, health.append, (1,)).start()
    threading.Timer(0.8, health.append, (2,)).start()
    started = time.monotonic()
    stack.wait_workers(2, timeout_s=10)
    assert time.monotonic() - started >= 0.7 and stack.live_workers() == 2
    with pytest.raises(TimeoutError, match="the gateway counted 2 live workers, not 3, for 0.5 s"):
        stack.wait_workers(3, timeout_s=0.5)


def test_wait_workers_fails_when_no_worker_is_left(stack, health):
    stack.spawn("worker", "worker-1", exits_after(0.2, 1, "out of memory"))
    with pytest.raises(RuntimeError, match=r"no worker is left \(worker-1 exited"):
        stack.wait_workers(1, timeout_s=10)


def test_stop_kills_what_ignores_sigterm_with_its_process_group_once_its_time_is_up(stack):
    # A service busy where SIGTERM does not reach it (vLLM compiling), with a child of its own.
    deaf = ("import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            f"subprocess.Popen([sys.executable, '-c', {SLEEP!r}]); time.sleep(60)")
    stubborn = stack.spawn("worker", "worker-1", deaf)
    gateway = stack.spawn("gateway", "gateway")
    ru_pool = stack.spawn("ru-pool", "ru-pool")
    wait_until(lambda: psutil.Process(stubborn.process.pid).children(), 10, "the deaf worker's child process",
               interval_s=0.05)
    child = psutil.Process(stubborn.process.pid).children()[0]
    time.sleep(0.3)  # its SIGTERM handler is set
    started = time.monotonic()
    stack.stop(timeout_s=1.0)
    took = time.monotonic() - started
    assert 0.9 < took < 2.0, took
    assert stubborn.process.returncode == -9
    assert gateway.process.returncode == ru_pool.process.returncode == -15  # they took SIGTERM
    child.wait(2)


def test_kite_run_once_serving_reports_exits_and_stops_when_no_worker_is_left(stack, capsys):
    one = stack.spawn("worker", "worker-1", exits_after(0, 1, "out of memory"))
    two = stack.spawn("worker", "worker-2")
    stack.spawn("gateway", "gateway")
    one.process.wait()
    told: set[int] = set()
    assert kite_main._report_exits(stack, told) == 0  # worker-2 serves on
    assert "worker-1 exited with code 1" in capsys.readouterr().err
    assert kite_main._report_exits(stack, told) == 0 and capsys.readouterr().err == ""  # told once
    two.process.kill()
    two.process.wait()
    assert kite_main._report_exits(stack, told) == 1
    err = capsys.readouterr().err
    assert "worker-2 exited with code -9" in err and "no worker is left" in err


def test_kite_run_once_serving_stops_when_another_service_exits(stack, capsys):
    stack.spawn("worker", "worker-1")
    gateway = stack.spawn("gateway", "gateway", exits_after(0, 1, "address in use"))
    gateway.process.wait()
    assert kite_main._report_exits(stack, set()) == 1
    assert "gateway exited with code 1" in capsys.readouterr().err


class RecordingStack(LocalStack):
    """Records what each service would be started with."""

    def __init__(self, options: StackOptions) -> None:
        super().__init__(options)
        self.started: list[tuple[str, dict | None, str | None]] = []

    def start_service(self, name, extra_env=None, instance_id=None, metrics=None):
        self.started.append((name, extra_env, instance_id))


@pytest.fixture()
def four_cores(monkeypatch):
    monkeypatch.setattr("os.cpu_count", lambda: 4)
    for name in ("VLLM_CPU_OMP_THREADS_BIND", "KITE_WORKER_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)


def test_each_worker_the_start_starts_gets_its_own_settings(tmp_path, four_cores):
    stack = RecordingStack(StackOptions(log_dir=tmp_path, services=("gateway",), num_workers=3,
                                        worker_envs=[{"VLLM_CPU_OMP_THREADS_BIND": "0"},
                                                     {"VLLM_CPU_OMP_THREADS_BIND": "1"}]))
    stack._start_services(pool_replicas=1, num_workers=3, arbitrators=1)
    assert stack.started == [
        ("gateway", None, None),
        ("worker", {"VLLM_CPU_OMP_THREADS_BIND": "0"}, "worker-1"),
        ("worker", {"VLLM_CPU_OMP_THREADS_BIND": "1"}, "worker-2"),
        # past the list's end: its share of the cores (4 // 3 = 1 thread, the third core)
        ("worker", {"KITE_WORKER_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "2"}, "worker-3")]


def test_several_workers_share_the_cores_out_unless_told_otherwise(tmp_path, four_cores, monkeypatch):
    def workers(num_workers: int, **options) -> list[dict | None]:
        stack = RecordingStack(StackOptions(log_dir=tmp_path, services=(), num_workers=num_workers, **options))
        stack._start_services(pool_replicas=1, num_workers=num_workers, arbitrators=1)
        stack.start_worker()  # one joining later takes the next share, wrapping round
        return [env for _, env, _ in stack.started]

    assert workers(2) == [{"KITE_WORKER_NUM_THREADS": "2", "VLLM_CPU_OMP_THREADS_BIND": "0,1"},
                          {"KITE_WORKER_NUM_THREADS": "2", "VLLM_CPU_OMP_THREADS_BIND": "2,3"},
                          {"KITE_WORKER_NUM_THREADS": "2", "VLLM_CPU_OMP_THREADS_BIND": "0,1"}]
    assert workers(2, env={"KITE_WORKER_NUM_THREADS": "1"})[1] == {
        "KITE_WORKER_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "1"}
    assert workers(1) == [{}, {}]  # one worker keeps vLLM's binding: every core is its own
    assert workers(2, env={"VLLM_CPU_OMP_THREADS_BIND": "auto"}) == [{}, {}, {}]
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-3")
    assert workers(2) == [{}, {}, {}]
