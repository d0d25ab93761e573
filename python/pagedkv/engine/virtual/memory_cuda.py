"""The virtual layout's reserved memory on an NVIDIA GPU, through the CUDA driver's virtual
memory API (cuda-python's ``cuda.bindings.driver``): ``cuMemAddressReserve`` reserves the
range, a commit is ``cuMemCreate`` + ``cuMemMap`` + ``cuMemSetAccess`` per page, a release
``cuMemUnmap`` + ``cuMemRelease``; the page must be a multiple of
``cuMemGetAllocationGranularity`` (2 MiB on current GPUs, so 4 KiB / 64 KiB pages are refused
here: vAttention needed a modified driver for smaller ones).

UNTESTED on a GPU: it was written on a machine without one. There it raises
:class:`~pagedkv.engine.errors.DeviceUnavailableError`; the tests check that much.
"""

from __future__ import annotations

from typing import Any

from pagedkv._optional import optional_imports

with optional_imports("pagedkv.engine", "engine"):
    import torch

from ..errors import DeviceUnavailableError, EngineConfigError
from .memory import _PageLedger

__all__ = ["CudaVirtualArena"]


def _driver() -> Any:
    """``cuda.bindings.driver`` after ``cuInit``.

    Raises:
        DeviceUnavailableError: no binding, no driver library or no GPU (names why).
    """
    try:
        from cuda.bindings import driver
    except ImportError as e:
        raise DeviceUnavailableError(f"CUDA virtual memory needs cuda-python (cuda.bindings): {e}") from None
    try:
        (err,) = driver.cuInit(0)
    except Exception as e:  # noqa: BLE001 - the binding raises its own types when libcuda is missing
        raise DeviceUnavailableError(f"CUDA virtual memory needs an NVIDIA GPU and driver: {e}") from None
    if err != driver.CUresult.CUDA_SUCCESS:
        raise DeviceUnavailableError(f"CUDA virtual memory needs an NVIDIA GPU and driver: cuInit gave {err!r}")
    return driver


def _ok(driver: Any, result: Any, call: str) -> Any:
    """The values of a driver call's ``(err, *values)`` result; RuntimeError on an error."""
    err, *values = result if isinstance(result, tuple) else (result,)
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"{call} failed: {err!r}")
    return values[0] if len(values) == 1 else values


class _DeviceRange:
    """``__cuda_array_interface__`` of a uint8 range, for ``torch.as_tensor``."""

    def __init__(self, ptr: int, size: int) -> None:
        self.__cuda_array_interface__ = {"shape": (size,), "typestr": "|u1", "data": (ptr, False), "version": 3}


class CudaVirtualArena:
    """:class:`~pagedkv.engine.virtual.memory.VirtualArena`'s interface on GPU ``device_index``.

    Args:
        size: bytes to reserve (rounded up to a whole page).
        page_size: commit granularity in bytes, a multiple of the driver's granularity.
        device_index: the GPU.

    Raises:
        DeviceUnavailableError: no GPU, driver or binding.
        EngineConfigError: ``page_size`` not a multiple of the driver's granularity (names it).
    """

    def __init__(self, size: int, page_size: int, device_index: int = 0) -> None:
        cu = self._cu = _driver()
        dev = _ok(cu, cu.cuDeviceGet(device_index), "cuDeviceGet")
        ctx = _ok(cu, cu.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
        _ok(cu, cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
        prop = cu.CUmemAllocationProp()
        prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = device_index
        self._prop = prop
        flag = cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
        self.granularity = int(_ok(cu, cu.cuMemGetAllocationGranularity(prop, flag), "cuMemGetAllocationGranularity"))
        if page_size % self.granularity:
            raise EngineConfigError(
                f"page_size={page_size} is invalid on this GPU: the driver maps multiples of {self.granularity} bytes"
            )
        access = cu.CUmemAccessDesc()
        access.location = prop.location
        access.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self._access = access
        self.page_size = page_size
        self.huge = True
        self.size = -(-size // page_size) * page_size
        self._ptr = int(_ok(cu, cu.cuMemAddressReserve(self.size, page_size, 0, 0), "cuMemAddressReserve"))
        self.base_address = self._ptr
        self.bytes = torch.as_tensor(_DeviceRange(self._ptr, self.size), device=f"cuda:{device_index}")
        self._handles: dict[int, Any] = {}  # page offset -> physical allocation
        self._ledger = _PageLedger(self.size, page_size)
        self.committed_bytes = self.peak_committed_bytes = 0
        self.faults = 0  # no page faults: pages are mapped explicitly
        self.commits = self.releases = 0

    def commit(self, offset: int, length: int) -> None:
        """Create and map a physical allocation for each page of ``[offset, offset + length)``.

        Raises:
            InvalidArgumentError: not whole pages inside the reservation (checked before any
                driver call: nothing mapped).
            PageStateError: a page of the range is mapped already (nothing mapped).
        """
        pages = self._ledger.check(offset, length, committed=False)
        self._ledger.mark(pages, True)
        cu, p = self._cu, self.page_size
        for off in range(offset, offset + length, p):
            handle = _ok(cu, cu.cuMemCreate(p, self._prop, 0), "cuMemCreate")
            _ok(cu, cu.cuMemMap(self._ptr + off, p, 0, handle, 0), "cuMemMap")
            _ok(cu, cu.cuMemSetAccess(self._ptr + off, p, [self._access], 1), "cuMemSetAccess")
            self._handles[off] = handle
        self.committed_bytes += length
        self.peak_committed_bytes = max(self.peak_committed_bytes, self.committed_bytes)
        self.commits += length // p

    def release(self, offset: int, length: int) -> None:
        """Unmap and free the pages of ``[offset, offset + length)``.

        Raises:
            InvalidArgumentError: not whole pages inside the reservation (nothing released).
            PageStateError: a page of the range is not mapped (nothing released).
        """
        pages = self._ledger.check(offset, length, committed=True)
        self._ledger.mark(pages, False)
        cu, p = self._cu, self.page_size
        for off in range(offset, offset + length, p):
            _ok(cu, cu.cuMemUnmap(self._ptr + off, p), "cuMemUnmap")
            _ok(cu, cu.cuMemRelease(self._handles.pop(off)), "cuMemRelease")
        self.committed_bytes -= length
        self.releases += length // p

    def resident_bytes(self) -> int:
        """Physical bytes mapped (the driver's allocations are exactly the committed pages)."""
        return self.committed_bytes

    def huge_bytes(self) -> int:
        """Same as :meth:`resident_bytes` (every page is a driver granule)."""
        return self.committed_bytes

    def close(self) -> None:
        """Release every page and the reservation."""
        for off in sorted(self._handles):
            self.release(off, self.page_size)
        del self.bytes
        _ok(self._cu, self._cu.cuMemAddressFree(self._ptr, self.size), "cuMemAddressFree")
