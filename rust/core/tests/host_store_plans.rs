//! How many host stores one step output plans (docs/design.md, "Host tier", Store): an
//! allocation that evicts more cached blocks than the host tier holds hands out at most one
//! store per host block, those the tier's eviction policy keeps; before, every evicted block
//! got a store and the later ones overwrote the earlier ones in the same output (60 stores
//! onto 8 host blocks). One group (in the one-group words of `common::OneGroup`) and two.

mod common;

use common::OneGroup;
use pagedkv_core::events::{KvEvent, Tier};
use pagedkv_core::host_tier::HostEviction;
use pagedkv_core::{CacheConfig, GroupSpec, KvCacheManager, SequenceSpec, StepRequest};
use std::collections::HashSet;

const BS: u32 = 4;
const HOST: u32 = 8;

fn toks(n: usize, salt: u32) -> Vec<u32> {
    (0..n as u32).map(|i| i * 7 + salt * 100_000 + 1).collect()
}

/// A step scheduling `n` tokens of `seq`.
fn schedule(seq: u64, n: u32) -> StepRequest {
    StepRequest {
        seq_ids: vec![seq],
        num_new_tokens: vec![n],
        ..StepRequest::default()
    }
}

/// The host stores announced in `events` (host `BlockStored` hashes), one per planned store.
fn host_stored(events: impl IntoIterator<Item = KvEvent>) -> usize {
    events
        .into_iter()
        .map(|e| match e {
            KvEvent::BlockStored {
                block_hashes,
                tier: Tier::Host,
                ..
            } => block_hashes.len(),
            _ => 0,
        })
        .sum()
}

/// Rows of a flat row-major array.
fn rows(v: &[i32], width: usize) -> Vec<Vec<i32>> {
    v.chunks(width).map(<[i32]>::to_vec).collect()
}

/// The manager with one full-attention group, asked in one-group words.
fn one_group(cfg: CacheConfig) -> impl OneGroup {
    <KvCacheManager as OneGroup>::build(cfg).unwrap()
}

#[test]
fn one_step_output_stores_at_most_the_host_blocks_one_group() {
    for eviction in HostEviction::ALL {
        let mut cfg = CacheConfig::new(64, BS);
        cfg.num_host_blocks = HOST;
        cfg.host_admission_min_seen = 1;
        cfg.host_eviction = eviction;
        cfg.enable_events = true;
        let m = one_group(cfg);
        // Seq 1 computes 60 full blocks (all cached), is freed.
        let a = toks(60 * BS as usize, 1);
        m.add_sequence(1, &a, SequenceSpec::default()).unwrap();
        let out = m.step(&schedule(1, 60 * BS));
        assert!(out.error.is_none());
        let a_table = m.block_table(1).unwrap();
        m.free(1);
        let _ = m.take_events();
        // Seq 2's prefill takes all 63 usable blocks: 3 uncached, then the 60 cached ones,
        // evicted A's tail first, each offered to the 8-block host tier.
        m.add_sequence(2, &toks(63 * BS as usize, 2), SequenceSpec::default())
            .unwrap();
        let out = m.step(&schedule(2, 63 * BS));
        assert!(out.error.is_none());
        m.check_invariants().unwrap();
        assert_eq!(host_stored(m.take_events()), 60, "{eviction:?}");
        let stores = rows(&out.host_stores, 3);
        // Before the fix: 60 rows onto 8 host blocks.
        assert_eq!(stores.len(), HOST as usize, "{eviction:?}");
        assert!(stores.iter().all(|r| r[0] == 0), "one group");
        let hosts: HashSet<i32> = stores.iter().map(|r| r[2]).collect();
        assert_eq!(hosts.len(), HOST as usize, "a host block stored twice");
        // The policy keeps the last 8 offered: A's first 8 blocks, stored tail first.
        let want: Vec<i32> = a_table[..8].iter().rev().map(|&b| b as i32).collect();
        assert_eq!(stores.iter().map(|r| r[1]).collect::<Vec<_>>(), want);
        assert_eq!(m.stats().host_stores_blocks, HOST as u64);
        // Those 8 come back as host hits of A, loaded from the host blocks they were stored to.
        m.free(2);
        m.add_sequence(3, &a, SequenceSpec::default()).unwrap();
        assert_eq!(m.lookup_prefix(3).unwrap(), 8 * BS as usize);
        let out = m.step(&schedule(3, 60 * BS));
        assert!(out.error.is_none());
        let loads = rows(&out.host_loads, 3);
        assert!(loads.iter().all(|r| r[0] == 0), "one group");
        let loaded: Vec<i32> = loads.iter().map(|r| r[1]).collect();
        let stored_to: Vec<i32> = stores.iter().rev().map(|r| r[2]).collect();
        assert_eq!(loaded, stored_to);
        m.check_invariants().unwrap();
    }
}

#[test]
fn one_step_output_stores_at_most_the_host_blocks_groups() {
    for eviction in HostEviction::ALL {
        // Two full-attention groups (every block stays cached), block size 4.
        let mut c = CacheConfig::with_groups(
            127,
            vec![GroupSpec::full(BS, 8), GroupSpec::full(BS, 8)],
            vec![0, 1],
        );
        c.num_host_blocks = HOST;
        c.host_admission_min_seen = 1;
        c.host_eviction = eviction;
        c.enable_events = true;
        let m = KvCacheManager::new(c).unwrap();
        // Seq 1 computes 30 full blocks per group (60 cached blocks), is freed.
        m.add_sequence(1, toks(30 * BS as usize, 1), SequenceSpec::default())
            .unwrap();
        assert!(m.step(&schedule(1, 30 * BS)).error.is_none());
        m.free(1);
        let _ = m.take_events();
        // Seq 2 takes 63 blocks per group: all 126 usable, evicting the 60 cached ones.
        m.add_sequence(2, toks(63 * BS as usize, 2), SequenceSpec::default())
            .unwrap();
        let out = m.step(&schedule(2, 63 * BS));
        assert!(out.error.is_none());
        m.check_invariants().unwrap();
        let planned = host_stored(m.take_events().into_iter().map(|e| e.event));
        assert_eq!(planned, 60, "{eviction:?}");
        let stores = rows(&out.host_stores, 3);
        // Before the fix: 60 rows onto 8 host blocks.
        assert_eq!(stores.len(), HOST as usize, "{eviction:?}");
        let hosts: HashSet<i32> = stores.iter().map(|r| r[2]).collect();
        assert_eq!(hosts.len(), HOST as usize, "a host block stored twice");
        assert_eq!(m.stats().host_stores_blocks, HOST as u64);
        m.free(2);
        m.check_invariants().unwrap();
    }
}
