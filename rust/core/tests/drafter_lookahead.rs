//! Model-based drafters (EAGLE / MTP) on `KvCacheManager`: lookahead slots past the scheduled
//! tokens whose tokens do not exist yet (`allocate_slots_with_lookahead`, held as spare blocks
//! the next allocations fill first), per-group prefix lookups (`lookup_prefix_group`) and the
//! hit limit (`set_hit_limit`) a scheduler uses to drop the last block of a hit.

use pagedkv_core::{CacheConfig, Error, GroupSpec, KvCacheManager, SequenceSpec};

const BS: u32 = 16;

fn full(num_blocks: u32) -> KvCacheManager {
    KvCacheManager::new(CacheConfig::with_groups(
        num_blocks,
        vec![GroupSpec::full(BS, 8)],
        vec![0],
    ))
    .unwrap()
}

/// One full-attention group and one sliding-window group of window `w`.
fn hybrid(num_blocks: u32, w: u32) -> KvCacheManager {
    KvCacheManager::new(CacheConfig::with_groups(
        num_blocks,
        vec![GroupSpec::full(BS, 8), GroupSpec::sliding_window(BS, 8, w)],
        vec![0, 1],
    ))
    .unwrap()
}

fn toks(n: usize, salt: u32) -> Vec<u32> {
    (0..n as u32).map(|i| i * 7 + salt * 1000 + 1).collect()
}

fn held(m: &KvCacheManager, seq: u64) -> Vec<usize> {
    m.block_tables(seq).unwrap().iter().map(Vec::len).collect()
}

#[test]
fn lookahead_slots_take_blocks_mid_prompt_and_the_next_chunk_fills_them_first() {
    let m = full(64);
    m.add_sequence(0, toks(40, 0), SequenceSpec::default())
        .unwrap();
    let free = m.pool().num_free();
    // A 30-token chunk of a 40-token prompt plus 3 lookahead slots: 33 positions, 3 blocks.
    let d = m.num_blocks_needed_with_lookahead(0, 30, 0, 3).unwrap();
    assert_eq!(d.take, 3);
    let a = m.allocate_slots_with_lookahead(0, 30, &[], 3).unwrap();
    assert_eq!(a.num_scheduled_tokens, 30);
    assert_eq!(a.groups[0].new_block_ids.len(), 3);
    assert_eq!(m.pool().num_free(), free - 3);
    assert_eq!(m.num_computed_tokens(0).unwrap(), 30);
    m.check_invariants().unwrap();
    // The rest of the prompt (40 tokens) plus 3 lookahead slots: 43 positions, still 3 blocks.
    let a = m.allocate_slots_with_lookahead(0, 10, &[], 3).unwrap();
    assert!(a.groups[0].new_block_ids.is_empty());
    assert_eq!(held(&m, 0), vec![3]);
    // A verify step: 1 token, 2 drafts, 3 lookahead slots: positions up to 46, 3 blocks; then
    // 49 positions take a 4th block.
    m.append_tokens(0, &[9]).unwrap();
    let a = m.allocate_slots_with_lookahead(0, 1, &[5, 6], 3).unwrap();
    assert!(a.groups[0].new_block_ids.is_empty());
    m.accept_drafts_keeping_blocks(0, 2).unwrap();
    m.append_tokens(0, &[7]).unwrap();
    let a = m.allocate_slots_with_lookahead(0, 1, &[8, 8], 3).unwrap();
    assert_eq!(a.groups[0].new_block_ids.len(), 1);
    assert_eq!(held(&m, 0), vec![4]);
    m.check_invariants().unwrap();
    // Lookahead blocks are private and never hashed; free releases them all.
    assert!(m.free(0));
    assert_eq!(m.pool().num_free(), free);
    m.check_invariants().unwrap();
}

#[test]
fn lookahead_blocks_are_never_cached() {
    let m = full(64);
    m.add_sequence(0, toks(20, 1), SequenceSpec::default())
        .unwrap();
    // 20 tokens + 12 lookahead: the second block holds 4 tokens and 12 lookahead slots.
    m.allocate_slots_with_lookahead(0, 20, &[], 12).unwrap();
    m.free(0);
    // A longer prompt with the same first 20 tokens hits only the full first block.
    let mut longer = toks(20, 1);
    longer.extend(toks(20, 2));
    m.add_sequence(1, longer, SequenceSpec::default()).unwrap();
    assert_eq!(m.lookup_prefix(1).unwrap(), 16);
}

#[test]
fn out_of_blocks_counts_the_lookahead_blocks_and_changes_nothing() {
    let m = full(4); // 3 usable blocks
    m.add_sequence(0, toks(40, 0), SequenceSpec::default())
        .unwrap();
    let err = m.allocate_slots_with_lookahead(0, 40, &[], 9).unwrap_err();
    assert!(
        matches!(
            err,
            Error::OutOfBlocks {
                requested: 4,
                available: 3
            }
        ),
        "{err:?}"
    );
    assert_eq!(m.num_computed_tokens(0).unwrap(), 0);
    assert_eq!(held(&m, 0), vec![0]);
    m.check_invariants().unwrap();
}

#[test]
fn the_hit_limit_caps_lookup_and_allocation() {
    let m = full(64);
    m.add_sequence(0, toks(64, 3), SequenceSpec::default())
        .unwrap();
    m.allocate_slots(0, 64).unwrap();
    m.add_sequence(1, toks(64, 3), SequenceSpec::default())
        .unwrap();
    // Default cap num_tokens - 1: 48 tokens; the full prompt is cached (4 blocks).
    assert_eq!(m.lookup_prefix(1).unwrap(), 48);
    assert_eq!(m.lookup_prefix_group(1, 0, 64).unwrap(), 64);
    assert_eq!(m.lookup_prefix_group(1, 0, 1000).unwrap(), 64);
    assert_eq!(m.lookup_prefix_group(1, 0, 40).unwrap(), 32);
    // EAGLE's drop: one block less.
    m.set_hit_limit(1, Some(32)).unwrap();
    assert_eq!(m.lookup_prefix(1).unwrap(), 32);
    let a = m.allocate_slots(1, 64).unwrap();
    assert_eq!(a.num_cached_tokens, 32);
    assert_eq!(a.num_scheduled_tokens, 32);
    m.check_invariants().unwrap();
    // None restores the default.
    m.add_sequence(2, toks(64, 3), SequenceSpec::default())
        .unwrap();
    m.set_hit_limit(2, Some(0)).unwrap();
    assert_eq!(m.lookup_prefix(2).unwrap(), 0);
    m.set_hit_limit(2, None).unwrap();
    assert_eq!(m.lookup_prefix(2).unwrap(), 48);
    assert!(matches!(
        m.set_hit_limit(9, None),
        Err(Error::UnknownSequence { .. })
    ));
    assert!(matches!(
        m.lookup_prefix_group(2, 1, 10),
        Err(Error::InvalidArgument { .. })
    ));
}

#[test]
fn per_group_lookups_see_each_group_alone() {
    let m = hybrid(128, 32);
    m.add_sequence(0, toks(80, 4), SequenceSpec::default())
        .unwrap();
    m.allocate_slots(0, 80).unwrap();
    m.add_sequence(1, toks(80, 4), SequenceSpec::default())
        .unwrap();
    assert_eq!(m.lookup_prefix_group(1, 0, 80).unwrap(), 80);
    assert_eq!(m.lookup_prefix_group(1, 1, 80).unwrap(), 80);
    assert_eq!(m.lookup_prefix(1).unwrap(), 64);
    // Below the default cap each group alone serves the probe limit's boundary.
    assert_eq!(m.lookup_prefix_group(1, 1, 47).unwrap(), 32);
    assert_eq!(m.block_tables(0).unwrap()[1].len(), 5);
    m.set_hit_limit(1, Some(48)).unwrap();
    let a = m.allocate_slots(1, 80).unwrap();
    assert_eq!(a.num_cached_tokens, 48);
    m.check_invariants().unwrap();
}
