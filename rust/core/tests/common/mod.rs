//! One interface over the two ways to manage one full-attention KV cache group: the one-group
//! `KvCacheManager` and the groups manager (`HybridManager`) built with one full group. The
//! one-group suites are written against [`OneGroup`] and run on both, so the groups manager is
//! held to every one-group behaviour before the one-group manager goes.
//!
//! Outputs are read into plain structs ([`Alloc`], [`Step`]) with the one-group shapes: a
//! block table row per sequence, copy-on-write pairs.

#![allow(dead_code)] // each suite uses part of the interface

use pagedkv_core::events::KvEvent;
use pagedkv_core::host_tier::HostTransfers;
use pagedkv_core::pool::BlockPool;
use pagedkv_core::{
    BlockId, CacheConfig, CacheStats, Error, HybridConfig, HybridManager, HybridStepOptions,
    KvCacheManager, PrefixHasher, SeqId, SeqStatus, SequenceSpec, StepDrafts, StepOptions,
    StepRequest,
};

type Result<T> = std::result::Result<T, Error>;

/// An allocation as the one-group suites check it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Alloc {
    pub num_scheduled_tokens: usize,
    pub num_cached_tokens: usize,
    pub num_context_tokens: usize,
    pub new_block_ids: Vec<BlockId>,
    pub copies: Vec<(BlockId, BlockId)>,
    pub num_draft_tokens: usize,
}

/// A step output as the one-group suites check it (`block_table` row-major `S x width`,
/// `copies` as `(src, dst)` pairs).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Step {
    pub num_scheduled: usize,
    pub error: Option<Error>,
    pub num_cached_tokens: Vec<i32>,
    pub new_block_indptr: Vec<i32>,
    pub new_block_ids: Vec<i32>,
    pub copies: Vec<i32>,
    pub table_start: Vec<i32>,
    pub table_version: Vec<u64>,
    pub table_delta_indptr: Vec<i32>,
    pub table_delta: Vec<i32>,
    pub num_draft_tokens: Vec<i32>,
    /// `(device, host)` pairs.
    pub host_stores: Vec<i32>,
    /// `(host, device)` pairs.
    pub host_loads: Vec<i32>,
    pub query_start_loc: Vec<i32>,
    pub seq_lens: Vec<i32>,
    pub context_lens: Vec<i32>,
    pub input_ids: Vec<i64>,
    pub slot_mapping: Vec<i64>,
    pub block_table: Vec<i32>,
    pub block_table_width: usize,
}

impl Step {
    /// Row `k` of the dense block table.
    pub fn block_table_row(&self, k: usize) -> &[i32] {
        let w = self.block_table_width;
        &self.block_table[k * w..(k + 1) * w]
    }
}

/// The calls the one-group suites make, in the one-group manager's words.
pub trait OneGroup: Sized {
    /// Which manager this is, for failure messages.
    const NAME: &'static str;
    fn build(cfg: CacheConfig) -> Result<Self>;
    fn pool(&self) -> &BlockPool;
    fn add_sequence(&self, seq: SeqId, prompt: &[u32], spec: SequenceSpec) -> Result<()>;
    fn append_tokens(&self, seq: SeqId, tokens: &[u32]) -> Result<()>;
    fn lookup_prefix(&self, seq: SeqId) -> Result<usize>;
    /// Blocks the next `allocate_slots(seq, n)` takes from the free pool.
    fn num_blocks_needed(&self, seq: SeqId, n: usize) -> Result<usize>;
    fn num_blocks_owed(&self, seqs: &[SeqId]) -> Result<usize>;
    fn allocate_slots(&self, seq: SeqId, n: usize) -> Result<Alloc>;
    fn fork(&self, parent: SeqId, child: SeqId) -> Result<()>;
    fn free(&self, seq: SeqId) -> bool;
    fn preempt_recompute(&self, seqs: &[SeqId]) -> Result<()>;
    fn swap_out(&self, seqs: &[SeqId]) -> Result<Vec<(BlockId, BlockId)>>;
    fn swap_in(&self, seqs: &[SeqId]) -> Result<Vec<(BlockId, BlockId)>>;
    fn reset_prefix_cache(&self) -> Result<()>;
    fn block_table(&self, seq: SeqId) -> Result<Vec<BlockId>>;
    fn num_tokens(&self, seq: SeqId) -> Result<usize>;
    fn num_computed_tokens(&self, seq: SeqId) -> Result<usize>;
    fn num_uncomputed_tokens(&self, seqs: &[SeqId]) -> Result<Vec<i32>>;
    fn status(&self, seq: SeqId) -> Result<SeqStatus>;
    fn num_sequences(&self) -> usize;
    fn step(&self, req: &StepRequest) -> Step {
        OneGroup::step_with(self, req, StepOptions::default())
    }
    fn step_with(&self, req: &StepRequest, opts: StepOptions) -> Step {
        OneGroup::step_with_drafts(self, req, &StepDrafts::default(), opts)
    }
    fn step_with_drafts(&self, req: &StepRequest, drafts: &StepDrafts, opts: StepOptions) -> Step;
    fn allocate_slots_with_drafts(&self, seq: SeqId, n: usize, drafts: &[u32]) -> Result<Alloc>;
    fn accept_drafts(&self, seq: SeqId, num_accepted: usize) -> Result<Vec<BlockId>>;
    fn accept_drafts_keeping_blocks(&self, seq: SeqId, num_accepted: usize)
        -> Result<Vec<BlockId>>;
    fn num_draft_tokens(&self, seq: SeqId) -> Result<usize>;
    fn take_host_transfers(&self) -> HostTransfers;
    fn hasher(&self) -> &PrefixHasher;
    fn tokens(&self, seq: SeqId) -> Result<Vec<u32>>;
    fn stats(&self) -> CacheStats;
    /// The buffered KV events (the groups manager's, all of group 0 or of no group).
    fn take_events(&self) -> Vec<KvEvent>;
    fn check_invariants(&self) -> std::result::Result<(), String>;
}

impl OneGroup for KvCacheManager {
    const NAME: &'static str = "KvCacheManager";
    fn build(cfg: CacheConfig) -> Result<Self> {
        KvCacheManager::new(cfg)
    }
    fn pool(&self) -> &BlockPool {
        KvCacheManager::pool(self)
    }
    fn add_sequence(&self, seq: SeqId, prompt: &[u32], spec: SequenceSpec) -> Result<()> {
        KvCacheManager::add_sequence(self, seq, prompt, spec)
    }
    fn append_tokens(&self, seq: SeqId, tokens: &[u32]) -> Result<()> {
        KvCacheManager::append_tokens(self, seq, tokens)
    }
    fn lookup_prefix(&self, seq: SeqId) -> Result<usize> {
        KvCacheManager::lookup_prefix(self, seq)
    }
    fn num_blocks_needed(&self, seq: SeqId, n: usize) -> Result<usize> {
        KvCacheManager::num_blocks_needed(self, seq, n)
    }
    fn num_blocks_owed(&self, seqs: &[SeqId]) -> Result<usize> {
        KvCacheManager::num_blocks_owed(self, seqs)
    }
    fn allocate_slots(&self, seq: SeqId, n: usize) -> Result<Alloc> {
        OneGroup::allocate_slots_with_drafts(self, seq, n, &[])
    }
    fn allocate_slots_with_drafts(&self, seq: SeqId, n: usize, drafts: &[u32]) -> Result<Alloc> {
        let a = KvCacheManager::allocate_slots_with_drafts(self, seq, n, drafts)?;
        Ok(Alloc {
            num_scheduled_tokens: a.num_scheduled_tokens,
            num_cached_tokens: a.num_cached_tokens,
            num_context_tokens: a.num_context_tokens,
            new_block_ids: a.new_block_ids,
            copies: a.copies,
            num_draft_tokens: a.num_draft_tokens,
        })
    }
    fn accept_drafts(&self, seq: SeqId, num_accepted: usize) -> Result<Vec<BlockId>> {
        KvCacheManager::accept_drafts(self, seq, num_accepted)
    }
    fn accept_drafts_keeping_blocks(
        &self,
        seq: SeqId,
        num_accepted: usize,
    ) -> Result<Vec<BlockId>> {
        KvCacheManager::accept_drafts_keeping_blocks(self, seq, num_accepted)
    }
    fn num_draft_tokens(&self, seq: SeqId) -> Result<usize> {
        KvCacheManager::num_draft_tokens(self, seq)
    }
    fn take_host_transfers(&self) -> HostTransfers {
        KvCacheManager::take_host_transfers(self)
    }
    fn hasher(&self) -> &PrefixHasher {
        KvCacheManager::hasher(self)
    }
    fn fork(&self, parent: SeqId, child: SeqId) -> Result<()> {
        KvCacheManager::fork(self, parent, child)
    }
    fn free(&self, seq: SeqId) -> bool {
        KvCacheManager::free(self, seq)
    }
    fn preempt_recompute(&self, seqs: &[SeqId]) -> Result<()> {
        KvCacheManager::preempt_recompute(self, seqs)
    }
    fn swap_out(&self, seqs: &[SeqId]) -> Result<Vec<(BlockId, BlockId)>> {
        KvCacheManager::swap_out(self, seqs)
    }
    fn swap_in(&self, seqs: &[SeqId]) -> Result<Vec<(BlockId, BlockId)>> {
        KvCacheManager::swap_in(self, seqs)
    }
    fn reset_prefix_cache(&self) -> Result<()> {
        KvCacheManager::reset_prefix_cache(self)
    }
    fn block_table(&self, seq: SeqId) -> Result<Vec<BlockId>> {
        KvCacheManager::block_table(self, seq)
    }
    fn num_tokens(&self, seq: SeqId) -> Result<usize> {
        KvCacheManager::num_tokens(self, seq)
    }
    fn tokens(&self, seq: SeqId) -> Result<Vec<u32>> {
        KvCacheManager::tokens(self, seq)
    }
    fn num_computed_tokens(&self, seq: SeqId) -> Result<usize> {
        KvCacheManager::num_computed_tokens(self, seq)
    }
    fn num_uncomputed_tokens(&self, seqs: &[SeqId]) -> Result<Vec<i32>> {
        KvCacheManager::num_uncomputed_tokens(self, seqs)
    }
    fn status(&self, seq: SeqId) -> Result<SeqStatus> {
        KvCacheManager::status(self, seq)
    }
    fn num_sequences(&self) -> usize {
        KvCacheManager::num_sequences(self)
    }
    fn step_with_drafts(&self, req: &StepRequest, drafts: &StepDrafts, opts: StepOptions) -> Step {
        let o = KvCacheManager::step_with_drafts(self, req, drafts, opts);
        Step {
            num_scheduled: o.num_scheduled,
            error: o.error,
            num_cached_tokens: o.num_cached_tokens,
            new_block_indptr: o.new_block_indptr,
            new_block_ids: o.new_block_ids,
            copies: o.copies,
            table_start: o.table_start,
            table_version: o.table_version,
            table_delta_indptr: o.table_delta_indptr,
            table_delta: o.table_delta,
            num_draft_tokens: o.num_draft_tokens,
            host_stores: o.host_stores,
            host_loads: o.host_loads,
            query_start_loc: o.query_start_loc,
            seq_lens: o.seq_lens,
            context_lens: o.context_lens,
            input_ids: o.input_ids,
            slot_mapping: o.slot_mapping,
            block_table: o.block_table,
            block_table_width: o.block_table_width,
        }
    }
    fn stats(&self) -> CacheStats {
        KvCacheManager::stats(self)
    }
    fn take_events(&self) -> Vec<KvEvent> {
        KvCacheManager::take_events(self)
    }
    fn check_invariants(&self) -> std::result::Result<(), String> {
        KvCacheManager::check_invariants(self)
    }
}

/// `(group, a, b)` rows of group 0 as `(a, b)` pairs.
fn pairs(triples: &[i32]) -> Vec<i32> {
    assert!(
        triples.chunks(3).all(|c| c[0] == 0),
        "one group: {triples:?}"
    );
    triples.chunks(3).flat_map(|c| [c[1], c[2]]).collect()
}

impl OneGroup for HybridManager {
    const NAME: &'static str = "HybridManager (one full group)";
    fn build(cfg: CacheConfig) -> Result<Self> {
        HybridManager::new(HybridConfig::from(&cfg))
    }
    fn pool(&self) -> &BlockPool {
        HybridManager::pool(self)
    }
    fn add_sequence(&self, seq: SeqId, prompt: &[u32], spec: SequenceSpec) -> Result<()> {
        HybridManager::add_sequence(self, seq, prompt.to_vec(), spec)
    }
    fn append_tokens(&self, seq: SeqId, tokens: &[u32]) -> Result<()> {
        HybridManager::append_tokens(self, seq, tokens)
    }
    fn lookup_prefix(&self, seq: SeqId) -> Result<usize> {
        HybridManager::lookup_prefix(self, seq)
    }
    fn num_blocks_needed(&self, seq: SeqId, n: usize) -> Result<usize> {
        let d = HybridManager::num_blocks_needed(self, seq, n)?;
        assert_eq!(d.release, 0, "a full-attention group releases nothing");
        Ok(d.take)
    }
    fn num_blocks_owed(&self, seqs: &[SeqId]) -> Result<usize> {
        HybridManager::num_blocks_owed(self, seqs)
    }
    fn allocate_slots(&self, seq: SeqId, n: usize) -> Result<Alloc> {
        OneGroup::allocate_slots_with_drafts(self, seq, n, &[])
    }
    fn allocate_slots_with_drafts(&self, seq: SeqId, n: usize, drafts: &[u32]) -> Result<Alloc> {
        let mut a = HybridManager::allocate_slots_with_drafts(self, seq, n, drafts)?;
        let g = a.groups.pop().expect("one group");
        Ok(Alloc {
            num_scheduled_tokens: a.num_scheduled_tokens,
            num_cached_tokens: a.num_cached_tokens,
            num_context_tokens: a.num_context_tokens,
            new_block_ids: g.new_block_ids,
            copies: g.copies,
            num_draft_tokens: a.num_draft_tokens,
        })
    }
    fn accept_drafts(&self, seq: SeqId, num_accepted: usize) -> Result<Vec<BlockId>> {
        Ok(HybridManager::accept_drafts(self, seq, num_accepted)?.swap_remove(0))
    }
    fn accept_drafts_keeping_blocks(
        &self,
        seq: SeqId,
        num_accepted: usize,
    ) -> Result<Vec<BlockId>> {
        Ok(HybridManager::accept_drafts_keeping_blocks(self, seq, num_accepted)?.swap_remove(0))
    }
    fn num_draft_tokens(&self, seq: SeqId) -> Result<usize> {
        HybridManager::num_draft_tokens(self, seq)
    }
    fn take_host_transfers(&self) -> HostTransfers {
        let t = HybridManager::take_host_transfers(self);
        let pair = |&(g, a, b): &(u32, BlockId, BlockId)| {
            assert_eq!(g, 0, "one group");
            (a, b)
        };
        HostTransfers {
            stores: t.stores.iter().map(pair).collect(),
            loads: t.loads.iter().map(pair).collect(),
        }
    }
    fn hasher(&self) -> &PrefixHasher {
        HybridManager::hasher(self)
    }
    fn fork(&self, parent: SeqId, child: SeqId) -> Result<()> {
        HybridManager::fork(self, parent, child)
    }
    fn free(&self, seq: SeqId) -> bool {
        HybridManager::free(self, seq)
    }
    fn preempt_recompute(&self, seqs: &[SeqId]) -> Result<()> {
        HybridManager::preempt_recompute(self, seqs)
    }
    fn swap_out(&self, seqs: &[SeqId]) -> Result<Vec<(BlockId, BlockId)>> {
        HybridManager::swap_out(self, seqs)
    }
    fn swap_in(&self, seqs: &[SeqId]) -> Result<Vec<(BlockId, BlockId)>> {
        HybridManager::swap_in(self, seqs)
    }
    fn reset_prefix_cache(&self) -> Result<()> {
        HybridManager::reset_prefix_cache(self)
    }
    fn block_table(&self, seq: SeqId) -> Result<Vec<BlockId>> {
        Ok(HybridManager::block_tables(self, seq)?.swap_remove(0))
    }
    fn num_tokens(&self, seq: SeqId) -> Result<usize> {
        HybridManager::num_tokens(self, seq)
    }
    fn tokens(&self, seq: SeqId) -> Result<Vec<u32>> {
        HybridManager::tokens(self, seq)
    }
    fn num_computed_tokens(&self, seq: SeqId) -> Result<usize> {
        HybridManager::num_computed_tokens(self, seq)
    }
    fn num_uncomputed_tokens(&self, seqs: &[SeqId]) -> Result<Vec<i32>> {
        HybridManager::num_uncomputed_tokens(self, seqs)
    }
    fn status(&self, seq: SeqId) -> Result<SeqStatus> {
        HybridManager::status(self, seq)
    }
    fn num_sequences(&self) -> usize {
        HybridManager::num_sequences(self)
    }
    fn step_with_drafts(&self, req: &StepRequest, drafts: &StepDrafts, opts: StepOptions) -> Step {
        let opts = HybridStepOptions {
            skip_block_table: opts.skip_block_table,
            skip_token_arrays: opts.skip_token_arrays,
            reserve_blocks: 0,
        };
        let o = HybridManager::step_with(self, req, drafts, opts);
        assert_eq!(o.num_groups, 1);
        Step {
            num_scheduled: o.num_scheduled,
            error: o.error,
            num_cached_tokens: o.num_cached_tokens,
            new_block_indptr: o.new_block_indptr,
            new_block_ids: o.new_block_ids,
            // (group, src, dst) triples of group 0 -> (src, dst) pairs.
            copies: pairs(&o.copies),
            table_start: o.table_start,
            table_version: o.table_version,
            table_delta_indptr: o.table_delta_indptr,
            table_delta: o.table_delta,
            num_draft_tokens: o.num_draft_tokens,
            host_stores: pairs(&o.host_stores),
            host_loads: pairs(&o.host_loads),
            query_start_loc: o.query_start_loc,
            seq_lens: o.seq_lens,
            context_lens: o.context_lens,
            input_ids: o.input_ids,
            slot_mapping: o.slot_mapping,
            block_table: o.block_table,
            block_table_width: o.block_table_width,
        }
    }
    fn stats(&self) -> CacheStats {
        HybridManager::stats(self)
    }
    fn take_events(&self) -> Vec<KvEvent> {
        let events = HybridManager::take_events(self);
        let groups = |e: &pagedkv_core::GroupEvent| matches!(e.group, None | Some(0));
        assert!(events.iter().all(groups), "{events:?}");
        events.into_iter().map(|e| e.event).collect()
    }
    fn check_invariants(&self) -> std::result::Result<(), String> {
        HybridManager::check_invariants(self)
    }
}

/// Instantiates each named generic test `fn name<M: OneGroup>()` once per manager, as
/// `one_group_manager::name` and `groups_manager::name`.
#[macro_export]
macro_rules! on_both_managers {
    ($($name:ident),* $(,)?) => {
        mod one_group_manager {
            $(#[test]
            fn $name() {
                super::$name::<pagedkv_core::KvCacheManager>();
            })*
        }
        mod groups_manager {
            $(#[test]
            fn $name() {
                super::$name::<pagedkv_core::HybridManager>();
            })*
        }
    };
}
