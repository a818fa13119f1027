"""Shared by the cuda op tests: the device fixture (a GPU, skipped without one, and the
emulated GPU of tests/emulated_gpu/gpu_emulator.py), the ops on it, and bf16 helpers for comparing
against the numpy reference."""

from __future__ import annotations

import numpy as np
import pytest

from eagerlm.kernels.batch import ForwardBatch, SeqSlice
from eagerlm.kernels.numpy_ops import NumpyOps
from eagerlm.vmm.kv_layout import ContiguousKV, KVLayout

REF = NumpyOps()
rng = np.random.default_rng(1234)  # reseeded per test (tests/conftest.py)


# "emulated-reverse": blocks, and a block's threads between synchronizations, run in the
# reverse order (tests/emulated_gpu/cuda_emulation/runtime.h). A GPU promises no order, so
# every kernel must give the same result both ways; one that races on shared or global
# memory does not.
# A test module of whole models sets FORWARD_SCHEDULE_ONLY: each kernel they run is tested
# under both orders one by one.
@pytest.fixture(scope="module", params=[pytest.param("gpu", marks=pytest.mark.gpu), "emulated",
                                        "emulated-reverse"])
def device(request):
    from eagerlm.vmm.cuda_driver import NoCudaDevice
    from eagerlm.vmm.device import open_device

    if request.param == "gpu":
        try:
            d = open_device("cuda")
        except NoCudaDevice as exc:
            pytest.skip(f"no CUDA device ({exc})")
        yield d
        d.close()
        return
    from tests.emulated_gpu.gpu_emulator import emulated_gpu_for_test

    if request.param == "emulated-reverse" and getattr(request.module,
                                                       "FORWARD_SCHEDULE_ONLY", False):
        pytest.skip("whole models run under the forward schedule only")
    with emulated_gpu_for_test(), pytest.MonkeyPatch.context() as mp:
        if request.param == "emulated-reverse":
            mp.setenv(SCHEDULE_VARIABLE, "reverse")
        d = open_device("cuda")
        yield d
        d.close()


SCHEDULE_VARIABLE = "EAGERLM_EMULATOR_SCHEDULE"


@pytest.fixture(scope="module")
def ops(device):
    from eagerlm.kernels.cuda_ops import CudaOps

    o = CudaOps(device, poison_outputs=True)
    yield o
    o.close()


@pytest.fixture()
def gemm_ops(ops, device):
    """`ops` for GEMMs and whole models. Not under the reversed schedule: GEMMs there are
    numpy's, and every kernel a model runs is tested under it one by one."""
    import os

    if os.environ.get(SCHEDULE_VARIABLE) == "reverse":
        pytest.skip("whole models and GEMMs run under the forward schedule only")
    if "Emulated" not in type(device.ctx).__name__ and "emulated" not in device.name:
        pytest.importorskip("nvmath.bindings.cublasLt", reason="nvmath-python not installed")
    return ops


def bf16(x: np.ndarray) -> np.ndarray:
    from eagerlm.kernels.device_tensor import from_bf16_bits, to_bf16_bits

    return from_bf16_bits(to_bf16_bits(np.asarray(x, np.float32)))


def rand(*shape: int, scale: float = 1.0) -> np.ndarray:
    return bf16(rng.standard_normal(shape).astype(np.float32) * scale)


def close(got: np.ndarray, want: np.ndarray, *, rel: float = 1e-2, ulps: float = 4,
          row: int | None = None) -> None:
    """bf16 agreement: relative error of the whole under `rel`, and each element within
    `ulps` bf16 ulps of itself, or of a floor where it is small: 1e-3 of the largest
    element, or with `row`, the RMS of its run of `row` trailing elements (an attention
    head's output: the rounding of a weighted sum's terms, such as the softmax weights
    FlashAttention-style kernels round to bf16, errs in proportion to the row, not to an
    element that cancels to near zero)."""
    got = np.asarray(got, np.float64)
    want = np.asarray(want, np.float64)
    assert got.shape == want.shape
    assert np.isfinite(got).all(), "an output element was not written (still NaN poison)"
    err = np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)
    assert err < rel, f"relative error {err:.2e}"
    if row is None:
        floor = np.abs(want).max() * 1e-3
    else:
        rows = want.reshape(-1, row)
        floor = np.sqrt((rows**2).mean(axis=-1, keepdims=True)) * np.ones_like(rows)
        floor = floor.reshape(want.shape)
    tol = ulps * 2.0**-8 * np.maximum(np.abs(want), floor)
    bad = np.abs(got - want) > tol
    assert not bad.any(), (f"{bad.sum()} elements off by more than {ulps} bf16 ulps; first "
                           f"at {np.argwhere(bad)[0].tolist()}")


def sessions(ops, layout_dev, layout_host, specs):
    """Sessions (n_past, n_new, capacity) with random cached KV, on host and device."""
    from eagerlm.kernels.device_tensor import ContiguousDeviceKV, to_bf16_bits

    host, dev, start = [], [], 0
    for n_past, n_new, cap in specs:
        h = ContiguousKV(layout_host, cap)
        h.data[:n_past] = rand(n_past, *layout_host.token_shape)
        d = ContiguousDeviceKV(ops, layout_dev, cap)
        bits = to_bf16_bits(h.data)
        from eagerlm.vmm.device import MemoryRange

        staging = ops.device.alloc_host(bits.nbytes)
        staging.array[:] = bits.view(np.uint8).reshape(-1)
        ops.stream.copy_h2d(MemoryRange(d.buffer.ptr, d.buffer.nbytes), staging, bits.nbytes)
        ops.synchronize()
        staging.free()
        host.append(SeqSlice(start, n_new, n_past, h))
        dev.append(SeqSlice(start, n_new, n_past, d))
        start += n_new
    return host, dev, start


def appended_batches(ops, specs, n_kv: int, hd: int, *, n_layers: int = 2, layer: int = 1):
    """Sessions `specs` (n_past, n_new, capacity) as one batch on the host and one on the
    device, with random new K/V for `layer` appended to both (the reference's kv_append
    and the device's): what every attention test starts from. Returns (host batch, device
    batch, number of rows)."""
    from eagerlm.kernels.device_tensor import KV_DTYPE

    host, dev, n_tok = sessions(ops, KVLayout(n_layers, n_kv, hd, KV_DTYPE),
                                KVLayout(n_layers, n_kv, hd), specs)
    tokens = np.zeros(n_tok, np.int32)
    bh = ForwardBatch(tokens, host, np.arange(n_tok))
    bd = ForwardBatch(tokens, dev, np.arange(n_tok))
    k, v = rand(n_tok, n_kv, hd), rand(n_tok, n_kv, hd)
    REF.kv_append(bh, layer, k, v)
    ops.kv_append(bd, layer, ops.upload(k, "bf16").reshape(n_tok, n_kv, hd),
                  ops.upload(v, "bf16").reshape(n_tok, n_kv, hd))
    return bh, bd, n_tok


def region_tensor(kv, shape):
    from eagerlm.kernels.device_tensor import DeviceTensor

    return DeviceTensor(kv.buffer.ptr, shape, "bf16")


def is_emulated(device) -> bool:
    """The emulated GPU (tests/emulated_gpu/gpu_emulator.py): about a thousand times slower than a
    real one, so whole-model tests run shorter there."""
    return "Fake" in device.name


def quantized_paths(ops, monkeypatch) -> set[str]:
    """The paths ("gemv", "tile") that `ops.quantized.linear` takes from now on
    (kernels/cuda_quantized.py): a test of a whole model says both ran."""
    seen: set[str] = set()
    uses_gemv = ops.quantized.uses_gemv

    def spy(*args):
        used = uses_gemv(*args)
        seen.add("gemv" if used else "tile")
        return used

    monkeypatch.setattr(ops.quantized, "uses_gemv", spy)
    return seen
