"""Virtual-memory KV cache: VirMem / PhyMem, the page pool, per-session KV regions, and the
device interface (cuda and cpu) they run on."""

from eagerlm.vmm.cuda_driver import CudaError, NoCudaDevice
from eagerlm.vmm.device import Device, Event, Stream, StreamError, open_device
from eagerlm.vmm.host_views import ViewsAlive
from eagerlm.vmm.kv_layout import ContiguousKV, KVLayout
from eagerlm.vmm.kv_region import KVRegion, RegionState, RegionStateError, StridedView
from eagerlm.vmm.page_pool import OutOfPages, PagePool

__all__ = [
    "ContiguousKV",
    "CudaError",
    "Device",
    "Event",
    "KVLayout",
    "KVRegion",
    "NoCudaDevice",
    "OutOfPages",
    "PagePool",
    "RegionState",
    "RegionStateError",
    "Stream",
    "StreamError",
    "StridedView",
    "ViewsAlive",
    "open_device",
]
