//! Fuzz target `hybrid_host_ops`: arbitrary bytes -> a full-attention group and a sliding-window
//! or chunked-local group over a small pool with a small host tier (LRU or ARC, any admission
//! count, dense or sparse retention), and a sequence of steps, frees, preemptions, swaps and
//! resets on [`KvCacheManager`].
//!
//! A model of the executor keeps, per group cache and block, the token prefix whose KV the block
//! holds, and runs each step output in the executor's order (host stores, the swaps since the
//! previous step, host loads, copy-on-write copies, the forward pass). After every operation:
//! - `check_invariants()` holds (both tiers);
//! - no step output stores into one host block twice;
//! - every block a scheduled query reads in each group holds that sequence's own prefix (a
//!   host load of another prompt's or stale KV fails it);
//! - a single-sequence step changed the free count by exactly `take - release` of
//!   `num_blocks_needed`, and failed with `OutOfBlocks` exactly when `take > free + release`;
//! - events keep set semantics per (tier, group).
//!
//! At the end every sequence is freed, two empty steps release every load, and the pool is
//! whole.

#![no_main]

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use pagedkv_core::events::{KvEvent, Tier};
use pagedkv_core::host_tier::HostEviction;
use pagedkv_core::{
    BlockHash, CacheConfig, Error, GroupSpec, KvCacheManager, SeqId, SequenceSpec, StepRequest,
    NULL_BLOCK,
};
use std::collections::{HashMap, HashSet};

const ID_SPACE: u8 = 6;
const MAX_OPS: usize = 96;

#[derive(Arbitrary, Debug)]
struct Cfg {
    num_blocks: u8,
    block_size: u8,
    chunked: bool,
    span: u8,
    host_blocks: u8,
    min_seen: u8,
    arc: bool,
    sparse: bool,
}

#[derive(Arbitrary, Debug)]
enum Op {
    Add { seq: u8, family: u8, len: u8 },
    Step { seqs: Vec<u8>, n: u8, append: bool },
    Empty,
    Free { seq: u8 },
    Preempt { seq: u8 },
    SwapOut { seq: u8 },
    SwapIn { seq: u8 },
    Reset,
}

#[derive(Arbitrary, Debug)]
struct Input {
    cfg: Cfg,
    ops: Vec<Op>,
}

/// What a block of one group's cache holds: the token prefix whose last block it is.
type Content = Vec<u32>;

struct Exec {
    /// `(group, block)` -> content, per tier.
    device: HashMap<(u32, u32), Content>,
    host: HashMap<(u32, u32), Content>,
    cpu: HashMap<(u32, u32), Content>,
    /// Swap plans since the last step: `(out?, src, dst)`.
    swaps: Vec<(bool, u32, u32)>,
    tokens: HashMap<SeqId, Vec<u32>>,
    /// Resolvable hashes per (tier, group), from the events.
    sets: HashMap<(Tier, u32), HashSet<BlockHash>>,
}

/// The content of block `b` of group `g` in `map` (empty: never written).
fn content(map: &HashMap<(u32, u32), Content>, g: i32, b: i32) -> Content {
    map.get(&(g as u32, b as u32)).cloned().unwrap_or_default()
}

impl Exec {
    /// Runs a step output's plans in the executor's order, then checks what each query reads.
    fn run(&mut self, m: &KvCacheManager, out: &pagedkv_core::StepOutput, seqs: &[SeqId]) {
        let ng = m.num_groups() as u32;
        // One output copies into a host block at most once (no store overwritten by a later
        // one of the same output).
        let mut dests = HashSet::new();
        for r in out.host_stores.chunks(3) {
            assert!(
                dests.insert(r[2]),
                "host block {} stored twice in one output",
                r[2]
            );
            let c = self
                .device
                .get(&(r[0] as u32, r[1] as u32))
                .cloned()
                .unwrap_or_default();
            self.host.insert((r[0] as u32, r[2] as u32), c);
        }
        for (is_out, a, b) in std::mem::take(&mut self.swaps) {
            for g in 0..ng {
                let (ga, gb) = (g as i32, (g, b));
                if is_out {
                    self.cpu.insert(gb, content(&self.device, ga, a as i32));
                } else {
                    self.device.insert(gb, content(&self.cpu, ga, a as i32));
                }
            }
        }
        for r in out.host_loads.chunks(3) {
            let c = self
                .host
                .get(&(r[0] as u32, r[1] as u32))
                .cloned()
                .unwrap_or_default();
            self.device.insert((r[0] as u32, r[2] as u32), c);
        }
        for r in out.copies.chunks(3) {
            let c = self
                .device
                .get(&(r[0] as u32, r[1] as u32))
                .cloned()
                .unwrap_or_default();
            self.device.insert((r[0] as u32, r[2] as u32), c);
        }
        for (k, &seq) in seqs.iter().enumerate().take(out.num_scheduled) {
            let (ctx, end) = (out.context_lens[k] as usize, out.seq_lens[k] as usize);
            let toks = &self.tokens[&seq];
            let tables = m.block_tables(seq).unwrap();
            for (g, table) in tables.iter().enumerate() {
                let spec = m.config().groups[g];
                let bs = spec.block_size as usize;
                for j in ctx / bs..=(end - 1) / bs {
                    let want = toks[..end.min((j + 1) * bs)].to_vec();
                    self.device.insert((g as u32, table[j]), want);
                }
                for j in spec.first_read(ctx) / bs..=(end - 1) / bs {
                    let want = &toks[..end.min((j + 1) * bs)];
                    assert_ne!(
                        table[j], NULL_BLOCK,
                        "seq {seq} group {g}: block {j} read but null"
                    );
                    assert_eq!(
                        self.device.get(&(g as u32, table[j])).map(Vec::as_slice),
                        Some(want),
                        "seq {seq} group {g}: block {j} (id {}) holds other KV",
                        table[j]
                    );
                }
            }
        }
    }

    fn replay(&mut self, m: &KvCacheManager) {
        for e in m.take_events() {
            match (e.group, e.event) {
                (None, KvEvent::AllBlocksCleared) => self.sets.clear(),
                (
                    Some(g),
                    KvEvent::BlockStored {
                        block_hashes, tier, ..
                    },
                ) => {
                    let s = self.sets.entry((tier, g)).or_default();
                    for h in block_hashes {
                        assert!(s.insert(h), "{tier:?} group {g}: hash stored twice");
                    }
                }
                (Some(g), KvEvent::BlockRemoved { block_hashes, tier }) => {
                    let s = self.sets.entry((tier, g)).or_default();
                    for h in block_hashes {
                        assert!(s.remove(&h), "{tier:?} group {g}: removed an unknown hash");
                    }
                }
                (g, e) => panic!("unexpected event {e:?} for group {g:?}"),
            }
        }
    }
}

fn config(c: &Cfg) -> CacheConfig {
    let bs = u32::from(c.block_size % 6) + 1;
    let span = u32::from(c.span % 16) + 1;
    let win = if c.chunked {
        GroupSpec::chunked_local(bs, 8, span)
    } else {
        GroupSpec::sliding_window(bs, 8, span)
    };
    let mut cfg = CacheConfig::with_groups(
        u32::from(c.num_blocks % 40) + 4,
        vec![GroupSpec::full(bs, 8), win],
        vec![1, 1, 0],
    );
    cfg.retention_interval = if c.sparse { 2 * bs } else { 0 };
    cfg.num_cpu_blocks = 8;
    cfg.num_host_blocks = u32::from(c.host_blocks % 16) + 1;
    cfg.host_admission_min_seen = u32::from(c.min_seen % 3) + 1;
    cfg.host_eviction = if c.arc {
        HostEviction::Arc
    } else {
        HostEviction::Lru
    };
    cfg.enable_events = true;
    cfg
}

fuzz_target!(|input: Input| {
    let m = KvCacheManager::new(config(&input.cfg)).expect("valid by construction");
    let mut x = Exec {
        device: HashMap::new(),
        host: HashMap::new(),
        cpu: HashMap::new(),
        swaps: Vec::new(),
        tokens: HashMap::new(),
        sets: HashMap::new(),
    };
    for op in input.ops.into_iter().take(MAX_OPS) {
        match op {
            Op::Add { seq, family, len } => {
                let id = u64::from(seq % ID_SPACE);
                let f = u32::from(family % 3);
                let prompt: Vec<u32> = (0..u32::from(len % 24) + 1).map(|i| f * 100 + i).collect();
                if m.add_sequence(id, prompt.clone(), SequenceSpec::default())
                    .is_ok()
                {
                    x.tokens.insert(id, prompt);
                }
            }
            Op::Step { seqs, n, append } => {
                let mut ids: Vec<SeqId> = Vec::new();
                for s in seqs.iter().take(3) {
                    let id = u64::from(s % ID_SPACE);
                    if x.tokens.contains_key(&id) && !ids.contains(&id) {
                        ids.push(id);
                    }
                }
                if ids.is_empty() {
                    continue;
                }
                let n = u32::from(n % 12) + 1;
                let mut req = StepRequest {
                    seq_ids: ids.clone(),
                    num_new_tokens: vec![n; ids.len()],
                    ..StepRequest::default()
                };
                if append {
                    req.append_indptr = (0..=ids.len() as u32).collect();
                    req.append_tokens = vec![7; ids.len()];
                }
                let single = ids.len() == 1 && !append;
                let need = single.then(|| m.num_blocks_needed(ids[0], n as usize));
                let free = m.pool().num_free();
                let out = m.step(&req);
                if append {
                    for &id in &ids[..out.num_scheduled] {
                        x.tokens.get_mut(&id).unwrap().push(7);
                    }
                }
                if let Some(Ok(d)) = need {
                    match &out.error {
                        None => assert_eq!(
                            free as isize - m.pool().num_free() as isize,
                            d.net(),
                            "step took other blocks than predicted"
                        ),
                        Some(Error::OutOfBlocks { .. }) => assert!(d.take > free + d.release),
                        Some(_) => {}
                    }
                }
                x.run(&m, &out, &ids);
            }
            Op::Empty => {
                let out = m.step(&StepRequest::default());
                x.run(&m, &out, &[]);
            }
            Op::Free { seq } => {
                let id = u64::from(seq % ID_SPACE);
                if m.free(id) {
                    x.tokens.remove(&id);
                }
            }
            Op::Preempt { seq } => {
                let _ = m.preempt_recompute(&[u64::from(seq % ID_SPACE)]);
            }
            Op::SwapOut { seq } => {
                if let Ok(plan) = m.swap_out(&[u64::from(seq % ID_SPACE)]) {
                    x.swaps.extend(plan.into_iter().map(|(g, c)| (true, g, c)));
                }
            }
            Op::SwapIn { seq } => {
                if let Ok(plan) = m.swap_in(&[u64::from(seq % ID_SPACE)]) {
                    x.swaps.extend(plan.into_iter().map(|(c, g)| (false, c, g)));
                }
            }
            Op::Reset => {
                let _ = m.reset_prefix_cache();
            }
        }
        m.check_invariants().unwrap();
        x.replay(&m);
    }
    for id in x.tokens.keys() {
        assert!(m.free(*id));
    }
    m.step(&StepRequest::default());
    m.step(&StepRequest::default());
    m.check_invariants().unwrap();
    assert_eq!(m.pool().num_free(), m.config().num_blocks as usize - 1);
});
