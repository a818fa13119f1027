"""Speculative decoding as the host plans it: the settings, each session's acceptance
record, and how many draft rows each speculating session gets in a round.

The device does the rest (kernels/speculative.py has the rules): the proposal, the
verification in the same forward as every other row, the acceptance, the new length and
the next input, all in buffers the next round reads. So a round is launched before the
host knows how many tokens the round before accepted; the host learns it when it harvests
that round's output (dispatch/control_thread.py), a round or two later, and only uses it
to size later rounds: how many pages to map, how many drafts are worth their rows.

**How many drafts (adaptive k).** A round of R rows costs `RoundBackend.round_cost(R)`
times a one-row round (the weights are read once per round whatever the rows, so on a
memory-bound device an extra row is cheap; on the cpu backend it is not, and the cost
grows in steps of four rows). A session whose drafts are accepted at rate a gains a**j
expected tokens from its j-th draft row (each draft needs every one before it accepted).
The plan takes draft rows best gain first, as many as maximise the round's expected tokens
per unit of cost, so speculation never lowers them: a session whose proposals stop being
accepted (free text, for prompt lookup) is given none, and a batch that is already wide
gives fewer.
The rate is estimated per session from its recent rounds (decayed counts, geometric-model
maximum likelihood: a accepted of k rows is a successes and one failure unless a = k);
a session given no draft rows still gets a proposal of one token on the device, checked
against the token it then samples (its "shadow"), so its rate keeps being measured at no
cost and speculation resumes when proposals start matching again.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from eagerlm.errors import InvalidParameters
from eagerlm.kernels.model import Transformer
from eagerlm.kernels.sampling import MAX_SPECULATIVE_TOKENS, SPECULATIVE_METHODS, SamplingParams
from eagerlm.vmm.kv_layout import KVLayout

# the prior of a session's acceptance rate: as if it had accepted one of two drafts
_PRIOR_HITS = 1.0
_PRIOR_TRIALS = 2.0
# how much of a session's acceptance record each round keeps (older rounds fade out)
_DECAY = 0.8
# draft rows are added only where the expected tokens per cost beat the round without them
# by this factor (allocate_drafts)
MARGIN = 1.2


@dataclass(frozen=True)
class SpeculationConfig:
    """The engine's speculative decoding (`--speculative`, `--num-speculative-tokens`);
    a request may choose its own in `SamplingParams`."""

    method: str = "off"  # "ngram" (prompt lookup), "draft" (a draft model) or "off"
    num_tokens: int = 8  # draft tokens a session proposes per round, at most
    ngram_min: int = 1  # prompt lookup: the shortest suffix looked up
    ngram_max: int = 3  # and the longest (the longest that occurs wins)
    # choose each round's draft rows by acceptance (off: always the most allowed)
    adaptive: bool = True
    # the cost of one more row in a round, relative to a round of one row (None: the
    # backend's own cost of a round by its rows, RoundBackend.round_cost)
    row_cost: float | None = None

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise InvalidParameters(f"speculative must be one of "
                                    f"{', '.join(SPECULATIVE_METHODS)}, not {self.method!r}",
                                    param="speculative")
        if not 0 <= self.num_tokens <= MAX_SPECULATIVE_TOKENS:
            raise InvalidParameters(f"num_speculative_tokens must be in [0, "
                                    f"{MAX_SPECULATIVE_TOKENS}], not {self.num_tokens}",
                                    param="num_speculative_tokens")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise InvalidParameters(f"ngram sizes must satisfy 1 <= min <= max, got "
                                    f"{self.ngram_min} and {self.ngram_max}")
        if self.row_cost is not None and not self.row_cost >= 0:
            raise InvalidParameters(f"row_cost must be >= 0, not {self.row_cost}")

    def method_for(self, params: SamplingParams) -> str:
        """What a request speculates with: its own choice, else the engine's; "off" for
        requests whose tokens cannot be verified row by row in one forward (penalties
        count every earlier token, a grammar's mask needs the token before)."""
        method = params.speculative or self.method
        if params.penalized or params.constrained or self.tokens_for(params) == 0:
            return "off"
        return method

    def tokens_for(self, params: SamplingParams) -> int:
        k = params.num_speculative_tokens
        return self.num_tokens if k is None else k


@dataclass
class SpecSession:
    """A speculating session's host-side record: its method, its most drafts per round,
    its acceptance rate, and whether the device already holds its history."""

    method: str
    k_max: int
    hits: float = _PRIOR_HITS
    trials: float = _PRIOR_TRIALS
    history_sent: bool = False  # its tokens are in the device's history (per admission)

    @property
    def rate(self) -> float:
        """The estimated probability that its next draft is accepted."""
        return self.hits / self.trials

    def observe(self, k: int, proposed: int, accepted: int, shadow: int) -> None:
        """A harvested round: `k` draft rows, `proposed` real proposals among them,
        `accepted` of them accepted; with no rows, `shadow` says whether the proposal
        made anyway matched the sampled token (1), did not (0), or none was found (-1)."""
        if k:
            hits, trials = accepted, min(accepted + 1, k)
        elif shadow >= 0 or self.method == "ngram":
            hits, trials = max(shadow, 0), 1  # no proposal is a miss: its rows are wasted
        else:
            return
        self.hits = self.hits * _DECAY + hits
        self.trials = self.trials * _DECAY + trials


RoundCost = Callable[[int, bool], float]  # (rows, drafted) -> cost, one-row rounds


def linear_cost(row_cost: float) -> RoundCost:
    """A round's cost when each row beyond the first adds `row_cost` (relative to a
    one-row round), drafts or not."""
    return lambda rows, drafted=False: 1.0 + row_cost * max(0, rows - 1)


def allocate_drafts(rates: list[float], caps: list[int], n_decode: int, n_rows: int,
                    cost: RoundCost, budget: int, margin: float = MARGIN, *,
                    drafter: Sequence[bool] = (), draft_first: float = 0.0,
                    draft_step: float = 0.0) -> list[int]:
    """Draft rows per speculating session (rates[i], at most caps[i]) in a round that
    already has `n_decode` decoding sessions and `n_rows` rows, costing `cost(rows,
    drafted)` relative to a one-row round (dispatch/round_costs.py: a round with draft
    rows may take another path than one without): the rows in order of expected gain
    (rate**j for a
    session's j-th), as many of them (at most `budget`) as maximise the round's expected
    tokens per unit of cost, and none unless that beats the round without drafts by
    `margin` (the rates are estimates: a draft row that only just pays on paper costs
    where the estimate is high, as on free text after a few lucky matches). (The cost need
    not be linear: the cpu backend's grows in steps of four rows, kernels/numpy_ops.py.)

    A session with `drafter[i]` takes its drafts from the draft model, whose forwards
    are priced in one-row rounds: its first of the round, `draft_first`, paid whatever
    the drafts (step 0: the proposal of the first token, a shadow one without draft rows,
    which also keeps the draft's KV current), then `draft_step` per draft token past the
    first of the round's longest run of them (the draft's steps are batched over its
    sessions). Such a row's gain ranks as gain / (1 + draft_step) (as if a row cost one
    round, its forward another draft_step), so cheaper rows of other sessions come
    first."""
    drafted_by = [bool(drafter) and drafter[i] for i in range(len(rates))]

    def rank(i: int, j: int, gain: float) -> float:  # the heap's key: j-th row of i
        return gain / (1 + draft_step) if drafted_by[i] and j > 1 else gain

    order: list[int] = []
    heap = [(-rates[i], i, 1, rates[i]) for i in range(len(rates))
            if caps[i] > 0 and rates[i] > 0]
    heapq.heapify(heap)
    gains, tokens = [], float(n_decode)
    while heap and len(order) < budget:
        _, i, j, gain = heapq.heappop(heap)
        order.append(i)
        gains.append(gain)
        if j < caps[i]:
            heapq.heappush(heap, (-rank(i, j + 1, gain * rates[i]), i, j + 1,
                                  gain * rates[i]))
    first = draft_first if any(drafted_by) else 0.0  # every round pays it, drafts or not
    best_n, best = 0, margin * tokens / (cost(n_rows, False) + first)
    runs, longest = [0] * len(rates), 0
    for m, (gain, i) in enumerate(zip(gains, order, strict=True), 1):
        tokens += gain
        runs[i] += 1
        if drafted_by[i]:
            longest = max(longest, runs[i])
        ratio = tokens / (cost(n_rows + m, True) + first + draft_step * max(0, longest - 1))
        if ratio > best:
            best_n, best = m, ratio
    ks = [0] * len(rates)
    for i in order[:best_n]:
        ks[i] += 1
    return ks


def kv_layouts(transformer: Transformer,
               draft: Transformer | None = None) -> tuple[KVLayout, KVLayout | None]:
    """The sessions' KV layout, and the draft model's beside it in the same cache (one
    region per session holds both models' KV token by token, so its pages, its prefix
    cache entry, its swap and its release serve both)."""
    cfg = transformer.config
    layout = KVLayout(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, transformer.ops.kv_dtype)
    if draft is None:
        return layout, None
    d = draft.config
    return layout.shared_with(KVLayout(d.n_layers, d.n_kv_heads, d.head_dim,
                                       draft.ops.kv_dtype))
