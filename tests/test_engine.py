"""The async Python API (`service.engine`) under asyncio and trio, and its synchronous
wrapper: streaming, whole completions, logprobs and penalties (against the sequential
reference loop), chat with KV reuse, cancellation, errors."""

from __future__ import annotations

import itertools
import time

import anyio
import pytest

from eagerlm.dispatch.errors import EmptyPrompt, PromptTooLong, TokenOutOfVocabulary
from eagerlm.dispatch.messages import FinishReason
from eagerlm.kernels.sampling import SamplingParams, TokenLogprob
from eagerlm.loader.synthetic import tiny_spec, write_synthetic_model
from eagerlm.service.api.chat_tokens import TurnMemory
from eagerlm.service.api.engine import Engine
from eagerlm.service.api.model_loading import LoadProgress
from eagerlm.service.api.records import TokenLogprobs
from eagerlm.service.api.streams import GenerationError
from eagerlm.service.api.sync_engine import SyncEngine
from eagerlm.vmm.cuda_driver import CudaError, NoCudaDevice
from tests.sequential_reference import SequentialGeneration

BACKENDS = ["asyncio", "trio"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
SETTINGS = {"page_size": 4096, "kv_budget_bytes": 1 << 22}


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("engine") / "qwen3.gguf"
    return str(write_synthetic_model(path, tiny_spec("qwen3", context_length=256)))


@pytest.fixture(scope="module")
def engine(model_path):
    with Engine.load(model_path, **SETTINGS) as e:
        yield e


def reference_chunks(engine: Engine, ids, params: SamplingParams):
    """The same request run alone through the sequential loop, chunk by chunk."""
    return list(SequentialGeneration(engine.loaded.transformer, engine.tokenizer, list(ids),
                                     params))


def reference(engine: Engine, ids, params: SamplingParams) -> tuple[list[int], str]:
    """The same request run alone through the sequential loop."""
    chunks = reference_chunks(engine, ids, params)
    return [t for c in chunks for t in c.token_ids], "".join(c.text for c in chunks)


def wait_idle(engine: Engine, timeout: float = 10.0) -> None:
    """Until every submitted request has finished (bounded)."""
    deadline = time.monotonic() + timeout
    while engine.active_requests and time.monotonic() < deadline:
        time.sleep(0.005)
    assert engine.active_requests == 0


def assert_no_session_or_page_leaked(engine: Engine) -> None:
    wait_idle(engine)
    engine.flush()
    d = engine.dispatcher
    assert not d.control.sessions
    assert d.pool.n_free == d.pool.n_pages


# -- streaming and whole completions --------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
def test_chunks_stream_the_reference_output_and_end_with_a_finish_reason(engine, backend):
    ids = engine.tokenizer.encode("the cat sat on")

    async def main():
        return [c async for c in engine.generate("the cat sat on", GREEDY)]

    chunks = anyio.run(main, backend=backend)
    assert [t for c in chunks for t in c.token_ids] == reference(engine, ids, GREEDY)[0]
    assert "".join(c.text for c in chunks) == reference(engine, ids, GREEDY)[1]
    assert [c.finish_reason for c in chunks] == [None] * (len(chunks) - 1) + [
        FinishReason.LENGTH]
    assert all(c.prompt_tokens == len(ids) for c in chunks)


@pytest.mark.parametrize("backend", BACKENDS)
def test_complete_returns_the_whole_result_for_text_or_token_ids(engine, backend):
    ids = engine.tokenizer.encode("alpha beta")

    async def main():
        return (await engine.complete("alpha beta", GREEDY),
                await engine.complete(ids, GREEDY))

    from_text, from_ids = anyio.run(main, backend=backend)
    assert (from_text.text, from_text.token_ids) == (from_ids.text, from_ids.token_ids)
    assert list(from_text.token_ids) == reference(engine, ids, GREEDY)[0]
    assert from_text.completion_tokens == 8 and from_text.prompt_tokens == len(ids)
    assert from_text.finish_reason is FinishReason.LENGTH


@pytest.mark.parametrize("backend", BACKENDS)
def test_many_concurrent_generations_share_one_event_loop(engine, backend):
    """40 generations at once from one loop: each equals its run alone, and the loop
    keeps running other tasks meanwhile (submission and tokenization never block it)."""
    prompts = [f"request number {i} says" for i in range(40)]
    params = [SamplingParams(temperature=0.0 if i % 2 else 0.9, seed=i, max_tokens=6,
                             ignore_eos=True) for i in range(40)]
    ticks = 0

    async def main():
        nonlocal ticks
        results = {}

        async def one(i):
            results[i] = await engine.complete(prompts[i], params[i])

        async def ticker():
            nonlocal ticks
            while True:
                ticks += 1
                await anyio.sleep(0)

        async with anyio.create_task_group() as tg:
            tg.start_soon(ticker)
            async with anyio.create_task_group() as gens:
                for i in range(40):
                    gens.start_soon(one, i)
            tg.cancel_scope.cancel()
        return results

    results = anyio.run(main, backend=backend)
    for i in range(40):
        expected = reference(engine, engine.tokenizer.encode(prompts[i]), params[i])[0]
        assert list(results[i].token_ids) == expected, i
    assert ticks > 40


# -- log-probabilities and penalties ----------------------------------------------------------

def assert_logprobs_match(engine: Engine, got: TokenLogprobs, want: TokenLogprob,
                          n: int) -> None:
    """`got` (the engine's) is `want` (the reference loop's) with each token's text."""
    assert got.token_id == want.token
    assert got.logprob == pytest.approx(want.logprob, abs=1e-4)
    assert len(got.top) == len(want.top) == n
    assert [t.token_id for t in got.top] == [t for t, _ in want.top]
    assert [t.logprob for t in got.top] == pytest.approx([v for _, v in want.top], abs=1e-4)
    for e in (got, *got.top):
        piece = engine.tokenizer.piece(e.token_id)
        assert (e.bytes, e.text) == (piece, piece.decode("utf-8", "replace"))
    assert all(a.logprob >= b.logprob for a, b in itertools.pairwise(got.top))


@pytest.mark.parametrize("backend", BACKENDS)
def test_logprobs_stream_with_each_token_and_equal_the_reference_loop(engine, backend):
    prompt = "the cat sat on the mat"
    ids = engine.tokenizer.encode(prompt)
    cases = [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=5),
             SamplingParams(temperature=0.9, seed=11, max_tokens=8, ignore_eos=True,
                            logprobs=3, frequency_penalty=0.5),
             SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=0)]

    async def main():
        streamed = []
        for params in cases:
            streamed.append([c async for c in engine.generate(prompt, params)])
        return streamed, [await engine.complete(ids, params) for params in cases]

    streamed, whole = anyio.run(main, backend=backend)
    for params, chunks, completion in zip(cases, streamed, whole, strict=True):
        want = [lp for c in reference_chunks(engine, ids, params) for lp in c.logprobs]
        for c in chunks:
            assert c.logprobs is not None and len(c.logprobs) == len(c.token_ids)
        got = [lp for c in chunks for lp in c.logprobs]
        assert [lp.token_id for lp in got] == [t for c in chunks for t in c.token_ids]
        assert [lp.token_id for lp in completion.logprobs] == list(completion.token_ids)
        assert len(got) == len(completion.logprobs) == len(want) == params.max_tokens
        # streamed and whole (the second run reuses cached KV) both equal the reference
        for g, c, w in zip(got, completion.logprobs, want, strict=True):
            assert_logprobs_match(engine, g, w, params.logprobs)
            assert_logprobs_match(engine, c, w, params.logprobs)
            if params.greedy and params.logprobs:  # the sampled token is the most likely
                assert (g.top[0].token_id, g.top[0].logprob) == (g.token_id, g.logprob)


@pytest.mark.parametrize("backend", BACKENDS)
def test_without_logprobs_chunks_and_completions_carry_none(engine, backend):
    async def main():
        chunks = [c async for c in engine.generate("no logprobs", GREEDY)]
        return chunks, await engine.complete("no logprobs", GREEDY)

    chunks, completion = anyio.run(main, backend=backend)
    assert all(c.logprobs is None for c in chunks) and completion.logprobs is None


REPETITIVE = "a b a b a b a b a b a b"


@pytest.mark.parametrize("penalty", [{"repetition_penalty": 1.5}, {"presence_penalty": 2.0},
                                     {"frequency_penalty": 2.0},
                                     {"frequency_penalty": -1.0, "presence_penalty": 0.5}])
def test_penalties_change_the_output_as_in_the_reference_loop(engine, penalty):
    ids = engine.tokenizer.encode(REPETITIVE)
    plain = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    penalized = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, **penalty)

    async def main():
        return (await engine.complete(REPETITIVE, plain),
                await engine.complete(REPETITIVE, penalized))

    without, with_ = anyio.run(main)
    assert list(without.token_ids) == reference(engine, ids, plain)[0]
    assert list(with_.token_ids) == reference(engine, ids, penalized)[0]
    assert with_.text == reference(engine, ids, penalized)[1]
    assert with_.token_ids != without.token_ids


# -- cancellation -----------------------------------------------------------------------------

LONG = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)


@pytest.mark.parametrize("backend", BACKENDS)
def test_leaving_the_iterator_early_cancels_the_session_and_frees_its_kv(engine, backend):
    cancelled_before = engine.dispatcher.service.stats.finished.get("cancelled", 0)

    async def main():
        n = 0
        async for chunk in engine.generate("a long story", LONG):
            n += len(chunk.token_ids)
            if n >= 3:
                break
        return n

    assert anyio.run(main, backend=backend) == 3
    assert_no_session_or_page_leaked(engine)
    assert engine.dispatcher.service.stats.finished["cancelled"] == cancelled_before + 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_cancelling_the_task_cancels_the_session_and_frees_its_kv(engine, backend):
    cancelled_before = engine.dispatcher.service.stats.finished.get("cancelled", 0)
    got = []

    async def main():
        async def consume():
            async for chunk in engine.generate("another long story", LONG):
                got.append(chunk)

        async with anyio.create_task_group() as tg:
            tg.start_soon(consume)
            while not got:
                await anyio.sleep(0.001)
            tg.cancel_scope.cancel()

    anyio.run(main, backend=backend)
    assert got and got[-1].finish_reason is None
    assert_no_session_or_page_leaked(engine)
    assert engine.dispatcher.service.stats.finished["cancelled"] == cancelled_before + 1


# -- chat -----------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
def test_second_chat_turn_reuses_the_kv_of_the_first(engine, backend):
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    turn1 = [{"role": "user", "content": "tell me about the mat"}]
    engine.flush()  # no KV cached from other tests

    async def main():
        first = await engine.chat_complete(turn1, params)
        turn2 = [*turn1, {"role": "assistant", "content": first.text},
                 {"role": "user", "content": "and then?"}]
        return first, await engine.chat_complete(turn2, params), turn2

    first, second, turn2 = anyio.run(main, backend=backend)
    assert first.cached_tokens == 0
    # the whole first exchange is reused: its prompt and reply (all but the last reply
    # token, whose KV is never computed)
    assert second.cached_tokens == first.prompt_tokens + first.completion_tokens - 1
    # and the reply is what the conversation gives without any cache
    ids = engine.prepare_chat(turn2).ids
    assert list(second.token_ids) == reference(engine, ids, params)[0]


def test_turn_memory_keeps_the_generated_ids_of_a_reply(engine):
    tok = engine.tokenizer
    memory = TurnMemory(tok)
    prompt_text = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    prompt_ids = tok.encode(prompt_text)
    reply_ids = [tok.encode("ab", add_special=False)[0], *tok.encode("c", add_special=False)]
    reply_text = tok.decode(reply_ids)
    memory.remember(prompt_text, prompt_ids, reply_text, [*reply_ids, tok.token_id("<|im_end|>")])
    follow = prompt_text + reply_text + "<|im_end|>\n<|im_start|>user\nmore<|im_end|>\n"
    ids = memory.encode(follow)
    assert ids[:len(prompt_ids) + len(reply_ids)] == [*prompt_ids, *reply_ids]
    assert tok.decode(ids) == tok.decode(tok.encode(follow))
    # text that does not continue a remembered turn is encoded as usual
    assert memory.encode("unrelated") == tok.encode("unrelated")


# -- errors -----------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
def test_requests_the_engine_refuses_raise_before_generating(engine, backend):
    async def main():
        with pytest.raises(PromptTooLong):
            await engine.generate(list(range(3, 300)), GREEDY).start()
        with pytest.raises(EmptyPrompt):
            async for _ in engine.generate([], GREEDY):
                pass
        with pytest.raises(TokenOutOfVocabulary, match="the prompt names token 1000000"):
            await engine.complete([10**6], GREEDY)

    anyio.run(main, backend=backend)
    assert engine.active_requests == 0


def test_a_request_running_when_the_engine_stops_raises_generation_error(model_path):
    async def main():
        with Engine.load(model_path, **SETTINGS) as e:
            stream = e.generate("x", SamplingParams(temperature=0.0, max_tokens=250,
                                                    ignore_eos=True))
            await stream.__anext__()
            await anyio.to_thread.run_sync(e.shutdown)
            with pytest.raises(GenerationError, match="shut down"):
                async for _ in stream:
                    pass
            with pytest.raises(RuntimeError, match="shut down"):
                await e.complete("y", GREEDY)

    anyio.run(main)


def _has_gpu() -> bool:
    from eagerlm.vmm.cuda_driver import device_count

    try:
        return device_count() > 0
    except NoCudaDevice:
        return False


@pytest.mark.parametrize("device, error", [
    pytest.param("cuda", NoCudaDevice,
                 marks=pytest.mark.skipif(_has_gpu(), reason="this machine has a GPU")),
    ("cuda:7", (NoCudaDevice, CudaError)),  # no GPU at all, or no 8th one
    ("tpu", ValueError)])
def test_devices_this_machine_cannot_use_give_a_clear_error(model_path, device, error):
    with pytest.raises(error, match="cuda|device"):
        Engine.load(model_path, device)


# -- opening ----------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
def test_open_reports_load_progress_and_shuts_down_on_exit(model_path, backend):
    seen: list[LoadProgress] = []

    async def main():
        async with Engine.open(model_path, on_progress=seen.append, **SETTINGS) as e:
            done = await e.complete("hi", GREEDY)
        return e, done

    e, done = anyio.run(main, backend=backend)
    assert done.completion_tokens == 8
    stages = [p.stage for p in seen]
    assert stages[0] == "header" and stages[-1] == "ready" and "weights" in stages
    weights = [p for p in seen if p.stage == "weights"]
    assert weights[-1].done == weights[-1].total > 0
    assert all(a.done <= b.done for a, b in itertools.pairwise(weights))
    with pytest.raises(RuntimeError, match="shut down"):
        e.dispatcher.submit([1, 2], GREEDY, lambda out: None)


# -- the synchronous wrapper ----------------------------------------------------------------

def test_sync_engine_gives_plain_iterators_with_the_same_results(engine):
    sync = SyncEngine(engine)
    ids = engine.tokenizer.encode("plain iterator")
    chunks = list(sync.generate("plain iterator", GREEDY))
    assert [t for c in chunks for t in c.token_ids] == reference(engine, ids, GREEDY)[0]
    whole = sync.complete("plain iterator", GREEDY)
    assert whole.text == anyio.run(engine.complete, "plain iterator", GREEDY).text
    assert whole.text == "".join(c.text for c in chunks)
    reply = sync.chat_complete([{"role": "user", "content": "hi"}], GREEDY)
    assert reply.completion_tokens == 8


def test_sync_engine_reports_the_same_logprobs(engine):
    sync = SyncEngine(engine)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=4,
                            repetition_penalty=1.3)
    chunks = list(sync.generate("plain iterator", params))
    assert all(len(c.logprobs) == len(c.token_ids) for c in chunks)
    whole = sync.complete("plain iterator", params)
    want = [lp for c in reference_chunks(engine, engine.tokenizer.encode("plain iterator"),
                                         params) for lp in c.logprobs]
    streamed = [lp for c in chunks for lp in c.logprobs]
    for g, c, w in zip(streamed, whole.logprobs, want, strict=True):
        assert_logprobs_match(engine, g, w, 4)
        assert_logprobs_match(engine, c, w, 4)
    reply = sync.chat_complete([{"role": "user", "content": "hi"}], params)
    assert len(reply.logprobs) == reply.completion_tokens == 6


def test_sync_iterator_left_early_cancels_its_session(engine):
    sync = SyncEngine(engine)
    for chunk in sync.generate("leave me", LONG):
        assert chunk.finish_reason is None
        break
    assert_no_session_or_page_leaked(engine)


def test_a_pool_full_of_cached_prefixes_still_gives_the_next_turn_its_hit(model_path):
    """Once unrelated requests have left their prefixes in every page (a replica that has
    served a while, now idle), a second chat turn still reuses the first: older entries
    are evicted to make room for the hit, rather than the hit being dropped. Eight large
    pages, so that a few cached prefixes fill the pool."""
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    turn1 = [{"role": "user", "content": "tell me about the mat"}]
    engine = Engine.load(model_path, page_size=1 << 16, kv_budget_bytes=8 << 16)
    pool = engine.dispatcher.pool

    async def main():
        for i in range(2 * pool.n_pages):
            await engine.complete(f"unrelated prompt number {i}: " + "w " * 20, params)
        first = await engine.chat_complete(turn1, params)
        full = pool.n_free == 0
        turn2 = [*turn1, {"role": "assistant", "content": first.text},
                 {"role": "user", "content": "and then?"}]
        return first, full, await engine.chat_complete(turn2, params)

    with engine:
        first, full, second = anyio.run(main)
    assert full  # the case in point: no free page when the second turn arrives
    assert second.cached_tokens == first.prompt_tokens + first.completion_tokens - 1
