"""The mixture-of-experts feed-forward on the cpu: how its expert tensors are held, the
router, and the expert products grouped by expert.

A layer's experts are three 3-D tensors of the file (`ffn_{gate,up,down}_exps`,
`[n_experts, out, in]`). `ExpertMatrices` holds one as the file's blocks, read in place
from a copy-on-write map of the file (never copied: a 30B-A3B model's experts are 17 of
its 18 GB, and a token reads only the few the router picks); one expert's matrix is a
`QuantizedMatrix` over a slice of those blocks, a view, so the compiled quantized kernels
(kernels/quantized.py) multiply by it as by any other matrix.

`moe_ffn` is `NumpyOps.moe_ffn`: the router's logits, the top k experts of each row and
their weights as llama.cpp's `build_moe_ffn` computes them (`route`), then the rows grouped
by expert (a decode row alone: its k experts, in the order of their scores), each row's
outputs summed with its weights. Quantized experts take two jobs over the cores
(`_grouped_experts`): every group's gate and up products, then every down product, each
job's output rows cut in pieces that the cores take in turn; float32 experts (`--weights
float`) go expert by expert through BLAS (`_expert`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from numba import njit

from eagerlm.kernels import cpu_row_ops as row_ops
from eagerlm.kernels.aligned_arrays import aligned
from eagerlm.kernels.cpu_kernel_registry import BLOCK_TYPES
from eagerlm.kernels.cpu_row_kernel import float32_rows
from eagerlm.kernels.cpu_threads import by_output_pieces, by_rows
from eagerlm.kernels.numba_settings import JIT
from eagerlm.kernels.quantized import GEMV_SERIAL_MAX_VALUES, QuantizedMatrix, gemv_activations
from eagerlm.loader.config import ExpertGating, MoEConfig
from eagerlm.loader.weights import MoEWeights

# Float operations in the order written (no `fastmath`): the routing and the weighted sum
# are compiled into the ops and, inlined, into the decode replay's table; reassociated,
# each caller's vectorizer could order a sum its own way, and the two paths' bits differ.
_JIT = {**JIT, "fastmath": False}

# llama.cpp clamps the sum of the chosen weights below at the smallest float16 normal
# before dividing by it (build_moe_ffn's ffn_moe_weights_sum_clamped)
WEIGHTS_SUM_MIN = np.float32(6.103515625e-5)


@dataclass(frozen=True, eq=False)
class ExpertMatrices:
    """A 3-D expert tensor held as the file's blocks: `shape` (n_experts, out, in),
    `blocks` uint8 `[n_experts, out, row bytes]`, each expert's rows C-contiguous, a view
    of the file's map (`mapped`: the cpu backend maps experts, it does not copy them;
    under tensor parallelism a device's range of each expert's rows, a view whose experts
    lie further apart than its rows, or a copy of its share of each expert's columns)."""

    qtype: GGMLQuantizationType
    shape: tuple[int, int, int]
    blocks: np.ndarray
    mapped: bool = True

    @classmethod
    def of(cls, qtype: GGMLQuantizationType, shape: tuple[int, ...],
           raw: np.ndarray, *, mapped: bool = True) -> ExpertMatrices:
        """The tensor over `raw`, its bytes as the file stores them, or already
        `[n_experts, out, row bytes]` (a device's share of each expert's rows): not
        copied."""
        n, rows, cols = shape
        block, type_size = GGML_QUANT_SIZES[qtype]
        if cols % block:
            raise ValueError(f"rows of {cols} values are not whole {qtype.name} blocks")
        return cls(qtype, (n, rows, cols), raw.reshape(n, rows, cols // block * type_size),
                   mapped)

    def expert(self, e: int) -> QuantizedMatrix:
        """Expert `e`'s matrix `(out, in)`: a view of its blocks."""
        return QuantizedMatrix(self.qtype, self.shape[1:], self.blocks[e])

    @property
    def nbytes(self) -> int:
        return int(self.blocks.nbytes)

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(np.float32)


CpuExperts = ExpertMatrices | np.ndarray  # float32 [n_experts, out, in] with --weights float


def expert(w: CpuExperts, e: int) -> QuantizedMatrix | np.ndarray:
    """Expert `e`'s matrix of a 3-D expert tensor, however it is held."""
    return w.expert(e) if isinstance(w, ExpertMatrices) else w[e]


# the gating's code in the compiled kernels (`route_row`)
_SOFTMAX, _SIGMOID, _SOFTMAX_WEIGHT = 0, 1, 2
GATING_CODES = {ExpertGating.SOFTMAX: _SOFTMAX, ExpertGating.SIGMOID: _SIGMOID,
                ExpertGating.SOFTMAX_WEIGHT: _SOFTMAX_WEIGHT}
_ONE = np.float32(1.0)


@njit(**_JIT)
def _softmax_in_place(v: np.ndarray, n: int) -> None:
    top = v[0]
    for i in range(1, n):
        top = max(top, v[i])
    total = np.float32(0.0)
    for i in range(n):
        v[i] = np.exp(v[i] - top)
        total += v[i]
    for i in range(n):
        v[i] = v[i] / total


@njit(**_JIT)
def route_row(scores: np.ndarray, gating: int, n_used: int, normalize: bool, scale: float,
              ids: np.ndarray, weights: np.ndarray) -> None:
    """One row's experts (`ids`, float32 holding integers: the decode replay's arena is
    float32) and their weights, from its router logits `scores` (overwritten with the
    scores). The ops (`route`) and the decode replay (kernels/cpu_decode_program.py) both
    call this, so a row's routing is the same bits on either path, alone or in a batch.
    Ties go to the lower expert index; the k picks cost k passes over the experts, which
    for a router's 8 of 128 is less than a sort."""
    n = scores.shape[0]
    if gating == _SOFTMAX:
        _softmax_in_place(scores, n)
    elif gating == _SIGMOID:
        for e in range(n):
            scores[e] = _ONE / (_ONE + np.exp(-scores[e]))
    for s in range(n_used):
        best = -1
        for e in range(n):
            taken = False
            for t in range(s):
                if ids[t] == e:
                    taken = True
                    break
            if not taken and (best < 0 or scores[e] > scores[best]):
                best = e
        ids[s] = best
        weights[s] = scores[best]
    if gating == _SOFTMAX_WEIGHT:
        _softmax_in_place(weights, n_used)
    if normalize:
        total = np.float32(0.0)
        for s in range(n_used):
            total += weights[s]
        total = max(total, WEIGHTS_SUM_MIN)
        for s in range(n_used):
            weights[s] = weights[s] / total
    if scale != 1.0:
        for s in range(n_used):
            weights[s] = weights[s] * np.float32(scale)


@njit(**_JIT)
def route_rows(scores: np.ndarray, gating: int, n_used: int, normalize: bool, scale: float,
               ids: np.ndarray, weights: np.ndarray) -> None:
    """`route_row` for every row of `scores` `[rows, n_experts]`."""
    for r in range(scores.shape[0]):
        route_row(scores[r], gating, n_used, normalize, scale, ids[r], weights[r])


@njit(**_JIT)
def combine_row(y: np.ndarray, weights: np.ndarray, out: np.ndarray) -> None:
    """out = sum over slots s, in order, of weights[s] * y[s] (`y` `[n_used, d]`): a row's
    chosen experts' outputs weighted and summed, in the order of their scores whatever
    other rows a batch holds (shared with the decode replay, as `route_row`)."""
    for j in range(out.shape[0]):
        acc = weights[0] * y[0, j]
        for s in range(1, weights.shape[0]):
            acc += weights[s] * y[s, j]
        out[j] = acc


@njit(**_JIT)
def combine_rows(y: np.ndarray, weights: np.ndarray, out: np.ndarray) -> None:
    """`combine_row` for every row: y `[rows * n_used, d]`, weights `[rows, n_used]`."""
    k = weights.shape[1]
    for r in range(out.shape[0]):
        combine_row(y[r * k:(r + 1) * k], weights[r], out[r])


# for kernels/cpu_compile.py's experts group, with gpt-oss's activation (whose only
# users are mixtures of experts)
KERNELS = (route_rows, combine_rows, row_ops.gated_oai)


def warm_up() -> None:
    """Compile (or load from numba's disk cache) the routing, the weighted sum and the
    clamped SwiGLU."""
    route(np.zeros((1, 2), np.float32), MoEConfig(2, 1, 1))
    ones = np.ones((1, 1), np.float32)
    combine_rows(ones, ones, np.zeros((1, 1), np.float32))
    row_ops.gated_oai(ones, ones, np.zeros((1, 1), np.float32))


def route(logits: np.ndarray, moe: MoEConfig) -> tuple[np.ndarray, np.ndarray]:
    """The experts each row uses and their weights, from the router's logits
    `[rows, n_experts]` (float32): int32 `[rows, n_used]` in descending order of the
    score the top k is taken over, and float32 weights `[rows, n_used]`.

    As build_moe_ffn: SOFTMAX scores by the softmax over all experts and weighs by those
    probabilities, SIGMOID by each logit's sigmoid, SOFTMAX_WEIGHT scores by the logits
    and weighs by a softmax over the k chosen; then, with `normalize`, the weights are
    divided by their sum (clamped below at `WEIGHTS_SUM_MIN`), and multiplied by `scale`.
    Compiled (`route_rows`).
    """
    scores = np.array(logits, np.float32, copy=True, order="C")
    ids = np.empty((len(scores), moe.n_used), np.float32)
    weights = np.empty((len(scores), moe.n_used), np.float32)
    route_rows(scores, GATING_CODES[moe.gating], moe.n_used, moe.normalize, moe.scale,
               ids, weights)
    return ids.astype(np.int32), weights


Linear = Callable[..., np.ndarray]
Gated = Callable[[np.ndarray, np.ndarray], np.ndarray]


def router_logits(linear: Linear, x: np.ndarray, w: MoEWeights) -> np.ndarray:
    """The router's logits `[rows, n_experts]`: a float32 router (as llama.cpp's quantizer
    leaves it) by F32's row kernel in any batch (`float32_rows`, rows split over the
    cores), a quantized one through `by_gemv`, so that each row's choice of experts and
    their weights are the same bits alone or in any batch (BLAS picks its sums' order by
    the row count: the experts' 8-bit activations turned a last-bit difference in a
    logit into a whole rounding step)."""
    router = w.router
    if not (isinstance(router, np.ndarray) and router.dtype == np.float32
            and router.flags.c_contiguous):
        return by_gemv(linear, x, router, w.router_bias)
    x = np.ascontiguousarray(x, np.float32)
    logits = np.empty((len(x), router.shape[0]), np.float32)

    def part(start: int, stop: int) -> None:
        float32_rows(x[start:stop], router, logits[start:stop], 0, router.shape[0])
    by_rows(len(x), part)
    if w.router_bias is not None:
        logits += w.router_bias
    return logits


def by_gemv(linear: Linear, x: np.ndarray, m: QuantizedMatrix | np.ndarray,
            bias: np.ndarray | None) -> np.ndarray:
    """linear(x, m, bias), for a quantized expert in runs of at most its type's `gemv_rows`
    rows: how many rows choose an expert depends on the whole batch, and past that count
    `quantized_linear` switches to float32 tiles, whose sums differ in their last bits
    from the 8-bit GEMV's. In runs, each row gets the same bits alone or in any batch."""
    if not isinstance(m, QuantizedMatrix):
        return linear(x, m, bias)
    limit = BLOCK_TYPES[m.qtype].gemv_rows
    if len(x) <= limit:
        return linear(x, m, bias)
    return np.concatenate([linear(x[i:i + limit], m, bias) for i in range(0, len(x), limit)])


def _expert(linear: Linear, gated: Gated, xe: np.ndarray, w: MoEWeights,
            e: int) -> np.ndarray:
    """Expert e's FFN of rows xe, by the ops' own linear."""
    gate = by_gemv(linear, xe, expert(w.gate, e), _bias(w.gate_bias, e))
    up = by_gemv(linear, xe, expert(w.up, e), _bias(w.up_bias, e))
    return by_gemv(linear, gated(gate, up), expert(w.down, e), _bias(w.down_bias, e))


def _bias(bias: np.ndarray | None, e: int) -> np.ndarray | None:
    return None if bias is None else bias[e]


def _grouped_experts(gated: Gated, x: np.ndarray, w: MoEWeights,
                     groups: list[tuple[int, np.ndarray]]) -> list[np.ndarray]:
    """Each group's (expert e, the rows of x that chose it) FFN output, for quantized
    experts: x quantized once for all of them, every group's gate and up products in one
    job over the cores (`_products`), their activations in one call, the down products in
    a second job. A decode row's eight experts were 24 calls one after another, each on
    one core (a 768 x 2048 product is under `GEMV_SERIAL_MAX_VALUES`), plus a
    quantization each. Each row's bits are those of `_expert`'s path: the kernels and the
    quantizer work row by row, in runs of at most `gemv_rows` rows either way."""
    limit = min(BLOCK_TYPES[m.qtype].gemv_rows for m in (w.gate, w.up, w.down))
    runs = [(e, rows[i:i + limit]) for e, rows in groups for i in range(0, len(rows), limit)]
    x_gate = gemv_activations(w.gate.qtype, x)
    x_up = x_gate if _same_layout(w.gate.qtype, w.up.qtype) else \
        gemv_activations(w.up.qtype, x)
    d_ff = w.gate.shape[1]
    total = sum(len(rows) for _, rows in runs)
    gate, up = np.empty((total, d_ff), np.float32), np.empty((total, d_ff), np.float32)
    jobs, at = [], 0
    for e, rows in runs:
        span = slice(at, at + len(rows))
        jobs.append((w.gate.expert(e), _rows_of(x_gate, rows), gate[span]))
        jobs.append((w.up.expert(e), _rows_of(x_up, rows), up[span]))
        at += len(rows)
    _products(jobs)
    _add_biases(gate, w.gate_bias, runs)
    _add_biases(up, w.up_bias, runs)
    hidden = np.ascontiguousarray(gated(gate, up), np.float32)
    h = gemv_activations(w.down.qtype, hidden)
    down = np.empty((total, w.down.shape[1]), np.float32)
    jobs, at = [], 0
    for e, rows in runs:
        span = slice(at, at + len(rows))
        jobs.append((w.down.expert(e), tuple(a[span] for a in h), down[span]))
        at += len(rows)
    _products(jobs)
    _add_biases(down, w.down_bias, runs)
    results, at = [], 0
    for _, rows in groups:
        results.append(down[at:at + len(rows)])
        at += len(rows)
    return results


def _same_layout(a: GGMLQuantizationType, b: GGMLQuantizationType) -> bool:
    """Whether types a and b's `gemv` take their activations alike."""
    ta, tb = BLOCK_TYPES[a], BLOCK_TYPES[b]
    return (ta.activation_group, ta.superblocks) == (tb.activation_group, tb.superblocks)


def _rows_of(acts: tuple[np.ndarray, ...], rows: np.ndarray) -> tuple[np.ndarray, ...]:
    """The activations of `rows` (a view for one row, else an aligned copy)."""
    if len(rows) == 1:
        r = int(rows[0])
        return tuple(a[r:r + 1] for a in acts)
    return tuple(aligned(a[rows]) for a in acts)


def _add_biases(y: np.ndarray, bias: np.ndarray | None,
                runs: list[tuple[int, np.ndarray]]) -> None:
    """Each run's rows of y plus its expert's bias (as `linear` adds one)."""
    if bias is None:
        return
    at = 0
    for e, rows in runs:
        y[at:at + len(rows)] += bias[e]
        at += len(rows)


def _products(jobs: list[tuple[QuantizedMatrix, tuple[np.ndarray, ...], np.ndarray]]) -> None:
    """y = x @ m^T for every job (m, x's activations, y) by m's type's `gemv`: the jobs'
    output rows, one after another, cut in pieces that the cores take in turn
    (`by_output_pieces`), so that a decode row's small products fill both cores."""
    ends = np.cumsum([m.shape[0] for m, _, _ in jobs])
    macs = sum(len(acts[0]) * m.shape[0] * m.shape[1] for m, acts, _ in jobs)

    def part(start: int, stop: int) -> None:
        j = int(np.searchsorted(ends, start, side="right"))
        while j < len(jobs) and ends[j] - jobs[j][0].shape[0] < stop:
            m, acts, y = jobs[j]
            lo = int(ends[j]) - m.shape[0]
            m.kernels.gemv(m.blocks, *acts, y, max(start, lo) - lo, min(stop, int(ends[j])) - lo)
            j += 1
    by_output_pieces(macs, int(ends[-1]), part, serial_max=GEMV_SERIAL_MAX_VALUES)


def moe_ffn(linear: Linear, gated: Gated, x: np.ndarray, w: MoEWeights,
            moe: MoEConfig) -> np.ndarray:
    """The mixture-of-experts FFN of rows x `[rows, d_model]`: `linear(x, matrix, bias)` and
    `gated(gate, up)` are the ops' own (NumpyOps.linear, its gated activation)."""
    n, d = x.shape
    out = np.zeros((n, d), np.float32)
    if n == 0:
        return out
    ids, weights = route(router_logits(linear, x, w), moe)
    pairs_of: list[np.ndarray] = []
    if n == 1:  # decode: the row's k experts, summed in turn
        groups = [(int(e), np.zeros(1, np.int64)) for e in ids[0]]
    else:  # one product per expert, over every row that chose it
        flat = ids.reshape(-1)
        order = np.argsort(flat, kind="stable")
        chosen, starts = np.unique(flat[order], return_index=True)
        ends = [*starts[1:], len(order)]
        pairs_of = [order[a:b] for a, b in zip(starts, ends, strict=True)]
        # (row, slot) pairs of each expert, row = pair // n_used
        groups = [(int(e), pairs // moe.n_used)
                  for e, pairs in zip(chosen, pairs_of, strict=True)]
    if all(isinstance(m, ExpertMatrices) for m in (w.gate, w.up, w.down)):
        results = _grouped_experts(gated, x, w, groups)
    else:  # float32 experts (--weights float): BLAS, expert by expert
        results = [_expert(linear, gated, x[rows], w, e) for e, rows in groups]
    if n == 1:
        by_pair = np.concatenate(results)
    else:  # each (row, slot) pair's output in row-major order
        by_pair = np.empty((n * moe.n_used, d), np.float32)
        for pairs, y in zip(pairs_of, results, strict=True):
            by_pair[pairs] = y
    combine_rows(np.ascontiguousarray(by_pair, np.float32), weights, out)
    if moe.d_ff_shared:
        shared = linear(gated(linear(x, w.shared_gate), linear(x, w.shared_up)), w.shared_down)
        if w.shared_router is not None:
            logit = linear(x, w.shared_router)  # [rows, 1]
            shared = shared * (np.float32(1.0) / (np.float32(1.0) + np.exp(-logit)))
        out += shared
    return out
