"""Shared fixtures: real servers on free ports, never the machine's own (Dynamo's tests/conftest.py style)."""

from __future__ import annotations

import pytest

from kite_cli.local_servers import LocalServer, start_nats, start_redis


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
