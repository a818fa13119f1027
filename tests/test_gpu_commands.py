"""The GPU benchmark scripts and the `eagerlm` commands with `--device cuda` run end to end
on the emulated GPU (tests/emulated_gpu/gpu_emulator.py), in CI-sized settings. A script that would
crash on the device costs one of the rare GPU sessions its minutes; here it costs a red CI
instead. Nothing is timed: the emulator's speed says nothing about a GPU's. What is
checked is that each completes and reports: a benchmark, the physical limit it compares
with and the figures beside it; a command, what it does on the cpu backend."""

from __future__ import annotations

import importlib
import json
import re
import sys

import pytest

from tests.emulated_gpu.gpu_emulator import emulated_gpu_for_test


@pytest.fixture
def emulator():
    with emulated_gpu_for_test() as drv:
        yield drv


def run_script(name: str, argv: list[str], monkeypatch, capsys) -> str:
    """`python benchmarks/NAME.py ARGV...`, in this process (so on the emulated GPU)."""
    module = importlib.import_module(f"benchmarks.{name}")
    monkeypatch.setattr(sys, "argv", [f"{name}.py", *argv])
    assert module.main() in (0, None)
    out = capsys.readouterr().out
    assert "nothing measured" not in out, out
    return out


def json_block(out: str) -> dict:
    match = re.search(r"```json\n(.*)\n```", out, re.S)
    assert match, out
    return json.loads(match.group(1))


def test_bench_gemm(emulator, monkeypatch, capsys) -> None:
    out = run_script("bench_gemm", ["--models", "qwen3-0.6b", "--layers", "q", "down",
                                    "--tokens", "1", "16", "--peak-dim", "128",
                                    "--copy-mib", "1", "--reps", "1"], monkeypatch, capsys)
    assert "measured matrix rate (128^3 bf16)" in out
    result = json_block(out)
    assert [(r["layer"], r["tokens"]) for r in result["rows"]] == [
        ("q", 1), ("q", 16), ("down", 1), ("down", 16)]
    assert all(r["tflops"] > 0 and r["of_hbm"] > 0 for r in result["rows"])
    assert result["quantized_rows"] == []


def test_bench_gemm_times_weights_kept_as_blocks_by_both_paths(emulator, monkeypatch,
                                                               capsys) -> None:
    out = run_script("bench_gemm", ["--models", "qwen3-0.6b", "--layers", "q", "--tokens",
                                    "1", "16", "--peak-dim", "128", "--copy-mib", "1",
                                    "--reps", "1", "--quantized", "q4_k"], monkeypatch, capsys)
    assert "weights as GGUF blocks" in out
    rows = json_block(out)["quantized_rows"]
    assert [(r["type"], r["tokens"], r["chosen"]) for r in rows] == [
        ("q4_k", 1, "gemv"), ("q4_k", 16, "tile")]
    assert rows[0]["gemv_us"] > 0 and rows[0]["gemv8_us"] > 0
    assert rows[1]["gemv_us"] is None and rows[1]["gemv8_us"] is None  # 16 rows: tiles only
    assert all(r["tile_us"] > 0 and r["bf16_us"] > 0 and r["of_hbm"] > 0 for r in rows)
    assert rows[0]["weight_bytes"] == 2048 * 1024 // 256 * 144


def test_bench_gemm_takes_every_weight_type(emulator, monkeypatch, capsys) -> None:
    """`--quantized all` (what .ci/gpu_check.sh micro runs): every type of
    kernels/cuda_weight_types.py on a small layer, its GEMV at 1 row (and the int8 one for
    the block types) and its tile path at 16."""
    from eagerlm.kernels.cuda_weight_types import WEIGHT_TYPES

    out = run_script("bench_gemm", ["--models", "tiny", "--tokens", "1", "16", "--peak-dim",
                                    "128", "--copy-mib", "1", "--reps", "1", "--quantized",
                                    "all"], monkeypatch, capsys)
    rows = json_block(out)["quantized_rows"]
    assert [(r["type"], r["tokens"]) for r in rows] == [
        (t.name, n) for t in WEIGHT_TYPES.values() for n in (1, 16)]
    for r in rows:
        t = next(t for t in WEIGHT_TYPES.values() if t.name == r["type"])
        assert r["weight_bytes"] == 64 * 512 // t.block_size * t.type_size
        assert r["tile_us"] > 0 and r["of_hbm"] > 0
        if r["tokens"] == 1:
            assert r["chosen"] == "gemv" and r["gemv_us"] > 0
            assert (r["gemv8_us"] is not None) == t.integer
        else:
            assert r["chosen"] == "tile" and r["gemv_us"] is None


def test_bench_decode_attention(emulator, monkeypatch, capsys) -> None:
    out = run_script("bench_decode_attention",
                     ["--sessions", "3", "--context", "96", "--heads", "4", "--kv-heads", "2",
                      "--head-dim", "64", "--reps", "1", "--warmup", "1", "--copy-mib", "1"],
                     monkeypatch, capsys)
    result = json_block(out)
    assert result["outputs_agree"] is True
    assert {r["kernel"] for r in result["rows"]} >= {"attention_decode",
                                                     "attention.cu general kernel"}
    assert all(r["gb_s"] > 0 for r in result["rows"])


def test_bench_prefill_attention(emulator, monkeypatch, capsys) -> None:
    out = run_script("bench_prefill_attention",
                     ["--tokens", "80", "--heads", "4", "--kv-heads", "2", "--head-dim", "64",
                      "--reps", "1", "--no-torch"], monkeypatch, capsys)
    result = json_block(out)
    (row,) = result["rows"]
    assert row["tokens"] == 80 and row["eagerlm_tflops"] > 0 and row["old_tflops"] > 0
    assert row["err_vs_old_kernel"] < 2e-2  # the timed kernel computes attention
    assert "start-up check" in out


def test_bench_load(emulator, monkeypatch, capsys, tmp_path) -> None:
    from gguf import GGMLQuantizationType

    from eagerlm.loader.synthetic import tiny_spec, write_synthetic_model

    path = write_synthetic_model(tmp_path / "m.gguf", tiny_spec(
        "qwen3", weight_type=GGMLQuantizationType.Q8_0))
    out = run_script("bench_load", ["--model", str(path), "--reps", "1", "--copy-mib", "1"],
                     monkeypatch, capsys)
    result = json_block(out)
    assert result["file_bytes"] > 0
    assert result["pinned_h2d_gb_s"] > 0 and result["slab_gb_s"] > 0
    assert result["naive_gb_s"] > 0
    assert "| slab loader |" in out


def test_bench_vmm_on_cuda(emulator, monkeypatch, capsys) -> None:
    out = run_script("bench_vmm", ["--backend", "cuda", "--sessions", "2", "--pages", "4",
                                   "--budget-gib", "0.25"], monkeypatch, capsys)
    (result,) = json.loads(out[out.index("\n[\n") + 1:])
    assert result["backend"] == "cuda"
    assert result["latency"]["map_us_p50"] > 0
    assert result["packing"]["live_over_mapped_at_full_length"] > 0.95
    assert "[cuda] live/mapped" in out


def test_bench_gpu_decode(emulator, monkeypatch, capsys, tmp_path) -> None:
    out = run_script("bench_gpu_decode",
                     ["--shapes", "tiny", "--prompt", "4", "--output", "4", "--batch", "2",
                      "--memory-fraction", "0.02", "--copy-mib", "1", "--weight-type", "q8_0",
                      "--json", str(tmp_path / "r.json")], monkeypatch, capsys)
    (row,) = json.loads((tmp_path / "r.json").read_text())
    assert row["shape"] == "tiny" and row["roofline_tok_s"] > 0
    for mode in ("graphs", "eager", "graphs_int8_gemv"):
        assert row[mode]["batch1"]["tok_s"] > 0 and row[mode]["batchN"]["tok_s"] > 0
    # the same file as bf16 in the same run: more bytes per token, a lower roofline
    bf16 = row["bf16"]
    assert bf16["graphs"]["batch1"]["tok_s"] > 0 and row["batch1_quantized_over_bf16"] > 0
    assert bf16["bytes_per_token"] > row["bytes_per_token"]
    assert "of roofline" in out and "weights bf16" in out


def _cli(argv: list[str]):
    """`eagerlm ARGV...` as the entry point parses it."""
    from eagerlm.service.cli.commands import build_parser

    return build_parser().parse_args(argv)


def test_eagerlm_profile_on_cuda(emulator, tmp_path, capsys) -> None:
    """The issue-8 bubble measurement on a GPU is this command with --device cuda."""
    out = tmp_path / "prof"
    args = _cli(["profile", "--synthetic", "tiny", "--device", "cuda", "--requests", "4",
                 "--max-batch", "4", "--prompt-len", "6", "--output-len", "8", "--min-batch",
                 "2", "--memory-fraction", "0.02", "--repeats", "1", "--out", str(out),
                 "--quiet"])
    assert args.func(args) == 0
    assert "bubble, steady decode" in capsys.readouterr().out
    report = json.loads((out / "profile.json").read_text())
    for mode in ("eager", "sync"):
        assert report["modes"][mode]["latency"]["output_tokens"] == 4 * 8
    assert (out / "timeline.png").exists() and (out / "trace.json").exists()


def test_eagerlm_bench_offline_on_cuda(emulator, tmp_path, capsys) -> None:
    out = tmp_path / "offline.json"
    args = _cli(["bench", "offline", "--synthetic", "tiny", "--device", "cuda", "-n", "5",
                 "--input-len", "4-12", "--output-len", "3-9", "--max-batch", "4",
                 "--memory-fraction", "0.02", "--json", str(out)])
    assert args.func(args) == 0
    assert "Throughput:" in capsys.readouterr().out
    s = json.loads(out.read_text())["summary"]
    assert s["n_failed"] == 0 and s["output_tokens"] > 0


def test_eagerlm_generate_on_cuda_prints_the_cpu_backends_greedy_text(emulator, tmp_path,
                                                                      capsys) -> None:
    from gguf import GGMLQuantizationType

    from eagerlm.loader.synthetic import tiny_spec, write_synthetic_model
    from eagerlm.service.cli.commands import main

    path = str(write_synthetic_model(tmp_path / "m.gguf", tiny_spec(
        "llama", weight_type=GGMLQuantizationType.BF16)))
    texts, launches = [], []
    for device in ("cpu", "cuda"):
        launches.append(emulator.calls.get("cuLaunchKernel", 0))
        assert main(["generate", "-m", path, "-p", "hello there", "-n", "12", "-t", "0",
                     "-q", "--device", device, "--memory-fraction", "0.02"]) == 0
        out, err = capsys.readouterr()
        assert "generated 12 tokens" in err
        texts.append(out)
    assert launches[0] == 0 < emulator.calls.get("cuLaunchKernel", 0)  # cuda ran on the GPU
    assert texts[0] == texts[1] and texts[0].strip()


def test_eagerlm_perplexity_on_cuda_is_the_cpu_backends_within_bf16(emulator, tmp_path,
                                                                    capsys) -> None:
    from gguf import GGMLQuantizationType

    from eagerlm.loader.synthetic import tiny_spec, write_synthetic_model
    from eagerlm.service.cli.commands import main

    path = str(write_synthetic_model(tmp_path / "m.gguf", tiny_spec(
        "llama", weight_type=GGMLQuantizationType.BF16)))
    text = tmp_path / "t.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 6)
    values, launches = [], []
    for device in ("cpu", "cuda"):
        launches.append(emulator.calls.get("cuLaunchKernel", 0))
        assert main(["perplexity", "-m", path, str(text), "--ctx", "16", "-q",
                     "--device", device]) == 0
        last = capsys.readouterr().out.strip().splitlines()[-1]
        assert last.startswith("perplexity: ")
        values.append(float(last.removeprefix("perplexity: ")))
    assert launches[0] == 0 < emulator.calls.get("cuLaunchKernel", 0)  # cuda ran on the GPU
    # bf16 activations and KV against float32 move the perplexity by 3e-4 of itself here
    # (PPL_TOLERANCE leaves 30 times that)
    assert abs(values[1] / values[0] - 1) < PPL_TOLERANCE, values


PPL_TOLERANCE = 0.01


def test_eagerlm_serve_on_cuda_streams_concurrent_chats(emulator, tmp_path) -> None:
    """The OpenAI-compatible server over a cuda engine: concurrent streamed chats, each
    the text the same request gets without streaming, and the KV pages all back after."""
    import concurrent.futures

    import openai

    from eagerlm.loader.synthetic import tiny_spec, write_synthetic_model
    from eagerlm.service.api.engine import Engine
    from eagerlm.service.http.server import ServerConfig, create_app
    from tests.test_server import LiveServer

    path = write_synthetic_model(tmp_path / "m.gguf", tiny_spec("qwen3", context_length=256))
    with Engine.load(path, "cuda", memory_fraction=0.02, model_name="m") as engine, \
            LiveServer(create_app(engine, ServerConfig())) as server, \
            openai.OpenAI(base_url=server.url + "/v1", api_key="-", max_retries=0,
                          timeout=120) as client:
        def chat(i: int, stream: bool) -> str:
            kw = dict(model="m", messages=[{"role": "user", "content": f"hello {i}"}],
                      max_tokens=6 + i, temperature=0, extra_body={"ignore_eos": True})
            if not stream:
                return client.chat.completions.create(**kw).choices[0].message.content
            return "".join(c.choices[0].delta.content or ""
                           for c in client.chat.completions.create(stream=True, **kw)
                           if c.choices)

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            streamed = list(pool.map(lambda i: chat(i, True), range(4)))
        assert streamed == [chat(i, False) for i in range(4)]
        assert all(streamed)
        engine.flush()
        pool_ = engine.dispatcher.pool
        assert pool_.n_free == pool_.n_pages
