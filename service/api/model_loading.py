"""Opening a model on a device, with progress a user can watch: `open_model`, the one
function every caller uses (the Engine, so generate / chat / serve; perplexity; profile and
bench through service/measure/harness.py).

Loading is the one slow, silent step before anything else happens (dequantizing a few
hundred MiB of weights takes seconds on the cpu backend), so it reports progress through a
callback, the same for every backend: the CLI draws a bar from it, the async API logs it
(service/api/progress.py).

Asking for "cuda" without a usable GPU fails here with the reason
(`vmm.cuda_driver.NoCudaDevice`); it never falls back to the cpu silently. (The cuda
backend, kernels/cuda_backend.py, has not yet run on a GPU.)
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass

from eagerlm.dispatch.follower_thread import DeviceGroup
from eagerlm.errors import InvalidParameters
from eagerlm.kernels.cpu_backend import WEIGHTS_MODES, cpu_transformer
from eagerlm.kernels.model import Transformer
from eagerlm.loader.config import RopeOverride
from eagerlm.loader.model_file import ModelFile
from eagerlm.vmm.device import Device, open_device


@dataclass(frozen=True)
class LoadProgress:
    """One step of loading: `stage` is "header", "weights", "compile" or "ready"; `done` of
    `total` counts bytes of weights (0 of 0 for the other stages). "compile" (cpu) comes
    twice: before the compiled kernels are built or read from their disk
    cache, with `seconds` None, and after, with the seconds it took."""

    stage: str
    done: int = 0
    total: int = 0
    elapsed_s: float = 0.0
    seconds: float | None = None

    @property
    def fraction(self) -> float:
        return self.done / self.total if self.total else 1.0


ProgressCallback = Callable[[LoadProgress], None]


@dataclass
class LoadedModel:
    """A model file, the device it runs on and its forward (whose `ops` are the device's
    backend, kernels/backend.py), ready for a dispatcher or a forward of its own."""

    model: ModelFile
    device: Device
    transformer: Transformer
    # a model split over several devices (tensor_parallel > 1): `device` and `transformer`
    # are its device 0's; the dispatcher runs one control thread per device
    group: DeviceGroup | None = None
    _close_group: Callable[[], None] | None = None

    def close(self) -> None:
        if self._close_group is not None:
            self._close_group()
        for dev in self.group.devices[1:] if self.group is not None else []:
            dev.close()
        self.device.close()
        self.model.close()


def check_device(spec: str) -> None:
    """Raise if `spec` cannot run a model here: a malformed spec (InvalidParameters) or no CUDA
    device (NoCudaDevice)."""
    kind, _, index = spec.partition(":")
    if kind == "cpu" and not index:
        return
    if kind != "cuda" or (index and not index.isdigit()):
        raise InvalidParameters(f"unknown device {spec!r}: expected 'cpu', 'cuda' or 'cuda:N'")
    device = open_device(spec)  # NoCudaDevice when there is no usable GPU
    device.close()


WEIGHTS_CHOICES = ("quantized", "float", "bf16")  # --weights: what some backend takes


def check_weights(weights: str | None, device: str) -> None:
    """Raise InvalidParameters unless `weights` (None: the default) is a way `device`'s
    backend holds matrices: cpu "quantized" or "float", cuda "quantized" or "bf16"."""
    if weights is None:
        return
    if device == "cpu":
        backend, modes = "cpu", WEIGHTS_MODES
    else:
        from eagerlm.kernels.cuda_backend import CUDA_WEIGHTS_MODES

        backend, modes = "cuda", CUDA_WEIGHTS_MODES
    if weights not in modes:
        raise InvalidParameters(f"weights={weights!r} is not a choice of the {backend} "
                                f"backend: {' or '.join(repr(m) for m in modes)}")


def open_model(path: str | os.PathLike[str], device: str = "cpu", *,
               page_size: int | None = None,
               on_progress: ProgressCallback | None = None,
               rope: RopeOverride | None = None,
               max_context: int | None = None,
               weights: str | None = None,
               tensor_parallel: int = 1) -> LoadedModel:
    """Open the GGUF at `path`, check `device` ("cpu", "cuda", "cuda:N"), and load the
    weights for its backend: numpy on cpu (kernels/cpu_backend.py), CudaOps on cuda
    (kernels/cuda_backend.py). `page_size` is the device's KV page size (None: its
    default); `on_progress` is told each stage (a progress bar, a log line).

    `rope` replaces the file's rope scaling; `max_context` (the context the caller will
    ask for: the engine's, a perplexity chunk) is checked against what the model then
    supports before any weight is read, so a context the model cannot serve fails in a
    second, not after the load.

    `weights` is how the backend holds the matrices: "quantized" (the default on both:
    the file's blocks, read by the kernels directly), or "float" on cpu (float32, the
    reference path) and "bf16" on cuda (every matrix dequantized to bf16 at load); a value
    the device's backend does not take is refused.

    `tensor_parallel` N > 1 splits the model over N cpu devices (kernels/tensor_parallel.py
    `cpu_group`: each a share of the cores, of the heads and FFN features, its own memory);
    a model that does not split N ways is refused (`UnevenShard`, naming the tensor). On
    cuda, N GPUs from `device`'s ordinal on (`cuda_group`, NCCL; tested on emulated GPUs
    only)."""
    t0 = time.perf_counter()

    def report(stage: str, done: int = 0, total: int = 0,
               seconds: float | None = None) -> None:
        if on_progress is not None:
            on_progress(LoadProgress(stage, done, total, time.perf_counter() - t0, seconds))

    check_tensor_parallel(tensor_parallel)
    check_device(device)
    check_weights(weights, device)
    model = ModelFile.open(path, rope=rope)
    dev: Device | None = None
    try:
        model.config.context_for(max_context)
        report("header")
        def on_bytes(done: int, total: int) -> None:
            report("weights", done, total)

        if tensor_parallel > 1:
            return _open_group(model, device, tensor_parallel, page_size, weights,
                               max_context, report)
        if device == "cpu":
            transformer = cpu_transformer(
                model, on_bytes, weights="quantized" if weights is None else weights,
                on_compile=lambda seconds: report("compile", seconds=seconds),
                context=max_context)
            dev = open_device(device, page_size=page_size)
        else:
            from eagerlm.kernels.cuda_backend import cuda_transformer

            dev = open_device(device, page_size=page_size)
            transformer = cuda_transformer(model, dev, on_bytes=on_bytes,
                                           weights="quantized" if weights is None else weights,
                                           context=max_context)
    except BaseException:
        if dev is not None:
            dev.close()
        model.close()
        raise
    report("ready")
    return LoadedModel(model, dev, transformer)


def check_tensor_parallel(n: int) -> None:
    """Raise InvalidParameters unless `n` is a device count."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise InvalidParameters(f"tensor_parallel must be a positive integer, not {n!r}",
                                param="tensor_parallel")


def _open_group(model: ModelFile, device: str, n: int, page_size: int | None,
                weights: str | None, max_context: int | None,
                report: Callable[..., None]) -> LoadedModel:
    """`model` over `n` devices: cpu devices, or the GPUs from `device`'s ordinal on
    (the caller closes `model` if this raises)."""
    from eagerlm.kernels.tensor_parallel import cpu_group, cuda_group

    mode = "quantized" if weights is None else weights
    if device != "cpu":
        from eagerlm.vmm.cuda_driver import device_count

        first = int(device.partition(":")[2] or 0)
        if first + n > (have := device_count()):
            raise InvalidParameters(f"tensor_parallel {n} from {device} needs GPUs "
                                    f"{first}..{first + n - 1}, but {have} are present",
                                    param="tensor_parallel")
        tp = cuda_group(model, n, ordinals=range(first, first + n), weights=mode)
        devices = [tf.ops.device for tf in tp.transformers]
    else:
        tp = cpu_group(model, n, weights=mode,
                       on_compile=lambda seconds: report("compile", seconds=seconds),
                       context=max_context)
        devices = []
        try:
            devices = [open_device("cpu", page_size=page_size) for _ in range(n)]
        except BaseException:
            for dev in devices:
                dev.close()
            tp.close()
            raise
    report("ready")
    group = DeviceGroup(devices, list(tp.transformers), tp.abort, tp.threads.contexts)
    return LoadedModel(model, devices[0], tp.transformers[0], group, tp.close)


class DraftVocabularyMismatch(InvalidParameters):
    """A draft model whose tokens are not the target's: its proposals would be other
    tokens than they say."""


@dataclass
class DraftModel:
    """A draft model for speculative decoding (dispatch/speculation.py), loaded on the
    target's device (`open_draft`)."""

    model: ModelFile
    transformer: Transformer

    def close(self) -> None:
        self.model.close()


def open_draft(path: str | os.PathLike[str], target: LoadedModel, *,
               weights: str | None = None) -> DraftModel:
    """Load a draft model (`--draft-model`, llama.cpp's `-md`) onto the target's device,
    refusing one whose vocabulary is not the target's: every token id it can propose must
    be the same token in the target (as llama.cpp checks, token by token)."""
    model = ModelFile.open(path)
    try:
        check_draft_vocabulary(target.model, model)
        if target.device.kind == "cpu":
            transformer = cpu_transformer(model, weights="quantized" if weights is None
                                          else weights)
        else:
            from eagerlm.kernels.cuda_backend import cuda_transformer
            from eagerlm.kernels.cuda_ops import CudaOps
            ops = CudaOps.beside(target.transformer.ops)  # its stream: rounds stay in order
            transformer = cuda_transformer(model, target.device, ops=ops,
                                           weights="quantized" if weights is None else weights)
    except BaseException:
        model.close()
        raise
    return DraftModel(model, transformer)


def check_draft_vocabulary(target: ModelFile, draft: ModelFile) -> None:
    """Raise DraftVocabularyMismatch unless the draft's vocabulary is the target's: the same
    size (as the logits each model gives) and the same token at every id."""
    t, d = target.tokenizer, draft.tokenizer
    if (draft.config.vocab_size != target.config.vocab_size
            or d.vocab_size != t.vocab_size):
        raise DraftVocabularyMismatch(
            f"the draft model has {draft.config.vocab_size} tokens, the model "
            f"{target.config.vocab_size}: a draft needs the same vocabulary",
            param="draft_model")
    for i in range(t.vocab_size):
        if d.token_text(i) != t.token_text(i):
            raise DraftVocabularyMismatch(
                f"token {i} is {d.token_text(i)!r} in the draft model but "
                f"{t.token_text(i)!r} in the model: a draft needs the same vocabulary",
                param="draft_model")
