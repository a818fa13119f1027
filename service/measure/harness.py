"""The engine under measurement: open a model (a GGUF file, or a synthetic one written
here, both through the engine's `open_model`), start a
dispatcher with given settings, and run a planned workload through it, timing every token
where it reaches the user (the request's output sink, on the service thread).

Shared by `eagerlm profile`, `eagerlm bench` and `benchmarks/`, so every number they
report comes from the same driver; the command-line arguments that describe the model and
the dispatcher settings are defined here once for both commands.
"""

from __future__ import annotations

import argparse
import math
import queue
import shutil
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from eagerlm.dispatch.control_thread import ControlConfig
from eagerlm.dispatch.dispatcher import Dispatcher, DispatcherConfig
from eagerlm.dispatch.messages import Output
from eagerlm.dispatch.scheduler import SchedulerConfig
from eagerlm.dispatch.speculation import SpeculationConfig
from eagerlm.errors import InvalidParameters
from eagerlm.kernels.sampling import Constraint, SamplingParams
from eagerlm.service.api.model_loading import LoadedModel, open_model
from eagerlm.service.cli.device_args import (
    add_device_args,
    add_tensor_parallel_args,
    kv_budget_bytes,
    speculative_tokens,
)
from eagerlm.service.measure.request_metrics import RequestRecord
from eagerlm.service.measure.workload import CONSTRAINED_SCHEMA, LengthRange, PlannedRequest


@dataclass(frozen=True)
class DispatchSettings:
    """The dispatcher settings a measurement runs with, recorded beside its results; the
    defaults are the engine's (those of the dispatch configs that own each setting)."""

    device: str = "cpu"
    max_batch: int = SchedulerConfig.max_batch
    max_round_tokens: int = SchedulerConfig.max_round_tokens
    lookahead: int = ControlConfig.lookahead
    kv_budget_mb: int | None = None  # None: the default pool (dispatch/kv_capacity.py)
    memory_fraction: float = DispatcherConfig.memory_fraction
    prefix_cache: bool = ControlConfig.prefix_cache
    cuda_graphs: bool = ControlConfig.cuda_graphs
    # speculative decoding (prompt lookup; dispatch/speculation.py)
    speculative: str = SpeculationConfig.method
    num_speculative_tokens: int = SpeculationConfig.num_tokens

    def dispatcher_config(self, sync: bool) -> DispatcherConfig:
        return DispatcherConfig(
            control=ControlConfig(SchedulerConfig(max_batch=self.max_batch,
                                                  max_round_tokens=self.max_round_tokens),
                                  lookahead=self.lookahead, sync=sync,
                                  prefix_cache=self.prefix_cache,
                                  cuda_graphs=self.cuda_graphs,
                                  speculation=SpeculationConfig(
                                      self.speculative, self.num_speculative_tokens)),
            kv_budget_bytes=kv_budget_bytes(self.kv_budget_mb),
            memory_fraction=self.memory_fraction)


@dataclass
class MeasuredModel(LoadedModel):
    """A model opened by `open_model` for measurement, with the name reports give it;
    `close` also removes a synthetic model's temporary file."""

    label: str = ""
    _tmpdir: str | None = field(default=None, repr=False)

    @property
    def vocab_size(self) -> int:
        return self.model.tokenizer.vocab_size

    @property
    def context_length(self) -> int:
        return self.model.config.context_length

    def close(self) -> None:
        super().close()
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None


def synthetic_names() -> list[str]:
    from eagerlm.loader.architectures import SUPPORTED_ARCHITECTURES
    from eagerlm.loader.synthetic import SHAPES

    return ["tiny", *(f"tiny-{a}" for a in SUPPORTED_ARCHITECTURES), *SHAPES]


def open_measured_model(model_path: str | None, synthetic: str | None,
                        min_context: int = 256, device: str = "cpu",
                        weights: str | None = None,
                        tensor_parallel: int = 1) -> MeasuredModel:
    """`open_model` (service/api/model_loading.py) on `device` of `model_path`, or of the
    synthetic model `synthetic` (see `synthetic_names`: `tiny` is a 2-layer qwen3 for
    tests, the others are real shapes with random weights) written to a temporary file
    first; with neither, of the demo model. `weights`, `tensor_parallel`: as
    `open_model`'s."""
    if synthetic is None:
        if model_path is None:
            from eagerlm.loader.demo_model import demo_model_path

            model_path = demo_model_path()
        return _measured(open_model(model_path, device, weights=weights,
                                    tensor_parallel=tensor_parallel),
                         Path(model_path).name)

    import dataclasses

    from eagerlm.loader.synthetic import SHAPES, tiny_spec, write_synthetic_model

    if synthetic == "tiny" or synthetic.startswith("tiny-"):
        arch = synthetic.partition("-")[2] or "qwen3"
        spec = tiny_spec(arch, context_length=max(256, min_context))
    elif synthetic in SHAPES:
        spec = SHAPES[synthetic]
        if spec.context_length < min_context:
            spec = dataclasses.replace(spec, context_length=min_context)
    else:
        raise InvalidParameters(f"unknown synthetic model {synthetic!r}; choose from "
                                f"{', '.join(synthetic_names())}")
    tmpdir = tempfile.mkdtemp(prefix="eagerlm-synthetic-")
    try:
        path = write_synthetic_model(Path(tmpdir) / f"{synthetic}.gguf", spec)
        return _measured(open_model(path, device, weights=weights,
                                    tensor_parallel=tensor_parallel), f"synthetic {synthetic}",
                         tmpdir)
    except BaseException:
        shutil.rmtree(tmpdir, ignore_errors=True)
        raise


def _measured(loaded: LoadedModel, label: str, tmpdir: str | None = None) -> MeasuredModel:
    return MeasuredModel(loaded.model, loaded.device, loaded.transformer, loaded.group,
                         loaded._close_group, label, tmpdir)


def start_engine(loaded: MeasuredModel, settings: DispatchSettings, sync: bool) -> Dispatcher:
    return Dispatcher(loaded.device, loaded.transformer, loaded.model.tokenizer,
                      settings.dispatcher_config(sync), group=loaded.group)


@dataclass
class RunResult:
    records: list[RequestRecord]
    start: float  # perf_counter when the first request was due
    end: float  # when the last request finished


def greedy(max_tokens: int, constrained: bool = False) -> SamplingParams:
    """Every benchmark request: greedy, EOS ignored, so it yields exactly `max_tokens`
    (a constrained one too: its schema outlasts it, workload.CONSTRAINED_SCHEMA)."""
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                          constraint=Constraint.json_schema(CONSTRAINED_SCHEMA)
                          if constrained else None)


def run_requests(engine: Dispatcher, requests: Sequence[PlannedRequest],
                 stall_timeout_s: float = 600.0) -> RunResult:
    """Submit each request at its arrival time (from this thread), record each token's
    time at the sink, and return once every request has finished.

    Raises TimeoutError if no request finishes for `stall_timeout_s` (a hung engine)."""
    finished: queue.SimpleQueue[int] = queue.SimpleQueue()
    records = [RequestRecord(r.index, 0.0, len(r.prompt_ids)) for r in requests]

    def sink_for(rec: RequestRecord):
        def sink(out: Output) -> None:
            now = time.perf_counter()
            if out.token_ids:
                rec.token_times.extend([now] * len(out.token_ids))
            if out.finish_reason is not None:
                rec.finish_reason = out.finish_reason.value
                rec.error = out.error
                finished.put(rec.index)
        return sink

    start = time.perf_counter()
    for req, rec in sorted(zip(requests, records), key=lambda p: p[0].arrival_s):
        delay = start + req.arrival_s - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        rec.arrival = time.perf_counter()
        engine.submit(req.prompt_ids, greedy(req.max_tokens, req.constrained), sink_for(rec))
    for _ in records:
        try:
            finished.get(timeout=stall_timeout_s)
        except queue.Empty:
            raise TimeoutError(f"no request finished in {stall_timeout_s:.0f} s") from None
    return RunResult(records, start, time.perf_counter())


def warm_up(engine: Dispatcher, vocab_size: int) -> None:
    """One short request, so first-call costs (allocations, page mapping) are not charged
    to the measured run; then forget its traces, once every round it caused has left one
    (eager dispatch launches rounds past a request's end; their traces, recorded after the
    clear, were counted as the measured run's)."""
    req = PlannedRequest(0, [i % vocab_size for i in range(1, 9)], 4, 0.0)
    run_requests(engine, [req], stall_timeout_s=300.0)
    engine.flush()  # the control thread has taken the request's stop: no round follows
    wait_rounds_consumed(engine)
    engine.traces.clear()


def wait_rounds_consumed(engine: Dispatcher, timeout_s: float = 2.0) -> None:
    """Wait until the service thread has recorded the trace of every round launched so
    far: a request's final tokens reach its sink just before its round's trace is."""
    deadline = time.perf_counter() + timeout_s
    traces = engine.traces
    while time.perf_counter() < deadline:
        last = engine.control.round_id - 1
        if last < 0 or (traces and traces[-1].round_id >= last):
            return
        time.sleep(0.001)


def rate_label(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}/s"


# -- command-line arguments shared by `eagerlm profile` and `eagerlm bench` ---------------

def add_model_args(p: argparse.ArgumentParser) -> None:
    """--model / --synthetic / --device, shared with `eagerlm bench`."""
    which = p.add_mutually_exclusive_group()
    which.add_argument("--model", "-m", metavar="PATH",
                       help="GGUF model file (default: the demo model, if installed)")
    which.add_argument("--synthetic", metavar="NAME",
                       help="a synthetic model with random weights instead: "
                            + ", ".join(synthetic_names()))
    add_device_args(p)
    add_tensor_parallel_args(p)


def add_engine_args(p: argparse.ArgumentParser,
                    max_batch: int = DispatchSettings.max_batch) -> None:
    """--max-batch (default the engine's, or the command's own `max_batch`),
    --max-round-tokens, --lookahead (the engine's defaults) and --seed."""
    d = DispatchSettings
    p.add_argument("--max-batch", type=int, default=max_batch,
                   help=f"most sessions per round (default {max_batch})")
    p.add_argument("--max-round-tokens", type=int, default=d.max_round_tokens,
                   help=f"prefill + decode tokens per round (default {d.max_round_tokens})")
    p.add_argument("--lookahead", type=int, default=d.lookahead,
                   help=f"rounds launched ahead of the service thread in eager mode "
                        f"(default {d.lookahead})")
    p.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    p.add_argument("--speculative", choices=("off", "ngram"), default=d.speculative,
                   help="speculative decoding by prompt lookup (the summary then shows how "
                        f"many proposals were accepted; default {d.speculative})")
    p.add_argument("--num-speculative-tokens", type=speculative_tokens,
                   default=d.num_speculative_tokens, metavar="K",
                   help=f"most drafted tokens per round (default {d.num_speculative_tokens})")


def engine_settings(args: argparse.Namespace) -> DispatchSettings:
    return DispatchSettings(device=args.device, max_batch=args.max_batch,
                          max_round_tokens=args.max_round_tokens, lookahead=args.lookahead,
                          kv_budget_mb=args.kv_budget_mib,
                          memory_fraction=args.memory_fraction, cuda_graphs=args.cuda_graphs,
                          speculative=args.speculative,
                          num_speculative_tokens=args.num_speculative_tokens)


def rate(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError("the request rate must be > 0 (inf: all at once)")
    return value


def length_range(text: str) -> LengthRange:
    try:
        return LengthRange.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
