"""Replay the allocator operation trace through nano-vllm's ``BlockManager``.

Run by ``allocator_speed.py`` in a subprocess: ``python replay_nanovllm.py --lib-path CHECKOUT
--trace-file T --out R.json``. Only ``nanovllm/engine/block_manager.py`` and
``nanovllm/engine/sequence.py`` (with ``sampling_params.py``) are imported: the package
``__init__`` (which pulls in torch, transformers and flash-attn for the model) is bypassed by
registering an empty ``nanovllm`` package whose path is the checkout's. The calls per step are the
ones nano-vllm's ``Scheduler`` makes: ``can_allocate`` + ``allocate`` for a prefill,
``can_append`` + ``may_append`` for a decode, ``hash_blocks`` after the step and ``deallocate``
when a request finishes. Needs ``xxhash`` and ``numpy``.
"""

from __future__ import annotations

import subprocess
import sys
import types
from pathlib import Path
from typing import Any

from replay_common import OpTrace, Replayer, main


class NanoVllmReplayer(Replayer):
    """nano-vllm's block manager (xxh64 prefix hashes, Python lists and a deque)."""

    name = "nano-vllm"

    def __init__(self, root: Path) -> None:
        self.root = root
        pkg = types.ModuleType("nanovllm")
        pkg.__path__ = [str(root / "nanovllm")]  # bypass nanovllm/__init__.py (model imports)
        sys.modules["nanovllm"] = pkg
        from nanovllm.engine.block_manager import BlockManager  # noqa: PLC0415
        from nanovllm.engine.sequence import Sequence  # noqa: PLC0415

        self.BlockManager = BlockManager
        self.Sequence = Sequence

    def version(self) -> dict[str, Any]:
        commit = None
        f = self.root / "COMMIT"
        if f.exists():
            commit = f.read_text().strip()
        else:
            r = subprocess.run(["git", "-C", str(self.root), "rev-parse", "HEAD"], capture_output=True, text=True)
            commit = r.stdout.strip() or None
        import xxhash  # noqa: PLC0415

        return {
            "path": str(self.root),
            "commit": commit,
            "hash": f"xxh64 (xxhash {xxhash.VERSION})",
            "python": sys.version.split()[0],
        }

    def prepare(self, trace: OpTrace, prompts: list[Any], outputs: list[Any]) -> None:
        self.Sequence.block_size = trace.block_size  # a class attribute in nano-vllm
        # nano-vllm has no null block; give it the same usable capacity as pagedkv.
        self.bm = self.BlockManager(trace.num_blocks - 1, trace.block_size)
        self.prompts = prompts
        self.outputs = outputs
        self.seqs: dict[int, Any] = {}
        self.sampled: dict[int, int] = {}
        self.cached_tokens = 0

    def step(self, t: int, admit: list[int], decode: list[int], finish: list[int]) -> None:
        bm = self.bm
        seqs = self.seqs
        for r in decode:
            seq = seqs[r]
            if not bm.can_append(seq):
                raise RuntimeError(f"nano-vllm: out of blocks for a decode of request {r} at step {t}")
            bm.may_append(seq)
            seq.num_scheduled_tokens = 1
        for r in admit:
            seq = self.Sequence(self.prompts[r])
            n = bm.can_allocate(seq)
            if n < 0:
                raise RuntimeError(f"nano-vllm: out of blocks admitting request {r} at step {t}")
            bm.allocate(seq, n)
            self.cached_tokens += seq.num_cached_tokens
            seq.num_scheduled_tokens = seq.num_tokens - seq.num_cached_tokens
            seqs[r] = seq
        # After the forward pass: hash newly full blocks, sample one token per request.
        outputs = self.outputs
        sampled = self.sampled
        for r in decode:
            seq = seqs[r]
            bm.hash_blocks(seq)
            seq.num_cached_tokens += 1
            seq.num_scheduled_tokens = 0
            k = sampled[r] + 1
            sampled[r] = k
            seq.append_token(outputs[r][k])
        for r in admit:
            seq = seqs[r]
            bm.hash_blocks(seq)
            seq.num_cached_tokens += seq.num_scheduled_tokens
            seq.num_scheduled_tokens = 0
            sampled[r] = 0
            seq.append_token(outputs[r][0])
        for r in finish:
            bm.deallocate(seqs.pop(r))
            del sampled[r]

    def counters(self) -> dict[str, Any]:
        return {
            "cached_prompt_tokens": self.cached_tokens,
            "blocks_in_use_at_end": len(self.bm.used_block_ids),
        }


def _factory(args):
    if not args.lib_path:
        raise SystemExit("replay_nanovllm.py needs --lib-path (a nano-vllm checkout)")
    return NanoVllmReplayer(Path(args.lib_path)), "list"


if __name__ == "__main__":
    main(_factory)
