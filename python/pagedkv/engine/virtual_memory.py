"""Reserved-but-uncommitted virtual memory for the virtual KV layout (vAttention, Prabhu et al.,
arXiv 2405.04437): address space is reserved up front, physical pages are committed on demand
and given back to the OS, at a chosen page size.

On the CPU this is an anonymous private ``mmap`` (``MAP_NORESERVE``: reserving costs no memory
and no overcommit charge). A page is *committed* by touching each OS page inside it (the first
write faults a zeroed page in, which the OS counts as a minor fault), and *released* with
``madvise(MADV_DONTNEED)``, after which the OS page is gone and the next touch reads zeros.
The commit granularity emulates a GPU driver's: 4 KiB (the OS page), 64 KiB (a GPU's small
page) or 2 MiB (the CUDA VMM granularity; a transparent huge page where the kernel allows
``madvise(MADV_HUGEPAGE)``, else :class:`HugePagesUnavailableError`).

:class:`SharedPages` is the sharing half (docs/design.md, "Paged vs virtual KV layout"): one
``memfd`` of physical pages mapped several times (``MAP_SHARED``: the same pages in each
mapping; ``MAP_PRIVATE``: copy-on-write per OS page on the first write). Python's ``mmap``
cannot place a mapping at a fixed address inside a reserved range (no ``MAP_FIXED``), so a
shared prefix is its own mapping beside the request's private range, not spliced into it.

The same interface on a GPU, through the CUDA driver's virtual memory API, is
:class:`pagedkv.engine.virtual_memory_cuda.CudaVirtualArena` (untested: written without a GPU).
"""

from __future__ import annotations

import mmap
import os
import resource
from pathlib import Path

from pagedkv._optional import optional_imports

with optional_imports("pagedkv.engine", "engine"):
    import torch

from pagedkv.errors import InvalidArgumentError

from .errors import EngineConfigError

__all__ = [
    "PAGE_SIZES",
    "OS_PAGE",
    "HugePagesUnavailableError",
    "VirtualArena",
    "SharedPages",
    "check_page_size",
    "minor_faults",
]

#: The commit granularities the layout emulates, in bytes: 4 KiB, 64 KiB, 2 MiB.
PAGE_SIZES = (4096, 65536, 2 * 1024 * 1024)
#: The OS page (the unit a touch commits and MADV_DONTNEED returns).
OS_PAGE = mmap.PAGESIZE
#: Linux's MAP_NORESERVE (Python 3.11's mmap module does not name it).
_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)
_HUGE = 2 * 1024 * 1024
_THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


class HugePagesUnavailableError(EngineConfigError):
    """2 MiB pages were asked for but the kernel's transparent huge pages are off (``never``),
    so a 2 MiB commit would be 512 separate 4 KiB pages. Also a ``ValueError``."""


def check_page_size(page_size: object) -> int:
    """``page_size`` as an int when it is one of :data:`PAGE_SIZES`.

    Raises:
        EngineConfigError: anything else (the message lists the choices).
    """
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size not in PAGE_SIZES:
        raise EngineConfigError(
            f"page_size={page_size!r} is invalid: expected one of {', '.join(str(p) for p in PAGE_SIZES)} "
            "bytes (4 KiB, 64 KiB, 2 MiB)"
        )
    return page_size


def minor_faults() -> int:
    """This process's minor page faults so far (``getrusage(RUSAGE_SELF).ru_minflt``)."""
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_minflt)


def _thp_mode() -> str | None:
    """The selected transparent-huge-page mode (``always``, ``madvise``, ``never``) or None."""
    try:
        text = _THP_SETTING.read_text()
    except OSError:
        return None
    return next((w[1:-1] for w in text.split() if w.startswith("[")), None)


class VirtualArena:
    """One reserved, initially uncommitted range of ``size`` bytes, committed and released in
    whole pages of ``page_size`` bytes.

    Args:
        size: bytes to reserve (rounded up to a whole page), > 0.
        page_size: commit granularity, one of :data:`PAGE_SIZES`.

    Attributes:
        size: reserved bytes (a multiple of ``page_size``).
        page_size: the commit granularity.
        bytes: ``uint8[size]`` torch tensor over the range (no copy; ``torch.frombuffer``); views
            of it are the KV tensors.
        committed_bytes: bytes the arena holds committed now (its own count, whole pages).
        peak_committed_bytes: the most it held.
        faults: minor faults counted during commits (``ru_minflt`` deltas; other threads'
            faults in that window count too).
        commits, releases: pages committed and released so far.
        huge: True when 2 MiB pages are asked for as transparent huge pages.

    Raises:
        EngineConfigError: a bad ``page_size`` or ``size``.
        HugePagesUnavailableError: 2 MiB pages with transparent huge pages off.
        KVCacheTooLargeError: the OS refused the reservation (names the size).
    """

    def __init__(self, size: int, page_size: int) -> None:
        from .errors import KVCacheTooLargeError

        self.page_size = check_page_size(page_size)
        if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
            raise EngineConfigError(f"size={size!r} is invalid: expected a number of bytes > 0")
        self.huge = page_size == _HUGE
        if self.huge and _thp_mode() in (None, "never"):
            raise HugePagesUnavailableError(
                f"page_size={page_size} (2 MiB) needs transparent huge pages, but "
                f"{_THP_SETTING} is {_thp_mode() or 'missing'}: use 65536 or 4096"
            )
        self.size = -(-size // page_size) * page_size
        pad = _HUGE if self.huge else 0  # room to start on a 2 MiB boundary
        try:
            self._map = mmap.mmap(
                -1,
                self.size + pad,
                flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE,
                prot=mmap.PROT_READ | mmap.PROT_WRITE,
            )
        except OSError as e:
            raise KVCacheTooLargeError(f"cannot reserve {self.size} bytes of address space: {e}") from None
        whole = torch.frombuffer(self._map, dtype=torch.uint8)
        self.base_address = whole.data_ptr()
        self._start = (-self.base_address) % _HUGE if self.huge else 0
        self.bytes = whole[self._start : self._start + self.size]
        # A flag of its own keeps the kernel from merging the range with a neighbouring
        # anonymous mapping (whose pages would then count in this range's resident set); not
        # dumping KV into core files is right anyway.
        self._map.madvise(mmap.MADV_DONTDUMP, 0, self.size + pad)
        if self.huge:
            self._map.madvise(mmap.MADV_HUGEPAGE, self._start, self.size)
        self.committed_bytes = 0
        self.peak_committed_bytes = 0
        self.faults = 0
        self.commits = 0
        self.releases = 0

    def _check_range(self, offset: int, length: int) -> None:
        p = self.page_size
        if offset % p or length % p or offset < 0 or length < 0 or offset + length > self.size:
            value, reason = f"[{offset}, {offset + length})", f"not whole pages of {p} inside {self.size}"
            raise InvalidArgumentError(
                f"invalid argument range = {value}: {reason}", arg="range", value=value, reason=reason
            )

    def commit(self, offset: int, length: int) -> None:
        """Commit the pages of ``[offset, offset + length)`` (bytes, whole pages, not yet
        committed): one write per OS page faults each in. Counts the faults.

        Raises:
            InvalidArgumentError: a range that is not whole pages inside the arena (nothing
                committed).
        """
        self._check_range(offset, length)
        if not length:
            return
        before = minor_faults()
        self.bytes[offset : offset + length : OS_PAGE].fill_(0)
        self.faults += minor_faults() - before
        self.committed_bytes += length
        self.peak_committed_bytes = max(self.peak_committed_bytes, self.committed_bytes)
        self.commits += length // self.page_size

    def release(self, offset: int, length: int) -> None:
        """Give the pages of ``[offset, offset + length)`` (committed, whole pages) back to the
        OS with ``madvise(MADV_DONTNEED)``; their contents read as zeros afterwards.

        Raises:
            InvalidArgumentError: a range that is not whole pages inside the arena (nothing
                released).
        """
        self._check_range(offset, length)
        if not length:
            return
        self._map.madvise(mmap.MADV_DONTNEED, self._start + offset, length)
        self.committed_bytes -= length
        self.releases += length // self.page_size

    def resident_bytes(self) -> int:
        """Bytes of this arena the OS holds resident now (its mapping's ``Rss`` in
        ``/proc/self/smaps``), the OS's view of what :attr:`committed_bytes` counts."""
        return _mapping_rss(self.base_address)

    def huge_bytes(self) -> int:
        """Bytes of this arena backed by transparent huge pages (``AnonHugePages``)."""
        return _mapping_rss(self.base_address, "AnonHugePages:")

    def close(self) -> None:
        """Unmap the range (views of :attr:`bytes` must be gone)."""
        del self.bytes
        self._map.close()


def _mapping_rss(address: int, field: str = "Rss:") -> int:
    """``field`` (kB) of the mapping of ``/proc/self/smaps`` that contains ``address``, in bytes."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(None, 1)[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == field:
                return int(line.split()[1]) * 1024
    return 0


class SharedPages:
    """``num_pages`` physical pages of ``page_size`` bytes in one ``memfd`` (shared memory),
    mappable several times: what a virtual layout shares between requests (a prefix) or a fork.

    Args:
        num_pages: pages in the file, >= 1.
        page_size: one of :data:`PAGE_SIZES` (pages are whole multiples of the OS page; huge
            pages are not used: shared memory's transparent huge pages are a separate kernel
            setting, off by default).

    Raises:
        EngineConfigError: a bad ``page_size`` or ``num_pages``.
    """

    def __init__(self, num_pages: int, page_size: int) -> None:
        self.page_size = check_page_size(page_size)
        if isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages < 1:
            raise EngineConfigError(f"num_pages={num_pages!r} is invalid: expected an integer >= 1")
        self.num_pages = num_pages
        self._fd = os.memfd_create("pagedkv-shared-kv", os.MFD_CLOEXEC)
        os.ftruncate(self._fd, num_pages * page_size)

    def map(self, first_page: int, num_pages: int, *, copy_on_write: bool = False) -> tuple[mmap.mmap, torch.Tensor]:
        """Map pages ``[first_page, first_page + num_pages)`` at a new address.

        With ``copy_on_write=False`` (``MAP_SHARED``) every mapping reads and writes the same
        physical pages; with ``True`` (``MAP_PRIVATE``) it reads them until its first write to
        an OS page, which copies that OS page (4 KiB) into private memory.

        Returns:
            the mapping and a ``uint8`` tensor over it (close the mapping after the tensor is gone).

        Raises:
            ValueError: pages outside the file.
        """
        if first_page < 0 or num_pages < 1 or first_page + num_pages > self.num_pages:
            raise ValueError(f"pages [{first_page}, {first_page + num_pages}) outside 0..{self.num_pages}")
        flags = mmap.MAP_PRIVATE if copy_on_write else mmap.MAP_SHARED
        m = mmap.mmap(
            self._fd,
            num_pages * self.page_size,
            flags=flags,
            prot=mmap.PROT_READ | mmap.PROT_WRITE,
            offset=first_page * self.page_size,
        )
        return m, torch.frombuffer(m, dtype=torch.uint8)

    def resident_bytes(self) -> int:
        """Bytes of the file held in memory (its blocks, counted once however often mapped)."""
        return os.fstat(self._fd).st_blocks * 512

    def close(self) -> None:
        """Close the file (pages stay while a mapping holds them)."""
        os.close(self._fd)
