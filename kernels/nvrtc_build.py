"""CUDA C kernel sources compiled by NVRTC straight to cubin, with an on-disk cache.

Why cubin and never PTX: the GPU machines run a CUDA 13.0 driver. A cubin built for the
device's `sm_XX` by an NVRTC of the same major version loads there as it is; PTX would be
JIT-compiled by the driver, which refuses PTX from a newer toolkit and costs start-up time
even when it accepts it. So every source is compiled for an explicit architecture
(`--gpu-architecture=sm_90`), and `nvrtcGetCUBIN` output is what gets loaded.

Sources live in `kernels/cuda/` (`*.cu`, with shared `*.cuh` headers). They include
`cuda_bf16.h` and friends from the `nvidia-cuda-runtime` wheel, found under site-packages
(`nvidia/cu13/include` for CUDA 13 wheels, `nvidia/cuda_runtime/include` for CUDA 12 ones)
or at `$EAGERLM_CUDA_INCLUDE`.

The cache is keyed by everything that changes the machine code: the source, every local
header, the options, the architecture, the NVRTC version and the runtime headers' version.
It lives in `$EAGERLM_CUBIN_CACHE`, else `$XDG_CACHE_HOME/eagerlm/cubin`, else
`~/.cache/eagerlm/cubin`; entries are written atomically, and a corrupt entry is rebuilt.
"""

from __future__ import annotations

import hashlib
import os
import re
import struct
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

from eagerlm.errors import DeviceUnavailable, EngineFailure

KERNEL_DIR = Path(__file__).resolve().parent / "cuda"
ELF_MAGIC = b"\x7fELF"

# -std=c++17 for `if constexpr` and templates; -lineinfo costs nothing at run time and lets
# profilers map SASS to source. No --use_fast_math: the ops are tested against a float32
# reference and the kernels use fast intrinsics (exp2f, rsqrtf) explicitly where they are
# accurate enough, so the rest keeps IEEE division, sqrt and denormals.
BASE_OPTIONS: tuple[str, ...] = ("--std=c++17", "-lineinfo", "--device-as-default-execution-space")


class KernelCompileError(EngineFailure):
    """NVRTC rejected a source; `log` holds NVRTC's own messages (file:line: error...)."""

    def __init__(self, name: str, arch: str, log: str) -> None:
        self.name = name
        self.arch = arch
        self.log = log
        super().__init__(f"NVRTC failed to compile {name} for {arch}:\n{log.strip()}")


class NvrtcUnavailable(DeviceUnavailable):
    """NVRTC or the CUDA runtime headers are not installed (pip install nvidia-cuda-nvrtc
    nvidia-cuda-runtime, or `pip install eagerlm[cuda]`)."""


def _nvrtc():
    try:
        from cuda.bindings import nvrtc
    except ImportError as exc:
        raise NvrtcUnavailable(f"cuda-python's NVRTC bindings are not importable: {exc}") from exc
    return nvrtc


def _check(result: tuple, call: str) -> object:
    err, *out = result
    if int(err) != 0:
        nvrtc = _nvrtc()
        _, name = nvrtc.nvrtcGetErrorString(err)
        raise RuntimeError(f"{call} failed: {name.decode() if isinstance(name, bytes) else name}")
    return out[0] if len(out) == 1 else tuple(out) if out else None


@cache
def nvrtc_version() -> tuple[int, int]:
    """(major, minor) of the NVRTC library that compiles; NvrtcUnavailable without one."""
    nvrtc = _nvrtc()
    try:
        result = nvrtc.nvrtcVersion()
    except Exception as exc:  # the bindings raise when libnvrtc cannot be loaded
        raise NvrtcUnavailable(
            f"libnvrtc cannot be loaded ({exc}); install nvidia-cuda-nvrtc") from exc
    major, minor = _check(result, "nvrtcVersion")
    return int(major), int(minor)


def _include_candidates() -> Iterable[Path]:
    env = os.environ.get("EAGERLM_CUDA_INCLUDE")
    if env:
        yield Path(env)
    for entry in sys.path:
        root = Path(entry) / "nvidia"
        yield root / "cu13" / "include"
        yield root / "cuda_runtime" / "include"
    yield Path("/usr/local/cuda/include")


def _headers_version(d: Path) -> int:
    """CUDART_VERSION (e.g. 13000) of the runtime headers in `d`; 0 if it says none."""
    text = (d / "cuda_runtime_api.h").read_text(errors="replace")
    m = re.search(r"#define\s+CUDART_VERSION\s+(\d+)", text)
    return int(m.group(1)) if m else 0


@cache
def cuda_include_dir() -> Path:
    """The directory holding `cuda_bf16.h` (nvidia-cuda-runtime's headers): one whose CUDA
    major version is NVRTC's where several are installed (NVRTC 13 with CUDA 12 headers,
    say, fails in ways that do not name the mismatch). EAGERLM_CUDA_INCLUDE always wins."""
    found = [d for d in dict.fromkeys(_include_candidates())
             if (d / "cuda_bf16.h").is_file() and (d / "cuda_runtime_api.h").is_file()]
    if not found:
        raise NvrtcUnavailable("CUDA runtime headers (cuda_bf16.h) not found: install "
                               "nvidia-cuda-runtime, or set EAGERLM_CUDA_INCLUDE")
    if os.environ.get("EAGERLM_CUDA_INCLUDE") and found[0] == Path(
            os.environ["EAGERLM_CUDA_INCLUDE"]):
        return found[0]
    try:
        major = nvrtc_version()[0]
    except NvrtcUnavailable:
        return found[0]
    return next((d for d in found if _headers_version(d) // 1000 == major), found[0])


@cache
def runtime_headers_version() -> int:
    """CUDART_VERSION of the headers the kernels include (part of the cache key)."""
    return _headers_version(cuda_include_dir())


def cache_dir() -> Path:
    env = os.environ.get("EAGERLM_CUBIN_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "eagerlm" / "cubin"


def normalize_arch(arch: str | int | tuple[int, int]) -> str:
    """'sm_90' from 'sm_90', '90', 90 or a compute capability (9, 0)."""
    if isinstance(arch, tuple):
        return f"sm_{arch[0]}{arch[1]}"
    text = str(arch)
    if text.startswith("sm_"):
        text = text[3:]
    if not re.fullmatch(r"\d{2,3}[a-z]?", text):
        raise ValueError(f"not a GPU architecture: {arch!r} (expected e.g. 'sm_90')")
    return f"sm_{text}"


def kernel_sources() -> list[str]:
    """Names (without .cu) of every kernel source, sorted."""
    return sorted(p.stem for p in KERNEL_DIR.glob("*.cu"))


@cache
def _headers_digest() -> str:
    h = hashlib.sha256()
    for p in sorted(KERNEL_DIR.glob("*.cuh")):
        h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


@dataclass(frozen=True)
class Cubin:
    """A compiled kernel source: the ELF image and where it came from."""

    name: str
    arch: str
    image: bytes
    key: str
    from_cache: bool
    compile_s: float = 0.0
    log: str = ""  # NVRTC warnings, if any

    def symbols(self) -> set[str]:
        return cubin_functions(self.image)

    def params(self) -> dict[str, list[tuple[int, int]]]:
        return cubin_params(self.image)


@dataclass
class CompileStats:
    compiled: int = 0
    cache_hits: int = 0
    seconds: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, c: Cubin) -> None:
        with self._lock:
            if c.from_cache:
                self.cache_hits += 1
            else:
                self.compiled += 1
                self.seconds += c.compile_s


STATS = CompileStats()


def cache_key(source: str, name: str, arch: str, options: Sequence[str]) -> str:
    major, minor = nvrtc_version()
    h = hashlib.sha256()
    for part in (source, name, arch, "\0".join(options), f"nvrtc {major}.{minor}",
                 f"cudart {runtime_headers_version()}", _headers_digest()):
        h.update(part.encode() + b"\0\1")
    return h.hexdigest()


def compile_source(source: str, name: str, arch: str | int | tuple[int, int], *,
                   options: Sequence[str] = (), use_cache: bool = True) -> Cubin:
    """Compile CUDA C `source` (named `name` in messages) to a cubin for `arch`.

    Raises KernelCompileError with NVRTC's log when the source does not compile.
    """
    arch = normalize_arch(arch)
    opts = [*BASE_OPTIONS, f"--gpu-architecture={arch}", f"-I{cuda_include_dir()}",
            f"-I{KERNEL_DIR}", *options]
    key = cache_key(source, name, arch, opts)
    path = cache_dir() / f"{key}.cubin"
    if use_cache:
        try:
            image = path.read_bytes()
        except OSError:
            image = b""
        if image.startswith(ELF_MAGIC):
            c = Cubin(name, arch, image, key, from_cache=True)
            STATS.add(c)
            return c
    t0 = time.perf_counter()
    image, log = _nvrtc_compile(source, name, arch, opts)
    c = Cubin(name, arch, image, key, from_cache=False,
              compile_s=time.perf_counter() - t0, log=log)
    STATS.add(c)
    if use_cache:
        _write_atomic(path, image)
    return c


def compile_kernel(name: str, arch: str | int | tuple[int, int], *,
                   defines: Sequence[tuple[str, str]] = (), use_cache: bool = True) -> Cubin:
    """Compile `kernels/cuda/<name>.cu` for `arch` (cached), with `-D<key>=<value>` for each
    of `defines` (kernels/cuda/quant_matrix.cu is compiled once per weight type so)."""
    src = KERNEL_DIR / f"{name}.cu"
    if not src.is_file():
        raise FileNotFoundError(f"no kernel source {src}")
    options = [f"-D{k}={v}" for k, v in defines]
    return compile_source(src.read_text(), f"{name}.cu", arch, options=options,
                          use_cache=use_cache)


def compile_all(jobs: Sequence[tuple[str, Sequence[tuple[str, str]]]],
                arches: Sequence[str | int], *, use_cache: bool = True,
                workers: int | None = None) -> list[Cubin]:
    """Each job (source name, defines) for every architecture, compiled in parallel (NVRTC
    releases the GIL while it compiles), in the order of `arches` then `jobs`."""
    work = [(src, tuple(defines), normalize_arch(a)) for a in arches for src, defines in jobs]
    workers = workers or max(1, min(len(work), os.cpu_count() or 1))
    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(
            lambda j: compile_kernel(j[0], j[2], defines=j[1], use_cache=use_cache), work))


def _nvrtc_compile(source: str, name: str, arch: str, opts: Sequence[str]) -> tuple[bytes, str]:
    nvrtc = _nvrtc()
    nvrtc_version()  # a clear NvrtcUnavailable before anything else
    prog = _check(nvrtc.nvrtcCreateProgram(source.encode(), name.encode(), 0, [], []),
                  "nvrtcCreateProgram")
    try:
        encoded = [o.encode() for o in opts]
        (err,) = nvrtc.nvrtcCompileProgram(prog, len(encoded), encoded)
        size = _check(nvrtc.nvrtcGetProgramLogSize(prog), "nvrtcGetProgramLogSize")
        buf = bytearray(int(size))
        _check(nvrtc.nvrtcGetProgramLog(prog, buf), "nvrtcGetProgramLog")
        log = bytes(buf).rstrip(b"\0").decode(errors="replace")
        if int(err) != 0:
            raise KernelCompileError(name, arch, log or f"nvrtcCompileProgram returned {err}")
        size = _check(nvrtc.nvrtcGetCUBINSize(prog), "nvrtcGetCUBINSize")
        image = bytearray(int(size))
        _check(nvrtc.nvrtcGetCUBIN(prog, image), "nvrtcGetCUBIN")
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
    if not image.startswith(ELF_MAGIC):
        raise KernelCompileError(name, arch, "NVRTC returned something that is not an ELF "
                                 "cubin (was a virtual architecture compute_XX given?)")
    return bytes(image), log


def _write_atomic(path: Path, data: bytes) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".cubin")
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only cache only costs recompiles


# -- reading cubins -------------------------------------------------------------------
# Enough ELF to list the kernels a cubin defines and their parameter layout, so tests
# (and the loader) can check that Python's idea of each kernel's arguments matches the
# compiled code: a wrong argument list is otherwise silent garbage on the device.

_EIATTR_MAX_THREADS = 0x05  # in .nv.info.<kernel>: __launch_bounds__' block, x y z
_EIATTR_KPARAM_INFO = 0x17
_EIATTR_REGCOUNT = 0x2F  # in .nv.info: (symbol index, registers per thread)
_STT_FUNC = 2
_SHT_SYMTAB = 2


def _sections(image: bytes) -> list[tuple[str, int, int, int, int]]:
    """(name, type, offset, size, link) of each section of an ELF64 little-endian file."""
    if not image.startswith(ELF_MAGIC) or image[4] != 2 or image[5] != 1:
        raise ValueError("not a 64-bit little-endian ELF image")
    shoff, = struct.unpack_from("<Q", image, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", image, 0x3A)
    raw = []
    for i in range(shnum):
        name, typ, _flags, _addr, off, size, link = struct.unpack_from(
            "<IIQQQQI", image, shoff + i * shentsize)
        raw.append((name, typ, off, size, link))
    _, _, str_off, _, _ = raw[shstrndx]

    def cstr(at: int) -> str:
        end = image.index(b"\0", at)
        return image[at:end].decode()

    return [(cstr(str_off + n), t, o, s, lk) for n, t, o, s, lk in raw]


def _symbols(image: bytes) -> list[tuple[str, int, int]]:
    """(name, st_info, section index) of each symbol, by symbol index."""
    secs = _sections(image)
    out = []
    for _name, typ, off, size, link in secs:
        if typ != _SHT_SYMTAB:
            continue
        str_off = secs[link][2]
        for at in range(off, off + size, 24):
            st_name, st_info, _other, shndx = struct.unpack_from("<IBBH", image, at)
            end = image.index(b"\0", str_off + st_name)
            out.append((image[str_off + st_name:end].decode(), st_info, shndx))
    return out


def _nv_info(image: bytes) -> Iterable[tuple[str, int, bytes]]:
    """(section, attribute, payload) of each record with a payload (EIFMT_SVAL) in the
    `.nv.info` sections: `.nv.info` itself (per-module) and `.nv.info.<kernel>`."""
    for name, _typ, off, size, _link in _sections(image):
        if name != ".nv.info" and not name.startswith(".nv.info."):
            continue
        at, end = off, off + size
        while at + 4 <= end:
            fmt, attr = image[at], image[at + 1]
            if fmt == 4:  # EIFMT_SVAL: u16 size, then the payload
                (n,) = struct.unpack_from("<H", image, at + 2)
                yield name, attr, image[at + 4:at + 4 + n]
                at += 4 + n
            elif fmt in (1, 2, 3):  # EIFMT_NVAL / BVAL / HVAL: no value or one inline, 4 bytes
                at += 4
            else:
                break


def cubin_functions(image: bytes) -> set[str]:
    """Names of the global functions (kernels) a cubin defines."""
    return {name for name, info, shndx in _symbols(image)
            if info & 0xF == _STT_FUNC and info >> 4 == 1 and shndx != 0}


def cubin_params(image: bytes) -> dict[str, list[tuple[int, int]]]:
    """Per kernel, its parameters as (offset, size) in bytes, in declaration order, read
    from the EIATTR_KPARAM_INFO records of its `.nv.info.<kernel>` section."""
    found: dict[str, dict[int, tuple[int, int]]] = {}
    for section, attr, payload in _nv_info(image):
        if section == ".nv.info":
            continue
        params = found.setdefault(section[len(".nv.info."):], {})
        if attr == _EIATTR_KPARAM_INFO and len(payload) >= 12:
            _index, ordinal, offset, flags = struct.unpack_from("<IHHI", payload)
            params[ordinal] = (offset, (flags >> 18) & 0x3FFF)
    return {k: [p[i] for i in sorted(p)] for k, p in found.items()}


@dataclass(frozen=True)
class KernelResources:
    """What a kernel needs of an SM, as compiled: registers per thread, and the most
    threads per block its `__launch_bounds__` allows (None: none declared, so 1024)."""

    registers: int
    max_threads: int | None

    @property
    def thread_limit(self) -> int:
        """The most threads a block of this kernel may have: its bound, or CUDA's 1024."""
        return self.max_threads or 1024

    def block_fits(self, threads: int, register_file: int = 65536) -> bool:
        """Whether a block of `threads` can launch: within the bound, and its registers
        (allocated per warp, per thread in units of 8) within the SM's register file."""
        if threads > self.thread_limit:
            return False
        warps = -(-threads // 32)
        return warps * 32 * (-(-self.registers // 8) * 8) <= register_file


def cubin_resources(image: bytes) -> dict[str, KernelResources]:
    """Per kernel, its registers (EIATTR_REGCOUNT) and launch bound (EIATTR_MAX_THREADS)."""
    symbols = _symbols(image)
    registers: dict[str, int] = {}
    bounds: dict[str, int] = {}
    for section, attr, payload in _nv_info(image):
        if section == ".nv.info" and attr == _EIATTR_REGCOUNT and len(payload) >= 8:
            index, count = struct.unpack_from("<II", payload)
            registers[symbols[index][0]] = count
        elif attr == _EIATTR_MAX_THREADS and len(payload) >= 12:
            x, y, z = struct.unpack_from("<III", payload)
            bounds[section[len(".nv.info."):]] = x * y * z
    return {k: KernelResources(r, bounds.get(k)) for k, r in registers.items()}


__all__ = [
    "KERNEL_DIR",
    "Cubin",
    "KernelCompileError",
    "KernelResources",
    "NvrtcUnavailable",
    "cache_dir",
    "compile_all",
    "compile_kernel",
    "compile_source",
    "cubin_functions",
    "cubin_params",
    "cubin_resources",
    "cuda_include_dir",
    "kernel_sources",
    "normalize_arch",
    "nvrtc_version",
]
