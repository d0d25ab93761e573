"""Bad inputs raise ValueError naming the tensor, what it got and what it expected -- before
any launch (the caches are left untouched)."""

import importlib.util

import pytest
import torch
from helpers.kernel_cases import make_case

import kernels

BACKENDS = ["torch"] + (["triton"] if importlib.util.find_spec("triton") else [])


def _case():
    return make_case([(10, 2), (5, 1)], block_size=8, num_kv_heads=2, group=2, head_size=16)


def _attn(case, backend, **over):
    args = dict(
        query=case.query,
        key_cache=case.key_cache,
        value_cache=case.value_cache,
        block_table=case.block_table,
        seq_lens=case.seq_lens,
        query_start_loc=case.query_start_loc,
    )
    kw = dict(softmax_scale=0.25)
    for k, v in over.items():
        (args if k in args else kw)[k] = v
    return kernels.paged_attention(*args.values(), backend=backend, **kw)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "bad,pattern",
    [
        (dict(block_table="i64"), r"paged_attention: block_table has dtype torch.int64, expected torch.int32"),
        (dict(seq_lens="i64"), r"seq_lens has dtype torch.int64, expected torch.int32"),
        (dict(query="f16"), r"query has dtype torch.float16, expected torch.float32"),
        (dict(query="int"), r"query has dtype torch.int32, expected torch.float32"),
        (dict(value_cache="f16"), r"value_cache has dtype torch.float16, expected torch.float32"),
        (dict(query="2d"), r"query has 2 dims \(shape \(3, 64\)\), expected 3 dims"),
        (dict(query="heads"), r"query has 3 heads, expected a multiple of num_kv_heads=2"),
        (dict(query="head_size"), r"query has head_size 8, expected 16"),
        (dict(seq_lens="short"), r"seq_lens has shape \(1,\), expected \(2,\)"),
        (dict(query_start_loc="end"), r"query_start_loc runs from 0 to 2, expected 0 to num_tokens=3"),
        (dict(seq_lens="too_short"), r"sequence 0 has query length 2 > seq_lens\[0\]=1"),
        (dict(block_table="narrow"), r"block_table has 1 columns, expected >= 2"),
        (dict(block_table="oob"), r"block_table holds block ids in \[\d+, 999\], expected ids in \[0, \d+\)"),
        (dict(block_table="meta"), r"block_table is on device meta, expected device cpu"),
        (dict(query="strided"), r"query has last-dim stride 2, expected 1"),
        (dict(softmax_scale=0.0), r"softmax_scale is 0.0, expected a positive float"),
        (dict(sliding_window=0), r"sliding_window is 0, expected None or an int >= 1"),
        (dict(out="shape"), r"out has shape \(3, 4, 8\), expected \(3, 4, 16\)"),
    ],
)
def test_paged_attention_rejects(backend, bad, pattern):
    case = _case()
    key, what = next(iter(bad.items()))
    t = getattr(case, key, None)
    if what == "i64":
        val = t.long()
    elif what == "f16":
        val = t.half()
    elif what == "int":
        val = t.int()
    elif what == "2d":
        val = t.reshape(t.shape[0], -1)
    elif what == "heads":
        val = torch.randn(t.shape[0], 3, t.shape[2])
    elif what == "head_size":
        val = t[..., :8].contiguous()
    elif what == "short":
        val = t[:1]
    elif what == "end":
        val = torch.tensor([0, 1, 2], dtype=torch.int32)
    elif what == "too_short":
        val = torch.tensor([1, 6], dtype=torch.int32)
    elif what == "narrow":
        val = t[:, :1]
    elif what == "oob":
        val = t.clone()
        val[0, 0] = 999
    elif what == "meta":
        val = t.to("meta")
    elif what == "strided":
        val = torch.randn(*t.shape[:2], 2 * t.shape[2])[..., ::2]
    elif what == "shape":
        val = torch.empty(3, 4, 8)
    else:
        val = what
    before = case.key_cache.clone()
    with pytest.raises(ValueError, match=pattern):
        _attn(case, backend, **{key: val})
    assert torch.equal(case.key_cache, before)


@pytest.mark.parametrize("backend", BACKENDS)
def test_reshape_and_cache_rejects(backend):
    kc = torch.zeros(4, 8, 2, 16)
    vc = torch.zeros_like(kc)
    k = torch.randn(5, 2, 16)
    slots = torch.arange(5)
    f = kernels.reshape_and_cache
    with pytest.raises(ValueError, match=r"slot_mapping has dtype torch.int32, expected torch.int64"):
        f(k, k, kc, vc, slots.int(), backend=backend)
    with pytest.raises(ValueError, match=r"key has shape \(5, 1, 16\), expected \(5, 2, 16\)"):
        f(k[:, :1], k, kc, vc, slots, backend=backend)
    with pytest.raises(ValueError, match=r"value has dtype torch.float16, expected torch.float32"):
        f(k, k.half(), kc, vc, slots, backend=backend)
    with pytest.raises(ValueError, match=r"value_cache has shape \(4, 8, 2, 8\), expected \(4, 8, 2, 16\)"):
        f(k, k, kc, vc[..., :8], slots, backend=backend)
    with pytest.raises(ValueError, match=r"slot_mapping has slot 32, expected slots < num_blocks\*block_size = 32"):
        f(k, k, kc, vc, torch.tensor([0, 1, 2, 3, 32]), backend=backend)
    with pytest.raises(ValueError, match=r"slot_mapping\[1\] is 1, a slot in the null block 0 \(slots 0..7\)"):
        f(k[:2], k[:2], kc, vc, torch.tensor([8, 1]), backend=backend)
    with pytest.raises(ValueError, match=r"slot_mapping\[0\] is 7, a slot in the null block 0"):
        f(k[:1], k[:1], kc, vc, torch.tensor([7]), backend=backend)
    with pytest.raises(ValueError, match=r"slot_mapping is on device meta, expected device cpu"):
        f(k, k, kc, vc, slots.to("meta"), backend=backend)
    with pytest.raises(ValueError, match=r"key_cache must be a torch.Tensor, got list"):
        f(k, k, [kc], vc, slots, backend=backend)
    assert kc.abs().sum() == 0 and vc.abs().sum() == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_copy_blocks_rejects(backend):
    kv = torch.randn(2, 2, 6, 4, 1, 8)
    before = kv.clone()
    f = kernels.copy_blocks
    with pytest.raises(ValueError, match=r"block_mapping has dtype torch.float32, expected torch.int32 or torch.int64"):
        f(kv, torch.tensor([[1.0, 2.0]]), backend=backend)
    with pytest.raises(ValueError, match=r"block_mapping has shape \(2, 3\), expected \(K, 2\)"):
        f(kv, torch.zeros(2, 3, dtype=torch.int64), backend=backend)
    with pytest.raises(ValueError, match=r"block_mapping dst ids span \[2, 6\], expected ids in \[0, 6\)"):
        f(kv, torch.tensor([[1, 2], [3, 6]]), backend=backend)
    with pytest.raises(ValueError, match=r"block_mapping has repeated dst ids"):
        f(kv, torch.tensor([[1, 2], [3, 2]]), backend=backend)
    with pytest.raises(
        ValueError, match=r"block_mapping\[0\] has dst block 0 \(the null block\), expected dst ids >= 1"
    ):
        f(kv, torch.tensor([[1, 0]]), backend=backend)
    with pytest.raises(ValueError, match=r"block_mapping uses block\(s\) \[2\] as both src and dst"):
        f(kv, torch.tensor([[1, 2], [2, 4]]), backend=backend)
    with pytest.raises(
        ValueError, match=r"kv_cache has shape \(2, 3, 6, 4, 1, 8\), expected \(\*, 2, \*, \*, \*, \*\)"
    ):
        f(torch.zeros(2, 3, 6, 4, 1, 8), torch.tensor([[1, 2]]), backend=backend)
    assert torch.equal(kv, before)


def test_copy_blocks_triton_requires_contiguous():
    if "triton" not in BACKENDS:
        pytest.skip("triton not installed")
    kv = torch.randn(2, 6, 2, 4, 1, 8).transpose(1, 2)
    with pytest.raises(ValueError, match=r"copy_blocks: kv_cache is not contiguous .* expected a contiguous tensor"):
        kernels.copy_blocks(kv, torch.tensor([[1, 2]]), backend="triton")


def test_swap_blocks_rejects():
    src = torch.randn(2, 2, 6, 4, 1, 8)
    with pytest.raises(ValueError, match=r"dst_kv_cache has dtype torch.float16, expected torch.float32"):
        kernels.swap_blocks(src, torch.zeros(2, 2, 3, 4, 1, 8, dtype=torch.float16), torch.tensor([[0, 0]]))
    with pytest.raises(
        ValueError, match=r"dst_kv_cache has shape \(3, 2, 3, 4, 1, 8\), expected \(2, 2, \*, 4, 1, 8\)"
    ):
        kernels.swap_blocks(src, torch.zeros(3, 2, 3, 4, 1, 8), torch.tensor([[0, 0]]))
    with pytest.raises(ValueError, match=r"block_mapping dst ids span \[3, 3\], expected ids in \[0, 3\)"):
        kernels.swap_blocks(src, torch.zeros(2, 2, 3, 4, 1, 8), torch.tensor([[0, 3]]))


def test_swap_null_block_rule_depends_on_dst_pool():
    # The CPU swap pool has no null block (swap-out may target CPU block 0); a device pool
    # does, so a swap-in into block 0 is rejected before anything is copied.
    src = torch.randn(2, 2, 6, 4, 1, 8)
    cpu_pool = torch.zeros(2, 2, 3, 4, 1, 8)
    kernels.swap_blocks(src, cpu_pool, torch.tensor([[4, 0]]))
    assert torch.equal(cpu_pool[:, :, 0], src[:, :, 4]) and cpu_pool[:, :, 1:].abs().sum() == 0
    with pytest.raises(ValueError, match=r"swap_blocks: block_mapping\[1\] has dst block 0 \(the null block\)"):
        kernels.swap_blocks(cpu_pool, torch.zeros(2, 2, 6, 4, 1, 8, device="meta"), torch.tensor([[0, 2], [1, 0]]))
