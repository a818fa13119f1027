"""The cpu kernels give the same products whichever instructions the compiling machine has.

kernels/cpu_simd.py names x86 instructions where the machine has them and falls back to
generic LLVM IR elsewhere: the unscaled 8-bit dot products are one `vpdpbusd` on AVX-512
VNNI (or AVX-VNNI) machines, `vpmaddubsw` + `vpmaddwd` on AVX2 ones, generic IR on the
rest; the table lookups `vpshufb` or generic IR; the prompts' 8-bit panels
(kernels/cpu_panel_gemm.py) 512-bit `vpdpbusd`, AVX2's `vpmaddubsw` + `vpmaddwd` (their int16
pair sums added over several steps where the codes are small, the codes past 127 as
magnitudes and signs), or generic IR. The integer sums are
exact on every path (no pair sum of the callers' codes saturates int16) and the
float32 work around them is written in one order (numba_settings.JIT_ORDERED), so the
products, and the tokens a model gives, are the same bits on every machine with fused
multiply-adds. Each narrower
path is compiled here in a new process told to compile for an older CPU (numba's
NUMBA_CPU_NAME / NUMBA_CPU_FEATURES, an empty cache), where this machine can run its
code, and compared with this process's products; so is its float16 conversion, against
numpy's, on every bit pattern (without F16C, LLVM's `fpext` of a float16 is a call of a
runtime helper that numba does not link: every block type's kernels crashed).
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from numba import njit

from eagerlm.kernels import quantized
from eagerlm.kernels.cpu_simd import half_to_float, host_features
from eagerlm.kernels.quantized import quantized_linear
from tests.test_cpu_quantized import assert_within_derived_bounds, random_matrix

# a signed and an unsigned 32-value type (`dot_signed`, `dot_unsigned`), one by table
# (`lut16`), two superblock types (`dot_unsigned_scaled`), a float type; for the panels,
# codes past 127 (Q8_0, IQ4_NL), and pair sums added in int16 over 8 steps (Q4_0, Q4_K)
# and over 2 (Q6_K)
TYPES = (Q.Q8_0, Q.Q4_0, Q.IQ4_NL, Q.Q4_K, Q.Q6_K, Q.F16)
FLOAT_TYPES = (Q.F16,)
ROWS, COLS = 48, 512
# what an older x86-64 has: the AVX2 generation (no AVX-512, no VNNI: the same bits as
# this machine's), and SSSE3 only (no FMA either: multiply-adds round twice, so within the
# products' derived bounds instead, tests/test_cpu_quantized.py)
_AVX2 = "+sse2,+sse3,+ssse3,+sse4.1,+sse4.2,+popcnt,+cx16,+avx,+avx2,+fma,+f16c,+bmi,+bmi2," \
    "+lzcnt,+movbe"
CPUS = {
    "avx2": ("haswell", _AVX2),
    # AVX-512 without VNNI (Skylake-SP): the AVX2 panels, their other operations 512 bits
    "avx512": ("skylake-avx512", _AVX2 + ",+avx512f,+avx512bw,+avx512vl,+avx512dq,+avx512cd"),
    "ssse3": ("core2", "+sse2,+sse3,+ssse3,+cx16"),
}

_PRODUCTS = """
import sys
import numpy as np
from eagerlm.kernels import quantized
from eagerlm.kernels.quantized import quantized_linear
quantized.PROMPT_PANELS, quantized.SIGNED_PANELS = True, True
from tests.test_cpu_instruction_sets import every_half, inputs
out = {"halves": every_half()}
for qtype, w, xs in inputs():
    for x in xs:
        out[f"{qtype.name}-{len(x)}"] = quantized_linear(x, w)
np.savez(sys.argv[1], **out)
"""


@njit(cache=False)
def _halves(out: np.ndarray) -> None:
    for bits in range(len(out)):
        out[bits] = half_to_float(bits)


def every_half() -> np.ndarray:
    """Every float16 bit pattern through `cpu_simd.half_to_float` (`vcvtph2ps` where the
    machine has F16C, integer operations where it does not), as float32."""
    out = np.empty(1 << 16, np.float32)
    _halves(out)
    return out


def inputs():
    """Each type's matrix and rows of x: one row (decode), five (a batch) and, for the
    block types, 30 (a prompt: the 8-bit panels, kernels/cpu_panel_gemm.py, taken here
    whatever the machine: `vpdpbusd` on 512-bit VNNI, generic vector code elsewhere)."""
    for qtype in TYPES:
        rng = np.random.default_rng(int(qtype) + 40)
        w = random_matrix(qtype, ROWS, COLS, rng)
        rows = (1, 5) if qtype in FLOAT_TYPES else (1, 5, 30)
        yield qtype, w, [rng.standard_normal((n, COLS)).astype(np.float32) for n in rows]


@pytest.mark.slow
@pytest.mark.parametrize("cpu", sorted(CPUS))
def test_an_older_cpus_kernels_agree_with_this_machines(cpu, tmp_path, monkeypatch):
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("x86-64 instruction sets")
    name, features = CPUS[cpu]
    wanted = {f[1:] for f in features.split(",")}
    if not wanted <= host_features():
        pytest.skip(f"this machine cannot run {cpu} code")
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "cache"), "NUMBA_CPU_NAME": name,
           "NUMBA_CPU_FEATURES": features}
    out = tmp_path / "products.npz"
    subprocess.run([sys.executable, "-c", _PRODUCTS, str(out)], env=env, check=True,
                   capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1])
    theirs = np.load(out)
    assert len(theirs.files) == 3 * len(TYPES) - len(FLOAT_TYPES) + 1
    monkeypatch.setattr(quantized, "PROMPT_PANELS", True)
    monkeypatch.setattr(quantized, "SIGNED_PANELS", True)
    # numpy's float16 conversion, the independent reference: the same bits but for the
    # NaNs, NaNs either way (F16C's conversion quiets a signalling NaN, numpy's does not)
    halves = np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(np.float32)
    nan = np.isnan(halves)
    assert np.isnan(theirs["halves"][nan]).all()
    np.testing.assert_array_equal(theirs["halves"][~nan].view(np.uint32),
                                  halves[~nan].view(np.uint32))
    for qtype, w, xs in inputs():
        for x in xs:
            key = f"{qtype.name}-{len(x)}"
            if "fma" in wanted:
                mine = quantized_linear(x, w)
                np.testing.assert_array_equal(theirs[key].view(np.uint32),
                                              mine.view(np.uint32), err_msg=key)
            else:
                assert_within_derived_bounds(theirs[key], x, w)
