"""Prefill attention on a GPU: the tensor-core flash kernel against PyTorch's flash SDPA.

The shape is a Llama-3.1-8B layer at a 4096-token prompt: 32 query heads, 8 KV heads
(GQA, 4 query heads per KV head), head dim 128, causal, bf16. Three figures, from the same
inputs on the same GPU in the same run, each timed with CUDA events around back-to-back
calls after a warm-up:

- eagerlm's prefill kernel (kernels/cuda/attention_prefill.cu, mma.sync on tensor cores),
  through `CudaOps.attention` as the forward calls it (with `CudaOps.tensor_core_prefill`
  switched on for this figure, whatever the engine's start-up check decides; that
  decision is printed too);
- `torch.nn.functional.scaled_dot_product_attention` restricted to the flash backend (GQA
  through `enable_gqa` where this torch has it, else K/V repeated to all heads: the same
  FLOPs);
- the CUDA-core kernel the prefill path used before (kernels/cuda/attention.cu).

TFLOP/s count 4 * heads * head_dim flops per visible (query, key) pair (Q.K^T and P.V,
2 each), the causal pairs counted exactly. The ratio eagerlm / torch is the figure to
watch (target >= 0.7). Outputs are also compared (relative error against torch's), as a
check that the kernel that was timed computes attention.

Run on a GPU machine: `python benchmarks/bench_prefill_attention.py [--tokens 4096] [--reps 20]`.
Prints a markdown table and a JSON block. Without a GPU it says so and exits 0. torch is
imported here only, never by the engine.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.gpu_timing import open_gpu, time_on_stream


def visible_pairs(n_past: int, n_new: int, window: int) -> int:
    pos = np.arange(n_past, n_past + n_new, dtype=np.int64)
    keys = pos + 1 if window <= 0 else np.minimum(pos + 1, window)
    return int(keys.sum())


@contextlib.contextmanager
def prefill_kernel(ops: Any, on: bool) -> Iterator[None]:
    """CudaOps.attention with the tensor-core prefill kernel on or off (off: attention.cu),
    whatever the engine's default."""
    saved = ops.tensor_core_prefill
    ops.tensor_core_prefill = on
    try:
        yield
    finally:
        ops.tensor_core_prefill = saved


def torch_flash(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float,
                reps: int) -> dict[str, Any]:
    """SDPA's flash backend on the same bf16 inputs: seconds per call, its output
    [n, heads, hd] as float32, and how GQA was expressed."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    dev = torch.device("cuda")

    def to_dev(x: np.ndarray) -> Any:  # [n, h, d] float32 -> [1, h, n, d] bf16
        return torch.from_numpy(x).to(dev).to(torch.bfloat16).transpose(0, 1).unsqueeze(0) \
            .contiguous()

    tq, tk, tv = to_dev(q), to_dev(k), to_dev(v)
    g = q.shape[1] // k.shape[1]
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        try:
            def fn() -> Any:
                return F.scaled_dot_product_attention(tq, tk, tv, is_causal=True, scale=scale,
                                                      enable_gqa=True)
            out = fn()
            how = "enable_gqa"
        except (RuntimeError, TypeError):
            ek, ev = tk.repeat_interleave(g, dim=1), tv.repeat_interleave(g, dim=1)

            def fn() -> Any:
                return F.scaled_dot_product_attention(tq, ek, ev, is_causal=True, scale=scale)
            out = fn()
            how = "K/V repeated to all heads"
        for _ in range(3):
            fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
    sec = start.elapsed_time(end) / 1e3 / reps
    ref = out[0].transpose(0, 1).float().cpu().numpy()
    return {"seconds": sec, "out": ref, "gqa": how, "torch": torch.__version__}


def rel_err(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def bench(ops: Any, n_tok: int, n_heads: int, n_kv: int, hd: int, window: int,
          reps: int, with_torch: bool, rng: np.random.Generator) -> dict[str, Any]:
    from eagerlm.kernels.batch import ForwardBatch, SeqSlice
    from eagerlm.kernels.device_tensor import KV_DTYPE, ContiguousDeviceKV
    from eagerlm.vmm.kv_layout import KVLayout

    kv = ContiguousDeviceKV(ops, KVLayout(1, n_kv, hd, KV_DTYPE), n_tok)
    batch = ForwardBatch(np.zeros(n_tok, np.int32), [SeqSlice(0, n_tok, 0, kv)],
                         np.array([n_tok - 1]))
    q = rng.standard_normal((n_tok, n_heads, hd), dtype=np.float32)
    k = rng.standard_normal((n_tok, n_kv, hd), dtype=np.float32)
    v = rng.standard_normal((n_tok, n_kv, hd), dtype=np.float32)
    ops.kv_append(batch, 0, ops.upload(k, "bf16").reshape(n_tok, n_kv, hd),
                  ops.upload(v, "bf16").reshape(n_tok, n_kv, hd))
    dq = ops.upload(q, "bf16").reshape(n_tok, n_heads, hd)
    scale = 1 / math.sqrt(hd)

    name = f"attention_prefill_hd{hd}"
    launched = []
    kernel = ops.kernels[name]
    real = kernel.launch
    kernel.launch = lambda *a, **kw: (launched.append(1), real(*a, **kw))[1]
    with prefill_kernel(ops, True):
        out = ops.attention(batch, 0, dq, scale=scale, window=window)
    del kernel.launch
    if not launched:
        raise RuntimeError(f"CudaOps.attention did not take {name} for this shape")
    ours = ops.to_numpy(out).reshape(n_tok, n_heads, hd)

    def run() -> Any:
        return ops.attention(batch, 0, dq, scale=scale, window=window)

    flop = 4.0 * n_heads * hd * visible_pairs(0, n_tok, window)
    row: dict[str, Any] = {"tokens": n_tok, "heads": n_heads, "kv_heads": n_kv, "head_dim": hd,
                           "window": window, "gflop": flop / 1e9}
    with prefill_kernel(ops, True):
        sec = time_on_stream(ops.device, ops.stream, run, reps)
    row.update(eagerlm_ms=sec * 1e3, eagerlm_tflops=flop / sec / 1e12)

    with prefill_kernel(ops, False):
        old = ops.to_numpy(run()).reshape(n_tok, n_heads, hd)
        sec_old = time_on_stream(ops.device, ops.stream, run, max(2, reps // 5), warmup=1)
    row.update(old_ms=sec_old * 1e3, old_tflops=flop / sec_old / 1e12,
               err_vs_old_kernel=rel_err(ours, old))

    if with_torch and window <= 0:
        try:
            t = torch_flash(q, k, v, scale, reps)
        except ImportError as exc:
            row["torch"] = f"not available ({exc})"
        else:
            row.update(torch_ms=t["seconds"] * 1e3, torch_tflops=flop / t["seconds"] / 1e12,
                       torch_gqa=t["gqa"], torch=t["torch"], err_vs_torch=rel_err(ours, t["out"]))
            row["ratio"] = row["eagerlm_tflops"] / row["torch_tflops"]
    kv.free()
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096])
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128, choices=(64, 128))
    ap.add_argument("--window", type=int, default=0, help="sliding window (no torch figure)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--no-torch", action="store_true")
    args = ap.parse_args()

    device = open_gpu("bench_prefill_attention")
    if device is None:
        return 0
    from eagerlm.kernels.cuda_ops import CudaOps

    ops = CudaOps(device)
    rng = np.random.default_rng(0)
    rows = [bench(ops, n, args.heads, args.kv_heads, args.head_dim, args.window, args.reps,
                  not args.no_torch, rng) for n in args.tokens]
    agrees = ops.attn.prefill_kernel_agrees(args.head_dim)
    print(f"device: {device.name}; the engine's start-up check of the kernel against "
          f"attention.cu: {'agrees, so the engine uses it' if agrees else 'DISAGREES'}\n")
    print("| tokens | heads / kv | hd | eagerlm ms | eagerlm TFLOP/s | torch flash TFLOP/s | "
          "ratio | attention.cu TFLOP/s | rel. err vs torch |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        torch_tf = f"{r['torch_tflops']:.1f}" if "torch_tflops" in r else "-"
        ratio = f"{r['ratio']:.2f}" if "ratio" in r else "-"
        err = f"{r['err_vs_torch']:.1e}" if "err_vs_torch" in r else "-"
        print(f"| {r['tokens']} | {r['heads']} / {r['kv_heads']} | {r['head_dim']} | "
              f"{r['eagerlm_ms']:.3f} | {r['eagerlm_tflops']:.1f} | {torch_tf} | {ratio} | "
              f"{r['old_tflops']:.2f} | {err} |")
    print("\n```json\n" + json.dumps({"device": device.name, "startup_check_agrees": agrees,
                                       "rows": rows}, indent=2) + "\n```")
    ops.close()
    device.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
