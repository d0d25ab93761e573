//! The one-group shapes: the configuration of one full-attention KV cache group
//! ([`CacheConfig`], which [`crate::HybridConfig::from`] turns into the manager's
//! configuration) and the results as a one-group caller reads them ([`SlotAllocation`],
//! [`StepOutput`] with one block table per sequence and `(src, dst)` copy pairs). The manager
//! itself is [`crate::HybridManager`] for one group and many alike; the Python binding's
//! one-group `KVCacheManager` answers in these shapes.
//!
//! Units: token counts are `usize` tokens; block counts are `usize` blocks; block ids are
//! [`BlockId`]s (GPU ids `1..num_blocks`, CPU swap ids `0..num_cpu_blocks`).

use crate::error::{Error, Result};
use crate::events::KvEvent;
use crate::hashing::{HashAlgo, PrefixHasher};
use crate::host_tier::{validate_host_tier, HostEviction, HostTransfers};
use crate::metrics::CacheStats;
use crate::pool::BlockPool;
use crate::request::{SeqStatus, SequenceSpec, StepDrafts, StepRequest};
use crate::{BlockId, HybridConfig, HybridManager, HybridStepOptions, SeqId};

/// Largest supported block size in tokens.
pub const MAX_BLOCK_SIZE: u32 = 4096;

/// Configuration of one full-attention KV cache group (see the module docs).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CacheConfig {
    /// Physical GPU blocks including the null block 0 (so `num_blocks - 1` are usable); >= 2.
    pub num_blocks: u32,
    /// Tokens per block, `1..=MAX_BLOCK_SIZE`.
    pub block_size: u32,
    /// Whether full blocks are hashed, cached and reused across sequences.
    pub enable_prefix_caching: bool,
    /// Hash function of the prefix cache (SHA-256 unless opted out).
    pub hash_algo: HashAlgo,
    /// Chain seed: processes that must agree on block hashes use the same seed.
    pub hash_seed: Vec<u8>,
    /// CPU swap-space blocks (0 disables swapping: every swap-out fails with `OutOfSwapSpace`).
    pub num_cpu_blocks: u32,
    /// Whether KV events are buffered for [`crate::HybridManager::take_events`].
    pub enable_events: bool,
    /// Host-memory blocks of the prefix cache's second tier ([`crate::host_tier`]; 0: no
    /// host tier, and nothing of it runs). Needs prefix caching on. Host block ids are
    /// `0..num_host_blocks`; the executor owns the host tensors (bytes are checked there).
    pub num_host_blocks: u32,
    /// Uses (registrations of computed blocks and prefix hits) a block hash needs before the
    /// device pool's eviction of it stores it to the host tier; 1 stores every evicted
    /// block. At least 1.
    pub host_admission_min_seen: u32,
    /// Which host block a full host tier evicts for a store.
    pub host_eviction: HostEviction,
}

impl CacheConfig {
    /// `num_blocks` GPU blocks (including the null block) of `block_size` tokens, with prefix
    /// caching on, SHA-256, an empty seed, no CPU swap space and events off. Not validated
    /// until [`Self::validate`] / [`crate::HybridManager::new`].
    pub fn new(num_blocks: u32, block_size: u32) -> Self {
        Self {
            num_blocks,
            block_size,
            enable_prefix_caching: true,
            hash_algo: HashAlgo::Sha256,
            hash_seed: Vec::new(),
            num_cpu_blocks: 0,
            enable_events: false,
            num_host_blocks: 0,
            host_admission_min_seen: 2,
            host_eviction: HostEviction::Lru,
        }
    }

    /// Checks every field. Errors: [`Error::InvalidConfig`] naming the field when
    /// `num_blocks < 2`, `block_size` is outside `1..=MAX_BLOCK_SIZE`, `num_host_blocks`
    /// exceeds [`crate::host_tier::MAX_HOST_BLOCKS`] or is set with prefix caching off (the host tier keys
    /// blocks by their prefix hash), or `host_admission_min_seen == 0`.
    pub fn validate(&self) -> Result<()> {
        validate_host_tier(
            self.num_host_blocks,
            self.host_admission_min_seen,
            self.enable_prefix_caching,
        )?;
        if self.num_blocks < 2 {
            return Err(Error::InvalidConfig {
                field: "num_blocks",
                value: self.num_blocks.to_string(),
                reason: "need at least 2 blocks (block 0 is the null block)".into(),
            });
        }
        if self.block_size == 0 || self.block_size > MAX_BLOCK_SIZE {
            return Err(Error::InvalidConfig {
                field: "block_size",
                value: self.block_size.to_string(),
                reason: format!("must be in 1..={MAX_BLOCK_SIZE} tokens"),
            });
        }
        Ok(())
    }
}

/// The result of one [`crate::HybridManager::allocate_slots`] call.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct SlotAllocation {
    /// Tokens scheduled by this call (the query length): `min(num_new_tokens, uncomputed)`.
    pub num_scheduled_tokens: usize,
    /// Tokens served from the prefix cache by this call (first allocation only; a multiple of
    /// `block_size`, else 0).
    pub num_cached_tokens: usize,
    /// Tokens with KV already present before the scheduled ones (cached hits included): the
    /// scheduled tokens occupy positions `num_context_tokens..num_context_tokens +
    /// num_scheduled_tokens`.
    pub num_context_tokens: usize,
    /// Blocks newly taken from the free pool for this sequence, in block-table order (the
    /// copy-on-write destination, if any, then fresh blocks). Prefix-hit blocks are not listed.
    pub new_block_ids: Vec<BlockId>,
    /// Copy-on-write plan: `(src, dst)` block pairs the kernel must copy before writing
    /// (at most one per call).
    pub copies: Vec<(BlockId, BlockId)>,
    /// Draft tokens given slots after the scheduled ones (speculative decoding): they occupy
    /// positions `num_context_tokens + num_scheduled_tokens ..` `+ num_draft_tokens`, pending
    /// until [`crate::HybridManager::accept_drafts`].
    pub num_draft_tokens: usize,
}

/// Output of [`crate::HybridManager::step`], flat integer arrays ready to become kernel tensors.
/// `S` = `num_scheduled`; per-token arrays have one entry per scheduled token.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StepOutput {
    /// Sequences scheduled (a prefix of the request: processing stops at the first failure).
    pub num_scheduled: usize,
    /// The failure that stopped processing, if any (that sequence is left unchanged, including
    /// its appended tokens).
    pub error: Option<Error>,
    /// Per scheduled seq: prefix-hit tokens of its first allocation, else 0.
    pub num_cached_tokens: Vec<i32>,
    /// Per scheduled seq: draft tokens scheduled after its finalized ones (the last
    /// `num_draft_tokens[k]` of its query; empty when the step had no drafts).
    pub num_draft_tokens: Vec<i32>,
    /// Length `S + 1`: cumulative query lengths (tokens).
    pub query_start_loc: Vec<i32>,
    /// Per scheduled seq: context + query tokens.
    pub seq_lens: Vec<i32>,
    /// Per scheduled seq: tokens with KV present before this step.
    pub context_lens: Vec<i32>,
    /// Per scheduled token: `block_id * block_size + offset` of its KV slot.
    pub slot_mapping: Vec<i64>,
    /// Length `S + 1`: CSR offsets into `new_block_ids`.
    pub new_block_indptr: Vec<i32>,
    /// Blocks newly taken per seq (see [`SlotAllocation::new_block_ids`]).
    pub new_block_ids: Vec<i32>,
    /// Copy-on-write plan, row-major `(src, dst)` GPU block pairs (length `2 * copies`), to
    /// run before the K/V writes.
    pub copies: Vec<i32>,
    /// Per scheduled token: its token id (the tokens the model reads this step, in the order
    /// of `slot_mapping`).
    pub input_ids: Vec<i64>,
    /// Host-tier stores, row-major `(device block, host block)` pairs: the executor copies
    /// these FIRST in the step (before swaps, host loads, copy-on-write and the forward
    /// pass), since the device blocks are about to be reused. Includes the stores planned by
    /// calls since the previous hand-out (docs/design.md, "Host tier"). Empty without a host
    /// tier.
    pub host_stores: Vec<i32>,
    /// Host-tier loads, row-major `(host block, device block)` pairs: copied after the
    /// stores and swaps, before copy-on-write and the forward pass. Their host blocks stay
    /// pinned until the next step call returns. Empty without a host tier.
    pub host_loads: Vec<i32>,
    /// The scheduled seqs' full block tables as one dense row-major `S x block_table_width`
    /// matrix, rows padded with the null block 0: the layout paged-attention kernels index
    /// (row `k` holds `ceil(seq_lens[k] / block_size)` real entries).
    pub block_table: Vec<i32>,
    /// Columns of `block_table`: the longest scheduled table, at least 1.
    pub block_table_width: usize,
    /// Per scheduled seq: the first logical block of its table that changed since the last
    /// step output that reported it (0 for a table new to the outputs: first allocation, a
    /// resumed preemption, a swap-in, a fork child). Entries before it are unchanged since that
    /// output; row `k` of the table is now `previous[..table_start[k]]` followed by its slice of
    /// `table_delta`. The delta form of the block table: a consumer keeping tables across
    /// steps (as vLLM's GPU model runner keeps its block table) applies only these changes.
    pub table_start: Vec<i32>,
    /// Per scheduled seq: the version of its table this output reports, one more than its
    /// previous report's. A sequence's first report is one more than the highest version any
    /// earlier output of this manager carried, so versions never repeat under one id, even
    /// when the id is reused by a new sequence. A consumer holding version `v` of an id's
    /// table may apply this delta only when this is `v + 1` (or `table_start` is 0);
    /// otherwise it missed an output (or holds a freed sequence's table under a reused id)
    /// and must re-read the whole table ([`crate::HybridManager::block_tables`]); this is what
    /// [`crate::block_tables::BlockTables`] does.
    pub table_version: Vec<u64>,
    /// Length `S + 1`: CSR offsets into `table_delta`.
    pub table_delta_indptr: Vec<i32>,
    /// Per scheduled seq, its table entries from `table_start` to its end (block ids).
    pub table_delta: Vec<i32>,
}

/// Options of [`crate::HybridManager::step_with`]. The default is what [`crate::HybridManager::step`]
/// returns.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StepOptions {
    /// Leave [`StepOutput::block_table`] empty (`block_table_width` 0): for callers that keep
    /// block tables themselves (from the table delta, [`StepOutput::table_start`] /
    /// [`StepOutput::table_delta`]), copying every scheduled table out each step would be
    /// O(scheduled sequences x longest table) wasted work.
    pub skip_block_table: bool,
    /// Leave the per-token arrays [`StepOutput::slot_mapping`] and [`StepOutput::input_ids`]
    /// empty: for callers that build them on the device from the block tables and positions
    /// (as vLLM's model runner does), or that need only the block ids (a scheduler). A long
    /// prefill otherwise writes 16 bytes per token into fresh memory.
    pub skip_token_arrays: bool,
}

impl StepOutput {
    /// Row `k` of the dense block table (`block_table_width` entries, null-padded).
    pub fn block_table_row(&self, k: usize) -> &[i32] {
        let w = self.block_table_width;
        &self.block_table[k * w..(k + 1) * w]
    }
}

/// The one-group form of a one-group manager's step output: the arrays moved as they are
/// (`G = 1`), copy-on-write and host rows without their group column. Precondition:
/// `o.num_groups == 1` (checked in debug builds).
impl From<crate::HybridStepOutput> for StepOutput {
    fn from(o: crate::HybridStepOutput) -> Self {
        debug_assert!(o.num_groups <= 1, "{} groups", o.num_groups);
        Self {
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
}

/// The one-group form of a one-group manager's allocation (group 0's blocks and copies).
impl From<crate::manager::HybridAllocation> for SlotAllocation {
    fn from(mut a: crate::manager::HybridAllocation) -> Self {
        debug_assert!(a.groups.len() <= 1, "{} groups", a.groups.len());
        let g = a.groups.pop().unwrap_or_default();
        Self {
            num_scheduled_tokens: a.num_scheduled_tokens,
            num_cached_tokens: a.num_cached_tokens,
            num_context_tokens: a.num_context_tokens,
            new_block_ids: g.new_block_ids,
            copies: g.copies,
            num_draft_tokens: a.num_draft_tokens,
        }
    }
}

/// `(group, a, b)` rows as `(a, b)` pairs.
fn pairs(triples: Vec<i32>) -> Vec<i32> {
    if triples.is_empty() {
        return triples;
    }
    triples.chunks_exact(3).flat_map(|c| [c[1], c[2]]).collect()
}

/// The manager with one full-attention group, asked in the one-group words: a
/// [`HybridManager`] built from a [`CacheConfig`], each call forwarded to it and its result
/// read in the one-group shape (group 0's table, blocks and copies; events and host transfers
/// without their group). Not a second manager: no state of its own besides the configuration.
/// The Python binding's one-group `KVCacheManager`, the one-group suites and fuzz targets use
/// it. Errors are the manager's.
#[derive(Debug)]
pub struct OneGroupManager {
    cfg: CacheConfig,
    inner: HybridManager,
}

impl OneGroupManager {
    /// Errors as [`HybridManager::new`] (`InvalidConfig` naming the field).
    pub fn new(cfg: CacheConfig) -> Result<Self> {
        cfg.validate()?;
        let inner = HybridManager::new(HybridConfig::from(&cfg))?;
        Ok(Self { cfg, inner })
    }

    /// The manager's `config`, in the one-group shape.
    pub fn config(&self) -> &CacheConfig {
        &self.cfg
    }

    /// The manager behind it.
    pub fn manager(&self) -> &HybridManager {
        &self.inner
    }

    /// The manager's `hasher`, in the one-group shape.
    pub fn hasher(&self) -> &PrefixHasher {
        self.inner.hasher()
    }

    /// The manager's `pool`, in the one-group shape.
    pub fn pool(&self) -> &BlockPool {
        self.inner.pool()
    }

    /// The manager's `add_sequence_owned`, in the one-group shape.
    pub fn add_sequence_owned(
        &self,
        seq: SeqId,
        prompt: Vec<u32>,
        spec: SequenceSpec,
    ) -> Result<()> {
        self.inner.add_sequence(seq, prompt, spec)
    }

    /// [`Self::add_sequence_owned`] of a borrowed prompt.
    pub fn add_sequence(&self, seq: SeqId, prompt: &[u32], spec: SequenceSpec) -> Result<()> {
        self.inner.add_sequence(seq, prompt.to_vec(), spec)
    }

    /// The manager's `append_tokens`, in the one-group shape.
    pub fn append_tokens(&self, seq: SeqId, tokens: &[u32]) -> Result<()> {
        self.inner.append_tokens(seq, tokens)
    }

    /// The manager's `lookup_prefix`, in the one-group shape.
    pub fn lookup_prefix(&self, seq: SeqId) -> Result<usize> {
        self.inner.lookup_prefix(seq)
    }

    /// Blocks the allocation takes from the free pool (a full-attention group releases none).
    pub fn num_blocks_needed(&self, seq: SeqId, num_new_tokens: usize) -> Result<usize> {
        Ok(self.inner.num_blocks_needed(seq, num_new_tokens)?.take)
    }

    /// The manager's `allocate_slots_with_drafts`, in the one-group shape.
    pub fn allocate_slots_with_drafts(
        &self,
        seq: SeqId,
        num_new_tokens: usize,
        drafts: &[u32],
    ) -> Result<SlotAllocation> {
        let a = self
            .inner
            .allocate_slots_with_drafts(seq, num_new_tokens, drafts)?;
        Ok(a.into())
    }

    /// The manager's `allocate_slots`, in the one-group shape.
    pub fn allocate_slots(&self, seq: SeqId, num_new_tokens: usize) -> Result<SlotAllocation> {
        self.allocate_slots_with_drafts(seq, num_new_tokens, &[])
    }

    /// The manager's `accept_drafts`, in the one-group shape.
    pub fn accept_drafts(&self, seq: SeqId, num_accepted: usize) -> Result<Vec<BlockId>> {
        Ok(first(self.inner.accept_drafts(seq, num_accepted)?))
    }

    /// The manager's `accept_drafts_keeping_blocks`, in the one-group shape.
    pub fn accept_drafts_keeping_blocks(
        &self,
        seq: SeqId,
        num_accepted: usize,
    ) -> Result<Vec<BlockId>> {
        Ok(first(
            self.inner.accept_drafts_keeping_blocks(seq, num_accepted)?,
        ))
    }

    /// The manager's `num_draft_tokens`, in the one-group shape.
    pub fn num_draft_tokens(&self, seq: SeqId) -> Result<usize> {
        self.inner.num_draft_tokens(seq)
    }

    /// The manager's `fork`, in the one-group shape.
    pub fn fork(&self, parent: SeqId, child: SeqId) -> Result<()> {
        self.inner.fork(parent, child)
    }

    /// The manager's `free`, in the one-group shape.
    pub fn free(&self, seq: SeqId) -> bool {
        self.inner.free(seq)
    }

    /// The manager's `preempt_recompute`, in the one-group shape.
    pub fn preempt_recompute(&self, seqs: &[SeqId]) -> Result<()> {
        self.inner.preempt_recompute(seqs)
    }

    /// The manager's `swap_out`, in the one-group shape.
    pub fn swap_out(&self, seqs: &[SeqId]) -> Result<Vec<(BlockId, BlockId)>> {
        self.inner.swap_out(seqs)
    }

    /// The manager's `swap_in`, in the one-group shape.
    pub fn swap_in(&self, seqs: &[SeqId]) -> Result<Vec<(BlockId, BlockId)>> {
        self.inner.swap_in(seqs)
    }

    /// The manager's `reset_prefix_cache`, in the one-group shape.
    pub fn reset_prefix_cache(&self) -> Result<()> {
        self.inner.reset_prefix_cache()
    }

    /// The manager's `block_table`, in the one-group shape.
    pub fn block_table(&self, seq: SeqId) -> Result<Vec<BlockId>> {
        Ok(first(self.inner.block_tables(seq)?))
    }

    /// The manager's `num_tokens`, in the one-group shape.
    pub fn num_tokens(&self, seq: SeqId) -> Result<usize> {
        self.inner.num_tokens(seq)
    }

    /// The manager's `num_computed_tokens`, in the one-group shape.
    pub fn num_computed_tokens(&self, seq: SeqId) -> Result<usize> {
        self.inner.num_computed_tokens(seq)
    }

    /// The manager's `status`, in the one-group shape.
    pub fn status(&self, seq: SeqId) -> Result<SeqStatus> {
        self.inner.status(seq)
    }

    /// The manager's `tokens`, in the one-group shape.
    pub fn tokens(&self, seq: SeqId) -> Result<Vec<u32>> {
        self.inner.tokens(seq)
    }

    /// The manager's `num_sequences`, in the one-group shape.
    pub fn num_sequences(&self) -> usize {
        self.inner.num_sequences()
    }

    /// The manager's `num_uncomputed_tokens`, in the one-group shape.
    pub fn num_uncomputed_tokens(&self, seqs: &[SeqId]) -> Result<Vec<i32>> {
        self.inner.num_uncomputed_tokens(seqs)
    }

    /// The manager's `num_blocks_owed`, in the one-group shape.
    pub fn num_blocks_owed(&self, seqs: &[SeqId]) -> Result<usize> {
        self.inner.num_blocks_owed(seqs)
    }

    /// One batched step with the default options.
    pub fn step(&self, req: &StepRequest) -> StepOutput {
        self.step_with_drafts(req, &StepDrafts::default(), StepOptions::default())
    }

    /// The manager's `step_with`, in the one-group shape.
    pub fn step_with(&self, req: &StepRequest, opts: StepOptions) -> StepOutput {
        self.step_with_drafts(req, &StepDrafts::default(), opts)
    }

    /// One batched step; the output's `G x ...` arrays are the one-group arrays as they are.
    pub fn step_with_drafts(
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
        self.inner.step_with(req, drafts, opts).into()
    }

    /// The manager's `take_host_transfers`, in the one-group shape.
    pub fn take_host_transfers(&self) -> HostTransfers {
        let t = self.inner.take_host_transfers();
        HostTransfers {
            stores: t.stores.into_iter().map(|(_, d, h)| (d, h)).collect(),
            loads: t.loads.into_iter().map(|(_, h, d)| (h, d)).collect(),
        }
    }

    /// The manager's `stats`, in the one-group shape.
    pub fn stats(&self) -> CacheStats {
        self.inner.stats()
    }

    /// The manager's `take_events`, in the one-group shape.
    pub fn take_events(&self) -> Vec<KvEvent> {
        self.inner
            .take_events()
            .into_iter()
            .map(|e| e.event)
            .collect()
    }

    /// The manager's `check_invariants`, in the one-group shape.
    pub fn check_invariants(&self) -> std::result::Result<(), String> {
        self.inner.check_invariants()
    }
}

/// Group 0's part of a per-group result.
fn first(mut per_group: Vec<Vec<BlockId>>) -> Vec<BlockId> {
    per_group.swap_remove(0)
}
