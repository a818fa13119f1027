"""Where a batch-1 decode step's time goes on the cpu backend, op by op.

The physical limit of a decode step is reading every weight once (bytes / copy bandwidth,
the roofline); what is not reading weights is overhead. This runs `--steps` decode steps
of one session after a `--prompt-tokens` prompt, op by op (the decode replay off:
benchmarks/bench_cpu_replay.py measures it), with every op of the forward timed (the
backend's methods wrapped: products by the matrices they read, attention, norms, the
activation, ...), and reports per op the minimum over the steps of its per-step total
(what it costs when nothing else on the machine gets in the way: this machine is shared,
and the medians carry the other work's noise) beside the median. Then:

- Python between the ops: the forward's time minus its ops';
- what is not reading weights: the same steps with every product replaced by an empty
  result of its shape (no kernel runs), so what remains is the forward's own cost;
- a product's fixed cost: `quantized_linear` of one row by a matrix of one block row,
  per type the file holds (the wrapper, the kernel's call and its threads' start);
- a parallel region's cost: an empty numba `prange` loop on the machine's cores against
  one thread (the wake-up of sleeping workers: numba_settings.py makes them sleep);
- the products' own rates: GB/s of each matrix's bytes at its minimum time.

Run: `python benchmarks/profile_cpu_decode.py --model FILE.gguf [--steps 32]
[--prompt-tokens 128]`.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numba
import numpy as np
from gguf import GGML_QUANT_SIZES

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_cpu_decode import copy_bandwidth_gb_s, prompt_ids
from eagerlm.kernels import numpy_ops
from eagerlm.kernels.batch import ForwardBatch
from eagerlm.kernels.cpu_backend import cpu_transformer
from eagerlm.kernels.cpu_threads import core_count
from eagerlm.kernels.model import Transformer
from eagerlm.kernels.quantized import QuantizedMatrix, quantized_linear
from eagerlm.loader.model_file import ModelFile
from eagerlm.vmm.kv_layout import ContiguousKV, KVLayout

OPS = tuple(name for name in numpy_ops.FORWARD_OPS if not name.startswith("_"))


class OpTimer:
    """Wraps the ops of a Transformer's backend (only its outermost calls count: an op
    that calls another is timed once) and keeps each step's per-op totals."""

    def __init__(self, tf: Transformer[np.ndarray]) -> None:
        self.steps: list[dict[str, float]] = []
        self.calls: collections.Counter[str] = collections.Counter()
        self._now: dict[str, float] = collections.defaultdict(float)
        self._depth = 0
        roles = {}
        for lw in tf.weights.layers:
            for name in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"):
                roles[id(getattr(lw, name))] = name
        roles[id(tf.weights.output)] = "lm_head"
        self.roles = roles
        for name in OPS:
            fn = getattr(tf.ops, name, None)
            if fn is not None:
                setattr(tf.ops, name, self._wrap(name, fn))
        # op by op: a replayed step (kernels/cpu_decode_program.py) calls no op to time
        # (benchmarks/bench_cpu_replay.py compares the two)
        tf.ops.replay = lambda transformer, batch: None  # type: ignore[method-assign]

    def _key(self, name: str, args: tuple[Any, ...]) -> str:
        if name == "linear":
            return f"product {self.roles.get(id(args[1]), '?')}"
        return name

    def _wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if self._depth:
                return fn(*args, **kwargs)
            self._depth += 1
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                key = self._key(name, args)
                self._now[key] += time.perf_counter() - t
                self.calls[key] += 1
                self._depth -= 1
        return timed

    def reset(self) -> None:
        self.steps.clear()
        self.calls.clear()
        self._now.clear()

    def end_step(self, total: float) -> None:
        self._now["(forward)"] = total
        self.steps.append(dict(self._now))
        self._now.clear()


@contextmanager
def empty_products() -> Iterator[None]:
    """Every product returns zeros of its shape at once: no kernel runs."""
    real = numpy_ops.quantized_linear
    numpy_ops.quantized_linear = lambda x, w: np.zeros((len(x), w.shape[0]), np.float32)
    try:
        yield
    finally:
        numpy_ops.quantized_linear = real


def decode_steps(tf: Transformer[np.ndarray], ids: list[int], steps: int,
                 timer: OpTimer | None = None) -> list[float]:
    cfg = tf.config
    kv = ContiguousKV(KVLayout(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim),
                      len(ids) + steps + 1)
    tf.forward(ForwardBatch.single(ids, 0, kv))
    if timer is not None:
        timer.reset()
    times = []
    for i in range(steps):
        t = time.perf_counter()
        tf.forward(ForwardBatch.single([ids[i % len(ids)]], len(ids) + i, kv))
        times.append(time.perf_counter() - t)
        if timer is not None:
            timer.end_step(times[-1])
    kv.free()
    return times


def tmin(fn: Callable[[], Any], n: int = 300) -> tuple[float, float]:
    """(minimum, median) seconds of `n` calls."""
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return min(ts), statistics.median(ts)


@numba.njit(parallel=True, cache=True)
def _empty_region(a: np.ndarray) -> None:
    for i in numba.prange(a.shape[0]):
        a[i] = i


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--copy-mib", type=int, default=512,
                    help="size of the copy that measures the bandwidth")
    args = ap.parse_args()

    model = ModelFile.open(args.model)
    tf = cpu_transformer(model)
    ids = prompt_ids(model, args.prompt_tokens)
    bw = copy_bandwidth_gb_s(args.copy_mib << 20)
    weights = sum(h.nbytes for h in tf.weights.handles())
    w = tf.weights
    if w.output is not w.token_embd:
        weights -= w.token_embd.nbytes - w.token_embd.nbytes // w.token_embd.shape[0]

    plain = decode_steps(tf, ids, args.steps)
    with empty_products():
        empty = decode_steps(tf, ids, args.steps)
    timer = OpTimer(tf)
    decode_steps(tf, ids, args.steps, timer)

    print(f"model {Path(args.model).name}: {weights / 1e6:.1f} MB read per step; copy "
          f"bandwidth {bw:.1f} GB/s: roofline {weights / bw / 1e6:.2f} ms per step")
    print(f"decode step: min {min(plain) * 1e3:.2f} ms, median "
          f"{statistics.median(plain) * 1e3:.2f} ms ({args.steps} steps after a "
          f"{args.prompt_tokens}-token prompt)")
    print(f"without the products (no kernel runs): min {min(empty) * 1e3:.2f} ms, median "
          f"{statistics.median(empty) * 1e3:.2f} ms: what is not reading weights\n")

    keys = sorted({k for s in timer.steps for k in s}, key=lambda k: -min(
        s.get(k, 0.0) for s in timer.steps))
    print("| op | ms per step, min over steps | median | calls per step | us per call (min) "
          "| GB/s at min |")
    print("|---|---|---|---|---|---|")
    by_role: dict[str, int] = collections.defaultdict(int)
    for lw in w.layers:
        for name in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"):
            m = getattr(lw, name)
            by_role[name] += m.nbytes if m is not None else 0  # (a mixture's layer: none)
    by_role["lm_head"] = w.output.nbytes
    op_min = 0.0
    for k in keys:
        per = [s.get(k, 0.0) for s in timer.steps]
        calls = timer.calls[k] / len(timer.steps)
        rate = ""
        if k.startswith("product "):
            n_bytes = sum(by_role.get(r, 0) for r in k.split(" ", 1)[1].split("+"))
            rate = f"{n_bytes / min(per) / 1e9:.1f}"
        if k != "(forward)":
            op_min += min(per)
        print(f"| {k} | {min(per) * 1e3:.3f} | {statistics.median(per) * 1e3:.3f} | "
              f"{calls:g} | {min(per) / max(calls, 1) * 1e6:.1f} | {rate} |")
    between = [s["(forward)"] - sum(v for k, v in s.items() if k != "(forward)")
               for s in timer.steps]
    print(f"| Python between the ops | {min(between) * 1e3:.3f} | "
          f"{statistics.median(between) * 1e3:.3f} | | | |")

    print("\nfixed cost of a product (one row by one block row), min / median us:")
    for qtype in sorted({h.qtype for h in w.handles() if isinstance(h, QuantizedMatrix)}):
        block, size = GGML_QUANT_SIZES[qtype]
        m = QuantizedMatrix(qtype, (1, block), np.zeros((1, size), np.uint8))
        x = np.zeros((1, block), np.float32)
        lo, med = tmin(lambda m=m, x=x: quantized_linear(x, m))
        print(f"  {qtype.name}: {lo * 1e6:.1f} / {med * 1e6:.1f}")
    a = np.zeros(64, np.float64)
    cores = min(core_count(), numba.config.NUMBA_NUM_THREADS)
    _empty_region(a)
    for n in (cores, 1):
        numba.set_num_threads(n)
        lo, med = tmin(lambda: _empty_region(a), 2000)
        print(f"empty parallel region on {n} thread(s), min / median us: "
              f"{lo * 1e6:.1f} / {med * 1e6:.1f}")
    numba.set_num_threads(cores)
    return 0


if __name__ == "__main__":
    sys.exit(main())
