"""Every repository path the docs name exists (README.md and docs/*.md).

A reader who follows a path the docs quote must find the file: a rules file, a test, a manifest. Checked:
inline code that looks like a repository path (`deploy/k8s/base/ru-pool.yaml`, `kite_worker/service.py`),
paths under a top-level folder written as plain text (docs/config.md is generated from help strings that
write them so), and the targets of relative Markdown links. Left out: URLs, absolute paths
(`/dev/shm`, `/openapi.json`), home-relative ones (`~/.cache/kite`), variable assignments, image names.

A path may be relative to the repository root, to its document's folder, to a package root (the docs
write `kite_worker/service.py` for services/worker/kite_worker/service.py) or to deploy/k8s (docs/deploy.md's
Kubernetes section writes `overlays/prod/...`).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")))
TOP_LEVEL = ("deploy/", "services/", "shared/", "bench/", "cli/", "tests/", "docs/", "proto/", ".ci/")
BASES = (ROOT, ROOT / "shared", ROOT / "cli", *sorted(p for p in (ROOT / "services").iterdir() if p.is_dir()),
         ROOT / "deploy" / "k8s")

FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
CODE_SPAN = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")
LINK = re.compile(r"\]\(([^)\s]+)\)")
BARE = re.compile(r"(?<![\w./-])((?:" + "|".join(re.escape(p) for p in TOP_LEVEL) + r")[\w./*-]*)")
EXTENSION = re.compile(r"\.[A-Za-z][A-Za-z0-9]*$")
HOSTNAME = re.compile(r"^[\w-]+(\.[\w-]+)+$")


def looks_like_repo_path(text: str) -> bool:
    if "://" in text or text.startswith(("/", "~", "$", ".venv")) or re.search(r"[=?<>:@{}|]", text):
        return False
    if "/" not in text or HOSTNAME.match(text.split("/")[0]):  # registry.example.com/kite/worker
        return False
    return text.startswith(TOP_LEVEL) or bool(EXTENSION.search(text))


def resolves(path: str, doc: Path) -> bool:
    path = path.rstrip("/")
    for base in (doc.parent, *BASES):
        if any(ch in path for ch in "*?["):
            if any(base.glob(path)):
                return True
        elif (base / path).exists():
            return True
    return False


def quoted_paths(doc: Path) -> list[tuple[int, str]]:
    """(line, path) of every repository path `doc` names."""
    text = doc.read_text()
    prose = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)  # keep line numbers
    found: list[tuple[int, str]] = []

    def line_of(pos: int) -> int:
        return prose.count("\n", 0, pos) + 1

    for m in CODE_SPAN.finditer(prose):
        words = m.group(1).split()
        if words and looks_like_repo_path(words[0]):
            found.append((line_of(m.start()), words[0]))
    outside_code = CODE_SPAN.sub(lambda m: " " * len(m.group(0)), prose)
    for m in BARE.finditer(outside_code):
        path = m.group(1).rstrip(".,;:")
        if path.count("/") and path.rstrip("/") not in {p.rstrip("/") for p in TOP_LEVEL}:
            found.append((line_of(m.start()), path))
    for m in LINK.finditer(outside_code):
        target = m.group(1).split("#")[0]
        if target and "://" not in target and not target.startswith("mailto:"):
            found.append((line_of(m.start()), target))
    return found


def test_the_path_finder_sees_what_the_docs_write(tmp_path):
    doc = tmp_path / "x.md"
    doc.write_text("Edit `deploy/k8s/base/ru-pool.yaml` and `kite_worker/service.py [--flag]`; the default is\n"
                   "(deploy/arbitrator/rules.yaml), see [here](other.md#part). Not paths: `/dev/shm`,\n"
                   "`~/.cache/kite`, `https://x.io/a.py`, `registry.example.com/kite/worker-gpu:1.2`,\n"
                   "`KITE_X=a/b.pem`, `python -m kite_cli`.\n"
                   "```\nls services/none.py\n```\n")
    assert quoted_paths(doc) == [(1, "deploy/k8s/base/ru-pool.yaml"), (1, "kite_worker/service.py"),
                                 (2, "deploy/arbitrator/rules.yaml"), (2, "other.md")]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_repository_path_in_the_docs_exists(doc):
    missing = [f"{doc.relative_to(ROOT)}:{line}: {path}" for line, path in quoted_paths(doc)
               if not resolves(path, doc)]
    assert not missing, "paths that are not in the repository:\n" + "\n".join(missing)
