"""The model forward on synthetic models of every architecture.

Reference: `tests/reference_forward.py`, a naive float64 implementation that reads the
file with gguf-py's reader and shares no code with the engine.
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from eagerlm.kernels.batch import ForwardBatch, SeqSlice
from eagerlm.kernels.cpu_backend import cpu_transformer
from eagerlm.loader.architectures import SUPPORTED_ARCHITECTURES
from eagerlm.loader.model_file import ModelFile
from eagerlm.loader.synthetic import IQ_TYPES, tiny_spec, write_synthetic_model
from eagerlm.vmm.kv_layout import ContiguousKV, KVLayout
from tests.reference_forward import reference_logits

# gemma3 needs 6 layers to have a global one (layer 5); a window of 4 over 12 tokens
# makes the sliding window matter.
SPECS = {
    "llama": tiny_spec("llama"),
    "qwen2": tiny_spec("qwen2", tied_embeddings=True),
    "qwen3": tiny_spec("qwen3", n_kv_heads=1),
    "gemma3": tiny_spec("gemma3", n_layers=6, sliding_window=4, tied_embeddings=True),
    "qwen3moe": tiny_spec("qwen3moe"),
    # the reference has no YaRN: gpt-oss's rope here is plain
    "gpt-oss": tiny_spec("gpt-oss", n_layers=3, sliding_window=4, rope_scaling=None,
                         rope_scaling_factor=None, rope_original_context=None),
    "phi3": tiny_spec("phi3"),
}
PROMPT = [1, 17, 300, 42, 42, 7, 99, 256, 3, 511, 128, 64]


def _open(tmp_path, spec):
    path = write_synthetic_model(tmp_path / f"{spec.architecture}.gguf", spec)
    model = ModelFile.open(path)
    return path, model, cpu_transformer(model)


def _kv(model: ModelFile, capacity: int = 64) -> ContiguousKV:
    c = model.config
    return ContiguousKV(KVLayout(c.n_layers, c.n_kv_heads, c.head_dim), capacity)


def _all_rows(n: int) -> np.ndarray:
    return np.arange(n)


@pytest.mark.parametrize("arch", SUPPORTED_ARCHITECTURES)
def test_prefill_logits_match_float64_reference(tmp_path, arch):
    path, model, tf = _open(tmp_path, SPECS[arch])
    ours = tf.forward(ForwardBatch.single(PROMPT, 0, _kv(model), _all_rows(len(PROMPT))))
    ref = reference_logits(str(path), PROMPT)
    np.testing.assert_allclose(ours, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())


def test_mixtral_style_llama_matches_float64_reference(tmp_path):
    """llama with expert tensors (Mixtral): softmax routing, the chosen weights normalized,
    experts as wide as feed_forward_length."""
    spec = tiny_spec("llama", n_experts=4, n_experts_used=2, d_ff=64)
    path, model, tf = _open(tmp_path, spec)
    assert model.config.moe is not None and model.config.moe.d_ff == 64
    ours = tf.forward(ForwardBatch.single(PROMPT, 0, _kv(model), _all_rows(len(PROMPT))))
    ref = reference_logits(str(path), PROMPT)
    np.testing.assert_allclose(ours, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())


@pytest.mark.parametrize("weight_type", [Q.F16, Q.BF16, Q.Q8_0, Q.Q5_0, Q.Q4_K, Q.Q6_K,
                                         *IQ_TYPES], ids=lambda q: q.name)
def test_quantized_weights_match_reference(tmp_path, weight_type):
    """F16 / BF16 weights multiply float32 activations: the float64 reference's logits to
    float32 rounding. Quantized weights multiply 8-bit activations (kernels/cpu_activations.py,
    as llama.cpp does), so their reference is the float64 forward with each such product's
    input rounded the same way: equal to float32 rounding, except that where a last-bit
    difference puts an activation on the other side of a rounding half-step (a jump of a
    whole step, carried on by the later layers) the logits move by up to the 8-bit rounding's
    own size. Hence: within twice the 8-bit reference's distance from the float64 one of
    that float64 reference, and on the 8-bit reference's top token wherever its lead over
    the second is above that distance."""
    # K-quants and most IQ types pack rows in blocks of 256 values, so every row length is
    # 256 here
    spec = tiny_spec("qwen3", weight_type=weight_type, embedding_type=Q.Q8_0, d_model=256,
                     head_dim=64, d_ff=256)
    path, model, tf = _open(tmp_path, spec)
    ours = tf.forward(ForwardBatch.single(PROMPT, 0, _kv(model), _all_rows(len(PROMPT))))
    ref = reference_logits(str(path), PROMPT)
    if weight_type in (Q.F16, Q.BF16):
        np.testing.assert_allclose(ours, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())
        return
    ref8 = reference_logits(str(path), PROMPT, eight_bit_activations=True)
    noise = np.abs(ref8 - ref).max()
    assert 0 < noise < 0.05 * np.abs(ref).max()
    assert np.abs(ours - ref).max() <= 2 * noise
    top2 = np.sort(ref8, axis=1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > noise
    assert clear.any()
    np.testing.assert_array_equal(ours.argmax(1)[clear], ref8.argmax(1)[clear])


def test_final_logit_softcap(tmp_path):
    spec = tiny_spec("gemma3", n_layers=6, final_logit_softcap=0.5)
    path, model, tf = _open(tmp_path, spec)
    ours = tf.forward(ForwardBatch.single(PROMPT, 0, _kv(model), _all_rows(len(PROMPT))))
    assert np.abs(ours).max() <= 0.5
    ref = reference_logits(str(path), PROMPT)
    np.testing.assert_allclose(ours, ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("arch", SUPPORTED_ARCHITECTURES)
def test_incremental_decode_equals_full_prefill(tmp_path, arch):
    """Prefill in two chunks then decode one token at a time through the KV cache: the
    logits of each position are those of a single full prefill."""
    _, model, tf = _open(tmp_path, SPECS[arch])
    full = tf.forward(ForwardBatch.single(PROMPT, 0, _kv(model), _all_rows(len(PROMPT))))
    kv = _kv(model)
    parts = [tf.forward(ForwardBatch.single(PROMPT[:5], 0, kv, _all_rows(5))),
             tf.forward(ForwardBatch.single(PROMPT[5:9], 5, kv, _all_rows(4)))]
    parts += [tf.forward(ForwardBatch.single([PROMPT[i]], i, kv)) for i in range(9, 12)]
    np.testing.assert_allclose(np.concatenate(parts), full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ["qwen3", "gemma3"])
def test_batched_sessions_equal_separate_runs(tmp_path, arch):
    """One batch mixing a prefill, a prefill continuation and a decode step gives each
    session the logits it gets alone."""
    _, model, tf = _open(tmp_path, SPECS[arch])
    a, b, c = PROMPT, PROMPT[::-1], PROMPT[3:9]
    kv_b, kv_c = _kv(model), _kv(model)
    tf.forward(ForwardBatch.single(b[:6], 0, kv_b))
    tf.forward(ForwardBatch.single(c[:5], 0, kv_c))
    kv_a = _kv(model)
    tokens = np.array(a + b[6:] + c[5:], dtype=np.int32)
    seqs = [SeqSlice(0, len(a), 0, kv_a), SeqSlice(len(a), 6, 6, kv_b),
            SeqSlice(len(a) + 6, 1, 5, kv_c)]
    rows = np.array([len(a) - 1, len(a) + 5, len(a) + 6])
    batched = tf.forward(ForwardBatch(tokens, seqs, rows))

    alone = []
    for seq in (a, b, c):
        alone.append(tf.forward(ForwardBatch.single(seq, 0, _kv(model)))[0])
    np.testing.assert_allclose(batched, np.stack(alone), rtol=1e-5, atol=1e-5)
