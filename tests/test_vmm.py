"""The virtual-memory KV cache, specified once and run on both backends.

Data goes in and out of regions through device copies, so the same test reads the same way on
the host (memfd pages) and on a GPU (cuMemCreate pages); the cuda variants skip with
"no CUDA device" where there is none and must pass on a GPU. Host-only tests at the end pin
down what only the host has: numpy views into the pages, and their safety.

The layout is chosen per device so one token is 3/32 of a page: tokens straddle page
boundaries (10.67 tokens per page) on both backends, the case a token-major layout must get
right.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from eagerlm.vmm.cuda_driver import NoCudaDevice
from eagerlm.vmm.device import Device, Memory, MemoryRange, Stream, open_device
from eagerlm.vmm.host_views import ViewsAlive
from eagerlm.vmm.kv_layout import ContiguousKV, KVLayout
from eagerlm.vmm.kv_region import KVRegion, RegionState, RegionStateError
from eagerlm.vmm.page_pool import OutOfPages, PagePool

BACKENDS = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
HOST_PAGE = 4096


@pytest.fixture(params=BACKENDS)
def device(request: pytest.FixtureRequest) -> Iterator[Device]:
    try:
        dev = open_device(request.param, page_size=HOST_PAGE if request.param == "cpu" else None)
    except NoCudaDevice:
        pytest.skip("no CUDA device")
    yield dev
    dev.close()


@pytest.fixture
def cpu() -> Iterator[Device]:
    dev = open_device("cpu", page_size=HOST_PAGE)
    yield dev
    dev.close()


def layout_for(device: Device) -> KVLayout:
    """3 layers, 2 KV heads, float32; 48 * head_dim bytes a token = 3/32 of a page."""
    return KVLayout(3, 2, device.page_size // 512, np.dtype(np.float32))


def pages_for(region: KVRegion, n_tokens: int) -> int:
    return -(-n_tokens * region.token_bytes // region.pool.page_size)


def pattern(layout: KVLayout, seeds: np.ndarray | int, start: int, n: int) -> np.ndarray:
    """Distinct uint32 words for tokens start .. start+n-1, each tagged with its seed."""
    seeds = np.broadcast_to(np.asarray(seeds, dtype=np.uint32), (n,))
    per_token = int(np.prod(layout.token_shape))
    pos = np.arange(start, start + n, dtype=np.uint32)[:, None]
    words = (seeds[:, None] * np.uint32(2654435761)) ^ (pos * np.uint32(40503)) \
        ^ np.arange(per_token, dtype=np.uint32)[None, :]
    return words.reshape(n, *layout.token_shape)


class KVIO:
    """Reads and writes device memory through host buffers and stream copies."""

    def __init__(self, device: Device) -> None:
        self.device = device
        self.stream: Stream = device.stream("test-io")

    def write(self, dst: Memory, offset: int, data: np.ndarray) -> None:
        host = self.device.alloc_host(data.nbytes)
        host.array[:] = np.ascontiguousarray(data).view(np.uint8).ravel()
        self.stream.copy_h2d(dst, host, data.nbytes, dst_offset=offset)
        self.stream.synchronize()
        host.free()

    def read(self, src: Memory, offset: int, nbytes: int) -> np.ndarray:
        host = self.device.alloc_host(nbytes)
        self.stream.copy_d2h(host, src, nbytes, src_offset=offset)
        self.stream.synchronize()
        out = host.array.copy()
        host.free()
        return out

    def write_tokens(self, region: KVRegion, start: int, words: np.ndarray) -> None:
        self.write(region.memory, start * region.token_bytes, words)

    def read_tokens(self, region: KVRegion, start: int, n: int) -> np.ndarray:
        raw = self.read(region.memory, start * region.token_bytes, n * region.token_bytes)
        return raw.view(np.uint32).reshape(n, *region.layout.token_shape)


@pytest.fixture
def io(device: Device) -> KVIO:
    return KVIO(device)


# -- VirMem and PhyMem ----------------------------------------------------------------


def test_map_unmap_remap_keeps_data(device: Device, io: KVIO) -> None:
    ps = device.page_size
    vm = device.reserve(4 * ps)
    a, b = device.alloc_pages(2)
    vm.map(0, a)
    vm.map(ps, b)
    data = np.random.default_rng(0).integers(0, 256, 2 * ps, dtype=np.uint8)
    io.write(MemoryRange(vm.base, 2 * ps), 0, data)

    assert vm.unmap(0) is a and a.refs == 0
    assert vm.is_vacant(0) and not vm.is_vacant(ps)
    vm.map(3 * ps, a)  # the same physical page, elsewhere in the range
    assert a.refs == 1
    assert np.array_equal(io.read(MemoryRange(vm.base + 3 * ps, ps), 0, ps), data[:ps])
    assert np.array_equal(io.read(MemoryRange(vm.base + ps, ps), 0, ps), data[ps:])

    with pytest.raises(ValueError, match="already mapped"):
        vm.map(ps, a)
    with pytest.raises(ValueError, match="vacant"):
        vm.unmap(0)
    with pytest.raises(ValueError):
        vm.map(4 * ps, a)  # past the end of the range
    assert set(vm.mapped) == {ps, 3 * ps}

    for page in vm.unmap_all():
        page.release()
    vm.free()


# -- growing regions ------------------------------------------------------------------


def test_region_grows_page_by_page_and_keeps_what_was_written(device: Device, io: KVIO) -> None:
    layout = layout_for(device)
    pool = PagePool(device, 32)
    region = pool.new_region(layout, 200)
    base = region.base_ptr
    written = 0
    for n in [1, 5, 10, 11, 12, 40, 64, 65, 100, 200]:
        region.ensure(n)
        assert region.n_pages == pages_for(region, n)
        assert region.capacity >= n
        assert region.mapped_bytes - region.live_bytes < pool.page_size, "tail under a page"
        io.write_tokens(region, written, pattern(layout, 1, written, n - written))
        written = n
        assert np.array_equal(io.read_tokens(region, 0, n), pattern(layout, 1, 0, n))
    assert region.base_ptr == base, "growth never moves the session"
    with pytest.raises(ValueError):
        region.ensure(201)
    region.release()
    assert pool.stats().pages_free == 32
    pool.audit()
    pool.close()


def test_ensure_can_map_ahead_without_counting_it_live(device: Device) -> None:
    layout = layout_for(device)
    pool = PagePool(device, 8)
    region = pool.new_region(layout, 100)
    assert region.ensure(10, ahead=22) == pages_for(region, 32)
    assert region.n_tokens == 10 and region.capacity >= 32
    assert region.ensure(30) == 0, "already mapped ahead"
    pool.close()


def test_out_of_pages_is_typed_and_changes_nothing(device: Device, io: KVIO) -> None:
    layout = layout_for(device)
    pool = PagePool(device, 4)
    a, b = pool.new_region(layout, 100), pool.new_region(layout, 100)
    a.ensure(30)  # 3 pages
    b.ensure(10)  # 1 page: the pool is empty
    io.write_tokens(b, 0, pattern(layout, 2, 0, 10))
    before = pool.stats()

    with pytest.raises(OutOfPages) as info:
        b.ensure(25)  # needs 2 more
    assert (info.value.wanted, info.value.free) == (2, 0)
    assert (b.n_pages, b.n_tokens, b.capacity) == (1, 10, 10)
    assert pool.stats() == before
    pool.audit()

    a.release()  # the scheduler frees a session and retries
    b.ensure(25)
    assert b.n_pages == 3
    assert np.array_equal(io.read_tokens(b, 0, 10), pattern(layout, 2, 0, 10))
    pool.close()


# -- deferred reclamation -------------------------------------------------------------


def test_released_pages_return_only_after_the_last_rounds_event(device: Device,
                                                                 io: KVIO) -> None:
    layout = layout_for(device)
    pool = PagePool(device, 8)
    region = pool.new_region(layout, 100)
    region.ensure(40)  # 4 pages
    n = region.n_pages
    host = device.alloc_host(region.live_bytes)
    host.array[:] = 1

    compute = device.stream("compute")
    gate = compute.gate()  # the last round is still running
    compute.copy_h2d(region.memory, host, region.live_bytes)  # ...and writes the region
    last_round = compute.record()
    region.release(after=last_round)

    assert region.state is RegionState.RELEASING
    assert pool.reclaim() == 0
    st = pool.stats()
    assert (st.pages_free, st.pages_pending, st.regions_pending) == (8 - n, n, 1)
    with pytest.raises(RegionStateError):
        region.ensure(50)

    gate.open()
    last_round.synchronize()
    assert pool.reclaim() == n
    st = pool.stats()
    assert (st.pages_free, st.pages_pending, st.regions_pending) == (8, 0, 0)
    assert region.state is RegionState.RELEASED
    host.free()
    pool.audit()
    pool.close()


# -- prefix sharing -------------------------------------------------------------------


def test_prefix_sharing_maps_whole_pages_and_copies_the_partial_one(device: Device,
                                                                    io: KVIO) -> None:
    layout = layout_for(device)
    pool = PagePool(device, 16)
    a = pool.new_region(layout, 100)
    a.ensure(30)
    io.write_tokens(a, 0, pattern(layout, 1, 0, 30))

    b = pool.new_region(layout, 100)
    shared = b.share_prefix_from(a, 25)  # 25 tokens = 2.34 pages
    assert shared == 2
    assert b.n_tokens == 25 and b.n_pages == 3
    st = pool.stats()
    assert (st.pages_shared, st.pages_mapped) == (2, a.n_pages + 1)
    assert np.array_equal(io.read_tokens(b, 0, 25), pattern(layout, 1, 0, 25))

    b.ensure(40)  # b continues differently from a after the prefix
    io.write_tokens(b, 25, pattern(layout, 2, 25, 15))
    assert np.array_equal(io.read_tokens(a, 0, 30), pattern(layout, 1, 0, 30))
    assert np.array_equal(io.read_tokens(b, 25, 15), pattern(layout, 2, 25, 15))

    a.release()  # the shared pages stay with b
    st = pool.stats()
    assert (st.pages_shared, st.pages_mapped) == (0, b.n_pages)
    assert np.array_equal(io.read_tokens(b, 0, 25), pattern(layout, 1, 0, 25))
    b.release()
    assert pool.stats().pages_free == 16
    pool.audit()
    pool.close()


def test_sharing_a_page_aligned_prefix_copies_nothing(device: Device, io: KVIO) -> None:
    layout = layout_for(device)
    pool = PagePool(device, 8)
    a = pool.new_region(layout, 100)
    a.ensure(40)
    io.write_tokens(a, 0, pattern(layout, 1, 0, 40))
    b = pool.new_region(layout, 100)
    assert b.share_prefix_from(a, 32) == 3  # 32 tokens are exactly 3 pages
    assert b.n_pages == 3 and pool.stats().pages_shared == 3
    assert np.array_equal(io.read_tokens(b, 0, 32), pattern(layout, 1, 0, 32))
    pool.close()


# -- swapping -------------------------------------------------------------------------


def test_swap_round_trip_is_bit_exact(device: Device, io: KVIO) -> None:
    layout = layout_for(device)
    pool = PagePool(device, 8)
    region = pool.new_region(layout, 100)
    region.ensure(37)
    words = np.random.default_rng(7).integers(0, 2**32, (37, *layout.token_shape),
                                              dtype=np.uint32)
    io.write_tokens(region, 0, words)
    base = region.base_ptr

    region.swap_out()
    assert region.state is RegionState.SWAPPED
    assert (region.n_pages, region.capacity) == (0, 0)
    st = pool.stats()
    assert (st.pages_free, st.swapped_bytes, st.regions_swapped) == (8, 37 * layout.token_bytes,
                                                                     1)
    with pytest.raises(RegionStateError):
        _ = region.memory

    region.swap_in()
    assert region.state is RegionState.ACTIVE and region.base_ptr == base
    assert np.array_equal(io.read_tokens(region, 0, 37), words)
    pool.audit()
    pool.close()


def test_swap_in_without_free_pages_stays_swapped(device: Device, io: KVIO) -> None:
    layout = layout_for(device)
    pool = PagePool(device, 4)
    region = pool.new_region(layout, 100)
    region.ensure(30)
    io.write_tokens(region, 0, pattern(layout, 3, 0, 30))
    region.swap_out()
    other = pool.new_region(layout, 100)
    other.ensure(40)  # takes all 4 pages

    with pytest.raises(OutOfPages):
        region.swap_in()
    assert region.state is RegionState.SWAPPED
    pool.audit()

    other.release()
    region.swap_in()
    assert np.array_equal(io.read_tokens(region, 0, 30), pattern(layout, 3, 0, 30))
    pool.close()


# -- reservations, sizing, stats ------------------------------------------------------


def test_virtual_reservations_are_recycled(device: Device) -> None:
    layout = layout_for(device)
    pool = PagePool(device, 4)
    a = pool.new_region(layout, 100)
    base = a.base_ptr
    a.ensure(10)
    a.release()
    b = pool.new_region(layout, 100)
    assert b.base_ptr == base and b.n_pages == 0
    assert pool.stats().reservations_total == 1
    c = pool.new_region(layout, 100)  # b holds the first range
    d = pool.new_region(layout, 1000)  # another size, another range
    assert len({b.base_ptr, c.base_ptr, d.base_ptr}) == 3
    for r in (b, c, d):
        r.release()
    st = pool.stats()
    assert (st.reservations_total, st.reservations_free) == (3, 3)
    pool.close()


def test_pool_is_sized_from_a_budget_or_the_free_memory(cpu: Device,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    ps = cpu.page_size
    assert PagePool.with_budget(cpu, 10 * ps + 100).n_pages == 10
    monkeypatch.setattr(cpu, "mem_info", lambda: (100 * ps, 200 * ps))
    pool = PagePool.from_free_memory(cpu, memory_fraction=0.5, keep_bytes=10 * ps)
    assert pool.n_pages == 40
    with pytest.raises(ValueError):
        PagePool.from_free_memory(cpu, memory_fraction=1.5)


def test_stats_report_live_and_mapped_bytes_and_map_latency(device: Device) -> None:
    layout = layout_for(device)
    pool = PagePool(device, 16)
    a, b = pool.new_region(layout, 100), pool.new_region(layout, 100)
    a.ensure(30)
    b.ensure(5)
    st = pool.stats()
    assert (st.pages_total, st.pages_free, st.pages_mapped) == (16, 12, 4)
    assert st.live_kv_bytes == 35 * layout.token_bytes
    assert st.mapped_bytes == 4 * pool.page_size
    assert st.live_fraction == pytest.approx(35 * 3 / 32 / 4)
    assert st.maps == 4 and st.map_mean_us > 0 and st.map_max_us >= st.map_mean_us
    a.release()
    assert pool.stats().unmaps == 3
    pool.close()


# -- the model-based test -------------------------------------------------------------


def test_random_sessions_never_leak_a_page(device: Device, io: KVIO) -> None:
    """Many sessions growing, sharing, swapping and releasing (now or after an event) in a
    random order against a model of what each holds: after every step the pool's accounting
    is exact, every live session reads back what was written, and at the end every page is
    free again."""
    rng = np.random.default_rng(2024)
    layout = layout_for(device)
    pool = PagePool(device, 16)
    compute = device.stream("compute")
    gate = None
    content: dict[KVRegion, np.ndarray] = {}  # live region -> seed of each position
    next_seed = 1

    def active() -> list[KVRegion]:
        return [r for r in content if r.state is RegionState.ACTIVE]

    def check(r: KVRegion) -> None:
        seeds = content[r]
        if len(seeds):
            got = io.read_tokens(r, 0, len(seeds))
            assert np.array_equal(got, pattern(layout, seeds, 0, len(seeds)))

    for step in range(600):
        op = rng.choice(["new", "grow", "grow", "grow", "release", "release_later", "share",
                         "swap", "reclaim", "hold"])
        live = active()
        if op == "new" and len(content) < 8:
            content[pool.new_region(layout, 120)] = np.zeros(0, np.uint32)
        elif op == "grow" and live:
            r = live[rng.integers(len(live))]
            n = min(120, r.n_tokens + int(rng.integers(1, 30)))
            pages, free = r.n_pages, pool.n_free
            try:
                r.ensure(n)
            except OutOfPages:
                assert (r.n_pages, pool.n_free) == (pages, free)
            else:
                seeds = np.full(n - len(content[r]), next_seed, np.uint32)
                next_seed += 1
                io.write_tokens(r, len(content[r]), pattern(layout, seeds, len(content[r]),
                                                            len(seeds)))
                content[r] = np.concatenate([content[r], seeds])
        elif op in ("release", "release_later") and content:
            r = list(content)[rng.integers(len(content))]
            r.release(after=compute.record() if op == "release_later" else None)
            del content[r]
        elif op == "share" and live and len(content) < 8:
            src = live[rng.integers(len(live))]
            k = int(rng.integers(0, src.n_tokens + 1))
            dst = pool.new_region(layout, 120)
            try:
                dst.share_prefix_from(src, k)
            except OutOfPages:
                dst.release()
            else:
                content[dst] = content[src][:k].copy()
        elif op == "swap" and content:
            r = list(content)[rng.integers(len(content))]
            if gate is not None:  # swapping waits for the rounds in flight: let them finish
                gate.open()
                gate = None
            if r.state is RegionState.ACTIVE:
                r.swap_out(after=compute.record())
            else:
                try:
                    r.swap_in()
                except OutOfPages:
                    assert r.state is RegionState.SWAPPED
        elif op == "reclaim":
            pool.reclaim()
        elif op == "hold":  # hold the compute stream for a while, or let it go
            if gate is None:
                gate = compute.gate()
            else:
                gate.open()
                gate = None

        pool.audit()
        st = pool.stats()
        assert st.pages_free + st.pages_mapped == st.pages_total
        for r in active():
            assert r.n_pages == pages_for(r, r.n_tokens)
        if step % 20 == 0:
            for r in active():
                check(r)

    for r in active():
        check(r)
    if gate is not None:
        gate.open()
    for r in list(content):
        r.release(after=compute.record())
    compute.synchronize()
    pool.reclaim()
    st = pool.stats()
    assert (st.pages_free, st.pages_mapped, st.regions_pending) == (16, 0, 0)
    assert st.reservations_free == st.reservations_total
    pool.audit()
    pool.close()


# -- host only: numpy views and their safety -------------------------------------------


def test_host_shared_pages_are_real_shared_memory(cpu: Device) -> None:
    layout = layout_for(cpu)
    pool = PagePool(cpu, 8)
    a = pool.new_region(layout, 100)
    a.ensure(30)
    b = pool.new_region(layout, 100)
    b.share_prefix_from(a, 25)
    a.k(0)[3] = 1.5  # written through one mapping...
    assert np.all(b.k(0)[3] == 1.5)  # ...seen through the other
    b.v(2)[20] = -2.0
    assert np.all(a.v(2)[20] == -2.0)
    a.k(1)[24] = 9.0  # the partial page was copied: not shared
    assert not np.any(b.k(1)[24] == 9.0)


def test_no_numpy_view_outlives_its_mapping(cpu: Device) -> None:
    layout = layout_for(cpu)
    pool = PagePool(cpu, 8)
    region = pool.new_region(layout, 100)
    region.ensure(20)
    held = region.k(1)[2:5]  # a slice of a view counts too

    with pytest.raises(ViewsAlive):
        region.release()
    with pytest.raises(ViewsAlive):
        region.swap_out()
    with pytest.raises(ViewsAlive):
        pool.close()
    held[:] = 3.0  # nothing was unmapped: the view is still good
    assert region.k(1)[3, 0, 0] == 3.0
    del held

    region.swap_out()
    region.swap_in()
    late = region.v(0)
    region.release(after=cpu.event())  # the event is complete, the view is not dropped
    assert pool.reclaim() == 0
    assert pool.stats().regions_pending == 1
    late[0] = 1.0  # still mapped
    del late
    assert pool.reclaim() == 2

    for use in (lambda: region.k(0), region.tokens, lambda: region.k_view(0),
                lambda: region.memory, lambda: region.ensure(5)):
        with pytest.raises(RegionStateError):
            use()
    pool.close()


def test_a_queued_copy_keeps_the_region_mapped(cpu: Device) -> None:
    pool = PagePool(cpu, 8)
    region = pool.new_region(layout_for(cpu), 100)
    region.ensure(20)
    host = cpu.alloc_host(region.live_bytes)
    s = cpu.stream()
    gate = s.gate()
    s.copy_d2h(host, region.memory, region.live_bytes)  # queued, not run yet
    with pytest.raises(ViewsAlive):
        region.release()  # would unmap under the queued copy
    gate.open()
    s.synchronize()
    region.release()
    pool.close()


def test_ops_on_a_stream_thread_while_the_control_thread_maps_ahead(cpu: Device) -> None:
    """The eager pattern on the host: a stream thread writes each round's KV through views
    while the control thread maps pages for the next rounds and finally releases the region
    after the last round's event. Nothing is lost, nothing crashes, every page comes back."""
    layout = layout_for(cpu)
    pool = PagePool(cpu, 16)
    region = pool.new_region(layout, 150)
    compute = cpu.stream("compute")

    def write_round(pos: int) -> None:
        for layer in range(layout.n_layers):
            region.k(layer)[pos] = pos
            region.v(layer)[pos] = -pos

    for pos in range(150):
        region.ensure(pos + 1, ahead=8)  # map ahead while earlier rounds still run
        compute.submit(lambda pos=pos: write_round(pos))
    last_round = compute.record()
    compute.synchronize()
    expected = np.arange(150, dtype=np.float32)
    for layer in range(layout.n_layers):
        assert np.array_equal(region.k(layer)[:150, 0, 0], expected)
        assert np.array_equal(region.v(layer)[:150, 1, -1], -expected)
    region.release(after=last_round)
    assert pool.reclaim() == 15  # 150 tokens of 3/32 page
    assert pool.stats().pages_free == 16
    pool.close()


def test_views_cover_only_mapped_pages(cpu: Device) -> None:
    layout = layout_for(cpu)
    pool = PagePool(cpu, 8)
    region = pool.new_region(layout, 100)
    region.ensure(11)  # 2 pages: 21 whole tokens
    assert region.capacity == 21 == region.k(0).shape[0]
    with pytest.raises(IndexError):
        region.k(0)[21]
    region.ensure(22)  # grows: new views see the new pages
    assert region.k(2).shape[0] == 32
    pool.close()


def test_layer_views_give_kernels_pointers_and_strides(device: Device) -> None:
    layout = layout_for(device)
    pool = PagePool(device, 8)
    region = pool.new_region(layout, 100)
    region.ensure(20)
    item = layout.dtype.itemsize
    v = region.v_view(2)
    assert v.ptr == region.base_ptr + (2 * 2 + 1) * layout.n_kv_heads * layout.head_dim * item
    assert v.shape == (region.capacity, layout.n_kv_heads, layout.head_dim)
    assert v.strides == (layout.token_bytes, layout.head_dim * item, item)
    if device.host_accessible:
        k = region.k(1)
        assert k.ctypes.data == region.k_view(1).ptr and k.strides == region.k_view(1).strides
        del k
    else:
        with pytest.raises(TypeError):
            region.k(0)
    pool.close()


def test_region_serves_the_numpy_ops_like_a_contiguous_cache(cpu: Device) -> None:
    from eagerlm.kernels.batch import ForwardBatch
    from eagerlm.kernels.numpy_ops import NumpyOps

    layout = KVLayout(2, 2, 8, np.dtype(np.float32))
    pool = PagePool(cpu, 16)
    paged = pool.new_region(layout, 64)
    ref = ContiguousKV(layout, 64)
    ops = NumpyOps()
    n_past = 0
    for n_new in (13, 1, 1, 7):
        paged.ensure(n_past + n_new)
        outs = []
        # the region as a round's work sees it (taken at launch: kernels/numpy_ops.py)
        for kv in (ops.session_kv(paged), ref):
            batch = ForwardBatch.single(np.zeros(n_new, np.int32), n_past, kv)
            state = np.random.default_rng(n_past)
            for layer in range(layout.n_layers):
                k, v = (state.standard_normal((n_new, 2, 8), dtype=np.float32) for _ in "kv")
                q = state.standard_normal((n_new, 4, 8), dtype=np.float32)
                ops.kv_append(batch, layer, k, v)
                outs.append(ops.attention(batch, layer, q, scale=8 ** -0.5, window=0))
        half = len(outs) // 2
        for got, want in zip(outs[:half], outs[half:], strict=True):
            np.testing.assert_array_equal(got, want)
        n_past += n_new
    paged.release()
    pool.close()
