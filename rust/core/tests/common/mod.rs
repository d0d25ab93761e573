//! The KV cache manager with one full-attention group, asked in the words the one-group suites
//! were written in (one block table per sequence, events without a group): [`OneGroup`],
//! implemented for `KvCacheManager` built from [`CacheConfig::new`] (one full-attention
//! group). Allocations and step outputs are the manager's (`SlotAllocation`, `StepOutput`),
//! asserted to be of one group.

#![allow(dead_code)] // each suite uses part of the interface

use pagedkv_core::events::KvEvent;
use pagedkv_core::host_tier::HostTransfers;
use pagedkv_core::pool::BlockPool;
use pagedkv_core::{
    BlockId, CacheConfig, CacheStats, Error, KvCacheManager, PrefixHasher, SeqId, SeqStatus,
    SequenceSpec, SlotAllocation, StepDrafts, StepOptions, StepOutput, StepRequest,
};

type Result<T> = std::result::Result<T, Error>;

/// An allocation of the manager with one group (`groups[0]` its blocks and copies).
pub type Alloc = SlotAllocation;

/// A step output of the manager with one group (`G = 1`: `block_table` row-major
/// `S x width`, `(0, src, dst)` copy triples).
pub type Step = StepOutput;

/// The calls the one-group suites make, in one-group words.
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
    /// The buffered KV events (the KV cache manager's, all of group 0 or of no group).
    fn take_events(&self) -> Vec<KvEvent>;
    fn check_invariants(&self) -> std::result::Result<(), String>;
}

impl OneGroup for KvCacheManager {
    const NAME: &'static str = "KvCacheManager (one full group)";
    fn build(cfg: CacheConfig) -> Result<Self> {
        assert_eq!(cfg.groups.len(), 1, "one group");
        KvCacheManager::new(cfg)
    }
    fn pool(&self) -> &BlockPool {
        KvCacheManager::pool(self)
    }
    fn add_sequence(&self, seq: SeqId, prompt: &[u32], spec: SequenceSpec) -> Result<()> {
        KvCacheManager::add_sequence(self, seq, prompt.to_vec(), spec)
    }
    fn append_tokens(&self, seq: SeqId, tokens: &[u32]) -> Result<()> {
        KvCacheManager::append_tokens(self, seq, tokens)
    }
    fn lookup_prefix(&self, seq: SeqId) -> Result<usize> {
        KvCacheManager::lookup_prefix(self, seq)
    }
    fn num_blocks_needed(&self, seq: SeqId, n: usize) -> Result<usize> {
        let d = KvCacheManager::num_blocks_needed(self, seq, n)?;
        assert_eq!(d.release, 0, "a full-attention group releases nothing");
        Ok(d.take)
    }
    fn num_blocks_owed(&self, seqs: &[SeqId]) -> Result<usize> {
        KvCacheManager::num_blocks_owed(self, seqs)
    }
    fn allocate_slots(&self, seq: SeqId, n: usize) -> Result<Alloc> {
        OneGroup::allocate_slots_with_drafts(self, seq, n, &[])
    }
    fn allocate_slots_with_drafts(&self, seq: SeqId, n: usize, drafts: &[u32]) -> Result<Alloc> {
        let a = KvCacheManager::allocate_slots_with_drafts(self, seq, n, drafts)?;
        assert_eq!(a.groups.len(), 1, "one group");
        Ok(a)
    }
    fn accept_drafts(&self, seq: SeqId, num_accepted: usize) -> Result<Vec<BlockId>> {
        Ok(KvCacheManager::accept_drafts(self, seq, num_accepted)?.swap_remove(0))
    }
    fn accept_drafts_keeping_blocks(
        &self,
        seq: SeqId,
        num_accepted: usize,
    ) -> Result<Vec<BlockId>> {
        Ok(KvCacheManager::accept_drafts_keeping_blocks(self, seq, num_accepted)?.swap_remove(0))
    }
    fn num_draft_tokens(&self, seq: SeqId) -> Result<usize> {
        KvCacheManager::num_draft_tokens(self, seq)
    }
    fn take_host_transfers(&self) -> HostTransfers {
        let t = KvCacheManager::take_host_transfers(self);
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
        Ok(KvCacheManager::block_tables(self, seq)?.swap_remove(0))
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
        let o = KvCacheManager::step_with(self, req, drafts, opts);
        assert_eq!(o.num_groups, 1);
        o
    }
    fn stats(&self) -> CacheStats {
        KvCacheManager::stats(self)
    }
    fn take_events(&self) -> Vec<KvEvent> {
        let events = KvCacheManager::take_events(self);
        let groups = |e: &pagedkv_core::GroupEvent| matches!(e.group, None | Some(0));
        assert!(events.iter().all(groups), "{events:?}");
        events.into_iter().map(|e| e.event).collect()
    }
    fn check_invariants(&self) -> std::result::Result<(), String> {
        KvCacheManager::check_invariants(self)
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
                super::$name::<pagedkv_core::KvCacheManager>();
            })*
        }
    };
}
