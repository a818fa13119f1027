"""A batch of decode rows' whole forward in one compiled call: the cpu backend's replay.

Run op by op, a decode step of a 24-layer model is ~400 calls from Python into compiled
code (norms, seven products, two ropes, a KV append, an attention and an activation per
layer, each product a hand-off to the other cores' threads), and on two cores that cost is
of the order of the products themselves once they read at the memory's speed. So the first
forward of a batch of n decode rows (every session one new row, every row's logits
wanted) is recorded instead of run: `Transformer.run` goes through the ops once with
`RecordingOps`, whose methods append a step to a table (the op, where in one float32
arena its inputs and output lie, which weights) instead of computing. Every later batch of
n decode rows runs the table in one call of `_run` on each core's thread
(kernels/cpu_threads.py's workers: one hand-off per forward), every thread walking the
steps together; a step is cut into chunks (row ranges of a product, (row, KV head) items
of the attention, rows of a norm) that the threads claim from an atomic counter, and a
thread that finds none left waits for the step's done counter before the next step,
unless the next step reads nothing the steps since the last wait write (Q, K and V's
products of one input; the two ropes): then it goes straight on (`GO_ON`). A
thread that never gets a core therefore only leaves its share to the others (it cannot
hold a step back, as a fixed split of the work would), and one thread alone runs the
whole table.

What is recorded is the one forward of kernels/model.py, against the one `Ops` protocol,
and each step calls the kernel the ops call (kernels/cpu_row_ops.py's norms and rope,
kernels/cpu_attention.py's attention items, each weight type's `gemv` through its row
kernel, the gated activation; float32 products by F32's row kernel, which the ops also
call up to `FIXED_ORDER_ROWS` rows and for a float32 router in any batch), so the replay
gives the ops' logits (tests/test_cpu_decode_program.py: bit for bit for the mixtures of
experts, within float32 rounding for the rest, whose softcap, for one, is numpy's tanh
in the ops). A row's replayed forward is therefore the same bits as the ops give it in
any batch wherever the ops' are (docs/architecture.md, "Batch invariance"). A forward the table
cannot express is not recorded and runs op by op as before: a matrix without a row
kernel, or more rows than its kernel takes; float32 experts, or a mixture's shared
expert; a batch with prompt rows, or logits wanted for some rows only (but where at
least half are: `NumpyOps.replay` takes every row's, then those). A device of a
tensor-parallel group records its share of the forward the same way, each all-reduce a
REDUCE step (kernels/host_collective.py's `exchange_sum` on the rows in the arena: the
devices meet in compiled code, the table never returning to Python for it); a split lm
head's logits are gathered after the last step.

A mixture of experts (quantized experts, read in place from the file's map) is six
steps: a GEMV of the router, ROUTE (kernels/cpu_moe.py's `route_row` of a row's logits,
the ids written into the arena as floats), EXPERT for the gate and up products (a chunk
is a row, one of its k slots and a range of output rows; the expert's blocks are found from
the id ROUTE wrote, so the table holds every expert's address at once and reads only the
chosen ones), the activation over the n * k pairs, EXPERT for the down products (one
input per pair), and COMBINE (`combine_row`); the router's and each expert's biases
(gpt-oss) are added as the ops add them, and ATTN takes a layer's attention sinks. The
ops call the same kernels on the same rows, so a replayed row is the ops' bits. Op by
op, a mixture's layer was ~20 calls from Python and three hand-offs to the cores per
decode step.

Products call a row kernel through its address (kernels/cpu_row_kernel.py: one C
signature for every weight type, so the table is one compiled function and a type's
kernel is compiled, and cached, with its type); a kernel of 8-bit activations has its
input quantized once by a QUANT step (through its quantizer's address too).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numba
import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from eagerlm.kernels import cpu_row_ops as row_ops
from eagerlm.kernels.aligned_arrays import CACHE_LINE, aligned_empty
from eagerlm.kernels.batch import ForwardBatch
from eagerlm.kernels.cpu_attention import DecodeRows, _attend_rows
from eagerlm.kernels.cpu_moe import GATING_CODES, ExpertMatrices, combine_row, route_row
from eagerlm.kernels.cpu_row_kernel import RowKernel, f32_at, i64_at, row_kernel
from eagerlm.kernels.cpu_sync import SCHED_YIELD, atomic_add, spin_until
from eagerlm.kernels.cpu_threads import SERIAL_MAX_VALUES, core_workers
from eagerlm.kernels.host_collective import Exchange, HostCollective, exchange_sum
from eagerlm.kernels.numba_settings import JIT as _JIT
from eagerlm.loader.config import Activation, RopeStyle

# fastmath without the no-NaN / no-inf promises, as kernels/cpu_row_ops.py
_JIT = {**_JIT, "fastmath": {"reassoc", "contract", "nsz", "arcp"}}

# -- the call through an address ---------------------------------------------------------

def _call_codegen(n_args: int) -> Any:
    """A call of the C function at the first argument's address (void, `n_args` int64
    arguments: cpu_row_kernel's signatures) with the others."""
    def codegen(context, builder, signature, values):
        fnty = ir.FunctionType(ir.VoidType(), [ir.IntType(64)] * n_args)
        builder.call(builder.inttoptr(values[0], fnty.as_pointer()), list(values[1:]))
        return context.get_dummy_value()
    return codegen


@intrinsic
def _call_row_kernel(typingctx, fn, w, x, scales, sums, y, n, k, rows, row_bytes, r0, r1):
    return types.void(*([types.int64] * 12)), _call_codegen(11)


@intrinsic
def _call_quantize(typingctx, fn, x, codes, scales, sums, n, k):
    return types.void(*([types.int64] * 7)), _call_codegen(6)


# -- the steps -------------------------------------------------------------------------

NORM, ADD_NORM, GEMV, ROPE, APPEND, ATTN, ACT, SOFTCAP, QUANT, ROUTE, EXPERT, COMBINE, \
    REDUCE = range(1, 14)
WIDTH = 24  # int64 fields per step; the last is the step's chunk count
GO_ON = WIDTH - 2  # the field saying the next step may start before this one ends
# the KV caches, as an arena range: what APPEND writes and ATTN reads
_CACHES = (-2, -1)
ROW_CHUNKS_PER_THREAD = 8  # a product's rows in this many chunks per thread
_LINE_FLOATS = CACHE_LINE // 4  # every arena buffer starts on a cache line


@njit(**_JIT)
def _floats(address: int, n: int) -> np.ndarray:
    return numba.carray(f32_at(address), (n,))


@njit(**_JIT)
def _rows(address: int, n: int, d: int) -> np.ndarray:
    return numba.carray(f32_at(address), (n, d))


@njit(**_JIT)
def _step_chunk(st: np.ndarray, fp: np.ndarray, base: int, rows: np.ndarray,
                bases: np.ndarray, positions: np.ndarray, token_stride: int, c: int,
                sched_yield: int) -> None:
    """Chunk c of step `st` (its floats `fp`), the arena at address `base`: every operand
    is rows at an address (arena offsets are in floats)."""
    op = st[0]
    if op == GEMV:
        n, k, n_rows, chunk = st[2], st[3], st[6], st[10]
        r0 = c * chunk
        r1 = min(n_rows, r0 + chunk)
        scales = base + 4 * st[11] if st[13] else 0
        sums = base + 4 * st[12] if st[13] else 0
        _call_row_kernel(st[5], st[4], base + 4 * st[1], scales, sums, base + 4 * st[8], n,
                         k, n_rows, st[7], r0, r1)
        if st[9]:
            bias = _floats(st[9], n_rows)
            for j in range(n):
                y = _floats(base + 4 * (st[8] + j * n_rows), n_rows)
                for r in range(r0, r1):
                    y[r] += bias[r]
    elif op == NORM:  # row c: `sub` rows of d values (a row's heads, for QK-norm)
        sub, d = st[4], st[5]
        row_ops.rms_norm(_rows(base + 4 * (st[1] + c * st[2]), sub, d), _floats(st[6], d),
                         fp[0], _rows(base + 4 * (st[7] + c * st[8]), sub, d))
    elif op == ADD_NORM:
        d = st[6]
        row_ops.add_rms_norm(_rows(base + 4 * (st[1] + c * st[2]), 1, d),
                             _rows(base + 4 * (st[3] + c * st[4]), 1, d), _floats(st[7], d),
                             fp[0], _rows(base + 4 * (st[8] + c * d), 1, d),
                             _rows(base + 4 * (st[9] + c * d), 1, d))
    elif op == ROPE:
        heads, hd, half = st[4], st[5], st[8] // 2
        x = numba.carray(f32_at(base + 4 * (st[1] + c * st[2])), (1, heads, hd))
        out = numba.carray(f32_at(base + 4 * (st[10] + c * heads * hd)), (1, heads, hd))
        row_ops.rope(x, _rows(base + 4 * (st[6] + c * half), 1, half),
                     _rows(base + 4 * (st[7] + c * half), 1, half), st[8], st[9] != 0, out)
    elif op == APPEND:  # row c's K and V into its session's cache at its position
        kv_dim = st[6]
        at = positions[c] * token_stride + st[7]
        cache = _floats(bases[c], at + 2 * kv_dim)
        k = _floats(base + 4 * (st[1] + c * st[2]), kv_dim)
        v = _floats(base + 4 * (st[3] + c * st[4]), kv_dim)
        for d in range(kv_dim):
            cache[at + d] = k[d]
            cache[at + kv_dim + d] = v[d]
    elif op == ATTN:  # item c (a row and a KV head) of kernels/cpu_attention's kernel
        n, heads, hd = st[2], st[3], st[4]
        q = numba.carray(f32_at(base + 4 * st[1]), (n, heads, hd))
        out = numba.carray(f32_at(base + 4 * st[5]), (n, heads, hd))
        # (the sinks' flag a run-time bool, so the kernel's compiled overload is the ops'
        # own, not one more for a literal)
        sinks = _floats(st[10], heads) if st[9] else _floats(base, 1)
        _attend_rows(q, out, rows, bases, positions, st[6], token_stride, st[7], fp[0], st[8],
                     sinks, st[9] != 0, c, st[WIDTH - 1])
    elif op == ACT:  # st[8]: cpu_row_ops.gated_kind's code
        width = st[6]
        gate = _rows(base + 4 * (st[1] + c * st[2]), 1, width)
        up = _rows(base + 4 * (st[3] + c * st[4]), 1, width)
        out = _rows(base + 4 * (st[7] + c * width), 1, width)
        if st[8] == row_ops.SILU_OAI:
            row_ops.gated_oai(gate, up, out)
        else:
            row_ops.gated(gate, up, st[8] == row_ops.GELU, out)
    elif op == ROUTE:  # row c's experts and weights, from its router logits
        n_experts, k = st[2], st[6]
        route_row(_floats(base + 4 * (st[1] + c * n_experts), n_experts), st[5], k,
                  st[7] != 0, fp[0], _floats(base + 4 * (st[3] + c * k), k),
                  _floats(base + 4 * (st[4] + c * k), k))
    elif op == EXPERT:  # a row's product by one of its chosen experts, a range of its rows
        n_used, rows, chunk = st[13], st[7], st[10]
        per_pair = -(-rows // chunk)
        pair = c // per_pair
        r0 = (c - pair * per_pair) * chunk
        r1 = min(rows, r0 + chunk)
        e = np.int64(_floats(base + 4 * (st[12] + pair), 1)[0])
        x_row = pair if st[14] else pair // n_used  # the down products: one input per pair
        _call_row_kernel(st[6], st[5] + e * st[11], base + 4 * (st[1] + x_row * st[2]),
                         base + 4 * (st[15] + x_row * st[16]) if st[19] else 0,
                         base + 4 * (st[17] + x_row * st[18]) if st[19] else 0,
                         base + 4 * (st[9] + pair * rows), 1, st[3], rows, st[8], r0, r1)
        if st[20]:  # the expert's bias `[n_experts, rows]`, as the ops add it
            y = _floats(base + 4 * (st[9] + pair * rows), rows)
            bias = _floats(st[20] + 4 * e * rows, rows)
            for r in range(r0, r1):
                y[r] += bias[r]
    elif op == COMBINE:  # row c: its experts' outputs weighted and summed
        k, d = st[3], st[4]
        combine_row(_rows(base + 4 * (st[1] + c * k * d), k, d),
                    _floats(base + 4 * (st[2] + c * k), k), _floats(base + 4 * (st[5] + c * d), d))
    elif op == SOFTCAP:  # in place
        x = _floats(base + 4 * (st[1] + c * st[3]), st[3])
        cap = np.float32(fp[0])
        for j in range(st[3]):
            x[j] = np.tanh(x[j] / cap) * cap
    elif op == REDUCE:  # x summed over the tensor-parallel group, in place
        size, capacity = st[6], st[7]
        exchange_sum(_floats(st[3], 2 * size * capacity), numba.carray(i64_at(st[4]), (st[8],)),
                     st[5], size, capacity, _floats(base + 4 * st[1], st[2]), sched_yield)
    else:  # QUANT: row c of x `[n, k]` as 8-bit codes, scales and sums (one row of each)
        k, padded = st[3], st[8]
        _call_quantize(st[7], base + 4 * (st[1] + c * k), base + 4 * st[4] + c * padded,
                       base + 4 * (st[5] + c * st[9]), base + 4 * (st[6] + c * st[10]), 1, k)


@njit(**_JIT)
def _run(steps: np.ndarray, fparams: np.ndarray, f32: np.ndarray, rows: np.ndarray,
         bases: np.ndarray, positions: np.ndarray, token_stride: int, counters: np.ndarray,
         sched_yield: int) -> None:
    """Every step in order, on one of the threads that run the table together (each
    calls this once, the GIL released): the chunks of a step it claims (counters: a claim
    and a done count per step, zero at the start), then, unless the step lets the next
    one start at once (`GO_ON`), a wait until all steps so far are done
    (kernels/cpu_sync.py's `spin_until`: `sched_yield` is the C library's, at that
    address)."""
    base = np.int64(f32.ctypes.data)
    first_open = 0  # the first step not known to be done
    for s in range(steps.shape[0]):
        st = steps[s]
        total = st[WIDTH - 1]
        while True:
            c = atomic_add(counters, 2 * s, 1)
            if c >= total:
                break
            _step_chunk(st, fparams[s], base, rows, bases, positions, token_stride, c,
                        sched_yield)
            atomic_add(counters, 2 * s + 1, 1)
        if st[GO_ON]:  # the next step reads nothing this one writes (and vice versa)
            continue
        for t in range(first_open, s + 1):
            spin_until(counters, 2 * t + 1, steps[t, WIDTH - 1], -1, sched_yield)
        first_open = s + 1


# -- recording ----------------------------------------------------------------------------


class Unsupported(Exception):
    """The forward does something the table cannot express: run it op by op."""


@dataclass(frozen=True)
class Buf:
    """Rows `[n, width]` of the arena, `stride` floats apart, from float `off`; `heads`:
    each row seen as that many heads (`reshape`)."""

    off: int
    n: int
    width: int
    stride: int
    heads: int = 1

    def reshape(self, *shape: int) -> Buf:
        """The rows `[n, heads, head_dim]` (or back to `[n, width]`): a view."""
        if shape[0] != self.n or int(np.prod(shape[1:])) != self.width:
            raise Unsupported(f"a reshape of {self.shape} to {shape}")
        return Buf(self.off, self.n, self.width, self.stride,
                   shape[1] if len(shape) == 3 else 1)

    @property
    def shape(self) -> tuple[int, ...]:
        if self.heads > 1:
            return (self.n, self.heads, self.width // self.heads)
        return (self.n, self.width)

    def __len__(self) -> int:
        return self.n


@dataclass
class DecodeProgram:
    """The recorded steps of one forward of n decode rows, and what they point into."""

    n: int
    steps: list[list[int]] = field(default_factory=list)
    fparams: list[list[float]] = field(default_factory=list)
    arena: int = 0  # floats
    pad: int = 1  # floats past the last buffer
    keep: list[Any] = field(default_factory=list)  # arrays whose addresses the steps hold
    embed: tuple[Any, float] | None = None  # the table and scale of the input rows
    x_in: Buf | None = None
    # a rope setting (and its frequency factors' id) -> the setting, the factors and where
    # its cos and sin `[n, dim / 2]` go in the arena, filled at each run
    ropes: dict[tuple[Any, int], tuple[Any, Any, int, int]] = field(default_factory=dict)
    logits: Buf | None = None
    layout: tuple[int, int] = (0, 0)  # (n_layers, kv_dim) of the caches it was recorded on
    values: int = 0  # multiply-adds of the products, per row
    # a tensor-parallel device's group exchange (its REDUCE steps'), and whether the
    # logits are its share of the vocabulary, gathered at the end
    exchange: Exchange | None = None
    gather: bool = False
    # the arena ranges the steps since the last wait read and write (`add`)
    _read: list[tuple[int, int]] = field(default_factory=list)
    _written: list[tuple[int, int]] = field(default_factory=list)

    def alloc(self, n: int, width: int) -> Buf:
        """Rows `[n, width]`, starting on a cache line of the (aligned) arena."""
        buf = Buf(self.arena, n, width, width)
        self.arena += -(-n * width // _LINE_FLOATS) * _LINE_FLOATS
        self.pad = max(self.pad, width)
        return buf

    def address(self, array: np.ndarray | None) -> int:
        if array is None:
            return 0
        array = np.ascontiguousarray(array, np.float32)
        self.keep.append(array)
        return int(array.ctypes.data)

    def add(self, fields: Sequence[int], chunks: int, floats: Sequence[float] = (), *,
            reads: Sequence[Any] = (), writes: Sequence[Any] = ()) -> None:
        """A step, which reads and writes the arena ranges (or `Buf`s) given: where it
        touches nothing that the steps since the last wait write (nor writes what they
        read), the step before it lets it start at once (`GO_ON`)."""
        row = [int(v) for v in fields]
        assert len(row) <= GO_ON
        rd, wr = [_span(r) for r in reads], [_span(w) for w in writes]
        if self.steps and not any(_overlap(a, b) for a in rd + wr for b in self._written) \
                and not any(_overlap(a, b) for a in wr for b in self._read):
            self.steps[-1][GO_ON] = 1
        else:
            self._read, self._written = [], []
        self._read += rd
        self._written += wr
        self.steps.append(row + [0] * (WIDTH - 1 - len(row)) + [int(chunks)])
        self.fparams.append([float(v) for v in floats] + [0.0] * (2 - len(floats)))

    def finish(self) -> None:
        if self.steps:
            self.steps[-1][GO_ON] = 0  # every step done before a call returns
        self._steps = np.array(self.steps, np.int64).reshape(-1, WIDTH)
        self._fparams = np.array(self.fparams, np.float64).reshape(-1, 2)

    def run(self, ops: Any, batch: ForwardBatch, decode: DecodeRows) -> np.ndarray:
        """The logits `[n, vocab]` of `batch` (n decode rows, the recorded shape). The
        arena is the call's own (every step writes its output before a later one reads
        it), so two forwards may run the same program at once."""
        f32 = aligned_empty(self.arena + self.pad, np.float32)
        assert self.embed is not None and self.x_in is not None and self.logits is not None
        table, scale = self.embed
        x = ops.embed(table, batch.tokens, scale)
        f32[self.x_in.off:self.x_in.off + x.size] = x.reshape(-1)
        for rope, factors, cos_at, sin_at in self.ropes.values():
            cos, sin = ops._rope_table(batch.positions, rope, factors)
            f32[cos_at:cos_at + cos.size] = cos.reshape(-1)
            f32[sin_at:sin_at + sin.size] = sin.reshape(-1)
        counters = np.zeros(2 * len(self._steps), np.int64)
        args = (self._steps, self._fparams, f32, decode.rows, decode.bases, decode.positions,
                decode.token_stride, counters, SCHED_YIELD)
        if self.values * self.n < SERIAL_MAX_VALUES:
            _run(*args)
        else:
            core_workers().run(lambda i, parts: _run(*args))
        if self.exchange is not None and self.exchange.aborted:
            raise threading.BrokenBarrierError  # a device of the group failed
        out = self.logits
        logits = f32[out.off:out.off + out.n * out.stride].reshape(out.n, out.stride)[
            :, :out.width].copy()
        return ops.all_gather(logits) if self.gather else logits


_NO_BUF = Buf(0, 1, 0, 0)  # a product's scales and sums where its x is float32


def _span(b: Any) -> tuple[int, int]:
    """A `Buf`'s arena range [start, end), or a range itself."""
    if isinstance(b, Buf):
        return (b.off, b.off + (b.n - 1) * b.stride + b.width)
    return b


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] < b[1] and b[0] < a[1]


def _contiguous(x: Buf, what: str) -> None:
    if x.stride != x.width:
        raise Unsupported(f"{what} of a strided input")


class RecordingOps:
    """The forward's ops (kernels/model.py's `Ops`), recording a `DecodeProgram` instead
    of computing (see the module docstring)."""

    def __init__(self, program: DecodeProgram, decode: DecodeRows, threads: int,
                 collective: HostCollective | None = None) -> None:
        self.p = program
        self._decode = decode
        self._threads = threads
        self._collective = collective  # recording a device of a tensor-parallel group
        self._codes: dict[tuple[int, int], list[Buf]] = {}  # `_quantized`

    def embed(self, table: Any, ids: Any, scale: float) -> Buf:
        p = self.p
        p.embed = (table, scale)
        p.x_in = p.alloc(p.n, table.shape[1])
        return p.x_in

    def rms_norm(self, x: Buf, w: np.ndarray, eps: float) -> Buf:
        d = len(w)
        if x.width % d or (d != x.width and x.stride != x.width):
            raise Unsupported("a norm over anything but rows or their heads")
        out = self.p.alloc(x.n, x.width)
        self.p.add([NORM, x.off, x.stride, x.n, x.width // d, d, self.p.address(w), out.off,
                    out.stride], x.n, [eps], reads=[x], writes=[out])
        return out.reshape(*x.shape)

    def add_rms_norm(self, residual: Buf, x: Buf, w: np.ndarray, eps: float
                     ) -> tuple[Buf, Buf]:
        h, out = self.p.alloc(x.n, x.width), self.p.alloc(x.n, x.width)
        self.p.add([ADD_NORM, residual.off, residual.stride, x.off, x.stride, x.n, x.width,
                    self.p.address(w), h.off, out.off], x.n, [eps],
                   reads=[residual, x], writes=[h, out])
        return h, out

    def linear(self, x: Buf, w: Any, bias: np.ndarray | None = None) -> Buf:
        kernel = row_kernel(w)
        if kernel is None:
            raise Unsupported(f"no row kernel for {type(w).__name__}")
        if x.n > kernel.max_rows:
            raise Unsupported(f"{x.n} rows, more than its row kernel takes")
        _contiguous(x, "a product")
        if x.width != w.shape[1]:
            raise Unsupported("a product of mismatched shapes")
        rows = w.shape[0]
        y = self.p.alloc(x.n, rows)
        data = w if isinstance(w, np.ndarray) else w.blocks
        self.p.keep.append(data)
        chunk = self._chunk(rows)
        inputs = self._inputs(x, kernel)
        x_at, scales, sums = (inputs + [_NO_BUF] * 2)[:3]
        self.p.add([GEMV, x_at.off, x.n, x.width, data.ctypes.data, kernel.address, rows,
                    data.strides[0], y.off, self.p.address(bias), chunk, scales.off,
                    sums.off, int(kernel.quantize != 0)], -(-rows // chunk),
                   reads=inputs, writes=[y])
        self.p.values += rows * x.width
        return y

    def _chunk(self, rows: int) -> int:
        """Output rows a chunk of a product takes."""
        return max(16, -(-rows // (ROW_CHUNKS_PER_THREAD * self._threads)))

    def _inputs(self, x: Buf, kernel: RowKernel) -> list[Buf]:
        """What a product by `kernel` reads of x: x, or its 8-bit codes, scales and sums."""
        return self._quantized(x, kernel) if kernel.quantize else [x]

    def _quantized(self, x: Buf, kernel: RowKernel) -> list[Buf]:
        """x's 8-bit codes, scales and sums for `kernel` (in the arena), made by a QUANT
        step the first time a product asks for them."""
        key = (x.off, kernel.quantize)
        if key not in self._codes:
            p = self.p
            padded = -(-x.width // kernel.pad) * kernel.pad
            codes = p.alloc(x.n, -(-padded // 4))  # int8 codes, four per float
            n_scales, n_sums = padded // kernel.scale_group, padded // kernel.sum_group
            scales, sums = p.alloc(x.n, n_scales), p.alloc(x.n, n_sums)
            p.add([QUANT, x.off, x.n, x.width, codes.off, scales.off, sums.off,
                   kernel.quantize, padded, n_scales, n_sums], x.n, reads=[x],
                  writes=[codes, scales, sums])
            self._codes[key] = [codes, scales, sums]
        return self._codes[key]

    def gated_ffn_act(self, gate: Buf, up: Buf, act: Activation) -> Buf:
        out = self.p.alloc(gate.n, gate.width)
        self.p.add([ACT, gate.off, gate.stride, up.off, up.stride, gate.n, gate.width,
                    out.off, row_ops.gated_kind(act)], gate.n,
                   reads=[gate, up], writes=[out])
        return out

    def moe_ffn(self, x: Buf, w: Any, moe: Any, act: Activation) -> Buf:
        """Router, top k, the chosen experts' gate and up products (one chunk per row,
        expert and range of rows, the expert's matrix found from the id the ROUTE step
        wrote), the activation, the down products and the weighted sum: the ops' steps
        (kernels/cpu_moe.py), the same kernels on the same rows."""
        if moe.d_ff_shared:
            raise Unsupported("a mixture with a shared expert")
        if not all(isinstance(m, ExpertMatrices) for m in (w.gate, w.up, w.down)):
            raise Unsupported("float32 experts")
        _contiguous(x, "a mixture of experts")
        p, n, k = self.p, x.n, moe.n_used
        ids, weights = p.alloc(n, k), p.alloc(n, k)
        # the router's logits by its row kernel (F32's, or its type's), as the ops'
        # `router_logits` take them
        logits = self.linear(x, w.router, w.router_bias)
        p.add([ROUTE, logits.off, moe.n_experts, ids.off, weights.off,
               GATING_CODES[moe.gating], k, int(moe.normalize)], n,
              [moe.scale], reads=[logits], writes=[ids, weights])
        gate = self._experts(x, w.gate, w.gate_bias, ids, k, per_pair=False)
        up = self._experts(x, w.up, w.up_bias, ids, k, per_pair=False)
        hidden = self.gated_ffn_act(gate, up, act)
        down = self._experts(hidden, w.down, w.down_bias, ids, k, per_pair=True)
        out = p.alloc(n, x.width)
        p.add([COMBINE, down.off, weights.off, k, x.width, out.off], n,
              reads=[down, weights], writes=[out])
        return out

    def _experts(self, x: Buf, m: ExpertMatrices, bias: np.ndarray | None, ids: Buf, k: int,
                 per_pair: bool) -> Buf:
        """y `[each row's k pairs, out]`: each (row, slot) pair's input (x's row, or with
        `per_pair` x's row of that pair) times the matrix of the expert in its slot, plus
        that expert's row of `bias` `[n_experts, out]`."""
        kernel = row_kernel(m.expert(0))
        if kernel is None:
            raise Unsupported(f"no row kernel for {m.qtype.name} experts")
        p = self.p
        n_pairs, rows = ids.n * k, m.shape[1]
        y = p.alloc(n_pairs, rows)
        p.keep.append(m.blocks)
        chunk = self._chunk(rows)
        inputs = self._inputs(x, kernel)
        x_at, scales, sums = (inputs + [_NO_BUF] * 2)[:3]
        p.add([EXPERT, x_at.off, x_at.stride, x.width, 0, m.blocks.ctypes.data,
               kernel.address, rows, m.blocks.strides[1], y.off, chunk, m.blocks.strides[0],
               ids.off, k, int(per_pair), scales.off, scales.stride, sums.off, sums.stride,
               int(kernel.quantize != 0), p.address(bias)], n_pairs * -(-rows // chunk),
              reads=[*inputs, ids], writes=[y])
        p.values += k * rows * x.width  # per decode row: its k experts' products
        return y

    def all_reduce(self, x: Buf) -> Buf:
        """The identity on a device alone; on a device of a tensor-parallel group, x summed
        over the group in place by a REDUCE step (kernels/host_collective.py's
        `exchange_sum`, as the ops' all-reduce: the devices meet in the same sequence
        whether each replays or runs op by op)."""
        collective = self._collective
        if collective is None:
            return x
        _contiguous(x, "an all-reduce")
        p = self.p
        ex = p.exchange = collective.group.exchange
        p.keep += [ex.data, ex.control]
        p.add([REDUCE, x.off, x.n * x.width, ex.data.ctypes.data, ex.control.ctypes.data,
               collective.rank, ex.size, ex.capacity, ex.control.size], 1,
              reads=[x], writes=[x])
        return x

    def all_gather(self, x: Buf) -> Buf:
        """A share of the vocabulary's logits: gathered after the table
        (`DecodeProgram.gather`; what follows, a softcap, is per value)."""
        self.p.gather = self._collective is not None
        return x

    def softcap(self, x: Buf, cap: float) -> Buf:
        _contiguous(x, "a softcap")
        self.p.add([SOFTCAP, x.off, x.n, x.width], x.n, [cap], reads=[x], writes=[x])
        return x

    def rows(self, x: Buf, rows: np.ndarray) -> Buf:
        if not np.array_equal(np.asarray(rows), np.arange(x.n)):
            raise Unsupported("logits of some rows only")
        return x

    def rope(self, x: Buf, positions: Any, rope: Any, freq_factors: Any = None) -> Buf:
        p = self.p
        key = (rope, id(freq_factors))
        if key not in p.ropes:
            half = rope.dim // 2
            p.ropes[key] = (rope, freq_factors, p.alloc(p.n, half).off,
                            p.alloc(p.n, half).off)
        cos_at, sin_at = p.ropes[key][2:]
        heads, hd = x.heads, x.width // x.heads
        out = p.alloc(x.n, x.width)
        p.add([ROPE, x.off, x.stride, x.n, heads, hd, cos_at, sin_at, rope.dim,
               int(rope.style is RopeStyle.NEOX), out.off], x.n,
              reads=[x, (cos_at, cos_at + p.n * rope.dim // 2),
                     (sin_at, sin_at + p.n * rope.dim // 2)], writes=[out])
        return out.reshape(*x.shape)

    def kv_append(self, batch: ForwardBatch, layer: int, k: Buf, v: Buf) -> None:
        decode = self._decode
        if k.width != decode.kv_dim or v.width != decode.kv_dim:
            raise Unsupported("a cache of another layout")
        self.p.add([APPEND, k.off, k.stride, v.off, v.stride, k.n, k.width,
                    layer * 2 * decode.kv_dim], k.n, reads=[k, v], writes=[_CACHES])

    def attention(self, batch: ForwardBatch, layer: int, q: Buf, *, scale: float,
                  window: int, sinks: Any = None) -> Buf:
        _contiguous(q, "an attention")
        decode = self._decode
        heads, hd = q.heads, q.width // q.heads
        n_kv = decode.kv_dim // hd
        out = self.p.alloc(q.n, q.width)
        self.p.add([ATTN, q.off, q.n, heads, hd, out.off, layer * 2 * decode.kv_dim, n_kv,
                    window, int(sinks is not None), self.p.address(sinks)], q.n * n_kv,
                   [scale], reads=[q, _CACHES], writes=[out])
        return out


def record(transformer: Any, batch: ForwardBatch, decode: DecodeRows,
           collective: HostCollective | None = None) -> DecodeProgram | None:
    """The table of `transformer`'s forward of `batch` (n decode rows), or None where the
    forward does something the table cannot express; with `collective`, a device's of a
    tensor-parallel group (its all-reduces steps of the table)."""
    program = DecodeProgram(len(batch.tokens), layout=(decode.n_layers, decode.kv_dim))
    try:
        program.logits = transformer.run(
            batch, RecordingOps(program, decode, core_workers().parts, collective))
    except Unsupported:
        return None
    program.finish()
    return program


KERNELS = (_run,)  # for kernels/cpu_compile.py

# Cleared while the table's kernel compiles in kernels/cpu_compile.py's helper process after
# a load on a cold cache, set once it is loaded here: until then decode batches run op by
# op (the same logits) instead of compiling it for seconds on the serving path.
TABLE_READY = threading.Event()
TABLE_READY.set()


def warm_up() -> None:
    """Compile (or load from numba's disk cache) the table's kernel, on an empty table,
    and the float32 row kernel."""
    row_kernel(np.zeros((1, 1), np.float32))
    ints = np.zeros(1, np.int64)
    _run(np.zeros((0, WIDTH), np.int64), np.zeros((0, 2)), np.zeros(1, np.float32), ints,
         ints, ints, 0, np.zeros(0, np.int64), SCHED_YIELD)
