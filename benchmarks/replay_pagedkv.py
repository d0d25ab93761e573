"""Replay the allocator operation trace through pagedkv's Python API.

Run by ``allocator_speed.py`` in a subprocess: ``python replay_pagedkv.py --trace-file T --out
R.json [--hash-algo sha256|xxh3_128]``. Per step: one batched ``KVCacheManager.step`` for the
running requests (one decode token each, the tokens they sampled last step passed as a 1-D
array: the binding's decode fast path), then ``add_sequence`` for each admitted request (its
prompt as a numpy array) and one batched ``step`` for their whole prompts, then ``free``
for the finished ones. The per-step input arrays (the batch's sequence ids and sampled tokens,
the admitted prompts' lengths) are built before the clock starts, as the token lists are for
every system: an engine holds them as arrays from its scheduler and sampler, so building them
from Python ints inside the clock would time the replay's bookkeeping, not pagedkv. The Rust
replay (``rust/core/examples/replay.rs``) builds the same inputs before its clock. So two
crossings into Rust per step, plus one per new / finished request. ``step`` returns each
sequence's new block ids, lengths and block-table changes (what a model runner needs to keep its
block tables, ``pagedkv.tensors.BlockTable``): the output of vLLM's KV cache manager, whose
model runner builds the per-token slot mapping on the GPU from its block tables. With
``--token-arrays`` it also writes the kernel-ready per-token slot mapping and input ids (16 bytes
per scheduled token, ``step(..., token_arrays=True)``, what pagedkv's own engine uses), which the
other systems' managers leave to their model runners.
The bare pool replay frees a finished request's blocks tail first in two calls (its decode ids
reversed, then its prompt's array with ``free_table``, which releases it from its end) rather
than concatenating them into one array first.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
from replay_common import OpTrace, Replayer, main


class PagedKVReplayer(Replayer):
    """pagedkv's KVCacheManager (Rust core behind PyO3; batched steps, GIL released)."""

    name = "pagedkv"

    def __init__(self, hash_algo: str, token_arrays: bool = False) -> None:
        import pagedkv  # noqa: PLC0415

        self.pagedkv = pagedkv
        self.hash_algo = hash_algo
        self.token_arrays = token_arrays

    def version(self) -> dict[str, Any]:
        import subprocess  # noqa: PLC0415
        from pathlib import Path  # noqa: PLC0415

        root = Path(__file__).resolve().parent.parent
        r = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True)
        return {
            "version": getattr(self.pagedkv, "__version__", "unknown"),
            "commit": r.stdout.strip() or None,
            "hash": self.hash_algo,
            "token_arrays": self.token_arrays,
            "python": sys.version.split()[0],
        }

    def prepare(self, trace: OpTrace, prompts: list[Any], outputs: list[Any]) -> None:
        cfg = self.pagedkv.CacheConfig(
            trace.num_blocks, trace.block_size, enable_prefix_caching=True, hash_algo=self.hash_algo
        )
        self.mgr = self.pagedkv.KVCacheManager(cfg)
        self.prompts = prompts
        self.cached_tokens = 0
        # Per step: the decode batch (ids in the order replay_common.run passes them, and the
        # token each sampled last step) and the admitted requests' prompt lengths, as arrays.
        self.decode_inputs: list[tuple[np.ndarray, np.ndarray] | None] = []
        self.admit_lens: list[np.ndarray] = []
        running: list[int] = []
        sampled: dict[int, int] = {}
        for admit, fin in zip(trace.admit, trace.finish):
            if running:
                ids = np.array(running, dtype=np.uint64)
                toks = np.fromiter((outputs[r][sampled[r]] for r in running), np.int64, len(running))
                self.decode_inputs.append((ids, toks))
                for r in running:
                    sampled[r] += 1
            else:
                self.decode_inputs.append(None)
            self.admit_lens.append(np.array([trace.prompt_lens[r] for r in admit], dtype=np.int64))
            for r in admit:
                sampled[r] = 0
            done = set(fin)
            running = [r for r in running if r not in done] + [r for r in admit if r not in done]

    def step(self, t: int, admit: list[int], decode: list[int], finish: list[int]) -> None:
        mgr = self.mgr
        dec = self.decode_inputs[t]
        if decode:
            ids, toks = dec
            if len(ids) != len(decode):
                raise AssertionError(f"step {t}: prebuilt decode batch of {len(ids)}, replay has {len(decode)}")
            out = mgr.step(ids, 1, toks, token_arrays=self.token_arrays)
            if out.error is not None:
                raise RuntimeError(f"pagedkv decode step {t} failed: {out.error!r}")
        if admit:
            prompts = self.prompts
            for r in admit:
                mgr.add_sequence(r, prompts[r])
            out = mgr.step(admit, self.admit_lens[t], token_arrays=self.token_arrays)
            if out.error is not None:
                raise RuntimeError(f"pagedkv prefill step {t} failed: {out.error!r}")
            self.cached_tokens += int(out.num_cached_tokens.sum())
        for r in finish:
            mgr.free(r)

    def pool_adapter(self, num_blocks: int) -> Any:
        """pagedkv.BlockPool (Rust; calls on up to 1,024 blocks keep the GIL): a prompt's blocks
        as one int32 array (``allocate``), the decode step's new blocks as a list of ints
        (``allocate_list``: one per sequence, no array to make and unpack), batch frees."""
        pool = self.pagedkv.BlockPool(num_blocks)

        pool_free = pool.free
        pool_free_table = pool.free_table

        class _Pool:
            allocate = staticmethod(pool.allocate)
            allocate_items = staticmethod(pool.allocate_list)

            @staticmethod
            def free_request(parts: list[Any]) -> None:
                # Tail first, as one request's table: its decode blocks (ints) last-first, then
                # its prompt's int32 array from its end. Two calls (the ids are in two
                # containers already) cost less than concatenating them into one array first.
                if len(parts) > 1:
                    pool_free(parts[:0:-1])
                pool_free_table(parts[0])

        return _Pool()

    def counters(self) -> dict[str, Any]:
        self.mgr.check_invariants()
        return {"cached_prompt_tokens": self.cached_tokens, "blocks_in_use_at_end": self.mgr.pool.num_used}


def _factory(args):
    return PagedKVReplayer(args.hash_algo or "sha256", args.token_arrays), "numpy"


def _arguments(ap) -> None:
    ap.add_argument(
        "--token-arrays",
        action="store_true",
        help="steps also write the per-token slot mapping and input ids (pagedkv's engine path)",
    )


if __name__ == "__main__":
    main(_factory, _arguments)
