"""Kernel inputs built from the allocator's output: block tables, slot mapping, lengths.

One path from the allocator to the kernels: :meth:`BatchTensors.from_steps` takes the
:class:`pagedkv.StepOutput` of a scheduler step -- whose arrays the core already lays out in the
kernels' dtypes and shapes -- and hands every kernel input over as torch tensors without
re-validating, casting or copying on the host (``torch.from_numpy``), then one transfer per
tensor to the device. The block tables come from a :class:`BlockTable` the caller keeps across
steps: the core reports only what changed in each table (the step output's table delta), as
vLLM's GPU model runner keeps its block table across steps and applies only the changes. The
engine's runner, the tests and ``benchmarks/step_overhead.py`` all use it. The other builders
here are the validating entry for arrays that did *not* come from the core (a caller's own block
tables): they check their input once and copy.

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

from pagedkv._core import KVCacheManager, StepOutput, apply_table_deltas
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


class BlockTable:
    """Block tables kept across scheduler steps, updated from the step outputs' table deltas.

    The core's :meth:`pagedkv.KVCacheManager.step` reports, per scheduled sequence, only the
    entries of its block table that changed since the last step output that reported it
    (``StepOutput.table_start`` / ``table_delta``: the blocks appended this step, or the whole
    table after a first allocation, a resumed preemption, a swap-in or a fork, or the tail from
    a copy-on-write on). This class holds one row per sequence of the last batch in a persistent
    ``int32[rows, width]`` buffer (grown in both dimensions as needed), applies each delta in
    O(changed entries), and gathers the batch's dense table for the kernels. The same
    bookkeeping as vLLM's GPU model runner's persistent block table (which applies the
    scheduler's new block ids to rows it keeps across steps).

    A delta applies only to the version of the table it follows (``StepOutput.table_version``);
    a sequence whose previous report this object did not see (a new ``BlockTable``, a sequence
    absent from the last batch, an output skipped) is read whole from ``manager.block_table``
    (one call), so the result is always the manager's current table. Feed it every step output
    of a manager, in order, before the next ``step``. Rows of sequences missing from a batch
    are kept while they are at most ``S + 64`` (``S`` = the batch), else all released (a
    released one is re-read if its sequence comes back). Not thread-safe.

    Args:
        manager: the :class:`pagedkv.KVCacheManager` whose step outputs are applied.
        rows, width: initial capacity (sequences x blocks); both grow on demand.
    """

    def __init__(self, manager: KVCacheManager, *, rows: int = 64, width: int = 64) -> None:
        if not isinstance(manager, KVCacheManager):
            raise _bad("manager", manager, "expected a pagedkv.KVCacheManager")
        self._manager = manager
        self._table = np.zeros((max(int(rows), 1), max(int(width), 1)), dtype=np.int32)
        self._lens = np.zeros(self._table.shape[0], dtype=np.int64)
        self._versions = np.zeros(self._table.shape[0], dtype=np.int64)
        self._row_of: dict[int, int] = {}
        self._free_rows: list[int] = list(range(self._table.shape[0] - 1, -1, -1))
        # The last batch's sequence ids and rows: a batch of the same sequences in the same
        # order (the steady decode state) reuses them without a per-sequence lookup.
        self._last_ids: bytes | None = None
        self._last_rows: npt.NDArray[np.intp] = np.zeros(0, np.intp)
        #: Whole tables read from the manager so far (sequences whose previous report this
        #: object did not apply); every other row was updated from its delta alone.
        self.num_table_reads = 0

    @property
    def num_rows(self) -> int:
        """Sequences whose tables are held (the last batch, plus recently absent ones)."""
        return len(self._row_of)

    def update(self, steps: Sequence[StepOutput]) -> npt.NDArray[np.int32]:
        """Apply the table deltas of ``steps`` (the outputs of one scheduler step, in batch
        order) and return the batch's dense block table ``int32[S, W]``: row ``k`` is the
        ``k``-th scheduled sequence's table padded with the null block 0, ``W`` the longest
        table (at least 1). A fresh array (later updates do not change it). O(changed entries
        + S x W) plus one ``manager.block_table`` call per sequence not seen in order."""
        steps = list(steps)
        if len(steps) == 1:
            ids = steps[0].seq_ids
        elif steps:
            ids = np.concatenate([p.seq_ids for p in steps])
        else:
            ids = np.zeros(0, np.uint64)
        key = ids.tobytes()  # compared as bytes: a fraction of a microsecond for 256 ids
        if key == self._last_ids:
            rows = self._last_rows
        elif (patched := self._patch_rows(ids, len(steps) > 1)) is not None:
            rows = patched
            self._last_ids, self._last_rows = key, rows
        else:
            seqs = ids.tolist()
            # One output never lists a sequence twice (the core refuses it); several might.
            if len(steps) > 1 and len(set(seqs)) != len(seqs):
                raise _bad("steps", seqs, "a sequence is scheduled twice in one batch")
            rows = self._assign_rows(seqs)
            self._last_ids, self._last_rows = key, rows
        while True:  # the deltas applied and the batch gathered in one pass, in Rust
            width, done = apply_table_deltas(self._table, self._lens, self._versions, rows, steps)
            if done is not None:
                break
            self._grow(self._table.shape[0], max(width, 2 * self._table.shape[1]))
        reread, dense = done
        if not reread:
            return dense
        versions = np.concatenate([p.table_version for p in steps])
        table = self._table
        for k in reread:  # a delta that does not follow the version held: read the table whole
            self.num_table_reads += 1
            whole = self._manager.block_table(int(ids[k]))
            if whole.size > table.shape[1]:
                self._grow(table.shape[0], max(int(whole.size), 2 * table.shape[1]))
                table = self._table
            r = int(rows[k])
            table[r, : whole.size] = whole
            table[r, whole.size : int(self._lens[r])] = 0
            self._lens[r] = whole.size
            self._versions[r] = int(versions[k])
            width = max(width, int(whole.size))
        return table[rows, : max(width, 1)]  # a fresh C-contiguous array

    def _patch_rows(self, ids: npt.NDArray[np.uint64], merged: bool) -> npt.NDArray[np.intp] | None:
        """Rows of a batch that differs from the last one in a few positions only (a sequence
        finished and another took its place): the last rows with those positions looked up.
        None when the batch is not such a neighbour (then :meth:`_assign_rows` does it all)."""
        if self._last_ids is None or merged or len(self._last_ids) != ids.nbytes:
            return None
        changed = np.nonzero(np.frombuffer(self._last_ids, dtype=np.uint64) != ids)[0]
        if changed.size > 8 or len(self._row_of) + changed.size > 2 * ids.size + 64:
            return None
        rows: npt.NDArray[np.intp] = self._last_rows.copy()
        for k, s in zip(changed.tolist(), ids[changed].tolist()):
            r = self._row_of.get(s, -1)
            if r < 0:  # new to this object; the one it replaces is kept as absent
                if not self._free_rows:
                    self._grow(2 * self._table.shape[0], self._table.shape[1])
                r = self._free_rows.pop()
                self._versions[r] = -2
                self._row_of[s] = r
            rows[k] = r
        return rows

    def _assign_rows(self, seqs: list[int]) -> npt.NDArray[np.intp]:
        """Rows of the batch's sequences, in batch order (new ones get free rows, held length
        0). Rows of sequences not in the batch are kept, unless more than ``S + 64`` of them
        are, when they are all released."""
        old = self._row_of
        new: dict[int, int] = {}
        fresh: list[int] = []
        for k, s in enumerate(seqs):
            r = old.pop(s, -1)
            if r < 0:
                fresh.append(k)
            new[s] = r
        if old and len(new) + len(old) > 2 * len(new) + 64:
            # Too many sequences absent from the batch (finished, or waiting): release them.
            self._last_ids = None  # the remembered batch may name released rows
            for r in old.values():
                self._free_rows.append(r)
                self._table[r, : int(self._lens[r])] = 0
                self._lens[r] = 0
            old = {}
        if len(fresh) > len(self._free_rows):
            short = len(fresh) - len(self._free_rows)
            self._grow(self._table.shape[0] + max(self._table.shape[0], short), self._table.shape[1])
        for k in fresh:
            r = self._free_rows.pop()
            self._versions[r] = -2  # no delta follows it: the table is read whole or from 0
            new[seqs[k]] = r
        rows = np.fromiter(new.values(), dtype=np.intp, count=len(new))
        new.update(old)  # absent sequences kept (after the batch's, so `rows` is the batch)
        self._row_of = new
        return rows

    def _grow(self, rows: int, width: int) -> None:
        old_rows, old_width = self._table.shape
        table = np.zeros((rows, width), dtype=np.int32)
        table[:old_rows, :old_width] = self._table
        self._table = table
        if rows > old_rows:
            self._lens = np.concatenate([self._lens, np.zeros(rows - old_rows, np.int64)])
            self._versions = np.concatenate([self._versions, np.zeros(rows - old_rows, np.int64)])
            self._free_rows[:0] = range(rows - 1, old_rows - 1, -1)


@dataclass(eq=False, slots=True)  # not frozen: building a frozen one costs ~1/3 of the whole path
class BatchTensors:
    """Every kernel input of one scheduler step, built by :meth:`from_steps`.

    Attributes (``S`` scheduled sequences, ``T`` scheduled tokens; "on ``device``" means a torch
    tensor there, or the numpy array itself when ``device`` is ``None``):
        block_table: ``int32[S, max_blocks]`` dense, padded with the null block 0 (on ``device``).
        slot_mapping: ``int64[T]`` KV-cache slot of each token (``-1`` padded; on ``device``).
        input_ids: ``int64[T]`` token id of each scheduled token (on ``device``).
        positions: ``int64[T]`` position of each token in its sequence (RoPE; on ``device``).
        seq_lens: ``int32[S]`` context + query tokens (on ``device``).
        context_lens: ``int32[S]`` tokens already in the cache before this step (on ``device``).
        query_start_loc: ``int32[S + 1]`` prefix sums of the query lengths (on ``device``).
        max_query_len: longest query this step (tokens; 0 for an empty batch).
        max_seq_len: longest sequence (tokens; 0 for an empty batch).
        copies: ``int32[C, 2]`` copy-on-write ``(src, dst)`` block pairs, to run before the
            K/V writes (on ``device``).
        swap_out: ``int32[K, 2]`` (device block, CPU block) pairs, on the host (the swap
            kernel reads the plan there to issue its copies), or ``None``; run first.
        swap_in: ``int32[K, 2]`` (CPU block, device block) pairs, on the host, or ``None``;
            run after ``swap_out``.
        query_start_loc_host, context_lens_host, positions_host: the host (numpy) arrays
            behind ``query_start_loc``, ``context_lens`` and ``positions``, for host-side
            bookkeeping without a device sync (the same memory as the tensors on the CPU).
        attn_plan: a per-step attention plan attached by the caller
            (:func:`pagedkv.kernels.plan_paged_attention`, built once for every layer), or
            ``None`` where the kernel needs none.
    """

    block_table: Any
    slot_mapping: Any
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
    query_start_loc_host: npt.NDArray[np.int32]
    context_lens_host: npt.NDArray[np.int32]
    positions_host: npt.NDArray[np.int64]
    attn_plan: Any = None

    @property
    def num_seqs(self) -> int:
        """Sequences in the batch (rows of ``block_table``)."""
        return int(self.block_table.shape[0])

    @property
    def num_tokens(self) -> int:
        """Scheduled tokens (length of ``slot_mapping``, padding included)."""
        return int(self.slot_mapping.shape[0])

    @classmethod
    def from_steps(
        cls,
        steps: StepOutput | Sequence[StepOutput],
        device: Device = "cpu",
        *,
        block_tables: BlockTable,
        swap_out: npt.NDArray[np.int32] | None = None,
        swap_in: npt.NDArray[np.int32] | None = None,
    ) -> BatchTensors:
        """The kernel inputs of one scheduler step: the one path from the allocator to the kernels.

        ``steps`` are the :class:`pagedkv.StepOutput` of one or more ``KVCacheManager.step``
        calls of the same scheduler step (e.g. running sequences, then newly admitted ones);
        their scheduled parts are merged once, in order. The core's arrays are consistent by
        construction and already in the kernels' layouts and dtypes (int64 slots and token ids,
        int32 lengths and ``query_start_loc``), so nothing is validated, cast or rebuilt: with
        one step every array crosses to torch with ``torch.from_numpy`` (no copy) and is then
        moved to ``device`` (one transfer each; none on the CPU, where the tensors share the
        step output's memory -- do not modify it while the result is in use). The dense int32
        block table comes from ``block_tables``, which applies the steps' table deltas to the
        tables it keeps across steps (:class:`BlockTable`). ``positions`` is computed here.
        O(S + T + changed table entries + S x longest table), vectorised.

        Arrays made by anything other than the core enter through the validating builders of
        this module (:func:`dense_block_table`, :func:`slot_mapping`, ...).

        Args:
            steps: one step output or a sequence of them (empty: an empty batch).
            device: torch device of the result, or ``None`` for numpy arrays (no torch import).
            block_tables: the :class:`BlockTable` of the manager that made ``steps``, kept by
                the caller across steps (every step output of the manager goes through it).
            swap_out, swap_in: the ``int32[K, 2]`` plans of ``KVCacheManager.swap_out`` /
                ``swap_in`` run in this step (``None``: none); kept on the host.

        Raises:
            InvalidArgumentError: a step that is not a core :class:`pagedkv.StepOutput`, or
                ``block_tables`` that is not a :class:`BlockTable`.
        """
        parts = [steps] if isinstance(steps, StepOutput) else list(steps)
        for i, p in enumerate(parts):
            if not isinstance(p, StepOutput):
                raise _bad(
                    f"steps[{i}]",
                    p,
                    "expected a pagedkv.StepOutput (build kernel inputs from "
                    "other arrays with dense_block_table, slot_mapping, ...)",
                )
        if not isinstance(block_tables, BlockTable):
            raise _bad("block_tables", block_tables, "expected a pagedkv.tensors.BlockTable")
        table = block_tables.update(parts)
        if len(parts) == 1:
            p = parts[0]
            slots, ids, lens, ctx, qsl, copies = (
                p.slot_mapping,
                p.input_ids,
                p.seq_lens,
                p.context_lens,
                p.query_start_loc,
                p.copies,
            )
        else:
            slots, ids, lens, ctx, qsl, copies = _merge(parts)
        num_seqs = int(lens.size)
        if slots.size == num_seqs:  # all decodes: each token sits right after its context
            positions = ctx.astype(np.int64)
            max_query_len = 1 if num_seqs else 0
        else:  # the context length plus the token's index in its query
            query_lens = np.diff(qsl)
            positions = np.arange(slots.size, dtype=np.int64) + np.repeat(ctx - qsl[:-1], query_lens)
            max_query_len = int(query_lens.max())
        to_dev, to_host = _movers(device)
        return cls(
            block_table=to_dev(table),
            slot_mapping=to_dev(slots),
            input_ids=to_dev(ids),
            positions=to_dev(positions),
            seq_lens=to_dev(lens),
            context_lens=to_dev(ctx),
            query_start_loc=to_dev(qsl),
            max_query_len=max_query_len,
            max_seq_len=int(lens.max()) if num_seqs else 0,
            copies=to_dev(copies),
            swap_out=None if swap_out is None else to_host(swap_out),
            swap_in=None if swap_in is None else to_host(swap_in),
            query_start_loc_host=qsl,
            context_lens_host=ctx,
            positions_host=positions,
        )


def _movers(device: Device) -> tuple[Callable[[Any], Any], Callable[[Any], Any]]:
    """Functions taking a C-contiguous array made by the core (or from its arrays) to ``device``
    and to the host: identity for ``device=None``; ``torch.from_numpy`` (no copy) on the CPU,
    plus one transfer elsewhere."""
    if device is None:
        return _identity, _identity
    with _TORCH_IMPORT:
        import torch  # lazy: `import pagedkv` must work without torch

    if device == "cpu":  # the common case, without building a torch.device
        return torch.from_numpy, torch.from_numpy
    target = device if isinstance(device, torch.device) else torch.device(device)
    if target.type == "cpu":
        return torch.from_numpy, torch.from_numpy
    return (lambda a: torch.from_numpy(a).to(target)), torch.from_numpy


def _identity(a: Any) -> Any:
    return a


def _merge(parts: list[StepOutput]) -> tuple[npt.NDArray[Any], ...]:
    """Concatenate the scheduled arrays of several step outputs (offsets shifted), in order; no
    parts make an empty batch."""
    if not parts:
        i32, i64 = np.zeros(0, np.int32), np.zeros(0, np.int64)
        return (
            i64,
            i64.copy(),
            i32,
            i32.copy(),
            np.zeros(1, np.int32),
            np.zeros((0, 2), np.int32),
        )
    tokens = np.cumsum([0] + [p.slot_mapping.size for p in parts[:-1]], dtype=np.int32)
    qsl = [parts[0].query_start_loc] + [p.query_start_loc[1:] + t for p, t in zip(parts[1:], tokens[1:])]
    return (
        np.concatenate([p.slot_mapping for p in parts]),
        np.concatenate([p.input_ids for p in parts]),
        np.concatenate([p.seq_lens for p in parts]),
        np.concatenate([p.context_lens for p in parts]),
        np.concatenate(qsl),
        np.concatenate([p.copies for p in parts]),
    )
