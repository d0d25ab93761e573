//! Fuzz target `host_tier_ops`: arbitrary bytes -> a cache configuration with a host tier
//! (0-7 host blocks, LRU or ARC eviction, admission after 0-3 uses: 0 must be refused, events
//! on or off) and up
//! to 96 operations on [`KvCacheManager`] with one full-attention group: add (shared-prefix prompts, cache salts),
//! allocate_slots (its host copies taken at once with take_host_transfers), step (one or
//! several sequences, with appends), empty steps, free, preempt, swap_out, swap_in, reset,
//! lookup.
//!
//! A model of the KV memory runs every plan the way an executor must (docs/design.md, "Host
//! tier"): host stores, then the swaps since the previous hand-out in call order, host loads,
//! copy-on-write copies, then the forward pass writing the scheduled tokens; each device,
//! host and CPU block holds the token prefix (and salt) whose KV it contains. After every
//! operation:
//! - `check_invariants()` holds (docs/design.md, "Invariants" 1-4 and 9: both tiers);
//! - no hand-out (step output or `take_host_transfers`) stores into one host block twice;
//! - every block of a sequence the last plans scheduled holds exactly that sequence's
//!   prefix (a prefix hit or a host load that serves other or stale KV fails it);
//! - an allocation takes exactly the blocks `num_blocks_needed` predicted, fails with
//!   `OutOfBlocks` exactly when that exceeds the free blocks, and a failed `allocate_slots`
//!   leaves the tables, free queue, ref counts, hashes and stats unchanged;
//! - `lookup_prefix` predicts a first allocation's cached tokens;
//! - the events keep set semantics per tier.
//!
//! At the end every sequence is freed and two empty steps release every load: the pool must
//! be whole and a reset must succeed and leave the host tier empty.

#![no_main]

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use pagedkv_core::events::{KvEvent, Tier};
use pagedkv_core::host_tier::HostEviction;
use pagedkv_core::{
    BlockHash, BlockId, CacheConfig, CacheStats, Error, ExtraKey, KvCacheManager, SeqId, SeqStatus,
    SequenceSpec, StepOutput, StepRequest,
};
use std::collections::{HashMap, HashSet};

const ID_SPACE: u8 = 6;
const MAX_OPS: usize = 96;

#[derive(Arbitrary, Debug)]
struct Cfg {
    num_blocks: u8,
    block_size: u8,
    host_blocks: u8,
    min_seen: u8,
    cpu_blocks: u8,
    events: bool,
}

#[derive(Arbitrary, Debug)]
enum Op {
    Add {
        seq: u8,
        family: u8,
        len: u8,
        salt: bool,
    },
    Allocate {
        seq: u8,
        num_new: u8,
    },
    Step {
        entries: Vec<(u8, u8, Vec<u8>)>,
    },
    EmptyStep,
    Free {
        seq: u8,
    },
    Preempt {
        seq: u8,
    },
    SwapOut {
        seq: u8,
    },
    SwapIn {
        seq: u8,
    },
    Reset,
    Lookup {
        seq: u8,
    },
}

#[derive(Arbitrary, Debug)]
struct Input {
    cfg: Cfg,
    ops: Vec<Op>,
}

/// What a block's KV is: the cache salt and the token prefix it was computed for.
type Content = (bool, Vec<u32>);

#[derive(Debug, Clone, PartialEq)]
struct Snap {
    refs: Vec<u32>,
    hashes: Vec<Option<BlockHash>>,
    free_queue: Vec<BlockId>,
    tables: Vec<Option<(Vec<BlockId>, usize, SeqStatus)>>,
    stats: CacheStats,
}

/// The sequence's block table (its one group's).
fn table(m: &KvCacheManager, id: SeqId) -> Result<Vec<BlockId>, Error> {
    Ok(m.block_tables(id)?.swap_remove(0))
}

/// `(group, a, b)` rows of group 0 as `(a, b)` pairs.
fn pairs(rows: &[(u32, BlockId, BlockId)]) -> Vec<(BlockId, BlockId)> {
    rows.iter()
        .map(|&(g, a, b)| {
            assert_eq!(g, 0, "one group");
            (a, b)
        })
        .collect()
}

fn snap(m: &KvCacheManager) -> Snap {
    let p = m.pool();
    let n = p.num_blocks();
    Snap {
        refs: (0..n).map(|b| p.ref_count(b)).collect(),
        hashes: (0..n).map(|b| p.block_hash(b)).collect(),
        free_queue: p.free_queue(),
        tables: (0..u64::from(ID_SPACE))
            .map(|id| {
                Some((
                    table(m, id).ok()?,
                    m.num_computed_tokens(id).ok()?,
                    m.status(id).ok()?,
                ))
            })
            .collect(),
        stats: m.stats(),
    }
}

/// The simulated executor and KV memory.
#[derive(Default)]
struct Kv {
    device: HashMap<BlockId, Content>,
    host: HashMap<BlockId, Content>,
    cpu: HashMap<BlockId, Content>,
    /// Swaps since the last hand-out, in call order: (out?, from, to).
    swaps: Vec<(bool, BlockId, BlockId)>,
    salt: HashMap<SeqId, bool>,
    resolvable: [HashSet<BlockHash>; 2],
}

impl Kv {
    fn run(
        &mut self,
        m: &KvCacheManager,
        stores: &[(BlockId, BlockId)],
        loads: &[(BlockId, BlockId)],
        copies: &[(BlockId, BlockId)],
        scheduled: &[(SeqId, usize, usize)],
    ) {
        let none = || (false, Vec::new());
        // One hand-out copies into a host block at most once (no store overwritten by a
        // later one of the same output).
        let mut dests = HashSet::new();
        for &(d, h) in stores {
            assert!(
                dests.insert(h),
                "host block {h} stored twice in one hand-out"
            );
            self.host
                .insert(h, self.device.get(&d).cloned().unwrap_or_else(none));
        }
        for (out, a, b) in std::mem::take(&mut self.swaps) {
            if out {
                self.cpu
                    .insert(b, self.device.get(&a).cloned().unwrap_or_else(none));
            } else {
                self.device
                    .insert(b, self.cpu.get(&a).cloned().unwrap_or_else(none));
            }
        }
        for &(h, d) in loads {
            self.device
                .insert(d, self.host.get(&h).cloned().unwrap_or_else(none));
        }
        for &(s, d) in copies {
            self.device
                .insert(d, self.device.get(&s).cloned().unwrap_or_else(none));
        }
        let bs = m.config().groups[0].block_size as usize;
        for &(seq, ctx, end) in scheduled {
            let table = table(m, seq).unwrap();
            let tokens = m.tokens(seq).unwrap();
            let salt = self.salt[&seq];
            for j in ctx / bs..(end - 1) / bs + 1 {
                self.device
                    .insert(table[j], (salt, tokens[..end.min((j + 1) * bs)].to_vec()));
            }
            for j in 0..(end - 1) / bs + 1 {
                let want = (salt, tokens[..end.min((j + 1) * bs)].to_vec());
                assert_eq!(
                    self.device.get(&table[j]),
                    Some(&want),
                    "seq {seq} block {j} (device {}) holds other KV",
                    table[j]
                );
            }
        }
    }

    fn run_step(&mut self, m: &KvCacheManager, out: &StepOutput, seqs: &[SeqId]) {
        let pairs = |v: &[i32]| -> Vec<(BlockId, BlockId)> {
            v.chunks(3)
                .map(|r| {
                    assert_eq!(r[0], 0, "one group");
                    (r[1] as BlockId, r[2] as BlockId)
                })
                .collect()
        };
        let scheduled: Vec<_> = (0..out.num_scheduled)
            .map(|k| {
                (
                    seqs[k],
                    out.context_lens[k] as usize,
                    out.seq_lens[k] as usize,
                )
            })
            .collect();
        self.run(
            m,
            &pairs(&out.host_stores),
            &pairs(&out.host_loads),
            &pairs(&out.copies),
            &scheduled,
        );
    }

    fn events(&mut self, m: &KvCacheManager) {
        for e in m.take_events() {
            assert!(matches!(e.group, None | Some(0)), "one group: {e:?}");
            match e.event {
                KvEvent::AllBlocksCleared => self.resolvable.iter_mut().for_each(|s| s.clear()),
                KvEvent::BlockStored {
                    block_hashes, tier, ..
                } => {
                    let set = &mut self.resolvable[usize::from(tier == Tier::Host)];
                    for h in block_hashes {
                        assert!(set.insert(h), "BlockStored({tier:?}) of a resolvable hash");
                    }
                }
                KvEvent::BlockRemoved { block_hashes, tier } => {
                    let set = &mut self.resolvable[usize::from(tier == Tier::Host)];
                    for h in block_hashes {
                        assert!(
                            set.remove(&h),
                            "BlockRemoved({tier:?}) of an unresolvable hash"
                        );
                    }
                }
            }
        }
    }
}

fn id(x: u8) -> SeqId {
    SeqId::from(x % ID_SPACE)
}

fn prompt(family: u8, len: u8) -> Vec<u32> {
    let base = 1000 * (u32::from(family % 3) + 1);
    (0..u32::from(len % 24) + 1).map(|i| base + i).collect()
}

fuzz_target!(|input: Input| {
    let c = &input.cfg;
    let mut cfg = CacheConfig::new(
        u32::from(c.num_blocks % 14) + 2,
        u32::from(c.block_size % 4) + 1,
    );
    cfg.num_host_blocks = u32::from(c.host_blocks % 8);
    // Bit 3 of the same byte picks the policy (the committed seeds keep their layout).
    cfg.host_eviction = if c.host_blocks & 8 != 0 {
        HostEviction::Arc
    } else {
        HostEviction::Lru
    };
    cfg.host_admission_min_seen = u32::from(c.min_seen % 4);
    cfg.num_cpu_blocks = u32::from(c.cpu_blocks % 6);
    cfg.enable_events = c.events;
    let m = match KvCacheManager::new(cfg.clone()) {
        Ok(m) => m,
        Err(e) => {
            assert_eq!(
                cfg.host_admission_min_seen, 0,
                "refused a valid config: {e}"
            );
            assert!(matches!(
                e,
                Error::InvalidConfig {
                    field: "host_admission_min_seen",
                    ..
                }
            ));
            return;
        }
    };
    assert_ne!(
        cfg.host_admission_min_seen, 0,
        "accepted host_admission_min_seen = 0"
    );
    let mut kv = Kv::default();
    for op in input.ops.into_iter().take(MAX_OPS) {
        match op {
            Op::Add {
                seq,
                family,
                len,
                salt,
            } => {
                let mut spec = SequenceSpec::default();
                if salt {
                    spec.extra_keys.push(ExtraKey::CacheSalt("t".into()));
                }
                if m.add_sequence(id(seq), prompt(family, len), spec).is_ok() {
                    kv.salt.insert(id(seq), salt);
                }
            }
            Op::Allocate { seq, num_new } => {
                let s = id(seq);
                let n = usize::from(num_new % 12);
                let Ok(demand) = m.num_blocks_needed(s, n) else {
                    continue;
                };
                assert_eq!(demand.release, 0, "a full-attention group releases nothing");
                let needed = demand.take;
                let first =
                    m.num_computed_tokens(s).unwrap() == 0 && table(&m, s).unwrap().is_empty();
                let lookup = m.lookup_prefix(s).unwrap();
                let before = snap(&m);
                match m.allocate_slots(s, n) {
                    Ok(a) => {
                        assert!(needed <= before.stats.free);
                        assert_eq!(
                            before.stats.free - m.stats().free,
                            needed,
                            "taken != predicted"
                        );
                        if first {
                            assert_eq!(a.num_cached_tokens, lookup);
                        }
                        // A caller outside step runs this call's plans before its forward.
                        let t = m.take_host_transfers();
                        let ctx = a.num_context_tokens;
                        kv.run(
                            &m,
                            &pairs(&t.stores),
                            &pairs(&t.loads),
                            &a.groups[0].copies,
                            &[(s, ctx, ctx + a.num_scheduled_tokens)],
                        );
                    }
                    Err(Error::OutOfBlocks {
                        requested,
                        available,
                    }) => {
                        assert_eq!((requested, available), (needed, before.stats.free));
                        assert!(needed > available);
                        assert_eq!(snap(&m), before, "failed allocation changed the state");
                    }
                    Err(e) => panic!("allocate_slots({s}, {n}) failed unexpectedly: {e}"),
                }
            }
            Op::Step { entries } => {
                let mut seen = HashSet::new();
                let mut req = StepRequest::default();
                req.append_indptr.push(0);
                for (seq, n, app) in entries.into_iter().take(4) {
                    let s = id(seq);
                    if !seen.insert(s)
                        || !matches!(m.status(s), Ok(SeqStatus::Running | SeqStatus::Preempted))
                    {
                        continue;
                    }
                    req.seq_ids.push(s);
                    req.num_new_tokens.push(u32::from(n % 12) + 1);
                    req.append_tokens
                        .extend(app.iter().take(3).map(|&t| u32::from(t % 3)));
                    req.append_indptr.push(req.append_tokens.len() as u32);
                }
                let out = m.step(&req);
                if let Some(e) = &out.error {
                    assert!(
                        matches!(e, Error::OutOfBlocks { .. } | Error::InvalidArgument { .. }),
                        "{e}"
                    );
                }
                kv.run_step(&m, &out, &req.seq_ids);
            }
            Op::EmptyStep => {
                let out = m.step(&StepRequest::default());
                assert!(out.error.is_none());
                kv.run_step(&m, &out, &[]);
            }
            Op::Free { seq } => {
                if m.free(id(seq)) {
                    kv.salt.remove(&id(seq));
                }
            }
            Op::Preempt { seq } => {
                let _ = m.preempt_recompute(&[id(seq)]);
            }
            Op::SwapOut { seq } => {
                if let Ok(plan) = m.swap_out(&[id(seq)]) {
                    kv.swaps.extend(plan.into_iter().map(|(g, c)| (true, g, c)));
                }
            }
            Op::SwapIn { seq } => {
                let before = snap(&m);
                match m.swap_in(&[id(seq)]) {
                    Ok(plan) => kv
                        .swaps
                        .extend(plan.into_iter().map(|(c, g)| (false, c, g))),
                    Err(Error::OutOfBlocks { .. }) => assert_eq!(snap(&m), before),
                    Err(_) => {}
                }
            }
            Op::Reset => {
                let before = snap(&m);
                match m.reset_prefix_cache() {
                    Ok(()) => {}
                    Err(Error::CacheInUse { .. }) => assert_eq!(snap(&m), before),
                    Err(e) => panic!("reset failed unexpectedly: {e}"),
                }
            }
            Op::Lookup { seq } => {
                let _ = m.lookup_prefix(id(seq));
            }
        }
        m.check_invariants()
            .unwrap_or_else(|e| panic!("invariant: {e}"));
        kv.events(&m);
        let st = m.stats();
        assert!(st.host_used <= st.num_host_blocks as usize);
        assert!(st.host_hits_tokens <= st.prefix_hits_tokens);
    }
    for s in 0..u64::from(ID_SPACE) {
        m.free(s);
    }
    let _ = m.step(&StepRequest::default());
    let _ = m.step(&StepRequest::default());
    m.check_invariants().unwrap();
    assert_eq!(m.pool().num_free(), m.pool().num_usable());
    m.reset_prefix_cache().unwrap();
    assert_eq!(m.stats().host_used, 0);
});
