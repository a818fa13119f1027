"""Mixture-of-experts models on the cpu backend beside llama.cpp: load, batch-1 decode,
batched decode, peak RSS, on real MoE shapes.

The model is a synthetic file of a real shape (loader/synthetic.py's SHAPES):
`qwen3-30b-a3b` (Qwen3-30B-A3B as a Q4_K_M file holds it, about 17 GB) or `gpt-oss-20b`
(MXFP4 experts, about 12 GB); `--layers N` keeps the shape but only N layers, for a quick
run on small memory. The file is written once (`--path`; reused if it exists with the
recorded spec) and both engines read the same file.

Each engine runs in its own subprocess, one after the other (eagerlm, llama.cpp, and
again with `--repeats`), so that each one's peak RSS is its own (read by a small launcher
with getrusage, as benchmarks/bench_cpu_decode.py does) and neither holds memory while the
other runs; the page cache is shared, so the file's pages read by one are warm for the
next. Measured:

- load s (eagerlm: open + weights + kernels; the experts are mapped from the file, not
  read, so the first tokens fault them in: llama.cpp mmaps the file the same way);
- prompt tok/s: one prefill of `--prompt-tokens` tokens;
- decode tok/s at batch 1: `--gen-tokens` greedy steps after it;
- batched decode: `--batch` requests of `--prompt-tokens` prompt and `--gen-tokens`
  output tokens submitted at once (eagerlm's dispatcher; llama.cpp's parallel decoding
  with as many sequences, benchmarks/llama_cpp_batched.py), output tok/s;
- peak RSS of each subprocess.

The physical limit of batch-1 decode is memory bandwidth over the bytes a token reads:
every weight outside the experts once (the token embedding one row), and per layer the
router and the k experts it picks of n (three matrices each): the active bytes, which
for Qwen3-30B-A3B are about a tenth of the file. The machine's copy bandwidth is measured
(numpy copy of 512 MiB, read + write) and the roofline tok/s and achieved fraction
printed; the same bytes for both engines, since both read the file's blocks. Where the
file does not fit in the page cache beside everything else, tokens also wait for the
disk, which the roofline does not count.

Run: `python benchmarks/bench_moe.py --shape qwen3-30b-a3b [--layers 4] [--path FILE]
[--prompt-tokens 64] [--gen-tokens 32] [--batch 8] [--threads 2] [--repeats 1]
[--no-peer] [--peer-no-repack] [--json out.json]`. Needs about the file's size of free
memory for the page cache to keep it (the full shapes: run on a quiet machine; llama.cpp
with `--peer-no-repack`, as its CPU backend otherwise holds a second, repacked copy of most
of the weights).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_cpu_decode import (
    _child_env,
    copy_bandwidth_gb_s,
    run_child,
    tensor_bytes,
)
from eagerlm.loader.model_file import ModelFile
from eagerlm.loader.synthetic import SHAPES, write_synthetic_model

# what each engine's subprocess runs: argv = path, prompt tokens, gen tokens, batch, threads
_EAGERLM = """
import json, sys, time
from benchmarks.bench_cpu_decode import measure_eagerlm
from eagerlm.service.measure.bench import bench_offline
from eagerlm.service.measure.harness import DispatchSettings, open_measured_model
from eagerlm.service.measure.workload import LengthRange, WorkloadSpec
path, p, g, batch = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
out = measure_eagerlm(path, p, g, "quantized")
loaded = open_measured_model(path, None)
spec = WorkloadSpec(batch, LengthRange(p, p), LengthRange(g, g), seed=0)
s = bench_offline(loaded, spec, DispatchSettings(max_batch=batch, max_round_tokens=512)).summary
out["batch_tok_s"] = s.output_tok_s
loaded.close()
print(json.dumps(out))
"""
_LLAMA_CPP = """
import json, sys
import numpy as np
from benchmarks.llama_cpp_batched import run_llama_cpp_workload
from benchmarks.llama_cpp_peer import measure_llama_cpp
path, p, g, batch, threads = (sys.argv[1], int(sys.argv[2]), int(sys.argv[3]),
                              int(sys.argv[4]), int(sys.argv[5]))
repack = sys.argv[6] == "repack"
out = measure_llama_cpp(path, p, g, threads, repack=repack)
rng = np.random.default_rng(0)
from eagerlm.loader.model_file import ModelFile
vocab = ModelFile.open(path).tokenizer.vocab_size
pairs = [(rng.integers(10, vocab, p).tolist(), g) for _ in range(batch)]
out["batch_tok_s"] = run_llama_cpp_workload(path, pairs, n_parallel=batch,
                                            n_threads=threads, repack=repack)["output_tok_s"]
print(json.dumps(out))
"""


def active_bytes(path: str) -> tuple[int, int, int]:
    """(bytes of the file's tensors, of them a decode token reads: `tensor_bytes`, of
    them experts)."""
    total, read = tensor_bytes(path)
    model = ModelFile.open(path)
    experts = sum(t.n_bytes for t in model.gguf.tensors.values() if len(t.shape) == 3)
    model.close()
    return total, read, experts


def model_file(shape: str, layers: int | None, path: str | None) -> str:
    """The synthetic file of `shape` (with `layers` layers), written unless it exists with
    the spec recorded beside it."""
    spec = SHAPES[shape]
    if layers is not None:
        spec = dataclasses.replace(spec, n_layers=layers)
    file = Path(path or f"/tmp/eagerlm-{shape}{f'-{layers}l' if layers else ''}.gguf")
    stamp = file.with_suffix(".spec")
    if file.exists() and stamp.exists() and stamp.read_text() == repr(spec):
        return str(file)
    t0 = time.perf_counter()
    write_synthetic_model(file, spec)
    stamp.write_text(repr(spec))
    print(f"wrote {file} ({file.stat().st_size / 1e9:.2f} GB) in "
          f"{time.perf_counter() - t0:.0f} s", file=sys.stderr)
    return str(file)


def run_engine(code: str, path: str, args: argparse.Namespace) -> dict[str, float]:
    cmd = [sys.executable, "-c", code, path, str(args.prompt_tokens), str(args.gen_tokens),
           str(args.batch), str(args.threads), "no-repack" if args.peer_no_repack else "repack"]
    out, rss = run_child(cmd, _child_env())
    result = json.loads(out.strip().splitlines()[-1])
    result["peak_rss"] = rss
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen3-30b-a3b",
                    choices=[n for n, s in SHAPES.items() if s.n_experts])
    ap.add_argument("--layers", type=int, default=None, help="keep only this many layers")
    ap.add_argument("--path", default=None, help="where the synthetic file is (written once)")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--gen-tokens", type=int, default=32)
    ap.add_argument("--batch", type=int, default=8, help="requests decoded together")
    ap.add_argument("--threads", type=int, default=2, help="llama.cpp threads")
    ap.add_argument("--repeats", type=int, default=1,
                    help="runs of each engine, alternating; median and range reported")
    ap.add_argument("--no-peer", action="store_true", help="skip llama.cpp")
    ap.add_argument("--peer-no-repack", action="store_true",
                    help="llama.cpp as its --no-repack: no second, interleaved copy of the "
                         "weights (which a file near the machine's memory has no room for)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()

    path = model_file(args.shape, args.layers, args.path)
    total, read, experts = active_bytes(path)
    engines = {"eagerlm": _EAGERLM} if args.no_peer else \
        {"eagerlm": _EAGERLM, "llama.cpp": _LLAMA_CPP}
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in engines}
    bandwidth = []
    for r in range(args.repeats):
        bandwidth.append(copy_bandwidth_gb_s())
        for name, code in engines.items():
            res = run_engine(code, path, args)
            runs[name].append(res)
            print(f"run {r + 1}/{args.repeats} {name}: " + ", ".join(
                f"{k} {v:.4g}" for k, v in res.items()), file=sys.stderr)

    bw = statistics.median(bandwidth)
    roof = bw * 1e9 / read
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.1f} GiB; "
          f"copy bandwidth {bw:.1f} GB/s (read+write)")
    print(f"model: {args.shape}{f' ({args.layers} layers)' if args.layers else ''}, "
          f"{total / 1e9:.2f} GB of tensors, {experts / 1e9:.2f} GB of them experts; a decode "
          f"token reads {read / 1e9:.3f} GB (active experts and the rest): roofline "
          f"{roof:.1f} tok/s")
    print(f"{args.prompt_tokens}-token prompt, {args.gen_tokens} decode steps, batch of "
          f"{args.batch}; {args.repeats} run(s), median (range)\n")
    print("| engine | load s | peak RSS GB | prompt tok/s | decode tok/s (batch 1) | "
          "of roofline | batched decode tok/s |")
    print("|---|---|---|---|---|---|---|")

    def cell(name: str, key: str, scale: float = 1.0, spec: str = ".1f") -> str:
        values = [r[key] * scale for r in runs[name]]
        med = statistics.median(values)
        if len(values) == 1:
            return format(med, spec)
        return f"{med:{spec}} ({min(values):{spec}}-{max(values):{spec}})"

    for name in engines:
        decode = statistics.median(r["decode_tok_s"] for r in runs[name])
        label = name
        if name == "llama.cpp":
            label = f"llama.cpp {args.threads} threads" + (", --no-repack"
                                                            if args.peer_no_repack else "")
        print(f"| {label} | {cell(name, 'load_s')} | {cell(name, 'peak_rss', 1e-9, '.2f')} | "
              f"{cell(name, 'prompt_tok_s')} | {cell(name, 'decode_tok_s', spec='.2f')} | "
              f"{decode / roof:.0%} | {cell(name, 'batch_tok_s', spec='.2f')} |")
    if "llama.cpp" in runs:
        for key in ("decode_tok_s", "batch_tok_s", "prompt_tok_s"):
            ratios = [a[key] / b[key] for a, b in zip(runs["eagerlm"], runs["llama.cpp"],
                                                      strict=True)]
            print(f"eagerlm / llama.cpp {key}: {statistics.median(ratios):.2f}x "
                  f"(per run pair: {', '.join(f'{x:.2f}' for x in ratios)})")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "date": time.strftime("%Y-%m-%d"), "shape": args.shape, "layers": args.layers,
            "bandwidth_gb_s": bandwidth, "tensor_bytes": total, "read_bytes": read,
            "expert_bytes": experts, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
