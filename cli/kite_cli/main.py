"""`kite` command line: `kite run` starts the local stack (what `make run` calls); `kite pool ...` administers
the ru-pool (stats, clear, pin/unpin, evict, purge; see `kite pool --help`)."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from pathlib import Path

from kite_cli.stack import LocalStack, ServiceProcess, StackOptions, StartInterrupted, default_state_file

# Nothing is served yet while starting, so a stop then does not wait for drains: what is still busy (a worker
# compiling its model) after this is killed, and `kite run` is gone within 10 s of Ctrl-C.
STOP_WHILE_STARTING_S = 5.0

RUN_EPILOG = """exit status: 0 after Ctrl-C (SIGINT) or SIGTERM once serving; 128 + the signal's number (130,
143) when stopped that way while starting; 1 when the start fails or, once serving, a service other than a
worker exits or no worker is left. A worker that exits is reported with the tail of its log."""


def _run(args: argparse.Namespace) -> int:
    stack = LocalStack(StackOptions(http_port=args.http_port, grpc_port=args.grpc_port,
                                    num_workers=args.workers, host=args.host,
                                    pool_replicas=args.pool_replicas, arbitrators=args.arbitrators,
                                    redis_data_dir=Path.home() / ".cache" / "kite" / "redis",
                                    state_file=default_state_file()))
    stop = threading.Event()
    signals: list[int] = []  # the signals that asked to stop, first first

    def on_signal(signum: int, _frame: object) -> None:
        signals.append(signum)
        stop.set()  # the start's wait loop and the watch loop below look at it

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    print(f"starting KITE: nats-server and 5 services (logs in {stack.log_dir}); the worker's vLLM compiles "
          "the model at the first start (1-2 minutes on 2 cores; later starts under a minute; Ctrl-C stops "
          "it) ...", flush=True)
    try:
        stack.start(timeout_s=900, stop=stop)
    except StartInterrupted:
        print(f"{signal.Signals(signals[0]).name} while starting: stopping KITE ...", flush=True)
        stack.stop(timeout_s=STOP_WHILE_STARTING_S)
        print("stopped.", flush=True)
        return 128 + signals[0]
    except BaseException as exc:
        stack.stop()
        print(f"KITE failed to start: {exc}", file=sys.stderr)
        return 1
    print(f"""
KITE is serving on {stack.http_url}  (OpenAI API at {stack.http_url}/v1, gRPC at {stack.grpc_target})
NATS at {stack.nats.url}: kite pool --nats-url {stack.nats.url} stats

  curl {stack.http_url}/v1/chat/completions -H 'Content-Type: application/json' \\
    -d '{{"model": "smollm2-135m-instruct", "temperature": 0,
         "messages": [{{"role": "user", "content": "What is the capital of France?"}}]}}'

Press Ctrl-C to stop.""", flush=True)
    status = 0
    told: set[int] = set()  # pids of the processes whose exit was reported
    try:
        while status == 0 and not stop.wait(1.0):
            status = _report_exits(stack, told)
    finally:
        print("stopping KITE ...", flush=True)
        stack.stop()
        print("stopped.", flush=True)
    return status


def _report_exits(stack: LocalStack, told: set[int]) -> int:
    """Once serving: report each process that exited (once, `told` holds them); 1 when `kite run` must stop
    (a service other than a worker exited, or no worker is left), else 0."""
    exited: list[ServiceProcess] = [p for p in stack.processes
                                    if p.process.poll() is not None and p.process.pid not in told]
    for proc in exited:
        told.add(proc.process.pid)
        print(stack.exit_report(proc), file=sys.stderr, flush=True)
    if any(p.name != "worker" for p in exited):
        return 1
    if exited and not stack.workers():
        print("no worker is left", file=sys.stderr, flush=True)
        return 1
    return 0


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value}: at least 1")
    return value


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["pool"]:
        from kite_cli import pool_admin

        return pool_admin.main(argv[1:])
    if argv[:1] == ["adapter"]:
        from kite_cli import adapter_admin

        return adapter_admin.main(argv[1:])
    if argv[:1] == ["arbitrator"]:
        from kite_cli import arbitrator_admin

        return arbitrator_admin.main(argv[1:])
    if argv[:1] == ["keys"]:
        from kite_cli import keys

        return keys.main(argv[1:])
    if argv[:1] == ["bench"]:
        from kite_cli import bench

        return bench.main(argv[1:])
    if argv[:1] == ["simulate"]:
        from kite_cli import simulate

        return simulate.main(argv[1:])
    parser = argparse.ArgumentParser(prog="kite", description="KITE command line")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="start nats-server and all five services locally", epilog=RUN_EPILOG)
    # Defaults: the gateway's settings, KITE_GATEWAY_HOST / _HTTP_PORT / _GRPC_PORT (127.0.0.1, 8000, 50051).
    run.add_argument("--host", default=None)
    run.add_argument("--http-port", type=int, default=None)
    run.add_argument("--grpc-port", type=int, default=None)
    run.add_argument("--workers", type=_positive, default=1, metavar="N", help="workers (default 1)")
    # Replicas (docs/ru-pool.md and docs/arbitrator.md, "Replicas"): several are named ru-pool-<n> /
    # arbitrator-<n>, each with its own metrics port; one of each leads through a JetStream lease.
    run.add_argument("--pool-replicas", type=_positive, default=1, metavar="N",
                     help="ru-pool replicas (default 1)")
    run.add_argument("--arbitrators", type=_positive, default=1, metavar="N",
                     help="arbitrator replicas (default 1)")
    run.set_defaults(func=_run)
    sub.add_parser("pool", help="ru-pool administration (stats, clear, pin, unpin, evict, purge)",
                   add_help=False)
    sub.add_parser("adapter", help="LoRA adapter declarations: `kite adapter declare|check FOLDER`",
                   add_help=False)
    sub.add_parser("arbitrator", help="arbitrator administration (status, reload, routing-mode, "
                   "clear-quarantine)", add_help=False)
    sub.add_parser("keys", help="API keys: `kite keys new TENANT`, `kite keys hash [KEY]`", add_help=False)
    sub.add_parser("bench", help="benchmark KITE against peers (see docs/benchmarks.md)", add_help=False)
    sub.add_parser("simulate", help="fleet simulation: real routing, pool index and admission code at 1,000 "
                   "workers and 10^7 blocks (see docs/architecture.md)", add_help=False)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
