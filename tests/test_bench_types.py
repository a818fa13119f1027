"""benchmarks/bench_types.py without llama.cpp: its arguments, its recipe table, and the
whole path from writing a file to the table row on the tiny shape (the type's blocks
written by loader/synthetic.py instead of llama.cpp's quantizer, eagerlm alone); and
benchmarks/profile_cpu_decode.py on a tiny model. Nothing is timed: what is checked is
that every step runs and reports what it measured."""

from __future__ import annotations

import json

import pytest
from gguf import GGMLQuantizationType as Q

from benchmarks import bench_types
from benchmarks.llama_cpp_quantize import ALL_TYPES, RECIPES
from eagerlm.loader.errors import UnsupportedTensorType

TINY_RUN = ["--shapes", "tiny", "--quantizer", "synthetic", "--no-peer", "--decode-tokens",
            "2", "--prompt-tokens", "8", "--requests", "2", "--batch-output", "2",
            "--copy-mib", "1"]


def test_all_types_hold_every_weight_type_llama_cpp_writes_for_a_dense_model() -> None:
    """One recipe per ggml weight type: all of them but the activation-only (Q8_1, Q8_K)
    and integer / float64 tensor types, which no recipe writes."""
    not_weights = {Q.Q8_1, Q.Q8_K, Q.I8, Q.I16, Q.I32, Q.I64, Q.F64}
    assert {RECIPES[name].qtype for name in ALL_TYPES} == set(Q) - not_weights
    assert len(set(ALL_TYPES)) == len(ALL_TYPES)


def test_only_the_recipes_llama_cpp_refuses_without_one_get_an_importance_matrix() -> None:
    """llama.cpp (src/llama-quant.cpp, tensor_requires_imatrix) refuses IQ1_*, IQ2_* and
    IQ3_XXS tensors, and Q2_K in a Q2_K_S file, without an importance matrix."""
    needing = {Q.IQ1_S, Q.IQ1_M, Q.IQ2_XXS, Q.IQ2_XS, Q.IQ2_S, Q.IQ3_XXS}
    for r in RECIPES.values():
        expected = r.qtype in needing or r.name in ("Q2_K_S", "IQ3_XS")
        assert r.needs_imatrix == expected, r.name


def test_unknown_shapes_and_types_are_refused_by_name(capsys) -> None:
    for argv, word in ((["--shapes", "llama-9b"], "llama-9b"), (["--types", "Q4_9"], "Q4_9")):
        with pytest.raises(SystemExit):
            bench_types.parse_args(argv)
        assert word in capsys.readouterr().err
    args = bench_types.parse_args(["--types", "q4_0, Q4_K_M"])
    assert args.type_list == ["Q4_0", "Q4_K_M"]
    assert bench_types.parse_args([]).type_list == list(ALL_TYPES)


def test_a_tiny_run_reports_each_types_figures_and_deletes_its_files(tmp_path, capsys) -> None:
    out = tmp_path / "types.json"
    scratch = tmp_path / "scratch"
    assert bench_types.main([*TINY_RUN, "--types", "Q8_0", "--scratch", str(scratch),
                             "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "| tiny | Q8_0 |" in text and "targets: decode >= 1.0x" in text
    (row,) = json.loads(out.read_text())["rows"]
    ours = row["summary"]["eagerlm"]
    assert ours["decode_tok_s"] > 0 and ours["prompt_tok_s"] > 0 and ours["batch_tok_s"] > 0
    assert row["summary"]["held_ratio"] <= bench_types.HELD_TARGET
    assert row["summary"]["roofline_tok_s"] > 0 and row["plan"]["decode_tokens"] == 2
    assert list(scratch.iterdir()) == []  # measured, then deleted (no --keep)
    assert bench_types.main(["--table-from", str(out), "--bandwidth", "20"]) == 0
    again = capsys.readouterr().out
    assert "Roofline: 20.0 GB/s" in again and "| tiny | Q8_0 |" in again


def test_a_refused_file_is_a_row_and_the_run_goes_on(tmp_path, capsys, monkeypatch) -> None:
    def refuse(*args, **kwargs):
        raise UnsupportedTensorType("tensor 'x' uses ggml type TQ1_0, which is not supported "
                                    "(supported: F32)")
    monkeypatch.setattr(bench_types, "open_measured_model", refuse)
    assert bench_types.main([*TINY_RUN, "--types", "Q8_0,Q4_0",
                             "--scratch", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    for name in ("Q8_0", "Q4_0"):
        assert f"| tiny | {name} |" in text
    assert text.count("refused: tensor 'x' uses ggml type TQ1_0, which is not supported |") == 2


def test_the_decode_profile_accounts_for_every_op_on_a_tiny_model(tmp_path, monkeypatch,
                                                                    capsys) -> None:
    """benchmarks/profile_cpu_decode.py on a 2-layer Q8_0 model: a row per product and
    per other op, the forward without its products, and the fixed costs it measures."""
    import dataclasses
    import sys

    from benchmarks import profile_cpu_decode
    from eagerlm.loader.synthetic import write_synthetic_model

    path = write_synthetic_model(tmp_path / "m.gguf",
                                 dataclasses.replace(bench_types.TINY, weight_type=Q.Q8_0))
    monkeypatch.setattr(sys, "argv", ["profile", "--model", str(path), "--steps", "3",
                                      "--prompt-tokens", "8", "--copy-mib", "1"])
    assert profile_cpu_decode.main() == 0
    out = capsys.readouterr().out
    for row in ("| product wq |", "| product wk |", "| product wv |", "| product w_gate |",
                "| product w_down |", "| product lm_head |", "| attention |", "| rope |",
                "| kv_append |", "| Python between the ops |",
                "without the products", "Q8_0:", "empty parallel region"):
        assert row in out, row
