"""Kernel inputs built from the allocator's output: block tables, slot mapping, lengths.

One path from the allocator to the kernels: :meth:`BatchTensors.from_steps` takes the
:class:`pagedkv.StepOutput` of a scheduler step -- whose
arrays the core already lays out in the kernels' dtypes and shapes -- and hands every kernel
input over as torch tensors without re-validating, casting or copying on the host
(``torch.from_numpy``), then one transfer per tensor to the device. The block tables come from a
:class:`BlockTable` the caller keeps across steps: the core reports only what changed in each
table (the step output's table delta, per KV cache group), as
vLLM's GPU model runner keeps its block tables across steps and applies only the changes.
:class:`BlockTable` (``pagedkv._core.BlockTable``, in Rust: the core's ``BlockTables`` over one
numpy buffer for every group) does the whole per-step update in one call: the seq-id -> row
bookkeeping, the deltas (a delta that does not follow the version a row holds -- a skipped
output, a sequence id reused by a new sequence -- makes it read that sequence's tables whole),
and the batch's dense tables, a view of its persistent buffer (rows kept in batch order, so a
steady decode batch needs no gather). :class:`BatchTensors` carries them with a group axis
(``[G, S, W]``, ``G = 1`` for the one-group configuration). The engine's runner, the tests and
``benchmarks/step_overhead.py`` all use it. The other builders here are the validating entry for
arrays that did *not* come from the core (a caller's own block tables): they check their input
once and copy.

Conventions (PagedAttention, Kwon et al., SOSP'23; the CSR form as used by FlashInfer):

- **Dense block table** ``int32[num_seqs, max_blocks]``: row ``i`` lists sequence ``i``'s
  physical block ids in logical order, padded on the right with the null block ``0``.
- **CSR block table** ``indptr int32[num_seqs + 1]``, ``indices int32[nnz]``,
  ``last_page_len int32[num_seqs]``: sequence ``i`` owns pages
  ``indices[indptr[i]:indptr[i+1]]``; its last page holds ``last_page_len[i]`` tokens
  (``1..block_size``; 0 for an empty sequence).
- **Slot mapping** ``int64[num_tokens]``: the flat KV-cache slot of each scheduled token,
  ``block_id * block_size + offset``; ``-1`` marks padding (kernels skip negative slots).
- **seq_lens** ``int32[num_seqs]``: context + query tokens of each sequence (units: tokens);
  padding sequences have length 0.
- **query_start_loc** ``int32[num_seqs + 1]``: prefix sums of the query lengths; the queries of
  sequence ``i`` are tokens ``query_start_loc[i]:query_start_loc[i+1]`` of the flat batch.

Every builder takes ``device``: a torch device (``"cpu"``, ``"cuda"``, ``torch.device``) to get a
``torch.Tensor`` there, or ``None`` to get the numpy array and not import torch at all. torch is
imported lazily, on the first call that asks for a device. The validating builders always copy:
their result never aliases the caller's arrays. Bad input raises :class:`pagedkv.errors.InvalidArgumentError` naming
the argument and value. All builders are O(num_seqs + nnz) (or O(num_tokens)).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from pagedkv._core import BlockTable, StepOutput
from pagedkv._optional import optional_imports
from pagedkv._repr import short_repr
from pagedkv.errors import InvalidArgumentError

if TYPE_CHECKING:  # pragma: no cover - typing only
    import torch

    Device = str | torch.device | None
else:
    Device = Any

__all__ = [
    "BatchTensors",
    "BlockTable",
    "block_table_csr",
    "csr_block_table",
    "dense_block_table",
    "query_start_loc",
    "seq_lens",
    "slot_mapping",
]


def _bad(arg: str, value: object, reason: str) -> InvalidArgumentError:
    text = short_repr(value, 120)
    return InvalidArgumentError(f"invalid argument {arg} = {text}: {reason}", arg=arg, value=text, reason=reason)


def _int_vector(arg: str, value: npt.ArrayLike) -> npt.NDArray[np.int64]:
    """`value` as a fresh 1-D int64 array; rejects floats, bools, other ranks."""
    arr = np.asarray(value)
    if arr.ndim != 1:
        raise _bad(arg, value, f"expected a 1-D array, got shape {arr.shape}")
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if arr.dtype.kind not in "iu":  # rejects bool ("b"), floats, objects
        raise _bad(arg, value, f"expected integers, got dtype {arr.dtype}")
    return arr.astype(np.int64, copy=True)


def _check_pad(arg: str, pad_to: int | None, needed: int) -> int:
    if pad_to is None:
        return needed
    if isinstance(pad_to, bool) or not isinstance(pad_to, (int, np.integer)):
        raise _bad(arg, pad_to, "expected an int or None")
    if pad_to < needed:
        raise _bad(arg, pad_to, f"smaller than the {needed} entries needed")
    return int(pad_to)


_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1


def _check_int32(arg: str, arr: npt.NDArray[np.int64]) -> None:
    if arr.size and (arr.min() < _INT32_MIN or arr.max() > _INT32_MAX):
        raise _bad(arg, arr, "values do not fit in int32")


def _check_csr(indptr: npt.ArrayLike, indices: npt.ArrayLike) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    ip = _int_vector("indptr", indptr)
    ix = _int_vector("indices", indices)
    if ip.size == 0:
        raise _bad("indptr", indptr, "needs num_seqs + 1 >= 1 entries")
    if ip[0] != 0:
        raise _bad("indptr", indptr, f"must start at 0, starts at {int(ip[0])}")
    if ip.size > 1 and np.any(np.diff(ip) < 0):
        raise _bad("indptr", indptr, "must be non-decreasing")
    if ip[-1] != ix.size:
        raise _bad("indptr", indptr, f"ends at {int(ip[-1])} but indices has {ix.size} entries")
    if ix.size and ix.min() < 0:
        raise _bad("indices", indices, f"block ids must be >= 0, found {int(ix.min())}")
    _check_int32("indices", ix)
    return ip, ix


# One stateless context manager for every lazy torch import here (built once: cheap per call).
_TORCH_IMPORT = optional_imports("pagedkv.tensors (torch tensors, device not None)", "torch")


def _place(arr: npt.NDArray[Any], device: Device) -> Any:
    """numpy array -> numpy (device None) or a torch tensor on `device`: no copy on the CPU
    (the tensor shares `arr`'s memory), one transfer elsewhere."""
    if device is None:
        return arr
    with _TORCH_IMPORT:
        import torch  # lazy: `import pagedkv` must work without torch

    tensor = torch.from_numpy(np.ascontiguousarray(arr))
    target = device if isinstance(device, torch.device) else torch.device(device)
    return tensor if target.type == "cpu" else tensor.to(target)


def block_table_csr(
    block_tables: Sequence[npt.ArrayLike],
) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.int32]]:
    """Concatenate per-sequence block tables into the CSR pair ``(indptr, indices)``.

    Args:
        block_tables: one 1-D integer array per sequence (for example
            ``[manager.block_table(s) for s in batch]``), physical block ids in logical order.

    Returns:
        ``indptr int32[S+1]`` and ``indices int32[nnz]`` (numpy; feed them to
        :func:`dense_block_table` or :func:`csr_block_table`).
    """
    rows = [_int_vector(f"block_tables[{i}]", t) for i, t in enumerate(block_tables)]
    lens = np.fromiter((r.size for r in rows), dtype=np.int64, count=len(rows))
    indptr = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum(lens, out=indptr[1:])
    indices = np.concatenate(rows) if rows else np.zeros(0, dtype=np.int64)
    _, ix = _check_csr(indptr, indices)
    return indptr.astype(np.int32), ix.astype(np.int32)


def dense_block_table(
    indptr: npt.ArrayLike,
    indices: npt.ArrayLike,
    *,
    pad_to: int | None = None,
    device: Device = "cpu",
) -> Any:
    """Dense block table ``int32[num_seqs, max_blocks]`` padded with the null block 0.

    Args:
        indptr: ``int[S+1]`` CSR row pointers (e.g. from :func:`block_table_csr`).
        indices: ``int[nnz]`` physical block ids, row after row.
        pad_to: number of columns; default the longest table (at least 1 so the tensor is never
            0-wide). Must be >= the longest table.
        device: torch device for the result, or None for a numpy array.

    Raises:
        InvalidArgumentError: malformed CSR, negative ids, or ``pad_to`` too small.
    """
    ip, ix = _check_csr(indptr, indices)
    num_seqs = ip.size - 1
    lens = np.diff(ip)
    longest = int(lens.max()) if num_seqs else 0
    width = _check_pad("pad_to", pad_to, max(longest, 1) if pad_to is None else longest)
    return _place(_dense(lens, ix, width), device)


def _dense(lens: npt.NDArray[Any], indices: npt.NDArray[Any], width: int) -> npt.NDArray[np.int32]:
    """Scatter CSR rows into a zero-padded ``[len(lens), width]`` table. A boolean mask with the
    first ``lens[i]`` entries of row ``i`` set is filled in row-major order, which is CSR order."""
    out = np.zeros((lens.size, width), dtype=np.int32)
    if indices.size:
        out[np.arange(width) < lens[:, None]] = indices
    return out


def csr_block_table(
    indptr: npt.ArrayLike,
    indices: npt.ArrayLike,
    seq_lens: npt.ArrayLike,
    block_size: int,
    *,
    device: Device = "cpu",
) -> tuple[Any, Any, Any]:
    """CSR page table ``(indptr, indices, last_page_len)`` (int32) for FlashInfer-style kernels.

    Sequence ``i`` uses ``ceil(seq_lens[i] / block_size)`` pages; block-table entries beyond
    those (blocks reserved ahead) are dropped. ``last_page_len[i]`` is the number of tokens in
    its last page, ``1..block_size``, or 0 when ``seq_lens[i] == 0``.

    Args:
        indptr, indices: the sequences' block tables in CSR form.
        seq_lens: ``int[S]`` tokens per sequence (context + query).
        block_size: tokens per block (>= 1).
        device: torch device, or None for numpy arrays.

    Raises:
        InvalidArgumentError: malformed CSR, a negative length, a table too short for its
            length, or ``block_size < 1``.
    """
    ip, ix = _check_csr(indptr, indices)
    lens = _int_vector("seq_lens", seq_lens)
    if isinstance(block_size, bool) or not isinstance(block_size, (int, np.integer)):
        raise _bad("block_size", block_size, "expected an int")
    if block_size < 1:
        raise _bad("block_size", block_size, "must be >= 1")
    if lens.size != ip.size - 1:
        raise _bad("seq_lens", seq_lens, f"has {lens.size} entries for {ip.size - 1} sequences")
    if lens.size and lens.min() < 0:
        raise _bad("seq_lens", seq_lens, "lengths must be >= 0")
    pages = (lens + block_size - 1) // block_size
    have = np.diff(ip)
    short = np.nonzero(pages > have)[0]
    if short.size:
        i = int(short[0])
        raise _bad(
            "indices",
            indices,
            f"sequence {i} has {int(have[i])} block(s) but seq_len {int(lens[i])} "
            f"needs {int(pages[i])} at block_size {block_size}",
        )
    out_indptr = np.zeros(lens.size + 1, dtype=np.int64)
    np.cumsum(pages, out=out_indptr[1:])
    keep = np.repeat(ip[:-1], pages) + (np.arange(int(out_indptr[-1])) - np.repeat(out_indptr[:-1], pages))
    out_indices = ix[keep]
    last = np.where(lens > 0, (lens - 1) % block_size + 1, 0)
    return (
        _place(out_indptr.astype(np.int32), device),
        _place(out_indices.astype(np.int32), device),
        _place(last.astype(np.int32), device),
    )


def slot_mapping(slots: npt.ArrayLike, *, pad_to: int | None = None, device: Device = "cpu") -> Any:
    """Slot mapping ``int64[num_tokens]``, padded with -1 up to ``pad_to`` tokens.

    Args:
        slots: one flat KV-cache slot per scheduled token (``StepOutput.slot_mapping``),
            ``block_id * block_size + offset``; negative entries already mean "skip".
        pad_to: total length (>= len(slots)); default no padding.
        device: torch device, or None for numpy.
    """
    arr = _int_vector("slots", slots)
    out = np.full(_check_pad("pad_to", pad_to, arr.size), -1, dtype=np.int64)
    out[: arr.size] = arr
    return _place(out, device)


def seq_lens(lengths: npt.ArrayLike, *, pad_to: int | None = None, device: Device = "cpu") -> Any:
    """Sequence lengths ``int32[num_seqs]`` (tokens), padded with 0 up to ``pad_to`` sequences.

    Raises:
        InvalidArgumentError: a negative length or one that does not fit int32.
    """
    arr = _int_vector("lengths", lengths)
    if arr.size and arr.min() < 0:
        raise _bad("lengths", lengths, "lengths must be >= 0")
    _check_int32("lengths", arr)
    out = np.zeros(_check_pad("pad_to", pad_to, arr.size), dtype=np.int32)
    out[: arr.size] = arr
    return _place(out, device)


def query_start_loc(query_lens: npt.ArrayLike, *, pad_to: int | None = None, device: Device = "cpu") -> Any:
    """``int32[num_seqs + 1]`` prefix sums of the query lengths (tokens), starting at 0.

    Args:
        query_lens: tokens scheduled per sequence this step (prefill chunk or 1 for decode).
        pad_to: number of sequences after padding; padding sequences get empty queries (the
            last offset repeats).
        device: torch device, or None for numpy.
    """
    arr = _int_vector("query_lens", query_lens)
    if arr.size and arr.min() < 0:
        raise _bad("query_lens", query_lens, "lengths must be >= 0")
    n = _check_pad("pad_to", pad_to, arr.size)
    out = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(arr, out=out[1 : arr.size + 1])
    out[arr.size + 1 :] = out[arr.size]
    _check_int32("query_lens", out)
    return _place(out.astype(np.int32), device)


@dataclass(eq=False, slots=True)  # not frozen: building a frozen one costs ~1/3 of the whole path
class BatchTensors:
    """Every kernel input of one scheduler step, built by :meth:`from_steps`, for ``G`` KV cache
    groups (``G = 1`` for the one-group configuration; a hybrid model's ``KVCacheManager`` has
    one per attention kind, docs/design.md, "KV cache groups").

    Attributes (``S`` scheduled sequences, ``T`` scheduled tokens; "on ``device``" means a torch
    tensor there, or the numpy array itself when ``device`` is ``None``):
        block_tables: ``int32[G, S, W]`` group ``g``'s dense tables (a layer of group ``g``
            reads ``block_tables[g]``), padded, and for a window's released entries set, with
            the null block 0 (on ``device``; on the CPU a view of the :class:`BlockTable`'s
            buffer, row stride >= ``W``, valid until the next step).
        block_table: ``int32[S, W]``, the one group's tables (``block_tables[0]``, a view);
            one group only (raises :class:`~pagedkv.errors.InvalidArgumentError` for more).
        slot_mappings: ``int64[G, T]`` row ``g``: each token's KV-cache slot in group ``g``'s
            layers (``-1`` padded; on ``device``).
        slot_mapping: ``int64[T]``, the one group's slots (``slot_mappings[0]``, a view); one
            group only (raises :class:`~pagedkv.errors.InvalidArgumentError` for more).
        input_ids: ``int64[T]`` token id of each scheduled token (on ``device``).
        positions: ``int64[T]`` position of each token in its sequence (RoPE; on ``device``).
        seq_lens: ``int32[S]`` context + query tokens (on ``device``).
        context_lens: ``int32[S]`` tokens already in the cache before this step (on ``device``).
        query_start_loc: ``int32[S + 1]`` prefix sums of the query lengths (on ``device``).
        max_query_len: longest query this step (tokens; 0 for an empty batch).
        max_seq_len: longest sequence (tokens; 0 for an empty batch).
        copies: copy-on-write plan to run before the K/V writes (on ``device``): ``int32[C,
            3]`` ``(group, src, dst)`` rows (to run in that group's layers).
        swap_out: ``int32[K, 2]`` (device block, CPU block) pairs, on the host (the swap
            kernel reads the plan there to issue its copies), or ``None``; run first.
        swap_in: ``int32[K, 2]`` (CPU block, device block) pairs, on the host, or ``None``;
            run after ``swap_out``.
        transfers: the block copies between the device pool and host memory to run before
            ``copies``, in order: ``(kind, int32[K, 2] plan on the host)`` with kind
            ``"host_store"`` (device block, host tier block), ``"swap_out"``, ``"swap_in"`` or
            ``"host_load"`` (host tier block, device block); by default ``swap_out`` then
            ``swap_in``.
        query_start_loc_host, context_lens_host, positions_host: the host (numpy) arrays
            behind ``query_start_loc``, ``context_lens`` and ``positions``, for host-side
            bookkeeping without a device sync (the same memory as the tensors on the CPU).
        attn_plan: a per-step attention plan attached by the caller (one per group,
            :func:`pagedkv.kernels.plan_paged_attention`, built once for every layer), or
            ``None`` where the kernel needs none.
    """

    block_tables: Any
    #: ``[S, W]`` (one group) or None (several): behind :attr:`block_table`.
    one_table: Any
    #: ``[G, T]``: behind :attr:`slot_mapping(s)`.
    slots: Any
    input_ids: Any
    positions: Any
    seq_lens: Any
    context_lens: Any
    query_start_loc: Any
    max_query_len: int
    max_seq_len: int
    copies: Any
    swap_out: Any
    swap_in: Any
    transfers: tuple[tuple[str, Any], ...]
    query_start_loc_host: npt.NDArray[np.int32]
    context_lens_host: npt.NDArray[np.int32]
    positions_host: npt.NDArray[np.int64]
    attn_plan: Any = None

    @property
    def num_groups(self) -> int:
        """``G``: KV cache groups (the leading dimension of ``block_tables`` and
        ``slot_mappings``)."""
        return int(self.block_tables.shape[0])

    @property
    def num_seqs(self) -> int:
        """Sequences in the batch (rows of each group's block table)."""
        return int(self.block_tables.shape[1])

    @property
    def num_tokens(self) -> int:
        """Scheduled tokens (length of each group's slot mapping, padding included)."""
        return int(self.slots.shape[-1])

    @property
    def block_table(self) -> Any:
        """``int32[S, W]``: the one group's dense block table (a view of ``block_tables[0]``).

        Raises:
            InvalidArgumentError: the batch has several KV cache groups (use ``block_tables``).
        """
        if self.one_table is None:
            raise _bad("block_table", self.num_groups, "a batch of several KV cache groups: use block_tables[g]")
        return self.one_table

    @property
    def slot_mapping(self) -> Any:
        """``int64[T]``: the one group's slot mapping (a view of ``slot_mappings[0]``).

        Raises:
            InvalidArgumentError: the batch has several KV cache groups (use ``slot_mappings``).
        """
        if self.slots.shape[0] != 1:
            raise _bad("slot_mapping", self.num_groups, "a batch of several KV cache groups: use slot_mappings[g]")
        return self.slots[0]

    @property
    def slot_mappings(self) -> Any:
        """``int64[G, T]``: every group's slot mapping."""
        return self.slots

    @classmethod
    def from_steps(
        cls,
        steps: StepOutput | Sequence[StepOutput],
        device: Device = "cpu",
        *,
        block_tables: BlockTable | None = None,
        swap_out: npt.NDArray[np.int32] | None = None,
        swap_in: npt.NDArray[np.int32] | None = None,
        transfers: Sequence[tuple[str, npt.NDArray[np.int32]]] | None = None,
    ) -> BatchTensors:
        """The kernel inputs of one scheduler step: the one path from the allocator to the kernels.

        ``steps`` are the :class:`pagedkv.StepOutput` of one or more ``KVCacheManager.step``
        calls of the same scheduler step (e.g. running sequences, then newly admitted ones); their
        scheduled parts are merged once, in order. The core's arrays are consistent by
        construction and already in the kernels' layouts and dtypes (int64 slots and token ids,
        int32 lengths and ``query_start_loc``), so nothing is validated, cast or rebuilt: with
        one step every array crosses to torch with ``torch.from_numpy`` (no copy) and is then
        moved to ``device`` (one transfer each; none on the CPU, where the tensors share the
        step output's memory -- do not modify it while the result is in use). The dense int32
        block tables come from ``block_tables``, which applies the steps' table deltas to the
        tables it keeps across steps (:class:`BlockTable`, one call into Rust for every group):
        on the CPU a view of that object's buffer, valid until its next update (the next
        step); while the batch keeps its shape the same tensors are returned, their contents
        updated. ``positions`` is computed here. O(S x G + T x G + changed table entries) for a
        batch in the last one's order, plus O(G x longest table) per sequence that moved.

        Arrays made by anything other than the core enter through the validating builders of
        this module (:func:`dense_block_table`, :func:`slot_mapping`, ...).

        Args:
            steps: one step output or a sequence of them, all of one manager (empty: an empty
                batch).
            device: torch device of the result, or ``None`` for numpy arrays (no torch import).
            block_tables: the :class:`BlockTable` of the manager that made ``steps``, kept by
                the caller across steps (every step output of the manager goes through it; the
                steps may then be made with ``block_table=False``); ``None``: the steps' own
                dense tables (made with ``block_table=True``), copied when several are merged,
                O(G x S x W).
            swap_out, swap_in: the ``int32[K, 2]`` plans of ``swap_out`` / ``swap_in`` run in
                this step (``None``: none); kept on the host.
            transfers: every device <-> host block copy of the step in execution order
                (``(kind, int32[K, 2] plan)``, kinds as in the attribute; the host tier's
                stores and loads with the swaps between them); ``None``: ``swap_out`` then
                ``swap_in``.

        Raises:
            InvalidArgumentError: a step that is not a core step output, steps of different
                group counts, a step without per-token arrays (made with
                ``token_arrays=False``), ``block_tables`` that is not a :class:`BlockTable`
                (or of a manager with another group count), or no ``block_tables`` and a step without
                dense tables; nothing changed.
        """
        parts: list[Any] = [steps] if isinstance(steps, StepOutput) else list(steps)
        if block_tables is not None and not isinstance(block_tables, BlockTable):
            raise _bad("block_tables", block_tables, "expected a pagedkv.tensors.BlockTable or None")
        for i, p in enumerate(parts):
            if not isinstance(p, StepOutput):
                raise _bad(
                    f"steps[{i}]",
                    p,
                    "expected a pagedkv.StepOutput (build kernel inputs from other arrays with "
                    "dense_block_table, slot_mapping, ...)",
                )
            if p.input_ids.size != p.num_tokens:
                raise _bad(
                    f"steps[{i}]",
                    p,
                    f"it schedules {p.num_tokens} tokens but has {p.input_ids.size} token ids: a "
                    "step made with token_arrays=False has no per-token arrays to build kernel "
                    "inputs from",
                )
            if block_tables is None and p.num_scheduled and p.block_tables.shape[2] == 0:
                raise _bad(f"steps[{i}]", p, "made with block_table=False: pass block_tables")
        if len({p.num_groups for p in parts}) > 1:
            raise _bad("steps", [p.num_groups for p in parts], "steps of one manager have one group count")
        # a BlockTable refuses the outputs of a manager with another group count (nothing changed)
        table = _dense_tables(parts) if block_tables is None else block_tables.update(parts)
        if len(parts) == 1:
            p = parts[0]
            slots, ids, lens, ctx, qsl, copies = (
                p.slot_mappings,
                p.input_ids,
                p.seq_lens,
                p.context_lens,
                p.query_start_loc,
                p.copies,
            )
            max_query_len, max_seq_len = p.max_query_len, p.max_seq_len
        else:
            slots, ids, lens, ctx, qsl, copies = _merge(parts, table.shape[0])
            max_query_len = max((p.max_query_len for p in parts), default=0)
            max_seq_len = max((p.max_seq_len for p in parts), default=0)
        if ids.size == lens.size:  # all decodes: each token sits right after its context
            positions = ctx.astype(np.int64)
        else:  # the context length plus the token's index in its query
            positions = np.arange(ids.size, dtype=np.int64) + np.repeat(ctx - qsl[:-1], np.diff(qsl))
        to_dev, to_host, table_to_dev = _movers(device)
        tables, one_table = table_to_dev(table)
        return cls(
            block_tables=tables,
            one_table=one_table,
            slots=to_dev(slots),
            input_ids=to_dev(ids),
            positions=to_dev(positions),
            seq_lens=to_dev(lens),
            context_lens=to_dev(ctx),
            query_start_loc=to_dev(qsl),
            max_query_len=max_query_len,
            max_seq_len=max_seq_len,
            copies=to_dev(copies) if copies.size else table_to_dev.no_copies,
            swap_out=None if swap_out is None else to_host(swap_out),
            swap_in=None if swap_in is None else to_host(swap_in),
            transfers=tuple(
                (kind, to_host(plan))
                for kind, plan in (
                    transfers if transfers is not None else (("swap_out", swap_out), ("swap_in", swap_in))
                )
                if plan is not None and len(plan)
            ),
            query_start_loc_host=qsl,
            context_lens_host=ctx,
            positions_host=positions,
        )


def _dense_tables(parts: list[Any]) -> npt.NDArray[np.int32]:
    """The steps' own dense tables (``block_table=True``) as one ``[G, S, W]`` array: the step's
    array itself for one step, else padded to the widest and concatenated; no parts: ``[1, 0,
    1]``."""
    if len(parts) == 1:
        return parts[0].block_tables  # type: ignore[no-any-return]
    tables = [p.block_tables for p in parts]
    g = tables[0].shape[0] if tables else 1
    width = max([t.shape[2] for t in tables] + [1])
    out = np.zeros((g, sum(t.shape[1] for t in tables), width), dtype=np.int32)
    row = 0
    for t in tables:
        out[:, row : row + t.shape[1], : t.shape[2]] = t
        row += t.shape[1]
    return out


class _TableToDevice:
    """A :class:`BlockTable`'s (or the steps') dense tables to ``device``, as ``(int32[G, S, W],
    int32[S, W] or None)``: on the CPU the torch tensors sharing them are built once per array
    object (the table returns the same array while the batch keeps its shape, its contents
    updated in place), so a steady decode step builds none."""

    __slots__ = ("_move", "_reuse", "_last", "no_copies")

    def __init__(self, move: Callable[[Any], Any], reuse: bool) -> None:
        self._move = move
        self._reuse = reuse
        # (array, tensors) as one tuple: replaced in one assignment, so threads sharing this
        # mover never pair one array with another's tensors
        self._last: tuple[Any, tuple[Any, Any]] = (None, (None, None))
        #: The empty copy plan ``int32[0, 3]`` on ``device`` (most steps copy nothing).
        self.no_copies = move(np.zeros((0, 3), np.int32))

    def __call__(self, table: npt.NDArray[np.int32]) -> tuple[Any, Any]:
        last = self._last
        if table is last[0]:
            return last[1]
        moved = self._move(table)
        tensors = (moved, moved[0] if table.shape[0] == 1 else None)
        if self._reuse:
            self._last = (table, tensors)
        return tensors


_MOVERS: dict[Any, tuple[Callable[[Any], Any], Callable[[Any], Any], _TableToDevice]] = {}


def _movers(device: Device) -> tuple[Callable[[Any], Any], Callable[[Any], Any], _TableToDevice]:
    """Functions taking a C-contiguous array made by the core (or from its arrays) to ``device``
    and to the host, and the block tables' mover: identity for ``device=None``;
    ``torch.from_numpy`` (no copy) on the CPU, plus one transfer elsewhere. Built once per
    device (the lazy torch import and the device parsing cost a step's worth of numpy calls)."""
    movers = _MOVERS.get(device)
    if movers is not None:
        return movers
    if device is None:
        # numpy too: a one-group table's [S, W] view is built once per array
        movers = (_identity, _identity, _TableToDevice(_identity, reuse=True))
    else:
        with _TORCH_IMPORT:
            import torch  # lazy: `import pagedkv` must work without torch

        target = device if isinstance(device, torch.device) else torch.device(device)
        if target.type == "cpu":
            movers = (torch.from_numpy, torch.from_numpy, _TableToDevice(torch.from_numpy, reuse=True))
        else:
            to_dev = lambda a: torch.from_numpy(a).to(target)  # noqa: E731
            # on a device the contents travel every step: nothing to reuse
            movers = (to_dev, torch.from_numpy, _TableToDevice(to_dev, reuse=False))
    _MOVERS[device] = movers
    return movers


def _identity(a: Any) -> Any:
    return a


def _merge(parts: list[Any], num_groups: int) -> tuple[npt.NDArray[Any], ...]:
    """Concatenate the scheduled arrays of several step outputs (offsets shifted), in order; no
    parts make an empty batch of ``num_groups`` groups. Slots are concatenated along the token
    axis (the last)."""
    if not parts:
        i32, i64 = np.zeros(0, np.int32), np.zeros(0, np.int64)
        return (
            np.zeros((num_groups, 0), np.int64),
            i64.copy(),
            i32,
            i32.copy(),
            np.zeros(1, np.int32),
            np.zeros((0, 3), np.int32),
        )
    tokens = np.cumsum([0] + [p.input_ids.size for p in parts[:-1]], dtype=np.int32)
    qsl = [parts[0].query_start_loc] + [p.query_start_loc[1:] + t for p, t in zip(parts[1:], tokens[1:])]
    return (
        np.concatenate([p.slot_mappings for p in parts], axis=-1),
        np.concatenate([p.input_ids for p in parts]),
        np.concatenate([p.seq_lens for p in parts]),
        np.concatenate([p.context_lens for p in parts]),
        np.concatenate(qsl),
        np.concatenate([p.copies for p in parts]),
    )
