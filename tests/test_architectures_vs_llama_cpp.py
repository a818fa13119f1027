"""Every architecture's forward agrees with llama.cpp's on the same file.

Reference: `tests/fixtures/arch_llama_logits.npz`, llama.cpp's logits (llama-cpp-python
0.3.36, CPU, f32 K/V cache, one batched eval) for small synthetic models with float32
weights, made by `tests/fixtures/make_arch_reference.py`, which documents the settings.
Each model is rewritten here from its recorded spec and must hash as it did then.

With float32 weights llama.cpp multiplies in float32 without quantizing activations, so
its logits differ from ours by float32 rounding only (measured when the fixture was made:
at most 7e-7 of the largest logit for llama, qwen2, qwen3, qwen3moe, Mixtral-style llama,
gpt-oss and phi3 with and without LongRoPE); gemma3 reads GELU from an fp16 table (at most
1.2e-4); gpt-oss with MXFP4 experts multiplies them by activations llama.cpp quantizes to
8 bits (1.8e-2, every argmax equal). The bounds below sit a few times above those.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from eagerlm.kernels.batch import ForwardBatch
from eagerlm.kernels.cpu_backend import cpu_transformer
from eagerlm.loader.model_file import ModelFile
from eagerlm.loader.synthetic import write_synthetic_model
from eagerlm.vmm.kv_layout import ContiguousKV, KVLayout
from tests.fixtures.make_arch_reference import case_spec

FIXTURE = np.load(Path(__file__).parent / "fixtures" / "arch_llama_logits.npz")
CASES = {case["name"]: case for case in json.loads(str(FIXTURE["cases"]))}
# largest |ours - llama.cpp| allowed, as a fraction of the largest |logit|
BOUND = {"gemma3": 5e-4, "gpt-oss-mxfp4": 5e-2}
DEFAULT_BOUND = 5e-6


def test_the_fixture_covers_every_architecture() -> None:
    from eagerlm.loader.architectures import SUPPORTED_ARCHITECTURES

    assert {c["spec"]["architecture"] for c in CASES.values()} == set(SUPPORTED_ARCHITECTURES)


@pytest.mark.parametrize("name", sorted(CASES))
def test_logits_equal_llama_cpps_to_float32_rounding(tmp_path, name) -> None:
    case = CASES[name]
    path = write_synthetic_model(tmp_path / f"{name}.gguf", case_spec(case["spec"]))
    assert hashlib.sha256(path.read_bytes()).hexdigest() == case["sha256"], (
        "the synthetic writer no longer writes the file llama.cpp was run on: regenerate "
        "the fixture with tests/fixtures/make_arch_reference.py (needs llama-cpp-python)")
    tokens = FIXTURE[f"{name}_tokens"]
    ref = FIXTURE[f"{name}_logits"]

    model = ModelFile.open(path)
    cfg = model.config
    kv = ContiguousKV(KVLayout(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim), len(tokens))
    ours = cpu_transformer(model).forward(
        ForwardBatch.single(tokens, 0, kv, np.arange(len(tokens))))

    assert ours.shape == ref.shape
    bound = BOUND.get(name, DEFAULT_BOUND)
    err = np.abs(ours - ref).max() / np.abs(ref).max()
    assert err < bound, err
    # the same top token on every row whose two best logits llama.cpp separates by more
    # than twice the bound (a nearer tie may go either way within it: gpt-oss-mxfp4's
    # 8-bit activations round differently from llama.cpp's)
    top2 = np.sort(ref, axis=-1)[:, -2:]
    separated = (top2[:, 1] - top2[:, 0]) > 2 * bound * np.abs(ref).max()
    assert separated.any()
    assert (ours.argmax(-1) == ref.argmax(-1))[separated].all()
