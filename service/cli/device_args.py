"""The command-line flags that choose the device and how the engine uses it, shared by
every `eagerlm` command that runs a model (generate, chat, serve, perplexity, profile,
bench), so the same flag means the same thing everywhere (perplexity uses only --device:
its chunks' KV caches are outside the page pool)."""

from __future__ import annotations

import argparse

from eagerlm.dispatch.dispatcher import DispatcherConfig
from eagerlm.dispatch.kv_capacity import DEFAULT_HOST_POOL_BYTES
from eagerlm.dispatch.speculation import SpeculationConfig
from eagerlm.kernels.sampling import MAX_SPECULATIVE_TOKENS, SPECULATIVE_METHODS


def memory_fraction(text: str) -> float:
    """An argparse type: a share in (0, 1], refused at parse time with the reason."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"{text} is not in (0, 1]")
    return value


def add_device_args(p: argparse.ArgumentParser) -> None:
    """--device, --weights, --memory-fraction, --no-cuda-graphs and --kv-budget-mib."""
    p.add_argument("--device", "-d", default="cpu", metavar="DEVICE",
                   help="where to run: 'cpu', 'cuda' or 'cuda:N' (default cpu; the cuda "
                        "backend is new and not yet verified on a GPU; without a GPU it "
                        "says so and exits)")
    p.add_argument("--weights", choices=("quantized", "float", "bf16"), default=None,
                   help="how the backend holds the weight matrices: 'quantized' (default: "
                        "the file's blocks, read by the kernels directly), 'float' (cpu: "
                        "float32, four bytes per value: the reference path) or 'bf16' "
                        "(cuda: every matrix dequantized to bf16 at load)")
    fraction = DispatcherConfig.memory_fraction
    p.add_argument("--memory-fraction", type=memory_fraction, default=fraction, metavar="F",
                   help="share of the memory still free after loading the weights that "
                        "the KV cache may use (cuda: the pool's size; cpu: the cap on the "
                        f"default pool; default {fraction:g})")
    p.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false",
                   help="launch decode rounds kernel by kernel instead of replaying CUDA "
                        "graphs (cuda; same output, more host time per round)")
    p.add_argument("--kv-budget-mib", "--kv-budget-mb", dest="kv_budget_mib", type=int,
                   default=None, metavar="MIB",
                   help="memory for the KV cache page pool on cpu (default: enough for one "
                        "session at the full context, at least "
                        f"{DEFAULT_HOST_POOL_BYTES >> 20}, within --memory-fraction of the "
                        "memory available); the context is cut to what one session can "
                        "hold in it")


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive integer")
    return value


def add_tensor_parallel_args(p: argparse.ArgumentParser) -> None:
    """--tensor-parallel (-tp): for the commands that run the dispatcher (generate, chat,
    serve, bench, profile); docs/tensor_parallel.md."""
    p.add_argument("--tensor-parallel", "-tp", dest="tensor_parallel", type=positive_int,
                   default=1, metavar="N",
                   help="split the model over N devices: on cpu each a share of the "
                        "cores with its own KV pool (the heads and FFN features split, two "
                        "all-reduces per layer); on cuda N GPUs from --device's on (NCCL; "
                        "not yet verified on GPUs); --speculative ngram on cpu only, no "
                        "--draft-model (default 1)")


def kv_budget_bytes(mib: int | None) -> int | None:
    """--kv-budget-mib in bytes; None (the flag not given) leaves the default pool."""
    return None if mib is None else mib << 20


def speculative_tokens(text: str) -> int:
    """An argparse type: drafts per round, 0 .. MAX_SPECULATIVE_TOKENS."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if not 0 <= value <= MAX_SPECULATIVE_TOKENS:
        raise argparse.ArgumentTypeError(f"{value} is not in [0, {MAX_SPECULATIVE_TOKENS}]")
    return value


def add_speculation_args(p: argparse.ArgumentParser) -> None:
    """--speculative, --num-speculative-tokens and --draft-model (dispatch/speculation.py)."""
    spec = SpeculationConfig()
    p.add_argument("--speculative", choices=SPECULATIVE_METHODS, default=spec.method,
                   help="speculative decoding: 'ngram' proposes what followed the last "
                        "words where they occurred earlier (prompt lookup), 'draft' what "
                        "--draft-model says; verified in the same forward, so the output is "
                        "the same; drafts shrink to none where they are not accepted "
                        f"(default {spec.method})")
    p.add_argument("--num-speculative-tokens", type=speculative_tokens,
                   default=spec.num_tokens, metavar="K",
                   help=f"most drafted tokens per round (default {spec.num_tokens})")
    p.add_argument("--draft-model", "-md", metavar="PATH", default=None,
                   help="a small GGUF with the model's vocabulary, for --speculative draft")
