"""The command-line flags that choose the device and how the engine uses it, shared by
every `eagerlm` command that runs a model (generate, chat, serve, perplexity, profile,
bench), so the same flag means the same thing everywhere (perplexity uses only --device:
its chunks' KV caches are outside the page pool)."""

from __future__ import annotations

import argparse

from eagerlm.dispatch.dispatcher import DispatcherConfig
from eagerlm.dispatch.kv_capacity import DEFAULT_HOST_POOL_BYTES


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


def kv_budget_bytes(mib: int | None) -> int | None:
    """--kv-budget-mib in bytes; None (the flag not given) leaves the default pool."""
    return None if mib is None else mib << 20
