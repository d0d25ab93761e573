"""Static model of decode attention's memory traffic: the bytes every program of
:func:`pagedkv.kernels.attention.paged_attention` reads, from its launch grid and tile sizes,
against the minimum a decode step must read.

Minimum per sequence of ``S`` cached tokens: its K and V once per KV head
(``2 * S * Hkv * D * elem`` bytes), its query once (``Hq * D * elem``) and its live block-table
entries once (``4 * ceil(S / block_size)``).

Model of the kernel (grid ``(B, Hkv, splits)`` for decode, one program per sequence, KV head and
KV partition, the GQA group packed into the tile's rows): each program reads its sequence's
three metadata ints, the ``G`` query rows of its KV head, then for each ``BLOCK_N`` step the
block-table entries of the step's positions and the K and V rows of the live positions (masked
lanes read nothing). Memory moves in 32-byte sectors: every load is rounded to the sectors it
touches, and a sector read by two loads counts twice (no cache reuse is assumed, so the model
is an upper bound). With split-KV, the partial results each program writes and the merge
kernel reads back are reported separately (``split_bytes``), as traffic on top of the reads.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch

from . import configs as C

__all__ = ["DecodeShape", "DecodeTraffic", "decode_traffic", "ENGINE_SHAPES", "engine_report", "markdown"]

SECTOR = 32


def _sectors(first_byte: int, nbytes: int) -> int:
    """Bytes of the 32-byte sectors covering ``[first_byte, first_byte + nbytes)``."""
    if nbytes <= 0:
        return 0
    return ((first_byte + nbytes - 1) // SECTOR - first_byte // SECTOR + 1) * SECTOR


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class DecodeShape:
    """A decode step: ``batch`` sequences of ``seq_len`` cached tokens (the new one included).

    Attributes:
        name: label for the report.
        num_q_heads, num_kv_heads, head_size: attention shape (``Hq``, ``Hkv``, ``D``).
        dtype: K/V and query dtype.
        block_size: cache block size (tokens).
        batch, seq_len: sequences and tokens per sequence.
        num_sms: SM count the launcher's split-KV choice sees (132: H100/H200, 108: A100).
    """

    name: str
    num_q_heads: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype
    block_size: int
    batch: int
    seq_len: int
    num_sms: int = 132


@dataclass(frozen=True)
class DecodeTraffic:
    """Modelled bytes of one decode launch (see the module docs), all in bytes.

    ``ratio`` = ``read_bytes / min_bytes`` (the figure to keep at or under 1.1);
    ``ratio_with_split`` adds the split-KV partials written and read back.
    """

    shape: DecodeShape
    tile: C.AttentionTile
    num_splits: int
    programs: int
    kv_bytes: int
    query_bytes: int
    block_table_bytes: int
    metadata_bytes: int
    read_bytes: int
    min_bytes: int
    split_bytes: int
    ratio: float
    ratio_with_split: float


def decode_traffic(shape: DecodeShape, num_kv_splits: int | None = None) -> DecodeTraffic:
    """Model one decode launch of ``shape`` with the launcher's tile and split choice (or
    ``num_kv_splits`` when given). Positions are taken as stored in distinct blocks (a paged
    pool: each block's rows are contiguous, blocks are anywhere)."""
    from .attention import default_num_kv_splits  # the launcher's own split rule

    e = torch.empty((), dtype=shape.dtype).element_size()
    hkv, d, bs, s_len = shape.num_kv_heads, shape.head_size, shape.block_size, shape.seq_len
    g = shape.num_q_heads // hkv
    tile = C.attention_tile(shape.dtype, d, g, 1)
    bn = tile.block_n
    programs = shape.batch * hkv
    splits = num_kv_splits or default_num_kv_splits(programs, s_len, shape.num_sms)
    row = d * e  # one position's K (or V) row of one KV head; rows start at multiples of D * elem
    chunk = _cdiv(_cdiv(s_len, splits), bn) * bn if splits > 1 else s_len
    kv = qb = btb = meta = 0
    for _ in range(hkv):
        for sp in range(splits):
            lo = sp * chunk if splits > 1 else 0
            hi = min(s_len, lo + chunk)
            meta += 3 * SECTOR  # seq_lens[b], query_start_loc[b], [b + 1]: one sector each at worst
            qb += g * _sectors(0, row)
            for start in range(lo, hi, bn):
                stop = min(start + bn, hi)
                pages = range(start // bs, (stop - 1) // bs + 1)
                btb += _sectors(4 * pages.start, 4 * len(pages))
                kv += 2 * (stop - start) * _sectors(0, row)
    kv, qb, btb, meta = kv * shape.batch, qb * shape.batch, btb * shape.batch, meta * shape.batch
    read = kv + qb + btb + meta
    minimum = shape.batch * (2 * s_len * hkv * row + shape.num_q_heads * row + 4 * _cdiv(s_len, bs))
    bd = C.block_d_for(d)
    split_bytes = 0
    if splits > 1:
        # each program writes G rows of (acc[D] fp32, m, l); the merge reads them all back
        split_bytes = 2 * shape.batch * splits * shape.num_q_heads * (4 * min(d, bd) + 8)
    return DecodeTraffic(
        shape,
        tile,
        splits,
        programs * splits,
        kv,
        qb,
        btb,
        meta,
        read,
        minimum,
        split_bytes,
        read / minimum,
        (read + split_bytes) / minimum,
    )


#: The engine's model (SmolLM2-135M) and common 128-head GQA serving shapes, bf16, block 16.
ENGINE_SHAPES: tuple[tuple[str, int, int, int], ...] = (
    ("SmolLM2-135M (9/3 heads, D 64)", 9, 3, 64),
    ("Llama-3-8B (32/8, D 128)", 32, 8, 128),
    ("Qwen2.5-7B (28/4, D 128)", 28, 4, 128),
    ("Llama-3-70B TP8 (8/1, D 128)", 8, 1, 128),
)
BATCHES = (1, 16, 64, 256)
SEQ_LENS = (128, 1024, 8192)


def engine_report(
    block_sizes: tuple[int, ...] = (16,), dtype: torch.dtype = torch.bfloat16, num_sms: int = 132
) -> list[dict[str, Any]]:
    """:func:`decode_traffic` over :data:`ENGINE_SHAPES` x batches x sequence lengths, as rows."""
    rows = []
    for (name, hq, hkv, d), bs, b, s in (
        (x, bs, b, s) for x in ENGINE_SHAPES for bs in block_sizes for b in BATCHES for s in SEQ_LENS
    ):
        t = decode_traffic(DecodeShape(name, hq, hkv, d, dtype, bs, b, s, num_sms))
        rows.append(
            {
                "shape": name,
                "num_q_heads": hq,
                "num_kv_heads": hkv,
                "head_size": d,
                "dtype": str(dtype).replace("torch.", ""),
                "block_size": bs,
                "batch": b,
                "seq_len": s,
                "num_sms": num_sms,
                "tile": asdict(t.tile),
                "num_splits": t.num_splits,
                "programs": t.programs,
                "kv_bytes": t.kv_bytes,
                "query_bytes": t.query_bytes,
                "block_table_bytes": t.block_table_bytes,
                "metadata_bytes": t.metadata_bytes,
                "read_bytes": t.read_bytes,
                "min_bytes": t.min_bytes,
                "split_bytes": t.split_bytes,
                "ratio": round(t.ratio, 4),
                "ratio_with_split": round(t.ratio_with_split, 4),
            }
        )
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    """Table of :func:`engine_report` rows (worst ratio first line)."""
    worst = max(rows, key=lambda r: r["ratio"])
    worst_s = max(rows, key=lambda r: r["ratio_with_split"])
    out = [
        "Decode attention memory traffic (static model: bytes read / minimum; target <= 1.1). "
        f"Worst read ratio {worst['ratio']:.3f} ({worst['shape']}, batch {worst['batch']}, seq {worst['seq_len']}); "
        f"worst with split-KV partials {worst_s['ratio_with_split']:.3f} ({worst_s['shape']}, batch "
        f"{worst_s['batch']}, seq {worst_s['seq_len']}, {worst_s['num_splits']} splits).",
        "",
        "| shape | batch | seq len | splits | programs | read MB | minimum MB | ratio | ratio incl. split partials |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        out.append(
            f"| {r['shape']} | {r['batch']} | {r['seq_len']} | {r['num_splits']} | {r['programs']} | "
            f"{r['read_bytes'] / 1e6:.3f} | {r['min_bytes'] / 1e6:.3f} | {r['ratio']:.3f} | "
            f"{r['ratio_with_split']:.3f} |"
        )
    return "\n".join(out) + "\n"
