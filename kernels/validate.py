"""Input checks shared by the Triton kernels and their torch references.

Every check runs on the host before anything is launched and raises
:class:`pagedkv.errors.KernelInputError` (a ``ValueError``) whose message names the op, the
tensor, what it got and what it expected, e.g.::

    paged_attention: block_table has dtype torch.int64, expected torch.int32

Checks of tensor *values* (block ids in range, ``query_start_loc`` monotone, ...) read the
tensor, so they only run when that tensor is on the CPU (the usual case: metadata comes from
the manager as numpy). Metadata already on a GPU is checked for dtype/shape/device only, to
avoid a device synchronisation on the hot path.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from pagedkv.errors import KernelInputError as KernelInputError  # re-exported for the ops

#: Dtypes the attention and cache kernels accept for activations and caches.
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
#: Largest head size the Triton attention kernel handles (padded to a power of two).
MAX_HEAD_SIZE = 256


def _fmt_dtypes(dtypes: Iterable[torch.dtype]) -> str:
    return " or ".join(str(d) for d in dtypes)


def check_tensor(
    op: str,
    name: str,
    t: object,
    *,
    dtypes: Sequence[torch.dtype] | None = None,
    ndim: int | None = None,
    shape: Sequence[int | None] | None = None,
    device: torch.device | None = None,
    contiguous: bool = False,
    last_dim_contiguous: bool = False,
) -> None:
    """Check one tensor argument; raise ``KernelInputError`` naming ``name`` on the first mismatch.

    ``shape`` entries that are ``None`` are not checked. ``device`` compares type and index.
    """
    if not isinstance(t, torch.Tensor):
        raise KernelInputError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if dtypes is not None and t.dtype not in dtypes:
        raise KernelInputError(f"{op}: {name} has dtype {t.dtype}, expected {_fmt_dtypes(dtypes)}")
    if ndim is not None and t.dim() != ndim:
        raise KernelInputError(f"{op}: {name} has {t.dim()} dims (shape {tuple(t.shape)}), expected {ndim} dims")
    if shape is not None:
        if t.dim() != len(shape) or any(s is not None and s != got for s, got in zip(shape, t.shape)):
            want = "(" + ", ".join("*" if s is None else str(s) for s in shape) + ("," if len(shape) == 1 else "") + ")"
            raise KernelInputError(f"{op}: {name} has shape {tuple(t.shape)}, expected {want}")
    if device is not None and not same_device(t.device, device):
        raise KernelInputError(f"{op}: {name} is on device {t.device}, expected device {device}")
    if contiguous and not t.is_contiguous():
        raise KernelInputError(f"{op}: {name} is not contiguous (strides {t.stride()}), expected a contiguous tensor")
    if last_dim_contiguous and t.dim() > 0 and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise KernelInputError(f"{op}: {name} has last-dim stride {t.stride(-1)}, expected 1 (contiguous head dim)")


def same_device(a: torch.device, b: torch.device) -> bool:
    """True when ``a`` and ``b`` name the same device (``cuda`` == ``cuda:<current>``)."""
    if a.type != b.type:
        return False
    if a.type == "cuda":
        ia = a.index if a.index is not None else torch.cuda.current_device()
        ib = b.index if b.index is not None else torch.cuda.current_device()
        return ia == ib
    return True


def check_cache_pair(op: str, key_cache: object, value_cache: object) -> None:
    """Check a per-layer K/V cache pair ``[num_blocks, block_size, num_kv_heads, head_size]``.

    Both must be float tensors of the same dtype, shape and device, with a contiguous head dim.
    """
    check_tensor(op, "key_cache", key_cache, dtypes=FLOAT_DTYPES, ndim=4, last_dim_contiguous=True)
    assert isinstance(key_cache, torch.Tensor)
    check_tensor(
        op,
        "value_cache",
        value_cache,
        dtypes=(key_cache.dtype,),
        shape=tuple(key_cache.shape),
        device=key_cache.device,
        last_dim_contiguous=True,
    )


def check_block_mapping(
    op: str,
    block_mapping: object,
    num_src_blocks: int,
    num_dst_blocks: int,
    *,
    cow: bool,
    dst_has_null_block: bool = True,
) -> None:
    """Check a ``[K, 2]`` (src, dst) block list (int32 or int64).

    When the mapping is on the CPU also check values: every src in ``[0, num_src_blocks)``,
    every dst in ``[0, num_dst_blocks)``, dst ids pairwise distinct, no dst equal to the null
    block 0 when ``dst_has_null_block`` (block 0 of a device KV pool is padding that block
    tables point at; writing it would corrupt every padded read -- a CPU swap pool has no null
    block, so swap-outs pass False), and -- for an in-place copy (``cow=True``) -- no dst that
    is also a src (pairs run in parallel, so a block may not be read and written by the same
    launch).
    """
    check_tensor(op, "block_mapping", block_mapping, dtypes=(torch.int32, torch.int64), ndim=2)
    assert isinstance(block_mapping, torch.Tensor)
    if block_mapping.shape[1] != 2:
        raise KernelInputError(
            f"{op}: block_mapping has shape {tuple(block_mapping.shape)}, expected (K, 2) (src, dst) pairs"
        )
    if block_mapping.device.type != "cpu" or block_mapping.numel() == 0:
        return
    src = block_mapping[:, 0]
    dst = block_mapping[:, 1]
    if int(src.min()) < 0 or int(src.max()) >= num_src_blocks:
        raise KernelInputError(
            f"{op}: block_mapping src ids span [{int(src.min())}, {int(src.max())}], "
            f"expected ids in [0, {num_src_blocks})"
        )
    if int(dst.min()) < 0 or int(dst.max()) >= num_dst_blocks:
        raise KernelInputError(
            f"{op}: block_mapping dst ids span [{int(dst.min())}, {int(dst.max())}], "
            f"expected ids in [0, {num_dst_blocks})"
        )
    if dst_has_null_block:
        hit = (dst == 0).nonzero()
        if hit.numel():
            i = int(hit[0, 0])
            raise KernelInputError(f"{op}: block_mapping[{i}] has dst block 0 (the null block), expected dst ids >= 1")
    if torch.unique(dst).numel() != dst.numel():
        raise KernelInputError(f"{op}: block_mapping has repeated dst ids, expected distinct dst blocks")
    if cow:
        overlap = set(src.tolist()) & set(dst.tolist())
        if overlap:
            raise KernelInputError(
                f"{op}: block_mapping uses block(s) {sorted(overlap)[:8]} as both src and dst, "
                "expected disjoint src and dst sets"
            )


def check_reshape_and_cache(
    op: str,
    key: object,
    value: object,
    key_cache: object,
    value_cache: object,
    slot_mapping: object,
) -> int | None:
    """Validate ``reshape_and_cache`` arguments (see :func:`pagedkv.kernels.reshape_and_cache`).

    Returns:
        The smallest slot when the values were read (``slot_mapping`` on the CPU and not
        empty), else None: callers pick a no-padding fast path from it without reading again.
    """
    check_cache_pair(op, key_cache, value_cache)
    assert isinstance(key_cache, torch.Tensor)
    _, block_size, num_kv_heads, head_size = key_cache.shape
    dev = key_cache.device
    check_tensor(op, "key", key, dtypes=(key_cache.dtype,), ndim=3, device=dev, last_dim_contiguous=True)
    assert isinstance(key, torch.Tensor)
    t = key.shape[0]
    check_tensor(op, "key", key, shape=(t, num_kv_heads, head_size))
    check_tensor(
        op,
        "value",
        value,
        dtypes=(key_cache.dtype,),
        shape=(t, num_kv_heads, head_size),
        device=dev,
        last_dim_contiguous=True,
    )
    return check_slot_mapping(
        op, slot_mapping, num_tokens=t, num_blocks=key_cache.shape[0], block_size=block_size, device=dev
    )


def check_slot_mapping(
    op: str, slot_mapping: object, *, num_tokens: int, num_blocks: int, block_size: int, device: torch.device
) -> int | None:
    """Check an int64 ``[num_tokens]`` slot mapping on ``device``; on the CPU also its values:
    every slot ``< num_blocks * block_size`` and none in the null block 0 (negative slots are
    padding, skipped by the writes).

    Returns:
        The smallest slot when the values were read (on the CPU, not empty), else None.

    Raises:
        KernelInputError: naming the bad slot or property.
    """
    check_tensor(op, "slot_mapping", slot_mapping, dtypes=(torch.int64,), shape=(num_tokens,), device=device)
    assert isinstance(slot_mapping, torch.Tensor)
    if slot_mapping.device.type != "cpu" or num_tokens == 0:
        return None
    n_slots = num_blocks * block_size
    # One read for both bounds.
    lo, hi = (int(x) for x in torch.aminmax(slot_mapping))
    if hi >= n_slots:
        raise KernelInputError(
            f"{op}: slot_mapping has slot {hi}, expected slots < num_blocks*block_size = {n_slots} "
            "(negative slots are skipped)"
        )
    if lo < block_size:  # padding (< 0, skipped) or a null-block slot: look closer
        # Slots 0..block_size-1 are block 0, the null block: padding reads it, nobody owns it.
        hit = ((slot_mapping >= 0) & (slot_mapping < block_size)).nonzero()
        if hit.numel():
            i = int(hit[0, 0])
            raise KernelInputError(
                f"{op}: slot_mapping[{i}] is {int(slot_mapping[i])}, a slot in the null block 0 "
                f"(slots 0..{block_size - 1}); expected slots >= block_size={block_size} or < 0 (skipped)"
            )
    return lo


def check_paged_attention(
    op: str,
    query: object,
    key_cache: object,
    value_cache: object,
    block_table: object,
    seq_lens: object,
    query_start_loc: object,
    softmax_scale: object,
    sliding_window: int | None,
    out: object,
) -> None:
    """Validate ``paged_attention`` arguments (see :func:`pagedkv.kernels.paged_attention`):
    :func:`check_attention_tensors` then :func:`check_attention_metadata`."""
    check_attention_tensors(op, query, key_cache, value_cache, softmax_scale, out)
    assert isinstance(query, torch.Tensor) and isinstance(key_cache, torch.Tensor)
    num_blocks, block_size = key_cache.shape[:2]
    check_attention_metadata(
        op,
        block_table,
        seq_lens,
        query_start_loc,
        num_tokens=query.shape[0],
        num_blocks=num_blocks,
        block_size=block_size,
        device=key_cache.device,
        sliding_window=sliding_window,
    )


def check_attention_tensors(
    op: str,
    query: object,
    key_cache: object,
    value_cache: object,
    softmax_scale: object,
    out: object,
) -> None:
    """The per-layer half of the ``paged_attention`` checks: dtype, shape, device and stride of
    ``query`` ``[T, Hq, D]``, the cache pair ``[num_blocks, block_size, Hkv, D]`` and ``out``,
    ``Hq`` a multiple of ``Hkv``, and ``softmax_scale > 0``. O(1): reads no tensor values.

    Raises:
        KernelInputError: (a ``ValueError``) naming the bad argument, what it got and what it expected.
    """
    check_cache_pair(op, key_cache, value_cache)
    assert isinstance(key_cache, torch.Tensor)
    num_blocks, block_size, num_kv_heads, head_size = key_cache.shape
    dev = key_cache.device
    check_tensor(op, "query", query, dtypes=(key_cache.dtype,), ndim=3, device=dev, last_dim_contiguous=True)
    assert isinstance(query, torch.Tensor)
    t, num_q_heads, qd = query.shape
    if qd != head_size:
        raise KernelInputError(f"{op}: query has head_size {qd}, expected {head_size} (the cache's head_size)")
    if num_q_heads % num_kv_heads != 0:
        raise KernelInputError(
            f"{op}: query has {num_q_heads} heads, expected a multiple of num_kv_heads={num_kv_heads}"
        )
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)) or not softmax_scale > 0:
        raise KernelInputError(f"{op}: softmax_scale is {softmax_scale!r}, expected a positive float")
    if out is not None:
        check_tensor(
            op,
            "out",
            out,
            dtypes=(query.dtype,),
            shape=tuple(query.shape),
            device=dev,
            last_dim_contiguous=True,
        )


def check_attention_metadata(
    op: str,
    block_table: object,
    seq_lens: object,
    query_start_loc: object,
    *,
    num_tokens: int | None,
    num_blocks: int,
    block_size: int,
    device: torch.device,
    sliding_window: int | None,
) -> None:
    """The per-step half of the ``paged_attention`` checks: int32 ``block_table [B, M]``,
    ``seq_lens [B]``, ``query_start_loc [B+1]`` on ``device`` and ``sliding_window`` None or
    >= 1. On the CPU also the values: ``query_start_loc`` runs from 0 to ``num_tokens`` (any
    end when ``num_tokens`` is None) without decreasing, every query length <= its ``seq_len``,
    the block table is wide enough and its live entries are block ids in ``[0, num_blocks)``.
    Cost O(B * M) when on the CPU.

    Raises:
        KernelInputError: (a ``ValueError``) naming the bad argument, what it got and what it expected.
    """
    dev = device
    check_tensor(op, "block_table", block_table, dtypes=(torch.int32,), ndim=2, device=dev)
    assert isinstance(block_table, torch.Tensor)
    b = block_table.shape[0]
    check_tensor(op, "seq_lens", seq_lens, dtypes=(torch.int32,), shape=(b,), device=dev)
    check_tensor(op, "query_start_loc", query_start_loc, dtypes=(torch.int32,), shape=(b + 1,), device=dev)
    if sliding_window is not None and (
        isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or sliding_window < 1
    ):
        raise KernelInputError(f"{op}: sliding_window is {sliding_window!r}, expected None or an int >= 1")
    assert isinstance(seq_lens, torch.Tensor) and isinstance(query_start_loc, torch.Tensor)
    if dev.type != "cpu" or b == 0:
        return
    qsl = query_start_loc.to(torch.int64)
    t = int(qsl[-1]) if num_tokens is None else num_tokens
    if int(qsl[0]) != 0 or int(qsl[-1]) != t:
        raise KernelInputError(
            f"{op}: query_start_loc runs from {int(qsl[0])} to {int(qsl[-1])}, expected 0 to num_tokens={t}"
        )
    q_lens = qsl[1:] - qsl[:-1]
    if bool((q_lens < 0).any()):
        raise KernelInputError(f"{op}: query_start_loc is decreasing, expected non-decreasing offsets")
    sl = seq_lens.to(torch.int64)
    neg = (sl < 0).nonzero()
    if neg.numel():
        i = int(neg[0, 0])
        raise KernelInputError(f"{op}: seq_lens[{i}] is {int(sl[i])}, expected seq_lens >= 0")
    bad = (q_lens > sl).nonzero()
    if bad.numel():
        i = int(bad[0, 0])
        raise KernelInputError(
            f"{op}: sequence {i} has query length {int(q_lens[i])} > seq_lens[{i}]={int(sl[i])}, "
            "expected query length <= seq_len (queries are the last tokens of the sequence)"
        )
    need = int(((sl + block_size - 1) // block_size).max())
    if need > block_table.shape[1]:
        raise KernelInputError(
            f"{op}: block_table has {block_table.shape[1]} columns, expected >= {need} "
            f"(max seq_len {int(sl.max())} / block_size {block_size})"
        )
    if need > 0:
        used = block_table[:, :need]
        cols = torch.arange(need).unsqueeze(0)
        live = cols < ((sl + block_size - 1) // block_size).unsqueeze(1)
        ids = used[live]
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_blocks):
            raise KernelInputError(
                f"{op}: block_table holds block ids in [{int(ids.min())}, {int(ids.max())}], "
                f"expected ids in [0, {num_blocks})"
            )
