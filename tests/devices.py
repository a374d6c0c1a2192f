"""The devices the KV tensor-path tests run on: the CPU always, CUDA where torch sees a GPU (skipped
otherwise, saying so). The same tests check the GPU path on a machine that has one: deploy/gpu/check.sh.
Needs torch only (no vLLM, nothing of conftest.py: check.sh runs these tests without the test servers)."""

from __future__ import annotations

import pytest
import torch

NO_CUDA = "no CUDA device visible to torch: run deploy/gpu/check.sh on a machine with an NVIDIA GPU"

DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param("cuda", id="cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)),
]
