"""llama.cpp on a whole workload, one request at a time or with parallel decoding.

Why: `eagerlm bench offline` runs many requests through continuous batching; the fair peer
is llama.cpp doing the same, not one batch-1 stream. This drives llama.cpp's low-level API
(through llama-cpp-python 0.3.36, imported lazily) the way its `examples/parallel` and
`llama-server` do: up to `n_parallel` sequences share one unified KV cache; each
`llama_decode` batch holds one decode token per running sequence plus prefill chunks of
newly admitted prompts, up to `n_batch` tokens; a finished sequence's KV is removed and the
next request takes its slot. `n_parallel=1` is plain batch-1 serving, request after request.

The prompts are token ids given by the caller (the same ids eagerlm gets: the demo model's
GGUF vocabulary is shared), decoding is greedy (argmax of each logits row), and every
request produces exactly its `max_tokens` (EOS ignored), as in eagerlm's benchmark.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

_QUIET = None  # the log callback, kept alive for as long as llama.cpp may call it


@dataclass
class _Slot:
    seq_id: int
    prompt: list[int]
    max_tokens: int
    n_fed: int = 0  # prompt tokens already in the cache
    n_generated: int = 0
    last: int = -1  # the last sampled token, fed at the next decode
    batch_row: int = -1  # row of the current batch whose logits belong to this slot
    token_times: list[float] = field(default_factory=list)


def run_llama_cpp_workload(model_path: str, requests: Sequence[tuple[Sequence[int], int]],
                           n_parallel: int = 1, n_threads: int = 2,
                           n_batch: int = 512, repack: bool = True) -> dict[str, float]:
    """Serve `requests` ((prompt ids, max_tokens) pairs) and time it (`repack=False`: as
    llama.cpp's --no-repack, benchmarks/llama_cpp_peer.model_params).

    Returns output tokens, wall seconds, output tokens/s and the mean time to first token
    (all requests are there at time 0, as in an offline benchmark)."""
    import ctypes

    import llama_cpp
    import numpy as np

    longest = max(len(p) + n for p, n in requests)
    llama_cpp.llama_backend_init()
    global _QUIET
    if _QUIET is None:  # llama.cpp logs every tensor it loads on stderr; keep it quiet
        _QUIET = llama_cpp.llama_log_callback(lambda level, text, data: None)
        llama_cpp.llama_log_set(_QUIET, ctypes.c_void_p(0))
    mparams = llama_cpp.llama_model_default_params()
    mparams.n_gpu_layers = 0
    mparams.use_extra_bufts = repack  # False: llama.cpp's --no-repack
    model = llama_cpp.llama_model_load_from_file(model_path.encode(), mparams)
    if not model:
        raise RuntimeError(f"llama.cpp could not load {model_path}")
    cparams = llama_cpp.llama_context_default_params()
    cparams.n_ctx = n_parallel * (longest + 8)
    cparams.n_batch = cparams.n_ubatch = n_batch
    cparams.n_seq_max = n_parallel
    cparams.kv_unified = True
    cparams.n_threads = cparams.n_threads_batch = n_threads
    ctx = llama_cpp.llama_init_from_model(model, cparams)
    if not ctx:
        llama_cpp.llama_model_free(model)
        raise RuntimeError("llama.cpp could not create a context")
    n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
    mem = llama_cpp.llama_get_memory(ctx)
    batch = llama_cpp.llama_batch_init(n_batch, 0, 1)

    def put(i: int, token: int, pos: int, seq: int, logits: bool) -> None:
        batch.token[i] = token
        batch.pos[i] = pos
        batch.n_seq_id[i] = 1
        batch.seq_id[i][0] = seq
        batch.logits[i] = logits

    def decode(n: int) -> None:
        batch.n_tokens = n
        if llama_cpp.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")

    def argmax(row: int) -> int:
        ptr = llama_cpp.llama_get_logits_ith(ctx, row)
        return int(np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)),
                                         shape=(n_vocab,)).argmax())

    try:
        put(0, int(requests[0][0][0]), 0, 0, True)  # warm-up, then an empty cache again
        decode(1)
        llama_cpp.llama_memory_clear(mem, True)

        queue = deque((list(p), n) for p, n in requests)
        free = list(range(n_parallel - 1, -1, -1))
        running: list[_Slot] = []
        done: list[_Slot] = []
        t0 = time.perf_counter()
        while queue or running:
            while queue and free:
                prompt, n = queue.popleft()
                running.append(_Slot(free.pop(), prompt, n))
            n_rows = 0
            for s in running:  # decode rows first: one token per prefilled sequence
                s.batch_row = -1
                if s.n_fed == len(s.prompt):
                    put(n_rows, s.last, len(s.prompt) + s.n_generated - 1, s.seq_id, True)
                    s.batch_row = n_rows
                    n_rows += 1
            for s in running:  # then prefill chunks, oldest first, while the batch has room
                if s.n_fed == len(s.prompt) or n_rows == n_batch:
                    continue
                take = min(len(s.prompt) - s.n_fed, n_batch - n_rows)
                for j in range(take):
                    last = s.n_fed + j == len(s.prompt) - 1
                    put(n_rows, s.prompt[s.n_fed + j], s.n_fed + j, s.seq_id, last)
                    if last:
                        s.batch_row = n_rows
                    n_rows += 1
                s.n_fed += take
            decode(n_rows)
            now = time.perf_counter()
            for s in list(running):
                if s.batch_row < 0:
                    continue
                s.last = argmax(s.batch_row)
                s.n_generated += 1
                s.token_times.append(now)
                if s.n_generated == s.max_tokens:
                    llama_cpp.llama_memory_seq_rm(mem, s.seq_id, -1, -1)
                    free.append(s.seq_id)
                    running.remove(s)
                    done.append(s)
        wall = time.perf_counter() - t0
    finally:
        llama_cpp.llama_batch_free(batch)
        llama_cpp.llama_free(ctx)
        llama_cpp.llama_model_free(model)
    n_out = sum(s.n_generated for s in done)
    return {"output_tokens": n_out, "wall_s": wall, "output_tok_s": n_out / wall,
            "ttft_mean_s": sum(s.token_times[0] - t0 for s in done) / len(done),
            "n_parallel": n_parallel, "n_threads": n_threads}
