"""GEMMs through cuBLASLt (kernels/cublaslt.py): TFLOP/s against the measured matrix rate.

The physical limit of prefill is the tensor cores' bf16 rate. It is measured here, in the
same run, as the rate of one large square product (8192^3) through the same code; each
model shape is reported as TFLOP/s and as a fraction of that. Decode-sized products
(few tokens) are bound by reading the weight instead, so they are also reported as GB/s
of weight bytes against the measured device-to-device copy rate (HBM).

Shapes: the linear layers of Qwen3-0.6B and Llama-3.1-8B (q, kv, o, gate/up, down, lm
head) at 1, 16, 64, 512, 2048 and 8192 tokens (and `tiny`, one small layer, for the
emulated GPU's test of this script).

`--quantized [TYPE ...]` (default types q4_k q6_k q8_0 q5_0; `all`: every GGUF type of
kernels/cuda_weight_types.py) also times each shape with the weight kept as the file's
values (kernels/cuda_quantized.py) by each of its paths: the fused dequantizing GEMV on
bf16 activations and float math, the same on int8 activations and dp4a (the block types;
up to the GEMV's row limit), and bf16 tiles + cuBLASLt (BF16: cuBLASLt on the matrix as
it is), beside the bf16 GEMM of the same shape in the same run: microseconds, GB/s of the
bytes read by the fastest against the measured copy rate (the roofline of few-token
products), its speedup over bf16, and which path `CudaOps.linear` takes at that shape (so
the GEMV's kind and row limit, and whether BF16 matrices should take `gemv_bf16`, can be
set from measurements).

Run on a GPU machine: `python benchmarks/bench_gemm.py [--reps 50] [--quantized]`.
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
from eagerlm.kernels.cuda_quantized import GEMV_MAX_ROWS, DeviceQuantizedMatrix
from eagerlm.kernels.cuda_weight_types import BY_NAME
from eagerlm.kernels.device_tensor import DeviceTensor

MODELS = {
    "qwen3-0.6b": {"q": (2048, 1024), "kv": (1024, 1024), "o": (1024, 2048),
                   "gate_up": (3072, 1024), "down": (1024, 3072), "lm_head": (151936, 1024)},
    "llama-3.1-8b": {"q": (4096, 4096), "kv": (1024, 4096), "o": (4096, 4096),
                     "gate_up": (14336, 4096), "down": (4096, 14336),
                     "lm_head": (128256, 4096)},
    "tiny": {"q": (64, 512)},
}
TOKENS = (1, 16, 64, 512, 2048, 8192)
QUANT_TYPES = ("q4_k", "q6_k", "q8_0", "q5_0")  # what Q4_K_M, Q5_K_M and Q8_0 files hold


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


def quantized_matrix(ops: CudaOps, kind: str, n_out: int, n_in: int) -> DeviceQuantizedMatrix:
    """A matrix of `kind` blocks (every byte 0x3C: finite scales and values, of no
    interest, in every type)."""
    t = BY_NAME[kind]
    buf = ops.device.alloc(n_out * (n_in // t.block_size) * t.type_size)
    ops.fill(DeviceTensor(buf.ptr, (buf.nbytes,), "u8"), 0x3C)
    return DeviceQuantizedMatrix(buf.ptr, t.qtype, (n_out, n_in), buf)


def time_quantized(ops: CudaOps, w: DeviceQuantizedMatrix, n_tok: int, reps: int, *,
                   path: str, out_f32: bool) -> float:
    """Seconds per product through `path`: "gemv" (float), "gemv8" (int8) or "tile"."""
    n_out, n_in = w.shape
    x = ops.empty((n_tok, n_in), "bf16")
    ops.fill(x, 0x3C)
    y = ops.empty((n_tok, n_out), "f32" if out_f32 else "bf16")
    q = ops.quantized
    saved = q.gemv_max_rows, q.gemv_int8
    q.gemv_max_rows = 0 if path == "tile" else GEMV_MAX_ROWS
    q.gemv_int8 = path == "gemv8"
    try:
        return time_on_stream(ops.device, ops.stream, lambda: q.linear(x, w, y, None), reps)
    finally:
        q.gemv_max_rows, q.gemv_int8 = saved


def quantized_rows(ops: CudaOps, model: str, layer: str, n_out: int, n_in: int,
                   tokens: list[int], kinds: list[str], bf16_us: dict[int, float], reps: int,
                   hbm: float) -> list[dict]:
    """Each type's GEMV (float, int8) and tile timings of one layer at each token count."""
    rows = []
    out_f32 = layer == "lm_head"
    for kind in kinds:
        w = quantized_matrix(ops, kind, n_out, n_in)
        try:
            for n_tok in tokens:
                probe = ops.empty((n_tok, n_in), "bf16")
                gemv = ops.quantized.uses_gemv(n_tok, w, probe)
                int8 = ops.quantized.gemv_int8 and w.type.gemv8 is not None
                chosen = ("gemv8" if int8 else "gemv") if gemv else "tile"
                us: dict[str, float | None] = {"gemv": None, "gemv8": None}
                if n_tok <= GEMV_MAX_ROWS and gemv:
                    for path in ("gemv", "gemv8") if w.type.gemv8 else ("gemv",):
                        us[path] = time_quantized(ops, w, n_tok, reps, path=path,
                                                  out_f32=out_f32) * 1e6
                us["tile"] = time_quantized(ops, w, n_tok, reps, path="tile",
                                            out_f32=out_f32) * 1e6
                faster = min((t, p) for p, t in us.items() if t is not None)[1]
                best = us[faster]
                assert best is not None
                gb_s = w.nbytes / (best / 1e6) / 1e9
                rows.append(dict(model=model, layer=layer, tokens=n_tok, type=kind,
                                 weight_bytes=w.nbytes, gemv_us=us["gemv"],
                                 gemv8_us=us["gemv8"], tile_us=us["tile"],
                                 bf16_us=bf16_us[n_tok], chosen=chosen, faster=faster,
                                 weight_gb_s=gb_s, of_hbm=gb_s * 1e9 / (hbm / 2),
                                 speedup_vs_bf16=bf16_us[n_tok] / best))
        finally:
            w.owner.free()
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--models", nargs="+", default=[m for m in MODELS if m != "tiny"],
                    choices=list(MODELS))
    ap.add_argument("--layers", nargs="+", help="only these layers (default: all)")
    ap.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    ap.add_argument("--peak-dim", type=int, default=8192,
                    help="side of the square product that measures the matrix rate")
    ap.add_argument("--copy-mib", type=int, default=1024, help="size of the timed copy")
    ap.add_argument("--quantized", nargs="*", metavar="TYPE", choices=[*BY_NAME, "all"],
                    help="also time weights kept as these GGUF types (given alone: "
                         f"{' '.join(QUANT_TYPES)}; all: every type) by the fused GEMV and "
                         "the tile path")
    args = ap.parse_args()
    kinds = None if args.quantized is None else (
        list(BY_NAME) if "all" in args.quantized else args.quantized or list(QUANT_TYPES))
    device = open_gpu("bench_gemm")
    if device is None:
        return 0
    ops = CudaOps(device)
    side = args.peak_dim
    peak_s = time_gemm(ops, side, side, side, max(5, args.reps // 5))
    peak = 2 * side**3 / peak_s / 1e12
    hbm = copy_bandwidth(ops.device, ops.stream, args.copy_mib << 20, 5)
    rows, qrows = [], []
    for model in args.models:
        for layer, (n_out, n_in) in MODELS[model].items():
            if args.layers and layer not in args.layers:
                continue
            bf16_us = {}
            for n_tok in args.tokens:
                out_dtype = CUDA_R_32F if layer == "lm_head" else CUDA_R_16BF
                sec = time_gemm(ops, n_tok, n_in, n_out, args.reps, out_dtype)
                bf16_us[n_tok] = sec * 1e6
                tflops = 2 * n_tok * n_in * n_out / sec / 1e12
                weight_gb_s = n_in * n_out * 2 / sec / 1e9
                rows.append(dict(model=model, layer=layer, tokens=n_tok, n_in=n_in,
                                 n_out=n_out, us=sec * 1e6, tflops=tflops,
                                 of_peak=tflops / peak, weight_gb_s=weight_gb_s,
                                 of_hbm=weight_gb_s * 1e9 / (hbm / 2)))
            if kinds:
                qrows += quantized_rows(ops, model, layer, n_out, n_in, args.tokens, kinds,
                                        bf16_us, args.reps, hbm)
    print(f"measured matrix rate ({side}^3 bf16): {peak:.0f} TFLOP/s; "
          f"device copy: {hbm / 1e12:.2f} TB/s read+write\n")
    print("| model | layer | tokens | us | TFLOP/s | of matrix rate | weight GB/s | of HBM |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['layer']} | {r['tokens']} | {r['us']:.1f} | "
              f"{r['tflops']:.1f} | {r['of_peak']:.0%} | {r['weight_gb_s']:.0f} | "
              f"{r['of_hbm']:.0%} |")
    if qrows:
        print("\nweights as GGUF blocks (GB/s: the quantized bytes read; of HBM: against the "
              "copy rate; chosen: the path CudaOps.linear takes)\n")
        print("| model | layer | tokens | type | GEMV us | int8 GEMV us | tile us | bf16 us | "
              "faster | chosen | weight GB/s | of HBM | vs bf16 |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for r in qrows:
            gemv, gemv8 = ("-" if r[k] is None else f"{r[k]:.1f}" for k in ("gemv_us", "gemv8_us"))
            print(f"| {r['model']} | {r['layer']} | {r['tokens']} | {r['type']} | {gemv} | "
                  f"{gemv8} | {r['tile_us']:.1f} | {r['bf16_us']:.1f} | {r['faster']} | "
                  f"{r['chosen']} | "
                  f"{r['weight_gb_s']:.0f} | {r['of_hbm']:.0%} | "
                  f"{r['speedup_vs_bf16']:.2f}x |")
    result = {"device": device.name, "matrix_tflops": peak, "copy_bytes_per_s": hbm,
              "heuristic_calls": ops.gemm.heuristic_calls, "rows": rows,
              "quantized_rows": qrows}
    print("\n```json\n" + json.dumps(result, indent=2) + "\n```")
    ops.close()
    device.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
