"""Host checks the engine runs before it commits memory: is the requested device usable, and
do the KV pools fit the free memory?

Why: ``torch.zeros`` on a pool that cannot fit fails late (after the model load) with a raw
``RuntimeError``/``OutOfMemoryError``; a CUDA device on a GPU-less machine fails deep inside
torch. Both are turned into the engine's typed errors naming the requested sizes.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, TypeVar

from pagedkv._optional import optional_imports

with optional_imports("pagedkv.engine", "engine"):
    import torch

from .errors import DeviceUnavailableError, KVCacheTooLargeError

__all__ = ["check_device", "available_memory", "check_kv_fits", "guard_allocation"]

T = TypeVar("T")


def check_device(device: Any) -> torch.device:
    """Parse ``device`` and check it can be used. O(1).

    Raises:
        DeviceUnavailableError: not a torch device string, or a CUDA device when CUDA is not
            available / the index is out of range (names the device).
    """
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError) as e:
        raise DeviceUnavailableError(f"device={device!r} is not a torch device: {e}") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceUnavailableError(
                f"device={str(dev)!r} requested but CUDA is not available on this machine "
                "(no GPU or no CUDA build of torch); use --device cpu"
            )
        n = torch.cuda.device_count()
        if dev.index is not None and dev.index >= n:
            raise DeviceUnavailableError(f"device={str(dev)!r} requested but only {n} CUDA device(s) exist")
    return dev


#: Where Linux reports ``MemAvailable`` (free memory plus page cache the kernel can reclaim).
MEMINFO = "/proc/meminfo"


def available_memory(dev: torch.device) -> int:
    """Bytes free for a new allocation on ``dev``: ``torch.cuda.mem_get_info`` on CUDA; on the
    host psutil's available memory, else Linux's ``MemAvailable`` (:data:`MEMINFO`), else
    ``os.sysconf`` free pages. Free pages alone (``MemFree``) leave out the page cache the
    kernel gives back on demand, often most of a machine's memory."""
    if dev.type == "cuda":
        return int(torch.cuda.mem_get_info(dev)[0])
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:  # psutil is optional
        pass
    try:
        with open(MEMINFO, encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # the value is in kB
    except (OSError, ValueError, IndexError):
        pass
    return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def _fmt_bytes(n: int) -> str:
    return f"{n} bytes ({n / 2**30:.2f} GiB)"


def check_kv_fits(
    dev: torch.device, num_blocks: int, num_cpu_blocks: int, bytes_per_block: int, num_host_blocks: int = 0
) -> None:
    """Check the device KV pool (``num_blocks``), the CPU swap pool (``num_cpu_blocks``) and the
    prefix cache's host tier (``num_host_blocks``) fit the memory free now. The swap pool and
    the host tier live in host memory; when ``dev`` is the CPU all three share it. O(1).

    Raises:
        KVCacheTooLargeError: naming the pool size in blocks and bytes and the free memory.
    """
    dev_bytes = num_blocks * bytes_per_block
    cpu_bytes = (num_cpu_blocks + num_host_blocks) * bytes_per_block
    host_pools = (f" + CPU swap pool {num_cpu_blocks} blocks" if num_cpu_blocks else "") + (
        f" + host tier {num_host_blocks} blocks" if num_host_blocks else ""
    )
    if dev.type == "cpu":
        free = available_memory(dev)
        if dev_bytes + cpu_bytes > free:
            raise KVCacheTooLargeError(
                f"KV cache of {num_blocks} blocks{host_pools} x {bytes_per_block} bytes = "
                f"{_fmt_bytes(dev_bytes + cpu_bytes)} does not fit the {_fmt_bytes(free)} of free host "
                "memory; lower num_kv_blocks / kv_bytes (--kv-blocks / --kv-bytes)"
                + (" or the host tier (--host-cache-bytes)" if num_host_blocks else "")
            )
        return
    free = available_memory(dev)
    if dev_bytes > free:
        raise KVCacheTooLargeError(
            f"KV cache of {num_blocks} blocks x {bytes_per_block} bytes = {_fmt_bytes(dev_bytes)} does not "
            f"fit the {_fmt_bytes(free)} free on {dev}; lower num_kv_blocks / kv_bytes (--kv-blocks / --kv-bytes)"
        )
    if num_cpu_blocks or num_host_blocks:
        host = available_memory(torch.device("cpu"))
        if cpu_bytes > host:
            raise KVCacheTooLargeError(
                f"{host_pools.removeprefix(' + ')} x {bytes_per_block} bytes = {_fmt_bytes(cpu_bytes)} "
                f"does not fit the {_fmt_bytes(host)} of free host memory; lower num_cpu_blocks (--cpu-blocks)"
                + (" or the host tier (--host-cache-bytes)" if num_host_blocks else "")
            )


def guard_allocation(what: str, num_blocks: int, bytes_per_block: int, alloc: Callable[[], T]) -> T:
    """Run ``alloc``; turn an allocation failure (the free-memory estimate can be stale) into
    :class:`KVCacheTooLargeError` naming ``what`` and its size in blocks and bytes."""
    try:
        return alloc()
    except (RuntimeError, MemoryError) as e:  # torch.OutOfMemoryError is a RuntimeError
        raise KVCacheTooLargeError(
            f"allocating the {what} of {num_blocks} blocks x {bytes_per_block} bytes = "
            f"{_fmt_bytes(num_blocks * bytes_per_block)} failed: {str(e).splitlines()[0]}"
        ) from e
