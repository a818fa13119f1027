"""What clients and operations tools written for OpenAI, vLLM and llama.cpp send and read,
over loopback with the official openai client: harmless extra fields accepted and ignored
(fields that would change the output still refused), vLLM's metric names as Prometheus'
own parser reads them, and /health turning 503 (and `serve` exiting non-zero) once the
engine's thread has died."""

from __future__ import annotations

import json
import logging
import socket
import threading
import time

import anyio
import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from eagerlm.errors import InvalidParameters
from eagerlm.loader.synthetic import tiny_spec, write_synthetic_model
from eagerlm.service.api.engine import Engine
from eagerlm.service.http.liveness import EngineDied
from eagerlm.service.http.server import ServerConfig, create_app, serve, serve_loading
from tests.test_server import LiveServer

MODEL = "tiny-dropin"
HI = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("dropin") / "qwen3.gguf"
    return str(write_synthetic_model(path, tiny_spec("qwen3", context_length=512)))


def load(model_path: str) -> Engine:
    return Engine.load(model_path, page_size=16384, kv_budget_bytes=32 << 20,
                       model_name=MODEL)


@pytest.fixture(scope="module")
def engine(model_path):
    with load(model_path) as e:
        yield e


@pytest.fixture(scope="module")
def server(engine):
    with LiveServer(create_app(engine, ServerConfig())) as s:
        yield s


@pytest.fixture()
def client(server):
    with server.openai() as c:
        yield c


# -- fields that cannot change the output are ignored, the others refused ------------------

HARMLESS = {"store": True, "metadata": {"team": "search"}, "service_tier": "flex",
            "prompt_cache_key": "user-42", "prompt_cache_retention": "24h",
            "safety_identifier": "hash", "user": "u1"}


def test_harmless_extra_fields_are_accepted_and_change_nothing(client, caplog):
    plain = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=4,
                                           temperature=0)
    with caplog.at_level(logging.INFO, logger="eagerlm.server"):
        for _ in range(2):
            r = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=4,
                                               temperature=0, extra_body=HARMLESS)
            assert r.choices[0].message.content == plain.choices[0].message.content
        c = client.completions.create(model=MODEL, prompt="hi", max_tokens=2,
                                      extra_body={"metadata": {"a": "b"}, "store": False})
    assert c.choices[0].text is not None
    logged = [m for m in caplog.messages if "ignoring the request field 'prompt_cache_key'"
              in m]
    assert len(logged) <= 1  # once per process (maybe before this test: never twice)


@pytest.mark.parametrize("field, value", [
    ("audio", {"voice": "alloy", "format": "wav"}), ("functions", [{"name": "f"}]),
    ("web_search_options", {}), ("verbosity", "low"), ("modalities", ["text", "audio"]),
    ("temprature", 0.5)])
def test_fields_that_would_change_the_output_stay_a_400_naming_them(client, field, value):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=HI, max_tokens=2,
                                       extra_body={field: value})
    assert e.value.body["param"] == field


# -- vLLM's metric names ---------------------------------------------------------------------

VLLM_FAMILIES = {
    "vllm:num_requests_running": "gauge", "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge", "vllm:prompt_tokens": "counter",
    "vllm:generation_tokens": "counter", "vllm:prefix_cache_queries": "counter",
    "vllm:prefix_cache_hits": "counter", "vllm:request_success": "counter",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:spec_decode_num_drafts": "counter", "vllm:spec_decode_num_draft_tokens": "counter",
    "vllm:spec_decode_num_accepted_tokens": "counter"}


def test_vllm_metric_names_carry_the_model_name_and_parse_as_prometheus_text(
        server, client, engine):
    for _ in range(2):  # the second request's prompt hits the prefix cache
        client.completions.create(model=MODEL, prompt="the same prompt, twice over",
                                  max_tokens=5, temperature=0,
                                  extra_body={"ignore_eos": True})
    text = httpx.get(server.url + "/metrics", timeout=30).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name, kind in VLLM_FAMILIES.items():
        assert families[name].type == kind, name
        for s in families[name].samples:
            assert s.labels["model_name"] == MODEL, s

    def value(name: str, **labels: str) -> float:
        return next(s.value for f in families.values() for s in f.samples
                    if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))

    assert value("vllm:generation_tokens_total") >= 10
    assert value("vllm:prompt_tokens_total") == value("vllm:prefix_cache_queries_total")
    assert 0 < value("vllm:prefix_cache_hits_total") < value("vllm:prompt_tokens_total")
    assert value("vllm:request_success_total", finished_reason="length") >= 2
    assert value("vllm:num_requests_running") == value("vllm:num_requests_waiting") == 0
    assert 0.0 <= value("vllm:kv_cache_usage_perc") <= 1.0
    assert value("vllm:time_to_first_token_seconds_count") >= 2
    assert value("vllm:e2e_request_latency_seconds_bucket", le="+Inf") == \
        value("vllm:e2e_request_latency_seconds_count")
    assert value("vllm:inter_token_latency_seconds_count") >= 8


# -- /health and the server's exit once the engine cannot serve --------------------------

def kill_control_thread(engine: Engine) -> None:
    """Make the control thread's next step raise, and wake it with a request."""
    control = engine.dispatcher.control

    def broken_step() -> bool:
        raise RuntimeError("injected failure")

    control._step = broken_step  # type: ignore[method-assign]
    outputs = list(engine.dispatcher.stream([1, 2, 3], _params()))  # wakes the thread
    assert outputs[-1].finish_reason.value == "error"
    deadline = time.monotonic() + 10
    while control.alive:
        assert time.monotonic() < deadline, "the control thread did not die"
        time.sleep(0.01)


def _params():
    from eagerlm.kernels.sampling import SamplingParams
    return SamplingParams(max_tokens=50, ignore_eos=True)


def test_health_is_ok_then_503_once_the_control_thread_has_died(model_path):
    with load(model_path) as engine, LiveServer(create_app(engine)) as server:
        r = httpx.get(server.url + "/health", timeout=10)
        assert r.status_code == 200 and r.json()["status"] == "ok"
        kill_control_thread(engine)
        r = httpx.get(server.url + "/health", timeout=10)
        assert r.status_code == 503, r.text
        assert "injected failure" in r.json()["error"]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def in_thread(fn) -> tuple[threading.Thread, list[BaseException]]:
    errors: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as e:
            errors.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, errors


def get_when_up(url: str) -> httpx.Response:
    deadline = time.monotonic() + 10
    while True:
        assert time.monotonic() < deadline, "the server did not come up"
        try:
            return httpx.get(url, timeout=1)
        except httpx.TransportError:
            time.sleep(0.05)


def test_serve_stops_and_raises_once_the_engine_cannot_serve(model_path):
    port = free_port()
    with load(model_path) as engine:
        thread, errors = in_thread(lambda: serve(engine, ServerConfig(port=port),
                                                 log_level="warning"))
        assert get_when_up(f"http://127.0.0.1:{port}/health").status_code == 200
        kill_control_thread(engine)
        thread.join(15)
        assert not thread.is_alive(), "serve kept running with a dead engine"
    assert len(errors) == 1 and isinstance(errors[0], EngineDied), errors


def test_health_is_503_loading_until_the_model_is_up_then_ok(model_path):
    port, release, engines = free_port(), threading.Event(), []

    def slow_load() -> Engine:
        assert release.wait(20)
        engines.append(load(model_path))
        return engines[0]

    url = f"http://127.0.0.1:{port}"
    thread, errors = in_thread(lambda: serve_loading(slow_load, ServerConfig(port=port),
                                                     log_level="warning"))
    r = get_when_up(url + "/health")
    assert r.status_code == 503 and r.json() == {"status": "loading"}
    r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "x"})
    assert r.status_code == 503 and r.json()["error"]["code"] == "model_loading"
    release.set()
    deadline = time.monotonic() + 20
    while httpx.get(url + "/health", timeout=5).status_code != 200:
        assert time.monotonic() < deadline, "never became healthy"
        time.sleep(0.05)
    kill_control_thread(engines[0])  # the only way to stop a server outside the main thread
    thread.join(15)
    assert not thread.is_alive() and isinstance(errors[0], EngineDied), errors
    assert engines[0].failure == "the engine is shut down"  # serve_loading owns the engine


def test_a_load_that_fails_stops_the_server_with_its_error():
    def bad_load() -> Engine:
        raise InvalidParameters("no such model")

    thread, errors = in_thread(lambda: serve_loading(bad_load, ServerConfig(port=free_port()),
                                                     log_level="warning"))
    thread.join(15)
    assert not thread.is_alive()
    assert len(errors) == 1 and isinstance(errors[0], InvalidParameters), errors


# -- SSE keep-alive comments -------------------------------------------------------------------

class _Releasable:
    released = closed = False

    def release(self) -> None:
        self.released = True

    def close(self) -> None:
        self.closed = True


async def test_an_idle_stream_gets_keep_alive_comments_between_its_events():
    from fastapi import FastAPI

    from eagerlm.service.http.event_stream import EventStream
    from eagerlm.service.http.openai_responses import error_ending
    from eagerlm.service.http.shutdown import Drain

    async def slow_events():
        yield "data: 1\n\n"
        await anyio.sleep(0.35)  # a long prefill
        yield "data: 2\n\n"

    held = _Releasable()
    app = FastAPI()

    @app.get("/events")
    async def events() -> EventStream:
        return EventStream(slow_events(), held, held, Drain(), error_ending, keepalive_s=0.1)

    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
        text = (await http.get("/events")).text
    blocks = text.split("\n\n")[:-1]
    assert blocks[0] == "data: 1" and blocks[-1] == "data: 2"
    assert set(blocks[1:-1]) == {": keep-alive"} and len(blocks[1:-1]) >= 2
    assert held.released and held.closed


class SlotTaken:
    """The server's one slot held by a long request from another thread (the gate is the
    server loop's: it is only touched through requests)."""

    def __init__(self, server: LiveServer) -> None:
        self.server = server
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        httpx.post(self.server.url + "/v1/completions", timeout=60, json={
            "model": MODEL, "prompt": "x", "max_tokens": 400, "ignore_eos": True})

    def __enter__(self) -> SlotTaken:
        gate = self.server.app.state.gate
        self.thread.start()
        deadline = time.monotonic() + 10
        while gate.active == 0:
            assert time.monotonic() < deadline
            time.sleep(0.005)
        return self

    def __exit__(self, *exc: object) -> None:
        self.thread.join(60)


def data_events(text: str) -> list[dict | str]:
    """The data events of a stream, without what differs between two runs."""
    out: list[dict | str] = []
    for block in text.split("\n\n"):
        if block.startswith("data: "):
            data = block[6:]
            out.append(data if data == "[DONE]" else
                       {k: v for k, v in json.loads(data).items() if k not in ("id", "created")})
    return out


def test_a_stream_queued_for_a_slot_gets_keep_alives_then_its_events(engine):
    app = create_app(engine, ServerConfig(max_concurrency=1, sse_keepalive_s=0.02))
    body = {"model": MODEL, "prompt": "x", "max_tokens": 3, "stream": True,
            "temperature": 0}
    with LiveServer(app) as server:
        alone = httpx.post(server.url + "/v1/completions", json=body, timeout=30).text
        with SlotTaken(server):
            queued = httpx.post(server.url + "/v1/completions", json=body, timeout=60).text
    blocks = [b for b in queued.split("\n\n") if b]
    first_data = next(i for i, b in enumerate(blocks) if b.startswith("data: "))
    assert first_data >= 2 and set(blocks[:first_data]) == {": keep-alive"}
    assert data_events(queued) == data_events(alone)
    assert app.state.gate.active == 0 and app.state.gate.queued == 0


def test_a_queued_stream_the_engine_refuses_ends_with_an_error_event(engine):
    app = create_app(engine, ServerConfig(max_concurrency=1, sse_keepalive_s=0.02))
    body = {"model": MODEL, "prompt": "x", "max_tokens": 3, "stream": True,
            "logit_bias": {"1000000": 1}}
    with LiveServer(app) as server, SlotTaken(server):
        text = httpx.post(server.url + "/v1/completions", json=body, timeout=60).text
    events = data_events(text)
    assert events[0]["error"]["param"] == "logit_bias"
    assert events[-1] == "[DONE]"
    assert app.state.gate.active == 0 and app.state.gate.queued == 0
