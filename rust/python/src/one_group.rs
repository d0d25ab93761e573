//! The one-group `KVCacheManager`'s core: the groups manager (`HybridManager`) with one
//! full-attention group, answering in the one-group shapes the Python class has always returned
//! (one block table per sequence, copy-on-write and host-transfer pairs, events without a
//! group). The binding keeps its Python API while the core keeps one manager.

use pagedkv_core::events::KvEvent;
use pagedkv_core::host_tier::HostTransfers;
use pagedkv_core::pool::BlockPool;
use pagedkv_core::{
    BlockId, CacheConfig, CacheStats, HybridConfig, HybridManager, HybridStepOptions,
    HybridStepOutput, Result, SeqId, SeqStatus, SequenceSpec, SlotAllocation, StepDrafts,
    StepOptions, StepOutput, StepRequest,
};

/// A [`HybridManager`] of one full-attention group with the one-group calls' result shapes.
#[derive(Debug)]
pub(crate) struct OneGroupManager {
    cfg: CacheConfig,
    inner: HybridManager,
}

/// `(group, a, b)` rows of group 0 as `(a, b)` pairs.
fn pairs(triples: Vec<i32>) -> Vec<i32> {
    if triples.is_empty() {
        return triples;
    }
    triples.chunks_exact(3).flat_map(|c| [c[1], c[2]]).collect()
}

impl OneGroupManager {
    /// Errors as [`HybridManager::new`] (`InvalidConfig` naming the field).
    pub(crate) fn new(cfg: CacheConfig) -> Result<Self> {
        cfg.validate()?;
        let inner = HybridManager::new(HybridConfig::from(&cfg))?;
        Ok(Self { cfg, inner })
    }

    pub(crate) fn config(&self) -> &CacheConfig {
        &self.cfg
    }

    pub(crate) fn pool(&self) -> &BlockPool {
        self.inner.pool()
    }

    pub(crate) fn add_sequence_owned(
        &self,
        seq: SeqId,
        prompt: Vec<u32>,
        spec: SequenceSpec,
    ) -> Result<()> {
        self.inner.add_sequence(seq, prompt, spec)
    }

    pub(crate) fn append_tokens(&self, seq: SeqId, tokens: &[u32]) -> Result<()> {
        self.inner.append_tokens(seq, tokens)
    }

    pub(crate) fn lookup_prefix(&self, seq: SeqId) -> Result<usize> {
        self.inner.lookup_prefix(seq)
    }

    /// Blocks the allocation takes from the free pool (a full-attention group releases none).
    pub(crate) fn num_blocks_needed(&self, seq: SeqId, num_new_tokens: usize) -> Result<usize> {
        Ok(self.inner.num_blocks_needed(seq, num_new_tokens)?.take)
    }

    pub(crate) fn allocate_slots_with_drafts(
        &self,
        seq: SeqId,
        num_new_tokens: usize,
        drafts: &[u32],
    ) -> Result<SlotAllocation> {
        let mut a = self
            .inner
            .allocate_slots_with_drafts(seq, num_new_tokens, drafts)?;
        let g = a.groups.pop().unwrap_or_default();
        Ok(SlotAllocation {
            num_scheduled_tokens: a.num_scheduled_tokens,
            num_cached_tokens: a.num_cached_tokens,
            num_context_tokens: a.num_context_tokens,
            new_block_ids: g.new_block_ids,
            copies: g.copies,
            num_draft_tokens: a.num_draft_tokens,
        })
    }

    pub(crate) fn accept_drafts(&self, seq: SeqId, num_accepted: usize) -> Result<Vec<BlockId>> {
        Ok(first(self.inner.accept_drafts(seq, num_accepted)?))
    }

    pub(crate) fn accept_drafts_keeping_blocks(
        &self,
        seq: SeqId,
        num_accepted: usize,
    ) -> Result<Vec<BlockId>> {
        Ok(first(
            self.inner.accept_drafts_keeping_blocks(seq, num_accepted)?,
        ))
    }

    pub(crate) fn num_draft_tokens(&self, seq: SeqId) -> Result<usize> {
        self.inner.num_draft_tokens(seq)
    }

    pub(crate) fn fork(&self, parent: SeqId, child: SeqId) -> Result<()> {
        self.inner.fork(parent, child)
    }

    pub(crate) fn free(&self, seq: SeqId) -> bool {
        self.inner.free(seq)
    }

    pub(crate) fn preempt_recompute(&self, seqs: &[SeqId]) -> Result<()> {
        self.inner.preempt_recompute(seqs)
    }

    pub(crate) fn swap_out(&self, seqs: &[SeqId]) -> Result<Vec<(BlockId, BlockId)>> {
        self.inner.swap_out(seqs)
    }

    pub(crate) fn swap_in(&self, seqs: &[SeqId]) -> Result<Vec<(BlockId, BlockId)>> {
        self.inner.swap_in(seqs)
    }

    pub(crate) fn reset_prefix_cache(&self) -> Result<()> {
        self.inner.reset_prefix_cache()
    }

    pub(crate) fn block_table(&self, seq: SeqId) -> Result<Vec<BlockId>> {
        Ok(first(self.inner.block_tables(seq)?))
    }

    pub(crate) fn num_tokens(&self, seq: SeqId) -> Result<usize> {
        self.inner.num_tokens(seq)
    }

    pub(crate) fn num_computed_tokens(&self, seq: SeqId) -> Result<usize> {
        self.inner.num_computed_tokens(seq)
    }

    pub(crate) fn status(&self, seq: SeqId) -> Result<SeqStatus> {
        self.inner.status(seq)
    }

    pub(crate) fn tokens(&self, seq: SeqId) -> Result<Vec<u32>> {
        self.inner.tokens(seq)
    }

    pub(crate) fn num_sequences(&self) -> usize {
        self.inner.num_sequences()
    }

    pub(crate) fn num_uncomputed_tokens(&self, seqs: &[SeqId]) -> Result<Vec<i32>> {
        self.inner.num_uncomputed_tokens(seqs)
    }

    pub(crate) fn num_blocks_owed(&self, seqs: &[SeqId]) -> Result<usize> {
        self.inner.num_blocks_owed(seqs)
    }

    /// One batched step; the output's `G x ...` arrays are the one-group arrays as they are.
    pub(crate) fn step_with_drafts(
        &self,
        req: &StepRequest,
        drafts: &StepDrafts,
        opts: StepOptions,
    ) -> StepOutput {
        let opts = HybridStepOptions {
            skip_block_table: opts.skip_block_table,
            skip_token_arrays: opts.skip_token_arrays,
            reserve_blocks: 0,
        };
        one_group_output(self.inner.step_with(req, drafts, opts))
    }

    pub(crate) fn take_host_transfers(&self) -> HostTransfers {
        let t = self.inner.take_host_transfers();
        HostTransfers {
            stores: t.stores.into_iter().map(|(_, d, h)| (d, h)).collect(),
            loads: t.loads.into_iter().map(|(_, h, d)| (h, d)).collect(),
        }
    }

    pub(crate) fn stats(&self) -> CacheStats {
        self.inner.stats()
    }

    pub(crate) fn take_events(&self) -> Vec<KvEvent> {
        self.inner
            .take_events()
            .into_iter()
            .map(|e| e.event)
            .collect()
    }

    pub(crate) fn check_invariants(&self) -> std::result::Result<(), String> {
        self.inner.check_invariants()
    }
}

/// Group 0's part of a per-group result.
fn first(mut per_group: Vec<Vec<BlockId>>) -> Vec<BlockId> {
    per_group.swap_remove(0)
}

/// A one-group step output: the arrays moved, not copied; copy-on-write and host rows lose
/// their group column.
fn one_group_output(o: HybridStepOutput) -> StepOutput {
    StepOutput {
        num_scheduled: o.num_scheduled,
        error: o.error,
        num_cached_tokens: o.num_cached_tokens,
        num_draft_tokens: o.num_draft_tokens,
        query_start_loc: o.query_start_loc,
        seq_lens: o.seq_lens,
        context_lens: o.context_lens,
        slot_mapping: o.slot_mapping,
        new_block_indptr: o.new_block_indptr,
        new_block_ids: o.new_block_ids,
        copies: pairs(o.copies),
        input_ids: o.input_ids,
        host_stores: pairs(o.host_stores),
        host_loads: pairs(o.host_loads),
        block_table: o.block_table,
        block_table_width: o.block_table_width,
        table_start: o.table_start,
        table_version: o.table_version,
        table_delta_indptr: o.table_delta_indptr,
        table_delta: o.table_delta,
    }
}
