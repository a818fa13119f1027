"""Decode attention alone (kernels/cuda/attention_decode.cu): GB/s against the measured
device copy rate, beside the general kernel (attention.cu) on the same batch.

Decode attention reads every K and V byte of every session once and does little else, so
its limit is memory bandwidth. The limit is measured in the same run as the rate of a
large device-to-device copy (cuMemcpyDtoDAsync, bytes read + written per second, timed
with CUDA events like the kernels); the kernel's rate counts K and V read plus q read and
the output written (the split partials and their merge are overhead, not counted).

Shape: Qwen3-0.6B-like (16 query heads, 8 KV heads, head_dim 128, bf16 KV), 64 sessions of
4096 positions each (one new row per session; 1 GiB of K and V per layer), KV token-major
with --layers layers per token (the kernel reads one layer: 2 KiB runs of K and V).
Also a sweep of the split count around the host's choice (decode_attention_splits).

Run on a GPU machine: `python benchmarks/bench_decode_attention.py [--reps 50]`.
Without a GPU it says so and exits 0. Prints a markdown table and a JSON block.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np

from benchmarks.gpu_timing import copy_bandwidth, open_gpu, time_on_stream


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sessions", type=int, default=64)
    ap.add_argument("--context", type=int, default=4096, help="positions per session")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2, help="layers in the KV token layout")
    ap.add_argument("--window", type=int, default=0)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--copy-mib", type=int, default=1024, help="size of the timed copy")
    args = ap.parse_args()

    device = open_gpu("bench_decode_attention")
    if device is None:
        return 0

    from eagerlm.kernels.batch import ForwardBatch, SeqSlice
    from eagerlm.kernels.cuda_attention import decode_attention_splits
    from eagerlm.kernels.cuda_ops import CudaOps
    from eagerlm.kernels.device_tensor import KV_DTYPE, ContiguousDeviceKV, DeviceTensor
    from eagerlm.vmm.kv_layout import KVLayout

    ops = CudaOps(device)
    n, ctx, nh, nkv, hd = args.sessions, args.context, args.heads, args.kv_heads, args.head_dim
    layer = args.layers - 1
    layout = KVLayout(args.layers, nkv, hd, KV_DTYPE)
    kvs = [ContiguousDeviceKV(ops, layout, ctx) for _ in range(n)]
    for i, kv in enumerate(kvs):  # small finite bf16s (0x3838 .. 0x3F3F), one per session
        ops.fill(DeviceTensor(kv.buffer.ptr, (kv.buffer.nbytes,), "u8"), 0x38 + i % 8)
    seqs = [SeqSlice(i, 1, ctx - 1, kv) for i, kv in enumerate(kvs)]
    batch = ForwardBatch(np.zeros(n, np.int32), seqs, np.arange(n))
    q = ops.empty((n, nh, hd), "bf16")
    ops.fill(DeviceTensor(q.ptr, (q.nbytes,), "u8"), 0x3C)
    scale = hd**-0.5
    keys = min(ctx, args.window) if args.window > 0 else ctx
    kv_bytes = n * keys * nkv * hd * 2 * 2
    io_bytes = kv_bytes + 2 * n * nh * hd * 2  # + q read + out written

    hbm = copy_bandwidth(ops.device, ops.stream, args.copy_mib << 20, max(5, args.reps // 5))

    def attention(decode: bool):
        ops.use_decode_attention = decode
        return lambda: ops.attention(batch, layer, q, scale=scale, window=args.window)

    rows = []

    def add(name: str, sec: float, n_splits: int | str) -> None:
        rate = io_bytes / sec
        rows.append(dict(kernel=name, splits=n_splits, us=sec * 1e6, gb_s=rate / 1e9,
                         of_copy=rate / hbm))

    # at a glance: both kernels give every session its own V
    new, old = ops.to_numpy(attention(True)()), ops.to_numpy(attention(False)())
    agree = bool(np.allclose(new, old, rtol=1e-2) and np.isfinite(new).all())

    def timed(fn) -> float:
        return time_on_stream(ops.device, ops.stream, fn, args.reps, args.warmup)

    plan = decode_attention_splits(keys, n, nkv, nh, ops.sm_count)
    add("attention_decode (host's split plan)", timed(attention(True)), plan[0])
    add("attention.cu general kernel", timed(attention(False)), "own")
    ops.use_decode_attention = True
    meta = ops.attn.batch_meta(batch)
    for n_splits in sorted({1, 2, 4, 8, 16, plan[0]}):
        split_len = -(-keys // n_splits)

        def run(n_splits=n_splits, split_len=split_len):
            return ops.attn.decode(meta, layer, q, scale=scale, window=args.window,
                                  n_splits=n_splits, split_len=split_len)

        add("attention_decode", timed(run), n_splits)

    print(f"device: {device.name}, {ops.sm_count} SMs; {n} sessions x {ctx} positions, "
          f"{nh} q / {nkv} kv heads, head_dim {hd}, window {args.window}")
    print(f"bytes per call: {io_bytes / 2**20:.1f} MiB (K and V {kv_bytes / 2**20:.1f} MiB); "
          f"device copy (cuMemcpyDtoDAsync, read + write): {hbm / 1e9:.0f} GB/s; "
          f"decode and general kernel agree: {agree}\n")
    print("| kernel | splits | us | GB/s | of copy rate |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['kernel']} | {r['splits']} | {r['us']:.1f} | {r['gb_s']:.0f} | "
              f"{r['of_copy']:.0%} |")
    result = {"device": device.name, "sm_count": ops.sm_count, "sessions": n, "context": ctx,
              "heads": nh, "kv_heads": nkv, "head_dim": hd, "window": args.window,
              "bytes_per_call": io_bytes, "copy_bytes_per_s": hbm, "split_plan": plan,
              "outputs_agree": agree, "rows": rows}
    print("\n```json\n" + json.dumps(result, indent=2) + "\n```")
    ops.close()
    device.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
