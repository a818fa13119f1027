"""The `eagerlm` command line: generate, chat, serve, tokenize, perplexity.

Every subcommand takes `--model PATH`; without it the demo model is used when its package
is installed. Errors about the user's input (an `EagerLMError`: bad model file, bad
parameters, prompt too long, a device this build cannot use) are printed as one line on
stderr with exit status 2, never as a traceback; the engine's own failure
(`EngineFailure`: a CUDA call, a kernel build) likewise with exit status 1.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from eagerlm.dispatch.scheduler import SchedulerConfig
from eagerlm.errors import EagerLMError, EngineFailure, InvalidParameters
from eagerlm.loader.config import RopeOverride, RopeScalingType
from eagerlm.loader.demo_model import demo_model_path
from eagerlm.loader.model_file import ModelFile
from eagerlm.service.api.model_loading import ProgressCallback
from eagerlm.service.api.progress import ProgressBar
from eagerlm.service.cli.device_args import (
    add_device_args,
    add_speculation_args,
    add_tensor_parallel_args,
    kv_budget_bytes,
)
from eagerlm.service.cli.env_settings import apply_env_defaults
from eagerlm.service.http.config import ServerConfig
from eagerlm.service.measure.bench import add_bench_parser
from eagerlm.service.measure.profiler import add_profile_parser

if TYPE_CHECKING:
    from eagerlm.kernels.sampling import Constraint, SamplingParams
    from eagerlm.service.api.engine import Engine
    from eagerlm.service.api.sync_engine import SyncEngine


def _model_path(arg: str | None) -> str:
    return arg if arg else demo_model_path()


def _open(args: argparse.Namespace) -> ModelFile:
    return ModelFile.open(_model_path(args.model))


def _read_text(name: str) -> str:
    """The text of the file the user named ('-': stdin); unreadable is their mistake."""
    if name == "-":
        return sys.stdin.read()
    try:
        return Path(name).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise InvalidParameters(f"cannot read {name}: {e}") from None


def _rope_override(args: argparse.Namespace) -> RopeOverride | None:
    """The rope scaling flags, checked (InvalidParameters: exit 2) before anything is
    loaded."""
    return RopeOverride.from_settings(args.rope_scaling, args.rope_scale, args.yarn_orig_ctx)




def _progress(quiet: bool) -> ProgressCallback | None:
    return None if quiet else ProgressBar(sys.stderr)


def _engine_settings(args: argparse.Namespace, **settings: object) -> dict[str, object]:
    """`EngineSettings` fields from the engine flags of `args`, plus `settings`."""
    if args.ctx is not None:
        settings["max_context"] = args.ctx
    settings["rope_scaling"] = args.rope_scaling
    settings["rope_scale"] = args.rope_scale
    settings["yarn_orig_ctx"] = args.yarn_orig_ctx
    settings["kv_budget_bytes"] = kv_budget_bytes(args.kv_budget_mib)
    settings["memory_fraction"] = args.memory_fraction
    settings["cuda_graphs"] = args.cuda_graphs
    settings["weights"] = args.weights
    settings["speculative"] = args.speculative
    settings["num_speculative_tokens"] = args.num_speculative_tokens
    settings["draft_model"] = args.draft_model
    settings["tensor_parallel"] = args.tensor_parallel
    return settings


def _open_engine(args: argparse.Namespace, **settings: object) -> SyncEngine:
    """Load the model of `args` on `args.device`, with a progress bar unless quiet."""
    from eagerlm.service.api.sync_engine import SyncEngine

    path = _model_path(args.model)
    _rope_override(args)
    if not args.quiet:
        print(f"loading {Path(path).name} on {args.device}...", file=sys.stderr, flush=True)
    engine = SyncEngine.open(path, args.device, on_progress=_progress(args.quiet),
                             **_engine_settings(args, **settings))
    capacity = engine.engine.dispatcher.capacity
    if capacity.limited_by_pool:  # a shorter context than the model's: said even if quiet
        print(f"eagerlm: warning: {capacity.describe()}", file=sys.stderr, flush=True)
    elif not args.quiet:
        print(capacity.describe(), file=sys.stderr, flush=True)
    return engine


_LOGIT_BIAS_ARG = re.compile(
    r"(?P<id>[0-9]+)(?P<sign>[+-]|=[+-]?)(?P<bias>(?:[0-9]+\.?[0-9]*|\.[0-9]+)"
    r"(?:[eE][+-]?[0-9]+)?)")


def logit_bias_arg(value: str) -> tuple[int, float]:
    """One `--logit-bias`, llama.cpp's TOKEN_ID(+|-)BIAS (`15043+1`, `2-100`) or
    TOKEN_ID=BIAS (`15043=-1.5`), as (token id, bias); an argparse error otherwise."""
    from eagerlm.kernels.sampling import MAX_LOGIT_BIAS

    match = _LOGIT_BIAS_ARG.fullmatch(value.strip())
    if not match:
        raise argparse.ArgumentTypeError(
            f"{value!r} is not ID+BIAS, ID-BIAS or ID=BIAS with a token id and a number "
            f"(e.g. 15043+1, 2-100, 15043=-1.5)")
    sign = "-" if match["sign"].endswith("-") else ""
    bias = float(sign + match["bias"])
    if not abs(bias) <= MAX_LOGIT_BIAS:
        raise argparse.ArgumentTypeError(
            f"{value!r}: the bias must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]")
    return int(match["id"]), bias


def _sampling(args: argparse.Namespace, **extra: object) -> SamplingParams:
    from eagerlm.kernels.sampling import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                          top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                          seed=args.seed, stop=tuple(args.stop or ()),
                          repetition_penalty=args.repeat_penalty,
                          presence_penalty=args.presence_penalty,
                          frequency_penalty=args.frequency_penalty,
                          logit_bias=tuple(args.logit_bias or ()),
                          ignore_eos=getattr(args, "ignore_eos", False), **extra)


def _constraint(args: argparse.Namespace) -> Constraint | None:
    """The output's constraint from `--json-schema FILE|JSON`, `--grammar FILE` (GBNF; Lark
    when the file ends in .lark) or `--regex` (at most one: argparse's group)."""
    from eagerlm.kernels.sampling import Constraint

    if args.json_schema is not None:
        text = args.json_schema
        if not text.lstrip().startswith(("{", "[", "true", "false")):
            text = _read_text(text)  # a file name, not inline JSON
        return Constraint.json_schema(text, "--json-schema")
    if args.grammar is not None:
        kind = "lark" if args.grammar.endswith(".lark") else "gbnf"
        return Constraint(kind, _read_text(args.grammar), "--grammar")
    if args.regex is not None:
        return Constraint.regex(args.regex, "--regex")
    return None


def cmd_generate(args: argparse.Namespace) -> int:
    from eagerlm.service.api.streams import GenerationError

    params = _sampling(args, constraint=_constraint(args))
    with _open_engine(args) as engine:
        t0 = time.perf_counter()
        if args.chat:
            stream = engine.chat([{"role": "user", "content": args.prompt}], params)
        elif args.suffix is not None:
            stream = engine.infill(args.prompt, args.suffix, params)
        else:
            stream = engine.generate(args.prompt, params)
        first = last = t0
        n_generated = n_prompt = 0
        finish = None
        try:
            with stream:
                for chunk in stream:
                    now = time.perf_counter()
                    if n_generated == 0:
                        first = now
                    last = now
                    n_generated += len(chunk.token_ids)
                    n_prompt = chunk.prompt_tokens
                    sys.stdout.write(chunk.text)
                    sys.stdout.flush()
                    finish = chunk.finish_reason
        except GenerationError as e:  # the engine failed, not the user's input
            print(f"\neagerlm: error: {e}", file=sys.stderr)
            return 1
    sys.stdout.write("\n")
    rate = (n_generated - 1) / (last - first) if n_generated > 1 and last > first else 0.0
    print(f"[prompt {n_prompt} tokens, generated {n_generated} tokens, "
          f"time to first token {(first - t0) * 1000:.0f} ms, {rate:.1f} tokens/s, "
          f"finish: {finish.value if finish else '-'}]", file=sys.stderr)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from eagerlm.service.cli.chat import ChatLoop

    params = _sampling(args)
    with _open_engine(args) as engine:
        return ChatLoop(engine, params, system=args.system).run()


def cmd_serve(args: argparse.Namespace) -> int:
    import os

    try:
        from eagerlm.service.http.server import serve_loading
    except ImportError as e:
        print(f"eagerlm: error: the server needs FastAPI and uvicorn ({e}); install them "
              f"with: pip install 'eagerlm[server]'", file=sys.stderr)
        return 2

    if args.model_path is not None:
        if args.model is not None and args.model != args.model_path:
            raise InvalidParameters(f"two models given: {args.model_path} and --model "
                                    f"{args.model}")
        args.model = args.model_path
    api_key = args.api_key or os.environ.get("EAGERLM_API_KEY") or None
    config = ServerConfig(host=args.host, port=args.port, api_key=api_key,
                          max_body_bytes=args.max_body_bytes,
                          max_concurrency=args.max_concurrency, max_queue=args.max_queue,
                          shutdown_grace_s=args.shutdown_grace,
                          reasoning_format=args.reasoning_format,
                          sse_keepalive_s=args.sse_keepalive, embeddings=args.embeddings,
                          webui=not args.no_webui)
    settings: dict[str, object] = {"max_batch": args.max_batch}
    if args.served_model_name:
        settings["model_name"] = args.served_model_name
    if api_key is None and args.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"eagerlm: warning: serving on {args.host} without --api-key: anyone who "
              f"can reach this address can use the model", file=sys.stderr)

    def load() -> Engine:  # while /health answers 503 "loading" (service/http/loading.py)
        engine = _open_engine(args, **settings).engine
        print(f"serving {engine.name!r} at http://{args.host}:{args.port}/v1 "
              f"(Ctrl-C stops)", file=sys.stderr, flush=True)
        return engine

    serve_loading(load, config, log_level="warning" if args.quiet else "info")
    return 0


def cmd_tokenize(args: argparse.Namespace) -> int:
    model = _open(args)
    text = _read_text(args.file)
    ids = model.tokenizer.encode(text, add_special=not args.no_bos)
    print(json.dumps(ids))
    return 0


def cmd_perplexity(args: argparse.Namespace) -> int:
    from eagerlm.service.api.model_loading import open_model
    from eagerlm.service.measure.perplexity import perplexity

    path = _model_path(args.model)
    rope = _rope_override(args)
    text = _read_text(args.file)
    if not args.quiet:
        print(f"loading {Path(path).name} on {args.device}...", file=sys.stderr, flush=True)
    # a chunk the model cannot hold (max_context) fails before any weight is read
    loaded = open_model(path, args.device, rope=rope, max_context=args.ctx,
                        on_progress=_progress(args.quiet), weights=args.weights)

    def progress(i: int, ppl: float) -> None:
        print(f"[{i + 1}]{ppl:.4f}", end=" ", file=sys.stderr, flush=True)

    try:
        result = perplexity(loaded.transformer, loaded.model.tokenizer, text, args.ctx,
                            on_chunk=progress)
    finally:
        loaded.close()
    print(f"\n{result.n_tokens} tokens, {result.n_chunks} chunks of {args.ctx}",
          file=sys.stderr)
    print(f"perplexity: {result.perplexity:.4f}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="eagerlm", description="Run GGUF language models (llama, qwen2, qwen3, gemma3).")
    sub = parser.add_subparsers(dest="command", required=True)

    def model_arg(p: argparse.ArgumentParser) -> None:
        p.add_argument("--model", "-m", metavar="PATH",
                       help="GGUF model file (default: the demo model, Gemma 3 270M Q4_K_M, "
                            "if the eagerlm[demo] extra is installed)")

    def rope_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("--rope-scaling", choices=[t.value for t in RopeScalingType],
                       default=None,
                       help="rope scaling in place of the model file's, as llama.cpp's flag: "
                            "yarn extends the context (e.g. Qwen: --rope-scaling yarn "
                            "--rope-scale 4 --yarn-orig-ctx 32768); default: the file's")
        p.add_argument("--rope-scale", type=float, default=None, metavar="F",
                       help="rope scaling factor: the context is extended F times "
                            "(default: the file's)")
        p.add_argument("--yarn-orig-ctx", type=int, default=None, metavar="N",
                       help="YaRN: the context the model was trained on before scaling "
                            "(default: the file's rope.scaling.original_context_length, "
                            "else its context length)")

    def engine_args(p: argparse.ArgumentParser) -> None:
        model_arg(p)
        add_device_args(p)
        add_tensor_parallel_args(p)
        p.add_argument("--ctx", "-c", "--ctx-size", type=int, default=None, metavar="N",
                       help="context length in tokens (default: the model's trained "
                            "context; more only as far as its rope scaling reaches, e.g. "
                            "original context x F with --rope-scaling yarn --rope-scale F)")
        rope_args(p)
        add_speculation_args(p)
        p.add_argument("--quiet", "-q", action="store_true",
                       help="no loading messages or progress bar")

    def sampling_args(p: argparse.ArgumentParser, max_tokens: int) -> None:
        p.add_argument("--max-tokens", "-n", "--n-predict", type=int, default=max_tokens,
                       help=f"most tokens to generate per reply (default {max_tokens})")
        p.add_argument("--temperature", "-t", "--temp", type=float, default=0.8,
                       help="sampling temperature; 0 = greedy (default 0.8)")
        p.add_argument("--top-k", type=int, default=40, help="keep the K most likely tokens; "
                       "0 = off (default 40)")
        p.add_argument("--top-p", type=float, default=0.95,
                       help="nucleus sampling mass in (0, 1] (default 0.95)")
        p.add_argument("--min-p", type=float, default=0.05,
                       help="drop tokens less likely than MIN_P x the best one (default 0.05)")
        p.add_argument("--seed", "-s", type=int, default=None,
                       help="random seed for reproducible sampling (default: random)")
        p.add_argument("--stop", action="append", metavar="TEXT",
                       help="stop when TEXT is generated (repeatable; TEXT is not printed)")
        p.add_argument("--repeat-penalty", type=float, default=1.0,
                       help="divide the logits of tokens already in the prompt or reply by "
                            "this (multiply when negative); 1 = off (default 1)")
        p.add_argument("--presence-penalty", type=float, default=0.0,
                       help="subtract this from tokens already generated, in [-2, 2] "
                            "(default 0)")
        p.add_argument("--frequency-penalty", type=float, default=0.0,
                       help="subtract this per earlier occurrence in the reply, in [-2, 2] "
                            "(default 0)")
        p.add_argument("--logit-bias", type=logit_bias_arg, action="append",
                       metavar="ID+BIAS",
                       help="add BIAS, in [-100, 100], to token ID's logit before sampling "
                            "(repeatable), as llama.cpp: 15043+1, 2-100 (-100 all but bans "
                            "a token, +100 all but forces it), or 15043=-1.5")

    g = sub.add_parser("generate", help="stream a completion of a prompt to stdout",
                       description="Stream a completion of PROMPT to stdout, then a one-line "
                                   "summary (tokens, time to first token, tokens/s) to stderr.")
    g.add_argument("--prompt", "-p", required=True, help="the text to complete")
    engine_args(g)
    sampling_args(g, 128)
    mode = g.add_mutually_exclusive_group()
    mode.add_argument("--chat", action="store_true",
                      help="wrap the prompt as a user turn with the model's chat template")
    mode.add_argument("--suffix", metavar="TEXT",
                      help="fill in the middle: write what goes between the prompt and "
                           "TEXT (models with FIM tokens, e.g. Qwen2.5-Coder)")
    shape = g.add_mutually_exclusive_group()
    shape.add_argument("--json-schema", metavar="FILE|JSON",
                       help="constrain the output to JSON that follows this schema (a file, "
                            "or the schema itself, e.g. '{\"type\": \"object\"}')")
    shape.add_argument("--grammar", metavar="FILE",
                       help="constrain the output to a GBNF grammar (llama.cpp's; a .lark "
                            "file is read as a Lark grammar)")
    shape.add_argument("--regex", metavar="RE",
                       help="constrain the output to match a regular expression")
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser(
        "chat", help="talk with the model in the terminal",
        description="An interactive conversation using the model's chat template. Replies "
                    "stream as they are generated; each turn reuses the KV cache of the "
                    "earlier turns, and a status line on stderr says how many prompt tokens "
                    "were reused. Commands: /reset starts a new conversation, /exit or "
                    "Ctrl-D leaves; Ctrl-C stops the current reply and keeps the chat open.")
    engine_args(c)
    sampling_args(c, 512)
    c.add_argument("--system", metavar="TEXT", default=None,
                   help="a system message opening the conversation")
    c.add_argument("--ignore-eos", action="store_true",
                   help="keep generating past the model's end-of-turn token (until "
                        "--max-tokens; for testing and benchmarks)")
    c.set_defaults(func=cmd_chat)

    s = sub.add_parser(
        "serve", help="serve the model over an OpenAI-compatible HTTP API",
        description="Serve the model over HTTP with OpenAI's API: GET /v1/models, POST "
                    "/v1/completions, /v1/chat/completions and /v1/responses (streaming or "
                    "not), /v1/embeddings (embedding models, or any with --embeddings); "
                    "Anthropic's POST /v1/messages; a chat page at / (unless --no-webui); "
                    "plus GET /health (503 while loading or once the engine cannot serve) "
                    "and GET /metrics (Prometheus; eagerlm's and vLLM's names). Requests beyond "
                    "--max-concurrency wait in a queue of --max-queue; beyond that the "
                    "server answers 429. Every option can also be set by an environment "
                    "variable: EAGERLM_ and the long flag in capitals (EAGERLM_PORT, "
                    "EAGERLM_MAX_CONCURRENCY, EAGERLM_MODEL...); the command line wins.")
    engine_args(s)
    srv = ServerConfig
    s.add_argument("--host", default=srv.host,
                   help=f"address to bind (default {srv.host}: this machine only; use 0.0.0.0 "
                        "to serve the network, preferably with --api-key)")
    s.add_argument("--port", type=int, default=srv.port, help=f"TCP port (default {srv.port})")
    s.add_argument("--api-key", metavar="KEY", default=None,
                   help="require 'Authorization: Bearer KEY' (or 'x-api-key: KEY') on /v1 "
                        "routes (default: the "
                        "EAGERLM_API_KEY environment variable; unset = no authentication)")
    s.add_argument("model_path", nargs="?", metavar="MODEL", default=None,
                   help="the GGUF file, as `vllm serve MODEL` (or --model)")
    s.add_argument("--served-model-name", "--alias", "-a", metavar="NAME", default=None,
                   help="the model id clients send (default: the file name without .gguf)")
    s.add_argument("--max-concurrency", "-np", "--parallel", type=int,
                   default=srv.max_concurrency, metavar="N",
                   help=f"requests generating at once, as llama-server's slots (default "
                        f"{srv.max_concurrency})")
    s.add_argument("--max-queue", type=int, default=srv.max_queue, metavar="N",
                   help=f"requests waiting for a slot before 429 (default {srv.max_queue})")
    s.add_argument("--max-batch", type=int, default=SchedulerConfig.max_batch, metavar="N",
                   help=f"sessions decoded together in one round "
                        f"(default {SchedulerConfig.max_batch})")
    s.add_argument("--max-body-bytes", type=int, default=srv.max_body_bytes, metavar="BYTES",
                   help=f"largest request body accepted; larger gets 413 "
                        f"(default {srv.max_body_bytes / 2**20:g} MiB)")
    s.add_argument("--shutdown-grace", type=float, default=srv.shutdown_grace_s,
                   metavar="SECONDS",
                   help=f"on SIGTERM/Ctrl-C, how long requests in flight may take to "
                        f"finish before streams are ended with an error event and others "
                        f"get 503 (default {srv.shutdown_grace_s:g}; a second signal ends it "
                        f"at once)")
    s.add_argument("--reasoning-format", choices=("auto", "none", "deepseek"),
                   default=srv.reasoning_format,
                   help="where a reasoning model's <think> block goes, as llama-server's "
                        "flag: deepseek splits it into reasoning_content, none leaves it in "
                        "the content, auto (default) is deepseek for chat templates that "
                        "write <think> (Qwen3, DeepSeek-R1 distills)")
    s.add_argument("--sse-keepalive", type=float, default=srv.sse_keepalive_s,
                   metavar="SECONDS",
                   help=f"a comment line on a stream idle this long, so proxies keep it "
                        f"open through a long prefill (default {srv.sse_keepalive_s:g}; 0: "
                        f"never)")
    s.add_argument("--embeddings", action="store_true",
                   help="serve /v1/embeddings for this model too, as llama-server's flag "
                        "(mean pooling unless the file says otherwise; embedding GGUFs are "
                        "served without it)")
    s.add_argument("--no-webui", action="store_true",
                   help="do not serve the chat page at / (as llama-server's flag)")
    s.set_defaults(func=cmd_serve)
    apply_env_defaults(s)  # every option also from EAGERLM_<OPTION> (service/cli/env_settings.py)

    t = sub.add_parser("tokenize", help="print the token ids of a text file as JSON",
                       description="Print the token ids of FILE's text as a JSON list, with "
                                   "BOS when the model adds one (like llama.cpp).")
    t.add_argument("file", metavar="FILE", help="text file to tokenize ('-' for stdin)")
    model_arg(t)
    t.add_argument("--no-bos", action="store_true", help="do not add BOS/EOS special tokens")
    t.set_defaults(func=cmd_tokenize)

    p = sub.add_parser("perplexity", help="perplexity of a text file, as llama.cpp computes it",
                       description="Perplexity of FILE computed like llama.cpp's "
                                   "llama-perplexity: chunks of CTX tokens, each starting "
                                   "with BOS, the second half of each chunk scored. The last "
                                   "line is 'perplexity: VALUE'.")
    p.add_argument("file", metavar="FILE", help="text file to score")
    model_arg(p)
    add_device_args(p)  # the pool's flags are accepted and unused: a chunk has its own KV
    p.add_argument("--ctx", "-c", "--ctx-size", type=int, default=512,
                   help="chunk size in tokens (default 512)")
    rope_args(p)
    p.add_argument("--quiet", "-q", action="store_true",
                   help="no loading messages or progress bar")
    p.set_defaults(func=cmd_perplexity)
    add_profile_parser(sub)
    add_bench_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except EngineFailure as e:  # the engine failed, not the user's input
        print(f"eagerlm: error: {e}", file=sys.stderr)
        return 1
    except EagerLMError as e:
        print(f"eagerlm: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\neagerlm: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
