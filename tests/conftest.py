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
