"""GEMMs through cuBLASLt (kernels/cublaslt.py): TFLOP/s against the measured matrix rate.

The physical limit of prefill is the tensor cores' bf16 rate. It is measured here, in the
same run, as the rate of one large square product (8192^3) through the same code; each
model shape is reported as TFLOP/s and as a fraction of that. Decode-sized products
(few tokens) are bound by reading the weight instead, so they are also reported as GB/s
of weight bytes against the measured device-to-device copy rate (HBM).

Shapes: the linear layers of Qwen3-0.6B and Llama-3.1-8B (q, kv, o, gate/up, down, lm
head) at 1, 16, 64, 512, 2048 and 8192 tokens.

Run on a GPU machine: `python benchmarks/bench_gemm.py [--reps 50]`.
Prints a markdown table and a JSON block on stdout.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.gpu_timing import copy_bandwidth, open_gpu, time_on_stream
from eagerlm.kernels.cublaslt import CUDA_R_16BF, CUDA_R_32F
from eagerlm.kernels.cuda_ops import CudaOps

MODELS = {
    "qwen3-0.6b": {"q": (2048, 1024), "kv": (1024, 1024), "o": (1024, 2048),
                   "gate_up": (3072, 1024), "down": (1024, 3072), "lm_head": (151936, 1024)},
    "llama-3.1-8b": {"q": (4096, 4096), "kv": (1024, 4096), "o": (4096, 4096),
                     "gate_up": (14336, 4096), "down": (4096, 14336),
                     "lm_head": (128256, 4096)},
}
TOKENS = (1, 16, 64, 512, 2048, 8192)


def time_gemm(ops: CudaOps, n_tok: int, n_in: int, n_out: int, reps: int,
              out_dtype: int = CUDA_R_16BF) -> float:
    """Seconds per product, from events around `reps` back-to-back launches."""
    x = ops.empty((n_tok, n_in), "bf16")
    w = ops.empty((n_out, n_in), "bf16")
    y = ops.empty((n_tok, n_out), "f32" if out_dtype == CUDA_R_32F else "bf16")
    for t in (x, w):
        ops.fill(t, 0x3C)  # 0x3C3C: a small finite bf16
    s = int(ops.stream.handle)
    return time_on_stream(ops.device, ops.stream, lambda: ops.gemm.matmul(
        s, y.ptr, x.ptr, w.ptr, n_tok, n_in, n_out, out_dtype), reps)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--layers", nargs="+", help="only these layers (default: all)")
    ap.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    ap.add_argument("--peak-dim", type=int, default=8192,
                    help="side of the square product that measures the matrix rate")
    ap.add_argument("--copy-mib", type=int, default=1024, help="size of the timed copy")
    args = ap.parse_args()
    device = open_gpu("bench_gemm")
    if device is None:
        return 0
    ops = CudaOps(device)
    side = args.peak_dim
    peak_s = time_gemm(ops, side, side, side, max(5, args.reps // 5))
    peak = 2 * side**3 / peak_s / 1e12
    hbm = copy_bandwidth(ops.device, ops.stream, args.copy_mib << 20, 5)
    rows = []
    for model in args.models:
        for layer, (n_out, n_in) in MODELS[model].items():
            if args.layers and layer not in args.layers:
                continue
            for n_tok in args.tokens:
                out_dtype = CUDA_R_32F if layer == "lm_head" else CUDA_R_16BF
                sec = time_gemm(ops, n_tok, n_in, n_out, args.reps, out_dtype)
                tflops = 2 * n_tok * n_in * n_out / sec / 1e12
                weight_gb_s = n_in * n_out * 2 / sec / 1e9
                rows.append(dict(model=model, layer=layer, tokens=n_tok, n_in=n_in,
                                 n_out=n_out, us=sec * 1e6, tflops=tflops,
                                 of_peak=tflops / peak, weight_gb_s=weight_gb_s,
                                 of_hbm=weight_gb_s * 1e9 / (hbm / 2)))
    print(f"measured matrix rate ({side}^3 bf16): {peak:.0f} TFLOP/s; "
          f"device copy: {hbm / 1e12:.2f} TB/s read+write\n")
    print("| model | layer | tokens | us | TFLOP/s | of matrix rate | weight GB/s | of HBM |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['layer']} | {r['tokens']} | {r['us']:.1f} | "
              f"{r['tflops']:.1f} | {r['of_peak']:.0%} | {r['weight_gb_s']:.0f} | "
              f"{r['of_hbm']:.0%} |")
    result = {"device": device.name, "matrix_tflops": peak, "copy_bytes_per_s": hbm,
              "heuristic_calls": ops.gemm.heuristic_calls, "rows": rows}
    print("\n```json\n" + json.dumps(result, indent=2) + "\n```")
    ops.close()
    device.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
