"""The matmul loops of every quantized block type, written once over a block decoder.

This module is a template: kernels/cpu_kernel_registry.py copies everything below the
`-- loops --` line into one generated module per block type, after lines binding the
names the loops use (here bound to Q8_0, so that this file imports and lints as it is):

- `decode_block(row, o, q, sc, mn)`: the type's decoder (kernels/cpu_block_decoders.py):
  the block at byte `o` of a row as codes `q[0:BLOCK]`, a scale per `SUB` values `sc`
  and, where `HAS_MIN`, a minimum per `SUB` values `mn`:
  value = sc * (q - CODE_OFFSET) + mn, codes 0..CODE_MAX (at most 127; -128..127 where
  `SIGNED_CODES`);
- `BLOCK`, `BLOCK_BYTES`: values and bytes per block; `SUB`: 16 or 32.

Why generated modules and not one kernel taking its decoder as an argument: numba compiles
a kernel once per argument type, and a jitted function's type is its dispatcher object, so
a decoder passed as an argument gives each type its own compiled kernel, as wanted, but
numba's disk cache keys such kernels on a pickle of the dispatcher that differs in every
process: every run recompiled every kernel (a closure over the decoder hits the same
wall). A generated module per type is ordinary code to numba: its kernels are cached like
any other, each type compiles only its own, and the loops exist once, here.

The kernels (one thread each; kernels/quantized.py splits output rows over the cores):

- `gemv(w, codes, scales, sums, y, r0, r1)`: y[j, r] = dot(row r of w, x[j]) for rows
  r0 .. r1 - 1 of w and every row of x, given as 8-bit codes with a scale and a sum per
  `SUB` values (kernels/cpu_activations.py). Each block is decoded once into stack
  buffers that LLVM keeps in registers and multiplied with every row of x: per 32 values
  an integer dot product of the codes with the activation codes (`dot_unsigned`:
  llama.cpp's `vpmaddubsw` + `vpmaddwd`), scaled into eight float32 lanes by the
  group's weight scale times activation scale (computed for the block's groups at once);
  the code offset and the minimum cost one multiply by each group's activation sum. One
  row of x keeps its sums in registers; more keep one vector per row in a stack buffer.
- `dequant(w, r0, out)`: rows r0 .. r0 + len(out) - 1 of w as float32 (the tiles BLAS
  multiplies for many rows of x, the embedding lookup).
- `row_kernel_address()`: `gemv` as a C function of kernels/cpu_row_kernel.py's
  `ROW_KERNEL` signature (what the decode replay calls), compiled on first use from
  `row_kernel`.
"""

from __future__ import annotations

# -- type binding: replaced in each generated module -------------------------------------------
from eagerlm.kernels.cpu_block_decoders import decode_q8_0 as decode_block

BLOCK, BLOCK_BYTES, SUB, HAS_MIN, CODE_OFFSET, SIGNED_CODES = 32, 34, 32, False, 0, True
INT_SCALES, CODE_MAX = False, 127

# -- loops: copied into each generated module --------------------------------------------------
import numpy as np  # noqa: E402
from numba import njit  # noqa: E402

from eagerlm.kernels.cpu_simd import (  # noqa: E402
    codes_f32x8,
    dot_signed,
    dot_signed_scaled,
    dot_unsigned,
    dot_unsigned_scaled,
    lane_sum,
    load_bytes,
    load_f32x8,
    load_i8_i32x8,
    load_i32x8,
    muladd,
    pair_lanes,
    scaled_add,
    stack_empty,
    store_f32x8,
    zeros_f32x8,
    zeros_i32x8,
)
from eagerlm.kernels.numba_settings import JIT_ORDERED  # noqa: E402

NSUB = BLOCK // SUB  # scale groups per block
CHUNK = max(1, 256 // BLOCK)  # blocks decoded together: 256 values
CHUNK_GROUPS = CHUNK * NSUB  # 8 or 16 scale groups: their products eight at a time
CHUNK_VALUES = CHUNK * BLOCK
HAS_OFFSET = HAS_MIN or CODE_OFFSET != 0
# the conditions the kernels branch on, as boolean constants: numba drops the untaken
# branch before typing it (a comparison it would type and compile both ways)
_HAS_CODE_OFFSET = CODE_OFFSET != 0
_SUB32 = SUB == 32
_SUB16 = SUB == 16
_ONE_BLOCK_CHUNKS = CHUNK == 1
_CODE_OFFSET = np.float32(CODE_OFFSET)
MAX_ROWS = 64  # rows of x `gemv` takes at most (its stack buffer of partial sums)
assert CHUNK_VALUES == 256  # the activations' padding (kernels/cpu_activations.PAD)
_ACC_LANES = 16 * MAX_ROWS  # two Float32x8 per row
_LINE = 16  # float32 outputs per cache line
_OUT_LANES = _LINE * MAX_ROWS


@njit(inline="always", **JIT_ORDERED)
def _keep_sums(accs, out, n, r, r0, r1, y):
    """Output r of each of the n rows of x (their two sums in `accs`) into `out`, a line
    of `_LINE` outputs per row of x, then y's line once r ends it (or the range). Stored
    one by one, the n outputs of an r are n lines a matrix's power-of-two width apart in
    y, all in one set of the L1 cache: 16 or more rows of x evicted each other's lines
    between one r and the next (8% of a 32-row run's time at 4096 outputs)."""
    t = r % _LINE
    for j in range(n):
        out[j * _LINE + t] = lane_sum(load_f32x8(accs, 16 * j)) + lane_sum(
            load_f32x8(accs, 16 * j + 8))
    if t == _LINE - 1 or r == r1 - 1:
        first = max(r0, r - t)
        for j in range(n):
            for i in range(first, r + 1):
                y[j, i] = out[j * _LINE + i % _LINE]


@njit(inline="always", **JIT_ORDERED)
def _decode_chunk(wr, b0, n_blocks, q, sc, mn):
    """Blocks b0 .. of a row, `CHUNK` of them or the row's last `n_blocks`, into q, sc,
    mn; a short chunk's missing blocks get scale and minimum 0, so they add exactly 0
    (the activations are zero-padded to whole chunks too, kernels/cpu_activations.py)."""
    if _ONE_BLOCK_CHUNKS:
        decode_block(wr, b0 * BLOCK_BYTES, q, sc, mn)
        return
    if n_blocks >= CHUNK:  # straight code: LLVM keeps q, sc, mn in registers
        for t in range(CHUNK):
            decode_block(wr, (b0 + t) * BLOCK_BYTES, q[t * BLOCK:], sc[t * NSUB:],
                         mn[t * NSUB:])
        return
    for t in range(CHUNK):
        if t < n_blocks:
            decode_block(wr, (b0 + t) * BLOCK_BYTES, q[t * BLOCK:], sc[t * NSUB:],
                         mn[t * NSUB:])
        else:
            for s in range(t * NSUB, (t + 1) * NSUB):
                sc[s] = 0.0
                mn[s] = 0.0


@njit(inline="always", **JIT_ORDERED)
def _unit(q, comb, codes, e0, u, acc):
    """acc + unit u's 32-value dot product of q with codes[e0 + 32u:], scaled by its
    groups' `comb` (scale products)."""
    if SIGNED_CODES:
        part = dot_signed(load_bytes(q, 32 * u), codes, e0 + 32 * u)
    else:
        part = dot_unsigned(load_bytes(q, 32 * u), codes, e0 + 32 * u)
    if _SUB32:
        return scaled_add(acc, part, comb[u])
    return scaled_add(acc, part, pair_lanes(comb, 2 * u))


@njit(inline="always", **JIT_ORDERED)
def _chunk_dot(q, sc, mn, comb, codes, scales, sums, c, acc, offsets):
    """Decoded chunk c times one row of x: `acc` (Float32x8) gains the chunk's scaled dot
    products (even and odd units in two sums: one chain of multiply-adds would wait on
    its own latency), `offsets` (Float32x8) the code offsets and minimums times the
    groups' activation sums, the groups' scale products eight at a time."""
    g0 = c * CHUNK_GROUPS
    for v in range(CHUNK_GROUPS // 8):
        s = load_f32x8(sc, 8 * v)
        store_f32x8(comb, 8 * v, s * load_f32x8(scales, g0 + 8 * v))
        if HAS_OFFSET:
            m = load_f32x8(mn, 8 * v) if HAS_MIN else zeros_f32x8()
            if _HAS_CODE_OFFSET:
                m = m - s * _CODE_OFFSET
            offsets = muladd(m, load_f32x8(sums, g0 + 8 * v), offsets)
    even = zeros_f32x8()
    odd = zeros_f32x8()
    e0 = c * CHUNK_VALUES
    for u in range(0, CHUNK_VALUES // 32, 2):
        even = _unit(q, comb, codes, e0, u, even)
        odd = _unit(q, comb, codes, e0, u + 1, odd)
    return acc + (even + odd), offsets


@njit(inline="always", **JIT_ORDERED)
def _scaled_unit(q, isc, codes, e0, u):
    """Unit u's 32-value dot product of q with codes[e0 + 32u:], its groups' integer
    scales applied to the products (int32 lanes)."""
    if SIGNED_CODES:
        if _SUB16:
            return dot_signed_scaled(load_bytes(q, 32 * u), codes, e0 + 32 * u, isc, 2 * u,
                                     True)
        return dot_signed_scaled(load_bytes(q, 32 * u), codes, e0 + 32 * u, isc, u, False)
    if _SUB16:
        return dot_unsigned_scaled(load_bytes(q, 32 * u), codes, e0 + 32 * u, isc, 2 * u,
                                   True)
    return dot_unsigned_scaled(load_bytes(q, 32 * u), codes, e0 + 32 * u, isc, u, False)


@njit(inline="always", **JIT_ORDERED)
def _super_dot(q, isc, imn, d, dmin, codes, scales, sums, b, acc, offsets):
    """Superblock b (decoded: codes q, integer sub-scales isc and mins imn, float scales d,
    dmin) times one row of x (codes, a scale per 256 values, integer sums per group):
    the eight units' scaled dot products summed as integers, less the code offset times
    the integer dot product of the sub-scales with the groups' activation sums (the same
    scale: at most ~8e8 in a lane, within int32), then one multiply-add by d x the
    activations' scale into `acc`; the mins (under dmin) as the integer dot product of
    the mins with the sums, into `offsets`."""
    total = zeros_i32x8()
    e0 = b * BLOCK
    for u in range(BLOCK // 32):
        total = total + _scaled_unit(q, isc, codes, e0, u)
    g0 = b * NSUB
    if _HAS_CODE_OFFSET:  # under the same scale d x xs: subtracted as integers
        for v in range(NSUB // 8):
            t = load_i8_i32x8(isc, 8 * v) * load_i32x8(sums, g0 + 8 * v)
            total = total - t * CODE_OFFSET
    xs = scales[b]
    acc = scaled_add(acc, total, d * xs)
    if HAS_MIN:
        for v in range(NSUB // 8):
            m = load_i8_i32x8(imn, 8 * v) * load_i32x8(sums, g0 + 8 * v)
            offsets = scaled_add(offsets, m, -dmin * xs)
    return acc, offsets


if INT_SCALES:  # the superblock types (kernels/cpu_activations.quantize_superblocks)
    @njit(**JIT_ORDERED)
    def gemv(w, codes, scales, sums, y, r0, r1):
        n = codes.shape[0]
        n_blocks = w.shape[1] // BLOCK_BYTES
        q = stack_empty(BLOCK, np.int8)
        isc = stack_empty(32, np.int8)
        imn = stack_empty(32, np.int8)
        if n == 1:
            c0, s0, m0 = codes[0], scales[0], sums[0]
            for r in range(r0, r1):
                wr = w[r]
                acc = zeros_f32x8()
                offsets = zeros_f32x8()
                for b in range(n_blocks):
                    d, dmin = decode_block(wr, b * BLOCK_BYTES, q, isc, imn)
                    acc, offsets = _super_dot(q, isc, imn, d, dmin, c0, s0, m0, b, acc,
                                              offsets)
                y[0, r] = lane_sum(acc) + lane_sum(offsets)
            return
        accs = stack_empty(_ACC_LANES, np.float32)
        out = stack_empty(_OUT_LANES, np.float32)
        for r in range(r0, r1):
            wr = w[r]
            for j in range(2 * n):
                store_f32x8(accs, 8 * j, zeros_f32x8())
            for b in range(n_blocks):
                d, dmin = decode_block(wr, b * BLOCK_BYTES, q, isc, imn)
                for j in range(n):
                    acc, offsets = _super_dot(q, isc, imn, d, dmin, codes[j], scales[j],
                                              sums[j], b, load_f32x8(accs, 16 * j),
                                              load_f32x8(accs, 16 * j + 8))
                    store_f32x8(accs, 16 * j, acc)
                    store_f32x8(accs, 16 * j + 8, offsets)
            _keep_sums(accs, out, n, r, r0, r1, y)

    @njit(**JIT_ORDERED)
    def dequant(w, r0, out):
        n_blocks = out.shape[1] // BLOCK
        q = stack_empty(BLOCK, np.int8)
        isc = stack_empty(32, np.int8)
        imn = stack_empty(32, np.int8)
        for t in range(out.shape[0]):
            wr, orow = w[r0 + t], out[t]
            for b in range(n_blocks):
                d, dmin = decode_block(wr, b * BLOCK_BYTES, q, isc, imn)
                for s in range(NSUB):
                    scale = d * np.float32(isc[s])
                    low = -dmin * np.float32(imn[s])
                    for i in range(0, SUB, 8):
                        value = (codes_f32x8(q, s * SUB + i) - _CODE_OFFSET) * scale
                        if HAS_MIN:
                            value = value + low
                        store_f32x8(orow, b * BLOCK + s * SUB + i, value)
else:  # per-group float scales
    @njit(**JIT_ORDERED)
    def gemv(w, codes, scales, sums, y, r0, r1):
        n = codes.shape[0]
        n_blocks = w.shape[1] // BLOCK_BYTES
        n_chunks = -(-n_blocks // CHUNK)
        q = stack_empty(CHUNK_VALUES, np.int8)
        sc = stack_empty(CHUNK_GROUPS, np.float32)
        mn = stack_empty(CHUNK_GROUPS, np.float32)
        comb = stack_empty(CHUNK_GROUPS, np.float32)
        if n == 1:
            c0, s0, m0 = codes[0], scales[0], sums[0]
            for r in range(r0, r1):
                wr = w[r]
                acc = zeros_f32x8()
                offsets = zeros_f32x8()
                for c in range(n_chunks):
                    _decode_chunk(wr, c * CHUNK, n_blocks - c * CHUNK, q, sc, mn)
                    acc, offsets = _chunk_dot(q, sc, mn, comb, c0, s0, m0, c, acc, offsets)
                y[0, r] = lane_sum(acc) + lane_sum(offsets)
            return
        accs = stack_empty(_ACC_LANES, np.float32)
        out = stack_empty(_OUT_LANES, np.float32)
        for r in range(r0, r1):
            wr = w[r]
            for j in range(2 * n):
                store_f32x8(accs, 8 * j, zeros_f32x8())
            for c in range(n_chunks):
                _decode_chunk(wr, c * CHUNK, n_blocks - c * CHUNK, q, sc, mn)
                for j in range(n):
                    acc, offsets = _chunk_dot(q, sc, mn, comb, codes[j], scales[j], sums[j], c,
                                              load_f32x8(accs, 16 * j),
                                              load_f32x8(accs, 16 * j + 8))
                    store_f32x8(accs, 16 * j, acc)
                    store_f32x8(accs, 16 * j + 8, offsets)
            _keep_sums(accs, out, n, r, r0, r1, y)


    @njit(**JIT_ORDERED)
    def dequant(w, r0, out):
        n_blocks = out.shape[1] // BLOCK
        q = stack_empty(BLOCK, np.int8)
        sc = stack_empty(NSUB, np.float32)
        mn = stack_empty(NSUB, np.float32)
        for t in range(out.shape[0]):
            wr, orow = w[r0 + t], out[t]
            for b in range(n_blocks):
                decode_block(wr, b * BLOCK_BYTES, q, sc, mn)
                for s in range(NSUB):
                    scale = sc[s]
                    for i in range(0, SUB, 8):
                        value = (codes_f32x8(q, s * SUB + i) - _CODE_OFFSET) * scale
                        if HAS_MIN:
                            value = value + mn[s]
                        store_f32x8(orow, b * BLOCK + s * SUB + i, value)


# -- panels: the prompts' 8-bit weight tiles (kernels/cpu_panel_gemm.py) -----------------------
from eagerlm.kernels.cpu_panel_gemm import (  # noqa: E402
    PANEL,
    ROW_BLOCK,
    X_CHUNK_BYTES,
    group_mac,
    int16_steps,
    store_accs,
    store_panel_words,
    zero_accs,
)

_FLIP = 0x80808080 if SIGNED_CODES else 0  # signed codes as unsigned bytes: + 128
_CODE_SHIFT = np.float32(CODE_OFFSET + (128 if SIGNED_CODES else 0))
_WORDS = BLOCK // 4  # 4-code words per block
_PANEL_CODES = PANEL * BLOCK  # a block of a panel's rows, decoded
_PANEL_GROUPS = PANEL * NSUB
_STEPS = SUB // 4  # 4-code words per group
# the panels' codes reach 255 for the signed types (plus 128), CODE_MAX otherwise
_INT16_STEPS = int16_steps(255 if SIGNED_CODES else CODE_MAX, _STEPS)
_ACCS = 2 * ROW_BLOCK


@njit(**JIT_ORDERED)
def pack_panels(w, r0, r1, codes, scales, offsets):
    """Rows r0 .. r1 - 1 of w as panels of `PANEL` rows (kernels/cpu_panel_gemm.py's
    layout): the codes unsigned (the signed types' plus 128) into `codes` (uint32 words),
    per group of `SUB` values the scale and the offset (minimum - scale * (code offset
    (+ 128))) into `scales` and `offsets`; the last panel's rows past r1 with scales and
    offsets 0. A block of the panel's rows is decoded into stack buffers, then transposed
    out 16 rows by 8 words at a time (`store_panel_words`): the stores run through the
    panel in order (one row's words, a panel's width apart, touched a cache line each)."""
    row_bytes = w.shape[1]
    n_blocks = row_bytes // BLOCK_BYTES
    words = n_blocks * _WORDS
    groups = n_blocks * NSUB
    flat = w.reshape(-1)  # a block at a byte offset: no view of a row per block
    q = stack_empty(_PANEL_CODES, np.int8)
    sc = stack_empty(_PANEL_GROUPS, np.float32)
    mn = stack_empty(_PANEL_GROUPS, np.float32)
    isc = stack_empty(32, np.int8)
    imn = stack_empty(32, np.int8)
    for p in range(-(-(r1 - r0) // PANEL)):
        rows = min(PANEL, r1 - r0 - p * PANEL)
        for b in range(n_blocks):
            for t in range(PANEL):
                if t >= rows:
                    for s in range(NSUB):
                        sc[t * NSUB + s] = 0.0
                        mn[t * NSUB + s] = 0.0
                    continue
                o = (r0 + p * PANEL + t) * row_bytes + b * BLOCK_BYTES
                if INT_SCALES:
                    d, dmin = decode_block(flat, o, q[t * BLOCK:], isc, imn)
                    for s in range(NSUB):
                        sc[t * NSUB + s] = d * np.float32(isc[s])
                        mn[t * NSUB + s] = -dmin * np.float32(imn[s]) if HAS_MIN \
                            else np.float32(0.0)
                else:
                    decode_block(flat, o, q[t * BLOCK:], sc[t * NSUB:], mn[t * NSUB:])
                    if not HAS_MIN:
                        for s in range(NSUB):
                            mn[t * NSUB + s] = 0.0
            at = (p * words + b * _WORDS) * PANEL
            for h in range(2):
                for c in range(BLOCK // 32):
                    store_panel_words(q, 16 * h * BLOCK + 32 * c, BLOCK, codes,
                                      at + 8 * c * PANEL + 16 * h, _FLIP)
            at = (p * groups + b * NSUB) * PANEL
            for s in range(NSUB):
                for t in range(PANEL):
                    scale = sc[t * NSUB + s]
                    scales[at + s * PANEL + t] = scale
                    offsets[at + s * PANEL + t] = mn[t * NSUB + s] - scale * _CODE_SHIFT


@njit(**JIT_ORDERED)
def panel_product(codes, scales, offsets, k, n_panels, xq, xd, xs, y, col0, n_cols):
    """y[j, col0 + c] = dot(row c of the tile, row j of x) for the tile's n_cols rows (in
    `n_panels` panels of rows of k values, `pack_panels`' layout) and every row of y; x
    as `quantize_activations`' codes xq, scales xd and sums xs per `SUB` values, with rows
    up to a multiple of `ROW_BLOCK` (zeros past y's). Rows of x in chunks that stay in
    the core's L2 while the tile's panels pass (`X_CHUNK_BYTES`)."""
    n_x, padded = xq.shape
    n_y, width = y.shape
    groups_x = xd.shape[1]
    groups = k // SUB
    chunk = max(ROW_BLOCK, X_CHUNK_BYTES // padded // ROW_BLOCK * ROW_BLOCK)
    xq_flat, xd_flat, xs_flat = xq.reshape(-1), xd.reshape(-1), xs.reshape(-1)
    y_flat = y.reshape(-1)
    tail = np.empty(ROW_BLOCK * PANEL, np.float32)
    for first in range(0, n_x, chunk):
        for p in range(n_panels):
            c_base = p * PANEL * (k // 4)
            s_base = p * PANEL * groups
            cols = min(PANEL, n_cols - p * PANEL)
            for j in range(first, min(n_x, first + chunk), ROW_BLOCK):
                accs = zero_accs(_ACCS)
                for g in range(groups):
                    accs = group_mac(accs, ROW_BLOCK, _STEPS, _INT16_STEPS, codes,
                                     c_base + _STEPS * g * PANEL, xq_flat, j * padded + SUB * g,
                                     padded, scales, offsets, s_base + g * PANEL, xd_flat,
                                     xs_flat, j * groups_x + g, groups_x)
                column = col0 + p * PANEL
                if cols == PANEL and j + ROW_BLOCK <= n_y:
                    store_accs(accs, ROW_BLOCK, y_flat, j * width + column, width)
                else:
                    store_accs(accs, ROW_BLOCK, tail, 0, PANEL)
                    for i in range(min(ROW_BLOCK, n_y - j)):
                        for c in range(cols):
                            y[j + i, column + c] = tail[i * PANEL + c]


# -- the row kernel: `gemv` behind kernels/cpu_row_kernel.py's C signature ----------------------
import functools  # noqa: E402

from numba import carray, cfunc  # noqa: E402

from eagerlm.kernels.cpu_row_kernel import ROW_KERNEL, f32_at, i8_at, i32_at, u8_at  # noqa: E402

_SCALE_GROUP = 256 if INT_SCALES else SUB  # activation values per scale
_sums_at = i32_at if INT_SCALES else f32_at  # the superblock types' sums are integers


def row_kernel(w, x, scales, sums, y, n, k, rows, row_bytes, r0, r1):  # pragma: no cover
    padded = -(-k // CHUNK_VALUES) * CHUNK_VALUES
    gemv(carray(u8_at(w), (rows, row_bytes)), carray(i8_at(x), (n, padded)),
         carray(f32_at(scales), (n, padded // _SCALE_GROUP)),
         carray(_sums_at(sums), (n, padded // SUB)), carray(f32_at(y), (n, rows)), r0, r1)


@functools.cache
def row_kernel_address() -> int:
    return cfunc(ROW_KERNEL, **JIT_ORDERED)(row_kernel).address
