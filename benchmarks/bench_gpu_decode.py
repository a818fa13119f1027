"""GPU decode speed beside the memory-bandwidth limit, weights kept quantized and as bf16,
with and without CUDA graphs.

For each real shape, one synthetic GGUF file (random weights, written on the fly) of a
quantized type (`--weight-type`, default q4_k_m: Q4_K matrices, the lm head Q6_K as
llama.cpp's Q4_K_M holds it), loaded twice: with its matrices kept as their blocks
(`--weights quantized`, kernels/cuda_quantized.py) and dequantized to bf16 at load
(`--weights bf16`, the path before quantized weights), so the same model runs both ways in
the same run:
- the physical limit: the measured device-to-device copy bandwidth (a copy reads and writes
  each byte, so bandwidth = 2 x bytes / time), and the bytes one decode step must read as
  the backend holds them (the quantized bytes, or bf16): every weight matrix once (the
  embedding table only when it is also the lm head) plus the KV cache of the context;
- batch-1 decode through the engine (one request, greedy, EOS ignored): tokens/s over the
  steady decode, the fraction of that load's roofline (tokens/s x bytes per token /
  bandwidth), and quantized against bf16;
- batch-64 decode: output tokens/s with 64 concurrent requests;
- per round, from the dispatcher's instrumentation: host time (plan + launch) and the
  device idle fraction between rounds in steady decode; with graphs and without for the
  quantized weights, with graphs for bf16, and with graphs for the quantized weights
  through the int8-activation GEMV (`gemv_int8`, kernels/cuda_quantized.py) instead of
  the float one, so the run says which GEMV to keep.

Targets (issue 6): >= 85% of the roofline at batch 1 on the 8B shape. HF transformers on
the same shapes: benchmarks/peer_transformers.py, run in the same session by
.ci/gpu_check.sh.

Run (GPU machine): python benchmarks/bench_gpu_decode.py [--shapes qwen3-0.6b,...]
[--weight-type q4_k_m] [--prompt 128 --output 256] [--json out.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

from gguf import GGMLQuantizationType as Q

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.gpu_timing import copy_bandwidth
from eagerlm.loader.synthetic import SHAPES, tiny_spec, write_synthetic_model
from eagerlm.service.measure.harness import (
    DispatchSettings,
    open_measured_model,
    run_requests,
    start_engine,
    warm_up,
)
from eagerlm.service.measure.round_timeline import DeviceClock, spans_from_traces, timeline_stats
from eagerlm.service.measure.workload import PlannedRequest


def bytes_per_token(loaded, context: int) -> int:
    """Weights read by one decode step, plus the KV cache of `context` positions."""
    total = loaded.transformer.weights.decode_bytes()
    cfg = loaded.model.config
    kv = context * cfg.n_layers * 2 * cfg.n_kv_heads * cfg.head_dim * 2
    return total + kv


# --weight-type: (matrices, lm head or tied embedding)
WEIGHT_TYPES = {"q4_k_m": (Q.Q4_K, Q.Q6_K), "q4_k": (Q.Q4_K, Q.Q4_K), "q6_k": (Q.Q6_K, Q.Q6_K),
                "q8_0": (Q.Q8_0, Q.Q8_0), "q5_0": (Q.Q5_0, Q.Q8_0), "q4_0": (Q.Q4_0, Q.Q4_0)}


def write_model(shape: str, weight_type: str, min_context: int, folder: Path) -> Path:
    """The synthetic model of `shape` (a real shape, or "tiny") in `weight_type`."""
    spec = tiny_spec("qwen3") if shape == "tiny" else SHAPES[shape]
    matrices, head = WEIGHT_TYPES[weight_type]
    spec = dataclasses.replace(spec, weight_type=matrices, output_type=head,
                               embedding_type=head if spec.tied_embeddings else matrices,
                               context_length=max(spec.context_length, min_context))
    return write_synthetic_model(folder / f"{shape}-{weight_type}.gguf", spec)


def decode_run(loaded, settings: DispatchSettings, n_requests: int, prompt: int,
               output: int) -> dict:
    engine = start_engine(loaded, settings, sync=False)
    try:
        warm_up(engine, loaded.vocab_size)
        clock = DeviceClock.calibrate(engine.device)
        reqs = [PlannedRequest(i, [(7 * i + j) % loaded.vocab_size for j in range(prompt)],
                               output, 0.0) for i in range(n_requests)]
        result = run_requests(engine, reqs)
        engine.flush()
        spans = spans_from_traces(engine.traces, clock)
        stats = timeline_stats(spans, min_batch=n_requests)
        firsts = [r.token_times[0] for r in result.records]
        lasts = [r.token_times[-1] for r in result.records]
        decode_s = max(lasts) - max(firsts)
        tokens = sum(len(r.token_times) - 1 for r in result.records)
        return {"tok_s": tokens / decode_s if decode_s > 0 else 0.0,
                "host_ms": stats.host_ms, "device_ms": stats.device_ms,
                "bubble": stats.bubble, "rounds": stats.n_rounds}
    finally:
        engine.shutdown()


def measure_shape(args: argparse.Namespace, shape: str, folder: Path) -> dict:
    """One shape's file, loaded quantized then as bf16, each measured; the results row."""
    t0 = time.perf_counter()
    path = write_model(shape, args.weight_type, args.prompt + args.output + 16, folder)
    print(f"\n== {shape} ({args.weight_type}): written in {time.perf_counter() - t0:.1f} s")
    row: dict = {"shape": shape, "weight_type": args.weight_type}
    bw = 0.0
    for weights in ("quantized", "bf16"):
        t0 = time.perf_counter()
        loaded = open_measured_model(str(path), None, device="cuda", weights=weights)
        print(f"-- weights {weights}: loaded in {time.perf_counter() - t0:.1f} s on "
              f"{loaded.device.name}")
        try:
            if not bw:
                stream = loaded.device.stream("bandwidth")
                try:
                    bw = copy_bandwidth(loaded.device, stream, args.copy_mib << 20)
                finally:
                    stream.close()
                row["bandwidth_gbs"] = bw / 1e9
            per_tok = bytes_per_token(loaded, args.prompt + args.output // 2)
            limit = bw / per_tok
            print(f"device copy bandwidth {bw / 1e9:.0f} GB/s; {per_tok / 1e9:.3f} GB read "
                  f"per token -> roofline {limit:.0f} tok/s at batch 1")
            part = {"bytes_per_token": per_tok, "roofline_tok_s": limit}
            runs = [("graphs", True, False)]
            if weights == "quantized":
                runs += [("eager", False, False), ("graphs_int8_gemv", True, True)]
            for key, graphs, int8 in runs:
                settings = DispatchSettings(device="cuda", max_batch=max(64, args.batch),
                                            memory_fraction=args.memory_fraction,
                                            cuda_graphs=graphs)
                loaded.transformer.ops.quantized.gemv_int8 = int8
                b1 = decode_run(loaded, settings, 1, args.prompt, args.output)
                bn = decode_run(loaded, settings, args.batch, args.prompt, args.output)
                tag = (f"{weights}{', int8 GEMV' if int8 else ''}, "
                       f"{'graphs' if graphs else 'eager launches'}")
                print(f"[{tag}] batch 1: {b1['tok_s']:.1f} tok/s = "
                      f"{b1['tok_s'] / limit:.1%} of roofline; host {b1['host_ms']:.2f} ms "
                      f"per round, device {b1['device_ms']:.2f} ms, idle {b1['bubble']:.1%}")
                print(f"[{tag}] batch {args.batch}: {bn['tok_s']:.0f} tok/s; host "
                      f"{bn['host_ms']:.2f} ms per round, device {bn['device_ms']:.2f} ms, "
                      f"idle {bn['bubble']:.1%}")
                part[key] = {"batch1": b1, "batchN": bn}
        finally:
            loaded.close()
        if weights == "quantized":
            row.update(part)  # the quantized figures at the top level, bf16 beside them
        else:
            row["bf16"] = part
    q1, b1 = row["graphs"]["batch1"]["tok_s"], row["bf16"]["graphs"]["batch1"]["tok_s"]
    row["batch1_quantized_over_bf16"] = q1 / b1 if b1 > 0 else 0.0
    print(f"batch 1 with graphs: quantized {q1:.1f} tok/s, bf16 {b1:.1f} tok/s "
          f"({row['batch1_quantized_over_bf16']:.2f}x)")
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="qwen3-0.6b,llama-3.2-1b,llama-3.1-8b")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--output", type=int, default=256)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--memory-fraction", type=float,
                    default=DispatchSettings.memory_fraction,
                    help="the KV pool's share of the GPU memory left after the weights")
    ap.add_argument("--copy-mib", type=int, default=1024, help="size of the timed copy")
    ap.add_argument("--weight-type", default="q4_k_m", choices=list(WEIGHT_TYPES),
                    help="the synthetic file's block type (default q4_k_m); 'tiny' needs a "
                         "32-value type (q8_0, q5_0, q4_0)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    try:
        from eagerlm.vmm.cuda_driver import NoCudaDevice, device_count

        device_count()
    except NoCudaDevice as exc:
        print(f"bench_gpu_decode: no GPU here ({exc}); nothing measured")
        return
    results = []
    for shape in args.shapes.split(","):
        folder = Path(tempfile.mkdtemp(prefix="eagerlm-decode-"))
        try:
            results.append(measure_shape(args, shape, folder))
        finally:
            shutil.rmtree(folder, ignore_errors=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
