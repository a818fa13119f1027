"""Memory-mapped GGUF reading with errors that say where.

The on-disk types (value types, tensor types, block sizes) come from the `gguf` package;
the parsing is our own because `gguf.GGUFReader` builds a numpy view per array element,
which takes about 19 s on the demo model's 262,144-entry vocabulary. Here a whole model's
header parses in well under a second and tensor data stays in the page cache until used.
"""

from __future__ import annotations

import contextlib
import math
import mmap
import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from eagerlm.errors import ModelNotFound
from eagerlm.loader.errors import GGUFFormatError, MissingKey, UnsupportedTensorType, quoted

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4
# No real tensor comes near these; past them a header is corrupt, not ambitious.
MAX_DIM_SIZE = 1 << 40
MAX_ELEMENTS = (1 << 63) - 1  # llama.cpp: a tensor's element count must fit an int64
MAX_STRING_BYTES = 1 << 30
MAX_KEY_BYTES = (1 << 16) - 1  # the GGUF spec: a key is at most 65535 bytes
MAX_TENSOR_NAME_BYTES = 63  # llama.cpp: GGML_MAX_NAME (64) with the terminating NUL
MAX_COUNT = 1 << 40
# The fewest bytes a key/value pair (empty key, type, a one-byte value) and a tensor info
# (empty name, n_dims, one dimension, type, offset) take: counts are checked against the
# bytes left before anything is read or allocated for them.
_MIN_KV_BYTES = 8 + 4 + 1
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 8 + 4 + 8
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
_UNSIGNED_TYPES = frozenset({GGUFValueType.UINT8, GGUFValueType.UINT16, GGUFValueType.UINT32,
                             GGUFValueType.UINT64})
MAX_ALIGNMENT = 1 << 30


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

    def rows(self, start: int, stop: int) -> TensorInfo:
        """Rows start .. stop - 1 of the outermost axis, as a tensor of their own (the
        parts of a fused tensor: each row is whole blocks, so the part is a contiguous
        range of the file)."""
        n = self.shape[0]
        if not 0 <= start < stop <= n:
            raise ValueError(f"rows {start}:{stop} of a tensor of {n}")
        row_bytes = self.n_bytes // n
        return TensorInfo(f"{self.name}[{start}:{stop}]", self.qtype,
                          (stop - start, *self.shape[1:]), self.offset + start * row_bytes,
                          (stop - start) * row_bytes)


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

    def string(self, what: str, limit: int = MAX_STRING_BYTES) -> str:
        """A length-prefixed string of at most `limit` bytes: a longer one is refused
        before a byte of it is copied."""
        start = self.pos
        n = self.u64(what)
        if n > limit:
            raise GGUFFormatError(f"{what} is {n} bytes long, more than the {limit} a GGUF "
                                  f"file may hold", path=self.path, offset=start)
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

    def value(self, vtype: int, key: str) -> tuple[Any, GGUFValueType, GGUFValueType | None]:
        """The value of `key` (its type `vtype` just read), its type, and the element
        type when it is an array. Nested arrays are refused, as llama.cpp refuses them:
        no model key holds one, and each level would recurse."""
        what = quoted(key)
        try:
            t = GGUFValueType(vtype)
        except ValueError:
            raise GGUFFormatError(f"unknown metadata value type {vtype}", path=self.path,
                                  field=key, offset=self.pos - 4) from None
        if t == GGUFValueType.STRING:
            return self.string(f"the value of {what}"), t, None
        if t != GGUFValueType.ARRAY:
            return self.scalar(_SCALAR_FORMATS[t], what), t, None
        start = self.pos
        etype = self.u32(what)
        count = self.u64(what)
        try:
            et = GGUFValueType(etype)
        except ValueError:
            raise GGUFFormatError(f"unknown array element type {etype}", path=self.path,
                                  field=key, offset=start) from None
        if et == GGUFValueType.ARRAY:
            raise GGUFFormatError("nested arrays are not supported", path=self.path,
                                  field=key, offset=start)
        # each element takes at least its size (a string its u64 length): a count the
        # rest of the file cannot hold is refused before anything is allocated for it
        least = 8 if et == GGUFValueType.STRING else _NUMPY_DTYPES[et].itemsize
        left = len(self.buf) - self.pos
        if count > MAX_COUNT or count * least > left:
            raise GGUFFormatError(f"{count} {et.name} elements do not fit in the {left} "
                                  f"bytes left: file truncated or absurd array length",
                                  path=self.path, field=key, offset=start)
        if et == GGUFValueType.STRING:
            return self.strings(count, what), t, et
        raw = self.take(count * _NUMPY_DTYPES[et].itemsize, what)
        return np.frombuffer(raw, dtype=_NUMPY_DTYPES[et]).copy(), t, et


class GGUFFile:
    """A GGUF file opened read-only: its metadata as Python values and its tensor table.

    Numeric arrays in the metadata become numpy arrays, string arrays lists of str;
    `value_types` keeps each key's type as stored (and its arrays' element type), so a
    count stored as a float is told from one stored as an integer. Tensor bytes are read
    through a shared memory map; `tensor_bytes` returns a read-only view that must not be
    kept after `close()`.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = str(path)
        with open(self.path, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            if size < 24:
                raise GGUFFormatError(f"file too small to be GGUF ({size} bytes)",
                                      path=self.path, offset=0)
            self._mmap = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        self._private: mmap.mmap | None = None  # `mapped_bytes`' map, made when first asked
        self.file_size = size
        try:
            self._parse(memoryview(self._mmap))
        except BaseException:
            self.close()
            raise

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> GGUFFile:
        if not Path(path).is_file():
            raise ModelNotFound(f"model file not found: {path}")
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
        left = len(buf) - cur.pos
        if n_tensors * _MIN_TENSOR_INFO_BYTES + n_kv * _MIN_KV_BYTES > left:
            raise GGUFFormatError(f"{n_tensors} tensors and {n_kv} metadata keys do not fit "
                                  f"in the file's {len(buf)} bytes", path=self.path, offset=8)
        metadata: dict[str, Any] = {}
        types: dict[str, tuple[GGUFValueType, GGUFValueType | None]] = {}
        for _ in range(n_kv):
            start = cur.pos
            key = cur.string("metadata key", limit=MAX_KEY_BYTES)
            if key in metadata:
                raise GGUFFormatError("duplicate metadata key", path=self.path, field=key,
                                      offset=start)
            vtype = cur.u32(f"type of {quoted(key)}")
            metadata[key], *vtypes = cur.value(vtype, key)
            types[key] = (vtypes[0], vtypes[1])
        self.metadata: Mapping[str, Any] = metadata
        self.value_types: Mapping[str, tuple[GGUFValueType, GGUFValueType | None]] = types

        infos: list[tuple[str, GGMLQuantizationType, tuple[int, ...], int, int]] = []
        for _ in range(n_tensors):
            start = cur.pos
            name = cur.string("tensor name", limit=MAX_TENSOR_NAME_BYTES)
            n_dims = cur.u32(f"dimensions of {name!r}")
            if not 1 <= n_dims <= MAX_DIMS:
                raise GGUFFormatError(f"tensor {name!r} has {n_dims} dimensions",
                                      path=self.path, offset=start)
            ne = [cur.u64(f"shape of {name!r}") for _ in range(n_dims)]
            if any(d == 0 or d > MAX_DIM_SIZE for d in ne) or math.prod(ne) > MAX_ELEMENTS:
                raise GGUFFormatError(f"tensor {name!r} has absurd shape {ne}",
                                      path=self.path, offset=start)
            raw_type = cur.u32(f"type of {name!r}")
            try:
                qtype = GGMLQuantizationType(raw_type)
            except ValueError:
                raise UnsupportedTensorType(f"tensor {name!r} has unknown ggml type {raw_type}",
                                            path=self.path, offset=start) from None
            offset = cur.u64(f"offset of {name!r}")
            infos.append((name, qtype, tuple(ne), offset, start))

        alignment = self._alignment(metadata, types)
        data_start = (cur.pos + alignment - 1) // alignment * alignment
        if any(bytes(buf[cur.pos:data_start])):
            # Writers pad with zeros: anything else here is header the count did not
            # cover (a tensor count one short would shift every tensor's data).
            raise GGUFFormatError("the padding before the tensor data is not zeros: the "
                                  "header holds more than its counts say", path=self.path,
                                  offset=cur.pos)
        self.data_offset = data_start

        tensors: dict[str, TensorInfo] = {}
        expected = 0  # the data of each tensor follows the one before, padded
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
            n_bytes = math.prod(ne[1:]) * (ne[0] // block) * type_size
            begin = data_start + rel
            if begin + n_bytes > self.file_size:
                raise GGUFFormatError(
                    f"tensor {name!r} data [{begin}, {begin + n_bytes}) lies past the end of "
                    f"the file ({self.file_size} bytes): truncated download?",
                    path=self.path, offset=header_at)
            if rel != expected:
                # llama.cpp's rule too: tensors lie in header order, each padded to the
                # alignment, so a changed offset, type or shape cannot go unnoticed
                raise GGUFFormatError(
                    f"tensor {name!r} has data offset {rel}, expected {expected} (the "
                    f"tensors before it end there)", path=self.path, offset=header_at)
            expected += (n_bytes + alignment - 1) // alignment * alignment
            if name in tensors:
                raise GGUFFormatError(f"duplicate tensor name {name!r}", path=self.path,
                                      offset=header_at)
            tensors[name] = TensorInfo(name, qtype, tuple(reversed(ne)), begin, n_bytes)
        self.tensors: Mapping[str, TensorInfo] = tensors

    def _alignment(self, metadata: Mapping[str, Any],
                   types: Mapping[str, tuple[GGUFValueType, GGUFValueType | None]]) -> int:
        """`general.alignment`: an integer power of two (llama.cpp reads a uint32)."""
        key = "general.alignment"
        if key not in metadata:
            return DEFAULT_ALIGNMENT
        vtype, _ = types[key]
        if vtype not in _UNSIGNED_TYPES:
            raise GGUFFormatError(f"alignment is stored as {vtype.name}, expected an "
                                  "unsigned integer", path=self.path, field=key)
        alignment = int(metadata[key])
        if alignment <= 0 or alignment & (alignment - 1) or alignment > MAX_ALIGNMENT:
            raise GGUFFormatError(f"alignment {alignment} is not a power of two up to "
                                  f"{MAX_ALIGNMENT}", path=self.path, field=key)
        return alignment

    # -- metadata ---------------------------------------------------------------------

    @property
    def architecture(self) -> str:
        return str(self.require("general.architecture"))

    def require(self, key: str) -> Any:
        """The value of a metadata key that must be present."""
        if key not in self.metadata:
            raise MissingKey(f"required metadata key {quoted(key)} is missing",
                             path=self.path, field=key)
        return self.metadata[key]

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    # -- tensors ----------------------------------------------------------------------

    def tensor_info(self, name: str) -> TensorInfo:
        if name not in self.tensors:
            raise MissingKey(f"required tensor {quoted(name)} is missing", path=self.path,
                             field=name)
        return self.tensors[name]

    def tensor_bytes(self, tensor: str | TensorInfo) -> np.ndarray:
        """The raw bytes of a tensor (quantized blocks as stored), a read-only uint8 view of
        the map: by name, or by its `TensorInfo` (which may be a part, `TensorInfo.rows`)."""
        info = self.tensor_info(tensor) if isinstance(tensor, str) else tensor
        return np.frombuffer(self._mmap, dtype=np.uint8, count=info.n_bytes, offset=info.offset)

    def mapped_bytes(self, tensor: str | TensorInfo) -> np.ndarray:
        """A tensor's raw bytes read in place, for a backend that keeps them there (the
        cpu backend's experts): a writable uint8 view of a private, copy-on-write map of
        the file, so the kernels take it as they take their own arrays, while its pages
        stay the page cache's (never written, they are read from the file as touched,
        and the kernel may drop them under pressure). Not to be kept after `close()`."""
        info = self.tensor_info(tensor) if isinstance(tensor, str) else tensor
        if self._private is None:
            with open(self.path, "rb") as fh:
                self._private = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY)
        return np.frombuffer(self._private, dtype=np.uint8, count=info.n_bytes,
                             offset=info.offset)

    def drop_pages(self, tensor: str | TensorInfo) -> None:
        """Unmap a tensor's pages from this process once a copy of it is made (the cpu
        backend copies every tensor): file pages read through the map stay in its resident
        set until unmapped, so a loaded model would otherwise count twice there (an 8B Q4_K
        file: 9.4 GB peak RSS instead of 5). The page cache keeps them, and a later read
        through the map faults them back in, so this changes no data; pages shared with a
        neighbouring tensor are dropped too, equally harmlessly."""
        advise = getattr(mmap, "MADV_DONTNEED", None)
        if self._mmap is None or advise is None:
            return
        info = self.tensor_info(tensor) if isinstance(tensor, str) else tensor
        start = info.offset - info.offset % mmap.PAGESIZE
        end = min(info.offset + info.n_bytes, len(self._mmap))
        if end > start:
            with contextlib.suppress(OSError, ValueError):  # advice only
                self._mmap.madvise(advise, start, end - start)

    def close(self) -> None:
        for attr in ("_mmap", "_private"):
            mm = getattr(self, attr, None)
            if mm is not None:
                # A view still alive keeps the map; it is released when the last view goes.
                with contextlib.suppress(BufferError):
                    mm.close()
                setattr(self, attr, None)

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
