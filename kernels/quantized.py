"""A weight matrix kept in its GGUF blocks on the cpu, and the matmul and row lookup over it.

`QuantizedMatrix` is what the cpu backend holds for a quantized (or float16 / bfloat16)
matrix: the file's bytes, `[rows, row_bytes]`, so it takes what the file takes. The ops
(kernels/numpy_ops.py) accept it wherever they accept a float32 matrix:

- `quantized_linear(x, w)`: x @ w^T, by the compiled kernels of w's type
  (kernels/cpu_kernel_registry.py; every type gguf-py knows but the float32 ones, which
  the backend keeps as float32 arrays). Up to the type's `gemv_rows` rows of x (decode,
  decode batches: 24 for the block types, 8 for F16 / BF16) take the type's `gemv`: x
  quantized to 8-bit codes per 32 values once (kernels/cpu_activations.py; F16 / BF16
  keep x float32), then each block decoded in registers and multiplied with every row of
  x, nothing dequantized to memory; the output rows are cut in pieces that the cores take
  in turn (kernels/cpu_threads.py's `by_output_pieces`), or run on the calling thread
  under `GEMV_SERIAL_MAX_VALUES` multiply-adds.
  Beyond that (prefill, big batches), on machines with 512-bit VNNI or AVX2 every block
  type but Q1_0 (and, on AVX2, the signed types where they have a faster path:
  `SIGNED_PANELS`) takes 8-bit panels (`prompt_panels`, kernels/cpu_panel_gemm.py): x
  quantized per 32 values once, `PANEL_TILE_BYTES` of
  panels at a time packed from the blocks by the type's `pack_panels` into a reused
  buffer per core, times every row of x by its `panel_product`; the cores take pieces of
  whole panels in turn. Elsewhere the types with a `prompt_run_rows` (the superblock
  types, F16) still take `gemv` on machines without AVX-512, in runs of that many rows of
  x (`prompt_runs`); the others (on AVX-512 machines every type the panels do not take),
  dequantize
  `TILE_ELEMENTS` worth of weight rows at a time into a reused float32 buffer and multiply
  it by BLAS, one share of the output rows per core: a tile per core is all the extra
  memory. Which is faster was measured per type and machine (docs/performance.md).
- `QuantizedMatrix.take(ids)`: rows dequantized (the embedding lookup).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass
from functools import partial
from types import ModuleType

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from eagerlm.kernels.aligned_arrays import aligned, aligned_empty
from eagerlm.kernels.cpu_activations import (
    PAD,
    SUPERBLOCK,
    activation_arrays,
    quantize_activations,
    quantize_into,
    quantize_superblocks,
    quantize_superblocks_into,
    quantizer_address,
    quantizer_function,
)
from eagerlm.kernels.cpu_kernel_registry import BLOCK_TYPES, kernels
from eagerlm.kernels.cpu_panel_gemm import PANEL, PANEL_ISA, PANELS_NATIVE, ROW_BLOCK
from eagerlm.kernels.cpu_row_kernel import RowKernel, register
from eagerlm.kernels.cpu_simd import HOST_AVX512
from eagerlm.kernels.cpu_threads import by_output_features, by_output_pieces, core_workers

# Prompts take `gemv` in runs (the types' `prompt_run_rows`) only on machines without
# AVX-512, where the runs were measured faster than float32 tiles times BLAS (an AMD EPYC,
# AVX2). With AVX-512, OpenBLAS's float32 kernels are twice as wide and `gemv`'s integer
# dot products are not: on a Xeon (AVX-512 VNNI) the tiles' prompts were 11-31% faster
# for every type measured, F16 and the superblock and IQ types (docs/performance.md,
# 2026-11-28).
PROMPT_RUNS = not HOST_AVX512
# Prompts of the block types take 8-bit panels (kernels/cpu_panel_gemm.py) where the
# machine has 512-bit VNNI (1.5-2.5x the tiles' and the runs' rates there) or AVX2
# (1.14-2.2x the runs' and tiles' on one core of the Xeon compiling for Haswell, every
# type but IQ4_XS, whose signed codes cost the panels more per product and whose runs
# are long; 1.7-2.5x the 512-bit tiles for the unsigned types compiling for an AVX-512
# machine without VNNI, where the signed types keep the tiles: `prompt_panels`;
# docs/performance.md, 2026-11-29).
PROMPT_PANELS = PANELS_NATIVE
# whether the signed types' prompts take the panels wherever the others' do: not on the
# AVX2 panels (magnitudes and signs, and 128 times x's sums back) where they have a
# faster path (`_takes_panels`)
SIGNED_PANELS = PANEL_ISA != "avx2"
# Cleared while the panels' kernels compile in kernels/cpu_compile.py's helper process
# after a load on a cold cache, set once they are loaded here: until then prompts take
# the float32 tiles (whose `dequant` the load compiles for these types too), as decode
# batches run op by op until the replay's table is ready, instead of the load waiting
# seconds more for them.
PANELS_READY = threading.Event()
PANELS_READY.set()
# pieces of a product per core for the panels: 8 rather than by_output_pieces' 3, so that a
# core slowed by other work (a shared host's) leaves less of the product to wait for at
# the end: 128 rows by an 8192 x 3072 Q4_K matrix on two cores 29 -> 23-25 ms there
# (docs/performance.md)
PANEL_PIECES = 8
# codes per panel tile: 1 MiB, 32 * k bytes a panel (a tile's rows times every row of x)
PANEL_TILE_BYTES = 1 << 20
# weights per tile: 2 MiB of float32 (128K-4M measured, docs/performance.md: 2816-value
# rows gained 8% over 1 MiB; an OpenBLAS call repacks x for every tile)
TILE_ELEMENTS = 1 << 19
# Below this many multiply-adds a `gemv` runs on the calling thread: at ~30 G multiply-adds
# a second per core (8-bit dot products) 2M take ~70 us alone, ~35 us on two cores plus the
# ~25-30 us a hand-off to the other core's worker costs (measured, docs/performance.md).
GEMV_SERIAL_MAX_VALUES = 1 << 21


@dataclass(frozen=True, eq=False)
class QuantizedMatrix:
    """A matrix of the file held as its blocks: `shape` (out_features, in_features) as the
    forward uses it, `blocks` uint8 `[out_features, row bytes]`, C-contiguous."""

    qtype: GGMLQuantizationType
    shape: tuple[int, int]
    blocks: np.ndarray

    @classmethod
    def of(cls, qtype: GGMLQuantizationType, shape: tuple[int, ...],
           raw: np.ndarray) -> QuantizedMatrix:
        """A copy of a tensor's raw bytes (`raw`, as the file stores them)."""
        rows, cols = shape
        if qtype not in BLOCK_TYPES:
            raise ValueError(f"the cpu backend has no kernels for {qtype.name} matrices")
        block, type_size = GGML_QUANT_SIZES[qtype]
        if cols % block:
            raise ValueError(f"rows of {cols} values are not whole {qtype.name} blocks")
        blocks = np.array(raw, dtype=np.uint8, copy=True).reshape(rows, cols // block * type_size)
        return cls(qtype, (rows, cols), blocks)

    @property
    def nbytes(self) -> int:
        return int(self.blocks.nbytes)

    @property
    def dtype(self) -> np.dtype:
        """What it computes as (so code that asks an array's dtype gets an answer)."""
        return np.dtype(np.float32)

    @property
    def kernels(self) -> ModuleType:
        """The compiled kernels of its type (kernels/cpu_kernel_registry.py)."""
        return kernels(self.qtype)

    def dequantize_rows(self, start: int, out: np.ndarray) -> np.ndarray:
        """Rows start .. start + len(out) as float32 into `out`."""
        self.kernels.dequant(self.blocks, start, out)
        return out

    def take(self, ids: np.ndarray) -> np.ndarray:
        """Rows `ids` as float32 `[len(ids), in_features]` (an embedding lookup)."""
        rows = QuantizedMatrix(self.qtype, (len(ids), self.shape[1]),
                               np.ascontiguousarray(self.blocks[np.asarray(ids)]))
        return rows.dequantize_rows(0, np.empty(rows.shape, np.float32))

    def dequantize(self) -> np.ndarray:
        """The whole matrix as float32 (tests, comparisons)."""
        return self.dequantize_rows(0, np.empty(self.shape, np.float32))


def quantized_linear(x: np.ndarray, w: QuantizedMatrix) -> np.ndarray:
    """x @ w^T, float32 `[rows of x, out_features]`."""
    x = aligned(np.asarray(x, dtype=np.float32))
    n = x.shape[0]
    out_features, in_features = w.shape
    y = np.empty((n, out_features), np.float32)
    if takes_gemv(w.qtype, n):
        acts = gemv_activations(w.qtype, x)
        by_output_pieces(n * out_features * in_features, out_features,
                         partial(_gemv_runs, w, acts, y), serial_max=GEMV_SERIAL_MAX_VALUES)
        return y
    if prompt_panels(w.qtype):
        sub = BLOCK_TYPES[w.qtype].activation_group
        padded = -(-n // ROW_BLOCK) * ROW_BLOCK
        if padded != n:
            x = np.concatenate([x, np.zeros((padded - n, in_features), np.float32)])
        acts = quantize_activations(x, sub)
        part = partial(_panels, w, acts, y, core_workers().local)
        by_output_pieces(n * out_features * in_features, -(-out_features // PANEL),
                         lambda a, b: part(a * PANEL, min(out_features, b * PANEL)),
                         per_core=PANEL_PIECES)
        return y
    by_output_features(n * out_features * in_features, out_features,
                       partial(_tiles, x, w, y, core_workers().local))
    return y


def gemv_activations(qtype: GGMLQuantizationType, x: np.ndarray) -> tuple[np.ndarray, ...]:
    """x as `qtype`'s `gemv` takes it: 8-bit codes with scales and sums per group (per 256
    values for the superblock types), or float32 itself (F16, BF16)."""
    block_type = BLOCK_TYPES[qtype]
    group = block_type.activation_group
    if block_type.superblocks:
        return quantize_superblocks(x, group)
    return quantize_activations(x, group) if group else (x,)


def takes_gemv(qtype: GGMLQuantizationType, n_rows: int) -> bool:
    """Whether `quantized_linear` multiplies `n_rows` rows of x by the type's `gemv` (8-bit
    activations for the block types) rather than by panels or float32 tiles and BLAS."""
    if n_rows <= BLOCK_TYPES[qtype].gemv_rows:
        return True
    return not prompt_panels(qtype) and prompt_runs(qtype) > 0


def prompt_panels(qtype: GGMLQuantizationType) -> bool:
    """Whether more than `gemv_rows` rows of x take 8-bit panels: a type whose prompts
    take them on this machine (`panel_types`) with the kernels ready (`PANELS_READY`)."""
    return _takes_panels(qtype) and PANELS_READY.is_set()


def _takes_panels(qtype: GGMLQuantizationType) -> bool:
    """`PROMPT_PANELS` and a type that has them (`has_panels`), but for a signed type on
    the AVX2 panels where it has a faster path: its runs (IQ4_XS, 0.81x), or the 512-bit
    tiles of an AVX-512 machine without VNNI (Q8_0 and IQ4_XS 0.69-0.72x there; the
    unsigned types 1.7-2.5x; docs/performance.md)."""
    if BLOCK_TYPES[qtype].signed and not SIGNED_PANELS and (
            HOST_AVX512 or prompt_runs(qtype)):
        return False
    return PROMPT_PANELS and has_panels(qtype)


def has_panels(qtype: GGMLQuantizationType) -> bool:
    """Whether `qtype` has 8-bit panels: the block types with `panels` (F16 and BF16 keep
    their tiles or runs, Q1_0 its tiles)."""
    block_type = BLOCK_TYPES[qtype]
    return block_type.activation_group > 0 and block_type.panels


def prompt_runs(qtype: GGMLQuantizationType) -> int:
    """The runs of rows of x in which more than `gemv_rows` rows take `qtype`'s `gemv`:
    its `prompt_run_rows` where `PROMPT_RUNS`, else 0 (float32 tiles)."""
    return BLOCK_TYPES[qtype].prompt_run_rows if PROMPT_RUNS else 0


def _gemv_runs(w: QuantizedMatrix, acts: tuple[np.ndarray, ...], y: np.ndarray, start: int,
               stop: int) -> None:
    """Output features start .. stop - 1 by `gemv`, over runs of the type's
    `prompt_runs` rows of x when there are more than its `gemv_rows`: each run's
    activations stay in the core's caches while every weight row of the share passes."""
    n = len(acts[0])
    gemv = w.kernels.gemv
    if n <= BLOCK_TYPES[w.qtype].gemv_rows:  # decode, decode batches (and no rows): one call
        gemv(w.blocks, *acts, y, start, stop)
        return
    run = prompt_runs(w.qtype)
    for j in range(0, n, run):
        gemv(w.blocks, *(a[j:j + run] for a in acts), y[j:j + run], start, stop)


def _panels(w: QuantizedMatrix, acts: tuple[np.ndarray, ...], y: np.ndarray,
            local: threading.local, start: int, stop: int) -> None:
    """Output features start .. stop - 1: `PANEL_TILE_BYTES` of 8-bit panels at a time
    packed from the blocks into this thread's buffers (the type's `pack_panels`), times
    every row of x by its `panel_product` (kernels/cpu_panel_gemm.py)."""
    in_features = w.shape[1]
    groups = in_features // BLOCK_TYPES[w.qtype].activation_group
    tile_rows = max(PANEL, PANEL_TILE_BYTES // in_features // PANEL * PANEL)
    tile_rows = min(tile_rows, -(-(stop - start) // PANEL) * PANEL)
    buffers = getattr(local, "panels", None)
    if buffers is None or buffers[0].size < tile_rows * in_features // 4 \
            or buffers[1].size < tile_rows * groups:
        buffers = local.panels = (aligned_empty(tile_rows * in_features // 4, np.uint32),
                                  aligned_empty(tile_rows * groups, np.float32),
                                  aligned_empty(tile_rows * groups, np.float32))
    codes, scales, offsets = buffers
    pack, product = w.kernels.pack_panels, w.kernels.panel_product
    for s in range(start, stop, tile_rows):
        rows = min(tile_rows, stop - s)
        pack(w.blocks, s, s + rows, codes, scales, offsets)
        product(codes, scales, offsets, in_features, -(-rows // PANEL), *acts, y, s, rows)


def _tiles(x: np.ndarray, w: QuantizedMatrix, y: np.ndarray, local: threading.local,
           start: int, stop: int) -> None:
    """Output features start .. stop - 1: a tile of `TILE_ELEMENTS` weights at a time
    dequantized into this thread's buffer, times x by BLAS."""
    in_features = w.shape[1]
    tile_rows = max(1, min(stop - start, TILE_ELEMENTS // in_features))
    tile = getattr(local, "tile", None)
    if tile is None or tile.size < tile_rows * in_features:
        tile = local.tile = np.empty(TILE_ELEMENTS + in_features, np.float32)
    for s in range(start, stop, tile_rows):
        rows = min(tile_rows, stop - s)
        part = tile[:rows * in_features].reshape(rows, in_features)
        w.dequantize_rows(s, part)
        y[:, s:s + rows] = x @ part.T


def row_kernel(w: object) -> RowKernel | None:
    """The decode replay's kernels of a `QuantizedMatrix` (kernels/cpu_row_kernel.py): its
    type's `gemv` and activation quantizer as C functions, compiled on first use; up to
    `gemv_rows` rows of x, as `quantized_linear` takes that path."""
    if not isinstance(w, QuantizedMatrix):
        return None
    block_type = BLOCK_TYPES[w.qtype]
    address = w.kernels.row_kernel_address()
    group = block_type.activation_group
    if not group:  # F16, BF16: float32 x
        return RowKernel(address, max_rows=block_type.gemv_rows)
    superblocks = block_type.superblocks
    return RowKernel(address, quantizer_address(superblocks, group),
                     scale_group=SUPERBLOCK if superblocks else group, sum_group=group,
                     pad=PAD, max_rows=block_type.gemv_rows)


register(row_kernel)


# -- compiling the kernels before the first forward (kernels/cpu_compile.py's groups) ------------
# Three parts, so that each compiles once when the load splits them over two processes:
# each type's own kernels, the activations' quantizers (shared by types), and the decode
# replay's C entries (compiled after the load, with the replay's table).

def dequantized_types(qtypes: Iterable[GGMLQuantizationType],
                      embedding: GGMLQuantizationType | None) -> set[GGMLQuantizationType]:
    """The types of `qtypes` whose `dequant` a forward runs: those whose prompts take
    float32 tiles (no `prompt_runs`; the panel types' too, while their panels compile
    after a load, `PANELS_READY`) and the embedding table's (`take`). The others only
    ever take `gemv`: a load compiles no `dequant` for them (a test or a comparison that
    dequantizes one compiles it then)."""
    tiled = {q for q in qtypes if not prompt_runs(q)}
    return tiled | ({embedding} & set(qtypes))


def panel_types(qtypes: Iterable[GGMLQuantizationType]) -> set[GGMLQuantizationType]:
    """The types of `qtypes` whose prompts take 8-bit panels on this machine, once their
    kernels are ready (`prompt_panels`)."""
    return {q for q in qtypes if _takes_panels(q)}


def warm_up(qtypes: Iterable[GGMLQuantizationType]) -> None:
    """Build and compile (or load from numba's disk cache) the `gemv` and `dequant` of
    `qtypes` and nothing else, on tiny inputs (`warm_up_gemv`, `warm_up_dequant`)."""
    warm_up_gemv(qtypes)
    warm_up_dequant(qtypes)


def warm_up_dequant(qtypes: Iterable[GGMLQuantizationType]) -> None:
    """The `dequant` of `qtypes` (the tiles, the embedding lookup)."""
    for qtype in sorted(set(qtypes), key=int):
        _tiny(qtype).dequantize()


def warm_up_panels(qtypes: Iterable[GGMLQuantizationType]) -> None:
    """The `pack_panels` and `panel_product` of `qtypes` (their prompts' panels,
    `prompt_panels`), on a tiny matrix and zeros."""
    for qtype in sorted(set(qtypes), key=int):
        w = _tiny(qtype)
        k = w.shape[1]
        groups = k // BLOCK_TYPES[qtype].activation_group
        codes, scales, offsets = (np.empty(PANEL * k // 4, np.uint32),
                                  np.empty(PANEL * groups, np.float32),
                                  np.empty(PANEL * groups, np.float32))
        w.kernels.pack_panels(w.blocks, 0, 1, codes, scales, offsets)
        acts = quantize_activations(np.zeros((ROW_BLOCK, k), np.float32),
                                    BLOCK_TYPES[qtype].activation_group)
        w.kernels.panel_product(codes, scales, offsets, k, 1, *acts,
                                np.empty((1, PANEL), np.float32), 0, 1)


def warm_up_gemv(qtypes: Iterable[GGMLQuantizationType]) -> None:
    """The `gemv` of `qtypes`, on zeros in its activations' layout: the quantizer that
    makes them is `warm_up_activations`'."""
    for qtype in sorted(set(qtypes), key=int):
        w = _tiny(qtype)
        block_type = BLOCK_TYPES[qtype]
        k = w.shape[1]
        if block_type.activation_group:
            acts = activation_arrays(1, k, block_type.activation_group,
                                     superblocks=block_type.superblocks)
            for a in acts:
                a[...] = 0
        else:
            acts = (np.zeros((1, k), np.float32),)
        w.kernels.gemv(w.blocks, *acts, np.empty((1, 1), np.float32), 0, 1)


def warm_up_activations(qtypes: Iterable[GGMLQuantizationType]) -> None:
    """The activations' quantizers (kernels/cpu_activations.py) the `gemv` of `qtypes`
    take their input from: one per layout, whatever the group."""
    for qtype in _one_per_quantizer(qtypes):
        gemv_activations(qtype, np.zeros(_tiny(qtype).shape, np.float32))


def warm_up_row_kernels(qtypes: Iterable[GGMLQuantizationType]) -> None:
    """The decode replay's C entries of `qtypes`: each one's `gemv` and quantizer as C
    functions (`row_kernel`)."""
    for qtype in sorted(set(qtypes), key=int):
        row_kernel(_tiny(qtype))


def activation_kernels(qtypes: Iterable[GGMLQuantizationType]) -> list:
    """The quantizers' numba dispatchers `warm_up_activations` compiles."""
    return [quantize_superblocks_into if BLOCK_TYPES[q].superblocks else quantize_into
            for q in _one_per_quantizer(qtypes)]


def row_kernel_functions(qtypes: Iterable[GGMLQuantizationType]) -> list:
    """The Python functions `warm_up_row_kernels` compiles as C functions (numba caches
    them on disk as it does its dispatchers)."""
    functions = []
    for qtype in sorted(set(qtypes), key=int):
        block_type = BLOCK_TYPES[qtype]
        functions.append(kernels(qtype).row_kernel)
        if block_type.activation_group:
            functions.append(quantizer_function(block_type.superblocks,
                                                block_type.activation_group))
    return functions


def _one_per_quantizer(qtypes: Iterable[GGMLQuantizationType]) -> list[GGMLQuantizationType]:
    """One of `qtypes` for each quantizer their `gemv` take (none for F16 / BF16)."""
    by_layout = {}
    for qtype in sorted(set(qtypes), key=int):
        block_type = BLOCK_TYPES[qtype]
        if block_type.activation_group:
            by_layout.setdefault(block_type.superblocks, qtype)
    return list(by_layout.values())


def _tiny(qtype: GGMLQuantizationType) -> QuantizedMatrix:
    """A one-row matrix of zeros of `qtype`, of whole activation layouts."""
    block, type_size = GGML_QUANT_SIZES[qtype]
    cols = max(block, 32)
    return QuantizedMatrix(qtype, (1, cols), np.zeros((1, cols // block * type_size), np.uint8))
