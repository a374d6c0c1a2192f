"""Test helpers are defined once (issue 37): waiting, the ru-pool's stats and block chains live in
tests/helpers.py. Before, 20-odd test modules each wrote their own polling loop (with its own timeout
message, or none), their own stats request and their own SHA-256 chain beside the production one. This reads
every test module with `ast` and fails on a function defined under a helper's name, or under a name such a
copy had, and on a hand-made hash chain (SHA-256 over a `parent`)."""

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


def offences(path: str, source: str, forbidden: set[str]) -> list[str]:
    tree = ast.parse(source)
    found = [f"{path}:{line}: defines {name}() (import it from tests.helpers)"
             for name, line in definitions(tree)
             if name.rsplit(".", 1)[-1] in forbidden and (path, name) not in ALLOWED]
    found += [f"{path}:{line}: hashes a chain by hand (use tests.helpers.chain_hashes / unit_chain)"
              for line in hand_made_chains(tree)]
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
