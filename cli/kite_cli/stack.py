"""A whole KITE stack on this machine: its own nats-server (and redis-server when installed) plus the five
services, each a separate process. Used by `kite run` (make run), the integration tests and benchmarks.

`kite run` records the stack it runs in a state file (`default_state_file()`, ~/.cache/kite/kite-run.json:
its pid, NATS URL, HTTP URL, gRPC address, log folder), removed when it stops; the admin commands (`kite
pool`, `python -m kite_cli.arbitrator_admin`) find the running stack's NATS there (`admin_nats_url`).

A start (`start`, `restart_services`, `wait_healthy`, and `wait_workers` for all of them to be live)
reports a worker that exits while it waits (`report`: its name, exit code and log tail) and goes on with
the others; it fails when no worker is left. After the
start a worker may die or be killed (tests do): the stack says nothing, `kite run` watches for itself.
`stop` is bounded: what has not exited when its time is up is killed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from kite_cli.local_servers import LocalServer, die_with_parent, find_binary, free_port, start_nats, start_redis
from kite_shared.config import setting

SERVICE_MODULES = {
    "fingerprinter": "kite_fingerprinter",
    "worker": "kite_worker",
    "ru-pool": "kite_ru_pool",
    "arbitrator": "kite_arbitrator",
    "gateway": "kite_gateway",
}


def default_threads(num_workers: int, num_cores: int) -> int:
    """Each worker's share of the cores, at least one thread."""
    return max(1, num_cores // num_workers)


def core_sets(num_workers: int, threads: int, num_cores: int) -> list[str]:
    """Worker i's cores (VLLM_CPU_OMP_THREADS_BIND), `threads` each, dealt out in turn and wrapping round
    when the workers want more cores than there are."""
    return [",".join(str((i * threads + k) % num_cores) for k in range(threads)) for i in range(num_workers)]


@dataclass
class StackOptions:
    # 0 = a free port; None = the KITE_GATEWAY_HTTP_PORT / _GRPC_PORT / _HOST settings (`kite run`), where
    # a gRPC port of 0 turns gRPC off, as for the gateway itself.
    http_port: int | None = 0
    grpc_port: int | None = 0
    num_workers: int = 1
    # ru-pool replicas (docs/ru-pool.md, "Replicas"): with more than one, each is named ru-pool-<n> and has
    # its own KITE_METRICS_PORT (a free one), whatever `metrics` says.
    pool_replicas: int = 1
    # arbitrator replicas (docs/arbitrator.md, "Replicas": one leads through a JetStream lease): likewise,
    # with more than one each is arbitrator-<n> with its own free KITE_METRICS_PORT.
    arbitrators: int = 1
    host: str | None = "127.0.0.1"
    with_redis: bool = True  # start a redis-server for the warm tier when one is installed
    services: tuple[str, ...] = ("fingerprinter", "ru-pool", "arbitrator", "gateway")  # besides workers
    env: dict[str, str] = field(default_factory=dict)  # extra KITE_* settings for every service
    # extra settings of the i-th worker `start` starts, on top of `env` (benchmarks pin each worker's model
    # threads to its own cores); workers past the list's end get none
    worker_envs: list[dict[str, str]] = field(default_factory=list)
    log_dir: Path | None = None
    metrics: bool = False  # give every non-gateway service a free KITE_METRICS_PORT
    redis_data_dir: Path | None = None  # keep the warm tier there across restarts (kite run); None: in memory
    state_file: Path | None = None  # record the running stack there for the admin commands (kite run)


@dataclass
class ServiceProcess:
    name: str
    process: subprocess.Popen
    log_path: Path
    metrics_port: int = 0  # its Prometheus endpoint on 127.0.0.1, when StackOptions.metrics is on
    # Set when this stack stops it (stop_process, kill, stop): its exit is then no event to report.
    stop_requested: bool = False

    @property
    def instance_id(self) -> str:
        """Its KITE_INSTANCE_ID (worker-1, ru-pool-2, arbitrator-1, ...), or the service name for a
        single unnamed one (which then names itself <host>-<pid> on the bus)."""
        return self.log_path.stem


class StartInterrupted(Exception):
    """The start's `stop` event was set (kite run: SIGINT or SIGTERM) before the stack was up."""


def _gateway_setting(name: str) -> int | str:
    """A KITE_GATEWAY_* setting from this process's environment (validated by the registry)."""
    spec = setting(name)
    return spec.parse(os.environ.get(spec.env, spec.default))


class LocalStack:
    def __init__(self, options: StackOptions) -> None:
        self.options = options
        if options.host is None:
            options.host = _gateway_setting("KITE_GATEWAY_HOST")
        # A port setting of 0 asks for a free one (the stack must know it to print and probe it) ...
        http_port = _gateway_setting("KITE_GATEWAY_HTTP_PORT") if options.http_port is None else options.http_port
        self.http_port = http_port or free_port()
        # ... but KITE_GATEWAY_GRPC_PORT=0 turns gRPC off.
        if options.grpc_port is None:
            self.grpc_port = _gateway_setting("KITE_GATEWAY_GRPC_PORT")
        else:
            self.grpc_port = options.grpc_port or free_port()
        self.log_dir = options.log_dir or Path(tempfile.mkdtemp(prefix="kite-stack-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.nats: LocalServer | None = None
        self.redis: LocalServer | None = None
        self.processes: list[ServiceProcess] = []
        self._worker_count = 0
        self._pool_count = 0
        self._arbitrator_count = 0

    @property
    def http_url(self) -> str:
        return f"http://{self.options.host}:{self.http_port}"

    @property
    def grpc_target(self) -> str:
        return f"{self.options.host}:{self.grpc_port}" if self.grpc_port else "off (KITE_GATEWAY_GRPC_PORT=0)"

    def base_env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update({
            "KITE_NATS_URL": self.nats.url if self.nats else env.get("KITE_NATS_URL", ""),
            "KITE_GATEWAY_HOST": self.options.host,
            "KITE_GATEWAY_HTTP_PORT": str(self.http_port),
            "KITE_GATEWAY_GRPC_PORT": str(self.grpc_port),
            "PYTHONUNBUFFERED": "1",
        })
        if self.redis is not None:
            env["KITE_REDIS_URL"] = self.redis.url
        # A local dev stack has no API keys: auth is off unless the caller's environment turns it on.
        env.setdefault("KITE_AUTH_ENABLED", "off")
        env.update(self.options.env)
        return env

    def start(self, timeout_s: float = 180.0, stop: threading.Event | None = None) -> None:
        """nats-server, redis-server and every service, until the gateway answers /health (without a gateway:
        until no process exited for a second). Raises RuntimeError when a service other than a worker exits
        or no worker is left (each worker that exits is reported as it does), TimeoutError after
        `timeout_s`, StartInterrupted within about 2 s of `stop` being set. What it started keeps running
        when it raises: the caller stops it (`stop`, or the context manager)."""
        self.nats = start_nats(log_file=self.log_dir / "nats-server.log")
        if self.options.state_file is not None:  # known now: admin commands can find it while it starts
            write_state(self.options.state_file, self.state())
        if self.options.with_redis and "KITE_REDIS_URL" not in self.options.env \
                and find_binary("redis-server"):
            self.redis = start_redis(log_file=self.log_dir / "redis-server.log",
                                     data_dir=self.options.redis_data_dir)
        self._start_services(self.options.pool_replicas, self.options.num_workers, self.options.arbitrators)
        started_workers = [p for p in self.processes if p.name == "worker"]
        if "gateway" in self.options.services:
            self._wait_healthy(timeout_s, stop, started_workers)
        else:  # nothing answers /health: only check that every process started
            self._wait_started(1.0, stop, started_workers)

    def _start_services(self, pool_replicas: int, num_workers: int, arbitrators: int) -> None:
        for name in self.options.services:
            if name == "ru-pool":
                for _ in range(pool_replicas):
                    self.start_pool_replica()
            elif name == "arbitrator":
                for _ in range(arbitrators):
                    self.start_arbitrator()
            else:
                self.start_service(name)
        for i in range(num_workers):
            self.start_worker(self.options.worker_envs[i] if i < len(self.options.worker_envs) else None)

    def start_service(self, name: str, extra_env: dict[str, str] | None = None,
                      instance_id: str | None = None, metrics: bool | None = None) -> ServiceProcess:
        """`metrics`: give it a free KITE_METRICS_PORT (None: as StackOptions.metrics says)."""
        env = self.base_env()
        env.update(extra_env or {})
        if instance_id:
            env["KITE_INSTANCE_ID"] = instance_id
        metrics_port = 0
        if metrics is None:
            metrics = self.options.metrics
        if metrics and name != "gateway":  # the gateway serves /metrics on its HTTP port
            metrics_port = free_port()
            env["KITE_METRICS_PORT"] = str(metrics_port)
        log_path = self.log_dir / f"{instance_id or name}.log"
        log = log_path.open("ab")
        # Own session (a terminal's Ctrl-C reaches `kite run` only, which stops services in order), but
        # dies with its parent: a killed `kite run` or test run leaves no service behind.
        process = subprocess.Popen([sys.executable, "-m", SERVICE_MODULES[name]], env=env,
                                   stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                   preexec_fn=die_with_parent)
        proc = ServiceProcess(name, process, log_path, metrics_port)
        self.processes.append(proc)
        return proc

    def start_worker(self, extra_env: dict[str, str] | None = None) -> ServiceProcess:
        self._worker_count += 1
        env = {**self.worker_cores(self._worker_count - 1, extra_env or {}), **(extra_env or {})}
        return self.start_service("worker", env, instance_id=f"worker-{self._worker_count}")

    def worker_cores(self, index: int, extra_env: dict[str, str]) -> dict[str, str]:
        """Worker `index`'s (0-based) share of this host's cores, when the stack runs several workers and
        nothing set their threads or binding (the caller's environment, StackOptions.env, `extra_env`):
        KITE_WORKER_NUM_THREADS = the cores shared out, and vLLM-CPU's VLLM_CPU_OMP_THREADS_BIND = its own
        cores. vLLM's default binding (`auto`) runs every engine's threads on every core whatever the
        thread count says: two engines on 2 cores then ran four spinning threads, and 4 concurrent
        requests went from 1.0-1.5 req/s to 0.11 (docs/benchmarks.md, "A fleet against vllm-router")."""
        chosen = {**os.environ, **self.options.env, **extra_env}
        if self.options.num_workers < 2 or "VLLM_CPU_OMP_THREADS_BIND" in chosen:
            return {}
        num_cores = os.cpu_count() or 1
        threads = int(chosen.get("KITE_WORKER_NUM_THREADS") or 0) or default_threads(self.options.num_workers,
                                                                                       num_cores)
        cores = core_sets(self.options.num_workers, threads, num_cores)[index % self.options.num_workers]
        return {"KITE_WORKER_NUM_THREADS": str(threads), "VLLM_CPU_OMP_THREADS_BIND": cores}

    def start_pool_replica(self, extra_env: dict[str, str] | None = None) -> ServiceProcess:
        """One more ru-pool replica. Alone (the default) it is `ru-pool` as before; once the stack runs
        several (StackOptions.pool_replicas > 1, or a replica added later) each is ru-pool-<n> with its
        own metrics port."""
        self._pool_count += 1
        if self.options.pool_replicas <= 1 and self._pool_count == 1:
            return self.start_service("ru-pool", extra_env)
        return self.start_service("ru-pool", extra_env, instance_id=f"ru-pool-{self._pool_count}", metrics=True)

    def start_arbitrator(self, extra_env: dict[str, str] | None = None) -> ServiceProcess:
        """One more arbitrator replica, named as start_pool_replica names ru-pool replicas: alone it is
        `arbitrator`; with several (StackOptions.arbitrators > 1, or one added later) arbitrator-<n> with
        its own metrics port."""
        self._arbitrator_count += 1
        if self.options.arbitrators <= 1 and self._arbitrator_count == 1:
            return self.start_service("arbitrator", extra_env)
        return self.start_service("arbitrator", extra_env, instance_id=f"arbitrator-{self._arbitrator_count}",
                                  metrics=True)

    def process(self, instance_id: str) -> ServiceProcess:
        """The stack's process named `instance_id` (ServiceProcess.instance_id: worker-2, ru-pool-1,
        arbitrator-2, gateway, ...), running or not: the newest one of that name. KeyError if none."""
        for proc in reversed(self.processes):
            if proc.instance_id == instance_id:
                return proc
        raise KeyError(f"no process {instance_id!r} in this stack: "
                       f"{sorted({p.instance_id for p in self.processes})}")

    def kill(self, instance_id: str, sig: int = signal.SIGKILL) -> ServiceProcess:
        """Send `sig` (default SIGKILL: no drain, no goodbye on the bus) to the named process and wait
        until it is gone; returns it."""
        proc = self.process(instance_id)
        self.stop_process(proc, sig=sig)
        return proc

    def workers(self) -> list[ServiceProcess]:
        return [p for p in self.processes if p.name == "worker" and p.process.poll() is None]

    def pool_replicas(self) -> list[ServiceProcess]:
        return [p for p in self.processes if p.name == "ru-pool" and p.process.poll() is None]

    def arbitrators(self) -> list[ServiceProcess]:
        return [p for p in self.processes if p.name == "arbitrator" and p.process.poll() is None]

    def health_status(self) -> int:
        try:
            with urllib.request.urlopen(self.http_url + "/health", timeout=2) as r:
                return r.status
        except urllib.error.HTTPError as exc:
            return exc.code
        except OSError:
            return 0

    def live_workers(self) -> int | None:
        """How many live workers the gateway's /health counts; None while it is not healthy (503: no worker
        or no fingerprinter answers) or does not answer."""
        try:
            with urllib.request.urlopen(self.http_url + "/health", timeout=2) as r:
                return json.load(r).get("workers")
        except (OSError, ValueError):  # urllib's HTTPError is an OSError
            return None

    def wait_workers(self, count: int, timeout_s: float = 120.0, stop: threading.Event | None = None) -> None:
        """Until the gateway counts exactly `count` live workers (/health answers 200 from the first one, so
        a test or benchmark that needs them all waits here). The workers running now are watched as
        `wait_healthy` watches them."""
        watched = self.workers()
        deadline = time.monotonic() + timeout_s
        reported: set[int] = set()
        seen = None
        while time.monotonic() < deadline:
            self._check_starting(stop, watched, reported)
            seen = self.live_workers()
            if seen == count:
                return
            time.sleep(0.25)
        raise TimeoutError(f"the gateway counted {seen} live workers, not {count}, for {timeout_s} s; "
                           f"logs in {self.log_dir}")

    def wait_healthy(self, timeout_s: float, stop: threading.Event | None = None) -> None:
        """Until the gateway's /health answers 200, as `start` waits. The workers running now are the ones it
        watches: one that exits by itself is reported, and none left fails the wait; a worker that died
        before it, or that this stack stops meanwhile, is no event."""
        self._wait_healthy(timeout_s, stop, self.workers())

    def wait_started(self, settle_s: float = 1.0, stop: threading.Event | None = None) -> None:
        """For a stack without a gateway: fail if a service process exits within `settle_s` (a worker: as
        `wait_healthy` says)."""
        self._wait_started(settle_s, stop, self.workers())

    def _wait_healthy(self, timeout_s: float, stop: threading.Event | None,
                      watched: list[ServiceProcess]) -> None:
        deadline = time.monotonic() + timeout_s
        reported: set[int] = set()
        while time.monotonic() < deadline:
            self._check_starting(stop, watched, reported)
            if self.health_status() == 200:
                return
            time.sleep(0.25)
        raise TimeoutError(f"the stack was not healthy within {timeout_s} s; logs in {self.log_dir}")

    def _wait_started(self, settle_s: float, stop: threading.Event | None, watched: list[ServiceProcess]) -> None:
        deadline = time.monotonic() + settle_s
        reported: set[int] = set()
        while time.monotonic() < deadline:
            self._check_starting(stop, watched, reported)
            time.sleep(0.1)

    def _check_starting(self, stop: threading.Event | None, watched: list[ServiceProcess],
                        reported: set[int]) -> None:
        """One look while waiting for a start: raise if it must end, report a watched worker that exited by
        itself (once: `reported` holds their pids)."""
        if stop is not None and stop.is_set():
            raise StartInterrupted("stopped while starting")
        dead = [p for p in self.processes if p.process.poll() is not None and p.name != "worker"]
        if dead:
            raise RuntimeError(self.exit_report(dead[0]))
        for proc in watched:
            if proc.process.poll() is not None and not proc.stop_requested and proc.process.pid not in reported:
                reported.add(proc.process.pid)
                self.report(self.exit_report(proc))
        if reported and not self.workers():
            names = ", ".join(p.instance_id for p in watched if p.process.pid in reported)
            raise RuntimeError(f"no worker is left ({names} exited while starting, reported above); "
                               f"logs in {self.log_dir}")

    def exit_report(self, proc: ServiceProcess) -> str:
        """What to tell about a process that exited: its name, exit code and the tail of its log."""
        return (f"{proc.instance_id} exited with code {proc.process.returncode}; see {proc.log_path}:\n"
                f"{self.tail(proc).rstrip()}")

    def report(self, message: str) -> None:
        """How a start tells about a worker that exited while it goes on (stderr; a subclass may log)."""
        print(message, file=sys.stderr, flush=True)

    @staticmethod
    def tail(proc: ServiceProcess, num_bytes: int = 3000) -> str:
        data = proc.log_path.read_bytes() if proc.log_path.exists() else b""
        return data[-num_bytes:].decode(errors="replace")

    def stop_process(self, proc: ServiceProcess, sig: int = signal.SIGTERM, timeout_s: float = 30.0) -> None:
        proc.stop_requested = True
        if proc.process.poll() is None:
            proc.process.send_signal(sig)
            try:
                proc.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                proc.process.kill()
                proc.process.wait()

    def restart_services(self, timeout_s: float = 180.0) -> None:
        """Stop every KITE process and start them again; nats-server and redis-server keep running."""
        num_workers = len(self.workers())
        pool_replicas = len(self.pool_replicas()) or self.options.pool_replicas
        arbitrators = len(self.arbitrators()) or self.options.arbitrators
        for proc in list(self.processes):
            self.stop_process(proc)
        self.processes.clear()
        self._pool_count = 0
        self._arbitrator_count = 0
        self._start_services(pool_replicas, num_workers, arbitrators)
        self.wait_healthy(timeout_s)

    def restart_nats(self, down_s: float = 1.0) -> None:
        """Stop the stack's nats-server and start a new one on the same port (services must reconnect)."""
        port = self.nats.port
        self.nats.stop()
        time.sleep(down_s)
        self.nats = start_nats(port=port, log_file=self.log_dir / "nats-server.log")

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop every service, then redis-server and nats-server, and remove the state file; the services
        take at most `timeout_s` together, whatever they are doing (a worker compiling its model may not
        act on SIGTERM for long): what still runs then is killed with its process group.

        The gateway gets SIGTERM first: it stops taking requests and finishes its streams while the workers
        still serve them; then every other service at once (with the gateway gone nothing waits on them)."""
        deadline = time.monotonic() + timeout_s
        self._terminate_together([p for p in self.processes if p.name == "gateway"], deadline)
        self._terminate_together([p for p in self.processes if p.name != "gateway"], deadline)
        for server in (self.redis, self.nats):
            if server is not None:
                server.stop()
        if self.options.state_file is not None:
            remove_state(self.options.state_file)

    @staticmethod
    def _terminate_together(procs: list[ServiceProcess], deadline: float) -> None:
        """SIGTERM to each of `procs`, then wait for all until `deadline`; SIGKILL to the process group (its
        own session: vLLM's engine processes included) of each one still running then."""
        running = [p for p in procs if p.process.poll() is None]
        for proc in running:
            proc.stop_requested = True
            proc.process.terminate()
        for proc in running:
            try:
                proc.process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                # Not reaped yet, so its pid (its group's id) cannot have been reused.
                os.killpg(proc.process.pid, signal.SIGKILL)
                proc.process.wait()

    def state(self) -> StackState:
        return StackState(pid=os.getpid(), nats_url=self.nats.url if self.nats else "",
                            http_url=self.http_url, grpc_target=self.grpc_target, log_dir=str(self.log_dir))

    def __enter__(self) -> "LocalStack":
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


# ------------------------------------------------------------------------ the running `kite run` stack
def default_state_file() -> Path:
    """Where `kite run` records the stack it runs, beside its other data (~/.cache/kite)."""
    return Path.home() / ".cache" / "kite" / "kite-run.json"


@dataclass(frozen=True)
class StackState:
    pid: int  # of the `kite run` process
    nats_url: str
    http_url: str
    grpc_target: str
    log_dir: str


def write_state(path: Path, state: StackState) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(state.__dict__, indent=2) + "\n")
    tmp.replace(path)  # readers see the old file or the new one, never half of one


def read_state(path: Path | None = None) -> StackState | None:
    """The stack recorded in `path` (default: `default_state_file()`) while its `kite run` lives; None when
    there is none, or the file is unreadable or was left by a `kite run` that was killed."""
    path = default_state_file() if path is None else path
    try:
        data = json.loads(path.read_text())
        state = StackState(pid=int(data["pid"]), nats_url=str(data["nats_url"]),
                             http_url=str(data["http_url"]), grpc_target=str(data["grpc_target"]),
                             log_dir=str(data["log_dir"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return state if state.nats_url and psutil.pid_exists(state.pid) else None


def remove_state(path: Path) -> None:
    """Remove the state file if this process wrote it (a second `kite run` may have replaced it)."""
    try:
        if json.loads(path.read_text()).get("pid") == os.getpid():
            path.unlink()
    except (OSError, ValueError, AttributeError):
        pass


def admin_nats_url(explicit: str | None = None, state_file: Path | None = None,
                   environ: dict[str, str] | None = None) -> tuple[str, str]:
    """(NATS URL, where it came from) for an admin command: the command line's, else KITE_NATS_URL when
    set, else the running `kite run` stack's (its state file), else the registry default."""
    spec = setting("KITE_NATS_URL")
    environ = os.environ if environ is None else environ
    if explicit:
        return explicit, "the command line"
    if environ.get(spec.env):
        return environ[spec.env], spec.env
    running = read_state(state_file)
    if running is not None:
        return running.nats_url, f"the stack `kite run` (pid {running.pid}) runs"
    return spec.default, f"the {spec.env} default"
