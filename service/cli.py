"""The `eagerlm` command line: generate, tokenize, perplexity.

Every subcommand takes `--model PATH`; without it the demo model is used when its package
is installed. Errors about the user's input (bad model file, bad parameters, prompt too
long) are printed as one line on stderr with exit status 2, never as a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from dispatch.errors import RequestError
from loader.demo_model import DemoModelMissing, demo_model_path
from loader.errors import ModelFileError
from loader.model_file import ModelFile


def _model_path(arg: str | None) -> str:
    return arg if arg else demo_model_path()


def _open(args: argparse.Namespace) -> ModelFile:
    return ModelFile.open(_model_path(args.model))


def _load_transformer(model: ModelFile, quiet: bool):
    from kernels.cpu_backend import cpu_transformer

    t0 = time.perf_counter()
    if not quiet:
        print(f"loading {Path(model.path).name} ({model.config.architecture}, "
              f"{model.config.n_layers} layers) on cpu...", file=sys.stderr, flush=True)
    transformer = cpu_transformer(model)
    if not quiet:
        print(f"loaded in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    return transformer


def cmd_generate(args: argparse.Namespace) -> int:
    from dispatch.dispatcher import Dispatcher, DispatcherConfig
    from kernels.sampling import SamplingParams
    from vmm.device import open_device

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                            seed=args.seed, stop=tuple(args.stop or ()))
    model = _open(args)
    transformer = _load_transformer(model, args.quiet)
    prompt = args.prompt
    if args.chat:
        prompt = model.render_chat([{"role": "user", "content": prompt}])
    ids = model.tokenizer.encode(prompt)
    config = DispatcherConfig(max_context=args.ctx)
    with Dispatcher(open_device("cpu"), transformer, model.tokenizer, config) as engine:
        t0 = time.perf_counter()
        first = last = t0
        n_generated = 0
        finish, error = None, None
        for out in engine.stream(ids, params):
            now = time.perf_counter()
            if n_generated == 0:
                first = now
            last = now
            n_generated += len(out.token_ids)
            sys.stdout.write(out.text)
            sys.stdout.flush()
            finish, error = out.finish_reason, out.error
    sys.stdout.write("\n")
    if error:
        print(f"eagerlm: error: {error}", file=sys.stderr)
        return 1
    rate = (n_generated - 1) / (last - first) if n_generated > 1 and last > first else 0.0
    print(f"[prompt {len(ids)} tokens, generated {n_generated} tokens, "
          f"time to first token {(first - t0) * 1000:.0f} ms, {rate:.1f} tokens/s, "
          f"finish: {finish.value if finish else '-'}]", file=sys.stderr)
    return 0


def cmd_tokenize(args: argparse.Namespace) -> int:
    model = _open(args)
    text = Path(args.file).read_text(encoding="utf-8") if args.file != "-" else sys.stdin.read()
    ids = model.tokenizer.encode(text, add_special=not args.no_bos)
    print(json.dumps(ids))
    return 0


def cmd_perplexity(args: argparse.Namespace) -> int:
    from service.perplexity import perplexity

    model = _open(args)
    text = Path(args.file).read_text(encoding="utf-8")
    transformer = _load_transformer(model, args.quiet)

    def progress(i: int, ppl: float) -> None:
        print(f"[{i + 1}]{ppl:.4f}", end=" ", file=sys.stderr, flush=True)

    result = perplexity(transformer, model.tokenizer, text, args.ctx, on_chunk=progress)
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

    g = sub.add_parser("generate", help="stream a completion of a prompt to stdout",
                       description="Stream a completion of PROMPT to stdout, then a one-line "
                                   "summary (tokens, time to first token, tokens/s) to stderr.")
    g.add_argument("--prompt", "-p", required=True, help="the text to complete")
    model_arg(g)
    g.add_argument("--max-tokens", "-n", type=int, default=128,
                   help="most tokens to generate (default 128)")
    g.add_argument("--temperature", "-t", type=float, default=0.8,
                   help="sampling temperature; 0 = greedy (default 0.8)")
    g.add_argument("--top-k", type=int, default=40, help="keep the K most likely tokens; "
                   "0 = off (default 40)")
    g.add_argument("--top-p", type=float, default=0.95,
                   help="nucleus sampling mass in (0, 1] (default 0.95)")
    g.add_argument("--min-p", type=float, default=0.05,
                   help="drop tokens less likely than MIN_P x the best one (default 0.05)")
    g.add_argument("--seed", type=int, default=None,
                   help="random seed for reproducible sampling (default: random)")
    g.add_argument("--stop", action="append", metavar="TEXT",
                   help="stop when TEXT is generated (repeatable; TEXT is not printed)")
    g.add_argument("--chat", action="store_true",
                   help="wrap the prompt as a user turn with the model's chat template")
    g.add_argument("--ctx", type=int, default=None,
                   help="context length limit in tokens (default: the model's)")
    g.add_argument("--quiet", "-q", action="store_true", help="no loading messages")
    g.set_defaults(func=cmd_generate)

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
    p.add_argument("--ctx", type=int, default=512, help="chunk size in tokens (default 512)")
    p.add_argument("--quiet", "-q", action="store_true", help="no loading messages")
    p.set_defaults(func=cmd_perplexity)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except (ModelFileError, RequestError, DemoModelMissing, FileNotFoundError,
            ValueError) as e:
        print(f"eagerlm: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\neagerlm: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
