"""Test helpers are defined once (issue 37): waiting, the ru-pool's stats and block chains live in
tests/helpers.py. Before, 20-odd test modules each wrote their own polling loop (with its own timeout
message, or none), their own stats request and their own SHA-256 chain beside the production one. This reads
every test module with `ast` and fails on a function defined under a helper's name, or under a name such a
copy had, on a hand-made hash chain (SHA-256 over a `parent`), and on a hand-written polling loop: a `while`
that compares a clock (time.monotonic(), time.time(), loop.time(), ...) against a deadline, or a
`for _ in range(n)` that sleeps until it breaks. A wait is tests.helpers.wait_until / wait_until_async /
wait_for_log, with one timeout message; a loop that is not a wait (load for a duration, a stream that
runs until cancelled) is named in LOOPS_ALLOWED with the reason it stays."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
HELPERS = TESTS / "helpers.py"
# The names the copies had before they were merged into tests/helpers.py.
FORMER_NAMES = {"wait_for", "_wait_for", "until", "_until", "wait_until", "wait_workers", "_wait_workers", "pool_stats",
                "_pool_stats", "chain", "make_chain", "chain_of", "make_units"}
# Same name, another meaning: (path under tests/, qualified name) -> why it stays.
ALLOWED = {("unit/test_deploy_manifests.py", "Dockerfile.chain"): "a Dockerfile's chain of build stages"}
# Loops against a clock that are not waits: (path under tests/, qualified function name) -> why it stays.
LOOPS_ALLOWED = {
    ("integration/test_routing_arbitrator.py", "test_overload_gives_fast_503s_not_timeouts"):
        "a measurement: probes new requests while a flood runs, recording each one's status and time, until "
        "the flood ends or three were shed (60 s at most)",
    ("integration/test_routing_arbitrator.py", "test_standby_worker_is_activated_under_load_and_takes_traffic.client"):
        "load: each client sends steady traffic until the activation is measured (90 s at most)",
    ("integration/test_grpc_api.py", "Scripted.stream"):
        "a producer: the scripted worker's 'forever' stream sends tokens until cancelled (30 s at most)",
}
CLOCKS = {"monotonic", "time", "perf_counter"}  # time.monotonic(), time.time(), loop.time(), ...


def helper_names() -> set[str]:
    tree = ast.parse(HELPERS.read_text())
    return {node.name for node in tree.body
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("_")}


def definitions(tree: ast.AST, prefix: str = ""):
    """(qualified name, line) of every function and method, nested ones included."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield prefix + node.name, node.lineno
            yield from definitions(node, f"{prefix}{node.name}.")
        elif isinstance(node, ast.ClassDef):
            yield from definitions(node, f"{prefix}{node.name}.")
        else:
            yield from definitions(node, prefix)


def hand_made_chains(tree: ast.AST):
    """Lines hashing a `parent` with hashlib.sha256: a block chain that is not kite_shared.fingerprint's."""
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "sha256"
                and any(isinstance(n, ast.Name) and n.id == "parent" for arg in node.args for n in ast.walk(arg))):
            yield node.lineno


def _own_nodes(node: ast.AST):
    """The nodes of `node`'s body, not entering functions or classes defined in it (scanned on their own)."""
    for child in ast.iter_child_nodes(node):
        yield child
        if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            yield from _own_nodes(child)


def _is_clock(node: ast.AST) -> bool:
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in CLOCKS
            and not node.args and not node.keywords)


def _scopes(tree: ast.AST, prefix: str = ""):
    """(qualified name, node) of the module ("<module>") and of every function and method in it."""
    if isinstance(tree, ast.Module):
        yield "<module>", tree
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield prefix + node.name, node
            yield from _scopes(node, f"{prefix}{node.name}.")
        elif isinstance(node, ast.ClassDef):
            yield from _scopes(node, f"{prefix}{node.name}.")
        elif not isinstance(node, ast.Lambda):
            yield from _scopes(node, prefix)


def polling_loops(tree: ast.AST):
    """(qualified function name, line) of each hand-written polling loop:
    - a `while` whose test or body compares against a deadline (a name assigned `clock() + ...`, or
      `started + ...` where `started = clock()`, in the same function) or compares a clock reading itself
      (`time.monotonic() - started < 120`);
    - a `for ... in range(...)` whose body sleeps and breaks or returns (a deadline of n sleeps)."""
    for name, scope in _scopes(tree):
        own = list(_own_nodes(scope))
        assigned = [(node.targets[0].id, node.value) for node in own
                    if isinstance(node, ast.Assign) and len(node.targets) == 1
                    and isinstance(node.targets[0], ast.Name)]
        stamps = {target for target, value in assigned if _is_clock(value)}
        deadlines = {target for target, value in assigned
                     if isinstance(value, ast.BinOp) and isinstance(value.op, ast.Add)
                     and any(_is_clock(n) or (isinstance(n, ast.Name) and n.id in stamps) for n in ast.walk(value))}
        for loop in own:
            inside = list(_own_nodes(loop))
            if isinstance(loop, ast.While):
                compares = [n for n in inside if isinstance(n, ast.Compare)]
                if any(_is_clock(n) or (isinstance(n, ast.Name) and n.id in deadlines)
                       for compare in compares for n in ast.walk(compare)):
                    yield name, loop.lineno
            elif (isinstance(loop, (ast.For, ast.AsyncFor)) and isinstance(loop.iter, ast.Call)
                  and isinstance(loop.iter.func, ast.Name) and loop.iter.func.id == "range"
                  and any(isinstance(n, (ast.Break, ast.Return)) for n in inside)
                  and any(isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "sleep"
                          for n in inside)):
                yield name, loop.lineno


def offences(path: str, source: str, forbidden: set[str]) -> list[str]:
    tree = ast.parse(source)
    found = [f"{path}:{line}: defines {name}() (import it from tests.helpers)"
             for name, line in definitions(tree)
             if name.rsplit(".", 1)[-1] in forbidden and (path, name) not in ALLOWED]
    found += [f"{path}:{line}: hashes a chain by hand (use tests.helpers.chain_hashes / unit_chain)"
              for line in hand_made_chains(tree)]
    found += [f"{path}:{line}: polls in a loop of its own in {name} (use tests.helpers.wait_until / "
              f"wait_until_async / wait_for_log, or name it in LOOPS_ALLOWED if it is not a wait)"
              for name, line in polling_loops(tree) if (path, name) not in LOOPS_ALLOWED]
    return found


def test_the_helpers_are_defined_in_tests_helpers_only():
    forbidden = helper_names() | FORMER_NAMES
    assert {"wait_until", "wait_until_async", "pool_stats", "pool_stats_async", "unit_chain"} <= forbidden
    found = []
    for file in sorted(TESTS.rglob("*.py")):
        if file != HELPERS:
            found += offences(file.relative_to(TESTS).as_posix(), file.read_text(), forbidden)
    assert not found, "\n".join(found)


def test_the_scan_finds_a_copy_nested_or_as_a_method():
    source = '''
import hashlib
async def wait_until_async(predicate): ...
class Bus:
    def pool_stats(self): ...
def scenario():
    def until(condition): ...
    parent = b""
    return hashlib.sha256(parent + b"x").digest()
def wait_for_models(): ...
'''
    assert offences("integration/test_x.py", source, helper_names() | FORMER_NAMES) == [
        "integration/test_x.py:3: defines wait_until_async() (import it from tests.helpers)",
        "integration/test_x.py:5: defines Bus.pool_stats() (import it from tests.helpers)",
        "integration/test_x.py:7: defines scenario.until() (import it from tests.helpers)",
        "integration/test_x.py:9: hashes a chain by hand (use tests.helpers.chain_hashes / unit_chain)",
    ]
    assert offences("unit/test_deploy_manifests.py", "class Dockerfile:\n    def chain(self): ...\n",
                    FORMER_NAMES) == []


def test_the_scan_finds_a_deadline_loop_however_it_is_written():
    source = '''
import asyncio, time
def healthy(stack):
    deadline = time.monotonic() + 30
    while stack.health_status() != 200 and time.monotonic() < deadline:
        time.sleep(0.1)
class Script:
    async def wait_cancelled(self, rid):
        deadline = asyncio.get_running_loop().time() + 5
        while True:
            if rid in self.cancelled or asyncio.get_running_loop().time() > deadline:
                break
            await asyncio.sleep(0.01)
def restarted(stack):
    started = time.monotonic()
    limit = started + 30
    while not stack.up():
        assert limit > time.time()
def exited(run, started):
    while run.poll() is None:
        assert time.monotonic() - started < 120
async def spans(exporter):
    for _ in range(50):
        if exporter.spans():
            break
        await asyncio.sleep(0.1)
def not_waits(run):
    for _ in range(3):  # no sleep: a repetition
        if run():
            break
    took = time.monotonic()
    while run.poll() is None:  # no clock in the loop: not a deadline loop
        run.step()
    return time.monotonic() - took
'''
    assert offences("integration/test_x.py", source, set()) == [
        f"integration/test_x.py:{line}: polls in a loop of its own in {name} (use tests.helpers.wait_until / "
        "wait_until_async / wait_for_log, or name it in LOOPS_ALLOWED if it is not a wait)"
        for name, line in [("healthy", 5), ("Script.wait_cancelled", 10), ("restarted", 17), ("exited", 20),
                           ("spans", 23)]]
    stream = ("import time\nclass Scripted:\n    def stream(self):\n        deadline = time.monotonic() + 30\n"
              "        while time.monotonic() < deadline:\n            self.send()\n")
    assert offences("integration/test_grpc_api.py", stream, set()) == []  # in LOOPS_ALLOWED
    assert len(offences("integration/test_other.py", stream, set())) == 1
