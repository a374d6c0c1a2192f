"""Shared fixtures: real servers on free ports, never the machine's own (Dynamo's tests/conftest.py style)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import redis

from kite_cli.local_servers import LocalServer, find_binary, free_port, start_nats, start_redis
from kite_shared.service import freeze_startup_heap
from tests.helpers import wait_until


def pytest_collection_finish(session) -> None:
    """Every test module is imported (torch, transformers, vLLM: about 720,000 objects): frozen out of the
    garbage collector's reach, as each service freezes its startup heap. Otherwise a full collection walks
    them, about 0.4 s here, inside whichever test happens to allocate then, on the session's event loop:
    a CI run once saw a read bounded at 0.2 s end after 0.81 s."""
    freeze_startup_heap("test session")


@pytest.fixture(scope="session")
def nats_server() -> LocalServer:
    server = start_nats()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def redis_server() -> LocalServer:
    server = start_redis()
    yield server
    server.stop()


class RedisClusterServers:
    """A real Redis Cluster: `size` redis-server processes in cluster mode, all primaries (no replicas),
    AUTH on (the password is in `url`, as KITE_REDIS_URL carries it in production)."""

    PASSWORD = "kite-cluster-test"

    def __init__(self, size: int = 3, log_dir: Path | None = None) -> None:
        self.servers: list[LocalServer] = []
        ports: list[int] = []
        while len(ports) < 2 * size:  # a client port and a cluster-bus port per node, all distinct
            port = free_port()
            if port not in ports:
                ports.append(port)
        try:
            for port, bus_port in zip(ports[:size], ports[size:]):
                # The bus port is explicit: the default (port + 10000) can overflow for ephemeral ports.
                self.servers.append(start_redis(
                    port, log_file=log_dir / f"redis-{port}.log" if log_dir else None,
                    extra_args=["--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{port}.conf",
                                "--cluster-port", str(bus_port), "--requirepass", self.PASSWORD,
                                "--masterauth", self.PASSWORD]))
            create = subprocess.run(
                [find_binary("redis-cli"), "--cluster", "create", *(f"127.0.0.1:{p}" for p in self.ports),
                 "--cluster-replicas", "0", "--cluster-yes"],
                env={**os.environ, "REDISCLI_AUTH": self.PASSWORD}, capture_output=True, text=True,
                timeout=60)
            if create.returncode != 0:
                raise RuntimeError(f"redis-cli --cluster create failed:\n{create.stdout}\n{create.stderr}")
            self._wait_ok(30.0)
        except BaseException:
            self.stop()
            raise

    @property
    def ports(self) -> list[int]:
        return [s.port for s in self.servers]

    @property
    def url(self) -> str:
        """Seed-node URL for KITE_REDIS_URL with KITE_REDIS_CLUSTER on."""
        return f"redis://:{self.PASSWORD}@127.0.0.1:{self.ports[0]}/0"

    def node(self, port: int) -> redis.Redis:
        """A plain client of one node (sees only that node's keys)."""
        return redis.Redis(port=port, password=self.PASSWORD)

    def client(self) -> redis.RedisCluster:
        """A cluster-aware synchronous client, for checks from the test side."""
        return redis.RedisCluster(host="127.0.0.1", port=self.ports[0], password=self.PASSWORD)

    def flush(self) -> None:
        for port in self.ports:
            with self.node(port) as r:
                r.flushall()

    def _wait_ok(self, timeout_s: float) -> None:
        """Every node reports cluster_state:ok and knows every other node."""
        def infos() -> list:
            found = []
            for port in self.ports:
                with self.node(port) as r:
                    found.append(r.execute_command("CLUSTER INFO"))
            return found

        wait_until(infos, timeout_s, "Redis Cluster ok: every node's cluster_state ok, knowing every node",
                   done=lambda infos: all(i["cluster_state"] == "ok" and int(i["cluster_known_nodes"])
                                          == len(self.ports) for i in infos))

    def stop(self) -> None:
        for server in self.servers:
            server.stop()


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory) -> RedisClusterServers:
    """A 3-primary Redis Cluster on free ports for the session; tests flush it (`flush()`) as needed."""
    missing = [b for b in ("redis-server", "redis-cli") if find_binary(b) is None]
    if missing:
        pytest.skip(f"Redis Cluster tests need {' and '.join(missing)} (apt-get install redis-server)")
    cluster = RedisClusterServers(3, log_dir=tmp_path_factory.mktemp("redis-cluster"))
    yield cluster
    cluster.stop()


class S3Server:
    """moto's standalone S3-compatible server in its own process (a real HTTP server, not a mock)."""

    def __init__(self) -> None:
        import os
        import subprocess
        import sys
        from pathlib import Path

        from kite_cli.local_servers import free_port, wait_for_port

        self.port = free_port()
        moto = Path(sys.executable).parent / "moto_server"
        cmd = [str(moto)] if moto.exists() else [sys.executable, "-m", "moto.server"]
        self.process = subprocess.Popen(cmd + ["-H", "127.0.0.1", "-p", str(self.port)],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for_port(self.port, self.process, 30.0, "moto_server")
        # Credentials reach boto3 through its standard environment variables, as in production.
        self._saved = {k: os.environ.get(k) for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
        os.environ["AWS_ACCESS_KEY_ID"] = "kite-test"
        os.environ["AWS_SECRET_ACCESS_KEY"] = "kite-test-secret"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        import os

        for key, value in self._saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        if self.process.poll() is None:
            self.process.terminate()
            self.process.wait(10)


@pytest.fixture(scope="session")
def s3_server() -> S3Server:
    server = S3Server()
    yield server
    server.stop()
