"""Replay the allocator operation trace through vLLM's V1 ``KVCacheManager`` (and so its
``BlockPool``, ``KVCacheCoordinator`` and ``FullAttentionManager``).

Run by ``allocator_speed.py`` in a subprocess with the Python of an environment where vLLM is
installed: ``VLLM_PY replay_vllm.py --trace-file T --out R.json``. No model, engine or GPU is
involved: one full-attention KV cache group (block size of the trace, 1 KV head of size 1,
fp32: the tensor shape is irrelevant to the manager), prefix caching on with vLLM's default hash
(``prefix_caching_hash_algo = "sha256"``), ``Request`` objects built with the engine core's
block hasher. The calls per step are the scheduler's: for a new request ``Request(...)`` (which
hashes its full prompt blocks), ``get_computed_blocks`` and ``allocate_slots`` with the hit;
for a running request ``append_output_token_ids`` (hashes a block when it fills) and
``allocate_slots(request, 1)``; then ``num_computed_tokens`` is advanced as
``Scheduler._update_after_schedule`` does; ``free`` for finished requests. ``SamplingParams``
objects are built before the clock starts.
"""

from __future__ import annotations

import os
import sys
from itertools import chain
from typing import Any

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

from replay_common import OpTrace, Replayer, main  # noqa: E402


class VllmReplayer(Replayer):
    """vLLM V1 KVCacheManager (pure Python block pool with a doubly linked free queue)."""

    name = "vLLM"

    def __init__(self, hash_algo: str) -> None:
        import torch  # noqa: PLC0415
        import vllm  # noqa: PLC0415
        from vllm.sampling_params import SamplingParams  # noqa: PLC0415
        from vllm.utils.hashing import get_hash_fn_by_name  # noqa: PLC0415
        from vllm.v1.core.kv_cache_manager import KVCacheManager  # noqa: PLC0415
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: PLC0415
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec  # noqa: PLC0415
        from vllm.v1.request import Request, RequestStatus  # noqa: PLC0415

        self.torch = torch
        self.vllm = vllm
        self.SamplingParams = SamplingParams
        self.KVCacheManager = KVCacheManager
        self.FullAttentionSpec = FullAttentionSpec
        self.KVCacheConfig = KVCacheConfig
        self.KVCacheGroupSpec = KVCacheGroupSpec
        self.Request = Request
        self.RUNNING = RequestStatus.RUNNING
        self.hash_algo = hash_algo
        self.hash_fn = get_hash_fn_by_name(hash_algo)
        init_none_hash(self.hash_fn)
        self.get_request_block_hasher = get_request_block_hasher

    def version(self) -> dict[str, Any]:
        return {
            "version": f"vllm {self.vllm.__version__}",
            "hash": self.hash_algo,
            "python": sys.version.split()[0],
            "torch": self.torch.__version__,
            "modules": "vllm.v1.core.kv_cache_manager.KVCacheManager (+ block_pool.BlockPool)",
        }

    def prepare(self, trace: OpTrace, prompts: list[Any], outputs: list[Any]) -> None:
        bs = trace.block_size
        spec = self.FullAttentionSpec(block_size=bs, num_kv_heads=1, head_size=1, dtype=self.torch.float32)
        cfg = self.KVCacheConfig(
            num_blocks=trace.num_blocks, kv_cache_tensors=[], kv_cache_groups=[self.KVCacheGroupSpec(["layer"], spec)]
        )
        max_len = max(p + o for p, o in zip(trace.prompt_lens, trace.output_lens))
        self.kvm = self.KVCacheManager(
            cfg, max_model_len=max_len + bs, scheduler_block_size=bs, hash_block_size=bs, enable_caching=True
        )
        self.hasher = self.get_request_block_hasher(bs, self.hash_fn)
        self.params = [self.SamplingParams(max_tokens=o) for o in trace.output_lens]
        self.prompts = prompts
        self.outputs = outputs
        self.reqs: dict[int, Any] = {}
        self.sampled: dict[int, int] = {}
        self.cached_tokens = 0

    def step(self, t: int, admit: list[int], decode: list[int], finish: list[int]) -> None:
        kvm = self.kvm
        reqs = self.reqs
        sampled = self.sampled
        outputs = self.outputs
        for r in decode:
            req = reqs[r]
            req.append_output_token_ids(outputs[r][sampled[r]])
            if kvm.allocate_slots(req, 1) is None:
                raise RuntimeError(f"vLLM: out of blocks for a decode of request {r} at step {t}")
        for r in admit:
            req = self.Request(
                str(r), self.prompts[r], self.params[r], None, arrival_time=0.0, block_hasher=self.hasher
            )
            blocks, n, _ = kvm.get_computed_blocks(req)
            if (
                kvm.allocate_slots(req, req.num_tokens - n, num_new_computed_tokens=n, new_computed_blocks=blocks)
                is None
            ):
                raise RuntimeError(f"vLLM: out of blocks admitting request {r} at step {t}")
            req.status = self.RUNNING
            req.num_computed_tokens = n
            self.cached_tokens += n
            reqs[r] = req
        # Scheduler._update_after_schedule, then one sampled token per request.
        for r in decode:
            reqs[r].num_computed_tokens += 1
            sampled[r] += 1
        for r in admit:
            req = reqs[r]
            req.num_computed_tokens = req.num_tokens
            sampled[r] = 0
        for r in finish:
            kvm.free(reqs.pop(r))
            del sampled[r]

    def pool_adapter(self, num_blocks: int) -> Any:
        """vllm.v1.core.block_pool.BlockPool (caching off): get_new_blocks / free_blocks."""
        from vllm.v1.core.block_pool import BlockPool  # noqa: PLC0415

        pool = BlockPool(num_blocks, enable_caching=False, hash_block_size=16)

        free_blocks = pool.free_blocks

        class _Pool:
            allocate = staticmethod(pool.get_new_blocks)
            allocate_items = staticmethod(pool.get_new_blocks)

            @staticmethod
            def free_request(parts: list[Any]) -> None:
                # Tail first without building a list, as vLLM's manager frees a request
                # (free_blocks walks any iterable once): decode blocks last-first, then the prompt's.
                free_blocks(chain(parts[:0:-1], reversed(parts[0])))

        return _Pool()

    def counters(self) -> dict[str, Any]:
        pool = self.kvm.block_pool
        return {
            "cached_prompt_tokens": self.cached_tokens,
            "blocks_in_use_at_end": pool.num_gpu_blocks - 1 - pool.get_num_free_blocks(),
        }


def _factory(args):
    return VllmReplayer(args.hash_algo or "sha256"), "list"


if __name__ == "__main__":
    main(_factory)
