"""Every GGUF weight type on the cpu backend, beside llama.cpp on the same file in the same run.

For each shape (`--shapes`: real models' tensor layouts from loader/synthetic.py's
`SHAPES`, random weights) a float16 base is written once by loader/synthetic.py, then for
each type (`--types`: llama.cpp's recipe names, benchmarks/llama_cpp_quantize.py) one GGUF
by llama.cpp's own quantizer (`llama_model_quantize`), as people download them. Per file,
eagerlm and llama.cpp (llama-cpp-python, `--threads` threads) alternate (ABBA over
`--repeats` passes), each measuring:

- batch-1 decode tokens/s: greedy single-token steps after a `--prompt-tokens` prompt;
- prompt tokens/s: the median of `--prompt-runs` (5) prefills of `--prompt-tokens` (128)
  tokens, each from an empty cache, after one not counted;
- output tokens/s at `--requests` (8) concurrent requests: eagerlm's dispatcher (eager,
  max batch 8, 512 tokens per round) against llama.cpp's parallel decoding of 8 sequences
  in a unified KV cache (benchmarks/llama_cpp_batched.py), the same prompts (32-64 random
  token ids, seed 0) and output lengths, greedy, EOS ignored;
- eagerlm's weights held (the bytes of its weight handles) against the file's size;
- the bandwidth roofline: the machine's copy bandwidth (numpy, read + write, measured
  before each pass; the most any copy of the run reached, as other work on a shared
  machine only lowers it, or `--bandwidth`) over the bytes a decode step must read (every
  tensor of the file, an untied embedding one row), and each engine's decode as a
  fraction of it.

Targets, printed per row: decode >= 1.0x llama.cpp, prompt >= 1.0x, 8 requests >= 1.0x,
weights held <= 1.1x the file; a row names the targets it misses.

Types whose products fall back to slow paths would take minutes per file at full length,
so eagerlm's first decode runs until `--decode-tokens` tokens or `--decode-seconds`,
whichever comes first, and both engines then decode that many tokens; the requests'
output length is cut the same way (`--batch-seconds`). A row says when it was cut.

Files go to `--scratch` (default: a folder in the system's temporary directory, outside
the repository); each type's file is deleted once measured unless `--keep`, and a file
already there is reused. The float16 base stays for the next run (`--drop-base` deletes
it). Shapes and their float16 bases: qwen1.5-0.5b 0.9 GB, llama-3.2-1b 2.5 GB,
llama-3.2-3b 6.4 GB, llama-3.1-8b 16 GB (run it last, with few types); a file whose
engines would need more than `--max-gib` of memory is skipped and says so.

Without llama.cpp (CI), `--quantizer synthetic --no-peer` writes each type's blocks with
loader/synthetic.py instead and measures eagerlm alone: the script's whole path, on the
`tiny` shape in seconds.

Run: `python benchmarks/bench_types.py [--shapes qwen1.5-0.5b,llama-3.2-1b] [--types
Q4_0,Q4_K_M | all] [--repeats 1] [--scratch DIR] [--keep] [--json out.json]`.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import hashlib
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType as Q

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_cpu_decode import copy_bandwidth_gb_s, prompt_ids, tensor_bytes
from benchmarks.llama_cpp_quantize import ALL_TYPES, RECIPES, Recipe, quantize
from eagerlm.kernels.batch import ForwardBatch
from eagerlm.kernels.cpu_compile import wait_for_later_kernels
from eagerlm.loader.errors import UnsupportedTensorType
from eagerlm.loader.model_file import ModelFile
from eagerlm.loader.synthetic import SHAPES, SyntheticSpec, tiny_spec, write_synthetic_model
from eagerlm.service.measure.bench import bench_offline
from eagerlm.service.measure.harness import DispatchSettings, open_measured_model
from eagerlm.service.measure.workload import LengthRange, WorkloadSpec, make_workload
from eagerlm.vmm.kv_layout import ContiguousKV, KVLayout

# A 2-layer llama whose rows are whole superblocks: the script's own check, in seconds
TINY = tiny_spec("llama", d_model=256, n_heads=4, n_kv_heads=2, head_dim=64, d_ff=512,
                 vocab_size=512, context_length=512)
ROUND_TOKENS = 512  # tokens per round for both engines (llama.cpp's default n_batch)
TARGETS = {"decode": 1.0, "prompt": 1.0, "batch": 1.0}  # eagerlm / llama.cpp, at least
HELD_TARGET = 1.1  # weights held / file size, at most


@dataclasses.dataclass
class Plan:
    """What both engines run on one file: decode steps, and the concurrent requests."""

    decode_tokens: int
    batch_output: int
    requests: list[tuple[list[int], int]]  # (prompt ids, output tokens)
    cut: bool = False  # shortened to fit the time budgets


def shape_spec(shape: str) -> SyntheticSpec:
    """The shape's float16 base: every matrix F16 (llama.cpp's quantizer reads it)."""
    spec = TINY if shape == "tiny" else SHAPES[shape]
    return dataclasses.replace(spec, weight_type=Q.F16, embedding_type=None,
                               output_type=None)


def _stamp(spec: SyntheticSpec) -> str:
    """Part of a file name that changes when the spec does (a stale file is not reused)."""
    return hashlib.sha256(repr(spec).encode()).hexdigest()[:8]


def base_file(scratch: Path, shape: str) -> Path:
    spec = shape_spec(shape)
    path = scratch / f"{shape}-{_stamp(spec)}-F16-base.gguf"
    if not path.exists():
        t = time.perf_counter()
        tmp = path.with_suffix(".partial")
        write_synthetic_model(tmp, spec)
        tmp.rename(path)
        log(f"{shape}: wrote the F16 base, {path.stat().st_size / 1e9:.2f} GB in "
            f"{time.perf_counter() - t:.0f} s")
    return path


def type_file(scratch: Path, shape: str, recipe: Recipe, quantizer: str,
              threads: int) -> tuple[Path, float]:
    """The shape's file in `recipe`, written now unless it is there; (path, seconds)."""
    spec = shape_spec(shape)
    path = scratch / f"{shape}-{_stamp(spec)}-{recipe.name}-{quantizer}.gguf"
    if path.exists():
        return path, 0.0
    t = time.perf_counter()
    tmp = path.with_suffix(".partial")
    if quantizer == "llama.cpp":
        quantize(base_file(scratch, shape), tmp, recipe, threads)
    else:
        write_synthetic_model(tmp, dataclasses.replace(spec, weight_type=recipe.qtype))
    tmp.rename(path)
    return path, time.perf_counter() - t


def log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


# -- one engine, one pass ---------------------------------------------------------------

def eagerlm_pass(path: Path, args: argparse.Namespace, plan: Plan | None,
                 make_plan: Any) -> tuple[dict[str, float], Plan]:
    """Load the file on the cpu backend and measure it; the first pass (no `plan` yet)
    decodes within the time budget and makes the plan: `make_plan(steps, tok/s)`."""
    t0 = time.perf_counter()
    loaded = open_measured_model(str(path), None)
    try:
        load_s = time.perf_counter() - t0
        # (on a cold cache the replay's table and the panels compile after the load)
        wait_for_later_kernels(600)
        tf, model = loaded.transformer, loaded.model
        held = sum(h.nbytes for h in tf.weights.handles())
        ids = prompt_ids(model, args.prompt_tokens)
        cfg = model.config
        layout = KVLayout(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim)
        # first-call allocations (the tiles of the many-rows path too) not charged to the
        # prompt: a short prompt past `gemv_rows`, then a decode step
        n_warm = min(len(ids) - 1, 32)
        warm = ContiguousKV(layout, n_warm + 1)
        tf.forward(ForwardBatch.single(ids[:n_warm], 0, warm))
        tf.forward(ForwardBatch.single(ids[n_warm:n_warm + 1], n_warm, warm))

        limit = plan.decode_tokens if plan else args.decode_tokens
        prompt_times = []
        for run in range(args.prompt_runs + 1):  # the first not counted: see llama_cpp_peer
            kv = ContiguousKV(layout, args.prompt_tokens + limit)
            t = time.perf_counter()
            logits = tf.forward(ForwardBatch.single(ids, 0, kv))
            prompt_times.append(time.perf_counter() - t)
            if run < args.prompt_runs:
                kv.free()
        prompt_s = float(np.median(prompt_times[1:]))
        token = int(np.argmax(logits[-1]))
        t = time.perf_counter()
        steps = 0
        while steps < limit:
            logits = tf.forward(ForwardBatch.single([token], args.prompt_tokens + steps, kv))
            token = int(np.argmax(logits[-1]))
            steps += 1
            if plan is None and time.perf_counter() - t > args.decode_seconds:
                break
        decode_tok_s = steps / (time.perf_counter() - t)
        kv.free()
        plan = plan or make_plan(steps, decode_tok_s)

        workload = batch_workload(args, plan)
        settings = DispatchSettings(max_batch=args.requests, max_round_tokens=ROUND_TOKENS)
        batch = bench_offline(loaded, workload, settings).summary
        return {"load_s": load_s, "held_bytes": held,
                "prompt_tok_s": args.prompt_tokens / prompt_s, "decode_tok_s": decode_tok_s,
                "batch_tok_s": batch.output_tok_s}, plan
    finally:
        loaded.close()


def batch_workload(args: argparse.Namespace, plan: Plan) -> WorkloadSpec:
    return WorkloadSpec(args.requests, LengthRange(32, 64),
                        LengthRange(plan.batch_output, plan.batch_output), seed=0)


def llama_cpp_pass(path: Path, args: argparse.Namespace, plan: Plan) -> dict[str, float]:
    from benchmarks.llama_cpp_batched import run_llama_cpp_workload
    from benchmarks.llama_cpp_peer import measure_llama_cpp

    res = measure_llama_cpp(str(path), args.prompt_tokens, plan.decode_tokens, args.threads,
                            prompt_runs=args.prompt_runs)
    batch = run_llama_cpp_workload(str(path), plan.requests, n_parallel=args.requests,
                                   n_threads=args.threads, n_batch=ROUND_TOKENS)
    return {"load_s": res["load_s"], "prompt_tok_s": res["prompt_tok_s"],
            "decode_tok_s": res["decode_tok_s"], "batch_tok_s": batch["output_tok_s"]}


# -- one file -------------------------------------------------------------------------

def measure_file(path: Path, args: argparse.Namespace, peer: bool) -> dict[str, Any]:
    """Both engines on one file, alternating; every pass's figures and the plan."""
    model = ModelFile.open(path)
    vocab, context = model.tokenizer.vocab_size, model.config.context_length
    model.close()

    def make_plan(steps: int, decode_tok_s: float) -> Plan:
        # a round of 8 decode rows costs about two batch-1 steps where the products are
        # bound by reading the weights, about one where they are bound by dequantizing
        out = args.batch_output if math.isinf(decode_tok_s) else max(
            2, min(args.batch_output, int(args.batch_seconds * decode_tok_s / 2)))
        spec = WorkloadSpec(args.requests, LengthRange(32, 64), LengthRange(out, out), seed=0)
        reqs = [(r.prompt_ids, r.max_tokens) for r in make_workload(spec, vocab, context)]
        return Plan(steps, out, reqs, steps < args.decode_tokens or out < args.batch_output)

    runs: dict[str, list[dict[str, float]]] = {"eagerlm": [], "llama.cpp": []}
    bandwidth: list[float] = []
    plan: Plan | None = None
    refused: str | None = None
    for r in range(args.repeats):
        bandwidth.append(copy_bandwidth_gb_s(args.copy_mib << 20))
        order = ("eagerlm", "llama.cpp") if r % 2 == 0 else ("llama.cpp", "eagerlm")
        for engine in order:
            if engine == "eagerlm" and refused is None:
                try:
                    res, plan = eagerlm_pass(path, args, plan, make_plan)
                except UnsupportedTensorType as e:
                    refused = str(e)
                    continue
            elif engine == "llama.cpp" and peer:
                if plan is None:  # eagerlm refused the file: llama.cpp alone, full length
                    plan = make_plan(args.decode_tokens, math.inf)
                res = llama_cpp_pass(path, args, plan)
            else:
                continue
            runs[engine].append(res)
            gc.collect()
            log(f"  pass {r + 1} {engine}: " + ", ".join(f"{k} {v:.3g}" for k, v in res.items()))
    return {"runs": runs, "bandwidth_gb_s": bandwidth, "refused": refused,
            "plan": None if plan is None else {"decode_tokens": plan.decode_tokens,
                                               "batch_output": plan.batch_output,
                                               "cut": plan.cut}}


def summarize(row: dict[str, Any], bandwidth: float) -> dict[str, Any]:
    """Medians, per-pass ratios, roofline fractions (at `bandwidth` GB/s) and the targets
    a row misses."""
    runs = row["runs"]
    out: dict[str, Any] = {}
    roof = bandwidth * 1e9 / row["read_bytes"]
    out["roofline_tok_s"] = roof
    for engine, rs in runs.items():
        if rs:
            out[engine] = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
            out[engine]["roofline_fraction"] = out[engine]["decode_tok_s"] / roof
    ours, theirs = runs["eagerlm"], runs["llama.cpp"]
    missed = []
    if ours and theirs:
        for key in TARGETS:
            ratio = statistics.median(a[f"{key}_tok_s"] / b[f"{key}_tok_s"]
                                      for a, b in zip(ours, theirs))
            out[f"{key}_ratio"] = ratio
            if ratio < TARGETS[key]:
                missed.append(key)
    if ours:
        out["held_ratio"] = out["eagerlm"]["held_bytes"] / row["file_bytes"]
        if out["held_ratio"] > HELD_TARGET:
            missed.append("held")
    out["missed"] = missed
    return out


# -- the table --------------------------------------------------------------------------

HEADER = ("| shape | type | file MB | held MB (x file) | decode tok/s eagerlm / llama.cpp "
          "(ratio) | prompt tok/s (ratio) | {n} requests out tok/s (ratio) | roofline tok/s | "
          "fraction eagerlm / llama.cpp | targets missed |\n|---|---|---|---|---|---|---|---|"
          "---|---|")


def _pair(s: dict[str, Any], key: str, spec: str) -> str:
    a = s.get("eagerlm", {}).get(f"{key}_tok_s")
    b = s.get("llama.cpp", {}).get(f"{key}_tok_s")
    text = f"{a:{spec}}" if a is not None else "-"
    text += f" / {b:{spec}}" if b is not None else " / -"
    if f"{key}_ratio" in s:
        text += f" ({s[f'{key}_ratio']:.2f}x)"
    return text


def _short(refusal: str) -> str:
    """A refusal without the list of supported types and the path."""
    return refusal.split(" (supported")[0].split(" (/")[0]


def table_row(shape: str, name: str, row: dict[str, Any]) -> str:
    if "error" in row:
        return f"| {shape} | {name} | - | - | {row['error']} | | | | | |"
    s = row["summary"]
    file_mb = row["file_bytes"] / 1e6
    held = (f"{s['eagerlm']['held_bytes'] / 1e6:.1f} ({s['held_ratio']:.2f}x)"
            if "eagerlm" in s else f"refused: {_short(row['refused'])}" if row["refused"]
            else "-")
    fractions = " / ".join(f"{s[e]['roofline_fraction']:.0%}" if e in s else "-"
                           for e in ("eagerlm", "llama.cpp"))
    plan = row["plan"] or {}
    cut = (f" (cut: {plan['decode_tokens']} decode steps, {plan['batch_output']} tokens per "
           f"request)" if plan.get("cut") else "")
    missed = ", ".join(s["missed"]) if s["missed"] else ("none" if "decode_ratio" in s
                                                         else "not compared")
    if row["refused"]:
        missed = "all: refused"
    return (f"| {shape} | {name} | {file_mb:.1f} | {held} | {_pair(s, 'decode', '.1f')}{cut} | "
            f"{_pair(s, 'prompt', '.0f')} | {_pair(s, 'batch', '.1f')} | "
            f"{s['roofline_tok_s']:.1f} | {fractions} | {missed} |")


# -- the run ----------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="qwen1.5-0.5b",
                    help=f"comma-separated: tiny, {', '.join(SHAPES)}")
    ap.add_argument("--types", default="all",
                    help=f"comma-separated llama.cpp recipes, or all ({', '.join(ALL_TYPES)}); "
                         f"also {', '.join(sorted(set(RECIPES) - set(ALL_TYPES)))}")
    ap.add_argument("--repeats", type=int, default=1,
                    help="passes per file, the engines alternating (ABBA); medians reported")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--prompt-runs", type=int, default=5,
                    help="prefills of the prompt per pass, from an empty cache, after one not "
                    "counted; the median")
    ap.add_argument("--decode-tokens", type=int, default=64, help="batch-1 decode steps, at most")
    ap.add_argument("--decode-seconds", type=float, default=20.0,
                    help="eagerlm's first decode stops here (both engines then run as many)")
    ap.add_argument("--requests", type=int, default=8, help="concurrent requests")
    ap.add_argument("--batch-output", type=int, default=32,
                    help="output tokens per concurrent request, at most")
    ap.add_argument("--batch-seconds", type=float, default=60.0,
                    help="cut the requests' output so eagerlm's run takes about this long")
    ap.add_argument("--threads", type=int, default=2, help="llama.cpp threads")
    ap.add_argument("--quantizer", choices=("llama.cpp", "synthetic"), default="llama.cpp",
                    help="who writes each type's file (synthetic: loader/synthetic.py, "
                         "no llama.cpp needed)")
    ap.add_argument("--no-peer", action="store_true", help="eagerlm alone (no llama.cpp)")
    ap.add_argument("--scratch", type=Path,
                    default=Path(tempfile.gettempdir()) / "eagerlm-bench-types",
                    help="where the model files go (outside the repository)")
    ap.add_argument("--keep", action="store_true", help="keep each type's file for reuse")
    ap.add_argument("--drop-base", action="store_true", help="delete the F16 bases at the end")
    ap.add_argument("--max-gib", type=float, default=6.0,
                    help="skip a file whose engine would hold more than this")
    ap.add_argument("--copy-mib", type=int, default=512,
                    help="size of the copy that measures the bandwidth")
    ap.add_argument("--bandwidth", type=float, default=0.0,
                    help="GB/s of the roofline (default: the most a copy reached in the run)")
    ap.add_argument("--json", type=Path, help="write every figure here (after each file)")
    ap.add_argument("--table-from", type=Path,
                    help="print the table of an earlier run's --json file, measure nothing")
    args = ap.parse_args(argv)
    args.shape_list = [s.strip() for s in args.shapes.split(",") if s.strip()]
    for s in args.shape_list:
        if s != "tiny" and s not in SHAPES:
            ap.error(f"unknown shape {s!r}; choose from tiny, {', '.join(SHAPES)}")
    names = ALL_TYPES if args.types == "all" else [
        t.strip().upper() for t in args.types.split(",") if t.strip()]
    for t in names:
        if t not in RECIPES:
            ap.error(f"unknown type {t!r}; choose from {', '.join(RECIPES)}")
    args.type_list = list(names)
    if args.repeats < 1 or args.decode_tokens < 1 or args.prompt_runs < 1 \
            or args.prompt_tokens < 8:
        ap.error("--repeats, --decode-tokens and --prompt-runs must be positive, "
                 "--prompt-tokens at least 8")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.table_from:
        results = json.loads(args.table_from.read_text())
        measured = [b for row in results["rows"] for b in row.get("bandwidth_gb_s", [])]
        print_table(results, args, args.bandwidth or max(measured, default=0.0))
        return 0
    peer = not args.no_peer
    if peer or args.quantizer == "llama.cpp":
        try:
            import llama_cpp  # noqa: F401
        except ImportError as e:
            sys.exit(f"llama.cpp is needed (pip install 'eagerlm[reference]'), or run with "
                     f"--quantizer synthetic --no-peer: {e}")
    args.scratch.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"date": time.strftime("%Y-%m-%d"), "machine": machine(),
                               "args": {k: str(v) for k, v in vars(args).items()}, "rows": []}
    measured: list[float] = []
    for shape in args.shape_list:
        for name in args.type_list:
            row = run_one(shape, RECIPES[name], args, peer)
            results["rows"].append({"shape": shape, "type": name, **row})
            measured += row.get("bandwidth_gb_s", [])
            limit = args.bandwidth or max(measured, default=0.0)
            if "runs" in row:
                row["summary"] = summarize(row, limit)
            log(table_row(shape, name, row))
            if args.json:
                args.json.write_text(json.dumps(results, indent=1, default=str))
        if args.drop_base:
            for base in args.scratch.glob(f"{shape}-*-F16-base.gguf"):
                base.unlink()
    # the physical limit: the copy bandwidth of the least busy moment of the run (copies
    # measured before each pass; other work on the machine only ever lowers them)
    print_table(results, args, args.bandwidth or max(measured, default=0.0))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1, default=str))
    return 0


def print_table(results: dict[str, Any], args: argparse.Namespace, limit: float) -> None:
    """Every row's summary at the roofline of `limit` GB/s, and the table."""
    results["bandwidth_limit_gb_s"] = limit
    lines = []
    for row in results["rows"]:
        if "runs" in row:
            row["summary"] = summarize(row, limit)
        lines.append(table_row(row["shape"], row["type"], row))
    run = results["args"]  # the run's own settings (strings), also for --table-from
    print(f"{results['date']}, machine: {results['machine']}; llama.cpp {run['threads']} "
          f"threads; {run['prompt_tokens']}-token prompt (median of "
          f"{run.get('prompt_runs', 1)} prefills); {run['requests']} requests of 32-64 "
          f"prompt tokens; {run['repeats']} pass(es) per file, medians")
    print(f"targets: decode >= {TARGETS['decode']}x, prompt >= {TARGETS['prompt']}x, "
          f"{run['requests']} requests >= {TARGETS['batch']}x llama.cpp; held <= "
          f"{HELD_TARGET}x file. Roofline: {limit:.1f} GB/s (the most a copy reached in the "
          f"run{', as given' if args.bandwidth else ''}) / bytes read per decode step.\n")
    print(HEADER.format(n=run["requests"]))
    print("\n".join(lines))


def run_one(shape: str, recipe: Recipe, args: argparse.Namespace, peer: bool) -> dict[str, Any]:
    """One file: written (or reused), measured, deleted unless kept; errors become the row."""
    log(f"{shape} {recipe.name}:")
    path = None
    try:
        path, write_s = type_file(args.scratch, shape, recipe, args.quantizer, args.threads)
        size = path.stat().st_size
        if size * 1.2 > args.max_gib * 2**30:
            return {"error": f"skipped: {size / 2**30:.1f} GiB file over --max-gib "
                             f"{args.max_gib}"}
        row = measure_file(path, args, peer)
        _, read = tensor_bytes(str(path))
        row.update(file_bytes=size, read_bytes=read, write_s=write_s)
        return row
    except Exception as e:  # the next type still runs; the row says what went wrong
        log(traceback.format_exc())
        return {"error": f"{type(e).__name__}: {str(e)[:200]}"}
    finally:
        if path is not None and not args.keep:
            path.unlink(missing_ok=True)


def machine() -> str:
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            name = next(line.split(":", 1)[1].strip() for line in f
                        if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{name}, {os.cpu_count()} cores"


if __name__ == "__main__":
    sys.exit(main())
