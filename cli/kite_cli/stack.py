"""A whole KITE stack on this machine: its own nats-server (and redis-server when installed) plus the five
services, each a separate process. Used by `kite run` (make run), the integration tests and benchmarks.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from kite_cli.local_servers import LocalServer, die_with_parent, find_binary, free_port, start_nats, start_redis

SERVICE_MODULES = {
    "fingerprinter": "kite_fingerprinter",
    "worker": "kite_worker",
    "ru-pool": "kite_ru_pool",
    "arbitrator": "kite_arbitrator",
    "gateway": "kite_gateway",
}


@dataclass
class StackOptions:
    http_port: int = 0  # 0 = a free port
    grpc_port: int = 0
    num_workers: int = 1
    host: str = "127.0.0.1"
    with_redis: bool = True  # start a redis-server for the warm tier when one is installed
    services: tuple[str, ...] = ("fingerprinter", "ru-pool", "arbitrator", "gateway")  # besides workers
    env: dict[str, str] = field(default_factory=dict)  # extra KITE_* settings for every service
    log_dir: Path | None = None
    metrics: bool = False  # give every non-gateway service a free KITE_METRICS_PORT
    redis_data_dir: Path | None = None  # keep the warm tier there across restarts (kite run); None: in memory


@dataclass
class ServiceProcess:
    name: str
    process: subprocess.Popen
    log_path: Path
    metrics_port: int = 0  # its Prometheus endpoint on 127.0.0.1, when StackOptions.metrics is on


class LocalStack:
    def __init__(self, options: StackOptions) -> None:
        self.options = options
        self.http_port = options.http_port or free_port()
        self.grpc_port = options.grpc_port or free_port()
        self.log_dir = options.log_dir or Path(tempfile.mkdtemp(prefix="kite-stack-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.nats: LocalServer | None = None
        self.redis: LocalServer | None = None
        self.processes: list[ServiceProcess] = []
        self._worker_count = 0

    @property
    def http_url(self) -> str:
        return f"http://{self.options.host}:{self.http_port}"

    @property
    def grpc_target(self) -> str:
        return f"{self.options.host}:{self.grpc_port}"

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

    def start(self, timeout_s: float = 180.0) -> None:
        self.nats = start_nats(log_file=self.log_dir / "nats-server.log")
        if self.options.with_redis and "KITE_REDIS_URL" not in self.options.env \
                and find_binary("redis-server"):
            self.redis = start_redis(log_file=self.log_dir / "redis-server.log",
                                     data_dir=self.options.redis_data_dir)
        for name in self.options.services:
            self.start_service(name)
        for _ in range(self.options.num_workers):
            self.start_worker()
        self.wait_healthy(timeout_s)

    def start_service(self, name: str, extra_env: dict[str, str] | None = None,
                      instance_id: str | None = None) -> ServiceProcess:
        env = self.base_env()
        env.update(extra_env or {})
        if instance_id:
            env["KITE_INSTANCE_ID"] = instance_id
        metrics_port = 0
        if self.options.metrics and name != "gateway":  # the gateway serves /metrics on its HTTP port
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
        return self.start_service("worker", extra_env, instance_id=f"worker-{self._worker_count}")

    def workers(self) -> list[ServiceProcess]:
        return [p for p in self.processes if p.name == "worker" and p.process.poll() is None]

    def health_status(self) -> int:
        try:
            with urllib.request.urlopen(self.http_url + "/health", timeout=2) as r:
                return r.status
        except urllib.error.HTTPError as exc:
            return exc.code
        except OSError:
            return 0

    def wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            dead = [p for p in self.processes if p.process.poll() is not None and p.name != "worker"]
            if dead:
                raise RuntimeError(f"{dead[0].name} exited with code {dead[0].process.returncode}; "
                                   f"see {dead[0].log_path}:\n{self.tail(dead[0])}")
            if self.health_status() == 200:
                return
            time.sleep(0.25)
        raise TimeoutError(f"the stack was not healthy within {timeout_s} s; logs in {self.log_dir}")

    @staticmethod
    def tail(proc: ServiceProcess, num_bytes: int = 3000) -> str:
        data = proc.log_path.read_bytes() if proc.log_path.exists() else b""
        return data[-num_bytes:].decode(errors="replace")

    def stop_process(self, proc: ServiceProcess, sig: int = signal.SIGTERM, timeout_s: float = 30.0) -> None:
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
        for proc in list(self.processes):
            self.stop_process(proc)
        self.processes.clear()
        for name in self.options.services:
            self.start_service(name)
        for _ in range(num_workers):
            self.start_worker()
        self.wait_healthy(timeout_s)

    def restart_nats(self, down_s: float = 1.0) -> None:
        """Stop the stack's nats-server and start a new one on the same port (services must reconnect)."""
        port = self.nats.port
        self.nats.stop()
        time.sleep(down_s)
        self.nats = start_nats(port=port, log_file=self.log_dir / "nats-server.log")

    def stop(self) -> None:
        # Gateway first (stops taking requests), workers last among services (finish streams).
        order = {"gateway": 0, "fingerprinter": 1, "arbitrator": 2, "ru-pool": 3, "worker": 4}
        for proc in sorted(self.processes, key=lambda p: order[p.name]):
            self.stop_process(proc)
        for server in (self.redis, self.nats):
            if server is not None:
                server.stop()

    def __enter__(self) -> "LocalStack":
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
