"""A naive float64 transformer forward, independent of the engine, for tests.

It reads the file with gguf-py's own `GGUFReader` (not our reader), dequantizes with
`gguf.quants`, and computes every token, head and position with explicit loops from the
definitions of each architecture as llama.cpp implements them (src/models/llama.cpp,
qwen2.cpp, qwen3.cpp, gemma3.cpp; hparams from llama-model.cpp). Slow, and meant to be:
it shares no code with kernels/.
"""

from __future__ import annotations

import math

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, quants


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
    }
    hp["hd"] = _field(r, f"{arch}.attention.key_length", hp["d"] // hp["n_heads"])
    weights = {}
    hp["types"] = {t.name: t.tensor_type for t in r.tensors}
    for t in r.tensors:
        w = quants.dequantize(t.data, t.tensor_type).astype(np.float64)
        weights[t.name] = w.reshape([int(x) for x in reversed(t.shape.tolist())])
    return hp, weights


def _rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / math.sqrt(float(np.mean(x * x)) + eps) * w


def _rope(v: np.ndarray, pos: int, base: float, neox: bool) -> np.ndarray:
    d = len(v)
    out = v.copy()
    for i in range(d // 2):
        theta = pos * base ** (-2.0 * i / d)
        c, s = math.cos(theta), math.sin(theta)
        a, b = (i, i + d // 2) if neox else (2 * i, 2 * i + 1)
        out[a] = v[a] * c - v[b] * s
        out[b] = v[a] * s + v[b] * c
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


def _product(hp: dict, W: dict[str, np.ndarray], name: str, v: np.ndarray) -> np.ndarray:
    """W[name] @ v, v rounded first where `hp["eight_bit"]` and the weight is quantized."""
    qtype = int(hp["types"][name])
    if hp.get("eight_bit") and qtype not in _FLOAT_TYPES:
        v = eight_bit(v, 256 if quants.GGML_QUANT_SIZES[GGMLQuantizationType(qtype)][0] == 256
                      else 32)
    return W[name] @ v


def reference_hidden_states(path: str, tokens: list[int],
                            loaded: tuple[dict, dict[str, np.ndarray]] | None = None
                            ) -> np.ndarray:
    """The output-normed hidden states `[len(tokens), d]` of one sequence, in float64:
    what the lm head reads and embedding models pool."""
    hp, W = loaded or load(path)
    arch, n_layers, d, H, KV, hd, eps = (hp[k] for k in
                                         ("arch", "n_layers", "d", "n_heads", "n_kv", "hd", "eps"))
    gemma = arch == "gemma3"
    neox = arch in ("qwen2", "qwen3", "gemma3")
    T = len(tokens)
    x = np.stack([W["token_embd.weight"][t] for t in tokens])
    if gemma:
        x = x * math.sqrt(d)
    for il in range(n_layers):
        p = f"blk.{il}."
        # gemma3: layer il uses the sliding window unless il % 6 == 5; local rope base 1e4
        local = gemma and il % 6 < 5
        base = 10000.0 if local else hp["base"]
        scale = 1.0 / math.sqrt(hd)
        qs, ks, vs = [], [], []
        for t in range(T):
            h = _rms(x[t], W[p + "attn_norm.weight"], eps)
            q = _product(hp, W, p + "attn_q.weight", h)
            k = _product(hp, W, p + "attn_k.weight", h)
            v = _product(hp, W, p + "attn_v.weight", h)
            if arch == "qwen2":
                q = q + W[p + "attn_q.bias"]
                k = k + W[p + "attn_k.bias"]
                v = v + W[p + "attn_v.bias"]
            q, k, v = q.reshape(H, hd), k.reshape(KV, hd), v.reshape(KV, hd)
            if arch in ("qwen3", "gemma3"):
                q = np.stack([_rms(q[i], W[p + "attn_q_norm.weight"], eps) for i in range(H)])
                k = np.stack([_rms(k[i], W[p + "attn_k_norm.weight"], eps) for i in range(KV)])
            qs.append(np.stack([_rope(q[i], t, base, neox) for i in range(H)]))
            ks.append(np.stack([_rope(k[i], t, base, neox) for i in range(KV)]))
            vs.append(v)
        attn_out = np.zeros((T, H * hd))
        for t in range(T):
            for i in range(H):
                kvh = i // (H // KV)
                js = [j for j in range(t + 1) if not (local and t - j >= hp["window"])]
                s = np.array([qs[t][i] @ ks[j][kvh] * scale for j in js])
                e = np.exp(s - s.max())
                pr = e / e.sum()
                attn_out[t, i * hd:(i + 1) * hd] = sum(pr[n] * vs[j][kvh]
                                                       for n, j in enumerate(js))
        for t in range(T):
            a = _product(hp, W, p + "attn_output.weight", attn_out[t])
            if gemma:
                a = _rms(a, W[p + "post_attention_norm.weight"], eps)
            x[t] = x[t] + a
            h = _rms(x[t], W[p + "ffn_norm.weight"], eps)
            g = _product(hp, W, p + "ffn_gate.weight", h)
            u = _product(hp, W, p + "ffn_up.weight", h)
            if gemma:  # GELU, tanh approximation
                act = 0.5 * g * (1 + np.tanh(math.sqrt(2 / math.pi) * (g + 0.044715 * g**3)))
            else:  # SiLU
                act = g / (1 + np.exp(-g))
            f = _product(hp, W, p + "ffn_down.weight", act * u)
            if gemma:
                f = _rms(f, W[p + "post_ffw_norm.weight"], eps)
            x[t] = x[t] + f
    return np.stack([_rms(x[t], W["output_norm.weight"], eps) for t in range(T)])
