"""The virtual KV layout (vAttention, Prabhu et al., arXiv 2405.04437): each sequence's K and V
of each layer live in one contiguous virtual range, reserved for the longest sequence the
engine serves, with physical pages committed as the sequence grows and given back when it
finishes or is preempted. Attention reads the contiguous K/V slice directly: no block table.

Memory: one :class:`~pagedkv.engine.virtual_memory.VirtualArena` holds ``max_seqs`` *slots*;
a slot is ``2 * num_layers`` *segments* (layer ``l``'s K, then its V), each
``ceil(max_seq_len * bytes_per_token / page) * page`` bytes, page-aligned, so a segment's
pages are committed from its start. A sequence of ``t`` tokens holds ``ceil(t *
bytes_per_token / page)`` pages in every segment (``bytes_per_token = num_kv_heads *
head_size * element size``): the tail of the last page of each of its ``2 * num_layers``
segments is the layout's waste, where the paged layout wastes the tail of one block.

Accounting: :class:`VirtualKVLayout` commits against a physical budget in pages (the paged
pool's bytes at equal budget), all or nothing per sequence, and answers the scheduler's
capacity questions in pages (:mod:`pagedkv.engine.virtual_manager`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from pagedkv._optional import optional_imports

with optional_imports("pagedkv.engine", "engine"):
    import torch
    import torch.nn.functional as F

from .errors import EngineConfigError
from .virtual_memory import VirtualArena, check_page_size

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
            virtual memory API, :class:`~pagedkv.engine.virtual_memory_cuda.CudaVirtualArena`;
            untested: written without a GPU).

    Raises:
        EngineConfigError: a bad page size, a budget too small for one token of one sequence,
            or a bad count (the message names the value).
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
        if dev.type == "cuda":
            from .virtual_memory_cuda import CudaVirtualArena

            self.arena: VirtualArena | CudaVirtualArena = CudaVirtualArena(
                max_seqs * self.slot_bytes, page_size, dev.index or 0
            )
        else:
            self.arena = VirtualArena(max_seqs * self.slot_bytes, page_size)
        self._free_slots = list(range(max_seqs - 1, -1, -1))
        self._slot: dict[int, int] = {}  # seq id -> slot
        self._pages: dict[int, int] = {}  # seq id -> committed pages per segment
        self._tokens: dict[int, int] = {}  # seq id -> tokens of KV it holds (its last step's length)
        self._views: dict[int, list[torch.Tensor]] = {}  # slot -> [K0, V0, K1, V1, ...] [max_seq_len, H, D]
        self.used_pages = 0
        self.attention_s = 0.0

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

    def can_hold(self, seq_id: int, tokens: int) -> bool:
        """True when :meth:`ensure` would succeed."""
        if tokens > self.max_seq_len:
            return False
        if seq_id not in self._slot and not self._free_slots:
            return False
        return self.pages_to_grow(seq_id, tokens) <= self.num_free_pages

    def ensure(self, seq_id: int, tokens: int) -> bool:
        """Commit pages so that ``seq_id`` holds ``tokens`` tokens of K/V in every layer (a slot
        taken on first use). All or nothing: on False nothing changed (the budget, the slots or
        ``max_seq_len`` do not allow it)."""
        if not self.can_hold(seq_id, tokens):
            return False
        slot = self._slot.get(seq_id)
        if slot is None:
            slot = self._slot[seq_id] = self._free_slots.pop()
            self._pages[seq_id] = 0
        have = self._pages[seq_id]
        want = pages_per_segment(tokens, self.bytes_per_token, self.page_size)
        if want > have:
            p = self.page_size
            for seg in range(self.num_segments):
                self.arena.commit(slot * self.slot_bytes + seg * self.segment_bytes + have * p, (want - have) * p)
            self.used_pages += self.num_segments * (want - have)
            self._pages[seq_id] = want
        self._tokens[seq_id] = max(self._tokens.get(seq_id, 0), tokens)
        return True

    def release(self, seq_id: int) -> bool:
        """Return every page of ``seq_id`` to the OS (``MADV_DONTNEED``) and its slot; False
        when it held none (idempotent)."""
        slot = self._slot.pop(seq_id, None)
        if slot is None:
            return False
        have = self._pages.pop(seq_id)
        self._tokens.pop(seq_id, None)
        if have:
            for seg in range(self.num_segments):
                self.arena.release(slot * self.slot_bytes + seg * self.segment_bytes, have * self.page_size)
        self.used_pages -= self.num_segments * have
        self._free_slots.append(slot)
        return True

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
        """Release every sequence and unmap the arena."""
        for seq_id in list(self._slot):
            self.release(seq_id)
        self._views.clear()
        self.arena.close()
