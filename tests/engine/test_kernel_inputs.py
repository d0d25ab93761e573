"""``BatchTensors.from_steps`` -- the one allocator-to-kernel path -- on the engine's real
batches: every kernel input of every step of a run that prefills, decodes, chunks a prefill,
copies a shared block on write and swaps, checked against what the KV cache manager and the
engine's own sequences say at that moment."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from pagedkv.engine import LLMEngine, SamplingParams
from pagedkv.tensors import BatchTensors, BlockTable


def _record(engine: LLMEngine) -> list[dict[str, Any]]:
    """Spy on the runner: per step, the kernel inputs plus the manager's own view, taken before
    the forward pass (block tables as the manager holds them then)."""
    seen: list[dict[str, Any]] = []
    original = engine.runner.prepare

    def spy(batch):
        bt = original(batch)
        seen.append(
            {
                "bt": bt,
                # a view of the runner's BlockTable buffer, valid until the next step: kept as is
                "block_table": bt.block_table.tolist(),
                "tables": [engine.manager.block_table(s.seq_id).tolist() for s in batch.seqs],
                "tokens": [list(s.token_ids) for s in batch.seqs],
                "copies": np.concatenate([p.copies for p in batch.steps]) if batch.steps else np.zeros((0, 3)),
                "swap_out": batch.swap_out,
                "swap_in": batch.swap_in,
                "num_parts": len(batch.steps),
            }
        )
        return bt

    engine.runner.prepare = spy
    return seen


def _check(step: dict[str, Any], block_size: int) -> None:
    bt: BatchTensors = step["bt"]
    tables, tokens = step["tables"], step["tokens"]
    s = len(tables)
    assert bt.num_seqs == s
    # dtypes end to end: int32 tables and lengths, int64 slots, ids and positions
    assert (bt.block_table.dtype, bt.seq_lens.dtype, bt.context_lens.dtype, bt.query_start_loc.dtype) == (
        torch.int32,
    ) * 4
    assert (bt.slot_mapping.dtype, bt.input_ids.dtype, bt.positions.dtype) == (torch.int64,) * 3
    width = max(1, max(len(t) for t in tables))
    assert step["block_table"] == [t + [0] * (width - len(t)) for t in tables]
    qsl = bt.query_start_loc.tolist()
    ctx, lens = bt.context_lens.tolist(), bt.seq_lens.tolist()
    assert qsl[0] == 0 and len(qsl) == s + 1
    want_pos, want_slots, want_ids = [], [], []
    for i in range(s):
        q = qsl[i + 1] - qsl[i]
        assert q >= 1 and lens[i] == ctx[i] + q
        for pos in range(ctx[i], lens[i]):
            want_pos.append(pos)
            want_slots.append(tables[i][pos // block_size] * block_size + pos % block_size)
            want_ids.append(tokens[i][pos])
    assert bt.positions.tolist() == want_pos
    assert bt.slot_mapping.tolist() == want_slots
    assert bt.input_ids.tolist() == want_ids
    assert bt.max_query_len == max(b - a for a, b in zip(qsl, qsl[1:]))
    assert bt.max_seq_len == max(lens)
    assert bt.copies.tolist() == step["copies"].tolist()
    for name in ("swap_out", "swap_in"):
        plan, got = step[name], getattr(bt, name)
        assert (got is None) == (plan is None)
        if plan is not None:
            assert got.dtype == torch.int32 and got.device.type == "cpu" and got.tolist() == plan.tolist()


def test_every_step_of_a_run_with_prefill_decode_chunks_cow_and_swap(tiny):
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (5, 17, 33, 1, 64, 40, 16, 48)]
    params = [
        SamplingParams(max_tokens=24),
        SamplingParams(max_tokens=16, n=3, temperature=1.0, seed=1),
        SamplingParams(max_tokens=12, beam_width=3),
    ] * 2 + [SamplingParams(max_tokens=20)] * 2
    engine = LLMEngine(
        tiny.hf, tokenizer=tiny.tokenizer, block_size=4, num_kv_blocks=60, max_tokens_per_step=32, preemption="swap"
    )
    steps = _record(engine)
    engine.generate(prompts, params)
    for step in steps:
        _check(step, 4)
    bts = [st["bt"] for st in steps]
    # the run really did every kind of step the contract covers
    assert any(bt.max_query_len > 1 for bt in bts)  # prefill
    assert any(bt.max_query_len == 1 for bt in bts)  # decode only
    assert any(
        0 < c < n for bt in bts for c, n in zip(bt.context_lens.tolist(), bt.seq_lens.tolist()) if n - c > 1
    )  # chunked prefill
    assert any(len(bt.copies) for bt in bts)  # copy-on-write
    assert any(bt.swap_out is not None for bt in bts) and any(bt.swap_in is not None for bt in bts)
    assert any(st["num_parts"] > 1 for st in steps)  # merged step outputs


def test_decode_step_tensors_share_the_core_arrays_on_the_cpu(tiny):
    engine = LLMEngine(tiny.hf, tokenizer=tiny.tokenizer, block_size=4, num_kv_blocks=64)
    engine.add_request([5, 6, 7, 8, 9], SamplingParams(max_tokens=4))
    engine.step()  # prefill
    batch = engine.scheduler.schedule()  # a decode step
    bt = BatchTensors.from_steps(batch.steps, "cpu", block_tables=engine.runner.block_tables)
    (out,) = batch.steps
    # torch.from_numpy: the very memory the core handed out, no host copy
    assert bt.slot_mapping.data_ptr() == out.slot_mapping.ctypes.data
    assert bt.query_start_loc.data_ptr() == out.query_start_loc.ctypes.data
    assert bt.positions.tolist() == [5] and bt.input_ids.tolist() == [batch.seqs[0].token_ids[5]]


def test_from_steps_refuses_arrays_that_did_not_come_from_the_core():
    from pagedkv.errors import InvalidArgumentError

    class Fake:
        block_table = np.zeros((1, 1), np.int32)

    with pytest.raises(InvalidArgumentError, match=r"steps\[0\].*expected a pagedkv.StepOutput"):
        BatchTensors.from_steps([Fake()], block_tables=None)  # type: ignore[list-item, arg-type]


def test_from_steps_refuses_a_missing_block_table(tiny):
    from pagedkv.errors import InvalidArgumentError

    engine = LLMEngine(tiny.hf, tokenizer=tiny.tokenizer, block_size=4, num_kv_blocks=64)
    engine.add_request([5, 6, 7], SamplingParams(max_tokens=2))
    batch = engine.scheduler.schedule()
    with pytest.raises(InvalidArgumentError, match=r"block_table=False: pass block_tables"):
        BatchTensors.from_steps(batch.steps, None, block_tables=None)
    with pytest.raises(InvalidArgumentError, match=r"block_tables.*expected a pagedkv.tensors.BlockTable"):
        BatchTensors.from_steps(batch.steps, None, block_tables=[])  # type: ignore[arg-type]


def test_no_step_outputs_make_an_empty_batch():
    import pagedkv

    tables = BlockTable(pagedkv.KVCacheManager(pagedkv.CacheConfig(8, 4)))
    bt = BatchTensors.from_steps([], None, block_tables=tables)
    assert (bt.num_seqs, bt.num_tokens, bt.max_query_len, bt.max_seq_len) == (0, 0, 0, 0)
    assert bt.query_start_loc.tolist() == [0] and bt.block_table.shape == (0, 1)
