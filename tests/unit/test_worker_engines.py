"""The worker's engines behind one contract (kite_worker.engines.base): each engine package imports nothing
from the other, the service never asks which engine runs, and both engines implement every member of the
contract the factory builds them by. Read from the sources (ast), so vLLM itself is never imported."""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
from pathlib import Path

import pytest

import kite_worker
import kite_worker.engines.reference
import kite_worker.engines.vllm
from kite_worker.engines import ENGINES
from kite_worker.engines.base import Engine

WORKER = Path(kite_worker.__file__).parent
PACKAGES = {"reference": kite_worker.engines.reference, "vllm": kite_worker.engines.vllm}
# Everything of the worker outside the engine packages that an engine may import: the contract and what
# both engines use. The service, the entrypoint and the control plane are not among them.
SHARED = ("kite_worker.engines.base", "kite_worker.engines.admission", "kite_worker.shadow",
          "kite_worker.write_policy", "kite_worker.pool_loader", "kite_worker.codec_tensors")


def modules_of(package) -> dict[str, Path]:
    """Every module of a package (its __init__ included), by name."""
    found = {package.__name__: Path(package.__file__)}
    for info in pkgutil.iter_modules(package.__path__, package.__name__ + "."):
        found[info.name] = Path(package.__path__[0]) / (info.name.rsplit(".", 1)[1] + ".py")
    return found


def imports_of(path: Path) -> set[str]:
    """The modules `path` imports anywhere (function-level and TYPE_CHECKING imports included)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert not node.level, f"{path}: relative import"
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)  # `from pkg import module`
    return names


def is_in(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


@pytest.mark.parametrize("engine", sorted(PACKAGES))
def test_an_engine_imports_nothing_of_the_other_nor_of_the_service(engine):
    (other,) = set(PACKAGES) - {engine}
    modules = modules_of(PACKAGES[engine])
    assert len(modules) >= 5, modules  # the scan sees the package's modules
    for name, path in modules.items():
        worker_imports = {m for m in imports_of(path) if is_in(m, "kite_worker")} - {"kite_worker"}
        assert not {m for m in worker_imports if is_in(m, PACKAGES[other].__name__)}, name
        strangers = {m for m in worker_imports if not is_in(m, PACKAGES[engine].__name__)
                     and not any(is_in(m, shared) for shared in SHARED)}
        assert strangers == set(), name


def test_the_shared_modules_import_no_engine():
    for name in SHARED:
        path = WORKER.parent / (name.replace(".", "/") + ".py")
        for package in PACKAGES.values():
            assert not {m for m in imports_of(path) if is_in(m, package.__name__)}, (name, package.__name__)


def code_words(tree: ast.AST) -> set[str]:
    """Names, attributes, arguments and string constants of a module's code (docstrings left out)."""
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr)
                  and isinstance(node.body[0].value, ast.Constant)}
    words = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            words.add(node.id)
        elif isinstance(node, ast.Attribute):
            words.add(node.attr)
        elif isinstance(node, ast.arg):
            words.add(node.arg)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            words.add(node.name)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            words.add(node.value)
    return words


def test_the_worker_service_never_asks_which_engine_runs():
    path = WORKER / "service.py"
    tree = ast.parse(path.read_text(), filename=str(path))
    engine_imports = {m for m in imports_of(path) if is_in(m, "kite_worker.engines")}
    assert engine_imports and all(is_in(m, "kite_worker.engines.base") for m in engine_imports), engine_imports
    engine_words = [w for w in code_words(tree) if any(k in w.lower() for k in ("vllm", "reference", "transformers"))]
    assert engine_words == []  # no flag, no engine class, no KITE_ENGINE value
    contract = {name for m in engine_imports for name in [m.rsplit(".", 1)[1]] if name[0].isupper()}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("isinstance", "type"):
            tested = {n.id for arg in node.args[1:] for n in ast.walk(arg) if isinstance(n, ast.Name)}
            assert not tested & (contract | {"Engine"}), ast.unparse(node)
            assert not (node.func.id == "type" and "engine" in ast.unparse(node)), ast.unparse(node)


def contract_members() -> set[str]:
    """The methods and properties the Engine protocol states (its attributes are set on instances)."""
    return {name for name, value in vars(Engine).items()
            if not name.startswith("_") and (inspect.isfunction(value) or isinstance(value, (property, classmethod)))}


@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_the_factorys_engines_implement_the_whole_contract(engine):
    module, name = ENGINES[engine]
    assert is_in(module, PACKAGES["reference" if engine == "transformers" else engine].__name__)
    engine_class = getattr(importlib.import_module(module), name)
    members = contract_members()
    assert {"start", "reserve", "submit", "cancel", "load", "pool_read", "adapters", "load_adapter",
            "unload_adapter", "quarantine", "close", "rounds", "create"} <= members
    missing = sorted(m for m in members if not hasattr(engine_class, m))
    assert missing == [], f"{name} lacks {missing}"
    for member in members:  # a property stays a property, a coroutine a coroutine
        stated, implemented = inspect.getattr_static(Engine, member), inspect.getattr_static(engine_class, member)
        assert isinstance(implemented, property) == isinstance(stated, property), (name, member)
        assert inspect.iscoroutinefunction(implemented) == inspect.iscoroutinefunction(stated), (name, member)


def test_vllm_loads_the_kv_connector_from_the_module_that_defines_it():
    from kite_worker.engines.vllm.model import KV_CONNECTOR_MODULE

    assert is_in(KV_CONNECTOR_MODULE, kite_worker.engines.vllm.__name__)
    path = modules_of(kite_worker.engines.vllm)[KV_CONNECTOR_MODULE]
    classes = {node.name for node in ast.parse(path.read_text()).body if isinstance(node, ast.ClassDef)}
    assert "KiteConnector" in classes
    model = (WORKER / "engines" / "vllm" / "model.py").read_text()
    assert 'kv_connector="KiteConnector", kv_connector_module_path=KV_CONNECTOR_MODULE' in model
