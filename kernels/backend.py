"""What a backend owes the rest of the engine, written down as Protocols both backends
satisfy (NumpyOps, kernels/numpy_ops.py; CudaOps, kernels/cuda_ops.py with
kernels/cuda_sampling.py); tests/test_backend_contract.py checks that they do.

- `Ops` (kernels/model.py): the forward's ops, one per step of `Transformer.forward`.
- `RoundBackend`: what the dispatcher (dispatch/control_thread.py, dispatch/round_work.py)
  asks of a backend beside the forward to run a round: where its work is enqueued, a
  session's KV as the ops read it, the round's inputs, the sampler and its per-session
  state, and the decode graphs where the backend has them. An optional capability is a
  member that says "none here" (`stream` is None, `decode_graphs` returns None), never an
  attribute the dispatcher probes for.
- `Backend`: both, plus what runs one session outside the dispatcher (the sequential
  reference loop, perplexity): a contiguous KV cache and logits brought to the host.

The per-session sampler state and a round's inputs are in the backend's own form (host
arrays and `TokenCounts` on cpu, device tensors on cuda): the dispatcher only hands them
back to the backend, so they are `Any` here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, runtime_checkable

import numpy as np

from eagerlm.kernels.model import Ops

if TYPE_CHECKING:
    from eagerlm.kernels.batch import ForwardBatch
    from eagerlm.kernels.model import Transformer
    from eagerlm.kernels.sampling import SamplingParams
    from eagerlm.kernels.speculative import SpecBuffers, SpecSeq
    from eagerlm.vmm.device import DeviceBuffer, Stream
    from eagerlm.vmm.kv_layout import KVLayout
    from eagerlm.vmm.kv_region import KVRegion

A = TypeVar("A")  # a backend's array type (np.ndarray, DeviceTensor)


@dataclass(frozen=True)
class DecodeKind:
    """Which variant of its bucket's fixed-buffer round a decode round takes: beside the
    forward and the draw, whether it counts inputs and adjusts logits (penalties, a logit
    bias), whether it writes logprobs, or whether it stops after the forward (constrained
    rows, sampled once the host has their masks). Over several devices the leader sends
    its round's kind to the followers (`RoundOrder.fixed`): each captures its own graph
    of its share at the same rounds as the leader, because a capture's warm-up runs the
    forward, whose collectives meet the other devices' (docs/tensor_parallel.md)."""

    adjusted: bool
    logprobs: bool
    forward_only: bool = False


@runtime_checkable
class DecodeRounds(Protocol):
    """Pure-decode rounds through fixed buffers (cuda: kernels/cuda_graphs.py's
    `DecodeGraphs`), as `RoundWork` runs them and the control thread closes them."""

    def kind(self, params: Sequence[SamplingParams], constrained: bool) -> DecodeKind | None:
        """The variant a decode round of one row per session with `params` takes
        (`constrained`: some row waits for a mask: the forward only); None when it fits
        no bucket and takes the general path."""
        ...

    def run(self, rows: np.ndarray, n_pasts: Sequence[int], kvs: Sequence[Any],
            params: Sequence[SamplingParams], out: Any, out_slots: Sequence[int],
            counts: Sequence[tuple[Any, int] | None] | None = None,
            logprobs_out: tuple[Any, Any] | None = None,
            biases: Sequence[Any | None] | None = None) -> bool:
        """Run the decode round (one row per session); False when it does not fit a
        bucket and must take the general path."""
        ...

    def forward(self, rows: np.ndarray, n_pasts: Sequence[int], kvs: Sequence[Any],
                params: Sequence[SamplingParams],
                counts: Sequence[tuple[Any, int] | None] | None = None,
                order: Sequence[int] | None = None) -> Any | None:
        """The decode round's forward only (a round with constrained rows, whose sampling
        waits for the host): its logits [n, vocab], row j of session `order[j]`; None when
        it does not fit a bucket."""
        ...

    def forward_shard(self, rows: np.ndarray, n_pasts: Sequence[int], kvs: Sequence[Any],
                      logit_rows: Sequence[int], leader: DecodeKind) -> None:
        """A follower device's share of a decode round its leader runs as `leader`: the
        forward only, padded to the same bucket (its collectives the leader's sizes), its
        logit rows the leader's (`logit_rows`: the all-gathered logits' row order); its
        graph captured at the rounds the leader's of that kind is."""
        ...

    def run_spec(self, rows: np.ndarray, seq_rows: Sequence[tuple[int, int, int]],
                 kvs: Sequence[Any], params: Sequence[SamplingParams],
                 out_slots: Sequence[int], seqs: Sequence[SpecSeq], buffers: SpecBuffers,
                 counts_at: int, stats_at: int, out: Any,
                 logprobs_out: tuple[Any, Any] | None = None) -> bool:
        """A decode round with speculating sessions (every row sampled, in row order;
        `seq_rows` (start, rows, n_past bound) per session): the speculation steps, the
        forward and the sampler through fixed buffers; False when it fits no bucket."""
        ...

    def close(self) -> None:
        """Free the graphs and their buffers, after the stream has finished every replay."""
        ...


@runtime_checkable
class RoundBackend(Protocol[A]):
    """The backend's duties toward the dispatcher, beside the forward's `Ops`."""

    # The KV cache's element type: the page pool and the sessions' regions are laid out
    # with it before any round runs (float32 on cpu, bf16 bits on cuda).
    kv_dtype: np.dtype

    # The stream the ops enqueue their work on, which must then be the rounds' compute
    # stream (cuda: kernels are launched on it as RoundWork runs). None where the ops
    # compute when called (numpy): the control thread makes its own compute stream and
    # runs each round's work on it.
    stream: Stream | None

    def session_kv(self, region: KVRegion) -> Any:
        """A session's KV as the ops read it, taken at launch (cpu: a view of the pages
        mapped now, as the control thread maps ahead meanwhile; cuda: the region itself,
        whose base pointer and strides the kernels read)."""
        ...

    def round_inputs(self, rows: DeviceBuffer, n_rows: int, token_buf: DeviceBuffer) -> Any:
        """A round's token ids from its metadata rows `[host id, token-buffer slot or -1]`
        (int32 pairs in `rows`): decode inputs exist only in the token buffer the previous
        round's sampler wrote, so the backend gathers them where they are."""
        ...

    def broadcast_tokens(self, token_buf: DeviceBuffer) -> None:
        """Device 0's token buffer (int32) into every device's, on the compute stream, at
        the end of a round of a model split over several devices: only device 0 samples,
        and the next round's decode inputs must be on every device before it runs. Nothing
        on a device alone."""
        ...

    def broadcast_round(self, rows: DeviceBuffer, n_rows: int,
                        pasts: Sequence[int] | None) -> list[int]:
        """A speculative round of a model split over devices: device 0's metadata rows
        (its proposals written into the draft rows) and its sessions' positions (`pasts`,
        read from the device there) into every device's, before the forward; returns the
        positions. On cuda the positions are never on the host: not supported there (the
        dispatcher refuses speculation over several GPUs)."""
        ...

    def token_counts(self, vocab: int, prompt: Sequence[int], output: Sequence[int]) -> Any:
        """A penalized session's token counts, built from its tokens so far: when it
        first samples, or after a preemption. From then on `count_inputs` keeps them up
        to date, in the backend's memory, where the sampled tokens are."""
        ...

    def count_inputs(self, tokens: Any, spans: Sequence[tuple[Any, int, int, int]]) -> None:
        """Add a round's inputs (`round_inputs`' result) to the sessions' counts: per span
        (counts, first row, rows, how many of those rows are still prompt tokens)."""
        ...

    def logit_bias(self, params: SamplingParams, vocab: int) -> A:
        """A session's logit bias in the sampler's form, float32 [vocab], made once per
        session (it stays with the sampler until the session ends)."""
        ...

    def sample_round(self, logits: A, params: Sequence[SamplingParams],
                     positions: Sequence[int], counts: Sequence[Any | None],
                     biases: Sequence[A | None], *, out: DeviceBuffer,
                     token_buf: DeviceBuffer, out_slots: Sequence[int],
                     logprobs_out: tuple[DeviceBuffer, DeviceBuffer] | None = None,
                     masks: Sequence[np.ndarray | None] | None = None,
                     first_row: int = 0, positions_at: Any = None) -> None:
        """Sample one token per logit row into `out` (int32) and into the token buffer at
        `out_slots` (a negative slot writes none): the next round reads its decode inputs
        there. Penalized rows need their `counts`, biased rows their `biases`,
        constrained rows their allowed-token `masks` (host int32 bitmasks, applied after
        the bias and penalties); with `logprobs_out`, also each row's logprobs (float32
        [n, 1 + MAX_LOGPROBS], int32 [n, MAX_LOGPROBS]) for rows whose params ask for them.
        The rows sampled are `first_row .. first_row + len(params)` of `logits`, written to
        the same rows of `out` and the logprob buffers: a round samples its unconstrained
        rows first and its constrained rows once their masks have come. `positions_at`
        (row positions on the device, rows of the forward batch) replaces `positions`
        where only the device knows them (speculation, cuda): row i draws at the position
        after its batch row's."""
        ...

    def decode_graphs(self, transformer: Transformer, token_buf: DeviceBuffer, *,
                      max_batch: int, max_context: int, layout: KVLayout,
                      enabled: bool = True) -> DecodeRounds | None:
        """Fixed buffers (and CUDA graphs, when `enabled`) for pure-decode rounds, made
        once per dispatcher; None where the backend runs every round eagerly (numpy)."""
        ...

    # -- speculative decoding (kernels/speculative.py has the rules) ----------------------

    def round_cost(self, rows: int) -> float:
        """A round of `rows` rows (a decode round's forward and sampling) relative to one of
        one row: what draft rows cost (dispatch/speculation.py weighs them against their
        expected gain)."""
        ...

    def spec_prepare(self, meta: DeviceBuffer, buffers: SpecBuffers,
                     seqs: Sequence[SpecSeq]) -> list[int]:
        """Before a round's inputs are gathered: each speculating session's first position
        (a decode row's from `buffers.lengths`, which only the device knows) and its
        prompt-lookup proposal, kept in `buffers.proposals` and written into its draft
        rows' host-id column of the round's metadata rows `meta`. Returns the positions
        where the backend knows them on the host (cpu), else the sessions' `past` values
        (cuda resolves them on the device)."""
        ...

    def spec_positions(self, batch: ForwardBatch, buffers: SpecBuffers,
                       past_of: Sequence[tuple[int, int] | None]) -> None:
        """Where `spec_prepare` returned no positions (cuda): make `batch`'s positions and
        per-session descriptors the device's, for sessions with `past_of[i]` = (slot,
        delta): their first row at the position `spec_prepare` found for the slot, plus
        delta. (Their `SeqSlice.n_past` are bounds, good for sizing only.)"""
        ...

    def spec_accept(self, out: DeviceBuffer, token_buf: DeviceBuffer, buffers: SpecBuffers,
                    seqs: Sequence[SpecSeq], counts_at: int, stats_at: int) -> None:
        """After a round's sampling (`out`: its samples, a speculating session's rows at
        `out ..`): each speculating session's accepted run, its count and statistics into
        `out` (int32 at `counts_at + j`, `stats_at + 3 j`), its new length and history in
        `buffers`, its next input in `token_buf`."""
        ...

    def draft_inputs(self, meta: DeviceBuffer, buffers: SpecBuffers, seqs: Sequence[SpecSeq],
                     step: int, prefill: Sequence[tuple[int, int]] = ()) -> Any:
        """The draft model's input tokens at `step` of a round (kernels/speculative.py's
        `draft_inputs_on_host`): at 0 the rows of the `prefill` spans of `meta`, then two
        per entry; at j > 0 one per entry, its draft row j."""
        ...

    def draft_propose(self, logits: A, meta: DeviceBuffer, buffers: SpecBuffers,
                      seqs: Sequence[SpecSeq], step: int) -> None:
        """The draft model's greedy proposals at `step` (one logits row per entry) into
        the entries' proposals and draft rows (`draft_propose_on_host`)."""
        ...


@runtime_checkable
class Backend(Ops[A], RoundBackend[A], Protocol[A]):
    """Everything a backend provides: the forward's `Ops`, the dispatcher's
    `RoundBackend`, and what one session run outside the dispatcher needs."""

    name: str  # the device kind it runs on: "cpu", "cuda"

    def contiguous_kv(self, layout: KVLayout, capacity: int) -> Any:
        """One session's KV cache in one allocation of `capacity` tokens (the sequential
        reference loop, perplexity); its `free()` gives the memory back."""
        ...

    def to_numpy(self, t: A) -> np.ndarray:
        """`t` on the host (float32 for float data), after the work that writes it."""
        ...
