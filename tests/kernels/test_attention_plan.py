"""Attention plans (plan once per step, run per layer): the plan-based reference attention
gives exactly the plan-less result, one plan serves several layers, and a plan refuses to run
with metadata, caches or queries it was not built for."""

import importlib.util

import pytest
import torch
from helpers.kernel_cases import dense_attention, make_case

import kernels
from kernels import plan as plan_mod
from kernels import reference

# (context_len, query_len): decodes of different lengths, a fresh prefill, a prefill over a
# cached prefix, a chunk in the middle of a prompt and a sequence with no query this step.
MIXED = [(40, 1), (0, 23), (17, 1), (33, 9), (5, 0), (64, 1), (16, 16), (1, 1)]


def _mixed_case(seed=0, group=3):
    return make_case(MIXED, block_size=8, num_kv_heads=2, group=group, head_size=32, seed=seed)


def _plan(case, window=None):
    return kernels.plan_paged_attention(
        case.block_table,
        case.seq_lens,
        case.query_start_loc,
        cache_shape=tuple(case.key_cache.shape),
        num_q_heads=case.query.shape[1],
        sliding_window=window,
    )


@pytest.mark.parametrize("window", [None, 1, 6])
@pytest.mark.parametrize("group", [1, 3])
def test_plan_equals_planless_on_mixed_batch(window, group):
    case = _mixed_case(seed=group, group=group)
    plan = _plan(case, window)
    with_plan = kernels.paged_attention(*case.attn_args(), softmax_scale=0.2, plan=plan, backend="torch")
    without = kernels.paged_attention(*case.attn_args(), softmax_scale=0.2, sliding_window=window, backend="torch")
    assert torch.equal(with_plan, without)
    torch.testing.assert_close(with_plan, dense_attention(case, 0.2, window), atol=2e-6, rtol=1e-5)
    # The plan carries the window: passing it again (equal) is accepted and changes nothing.
    again = kernels.paged_attention(
        *case.attn_args(), softmax_scale=0.2, sliding_window=window, plan=plan, backend="torch"
    )
    assert torch.equal(again, with_plan)


def test_plan_groups_decodes_and_prefills():
    case = _mixed_case()
    plan = _plan(case)
    assert [(p.seq, p.q_start, p.q_end) for p in plan.prefills] == [(1, 1, 24), (3, 25, 34), (6, 35, 51)]
    assert len(plan.decodes) == 1
    grp = plan.decodes[0]
    # Decode rows in batch order: sequences 0, 2, 5, 7 -> rows 0, 24, 34, 51 (not a run).
    assert grp.rows.tolist() == [0, 24, 34, 51]
    # Block ids padded to the longest decode sequence: 64 + 1 positions = 9 blocks of 8.
    assert grp.blocks.shape == (4, 9) and grp.mask.shape == (4, 1, 1, 72)
    assert grp.mask[:, 0, 0, :].eq(0).sum(1).tolist() == [41, 18, 65, 2]  # additive: 0 = visible, else -inf
    assert grp.mask.isneginf().sum().item() == 4 * 72 - (41 + 18 + 65 + 2)
    assert grp.blocks[1, :3].tolist() == case.block_table[2, :3].tolist() and grp.blocks[1, 3:].eq(0).all()
    # The fresh prompt (0, 23) runs as plain causal attention; the two over a cached prefix
    # keep a mask of G * q_len rows by seq_len positions.
    assert [p.mask is None for p in plan.prefills] == [True, False, False]
    assert [tuple(p.mask.shape) for p in plan.prefills[1:]] == [(3 * 9, 42), (3 * 16, 32)]
    assert plan.num_tokens == 52 and plan.cache_shape == (case.key_cache.shape[0], 8, 2, 32)


def test_plan_decode_run_uses_a_slice():
    case = make_case([(9, 1), (30, 1), (2, 1)], block_size=4, num_kv_heads=1, group=2, head_size=16)
    plan = _plan(case)
    assert plan.decodes[0].rows == slice(0, 3)
    out = kernels.paged_attention(*case.attn_args(), softmax_scale=0.3, plan=plan, backend="torch")
    torch.testing.assert_close(out, dense_attention(case, 0.3), atol=2e-6, rtol=1e-5)


def test_plan_splits_decodes_over_the_memory_budget(monkeypatch):
    case = _mixed_case(seed=5)
    # Budget for two decode sequences of <= 41 positions: the length-sorted split path.
    monkeypatch.setattr(plan_mod, "DECODE_GROUP_ELEMS", 2 * 41 * 2 * 32)
    plan = _plan(case)
    # Block-padded groups of at most 10 blocks of 8: only the two shortest (1 and 3 blocks) pair.
    assert [g.size for g in plan.decodes] == [2, 1, 1]
    out = kernels.paged_attention(*case.attn_args(), softmax_scale=0.2, plan=plan, backend="torch")
    torch.testing.assert_close(out, dense_attention(case, 0.2), atol=2e-6, rtol=1e-5)


def test_plan_splits_decodes_of_very_different_lengths():
    # Six short decodes and one long one: one padded group would attend 7 x 600 positions,
    # two length-sorted groups 6 x 8 + 600; the rows of a split group are a tensor.
    seqs = [(4, 1)] * 3 + [(599, 1)] + [(6, 1)] * 3
    case = make_case(seqs, block_size=8, num_kv_heads=1, group=2, head_size=16)
    plan = _plan(case)
    assert [g.size for g in plan.decodes] == [6, 1]
    assert plan.decodes[0].rows.tolist() == [0, 1, 2, 4, 5, 6] and plan.decodes[1].rows == slice(3, 4)
    out = kernels.paged_attention(*case.attn_args(), softmax_scale=0.3, plan=plan, backend="torch")
    torch.testing.assert_close(out, dense_attention(case, 0.3), atol=2e-6, rtol=1e-5)
    # Equal lengths: one group in batch order (a slice).
    same = _plan(make_case([(30, 1)] * 5, block_size=8, num_kv_heads=1, group=2, head_size=16))
    assert len(same.decodes) == 1 and same.decodes[0].rows == slice(0, 5)


@pytest.mark.parametrize("seed", range(20))
def test_decode_split_is_the_cheapest_partition(seed):
    # _split_sorted against brute force over every cut of a sorted list into runs.
    import itertools
    import random

    rng = random.Random(seed)
    blocks = sorted(rng.randint(1, 60) for _ in range(rng.randint(1, 8)))
    bs, cap = 16, rng.choice([60, 120, 10_000])

    def cost(runs):
        return sum(plan_mod.DECODE_GROUP_COST_POSITIONS + (j - i) * blocks[j - 1] * bs for i, j in runs)

    def ok(runs):
        return all(j - i == 1 or (j - i) * blocks[j - 1] <= cap for i, j in runs)

    n = len(blocks)
    best = min(
        cost(r)
        for k in range(n)
        for cuts in itertools.combinations(range(1, n), k)
        if ok(r := list(zip((0, *cuts), (*cuts, n))))
    )
    got = plan_mod._split_sorted(blocks, bs, cap)
    assert [i for i, _ in got] == [0] + [j for _, j in got[:-1]] and got[-1][1] == n  # runs tile 0..n
    assert ok(got) and cost(got) == best


def test_one_plan_serves_every_layer():
    # Two layers of one all-layer cache and one block table: one plan, two calls.
    case = _mixed_case(seed=2)
    layers = [
        (case.query, case.key_cache, case.value_cache),
        (case.query.flip(0), case.value_cache * 0.5, case.key_cache),
    ]  # other K/V/Q values
    kv = torch.stack([torch.stack([k, v]) for _, k, v in layers])
    plan = _plan(case)
    meta = (case.block_table, case.seq_lens, case.query_start_loc)
    for layer, (q, k, v) in enumerate(layers):
        got = kernels.paged_attention(
            q, kv[layer, 0], kv[layer, 1], *meta, softmax_scale=0.2, plan=plan, backend="torch"
        )
        assert torch.equal(got, reference.paged_attention(q, k, v, *meta, softmax_scale=0.2))


def test_plan_on_cache_without_flat_rows():
    # A cache whose (block, row) dims cannot be merged into one row index takes the
    # (block, row) gather; same numbers.
    case = _mixed_case(seed=4)
    k_t = case.key_cache.transpose(0, 1).contiguous().transpose(0, 1)  # strides (D*H, nb*H*D, ...)
    v_t = case.value_cache.transpose(0, 1).contiguous().transpose(0, 1)
    assert k_t.stride(0) != k_t.shape[1] * k_t.stride(1)
    plan = _plan(case)
    got = kernels.paged_attention(
        case.query,
        k_t,
        v_t,
        case.block_table,
        case.seq_lens,
        case.query_start_loc,
        softmax_scale=0.2,
        plan=plan,
        backend="torch",
    )
    assert torch.equal(got, reference.paged_attention(*case.attn_args(), softmax_scale=0.2))


def test_plan_ignores_block_table_padding():
    # Entries past a sequence's live blocks are never read, even if they are not block ids.
    case = make_case([(20, 1), (3, 1)], block_size=8, num_kv_heads=1, group=1, head_size=16)
    case.block_table[1, 1:] = 10_000
    plan = _plan(case)
    out = kernels.paged_attention(*case.attn_args(), softmax_scale=0.25, plan=plan, backend="torch")
    torch.testing.assert_close(out, dense_attention(case, 0.25), atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize(
    "change,pattern",
    [
        ("block_table", r"paged_attention: block_table is not the tensor the plan was built from"),
        ("seq_lens", r"paged_attention: seq_lens is not the tensor the plan was built from"),
        ("cache", r"paged_attention: key_cache has shape \(\d+, 4, 2, 32\), expected \(\d+, 8, 2, 32\)"),
        ("tokens", r"paged_attention: query has shape \(51, 6, 32\), expected \(52, 6, 32\)"),
        ("window", r"paged_attention: sliding_window is 3, expected None \(the plan has no window\)"),
    ],
)
def test_plan_mismatch_is_refused(change, pattern):
    case = _mixed_case()
    plan = _plan(case)
    args = dict(
        query=case.query,
        key_cache=case.key_cache,
        value_cache=case.value_cache,
        block_table=case.block_table,
        seq_lens=case.seq_lens,
        query_start_loc=case.query_start_loc,
    )
    kw = {}
    if change in ("block_table", "seq_lens"):
        args[change] = args[change].clone()
    elif change == "cache":
        args["key_cache"] = case.key_cache.reshape(-1, 4, 2, 32)
        args["value_cache"] = case.value_cache.reshape(-1, 4, 2, 32)
    elif change == "tokens":
        args["query"] = case.query[:-1]
    else:
        kw["sliding_window"] = 3
    with pytest.raises(ValueError, match=pattern):
        kernels.paged_attention(*args.values(), softmax_scale=0.2, plan=plan, backend="torch", **kw)


@pytest.mark.parametrize(
    "bad,pattern",
    [
        ("oob", r"plan_paged_attention: block_table holds block ids in \[\d+, 999\], expected ids in \[0, \d+\)"),
        ("neg_len", r"plan_paged_attention: seq_lens\[2\] is -1, expected seq_lens >= 0"),
        ("qsl", r"plan_paged_attention: query_start_loc has dtype torch.int64, expected torch.int32"),
        ("heads", r"plan_paged_attention: num_q_heads is 5, expected a positive multiple of num_kv_heads=2"),
        ("tokens", r"plan_paged_attention: query_start_loc runs from 0 to 52, expected 0 to num_tokens=50"),
    ],
)
def test_plan_validates_metadata_once(bad, pattern):
    case = _mixed_case()
    bt, sl, qsl = case.block_table, case.seq_lens, case.query_start_loc
    kw = dict(cache_shape=tuple(case.key_cache.shape), num_q_heads=case.query.shape[1])
    if bad == "oob":
        bt = bt.clone()
        bt[0, 0] = 999
    elif bad == "neg_len":
        sl = sl.clone()
        sl[2] = -1
    elif bad == "qsl":
        qsl = qsl.long()
    elif bad == "heads":
        kw["num_q_heads"] = 5
    else:
        kw["num_tokens"] = 50
    with pytest.raises(ValueError, match=pattern):
        kernels.plan_paged_attention(bt, sl, qsl, **kw)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
def test_triton_backend_accepts_and_ignores_plan():
    case = make_case([(12, 1), (0, 5), (7, 3)], block_size=16, num_kv_heads=2, group=2, head_size=32)
    plan = _plan(case, window=4)
    got = kernels.paged_attention(*case.attn_args(), softmax_scale=0.2, plan=plan, backend="triton")
    torch.testing.assert_close(got, dense_attention(case, 0.2, 4), atol=1e-5, rtol=1e-4)


# ---- cache writes through a plan built with the step's slot mapping ---------------------------


def _write_case(num_tokens=12, num_blocks=9, bs=4, hkv=2, d=8, seed=3):
    g = torch.Generator().manual_seed(seed)
    kc, vc = torch.zeros(num_blocks, bs, hkv, d), torch.zeros(num_blocks, bs, hkv, d)
    slots = torch.randperm((num_blocks - 1) * bs, generator=g)[:num_tokens] + bs  # never the null block
    key = torch.randn(num_tokens, hkv, d, generator=g)
    value = torch.randn(num_tokens, hkv, d, generator=g)
    # One sequence of num_tokens tokens over the blocks its slots use (the metadata the plan needs).
    bt = torch.arange(1, num_blocks, dtype=torch.int32).unsqueeze(0)
    meta = (bt, torch.tensor([num_tokens], dtype=torch.int32), torch.tensor([0, num_tokens], dtype=torch.int32))
    return kc, vc, slots, key, value, meta


def _write_plan(kc, meta, slots, num_q_heads=2):
    return kernels.plan_paged_attention(*meta, cache_shape=tuple(kc.shape), num_q_heads=num_q_heads, slot_mapping=slots)


def test_cache_write_with_plan_equals_plain_write():
    kc, vc, slots, key, value, meta = _write_case()
    plan = _write_plan(kc, meta, slots)
    assert plan.slot_mapping is slots and plan.min_slot == int(slots.min())
    kernels.reshape_and_cache(key, value, kc, vc, slots, plan=plan, backend="torch")
    want_k, want_v = torch.zeros_like(kc), torch.zeros_like(vc)
    reference.reshape_and_cache(key, value, want_k, want_v, slots)
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)
    flat = kc.view(-1, *kc.shape[2:])
    assert torch.equal(flat[slots], key)  # every row landed at its own slot


def test_cache_write_refuses_a_plan_of_another_slot_mapping_or_cache():
    kc, vc, slots, key, value, meta = _write_case()
    plan = _write_plan(kc, meta, slots)
    before = kc.clone()
    with pytest.raises(ValueError, match="slot_mapping is not the tensor the plan was built from"):
        reference.reshape_and_cache(key, value, kc, vc, slots.clone(), plan=plan)
    small_k, small_v = torch.zeros(5, *kc.shape[1:]), torch.zeros(5, *kc.shape[1:])
    with pytest.raises(ValueError, match=r"key_cache has shape \(5, 4, 2, 8\), expected \(9, 4, 2, 8\)"):
        reference.reshape_and_cache(key, value, small_k, small_v, slots, plan=plan)
    with pytest.raises(ValueError, match=r"key has shape \(11, 2, 8\), expected \(12, 2, 8\)"):
        reference.reshape_and_cache(key[:11], value, kc, vc, slots, plan=plan)
    assert torch.equal(kc, before)  # nothing written


def test_plan_checks_slot_values_once():
    kc, vc, slots, key, value, meta = _write_case()
    bad = slots.clone()
    bad[5] = 2  # a slot in the null block 0
    with pytest.raises(ValueError, match=r"plan_paged_attention: slot_mapping\[5\] is 2, a slot in the null block 0"):
        _write_plan(kc, meta, bad)
    bad[5] = kc.shape[0] * kc.shape[1]  # one past the cache
    with pytest.raises(ValueError, match="plan_paged_attention: slot_mapping has slot 36, expected slots < "):
        _write_plan(kc, meta, bad)
    # A plan built without a slot mapping leaves the write to its full checks, which catch it.
    plan = kernels.plan_paged_attention(*meta, cache_shape=tuple(kc.shape), num_q_heads=2)
    assert plan.slot_mapping is None
    with pytest.raises(ValueError, match="reshape_and_cache: slot_mapping has slot 36"):
        reference.reshape_and_cache(key, value, kc, vc, bad, plan=plan)
