"""A model in each of a handful of weight types, as llama.cpp's quantizer writes it, gives
llama.cpp's logits within llama.cpp's own noise.

Reference: `tests/fixtures/types_llama_logits.npz`, llama.cpp's top-32 log-probs
(llama-cpp-python 0.3.36, one batched eval of 80 tokens) on a 2-layer llama (hidden 256)
written by llama.cpp's `llama_model_quantize` in each type, every matrix in it; made by
`tests/fixtures/make_types_reference.py`, which documents how. The K-quant and IQ files
are committed (tests/fixtures/types/); the others are rewritten here by
loader/synthetic.py and must hash, tensor for tensor, as llama.cpp's did.

The bound is llama.cpp's noise, measured here: llama.cpp multiplies with its activations
rounded to the weights' dot type (8-bit blocks with one scale per 32 values for the
32-value types, per 256 for the K-quants and IQ4_XS; float16 or bfloat16 for those
types), so its logits are not the exact products of its own weights. How far they are is
the distance from them to the float64 forward of tests/reference_forward.py on the same
file (gguf-py's dequantizer, loader/ggml_quants.py's for Q1_0, no rounding of
activations): over the top 32 log-probs, a mean of 0.001 (F16), 0.011 (BF16), 0.019
(Q1_0), 0.038-0.040 (the 32-value types) and 0.054-0.058 (Q4_K, Q6_K, IQ4_XS) when the
fixture was made, up to 0.37 on one row. eagerlm may round its own activations too
(8-bit, as llama.cpp), independently of llama.cpp, which puts it up to sqrt(2) times that
noise away: the test allows twice the mean distance and four times the KL divergence (KL
grows with the square of a perturbation), and top-1 agreement on every row whose two most
likely tokens llama.cpp separates by more than twice its largest deviation on any row; on
closer rows a top-1 is a tie within noise.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from gguf import GGMLQuantizationType

from eagerlm.kernels.batch import ForwardBatch
from eagerlm.kernels.cpu_backend import cpu_transformer
from eagerlm.loader.model_file import ModelFile
from eagerlm.loader.synthetic import write_synthetic_model
from eagerlm.vmm.kv_layout import ContiguousKV, KVLayout
from tests.fixtures.make_types_reference import (
    FIXTURES,
    OUT_PATH,
    divergence,
    log_softmax64,
    spec,
    tensor_sha256,
)
from tests.reference_forward import reference_logits

FIXTURE = np.load(OUT_PATH)
CASES = {c["type"]: c for c in json.loads(str(FIXTURE["cases"]))["types"]}
TOKENS = FIXTURE["tokens"]
# rows of one forward each: many rows (the tiles, or gemv in runs: `prompt_run_rows`), a few
# (a decode batch), then one by one
SPLITS = ((0, 66), (66, 76), *((i, i + 1) for i in range(76, len(TOKENS))))


def model_file(name: str, tmp_path) -> str:
    case = CASES[name]
    if case["file"]:
        path = FIXTURES / case["file"]
    else:
        path = write_synthetic_model(tmp_path / f"{name}.gguf",
                                     spec(GGMLQuantizationType[name]))
    assert tensor_sha256(path) == case["tensor_sha256"], (
        "not the file llama.cpp wrote: regenerate with tests/fixtures/make_types_reference.py")
    return str(path)


def eagerlm_logprobs(path: str) -> np.ndarray:
    model = ModelFile.open(path)
    cfg = model.config
    tf = cpu_transformer(model)
    kv = ContiguousKV(KVLayout(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim), len(TOKENS))
    logits = [tf.forward(ForwardBatch.single(TOKENS[a:b], a, kv, np.arange(b - a)))
              for a, b in SPLITS]
    return log_softmax64(np.concatenate(logits))


def test_the_fixture_covers_the_types_and_stays_small() -> None:
    assert set(CASES) >= {"F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K", "IQ4_NL",
                          "IQ4_XS", "Q1_0"}
    committed = sum((FIXTURES / c["file"]).stat().st_size for c in CASES.values() if c["file"])
    assert committed + OUT_PATH.stat().st_size < 3_000_000


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CASES))
def test_logits_agree_with_llama_cpp_within_its_own_noise(tmp_path, name) -> None:
    path = model_file(name, tmp_path)
    ids = FIXTURE[f"{name}_top_ids"].astype(np.int64)
    theirs = FIXTURE[f"{name}_top_logprobs"].astype(np.float64)
    exact = log_softmax64(reference_logits(path, [int(t) for t in TOKENS]))
    noise = divergence(ids, theirs, exact)
    ours = eagerlm_logprobs(path)
    dev = divergence(ids, theirs, ours)

    assert dev["mean_abs_logprob"] <= 2 * noise["mean_abs_logprob"], (dev, noise)
    assert dev["kl"] <= 4 * noise["kl"], (dev, noise)
    worst_row = np.abs(theirs - np.take_along_axis(exact, ids, axis=1)).max()
    clear = theirs[:, 0] - theirs[:, 1] > 2 * worst_row
    assert clear.sum() >= len(TOKENS) // 4  # the check below has rows to check
    np.testing.assert_array_equal(ours.argmax(axis=1)[clear], ids[clear, 0])
