"""Constrained sessions among unconstrained ones, eager dispatch (cpu backend, demo model).

The same batch runs twice: every request unconstrained, then half of them constrained to a
JSON schema that does not end within the run (an array of short strings), so both runs
produce the same number of tokens. All requests are submitted at once, greedy, EOS
ignored, `--gen-tokens` each. Reported per run: steady-decode output tokens/s (requests
over the median time of the rounds in which all of them decode: robust to the stalls of a
shared machine, which swamp whole-run rates), output tokens/s over the whole run, the
unconstrained requests' tokens/s alone (what the constrained ones must not slow), and
from the rounds' traces the time constrained rows' sampling waited for the host's masks
(`RoundTrace.mask_wait`: in eager mode the host advances the grammar with token t while
the round after t runs its forward, so this is the part it did not hide).

The physical limit is the unconstrained run itself: constraining adds a mask per row (a
few hundred microseconds on the host, the -inf fill on the device) and should cost
little more.

Each run starts a fresh dispatcher (no prefix cache carried over); after one warm-up run,
`--repeats` pairs alternate which configuration goes first, and medians are reported.

Run: `python benchmarks/bench_constrained.py [--model PATH] [--requests 8] [--gen-tokens 32]
[--repeats 3] [--out results.json]`
"""

from __future__ import annotations

import argparse
import json
import queue
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eagerlm.dispatch.control_thread import ControlConfig
from eagerlm.dispatch.dispatcher import Dispatcher, DispatcherConfig
from eagerlm.dispatch.scheduler import SchedulerConfig
from eagerlm.kernels.cpu_backend import cpu_transformer
from eagerlm.kernels.sampling import Constraint, SamplingParams
from eagerlm.loader.demo_model import demo_model_path
from eagerlm.loader.model_file import ModelFile
from eagerlm.vmm.device import open_device

# long enough to outlast the run: the constrained requests make as many tokens as the rest
SCHEMA = {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 1000}


def run(tf, tok, prompts, gen_tokens: int, constrain_every: int, sync: bool) -> dict:
    cfg = DispatcherConfig(control=ControlConfig(
        SchedulerConfig(max_batch=len(prompts), max_round_tokens=512), sync=sync))
    free = SamplingParams(temperature=0.0, max_tokens=gen_tokens, ignore_eos=True)
    bound = SamplingParams(temperature=0.0, max_tokens=gen_tokens, ignore_eos=True,
                           constraint=Constraint.json_schema(SCHEMA))
    with Dispatcher(open_device("cpu"), tf, tok, cfg) as d:
        d.grammars.ll_tokenizer()  # built once per dispatcher; not part of the run
        q: queue.Queue = queue.Queue()
        t0 = time.perf_counter()
        for i, p in enumerate(prompts):
            constrained = constrain_every > 0 and i % constrain_every == 0
            d.submit(p, bound if constrained else free,
                     lambda o, i=i: q.put((i, time.perf_counter(), o)))
        n_tokens = [0] * len(prompts)
        last = [t0] * len(prompts)
        done = 0
        while done < len(prompts):
            i, t, out = q.get()
            n_tokens[i] += len(out.token_ids)
            last[i] = t
            done += out.finish_reason is not None
        wall = time.perf_counter() - t0
        traces = list(d.traces)
    # the requests unconstrained in both configurations (odd indices), compared across them
    free_ids = [i for i in range(len(prompts)) if i % 2 == 1]
    free_wall = max(last[i] for i in free_ids) - t0
    waits = [tr.mask_wait for tr in traces if tr.n_constrained]
    # steady decode: the rounds in which every request decodes; their median time is
    # robust to the rare stalls of a shared 2-core machine (single rounds of tens of
    # seconds, in either configuration), which swamp whole-run rates
    full = [tr.device_start.elapsed_ms(tr.device_end) for tr in traces
            if tr.n_decode == len(prompts)]
    steady_ms = statistics.median(full) if full else float("nan")
    return {"tokens_per_s": sum(n_tokens) / wall,
            "steady_tokens_per_s": len(prompts) / steady_ms * 1e3,
            "steady_round_ms_median": steady_ms, "steady_rounds": len(full),
            "unconstrained_tokens_per_s": sum(n_tokens[i] for i in free_ids) / free_wall,
            "rounds": len(traces), "rounds_with_constrained_rows": len(waits),
            "mask_wait_total_ms": 1e3 * sum(waits),
            "mask_wait_max_ms": 1e3 * max(waits, default=0.0),
            "wall_s": wall,
            "round_ms": [round(tr.device_start.elapsed_ms(tr.device_end), 1) for tr in traces]}



def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--gen-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3,
                    help="pairs of runs, alternating which goes first (default 3)")
    ap.add_argument("--sync", action="store_true", help="synchronous dispatch instead")
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON")
    args = ap.parse_args()
    model = ModelFile.open(args.model or demo_model_path())
    tf = cpu_transformer(model)
    tok = model.tokenizer
    prompts = [tok.encode(f"Item {i}: list a few words as a JSON array.")
               for i in range(args.requests)]
    run(tf, tok, prompts, 4, 2, args.sync)  # warm-up: first-call costs, not measured
    runs: dict[str, list[dict]] = {"unconstrained": [], "half_constrained": []}
    for i in range(args.repeats):
        order = [("unconstrained", 0), ("half_constrained", 2)]
        for name, every in order if i % 2 == 0 else order[::-1]:  # no order bias
            runs[name].append(run(tf, tok, prompts, args.gen_tokens, every, args.sync))
    for name, rs in runs.items():
        med = {k: statistics.median(r[k] for r in rs) for k in
               ("tokens_per_s", "steady_tokens_per_s", "steady_round_ms_median",
                "unconstrained_tokens_per_s", "mask_wait_total_ms", "mask_wait_max_ms",
                "wall_s")}
        per_run = ", ".join(f"{r['tokens_per_s']:.1f}" for r in rs)
        print(f"{name:>17}: steady decode {med['steady_tokens_per_s']:6.1f} tok/s (round "
              f"{med['steady_round_ms_median']:.0f} ms), {med['tokens_per_s']:6.1f} tok/s "
              f"overall, odd (never constrained) requests "
              f"{med['unconstrained_tokens_per_s']:6.1f} tok/s, mask wait "
              f"{med['mask_wait_total_ms']:.2f} ms per run (max {med['mask_wait_max_ms']:.2f}"
              f" ms in a round), {med['wall_s']:.1f} s (medians of {len(rs)}; tok/s per "
              f"run: {per_run})")
    if args.out is not None:
        args.out.write_text(json.dumps(runs, indent=2))


if __name__ == "__main__":
    main()
