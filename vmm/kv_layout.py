"""The token-major layout of a session's KV cache, and a plain contiguous host cache.

All layers' K and V of one token are adjacent: a session's cache is an array
`[capacity, n_layers, 2, n_kv_heads, head_dim]`. Growing a session by one token touches one
contiguous slice, so when the cache is backed by pages mapped on demand (the VMM regions)
the unused tail of a session is less than one page whatever the layer count. Attention
reads a layer's K (or V) through a strided view `[tokens, n_kv_heads, head_dim]`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class KVLayout:
    n_layers: int
    n_kv_heads: int
    head_dim: int
    dtype: np.dtype = field(default_factory=lambda: np.dtype(np.float32))

    @property
    def token_shape(self) -> tuple[int, int, int, int]:
        return (self.n_layers, 2, self.n_kv_heads, self.head_dim)

    @property
    def token_bytes(self) -> int:
        """Bytes one token occupies across all layers, K and V."""
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim * self.dtype.itemsize

    def tokens_in(self, n_bytes: int) -> int:
        return n_bytes // self.token_bytes

    def view(self, buffer: np.ndarray) -> np.ndarray:
        """A flat byte or element buffer seen as `[tokens, layers, 2, kv_heads, head_dim]`."""
        flat = buffer.reshape(-1).view(self.dtype)
        n = flat.size // int(np.prod(self.token_shape))
        return flat[: n * int(np.prod(self.token_shape))].reshape((n, *self.token_shape))


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
