"""`kite run`'s ports are settings, and the admin commands find the running local stack by themselves
(issue 13): the stack records itself in a state file while it runs; `kite pool` and the arbitrator admin
take the NATS URL from the command line, else KITE_NATS_URL, else that file, else the registry default.
The end-to-end check (a real `kite run`, `kite pool stats` without flags) is
tests/integration/test_kite_run.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kite_cli import arbitrator_admin, main as kite_main, pool_admin
from kite_cli.stack import (LocalStack, StackState, StackOptions, admin_nats_url, default_state_file,
                            read_state, remove_state, write_state)

GATEWAY_VARS = ("KITE_GATEWAY_HOST", "KITE_GATEWAY_HTTP_PORT", "KITE_GATEWAY_GRPC_PORT")


@pytest.fixture
def clean_env(monkeypatch, tmp_path):
    for name in (*GATEWAY_VARS, "KITE_NATS_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # default_state_file() lives under it
    return monkeypatch


def dead_pid() -> int:
    return int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True, check=True).stdout)


def state(pid: int | None = None, nats_url: str = "nats://127.0.0.1:4999") -> StackState:
    return StackState(pid=os.getpid() if pid is None else pid, nats_url=nats_url,
                        http_url="http://127.0.0.1:8000", grpc_target="127.0.0.1:50051", log_dir="/tmp/x")


# ------------------------------------------------------------------------------------ ports as settings
def test_kite_run_takes_host_and_ports_from_the_gateway_settings(clean_env, tmp_path):
    clean_env.setenv("KITE_GATEWAY_HTTP_PORT", "8123")
    clean_env.setenv("KITE_GATEWAY_GRPC_PORT", "50123")
    clean_env.setenv("KITE_GATEWAY_HOST", "127.0.0.2")
    stack = LocalStack(StackOptions(http_port=None, grpc_port=None, host=None, log_dir=tmp_path))
    assert (stack.http_port, stack.grpc_port) == (8123, 50123)
    assert stack.http_url == "http://127.0.0.2:8123" and stack.grpc_target == "127.0.0.2:50123"
    env = stack.base_env()
    assert (env["KITE_GATEWAY_HOST"], env["KITE_GATEWAY_HTTP_PORT"], env["KITE_GATEWAY_GRPC_PORT"]) == \
        ("127.0.0.2", "8123", "50123")


def test_registry_defaults_and_zero_ports(clean_env, tmp_path):
    stack = LocalStack(StackOptions(http_port=None, grpc_port=None, host=None, log_dir=tmp_path))
    assert (stack.options.host, stack.http_port, stack.grpc_port) == ("127.0.0.1", 8000, 50051)
    # An HTTP port setting of 0 gets a free port (the stack must know it); a gRPC port of 0 turns gRPC
    # off, as it does for the gateway.
    clean_env.setenv("KITE_GATEWAY_HTTP_PORT", "0")
    clean_env.setenv("KITE_GATEWAY_GRPC_PORT", "0")
    stack = LocalStack(StackOptions(http_port=None, grpc_port=None, host=None, log_dir=tmp_path))
    assert stack.http_port > 0 and stack.grpc_port == 0 and "off" in stack.grpc_target
    assert stack.base_env()["KITE_GATEWAY_GRPC_PORT"] == "0"
    # Tests and benchmarks pass 0: free ports, whatever the environment says.
    stack = LocalStack(StackOptions(log_dir=tmp_path))
    assert stack.http_port > 0 and stack.grpc_port > 0 and stack.http_port != 8000


def test_kite_run_flags_default_to_the_settings_and_it_records_its_state(clean_env, monkeypatch):
    seen = {}

    class Stack:
        def __init__(self, options):
            seen["options"] = options
            self.log_dir = "/tmp/x"

        def start(self, timeout_s, stop=None):
            raise RuntimeError("not here")

        def stop(self, timeout_s=30.0):
            pass

    monkeypatch.setattr(kite_main, "LocalStack", Stack)
    monkeypatch.setattr(kite_main.signal, "signal", lambda *args: None)  # keep pytest's own handlers
    assert kite_main.main(["run"]) == 1
    options = seen["options"]
    assert (options.http_port, options.grpc_port, options.host) == (None, None, None)
    assert options.state_file == default_state_file()
    assert kite_main.main(["run", "--http-port", "9001"]) == 1
    assert seen["options"].http_port == 9001


# ------------------------------------------------------------------------------------------ state file
def test_state_file_round_trip_and_removal(tmp_path):
    path = tmp_path / "kite" / "kite-run.json"
    assert read_state(path) is None
    write_state(path, state())
    assert read_state(path) == state()
    assert list(path.parent.iterdir()) == [path]  # no temporary file left
    remove_state(path)
    assert not path.exists()


def test_stale_or_foreign_state_files(tmp_path):
    path = tmp_path / "kite-run.json"
    write_state(path, state(pid=dead_pid()))  # left by a `kite run` killed with SIGKILL
    assert read_state(path) is None
    path.write_text("{not json")
    assert read_state(path) is None
    path.write_text(json.dumps({"pid": os.getpid()}))
    assert read_state(path) is None
    # Another `kite run` replaced the file: stopping this one leaves it.
    write_state(path, state(pid=os.getppid()))
    remove_state(path)
    assert path.exists()


def test_default_state_file_is_under_the_kite_data_folder(clean_env, tmp_path):
    assert default_state_file() == tmp_path / "home" / ".cache" / "kite" / "kite-run.json"


# ---------------------------------------------------------------------------------- admin NATS lookup
def test_admin_nats_url_precedence(tmp_path):
    path = tmp_path / "kite-run.json"
    assert admin_nats_url(None, path, {}) == ("nats://127.0.0.1:4222", "the KITE_NATS_URL default")
    write_state(path, state(nats_url="nats://127.0.0.1:41234"))
    url, source = admin_nats_url(None, path, {})
    assert url == "nats://127.0.0.1:41234" and "kite run" in source and str(os.getpid()) in source
    assert admin_nats_url(None, path, {"KITE_NATS_URL": "nats://env:4222"}) == ("nats://env:4222",
                                                                                "KITE_NATS_URL")
    assert admin_nats_url("nats://flag:4222", path, {"KITE_NATS_URL": "nats://env:4222"})[0] == \
        "nats://flag:4222"


def test_kite_pool_uses_the_running_stack_without_flags(clean_env, monkeypatch, capsys):
    write_state(default_state_file(), state(nats_url="nats://127.0.0.1:41235"))
    urls = []

    async def fake_run(url, req, timeout_s, common, source=""):
        urls.append(url)
        return 0

    monkeypatch.setattr(pool_admin, "_run", fake_run)
    assert pool_admin.main(["stats"]) == 0
    assert urls == ["nats://127.0.0.1:41235"]
    assert "kite run" in capsys.readouterr().err
    clean_env.setenv("KITE_NATS_URL", "nats://127.0.0.1:4333")
    assert pool_admin.main(["stats"]) == 0 and urls[-1] == "nats://127.0.0.1:4333"
    assert pool_admin.main(["--nats-url", "nats://127.0.0.1:4444", "stats"]) == 0
    assert urls[-1] == "nats://127.0.0.1:4444"


def test_arbitrator_admin_uses_the_running_stack_without_flags(clean_env, monkeypatch, capsys):
    write_state(default_state_file(), state(nats_url="nats://127.0.0.1:41236"))
    urls = []

    def fake_admin(url, op, mode, model_fingerprint=""):
        urls.append((url, op, model_fingerprint))
        return arbitrator_admin.ArbitratorAdminReply(ok=True)

    monkeypatch.setattr(arbitrator_admin, "admin", fake_admin)
    assert kite_main.main(["arbitrator", "status"]) == 0
    assert kite_main.main(["arbitrator", "clear-quarantine", "ab" * 32]) == 0
    assert urls == [("nats://127.0.0.1:41236", "status", ""),
                    ("nats://127.0.0.1:41236", "clear_quarantine", "ab" * 32)]
