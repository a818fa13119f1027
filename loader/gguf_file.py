"""Memory-mapped GGUF reading with errors that say where.

The on-disk types (value types, tensor types, block sizes) come from the `gguf` package;
the parsing is our own because `gguf.GGUFReader` builds a numpy view per array element,
which takes about 19 s on the demo model's 262,144-entry vocabulary. Here a whole model's
header parses in well under a second and tensor data stays in the page cache until used.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from loader.errors import GGUFFormatError, MissingKey, UnsupportedTensorType

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4
# No real tensor comes near these; past them a header is corrupt, not ambitious.
MAX_DIM_SIZE = 1 << 40
MAX_STRING_BYTES = 1 << 30
MAX_COUNT = 1 << 40
_U64 = struct.Struct("<Q")

_SCALAR_FORMATS: dict[GGUFValueType, str] = {
    GGUFValueType.UINT8: "<B",
    GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I",
    GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f",
    GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d",
}
_NUMPY_DTYPES: dict[GGUFValueType, np.dtype] = {
    t: np.dtype(fmt) for t, fmt in _SCALAR_FORMATS.items()
}


@dataclass(frozen=True)
class TensorInfo:
    """One tensor's header entry.

    `shape` is in numpy order (outermost first), the reverse of ggml's `ne`, so a weight
    matrix of a linear layer is (out_features, in_features) as the forward uses it.
    """

    name: str
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]
    offset: int  # absolute offset of the first byte in the file
    n_bytes: int

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


class _Cursor:
    """Reads little-endian values from a buffer, naming the offset when it runs out."""

    def __init__(self, buf: memoryview, path: str) -> None:
        self.buf = buf
        self.pos = 0
        self.path = path

    def take(self, n: int, what: str) -> memoryview:
        end = self.pos + n
        if n < 0 or end > len(self.buf):
            raise GGUFFormatError(
                f"file truncated while reading {what}: needs {n} bytes, "
                f"{len(self.buf) - self.pos} left",
                path=self.path, offset=self.pos)
        out = self.buf[self.pos:end]
        self.pos = end
        return out

    def scalar(self, fmt: str, what: str) -> Any:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt), what))[0]

    def u32(self, what: str) -> int:
        return self.scalar("<I", what)

    def u64(self, what: str) -> int:
        return self.scalar("<Q", what)

    def string(self, what: str) -> str:
        start = self.pos
        n = self.u64(what)
        if n > MAX_STRING_BYTES:
            raise GGUFFormatError(f"absurd string length {n} in {what}", path=self.path,
                                  offset=start)
        raw = bytes(self.take(n, what))
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            # Some vocabularies hold invalid UTF-8 pieces; keep the bytes recoverable.
            return raw.decode("utf-8", errors="surrogateescape")

    def strings(self, count: int, what: str) -> list[str]:
        """`count` strings in a row: `string` in one tight loop, because vocabularies hold
        hundreds of thousands (Gemma 3: 262k; one call each took a second to load)."""
        buf, pos, size = self.buf, self.pos, len(self.buf)
        length = _U64.unpack_from
        out: list[str] = []
        append = out.append
        for _ in range(count):
            if pos + 8 > size:
                self.pos = pos
                self.u64(what)  # raises: truncated
            (n,) = length(buf, pos)
            if n > MAX_STRING_BYTES:
                raise GGUFFormatError(f"absurd string length {n} in {what}", path=self.path,
                                      offset=pos)
            pos += 8
            if pos + n > size:
                self.pos = pos
                self.take(n, what)  # raises: truncated
            try:
                append(str(buf[pos:pos + n], "utf-8"))
            except UnicodeDecodeError:  # as in `string`
                append(str(buf[pos:pos + n], "utf-8", "surrogateescape"))
            pos += n
        self.pos = pos
        return out

    def value(self, vtype: int, key: str) -> Any:
        try:
            t = GGUFValueType(vtype)
        except ValueError:
            raise GGUFFormatError(f"unknown metadata value type {vtype}", path=self.path,
                                  field=key, offset=self.pos - 4) from None
        if t == GGUFValueType.STRING:
            return self.string(key)
        if t == GGUFValueType.ARRAY:
            start = self.pos
            etype = self.u32(key)
            count = self.u64(key)
            if count > MAX_COUNT:
                raise GGUFFormatError(f"absurd array length {count}", path=self.path,
                                      field=key, offset=start)
            try:
                et = GGUFValueType(etype)
            except ValueError:
                raise GGUFFormatError(f"unknown array element type {etype}", path=self.path,
                                      field=key, offset=start) from None
            if et in _NUMPY_DTYPES:
                dt = _NUMPY_DTYPES[et]
                raw = self.take(count * dt.itemsize, key)
                return np.frombuffer(raw, dtype=dt).copy()
            if et == GGUFValueType.STRING:
                return self.strings(count, key)
            return [self.value(etype, key) for _ in range(count)]
        return self.scalar(_SCALAR_FORMATS[t], key)


class GGUFFile:
    """A GGUF file opened read-only: its metadata as Python values and its tensor table.

    Numeric arrays in the metadata become numpy arrays, string arrays lists of str.
    Tensor bytes are read through a shared memory map; `tensor_bytes` returns a read-only
    view that must not be kept after `close()`.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = str(path)
        with open(self.path, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            if size < 24:
                raise GGUFFormatError(f"file too small to be GGUF ({size} bytes)",
                                      path=self.path, offset=0)
            self._mmap = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        self.file_size = size
        try:
            self._parse(memoryview(self._mmap))
        except BaseException:
            self.close()
            raise

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> GGUFFile:
        if not Path(path).is_file():
            raise FileNotFoundError(f"model file not found: {path}")
        return cls(path)

    def _parse(self, buf: memoryview) -> None:
        cur = _Cursor(buf, self.path)
        magic = bytes(cur.take(4, "magic"))
        if magic != GGUF_MAGIC:
            raise GGUFFormatError(f"bad magic {magic!r}, expected {GGUF_MAGIC!r}: not a GGUF file",
                                  path=self.path, offset=0)
        self.version = cur.u32("version")
        if self.version not in (2, 3):
            raise GGUFFormatError(f"unsupported GGUF version {self.version}", path=self.path,
                                  offset=4)
        n_tensors = cur.u64("tensor count")
        n_kv = cur.u64("metadata count")
        if n_tensors > MAX_COUNT or n_kv > MAX_COUNT:
            raise GGUFFormatError(f"absurd counts: {n_tensors} tensors, {n_kv} keys",
                                  path=self.path, offset=8)
        metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = cur.string("metadata key")
            vtype = cur.u32(f"type of {key}")
            metadata[key] = cur.value(vtype, key)
        self.metadata: Mapping[str, Any] = metadata

        infos: list[tuple[str, GGMLQuantizationType, tuple[int, ...], int, int]] = []
        for _ in range(n_tensors):
            start = cur.pos
            name = cur.string("tensor name")
            n_dims = cur.u32(f"dimensions of {name}")
            if not 1 <= n_dims <= MAX_DIMS:
                raise GGUFFormatError(f"tensor {name!r} has {n_dims} dimensions",
                                      path=self.path, offset=start)
            ne = [cur.u64(f"shape of {name}") for _ in range(n_dims)]
            if any(d == 0 or d > MAX_DIM_SIZE for d in ne):
                raise GGUFFormatError(f"tensor {name!r} has absurd shape {ne}",
                                      path=self.path, offset=start)
            raw_type = cur.u32(f"type of {name}")
            try:
                qtype = GGMLQuantizationType(raw_type)
            except ValueError:
                raise UnsupportedTensorType(f"tensor {name!r} has unknown ggml type {raw_type}",
                                            path=self.path, offset=start) from None
            offset = cur.u64(f"offset of {name}")
            infos.append((name, qtype, tuple(ne), offset, start))

        alignment = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        if alignment <= 0 or alignment & (alignment - 1):
            raise GGUFFormatError(f"alignment {alignment} is not a power of two",
                                  path=self.path, field="general.alignment")
        data_start = (cur.pos + alignment - 1) // alignment * alignment
        self.data_offset = data_start

        tensors: dict[str, TensorInfo] = {}
        for name, qtype, ne, rel, header_at in infos:
            if qtype not in GGML_QUANT_SIZES:
                raise UnsupportedTensorType(f"tensor {name!r} has ggml type {qtype.name} "
                                            "with no known block size",
                                            path=self.path, offset=header_at)
            block, type_size = GGML_QUANT_SIZES[qtype]
            if ne[0] % block:
                raise GGUFFormatError(
                    f"tensor {name!r}: row length {ne[0]} is not a multiple of the "
                    f"{qtype.name} block size {block}", path=self.path, offset=header_at)
            n_rows = int(np.prod(ne[1:], dtype=np.int64)) if len(ne) > 1 else 1
            n_bytes = n_rows * (ne[0] // block) * type_size
            begin = data_start + rel
            if begin + n_bytes > self.file_size:
                raise GGUFFormatError(
                    f"tensor {name!r} data [{begin}, {begin + n_bytes}) lies past the end of "
                    f"the file ({self.file_size} bytes): truncated download?",
                    path=self.path, offset=header_at)
            if name in tensors:
                raise GGUFFormatError(f"duplicate tensor name {name!r}", path=self.path,
                                      offset=header_at)
            tensors[name] = TensorInfo(name, qtype, tuple(reversed(ne)), begin, n_bytes)
        self.tensors: Mapping[str, TensorInfo] = tensors

    # -- metadata ---------------------------------------------------------------------

    @property
    def architecture(self) -> str:
        return str(self.require("general.architecture"))

    def require(self, key: str) -> Any:
        """The value of a metadata key that must be present."""
        if key not in self.metadata:
            raise MissingKey(f"required metadata key {key!r} is missing", path=self.path,
                             field=key)
        return self.metadata[key]

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    # -- tensors ----------------------------------------------------------------------

    def tensor_info(self, name: str) -> TensorInfo:
        if name not in self.tensors:
            raise MissingKey(f"required tensor {name!r} is missing", path=self.path, field=name)
        return self.tensors[name]

    def tensor_bytes(self, name: str) -> np.ndarray:
        """The raw bytes of a tensor (quantized blocks as stored), a read-only uint8 view."""
        info = self.tensor_info(name)
        return np.frombuffer(self._mmap, dtype=np.uint8, count=info.n_bytes, offset=info.offset)

    def close(self) -> None:
        mm = getattr(self, "_mmap", None)
        if mm is not None:
            # A view still alive keeps the map; it is released when the last view goes.
            with contextlib.suppress(BufferError):
                mm.close()
            self._mmap = None

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
