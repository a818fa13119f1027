"""Demo-model speed on the cpu backend at batch 1, beside llama.cpp on the same threads.

What is measured (same prompt and token counts as `llama_cpp_peer.py`):
- load time (GGUF open + dequantization of every weight to float32);
- prompt tokens/s: one prefill of `--prompt-tokens` tokens from an empty cache;
- decode tokens/s at batch 1: `--gen-tokens` greedy single-token steps.

The physical limit of batch-1 decode is memory bandwidth: every step reads every weight
once. The script measures this machine's copy bandwidth (numpy copy of a 512 MiB array,
read + write counted) and reports the roofline tokens/s = bandwidth / bytes read per token
and the achieved fraction. Our cpu backend holds float32 weights (4 bytes per parameter),
llama.cpp reads the quantized blocks (about 0.9 bytes per parameter here), so llama.cpp's
roofline is higher: the table shows both.

Run: `python benchmarks/bench_cpu_decode.py [--model PATH] [--threads 2]`.
The llama.cpp column needs `pip install 'eagerlm[reference]'` (llama-cpp-python).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
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

REFERENCE_TEXT = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "reference_text.txt"


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


def measure_eagerlm(path: str, prompt_tokens: int, gen_tokens: int) -> dict[str, float]:
    t0 = time.perf_counter()
    model = ModelFile.open(path)
    tf = cpu_transformer(model)
    load_s = time.perf_counter() - t0
    weight_bytes = sum(w.nbytes for w in tf.weights.handles())

    text = REFERENCE_TEXT.read_text(encoding="utf-8")
    ids = model.tokenizer.encode(text)
    while len(ids) < prompt_tokens:
        ids += ids[1:]
    ids = ids[:prompt_tokens]
    cfg = model.config
    layout = KVLayout(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim)

    warm = ContiguousKV(layout, 8)  # first-call allocations are not charged to the prompt
    tf.forward(ForwardBatch.single(ids[:4], 0, warm))

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
            "decode_tok_s": gen_tokens / decode_s, "weight_bytes": weight_bytes}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="GGUF file (default: the demo model)")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--gen-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-peer", action="store_true", help="skip llama.cpp")
    args = ap.parse_args()
    path = args.model or demo_model_path()

    bw = copy_bandwidth_gb_s()
    ours = measure_eagerlm(path, args.prompt_tokens, args.gen_tokens)
    peer = None
    if not args.no_peer:
        try:
            from benchmarks.llama_cpp_peer import measure_llama_cpp
            peer = measure_llama_cpp(path, args.prompt_tokens, args.gen_tokens, args.threads)
        except ImportError as e:
            print(f"llama.cpp peer skipped: {e}", file=sys.stderr)
    gguf_bytes = os.path.getsize(path)

    roof = bw * 1e9 / ours["weight_bytes"]
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"copy bandwidth {bw:.1f} GB/s (read+write)")
    print(f"model: {Path(path).name}, {gguf_bytes / 1e6:.0f} MB file, "
          f"{ours['weight_bytes'] / 1e6:.0f} MB as float32")
    print()
    print("| engine | load s | prompt tok/s | decode tok/s | decode roofline tok/s | "
          "fraction |")
    print("|---|---|---|---|---|---|")
    print(f"| eagerlm cpu (float32) | {ours['load_s']:.2f} | {ours['prompt_tok_s']:.0f} | "
          f"{ours['decode_tok_s']:.1f} | {roof:.1f} | {ours['decode_tok_s'] / roof:.0%} |")
    if peer:
        proof = bw * 1e9 / gguf_bytes
        print(f"| llama.cpp {args.threads} threads (quantized) | {peer['load_s']:.2f} | "
              f"{peer['prompt_tok_s']:.0f} | {peer['decode_tok_s']:.1f} | {proof:.1f} | "
              f"{peer['decode_tok_s'] / proof:.0%} |")
        print(f"\neagerlm / llama.cpp: decode {ours['decode_tok_s'] / peer['decode_tok_s']:.2f}x, "
              f"prompt {ours['prompt_tok_s'] / peer['prompt_tok_s']:.2f}x")
    print()
    print(json.dumps({"bandwidth_gb_s": bw, "eagerlm": ours, "llama_cpp": peer,
                      "prompt_tokens": args.prompt_tokens, "gen_tokens": args.gen_tokens}))


if __name__ == "__main__":
    main()
