"""Embeddings (`Engine.embed`, POST /v1/embeddings) against a float64 numpy computation of
the same pooling over tests/reference_forward.py's hidden states: the file's pooling (last
token, as Qwen3-Embedding; CLS; mean) or mean for any model served with `--embeddings`,
L2-normalised; OpenAI's format, float and base64, through the official client."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import openai
import pytest

from eagerlm.loader.synthetic import tiny_spec, write_synthetic_model
from eagerlm.service.api.embeddings import Pooling
from eagerlm.service.api.engine import Engine
from eagerlm.service.http.server import ServerConfig, create_app
from tests.reference_forward import reference_hidden_states
from tests.test_server import LiveServer

MODEL = "tiny-embed"
TEXTS = ["the cat sat on the mat", "a completely different sentence", "x"]


def reference_embedding(path: str, ids: list[int], pooling: Pooling) -> np.ndarray:
    hidden = reference_hidden_states(path, ids).astype(np.float64)
    v = {Pooling.MEAN: hidden.mean(axis=0), Pooling.CLS: hidden[0],
         Pooling.LAST: hidden[-1]}[pooling]
    return v / np.linalg.norm(v)


def load(path) -> Engine:
    return Engine.load(path, page_size=16384, kv_budget_bytes=16 << 20, model_name=MODEL)


@pytest.fixture(scope="module")
def embedding_model(tmp_path_factory):
    spec = tiny_spec("qwen3", pooling_type=int(Pooling.LAST))
    return str(write_synthetic_model(tmp_path_factory.mktemp("emb") / "qwen3-emb.gguf", spec))


@pytest.fixture(scope="module")
def plain_model(tmp_path_factory):
    return str(write_synthetic_model(tmp_path_factory.mktemp("emb") / "llama.gguf",
                                     tiny_spec("llama")))


@pytest.fixture(scope="module")
def engine(embedding_model):
    with load(embedding_model) as e:
        yield e


def test_the_file_says_how_to_pool(engine, plain_model):
    assert engine.pooling is Pooling.LAST
    with load(plain_model) as plain:
        assert plain.pooling is None


@pytest.mark.parametrize("pooling", [None, Pooling.MEAN, Pooling.CLS])
def test_embed_matches_float64_pooling_of_the_reference_forward(engine, embedding_model,
                                                                pooling):
    vectors = engine.embed(TEXTS, pooling=pooling)
    for text, v in zip(TEXTS, vectors):
        ids = engine.tokenizer.encode(text)
        want = reference_embedding(embedding_model, ids, pooling or Pooling.LAST)
        assert v.dtype == np.float32 and v.shape == want.shape
        assert abs(np.linalg.norm(v) - 1) < 1e-5
        np.testing.assert_allclose(v, want, atol=2e-5)


def test_embed_between_running_generations_leaves_them_unchanged(engine):
    from eagerlm.kernels.sampling import SamplingParams

    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    alone = list(engine.dispatcher.stream([1, 2, 3, 4], params))
    stream = engine.dispatcher.stream([1, 2, 3, 4], params)
    first = next(stream)
    vectors = engine.embed(TEXTS[:1])
    rest = list(stream)
    assert [t for o in [first, *rest] for t in o.token_ids] == \
        [t for o in alone for t in o.token_ids]
    np.testing.assert_array_equal(vectors[0], engine.embed(TEXTS[:1])[0])


@pytest.fixture(scope="module")
def server(engine):
    with LiveServer(create_app(engine, ServerConfig())) as s:
        yield s


def test_openai_client_gets_the_embeddings_base64_and_float(server, engine):
    want = engine.embed(TEXTS)
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as c:
        r = c.embeddings.create(model=MODEL, input=TEXTS)  # the client asks for base64
    assert [d.index for d in r.data] == [0, 1, 2]
    for d, w in zip(r.data, want):
        np.testing.assert_array_equal(np.asarray(d.embedding, np.float32), w)
    n_tokens = sum(len(engine.tokenizer.encode(t)) for t in TEXTS)
    assert r.usage.prompt_tokens == r.usage.total_tokens == n_tokens

    body = httpx.post(server.url + "/v1/embeddings", timeout=30, json={
        "model": MODEL, "input": engine.tokenizer.encode(TEXTS[0]),
        "encoding_format": "float"}).json()
    assert body["object"] == "list" and body["data"][0]["object"] == "embedding"
    np.testing.assert_array_equal(np.asarray(body["data"][0]["embedding"], np.float32),
                                  want[0])
    b64 = httpx.post(server.url + "/v1/embeddings", timeout=30, json={
        "model": MODEL, "input": TEXTS[0], "encoding_format": "base64"}).json()
    raw = np.frombuffer(base64.b64decode(b64["data"][0]["embedding"]), "<f4")
    np.testing.assert_array_equal(raw, want[0])


@pytest.mark.parametrize("fields, param", [
    ({"input": []}, "input"), ({"input": ["a", ""]}, "input"),
    ({"input": [[10 ** 6]]}, "input"), ({"dimensions": 8}, "dimensions"),
    ({"encoding_format": "int8"}, "encoding_format"), ({"input": "a", "pooling": 1},
                                                      "pooling")])
def test_bad_embedding_requests_are_400s_naming_the_field(server, fields, param):
    r = httpx.post(server.url + "/v1/embeddings", timeout=30,
                   json={"model": MODEL, "input": "a", **fields})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_a_chat_model_embeds_only_with_the_embeddings_flag_and_still_chats(plain_model):
    with load(plain_model) as engine:
        with LiveServer(create_app(engine, ServerConfig())) as s:
            r = httpx.post(s.url + "/v1/embeddings", json={"model": MODEL, "input": "a"})
            assert r.status_code == 400 and r.json()["error"]["param"] == "model"
        with LiveServer(create_app(engine, ServerConfig(embeddings=True))) as s:
            r = httpx.post(s.url + "/v1/embeddings", timeout=30,
                           json={"model": MODEL, "input": TEXTS[0]})
            ids = engine.tokenizer.encode(TEXTS[0])
            np.testing.assert_allclose(r.json()["data"][0]["embedding"],
                                       reference_embedding(plain_model, ids, Pooling.MEAN),
                                       atol=2e-5)
            chat = httpx.post(s.url + "/v1/chat/completions", timeout=30, json={
                "model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 2})
            assert chat.status_code == 200


def test_pooling_type_is_written_and_read_as_llama_cpp_does(embedding_model):
    from gguf import GGUFReader

    field = GGUFReader(embedding_model).get_field("qwen3.pooling_type")
    assert field is not None and int(field.contents()) == 3
    assert tiny_spec("qwen3").pooling_type is None  # chat models write no key


def test_embed_on_an_engine_that_cannot_serve_raises_instead_of_waiting(embedding_model):
    from eagerlm.errors import EngineClosed
    from tests.test_server_dropin import kill_control_thread

    with load(embedding_model) as engine:
        kill_control_thread(engine)
        with pytest.raises(EngineClosed, match="injected failure"):
            engine.embed(["hello"])


def test_on_the_emulated_gpu_embeddings_run_between_rounds_as_on_the_cpu(tmp_path):
    """The cuda backend: the control thread launches the embedding's forward between two
    rounds (its matrices are bf16 there, hence the tolerance), and a generation running
    meanwhile gives the tokens it gives alone."""
    from eagerlm.dispatch.dispatcher import Dispatcher, DispatcherConfig
    from eagerlm.kernels.cuda_backend import cuda_transformer
    from eagerlm.kernels.cuda_ops import CudaOps
    from eagerlm.kernels.sampling import SamplingParams
    from eagerlm.loader.model_file import ModelFile
    from eagerlm.service.api.embeddings import embed_ids
    from eagerlm.vmm.device import open_device
    from tests.emulated_gpu.gpu_emulator import emulated_gpu_for_test

    path = write_synthetic_model(tmp_path / "emb.gguf",
                                 tiny_spec("qwen3", context_length=128, pooling_type=3))
    with emulated_gpu_for_test(row_exact_gemm=True):
        gpu = open_device("cuda")
        model = ModelFile.open(path)
        tf = cuda_transformer(model, ops=CudaOps(gpu))
        d = Dispatcher(gpu, tf, model.tokenizer, DispatcherConfig(memory_fraction=0.05))
        try:
            ids = model.tokenizer.encode(TEXTS[0])
            params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
            alone = [t for o in d.stream([1, 2, 3], params) for t in o.token_ids]
            stream = d.stream([1, 2, 3], params)
            first = next(stream)
            for pooling in (Pooling.LAST, Pooling.MEAN):
                v = d.call_between_rounds(lambda p=pooling: embed_ids(tf, ids, p))
                np.testing.assert_allclose(v, reference_embedding(str(path), ids, pooling),
                                           atol=5e-3)
            assert first.token_ids + [t for o in stream for t in o.token_ids] == alone
        finally:
            d.shutdown()
            gpu.close()
