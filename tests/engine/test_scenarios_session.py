"""Regression scenarios S4 and S7 (docs/design.md, "Regression scenarios") on the virtual KV
layout's page sharing (``VirtualKVLayout(sharing=True)``): copy-on-write at page granularity
after a fork, and release twice."""

from __future__ import annotations

import pytest
import torch

from pagedkv.engine.virtual_layout import VirtualKVLayout

PAGE = 4096
#: 1 layer x 2 KV heads x 12 dims fp32: 96 bytes per token, so page boundaries fall inside
#: tokens unless the token count is a multiple of 128 (3 pages).
BYTES_PER_TOKEN = 96


def _layout() -> VirtualKVLayout:
    return VirtualKVLayout(
        num_layers=1,
        num_kv_heads=2,
        head_size=12,
        dtype=torch.float32,
        page_size=PAGE,
        budget_bytes=64 * PAGE,
        max_seqs=4,
        max_seq_len=512,
        sharing=True,
    )


@pytest.mark.parametrize("write_child", [False, True])
@pytest.mark.parametrize("alen", [1, 16, 129])
@pytest.mark.parametrize("plen", [1, 16, 128, 129])
def test_s7_fork_copies_one_page_per_segment_iff_the_fork_point_is_inside_a_page(
    plen: int, alen: int, write_child: bool
) -> None:
    lay = _layout()
    segs = lay.num_segments
    assert lay.ensure(1, plen, start=0)
    for s, seg in enumerate(lay.segments(1)):
        seg[:plen] = torch.arange(plen, dtype=torch.float32).view(-1, 1, 1) + 1000 * s
    want = [seg[:plen].clone() for seg in lay.segments(1)]
    pages = -(-plen * BYTES_PER_TOKEN // PAGE)
    assert lay.fork(1, 2, plen) == pages
    assert lay.num_free_pages == 64 - segs * pages  # shared, once
    writer, other = (2, 1) if write_child else (1, 2)
    assert lay.ensure(writer, plen + alen, start=plen)
    for seg in lay.segments(writer):
        seg[plen : plen + alen] = -1.0
    straddles = plen * BYTES_PER_TOKEN % PAGE != 0
    assert lay.stats().cow_pages == segs * straddles
    grown = -(-(plen + alen) * BYTES_PER_TOKEN // PAGE) - pages
    assert lay.num_free_pages == 64 - segs * (pages + grown + straddles)
    # Neither side's prompt changed; the other side never sees the writer's tokens.
    for s in range(segs):
        assert torch.equal(lay.segments(other)[s][:plen], want[s])
        assert torch.equal(lay.segments(writer)[s][:plen], want[s])
        # The rest of the other side's straddling page (positions past its committed pages
        # must not be read) kept its zeros.
        end = min(plen + alen, pages * PAGE // BYTES_PER_TOKEN)
        assert not bool((lay.segments(other)[s][plen:end] == -1.0).any())
    assert lay.release(1) and lay.release(2)
    assert lay.stats().resident_bytes == 0 and lay.num_free_pages == 64
    lay.close()


def test_s4_release_twice_or_unknown_changes_nothing() -> None:
    lay = _layout()
    assert lay.ensure(1, 100, start=0)
    assert lay.fork(1, 2, 100) == 3
    assert lay.release(1)
    held = (lay.num_free_pages, lay.stats().resident_bytes, lay.seq_ids())
    assert held[0] == 64 - 3 * lay.num_segments  # the child keeps the shared pages
    assert not lay.release(1)
    assert not lay.release(42)
    assert (lay.num_free_pages, lay.stats().resident_bytes, lay.seq_ids()) == held
    assert lay.release(2)
    assert not lay.release(2)
    assert lay.stats().resident_bytes == 0 and lay.num_free_pages == 64
    lay.close()
