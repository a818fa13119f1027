#!/usr/bin/env bash
# Run HERE (the development machine) before a GPU session: downloads, into .whl/ (in
# .gitignore), the wheels the GPU machine's image lacks, for its Python 3.12 / x86_64. The device
# tool carries .whl/ along (name it in `carry`); .ci/gpu_check.sh installs them there.
# Only what the GPU tests and benchmarks import: the image already has numpy, jinja2, anyio,
# pytest, cuda-bindings, nvrtc, the CUDA runtime and cuBLAS.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
for spec in gguf==0.19.0 regex nvmath-python==1.0.0 pytest-asyncio; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 --platform any -d .whl "$spec"
done
du -sh .whl
