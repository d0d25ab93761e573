"""The seam between ``PagedKVScheduler`` and the rest of vLLM: every read vLLM makes of
``scheduler.kv_cache_manager`` (and through it) outside the scheduler's own calls, answered from
pagedkv's state, tested the way vLLM makes it.

- vLLM's real ``EngineCore`` starts with ``PagedKVScheduler`` (a model executor that reports a
  KV cache spec and memory but runs no model) and serves requests through ``EngineCore.step``
  exactly as with the stock scheduler;
- the same for a hybrid model: the engine core groups a tiny Gemma 3 config's layers (their
  sliding-window and full-attention specs) into six KV cache groups that reach
  ``PagedKVCacheManager`` over pagedkv's groups manager; requests past the window, prefix hits and preemption are
  served as stock step by step, and a model runner's block tables, rebuilt from each
  ``SchedulerOutput`` as vLLM's runner does, are the manager's;
- ``EngineCore._initialize_effective_attention_block_size`` and
  ``EngineCore.get_kv_cache_group_metadata`` (both read
  ``kv_cache_manager.coordinator.single_type_managers``) give the stock results;
- every read listed in docs/design/vllm-seam.md ("vLLM seam") resolves on pagedkv's manager, the table
  names every ``kv_cache_manager.*`` read in the installed vLLM's source, and the paths only KV
  connectors reach stay unreached;
- with ``async_scheduling=True`` the engine core runs ``step_with_batch_queue`` (two batches
  in flight, the executor answering with futures) with the plug-in's async variant, equal to
  stock ``AsyncScheduler``;
- a vLLM release outside 0.32 / 0.33 is refused when the scheduler is built.

Runs only where vLLM is installed (``make test-vllm`` runs it under each supported release).
"""

from __future__ import annotations

import re
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM not installed (make test-vllm runs this suite)")

import torch  # noqa: E402
import vllm  # noqa: E402
from vllm.v1.core.sched.async_scheduler import AsyncScheduler  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.engine.core import EngineCore  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec  # noqa: E402

import pagedkv  # noqa: E402
from pagedkv.integrations.vllm import (  # noqa: E402
    SUPPORTED_VLLM_RELEASES,
    PagedKVAsyncScheduler,
    PagedKVCacheManager,
    PagedKVScheduler,
    UnsupportedVllmCallError,
    UnsupportedVllmConfigError,
    UnsupportedVllmVersionError,
    check_supported_version,
)
from pagedkv.testing.vllm_scheduler import (  # noqa: E402
    GEMMA3_NUM_LAYERS,
    GEMMA3_WINDOW,
    Driver,
    build_scheduler,
    fake_async_model_output,
    fake_model_output,
    fake_token,
    make_request,
    make_vllm_config,
    tiny_gemma3_model_dir,
)

BS = 16
DESIGN = Path(__file__).resolve().parents[3] / "docs" / "design" / "vllm-seam.md"

# ---- vLLM's EngineCore, started and stepped without a model --------------------------------

NUM_LAYERS = 2
NUM_KV_HEADS = 2
HEAD_SIZE = 16


class NoModelExecutor:
    """A vLLM model executor with no model: reports one full-attention KV cache spec per layer
    and memory for ``NUM_BLOCKS`` blocks (the engine core sizes the pool from them, as it does
    after profiling a real model), and answers ``execute_model`` with the harness's fake model
    (the token depends only on the request id and position).

    Async-capable (``supports_async_scheduling``): with the config's async scheduling on,
    ``execute_model(non_block=True)`` returns a future of None and ``sample_tokens`` a future
    of the output (taken when the batch was scheduled), as vLLM's executors answer
    ``step_with_batch_queue``."""

    NUM_BLOCKS = 64
    scheduler: Any = None

    def __init__(self, vllm_config: Any) -> None:
        self.vllm_config = vllm_config
        self.kv_cache_configs: Any = None
        self.supported_tasks = ("generate",)

    def _spec(self) -> Any:
        bs = self.vllm_config.cache_config.block_size
        return FullAttentionSpec(block_size=bs, num_kv_heads=NUM_KV_HEADS, head_size=HEAD_SIZE, dtype=torch.float32)

    def register_failure_callback(self, callback: Any) -> None:
        pass

    def collective_rpc(self, method: Any, timeout: Any = None, args: tuple = (), kwargs: Any = None) -> list[Any]:
        return []

    def get_kv_cache_specs(self) -> list[dict[str, Any]]:
        return [{f"model.layers.{i}.self_attn.attn": self._spec() for i in range(NUM_LAYERS)}]

    def get_supported_kv_cache_layouts(self) -> list[list[str]]:
        return [["NHD"]]

    def set_kv_cache_layout(self, *args: Any) -> None:
        pass

    def determine_available_memory(self) -> list[int]:
        # One block more than the pool: vLLM keeps block 0 as its null block.
        return [(self.NUM_BLOCKS + 1) * self._spec().page_size_bytes * NUM_LAYERS]

    def initialize_from_config(self, kv_cache_configs: Any) -> None:
        self.kv_cache_configs = kv_cache_configs

    def compile_or_warm_up_model(self) -> None:
        pass

    @classmethod
    def supports_async_scheduling(cls) -> bool:
        return True

    def execute_model(self, scheduler_output: Any, non_block: bool = False) -> Any:
        future: Future[Any] = Future()
        if self.vllm_config.scheduler_config.async_scheduling:
            self._sampled = fake_async_model_output(self.scheduler, scheduler_output)
            # An empty batch is answered by execute_model itself (nothing to sample).
            future.set_result(None if scheduler_output.total_num_scheduled_tokens else self._sampled)
            return future
        out = fake_model_output(self.scheduler, scheduler_output)
        if not non_block:
            return out
        future.set_result(out)
        return future

    def sample_tokens(self, grammar_output: Any, non_block: bool = False) -> Any:
        assert self.vllm_config.scheduler_config.async_scheduling, "execute_model returned the output"
        future: Future[Any] = Future()
        future.set_result(self._sampled)
        return future

    def take_draft_token_ids(self) -> None:
        return None

    def shutdown(self) -> None:
        pass


def _engine_core(scheduler_cls: type, async_scheduling: bool = False) -> Any:
    cfg = make_vllm_config(
        num_blocks=NoModelExecutor.NUM_BLOCKS,
        scheduler_cls=scheduler_cls,
        max_model_len=1024,
        async_scheduling=async_scheduling,
    )
    cfg.cache_config.num_gpu_blocks = None  # sized by the engine core from the executor
    core = EngineCore(cfg, NoModelExecutor, log_stats=True)
    core.model_executor.scheduler = core.scheduler
    return core


def _serve(core: Any, requests: list[Any], max_steps: int = 1000) -> tuple[dict[str, list[int]], dict[str, Any]]:
    """Add ``requests`` and step the engine core until none is left: the new tokens of each
    request, and the stats the scheduler reported (prefix-cache counts summed, KV cache usage
    per step: ``Scheduler.make_stats`` reads both from the manager)."""
    for request in requests:
        core.add_request(request)
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    stats: dict[str, Any] = {"requests": 0, "queries": 0, "hits": 0, "usage": []}
    for _ in range(max_steps):
        if not core.scheduler.has_requests() and not core.batch_queue:
            break
        # The engine core's own choice: step_with_batch_queue under async scheduling.
        outputs, _ = core.step_fn()
        for eco in (outputs or {}).values():
            for o in eco.outputs:
                tokens[o.request_id].extend(o.new_token_ids)
            if eco.scheduler_stats is None:
                continue
            stats["usage"].append(eco.scheduler_stats.kv_cache_usage)
            prefix = eco.scheduler_stats.prefix_cache_stats
            if prefix is not None:
                for key in ("requests", "queries", "hits"):
                    stats[key] += getattr(prefix, key)
    assert not core.scheduler.has_requests()
    return tokens, stats


def _requests(tag: str) -> list[Any]:
    system = list(range(1000, 1000 + 3 * BS))
    return [make_request(f"{tag}{i}", system + [7 + i] * (i + 1), max_tokens=6) for i in range(4)]


def test_engine_core_starts_and_serves_with_pagedkv_scheduler() -> None:
    # vLLM's EngineCore.__init__ builds the scheduler from the configured class, then reads
    # kv_cache_manager.coordinator.single_type_managers (start-up failed with AttributeError
    # before the coordinator view existed).
    stock = _engine_core(Scheduler)
    paged = _engine_core(PagedKVScheduler)
    assert type(paged.scheduler) is PagedKVScheduler
    assert isinstance(paged.scheduler.kv_cache_manager, PagedKVCacheManager)
    # The engine core sized the pool from the executor's memory, for both.
    assert paged.scheduler.kv_cache_config.num_blocks == stock.scheduler.kv_cache_config.num_blocks
    assert paged.scheduler.kv_cache_manager.num_blocks == paged.scheduler.kv_cache_config.num_blocks
    assert paged.vllm_config.cache_config.effective_attention_block_size == BS
    assert (
        paged.vllm_config.cache_config.effective_attention_block_size
        == stock.vllm_config.cache_config.effective_attention_block_size
    )
    assert paged.get_kv_cache_group_metadata() == stock.get_kv_cache_group_metadata()

    # The first request alone, then three sharing its 3-block system prompt.
    results = {}
    for name, core in (("stock", stock), ("paged", paged)):
        first = _serve(core, _requests("r")[:1])
        rest = _serve(core, _requests("r")[1:])
        results[name] = (first, rest)
    assert results["paged"] == results["stock"]
    (tokens, first_stats), (rest_tokens, rest_stats) = results["paged"]
    assert tokens["r0"] == [fake_token("r0", 3 * BS + 1 + k) for k in range(6)]
    assert all(len(t) == 6 for t in rest_tokens.values())
    assert first_stats["hits"] == 0 and rest_stats["hits"] == 3 * 3 * BS
    assert max(rest_stats["usage"]) > 0.0
    # The engine core's own entry points into the manager.
    assert paged.scheduler.get_kv_cache_usage() == stock.scheduler.get_kv_cache_usage() == 0.0
    assert paged.reset_prefix_cache() is True and stock.reset_prefix_cache() is True
    system = list(range(1000, 1000 + 3 * BS))
    _, after_reset = _serve(paged, [make_request("again", [*system, 7], max_tokens=2)])
    assert after_reset["queries"] > 0 and after_reset["hits"] == 0


def test_engine_core_with_async_scheduling_runs_the_async_variant_equal_to_stock() -> None:
    # vLLM's EngineCore with async_scheduling=True: a batch queue of two, step_with_batch_queue
    # scheduling step N+1 before step N's output is consumed. --scheduler-cls PagedKVScheduler
    # builds the async variant; the engine's outputs and stats equal stock AsyncScheduler's.
    stock = _engine_core(AsyncScheduler, async_scheduling=True)
    paged = _engine_core(PagedKVScheduler, async_scheduling=True)
    assert type(paged.scheduler) is PagedKVAsyncScheduler
    assert paged.batch_queue is not None and paged.batch_queue.maxlen == 2
    assert paged.step_fn == paged.step_with_batch_queue
    results = {}
    for name, core in (("stock", stock), ("paged", paged)):
        first = _serve(core, _requests("r")[:1])
        rest = _serve(core, _requests("r")[1:])
        results[name] = (first, rest)
    assert results["paged"] == results["stock"]
    (tokens, _), (rest_tokens, rest_stats) = results["paged"]
    assert tokens["r0"] == [fake_token("r0", 3 * BS + 1 + k) for k in range(6)]
    assert all(len(t) == 6 for t in rest_tokens.values())
    assert rest_stats["hits"] == 3 * 3 * BS
    manager = paged.scheduler.kv_cache_manager
    assert manager.async_scheduling and not manager._unknown
    assert manager.manager.num_sequences == 0 and manager.usage == 0.0


def test_initialize_effective_attention_block_size_on_built_scheduler() -> None:
    # The exact function vLLM's engine core calls right after building the scheduler.
    for block_size in (16, 32):
        results = {}
        for cls in (Scheduler, PagedKVScheduler):
            cfg = make_vllm_config(num_blocks=64, block_size=block_size)
            core = EngineCore.__new__(EngineCore)
            core.vllm_config = cfg
            core.scheduler = build_scheduler(cls, cfg)
            cfg.cache_config.effective_attention_block_size = -1
            EngineCore._initialize_effective_attention_block_size(core)
            results[cls] = (
                cfg.cache_config.effective_attention_block_size,
                EngineCore.get_kv_cache_group_metadata(core),
            )
        assert results[PagedKVScheduler] == results[Scheduler]
        assert results[PagedKVScheduler][0] == block_size


# ---- a hybrid model (Gemma 3's layer pattern) in the engine core ---------------------------


class WorkerTables:
    """The block tables a vLLM model runner keeps per request and KV cache group, rebuilt from
    each ``SchedulerOutput`` exactly as its ``_update_states`` does: a new request's
    ``block_ids``; a scheduled cached request's ``new_block_ids`` appended (replacing the table
    when it resumes from preemption); finished requests dropped."""

    def __init__(self) -> None:
        self.tables: dict[str, list[list[int]]] = {}

    def update(self, out: Any) -> None:
        for rid in out.finished_req_ids:
            self.tables.pop(rid, None)
        for new in out.scheduled_new_reqs:
            self.tables[new.req_id] = [list(ids) for ids in new.block_ids]
        cached = out.scheduled_cached_reqs
        for rid, new_ids in zip(cached.req_ids, cached.new_block_ids, strict=True):
            if rid in cached.resumed_req_ids:
                assert new_ids is not None
                self.tables[rid] = [list(ids) for ids in new_ids]
            elif new_ids is not None:
                for table, more in zip(self.tables[rid], new_ids, strict=True):
                    table.extend(more)


class HybridNoModelExecutor(NoModelExecutor):
    """``NoModelExecutor`` for the tiny Gemma 3 config (:func:`tiny_gemma3_model_dir`): each
    layer reports the spec vLLM's attention layer reports for it (``SlidingWindowSpec`` of the
    config's window for a sliding layer, ``FullAttentionSpec`` for a full one, as the config's
    ``layer_types`` say), memory for ``NUM_BLOCKS`` blocks of the six groups vLLM forms. Each
    step it mirrors the model runner's block tables (:class:`WorkerTables`) and checks them
    against ``kv_cache_manager.get_block_ids``: what the worker reads is the manager's table
    (an entry the manager released out of the window may still hold the old id there, as it
    does in vLLM's runner; the attention never reads it). It records per step the preempted
    requests, the new requests' prefix hits (their ``num_computed_tokens``) and, per scheduled
    request, each group's table length and real blocks."""

    NUM_BLOCKS = 1024

    def __init__(self, vllm_config: Any) -> None:
        super().__init__(vllm_config)
        self.worker = WorkerTables()
        self.steps: list[dict[str, Any]] = []

    def _layer_specs(self) -> dict[str, Any]:
        text = self.vllm_config.model_config.hf_text_config
        bs = self.vllm_config.cache_config.block_size
        kw: dict[str, Any] = dict(block_size=bs, num_kv_heads=1, head_size=16, dtype=torch.float32)
        return {
            f"model.layers.{i}.self_attn.attn": (
                SlidingWindowSpec(sliding_window=text.sliding_window, **kw)
                if kind == "sliding_attention"
                else FullAttentionSpec(**kw)
            )
            for i, kind in enumerate(text.layer_types)
        }

    def get_kv_cache_specs(self) -> list[dict[str, Any]]:
        return [self._layer_specs()]

    def determine_available_memory(self) -> list[int]:
        # vLLM packs each of its six groups' three layers in one page per block; block 0 is
        # its null block.
        page = FullAttentionSpec(
            block_size=self.vllm_config.cache_config.block_size, num_kv_heads=1, head_size=16, dtype=torch.float32
        ).page_size_bytes
        return [(self.NUM_BLOCKS + 1) * page * GEMMA3_NUM_LAYERS // 6]

    def execute_model(self, scheduler_output: Any, non_block: bool = False) -> Any:
        kvm = self.scheduler.kv_cache_manager
        self.worker.update(scheduler_output)
        held = {}
        for rid in sorted(scheduler_output.num_scheduled_tokens):
            theirs = kvm.get_block_ids(rid)
            ours = self.worker.tables[rid]
            assert [len(t) for t in ours] == [len(t) for t in theirs], rid
            for g, (w, m) in enumerate(zip(ours, theirs, strict=True)):
                assert all(b == 0 or a == b for a, b in zip(w, m, strict=True)), (rid, g, w, m)
            held[rid] = tuple((len(t), sum(1 for b in t if b)) for t in theirs)
        self.steps.append(
            {
                "new_prefix_hits": {r.req_id: r.num_computed_tokens for r in scheduler_output.scheduled_new_reqs},
                "preempted": sorted(scheduler_output.preempted_req_ids or ()),
                "held": held,
            }
        )
        return super().execute_model(scheduler_output, non_block)


def _hybrid_engine_core(
    scheduler_cls: type, num_blocks: int = 1024, retention: int | None = None, max_model_len: int = 4096
) -> Any:
    """vLLM's ``EngineCore`` on the tiny Gemma 3 config with ``scheduler_cls``, the pool sized
    by the engine core for ``num_blocks`` blocks; ``retention`` is vLLM's
    ``prefix_cache_retention_interval`` (None: dense, every window block cached, where
    pagedkv's hits equal vLLM's; 0: vLLM's default sparse retention)."""
    executor = type("Executor", (HybridNoModelExecutor,), {"NUM_BLOCKS": num_blocks})
    cfg = make_vllm_config(
        num_blocks=num_blocks,
        scheduler_cls=scheduler_cls,
        max_model_len=max_model_len,
        max_num_batched_tokens=256,
        model_dir=tiny_gemma3_model_dir(),
    )
    cfg.cache_config.num_gpu_blocks = None  # sized by the engine core from the executor
    cfg.cache_config.prefix_cache_retention_interval = retention
    core = EngineCore(cfg, executor, log_stats=True)
    core.model_executor.scheduler = core.scheduler
    return core


def _long_prompt(seed: int, n: int) -> list[int]:
    return [100 + (seed * 7919 + 31 * i) % 3900 for i in range(n)]


def test_engine_core_groups_a_gemma3_model_into_the_hybrid_manager() -> None:
    stock = _hybrid_engine_core(Scheduler)
    paged = _hybrid_engine_core(PagedKVScheduler)
    kv = paged.scheduler.kv_cache_config
    # vLLM's engine core formed Gemma 3's groups from the layers' specs: the full-attention
    # layers 5, 11, 17 in one group, the 15 sliding-window layers in five of three.
    kinds = [
        (type(g.kv_cache_spec).__name__, getattr(g.kv_cache_spec, "sliding_window", None)) for g in kv.kv_cache_groups
    ]
    assert kinds == [
        (type(g.kv_cache_spec).__name__, getattr(g.kv_cache_spec, "sliding_window", None))
        for g in stock.scheduler.kv_cache_config.kv_cache_groups
    ]
    assert sorted(kinds, key=str) == sorted(
        [("FullAttentionSpec", None)] + [("SlidingWindowSpec", GEMMA3_WINDOW)] * 5, key=str
    )
    full = [g for g in kv.kv_cache_groups if type(g.kv_cache_spec) is FullAttentionSpec]
    assert [sorted(g.layer_names) for g in full] == [[f"model.layers.{i}.self_attn.attn" for i in (11, 17, 5)]]
    assert all(len(g.layer_names) == 3 for g in kv.kv_cache_groups)
    kvm = paged.scheduler.kv_cache_manager
    assert isinstance(kvm, PagedKVCacheManager)
    assert kvm.num_kv_cache_groups == kvm.manager.num_groups == 6
    assert [s.kind for s in kvm.manager.groups] == ["full" if k[1] is None else "sliding_window" for k in kinds]
    assert kv.num_blocks == stock.scheduler.kv_cache_config.num_blocks == kvm.num_blocks
    assert paged.vllm_config.cache_config.effective_attention_block_size == BS
    assert paged.get_kv_cache_group_metadata() == stock.get_kv_cache_group_metadata()
    assert len(paged.get_kv_cache_group_metadata()) == 6


def _hybrid_pair(num_blocks: int = 1024, retention: int | None = None, **kw: Any) -> dict[str, Any]:
    return {
        "stock": _hybrid_engine_core(Scheduler, num_blocks, retention, **kw),
        "paged": _hybrid_engine_core(PagedKVScheduler, num_blocks, retention, **kw),
    }


LONG = _long_prompt(1, 700)


def _serve_past_the_window(retention: int | None) -> dict[str, dict[str, Any]]:
    """A prompt past the 512-token window; the same prompt again with a short prompt that is
    its first 40 tokens; two prompts sharing its first 600 tokens: served through
    ``EngineCore.add_request`` / ``step`` on stock and plug-in engine cores (the worker's
    tables checked against the manager's every step)."""
    results = {}
    for name, core in _hybrid_pair(retention=retention).items():
        first = _serve(core, [make_request("long", LONG, max_tokens=20)])
        again = _serve(
            core, [make_request("again", LONG, max_tokens=20), make_request("short", LONG[:40], max_tokens=5)]
        )
        share = _serve(core, [make_request(f"s{i}", LONG[:600] + [9 + i] * (30 + i), max_tokens=8) for i in range(2)])
        groups = core.scheduler.kv_cache_config.kv_cache_groups
        steps = core.model_executor.steps
        results[name] = {
            "tokens": {**first[0], **again[0], **share[0]},
            "hits": {rid: n for step in steps for rid, n in step["new_prefix_hits"].items()},
            "stats": [{k: v for k, v in run[1].items() if k != "usage"} for run in (first, again, share)],
            "usage": [run[1]["usage"] for run in (first, again, share)],
            "steps": steps,
            "freed": _freed(core),
            "full_groups": [g for g, x in enumerate(groups) if type(x.kv_cache_spec) is FullAttentionSpec],
        }
    tokens = results["paged"]["tokens"]
    assert tokens == results["stock"]["tokens"]
    assert tokens["long"] == [fake_token("long", 700 + k) for k in range(20)]
    assert tokens["again"] == [fake_token("again", 700 + k) for k in range(20)]
    assert tokens["short"] == [fake_token("short", 40 + k) for k in range(5)]
    assert all(tokens[f"s{i}"] == [fake_token(f"s{i}", 630 + i + k) for k in range(8)] for i in range(2))
    for r in results.values():
        assert r["freed"] == (0.0, 0)  # every block back (cached ones count as free)
    return results


def test_engine_core_serves_a_gemma3_model_past_its_window_as_stock() -> None:
    # Dense retention (vLLM's prefix_cache_retention_interval=None): step by step the same
    # hits, per-group holdings, scheduler stats and KV cache usage as stock.
    results = _serve_past_the_window(None)
    stock, paged = results["stock"], results["paged"]
    assert paged["hits"] == stock["hits"]
    # The repeat hits all but its last block (699 tokens: 43 blocks of 16) in every group, the
    # 40-token prefix 2 blocks, each sibling the 600 shared tokens' 37 whole blocks.
    assert paged["hits"] == {"long": 0, "again": 43 * BS, "short": 2 * BS, "s0": 37 * BS, "s1": 37 * BS}
    assert paged["stats"] == stock["stats"]
    assert [s["hits"] for s in paged["stats"]] == [0, 45 * BS, 74 * BS]
    assert paged["usage"] == stock["usage"]
    assert paged["steps"] == stock["steps"]
    # The sliding-window groups released blocks behind the window (null entries) and never
    # held more than the window's blocks plus a chunk's; the full-attention group none.
    full = _full_group(paged)
    released = set()
    for step in paged["steps"]:
        for held in step["held"].values():
            for g, (length, real) in enumerate(held):
                if g == full:
                    assert real == length
                else:
                    assert real <= -(-(GEMMA3_WINDOW - 1 + 256) // BS) + 1
                    if real < length:
                        released.add(g)
    assert released == set(range(6)) - {full}


def test_engine_core_gemma3_hits_under_vllms_default_retention() -> None:
    # vLLM's default sparse retention (0) keeps only the first request's replay boundary of the
    # window groups, pagedkv (retention 0 = dense, by design) every block: the outputs agree,
    # the hits are asserted and reported for both.
    results = _serve_past_the_window(0)
    stock, paged = results["stock"], results["paged"]
    print(f"default retention: prefix hits stock {stock['hits']}, pagedkv {paged['hits']}")
    assert paged["hits"] == {"long": 0, "again": 43 * BS, "short": 2 * BS, "s0": 37 * BS, "s1": 37 * BS}
    assert stock["hits"]["long"] == 0 and stock["hits"]["again"] == 43 * BS
    # vLLM kept no window block at the short prompt's hit point; the first sibling hits only
    # the short prompt's own 2 blocks (its replay boundary); the second the junction the
    # first pinned.
    assert stock["hits"]["short"] == 0 and stock["hits"]["s0"] == 2 * BS and stock["hits"]["s1"] == 37 * BS


def _full_group(result: dict[str, Any]) -> int:
    (g,) = result["full_groups"]
    return int(g)


def _freed(core: Any) -> tuple[float, int]:
    """After the requests finished: KV cache usage (cached blocks count as free) and the
    requests the manager still holds blocks for (pagedkv's sequences; stock: none tracked)."""
    kvm = core.scheduler.kv_cache_manager
    if isinstance(kvm, PagedKVCacheManager):
        kvm.manager.check_invariants()
        return kvm.usage, kvm.manager.num_sequences
    return kvm.usage, 0


def test_engine_core_preempts_a_gemma3_model_under_a_small_pool() -> None:
    # 300 blocks for six requests growing to 600-700 tokens, past the window (a request then
    # holds 44 full-attention blocks and up to 34 in each sliding-window group): running
    # requests are preempted and resumed by recompute, as stock; every request ends with its
    # tokens and nothing stays held.
    results = {}
    for name, core in _hybrid_pair(num_blocks=300, retention=None, max_model_len=704).items():
        requests = [make_request(f"p{i}", _long_prompt(10 + i, 100 + 20 * i), max_tokens=500) for i in range(6)]
        tokens, stats = _serve(core, requests, max_steps=5000)
        steps = core.model_executor.steps
        results[name] = {
            "tokens": tokens,
            "hits": stats["hits"],
            "preempted": [s["preempted"] for s in steps],
            "steps": steps,
            "freed": _freed(core),
        }
    stock, paged = results["stock"], results["paged"]
    for i in range(6):
        assert paged["tokens"][f"p{i}"] == [fake_token(f"p{i}", 100 + 20 * i + k) for k in range(500)]
    assert paged["tokens"] == stock["tokens"]
    preempted = sum(map(len, paged["preempted"]))
    print(
        f"hybrid preemption: preempted stock {sum(map(len, stock['preempted']))}, pagedkv {preempted}; "
        f"hit tokens stock {stock['hits']}, pagedkv {paged['hits']}"
    )
    assert preempted > 0 and paged["preempted"] == stock["preempted"]
    assert paged["steps"] == stock["steps"]
    assert paged["freed"] == stock["freed"] == (0.0, 0)


# ---- the coordinator view ------------------------------------------------------------------


def _pair(**config: Any) -> tuple[Any, Any]:
    return (
        build_scheduler(Scheduler, make_vllm_config(**config)),
        build_scheduler(PagedKVScheduler, make_vllm_config(**config)),
    )


def test_coordinator_view_matches_vllms_coordinator() -> None:
    stock, paged = _pair(num_blocks=64, enable_prefix_caching=False)
    theirs, ours = stock.kv_cache_manager.coordinator, paged.kv_cache_manager.coordinator
    assert len(ours.single_type_managers) == len(theirs.single_type_managers) == 1
    (group,), (their_group,) = ours.single_type_managers, theirs.single_type_managers
    assert group.block_size == their_group.block_size == BS
    assert group.kv_cache_spec == their_group.kv_cache_spec
    assert group.kv_cache_spec is paged.kv_cache_config.kv_cache_groups[0].kv_cache_spec
    assert group.kv_cache_group_id == their_group.kv_cache_group_id == 0
    assert group.enable_caching is False
    assert ours.enable_partial_hash_hits == theirs.enable_partial_hash_hits is False
    assert ours.num_reprefillable_tokens == theirs.num_reprefillable_tokens == 0
    assert ours.kv_cache_config is paged.kv_cache_config
    assert ours.block_size == BS
    assert paged.kv_cache_manager.kv_cache_config is paged.kv_cache_config
    assert paged.kv_cache_manager.max_model_len == stock.kv_cache_manager.max_model_len
    assert paged.kv_cache_manager.mamba_shared_prefix_checkpoint is False
    assert stock.kv_cache_manager.mamba_shared_prefix_checkpoint is False


def test_coordinator_view_is_read_only() -> None:
    _, paged = _pair(num_blocks=64)
    kvm = paged.kv_cache_manager
    with pytest.raises(AttributeError):
        kvm.coordinator = None
    with pytest.raises(AttributeError):
        kvm.coordinator.block_size = 32
    with pytest.raises(AttributeError):
        kvm.coordinator.single_type_managers[0].block_size = 32
    with pytest.raises(AttributeError):
        kvm.coordinator.single_type_managers[0].kv_cache_spec = None
    assert kvm.coordinator.block_size == BS


def test_get_num_blocks_to_allocate_matches_vllm_every_step() -> None:
    # Both coordinators asked as vLLM's scheduler asks (no hit blocks), for every live request
    # after every step of a stream with chunked prefill, prefix hits and preemption.
    stock, paged = _pair(num_blocks=25, max_num_batched_tokens=96)
    drivers = Driver(stock), Driver(paged)
    system = list(range(2000, 2000 + 2 * BS))
    for d in drivers:
        for i in range(6):
            d.add(make_request(f"q{i}", system + list(range(3000 + 50 * i, 3000 + 50 * i + 9 + i)), max_tokens=40))
    asked = 0
    for _ in range(400):
        if not stock.has_unfinished_requests():
            break
        for d in drivers:
            d.step()
        for rid, request in stock.requests.items():
            for extra in (0, 1, BS, 3 * BS + 5):
                kw = dict(
                    request_id=rid,
                    num_tokens=request.num_tokens + extra,
                    new_computed_blocks=stock.kv_cache_manager.empty_kv_cache_blocks.blocks,
                    num_encoder_tokens=0,
                    total_computed_tokens=request.num_computed_tokens,
                    num_local_computed_tokens=request.num_computed_tokens,
                    num_tokens_main_model=request.num_tokens + extra,
                )
                want = stock.kv_cache_manager.coordinator.get_num_blocks_to_allocate(**kw)
                kw["new_computed_blocks"] = paged.kv_cache_manager.empty_kv_cache_blocks.blocks
                assert paged.kv_cache_manager.coordinator.get_num_blocks_to_allocate(**kw) == want, (rid, extra)
                asked += 1
    assert not paged.has_unfinished_requests()
    assert asked > 200
    assert drivers[0].outputs == drivers[1].outputs


def test_get_num_blocks_to_allocate_bad_input() -> None:
    _, paged = _pair(num_blocks=64)
    view = paged.kv_cache_manager.coordinator
    assert view.get_num_blocks_to_allocate("never-seen", 33) == 3
    with pytest.raises(pagedkv.InvalidArgumentError, match="num_tokens"):
        view.get_num_blocks_to_allocate("x", -1)
    with pytest.raises(pagedkv.InvalidArgumentError, match="cross-attention"):
        view.get_num_blocks_to_allocate("x", 4, num_encoder_tokens=4)
    with pytest.raises(pagedkv.InvalidArgumentError, match="new_computed_blocks"):
        view.get_num_blocks_to_allocate("x", 4, new_computed_blocks=([object()],))


def test_manager_refuses_a_kv_cache_config_it_does_not_match() -> None:
    stock, _ = _pair(num_blocks=64)
    # Built as vLLM builds its own manager: the groups' block size must be the scheduler's.
    with pytest.raises(pagedkv.InvalidConfigError) as err:
        PagedKVCacheManager(stock.kv_cache_config, scheduler_block_size=32)
    assert err.value.field == "kv_cache_spec.block_size"
    standalone = PagedKVCacheManager(stock.kv_cache_config)
    assert standalone.num_blocks == 64 and standalone.block_size == BS
    assert (
        standalone.coordinator.single_type_managers[0].kv_cache_spec
        is stock.kv_cache_config.kv_cache_groups[0].kv_cache_spec
    )
    assert standalone.coordinator.kv_cache_config is stock.kv_cache_config


# ---- every read, listed and answered ------------------------------------------------------

_READ = re.compile(r"kv_cache_manager\)?\.([A-Za-z_]+(?:\.[A-Za-z_]+)?)")


def _seam_table() -> dict[str, str]:
    """``{read path: how it is answered}`` from docs/design/vllm-seam.md's table."""
    section = DESIGN.read_text(encoding="utf-8")  # the chapter file holds the section alone
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 3 and cells[0].startswith("`") and cells[0] != "`read`":
            rows[cells[0].strip("`")] = cells[2]
    return rows


def _installed_reads() -> set[str]:
    """Every ``kv_cache_manager.X`` / ``kv_cache_manager.X.Y`` in the installed vLLM's source,
    except the definition module of vLLM's own manager."""
    root = Path(vllm.__file__).parent
    found = set()
    for path in root.rglob("*.py"):
        if path.name == "kv_cache_manager.py":
            continue
        for m in _READ.finditer(path.read_text(encoding="utf-8", errors="replace")):
            if m.group(1) != "py":
                found.add(m.group(1))
    return found


def test_docs_list_every_read_in_the_installed_vllm() -> None:
    table = _seam_table()
    missing = sorted(_installed_reads() - set(table))
    assert not missing, f"vLLM {vllm.__version__} reads kv_cache_manager.{missing}, not in docs/design/vllm-seam.md"


def _resolve(obj: Any, path: str) -> Any:
    for name in path.split("."):
        if isinstance(obj, tuple):
            obj = obj[0]
        obj = getattr(obj, name)
    return obj


def test_every_answered_read_resolves_on_pagedkv() -> None:
    _, paged = _pair(num_blocks=64)
    kvm = paged.kv_cache_manager
    table = _seam_table()
    answered = [p for p, how in table.items() if not how.startswith("not reached")]
    unreached = [p for p, how in table.items() if how.startswith("not reached")]
    assert len(answered) >= 25
    for path in answered:
        _resolve(kvm, path)
    # A path nothing but a refused feature reaches raises a typed error (none left in 0.33:
    # block zeroing is served since mixed-precision caches, bounded-replay SWA-MLA, are).
    for path in unreached:
        with pytest.raises(UnsupportedVllmCallError) as err:
            getattr(kvm, path.split(".")[0])([])
        assert isinstance(err.value, NotImplementedError)


def test_block_pool_paths_stay_unreached_under_preemption() -> None:
    # vLLM writes kv_cache_manager.block_pool only when freeing blocks it deferred (a KV
    # connector with overlapping batches) or copy-on-write retentions (copies pagedkv never
    # plans): neither queue ever fills.
    stock, paged = _pair(num_blocks=25, max_num_batched_tokens=256)
    driver = Driver(paged)
    for i in range(6):
        driver.add(make_request(f"p{i}", list(range(100 * i, 100 * i + 40)), max_tokens=40))
    records = []
    while paged.has_unfinished_requests():
        records.append(driver.step())
        assert not paged.deferred_frees
        assert paged.kv_cache_manager.take_kv_cache_block_copies() == ([], [])
    assert any(r["preempted"] for r in records)
    assert paged.defer_block_free is False and paged.connector is None


# ---- supported releases --------------------------------------------------------------------


def test_installed_vllm_is_a_supported_release() -> None:
    assert check_supported_version() in SUPPORTED_VLLM_RELEASES == ("0.32", "0.33")


@pytest.mark.parametrize(
    ("version", "release"),
    [("0.32.0", "0.32"), ("0.32.0+cpu", "0.32"), ("0.33.2", "0.33"), ("0.33.0rc1", "0.33")],
)
def test_supported_versions(version: str, release: str) -> None:
    assert check_supported_version(version) == release


@pytest.mark.parametrize("version", ["0.31.9", "0.34.0", "1.0.0", "0.3.3", "0.330.1", "dev", ""])
def test_scheduler_refuses_an_unsupported_vllm(monkeypatch: pytest.MonkeyPatch, version: str) -> None:
    monkeypatch.setattr(vllm, "__version__", version)
    cfg = make_vllm_config(num_blocks=64)
    with pytest.raises(UnsupportedVllmVersionError) as err:
        build_scheduler(PagedKVScheduler, cfg)
    e = err.value
    assert isinstance(e, ValueError) and isinstance(e, UnsupportedVllmConfigError)
    assert isinstance(e, pagedkv.PagedKVError)
    assert e.value == version and e.supported == ("0.32", "0.33")
    assert "0.32" in str(e) and "0.33" in str(e) and f"vLLM {version} " in str(e)
    # The stock scheduler is unaffected by the fake version.
    build_scheduler(Scheduler, cfg)
