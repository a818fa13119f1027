"""The OpenAI-compatible server on the cpu backend and a synthetic model, over loopback:
the official openai client, logprobs and penalties (against the sequential reference loop),
logit bias, every bad input, disconnects, load, limits and metrics."""

from __future__ import annotations

import dataclasses
import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import anyio
import httpx
import openai
import pytest
import uvicorn

from eagerlm.kernels.sampling import SamplingParams
from eagerlm.loader.synthetic import tiny_spec, write_synthetic_model
from eagerlm.service.api.engine import Engine
from eagerlm.service.api.records import Logprob, TokenLogprobs
from eagerlm.service.http.admission import AdmissionGate, QueueFull
from eagerlm.service.http.openai_responses import (
    LOGPROB_FLOOR,
    chat_logprobs_body,
    completion_logprobs_body,
)
from eagerlm.service.http.server import ServerConfig, create_app
from tests.sequential_reference import SequentialGeneration

MODEL = "tiny-qwen3"
CONTEXT = 1024


class LiveServer:
    """uvicorn serving `app` from a background thread on a free loopback port."""

    def __init__(self, app) -> None:
        self.app = app
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run,
                                       kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()

    def openai(self, timeout: float = 30) -> openai.OpenAI:
        """The official client against this server (no retries: a failure shows)."""
        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0,
                             timeout=timeout)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("server") / "qwen3.gguf"
    return str(write_synthetic_model(path, tiny_spec("qwen3", context_length=CONTEXT)))


@pytest.fixture(scope="module")
def engine(model_path):
    with Engine.load(model_path, page_size=16384, kv_budget_bytes=64 << 20,
                     model_name=MODEL) as e:
        yield e


@pytest.fixture(scope="module")
def server(engine):
    with LiveServer(create_app(engine, ServerConfig(max_body_bytes=64 << 10))) as s:
        yield s


@pytest.fixture()
def client(server):
    with server.openai() as c:
        yield c


def wait_until(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


def assert_idle_and_nothing_leaked(engine: Engine, server: LiveServer) -> None:
    gate: AdmissionGate = server.app.state.gate
    wait_until(lambda: engine.active_requests == 0)
    wait_until(lambda: gate.active == 0 and gate.queued == 0)
    engine.flush()
    d = engine.dispatcher
    assert not d.control.sessions
    assert d.pool.n_free == d.pool.n_pages


HI = [{"role": "user", "content": "hello there"}]


# -- the official client: chat and completions ---------------------------------------------

def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list()] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL


def test_chat_completion_reports_text_finish_reason_and_usage(client, engine):
    r = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=7, temperature=0,
                                       extra_body={"ignore_eos": True})
    choice = r.choices[0]
    expected = anyio.run(engine.chat_complete, HI, SamplingParams(
        temperature=0.0, max_tokens=7, ignore_eos=True))
    assert choice.message.role == "assistant" and choice.message.content == expected.text
    assert choice.finish_reason == "length"
    assert r.usage.prompt_tokens == len(engine.prepare_chat(HI).ids)
    assert r.usage.completion_tokens == 7
    assert r.usage.total_tokens == r.usage.prompt_tokens + 7
    assert r.object == "chat.completion" and r.model == MODEL


def test_streamed_chat_joins_to_the_same_text_and_ends_with_usage(client):
    kwargs = dict(model=MODEL, messages=HI, max_tokens=9, temperature=0,
                  extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**kwargs).choices[0].message.content
    chunks = list(client.chat.completions.create(
        **kwargs, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 9
    assert all(c.usage is None for c in chunks[:-1])


def test_completions_streamed_and_not_agree(client):
    kwargs = dict(model=MODEL, prompt="once upon a time", max_tokens=6, temperature=0,
                  extra_body={"ignore_eos": True})
    whole = client.completions.create(**kwargs)
    streamed = list(client.completions.create(**kwargs, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == whole.choices[0].text
    assert streamed[-1].choices[0].finish_reason == whole.choices[0].finish_reason == "length"
    assert whole.usage.completion_tokens == 6


def test_max_completion_tokens_is_the_newer_name_for_max_tokens(client):
    r = client.chat.completions.create(model=MODEL, messages=HI, max_completion_tokens=3,
                                       extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"


def test_completions_default_to_16_tokens(client):
    r = client.completions.create(model=MODEL, prompt="x", extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 16


def test_stop_string_ends_the_text_before_it(client):
    kwargs = dict(model=MODEL, prompt="the mat", max_tokens=30, temperature=0,
                  extra_body={"ignore_eos": True})
    free = client.completions.create(**kwargs).choices[0].text
    stop = free[10:13]
    assert len(stop) == 3
    r = client.completions.create(**kwargs, stop=[stop])
    assert r.choices[0].text == free[:free.find(stop)]
    assert r.choices[0].finish_reason == "stop"
    streamed = list(client.completions.create(**kwargs, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == free[:free.find(stop)]


def test_seed_makes_sampling_reproducible(client):
    def sample(seed):
        return client.chat.completions.create(
            model=MODEL, messages=HI, max_tokens=12, temperature=1.0, seed=seed,
            extra_body={"ignore_eos": True}).choices[0].message.content

    assert sample(7) == sample(7)
    assert sample(7) != sample(8)


def test_n_choices_are_distinct_draws_with_summed_usage(client):
    r = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=5, n=3,
                                       temperature=1.0, seed=3,
                                       extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert len({c.message.content for c in r.choices}) == 3
    assert r.usage.completion_tokens == 15
    again = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=5, n=3,
                                           temperature=1.0, seed=3,
                                           extra_body={"ignore_eos": True})
    assert [c.message.content for c in again.choices] == [c.message.content
                                                          for c in r.choices]
    streamed = list(client.chat.completions.create(
        model=MODEL, messages=HI, max_tokens=5, n=3, temperature=1.0, seed=3, stream=True,
        extra_body={"ignore_eos": True}))
    for i in range(3):
        text = "".join(c.choices[0].delta.content or "" for c in streamed
                       if c.choices and c.choices[0].index == i)
        assert text == r.choices[i].message.content


def test_several_prompts_with_n_give_prompt_major_choices(client):
    r = client.completions.create(model=MODEL, prompt=["alpha", "beta gamma"], n=2,
                                  max_tokens=4, temperature=0,
                                  extra_body={"ignore_eos": True})
    texts = [c.text for c in r.choices]
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert texts[0] == texts[1] and texts[2] == texts[3]  # greedy: equal per prompt
    alone = client.completions.create(model=MODEL, prompt="beta gamma", max_tokens=4,
                                      temperature=0, extra_body={"ignore_eos": True})
    assert texts[2] == alone.choices[0].text
    assert r.usage.completion_tokens == 16


def test_second_chat_turn_reports_cached_prompt_tokens(client, engine):
    engine.flush()
    first = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=8,
                                           temperature=0, extra_body={"ignore_eos": True})
    turn2 = [*HI, {"role": "assistant", "content": first.choices[0].message.content},
             {"role": "user", "content": "go on"}]
    second = client.chat.completions.create(model=MODEL, messages=turn2, max_tokens=4,
                                            temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == \
        first.usage.prompt_tokens + first.usage.completion_tokens - 1


# -- log-probabilities and penalties ---------------------------------------------------------

def reference_logprobs(engine: Engine, ids, params: SamplingParams):
    """The sampler's logprobs of the request run alone through the sequential loop."""
    chunks = SequentialGeneration(engine.loaded.transformer, engine.tokenizer, list(ids),
                                  params)
    return [lp for c in chunks for lp in c.logprobs]


def piece(engine: Engine, token_id: int) -> tuple[str, list[int]]:
    raw = engine.tokenizer.piece(token_id)
    return raw.decode("utf-8", "replace"), list(raw)


def test_chat_logprobs_match_the_reference_loop_streamed_and_not(client, engine):
    kwargs = dict(model=MODEL, messages=HI, max_tokens=8, temperature=0, logprobs=True,
                  top_logprobs=3, extra_body={"ignore_eos": True})
    r = client.chat.completions.create(**kwargs)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 8
    want = reference_logprobs(engine, engine.prepare_chat(HI).ids, SamplingParams(
        temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=3))
    for entry, ref in zip(content, want, strict=True):
        assert (entry.token, entry.bytes) == piece(engine, ref.token)
        assert entry.logprob == pytest.approx(ref.logprob, abs=1e-4)
        assert len(entry.top_logprobs) == 3
        for top, (tid, lp) in zip(entry.top_logprobs, ref.top, strict=True):
            assert (top.token, top.bytes) == piece(engine, tid)
            assert top.logprob == pytest.approx(lp, abs=1e-4)
        # greedy: the sampled token is the most likely one
        assert (entry.top_logprobs[0].token, entry.top_logprobs[0].logprob) == \
            (entry.token, entry.logprob)
    assert b"".join(bytes(e.bytes) for e in content).decode("utf-8", "replace") == \
        r.choices[0].message.content

    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content]
    assert [(e.token, e.bytes) for e in streamed] == [(e.token, e.bytes) for e in content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content],
                                                          abs=1e-4)
    assert all(len(e.top_logprobs) == 3 for e in streamed)
    assert chunks[0].choices[0].logprobs is None  # the role chunk has no tokens


def test_chat_logprobs_without_top_logprobs_have_no_alternatives(client):
    r = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=4,
                                       temperature=0.7, seed=5, logprobs=True,
                                       extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == 4 and all(e.top_logprobs == [] for e in content)
    assert all(e.logprob <= 0 for e in content)
    plain = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=2)
    assert plain.choices[0].logprobs is None


def test_chat_logprobs_body_is_openai_shaped(server):
    with httpx.Client(base_url=server.url, timeout=30) as http:
        body = http.post("/v1/chat/completions", json={
            "model": MODEL, "messages": HI, "max_tokens": 2, "temperature": 0,
            "logprobs": True, "top_logprobs": 2, "ignore_eos": True}).json()
    logprobs = body["choices"][0]["logprobs"]
    assert set(logprobs) == {"content", "refusal"} and logprobs["refusal"] is None
    for entry in logprobs["content"]:
        assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
        assert isinstance(entry["token"], str) and isinstance(entry["logprob"], float)
        assert all(isinstance(b, int) and 0 <= b < 256 for b in entry["bytes"])
        for top in entry["top_logprobs"]:
            assert set(top) == {"token", "logprob", "bytes"}


def test_completion_logprobs_match_the_reference_loop_streamed_and_not(client, engine):
    kwargs = dict(model=MODEL, prompt="once upon a time", max_tokens=10, temperature=0,
                  logprobs=5, extra_body={"ignore_eos": True})
    r = client.completions.create(**kwargs)
    lp = r.choices[0].logprobs
    want = reference_logprobs(engine, engine.tokenizer.encode("once upon a time"),
                              SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True,
                                             logprobs=5))
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == \
        len(lp.text_offset) == r.usage.completion_tokens == 10
    assert lp.tokens == [piece(engine, ref.token)[0] for ref in want]
    assert lp.token_logprobs == pytest.approx([ref.logprob for ref in want], abs=1e-4)
    offset = 0
    for i, ref in enumerate(want):
        assert lp.text_offset[i] == offset
        offset += len(lp.tokens[i])
        top = lp.top_logprobs[i]
        expected = {}
        for tid, value in ref.top:  # texts may coincide: the more likely one is kept
            expected.setdefault(piece(engine, tid)[0], value)
        assert top.keys() == expected.keys() and 1 <= len(top) <= 5
        assert list(top.values()) == pytest.approx(list(expected.values()), abs=1e-4)
        # greedy: the sampled token is the most likely, so it is in the dict already
        assert top[lp.tokens[i]] == pytest.approx(lp.token_logprobs[i], abs=1e-6)
        assert max(top.values()) == pytest.approx(lp.token_logprobs[i], abs=1e-6)

    streamed = list(client.completions.create(**kwargs, stream=True))
    parts = [c.choices[0].logprobs for c in streamed if c.choices[0].logprobs]
    assert [t for p in parts for t in p.tokens] == lp.tokens
    assert [o for p in parts for o in p.text_offset] == lp.text_offset
    assert [v for p in parts for v in p.token_logprobs] == pytest.approx(lp.token_logprobs,
                                                                         abs=1e-4)
    assert [d.keys() for p in parts for d in p.top_logprobs] == \
        [d.keys() for d in lp.top_logprobs]
    assert "".join(c.choices[0].text for c in streamed) == r.choices[0].text


def test_completion_logprobs_zero_give_only_the_sampled_token(client):
    r = client.completions.create(model=MODEL, prompt=["alpha", "beta"], n=2, max_tokens=3,
                                  temperature=1.0, seed=9, logprobs=0,
                                  extra_body={"ignore_eos": True})
    assert len(r.choices) == 4
    for choice in r.choices:
        lp = choice.logprobs
        assert len(lp.tokens) == 3
        assert lp.top_logprobs == [{t: v} for t, v in zip(lp.tokens, lp.token_logprobs,
                                                          strict=True)]
    plain = client.completions.create(model=MODEL, prompt="alpha", max_tokens=2)
    assert plain.choices[0].logprobs is None


def test_logprob_bodies_floor_minus_infinity_and_keep_the_likelier_of_equal_texts():
    alt = [Logprob(7, "\ufffd", b"\xe2", -1.0), Logprob(8, "\ufffd", b"\x80", -2.0),
           Logprob(9, "z", b"z", float("-inf"))]
    entries = [TokenLogprobs(8, "\ufffd", b"\x80", -2.0, tuple(alt)),
               TokenLogprobs(3, "ab", b"ab", float("-inf"), ())]
    legacy = completion_logprobs_body(entries, offset=5)
    assert legacy == {"tokens": ["\ufffd", "ab"], "token_logprobs": [-2.0, LOGPROB_FLOOR],
                      "top_logprobs": [{"\ufffd": -1.0, "z": LOGPROB_FLOOR},
                                       {"ab": LOGPROB_FLOOR}],
                      "text_offset": [5, 6]}
    chat_body = chat_logprobs_body(entries)
    assert chat_body["content"][0]["top_logprobs"][1] == {"token": "\ufffd", "logprob": -2.0,
                                                          "bytes": [0x80]}
    assert chat_body["content"][1]["logprob"] == LOGPROB_FLOOR
    assert json.loads(json.dumps(chat_body, allow_nan=False)) == chat_body
    assert chat_logprobs_body(None) is None and completion_logprobs_body(None) is None


REPETITIVE = "a b a b a b a b a b a b"


@pytest.mark.parametrize("penalty", [{"presence_penalty": 2.0}, {"frequency_penalty": 2.0},
                                     {"repetition_penalty": 1.5}])
def test_penalties_change_the_output_as_in_the_reference_loop(client, engine, penalty):
    ids = engine.tokenizer.encode(REPETITIVE)
    plain = client.completions.create(model=MODEL, prompt=REPETITIVE, max_tokens=24,
                                      temperature=0, extra_body={"ignore_eos": True})
    r = client.completions.create(model=MODEL, prompt=REPETITIVE, max_tokens=24,
                                  temperature=0, logprobs=0,
                                  extra_body={"ignore_eos": True, **penalty})
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=0,
                            **penalty)
    chunks = list(SequentialGeneration(engine.loaded.transformer, engine.tokenizer, ids,
                                       params))
    assert r.choices[0].text == "".join(c.text for c in chunks)
    assert r.choices[0].logprobs.tokens == [piece(engine, t)[0] for c in chunks
                                            for t in c.token_ids]
    assert r.choices[0].text != plain.choices[0].text
    streamed = list(client.chat.completions.create(
        model=MODEL, messages=HI, max_tokens=12, temperature=0, stream=True,
        extra_body={"ignore_eos": True, **penalty}))
    whole = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=12,
                                           temperature=0,
                                           extra_body={"ignore_eos": True, **penalty})
    expected = SequentialGeneration(engine.loaded.transformer, engine.tokenizer,
                                    engine.prepare_chat(HI).ids, dataclasses.replace(
                                        params, max_tokens=12))
    text = "".join(c.text for c in expected)
    assert whole.choices[0].message.content == text
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == text


# -- logit bias ------------------------------------------------------------------------------

def ids_with_text(engine: Engine, text: str) -> list[int]:
    """The token ids whose text (as logprobs report it) is `text`."""
    return [i for i in range(engine.tokenizer.vocab_size) if piece(engine, i)[0] == text]


def id_of_bytes(engine: Engine, raw: list[int]) -> int:
    """The token id whose bytes (chat logprobs' `bytes`) are `raw`."""
    (token,) = [i for i in range(engine.tokenizer.vocab_size) if engine.tokenizer.piece(i)
                == bytes(raw)]
    return token


def test_logit_bias_of_plus_100_makes_the_output_that_token(client, engine):
    """+100 on one token forces it, greedy or sampled, on both routes; logprobs stay the
    model's own (the forced token is not the model's favourite)."""
    prompt_ids = engine.tokenizer.encode("once upon a time")
    kwargs = dict(model=MODEL, prompt=prompt_ids, max_tokens=8, temperature=0, logprobs=0,
                  extra_body={"ignore_eos": True})
    plain = client.completions.create(**kwargs).choices[0].logprobs
    forced = next(i for i in engine.tokenizer.encode(" the river thought") if
                  piece(engine, i)[0] not in plain.tokens and
                  len(ids_with_text(engine, piece(engine, i)[0])) == 1)
    text = piece(engine, forced)[0]

    r = client.completions.create(**kwargs, logit_bias={str(forced): 100})
    lp = r.choices[0].logprobs
    assert lp.tokens == [text] * 8
    assert r.choices[0].text == text * 8
    assert lp.token_logprobs[0] < plain.token_logprobs[0]  # the model's, not the biased

    chat_r = client.chat.completions.create(
        model=MODEL, messages=HI, max_tokens=6, temperature=1.0, seed=11, n=2,
        logprobs=True, logit_bias={str(forced): 100}, extra_body={"ignore_eos": True})
    for choice in chat_r.choices:
        assert [bytes(e.bytes) for e in choice.logprobs.content] == \
            [engine.tokenizer.piece(forced)] * 6


def test_logit_bias_of_minus_100_on_the_greedy_token_gives_the_runner_up(client, engine):
    """Banning the token greedy picks makes the first token the one the unbiased
    distribution ranks second, with the logprob the unbiased request reported for it."""
    kwargs = dict(model=MODEL, messages=HI, max_tokens=1, temperature=0, logprobs=True,
                  top_logprobs=2)
    first, second = client.chat.completions.create(**kwargs).choices[0].logprobs.content[
        0].top_logprobs
    assert first.logprob > second.logprob  # no tie to break
    banned = id_of_bytes(engine, first.bytes)
    r = client.chat.completions.create(**kwargs, logit_bias={str(banned): -100})
    entry = r.choices[0].logprobs.content[0]
    assert (entry.bytes, entry.logprob) == (second.bytes, pytest.approx(second.logprob,
                                                                        abs=1e-4))
    assert entry.top_logprobs[0].bytes == first.bytes  # still the model's favourite

    # the same on /v1/completions with prompt ids; the legacy top_logprobs are keyed by
    # text, so every token with the favourite's text is banned, and the first token is
    # then the most likely one with another text: the dict's second key
    prompt_ids = engine.tokenizer.encode("once upon a time")
    kwargs = dict(model=MODEL, prompt=prompt_ids, max_tokens=1, temperature=0, logprobs=5)
    top = client.completions.create(**kwargs).choices[0].logprobs.top_logprobs[0]
    (best, best_lp), (runner_up, runner_up_lp) = list(top.items())[:2]
    assert best_lp > runner_up_lp
    bias = {str(i): -100 for i in ids_with_text(engine, best)}
    lp = client.completions.create(**kwargs, logit_bias=bias).choices[0].logprobs
    assert lp.tokens == [runner_up]
    assert lp.token_logprobs[0] == pytest.approx(runner_up_lp, abs=1e-4)


def test_empty_or_null_logit_bias_is_no_bias(server):
    with httpx.Client(base_url=server.url, timeout=30) as http:
        texts = []
        for bias in ({}, None, "absent"):
            body = {"model": MODEL, "prompt": "once upon a time", "max_tokens": 6,
                    "temperature": 0, "ignore_eos": True}
            if bias != "absent":
                body["logit_bias"] = bias
            r = http.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            texts.append(r.json()["choices"][0]["text"])
        assert texts[0] == texts[1] == texts[2]


def test_logit_bias_on_a_token_beyond_the_vocabulary_is_a_400(model_path):
    """An id the model does not have is refused (both routes, streamed or not), nothing is
    left behind, and the last id of the vocabulary is accepted. (An engine of its own: had
    the id reached the sampler, it would fail the round, and the engine with it.)"""
    with Engine.load(model_path, page_size=16384, kv_budget_bytes=16 << 20,
                     model_name=MODEL) as engine, \
            LiveServer(create_app(engine, ServerConfig())) as server, \
            httpx.Client(base_url=server.url, timeout=30) as http:
        vocab = engine.tokenizer.vocab_size
        for route, body in (("completions", {"model": MODEL, "prompt": "x"}),
                            ("chat/completions", chat()),
                            ("completions", {"model": MODEL, "prompt": "x", "stream": True}),
                            ("chat/completions", chat(stream=True, n=2))):
            r = http.post(f"/v1/{route}", json={**body, "max_tokens": 2,
                                                "logit_bias": {"1": 5, str(vocab): 1}})
            assert r.status_code == 400, r.text
            assert r.json()["error"]["type"] == "invalid_request_error"
            assert r.json()["error"]["param"] == "logit_bias"
            assert f"names token {vocab}" in r.json()["error"]["message"]
        edge = http.post("/v1/completions", json={"model": MODEL, "prompt": "x",
                                                  "max_tokens": 2,
                                                  "logit_bias": {str(vocab - 1): 1}})
        assert edge.status_code == 200, edge.text
        good = http.post("/v1/completions", json={"model": MODEL, "prompt": "ok",
                                                  "max_tokens": 2})
        assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] >= 1
        assert_idle_and_nothing_leaked(engine, server)


# -- bad input: the right status and error body, then good requests still work ---------------

def chat(**fields):
    return {"model": MODEL, "messages": HI, **fields}


BAD_REQUESTS = [
    # (route, body as JSON-able or raw bytes, status, param, code)
    ("chat/completions", b"{not json", 400, None, "invalid_json"),
    ("chat/completions", b"[1, 2]", 400, None, None),
    ("chat/completions", chat(max_tokens="5"), 400, "max_tokens", "invalid_type"),
    ("chat/completions", chat(temperature="hot"), 400, "temperature", "invalid_type"),
    ("chat/completions", chat(stream="yes"), 400, "stream", "invalid_type"),
    ("chat/completions", {"model": MODEL, "messages": "hi"}, 400, "messages", "invalid_type"),
    ("chat/completions", {"model": MODEL}, 400, "messages", None),
    ("chat/completions", chat(messages=[{"role": "wizard", "content": "x"}]), 400,
     "messages[0].role", None),
    ("chat/completions", chat(model="gpt-4o"), 404, "model", "model_not_found"),
    ("chat/completions", chat(max_tokens=0), 400, "max_tokens", "invalid_value"),
    ("chat/completions", chat(max_tokens=CONTEXT), 400, "max_tokens",
     "context_length_exceeded"),
    ("chat/completions", chat(messages=[{"role": "user", "content": "word " * CONTEXT}]),
     400, "messages", "context_length_exceeded"),
    ("chat/completions", chat(n=0), 400, "n", "invalid_value"),
    ("chat/completions", chat(n=1000), 400, "n", "invalid_value"),
    ("chat/completions", chat(top_p=1.5), 400, "top_p", "invalid_value"),
    ("chat/completions", chat(seed=1.5), 400, "seed", "invalid_type"),
    ("chat/completions", chat(stop=[""]), 400, "stop", None),
    ("chat/completions", chat(stream_options={"include_usage": True}), 400,
     "stream_options", None),
    ("chat/completions", chat(logprobs="yes"), 400, "logprobs", "invalid_type"),
    ("chat/completions", chat(logprobs=1), 400, "logprobs", "invalid_type"),
    ("chat/completions", chat(top_logprobs=3), 400, "top_logprobs", "invalid_value"),
    ("chat/completions", chat(logprobs=False, top_logprobs=0), 400, "top_logprobs",
     "invalid_value"),
    ("chat/completions", chat(logprobs=True, top_logprobs=21), 400, "top_logprobs",
     "invalid_value"),
    ("chat/completions", chat(logprobs=True, top_logprobs=-1), 400, "top_logprobs",
     "invalid_value"),
    ("chat/completions", chat(logprobs=True, top_logprobs=2.5), 400, "top_logprobs",
     "invalid_type"),
    ("chat/completions", chat(presence_penalty=2.5), 400, "presence_penalty",
     "invalid_value"),
    ("chat/completions", chat(presence_penalty="high"), 400, "presence_penalty",
     "invalid_type"),
    ("chat/completions", chat(frequency_penalty=-2.01), 400, "frequency_penalty",
     "invalid_value"),
    ("chat/completions", chat(repetition_penalty=0), 400, "repetition_penalty",
     "invalid_value"),
    ("chat/completions", b'{"model": "tiny-qwen3", "messages": [{"role": "user", '
     b'"content": "x"}], "repetition_penalty": Infinity}', 400, "repetition_penalty",
     "invalid_value"),
    ("chat/completions", chat(logit_bias={"abc": 1}), 400, "logit_bias", "invalid_value"),
    ("chat/completions", chat(logit_bias={"-1": 1}), 400, "logit_bias", "invalid_value"),
    ("chat/completions", chat(logit_bias={"5": 101}), 400, "logit_bias", "invalid_value"),
    ("chat/completions", chat(logit_bias={"5": -100.5}), 400, "logit_bias",
     "invalid_value"),
    ("chat/completions", chat(logit_bias={"5": "x"}), 400, "logit_bias", "invalid_type"),
    ("chat/completions", chat(logit_bias={"5": True}), 400, "logit_bias", "invalid_type"),
    ("chat/completions", chat(logit_bias=[[5, 1]]), 400, "logit_bias", "invalid_type"),
    ("chat/completions", chat(logit_bias={"7": 1, "07": 1}), 400, "logit_bias",
     "invalid_value"),
    ("chat/completions", b'{"model": "tiny-qwen3", "messages": [{"role": "user", '
     b'"content": "x"}], "logit_bias": {"5": NaN}}', 400, "logit_bias", "invalid_value"),
    # the built-in qwen3 template has no tool support (tests/test_server_tools.py: tools)
    ("chat/completions", chat(tools=[{"type": "function", "function": {"name": "f"}}]), 400,
     "tools", "unsupported_parameter"),
    ("chat/completions", chat(tools=[{"type": "function", "function": {"name": "f"}}],
                              tool_choice="none"), 400, "tools", "unsupported_parameter"),
    ("chat/completions", chat(tool_choice="required"), 400, "tool_choice",
     "invalid_value"),  # forcing a call needs tools
    ("chat/completions", chat(temprature=0.5), 400, "temprature", "unknown_parameter"),
    ("completions", {"model": MODEL, "prompt": "x", "logprobs": 21}, 400, "logprobs",
     "invalid_value"),
    ("completions", {"model": MODEL, "prompt": "x", "logprobs": -1}, 400, "logprobs",
     "invalid_value"),
    ("completions", {"model": MODEL, "prompt": "x", "logprobs": True}, 400, "logprobs",
     "invalid_type"),
    ("completions", {"model": MODEL, "prompt": "x", "top_logprobs": 2}, 400,
     "top_logprobs", "unknown_parameter"),
    ("completions", {"model": MODEL, "prompt": "x", "presence_penalty": -3}, 400,
     "presence_penalty", "invalid_value"),
    ("completions", {"model": MODEL, "prompt": "x", "frequency_penalty": 2.5}, 400,
     "frequency_penalty", "invalid_value"),
    ("completions", {"model": MODEL, "prompt": "x", "repetition_penalty": -1}, 400,
     "repetition_penalty", "invalid_value"),
    ("completions", {"model": MODEL, "prompt": "x", "echo": True}, 400, "echo",
     "unsupported_parameter"),
    ("completions", {"model": MODEL, "prompt": "x", "logit_bias": {"abc": 1}}, 400,
     "logit_bias", "invalid_value"),
    ("completions", {"model": MODEL, "prompt": "x", "logit_bias": {"5": 101}}, 400,
     "logit_bias", "invalid_value"),
    ("completions", {"model": MODEL, "prompt": "x", "logit_bias": {"5": "x"}}, 400,
     "logit_bias", "invalid_type"),
    ("completions", {"model": MODEL, "prompt": "x", "logit_bias": [5]}, 400,
     "logit_bias", "invalid_type"),
    ("completions", {"model": MODEL, "prompt": "x", "logit_bias": "5:1"}, 400,
     "logit_bias", "invalid_type"),
    ("completions", {"model": MODEL, "prompt": [1, "a"]}, 400, "prompt", "invalid_type"),
    ("completions", {"model": MODEL, "prompt": [10 ** 6]}, 400, "prompt", None),
    ("completions", {"model": MODEL, "prompt": list(range(3, 3 + CONTEXT))}, 400, "prompt",
     "context_length_exceeded"),
    ("completions", {"model": MODEL, "prompt": "x", "max_tokens": -1}, 400, "max_tokens",
     "invalid_value"),
]


@pytest.mark.parametrize("route, body, status, param, code", BAD_REQUESTS)
def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(
        server, route, body, status, param, code):
    with httpx.Client(base_url=server.url, timeout=30) as http:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        r = http.post(f"/v1/{route}", content=content,
                      headers={"content-type": "application/json"})
        assert r.status_code == status, r.text
        error = r.json()["error"]
        assert error["message"] and error["type"]
        assert error["param"] == param
        if code is not None:
            assert error["code"] == code
        good = http.post("/v1/completions", json={"model": MODEL, "prompt": "ok",
                                                  "max_tokens": 2})
        assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] >= 1


def test_no_tools_with_any_tool_choice_is_a_plain_chat(server):
    """`tools: []`, and tool_choice or parallel_tool_calls without tools, are accepted on
    a model without tool support and change nothing."""
    body = chat(max_tokens=5, temperature=0, ignore_eos=True)
    with httpx.Client(base_url=server.url, timeout=30) as http:
        plain = http.post("/v1/chat/completions", json=body).json()["choices"][0]
        for extra in ({"tools": []}, {"tool_choice": "auto"}, {"tool_choice": "none"},
                      {"tools": [], "parallel_tool_calls": False}):
            r = http.post("/v1/chat/completions", json={**body, **extra})
            assert r.status_code == 200, (extra, r.text)
            assert r.json()["choices"][0] == plain


def test_the_openai_client_raises_the_matching_exceptions(client):
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=HI)
    with pytest.raises(openai.BadRequestError, match="presence_penalty") as e:
        client.chat.completions.create(model=MODEL, messages=HI, presence_penalty=3.0)
    assert e.value.param == "presence_penalty"
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        client.chat.completions.create(model=MODEL, messages=HI, top_logprobs=2)


def test_body_too_large_unknown_route_and_wrong_method(server):
    with httpx.Client(base_url=server.url, timeout=30) as http:
        huge = {"model": MODEL, "prompt": "x" * (100 << 10)}
        r = http.post("/v1/completions", json=huge)
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
        r = http.get("/v1/nothing")
        assert r.status_code == 404 and "error" in r.json()
        r = http.get("/v1/chat/completions")
        assert r.status_code == 405 and "error" in r.json()
        assert http.get("/health").json()["status"] == "ok"


def test_api_key_is_required_when_configured(engine):
    app = create_app(engine, ServerConfig(api_key="sesame"))
    with LiveServer(app) as s, httpx.Client(base_url=s.url, timeout=30) as http:
        assert http.get("/v1/models").status_code == 401
        wrong = http.get("/v1/models", headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
        assert http.get("/health").status_code == 200
        for route, body in (("tokenize", {"prompt": "a"}), ("detokenize", {"tokens": [1]})):
            assert http.post(f"/{route}", json=body).status_code == 401
            assert http.post(f"/{route}", json=body,
                             headers={"Authorization": "Bearer sesame"}).status_code == 200
        with openai.OpenAI(base_url=s.url + "/v1", api_key="sesame", max_retries=0) as c:
            assert c.completions.create(model=MODEL, prompt="a", max_tokens=2).choices
        with openai.OpenAI(base_url=s.url + "/v1", api_key="wrong", max_retries=0) as c, \
                pytest.raises(openai.AuthenticationError):
            c.models.list()


def test_default_bind_address_is_loopback():
    assert ServerConfig().host == "127.0.0.1"


# -- concurrency limit ------------------------------------------------------------------------

def test_full_queue_answers_429_until_a_slot_frees(engine):
    app = create_app(engine, ServerConfig(max_concurrency=1, max_queue=1))
    gate: AdmissionGate = app.state.gate
    body = {"model": MODEL, "prompt": "x", "max_tokens": 2}

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            running, queued = gate.enter(), gate.enter()  # one slot taken, one waiting
            r = await http.post("/v1/completions", json=body)
            assert r.status_code == 429
            assert r.json()["error"]["type"] == "rate_limit_error"
            running.release()  # the slot passes to the queued ticket
            await queued.wait()
            queued.release()
            r = await http.post("/v1/completions", json=body)
            assert r.status_code == 200
        assert gate.active == 0 and gate.queued == 0

    anyio.run(main)


def test_admission_gate_is_first_come_first_served_and_releases_cancelled_waiters():
    async def main():
        gate = AdmissionGate(max_active=1, max_queued=2)
        first = gate.enter()
        second, third = gate.enter(), gate.enter()
        with pytest.raises(QueueFull):
            gate.enter()
        order = []

        async def wait(name, ticket):
            await ticket.wait()
            order.append(name)

        async with anyio.create_task_group() as tg:
            tg.start_soon(wait, "second", second)
            tg.start_soon(wait, "third", third)
            await anyio.sleep(0.01)
            first.release()
            await anyio.sleep(0.01)
            assert order == ["second"]
            second.release()
        assert order == ["second", "third"]
        third.release()
        assert gate.active == 0

        waiting = AdmissionGate(max_active=1, max_queued=1)
        holder, queued = waiting.enter(), waiting.enter()
        with anyio.move_on_after(0.01):
            await queued.wait()  # cancelled: leaves the queue
        assert waiting.queued == 0
        holder.release()
        assert waiting.active == 0

    anyio.run(main)


# -- disconnects and load ---------------------------------------------------------------------

def sse_payloads(lines: list[str]) -> list[dict | str]:
    out: list[dict | str] = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_a_client_leaving_mid_stream_cancels_its_session(server, engine):
    cancelled = engine.dispatcher.service.stats.finished.get("cancelled", 0)
    body = {"model": MODEL, "prompt": "go on forever", "max_tokens": 1000,
            "ignore_eos": True, "temperature": 0, "stream": True}
    with httpx.Client(base_url=server.url, timeout=30) as http, \
            http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                break  # leave after the first chunk: the connection closes
    assert_idle_and_nothing_leaked(engine, server)
    assert engine.dispatcher.service.stats.finished["cancelled"] == cancelled + 1


def test_100_concurrent_streaming_clients_with_10_disconnecting(server, engine):
    """90 clients read their streams to the end, 10 hang up after the first chunk: the 90
    get exactly the text a lone request gets, the 10 sessions are cancelled, no session,
    KV page or concurrency slot is left behind, and the server still answers."""
    prompts = [f"client prompt {k}" for k in range(5)]
    expected = {}
    with httpx.Client(base_url=server.url, timeout=30) as http:
        for p in prompts:
            r = http.post("/v1/completions", json={"model": MODEL, "prompt": p,
                                                   "max_tokens": 8, "temperature": 0,
                                                   "ignore_eos": True})
            expected[p] = r.json()["choices"][0]["text"]
    cancelled = engine.dispatcher.service.stats.finished.get("cancelled", 0)
    results: dict[int, str] = {}

    async def one(http: httpx.AsyncClient, i: int) -> None:
        leaves = i % 10 == 0
        body = {"model": MODEL, "prompt": prompts[i % 5], "temperature": 0,
                "ignore_eos": True, "stream": True, "max_tokens": 900 if leaves else 8}
        async with http.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            lines = []
            async for line in r.aiter_lines():
                lines.append(line)
                if leaves and line.startswith("data: "):
                    return  # hang up mid-stream
        events = sse_payloads(lines)
        assert events[-1] == "[DONE]"
        assert events[-2]["choices"][0]["finish_reason"] == "length"
        results[i] = "".join(e["choices"][0]["text"] for e in events[:-1])

    async def main():
        limits = httpx.Limits(max_connections=100, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=server.url, timeout=60, limits=limits) as http:
            with anyio.fail_after(60):
                async with anyio.create_task_group() as tg:
                    for i in range(100):
                        tg.start_soon(one, http, i)

    anyio.run(main)
    assert len(results) == 90
    for i, text in results.items():
        assert text == expected[prompts[i % 5]], i
    assert_idle_and_nothing_leaked(engine, server)
    assert engine.dispatcher.service.stats.finished["cancelled"] == cancelled + 10
    with httpx.Client(base_url=server.url, timeout=30) as http:
        assert http.get("/health").json()["status"] == "ok"


# -- health and metrics -----------------------------------------------------------------------

def metric(text: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    assert match, name
    return float(match.group(1))


def test_metrics_are_prometheus_text_with_the_promised_series(server, client):
    client.completions.create(model=MODEL, prompt="count me", max_tokens=5,
                              extra_body={"ignore_eos": True})
    with httpx.Client(base_url=server.url, timeout=30) as http:
        r = http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    text = r.text
    for family in ("eagerlm_requests_total", "eagerlm_generation_tokens_total",
                   "eagerlm_time_to_first_token_seconds", "eagerlm_inter_token_latency_seconds",
                   "eagerlm_queue_length", "eagerlm_kv_pages_in_use", "eagerlm_bubble_fraction"):
        assert f"# TYPE {family} " in text, family
    assert metric(text, "eagerlm_generation_tokens_total") >= 5
    assert metric(text, "eagerlm_time_to_first_token_seconds_count") >= 1
    assert metric(text, 'eagerlm_time_to_first_token_seconds_bucket{le="+Inf"}') == \
        metric(text, "eagerlm_time_to_first_token_seconds_count")
    assert metric(text, "eagerlm_inter_token_latency_seconds_count") >= 4
    assert metric(text, "eagerlm_queue_length") == 0
    assert 0 <= metric(text, "eagerlm_kv_pages_in_use") <= metric(text,
                                                                 "eagerlm_kv_pages_total")
    assert 0.0 <= metric(text, "eagerlm_bubble_fraction") < 1.0
    assert re.search(r'^eagerlm_http_responses_total\{route="/v1/completions",status="200"\} '
                     r"[1-9]", text, re.MULTILINE)
    for line in text.splitlines():  # every sample line is NAME{labels} NUMBER
        if line and not line.startswith("#"):
            assert re.fullmatch(r'[a-z_:][a-z0-9_:]*(\{[^}]*\})? [-+0-9.eInf]+', line), line


# -- the `eagerlm serve` command --------------------------------------------------------------

def test_eagerlm_serve_binds_loopback_and_answers_until_interrupted(model_path):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "eagerlm", "serve", "--model", model_path, "--port",
         str(port), "--api-key", "k", "--served-model-name", "m", "-q"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None, proc.stderr.read().decode()
            assert time.monotonic() < deadline, "eagerlm serve did not come up"
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.05)
        with openai.OpenAI(base_url=url + "/v1", api_key="k", max_retries=0) as c:
            assert [m.id for m in c.models.list()] == ["m"]
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stderr.close()


# -- fill in the middle ----------------------------------------------------------------------

FIM_SPECIALS = ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>")


def test_completion_with_a_suffix_fills_in_the_middle(tmp_path):
    """`suffix` on /v1/completions: the model writes what goes between the prompt and the
    suffix, from the FIM prompt the tokenizer builds (checked against llama.cpp's rule in
    tests/test_tokenizer.py). The reference is the sequential generator run on those ids;
    the prompt's and suffix's texts are data, so a control-token text in them stays text."""
    path = write_synthetic_model(tmp_path / "coder.gguf", tiny_spec(
        "qwen2", context_length=CONTEXT, extra_specials=FIM_SPECIALS))
    prefix, suffix = "def add(a, b):\n    <|fim_suffix|>", "\n    return c\n"
    with Engine.load(path, page_size=16384, kv_budget_bytes=16 << 20,
                     model_name=MODEL) as engine, \
            LiveServer(create_app(engine, ServerConfig())) as server, \
            openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                          timeout=30) as client:
        ids = engine.tokenizer.encode_infill(prefix, suffix)
        params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        want = "".join(c.text for c in SequentialGeneration(
            engine.loaded.transformer, engine.tokenizer, ids, params))
        for stream in (False, True):
            r = client.completions.create(model=MODEL, prompt=[prefix, prefix],
                                          suffix=suffix, max_tokens=12, temperature=0,
                                          stream=stream, extra_body={"ignore_eos": True})
            if stream:
                texts = ["", ""]
                for chunk in r:
                    for c in chunk.choices:
                        texts[c.index] += c.text
            else:
                texts = [c.text for c in r.choices]
                assert r.usage.prompt_tokens == 2 * len(ids)
            assert texts == [want, want]
        plain = client.completions.create(model=MODEL, prompt=prefix, max_tokens=12,
                                          temperature=0, extra_body={"ignore_eos": True})
        assert plain.usage.prompt_tokens != len(ids)  # without a suffix: a plain prompt
        assert_idle_and_nothing_leaked(engine, server)


def test_a_suffix_needs_a_model_with_fim_tokens_and_a_text_prompt(server, engine):
    with httpx.Client(base_url=server.url, timeout=30) as http:
        for body, message in (({"prompt": "x", "suffix": "y"}, "no fill-in-the-middle"),
                              ({"prompt": [1, 2], "suffix": "y"}, "text prompts")):
            r = http.post("/v1/completions", json={"model": MODEL, "max_tokens": 2, **body})
            assert r.status_code == 400, r.text
            assert r.json()["error"]["param"] == "suffix"
            assert message in r.json()["error"]["message"]
        empty = http.post("/v1/completions", json={"model": MODEL, "prompt": "x",
                                                   "suffix": "", "max_tokens": 2})
        assert empty.status_code == 200  # an empty suffix is no suffix
    assert_idle_and_nothing_leaked(engine, server)


# -- tokenize / detokenize -------------------------------------------------------------------

def test_tokenize_gives_the_ids_the_completion_routes_use(server, engine, client):
    """vLLM's /tokenize: the count equals the completion's prompt_tokens, for a text prompt
    and for chat messages; the ids are the tokenizer's; /detokenize gives the text back."""
    text = "Tokenize me, <|im_start|> and all."
    with httpx.Client(base_url=server.url, timeout=30) as http:
        r = http.post("/tokenize", json={"model": MODEL, "prompt": text}).json()
        assert r["tokens"] == engine.tokenizer.encode(text)
        assert r["max_model_len"] == engine.context_length
        done = client.completions.create(model=MODEL, prompt=text, max_tokens=1)
        assert r["count"] == len(r["tokens"]) == done.usage.prompt_tokens
        bare = http.post("/tokenize", json={"prompt": text, "add_special_tokens": False})
        assert bare.json()["tokens"] == engine.tokenizer.encode(text, add_special=False)
        chat = http.post("/tokenize", json={"messages": HI}).json()
        done = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=1)
        assert chat["count"] == done.usage.prompt_tokens
        no_prompt = http.post("/tokenize", json={"messages": HI,
                                                 "add_generation_prompt": False}).json()
        assert no_prompt["count"] < chat["count"]
        assert chat["tokens"][:no_prompt["count"]] == no_prompt["tokens"]
        back = http.post("/detokenize", json={"model": MODEL, "tokens": r["tokens"]}).json()
        assert back == {"prompt": text}
    assert_idle_and_nothing_leaked(engine, server)


@pytest.mark.parametrize("route, body, status, param", [
    ("tokenize", {"prompt": "x", "messages": HI}, 400, "prompt"),
    ("tokenize", {}, 400, "prompt"),
    ("tokenize", {"prompt": 5}, 400, "prompt"),
    ("tokenize", {"prompt": "x", "add_generation_prompt": True}, 400,
     "add_generation_prompt"),
    ("tokenize", {"messages": HI, "add_special_tokens": True}, 400, "add_special_tokens"),
    ("tokenize", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role"),
    ("tokenize", {"prompt": "x", "model": "other"}, 404, "model"),
    ("tokenize", {"prompt": "x", "stream": True}, 400, "stream"),
    ("detokenize", {"tokens": [1, 10 ** 6]}, 400, "tokens"),
    ("detokenize", {"tokens": [1, -1]}, 400, "tokens"),
    ("detokenize", {"tokens": "1 2"}, 400, "tokens"),
    ("detokenize", {}, 400, "tokens"),
])
def test_bad_tokenize_requests_get_openai_errors(server, route, body, status, param):
    with httpx.Client(base_url=server.url, timeout=30) as http:
        r = http.post(f"/{route}", json=body)
        assert r.status_code == status, r.text
        assert r.json()["error"]["param"] == param
        assert http.post("/tokenize", json={"prompt": "fine"}).status_code == 200
