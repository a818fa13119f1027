"""The cpu kernels of every GGUF weight type: one registry row per type, and the compiled
module each row becomes.

A row names the loops a type runs (kernels/cpu_quant_loops.py for the block types, over
the type's decoder in kernels/cpu_block_decoders.py; kernels/cpu_float_loops.py for F16
and BF16, over a value loader, and for F32's products of a few rows: `FLOAT32`) and the
constants that specialise them. Adding a type is its decoder plus one row here.

`kernels(qtype)` returns the type's module of compiled kernels (`gemv`, `dequant`, and
`row_kernel_address()`, `gemv` as the decode replay calls it: kernels/cpu_row_kernel.py),
building it on first use: the template's loops below its `-- loops --` line, after the
row's binding lines, written to a real file and imported (why a file and not a closure:
kernels/cpu_quant_loops.py's docstring). The file's name carries a hash of everything
its code is made of (the template, the decoders, the SIMD operations, numba's options,
gguf-py's version for its tables), so an edit or an upgrade writes a new file and numba's
cache, which checks only that file's time stamp, never serves stale code; an unchanged
file is left as it is, so its kernels load from numba's cache. Only the types a model
holds are ever built (`cpu_compile.compile_kernels`).

Files live beside numba's cache (`numba.config.CACHE_DIR` where set, else the kernels'
`__pycache__`, else a temporary directory), in `eagerlm_kernels/`.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
import tempfile
import threading
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from types import ModuleType

import numba
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

Q = GGMLQuantizationType
_KERNELS_DIR = Path(__file__).resolve().parent
_LOOPS_MARK = "# -- loops:"
# the modules whose text the generated code is made of (besides its template)
_INGREDIENTS = ("cpu_block_decoders.py", "cpu_simd.py", "numba_settings.py", "iq_tables.py",
                "cpu_row_kernel.py", "cpu_panel_gemm.py")


@dataclass(frozen=True)
class BlockType:
    """How the cpu kernels compute with one GGUF type: `loops`, the template module
    (in eagerlm.kernels), and `binding`, the lines binding its names for this type;
    `activation_group`: 16 or 32 for the types whose `gemv` takes x as 8-bit codes with a
    scale and a sum per that many values (kernels/cpu_activations.py), 0 for those taking
    it as float32; `superblocks`: whether those activations have one scale per 256 values
    (`quantize_superblocks`, the 256-value superblock types, whose decoders give integer
    sub-scales) rather than per group; `gemv_rows`: up to how many rows of x its `gemv`
    beats float32 tiles times BLAS (kernels/quantized.py; measured, docs/performance.md);
    `prompt_run_rows`: 0 where more rows (a prompt) take the float32 tiles, else they
    take `gemv` too, in runs of that many rows of x, on machines without AVX-512
    (kernels/quantized.py's `PROMPT_RUNS`): where that measured faster on an AVX2 machine's
    prompts (the superblock types, whose integer sub-scales keep a superblock's dot
    products in integers; 32 rows for the IQ grid types, whose grids cost more to decode
    again for each run; 64 for IQ4_XS, whose signed codes cost its dot products one more
    instruction than the others', so that it gains on the tiles only in long runs; F16,
    whose register tiles beat its tiles' BLAS; not the 32-value blocks, a float
    multiply-add per 32 products, nor BF16, whose shifts cost more than F16C's
    conversions: docs/performance.md)."""

    qtype: GGMLQuantizationType
    loops: str
    binding: str
    activation_group: int
    superblocks: bool
    gemv_rows: int
    prompt_run_rows: int = 0
    # whether prompts may take 8-bit panels (kernels/quantized.py's `PROMPT_PANELS`): all
    # but Q1_0, whose 8-bit products of the llama.cpp fixture's prompt measured 2.9x
    # llama.cpp's own distance from the exact logits (KL; every other type 0.4-1.05x), so
    # its prompts keep float32 tiles (tests/test_types_vs_llama_cpp.py, 2026-11-28)
    panels: bool = True
    # whether its codes are signed (-128..127): AVX2's panels multiply them as magnitudes
    # and signs (kernels/cpu_panel_gemm.py), slower than the type's other path where it
    # has one (kernels/quantized.py's `SIGNED_PANELS`)
    signed: bool = False


def _blocks(qtype: GGMLQuantizationType, sub: int, code_max: int = 127, *, offset: int = 0,
            has_min: bool = False, signed: bool = False, prompt_run_rows: int = 0,
            panels: bool = True) -> BlockType:
    """A block type, decoded by `cpu_block_decoders.decode_<type>`: codes (0..code_max, at
    most 127, or -128..127 if `signed`) q per value and a scale sc per `sub` values, plus
    a minimum mn per `sub` values if `has_min`: value = sc * (q - offset) + mn. The
    256-value superblock types' scales are integers times the block's float scales
    (d * isc, -dmin * imn). `code_max` sets how many of AVX2's int16 pair sums the
    prompts' panels add before widening them (kernels/cpu_panel_gemm.py)."""
    block, block_bytes = GGML_QUANT_SIZES[qtype]
    superblocks = block == 256
    binding = (f"from eagerlm.kernels.cpu_block_decoders import decode_{qtype.name.lower()} "
               f"as decode_block\n\n"
               f"BLOCK, BLOCK_BYTES, SUB, HAS_MIN, CODE_OFFSET, SIGNED_CODES = "
               f"{block}, {block_bytes}, {sub}, {has_min}, {offset}, {signed}\n"
               f"INT_SCALES, CODE_MAX = {superblocks}, {code_max}\n")
    return BlockType(qtype, "cpu_quant_loops", binding, sub, superblocks, 24, prompt_run_rows,
                     panels, signed)


def _floats(qtype: GGMLQuantizationType, name: str, *, prompt_run_rows: int = 0) -> BlockType:
    """A float type, loaded by `cpu_simd.load_<name>` / `load_<name>x8`."""
    binding = (f"from eagerlm.kernels.cpu_simd import load_{name} as load_value\n"
               f"from eagerlm.kernels.cpu_simd import load_{name}x8 as load_values\n\n"
               f"VALUE_BYTES = {GGML_QUANT_SIZES[qtype][1]}\n")
    return BlockType(qtype, "cpu_float_loops", binding, 0, False, 8, prompt_run_rows)


BLOCK_TYPES: dict[GGMLQuantizationType, BlockType] = {t.qtype: t for t in (
    _floats(Q.F16, "f16", prompt_run_rows=16),
    _floats(Q.BF16, "bf16"),
    _blocks(Q.Q4_0, 32, 15, offset=8),
    _blocks(Q.Q4_1, 32, 15, has_min=True),
    _blocks(Q.Q5_0, 32, 31, offset=16),
    _blocks(Q.Q5_1, 32, 31, has_min=True),
    _blocks(Q.Q8_0, 32, signed=True),
    _blocks(Q.Q2_K, 16, 3, has_min=True, prompt_run_rows=16),
    _blocks(Q.Q3_K, 16, 7, offset=4, prompt_run_rows=16),
    _blocks(Q.Q4_K, 32, 15, has_min=True, prompt_run_rows=16),
    _blocks(Q.Q5_K, 32, 31, has_min=True, prompt_run_rows=16),
    _blocks(Q.Q6_K, 16, 63, offset=32, prompt_run_rows=16),
    _blocks(Q.IQ1_S, 32, 18, offset=9, prompt_run_rows=32),
    _blocks(Q.IQ1_M, 16, 18, offset=9, prompt_run_rows=32),
    _blocks(Q.IQ2_XXS, 32, 86, offset=43, prompt_run_rows=32),
    _blocks(Q.IQ2_XS, 16, 86, offset=43, prompt_run_rows=32),
    _blocks(Q.IQ2_S, 16, 86, offset=43, prompt_run_rows=32),
    _blocks(Q.IQ3_XXS, 32, 124, offset=62, prompt_run_rows=32),
    _blocks(Q.IQ3_S, 32, 30, offset=15, prompt_run_rows=32),
    _blocks(Q.IQ4_NL, 32, signed=True),
    _blocks(Q.IQ4_XS, 32, signed=True, prompt_run_rows=64),
    _blocks(Q.TQ1_0, 32, 2, offset=1, prompt_run_rows=16),
    _blocks(Q.TQ2_0, 32, 3, offset=1, prompt_run_rows=16),
    _blocks(Q.MXFP4, 32, 24, offset=12),
    _blocks(Q.NVFP4, 16, 24, offset=12),
    _blocks(Q.Q1_0, 32, 2, offset=1, panels=False),
)}

# F32 matrices are held as float32 arrays, not as blocks (kernels/cpu_backend.py's
# `keeps_blocks`): not a block type, but their products of up to `FIXED_ORDER_ROWS` rows
# run the float loops too (kernels/cpu_row_kernel.py's `float32_rows`), whose register
# tiles read a row of w once for four rows of x
FLOAT32 = _floats(Q.F32, "f32")

_built: dict[GGMLQuantizationType, ModuleType] = {}
_lock = threading.Lock()


def kernels(qtype: GGMLQuantizationType) -> ModuleType:
    """The compiled kernels of `qtype` (a module with `gemv` and `dequant`), built and
    imported on first use; KeyError for a type without a row (F32's is `FLOAT32`)."""
    module = _built.get(qtype)
    if module is None:
        with _lock:
            module = _built.get(qtype)
            if module is None:
                module = _built[qtype] = _import(
                    FLOAT32 if qtype == Q.F32 else BLOCK_TYPES[qtype])
    return module


def source(block_type: BlockType) -> str:
    """The text of `block_type`'s generated module."""
    template = (_KERNELS_DIR / f"{block_type.loops}.py").read_text()
    loops = template[template.index(_LOOPS_MARK):]
    name = block_type.qtype.name
    return (f'"""The cpu kernels of {name}: generated by eagerlm.kernels.cpu_kernel_registry '
            f'from kernels/{block_type.loops}.py. Do not edit."""\n\n'
            f"from __future__ import annotations\n\n{block_type.binding}\n{loops}")


def _import(block_type: BlockType) -> ModuleType:
    text = source(block_type)
    digest = hashlib.sha256(text.encode())
    for ingredient in _INGREDIENTS:
        digest.update((_KERNELS_DIR / ingredient).read_bytes())
    digest.update(f"gguf {version('gguf')}, numba {numba.__version__}".encode())
    stem = f"{block_type.qtype.name.lower()}_{digest.hexdigest()[:16]}"
    directory = _generated_dir()
    path = directory / f"{stem}.py"
    if not path.exists():
        # other versions' modules of the type stay: a process of that version (another
        # install sharing the cache, a server started before an upgrade) may still
        # compile from its module (the decode replay's row kernels compile on first use),
        # and numba cannot cache a function whose source file is gone ("no locator
        # available"). They are a few KB each, beside numba's own cache files of them.
        _write_atomically(path, text)
    name = f"eagerlm_kernels_{stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _generated_dir() -> Path:
    """Where generated modules go: beside numba's cache, in a directory this process can
    write."""
    base = Path(numba.config.CACHE_DIR) if numba.config.CACHE_DIR else _KERNELS_DIR / "__pycache__"
    for directory in (base / "eagerlm_kernels",
                      Path(tempfile.gettempdir()) / "eagerlm-numba-cache" / "eagerlm_kernels"):
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError:
            continue
        if os.access(directory, os.W_OK):
            return directory
    raise OSError("no writable directory for the cpu kernels' generated modules")


def _write_atomically(path: Path, text: str) -> None:
    """Write `text` to `path` through a temporary file and a rename, so that a process
    importing it concurrently sees the whole file or none."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}-", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
