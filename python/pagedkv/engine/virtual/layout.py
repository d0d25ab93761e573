"""The virtual KV layout (vAttention, Prabhu et al., arXiv 2405.04437): each sequence's K and V
of each layer live in one contiguous virtual range, reserved for the longest sequence the
engine serves, with physical pages committed as the sequence grows and given back when it
finishes or is preempted. Attention reads the contiguous K/V slice directly: no block table.

Memory: one arena (:class:`~pagedkv.engine.virtual.memory.VirtualArena`, or
:class:`~pagedkv.engine.virtual.memory.SharedArena` with ``sharing``) holds ``max_seqs`` *slots*;
a slot is ``2 * num_layers`` *segments* (layer ``l``'s K, then its V), each
``ceil(max_seq_len * bytes_per_token / page) * page`` bytes, page-aligned, so a segment's
pages are committed from its start. A sequence of ``t`` tokens holds ``ceil(t *
bytes_per_token / page)`` pages in every segment (``bytes_per_token = num_kv_heads *
head_size * element size``): the tail of the last page of each of its ``2 * num_layers``
segments is the layout's waste, where the paged layout wastes the tail of one block.

Accounting: :class:`VirtualKVLayout` commits against a physical budget in pages (the paged
pool's bytes at equal budget), all or nothing per sequence, and answers the scheduler's
capacity questions in pages (:mod:`pagedkv.engine.virtual.manager`).

Sharing (``sharing=True``, a :class:`~pagedkv.engine.virtual.memory.SharedArena`): the unit is a
*page group*, page ``p`` of all ``2 * num_layers`` segments (every segment of a sequence holds
the same tokens at the same offsets). Page ``p`` holds bytes ``[p * page, (p + 1) * page)`` of
each segment, i.e. the tokens ``[0, end(p))``, ``end(p) = ceil((p + 1) * page /
bytes_per_token)``, decide its contents, and it is *full* once ``end(p)`` tokens are computed.

* Prefix caching: a full page group is registered under a chained hash of the sequence's
  root (cache salt, extra keys) and its tokens ``[0, end(p))`` and held by the cache (frame
  references) after its sequence finishes; LRU eviction of groups no sequence maps, deepest
  pages first. A new prompt of ``N`` tokens matching ``k`` groups maps them and skips
  ``H = min(floor(k * page / bytes_per_token), N - 1)`` tokens (the hit).
* Forks: the child maps every page of the parent holding a computed token.
* Copy-on-write at page granularity: before a sequence writes into a page some other holder
  maps (a fork sibling, the cache), it takes a private copy of that page group. So a page
  straddling a divergence point (the hit's end, a fork's prompt end) is copied, pages wholly
  below it stay shared.
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from pagedkv._optional import optional_imports

with optional_imports("pagedkv.engine", "engine"):
    import torch
    import torch.nn.functional as F

from ..errors import EngineConfigError
from .memory import SharedArena, VirtualArena, check_page_size

__all__ = ["VirtualKVLayout", "LayoutStats", "pages_per_segment"]


def pages_per_segment(tokens: int, bytes_per_token: int, page_size: int) -> int:
    """Pages one segment (one layer's K or V of one sequence) needs to hold ``tokens`` tokens."""
    return -(-tokens * bytes_per_token // page_size)


@dataclass(frozen=True)
class LayoutStats:
    """A snapshot of :class:`VirtualKVLayout` (bytes unless named otherwise).

    Attributes:
        committed_bytes: pages committed now, all segments (the layout's own count).
        resident_bytes: the arena's resident set according to the OS (``/proc/self/smaps``).
        token_bytes: bytes holding a token's K or V (tokens held x bytes per token, all layers).
        budget_bytes: the physical budget.
        peak_committed_bytes: the most committed at once.
        page_faults: minor faults taken while committing.
        pages_committed, pages_released: totals since construction.
        sequences: sequences holding a slot.
        attention_s: seconds spent in :meth:`VirtualKVLayout.attend` (writes + attention).
        prefix_hit_tokens: tokens served by mapped cached pages (sum of the hits, recompute
            resumes included; the manager's hit-rate counters count first lookups only).
        shared_pages: pages mapped from existing frames (prefix hits and forks, all segments).
        cow_pages: pages copied before a write into a page another holder maps.
        cached_pages: frames the prefix cache holds now (all segments).
        peak_used_bytes: the most held by sequences at once (shared pages once; the cache's
            unmapped pages, free on demand, not counted); ``peak_committed_bytes`` counts them.
    """

    committed_bytes: int
    resident_bytes: int
    token_bytes: int
    budget_bytes: int
    peak_committed_bytes: int
    page_faults: int
    pages_committed: int
    pages_released: int
    sequences: int
    attention_s: float
    prefix_hit_tokens: int = 0
    shared_pages: int = 0
    cow_pages: int = 0
    cached_pages: int = 0
    peak_used_bytes: int = 0


class VirtualKVLayout:
    """Contiguous per-sequence K/V ranges over reserved virtual memory (see the module docs).

    Args:
        num_layers, num_kv_heads, head_size: the model's KV shape.
        dtype: KV dtype (the model's).
        page_size: commit granularity in bytes (4096, 65536 or 2097152).
        budget_bytes: physical bytes the layout may commit, >= one page per segment.
        max_seqs: slots (most sequences holding KV at once), >= 1.
        max_seq_len: tokens each slot's segments are reserved for, >= 1.
        device: ``None`` or a CPU device (an anonymous ``mmap``), or a CUDA device (the driver's
            virtual memory API, :class:`~pagedkv.engine.virtual.memory_cuda.CudaVirtualArena`;
            untested: written without a GPU).
        sharing: pages mappable into several sequences' ranges (prefix caching, forks; a
            :class:`~pagedkv.engine.virtual.memory.SharedArena`); CPU only.

    Raises:
        EngineConfigError: a bad page size, a budget too small for one token of one sequence,
            a bad count (the message names the value), or ``sharing`` on a CUDA device.
        HugePagesUnavailableError: 2 MiB pages without transparent huge pages.
        DeviceUnavailableError: a CUDA device without a GPU, driver or cuda-python.
    """

    def __init__(
        self,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_size: int,
        dtype: torch.dtype,
        page_size: int,
        budget_bytes: int,
        max_seqs: int,
        max_seq_len: int,
        device: torch.device | str | None = None,
        sharing: bool = False,
    ) -> None:
        self.page_size = check_page_size(page_size)
        for name, v in (("max_seqs", max_seqs), ("max_seq_len", max_seq_len)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise EngineConfigError(f"{name}={v!r} is invalid: expected an integer >= 1")
        self.num_layers, self.num_kv_heads, self.head_size, self.dtype = num_layers, num_kv_heads, head_size, dtype
        self.element_size = torch.tensor([], dtype=dtype).element_size()
        self.bytes_per_token = num_kv_heads * head_size * self.element_size  # one layer's K (or V)
        self.num_segments = 2 * num_layers
        self.max_seqs, self.max_seq_len = max_seqs, max_seq_len
        self.segment_bytes = pages_per_segment(max_seq_len, self.bytes_per_token, page_size) * page_size
        self.slot_bytes = self.num_segments * self.segment_bytes
        if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes < 0:
            raise EngineConfigError(f"budget_bytes={budget_bytes!r} is invalid: expected a number of bytes >= 0")
        self.total_pages = budget_bytes // page_size
        if self.total_pages < self.num_segments:
            raise EngineConfigError(
                f"budget_bytes={budget_bytes} is invalid: it holds {self.total_pages} pages of {page_size} "
                f"bytes, fewer than the {self.num_segments} (one per layer's K and V) a one-token sequence needs"
            )
        self.budget_bytes = budget_bytes
        dev = torch.device(device) if device is not None else torch.device("cpu")
        self.sharing = bool(sharing)
        if self.sharing and dev.type != "cpu":
            raise EngineConfigError(f"sharing=True is invalid on {dev}: shared pages need the CPU arena")
        if self.sharing:
            self.arena: VirtualArena | SharedArena | CudaVirtualArena = SharedArena(
                max_seqs * self.slot_bytes, page_size, self.total_pages
            )
        elif dev.type == "cuda":
            from .memory_cuda import CudaVirtualArena

            self.arena = CudaVirtualArena(max_seqs * self.slot_bytes, page_size, dev.index or 0)
        else:
            self.arena = VirtualArena(max_seqs * self.slot_bytes, page_size)
        self._free_slots = list(range(max_seqs - 1, -1, -1))
        self._slot: dict[int, int] = {}  # seq id -> slot
        self._pages: dict[int, int] = {}  # seq id -> committed pages per segment
        self._tokens: dict[int, int] = {}  # seq id -> tokens of KV it holds (its last step's length)
        self._views: dict[int, list[torch.Tensor]] = {}  # slot -> [K0, V0, K1, V1, ...] [max_seq_len, H, D]
        self._private_used = 0  # pages committed (no sharing)
        self.attention_s = 0.0
        # sharing: the prefix cache of page groups (module docs)
        self._keys: dict[int, list[bytes]] = {}  # seq id -> chain hashes of its full pages 0, 1, ...
        self._cache: dict[bytes, tuple[int, ...]] = {}  # hash -> frames of the page group (one per segment)
        self._entry_of: dict[int, bytes] = {}  # first segment's frame -> hash
        self._evictable: OrderedDict[bytes, None] = OrderedDict()  # groups only the cache holds, LRU first
        self.prefix_hit_tokens = self.shared_pages = self.cow_pages = 0
        self.peak_used_pages = 0

    @property
    def used_pages(self) -> int:
        """Pages of the budget in use by sequences (shared frames once; cached frames no
        sequence maps are free: evicted on demand)."""
        if isinstance(self.arena, SharedArena):
            return self.arena.live_frames - len(self._evictable) * self.num_segments
        return self._private_used

    # ---- accounting ---------------------------------------------------------------------------

    @property
    def num_free_pages(self) -> int:
        """Pages of the budget not committed."""
        return self.total_pages - self.used_pages

    def pages_for(self, tokens: int) -> int:
        """Pages (all segments) a sequence of ``tokens`` tokens holds."""
        return self.num_segments * pages_per_segment(tokens, self.bytes_per_token, self.page_size)

    def pages_held(self, seq_id: int) -> int:
        """Pages (all segments) ``seq_id`` holds now (0 for none)."""
        return self.num_segments * self._pages.get(seq_id, 0)

    def pages_to_grow(self, seq_id: int, tokens: int) -> int:
        """Pages ``seq_id`` must still commit to hold ``tokens`` tokens (0 when it already can)."""
        return max(0, self.pages_for(tokens) - self.pages_held(seq_id))

    def can_hold(self, seq_id: int, tokens: int, start: int | None = None) -> bool:
        """True when :meth:`ensure` would succeed."""
        if tokens > self.max_seq_len:
            return False
        if seq_id not in self._slot and not self._free_slots:
            return False
        cow = self.num_segments * len(self._cow_pages(seq_id, tokens, start, fresh_only=True))
        return self.pages_to_grow(seq_id, tokens) + cow <= self.num_free_pages

    def ensure(self, seq_id: int, tokens: int, start: int | None = None) -> bool:
        """Commit pages so that ``seq_id`` holds ``tokens`` tokens of K/V in every layer (a slot
        taken on first use). ``start``: the first position this step writes (with sharing, a
        page from there on that another holder maps is copied first: copy-on-write). All or
        nothing: on False nothing changed (the budget, the slots or ``max_seq_len`` do not
        allow it)."""
        if not self.can_hold(seq_id, tokens, start):
            return False
        slot = self._take_slot(seq_id)
        for page in self._cow_pages(seq_id, tokens, start):
            self._copy_on_write(slot, page)
        have = self._pages[seq_id]
        want = pages_per_segment(tokens, self.bytes_per_token, self.page_size)
        if want > have:
            p = self.page_size
            self._make_room(self.num_segments * (want - have))
            for seg in range(self.num_segments):
                self.arena.commit(self._offset(slot, seg, have), (want - have) * p)
            if not self.sharing:
                self._private_used += self.num_segments * (want - have)
            self._pages[seq_id] = want
        self._tokens[seq_id] = max(self._tokens.get(seq_id, 0), tokens)
        self.peak_used_pages = max(self.peak_used_pages, self.used_pages)
        return True

    def _offset(self, slot: int, seg: int, page: int) -> int:
        """Byte offset of page ``page`` of segment ``seg`` of ``slot`` in the arena."""
        return slot * self.slot_bytes + seg * self.segment_bytes + page * self.page_size

    def _take_slot(self, seq_id: int) -> int:
        slot = self._slot.get(seq_id)
        if slot is None:
            slot = self._slot[seq_id] = self._free_slots.pop()
            self._pages[seq_id] = 0
        return slot

    def release(self, seq_id: int) -> bool:
        """Return every page of ``seq_id`` to the OS (``MADV_DONTNEED``; with sharing, its
        mappings are dropped and frames no one else holds are returned) and its slot; False
        when it held none (idempotent)."""
        slot = self._slot.pop(seq_id, None)
        if slot is None:
            return False
        have = self._pages.pop(seq_id)
        self._tokens.pop(seq_id, None)
        self._keys.pop(seq_id, None)
        if have:
            arena = self.arena
            heads = (
                [arena.frame_at(self._offset(slot, 0, q)) for q in range(have)]
                if isinstance(arena, SharedArena)
                else []
            )
            for seg in range(self.num_segments):
                self.arena.release(self._offset(slot, seg, 0), have * self.page_size)
            for head in reversed(heads):  # deepest pages first in the LRU order: evicted first
                self._note_unmapped(head)
        if not self.sharing:
            self._private_used -= self.num_segments * have
        self._free_slots.append(slot)
        return True

    # ---- sharing: forks, the prefix cache, copy-on-write -------------------------------------

    def _cow_pages(self, seq_id: int, tokens: int, start: int | None, *, fresh_only: bool = False) -> list[int]:
        """Pages ``seq_id`` will write (positions ``start .. tokens``) that another holder maps;
        ``fresh_only``: only those whose copy needs a frame beyond the ones it frees (a page
        only the cache holds besides this sequence becomes evictable when copied)."""
        if not self.sharing or start is None or seq_id not in self._slot:
            return []
        arena = self.arena
        assert isinstance(arena, SharedArena)
        slot, have = self._slot[seq_id], self._pages[seq_id]
        first = start * self.bytes_per_token // self.page_size
        last = min(have, pages_per_segment(tokens, self.bytes_per_token, self.page_size))
        out = []
        for page in range(first, last):
            head = arena.frame_at(self._offset(slot, 0, page))
            others = arena.refcount(head) - 1 - (head in self._entry_of)
            if others > 0 or (not fresh_only and arena.refcount(head) > 1):
                out.append(page)
        return out

    def _copy_on_write(self, slot: int, page: int) -> None:
        """Give ``slot`` private frames for page group ``page`` holding the same bytes."""
        arena = self.arena
        assert isinstance(arena, SharedArena)
        p = self.page_size
        head = arena.frame_at(self._offset(slot, 0, page))
        offsets = [self._offset(slot, seg, page) for seg in range(self.num_segments)]
        data = [arena.bytes[off : off + p].clone() for off in offsets]
        for off in offsets:
            arena.release(off, p)
        self._note_unmapped(head)  # a group left to the cache alone may be evicted for the copy
        self._make_room(self.num_segments)
        for off, d in zip(offsets, data):
            arena.commit(off, p)
            arena.bytes[off : off + p].copy_(d)
        self.cow_pages += self.num_segments

    def _make_room(self, frames: int) -> None:
        """Evict cached page groups no sequence maps (LRU) until ``frames`` frames are free."""
        arena = self.arena
        if not isinstance(arena, SharedArena):
            return
        while arena.num_free_frames < frames and self._evictable:
            key, _ = self._evictable.popitem(last=False)
            group = self._cache.pop(key)
            del self._entry_of[group[0]]
            for f in group:
                arena.drop(f)

    def _note_unmapped(self, head: int) -> None:
        """A mapping of the page group whose first frame is ``head`` went away: a cached group
        left to the cache alone becomes evictable (most recent)."""
        key = self._entry_of.get(head)
        if key is not None and isinstance(self.arena, SharedArena) and self.arena.refcount(head) == 1:
            self._evictable[key] = None

    def _end(self, page: int) -> int:
        """Tokens deciding page ``page``'s contents: ``ceil((page + 1) * page_size / bytes_per_token)``."""
        return -(-(page + 1) * self.page_size // self.bytes_per_token)

    def _chain(self, prev: bytes, token_ids: Sequence[int] | Any, page: int) -> bytes:
        lo = self._end(page - 1) if page else 0
        chunk = np.asarray(token_ids[lo : self._end(page)], dtype=np.int64).tobytes()
        return hashlib.blake2b(prev + chunk, digest_size=16).digest()

    def needs_register(self, seq_id: int, num_computed: int) -> bool:
        """True when ``seq_id`` has a full page group not yet registered (cheap check)."""
        full = min(num_computed * self.bytes_per_token // self.page_size, self._pages.get(seq_id, 0))
        return self.sharing and full > len(self._keys.get(seq_id, ()))

    def register(self, seq_id: int, token_ids: Sequence[int] | Any, num_computed: int, root: bytes) -> int:
        """Put ``seq_id``'s full page groups (its first ``num_computed`` tokens of
        ``token_ids`` computed) in the prefix cache under ``root`` (the sequence's cache salt
        and extra keys, hashed); a group whose hash is cached already stays private. Returns
        the groups added."""
        if not self.needs_register(seq_id, num_computed):
            return 0
        arena = self.arena
        assert isinstance(arena, SharedArena)
        slot, keys = self._slot[seq_id], self._keys.setdefault(seq_id, [])
        full = min(num_computed * self.bytes_per_token // self.page_size, self._pages[seq_id])
        added = 0
        for page in range(len(keys), full):
            key = self._chain(keys[-1] if keys else root, token_ids, page)
            keys.append(key)
            if key in self._cache:
                continue
            group = tuple(arena.frame_at(self._offset(slot, seg, page)) for seg in range(self.num_segments))
            if group[0] in self._entry_of:
                continue
            for f in group:
                arena.hold(f)
            self._cache[key] = group
            self._entry_of[group[0]] = key
            added += 1
        return added

    def lookup(self, token_ids: Sequence[int] | Any, root: bytes) -> tuple[int, list[bytes]]:
        """The hit of a new sequence with these prompt tokens and root: ``(H, hashes)``, the
        tokens it can skip (``min(floor(k * page / bytes_per_token), N - 1)`` for ``k`` matched
        page groups) and the hashes of the groups holding them. No side effects."""
        if not self.sharing:
            return 0, []
        n, keys, prev, page = len(token_ids), [], root, 0
        while self._end(page) <= n:
            prev = self._chain(prev, token_ids, page)
            if prev not in self._cache:
                break
            keys.append(prev)
            page += 1
        hit = min(len(keys) * self.page_size // self.bytes_per_token, n - 1)
        if hit <= 0:
            return 0, []
        return hit, keys[: pages_per_segment(hit, self.bytes_per_token, self.page_size)]

    def share_prefix(self, seq_id: int, token_ids: Sequence[int] | Any, root: bytes) -> int:
        """Map the cached page groups of the longest cached prefix of ``token_ids`` into the
        new sequence ``seq_id`` (it holds nothing yet); returns the hit tokens (0: no hit, no
        slot free, or ``seq_id`` holds pages already)."""
        if self._pages.get(seq_id) or (seq_id not in self._slot and not self._free_slots):
            return 0
        hit, keys = self.lookup(token_ids, root)
        if not hit:
            return 0
        arena = self.arena
        assert isinstance(arena, SharedArena)
        slot = self._take_slot(seq_id)
        for key in keys:  # mapped now: not evictable
            self._evictable.pop(key, None)
        groups = [self._cache[k] for k in keys]
        for seg in range(self.num_segments):
            arena.map_frames(self._offset(slot, seg, 0), [g[seg] for g in groups])
        self._pages[seq_id] = len(keys)
        self._keys[seq_id] = list(keys)
        self._tokens[seq_id] = hit
        self.prefix_hit_tokens += hit
        self.shared_pages += self.num_segments * len(keys)
        return hit

    def fork(self, parent_id: int, child_id: int, num_tokens: int) -> int:
        """Map the pages of ``parent_id`` holding its first ``num_tokens`` tokens into the new
        sequence ``child_id`` (no copy: the first write into a shared page copies it).
        Returns the pages mapped per segment.

        Raises:
            EngineConfigError: the layout was built without ``sharing``.
            pagedkv.OutOfBlocksError: no slot is free.
            KeyError: ``child_id`` holds a slot already, or ``parent_id`` holds none.
        """
        from pagedkv.errors import OutOfBlocksError

        if not self.sharing:
            raise EngineConfigError("fork is invalid on a virtual layout built with sharing=False")
        if child_id in self._slot or parent_id not in self._slot:
            raise KeyError(f"fork {parent_id} -> {child_id}: the parent must hold a slot, the child none")
        if not self._free_slots:
            raise OutOfBlocksError("virtual KV layout: no slot free for a fork", requested=1, available=0)
        arena = self.arena
        assert isinstance(arena, SharedArena)
        pslot = self._slot[parent_id]
        n = min(pages_per_segment(num_tokens, self.bytes_per_token, self.page_size), self._pages[parent_id])
        slot = self._take_slot(child_id)
        for seg in range(self.num_segments):
            frames = [arena.frame_at(self._offset(pslot, seg, q)) for q in range(n)]
            arena.map_frames(self._offset(slot, seg, 0), frames)
        self._pages[child_id] = n
        self._keys[child_id] = list(self._keys.get(parent_id, []))[:n]
        self._tokens[child_id] = num_tokens
        self.shared_pages += self.num_segments * n
        return n

    def reset_cache(self) -> None:
        """Drop the prefix cache (groups still mapped stay with their sequences)."""
        arena = self.arena
        if not isinstance(arena, SharedArena):
            return
        for group in self._cache.values():
            for f in group:
                arena.drop(f)
        self._cache.clear()
        self._entry_of.clear()
        self._evictable.clear()
        for keys in self._keys.values():
            keys.clear()

    def seq_ids(self) -> list[int]:
        """Sequences holding a slot."""
        return list(self._slot)

    def stats(self) -> LayoutStats:
        """The current :class:`LayoutStats`."""
        return LayoutStats(
            committed_bytes=self.used_pages * self.page_size,
            resident_bytes=self.arena.resident_bytes(),
            token_bytes=sum(self._tokens.values()) * self.bytes_per_token * self.num_segments,
            budget_bytes=self.budget_bytes,
            peak_committed_bytes=self.arena.peak_committed_bytes,
            page_faults=self.arena.faults,
            pages_committed=self.arena.commits,
            pages_released=self.arena.releases,
            sequences=len(self._slot),
            attention_s=self.attention_s,
            prefix_hit_tokens=self.prefix_hit_tokens,
            shared_pages=self.shared_pages,
            cow_pages=self.cow_pages,
            cached_pages=len(self._cache) * self.num_segments,
            peak_used_bytes=self.peak_used_pages * self.page_size,
        )

    # ---- K/V access and attention ---------------------------------------------------------------

    def segments(self, seq_id: int) -> list[torch.Tensor]:
        """``[K_0, V_0, K_1, V_1, ...]``: each ``[max_seq_len, num_kv_heads, head_size]``, a view
        of ``seq_id``'s contiguous range (positions past its committed pages must not be read
        or written)."""
        slot = self._slot[seq_id]
        views = self._views.get(slot)
        if views is None:
            n = self.max_seq_len * self.bytes_per_token
            base = slot * self.slot_bytes
            views = [
                self.arena.bytes[base + s * self.segment_bytes : base + s * self.segment_bytes + n]
                .view(self.dtype)
                .view(self.max_seq_len, self.num_kv_heads, self.head_size)
                for s in range(self.num_segments)
            ]
            self._views[slot] = views
        return views

    def attend(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        seqs: list[tuple[int, int, int, int]],
        softmax_scale: float,
    ) -> torch.Tensor:
        """Layer ``layer`` of one step: write each sequence's new ``k``/``v`` rows into its
        contiguous range, then causal attention of its queries over ``[0, seq_len)`` of it.

        Args:
            q: ``[T, num_heads, head_size]``; k, v: ``[T, num_kv_heads, head_size]`` (the
                step's flat varlen batch).
            seqs: per sequence ``(seq_id, q_start, q_end, context_len)``: its query rows and
                the tokens it held before this step (its new tokens sit at positions
                ``context_len ..``).
            softmax_scale: multiplier of ``q.k``.

        Returns:
            ``[T, num_heads, head_size]`` in ``q.dtype`` (math in fp32, as the paged reference).
        """
        t0 = time.perf_counter()
        t, hq, d = q.shape
        hkv = self.num_kv_heads
        g = hq // hkv
        out = torch.empty(t, hq, d, dtype=torch.float32, device=q.device)
        for seq_id, start, end, ctx in seqs:
            views = self.segments(seq_id)
            kc, vc = views[2 * layer], views[2 * layer + 1]
            n = end - start
            s = ctx + n
            kc[ctx:s] = k[start:end]
            vc[ctx:s] = v[start:end]
            ks = kc[:s].float().transpose(0, 1)  # [Hkv, S, D]
            vs = vc[:s].float().transpose(0, 1)
            qs = q[start:end].float().reshape(n, hkv, g, d).permute(1, 2, 0, 3)  # [Hkv, G, n, D]
            ke, ve = ks.unsqueeze(1).expand(hkv, g, s, d), vs.unsqueeze(1).expand(hkv, g, s, d)
            if ctx == 0:
                o = F.scaled_dot_product_attention(qs, ke, ve, is_causal=True, scale=softmax_scale)
            elif n == 1:  # a decode sees its whole context
                o = F.scaled_dot_product_attention(qs, ke, ve, scale=softmax_scale)
            else:  # a chunk after a context: query i sees positions <= ctx + i
                mask = torch.arange(s, device=q.device)[None, :] <= (ctx + torch.arange(n, device=q.device))[:, None]
                o = F.scaled_dot_product_attention(qs, ke, ve, attn_mask=mask, scale=softmax_scale)
            out[start:end] = o.permute(2, 0, 1, 3).reshape(n, hq, d)
        self.attention_s += time.perf_counter() - t0
        return out if q.dtype == torch.float32 else out.to(q.dtype)

    def close(self) -> None:
        """Release every sequence, drop the prefix cache and unmap the arena."""
        for seq_id in list(self._slot):
            self.release(seq_id)
        self.reset_cache()
        self._views.clear()
        self.arena.close()
