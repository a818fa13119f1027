"""The synthetic model writer (loader/synthetic.py): what the benchmark shapes rest on, since
real models over 64 MiB cannot travel to the GPU machine."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType, quants

from eagerlm.loader.gguf_file import GGUFFile
from eagerlm.loader.synthetic import RANDOM_BYTE_TYPES, bf16_bits, tiny_spec, write_synthetic_model


def test_bf16_bits_round_as_gguf_does() -> None:
    """Reference: gguf-py's own `quants.quantize(.., BF16)`, on random values and on the
    cases that decide a rounding rule: exact ties to even and to odd, values just above
    and below a tie, subnormals, the largest finite floats; a size that is not a multiple
    of the chunk."""
    rng = np.random.default_rng(0)
    random = (rng.standard_normal(100_003) * 10.0 ** rng.integers(-30, 30, 100_003))
    upper = rng.integers(0, 1 << 16, 4000, dtype=np.uint32) << 16
    ties = np.concatenate([upper | 0x8000, upper | 0x7FFF, upper | 0x8001, upper | 0xFFFF])
    ties = ties[((ties >> 23) & 0xFF) != 0xFF]  # finite only
    edge = np.array([0.0, -0.0, 1e-45, -1e-45, 1e-40, 3.4028235e38, -3.4028235e38],
                    np.float32)
    values = np.concatenate([random.astype(np.float32), ties.view(np.float32), edge])
    got = bf16_bits(values, chunk=1000)
    want = quants.quantize(values, GGMLQuantizationType.BF16).view(np.uint16)
    np.testing.assert_array_equal(got, want)


def test_uniform_init_draws_matrices_of_the_normal_draws_scale(tmp_path) -> None:
    """The real shapes draw their matrices uniform for speed: mean 0, standard deviation
    1/sqrt(fan_in) as the normal draw's (uniform on [-a, a] has variance a^2 / 3), bounded
    by a = sqrt(3) / sqrt(fan_in); norms keep their normal draw around 1."""
    spec = tiny_spec("llama", d_model=256, d_ff=512,
                     weight_type=GGMLQuantizationType.F32, uniform_init=True)
    with GGUFFile.open(write_synthetic_model(tmp_path / "u.gguf", spec)) as f:
        w = f.tensor_bytes("blk.0.ffn_down.weight").view(np.float32).reshape(256, 512)
        norm = f.tensor_bytes("blk.0.attn_norm.weight").view(np.float32)
        std = 1 / np.sqrt(512)
        assert abs(w.mean()) < 0.02 * std
        assert abs(w.std() / std - 1) < 0.02
        assert np.abs(w).max() <= np.sqrt(3) * std
        assert np.abs(w).max() > 0.99 * np.sqrt(3) * std  # uniform, not normal: a hard edge
        assert abs(norm.mean() - 1) < 0.05


def test_the_default_draw_is_normal(tmp_path) -> None:
    """Tests keep normal weights: beyond sqrt(3) standard deviations there are values."""
    spec = tiny_spec("llama", d_model=256, d_ff=512, weight_type=GGMLQuantizationType.F32)
    with GGUFFile.open(write_synthetic_model(tmp_path / "n.gguf", spec)) as f:
        w = f.tensor_bytes("blk.0.ffn_down.weight").view(np.float32)
        assert np.abs(w).max() > 3 / np.sqrt(512)


@pytest.mark.parametrize("uniform", [False, True], ids=["normal", "uniform"])
@pytest.mark.parametrize("qtype", sorted(RANDOM_BYTE_TYPES, key=lambda q: q.name),
                         ids=lambda q: q.name)
def test_random_block_weights_are_finite_and_of_the_float_draws_scale(tmp_path, qtype,
                                                                      uniform) -> None:
    """gguf-py cannot quantize the K-quants and IQ types, so their blocks are random
    bytes with each block's float16 scale set (IQ1_M's spread over four nibbles) to give
    the block the RMS of its float draw, and a K-quant's minimum so that it averages zero.
    Read back through gguf-py's dequantization: every weight finite, each matrix's mean
    near zero and its standard deviation the draw's (1 for the embedding, 1/sqrt(fan_in)
    for the others) within 10%, nothing beyond 8 of them: a model of random blocks has
    activations of a real model's size, not ones that blow up through the layers. The real
    shapes (uniform_init) draw no values for these types, only the block scales: the same
    holds of them."""
    spec = tiny_spec("llama", d_model=256, head_dim=64, d_ff=512, weight_type=qtype,
                     uniform_init=uniform)
    with GGUFFile.open(write_synthetic_model(tmp_path / "iq.gguf", spec)) as f:
        for name, fan_in in (("token_embd.weight", None), ("blk.0.ffn_down.weight", 512),
                             ("blk.1.attn_q.weight", 256)):
            info = f.tensor_info(name)
            assert info.qtype == qtype
            w = quants.dequantize(f.tensor_bytes(name).reshape(info.shape[0], -1), qtype)
            assert w.shape == info.shape
            std = 1.0 if fan_in is None else 1 / np.sqrt(fan_in)
            assert np.isfinite(w).all(), name
            assert abs(w.std() / std - 1) < 0.1, (name, w.std() / std)
            # (IQ4_NL's codebook itself averages -0.08 of its RMS)
            assert abs(w.mean()) < 0.1 * std, (name, w.mean() / std)
            assert np.abs(w).max() < 8 * std, name


def test_llama3_rope_writes_rope_freqs_as_llama_3_files_hold_them(tmp_path) -> None:
    """Llama 3.x files carry per-pair rope divisors (rope_freqs.weight): 1 for pairs whose
    wavelength is under original_context / 4, the scaling factor for those over
    original_context, rising strictly between. The engine must then read them."""
    from eagerlm.loader.model_file import ModelFile
    from eagerlm.loader.synthetic import SHAPES, llama3_rope_factors

    spec = SHAPES["llama-3.1-8b"]
    factors = llama3_rope_factors(spec)
    wavelength = 2 * np.pi * spec.rope_base ** (np.arange(64) * 2 / spec.head_dim)
    assert (factors[wavelength < 8192 / 4] == 1).all()
    assert (factors[wavelength > 8192] == 8).all()
    between = factors[(wavelength >= 8192 / 4) & (wavelength <= 8192)]
    assert len(between) > 1 and (np.diff(between) > 0).all()

    tiny = tiny_spec("llama", llama3_rope_factor=8.0)
    model = ModelFile.open(write_synthetic_model(tmp_path / "l3.gguf", tiny))
    assert model.config.rope_freq_factors
    np.testing.assert_array_equal(model.gguf.tensor_bytes("rope_freqs.weight").view(np.float32),
                                  llama3_rope_factors(tiny))


def test_the_output_matrix_can_have_its_own_type(tmp_path) -> None:
    """Q4_K_M files hold token_embd as Q4_K and output as Q6_K; `output_type` writes that."""
    Q = GGMLQuantizationType
    spec = tiny_spec("llama", d_model=256, head_dim=64, d_ff=512, weight_type=Q.Q4_K,
                     output_type=Q.Q6_K, uniform_init=True)
    with GGUFFile.open(write_synthetic_model(tmp_path / "m.gguf", spec)) as f:
        assert f.tensor_info("output.weight").qtype == Q.Q6_K
        assert f.tensor_info("token_embd.weight").qtype == Q.Q4_K
        assert f.tensor_info("blk.1.ffn_down.weight").qtype == Q.Q4_K
