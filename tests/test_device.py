"""The device interface, specified once and run against both backends.

cuda variants skip with "no CUDA device" where there is none and must pass on a GPU.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

from eagerlm.vmm.cuda_driver import CudaError, NoCudaDevice, check
from eagerlm.vmm.device import Device, StreamError, open_device
from eagerlm.vmm.host_views import ViewsAlive

BACKENDS = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.fixture(params=BACKENDS)
def device(request: pytest.FixtureRequest) -> Iterator[Device]:
    try:
        dev = open_device(request.param)
    except NoCudaDevice:
        pytest.skip("no CUDA device")
    yield dev
    dev.close()


def _upload(device: Device, data: np.ndarray):
    """A device buffer holding `data` (bytes), through a host buffer and an h2d copy."""
    buf = device.alloc(data.nbytes)
    host = device.alloc_host(data.nbytes)
    host.array[:] = data.view(np.uint8).ravel()
    s = device.stream()
    s.copy_h2d(buf, host)
    s.synchronize()
    host.free()
    return buf


def _download(device: Device, buf, nbytes: int | None = None) -> np.ndarray:
    n = buf.nbytes if nbytes is None else nbytes
    host = device.alloc_host(n)
    s = device.stream()
    s.copy_d2h(host, buf, n)
    s.synchronize()
    out = host.array.copy()
    host.free()
    return out


def test_copies_round_trip_host_device_device_host(device: Device) -> None:
    data = np.random.default_rng(0).integers(0, 256, 10_000, dtype=np.uint8)
    a = _upload(device, data)
    b = device.alloc(data.nbytes)
    s = device.stream()
    s.copy_d2d(b, a, 4_000, dst_offset=100, src_offset=200)
    s.synchronize()
    got = _download(device, b)
    assert np.array_equal(got[100:4_100], data[200:4_200])
    a.free()
    b.free()


def test_copy_out_of_bounds_raises_before_enqueueing(device: Device) -> None:
    a, b = device.alloc(100), device.alloc(100)
    s = device.stream()
    with pytest.raises(ValueError, match="outside"):
        s.copy_d2d(a, b, 50, dst_offset=60)
    with pytest.raises(ValueError, match="outside"):
        s.copy_d2d(a, b, 101)
    s.synchronize()
    a.free()
    b.free()


def test_event_completes_only_when_its_stream_reaches_it(device: Device) -> None:
    s = device.stream()
    gate = s.gate()
    ev = s.record()
    time.sleep(0.01)
    assert not ev.query()
    gate.open()
    ev.synchronize()
    assert ev.query()


def test_a_never_recorded_event_counts_as_complete(device: Device) -> None:
    assert device.event().query()


def test_elapsed_time_between_events_is_measured(device: Device) -> None:
    s = device.stream()
    start = s.record(device.event())
    gate = s.gate()
    end = s.record(device.event())
    time.sleep(0.02)
    gate.open()
    end.synchronize()
    assert start.elapsed_ms(end) >= 15.0


def test_stream_waits_for_another_streams_event(device: Device) -> None:
    data = np.arange(256, dtype=np.uint8)
    src = _upload(device, data)
    dst = device.alloc(256)
    a, b = device.stream("a"), device.stream("b")
    gate = a.gate()
    produced = a.record()
    b.wait_event(produced)
    b.copy_d2d(dst, src)
    copied = b.record()
    time.sleep(0.01)
    assert not copied.query(), "b ran past an event a has not reached"
    gate.open()
    copied.synchronize()
    assert np.array_equal(_download(device, dst), data)


def test_open_device_rejects_unknown_names() -> None:
    with pytest.raises(ValueError, match="unknown device"):
        open_device("tpu")


def test_cuda_without_a_gpu_says_no_cuda_device() -> None:
    try:
        open_device("cuda").close()
    except NoCudaDevice as exc:
        assert "no CUDA device" in str(exc)
    else:
        pytest.skip("a CUDA device is present")


def test_a_failed_driver_call_names_the_call_and_the_error() -> None:
    from cuda.bindings import driver

    with pytest.raises(CudaError) as info:
        check((driver.CUresult.CUDA_ERROR_OUT_OF_MEMORY, None), "cuMemCreate")
    assert info.value.call == "cuMemCreate"
    assert info.value.name == "CUDA_ERROR_OUT_OF_MEMORY"
    assert "cuMemCreate failed: CUDA_ERROR_OUT_OF_MEMORY" in str(info.value)
    assert check((driver.CUresult.CUDA_SUCCESS, 7), "cuDeviceGetCount") == 7


# -- cpu streams --------------------------------------------------------------------


def test_cpu_stream_runs_work_strictly_in_order_on_its_own_thread() -> None:
    dev = open_device("cpu")
    s = dev.stream()
    seen: list[tuple[int, str]] = []
    for i in range(200):
        s.submit(lambda i=i: seen.append((i, threading.current_thread().name)))
    s.synchronize()
    assert [i for i, _ in seen] == list(range(200))
    assert {name for _, name in seen} == {"eagerlm-stream"}
    dev.close()


def test_cpu_stream_failure_is_sticky_and_reported_by_events() -> None:
    dev = open_device("cpu")
    s = dev.stream()
    ran: list[int] = []
    s.submit(lambda: 1 / 0)
    s.submit(lambda: ran.append(1))
    ev = s.record()
    with pytest.raises(StreamError, match="ZeroDivisionError"):
        ev.synchronize()
    with pytest.raises(StreamError):
        s.synchronize()
    assert ran == [], "work after a failure must not run"
    dev.close()


def test_cpu_rerecorded_event_refers_to_its_latest_record() -> None:
    dev = open_device("cpu")
    s = dev.stream()
    ev = s.record()
    ev.synchronize()
    gate = s.gate()
    s.record(ev)
    assert not ev.query()
    gate.open()
    ev.synchronize()
    dev.close()


# -- pinned host memory -------------------------------------------------------------


def test_pinned_buffer_cannot_be_freed_under_a_live_view() -> None:
    try:
        dev = open_device("cuda")
    except NoCudaDevice:
        pytest.skip("no CUDA device")
    host = dev.alloc_host(4096)
    view = host.array[10:20]
    with pytest.raises(ViewsAlive):
        host.free()
    view[:] = 7  # still mapped: the failed free changed nothing
    del view
    host.free()
    dev.close()
