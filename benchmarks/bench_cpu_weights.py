"""The cpu backend's weight kernels alone: GB/s of the weights' bytes against the machine's
memory bandwidth, per weight type, matrix shape and rows of x.

`quantized_linear(x, w)` (kernels/quantized.py) is timed as the forward calls it: on every
core above `cpu_threads.SERIAL_MAX_VALUES` multiply-adds, with x quantized to 8 bits per
call for the block types. Matrices are random blocks (loader/synthetic.py's writer: gguf-py's
quantizer, or loader/ggml_quants.py's port of ggml's for Q1_0, or random bytes with sane
scales for the types neither quantizes). Each timed call reads a different copy of the
matrix, the copies together over `--working-set` MiB (default 96, three times this
machine's L3), so every call reads its weights from memory as a decode step does;
`--in-cache` times one copy, warm.

Reported per (type, shape, rows of x): microseconds per call (median over `--repeats`
passes, each the median of `--calls` calls; the passes run the types in alternating order,
ABBA, as the machine may be shared), GB/s of the matrix's bytes, and that as a fraction of
the physical limit: the read bandwidth of all cores (each core summing its share of a
512 MiB array with numpy, measured in the same run), the rate at which a one-row product
can at best stream its weights. The copy bandwidth (read + write) is printed beside it.
Many rows (above the type's `gemv_rows`: float32 tiles times BLAS) also report GFLOP/s.

There is no peer at this level: llama.cpp's kernels are not callable one by one from
llama-cpp-python. benchmarks/bench_types.py compares whole models beside llama.cpp.

Run: `python benchmarks/bench_cpu_weights.py [--types Q4_0 Q4_K ...] [--shapes 4096x1024 ...]
[--rows 1 4 8 16 128] [--repeats 3] [--calls 20] [--threads N] [--in-cache] [--json PATH]`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from benchmarks.bench_cpu_decode import copy_bandwidth_gb_s
from eagerlm.kernels import cpu_threads
from eagerlm.kernels.cpu_kernel_registry import BLOCK_TYPES
from eagerlm.kernels.cpu_threads import CoreWorkers, core_workers, hold_blas_to_one_thread
from eagerlm.kernels.quantized import QuantizedMatrix, quantized_linear, warm_up
from eagerlm.loader import ggml_quants
from eagerlm.loader.synthetic import RANDOM_BYTE_TYPES, bf16_bits, random_blocks

Q = GGMLQuantizationType
DEFAULT_SHAPES = ("4096x1024", "1024x4096", "1024x1024")  # a 0.4B llama's FFN and attention
DEFAULT_ROWS = (1, 4, 8, 16, 128)


def read_bandwidth_gb_s(n_bytes: int = 512 << 20, repeats: int = 5) -> float:
    """All cores summing their share of a large array (numpy releases the GIL in the
    sum): bytes read per second, best of `repeats`."""
    data = np.ones(n_bytes // 8)
    workers = core_workers()
    share = -(-len(data) // workers.parts)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        workers.run(lambda i, parts: data[i * share:(i + 1) * share].sum())
        best = min(best, time.perf_counter() - t)
    return n_bytes / best / 1e9


def random_matrix(qtype: GGMLQuantizationType, rows: int, cols: int,
                  rng: np.random.Generator) -> QuantizedMatrix:
    """Weights of a trained layer's size (1 / sqrt(cols)) in `qtype`'s blocks."""
    std = 1 / np.sqrt(cols)
    if qtype in RANDOM_BYTE_TYPES:
        block, _ = GGML_QUANT_SIZES[qtype]
        scales = rng.uniform(0.5, 1.5, rows * cols // block).astype(np.float32) * std / 4
        raw = random_blocks(qtype, scales, rng)
    else:
        values = (rng.standard_normal((rows, cols)) * std).astype(np.float32)
        if qtype == Q.F16:
            raw = values.astype(np.float16).view(np.uint8)
        elif qtype == Q.BF16:
            raw = bf16_bits(values).view(np.uint8)
        else:
            raw = ggml_quants.quantize(values, qtype)
    return QuantizedMatrix.of(qtype, (rows, cols), raw.reshape(rows, -1))


def time_case(copies: list[QuantizedMatrix], n: int, calls: int) -> float:
    """Median seconds of `calls` products of n rows, each on the next copy."""
    x = np.random.default_rng(n).standard_normal((n, copies[0].shape[1])).astype(np.float32)
    for w in copies[:2]:
        quantized_linear(x, w)
    times = []
    for i in range(calls):
        w = copies[i % len(copies)]
        t = time.perf_counter()
        quantized_linear(x, w)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--types", nargs="*", default=[q.name for q in BLOCK_TYPES])
    p.add_argument("--shapes", nargs="*", default=list(DEFAULT_SHAPES))
    p.add_argument("--rows", nargs="*", type=int, default=list(DEFAULT_ROWS))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--threads", type=int, default=0, help="cores to use (0: all)")
    p.add_argument("--working-set", type=int, default=96, help="MiB of matrix copies")
    p.add_argument("--in-cache", action="store_true", help="one copy, warm in cache")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)

    hold_blas_to_one_thread()
    if args.threads:
        cpu_threads._workers = CoreWorkers(args.threads)
    types = [Q[name] for name in args.types]
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes]
    warm_up(types)
    read_bw, copy_bw = read_bandwidth_gb_s(), copy_bandwidth_gb_s()
    rng = np.random.default_rng(0)
    cases = {}
    for qtype in types:
        for rows, cols in shapes:
            one = random_matrix(qtype, rows, cols, rng)
            n_copies = 1 if args.in_cache else max(2, -(-(args.working_set << 20) // one.nbytes))
            cases[qtype, (rows, cols)] = [one] + [
                QuantizedMatrix(qtype, one.shape, one.blocks.copy()) for _ in range(n_copies - 1)]
    times: dict[tuple, list[float]] = {}
    order = list(cases)
    for rep in range(args.repeats):
        for key in order if rep % 2 == 0 else order[::-1]:
            for n in args.rows:
                times.setdefault((*key, n), []).append(time_case(cases[key], n, args.calls))

    print(f"read bandwidth {read_bw:.1f} GB/s ({core_workers().parts} cores), copy bandwidth "
          f"{copy_bw:.1f} GB/s (read + write); {'in cache' if args.in_cache else 'from memory'}")
    print("| type | shape | rows of x | path | us per call | GB/s of weights | of read bandwidth "
          "| GFLOP/s |")
    print("|---|---|---|---|---|---|---|---|")
    results = []
    for (qtype, (rows, cols), n), ts in times.items():
        t = statistics.median(ts)
        nbytes = cases[qtype, (rows, cols)][0].nbytes
        gb_s = nbytes / t / 1e9
        path = "gemv" if n <= BLOCK_TYPES[qtype].gemv_rows else "tiles + BLAS"
        gflops = 2 * n * rows * cols / t / 1e9
        print(f"| {qtype.name} | {rows}x{cols} | {n} | {path} | {t * 1e6:.0f} | {gb_s:.1f} | "
              f"{gb_s / read_bw:.0%} | {gflops:.1f} |")
        results.append({"type": qtype.name, "shape": [rows, cols], "rows": n, "path": path,
                        "us": t * 1e6, "us_passes": [v * 1e6 for v in ts], "gb_s": gb_s,
                        "gflop_s": gflops})
    if args.json:
        args.json.write_text(json.dumps({
            "date": time.strftime("%Y-%m-%d"), "read_bandwidth_gb_s": read_bw,
            "copy_bandwidth_gb_s": copy_bw, "cores": core_workers().parts,
            "in_cache": args.in_cache, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
