"""The benchmark harness: workloads as specified (lengths, seeds, Poisson arrivals),
latency statistics computed exactly on hand-made timings, `eagerlm bench offline|online`
against the in-process engine (cpu backend, tiny synthetic model), and the URL mode against
a minimal OpenAI-style streaming server run in the test."""

from __future__ import annotations

import argparse
import json
import math
import statistics
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

from eagerlm.service.measure.bench import add_bench_parser, bench_online_url
from eagerlm.service.measure.request_metrics import Distribution, RequestRecord, summarize
from eagerlm.service.measure.workload import LengthRange, WorkloadSpec, make_workload


def _parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="eagerlm")
    add_bench_parser(ap.add_subparsers(dest="command", required=True))
    return ap.parse_args(argv)


# -- workloads ---------------------------------------------------------------------------

def test_defaults_are_nano_vllm_shaped():
    args = _parse(["bench", "offline"])
    assert args.num_requests == 256
    assert args.input_len == LengthRange(100, 1024) == args.output_len
    assert _parse(["bench", "online"]).request_rate == math.inf


def test_length_ranges_parse_and_refuse_nonsense():
    assert LengthRange.parse("100-1024") == LengthRange(100, 1024)
    assert LengthRange.parse("32") == LengthRange(32, 32)
    for bad in ("0", "9-3", "a-b", "-5"):
        with pytest.raises(ValueError):
            LengthRange.parse(bad)


def test_workload_lengths_are_in_range_and_fixed_by_the_seed():
    spec = WorkloadSpec(200, LengthRange(5, 40), LengthRange(3, 9), seed=7)
    reqs = make_workload(spec, vocab_size=100)
    assert reqs == make_workload(spec, vocab_size=100)
    assert reqs != make_workload(WorkloadSpec(200, spec.input_len, spec.output_len, seed=8),
                                 vocab_size=100)
    assert {len(r.prompt_ids) for r in reqs} == set(range(5, 41))  # uniform: all drawn
    assert {r.max_tokens for r in reqs} == set(range(3, 10))
    assert all(0 <= t < 100 for r in reqs for t in r.prompt_ids)
    assert all(r.arrival_s == 0.0 for r in reqs)  # infinite rate: all at once


def test_workload_is_cut_to_fit_the_context():
    spec = WorkloadSpec(50, LengthRange(100, 200), LengthRange(50, 80))
    for r in make_workload(spec, vocab_size=10, context_length=128):
        assert len(r.prompt_ids) + r.max_tokens < 128 and len(r.prompt_ids) >= 1


def test_poisson_arrivals_have_the_requested_rate():
    spec = WorkloadSpec(4000, LengthRange(1, 1), LengthRange(1, 1), request_rate=20.0)
    times = [r.arrival_s for r in make_workload(spec, vocab_size=10)]
    gaps = np.diff(times)
    assert times[0] == 0.0 and (gaps >= 0).all()
    assert statistics.mean(gaps) == pytest.approx(1 / 20, rel=0.05)
    assert statistics.stdev(gaps) == pytest.approx(1 / 20, rel=0.08)  # exponential


# -- statistics ----------------------------------------------------------------------------

def test_latency_summary_of_known_timings_is_exact():
    a = RequestRecord(0, 10.0, 5, token_times=[10.5, 10.75, 11.0, 11.5])
    b = RequestRecord(1, 10.25, 3, token_times=[11.25, 12.25])
    failed = RequestRecord(2, 10.0, 4, error="boom")
    s = summarize([a, b, failed])
    assert (s.n_requests, s.n_failed, s.input_tokens, s.output_tokens) == (3, 1, 8, 6)
    assert s.duration_s == 2.25  # first arrival 10.0 to last token 12.25
    assert s.output_tok_s == 6 / 2.25
    assert s.ttft == Distribution(2, 750.0, 750.0, 950.0, 995.0)  # 500 and 1000 ms
    # ITLs 250, 250, 500 (a) and 1000 (b): linear-interpolated percentiles
    assert s.itl.mean == 500.0 and s.itl.p50 == 375.0
    assert s.itl.p90 == float(np.percentile([250, 250, 500, 1000], 90))
    assert s.tpot.n == 2 and s.tpot.mean == (1000 / 3 + 1000) / 2
    assert s.e2e.p50 == 1750.0  # 1500 and 2000 ms


# -- the in-process engine ---------------------------------------------------------------

def test_bench_offline_produces_every_requested_token(tmp_path, capsys):
    out = tmp_path / "offline.json"
    args = _parse(["bench", "offline", "--synthetic", "tiny", "-n", "6", "--input-len",
                   "4-24", "--output-len", "2-10", "--max-batch", "4", "--json", str(out)])
    assert args.func(args) == 0
    assert "Throughput:" in capsys.readouterr().out
    result = json.loads(out.read_text())
    planned = make_workload(WorkloadSpec(6, LengthRange(4, 24), LengthRange(2, 10)),
                            vocab_size=512, context_length=256)
    s = result["summary"]
    assert s["n_failed"] == 0
    assert s["output_tokens"] == sum(r.max_tokens for r in planned)
    assert s["input_tokens"] == sum(len(r.prompt_ids) for r in planned)
    assert s["output_tok_s"] > 0 and result["settings"]["mode"] == "eager"


def test_bench_online_against_the_engine_reports_latency_percentiles(tmp_path, capsys):
    out = tmp_path / "online.json"
    args = _parse(["bench", "online", "--synthetic", "tiny", "-n", "8", "--input-len", "8",
                   "--output-len", "6", "--request-rate", "200", "--json", str(out)])
    assert args.func(args) == 0
    text = capsys.readouterr().out
    for line in ("P99 TTFT (ms)", "P90 ITL (ms)", "P50 E2E latency (ms)"):
        assert line in text
    s = json.loads(out.read_text())["summary"]
    assert s["output_tokens"] == 8 * 6 and s["itl"]["n"] == 8 * 5
    assert 0 < s["ttft"]["p50"] <= s["e2e"]["p50"]


# -- an OpenAI-compatible URL ----------------------------------------------------------------

class _FakeCompletions(BaseHTTPRequestHandler):
    """Streams `max_tokens` one-word chunks, then usage and [DONE]; refuses model "bad"."""

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path != "/v1/completions" or body.get("model") == "bad":
            self.send_response(404)
            self.end_headers()
            self.wfile.write(b'{"error": "no such model"}')
            return
        assert body["stream"] is True and body["temperature"] == 0.0
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        n = body["max_tokens"]
        for i in range(n):
            chunk = {"choices": [{"index": 0, "text": f" w{i}",
                                  "finish_reason": "length" if i == n - 1 else None}]}
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            self.wfile.flush()
        usage = {"choices": [], "usage": {"prompt_tokens": len(body["prompt"].split()),
                                          "completion_tokens": n}}
        self.wfile.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def fake_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _FakeCompletions)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_url_mode_times_a_streaming_server(fake_server):
    spec = WorkloadSpec(5, LengthRange(3, 9), LengthRange(2, 7), request_rate=100.0, seed=3)
    result = bench_online_url(fake_server, "m", spec)
    planned = make_workload(spec, vocab_size=32000)
    s = result.summary
    assert s.n_failed == 0
    assert s.output_tokens == sum(r.max_tokens for r in planned)
    assert s.input_tokens == sum(len(r.prompt_ids) for r in planned)  # server's usage
    assert s.ttft.n == 5 and s.ttft.p50 > 0


def test_url_mode_counts_refused_requests_as_failed(fake_server):
    spec = WorkloadSpec(3, LengthRange(2, 2), LengthRange(2, 2))
    s = bench_online_url(fake_server, "bad", spec).summary
    assert (s.n_requests, s.n_failed, s.output_tokens) == (3, 3, 0)
