"""Tensor parallelism on the cpu backend: a model over 2 cpu devices of one core each
beside the same model on one device of every core, in the same run.

Measured per configuration (kernels/tensor_parallel.py's sequential loop, no dispatcher:
its per-device control threads are phase 2 of the work, docs/tensor_parallel.md):

- decode tokens/s at batch 1 and at batch 8 (8 sessions decoded in one batch), greedy, after
  a prompt of `--prompt-tokens` per session;
- per device: the share of the decode time spent in its collectives, split into waiting
  for the other device to arrive (the bubble: their imbalance) and the rest (the
  all-reduce's sum; the gather's copy and second barrier), from
  kernels/host_collective.py's `CollectiveStats`;
- the lm head split by vocabulary (the default) and kept whole on every device (the
  other arm of loader/sharding.py's choice).

Physical limit: batch-1 decode reads every weight once per token, so tokens/s is bounded
by memory bandwidth / bytes read per token (measured here: a numpy copy of 512 MiB, read
and write counted); two devices of one core each share the machine's bandwidth, so tp 2
cannot beat tp 1 on it: what it can show on one machine is what the collectives cost.
No peer: llama.cpp's cpu backend has no tensor parallelism (its batch-1 figure on this
model is benchmarks/bench_cpu_decode.py's).

Configurations alternate (tp1, tp2, tp2-whole-head, tp2-whole-head, tp2, tp1, ...) for
`--repeats` rounds; medians and ranges are printed. The machine may be shared: say so.

Run: `python benchmarks/bench_tensor_parallel.py [--model demo|llama-1b|PATH] [--repeats 2]`.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gguf import GGMLQuantizationType as Q

from benchmarks.bench_cpu_decode import tensor_bytes
from eagerlm.kernels.batch import ForwardBatch, SeqSlice
from eagerlm.kernels.host_collective import CollectiveStats
from eagerlm.kernels.tensor_parallel import cpu_group
from eagerlm.loader.model_file import ModelFile
from eagerlm.vmm.kv_layout import ContiguousKV


def model_path(name: str, tmp: Path) -> str:
    if name == "demo":
        from eagerlm.loader.demo_model import demo_model_path

        return demo_model_path()
    if name == "llama-1b":  # Llama 3.2 1B's shape, its matrices Q4_K as a Q4_K_M file's
        from eagerlm.loader.synthetic import SHAPES, write_synthetic_model

        spec = dataclasses.replace(SHAPES["llama-3.2-1b"], weight_type=Q.Q4_K,
                                   embedding_type=Q.Q6_K)
        return str(write_synthetic_model(tmp / "llama-1b-q4k.gguf", spec))
    return name


def bandwidth() -> float:
    a = np.ones(64 << 20, np.float64)
    b = np.empty_like(a)
    best = min(_timed(lambda: np.copyto(b, a)) for _ in range(5))
    return 2 * a.nbytes / best


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def decode(group, batch: int, prompt: int, steps: int) -> dict:
    """Tokens/s of `steps` decode rounds of `batch` sessions, and each device's
    collective share of that time."""
    rng = np.random.default_rng(0)
    vocab = group.config.vocab_size
    cap = prompt + steps + 1
    kvs = [[ContiguousKV(group.kv_layout(r), cap) for _ in range(batch)]
           for r in range(group.size)]
    for s in range(batch):  # prompts, one session at a time
        ids = rng.integers(0, vocab, prompt).astype(np.int32)
        group.forward([ForwardBatch.single(ids, 0, kvs[r][s]) for r in range(group.size)])
    tokens = rng.integers(0, vocab, batch).astype(np.int32)
    def stats() -> list[CollectiveStats | None]:  # (snapshots)
        return [tf.ops.collective.stats if tf.ops.collective else None
                for tf in group.transformers]
    before = stats()
    t0 = time.perf_counter()
    for step in range(steps):
        batches = [ForwardBatch(tokens, [SeqSlice(i, 1, prompt + step, kvs[r][i])
                                         for i in range(batch)], np.arange(batch))
                   for r in range(group.size)]
        logits = group.forward(batches)
        tokens = logits.argmax(axis=1).astype(np.int32)
    dt = time.perf_counter() - t0
    out = {"tok_s": batch * steps / dt, "devices": []}
    for s, b in zip(stats(), before, strict=True):
        if s is not None and b is not None:
            out["devices"].append({"calls": (s.calls - b.calls) / steps,
                                   "wait": (s.wait_s - b.wait_s) / dt,
                                   "work": (s.work_s - b.work_s) / dt})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="demo")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--steps", type=int, default=24)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = model_path(args.model, Path(tmp))
        model = ModelFile.open(path)
        weight_bytes = tensor_bytes(path)[1]  # read per decode token (experts: k of n)
        bw = bandwidth()
        configs = {"tp1": dict(size=1), "tp2": dict(size=2),
                   "tp2-whole-head": dict(size=2, split_lm_head=False)}
        order = list(configs) + list(configs)[::-1]
        results: dict[tuple[str, int], list[dict]] = {}
        for _ in range(args.repeats):
            for name in order[:len(configs)] if _ % 2 == 0 else order[len(configs):]:
                group = cpu_group(model, **configs[name])
                try:
                    for batch in (1, 8):
                        results.setdefault((name, batch), []).append(
                            decode(group, batch, args.prompt_tokens, args.steps))
                finally:
                    group.close()
        print(f"model {args.model}: {weight_bytes / 1e6:.0f} MB read per token; copy bandwidth "
              f"{bw / 1e9:.1f} GB/s, batch-1 roofline {bw / weight_bytes:.1f} tok/s")
        for (name, batch), runs in results.items():
            tok = [r["tok_s"] for r in runs]
            line = (f"{name:15s} batch {batch}: {statistics.median(tok):7.2f} tok/s "
                    f"(range {min(tok):.2f}-{max(tok):.2f})")
            if batch == 1:
                line += f", {statistics.median(tok) * weight_bytes / bw:.0%} of the roofline"
            for d in range(len(runs[0]["devices"])):
                wait = statistics.median(r["devices"][d]["wait"] for r in runs)
                work = statistics.median(r["devices"][d]["work"] for r in runs)
                calls = runs[0]["devices"][d]["calls"]
                line += (f"; device {d}: {calls:.0f} collectives/step, bubble {wait:.1%}, "
                         f"collective work {work:.1%}")
            print(line)


if __name__ == "__main__":
    main()
