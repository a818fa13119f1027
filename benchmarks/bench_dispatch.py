"""Eager vs sync dispatch: 32 concurrent requests on the demo model (cpu backend).

Every request gets the same kind of work (a prompt cut from the reference text, greedy,
`--gen-tokens` tokens with EOS ignored), all submitted at once. Reported per mode:
output tokens/s over the whole run, inter-token latency p50/p90/p99 (gaps between a
request's successive tokens as the user sees them), time to first token p50, and the
device busy fraction (sum of the rounds' compute time, from their events, over the wall
time), which is what eagerness is for: in sync mode the device idles while the host
looks at tokens.

Run: `python benchmarks/bench_dispatch.py [--model PATH] [--requests 32] [--gen-tokens 32]`
"""

from __future__ import annotations

import argparse
import json
import queue
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eagerlm.dispatch.control_thread import ControlConfig
from eagerlm.dispatch.dispatcher import Dispatcher, DispatcherConfig
from eagerlm.dispatch.scheduler import SchedulerConfig
from eagerlm.kernels.cpu_backend import cpu_transformer
from eagerlm.kernels.sampling import SamplingParams
from eagerlm.loader.demo_model import demo_model_path
from eagerlm.loader.model_file import ModelFile
from eagerlm.vmm.device import open_device

TEXT = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "reference_text.txt"


def run(tf, tok, prompts, gen_tokens: int, sync: bool, max_batch: int) -> dict[str, float]:
    cfg = DispatcherConfig(control=ControlConfig(
        SchedulerConfig(max_batch=max_batch, max_round_tokens=512), sync=sync))
    params = SamplingParams(temperature=0.0, max_tokens=gen_tokens, ignore_eos=True)
    with Dispatcher(open_device("cpu"), tf, tok, cfg) as d:
        q: queue.Queue = queue.Queue()
        t0 = time.perf_counter()
        for i, p in enumerate(prompts):
            d.submit(p, params, lambda o, i=i: q.put((i, time.perf_counter(), o)))
        stamps: dict[int, list[float]] = {i: [] for i in range(len(prompts))}
        done = 0
        while done < len(prompts):
            i, t, out = q.get()
            stamps[i].extend([t] * len(out.token_ids))
            done += out.finish_reason is not None
        wall = time.perf_counter() - t0
        traces = list(d.traces)
    busy = sum(tr.device_start.elapsed_ms(tr.device_end) for tr in traces) / 1e3
    itl = np.concatenate([np.diff(s) for s in stamps.values()]) * 1e3
    ttft = np.array([s[0] - t0 for s in stamps.values()]) * 1e3
    n_out = sum(len(s) for s in stamps.values())
    return {"tokens_per_s": n_out / wall, "itl_p50_ms": float(np.percentile(itl, 50)),
            "itl_p90_ms": float(np.percentile(itl, 90)),
            "itl_p99_ms": float(np.percentile(itl, 99)),
            "ttft_p50_ms": float(np.percentile(ttft, 50)), "device_busy": busy / wall,
            "rounds": len(traces), "wall_s": wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--gen-tokens", type=int, default=32)
    args = ap.parse_args()
    model = ModelFile.open(args.model or demo_model_path())
    tf = cpu_transformer(model)
    ids = model.tokenizer.encode(TEXT.read_text(encoding="utf-8"))
    step = (len(ids) - args.prompt_tokens) // args.requests
    prompts = [ids[i * step:i * step + args.prompt_tokens] for i in range(args.requests)]
    # warm-up: first-touch page faults of weights and KV pages are not charged to a mode
    run(tf, model.tokenizer, prompts[:4], 4, False, max_batch=args.requests)
    results = {}
    for mode in ("eager", "sync"):
        results[mode] = run(tf, model.tokenizer, prompts, args.gen_tokens, mode == "sync",
                            max_batch=args.requests)
    print(f"{args.requests} concurrent requests, {args.prompt_tokens} prompt + "
          f"{args.gen_tokens} generated tokens each, greedy, cpu backend")
    print("| mode | output tok/s | ITL p50 ms | ITL p90 ms | ITL p99 ms | TTFT p50 ms | "
          "device busy |")
    print("|---|---|---|---|---|---|---|")
    for mode, r in results.items():
        print(f"| {mode} | {r['tokens_per_s']:.1f} | {r['itl_p50_ms']:.1f} | "
              f"{r['itl_p90_ms']:.1f} | {r['itl_p99_ms']:.1f} | {r['ttft_p50_ms']:.0f} | "
              f"{r['device_busy']:.0%} |")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
