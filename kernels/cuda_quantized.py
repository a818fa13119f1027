"""Weight matrices kept on the GPU as their GGUF blocks, and the linear layer and embedding
lookup over them: the cuda counterpart of kernels/quantized.py, with the same choices.

`DeviceQuantizedMatrix` is what the cuda backend holds for a matrix of a type whose row in
kernels/cuda_weight_types.py says "blocks" (with `weights="quantized"`,
kernels/cuda_backend.py): the file's bytes for it, uploaded as they are by the slab loader,
`[out_features, row bytes]`, so it takes what the file takes (a Q4_K_M file's matrices
about 3.3x less than as bf16; F16 2 bytes a value). `CudaOps.linear` and
`CudaOps.embed` accept it where they accept a bf16 matrix, and hand it to `QuantizedLinear`:

- at most `gemv_max_rows` rows of x (decode, small batches; `GEMV_MAX_ROWS`, 8, by default),
  every type (a float type's rows a multiple of 32 values): one fused launch that reads
  the matrix and dequantizes it in registers (`gemv_<type>`, kernels/cuda/quant_matrix.cu),
  the bias added in the same launch: bf16 activations and float math, or with `gemv_int8`
  int8 activations and dp4a for the block types (`gemv8_<type>`; one more launch quantizes
  x);
- otherwise (prefill, large batches) the matrix `tile_rows` rows at a time is dequantized
  to bf16 into one reused scratch buffer (the type's `dequant_<type>_bf16` on a slice of
  the blocks) and multiplied by cuBLASLt into its columns of the output: one tile of
  `TILE_ELEMENTS` values (32 MiB) is all the extra memory, allocated at load (`reserve`)
  and counted by the GPU memory check. A BF16 matrix (which the loader holds as a bf16
  tensor; benchmarks make one to time `gemv_bf16`) is cuBLASLt's operand as it is.

Both run on the ops' stream, in order, so consecutive tiles (and layers) reuse the scratch
safely, and a decode graph captures either path (the scratch's address is fixed).

Where the two paths cross on a GPU is not measured yet (no GPU has run them):
`benchmarks/bench_gemm.py --quantized` times both per shape and type; the threshold
follows the cpu backend's and llama.cpp's mmvq (up to 8 rows) until then.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gguf import GGMLQuantizationType

from eagerlm.kernels.cuda_weight_types import WEIGHT_TYPES, WeightType
from eagerlm.kernels.device_tensor import DeviceTensor, check_tensor

if TYPE_CHECKING:
    from collections.abc import Iterable

    from eagerlm.kernels.cuda_ops import CudaOps

GEMV_MAX_ROWS = 8  # GEMV_MAX_ROWS in kernels/cuda/quant_matrix.cu
GEMV_WARPS = 4  # warps per GEMV block (GEMV_WARPS there)
TILE_ELEMENTS = 1 << 24  # weights per bf16 tile: 32 MiB
TILE_ROW_MULTIPLE = 64  # tiles start 128-byte aligned in a bf16 output row


@dataclass(frozen=True, eq=False)
class DeviceQuantizedMatrix:
    """A matrix of the file on the device as its blocks: `shape` (out_features,
    in_features) as the forward uses it, `ptr` the first of `out_features` rows of
    `row_bytes` each, as the file lays them out. `owner` keeps the memory alive."""

    ptr: int
    qtype: GGMLQuantizationType
    shape: tuple[int, int]
    owner: Any = None

    @property
    def type(self) -> WeightType:
        """The type's row of kernels/cuda_weight_types.py (its kernels)."""
        return WEIGHT_TYPES[self.qtype]

    @property
    def row_bytes(self) -> int:
        return self.shape[1] // self.type.block_size * self.type.type_size

    @property
    def nbytes(self) -> int:
        return self.shape[0] * self.row_bytes


def warps_per_row(n_in: int) -> int:
    """Warps of a GEMV block that share one output row: one per 32 of its 32-value units,
    up to the block's four (a row of 4096 values has 128 units: four warps of 32 lanes,
    one unit each per pass; one of 1024, one warp)."""
    units = n_in // 32
    return 4 if units >= 128 else 2 if units >= 64 else 1


def tile_rows(shape: tuple[int, int]) -> int:
    """Rows of a matrix of `shape` dequantized per tile: `TILE_ELEMENTS` worth, a multiple
    of `TILE_ROW_MULTIPLE`, or the whole matrix where it is smaller."""
    n_out, n_in = shape
    rows = max(TILE_ROW_MULTIPLE, TILE_ELEMENTS // n_in // TILE_ROW_MULTIPLE * TILE_ROW_MULTIPLE)
    return min(n_out, rows)


def tile_bytes(shapes: Iterable[tuple[int, int]]) -> int:
    """The scratch a set of matrices' tile path needs: the largest tile, in bf16."""
    return max((tile_rows(s) * s[1] * 2 for s in shapes), default=0)


class QuantizedLinear:
    """The ops over `DeviceQuantizedMatrix`es on one `CudaOps` (its stream, kernels and
    cuBLASLt plans), with the tile path's scratch."""

    def __init__(self, ops: CudaOps) -> None:
        self.ops = ops
        self.gemv_max_rows = GEMV_MAX_ROWS  # 0: every product by the tile path
        self.gemv_warps_per_row: int | None = None  # None: `warps_per_row` (tests force it)
        # the GEMV on int8 activations and dp4a (gemv8_<type>) rather than bf16 and float
        # math: off until a GPU's measurements favour it (bench_gemm.py --quantized)
        self.gemv_int8 = False
        self._scratch: Any = None  # DeviceBuffer

    @property
    def scratch_bytes(self) -> int:
        return 0 if self._scratch is None else int(self._scratch.nbytes)

    def reserve(self, matrices: Iterable[DeviceQuantizedMatrix]) -> None:
        """Allocate the tile scratch for these matrices now, and load their types' kernels
        (at load: an allocation or a module load inside a graph capture would invalidate
        it, and the first request should not wait for a compilation)."""
        matrices = list(matrices)
        modules = {m.type.module for m in matrices}
        if self.gemv_int8 and any(m.type.integer for m in matrices):
            modules.add("quant_matrix")  # quantize_q8
        self.ops.kernels.load_modules(sorted(modules))
        need = tile_bytes(m.shape for m in matrices if m.type.tiles)
        if need > self.scratch_bytes:
            self.release()
            self._scratch = self.ops.device.alloc(need)

    def release(self) -> None:
        """Free the scratch (after the work that uses it: the stream is synchronized)."""
        if self._scratch is not None:
            self.ops.synchronize()
            self._scratch.free()
            self._scratch = None

    def uses_gemv(self, n_tokens: int, w: DeviceQuantizedMatrix, x: DeviceTensor) -> bool:
        """Whether `linear` takes the fused GEMV: few enough rows, x 16-byte aligned, and
        rows of whole 32-value units (always so for a block type)."""
        return (0 < n_tokens <= self.gemv_max_rows and w.shape[1] % 32 == 0
                and x.ptr % 16 == 0)

    def linear(self, x: DeviceTensor, w: DeviceQuantizedMatrix, y: DeviceTensor,
               bias: DeviceTensor | None) -> bool:
        """Enqueue y = x @ w^T (y bf16, or float32 for logits); True where the bias was
        added too (the GEMV adds it), False where the caller still has to add it."""
        from eagerlm.kernels.cublaslt import CUDA_R_16BF, CUDA_R_32F

        ops = self.ops
        n_out, n_in = w.shape
        n_tok = x.size // n_in
        out_f32 = y.dtype == "f32"
        if n_tok == 0:
            return True
        t = w.type
        if self.uses_gemv(n_tok, w, x):
            if bias is not None:
                check_tensor(bias, "f32", "bias")
            per_row = self.gemv_warps_per_row or warps_per_row(n_in)
            grid = -(-n_out // (GEMV_WARPS // per_row))
            b = 0 if bias is None else bias.ptr
            if self.gemv_int8 and t.gemv8 is not None:
                qx, dx = self.quantize_q8(x, n_tok * n_in // 32)
                ops.kernels[t.gemv8].launch(
                    ops.stream.handle, grid, 32 * GEMV_WARPS, y.ptr, qx.ptr, dx.ptr, w.ptr, b,
                    n_tok, n_in, n_out, int(out_f32), per_row)
            else:
                ops.kernels[t.gemv].launch(
                    ops.stream.handle, grid, 32 * GEMV_WARPS, y.ptr, x.ptr, w.ptr, b, n_tok,
                    n_in, n_out, int(out_f32), per_row)
            return True
        s = ops.stream.handle
        out_type = CUDA_R_32F if out_f32 else CUDA_R_16BF
        if not t.tiles:  # bf16 already: cuBLASLt's operand as it is
            ops.gemm.matmul(int(s), y.ptr, x.ptr, w.ptr, n_tok, n_in, n_out, out_type)
            return False
        rows = tile_rows(w.shape)
        if rows * n_in * 2 > self.scratch_bytes:
            self.reserve([w])  # a matrix not loaded by the backend (tests, benchmarks)
        dequant = ops.kernels[t.dequant("bf16")]
        for start in range(0, n_out, rows):
            part = min(rows, n_out - start)
            n = part * n_in
            dequant.launch(s, ops._grid(t.dequant_threads(n)), 256, self._scratch.ptr,
                           w.ptr + start * w.row_bytes, n)
            ops.gemm.matmul(int(s), y.ptr + start * y.itemsize, x.ptr, self._scratch.ptr,
                            n_tok, n_in, part, out_type, ldy=n_out)
        return False

    def quantize_q8(self, x: DeviceTensor, n_units: int) -> tuple[DeviceTensor, DeviceTensor]:
        """x (bf16) as int8 per 32 values and their float32 scales (the int8 GEMV's input;
        kernels/cuda/quant_matrix.cu's quantize_q8)."""
        ops = self.ops
        qx = ops.empty((n_units * 32,), "u8")
        dx = ops.empty((n_units,), "f32")
        grid = max(1, min(-(-n_units // GEMV_WARPS), ops.sm_count * 32))
        ops.kernels["quantize_q8"].launch(ops.stream.handle, grid, 32 * GEMV_WARPS, qx.ptr,
                                          dx.ptr, x.ptr, n_units)
        return qx, dx

    def embed(self, table: DeviceQuantizedMatrix, out: DeviceTensor, ids_ptr: int,
              stride: int, token_buf: int, n: int, scale: float) -> None:
        """Rows of `table` (ids as `CudaOps.embed` takes them) dequantized, times `scale`,
        into float32 `out`."""
        vocab, d = table.shape
        self.ops.kernels[table.type.embed].launch(
            self.ops.stream.handle, n, 256, out.ptr, table.ptr, ids_ptr, stride, token_buf, n,
            d, vocab, float(scale))
