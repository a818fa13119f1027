"""The transformer forward, written once for every architecture and every backend.

Architectures differ only through `ModelConfig` fields and the optional weights they
imply (biases, QK-norm, post-norms, attention sinks, a mixture of experts in place of the
dense FFN); backends differ only through the ops object. The code reads in data-flow order:

    x = embed(tokens) * embedding_scale
    per layer:  h = x + post_attn_norm(attn(norm(x)));  x = h + post_ffn_norm(ffn(norm(h)))
    logits = softcap(lm_head(norm(x)))

where ffn is the gated FFN or, in a mixture-of-experts model, the router's top-k experts'
gated FFNs weighted and summed (`Ops.moe_ffn`).

Tensor parallelism (loader/sharding.py) changes no line of it: each device holds its share
of the heads and FFN features (its `config` is its part's, `Shard.local_config`), the
attention's and the FFN's outputs are summed over the devices by `all_reduce` (the
identity on one device), and a split lm head's logits are gathered by `all_gather`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

from eagerlm.kernels.batch import ForwardBatch
from eagerlm.loader.config import Activation, ModelConfig, MoEConfig, RopeParams
from eagerlm.loader.weights import LayerWeights, ModelWeights, MoEWeights

if TYPE_CHECKING:
    from eagerlm.kernels.backend import Backend

A = TypeVar("A")  # a backend's array type


class Ops(Protocol[A]):
    """What a backend provides to the forward (see kernels/numpy_ops.py for the reference;
    what else it provides, for the dispatcher's rounds and single sessions, is
    kernels/backend.py's `Backend`)."""

    def embed(self, table: A, ids: Any, scale: float) -> A: ...
    def rms_norm(self, x: A, w: A, eps: float) -> A: ...
    def add_rms_norm(self, residual: A, x: A, w: A, eps: float) -> tuple[A, A]: ...
    def linear(self, x: A, w: A, bias: A | None = None) -> A: ...
    def gated_ffn_act(self, gate: A, up: A, act: Activation) -> A: ...
    def moe_ffn(self, x: A, w: MoEWeights[A], moe: MoEConfig, act: Activation) -> A: ...
    def softcap(self, x: A, cap: float) -> A: ...
    def all_reduce(self, x: A) -> A: ...
    def all_gather(self, x: A) -> A: ...
    def rows(self, x: A, rows: Any) -> A: ...
    def rope(self, x: A, positions: Any, rope: RopeParams,
             freq_factors: A | None = None) -> A: ...
    def kv_append(self, batch: ForwardBatch, layer: int, k: A, v: A) -> None: ...
    def attention(self, batch: ForwardBatch, layer: int, q: A, *, scale: float,
                  window: int, sinks: A | None = None) -> A: ...
    def replay(self, transformer: Transformer[A], batch: ForwardBatch) -> A | None: ...


class Transformer(Generic[A]):
    """A decoder-only transformer: config + weights + ops. The forward uses only the ops'
    `Ops`; whoever runs the transformer (the dispatcher, perplexity) uses the rest of its
    `Backend`."""

    def __init__(self, config: ModelConfig, weights: ModelWeights[A], ops: Backend[A], *,
                 context: int | None = None) -> None:
        """`context`: the longest session the model will run (None: the config's default),
        which picks LongRoPE's short or long factors where the model has them."""
        self.config = config
        self.weights = weights
        self.ops = ops
        self._rope = [config.layer_rope(i) for i in range(config.n_layers)]  # per model
        self._rope_factors = weights.rope_freq_factors
        if config.long_rope_factors:
            long = config.rope_long_for(config.context_for(context))
            self._rope_factors = weights.rope_factors_long if long else \
                weights.rope_factors_short

    def forward(self, batch: ForwardBatch) -> A:
        """Run the batch through the model, append its K/V to the sessions' caches, and
        return the logits `[len(batch.logit_rows), vocab]`: from the backend's recording
        of this forward where it keeps one (`Ops.replay`: the cpu backend's decode rows,
        kernels/cpu_decode_program.py), else op by op (`run`)."""
        logits = self.ops.replay(self, batch)
        return self.run(batch, self.ops) if logits is None else logits

    def run(self, batch: ForwardBatch, ops: Ops[Any]) -> Any:
        """The forward against `ops`: the backend's, or ops that record it
        (kernels/cpu_decode_program.py's `RecordingOps`)."""
        cfg, w = self.config, self.weights
        h = self.hidden_states(batch, ops)
        logits = ops.linear(ops.rows(h, batch.logit_rows), w.output)
        if w.output.shape[0] < cfg.vocab_size:  # a share of the vocabulary per device
            logits = ops.all_gather(logits)
        if cfg.final_logit_softcap:
            logits = ops.softcap(logits, cfg.final_logit_softcap)
        return logits

    def hidden_states(self, batch: ForwardBatch, ops: Ops[Any] | None = None) -> A:
        """The final-normed hidden states of every row, `[len(batch.tokens), d_model]`:
        what the lm head reads, and what embedding models pool (service/api/embeddings.py)."""
        cfg, w = self.config, self.weights
        ops = self.ops if ops is None else ops
        x = ops.embed(w.token_embd, batch.tokens, cfg.embedding_scale)
        h = ops.rms_norm(x, w.layers[0].attn_norm, cfg.norm_eps)
        for i, lw in enumerate(w.layers):
            a = self._attention(ops, i, lw, h, batch)
            if cfg.post_norms:
                a = ops.rms_norm(a, lw.post_attn_norm, cfg.norm_eps)
            x, h = ops.add_rms_norm(x, a, lw.ffn_norm, cfg.norm_eps)
            f = self._ffn(ops, lw, h)
            if cfg.post_norms:
                f = ops.rms_norm(f, lw.post_ffn_norm, cfg.norm_eps)
            next_norm = w.layers[i + 1].attn_norm if i + 1 < cfg.n_layers else w.output_norm
            x, h = ops.add_rms_norm(x, f, next_norm, cfg.norm_eps)
        return h

    def _attention(self, ops: Ops[Any], i: int, lw: LayerWeights[A], h: A,
                   batch: ForwardBatch) -> A:
        cfg = self.config
        n = len(batch.tokens)
        q = ops.linear(h, lw.wq, lw.bq).reshape(n, cfg.n_heads, cfg.head_dim)
        k = ops.linear(h, lw.wk, lw.bk).reshape(n, cfg.n_kv_heads, cfg.head_dim)
        v = ops.linear(h, lw.wv, lw.bv).reshape(n, cfg.n_kv_heads, cfg.head_dim)
        if cfg.qk_norm:
            q = ops.rms_norm(q, lw.q_norm, cfg.norm_eps)
            k = ops.rms_norm(k, lw.k_norm, cfg.norm_eps)
        rope, factors = self._rope[i], self._rope_factors
        q = ops.rope(q, batch.positions, rope, factors)
        k = ops.rope(k, batch.positions, rope, factors)
        ops.kv_append(batch, i, k, v)
        o = ops.attention(batch, i, q, scale=cfg.attention_scale, window=cfg.sliding_window[i],
                          sinks=lw.sinks)
        # (an output bias is added once: the other devices of a group hold zeros for it,
        # loader/sharding.py)
        return ops.all_reduce(ops.linear(o, lw.wo, lw.bo))

    def _ffn(self, ops: Ops[Any], lw: LayerWeights[A], h: A) -> A:
        if lw.moe is not None:  # (every device runs its share of each chosen expert)
            return ops.all_reduce(
                ops.moe_ffn(h, lw.moe, self.config.moe, self.config.activation))
        gate = ops.linear(h, lw.w_gate)
        up = ops.linear(h, lw.w_up)
        return ops.all_reduce(
            ops.linear(ops.gated_ffn_act(gate, up, self.config.activation), lw.w_down))
