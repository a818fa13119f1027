"""eagerlm replicas behind SGLang's router (`sglang-router`), on loopback.

Three `eagerlm serve` processes (cpu backend, a tiny synthetic model) and one router in
front of them, each a process this module starts and ends by its own id. What is pinned
down is what docs/deployment.md promises: the router spreads unrelated requests over the
replicas; with its cache-aware policy a conversation's turns go back to the replica that
holds its prefix, whose prefix-cache counter (`eagerlm_cached_prompt_tokens_total`) rises;
a replica killed under load fails the requests it held cleanly (an error or a cut stream,
never a hang), the others take the new ones, and the replica restarted rejoins.

Every wait is bounded (HTTP timeouts, deadlines), so a regression fails instead of hanging.
"""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from eagerlm.dispatch.token_judge import TokenJudge
from eagerlm.kernels.sampling import SamplingParams
from eagerlm.loader.synthetic import tiny_spec, write_synthetic_model
from eagerlm.loader.tokenizer import Tokenizer
from eagerlm.service.http.openai_errors import OpenAIError
from eagerlm.service.http.openai_requests import parse_chat_request, parse_completion_request

MODEL = "tiny"
START_TIMEOUT_S = 60.0  # a replica or the router up and healthy (2 shared cores, CI)
REQUEST_TIMEOUT_S = 30.0  # any one request through the router


# -- what the router adds to each request ----------------------------------------------------

# The fields sglang-router 0.3 adds to every body it forwards (seen on the wire, logged by a
# stub worker), beside the client's own.
ROUTER_COMPLETION_FIELDS = {"echo": False, "no_stop_trim": False, "ignore_eos": False,
                            "skip_special_tokens": True, "return_hidden_states": False}
ROUTER_CHAT_FIELDS = {"logprobs": False, "no_stop_trim": False, "ignore_eos": False,
                      "continue_final_message": False, "skip_special_tokens": True,
                      "separate_reasoning": True, "stream_reasoning": True,
                      "return_hidden_states": False}


def test_the_fields_the_router_adds_are_accepted_at_its_values_only():
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    assert parse_completion_request({"model": MODEL, "prompt": "hi",
                                     **ROUTER_COMPLETION_FIELDS}).skip_special_tokens
    assert parse_chat_request({**chat, **ROUTER_CHAT_FIELDS}).skip_special_tokens
    for field_name, other in (("no_stop_trim", True), ("return_hidden_states", True),
                              ("continue_final_message", True),
                              ("separate_reasoning", False)):
        with pytest.raises(OpenAIError) as refused:
            parse_chat_request({**chat, **ROUTER_CHAT_FIELDS, field_name: other})
        assert refused.value.status == 400 and refused.value.param == field_name


def test_skip_special_tokens_leaves_control_tokens_out_of_the_text():
    """vLLM's and SGLang's field, which the router sets: a control token the model writes
    (one that does not end the request) shows as its text only when it is off."""
    tok = Tokenizer.from_metadata(tiny_spec("qwen3").vocab().metadata())
    ids = [*tok.encode("a", add_special=False), tok.token_id("<|im_start|>"),
           *tok.encode("b", add_special=False)]

    def text(skip: bool) -> str:
        judge = TokenJudge(tok, SamplingParams(max_tokens=len(ids), ignore_eos=True,
                                               skip_special_tokens=skip), len(ids))
        return "".join(judge.accept(t)[0] for t in ids)
    assert text(False) == "a<|im_start|>b"
    assert text(True) == "ab"


# -- replicas behind the router ---------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.TransportError:
        return False


@dataclass
class Replica:
    """One `eagerlm serve` process on its own port; `start` again after `kill` restarts
    it on the same port, as a supervisor would."""

    model_path: Path
    log: Path
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "eagerlm", "serve", "--model", str(self.model_path),
                 "--port", str(self.port), "--served-model-name", MODEL,
                 "--kv-budget-mib", "16", "-q"],
                stdout=log, stderr=subprocess.STDOUT)

    def wait_healthy(self) -> None:
        def up() -> bool:
            assert self.proc is not None and self.proc.poll() is None, self.log.read_text()
            return answers(self.url + "/health")
        wait_until(up, START_TIMEOUT_S, f"replica {self.url}")

    def kill(self) -> None:
        """SIGKILL: the replica dies mid-work, as a crashed or OOM-killed one does."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()

    def metric(self, name: str) -> float:
        """The sum of a metric's samples (all label sets) in the replica's /metrics."""
        text = httpx.get(self.url + "/metrics", timeout=5).text
        return sum(float(v) for v in re.findall(
            rf"^{name}(?:\{{[^}}]*\}})? (\S+)$", text, re.MULTILINE))

    def finished(self) -> float:
        return self.metric("eagerlm_requests_total")


@dataclass
class Router:
    """`python -m sglang_router.launch_router` over the replicas, health-checking them
    every second so that a dead one leaves, and a restarted one returns, within seconds
    (docs/deployment.md gives the same flags)."""

    worker_urls: list[str]
    policy: str
    log: Path
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "sglang_router.launch_router",
                 "--worker-urls", *self.worker_urls, "--policy", self.policy,
                 "--host", "127.0.0.1", "--port", str(self.port),
                 "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
                 "--health-check-interval-secs", "1", "--health-failure-threshold", "1",
                 "--health-success-threshold", "1",
                 # a killed replica refuses connections at once; a live one on 2 shared CI
                 # cores can take seconds to answer while it loads its compiled kernels, and
                 # one late answer would take it out of the rotation (failure threshold 1)
                 "--health-check-timeout-secs", "10",
                 # the circuit a dead replica's failures open is tried again after 1 s
                 # (default 60), so that the restarted one returns within the test's time
                 "--cb-timeout-duration-secs", "1",
                 "--request-timeout-secs", str(int(REQUEST_TIMEOUT_S)),
                 "--shutdown-grace-period-secs", "1", "--log-level", "warn"],
                stdout=log, stderr=subprocess.STDOUT)
        wait_until(self._ready, START_TIMEOUT_S, "the router and its workers")

    def _ready(self) -> bool:
        assert self.proc is not None and self.proc.poll() is None, self.log.read_text()
        try:
            r = httpx.post(self.url + "/v1/completions", timeout=5, json={
                "model": MODEL, "prompt": "ready?", "max_tokens": 1})
        except httpx.TransportError:
            return False
        return r.status_code == 200

    def health_failures(self) -> list[str]:
        """The health checks the router logged as failed, for a failure's message."""
        return [line for line in self.log.read_text(errors="replace").splitlines()
                if "health check failed" in line]

    def healthy(self, worker_url: str) -> bool:
        """What the router's health checker last saw of a worker (its `GET /workers`)."""
        workers = httpx.get(self.url + "/workers", timeout=5).json()["workers"]
        return next(w["is_healthy"] for w in workers if w["url"] == worker_url)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("router") / "tiny.gguf"
    return write_synthetic_model(path, tiny_spec("qwen3", context_length=1024))


@pytest.fixture(scope="module")
def replica_set(model_path, tmp_path_factory) -> Iterator[tuple[list[Replica], Router]]:
    """Three replicas behind one cache-aware router (the router's default policy)."""
    pytest.importorskip("sglang_router", reason="the router comes with the test extra")
    logs = tmp_path_factory.mktemp("logs")
    replicas = [Replica(model_path, logs / f"replica{i}.log") for i in range(3)]
    router = Router([r.url for r in replicas], "cache_aware", logs / "router.log")
    try:
        for r in replicas:
            r.start()
        for r in replicas:
            r.wait_healthy()
        router.start()
        yield replicas, router
    finally:
        router.stop()
        for r in replicas:
            r.stop()


def complete(router: Router, prompt: str, max_tokens: int = 4) -> httpx.Response:
    return httpx.post(router.url + "/v1/completions", timeout=REQUEST_TIMEOUT_S, json={
        "model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})


def distinct_prompt(i: int) -> str:
    """Prompts that share no prefix with one another, so the cache-aware policy has no
    match to follow and places them by load."""
    return f"{i * 7919 % 1000:03d} " + " ".join(f"w{(i * 31 + k) % 97}" for k in range(12))


def test_an_idle_replica_reports_no_load_however_warm_its_cache(replica_set):
    """`/get_load` in SGLang's form (what the router's power_of_two policy reads): one
    entry, whose `num_tokens` counts running requests' tokens, not cached prefixes. The
    router reads it as SGLang's (its own `/get_loads` says -1 for a load it cannot read),
    and lists the served model under its name, read from each replica's `/server_info`."""
    replicas, router = replica_set
    for i in range(3):
        r = httpx.post(replicas[0].url + "/v1/completions", timeout=REQUEST_TIMEOUT_S,
                       json={"model": MODEL, "prompt": distinct_prompt(50 + i),
                             "max_tokens": 2})
        assert r.status_code == 200
    assert replicas[0].metric("eagerlm_kv_pages_in_use") > 0  # the prefixes stay cached
    assert httpx.get(replicas[0].url + "/get_load", timeout=5).json() == [
        {"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}]
    assert httpx.get(router.url + "/v1/models", timeout=5).json()["data"][0]["id"] == MODEL
    loads = httpx.get(router.url + "/get_loads", timeout=5).json()["workers"]
    assert sorted((w["worker"], w["load"]) for w in loads) == sorted(
        (r.url, 0) for r in replicas)


def test_unrelated_requests_spread_over_every_replica(replica_set):
    replicas, router = replica_set
    wait_until(lambda: all(router.healthy(r.url) for r in replicas), START_TIMEOUT_S,
               "the router to see every replica healthy")
    before = [r.finished() for r in replicas]
    with ThreadPoolExecutor(6) as pool:
        responses = list(pool.map(lambda i: complete(router, distinct_prompt(i)), range(18)))
    assert [r.status_code for r in responses] == [200] * 18
    served = [r.finished() - b for r, b in zip(replicas, before)]
    assert sum(served) == 18
    assert all(n >= 1 for n in served), (served, router.health_failures())


def test_a_conversation_goes_back_to_the_replica_holding_its_prefix(replica_set):
    """Each turn's prompt is the last turn's prompt, its reply and a new question: the
    cache-aware router sends it where the last turn ran, and that replica's prefix cache
    serves the shared part (its cached-token counter rises turn after turn)."""
    replicas, router = replica_set
    messages = [{"role": "system", "content": "You answer in one short sentence. " * 8}]
    placements, cached_gains = [], []
    for turn in range(4):
        messages.append({"role": "user", "content": f"Question {turn}: what comes next?"})
        finished = [r.finished() for r in replicas]
        cached = [r.metric("eagerlm_cached_prompt_tokens_total") for r in replicas]
        r = httpx.post(router.url + "/v1/chat/completions", timeout=REQUEST_TIMEOUT_S, json={
            "model": MODEL, "messages": messages, "max_tokens": 6, "temperature": 0})
        assert r.status_code == 200, r.text
        messages.append({"role": "assistant",
                         "content": r.json()["choices"][0]["message"]["content"]})
        served = [i for i, rep in enumerate(replicas) if rep.finished() > finished[i]]
        assert len(served) == 1, served
        placements.append(served[0])
        cached_gains.append(replicas[served[0]].metric("eagerlm_cached_prompt_tokens_total")
                            - cached[served[0]])
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == cached_gains[-1]
    assert len(set(placements)) == 1, placements
    assert all(gain > 0 for gain in cached_gains[1:]), cached_gains


def test_a_killed_replica_fails_its_requests_cleanly_and_rejoins_once_restarted(replica_set):
    replicas, router = replica_set

    def stream(i: int) -> str:
        """One streamed request's outcome: 'done' (all its tokens, then [DONE]) or
        'failed' (an error status, an error event, or a stream cut short)."""
        # long enough to be seen in flight: 48 tokens of the tiny model could all be done
        # between two looks at the replicas' loads (a clean-clone CI timed out so)
        body = {"model": MODEL, "prompt": distinct_prompt(100 + i), "max_tokens": 384,
                "temperature": 0, "stream": True, "ignore_eos": True}
        try:
            with httpx.stream("POST", router.url + "/v1/completions", json=body,
                              timeout=REQUEST_TIMEOUT_S) as r:
                if r.status_code != 200:
                    return "failed"
                lines = [line for line in r.iter_lines() if line.startswith("data:")]
        except httpx.TransportError:
            return "failed"
        if lines[-1:] != ["data: [DONE]"]:
            return "failed"
        chunks = [json.loads(line[5:]) for line in lines[:-1]]
        if any("error" in c for c in chunks):
            return "failed"
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"  # all its tokens
        return "done"

    held: list[Replica] = []

    def some_held() -> bool:
        held[:] = [r for r in replicas
                   if httpx.get(r.url + "/get_load", timeout=5).json()[0]["num_tokens"] > 0]
        return bool(held)

    # Under load: twelve streams in flight over three replicas; the victim dies holding some.
    # The victim is whichever replica is first seen holding requests' tokens: the cache-aware
    # policy places unmatched prompts on the replica whose prefix tree is smallest, which
    # depends on what the earlier tests sent where, so a fixed replica may be given none.
    started = time.monotonic()
    with ThreadPoolExecutor(12) as pool:
        outcomes = [pool.submit(stream, i) for i in range(12)]
        wait_until(some_held, 20, "a replica to hold requests' tokens")
        victim = held[0]
        victim.kill()
        others = [r for r in replicas if r is not victim]
        results = [f.result(timeout=2 * REQUEST_TIMEOUT_S) for f in outcomes]
    assert time.monotonic() - started < 2 * REQUEST_TIMEOUT_S  # nobody hung
    assert set(results) <= {"done", "failed"}
    assert results.count("done") >= 1  # the other replicas' streams ran to the end

    # Once the router's health check has seen it dead (within one check interval; until
    # then a request sent to it fails, as the in-flight ones did), new requests all go to
    # the live replicas.
    wait_until(lambda: not router.healthy(victim.url), 10, "the router to drop the victim")
    before = [r.finished() for r in others]
    for i in range(6):
        assert complete(router, distinct_prompt(200 + i)).status_code == 200
    assert sum(r.finished() for r in others) - sum(before) == 6

    # Restarted on its port, the replica is taken back: it serves new requests again.
    victim.start()
    victim.wait_healthy()
    wait_until(lambda: router.healthy(victim.url), 10, "the router to take the victim back")

    def victim_serves() -> bool:
        """A burst of six at once: with no prefix to follow, the cache-aware policy picks
        the least busy replica, which an idle newcomer is while the others work."""
        base = int(time.monotonic() * 100)
        with ThreadPoolExecutor(6) as pool:
            codes = list(pool.map(lambda i: complete(router, distinct_prompt(base + i),
                                                     max_tokens=16).status_code, range(6)))
        assert codes == [200] * 6
        return victim.finished() > 0
    wait_until(victim_serves, 30, "the restarted replica to be routed to")
