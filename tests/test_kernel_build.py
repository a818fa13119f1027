"""Kernel build: every CUDA C source compiles with NVRTC to a cubin for sm_80 and sm_90,
on a machine without a GPU (CI), and the Python side agrees with what was compiled.

- every source gives an ELF cubin (never PTX) defining the kernels SIGNATURES lists for it,
  and no kernel SIGNATURES does not know;
- every kernel's parameter table in the cubin (offset and size of each parameter) is the
  one SIGNATURES declares, so a launch never packs its arguments wrong;
- the on-disk cache returns the same image without compiling, is keyed by architecture and
  options, and rebuilds a corrupt entry;
- a source that does not compile raises KernelCompileError carrying NVRTC's log.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from kernels import nvrtc_build as nb
from kernels.cuda_kernels import SIGNATURES, expected_params
from kernels.cuda_ops import SAMPLE_PARAMS, SEQ_DESC

ARCHES = ("sm_80", "sm_90")

TINY = """
#include "common.cuh"
extern "C" __global__ void tiny(bf16* out, float x, int n) {
  if (threadIdx.x < n) out[threadIdx.x] = from_f32<bf16>(x);
}
"""


@pytest.fixture(scope="module")
def cubins() -> dict[tuple[str, str], nb.Cubin]:
    t0 = time.perf_counter()
    built = nb.compile_all(ARCHES)
    elapsed = time.perf_counter() - t0
    compiled = sum(not c.from_cache for c in built.values())
    print(f"\n{len(built)} cubins ({compiled} compiled, {len(built) - compiled} from the "
          f"cache {nb.cache_dir()}) in {elapsed:.1f} s with NVRTC {nb.nvrtc_version()}")
    return built


def test_nvrtc_and_runtime_headers_are_installed() -> None:
    major, _ = nb.nvrtc_version()
    assert major >= 12
    assert (nb.cuda_include_dir() / "cuda_bf16.h").is_file()


def test_headers_of_nvrtcs_cuda_version_are_preferred(tmp_path, monkeypatch) -> None:
    """Where CUDA 12 and 13 runtime headers are both installed, NVRTC 13 gets 13's,
    whichever comes first on sys.path; with no match the first found is used."""
    dirs = []
    for name, version in (("cu12", 12080), ("cu13", 13000)):
        d = tmp_path / name
        d.mkdir()
        (d / "cuda_bf16.h").write_text("")
        (d / "cuda_runtime_api.h").write_text(f"#define CUDART_VERSION {version}\n")
        dirs.append(d)
    monkeypatch.delenv("EAGERLM_CUDA_INCLUDE", raising=False)
    monkeypatch.setattr(nb, "_include_candidates", lambda: iter(dirs))
    nb.cuda_include_dir.cache_clear()
    try:
        for nvrtc_major, want in ((13, dirs[1]), (12, dirs[0]), (14, dirs[0])):
            monkeypatch.setattr(nb, "nvrtc_version", lambda m=nvrtc_major: (m, 0))
            nb.cuda_include_dir.cache_clear()
            assert nb.cuda_include_dir() == want
    finally:
        nb.cuda_include_dir.cache_clear()


def test_every_source_is_covered() -> None:
    assert set(nb.kernel_sources()) == {src for src, _ in SIGNATURES.values()}


@pytest.mark.parametrize("arch", ARCHES)
def test_every_kernel_compiles_to_a_cubin(cubins: dict, arch: str) -> None:
    for source in nb.kernel_sources():
        c = cubins[(source, arch)]
        assert c.image[:4] == b"\x7fELF", f"{source} for {arch} is not an ELF cubin"
        assert c.arch == arch
        expected = {name for name, (src, _) in SIGNATURES.items() if src == source}
        defined = c.symbols()
        assert expected <= defined, f"{source}.cu lacks {sorted(expected - defined)}"
        assert defined <= expected, f"{source}.cu defines kernels SIGNATURES does not " \
                                    f"declare: {sorted(defined - expected)}"


@pytest.mark.parametrize("arch", ARCHES)
def test_signatures_match_the_compiled_parameters(cubins: dict, arch: str) -> None:
    for name, (source, kinds) in SIGNATURES.items():
        params = cubins[(source, arch)].params()
        assert params[name] == expected_params(kinds), name


@pytest.mark.parametrize("arch", ARCHES)
def test_every_kernel_fits_an_sm_at_the_block_size_it_declares(cubins: dict,
                                                              arch: str) -> None:
    """Registers and launch bounds read from the cubins: a block of a kernel's
    `__launch_bounds__` (1024 threads where it declares none) fits the 64K-register file,
    so no launch of it within its bound fails with CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES."""
    checked = set()
    for (src, built_for), cubin in cubins.items():
        if built_for != arch:
            continue
        found = nb.cubin_resources(cubin.image)
        assert set(found) == cubin.symbols(), src
        for name, needs in found.items():
            assert 0 < needs.registers <= 255, name
            assert needs.block_fits(needs.thread_limit), (name, needs)
            checked.add(name)
    assert checked == set(SIGNATURES)


def test_launch_bounds_are_read_as_declared(cubins: dict) -> None:
    """The values the kernels' sources declare: attention_prefill.cu's 256 threads (8 warps),
    attention_decode.cu's 128, the sampler's 1024, and none for the elementwise kernels."""
    found = {k: v for (_src, arch), c in cubins.items() if arch == "sm_90"
             for k, v in nb.cubin_resources(c.image).items()}
    assert found["attention_prefill_hd128"].max_threads == 256
    assert found["attention_decode_hd64_g1"].max_threads == 128
    assert found["sample_rows"].max_threads == 1024
    assert found["swiglu"].max_threads is None


def test_a_block_fits_by_warps_of_registers_rounded_to_8() -> None:
    needs = nb.KernelResources(registers=250, max_threads=256)  # 256 a thread as allocated
    assert needs.block_fits(256) and not needs.block_fits(257)
    assert not nb.KernelResources(registers=65, max_threads=None).block_fits(1024)
    assert nb.KernelResources(registers=64, max_threads=None).block_fits(1024)
    assert nb.KernelResources(registers=129, max_threads=None).block_fits(480)  # 15 warps
    assert not nb.KernelResources(registers=129, max_threads=None).block_fits(481)


def test_structs_shared_with_the_kernels_have_the_compiled_size() -> None:
    # common.cuh and sampler.cu static_assert the same sizes: all three agree
    assert SEQ_DESC.itemsize == 24
    assert SAMPLE_PARAMS.itemsize == 32
    assert SAMPLE_PARAMS.fields["seed"][1] == 16
    assert SEQ_DESC.fields["kv_base"][1] == 16


def test_cache_returns_the_same_image_without_compiling(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("EAGERLM_CUBIN_CACHE", str(tmp_path))
    first = nb.compile_source(TINY, "tiny.cu", "sm_90")
    assert not first.from_cache
    assert (tmp_path / f"{first.key}.cubin").read_bytes() == first.image
    again = nb.compile_source(TINY, "tiny.cu", "sm_90")
    assert again.from_cache and again.image == first.image and again.key == first.key
    assert "tiny" in again.symbols()


def test_cache_key_covers_arch_options_and_source(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("EAGERLM_CUBIN_CACHE", str(tmp_path))
    a = nb.compile_source(TINY, "tiny.cu", "sm_90")
    b = nb.compile_source(TINY, "tiny.cu", "sm_80")
    c = nb.compile_source(TINY, "tiny.cu", "sm_90", options=["-DEXTRA=1"])
    d = nb.compile_source(TINY + "\n// changed\n", "tiny.cu", "sm_90")
    assert len({a.key, b.key, c.key, d.key}) == 4
    assert not any(x.from_cache for x in (b, c, d))


def test_corrupt_cache_entry_is_rebuilt(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("EAGERLM_CUBIN_CACHE", str(tmp_path))
    first = nb.compile_source(TINY, "tiny.cu", "sm_80")
    (tmp_path / f"{first.key}.cubin").write_bytes(b"not a cubin")
    again = nb.compile_source(TINY, "tiny.cu", "sm_80")
    assert not again.from_cache and again.image[:4] == b"\x7fELF"
    assert (tmp_path / f"{first.key}.cubin").read_bytes()[:4] == b"\x7fELF"


def test_compile_error_carries_the_nvrtc_log(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("EAGERLM_CUBIN_CACHE", str(tmp_path))
    broken = 'extern "C" __global__ void broken(float* x) {\n  x[0] = undeclared_name;\n}\n'
    with pytest.raises(nb.KernelCompileError) as info:
        nb.compile_source(broken, "broken.cu", "sm_90")
    err = info.value
    assert err.name == "broken.cu" and err.arch == "sm_90"
    assert "undeclared_name" in err.log and "error" in err.log
    assert "broken.cu(2)" in err.log  # file and line, as NVRTC reports them
    assert "undeclared_name" in str(err)
    assert not list(tmp_path.glob("*.cubin"))  # nothing cached


@pytest.mark.parametrize("arch,expected", [("sm_90", "sm_90"), ("90", "sm_90"), (80, "sm_80"),
                                           ((9, 0), "sm_90"), ("sm_90a", "sm_90a")])
def test_architecture_names(arch, expected) -> None:
    assert nb.normalize_arch(arch) == expected


@pytest.mark.parametrize("arch", ["compute_90", "sm90", "hopper", ""])
def test_virtual_or_unknown_architectures_are_refused(arch) -> None:
    with pytest.raises(ValueError):
        nb.normalize_arch(arch)


def test_cubin_reader_finds_kernels_and_parameters(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("EAGERLM_CUBIN_CACHE", str(tmp_path))
    c = nb.compile_source(TINY, "tiny.cu", "sm_80")
    assert c.symbols() == {"tiny"}
    assert c.params()["tiny"] == [(0, 8), (8, 4), (12, 4)]  # bf16*, float, int
    assert expected_params("pfi") == [(0, 8), (8, 4), (12, 4)]
    assert expected_params("pid") == [(0, 8), (8, 4), (16, 8)]


def test_bf16_bit_conversion_rounds_to_nearest_even() -> None:
    from kernels.cuda_ops import from_bf16_bits, to_bf16_bits

    x = np.array([1.0, -2.5, 1.00390625, 1.01171875, np.inf, np.nan, 3e38], np.float32)
    back = from_bf16_bits(to_bf16_bits(x))
    assert back[0] == 1.0 and back[1] == -2.5
    assert back[2] == 1.0  # halfway, rounds to even
    assert back[3] == 1.015625  # halfway, rounds to even (up)
    assert np.isinf(back[4]) and np.isnan(back[5])


def test_launch_packs_each_argument_into_its_own_slot() -> None:
    """What cuLaunchKernel receives: an array of pointers, one per parameter, each to the
    argument's bytes (ints, floats and doubles in their C representation)."""
    import ctypes

    from kernels.cuda_kernels import Kernel

    class FakeContext:
        def bind(self) -> None:
            pass

    seen = {}

    def fake_launch(fn, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
        ptrs = (ctypes.c_void_p * 5).from_address(params)
        seen["p"] = ctypes.c_uint64.from_address(ptrs[0]).value
        seen["i"] = ctypes.c_int32.from_address(ptrs[1]).value
        seen["f"] = ctypes.c_float.from_address(ptrs[2]).value
        seen["q"] = ctypes.c_int64.from_address(ptrs[3]).value
        seen["d"] = ctypes.c_double.from_address(ptrs[4]).value
        seen["grid"] = (gx, gy, gz, bx, by, bz, smem, extra)
        return (0,)

    k = Kernel("k", object(), "pifqd", FakeContext())  # type: ignore[arg-type]
    k._launch = fake_launch
    k.launch(None, (3, 2, 1), 128, 0xDEADBEEF00, -7, 1.5, -(1 << 40), 0.1, smem=96)
    assert seen == {"p": 0xDEADBEEF00, "i": -7, "f": 1.5, "q": -(1 << 40), "d": 0.1,
                    "grid": (3, 2, 1, 128, 1, 1, 96, 0)}
    with pytest.raises(TypeError):
        k.launch(None, 1, 1, 1, 2)


def test_staging_ring_waits_for_every_copy_it_overwrites() -> None:
    """The pinned upload ring (kernels/cuda_ops.py) never rewrites bytes that a queued copy
    has yet to read, also when it wraps past a tail the previous lap left in flight."""
    from kernels.cuda_ops import DeviceTensor, _StagingRing

    class Ev:
        def __init__(self, stream) -> None:
            self.stream, self.upto = stream, len(stream.copies)

        def synchronize(self) -> None:  # copies of one stream complete in order
            self.stream.done = max(self.stream.done, self.upto)

    class FakeStream:
        def __init__(self) -> None:
            self.copies: list[tuple[int, int]] = []
            self.done = 0

        def copy_h2d(self, dst, src, n, src_offset=0) -> None:
            lo, hi = src_offset, src_offset + n
            for a, b in self.copies[self.done:]:
                assert not (a < hi and lo < b), f"[{lo}, {hi}) rewrites in-flight [{a}, {b})"
            self.copies.append((lo, hi))

        def record(self, event) -> Ev:
            return Ev(self)

    class Host:
        def __init__(self, n: int) -> None:
            self.array, self.nbytes = np.zeros(n, np.uint8), n

    class FakeOps:
        class device:
            alloc_host = Host

            @staticmethod
            def event(timing: bool = False) -> None:
                return None

    rng = np.random.default_rng(0)
    for trial in range(200):
        ops = FakeOps()
        ops.stream = FakeStream()
        ring = _StagingRing(ops, nbytes=4096)  # type: ignore[arg-type]
        sizes = [1024, 1024, 1024, 1024, 3000, 1500] if trial == 0 else \
            rng.integers(1, 4097, 40) // rng.choice([1, 16], 40)
        for n in sizes:
            ring.upload(np.zeros(int(n), np.uint8), DeviceTensor(0, (int(n),), "u8"))
            if rng.random() < 0.1:  # the GPU catches up
                ops.stream.done = len(ops.stream.copies)
