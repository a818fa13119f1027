"""Hostile chat templates stop: a render has a time limit, no value it builds may exceed
the size limit, and a render builds a bounded amount in all; in the library, the CLI and
the server, leaving no thread, alarm or concurrency slot behind.

The size cases run in one child process whose address space is capped (RLIMIT_AS), so a
case that allocated gigabytes before failing would show up as a MemoryError there.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from eagerlm.loader.chat_template import ChatTemplate, ChatTemplateError
from eagerlm.loader.synthetic import tiny_spec, write_synthetic_model
from eagerlm.loader.template_budget import MAX_BUILT, MAX_VALUE_CHARS
from eagerlm.service.api.engine import Engine
from eagerlm.service.http.server import ServerConfig, create_app
from tests.test_chat_template import QWEN25_TEMPLATE
from tests.test_server import LiveServer, wait_until

ROOT = Path(__file__).resolve().parent.parent
USER = [{"role": "user", "content": "hi"}]
LOOPS = ("{% for a in range(100000) %}{% for b in range(100000) %}"
         "{% for c in range(100000) %}{% endfor %}{% endfor %}{% endfor %}")
LIMIT_S = 0.5


def looping(limit_s: float = LIMIT_S) -> ChatTemplate:
    template = ChatTemplate(LOOPS)
    template.time_limit_s = limit_s
    return template


# -- time ----------------------------------------------------------------------------------

def test_nested_loops_stop_at_the_time_limit_with_an_error_naming_it():
    start = time.monotonic()
    with pytest.raises(ChatTemplateError, match=r"exceeded the 0.5 s time limit"):
        looping().render(USER)
    assert time.monotonic() - start < LIMIT_S + 1


def test_exponential_macro_recursion_stops_at_the_time_limit():
    template = ChatTemplate("{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}"
                            "{% endmacro %}{{ f(60) }}")
    template.time_limit_s = LIMIT_S
    with pytest.raises(ChatTemplateError, match="time limit"):
        template.render(USER)


def test_an_interrupted_render_leaves_nothing_behind_on_its_thread():
    with pytest.raises(ChatTemplateError, match="time limit"):
        looping().render(USER)
    time.sleep(LIMIT_S + 0.2)  # a stray alarm would land in this thread by now
    sum(range(1_000_000))
    assert ChatTemplate("ok {{ messages[0].content }}").render(USER) == "ok hi"


def test_time_limit_works_on_other_threads_and_in_parallel():
    results: list[str] = []

    def render() -> None:
        try:
            looping().render(USER)
        except ChatTemplateError as e:
            results.append(str(e))

    threads = [threading.Thread(target=render) for _ in range(3)]
    start = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert time.monotonic() - start < LIMIT_S + 2
    assert len(results) == 3 and all("time limit" in r for r in results)


def test_a_fast_render_just_under_its_limit_is_not_interrupted():
    template = ChatTemplate("{% for i in range(20000) %}{{ i }}{% endfor %}")
    template.time_limit_s = 0.05
    for _ in range(50):  # renders near the deadline: a late alarm must never leak out
        try:
            template.render(USER)
        except ChatTemplateError as e:
            assert "time limit" in str(e)
    sum(range(1_000_000))


# -- size ----------------------------------------------------------------------------------

TOO_BIG = f"exceeds the {MAX_VALUE_CHARS}-character limit on any one value"
SIZE_CASES = {
    "join filter": "{{ (['x' * 1000000] * 2000) | join }}",
    "center filter": "{{ 'x' | center(2000000000) }}",
    "format filter": "{{ '%2000000000s' | format('x') }}",
    "percent operator": "{{ '%*d' % (2000000000, 1) }}",
    "str.format width": "{{ '{:>2000000000}'.format(1) }}",
    "str.format nested width": "{{ '{:>{}}'.format(1, 2000000000) }}",
    "str.format precision": "{{ '{:.2000000000f}'.format(1.5) }}",
    "str.ljust": "{{ 'x'.ljust(2000000000) }}",
    "str.center": "{{ 'x'.center(2000000000) }}",
    "str.zfill": "{{ 'x'.zfill(2000000000) }}",
    "str.expandtabs": "{{ ('\t' * 1000).expandtabs(2000000) }}",
    "str.join": "{{ ('x' * 1000000).join(['a'] * 2000) }}",
    "str.replace": "{{ ('x' * 100000).replace('', 'y' * 100000) }}",
    "str.translate": "{{ ('a' * 100000).translate({97: 'b' * 100000}) }}",
    "replace filter": "{{ ('x' * 100000) | replace('x', 'y' * 100000) }}",
    "indent filter": "{{ ('x\n' * 100000) | indent(100000) }}",
    "wordwrap filter": "{{ ('a ' * 1000000) | wordwrap(1, wrapstring='x' * 10000) }}",
    "batch filter": "{{ [1] | batch(2000000000, 'x') | list }}",
    "repetition": "{{ 'x' * 100000000 }}",
    "int.to_bytes": "{{ (5).to_bytes(2000000000, 'big') }}",
    "~ doubling in a loop": "{% set ns = namespace(s='x') %}{% for i in range(64) %}"
                            "{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
    "+ doubling in a loop": "{% set ns = namespace(s='x') %}{% for i in range(64) %}"
                            "{% set ns.s = ns.s + ns.s %}{% endfor %}",
    "list + doubling": "{% set ns = namespace(s=['x'] * 1000) %}{% for i in range(64) %}"
                       "{% set ns.s = ns.s + ns.s %}{% endfor %}",
    "shared list literal": "{% set ns = namespace(s='x' * 1000) %}{% for i in range(64) %}"
                           "{% set ns.s = [ns.s, ns.s] %}{% endfor %}{{ ns.s }}",
    "macro doubling": "{% macro d(s) %}{{ s }}{{ s }}{% endmacro %}{% set ns = namespace(s='x') %}"
                      "{% for i in range(64) %}{% set ns.s = d(ns.s) %}{% endfor %}",
    "block set doubling": "{% set ns = namespace(s='x') %}{% for i in range(64) %}"
                          "{% set ns.s %}{{ ns.s }}{{ ns.s }}{% endset %}{% endfor %}",
    "str of a shared list": "{{ (['x' * 100000] * 100000) | upper }}",
    "indented json": "{% set d = [[[[[['x'] * 1000]]]]] %}"
                     "{{ ([d] * 1000) | tojson(indent=100000) }}",
    # held alive by recursion: each value is small enough, all of them together are not
    "built in all": "{% macro f(n, s) %}{% if n %}{{ f(n - 1, s ~ 'x') }}{% endif %}"
                    "{% endmacro %}{% set a = 'x' * 1000000 %}{% set b = a ~ a ~ a ~ a %}"
                    "{{ f(200, b ~ b ~ b ~ b) }}",
    "integer squaring": "{% set ns = namespace(x=3) %}{% for i in range(64) %}"
                        "{% set ns.x = ns.x * ns.x %}{% endfor %}",
    "sum of lists": "{{ ([[1] * 1000] * 1000) | sum(start=[]) }}",
}
EXPECTED = {"built in all": f"more than {MAX_BUILT} characters in all",
            "integer squaring": "integer above 4096 bits",
            "sum of lists": "summed sequences"}

CHILD = """
import json, resource, sys, time
resource.setrlimit(resource.RLIMIT_AS, (1536 << 20, 1536 << 20))
from eagerlm.loader.chat_template import ChatTemplate, ChatTemplateError
out = {}
for name, source in json.loads(sys.stdin.read()).items():
    start = time.monotonic()
    try:
        ChatTemplate(source).render([{"role": "user", "content": "hi"}])
        message = "rendered"
    except ChatTemplateError as e:
        message = str(e)
    except MemoryError:
        message = "MemoryError"
    out[name] = [message, time.monotonic() - start]
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def size_results() -> dict[str, list]:
    done = subprocess.run([sys.executable, "-c", CHILD], input=json.dumps(SIZE_CASES),
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.mark.parametrize("case", list(SIZE_CASES))
def test_big_values_stop_at_the_size_limit_quickly_in_bounded_memory(case, size_results):
    message, seconds = size_results[case]
    assert EXPECTED.get(case, TOO_BIG) in message
    assert seconds < 3


def test_a_large_legitimate_conversation_renders_within_the_limits():
    content = "word " * 800_000  # 4M characters: about a million tokens
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": content},
                {"role": "assistant", "content": content},
                {"role": "user", "content": "and?"}]
    text = ChatTemplate(QWEN25_TEMPLATE).render(messages, add_generation_prompt=True)
    assert text.count(content) == 2 and text.endswith("<|im_start|>assistant\n")


# -- the CLI and the server ----------------------------------------------------------------

@pytest.fixture(scope="module")
def looping_model(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("limits") / "loops.gguf"
    return write_synthetic_model(path, tiny_spec("qwen2", context_length=4096,
                                                 chat_template=LOOPS))


def test_cli_generate_with_a_looping_template_exits_2_with_one_line(looping_model):
    # the CLI's own entry point, with the class-wide limit lowered to keep the test fast
    code = ("import sys; from eagerlm.loader.chat_template import ChatTemplate; "
            "ChatTemplate.time_limit_s = 1.0; from eagerlm.service.cli.commands import main; "
            "sys.exit(main(sys.argv[1:]))")
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-c", code, "generate", "-m", str(looping_model),
                           "--chat", "-p", "hi", "-n", "2", "-q"],
                          capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "eagerlm: error: chat template rendering exceeded the 1 s time limit "
        "(field 'gguf:tokenizer.chat_template')"]
    assert time.monotonic() - start < 30


@pytest.fixture(scope="module")
def looping_server(looping_model):
    with Engine.load(looping_model, page_size=16384, kv_budget_bytes=64 << 20,
                     model_name="loops") as engine:
        engine.model.chat_template.time_limit_s = 1.0
        app = create_app(engine, ServerConfig(max_concurrency=2, max_queue=0))
        with LiveServer(app) as server:
            yield server


def test_server_answers_a_looping_template_with_400_and_keeps_serving(looping_server):
    url = looping_server.url
    chat = {"model": "loops", "messages": USER, "max_tokens": 2}
    completion = {"model": "loops", "prompt": "hi", "max_tokens": 2}
    with httpx.Client(timeout=30) as client:
        client.post(url + "/v1/completions", json=completion)  # warm the worker pool
        threads_before = threading.active_count()
        replies: list[httpx.Response] = []
        started = time.monotonic()
        slow = threading.Thread(target=lambda: replies.append(
            client.post(url + "/v1/chat/completions", json=chat)))
        slow.start()
        time.sleep(0.2)
        meanwhile = client.post(url + "/v1/completions", json=completion)
        assert meanwhile.status_code == 200 and slow.is_alive()  # answered during the render
        slow.join(10)
        assert time.monotonic() - started < 5
        (reply,) = replies
        assert reply.status_code == 400
        error = reply.json()["error"]
        assert error["param"] == "messages" and "1 s time limit" in error["message"]
        for _ in range(3):  # each render ends: no worker thread stays busy, no slot held
            assert client.post(url + "/v1/chat/completions", json=chat).status_code == 400
        gate = looping_server.app.state.gate
        wait_until(lambda: gate.active == 0)
        assert threading.active_count() <= threads_before + 1
        assert client.post(url + "/v1/completions", json=completion).status_code == 200
