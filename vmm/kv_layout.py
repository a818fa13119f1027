"""The token-major layout of a session's KV cache, and a plain contiguous host cache.

All layers' K and V of one token are adjacent: a session's cache is an array
`[capacity, n_layers, 2, n_kv_heads, head_dim]`. Growing a session by one token touches one
contiguous slice, so when the cache is backed by pages mapped on demand (the VMM regions)
the unused tail of a session is less than one page whatever the layer count. Attention
reads a layer's K (or V) through a strided view `[tokens, n_kv_heads, head_dim]`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class KVLayout:
    """One model's token-major KV. Two models may share one cache token by token (a draft
    model's KV beside its target's, so one region, one set of pages, one prefix cache and
    one preemption serve both): each one's layout then has the shared `stride` (bytes per
    token) and its own `offset` within a token (`shared_with`)."""

    n_layers: int
    n_kv_heads: int
    head_dim: int
    dtype: np.dtype = field(default_factory=lambda: np.dtype(np.float32))
    stride: int = 0  # bytes from one token to the next; 0: this model's own bytes
    offset: int = 0  # where this model's part of a token starts

    @property
    def token_shape(self) -> tuple[int, int, int, int]:
        return (self.n_layers, 2, self.n_kv_heads, self.head_dim)

    @property
    def own_bytes(self) -> int:
        """Bytes of this model's K and V of one token, across its layers."""
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim * self.dtype.itemsize

    @property
    def token_bytes(self) -> int:
        """Bytes one token occupies in the cache (with a shared cache, every model's)."""
        return self.stride or self.own_bytes

    def shared_with(self, other: KVLayout) -> tuple[KVLayout, KVLayout]:
        """This layout and `other` in one cache: this model's part first in each token."""
        stride = -(-(self.own_bytes + other.own_bytes) // 16) * 16  # keeps 16-byte loads
        return (dataclasses.replace(self, stride=stride, offset=0),
                dataclasses.replace(other, stride=stride, offset=self.own_bytes))

    def tokens_in(self, n_bytes: int) -> int:
        return n_bytes // self.token_bytes

    def view(self, buffer: np.ndarray) -> np.ndarray:
        """A flat byte or element buffer seen as `[tokens, layers, 2, kv_heads, head_dim]`
        (this model's part of each token)."""
        flat = buffer.reshape(-1).view(self.dtype)
        item = self.dtype.itemsize
        per_token, own = self.token_bytes // item, self.own_bytes // item
        n = flat.size // per_token
        tokens = flat[: n * per_token].reshape(n, per_token)
        start = self.offset // item
        return tokens[:, start:start + own].reshape((n, *self.token_shape))


class TokenMajorKV:
    """A session's KV as the numpy ops read it (the `SessionKV` protocol), over a
    token-major array `[capacity, n_layers, 2, n_kv_heads, head_dim]`.

    The dispatcher takes one of these over a KV region's mapped pages when it launches a
    round, so the work on the stream sees a fixed view while the control thread maps
    pages ahead for the next round.
    """

    def __init__(self, data: np.ndarray) -> None:
        self.data = data
        self.capacity = data.shape[0]

    def k(self, layer: int) -> np.ndarray:
        return self.data[:, layer, 0]

    def v(self, layer: int) -> np.ndarray:
        return self.data[:, layer, 1]


class ContiguousKV(TokenMajorKV):
    """A session's KV cache in one host array of fixed capacity.

    The simplest backing of the layout, used by the sequential generation loop and as the
    reference the paged VMM regions are tested against.
    """

    def __init__(self, layout: KVLayout, capacity: int) -> None:
        self.layout = layout
        super().__init__(np.zeros((capacity, *layout.token_shape), dtype=layout.dtype))

    def free(self) -> None:
        """Nothing to give back before the last reference goes (a device cache's `free`,
        kernels/device_tensor.py's ContiguousDeviceKV, returns its memory)."""
