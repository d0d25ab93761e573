//! The KV cache manager with one full-attention group, asked in the one-group words the
//! one-group suites were written in (one block table per sequence, copy-on-write pairs, events
//! without a group): [`OneGroup`], implemented for `HybridManager` built from a one-group
//! [`CacheConfig`]. Results are the core's one-group shapes (`SlotAllocation`, `StepOutput`).

#![allow(dead_code)] // each suite uses part of the interface

use pagedkv_core::events::KvEvent;
use pagedkv_core::host_tier::HostTransfers;
use pagedkv_core::pool::BlockPool;
use pagedkv_core::{
    BlockId, CacheConfig, CacheStats, Error, HybridConfig, HybridManager, HybridStepOptions,
    PrefixHasher, SeqId, SeqStatus, SequenceSpec, SlotAllocation, StepDrafts, StepOptions,
    StepOutput, StepRequest,
};

type Result<T> = std::result::Result<T, Error>;

/// An allocation in the one-group shape.
pub type Alloc = SlotAllocation;

/// A step output in the one-group shape (`block_table` row-major `S x width`, copy pairs).
pub type Step = StepOutput;

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

impl OneGroup for HybridManager {
    const NAME: &'static str = "HybridManager (one full group)";
    fn build(cfg: CacheConfig) -> Result<Self> {
        cfg.validate()?; // the one-group fields' own errors (block_size, num_blocks)
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
        Ok(HybridManager::allocate_slots_with_drafts(self, seq, n, drafts)?.into())
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
        o.into()
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

/// Instantiates each named generic test `fn name<M: OneGroup>()` as a `#[test]` on the manager
/// with one full-attention group.
#[macro_export]
macro_rules! one_group_tests {
    ($($name:ident),* $(,)?) => {
        mod one_group {
            $(#[test]
            fn $name() {
                super::$name::<pagedkv_core::HybridManager>();
            })*
        }
    };
}
