//! Successor-aware block hashes (`CacheConfig::hash_lookahead_tokens`): block `j`'s key also
//! covers the `k` tokens after it, so a block is registered only once those tokens are known,
//! and a prefix hit of `p` tokens needs `p + k` known tokens. `k = 0` keeps today's keys.

use pagedkv_core::{CacheConfig, Error, GroupSpec, KvCacheManager, SequenceSpec};

const BS: u32 = 16;

fn config(num_blocks: u32, k: u32) -> CacheConfig {
    let mut cfg = CacheConfig::with_groups(num_blocks, vec![GroupSpec::full(BS, 8)], vec![0]);
    cfg.hash_lookahead_tokens = k;
    cfg
}

fn manager(num_blocks: u32, k: u32) -> KvCacheManager {
    KvCacheManager::new(config(num_blocks, k)).unwrap()
}

fn toks(n: usize, salt: u32) -> Vec<u32> {
    (0..n as u32).map(|i| i * 7 + salt * 1000 + 1).collect()
}

fn table(m: &KvCacheManager, seq: u64) -> Vec<u32> {
    m.block_tables(seq).unwrap().remove(0)
}

/// Whether each block of `seq`'s table is registered in the prefix cache.
fn hashed(m: &KvCacheManager, seq: u64) -> Vec<bool> {
    table(m, seq)
        .iter()
        .map(|&b| m.pool().is_hashed(b))
        .collect()
}

#[test]
fn default_keys_are_the_plain_chain_bit_for_bit() {
    let m = manager(32, 0);
    let t = toks(40, 0);
    m.add_sequence(0, t.clone(), SequenceSpec::default())
        .unwrap();
    m.allocate_slots(0, 40).unwrap();
    let h = m.hasher();
    let h0 = h.hash_block(None, &t[..16], &[]);
    let h1 = h.hash_block(Some(&h0), &t[16..32], &[]);
    let tb = table(&m, 0);
    assert_eq!(m.pool().block_hash(tb[0]), Some(h0));
    assert_eq!(m.pool().block_hash(tb[1]), Some(h1));
    assert_eq!(hashed(&m, 0), vec![true, true, false]);
    m.check_invariants().unwrap();
}

#[test]
fn a_key_covers_the_block_and_its_k_successor_tokens() {
    for k in [1usize, 3] {
        let m = manager(32, k as u32);
        let t = toks(40, 1);
        m.add_sequence(0, t.clone(), SequenceSpec::default())
            .unwrap();
        m.allocate_slots(0, 40).unwrap();
        let h = m.hasher();
        let h0 = h.hash_block(None, &t[..16 + k], &[]);
        let h1 = h.hash_block(Some(&h0), &t[16..32 + k], &[]);
        let tb = table(&m, 0);
        assert_eq!(m.pool().block_hash(tb[0]), Some(h0), "k={k}");
        assert_eq!(m.pool().block_hash(tb[1]), Some(h1), "k={k}");
        // Differs from the plain key.
        assert_ne!(Some(h.hash_block(None, &t[..16], &[])), Some(h0));
        m.check_invariants().unwrap();
    }
}

#[test]
fn registration_waits_until_the_successor_tokens_are_known() {
    let m = manager(32, 1);
    m.add_sequence(0, toks(32, 2), SequenceSpec::default())
        .unwrap();
    // The whole 32-token prompt computed: block 0's successor (token 16) is known, block 1's
    // (token 32) is not yet sampled.
    m.allocate_slots(0, 32).unwrap();
    assert_eq!(hashed(&m, 0), vec![true, false]);
    m.check_invariants().unwrap();
    // The sampled token arrives and is scheduled: block 1 is registered by that allocation.
    m.append_tokens(0, &[77]).unwrap();
    m.allocate_slots(0, 1).unwrap();
    assert_eq!(hashed(&m, 0), vec![true, true, false]);
    m.check_invariants().unwrap();

    // k = 2 and a chunked prefill: a 17-token chunk of a 40-token prompt fills block 0, whose
    // successors (tokens 16, 17) are in the prompt: registered at once; a chunk ending at 32
    // registers block 1 (tokens 32, 33 are prompt tokens).
    let m = manager(32, 2);
    m.add_sequence(0, toks(40, 3), SequenceSpec::default())
        .unwrap();
    m.allocate_slots(0, 17).unwrap();
    assert_eq!(hashed(&m, 0), vec![true, false]);
    m.allocate_slots(0, 15).unwrap();
    assert_eq!(hashed(&m, 0), vec![true, true]);
    m.check_invariants().unwrap();

    // k = 2, a 47-token prompt: block 2 (tokens 32..48) fills after one decode token, and
    // registers only once tokens 48 and 49 are known, two decode steps later.
    let m = manager(32, 2);
    m.add_sequence(0, toks(47, 4), SequenceSpec::default())
        .unwrap();
    m.allocate_slots(0, 47).unwrap();
    assert_eq!(hashed(&m, 0), vec![true, true, false]);
    m.append_tokens(0, &[5]).unwrap(); // token 47
    m.allocate_slots(0, 1).unwrap();
    assert_eq!(hashed(&m, 0), vec![true, true, false]);
    m.append_tokens(0, &[6]).unwrap(); // token 48
    m.allocate_slots(0, 1).unwrap();
    assert_eq!(hashed(&m, 0), vec![true, true, false, false]);
    m.append_tokens(0, &[7]).unwrap(); // token 49
    m.allocate_slots(0, 1).unwrap();
    assert_eq!(hashed(&m, 0), vec![true, true, true, false]);
    m.check_invariants().unwrap();
}

#[test]
fn a_hit_needs_the_successor_tokens_and_they_must_match() {
    let t = toks(48, 5);
    for k in [0u32, 1] {
        let m = manager(64, k);
        m.add_sequence(0, t.clone(), SequenceSpec::default())
            .unwrap();
        m.allocate_slots(0, 48).unwrap();
        // 48 computed: with k = 1 blocks 0 and 1 are cached (block 2's successor is unknown).
        let expect = if k == 0 {
            vec![true, true, true]
        } else {
            vec![true, true, false]
        };
        assert_eq!(hashed(&m, 0), expect);
        // A prompt of exactly A's first 32 tokens: block 1's successor (token 32) is not in it.
        m.add_sequence(1, t[..32].to_vec(), SequenceSpec::default())
            .unwrap();
        assert_eq!(m.lookup_prefix(1).unwrap(), 16, "k={k}");
        // Probing with the whole prompt allowed: k = 0 serves all 32, k = 1 still 16.
        m.set_hit_limit(1, Some(32)).unwrap();
        assert_eq!(m.lookup_prefix(1).unwrap(), if k == 0 { 32 } else { 16 });
        assert_eq!(
            m.lookup_prefix_group(1, 0, 32).unwrap(),
            if k == 0 { 32 } else { 16 }
        );
        // With the successor: 33 tokens hit 32 either way.
        m.add_sequence(2, t[..33].to_vec(), SequenceSpec::default())
            .unwrap();
        assert_eq!(m.lookup_prefix(2).unwrap(), 32, "k={k}");
        // A different successor token: k = 1 proves it and stops at block 0.
        let mut other = t[..33].to_vec();
        other[32] = 999_999;
        m.add_sequence(3, other, SequenceSpec::default()).unwrap();
        assert_eq!(
            m.lookup_prefix(3).unwrap(),
            if k == 0 { 32 } else { 16 },
            "k={k}"
        );
        // The allocation takes exactly the hit the lookup reported.
        let a = m.allocate_slots(3, 33).unwrap();
        assert_eq!(a.num_cached_tokens, if k == 0 { 32 } else { 16 });
        assert_eq!(table(&m, 3)[0], table(&m, 0)[0]);
        m.check_invariants().unwrap();
    }
}

#[test]
fn demand_of_a_group_counts_hits_on_blocks_an_earlier_member_registers() {
    // num_blocks_owed's simulation registers blocks with the same lookahead rule: member 1
    // hits what member 0 registers, so it is owed exactly what the real allocations take.
    let t = toks(33, 6);
    let m = manager(64, 1);
    m.add_sequence(0, t.clone(), SequenceSpec::default())
        .unwrap();
    m.add_sequence(1, t.clone(), SequenceSpec::default())
        .unwrap();
    let owed = m.num_blocks_owed(&[0, 1]).unwrap();
    let free = m.pool().num_free();
    m.allocate_slots(0, 33).unwrap();
    let a = m.allocate_slots(1, 33).unwrap();
    assert_eq!(a.num_cached_tokens, 32);
    assert_eq!(owed, free - m.pool().num_free());
    m.check_invariants().unwrap();
}

#[test]
fn invalid_lookahead_settings_are_typed_errors() {
    let field_of = |cfg: CacheConfig| match KvCacheManager::new(cfg) {
        Err(Error::InvalidConfig { field, .. }) => field,
        other => panic!("expected InvalidConfig, got {:?}", other.map(|_| ())),
    };
    assert_eq!(field_of(config(8, 65)), "hash_lookahead_tokens");
    let mut c = config(8, 1);
    c.enable_prefix_caching = false;
    assert_eq!(field_of(c), "hash_lookahead_tokens");
    let mut c = config(8, 1);
    c.enable_events = true;
    assert_eq!(field_of(c), "hash_lookahead_tokens");
    let mut c = config(8, 1);
    c.num_host_blocks = 4;
    assert_eq!(field_of(c), "hash_lookahead_tokens");
    assert!(KvCacheManager::new(config(8, 64)).is_ok());
}

mod model {
    //! Random workloads against a model of the prefix cache in a pool too large to evict:
    //! block `j` of a sequence is cached once its `(j + 1) * bs` tokens are computed and the
    //! `k` tokens after it are known, under the token prefix `[0, (j + 1) * bs + k)`; a first
    //! allocation hits the longest run of cached prefixes up to `min(len - 1, len - k)` tokens.

    use super::*;
    use proptest::prelude::*;
    use std::collections::{HashMap, HashSet};

    #[derive(Debug, Clone)]
    enum Op {
        /// A new sequence: `base` tokens of shared prompt `shared`, then `tail` own tokens.
        Add {
            shared: u8,
            base: usize,
            tail: usize,
        },
        /// Schedule up to `n` tokens of sequence `i % live` (appending one sampled token when
        /// it has computed all its tokens).
        Step {
            i: usize,
            n: usize,
            tok: u8,
        },
        Free {
            i: usize,
        },
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (0u8..2, 0usize..70, 1usize..20).prop_map(|(shared, base, tail)| Op::Add {
                shared,
                base,
                tail
            }),
            (any::<usize>(), 1usize..40, 0u8..3).prop_map(|(i, n, tok)| Op::Step { i, n, tok }),
            any::<usize>().prop_map(|i| Op::Free { i }),
        ]
    }

    fn run(k: usize, ops: &[Op]) {
        let bs = BS as usize;
        let m = manager(4096, k as u32);
        let mut cached: HashSet<Vec<u32>> = HashSet::new();
        let mut live: Vec<u64> = Vec::new();
        let mut toks_of: HashMap<u64, Vec<u32>> = HashMap::new();
        let mut computed: HashMap<u64, usize> = HashMap::new();
        let mut next = 0u64;
        for (n_op, op) in ops.iter().enumerate() {
            match *op {
                Op::Add { shared, base, tail } => {
                    let mut t: Vec<u32> = toks(base, u32::from(shared) + 10);
                    t.extend((0..tail as u32).map(|x| 50_000 + next as u32 * 100 + x));
                    m.add_sequence(next, t.clone(), SequenceSpec::default())
                        .unwrap();
                    // The model's hit: the longest run of cached prefixes, capped.
                    let cap = (t.len() - 1).min(t.len().saturating_sub(k)) / bs;
                    let want = (0..cap)
                        .take_while(|&j| cached.contains(&t[..(j + 1) * bs + k]))
                        .count()
                        * bs;
                    assert_eq!(m.lookup_prefix(next).unwrap(), want, "op {n_op}");
                    toks_of.insert(next, t);
                    computed.insert(next, 0);
                    live.push(next);
                    next += 1;
                }
                Op::Step { i, n, tok } => {
                    if live.is_empty() {
                        continue;
                    }
                    let id = live[i % live.len()];
                    let t = toks_of.get_mut(&id).unwrap();
                    let c = computed[&id];
                    if c == t.len() {
                        t.push(7 + u32::from(tok));
                        m.append_tokens(id, &t[t.len() - 1..]).unwrap();
                    }
                    let a = m.allocate_slots(id, n).unwrap();
                    let c = computed[&id].max(a.num_cached_tokens) + a.num_scheduled_tokens;
                    computed.insert(id, c);
                    let full = c.min(t.len().saturating_sub(k)) / bs;
                    for j in 0..full {
                        cached.insert(t[..(j + 1) * bs + k].to_vec());
                    }
                }
                Op::Free { i } => {
                    if live.is_empty() {
                        continue;
                    }
                    let id = live.remove(i % live.len());
                    assert!(m.free(id));
                }
            }
            m.check_invariants().unwrap();
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]
        #[test]
        fn hits_and_registration_follow_the_model(
            k in 0usize..3,
            ops in proptest::collection::vec(op(), 1..40),
        ) {
            run(k, &ops);
        }
    }
}

#[test]
fn cache_computed_registers_a_block_once_its_successor_is_appended() {
    let m = manager(32, 1);
    m.add_sequence(0, toks(32, 8), SequenceSpec::default())
        .unwrap();
    m.allocate_slots(0, 32).unwrap();
    m.cache_computed(0).unwrap();
    assert_eq!(hashed(&m, 0), vec![true, false]); // token 32 unknown
    let free = m.pool().num_free();
    m.append_tokens(0, &[3]).unwrap();
    m.cache_computed(0).unwrap();
    assert_eq!(hashed(&m, 0), vec![true, true]);
    assert_eq!(m.pool().num_free(), free); // nothing allocated
    assert_eq!(m.num_computed_tokens(0).unwrap(), 32);
    m.check_invariants().unwrap();
    // Without hash lookahead: a no-op (the allocation registered every computed block).
    let m = manager(32, 0);
    m.add_sequence(0, toks(32, 8), SequenceSpec::default())
        .unwrap();
    m.allocate_slots(0, 32).unwrap();
    m.cache_computed(0).unwrap();
    assert_eq!(hashed(&m, 0), vec![true, true]);
    assert!(matches!(
        m.cache_computed(9),
        Err(Error::UnknownSequence { .. })
    ));
}
