#!/usr/bin/env bash
# Run ON THE GPU MACHINE (through the device tool, with `carry: [".whl"]`): installs the
# carried wheels, then runs the GPU tests and the GPU benchmarks, writing logs under $OUT.
# Usage: bash .ci/gpu_check.sh [tests|micro|decode|peer|bench|all|dry] [SHAPES]   (default all)
#   micro: vmm, load, GEMM (bf16, and weights kept as GGUF blocks: the common types at many
#   token counts, then every type at 1, 8 and 512) and attention benchmarks;
#   decode: bench_gpu_decode (a Q4_K_M file, quantized and bf16 weights), and with 2 or
#   more GPUs `eagerlm bench -tp` over them beside -tp 1; peer: HF
#   transformers, each on SHAPES (comma-separated; default qwen3-0.6b,llama-3.2-1b, plus
#   llama-3.1-8b for decode); bench = micro + decode + peer; dry: every benchmark's command
#   line with --help (imports and flags checked, nothing measured).
# It works from a bare copy of the checkout: nothing of ours is installed; .ci/link_checkout.py
# lays the checkout out as the `eagerlm` package. GPU_CHECK_TESTS selects the tests by
# pytest -k (default "not emulated"). CI runs this script on the emulated GPU
# (tests/test_gpu_check_script.py), so a broken script never costs device time.
# One device call may run 10 minutes: run `tests`, `micro`, `decode qwen3-0.6b,llama-3.2-1b`,
# `decode llama-3.1-8b` and `peer` as separate calls. Each benchmark is also stopped after
# its own time limit, so one that hangs leaves the others their time, and its log says so.
set -uo pipefail
cd "$(dirname "$0")/.."
what=${1:-all}
out=${OUT:-/tmp/eagerlm-gpu}
mkdir -p "$out"
shapes=${2:-}
shapes=${shapes//,/ }
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
else
  echo "no wheels in .whl/ (run .ci/gpu_wheels.sh first, and carry .whl): using what is installed"
fi
package=$(python3 .ci/link_checkout.py "${TMPDIR:-/tmp}/eagerlm-checkout") || exit 1
export PYTHONPATH=/tmp/site:$package:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 | tee "$out/device.txt"
python3 -c "import os, eagerlm.kernels as k; print('eagerlm from', os.path.realpath(k.__file__))" \
  2>&1 | tee -a "$out/device.txt"
status=0
if [ "$what" = tests ] || [ "$what" = all ]; then
  # the modules with GPU tests (each also runs its cpu cases); the server and API tests
  # need packages the image lacks and no GPU, so they stay with CI
  # the build and the mma fragment self-test first: everything else rests on them; a
  # test that hangs on the device is stopped after 5 minutes (pytest-timeout is there)
  timeout_opt=$(python3 -c "import pytest_timeout" 2>/dev/null && echo "--timeout=300")
  python3 -m pytest -q -rs -p no:cacheprovider $timeout_opt -k "${GPU_CHECK_TESTS:-not emulated}" \
    tests/test_kernel_build.py tests/test_cuda_prefill_attention.py tests/test_cuda_*.py \
    tests/test_vmm.py tests/test_device.py tests/test_slab_loader.py \
    2>&1 | tee "$out/gpu_tests.log"
  status=${PIPESTATUS[0]}
fi
# run NAME LIMIT_S LOG CMD...: one benchmark, its output appended to $out/LOG
run() {
  local name=$1 limit=$2 log=$3
  shift 3
  [ "$what" = dry ] && set -- "$@" --help
  echo "== $name (limit ${limit}s)" | tee -a "$out/$log"
  timeout "$limit" "$@" 2>&1 | tee -a "$out/$log"
  local rc=${PIPESTATUS[0]}
  [ "$rc" = 124 ] && echo "== $name: stopped after ${limit}s" | tee -a "$out/$log"
  [ "$rc" = 0 ] || status=$rc
}
part() { [ "$what" = "$1" ] || [ "$what" = bench ] || [ "$what" = all ] || [ "$what" = dry ]; }
if part micro; then
  run vmm 120 bench_vmm.log python3 benchmarks/bench_vmm.py --backend cuda
  run load 150 bench_load.log python3 benchmarks/bench_load.py
  run gemm 120 bench_gemm.log python3 benchmarks/bench_gemm.py
  run gemm-quantized 240 bench_gemm_quantized.log python3 benchmarks/bench_gemm.py \
    --quantized --tokens 1 2 4 8 16 64 512 --reps 20
  # every GGUF type (decode's GEMVs, 8 rows, a prefill's tiles) on two layers of each shape
  run gemm-quantized-all-types 150 bench_gemm_quantized.log python3 benchmarks/bench_gemm.py \
    --quantized all --layers gate_up lm_head --tokens 1 8 512 --reps 20
  run decode-attention 90 bench_attention.log python3 benchmarks/bench_decode_attention.py
  run prefill-attention 90 bench_attention.log python3 benchmarks/bench_prefill_attention.py
fi
if part decode; then
  for shape in ${shapes:-qwen3-0.6b llama-3.2-1b llama-3.1-8b}; do
    limit=300
    [ "$shape" = llama-3.1-8b ] && limit=560  # loaded twice: quantized, then bf16
    run "decode $shape" $limit bench_decode.log \
      python3 benchmarks/bench_gpu_decode.py --shapes $shape --json "$out/decode_$shape.json"
  done
fi
if part decode; then
  # tensor parallelism (issue 34): the engine over the most GPUs found that split the
  # shape's heads (a power of two), beside one GPU, in the same call; only with two or more
  gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
  tp=1
  while [ $((tp * 2)) -le "${gpus:-0}" ] && [ "$tp" -lt 8 ]; do tp=$((tp * 2)); done
  [ "$what" = dry ] && [ "$tp" -lt 2 ] && tp=2
  if [ "$tp" -ge 2 ]; then
    for n in 1 "$tp"; do
      run "tensor parallel -tp $n" 300 bench_tensor_parallel.log \
        python3 -m eagerlm bench offline --synthetic qwen3-0.6b --device cuda -tp "$n" \
        -n 32 --input-len 128 --output-len 128 --json "$out/tensor_parallel_$n.json"
    done
  fi
fi
if part peer; then
  for shape in ${shapes:-qwen3-0.6b llama-3.2-1b}; do
    run "transformers $shape" 240 peer_transformers.log \
      python3 benchmarks/peer_transformers.py --shape $shape --device cuda --num-requests 64
  done
fi
exit "$status"
