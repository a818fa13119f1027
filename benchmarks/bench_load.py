"""Weight loading: the pinned slab loader against a naive synchronous loader and against
the host link's measured pinned bandwidth (the physical limit of loading).

1. Pinned H2D bandwidth: a 256 MiB pinned buffer copied to the device with
   cuMemcpyHtoDAsync, ten times; the best rate is the limit a loader can approach.
2. Naive loader: per tensor, allocate, cuMemcpyHtoD straight from the memory-mapped file
   (pageable, synchronous), dequantize, synchronize. No overlap of anything.
3. Slab loader (kernels/cuda_backend.load_cuda_weights): pinned staging reused by size,
   the copy into staging overlapping the previous tensor's DMA, dequantization on the GPU.

Both loaders read the file through the page cache, warmed first (a cold disk would measure
the disk). Reported: seconds, GB/s of file bytes, and the fraction of the pinned limit.

Run on a GPU machine: `python benchmarks/bench_load.py [--model PATH | --shape qwen3-0.6b]`
(the synthetic model of a real shape is written to a temporary directory first).
Prints a markdown table and a JSON block on stdout.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.gpu_timing import open_gpu
from eagerlm.kernels.cuda_backend import CudaWeights, free_weights, load_cuda_weights
from eagerlm.kernels.cuda_ops import CudaOps
from eagerlm.loader.model_file import ModelFile
from eagerlm.loader.synthetic import SHAPES, write_synthetic_model
from eagerlm.loader.weights import build_weights
from eagerlm.vmm.cuda_driver import cu, driver


def pinned_bandwidth(ops: CudaOps, nbytes: int = 256 << 20, reps: int = 10) -> float:
    host = ops.device.alloc_host(nbytes)
    host.array[:] = 1
    dev = ops.device.alloc(nbytes)
    best = float("inf")
    for _ in range(reps):
        start = ops.stream.record(ops.device.event())
        ops.stream.copy_h2d(dev, host, nbytes)
        end = ops.stream.record(ops.device.event())
        end.synchronize()
        best = min(best, start.elapsed_ms(end) / 1e3)
    host.free()
    dev.free()
    return nbytes / best / 1e9


def naive_load(model: ModelFile, ops: CudaOps) -> tuple[float, int]:
    """Synchronous: pageable copy, dequantize, wait, per tensor."""
    builder = CudaWeights(ops, model.path)
    d = driver()
    total = 0

    def fetch(info):
        nonlocal total
        raw = model.gguf.tensor_bytes(info.name)
        total += info.n_bytes
        dst = ops.device.alloc(info.n_bytes)
        ops.ctx.bind()
        cu("cuMemcpyHtoD", d.CUdeviceptr(dst.ptr), raw.ctypes.data, info.n_bytes)
        if builder.is_final(info):
            return builder.wrap(dst, info)
        w = builder.expand(ops.stream, dst, info)
        ops.stream.synchronize()
        dst.free()
        return w

    t0 = time.perf_counter()
    weights = build_weights(model.gguf, model.config, fetch)
    ops.synchronize()
    seconds = time.perf_counter() - t0
    free_weights(weights)
    return seconds, total


def warm_page_cache(model: ModelFile) -> float:
    t0 = time.perf_counter()
    for name in model.gguf.tensors:
        np.bitwise_xor.reduce(model.gguf.tensor_bytes(name)[::4096])
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="a GGUF file (default: a synthetic model of --shape)")
    ap.add_argument("--shape", default="qwen3-0.6b", choices=sorted(SHAPES))
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--copy-mib", type=int, default=256,
                    help="size of the pinned host-to-device copy that measures the limit")
    args = ap.parse_args()

    device = open_gpu("bench_load")
    if device is None:
        return
    ops = CudaOps(device)
    with tempfile.TemporaryDirectory() as tmp:
        path = args.model or str(write_synthetic_model(Path(tmp) / "m.gguf",
                                                       SHAPES[args.shape]))
        model = ModelFile.open(path)
        warm = warm_page_cache(model)
        limit = pinned_bandwidth(ops, args.copy_mib << 20)
        naive = [naive_load(model, ops) for _ in range(args.reps)]
        slab = []
        for _ in range(args.reps):
            weights, stats = load_cuda_weights(model, ops)
            slab.append(stats)
            free_weights(weights)
        n_bytes = naive[0][1]
        naive_s = min(s for s, _ in naive)
        slab_s = min(s.seconds for s in slab)
        best = min(slab, key=lambda s: s.seconds)
        result = {
            "device": device.name, "model": Path(path).name, "file_bytes": n_bytes,
            "page_cache_warm_s": warm, "pinned_h2d_gb_s": limit,
            "naive_s": naive_s, "naive_gb_s": n_bytes / naive_s / 1e9,
            "slab_s": slab_s, "slab_gb_s": n_bytes / slab_s / 1e9,
            "slab_fraction_of_pinned": n_bytes / slab_s / 1e9 / limit,
            "speedup_vs_naive": naive_s / slab_s,
            "slab_report": best.report(),
        }
    print("| loader | seconds | GB/s | of pinned H2D |")
    print("|---|---|---|---|")
    print(f"| pinned H2D copy (limit) | - | {limit:.1f} | 100% |")
    print(f"| naive synchronous | {naive_s:.2f} | {result['naive_gb_s']:.1f} | "
          f"{result['naive_gb_s'] / limit:.0%} |")
    print(f"| slab loader | {slab_s:.2f} | {result['slab_gb_s']:.1f} | "
          f"{result['slab_fraction_of_pinned']:.0%} |")
    print("\n```json\n" + json.dumps(result, indent=2) + "\n```")
    ops.close()
    device.close()


if __name__ == "__main__":
    main()
