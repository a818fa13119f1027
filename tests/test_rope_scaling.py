"""YaRN rope scaling, as llama.cpp implements it, and the user's rope scaling override.

References, each independent of the code under test:
- the numpy op against the formulas of llama.cpp (ggml.c `ggml_rope_yarn_corr_dims`,
  ggml-cpu/ops.cpp `rope_yarn_ramp` / `rope_yarn`, llama-context.cpp's
  `yarn_attn_factor`), re-derived here in float64 scalar loops; and against YaRN's defining
  limits (Peng et al. 2023, "YaRN: Efficient Context Window Extension of Large Language
  Models", sec. 3.2-3.4): dimensions that turn more than beta_fast times over the
  original context keep their angle, those that turn fewer than beta_slow times are
  interpolated by the factor, and attention logits are scaled by (0.1 ln s + 1)^2;
- whole models against llama.cpp's own logits (llama-cpp-python 0.3.36, CPU) on synthetic
  qwen3 and gemma3 models at positions up to 2.5x past the original context, stored in
  `fixtures/yarn_llama_logits.npz` by `fixtures/make_yarn_reference.py`;
- config reading against files written by gguf-py's writer (loader/synthetic.py).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from eagerlm.kernels.batch import ForwardBatch
from eagerlm.kernels.cpu_backend import cpu_transformer
from eagerlm.kernels.numpy_ops import NumpyOps
from eagerlm.loader.config import (
    ContextTooLong,
    RopeOverride,
    RopeParams,
    RopeScalingType,
    RopeStyle,
)
from eagerlm.loader.errors import InvalidMetadata
from eagerlm.loader.model_file import ModelFile
from eagerlm.loader.synthetic import tiny_spec, write_synthetic_model
from eagerlm.service.api.engine_settings import EngineSettings
from eagerlm.service.cli.commands import main
from eagerlm.service.measure.perplexity import perplexity
from eagerlm.vmm.kv_layout import ContiguousKV, KVLayout
from tests.fixtures.make_yarn_reference import CASES, OUT_PATH, case_spec, case_tokens

YARN = RopeScalingType.YARN
OPS = NumpyOps()


def _ggml_yarn_angles(p: float, *, dim: int, base: float, freq_scale: float,
                      n_ctx_orig: int, beta_fast: float, beta_slow: float,
                      attn_factor_file: float = 1.0) -> tuple[list[float], float]:
    """(angle of each pair, cos/sin multiplier) at position p with YaRN on, written out
    from llama.cpp's formulas (see the module docstring), in float64."""

    def corr_dim(n_rot: float) -> float:  # the pair index that turns n_rot times
        return dim * math.log(n_ctx_orig / (n_rot * 2 * math.pi)) / (2 * math.log(base))

    low = max(0.0, math.floor(corr_dim(beta_fast)))
    high = min(dim - 1.0, math.ceil(corr_dim(beta_slow)))
    angles = []
    for i in range(dim // 2):
        extrap = p * base ** (-2.0 * i / dim)
        interp = freq_scale * extrap
        ramp = 1 - min(1.0, max(0.0, (i - low) / max(0.001, high - low)))
        angles.append(interp * (1 - ramp) + extrap * ramp)
    s = 1 / freq_scale
    # cparams.yarn_attn_factor = get_mscale(s) / (1 + 0.1 ln s) * file's attn_factor, then
    # rope_yarn multiplies by 1 + 0.1 ln(1 / freq_scale)
    get_mscale = 0.1 * math.log(s) + 1 if s > 1 else 1.0
    attn = get_mscale / (1 + 0.1 * math.log(s)) * attn_factor_file
    return angles, attn * (1 + 0.1 * math.log(1 / freq_scale))


def _rotate(v: np.ndarray, angles: list[float], m: float, neox: bool) -> np.ndarray:
    out = v.astype(np.float64).copy()
    d = 2 * len(angles)
    for i, t in enumerate(angles):
        a, b = (i, i + d // 2) if neox else (2 * i, 2 * i + 1)
        out[a] = m * (v[a] * math.cos(t) - v[b] * math.sin(t))
        out[b] = m * (v[a] * math.sin(t) + v[b] * math.cos(t))
    return out


# -- the op ------------------------------------------------------------------------------


@pytest.mark.parametrize("style", [RopeStyle.NEOX, RopeStyle.NORM])
@pytest.mark.parametrize("dim, base, orig, scale", [
    (128, 1e6, 32768, 4.0),  # Qwen3 with the model card's YaRN settings
    (64, 10000.0, 4096, 8.0),
    (32, 500000.0, 2048, 2.0),
])
def test_numpy_yarn_rope_matches_llama_cpp_formulas(style, dim, base, orig, scale):
    rng = np.random.default_rng(0)
    positions = np.array([0, 1, 100, orig - 1, orig, 3 * orig + 7, int(scale * orig) - 1])
    x = rng.standard_normal((len(positions), 2, dim + 16)).astype(np.float32)  # 16 unrotated
    rope = RopeParams(style=style, dim=dim, base=base, freq_scale=1 / scale, ext_factor=1.0,
                      attn_factor=1.0, original_context=orig)
    got = OPS.rope(x, positions, rope)
    for t, p in enumerate(positions):
        angles, m = _ggml_yarn_angles(float(p), dim=dim, base=base, freq_scale=1 / scale,
                                      n_ctx_orig=orig, beta_fast=32.0, beta_slow=1.0)
        for h in range(2):
            want = _rotate(x[t, h, :dim], angles, m, style is RopeStyle.NEOX)
            np.testing.assert_allclose(got[t, h, :dim], want, rtol=0, atol=2e-6 * m * 8)
            np.testing.assert_array_equal(got[t, h, dim:], x[t, h, dim:])


def test_yarn_keeps_fast_dimensions_and_interpolates_slow_ones():
    """YaRN's defining limits: a pair that turns more than beta_fast times over the original
    context has its plain angle, one that turns fewer than beta_slow times the angle / s;
    every |output| is |input| x (0.1 ln s + 1). (1-d rotations read off cos and sin.)"""
    dim, base, orig, s = 128, 1e6, 32768, 4.0
    rope = RopeParams(style=RopeStyle.NEOX, dim=dim, base=base, freq_scale=1 / s,
                      ext_factor=1.0, attn_factor=1.0, original_context=orig)
    p = 100_000
    half = dim // 2
    x = np.zeros((half, 1, dim), np.float32)
    x[np.arange(half), 0, np.arange(half)] = 1.0  # row i: the unit vector of pair i
    out = OPS.rope(x, np.full(half, p), rope)[:, 0, :]
    cos, sin = out[np.arange(half), np.arange(half)], out[np.arange(half), np.arange(half) + half]
    mscale = 0.1 * math.log(s) + 1
    np.testing.assert_allclose(np.hypot(cos, sin), mscale, rtol=1e-6)
    turns = orig * base ** (-2.0 * np.arange(half) / dim) / (2 * math.pi)
    angle = np.arctan2(sin, cos)
    plain = p * base ** (-2.0 * np.arange(half) / dim)

    def wrapped(a: np.ndarray) -> np.ndarray:
        return np.angle(np.exp(1j * a))

    fast, slow = turns > 32, turns < 1
    assert fast.sum() >= 20 and slow.sum() >= 20
    np.testing.assert_allclose(angle[fast], wrapped(plain[fast]), atol=1e-4)
    np.testing.assert_allclose(angle[slow], wrapped(plain[slow] / s), atol=1e-4)
    assert (~fast & ~slow).sum() >= 5  # a blended band (its values: the formula test above)


def test_yarn_off_is_plain_linear_rope():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((4, 2, 64)).astype(np.float32)
    pos = np.array([0, 10, 5000, 70000])
    linear = RopeParams(style=RopeStyle.NEOX, dim=64, base=1e4, freq_scale=0.5)
    unscaled = RopeParams(style=RopeStyle.NEOX, dim=64, base=1e4)
    np.testing.assert_allclose(OPS.rope(x, pos, linear), OPS.rope(x, pos // 2, unscaled),
                               atol=1e-6)


# -- whole models against llama.cpp --------------------------------------------------------


@pytest.fixture(scope="module")
def llama_reference():
    return np.load(OUT_PATH)


def _overrides(case: str) -> RopeOverride | None:
    """The case's llama.cpp context parameters as our override (the fixture's CASES)."""
    params = CASES[case][1]
    if not params:
        return None
    return RopeOverride(YARN, 1 / params["rope_freq_scale"], params["yarn_orig_ctx"])


def _logits(path, rope: RopeOverride | None, tokens: np.ndarray, rows: np.ndarray):
    model = ModelFile.open(path, rope=rope)
    c = model.config
    kv = ContiguousKV(KVLayout(c.n_layers, c.n_kv_heads, c.head_dim), len(tokens))
    return cpu_transformer(model).forward(ForwardBatch.single(list(tokens), 0, kv, rows))


# llama.cpp's cpu GELU goes through a float16 table (ggml-cpu/vec.h GGML_GELU_FP16), which
# moves gemma3's logits by ~1e-4 of their range; qwen3 agrees to ~1e-6.
TOLERANCE = {"qwen3_file": 1e-4, "qwen3_override": 1e-4, "gemma3_file": 1e-3}


@pytest.mark.parametrize("case", list(CASES))
def test_forward_matches_llama_cpp_past_the_original_context(tmp_path, case,
                                                              llama_reference):
    spec = case_spec(case)
    path = write_synthetic_model(tmp_path / f"{case}.gguf", spec)
    tokens = llama_reference[f"{case}/tokens"]
    rows = llama_reference[f"{case}/rows"]
    ref = llama_reference[f"{case}/logits"]
    np.testing.assert_array_equal(tokens, case_tokens(case, spec.vocab_size))
    assert rows.max() >= 2 * 128  # positions far past the original context of 128
    tol = TOLERANCE[case] * np.abs(ref).max()
    ours = _logits(path, _overrides(case), tokens, rows)
    np.testing.assert_allclose(ours, ref, rtol=0, atol=tol)
    # the comparison sees rope scaling: the unscaled rope misses by far more than `tol`
    plain = _logits(path, RopeOverride(RopeScalingType.NONE), tokens, rows)
    assert np.abs(plain - ref)[rows > 128].max() > 50 * tol


# -- reading the file -------------------------------------------------------------------


def _config(tmp_path, rope: RopeOverride | None = None, **spec):
    path = write_synthetic_model(tmp_path / "m.gguf", tiny_spec(spec.pop("arch", "qwen3"),
                                                                **spec))
    return ModelFile.open(path, rope=rope).config


def test_yarn_keys_are_read_with_llama_cpp_defaults(tmp_path):
    cfg = _config(tmp_path, context_length=32768, rope_base=1e6, rope_scaling="yarn",
                  rope_scaling_factor=4.0, rope_original_context=32768, rope_attn_factor=0.5)
    s = cfg.rope_scaling
    assert (s.type, s.factor, s.original_context, s.attn_factor) == (YARN, 4.0, 32768, 0.5)
    assert (s.beta_fast, s.beta_slow) == (32.0, 1.0)  # llama.cpp's for these architectures
    assert (cfg.context_length, cfg.max_context) == (32768, 131072)
    rope = cfg.layer_rope(0)
    assert (rope.freq_scale, rope.ext_factor, rope.original_context) == (0.25, 1.0, 32768)
    assert rope.mscale == pytest.approx(0.5 * (1 + 0.1 * math.log(4)))
    # without the optional keys: original context = the trained one, attn_factor 1
    cfg = _config(tmp_path, context_length=4096, rope_scaling="yarn", rope_scaling_factor=2.0)
    assert (cfg.rope_scaling.original_context, cfg.rope_scaling.attn_factor) == (4096, 1.0)
    assert cfg.max_context == 8192


def test_file_without_scaling_keys_is_unscaled(tmp_path):
    cfg = _config(tmp_path, context_length=4096)
    rope = cfg.layer_rope(0)
    assert (rope.freq_scale, rope.ext_factor, rope.mscale) == (1.0, 0.0, 1.0)
    assert cfg.max_context == cfg.context_length == 4096


def test_gemma3_sliding_window_layers_keep_their_own_rope_under_yarn(tmp_path):
    """llama.cpp: sliding-window layers use rope_freq_base_train_swa and freq_scale 1 but
    the context's ext_factor / attn_factor, so YaRN's mscale cancels there."""
    cfg = _config(tmp_path, arch="gemma3", n_layers=6, rope_base=1e6, rope_scaling="yarn",
                  rope_scaling_factor=8.0, rope_original_context=1024)
    local, glob = cfg.layer_rope(0), cfg.layer_rope(5)
    assert cfg.is_swa(0) and not cfg.is_swa(5)
    assert (local.base, local.freq_scale, local.ext_factor) == (1e4, 1.0, 1.0)
    assert local.mscale == pytest.approx(1.0)
    assert (glob.base, glob.freq_scale) == (1e6, 0.125)
    assert glob.mscale == pytest.approx(1 + 0.1 * math.log(8))


@pytest.mark.parametrize("scaling, factor, error, message", [
    ("yarn", -2.0, InvalidMetadata, "-2 is out of range.*rope.scaling.factor"),
])
def test_unsupported_or_bad_scaling_in_the_file_is_refused(tmp_path, scaling, factor,
                                                           error, message):
    with pytest.raises(error, match=message):
        _config(tmp_path, rope_scaling=scaling, rope_scaling_factor=factor)


def test_longrope_scales_positions_as_llama_cpp_does(tmp_path):
    """llama.cpp's LONGROPE type: any type but none takes freq_scale = 1 / factor, and only
    YaRN has an ext_factor; its per-frequency factors are tensors of their own
    (rope_factors_long / _short, tests/test_architectures_vs_llama_cpp.py's phi3 cases)."""
    rope = _config(tmp_path, rope_scaling="longrope", rope_scaling_factor=4.0).layer_rope(0)
    assert (rope.freq_scale, rope.ext_factor) == (0.25, 0.0)


# -- the user's override ----------------------------------------------------------------


def test_override_qwen_model_card_settings(tmp_path):
    """`--rope-scaling yarn --rope-scale 4 --yarn-orig-ctx 32768` on a Qwen3 file (trained
    context 40960, no scaling): the context reaches 131072 = 32768 x 4 (llama.cpp sets
    n_ctx_train to n_ctx_orig_yarn / freq_scale); the default stays the trained one."""
    cfg = _config(tmp_path, RopeOverride(YARN, 4.0, 32768), context_length=40960)
    assert cfg.rope_scaling.type is YARN and cfg.layer_rope(0).freq_scale == 0.25
    assert cfg.layer_rope(0).original_context == 32768
    assert cfg.max_context == 131072
    assert cfg.context_for(None) == 40960
    assert cfg.context_for(131072) == 131072
    with pytest.raises(ContextTooLong, match="131072 tokens that yarn rope scaling by 4 "
                                             "from an original context of 32768"):
        cfg.context_for(131073)


def test_override_keeps_what_it_does_not_name(tmp_path):
    yarn_file = dict(context_length=8192, rope_scaling="yarn", rope_scaling_factor=4.0,
                     rope_original_context=8192)
    cfg = _config(tmp_path, RopeOverride(factor=2.0), **yarn_file)  # --rope-scale 2 alone
    assert (cfg.rope_scaling.type, cfg.rope_scaling.original_context) == (YARN, 8192)
    assert cfg.max_context == 16384
    cfg = _config(tmp_path, RopeOverride(RopeScalingType.NONE), **yarn_file)
    assert cfg.layer_rope(0).freq_scale == 1.0 and cfg.layer_rope(0).ext_factor == 0.0
    assert cfg.max_context == 8192  # the unscaled rope's context
    # a linearly scaled file's context counts its factor: the override replaces it
    cfg = _config(tmp_path, RopeOverride(RopeScalingType.LINEAR, 2.0), context_length=8192,
                  rope_scaling="linear", rope_scaling_factor=4.0)
    assert (cfg.layer_rope(0).freq_scale, cfg.max_context) == (0.5, 4096)


def test_context_beyond_the_trained_one_needs_scaling(tmp_path):
    cfg = _config(tmp_path, context_length=256)
    assert cfg.context_for(None) == 256 and cfg.context_for(100) == 100
    with pytest.raises(ContextTooLong, match="--ctx 257 exceeds the model's context length "
                                             "256; rope scaling can extend it"):
        cfg.context_for(257)


@pytest.mark.parametrize("override, message", [
    (dict(factor=0.0), "--rope-scale must be a positive number"),
    (dict(factor=float("nan")), "--rope-scale must be a positive number"),
    (dict(original_context=0), "--yarn-orig-ctx must be a positive number"),
    (dict(scaling=RopeScalingType.NONE, factor=2.0), "does not apply with --rope-scaling none"),
    (dict(scaling=YARN, factor=0.5), "--rope-scale must be at least 1"),
])
def test_impossible_override_values_are_refused(override, message):
    with pytest.raises(ValueError, match=message):
        RopeOverride(**override)


@pytest.mark.parametrize("file_scaling, override, message", [
    (None, RopeOverride(YARN), "--rope-scaling yarn needs --rope-scale F"),
    # an explicit type none (as converters write it): llama.cpp would ignore --rope-scale
    ("none", RopeOverride(factor=4.0), "model's rope scaling type is none"),
    (None, RopeOverride(RopeScalingType.LINEAR, 2.0, 1024), "--yarn-orig-ctx applies only"),
])
def test_override_that_does_not_fit_the_model_is_refused(tmp_path, file_scaling, override,
                                                         message):
    path = write_synthetic_model(tmp_path / "m.gguf",
                                 tiny_spec("qwen3", rope_scaling=file_scaling))
    with pytest.raises(ValueError, match=message):
        ModelFile.open(path, rope=override)


def test_engine_settings_check_the_override_on_construction():
    assert EngineSettings().rope_override() is None
    assert EngineSettings(rope_scaling="yarn", rope_scale=4.0,
                          yarn_orig_ctx=32768).rope_override() == RopeOverride(YARN, 4.0, 32768)
    with pytest.raises(ValueError, match="--rope-scaling must be one of none, linear, yarn"):
        EngineSettings(rope_scaling="ntk")
    with pytest.raises(ValueError, match="--rope-scale must be a positive number"):
        EngineSettings(rope_scaling="yarn", rope_scale=-1.0)


# -- the CLI ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("m") / "qwen3.gguf"
    return str(write_synthetic_model(path, tiny_spec("qwen3", context_length=64)))


def test_cli_yarn_allows_a_longer_context(small_model, capsys):
    prompt = " ".join(["word"] * 90)
    assert len(ModelFile.open(small_model).tokenizer.encode(prompt)) > 64  # the trained ctx
    base = ["generate", "-m", small_model, "-p", prompt, "-n", "3", "-t", "0", "-q"]
    assert main([*base, "--ctx", "128"]) == 2
    assert "--ctx 128 exceeds the model's context length 64" in capsys.readouterr().err
    assert main([*base, "--ctx", "128", "--rope-scaling", "yarn", "--rope-scale", "2"]) == 0
    assert "generated 3 tokens" in capsys.readouterr().err
    assert main([*base, "--ctx", "129", "--rope-scaling", "yarn", "--rope-scale", "2"]) == 2
    assert "exceeds the 128 tokens that yarn rope scaling by 2" in capsys.readouterr().err


@pytest.mark.parametrize("flags, message", [
    (["--rope-scaling", "ntk"], "invalid choice: 'ntk'"),
    (["--rope-scale", "x"], "invalid float value: 'x'"),
    (["--rope-scale", "-4"], "--rope-scale must be a positive number"),
    (["--rope-scaling", "none", "--rope-scale", "2"], "does not apply with --rope-scaling none"),
    (["--yarn-orig-ctx", "-1"], "--yarn-orig-ctx must be a positive number"),
    (["--rope-scaling", "yarn"], "--rope-scaling yarn needs --rope-scale F"),
])
def test_cli_bad_rope_flags_exit_2_with_the_reason(small_model, capsys, flags, message):
    try:
        status = main(["generate", "-m", small_model, "-p", "hi", "-q", *flags])
    except SystemExit as e:  # refused by argparse itself (a choice, a number's syntax)
        status = e.code
    assert status == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_perplexity_context_follows_the_rope_scaling(small_model, tmp_path, capsys):
    model = ModelFile.open(small_model)
    tf = cpu_transformer(model)
    text = "the quick brown fox jumps over the lazy dog " * 40
    with pytest.raises(ContextTooLong, match="--ctx 96 exceeds the model's context length 64"):
        perplexity(tf, model.tokenizer, text, 96)
    f = tmp_path / "t.txt"
    f.write_text(text)
    assert main(["perplexity", "-m", small_model, str(f), "--ctx", "96", "-q",
                 "--rope-scaling", "yarn", "--rope-scale", "2"]) == 0
    assert capsys.readouterr().out.startswith("perplexity: ")


def test_rope_params_are_per_model_constants(tmp_path):
    """What the forward hands to every rope launch is fixed per layer (CUDA graphs capture
    it): equal and hashable across calls."""
    cfg = _config(tmp_path, RopeOverride(YARN, 4.0, 1024))
    assert cfg.layer_rope(1) == cfg.layer_rope(1)
    assert hash(cfg.layer_rope(1)) == hash(dataclasses.replace(cfg.layer_rope(1)))
