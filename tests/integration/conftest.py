"""Integration fixtures: a real KITE stack (nats-server + the five services as processes, the real model)."""

from __future__ import annotations

import pytest

from kite_cli.stack import LocalStack, StackOptions

MODEL = "smollm2-135m-instruct"


class RunningStack(LocalStack):
    model = MODEL


def _start(options: StackOptions) -> RunningStack:
    stack = RunningStack(options)
    # Each stack gets its own cold tier folder: tests never share or leave blocks in ~/.cache/kite/cold.
    stack.options.env.setdefault("KITE_COLD_DIR", str(stack.log_dir / "cold"))
    # The API, fault and tier suites run on the reference engine (it starts in seconds); the vLLM engine
    # has its own suite (test_vllm_worker.py) because each vLLM worker takes about a minute to start.
    stack.options.env.setdefault("KITE_ENGINE", "transformers")
    try:
        stack.start()
    except BaseException:
        for proc in stack.processes:
            print(f"--- {proc.name} ---\n{stack.tail(proc)}")
        stack.stop()
        raise
    return stack


@pytest.fixture(scope="session")
def kite_stack() -> RunningStack:
    """One stack for the API tests (one worker). Tests must not kill its processes."""
    stack = _start(StackOptions(num_workers=1))
    yield stack
    stack.stop()


@pytest.fixture()
def fresh_stack_factory():
    """Start a dedicated stack for a test that kills or adds processes; stopped after the test."""
    stacks: list[RunningStack] = []

    def start(**kwargs) -> RunningStack:
        stack = _start(StackOptions(**kwargs))
        stacks.append(stack)
        return stack

    yield start
    for stack in stacks:
        stack.stop()
