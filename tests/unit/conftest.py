"""Unit tests run from an empty folder, not from the repository root: a test that opens `docs/...` or runs
`python -c "from tests..."` without anchoring on the repository (`Path(__file__).resolve().parents[2]`)
fails here, as it would for anyone running pytest from another directory (issue 13)."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="package", autouse=True)
def _run_outside_the_repository(tmp_path_factory):
    previous = os.getcwd()
    os.chdir(tmp_path_factory.mktemp("cwd"))
    yield
    os.chdir(previous)
