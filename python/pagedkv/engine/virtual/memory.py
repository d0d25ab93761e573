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

:class:`SharedArena` is the sharing half (docs/design.md, "Paged vs virtual KV layout"): the
range is reserved ``PROT_NONE`` and each committed page is a ``MAP_SHARED | MAP_FIXED`` view of
one page-sized *frame* of a ``memfd`` (through libc's ``mmap`` by ``ctypes``: Python's ``mmap``
module has no ``MAP_FIXED``), so one physical page can be mapped at several places of the range
(a prefix shared by several sequences, a fork's prompt). Frames are reference counted; the
last reference gone, the frame goes back to the OS with ``fallocate(FALLOC_FL_PUNCH_HOLE)``.
:class:`SharedPages` is the plain form (one ``memfd`` mapped at new addresses).

The same interface on a GPU, through the CUDA driver's virtual memory API, is
:class:`pagedkv.engine.virtual.memory_cuda.CudaVirtualArena` (untested: written without a GPU).
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import resource
from pathlib import Path

from pagedkv._optional import optional_imports

with optional_imports("pagedkv.engine", "engine"):
    import torch

from pagedkv.errors import InvalidArgumentError

from ..errors import EngineConfigError

__all__ = [
    "PAGE_SIZES",
    "OS_PAGE",
    "HugePagesUnavailableError",
    "VirtualArena",
    "SharedArena",
    "SharedPages",
    "PageStateError",
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


class PageStateError(InvalidArgumentError):
    """A page committed (or mapped) twice, or released while not committed: the caller's page
    bookkeeping is wrong. Also an :class:`~pagedkv.errors.InvalidArgumentError` and a
    ``ValueError``; nothing changed."""


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


class _PageLedger:
    """Which pages of an arena of ``size`` bytes are committed: the range and double-commit
    checks every arena runs before touching memory (so a refused call changes nothing)."""

    def __init__(self, size: int, page_size: int) -> None:
        self.size, self.page_size = size, page_size
        self.committed: set[int] = set()  # page indices (sparse: a reservation may span terabytes)

    def pages(self, offset: int, length: int) -> range:
        """Page indices of ``[offset, offset + length)``.

        Raises:
            InvalidArgumentError: not whole pages inside the arena.
        """
        p = self.page_size
        if (
            any(isinstance(v, bool) or not isinstance(v, int) for v in (offset, length))
            or offset % p
            or length % p
            or offset < 0
            or length < 0
            or offset + length > self.size
        ):
            value, reason = f"[{offset}, {offset + length})", f"not whole pages of {p} inside {self.size}"
            raise InvalidArgumentError(
                f"invalid argument range = {value}: {reason}", arg="range", value=value, reason=reason
            )
        return range(offset // p, (offset + length) // p)

    def check(self, offset: int, length: int, *, committed: bool) -> range:
        """:meth:`pages`, each of them committed (``committed=True``) or none of them.

        Raises:
            InvalidArgumentError: a bad range.
            PageStateError: a page in the other state (names the first).
        """
        pages = self.pages(offset, length)
        for i in pages:
            if (i in self.committed) != committed:
                value = f"[{offset}, {offset + length})"
                reason = f"page {i} (offset {i * self.page_size}) is " + (
                    "not committed" if committed else "already committed"
                )
                raise PageStateError(
                    f"invalid argument range = {value}: {reason}", arg="range", value=value, reason=reason
                )
        return pages

    def mark(self, pages: range, committed: bool) -> None:
        """Record ``pages`` as committed or not."""
        if committed:
            self.committed.update(pages)
        else:
            self.committed.difference_update(pages)


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
        from ..errors import KVCacheTooLargeError

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
        self._ledger = _PageLedger(self.size, page_size)

    def commit(self, offset: int, length: int) -> None:
        """Commit the pages of ``[offset, offset + length)`` (bytes, whole pages, not yet
        committed): one write per OS page faults each in. Counts the faults.

        Raises:
            InvalidArgumentError: a range that is not whole pages inside the arena (nothing
                committed).
            PageStateError: a page of the range is committed already (nothing committed).
        """
        pages = self._ledger.check(offset, length, committed=False)
        if not length:
            return
        self._ledger.mark(pages, True)
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
            PageStateError: a page of the range is not committed (nothing released).
        """
        pages = self._ledger.check(offset, length, committed=True)
        if not length:
            return
        self._ledger.mark(pages, False)
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


# libc's mmap family by ctypes (Python's mmap module cannot map at a fixed address). Linux values.
_PROT_NONE, _PROT_RW = 0, mmap.PROT_READ | mmap.PROT_WRITE
_MAP_SHARED, _MAP_PRIVATE, _MAP_FIXED, _MAP_ANONYMOUS = 0x01, 0x02, 0x10, 0x20
_FALLOC_FL_KEEP_SIZE, _FALLOC_FL_PUNCH_HOLE = 0x01, 0x02
_MAP_FAILED = ctypes.c_void_p(-1).value


def _libc() -> ctypes.CDLL:
    """libc with ``mmap`` / ``munmap`` / ``fallocate`` typed (64-bit ``off_t``)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int64]
    libc.munmap.restype = ctypes.c_int
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.fallocate.restype = ctypes.c_int
    libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    return libc


class SharedArena:
    """A reserved range of ``size`` bytes whose pages are views of *frames* of one ``memfd``: a
    frame (one physical page of ``page_size`` bytes) can be mapped at several page offsets of
    the range at once, so sequences share KV pages (prefix caching, forks) by mapping, not
    copying. The vAttention design (Prabhu et al., arXiv 2405.04437) with the CUDA driver's
    ``cuMemMap`` of one physical handle at several virtual addresses done by the OS instead.

    The range is reserved ``PROT_NONE`` (``MAP_NORESERVE``: no memory, no overcommit charge);
    :meth:`commit` maps a fresh frame at each page (``MAP_SHARED | MAP_FIXED``) and touches it
    (first-touch faults, counted); :meth:`map_frames` maps existing frames. Each frame counts
    its references (mappings plus :meth:`hold`); :meth:`release` puts ``PROT_NONE`` back over the
    pages and drops their references, and a frame whose count reaches 0 is returned to the OS
    with ``fallocate(FALLOC_FL_PUNCH_HOLE)`` and reused. 2 MiB pages are the accounting and
    sharing unit; they are backed by 2 MiB shared-memory huge pages only where the kernel's
    ``shmem_enabled`` allows (``huge``), else by 4 KiB OS pages.

    Args:
        size: bytes to reserve (rounded up to a whole page), > 0.
        page_size: one of :data:`PAGE_SIZES`.
        num_frames: physical pages the file may hold at once, >= 1 (the budget).

    Attributes:
        size, page_size, num_frames: as given (``size`` rounded up).
        bytes: ``uint8[size]`` tensor over the range (read or write only mapped pages: the rest
            is ``PROT_NONE`` and faults with SIGSEGV).
        committed_bytes: bytes of live frames (referenced at least once), each counted once
            however often it is mapped; peak_committed_bytes: the most at once.
        faults: minor faults during commits; commits, releases: frames created, frames
            returned to the OS; huge: True when shared-memory huge pages back 2 MiB frames.

    Raises:
        EngineConfigError: a bad ``page_size``, ``size`` or ``num_frames``.
        KVCacheTooLargeError: the OS refused the reservation or the file.
    """

    def __init__(self, size: int, page_size: int, num_frames: int) -> None:
        from ..errors import KVCacheTooLargeError

        self.page_size = check_page_size(page_size)
        for name, v, low in (("size", size, 1), ("num_frames", num_frames, 1)):
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise EngineConfigError(f"{name}={v!r} is invalid: expected an integer >= {low}")
        self.size = -(-size // page_size) * page_size
        self.num_frames = num_frames
        self._libc = _libc()
        pad = page_size  # room to start on a page boundary (2 MiB pages: a huge-page boundary)
        addr = self._libc.mmap(None, self.size + pad, _PROT_NONE, _MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_NORESERVE, -1, 0)
        if addr in (None, _MAP_FAILED):
            e = ctypes.get_errno()
            raise KVCacheTooLargeError(f"cannot reserve {self.size} bytes of address space: {os.strerror(e)}")
        self._reservation = (addr, self.size + pad)
        self.base_address = addr + (-addr) % page_size
        try:
            self._fd = os.memfd_create("pagedkv-kv-frames", os.MFD_CLOEXEC)
            os.ftruncate(self._fd, num_frames * page_size)
        except OSError as e:
            self._libc.munmap(addr, self.size + pad)
            raise KVCacheTooLargeError(
                f"cannot create a file of {num_frames} pages of {page_size} bytes: {e}"
            ) from None
        self.huge = page_size == _HUGE and _shmem_thp_mode() in ("always", "within_size", "advise")
        self.bytes = torch.frombuffer((ctypes.c_uint8 * self.size).from_address(self.base_address), dtype=torch.uint8)
        self._ledger = _PageLedger(self.size, page_size)
        self._frame_at: dict[int, int] = {}  # page index -> frame mapped there
        self._refs = [0] * num_frames
        self._free = list(range(num_frames - 1, -1, -1))  # lowest first: neighbours merge into one mapping
        self.committed_bytes = self.peak_committed_bytes = 0
        self.faults = self.commits = self.releases = 0

    # ---- frames ----------------------------------------------------------------------------

    @property
    def num_free_frames(self) -> int:
        """Frames not referenced (free for :meth:`commit`)."""
        return len(self._free)

    @property
    def live_frames(self) -> int:
        """Frames referenced at least once."""
        return self.num_frames - len(self._free)

    def frame_at(self, offset: int) -> int:
        """The frame mapped at page ``offset``.

        Raises:
            InvalidArgumentError, PageStateError: not a page offset, or nothing mapped there.
        """
        (i,) = self._ledger.check(offset, self.page_size, committed=True)
        return self._frame_at[i]

    def refcount(self, frame: int) -> int:
        """References to ``frame`` (mappings plus holds); 0 for a free frame."""
        return self._refs[frame]

    def hold(self, frame: int) -> None:
        """Take a reference to a live ``frame`` that is not a mapping (a cache's).

        Raises:
            PageStateError: the frame is free.
        """
        self._check_live(frame)
        self._refs[frame] += 1

    def drop(self, frame: int) -> None:
        """Drop a reference taken by :meth:`hold`; the frame goes back to the OS at 0.

        Raises:
            PageStateError: the frame is free.
        """
        self._check_live(frame)
        self._unref(frame)

    def _check_live(self, frame: int) -> None:
        if not 0 <= frame < self.num_frames or self._refs[frame] == 0:
            raise PageStateError(
                f"invalid argument frame = {frame}: not a live frame", arg="frame", value=str(frame), reason="not live"
            )

    def _unref(self, frame: int) -> None:
        self._refs[frame] -= 1
        if self._refs[frame] == 0:
            p = self.page_size
            if self._libc.fallocate(self._fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, frame * p, p):
                raise OSError(ctypes.get_errno(), f"fallocate(PUNCH_HOLE) of frame {frame}")
            self._free.append(frame)
            self.committed_bytes -= p
            self.releases += 1

    # ---- mapping ---------------------------------------------------------------------------

    def _map(self, page: int, frame: int) -> None:
        p = self.page_size
        addr = self._libc.mmap(self.base_address + page * p, p, _PROT_RW, _MAP_SHARED | _MAP_FIXED, self._fd, frame * p)
        if addr in (None, _MAP_FAILED):
            e = ctypes.get_errno()
            hint = " (each mapping is a VMA: see /proc/sys/vm/max_map_count)" if e == errno.ENOMEM else ""
            raise OSError(e, f"mmap of frame {frame} at page {page}: {os.strerror(e)}{hint}")
        if self.huge:
            self._libc.madvise(ctypes.c_void_p(addr), ctypes.c_size_t(p), mmap.MADV_HUGEPAGE)
        self._frame_at[page] = frame
        self._refs[frame] += 1

    def commit(self, offset: int, length: int) -> None:
        """Map a fresh frame at each page of ``[offset, offset + length)`` and fault it in by a
        write per OS page (counted in :attr:`faults`); the pages read as zeros.

        Raises:
            InvalidArgumentError: not whole pages inside the arena.
            PageStateError: a page of the range is mapped already.
            pagedkv.OutOfBlocksError: fewer free frames than pages (nothing mapped).
        """
        from pagedkv.errors import OutOfBlocksError

        pages = self._ledger.check(offset, length, committed=False)
        if len(pages) > len(self._free):
            raise OutOfBlocksError(
                f"shared arena: {len(pages)} pages to commit, {len(self._free)} free frames",
                requested=len(pages),
                available=len(self._free),
            )
        if not length:
            return
        for page in pages:
            self._map(page, self._free.pop())
        self._ledger.mark(pages, True)
        before = minor_faults()
        self.bytes[offset : offset + length : OS_PAGE].fill_(0)
        self.faults += minor_faults() - before
        self.committed_bytes += length
        self.peak_committed_bytes = max(self.peak_committed_bytes, self.committed_bytes)
        self.commits += len(pages)

    def map_frames(self, offset: int, frames: list[int]) -> None:
        """Map live ``frames`` at the pages from ``offset`` on (one each; they gain a reference):
        the range then reads and writes the same physical memory as every other view of them.

        Raises:
            InvalidArgumentError: not whole pages inside the arena.
            PageStateError: a page is mapped already or a frame is free (nothing mapped).
        """
        pages = self._ledger.check(offset, len(frames) * self.page_size, committed=False)
        for f in frames:
            self._check_live(f)
        for page, f in zip(pages, frames):
            self._map(page, f)
        self._ledger.mark(pages, True)

    def release(self, offset: int, length: int) -> None:
        """Unmap the pages of ``[offset, offset + length)`` (``PROT_NONE`` again) and drop
        their frames' references (a frame at 0 is returned to the OS).

        Raises:
            InvalidArgumentError: not whole pages inside the arena.
            PageStateError: a page of the range is not mapped (nothing released).
        """
        pages = self._ledger.check(offset, length, committed=True)
        if not length:
            return
        flags = _MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_NORESERVE | _MAP_FIXED
        addr = self._libc.mmap(self.base_address + offset, length, _PROT_NONE, flags, -1, 0)
        if addr in (None, _MAP_FAILED):
            raise OSError(ctypes.get_errno(), f"re-reserving [{offset}, {offset + length})")
        self._ledger.mark(pages, False)
        for page in pages:
            self._unref(self._frame_at.pop(page))

    def resident_bytes(self) -> int:
        """Bytes of the frames' file in memory (each physical page once, however often mapped)."""
        return os.fstat(self._fd).st_blocks * 512

    def huge_bytes(self) -> int:
        """Bytes backed by shared-memory huge pages (``ShmemPmdMapped`` is per mapping; this
        is :meth:`resident_bytes` when :attr:`huge`, else 0)."""
        return self.resident_bytes() if self.huge else 0

    def close(self) -> None:
        """Unmap everything and close the file (views of :attr:`bytes` must be gone)."""
        del self.bytes
        addr, length = self._reservation
        self._libc.munmap(addr, length)
        os.close(self._fd)
        self._frame_at.clear()


def _shmem_thp_mode() -> str | None:
    """The selected shared-memory transparent-huge-page mode, or None."""
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/shmem_enabled").read_text()
    except OSError:
        return None
    return next((w[1:-1] for w in text.split() if w.startswith("[")), None)


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
