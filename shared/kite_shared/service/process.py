"""How a service process stops outside the runtime's drain: at once on a signal while it is not yet
connected to NATS, and without leaving the processes it started behind.

Before the NATS connection is up a service serves nothing, so SIGTERM or SIGINT then end the process at
once, with status 0 and the log line "<service> stopping before NATS connected" (see
exit_on_signal_until_connected): connecting retries for ever (a wrong password, no server yet), and an
orchestrator must not have to wait out its grace period and SIGKILL it. An entrypoint that loads something
slow (a model) before run_service calls exit_on_signal_until_connected first.

Boundary: signals, child processes and the immediate exit; the drain once connected is
kite_shared.service.runtime's.
"""

from __future__ import annotations

import logging
import os
import signal
import sys

log = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def exit_on_signal_until_connected(service: str) -> None:
    """From now until run_service is connected to NATS, SIGTERM and SIGINT end the process at once, status 0.

    Until then the service serves nothing, so there is nothing to drain; but it may be busy for long
    (loading a model, or connecting to NATS, which retries for ever), and an orchestrator would otherwise
    wait out its grace period and SIGKILL it. run_service calls this first; an entrypoint that loads
    something slow before calling run_service calls it before that.
    """
    def on_signal(signum: int, _frame: object) -> None:
        exit_before_connected(service, signum, "")

    for sig in STOP_SIGNALS:
        signal.signal(sig, on_signal)


def exit_before_connected(service: str, signum: int, last_nats_error: str) -> None:
    why = f"; last NATS error: {last_nats_error}" if last_nats_error else ""
    log.warning("%s stopping before NATS connected (%s%s): nothing to drain", service,
                signal.Signals(signum).name, why)
    # Not SystemExit: raised into whatever was running (model loading, nats-py's connect loop) it could
    # be caught, or leave the interpreter waiting at exit for threads and atexit hooks (tracing exporters).
    exit_now()


def terminate_children(grace_s: float = 5.0) -> None:
    """End every process this one started (vLLM's engine-core and model-runner processes, in the
    worker) before exiting, so none outlives it: they would hold gigabytes and spin on their queues.
    SIGTERM first, SIGKILL after `grace_s`."""
    import psutil

    # Python's multiprocessing resource tracker ignores SIGTERM by design and exits by itself when this
    # process does (its pipe closes): waiting for it would only add the whole grace period.
    children = [c for c in psutil.Process().children(recursive=True) if not _is_resource_tracker(c)]
    for child in children:
        try:
            child.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(children, timeout=grace_s)
    for child in alive:
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass


def _is_resource_tracker(proc) -> bool:
    import psutil

    try:
        return "multiprocessing.resource_tracker" in " ".join(proc.cmdline())
    except psutil.Error:
        return False


def exit_now() -> None:
    """End the process at once with status 0 (os._exit: no atexit hooks, no waiting for threads), its log
    lines flushed and its children stopped first."""
    for handler in logging.getLogger().handlers:
        handler.flush()
    sys.stderr.flush()
    terminate_children()
    os._exit(0)
