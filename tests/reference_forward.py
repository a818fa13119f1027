"""A naive float64 transformer forward, independent of the engine, for tests.

It reads the file with gguf-py's own `GGUFReader` (not our reader), dequantizes with
`gguf.quants` (Q1_0, which gguf-py cannot dequantize, with loader/ggml_quants.py's port of
ggml's dequantizer, held to llama.cpp's to the bit by tests/test_gguf_file.py), and
computes every token, head and position with explicit loops from the definitions of each
architecture as llama.cpp implements them (src/models/llama.cpp, qwen2.cpp, qwen3.cpp,
qwen3moe.cpp, gemma3.cpp, openai-moe.cpp, phi3.cpp; hparams from llama-model.cpp;
build_moe_ffn in llama-graph.cpp for the mixtures of experts). Slow, and meant to be: it
shares no code with kernels/. Not covered: rope scaling (YaRN, linear) and rope frequency
factors.
"""

from __future__ import annotations

import math

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, quants

from eagerlm.loader import ggml_quants


def _field(r: GGUFReader, key: str, default=None):
    f = r.fields.get(key)
    return default if f is None else f.contents()


def load(path: str) -> tuple[dict, dict[str, np.ndarray]]:
    """The hyperparameters (and, under "types", each tensor's GGML type) and the weights
    dequantized to float64."""
    r = GGUFReader(path)
    arch = _field(r, "general.architecture")
    hp = {
        "arch": arch,
        "n_layers": _field(r, f"{arch}.block_count"),
        "d": _field(r, f"{arch}.embedding_length"),
        "n_heads": _field(r, f"{arch}.attention.head_count"),
        "n_kv": _field(r, f"{arch}.attention.head_count_kv"),
        "eps": _field(r, f"{arch}.attention.layer_norm_rms_epsilon"),
        "base": _field(r, f"{arch}.rope.freq_base", 10000.0),
        "window": _field(r, f"{arch}.attention.sliding_window", 0),
        "softcap": _field(r, f"{arch}.final_logit_softcapping", 0.0),
        "n_experts": _field(r, f"{arch}.expert_count", 0),
        "n_used": _field(r, f"{arch}.expert_used_count", 0),
    }
    hp["rope_dim"] = _field(r, f"{arch}.rope.dimension_count", None)
    hp["hd"] = _field(r, f"{arch}.attention.key_length", hp["d"] // hp["n_heads"])
    weights = {}
    hp["types"] = {t.name: t.tensor_type for t in r.tensors}
    for t in r.tensors:
        w = ggml_quants.dequantize(t.data, t.tensor_type).astype(np.float64)
        weights[t.name] = w.reshape([int(x) for x in reversed(t.shape.tolist())])
    return hp, weights


def _rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / math.sqrt(float(np.mean(x * x)) + eps) * w


def _rope(v: np.ndarray, pos: int, base: float, neox: bool, d: int | None = None
          ) -> np.ndarray:
    """Rotate the first d (default all) dims of a head."""
    d = d or len(v)
    out = v.copy()
    for i in range(d // 2):
        theta = pos * base ** (-2.0 * i / d)
        c, s = math.cos(theta), math.sin(theta)
        a, b = (i, i + d // 2) if neox else (2 * i, 2 * i + 1)
        out[a] = v[a] * c - v[b] * s
        out[b] = v[a] * s + v[b] * c
    return out


def _act(g: np.ndarray, u: np.ndarray, arch: str) -> np.ndarray:
    """The gated activation act(g) * u of the family."""
    if arch == "gemma3":  # GELU, tanh approximation
        return 0.5 * g * (1 + np.tanh(math.sqrt(2 / math.pi) * (g + 0.044715 * g**3))) * u
    if arch == "gpt-oss":  # ggml's swiglu_oai: alpha 1.702, limit 7
        g = np.minimum(g, 7.0)
        u = np.clip(u, -7.0, 7.0)
        return g / (1 + np.exp(-1.702 * g)) * (u + 1)
    return g / (1 + np.exp(-g)) * u  # SiLU


def _moe(W: dict[str, np.ndarray], p: str, h: np.ndarray, hp: dict, arch: str) -> np.ndarray:
    """build_moe_ffn for one token: router logits (+ bias), top k, weights (softmax over all
    then normalized to the k; gpt-oss: softmax over the k chosen logits), the k experts'
    FFNs (+ biases) weighted and summed."""
    logits = W[p + "ffn_gate_inp.weight"] @ h
    if p + "ffn_gate_inp.bias" in W:
        logits = logits + W[p + "ffn_gate_inp.bias"]
    k = hp["n_used"]
    if arch == "gpt-oss":
        chosen = np.argsort(-logits, kind="stable")[:k]
        e = np.exp(logits[chosen] - logits[chosen].max())
        weights = e / e.sum()
    else:
        e = np.exp(logits - logits.max())
        probs = e / e.sum()
        chosen = np.argsort(-probs, kind="stable")[:k]
        weights = probs[chosen] / probs[chosen].sum()
    out = np.zeros_like(h)
    for wgt, ex in zip(weights, chosen, strict=True):
        def mat(name: str, v: np.ndarray, ex: int = int(ex)) -> np.ndarray:
            return _product(hp, W, p + name + ".weight", v, ex)

        def bias(name: str, ex: int = int(ex)) -> np.ndarray | float:
            b = W.get(p + name + ".bias")
            return 0.0 if b is None else b[ex]
        g = mat("ffn_gate_exps", h) + bias("ffn_gate_exps")
        u = mat("ffn_up_exps", h) + bias("ffn_up_exps")
        out += wgt * (mat("ffn_down_exps", _act(g, u, arch)) + bias("ffn_down_exps"))
    return out


def eight_bit(v: np.ndarray, group: int = 32) -> np.ndarray:
    """v rounded as llama.cpp (and eagerlm's cpu kernels) round the activations of a
    product with quantized weights: per 32 values (ggml's Q8_0; per 256, Q8_K, for the
    types of 256-value superblocks), to the nearest multiple of max |v| / 127."""
    g = v.reshape(-1, group)
    d = np.abs(g).max(axis=1, keepdims=True) / 127
    return (np.rint(g / np.where(d > 0, d, 1)) * d).reshape(v.shape)


def reference_logits(path: str, tokens: list[int], eight_bit_activations: bool = False
                     ) -> np.ndarray:
    """Logits `[len(tokens), vocab]` for every position of one sequence, in float64;
    with `eight_bit_activations`, every product with a quantized (not float) weight first
    rounds its input by `eight_bit`."""
    hp, W = load(path)
    hp["eight_bit"] = eight_bit_activations
    hidden = reference_hidden_states(path, tokens, (hp, W))
    name = "output.weight" if "output.weight" in W else "token_embd.weight"
    logits = np.stack([_product(hp, W, name, h) for h in hidden])
    if hp["softcap"]:
        logits = np.tanh(logits / hp["softcap"]) * hp["softcap"]
    return logits


_FLOAT_TYPES = {0, 1, 30}  # F32, F16, BF16


def _product(hp: dict, W: dict[str, np.ndarray], name: str, v: np.ndarray,
             expert: int | None = None) -> np.ndarray:
    """W[name] @ v (expert `expert`'s matrix of a 3-D expert tensor), v rounded first where
    `hp["eight_bit"]` and the weight is quantized."""
    qtype = int(hp["types"][name])
    if hp.get("eight_bit") and qtype not in _FLOAT_TYPES:
        v = eight_bit(v, 256 if quants.GGML_QUANT_SIZES[GGMLQuantizationType(qtype)][0] == 256
                      else 32)
    return (W[name] if expert is None else W[name][expert]) @ v


def reference_hidden_states(path: str, tokens: list[int],
                            loaded: tuple[dict, dict[str, np.ndarray]] | None = None
                            ) -> np.ndarray:
    """The output-normed hidden states `[len(tokens), d]` of one sequence, in float64:
    what the lm head reads and embedding models pool."""
    hp, W = loaded or load(path)
    arch, n_layers, d, H, KV, hd, eps = (hp[k] for k in
                                         ("arch", "n_layers", "d", "n_heads", "n_kv", "hd", "eps"))
    gemma, oss = arch == "gemma3", arch == "gpt-oss"
    neox = arch != "llama"
    qk_norm = arch in ("qwen3", "qwen3moe", "gemma3")
    T = len(tokens)
    x = np.stack([W["token_embd.weight"][t] for t in tokens])
    if gemma:
        x = x * math.sqrt(d)
    for il in range(n_layers):
        p = f"blk.{il}."
        # gemma3: layer il uses the sliding window unless il % 6 == 5; local rope base 1e4.
        # gpt-oss: even layers use it, with the same rope
        local = (gemma and il % 6 < 5) or (oss and il % 2 == 0)
        base = 10000.0 if local and gemma else hp["base"]
        scale = 1.0 / math.sqrt(hd)
        qs, ks, vs = [], [], []
        for t in range(T):
            h = _rms(x[t], W[p + "attn_norm.weight"], eps)
            if p + "attn_qkv.weight" in W:  # phi3: Q, K, V rows in one matrix
                qkv = _product(hp, W, p + "attn_qkv.weight", h)
                q, k, v = qkv[:H * hd], qkv[H * hd:(H + KV) * hd], qkv[(H + KV) * hd:]
            else:
                q = _product(hp, W, p + "attn_q.weight", h)
                k = _product(hp, W, p + "attn_k.weight", h)
                v = _product(hp, W, p + "attn_v.weight", h)
            if p + "attn_q.bias" in W:
                q = q + W[p + "attn_q.bias"]
                k = k + W[p + "attn_k.bias"]
                v = v + W[p + "attn_v.bias"]
            q, k, v = q.reshape(H, hd), k.reshape(KV, hd), v.reshape(KV, hd)
            if qk_norm:
                q = np.stack([_rms(q[i], W[p + "attn_q_norm.weight"], eps) for i in range(H)])
                k = np.stack([_rms(k[i], W[p + "attn_k_norm.weight"], eps) for i in range(KV)])
            rd = hp["rope_dim"]
            qs.append(np.stack([_rope(q[i], t, base, neox, rd) for i in range(H)]))
            ks.append(np.stack([_rope(k[i], t, base, neox, rd) for i in range(KV)]))
            vs.append(v)
        attn_out = np.zeros((T, H * hd))
        sinks = W.get(p + "attn_sinks.weight")
        for t in range(T):
            for i in range(H):
                kvh = i // (H // KV)
                js = [j for j in range(t + 1) if not (local and t - j >= hp["window"])]
                s = np.array([qs[t][i] @ ks[j][kvh] * scale for j in js])
                # an attention sink: one more logit in the softmax, with no value
                m = s.max() if sinks is None else max(s.max(), sinks[i])
                e = np.exp(s - m)
                total = e.sum() + (0.0 if sinks is None else math.exp(sinks[i] - m))
                pr = e / total
                attn_out[t, i * hd:(i + 1) * hd] = sum(pr[n] * vs[j][kvh]
                                                       for n, j in enumerate(js))
        for t in range(T):
            a = _product(hp, W, p + "attn_output.weight", attn_out[t])
            if p + "attn_output.bias" in W:
                a = a + W[p + "attn_output.bias"]
            if gemma:
                a = _rms(a, W[p + "post_attention_norm.weight"], eps)
            x[t] = x[t] + a
            # gpt-oss stores the FFN's pre-norm as post_attention_norm
            h = _rms(x[t], W[p + ("post_attention_norm" if oss else "ffn_norm") + ".weight"],
                     eps)
            if p + "ffn_gate_inp.weight" in W:
                f = _moe(W, p, h, hp, arch)
            else:
                if p + "ffn_gate.weight" in W:
                    g = _product(hp, W, p + "ffn_gate.weight", h)
                    u = _product(hp, W, p + "ffn_up.weight", h)
                else:  # phi3: gate then up rows in ffn_up
                    gu = _product(hp, W, p + "ffn_up.weight", h)
                    g, u = gu[:len(gu) // 2], gu[len(gu) // 2:]
                f = _product(hp, W, p + "ffn_down.weight", _act(g, u, arch))
            if gemma:
                f = _rms(f, W[p + "post_ffw_norm.weight"], eps)
            x[t] = x[t] + f
    return np.stack([_rms(x[t], W["output_norm.weight"], eps) for t in range(T)])
