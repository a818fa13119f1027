"""Offline throughput, eagerlm beside llama.cpp, same model, same workload, same run.

The workload is `eagerlm bench offline`'s (`service.workload`: N requests, prompt and output
lengths uniform over ranges, random token ids, greedy, EOS ignored, everything submitted at
once). Run on it:
- eagerlm, eager and sync dispatch (`service.bench.bench_offline`);
- llama.cpp (llama-cpp-python) one request at a time (`n_parallel=1`), and with parallel
  decoding of up to `--max-batch` sequences in a unified KV cache
  (`benchmarks/llama_cpp_batched.py`).

The physical limit stated beside them is the compute roofline of this machine: the
matrix-multiply FLOPs the workload needs (2 x weights per prompt token without the LM head,
2 x weights with it per output token; attention ignored at these short lengths) at the
float32 GEMM rate numpy reaches here (best of a few 2048^3 products). The defaults are
sized for a 2-core cpu; the reference benchmarks' shape (256 requests, 100-1024 tokens) is
`--num-requests 256 --input-len 100-1024 --output-len 100-1024`.

On a shared machine, `--repeats N` runs the whole sequence N times (the engines alternate
within each pass) and reports the median and range of each figure; `--dispatch eager` and
`--peer-parallel 8` leave out runs that a comparison does not need.

Run: `python benchmarks/bench_offline.py [--model PATH] [--weights quantized|float]
[--num-requests 8] [--input-len 32-64] [--output-len 32-64] [--max-batch 8] [--threads 2]
[--dispatch eager,sync] [--peer-parallel 1,8] [--repeats 1] [--json out.json]`
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from threadpoolctl import threadpool_limits

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eagerlm.kernels.cpu_threads import core_count
from eagerlm.loader.config import ModelConfig
from eagerlm.service.measure.bench import bench_offline
from eagerlm.service.measure.harness import DispatchSettings, open_measured_model
from eagerlm.service.measure.workload import LengthRange, WorkloadSpec, make_workload

# tokens per round (prefill chunks + decodes), the same for both engines: llama.cpp's
# default n_batch, rather than eagerlm's own default (SchedulerConfig.max_round_tokens)
ROUND_TOKENS = 512


def gemm_gflops(n: int = 2048, repeats: int = 3) -> float:
    """The machine's float32 GEMM rate on all its cores (the quantized cpu backend, once
    loaded, holds numpy's BLAS to one thread: kernels/cpu_threads.py)."""
    a = np.random.default_rng(0).standard_normal((n, n), dtype=np.float32)
    best = float("inf")
    with threadpool_limits(core_count(), user_api="blas"):
        for _ in range(repeats):
            t = time.perf_counter()
            a @ a
            best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best / 1e9


def matmul_params(cfg: ModelConfig) -> tuple[int, int]:
    """(weights in the layers' matrices, weights of the LM head)."""
    d, q, kv = cfg.d_model, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    per_layer = d * q + 2 * d * kv + q * d + 3 * d * cfg.d_ff
    return cfg.n_layers * per_layer, cfg.vocab_size * d


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="GGUF file (default: the demo model)")
    ap.add_argument("--num-requests", type=int, default=8)
    ap.add_argument("--input-len", type=LengthRange.parse, default=LengthRange(32, 64))
    ap.add_argument("--output-len", type=LengthRange.parse, default=LengthRange(32, 64))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-batch", type=int, default=8,
                    help="eagerlm's max batch and llama.cpp's parallel sequences")
    ap.add_argument("--threads", type=int, default=2, help="llama.cpp threads")
    ap.add_argument("--weights", default=None, choices=("quantized", "float"),
                    help="how eagerlm's cpu backend holds the weights (default: its default)")
    ap.add_argument("--dispatch", default="eager,sync", help="eagerlm dispatch modes")
    ap.add_argument("--peer-parallel", default=None,
                    help="llama.cpp parallel sequences to run, comma-separated "
                         "(default: 1 and --max-batch)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="passes over every engine; median and range reported")
    ap.add_argument("--no-peer", action="store_true", help="skip llama.cpp")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()

    workload = WorkloadSpec(args.num_requests, args.input_len, args.output_len, seed=args.seed)
    loaded = open_measured_model(args.model, None, weights=args.weights)
    requests = make_workload(workload, loaded.vocab_size, loaded.context_length)
    n_in = sum(len(r.prompt_ids) for r in requests)
    n_out = sum(r.max_tokens for r in requests)
    body, head = matmul_params(loaded.model.config)
    gflop = (2 * body * n_in + 2 * (body + head) * n_out) / 1e9
    peak = gemm_gflops()
    roof = n_out / (gflop / peak)
    path = str(loaded.model.path)
    pairs = [(r.prompt_ids, r.max_tokens) for r in requests]
    parallel = ([int(n) for n in args.peer_parallel.split(",")] if args.peer_parallel
                else list(dict.fromkeys((1, args.max_batch))))
    if not args.no_peer:
        from benchmarks.llama_cpp_batched import run_llama_cpp_workload

    runs: dict[str, list[dict]] = {}
    settings = DispatchSettings(max_batch=args.max_batch, max_round_tokens=ROUND_TOKENS)
    weights = f", {args.weights} weights" if args.weights else ""
    for _ in range(args.repeats):
        for mode in [m.strip() for m in args.dispatch.split(",") if m.strip()]:
            s = bench_offline(loaded, workload, settings, sync=mode == "sync").summary
            runs.setdefault(f"eagerlm {mode}{weights}, batch<={args.max_batch}", []).append({
                "output_tok_s": s.output_tok_s, "wall_s": s.duration_s,
                "ttft_mean_s": s.ttft.mean / 1e3})
        if not args.no_peer:
            for n_par in parallel:
                r = run_llama_cpp_workload(path, pairs, n_parallel=n_par,
                                           n_threads=args.threads, n_batch=ROUND_TOKENS)
                runs.setdefault(f"llama.cpp {args.threads} threads, parallel {n_par}",
                                []).append(r)
    loaded.close()
    results = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]}
               for name, rs in runs.items()}

    print(f"machine: {platform.machine()}, {os.cpu_count()} cores; float32 GEMM "
          f"{peak:.0f} GFLOP/s; model {Path(path).name}")
    print(f"workload: {args.num_requests} requests, input {args.input_len}, output "
          f"{args.output_len} (seed {args.seed}): {n_in} prompt + {n_out} output tokens, "
          f"{gflop:.0f} GFLOP")
    print(f"compute roofline at that rate: {roof:.1f} output tok/s\n")
    if args.repeats > 1:
        print(f"{args.repeats} passes: median (range)\n")
    print("| engine | output tok/s | of roofline | wall s | mean TTFT s |")
    print("|---|---|---|---|---|")
    for name, r in results.items():
        tok_s = [x["output_tok_s"] for x in runs[name]]
        spread = f" ({min(tok_s):.1f}-{max(tok_s):.1f})" if len(tok_s) > 1 else ""
        print(f"| {name} | {r['output_tok_s']:.1f}{spread} | {r['output_tok_s'] / roof:.0%} | "
              f"{r['wall_s']:.2f} | {r['ttft_mean_s']:.2f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "date": time.strftime("%Y-%m-%d"), "gemm_gflops": peak, "roofline_tok_s": roof,
            "workload": {"n": args.num_requests, "input_len": str(args.input_len),
                         "output_len": str(args.output_len), "seed": args.seed},
            "results": results, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
