"""`eagerlm bench`: throughput and serving latency benchmarks.

- `offline`: every request submitted at once, EOS ignored, lengths drawn uniformly from
  ranges; reports total output tokens/s (nano-vllm's `bench.py`: 256 requests, 100-1024
  tokens in and out).
- `online`: Poisson arrivals at `--request-rate` against the in-process engine, or against
  an OpenAI-compatible server with `--url`; reports TTFT / TPOT / ITL / end-to-end
  percentiles and throughput (vLLM's `benchmark_serving`).

The defaults are the reference benchmarks' shapes; on the cpu backend they take hours, so
pass small ranges there (e.g. `--num-requests 8 --input-len 32-64 --output-len 32-64`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagerlm.errors import InvalidParameters
from eagerlm.loader.tokenizer import Tokenizer
from eagerlm.service.api.model_loading import check_device
from eagerlm.service.measure.harness import (
    DispatchSettings,
    MeasuredModel,
    add_engine_args,
    add_model_args,
    engine_settings,
    length_range,
    open_measured_model,
    rate,
    rate_label,
    run_requests,
    start_engine,
    warm_up,
)
from eagerlm.service.measure.request_metrics import (
    LatencySummary,
    RequestRecord,
    format_latency,
    summarize,
)
from eagerlm.service.measure.workload import (
    LengthRange,
    PlannedRequest,
    WorkloadSpec,
    make_workload,
)


@dataclass(frozen=True)
class BenchResult:
    kind: str  # "offline" or "online"
    target: str  # model label or URL
    workload: WorkloadSpec
    summary: LatencySummary
    settings: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        w = self.workload
        return {"kind": self.kind, "target": self.target, "date": time.strftime("%Y-%m-%d"),
                "workload": {"n_requests": w.n_requests, "input_len": str(w.input_len),
                             "output_len": str(w.output_len),
                             "request_rate": rate_label(w.request_rate), "seed": w.seed},
                "settings": self.settings,
                "summary": dataclasses.asdict(self.summary) | {
                    "output_tok_s": self.summary.output_tok_s,
                    "total_tok_s": self.summary.total_tok_s,
                    "request_s": self.summary.request_s}}


def run_engine(loaded: MeasuredModel, settings: DispatchSettings,
               requests: Sequence[PlannedRequest], sync: bool = False) -> list[RequestRecord]:
    """The workload through a fresh in-process engine (after a warm-up request)."""
    with start_engine(loaded, settings, sync) as engine:
        warm_up(engine, loaded.vocab_size)
        return run_requests(engine, requests).records


def bench_offline(loaded: MeasuredModel, workload: WorkloadSpec, settings: DispatchSettings,
                  sync: bool = False) -> BenchResult:
    if math.isfinite(workload.request_rate):
        workload = dataclasses.replace(workload, request_rate=math.inf)
    requests = make_workload(workload, loaded.vocab_size, loaded.context_length)
    records = run_engine(loaded, settings, requests, sync)
    return BenchResult("offline", loaded.label, workload, summarize(records),
                       _settings_json(settings, sync))


def bench_online_engine(loaded: MeasuredModel, workload: WorkloadSpec,
                        settings: DispatchSettings, sync: bool = False) -> BenchResult:
    requests = make_workload(workload, loaded.vocab_size, loaded.context_length)
    records = run_engine(loaded, settings, requests, sync)
    return BenchResult("online", loaded.label, workload, summarize(records),
                       _settings_json(settings, sync))


def bench_online_url(url: str, served_model: str, workload: WorkloadSpec,
                     tokenizer: Tokenizer | None = None,
                     context_length: int | None = None) -> BenchResult:
    """Against a server. With the served model's `tokenizer`, prompts are its decoding of
    random ids (about the planned token counts); without, plain words."""
    from eagerlm.service.measure.openai_load import run_against_url, word_prompt

    vocab = tokenizer.vocab_size if tokenizer is not None else 32000
    requests = make_workload(workload, vocab, context_length)
    if tokenizer is not None:
        prompts = [tokenizer.decode(r.prompt_ids) for r in requests]
    else:
        prompts = [word_prompt(len(r.prompt_ids), workload.seed * 100_003 + r.index)
                   for r in requests]
    records = run_against_url(url, served_model, requests, prompts)
    return BenchResult("online", url, workload, summarize(records),
                       {"served_model": served_model})


def _settings_json(settings: DispatchSettings, sync: bool) -> dict[str, Any]:
    return dataclasses.asdict(settings) | {"mode": "sync" if sync else "eager"}


def format_offline(result: BenchResult) -> str:
    """nano-vllm's line, plus what it rests on."""
    s, w = result.summary, result.workload
    return (f"{result.target}: {w.n_requests} requests, input {w.input_len}, output "
            f"{w.output_len} tokens (seed {w.seed})\n"
            f"Total: {s.output_tokens}tok, Time: {s.duration_s:.2f}s, "
            f"Throughput: {s.output_tok_s:.2f}tok/s "
            f"(input {s.input_tokens}tok, {s.total_tok_s:.2f}tok/s in+out"
            + (f", {s.n_failed} failed" if s.n_failed else "") + ")")


# -- command line ------------------------------------------------------------------------

def cmd_bench(args: argparse.Namespace) -> int:
    check_device(args.device)  # a clear error before anything is loaded
    workload = WorkloadSpec(args.num_requests, args.input_len, args.output_len,
                            getattr(args, "request_rate", math.inf), args.seed)
    url = getattr(args, "url", None)
    if url is not None:
        if args.synthetic:
            raise InvalidParameters("--synthetic does not apply with --url (the server has its "
                                    "model); pass --model for the served model's tokenizer, "
                                    "or nothing")
        tokenizer = context = None
        if args.model:  # only the tokenizer is read: no weights are loaded
            from eagerlm.loader.model_file import ModelFile

            m = ModelFile.open(args.model)
            tokenizer, context = m.tokenizer, m.config.context_length
        result = bench_online_url(url, args.served_model, workload, tokenizer, context)
    else:
        need = args.input_len.high + args.output_len.high + 1
        loaded = open_measured_model(args.model, args.synthetic, min_context=need,
                                     device=args.device, weights=args.weights,
                                     tensor_parallel=args.tensor_parallel)
        try:
            run = bench_offline if args.bench_kind == "offline" else bench_online_engine
            result = run(loaded, workload, engine_settings(args), args.sync)
        finally:
            loaded.close()
    if args.bench_kind == "offline":
        print(format_offline(result))
    else:
        print(format_latency(result.summary, f"Serving Benchmark Result ({result.target}, "
                                             f"rate {rate_label(workload.request_rate)})"))
    if args.json:
        Path(args.json).write_text(json.dumps(result.to_json(), indent=1), encoding="utf-8")
        print(f"wrote {args.json}", file=sys.stderr)
    return 1 if result.summary.n_failed else 0


def add_bench_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add `eagerlm bench offline|online` to the CLI's subcommands (handler: `cmd_bench`)."""
    p = subparsers.add_parser(
        "bench", help="offline throughput or online serving latency benchmark",
        description=__doc__.split("\n\n")[1] if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    kinds = p.add_subparsers(dest="bench_kind", required=True)
    off = kinds.add_parser("offline", help="all requests at once: total output tokens/s")
    on = kinds.add_parser("online", help="Poisson arrivals: TTFT / ITL / E2E percentiles "
                                         "against the engine or an OpenAI-compatible URL")
    for q in (off, on):
        add_model_args(q)
        q.add_argument("--num-requests", "-n", type=int, default=256,
                       help="number of requests (default 256)")
        q.add_argument("--input-len", type=length_range, default=LengthRange(100, 1024),
                       metavar="N|MIN-MAX", help="prompt tokens, uniform (default 100-1024)")
        q.add_argument("--output-len", type=length_range, default=LengthRange(100, 1024),
                       metavar="N|MIN-MAX",
                       help="output tokens, uniform, EOS ignored (default 100-1024)")
        add_engine_args(q)
        q.add_argument("--sync", action="store_true",
                       help="synchronous dispatch instead of eager (for comparison)")
        q.add_argument("--json", metavar="PATH", help="also write the results as JSON")
        q.set_defaults(func=cmd_bench)
    on.add_argument("--request-rate", type=rate, default=math.inf,
                    help="Poisson arrivals per second (default inf: all at once)")
    on.add_argument("--url", help="benchmark an OpenAI-compatible server at this base URL "
                                  "(e.g. http://localhost:8000) instead of the engine")
    on.add_argument("--served-model", default="eagerlm",
                    help="the `model` field sent to the server (default eagerlm)")
    return p
