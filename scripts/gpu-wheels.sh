#!/usr/bin/env bash
# Downloads the wheels of scripts/gpu-wheels.txt for the GPU machine (x86-64, CPython 3.12) into .whl/
# (git-ignored), slims bitsandbytes to its CUDA 13.0 + CPU libraries, and prints the total size: the
# working tree plus .whl must stay under the device's 64 MiB. Usage: scripts/gpu-wheels.sh [PYTHON]
set -euo pipefail
cd "$(dirname "$0")/.."
py="${1:-${PYTHON:-python3}}"
mkdir -p .whl
grep -v '^\s*#' scripts/gpu-wheels.txt | grep -v '^\s*$' >.whl/requirements.txt
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
  --abi abi3 --abi none --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux_2_34_x86_64 --platform manylinux1_x86_64 --platform any -d .whl -r .whl/requirements.txt
"$py" scripts/gpu_wheels_slim.py .whl
# exactly one wheel per pinned name, nothing else
"$py" scripts/gpu_wheels_slim.py --check .whl scripts/gpu-wheels.txt
du -cb .whl/*.whl | tail -1 | awk '{printf "wheels: %.1f MiB\n", $1 / 1048576}'
