"""The architecture registry (loader/architectures.py): every family's files read back as
the synthetic writer meant them, and what a family cannot be is refused by name."""

from __future__ import annotations

import dataclasses

import pytest

from eagerlm.errors import UnsupportedModel
from eagerlm.loader.architectures import SUPPORTED_ARCHITECTURES, Keys, config_from_keys
from eagerlm.loader.config import ExpertGating
from eagerlm.loader.errors import ModelFileError
from eagerlm.loader.model_file import ModelFile
from eagerlm.loader.synthetic import tiny_spec, write_synthetic_model


@pytest.mark.parametrize("arch", SUPPORTED_ARCHITECTURES)
def test_a_written_file_reads_back_with_the_config_its_writer_planned(tmp_path, arch):
    spec = tiny_spec(arch)
    model = ModelFile.open(write_synthetic_model(tmp_path / f"{arch}.gguf", spec))
    planned = spec.tensor_config()
    # the writer leaves the rope scaling out of its plan (it decides no tensor); the file
    # holds float32 values
    assert model.config.norm_eps == pytest.approx(planned.norm_eps, rel=1e-6)
    assert dataclasses.replace(model.config, rope_scaling=planned.rope_scaling,
                               rope_scale_swa=planned.rope_scale_swa,
                               norm_eps=planned.norm_eps) == planned


def test_the_families_route_their_experts_as_llama_cpp_does(tmp_path):
    def moe(arch, **kw):
        return tiny_spec(arch, **kw).tensor_config().moe

    assert (moe("qwen3moe").gating, moe("qwen3moe").normalize) == (ExpertGating.SOFTMAX, True)
    oss = moe("gpt-oss")
    assert (oss.gating, oss.normalize, oss.biases) == (ExpertGating.SOFTMAX_WEIGHT, False, True)
    mixtral = moe("llama", n_experts=4, n_experts_used=2, d_ff=96)
    assert (mixtral.gating, mixtral.normalize, mixtral.d_ff) == (ExpertGating.SOFTMAX, True, 96)
    assert tiny_spec("llama").tensor_config().moe is None


def _keys(arch: str, **changes: object) -> Keys:
    metadata = tiny_spec(arch).model_metadata()
    metadata.update({f"{arch}.{k}": v for k, v in changes.items()})
    return Keys(metadata, {"output.weight"}, arch, "test.gguf")


def test_more_experts_used_than_there_are_is_refused_naming_the_key():
    with pytest.raises(ModelFileError, match="9 experts used per token of 8") as e:
        config_from_keys(_keys("qwen3moe", expert_used_count=9), 512)
    assert e.value.field == "qwen3moe.expert_used_count"


def test_a_family_without_experts_refuses_an_expert_count():
    with pytest.raises(UnsupportedModel, match="mixture-of-experts qwen3 models"):
        config_from_keys(_keys("qwen3", expert_count=8, expert_used_count=2), 512)


def test_an_expert_tensor_of_the_wrong_shape_is_named(tmp_path):
    from eagerlm.kernels.cpu_backend import cpu_transformer
    from eagerlm.loader.errors import GGUFFormatError

    good = write_synthetic_model(tmp_path / "a.gguf", tiny_spec("qwen3moe"))
    model = ModelFile.open(good)
    cfg = dataclasses.replace(model.config, moe=dataclasses.replace(model.config.moe,
                                                                    d_ff=48))
    model.config = cfg
    with pytest.raises(GGUFFormatError, match="ffn_gate_exps.weight' has shape"):
        cpu_transformer(model)
