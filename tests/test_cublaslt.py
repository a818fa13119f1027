"""kernels/cublaslt.py's plans, on the emulated GPU's cuBLASLt
(tests/emulated_gpu/fake_cublaslt.py).

The products themselves are checked against float64 numpy in tests/test_cuda_ops.py, on a
GPU and on the emulator. Here: a plan (descriptors plus the heuristic's algorithm) is made
once per shape and operand alignment and reused, evicted plans and a closed Gemm leave no
cuBLASLt object alive, and the fake refuses what the library refuses, so that the tests
that pass through it could fail.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from eagerlm.kernels.cublaslt import CUDA_R_16BF, CUDA_R_32F, alignment


@pytest.fixture()
def emulated():
    from eagerlm.vmm.device import open_device
    from tests.emulated_gpu.gpu_emulator import emulated_gpu_for_test

    with emulated_gpu_for_test() as drv:
        from eagerlm.kernels.cuda_ops import CudaOps

        device = open_device("cuda")
        ops = CudaOps(device)
        yield ops, drv.cublaslt
        ops.close()
        device.close()


def _operands(ops, n_tok: int, n_in: int, n_out: int, offset: int = 0):
    """Zeroed x, w, y, each `offset` bytes into its own allocation, and the allocations."""
    keep = [ops.upload(np.zeros(nbytes + offset, np.uint8))  # y: room for float32
            for nbytes in (n_tok * n_in * 2, n_out * n_in * 2, n_tok * n_out * 4)]
    return keep, [t.ptr + offset for t in keep]


def test_alignment_is_the_largest_power_of_two_dividing_the_pointer_up_to_256() -> None:
    assert [alignment(p) for p in (0, 0x1000, 0x1100, 0x1080, 0x1002, 0x1010)] == \
        [256, 256, 256, 128, 2, 16]


def test_a_plan_is_made_once_per_shape_and_alignment(emulated) -> None:
    ops, lt = emulated
    gemm = ops.gemm
    s = int(ops.stream.handle)
    _keep, (x, w, y) = _operands(ops, 4, 64, 32)
    for _ in range(3):
        gemm.matmul(s, y, x, w, 4, 64, 32)
    assert gemm.heuristic_calls == 1
    gemm.matmul(s, y, x, w, 2, 64, 32)  # fewer tokens: another shape
    gemm.matmul(s, y, x, w, 4, 64, 32, CUDA_R_32F)  # float32 out: another problem
    assert gemm.heuristic_calls == 3
    _keep2, (x2, w2, y2) = _operands(ops, 4, 64, 32, offset=16)
    gemm.matmul(s, y2, x2, w2, 4, 64, 32)  # same shape, 16-byte aligned operands
    gemm.matmul(s, y2, x2, w2, 4, 64, 32)
    assert gemm.heuristic_calls == 4
    ops.synchronize()
    assert lt.matmuls == 7


def test_evicted_plans_and_a_closed_gemm_leave_no_cublaslt_object(emulated,
                                                                  monkeypatch) -> None:
    import eagerlm.kernels.cublaslt

    monkeypatch.setattr(eagerlm.kernels.cublaslt, "MAX_CACHED_SHAPES", 2)
    ops, lt = emulated
    gemm = ops.gemm
    _keep, (x, w, y) = _operands(ops, 8, 64, 32)
    for n_tok in (1, 2, 3, 4):
        gemm.matmul(int(ops.stream.handle), y, x, w, n_tok, 64, 32)
    ops.synchronize()
    assert len(gemm._plans) == 2
    assert lt.live_objects() == 1 + 2 * 4  # the handle, and 2 plans of desc + 3 layouts
    gemm.close()
    assert lt.live_objects() == 0


# -- the fake keeps the library's contract ----------------------------------------------


def _heuristic(lt, m: int, n: int, k: int, prefs: dict[int, int] | None = None):
    pa = lt.MatmulPreferenceAttribute
    h = lt.create()
    desc = lt.matmul_desc_create(68, CUDA_R_32F)  # CUBLAS_COMPUTE_32F
    t = ctypes.c_int32(1)
    lt.matmul_desc_set_attribute(desc, int(lt.MatmulDescAttribute.TRANSA),
                                 ctypes.addressof(t), 4)
    a = lt.matrix_layout_create(CUDA_R_16BF, k, m, k)
    b = lt.matrix_layout_create(CUDA_R_16BF, k, n, k)
    d = lt.matrix_layout_create(CUDA_R_16BF, m, n, m)
    pref = lt.matmul_preference_create()
    for attr, value in (prefs or {}).items():
        v = ctypes.c_uint32(value)
        lt.matmul_preference_set_attribute(pref, int(attr), ctypes.addressof(v), 4)
    ws = ctypes.c_uint64(1 << 20)
    lt.matmul_preference_set_attribute(pref, int(pa.MAX_WORKSPACE_BYTES),
                                       ctypes.addressof(ws), 8)
    result = lt.MatmulHeuristicResult(1)
    count = ctypes.c_int32(0)
    lt.matmul_algo_get_heuristic(h, desc, a, b, d, d, pref, 1, result.ptr,
                                 ctypes.addressof(count))
    assert count.value == 1
    return h, desc, a, b, d, result


def test_the_fake_refuses_operands_less_aligned_than_the_preference(emulated) -> None:
    from tests.emulated_gpu.fake_cublaslt import NOT_SUPPORTED, FakeCublasLtError

    ops, lt = emulated
    alpha, beta = np.ones(1, np.float32), np.zeros(1, np.float32)
    _keep, (x, w, y) = _operands(ops, 4, 64, 32, offset=2)
    h, desc, a, b, d, result = _heuristic(lt, 32, 4, 64)  # default: 256-byte operands
    args = (h, desc, alpha.ctypes.data, w, a, x, b, beta.ctypes.data, y, d, y, d,
            result.ptr, ops.gemm.workspace_ptr, 1 << 20, int(ops.stream.handle))
    with pytest.raises(FakeCublasLtError) as err:
        lt.matmul(*args)
    assert err.value.status == NOT_SUPPORTED
    pa = lt.MatmulPreferenceAttribute
    told = {pa.MIN_ALIGNMENT_A_BYTES: 2, pa.MIN_ALIGNMENT_B_BYTES: 2,
            pa.MIN_ALIGNMENT_C_BYTES: 2, pa.MIN_ALIGNMENT_D_BYTES: 2}
    h, desc, a, b, d, result = _heuristic(lt, 32, 4, 64, told)
    lt.matmul(h, desc, alpha.ctypes.data, w, a, x, b, beta.ctypes.data, y, d, y, d,
              result.ptr, ops.gemm.workspace_ptr, 1 << 20, int(ops.stream.handle))
    ops.synchronize()


def test_the_fake_refuses_what_the_library_refuses(emulated) -> None:
    from tests.emulated_gpu.fake_cublaslt import INVALID_VALUE, FakeCublasLtError

    _ops, lt = emulated
    with pytest.raises(TypeError):  # the real binding's argument conversion
        lt.matrix_layout_create(CUDA_R_16BF, "64", 4, 64)
    with pytest.raises(FakeCublasLtError):  # column-major: ld >= rows
        lt.matrix_layout_create(CUDA_R_16BF, 64, 4, 32)
    desc = lt.matmul_desc_create(68, CUDA_R_32F)
    v = ctypes.c_int64(1)
    with pytest.raises(FakeCublasLtError):  # TRANSA is an int32
        lt.matmul_desc_set_attribute(desc, int(lt.MatmulDescAttribute.TRANSA),
                                     ctypes.addressof(v), 8)
    h = lt.create()
    a = lt.matrix_layout_create(CUDA_R_16BF, 64, 32, 64)
    b = lt.matrix_layout_create(CUDA_R_16BF, 48, 4, 48)  # k = 48, A's is 64
    d = lt.matrix_layout_create(CUDA_R_16BF, 32, 4, 32)
    pref = lt.matmul_preference_create()
    result, count = lt.MatmulHeuristicResult(1), ctypes.c_int32(0)
    with pytest.raises(FakeCublasLtError) as err:
        lt.matmul_algo_get_heuristic(h, desc, a, b, d, d, pref, 1, result.ptr,
                                     ctypes.addressof(count))
    assert err.value.status == INVALID_VALUE
