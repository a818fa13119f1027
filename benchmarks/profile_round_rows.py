"""What a speculative round of R rows costs against a round of one row, on the cpu backend.

A speculating session's round is one forward of k + 1 rows with every row's logits (each
row is sampled); prompt lookup pays when the tokens a round yields beat that cost. The
adaptive plan (dispatch/speculation.py) decides draft rows by `RoundBackend.round_cost`;
this measures the real ratio: one session after a `--past`-token prompt, a forward of R
rows (all logits) for each R in `--rows`, interleaved over R (ABBA), `--repeats` times;
per R the minimum and the median of wall time and of this process's CPU time (on a
shared machine wall time also counts waits for a core), each against R = 1, beside
`round_cost(R)`.

Run: `python benchmarks/profile_round_rows.py [--model PATH] [--rows 1,2,4,5,8,9,12,16]
[--repeats 8] [--past 300]`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eagerlm.kernels.batch import ForwardBatch
from eagerlm.kernels.cpu_backend import cpu_transformer
from eagerlm.loader.demo_model import demo_model_path
from eagerlm.loader.model_file import ModelFile
from eagerlm.vmm.kv_layout import ContiguousKV, KVLayout


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="GGUF (default: the demo model)")
    ap.add_argument("--rows", default="1,2,4,5,8,9,12,16")
    ap.add_argument("--repeats", type=int, default=8)
    ap.add_argument("--past", type=int, default=300, help="tokens already in the KV")
    args = ap.parse_args()
    rows = sorted({1, *(int(x) for x in args.rows.split(","))})

    model = ModelFile.open(args.model or demo_model_path())
    tf = cpu_transformer(model)
    cfg = model.config
    kv = ContiguousKV(KVLayout(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim),
                      args.past + max(rows))
    ids = np.arange(1000, 1000 + max(args.past, max(rows)), dtype=np.int32)
    tf.forward(ForwardBatch.single(ids[:args.past], 0, kv))

    def forward(r: int) -> None:  # every row's logits, as a speculative round samples each
        tf.forward(ForwardBatch.single(ids[:r], args.past, kv, np.arange(r)))

    for r in rows:  # compiles, first allocations
        forward(r)
    wall: dict[int, list[float]] = {r: [] for r in rows}
    cpu: dict[int, list[float]] = {r: [] for r in rows}
    for rep in range(args.repeats):
        for r in rows if rep % 2 == 0 else rows[::-1]:
            t, c = time.perf_counter(), time.process_time()
            forward(r)
            wall[r].append(time.perf_counter() - t)
            cpu[r].append(time.process_time() - c)

    print(f"{Path(model.path).name}, {args.past} tokens past, {args.repeats} repeats")
    print(f"{'rows':>5}{'wall min ms':>13}{'x 1 row':>9}{'wall med ms':>13}{'x 1 row':>9}"
          f"{'CPU min ms':>12}{'x 1 row':>9}{'CPU med ms':>12}{'x 1 row':>9}"
          f"{'round_cost':>12}")
    stats = {name: {r: (min(v), statistics.median(v)) for r, v in d.items()}
             for name, d in (("wall", wall), ("cpu", cpu))}
    for r in rows:
        line = f"{r:5d}"
        for name in ("wall", "cpu"):
            (lo, med), (lo1, med1) = stats[name][r], stats[name][1]
            line += f"{lo * 1e3:13.1f}{lo / lo1:9.2f}{med * 1e3:13.1f}{med / med1:9.2f}"
        print(line + f"{tf.ops.round_cost(r):12.2f}")


if __name__ == "__main__":
    main()
