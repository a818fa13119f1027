"""GPU decode speed beside the memory-bandwidth limit, with and without CUDA graphs.

For each synthetic bf16 model of a real shape (random weights, written on the fly):
- the physical limit: the measured device-to-device copy bandwidth (a copy reads and writes
  each byte, so bandwidth = 2 x bytes / time), and the bytes one decode step must read:
  every weight matrix once (the embedding table only when it is also the lm head) plus the
  KV cache of the context;
- batch-1 decode through the engine (one request, greedy, EOS ignored): tokens/s over the
  steady decode, and the fraction of the roofline (tokens/s x bytes per token / bandwidth);
- batch-64 decode: output tokens/s with 64 concurrent requests;
- per round, from the dispatcher's instrumentation: host time (plan + launch) and the
  device idle fraction between rounds in steady decode, with graphs and without.

Targets (issue 6): >= 85% of the roofline at batch 1 on the 8B shape. HF transformers on
the same shapes: benchmarks/peer_transformers.py, run in the same session by
.ci/gpu_check.sh.

Run (GPU machine): python benchmarks/bench_gpu_decode.py [--shapes qwen3-0.6b,...]
[--prompt 128 --output 256] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.gpu_timing import copy_bandwidth
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
    w = loaded.transformer.weights
    total = sum(t.nbytes for t in w.handles() if t is not w.token_embd or t is w.output)
    cfg = loaded.model.config
    kv = context * cfg.n_layers * 2 * cfg.n_kv_heads * cfg.head_dim * 2
    return total + kv


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
        t0 = time.perf_counter()
        loaded = open_measured_model(None, shape, min_context=args.prompt + args.output + 16,
                            device="cuda")
        print(f"\n== {shape}: loaded in {time.perf_counter() - t0:.1f} s on "
              f"{loaded.device.name}")
        try:
            stream = loaded.device.stream("bandwidth")
            try:
                bw = copy_bandwidth(loaded.device, stream, args.copy_mib << 20)
            finally:
                stream.close()
            per_tok = bytes_per_token(loaded, args.prompt + args.output // 2)
            limit = bw / per_tok
            print(f"device copy bandwidth {bw / 1e9:.0f} GB/s; {per_tok / 1e9:.3f} GB read "
                  f"per token -> roofline {limit:.0f} tok/s at batch 1")
            row = {"shape": shape, "bandwidth_gbs": bw / 1e9, "roofline_tok_s": limit}
            for graphs in (True, False):
                settings = DispatchSettings(device="cuda", max_batch=max(64, args.batch),
                                            memory_fraction=args.memory_fraction,
                                            cuda_graphs=graphs)
                b1 = decode_run(loaded, settings, 1, args.prompt, args.output)
                bn = decode_run(loaded, settings, args.batch, args.prompt, args.output)
                tag = "graphs" if graphs else "eager launches"
                print(f"[{tag}] batch 1: {b1['tok_s']:.1f} tok/s = "
                      f"{b1['tok_s'] / limit:.1%} of roofline; host {b1['host_ms']:.2f} ms "
                      f"per round, device {b1['device_ms']:.2f} ms, idle {b1['bubble']:.1%}")
                print(f"[{tag}] batch {args.batch}: {bn['tok_s']:.0f} tok/s; host "
                      f"{bn['host_ms']:.2f} ms per round, device {bn['device_ms']:.2f} ms, "
                      f"idle {bn['bubble']:.1%}")
                row["graphs" if graphs else "eager"] = {"batch1": b1, "batchN": bn}
            results.append(row)
        finally:
            loaded.close()
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
