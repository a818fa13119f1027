"""A mixture of experts' expert tensors on the cpu backend: read in place from a
copy-on-write map of the file, never copied, and not counted as memory the backend holds
(`ModelTooLarge` counts the rest), so a model whose experts alone exceed the memory still
loads; the tokens then read the experts they use through the page cache."""

from __future__ import annotations

import mmap

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from eagerlm.errors import ModelTooLarge
from eagerlm.kernels import cpu_backend
from eagerlm.kernels.cpu_backend import cpu_transformer, held_bytes, mapped_bytes
from eagerlm.kernels.cpu_moe import ExpertMatrices
from eagerlm.loader.model_file import ModelFile
from eagerlm.loader.synthetic import tiny_spec, write_synthetic_model


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    spec = tiny_spec("qwen3moe", weight_type=Q.Q8_0, n_experts=32, d_ff_expert=128)
    path = write_synthetic_model(tmp_path_factory.mktemp("mapped") / "moe.gguf", spec)
    return ModelFile.open(path)


def _base(a: np.ndarray) -> object:
    """What an array's memory finally belongs to (numpy keeps a memoryview of a buffer)."""
    base: object = a
    while isinstance(base, np.ndarray) and base.base is not None:
        base = base.base
    return base.obj if isinstance(base, memoryview) else base


def test_the_experts_are_views_of_the_files_map(model) -> None:
    tf = cpu_transformer(model)
    for i, layer in enumerate(tf.weights.layers):
        for experts in (layer.moe.gate, layer.moe.up, layer.moe.down):
            assert isinstance(experts, ExpertMatrices) and experts.mapped
            assert isinstance(_base(experts.blocks), mmap.mmap)  # not a copy
            # writable, so the kernels take it as they take their own arrays: a private map
            assert experts.blocks.flags.writeable
        raw = model.gguf.tensor_bytes(f"blk.{i}.ffn_down_exps.weight")
        np.testing.assert_array_equal(layer.moe.down.blocks.reshape(-1), raw)


def test_too_large_counts_what_is_held_not_the_mapped_experts(model, monkeypatch) -> None:
    """The need is everything but the experts; with only that much memory the model loads
    though its file is several times larger, and with a byte less it is refused."""
    experts = mapped_bytes(model, "quantized")
    need = held_bytes(model, "quantized")
    assert experts == sum(t.n_bytes for t in model.gguf.tensors.values() if len(t.shape) == 3)
    assert experts > 2 * need  # most of the file
    monkeypatch.setattr(cpu_backend, "available_memory", lambda: need)
    tf = cpu_transformer(model)
    held = sum(w.nbytes for w in tf.weights.handles() if not isinstance(w, ExpertMatrices))
    assert held == need
    monkeypatch.setattr(cpu_backend, "available_memory", lambda: need - 1)
    with pytest.raises(ModelTooLarge):
        cpu_transformer(model)


def test_float_weights_copy_the_experts_and_count_them(model) -> None:
    """--weights float dequantizes everything, experts included, and counts it."""
    assert mapped_bytes(model, "float") == 0
    assert held_bytes(model, "float") == 4 * sum(t.n_elements
                                                  for t in model.gguf.tensors.values())
