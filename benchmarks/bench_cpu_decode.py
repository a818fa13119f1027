"""Demo-model speed and memory on the cpu backend at batch 1, beside llama.cpp on the same threads.

Measured in one run, for eagerlm with `--weights quantized` (the default: each matrix kept
as the file's GGUF blocks, read by the compiled kernels of kernels/cpu_kernel_registry.py),
eagerlm with `--weights float` (every weight dequantized to float32: the comparison) and
llama.cpp (llama-cpp-python, same threads, same prompt and token counts as
`llama_cpp_peer.py`):

- weights held: bytes the backend holds for the weights (the sum over the Transformer's
  distinct weight handles), beside the GGUF file's size;
- peak RSS of a whole `eagerlm generate` (one subprocess per weights mode, its peak resident
  set read with `getrusage(RUSAGE_CHILDREN)` in a small launcher process), and of
  `llama_cpp_peer.py`'s measurement in a subprocess the same way;
- first-use compile time of the quantized kernels: a subprocess loads the model with
  `NUMBA_CACHE_DIR` pointing at an empty directory (cold: numba compiles), then another one
  with the same directory (warm: read from the cache);
- load time in this process (GGUF open + building the weights + the kernels' warm-up);
- prompt tokens/s: one prefill of `--prompt-tokens` tokens from an empty cache;
- decode tokens/s at batch 1: `--gen-tokens` greedy single-token steps.

The physical limit of batch-1 decode is memory bandwidth: every step reads every weight
once. The script measures this machine's copy bandwidth (numpy copy of a 512 MiB array,
read + write counted) and reports the roofline tokens/s = bandwidth / bytes read per token
and the achieved fraction, where the bytes read per token are the weights as each engine
holds them: for eagerlm quantized the blocks' bytes plus the float32 vectors (norms), for
eagerlm float 4 bytes per parameter, for llama.cpp the file's tensor bytes. (An untied
token embedding is read one row per token and is counted so.)

The machine this runs on may be shared: `--repeats N` runs every engine N times,
alternating them (eagerlm quantized, llama.cpp, eagerlm float, ...), and reports the median
and the range of each figure.

Run: `python benchmarks/bench_cpu_decode.py [--model PATH] [--threads 2] [--repeats 3]
[--weights quantized,float] [--no-peer] [--no-subprocess]`.
The llama.cpp column needs `pip install 'eagerlm[reference]'` (llama-cpp-python).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from threadpoolctl import threadpool_limits

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import eagerlm
from eagerlm.kernels.batch import ForwardBatch
from eagerlm.kernels.cpu_backend import cpu_transformer
from eagerlm.kernels.cpu_threads import core_count
from eagerlm.loader.demo_model import demo_model_path
from eagerlm.loader.model_file import ModelFile
from eagerlm.vmm.kv_layout import ContiguousKV, KVLayout

ROOT = Path(__file__).resolve().parents[1]
REFERENCE_TEXT = ROOT / "tests" / "fixtures" / "reference_text.txt"

# A subprocess that loads the model on the cpu backend and prints the load and compile times.
_LOAD_SNIPPET = """
import json, sys, time
t0 = time.perf_counter()
from eagerlm.kernels.cpu_backend import cpu_transformer
from eagerlm.loader.model_file import ModelFile
compiled = []
tf = cpu_transformer(ModelFile.open(sys.argv[1]), weights=sys.argv[2],
                     on_compile=lambda s: s is not None and compiled.append(s))
print(json.dumps({"load_s": time.perf_counter() - t0,
                  "compile_s": compiled[0] if compiled else 0.0}))
"""


def copy_bandwidth_gb_s(n_bytes: int = 512 << 20, repeats: int = 5) -> float:
    """Best of a few large copies, counting bytes read plus bytes written."""
    src = np.ones(n_bytes // 4, dtype=np.float32)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t)
    return 2 * n_bytes / best / 1e9


def prompt_ids(model: ModelFile, n: int) -> list[int]:
    ids = model.tokenizer.encode(REFERENCE_TEXT.read_text(encoding="utf-8"))
    while len(ids) < n:
        ids += ids[1:]
    return ids[:n]


def measure_eagerlm(path: str, prompt_tokens: int, gen_tokens: int,
                    weights: str = "quantized") -> dict[str, float]:
    if weights == "float":  # a quantized engine, loaded before, held BLAS to one thread
        threadpool_limits(core_count(), user_api="blas")
    t0 = time.perf_counter()
    model = ModelFile.open(path)
    tf = cpu_transformer(model, weights=weights)  # type: ignore[arg-type]
    load_s = time.perf_counter() - t0
    w = tf.weights
    held = sum(h.nbytes for h in w.handles())
    read = held
    if w.output is not w.token_embd:  # an untied embedding: one row read per token
        read -= w.token_embd.nbytes - w.token_embd.nbytes // w.token_embd.shape[0]

    ids = prompt_ids(model, prompt_tokens)
    cfg = model.config
    layout = KVLayout(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim)

    warm = ContiguousKV(layout, 8)  # first-call allocations are not charged to the prompt
    tf.forward(ForwardBatch.single(ids[:4], 0, warm))
    tf.forward(ForwardBatch.single(ids[4:5], 4, warm))

    kv = ContiguousKV(layout, prompt_tokens + gen_tokens)
    t = time.perf_counter()
    logits = tf.forward(ForwardBatch.single(ids, 0, kv))
    prompt_s = time.perf_counter() - t
    token = int(np.argmax(logits[-1]))
    t = time.perf_counter()
    for i in range(gen_tokens):
        logits = tf.forward(ForwardBatch.single([token], prompt_tokens + i, kv))
        token = int(np.argmax(logits[-1]))
    decode_s = time.perf_counter() - t
    return {"load_s": load_s, "prompt_tok_s": prompt_tokens / prompt_s,
            "decode_tok_s": gen_tokens / decode_s, "held_bytes": held, "read_bytes": read}


def tensor_bytes(path: str) -> tuple[int, int]:
    """(bytes of the file's tensor data, of it read per decode token): a mixture's experts
    scaled by the share a token picks (k of n), the token embedding one row where the lm
    head is a tensor of its own."""
    model = ModelFile.open(path)
    tensors, moe = model.gguf.tensors, model.config.moe
    total = sum(info.n_bytes for info in tensors.values())
    read = total
    if moe is not None:
        experts = sum(info.n_bytes for info in tensors.values() if len(info.shape) == 3)
        read -= experts - experts * moe.n_used // moe.n_experts
    if "output.weight" in tensors and "token_embd.weight" in tensors:
        embd = tensors["token_embd.weight"]  # (rows, columns): one row a token
        read -= embd.n_bytes - embd.n_bytes // embd.shape[0]
    model.close()
    return total, read


def _child_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    # the children import this eagerlm (the directory holding the package) and `benchmarks`
    # (not resolved: a checkout laid out by .ci/link_checkout.py is a folder of links)
    package_parent = os.path.dirname(os.path.dirname(os.path.abspath(eagerlm.__file__)))
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [package_parent, str(ROOT), env.get("PYTHONPATH", "")]))
    env.update(extra)
    return env


# Runs argv[2:] and writes its peak RSS (KiB) to the file argv[1]. A child's ru_maxrss counts
# what the process it was forked from held (Linux takes the forked copy's high-water mark at
# exec), so the measured command is started from this small launcher, not from the
# benchmark's process with a model loaded.
_LAUNCHER = """
import resource, subprocess, sys
rc = subprocess.run(sys.argv[2:]).returncode
with open(sys.argv[1], "w") as f:
    f.write(str(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss))
sys.exit(rc)
"""


def run_child(cmd: list[str], env: dict[str, str]) -> tuple[str, int]:
    """Run `cmd`; (its stdout, its peak RSS in bytes). Raises on a non-zero exit."""
    with tempfile.TemporaryDirectory() as tmp:
        rss_file = os.path.join(tmp, "maxrss")
        p = subprocess.run([sys.executable, "-c", _LAUNCHER, rss_file, *cmd],
                           capture_output=True, env=env, cwd=ROOT)
        if p.returncode != 0:
            raise RuntimeError(f"{cmd[:4]} exited {p.returncode}: "
                               f"{p.stderr.decode(errors='replace')[-2000:]}")
        with open(rss_file) as f:
            return p.stdout.decode(errors="replace"), int(f.read()) * 1024  # KiB on Linux


def _check_child_imports_this_eagerlm() -> None:
    out, _ = run_child([sys.executable, "-c", "import eagerlm.kernels as k; print(k.__file__)"],
                       _child_env())
    mine = os.path.dirname(os.path.abspath(sys.modules["eagerlm.kernels"].__file__ or ""))
    if os.path.dirname(os.path.abspath(out.strip())) != mine:
        raise RuntimeError(f"a subprocess imports {out.strip()}, not {mine}")


def peak_rss_generate(path: str, weights: str, max_tokens: int) -> int:
    text = REFERENCE_TEXT.read_text(encoding="utf-8")[:600]
    _, rss = run_child([sys.executable, "-m", "eagerlm", "generate", "--model", path,
                        "--weights", weights, "--prompt", text, "--max-tokens",
                        str(max_tokens), "--quiet"], _child_env())
    return rss


def peak_rss_llama_cpp(path: str, prompt_tokens: int, gen_tokens: int) -> int:
    code = ("import sys; from benchmarks.llama_cpp_peer import measure_llama_cpp; "
            f"measure_llama_cpp(sys.argv[1], {prompt_tokens}, {gen_tokens}, 2)")
    _, rss = run_child([sys.executable, "-c", code, path], _child_env())
    return rss


def compile_times(path: str) -> dict[str, float]:
    """Load times of the quantized model in fresh processes, numba's cache cold then warm."""
    with tempfile.TemporaryDirectory() as cache:
        env = _child_env(NUMBA_CACHE_DIR=cache)
        cmd = [sys.executable, "-c", _LOAD_SNIPPET, path, "quantized"]
        cold = json.loads(run_child(cmd, env)[0].strip().splitlines()[-1])
        warm = json.loads(run_child(cmd, env)[0].strip().splitlines()[-1])
    return {"cold_compile_s": cold["compile_s"], "cold_load_s": cold["load_s"],
            "warm_compile_s": warm["compile_s"], "warm_load_s": warm["load_s"]}


def summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def fmt(s: dict[str, float], spec: str) -> str:
    if s["min"] == s["max"]:
        return format(s["median"], spec)
    return f"{s['median']:{spec}} ({s['min']:{spec}}-{s['max']:{spec}})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="GGUF file (default: the demo model)")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--gen-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2, help="llama.cpp threads")
    ap.add_argument("--weights", default="quantized,float",
                    help="eagerlm weights modes to run, comma-separated")
    ap.add_argument("--repeats", type=int, default=1,
                    help="runs of each engine, alternating; median and range reported")
    ap.add_argument("--rss-tokens", type=int, default=32,
                    help="tokens `eagerlm generate` makes in the peak-RSS subprocess")
    ap.add_argument("--no-peer", action="store_true", help="skip llama.cpp")
    ap.add_argument("--no-subprocess", action="store_true",
                    help="skip the subprocess measures (peak RSS, compile time)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    path = str(args.model or demo_model_path())
    modes = [m.strip() for m in args.weights.split(",") if m.strip()]

    peer_fn = None
    if not args.no_peer:
        try:
            import llama_cpp  # noqa: F401

            from benchmarks.llama_cpp_peer import measure_llama_cpp
            peer_fn = measure_llama_cpp
        except ImportError as e:
            print(f"llama.cpp peer skipped: {e}", file=sys.stderr)

    if not args.no_subprocess:
        import eagerlm.kernels  # noqa: F401

        _check_child_imports_this_eagerlm()
    bw_runs: list[float] = []
    runs: dict[str, list[dict[str, float]]] = {}
    order = [f"eagerlm {m}" for m in modes]
    if peer_fn is not None:
        order.insert(1, "llama.cpp")
    for r in range(args.repeats):
        bw_runs.append(copy_bandwidth_gb_s())
        for name in order:
            if name == "llama.cpp":
                res = peer_fn(path, args.prompt_tokens, args.gen_tokens, args.threads)
            else:
                res = measure_eagerlm(path, args.prompt_tokens, args.gen_tokens,
                                      name.split()[1])
            gc.collect()
            if not args.no_subprocess:
                if name == "llama.cpp":
                    res["peak_rss"] = peak_rss_llama_cpp(path, args.prompt_tokens,
                                                         args.gen_tokens)
                else:
                    res["peak_rss"] = peak_rss_generate(path, name.split()[1],
                                                        args.rss_tokens)
                    if name == "eagerlm quantized":
                        res.update(compile_times(path))
            runs.setdefault(name, []).append(res)
            print(f"run {r + 1}/{args.repeats} {name}: " + ", ".join(
                f"{k} {v:.3g}" for k, v in res.items()), file=sys.stderr)

    gguf_bytes = os.path.getsize(path)
    file_tensors, file_read = tensor_bytes(path)
    bw = summary(bw_runs)
    stats = {name: {k: summary([r[k] for r in rs]) for k in rs[0]} for name, rs in runs.items()}
    for name, st in stats.items():
        read = st["read_bytes"]["median"] if "read_bytes" in st else file_read
        fracs = [r["decode_tok_s"] / (b * 1e9 / read) for r, b in zip(runs[name], bw_runs)]
        st["roofline_tok_s"] = summary([b * 1e9 / read for b in bw_runs])
        st["roofline_fraction"] = summary(fracs)
        st["read_bytes"] = summary([read])
        if "held_bytes" not in st:
            st["held_bytes"] = summary([file_tensors])  # mapped from the file

    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"copy bandwidth {fmt(bw, '.1f')} GB/s (read+write)")
    print(f"model: {Path(path).name}, {gguf_bytes / 1e6:.1f} MB file "
          f"({file_tensors / 1e6:.1f} MB of tensors); {args.prompt_tokens}-token prompt, "
          f"{args.gen_tokens} decode steps; {args.repeats} run(s) each, median (range)")
    print()
    print("| engine | weights held MB (x file) | peak RSS MB | load s | prompt tok/s | "
          "decode tok/s | MB read / token | decode roofline tok/s | fraction |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, st in stats.items():
        label = f"llama.cpp {args.threads} threads" if name == "llama.cpp" else name
        held = st["held_bytes"]["median"]
        rss = fmt({k: v / 1e6 for k, v in st["peak_rss"].items()}, ".0f") \
            if "peak_rss" in st else "-"
        print(f"| {label} | {held / 1e6:.1f} ({held / gguf_bytes:.2f}x) | {rss} | "
              f"{fmt(st['load_s'], '.2f')} | {fmt(st['prompt_tok_s'], '.0f')} | "
              f"{fmt(st['decode_tok_s'], '.1f')} | {st['read_bytes']['median'] / 1e6:.1f} | "
              f"{fmt(st['roofline_tok_s'], '.1f')} | {fmt(st['roofline_fraction'], '.0%')} |")
    q = stats.get("eagerlm quantized")
    if q and "cold_compile_s" in q:
        print(f"\nquantized kernels' first-use compile (fresh process, empty NUMBA_CACHE_DIR): "
              f"{fmt(q['cold_compile_s'], '.1f')} s of a {fmt(q['cold_load_s'], '.1f')} s "
              f"load; from the cache: {fmt(q['warm_compile_s'], '.2f')} s of "
              f"{fmt(q['warm_load_s'], '.2f')} s")
    peer = runs.get("llama.cpp")
    if peer:
        print()
        for name in order:
            if name == "llama.cpp":
                continue
            d = [a["decode_tok_s"] / b["decode_tok_s"] for a, b in zip(runs[name], peer)]
            p = [a["prompt_tok_s"] / b["prompt_tok_s"] for a, b in zip(runs[name], peer)]
            print(f"{name} / llama.cpp (per run pair): decode {fmt(summary(d), '.2f')}x, "
                  f"prompt {fmt(summary(p), '.2f')}x")
    result = {"date": time.strftime("%Y-%m-%d"), "bandwidth_gb_s": bw_runs,
              "file_bytes": gguf_bytes, "tensor_bytes": file_tensors, "runs": runs,
              "prompt_tokens": args.prompt_tokens, "gen_tokens": args.gen_tokens}
    print()
    print(json.dumps(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
