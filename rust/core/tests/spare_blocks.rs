//! Spare blocks of a group out of the prefix cache (`GroupSpec::with_spare_blocks`), and block
//! sizes above `MAX_BLOCK_SIZE` with prefix caching off: how pagedkv expresses vLLM's Mamba
//! groups in cache mode "none" (one block of the context length per request plus `k` blocks
//! for the drafts' states, the blocks before the last computed token's released).

use pagedkv_core::kv_groups::{MAX_BLOCK_SIZE, MAX_UNCACHED_BLOCK_SIZE};
use pagedkv_core::{CacheConfig, Error, GroupSpec, KvCacheManager, SequenceSpec, NULL_BLOCK};

/// Attention blocks of 16 tokens, a Mamba-like group of `ctx` tokens per block with `k` spare
/// blocks (pages of `lcm` bytes), prefix caching off.
fn cfg(num_blocks: u32, ctx: u32, k: u32) -> CacheConfig {
    let lcm = num_lcm(16, ctx);
    let mut c = CacheConfig::with_groups(
        num_blocks,
        vec![
            GroupSpec::full(16, u64::from(lcm / 16)),
            GroupSpec::sliding_window(ctx, u64::from(lcm / ctx), 2)
                .uncached()
                .with_spare_blocks(k),
        ],
        vec![0, 1, 1],
    );
    c.enable_prefix_caching = false;
    c
}

fn num_lcm(a: u32, b: u32) -> u32 {
    let (mut x, mut y) = (a, b);
    while y != 0 {
        (x, y) = (y, x % y);
    }
    a / x * b
}

fn toks(n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| i * 7 + 1).collect()
}

fn real(t: &[u32]) -> usize {
    t.iter().filter(|&&b| b != NULL_BLOCK).count()
}

#[test]
fn spare_blocks_are_counted_kept_and_released_at_the_end() {
    // Context length 3000: a scheduler block size (LCM) of 6000, above MAX_BLOCK_SIZE.
    let m = KvCacheManager::new(cfg(200, 3000, 2)).unwrap();
    assert_eq!(m.hit_unit(), 6000);
    let free0 = m.pool().num_free();
    m.add_sequence(1, toks(100), SequenceSpec::default())
        .unwrap();
    let need = m.num_blocks_needed(1, 64).unwrap();
    let a = m.allocate_slots(1, 64).unwrap();
    // 4 attention blocks, 1 + 2 in the Mamba-like group.
    assert_eq!(free0 - m.pool().num_free(), 7);
    assert_eq!(need.take, 7);
    assert_eq!(a.groups[1].new_block_ids.len(), 3);
    let a = m.allocate_slots(1, 36).unwrap();
    assert!(a.groups[1].new_block_ids.is_empty());
    let t = m.block_tables(1).unwrap();
    assert_eq!((t[0].len(), t[1].len(), real(&t[1])), (7, 3, 3));
    // A verify step of three drafts, one accepted, the rejected ones' blocks given back: the
    // group keeps its 1 + 2 blocks (vLLM's do not change either).
    m.append_tokens(1, &[9]).unwrap();
    m.allocate_slots_with_drafts(1, 1, &[5, 6, 7]).unwrap();
    m.accept_drafts(1, 1).unwrap();
    let t = m.block_tables(1).unwrap();
    assert_eq!((t[1].len(), real(&t[1])), (3, 3));
    m.check_invariants().unwrap();
    m.free(1);
    assert_eq!(m.pool().num_free(), free0);
}

#[test]
fn past_the_block_one_more_is_taken_and_the_first_released() {
    // Context length 32, k = 2: slots past 32 take a fourth block; once the computed tokens
    // pass 33 the first block (before the last computed token's) is released.
    let m = KvCacheManager::new(cfg(100, 32, 2)).unwrap();
    m.add_sequence(1, toks(30), SequenceSpec::default())
        .unwrap();
    m.allocate_slots(1, 30).unwrap();
    assert_eq!(m.block_tables(1).unwrap()[1].len(), 3);
    for n in 31usize..=40 {
        m.append_tokens(1, &[9]).unwrap();
        m.allocate_slots(1, 1).unwrap();
        let t = m.block_tables(1).unwrap();
        // ceil(n / 32) + 2 entries; the allocation releases the blocks before the one of the
        // last token computed before it (token n - 2), as vLLM's does.
        assert_eq!(t[1].len(), n.div_ceil(32) + 2, "n = {n}");
        assert_eq!(t[1][0] == NULL_BLOCK, n - 2 >= 32, "n = {n}");
        m.check_invariants().unwrap();
    }
}

#[test]
fn spare_blocks_and_large_blocks_are_refused_where_they_do_not_fit() {
    let mut c = cfg(64, 3000, 1);
    c.groups[1] = GroupSpec::full(3000, 2).with_spare_blocks(1);
    match KvCacheManager::new(c) {
        Err(Error::InvalidConfig { field, .. }) => assert_eq!(field, "spare_blocks"),
        other => panic!("expected InvalidConfig, got {other:?}"),
    }
    // Blocks above MAX_BLOCK_SIZE need prefix caching off.
    let mut c = cfg(64, 5000, 1);
    c.enable_prefix_caching = true;
    match KvCacheManager::new(c) {
        Err(Error::InvalidConfig { field, reason, .. }) => {
            assert_eq!(field, "block_size");
            assert!(reason.contains(&MAX_BLOCK_SIZE.to_string()), "{reason}");
        }
        other => panic!("expected InvalidConfig, got {other:?}"),
    }
    let c = cfg(64, MAX_UNCACHED_BLOCK_SIZE * 2, 0);
    match KvCacheManager::new(c) {
        Err(Error::InvalidConfig { field, .. }) => assert_eq!(field, "block_size"),
        other => panic!("expected InvalidConfig, got {other:?}"),
    }
}
