"""The cuda backend's code run against a fake CUDA driver, on machines without a GPU.

The real cuda tests skip without a GPU, which would leave every line of `cuda_device`, the
cuda `PhyMem` / `VirMem` and `cuda_driver` unexecuted until a GPU run. So this module swaps
cuda-python's driver module for `FakeDriver`, which keeps the driver's rules the code must
respect (a context current on the calling thread; cuMemMap only into a reservation, aligned,
onto vacant addresses; memory unusable until cuMemSetAccess; cuMemUnmap of whole mappings;
copies only over device-accessible ranges; stream order, events and stream waits) and backs
device memory with host memory the same way the host backend does. Where cuda-python cannot
load a driver, every call is also passed to the real binding first, which converts (and so
type-checks) every argument before failing to find the library: a wrong argument type is a
TypeError here rather than on the GPU machine.

The backend-agnostic tests of test_vmm and test_device are imported and run again on this
fake device. It proves the plumbing, not the hardware: the real driver's behaviour is checked
only by the `cuda` variants of those tests on a GPU.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

import eagerlm.vmm.cuda_driver
from eagerlm.vmm.cuda_device import CudaDevice
from eagerlm.vmm.cuda_driver import CudaError, NoCudaDevice
from eagerlm.vmm.device import Device, open_device
from eagerlm.vmm.host_views import ViewsAlive
from eagerlm.vmm.page_pool import PagePool
from tests.emulated_gpu.fake_cuda_driver import _GRANULARITY, _VALIDATE, FakeDriver, R
from tests.test_device import (  # noqa: F401  (collected again here, on the fake device)
    test_a_never_recorded_event_counts_as_complete,
    test_copies_round_trip_host_device_device_host,
    test_copy_out_of_bounds_raises_before_enqueueing,
    test_elapsed_time_between_events_is_measured,
    test_event_completes_only_when_its_stream_reaches_it,
    test_stream_waits_for_another_streams_event,
)
from tests.test_vmm import (  # noqa: F401
    KVIO,
    layout_for,
    test_ensure_can_map_ahead_without_counting_it_live,
    test_layer_views_give_kernels_pointers_and_strides,
    test_map_unmap_remap_keeps_data,
    test_out_of_pages_is_typed_and_changes_nothing,
    test_prefix_sharing_maps_whole_pages_and_copies_the_partial_one,
    test_random_sessions_never_leak_a_page,
    test_region_grows_page_by_page_and_keeps_what_was_written,
    test_released_pages_return_only_after_the_last_rounds_event,
    test_sharing_a_page_aligned_prefix_copies_nothing,
    test_stats_report_live_and_mapped_bytes_and_map_latency,
    test_swap_in_without_free_pages_stays_swapped,
    test_swap_round_trip_is_bit_exact,
    test_virtual_reservations_are_recycled,
)


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeDriver:
    drv = FakeDriver()
    monkeypatch.setattr(eagerlm.vmm.cuda_driver, "_driver", drv)
    return drv


@pytest.fixture
def device(fake: FakeDriver) -> Iterator[Device]:
    dev = CudaDevice(0)
    yield dev
    dev.close()
    for w in fake.streams.values():
        w.stop()


@pytest.fixture
def io(device: Device) -> KVIO:
    return KVIO(device)


# -- what only the cuda backend does ---------------------------------------------------


def test_the_fake_device_is_the_cuda_backend(device: Device, fake: FakeDriver) -> None:
    assert device.kind == "cuda" and not device.host_accessible
    assert device.page_size == _GRANULARITY and "Fake VMM GPU" in device.name
    assert layout_for(device).head_dim == _GRANULARITY // 512


def test_every_thread_binds_the_context_before_calling(device: Device,
                                                       fake: FakeDriver) -> None:
    errors: list[BaseException] = []

    def other_thread() -> None:
        try:
            pool = PagePool(device, 2)
            region = pool.new_region(layout_for(device), 20)
            region.ensure(15)
            pool.close()
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=other_thread)
    t.start()
    t.join()
    assert errors == []


def test_a_driver_failure_is_a_cuda_error_naming_the_call(device: Device,
                                                          fake: FakeDriver) -> None:
    fake.total = fake.used + 3 * _GRANULARITY
    with pytest.raises(CudaError, match="cuMemCreate failed: CUDA_ERROR_OUT_OF_MEMORY"):
        PagePool(device, 5)
    assert fake.handles == {}, "pages made before the failure are released"


def test_pool_sized_from_free_device_memory(device: Device, fake: FakeDriver) -> None:
    fake.total = fake.used + 40 * _GRANULARITY
    pool = PagePool.from_free_memory(device, memory_fraction=0.5)
    assert pool.n_pages == 20
    pool.close()


def test_pool_close_gives_everything_back_to_the_driver(device: Device,
                                                        fake: FakeDriver) -> None:
    layout = layout_for(device)
    pool = PagePool(device, 8)
    a = pool.new_region(layout, 100)
    a.ensure(30)
    b = pool.new_region(layout, 100)
    b.share_prefix_from(a, 20)
    c = pool.new_region(layout, 100)
    c.ensure(10)
    c.release(after=device.stream().record())
    pool.close()
    assert (fake.handles, fake.reservations, fake.mappings) == ({}, {}, {})


def test_pinned_host_buffer_is_not_freed_under_a_view(device: Device) -> None:
    host = device.alloc_host(4096)
    view = host.array[8:16]
    with pytest.raises(ViewsAlive):
        host.free()
    view[:] = 1
    del view
    host.free()


def test_a_gate_holds_the_stream_until_opened(device: Device) -> None:
    s = device.stream()
    gate = s.gate()
    ev = s.record()
    time.sleep(0.01)
    assert not ev.query()
    gate.open()
    ev.synchronize()
    s.close()


def test_real_bindings_accept_every_argument_passed(fake: FakeDriver) -> None:
    """With no driver library the fake forwarded each call to the real binding first."""
    if not _VALIDATE:
        pytest.skip("a CUDA driver is loadable: arguments are checked by the GPU tests")
    dev = CudaDevice(0)
    buf = dev.alloc(256)
    s = dev.stream()
    host = dev.alloc_host(256)
    s.copy_h2d(buf, host)
    s.copy_d2h(host, buf)
    s.record().synchronize()
    dev.close()
    assert {"cuMemcpyHtoDAsync", "cuMemcpyDtoHAsync", "cuEventRecord"} <= set(fake.calls)
    np.testing.assert_array_equal(host.array, 0)


def test_a_driver_that_fails_cuinit_means_no_cuda_device(fake: FakeDriver,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fake, "cuInit", lambda flags: (R.CUDA_ERROR_NO_DEVICE,))
    with pytest.raises(NoCudaDevice, match="no CUDA device: cuInit failed with "
                                           "CUDA_ERROR_NO_DEVICE"):
        open_device("cuda")


def test_a_gpu_without_vmm_is_refused_and_its_context_released(
        fake: FakeDriver, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fake, "cuDeviceGetAttribute", lambda attr, dev: (R.CUDA_SUCCESS, 0))
    with pytest.raises(NoCudaDevice, match="virtual memory"):
        open_device("cuda")
    assert fake.ctx_refs == 0
