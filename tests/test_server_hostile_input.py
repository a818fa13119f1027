"""Hostile and careless input to the server: never a 500 for the client's own input, never
a traceback or an unencodable reply, bodies only as application/json, every answer
counted, and a SIGTERM that ends every response cleanly and exits 0."""

from __future__ import annotations

import json
import logging
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from eagerlm.errors import InvalidParameters
from eagerlm.loader.synthetic import tiny_spec, write_synthetic_model
from eagerlm.service.api.bounded_json import MAX_JSON_DEPTH, JSONRefused, loads, nesting_depth
from eagerlm.service.api.engine import Engine
from eagerlm.service.api.tool_calls import ToolCallFormat, ToolCallParser
from eagerlm.service.http.server import ServerConfig, create_app
from tests.test_server import (
    LiveServer,
    assert_idle_and_nothing_leaked,
    sse_payloads,
    wait_until,
)

MODEL = "tiny-hostile"
JSON = {"content-type": "application/json"}
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("hostile") / "qwen3.gguf"
    return str(write_synthetic_model(path, tiny_spec("qwen3", context_length=4096)))


@pytest.fixture(scope="module")
def engine(model_path):
    with Engine.load(model_path, page_size=16384, kv_budget_bytes=64 << 20,
                     model_name=MODEL) as e:
        yield e


@pytest.fixture(scope="module")
def server(engine):
    with LiveServer(create_app(engine, ServerConfig())) as s:
        yield s


def post(http: httpx.Client, route: str, raw: bytes, **headers: str) -> httpx.Response:
    return http.post(route, content=raw, headers={**JSON, **headers})


def assert_openai_error(r: httpx.Response, status: int, code: str | None = None) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["message"] and error["type"]
    if code is not None:
        assert error["code"] == code, error
    return error


def still_serving(http: httpx.Client) -> None:
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "ok", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1


# -- client input is never a 500 ----------------------------------------------------------

def test_json_nested_deeper_than_the_limit_is_a_400_naming_the_limit(server, engine):
    """100k nested arrays made Python's parser raise RecursionError, a 500. The depth is
    now measured first, in linear time, wherever client JSON is decoded: the body, and a
    tool call's `arguments` string inside it."""
    deep = b"[" * 100_000 + b"]" * 100_000
    tool_turn = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function",
         "function": {"name": "f", "arguments": "[" * 100_000 + "]" * 100_000}}]}
    with httpx.Client(base_url=server.url, timeout=30) as http:
        for route in ("/v1/chat/completions", "/v1/completions", "/tokenize"):
            error = assert_openai_error(post(http, route, deep), 400, "invalid_json")
            assert f"deeper than {MAX_JSON_DEPTH}" in error["message"]
        deep_object = b'{"a":' * 50_000 + b"1" + b"}" * 50_000
        assert_openai_error(post(http, "/v1/chat/completions", deep_object), 400,
                            "invalid_json")
        r = http.post("/v1/chat/completions", json={
            "model": MODEL, "messages": [*HI, tool_turn, {"role": "tool",
                                                          "tool_call_id": "c1",
                                                          "content": "x"}]})
        error = assert_openai_error(r, 400, "invalid_value")
        assert error["param"] == "messages[1].tool_calls[0].function.arguments"
        assert f"deeper than {MAX_JSON_DEPTH}" in error["message"]
        # at the limit the body is parsed: the error is about the field, not the depth
        at_limit = {"model": MODEL, "prompt": "x", "user": 0}
        inner: object = 1
        for _ in range(MAX_JSON_DEPTH - 1):
            inner = [inner]
        at_limit["user"] = inner
        error = assert_openai_error(http.post("/v1/completions", json=at_limit), 400)
        assert error["param"] == "user"
        still_serving(http)
    assert_idle_and_nothing_leaked(engine, server)


def test_the_depth_is_measured_in_linear_time_without_counting_brackets_in_strings():
    start = time.perf_counter()
    assert nesting_depth("[" * (2 << 20)) == 2 << 20  # 2 MiB, twice the default body limit
    assert nesting_depth('"' + '\\"' * (1 << 20)) == 0  # one unterminated string
    assert nesting_depth('"\\"' * (1 << 20) + "\\") == 0  # quotes that each restart one
    assert time.perf_counter() - start < 2.0  # a quadratic scan would take hours
    assert nesting_depth('{"a": [1, {"b": "[[[[{{"}], "c": "\\"]"}') == 3
    assert loads('{"code": "' + "[" * 1000 + '"}') == {"code": "[" * 1000}
    with pytest.raises(JSONRefused):
        loads("[" * (MAX_JSON_DEPTH + 1) + "]" * (MAX_JSON_DEPTH + 1))


def test_a_model_writing_calls_nested_too_deep_gets_them_back_as_content():
    """A model's tool call is parsed with the same bound: text the parser could not read
    without deep recursion stays content, whatever the format."""
    deep = '{"name": "f", "arguments": ' + "[" * 5000 + "]" * 5000 + "}"
    for fmt, text in ((ToolCallFormat.LLAMA3_JSON, deep),
                      (ToolCallFormat.HERMES, f"<tool_call>{deep}</tool_call>")):
        reply = ToolCallParser(fmt, ["f"]).reply(text, True)
        assert reply.content == text and not reply.tool_calls


LONE_SURROGATE_BODIES = [
    # (route, raw body): a lone surrogate where it made the error message unencodable,
    # or reached the tokenizer and the model as bytes that are not UTF-8
    ("/v1/completions", b'{"model": "\\ud800", "prompt": "x"}'),
    ("/v1/completions", b'{"model": "tiny-hostile", "\\udfff": 1, "prompt": "x"}'),
    ("/v1/completions", b'{"model": "tiny-hostile", "prompt": "a\\ud800b", "max_tokens": 2}'),
    ("/v1/completions", b'{"model": "tiny-hostile", "prompt": "a", "stop": "\\udc00", '
                        b'"max_tokens": 2}'),
    ("/v1/completions", b'{"model": "tiny-hostile", "prompt": "a\\ud800", "stream": true}'),
    ("/v1/chat/completions", b'{"model": "tiny-hostile", "messages": [{"role": "user", '
                             b'"content": "\\ud83d"}], "max_tokens": 2}'),
    ("/v1/chat/completions", b'{"model": "tiny-hostile", "messages": [{"role": "\\ud800", '
                             b'"content": "x"}]}'),
    ("/tokenize", b'{"prompt": "\\ud800"}'),
    ("/tokenize", b'{"messages": [{"role": "user", "content": "\\udfff"}]}'),
]


@pytest.mark.parametrize("route, raw", LONE_SURROGATE_BODIES)
def test_a_lone_surrogate_anywhere_in_the_body_is_a_400(server, route, raw):
    with httpx.Client(base_url=server.url, timeout=30) as http:
        error = assert_openai_error(post(http, route, raw), 400, "invalid_json")
        assert "surrogate" in error["message"]
        paired = raw.replace(b"\\ud83d", b"\\ud83d\\ude00")  # a pair is one character
        if paired != raw:
            assert post(http, route, paired).status_code == 200
        still_serving(http)


def test_an_error_message_quoting_unencodable_text_still_encodes(server, engine,
                                                                 monkeypatch):
    """Error bodies are rendered as ASCII JSON: whatever a message quotes (here a lone
    surrogate in an exception's text), the reply encodes and says it."""
    def refuse(prompt):
        raise InvalidParameters("cannot take \ud800 here")

    monkeypatch.setattr(engine, "prepare", refuse)
    with httpx.Client(base_url=server.url, timeout=30) as http:
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
        assert r.status_code == 400, r.text
        assert r.content.isascii()
        assert json.loads(r.content)["error"]["message"] == "cannot take \ud800 here"


def metric_value(text: str, route: str, status: int) -> float:
    match = re.search(rf'^eagerlm_http_responses_total\{{route="{re.escape(route)}",'
                      rf'status="{status}"\}} (\S+)$', text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def test_an_unexpected_exception_is_an_openai_500_and_is_counted(server, engine,
                                                                 monkeypatch):
    """The 500 of a bug is answered by Starlette's outermost middleware, after the
    response counter; it is counted all the same."""
    def broken(prompt):
        raise RuntimeError("a bug")

    with httpx.Client(base_url=server.url, timeout=30) as http:
        before = metric_value(http.get("/metrics").text, "/v1/completions", 500)
        monkeypatch.setattr(engine, "prepare", broken)
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
        error = assert_openai_error(r, 500)
        assert error["type"] == "server_error" and "a bug" in error["message"]
        monkeypatch.undo()
        after = metric_value(http.get("/metrics").text, "/v1/completions", 500)
        assert after == before + 1
        still_serving(http)
    assert_idle_and_nothing_leaked(engine, server)


# -- clients that go away --------------------------------------------------------------------

def send_and_close(url: str, route: str, body: bytes, sent: int) -> None:
    """POST `body` to `route` declaring its whole length, send only its first `sent`
    bytes, and close the connection: a cancelled request, a client-side timeout."""
    host, port = url.removeprefix("http://").split(":")
    head = (f"POST {route} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(head + body[:sent])


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize("half", [True, False], ids=["half a body", "headers only"])
def test_a_client_that_closes_before_its_body_is_read_is_a_quiet_499_not_a_500(
        server, engine, caplog, route, half):
    """starlette's ClientDisconnect, from reading the body, reached the catch-all handler:
    counted as a 500, logged with two tracebacks (ours and uvicorn's). Now it is counted
    as a 499 ("client closed request", as nginx and vLLM log it) with one info line."""
    fields = {"messages": HI} if "chat" in route else {"prompt": "x"}
    body = json.dumps({"model": MODEL, "max_tokens": 4, **fields}).encode()
    uvicorn_log = logging.getLogger("uvicorn.error")  # does not propagate to caplog's root
    uvicorn_log.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.DEBUG), \
                httpx.Client(base_url=server.url, timeout=30) as http:
            counts = http.get("/metrics").text
            before = {status: metric_value(counts, route, status) for status in (499, 500)}
            submitted = engine.metrics.submitted
            caplog.clear()
            send_and_close(server.url, route, body, len(body) // 2 if half else 0)
            wait_until(lambda: metric_value(http.get("/metrics").text, route, 499)
                       == before[499] + 1)
            assert metric_value(http.get("/metrics").text, route, 500) == before[500]
            still_serving(http)
    finally:
        uvicorn_log.removeHandler(caplog.handler)
    assert engine.metrics.submitted == submitted + 1  # still_serving's request alone
    ours = [r for r in caplog.records if "closed the connection" in r.getMessage()]
    assert len(ours) == 1 and ours[0].levelno == logging.INFO, caplog.text
    assert f"POST {route}: 499" in ours[0].getMessage()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    assert not [r for r in caplog.records if r.exc_info], caplog.text
    assert_idle_and_nothing_leaked(engine, server)


# -- content types -------------------------------------------------------------------------

@pytest.mark.parametrize("content_type", [
    "text/plain", "text/plain;charset=UTF-8", "application/x-www-form-urlencoded",
    "multipart/form-data; boundary=x", "application/merge-patch+json", "application/jsonx",
    None])
def test_bodies_not_sent_as_application_json_are_refused_with_415(server, content_type):
    """A browser posts text/plain, form types or no type cross-origin without a CORS
    preflight; `curl -d` sends a form type. None of them reaches the model."""
    body = json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 2}).encode()
    with httpx.Client(base_url=server.url, timeout=30) as http:
        for route in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
            headers = {} if content_type is None else {"content-type": content_type}
            r = http.post(route, content=body, headers=headers)
            error = assert_openai_error(r, 415, "unsupported_media_type")
            assert "application/json" in error["message"]
        for accepted in ("application/json; charset=utf-8", "Application/JSON"):
            r = http.post("/v1/completions", content=body,
                          headers={"content-type": accepted})
            assert r.status_code == 200, r.text


# -- SIGTERM ---------------------------------------------------------------------------------

def test_sigterm_ends_every_response_cleanly_refuses_new_ones_and_exits_0(model_path):
    """Two long streams and a long whole reply run, one more request waits for a slot;
    SIGTERM. New requests are refused at once; after the grace period the streams end
    with an in-band error event and [DONE], the others get a 503, and the process exits 0
    (uvicorn alone cut the streams mid-body and died of the signal, status -15)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "eagerlm", "serve", "--model", model_path, "--port",
         str(port), "--device", "cpu", "--served-model-name", MODEL, "-q",
         "--max-concurrency", "3", "--shutdown-grace", "0.5"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    long = {"model": MODEL, "prompt": "go on", "max_tokens": 4000, "ignore_eos": True}
    streams: dict[int, list] = {}
    replies: dict[str, httpx.Response] = {}
    first_chunks = threading.Semaphore(0)

    def stream(i: int) -> None:
        with httpx.Client(base_url=url, timeout=30) as http, \
                http.stream("POST", "/v1/completions", json={**long, "stream": True}) as r:
            assert r.status_code == 200
            lines = []
            for line in r.iter_lines():
                if not lines:
                    first_chunks.release()
                lines.append(line)
            streams[i] = sse_payloads(lines)

    def whole(name: str) -> None:
        with httpx.Client(base_url=url, timeout=30) as http:
            replies[name] = http.post("/v1/completions", json=long)

    threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(2)]
    threads += [threading.Thread(target=whole, args=(name,), daemon=True)
                for name in ("running", "queued")]
    try:
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None, proc.stderr.read().decode()
            assert time.monotonic() < deadline, "eagerlm serve did not come up"
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.05)
        for t in threads[:3]:
            t.start()
        for _ in range(2):
            assert first_chunks.acquire(timeout=10)
        threads[3].start()  # waits: the three slots are taken
        with httpx.Client(base_url=url, timeout=5) as http:
            deadline = time.monotonic() + 10
            while "eagerlm_queue_length 1" not in http.get("/metrics").text:
                assert time.monotonic() < deadline, "the fourth request never queued"
                time.sleep(0.02)

        proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 3
        while True:  # the server notices the signal within its 0.1 s tick
            try:
                r = httpx.get(url + "/health", timeout=2)
            except httpx.TransportError:
                break  # the listening socket is closed
            if r.status_code == 503:
                assert r.json()["error"]["code"] == "server_shutting_down"
                break
            assert r.status_code == 200 and time.monotonic() < deadline
            time.sleep(0.02)

        assert proc.wait(timeout=20) == 0
        for t in threads:
            t.join(10)
            assert not t.is_alive()
        for events in streams.values():
            assert events[-1] == "[DONE]"
            assert events[-2]["error"]["code"] == "server_shutting_down"
            assert all("choices" in e for e in events[:-2])  # whole events up to there
        assert len(streams) == 2
        for name in ("running", "queued"):
            assert_openai_error(replies[name], 503, "server_shutting_down")
        assert b"Traceback" not in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stderr.close()
