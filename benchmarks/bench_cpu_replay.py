"""The cpu backend's decode replay (kernels/cpu_decode_program.py) against the same forward
run op by op, on one file: batch-1 (or `--rows` sessions) decode steps, alternating.

Both paths run on copies of the same caches from the same prompt, in blocks of `--block`
steps, ABBA (replay, ops, ops, replay, ...), so that a shared machine's load falls on
both alike; each step's wall time and process CPU time (every thread's, `time.process_time`)
are kept, and their medians reported per path. The physical limit is reading the weights
once per step (llama.cpp's bytes per token over the copy bandwidth measured in the run:
the roofline), and the peer is llama.cpp's greedy decode of the same file on
`--threads` threads (llama-cpp-python; `--no-peer` without it).

Run: `python benchmarks/bench_cpu_replay.py --model FILE.gguf [--blocks 8 --block 8]`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_cpu_decode import copy_bandwidth_gb_s, tensor_bytes
from eagerlm.kernels import cpu_decode_program
from eagerlm.kernels.batch import ForwardBatch, SeqSlice
from eagerlm.kernels.cpu_backend import cpu_transformer
from eagerlm.loader.model_file import ModelFile
from eagerlm.vmm.kv_layout import KVLayout, TokenMajorKV


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--rows", type=int, default=1, help="sessions decoding together")
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--blocks", type=int, default=8, help="blocks per path")
    ap.add_argument("--block", type=int, default=8, help="decode steps per block")
    ap.add_argument("--threads", type=int, default=2, help="llama.cpp threads")
    ap.add_argument("--no-peer", action="store_true")
    args = ap.parse_args()

    model = ModelFile.open(args.model)
    tf = cpu_transformer(model)
    cpu_decode_program.TABLE_READY.wait()  # on a cold cache compiled after the load
    cfg = tf.config
    layout = KVLayout(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim)
    capacity = args.prompt_tokens + args.blocks * args.block * 2 + 8
    rng = np.random.default_rng(0)
    prompt = rng.integers(10, cfg.vocab_size, args.prompt_tokens).astype(np.int32)
    caches: dict[str, list[TokenMajorKV]] = {"replay": [], "ops": []}
    for _ in range(args.rows):
        for kind in caches:
            kv = TokenMajorKV(np.zeros((capacity, *layout.token_shape), np.float32))
            tf.forward(ForwardBatch.single(prompt, 0, kv))
            caches[kind].append(kv)
    position = {kind: args.prompt_tokens for kind in caches}
    token = {kind: np.full(args.rows, 11, np.int32) for kind in caches}
    times: dict[str, list[tuple[float, float]]] = {kind: [] for kind in caches}

    def step(kind: str) -> tuple[float, float]:
        p = position[kind]
        batch = ForwardBatch(token[kind], [SeqSlice(i, 1, p, kv) for i, kv in
                                           enumerate(caches[kind])], np.arange(args.rows))
        w0, c0 = time.perf_counter(), time.process_time()
        logits = tf.forward(batch) if kind == "replay" else tf.run(batch, tf.ops)
        w1, c1 = time.perf_counter(), time.process_time()
        token[kind] = logits.argmax(axis=1).astype(np.int32)
        position[kind] = p + 1
        return w1 - w0, c1 - c0

    step("replay")  # records the table (and compiles what it calls); not timed
    step("ops")
    order = ["replay", "ops", "ops", "replay"]
    for b in range(args.blocks * 2):
        kind = order[b % 4]
        times[kind] += [step(kind) for _ in range(args.block)]
    same = all(np.array_equal(a.data, b.data) for a, b in
               zip(caches["replay"], caches["ops"], strict=True))

    _, read = tensor_bytes(args.model)
    bandwidth = copy_bandwidth_gb_s()
    roofline_ms = read / bandwidth / 1e6
    print(f"{Path(args.model).name}: {cfg.n_layers} layers, {read / 1e6:.0f} MB read per "
          f"token; copy bandwidth {bandwidth:.1f} GB/s -> roofline {roofline_ms:.2f} ms/step")
    print(f"{args.rows} row(s), {len(times['ops'])} steps per path, ABBA blocks of {args.block}")
    for kind, values in times.items():
        wall = statistics.median(v[0] for v in values) * 1e3
        cpu = statistics.median(v[1] for v in values) * 1e3
        print(f"  {kind:>6}: wall {wall:6.2f} ms (min {min(v[0] for v in values) * 1e3:6.2f}), "
              f"cpu {cpu:6.2f} ms per step; roofline / wall {roofline_ms / wall:.0%}")
    print(f"  caches after both paths' steps identical: {same}")
    if not args.no_peer:
        from benchmarks.llama_cpp_peer import measure_llama_cpp

        res = measure_llama_cpp(args.model, args.prompt_tokens, args.blocks * args.block,
                                args.threads)
        ms = 1e3 / res["decode_tok_s"]
        print(f"  llama.cpp ({args.threads} threads): {ms:.2f} ms per step (batch 1); "
              f"roofline / wall {roofline_ms / ms:.0%}")


if __name__ == "__main__":
    main()
