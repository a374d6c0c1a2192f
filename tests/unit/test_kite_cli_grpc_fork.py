"""kite_cli turns gRPC's fork handlers off: its children start through a fork with code before exec
(local_servers.die_with_parent), and gRPC's handlers restarted its poller in such a child, which then died
now and then (a CI run lost a ru-pool to "epoll_wait error: Bad file descriptor")."""

from __future__ import annotations

import os
import subprocess
import sys

# Started in a fresh interpreter, as a user of kite_cli would be: the order of the imports is what is tested.
_SPAWNER = """
import subprocess, sys
if sys.argv[1] == "kite_cli first":
    import kite_cli.local_servers
from concurrent import futures
import grpc
server = grpc.server(futures.ThreadPoolExecutor(2))
port = server.add_insecure_port("127.0.0.1:0")
server.start()
channel = grpc.insecure_channel(f"127.0.0.1:{port}")
grpc.channel_ready_future(channel).result(timeout=10)  # a live connection: the poller has work
from kite_cli.local_servers import die_with_parent
codes = [subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True,
                          preexec_fn=die_with_parent).wait() for _ in range(40)]
print("exit codes", sorted(set(codes)))
"""


def _spawn(order: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "GRPC_ENABLE_FORK_SUPPORT"}
    env["GRPC_VERBOSITY"] = "INFO"  # gRPC logs each fork its handlers see
    return subprocess.run([sys.executable, "-c", _SPAWNER, order], env=env, capture_output=True, text=True,
                          timeout=120, check=True)


def test_children_start_without_grpc_fork_handlers_when_kite_cli_comes_first():
    done = _spawn("kite_cli first")
    assert "exit codes [0]" in done.stdout
    assert "fork_posix" not in done.stderr


def test_grpc_used_before_kite_cli_keeps_its_fork_handlers():
    # The control: the setting is read once, at gRPC's first use, so it must come before it.
    done = _spawn("grpc first")
    assert "fork_posix" in done.stderr
