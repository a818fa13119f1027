#!/usr/bin/env bash
# Run ON THE GPU MACHINE (through the device tool, with `carry: [".whl"]`): installs the
# carried wheels, then runs the GPU tests and the GPU benchmarks, writing logs under $OUT.
# Usage: bash .ci/gpu_check.sh [tests|bench|all]   (default all)
set -uo pipefail
cd "$(dirname "$0")/.."
what=${1:-all}
out=${OUT:-/tmp/eagerlm-gpu}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$out/device.txt"
status=0
if [ "$what" = tests ] || [ "$what" = all ]; then
  # the modules with GPU tests (each also runs its cpu cases); the server and API tests
  # need packages the image lacks and no GPU, so they stay with CI
  # the build and the mma fragment self-test first: everything else rests on them; a
  # test that hangs on the device is stopped after 5 minutes (pytest-timeout is there)
  timeout_opt=$(python3 -c "import pytest_timeout" 2>/dev/null && echo "--timeout=300")
  python3 -m pytest -q -rs -p no:cacheprovider $timeout_opt -k "not emulated" \
    tests/test_kernel_build.py tests/test_cuda_prefill_attention.py tests/test_cuda_*.py \
    tests/test_vmm.py tests/test_device.py tests/test_slab_loader.py \
    2>&1 | tee "$out/gpu_tests.log"
  status=${PIPESTATUS[0]}
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  python3 benchmarks/bench_vmm.py --backend cuda 2>&1 | tee "$out/bench_vmm.log"
  python3 benchmarks/bench_load.py 2>&1 | tee "$out/bench_load.log"
  python3 benchmarks/bench_gemm.py 2>&1 | tee "$out/bench_gemm.log"
  python3 benchmarks/bench_decode_attention.py 2>&1 | tee "$out/bench_attention.log"
  python3 benchmarks/bench_prefill_attention.py 2>&1 | tee -a "$out/bench_attention.log"
  python3 benchmarks/bench_gpu_decode.py --shapes qwen3-0.6b,llama-3.2-1b,llama-3.1-8b \
    2>&1 | tee "$out/bench_decode.log"
  for shape in qwen3-0.6b llama-3.2-1b; do
    python3 benchmarks/peer_transformers.py --shape $shape --device cuda --num-requests 64 \
      2>&1 | tee -a "$out/peer_transformers.log"
  done
fi
exit "$status"
