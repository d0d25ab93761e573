//! The KV cache manager: per-sequence block tables over a [`BlockPool`], prefix caching, slot
//! allocation, fork with copy-on-write, preemption by recompute or swap, and the batched
//! scheduler-step entry point, with speculative decoding's draft tokens (lookahead slots that
//! are written but never hashed until accepted).
//!
//! Algorithms: paged KV memory with block tables, reference-counted sharing and copy-on-write
//! (PagedAttention, Kwon et al., SOSP'23, §4.2–4.5); automatic prefix caching with chained
//! block hashes and the "always recompute the last token" cap, observable behaviour as vLLM V1
//! `KVCacheManager` (`get_computed_blocks`, `allocate_slots`, `free`) and `BlockPool`.
//!
//! Concurrency: every method takes one mutex over the per-sequence state (locking; the
//! [`crate::sync`] mutex, so loom models see it), then calls into the pool (whose own hot
//! paths are lock-free). Because all manager mutations of the pool happen under that mutex, a capacity check followed by the pool calls is
//! exact: the blocks a call predicts are the blocks it takes, and a call that fails does so
//! before touching the pool. Mutating the pool directly (through [`KvCacheManager::pool`]'s
//! methods) while the manager is in use breaks that guarantee; the pool reference is meant for
//! inspection.
//!
//! Units: token counts are `usize` tokens; block counts are `usize` blocks; block ids are
//! [`BlockId`]s (GPU ids `1..num_blocks`, CPU swap ids `0..num_cpu_blocks`).

use crate::error::{Error, Result};
use crate::events::{EventSink, KvEvent, Tier};
use crate::hashing::{BlockHash, ChainJob, ExtraKey, HashAlgo, PrefixHasher};
use crate::host_tier::{
    BlockMeta, HostEviction, HostKey, HostTier, HostTransfers, StoreOutcome, MAX_HOST_BLOCKS,
};
use crate::metrics::{CacheStats, ManagerCounters};
use crate::pool::BlockPool;
use crate::seq_table::{duplicate_id, SeqTable};
use crate::sync::Mutex;
use crate::{BlockId, SeqId, NULL_BLOCK};
use std::borrow::Cow;
use std::collections::{HashMap, HashSet};
use std::sync::Arc;

/// Largest supported block size in tokens.
pub const MAX_BLOCK_SIZE: u32 = 4096;

/// Configuration of a [`KvCacheManager`].
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
    /// Whether KV events are buffered for [`KvCacheManager::take_events`].
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
    /// until [`Self::validate`] / [`KvCacheManager::new`].
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
    /// exceeds [`MAX_HOST_BLOCKS`] or is set with prefix caching off (the host tier keys
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

/// A multimodal item embedded in a sequence's tokens: its content hash and the token range
/// `[start, start + len)` it occupies. Every full block overlapping the range gets an
/// [`ExtraKey::Multimodal`] key (item hash + start offset relative to the block), so two
/// prompts with the same placeholder tokens but different images never share cached KV.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct MmItem {
    /// Content hash of the item (any bytes, typically a SHA-256 of the pixels / audio).
    pub item_hash: Vec<u8>,
    /// Position, in tokens, of the item's first token in the sequence.
    pub start: u64,
    /// Number of tokens the item occupies (>= 1).
    pub len: u64,
}

/// Per-sequence inputs to prefix hashing.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct SequenceSpec {
    /// Keys mixed into the hash of every block of the sequence, in this order: model / adapter
    /// identity ([`ExtraKey::Adapter`]), cache salt ([`ExtraKey::CacheSalt`]), tagged keys.
    pub extra_keys: Vec<ExtraKey>,
    /// Multimodal items; each adds a per-block key to the blocks it overlaps (after
    /// `extra_keys`, in this list's order).
    pub mm_items: Vec<MmItem>,
}

impl SequenceSpec {
    /// Extra keys hashed into logical block `k` (tokens `k*block_size..(k+1)*block_size`): the
    /// sequence keys, then one [`ExtraKey::Multimodal`] per item overlapping the block (offset =
    /// item start minus block start). The manager and [`crate::kv_indexer`] both hash with this,
    /// so a router computes the same block hashes as the engines. O(keys + items).
    pub fn block_keys(&self, block_size: usize, k: usize) -> Cow<'_, [ExtraKey]> {
        if self.mm_items.is_empty() {
            return Cow::Borrowed(&self.extra_keys);
        }
        let (lo, hi) = ((k * block_size) as u64, ((k + 1) * block_size) as u64);
        let mut keys = self.extra_keys.clone();
        for item in self
            .mm_items
            .iter()
            .filter(|m| m.start < hi && m.start + m.len > lo)
        {
            keys.push(ExtraKey::Multimodal {
                item_hash: item.item_hash.clone(),
                offset: item.start as i64 - lo as i64,
            });
        }
        Cow::Owned(keys)
    }
}

/// Where a sequence's KV lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SeqStatus {
    /// On the GPU (possibly with no blocks yet, before the first allocation).
    Running,
    /// Preempted by recompute: no blocks, tokens kept, `num_computed_tokens == 0`.
    Preempted,
    /// Swapped out: the block table holds CPU swap-block ids.
    Swapped,
}

impl SeqStatus {
    /// Lower-case name used in error messages (`"running"`, `"preempted"`, `"swapped"`).
    pub fn name(self) -> &'static str {
        match self {
            SeqStatus::Running => "running",
            SeqStatus::Preempted => "preempted",
            SeqStatus::Swapped => "swapped",
        }
    }
}

/// The result of one [`KvCacheManager::allocate_slots`] call.
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
    /// until [`KvCacheManager::accept_drafts`].
    pub num_draft_tokens: usize,
}

/// Input of the batched [`KvCacheManager::step`]: one entry per sequence, processed in order.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StepRequest {
    /// Sequences to schedule.
    pub seq_ids: Vec<SeqId>,
    /// Per sequence, the most tokens to schedule (same length as `seq_ids`).
    pub num_new_tokens: Vec<u32>,
    /// CSR offsets into `append_tokens` (length `seq_ids.len() + 1`), or empty for no appends.
    pub append_indptr: Vec<u32>,
    /// Newly sampled tokens to append to each sequence before scheduling it.
    pub append_tokens: Vec<u32>,
}

/// Draft tokens of a speculative-decoding step ([`KvCacheManager::step_with_drafts`]), CSR
/// over the request's sequences: sequence `i` proposes
/// `tokens[indptr[i]..indptr[i + 1]]`. Empty `indptr` (the default) means no drafts.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StepDrafts {
    /// CSR offsets into `tokens` (length `seq_ids.len() + 1`), or empty for no drafts.
    pub indptr: Vec<u32>,
    /// Proposed (draft) token ids, not yet verified.
    pub tokens: Vec<u32>,
}

/// Output of [`KvCacheManager::step`], flat integer arrays ready to become kernel tensors.
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
    /// and must re-read the whole table ([`KvCacheManager::block_table`]); this is what
    /// [`crate::block_tables::BlockTables`] does.
    pub table_version: Vec<u64>,
    /// Length `S + 1`: CSR offsets into `table_delta`.
    pub table_delta_indptr: Vec<i32>,
    /// Per scheduled seq, its table entries from `table_start` to its end (block ids).
    pub table_delta: Vec<i32>,
}

/// Options of [`KvCacheManager::step_with`]. The default is what [`KvCacheManager::step`]
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

/// One sequence's bookkeeping.
#[derive(Debug, Clone)]
struct Sequence {
    tokens: Vec<u32>,
    spec: SequenceSpec,
    status: SeqStatus,
    /// Tokens whose KV is (scheduled to be) written.
    num_computed: usize,
    /// GPU block table (Running / Preempted) or CPU swap-block table (Swapped).
    blocks: Vec<BlockId>,
    /// Leading blocks of the table already registered in the prefix cache.
    num_cached_blocks: usize,
    /// Memo of the chained hashes of the first full blocks of `tokens` (tokens only grow, so a
    /// memoised hash stays valid).
    hashes: Vec<BlockHash>,
    /// Leading entries of `blocks` that a step output has reported and that have not changed
    /// since (the next step's table delta starts here).
    table_reported: usize,
    /// The version of its table the last step output reported (see
    /// [`StepOutput::table_version`]).
    table_version: u64,
    /// Its KV predates the last prefix-cache reset (it was swapped out then): none of its
    /// blocks is registered in the prefix cache until a recompute preemption computes the KV
    /// afresh (docs/design.md, "Invariants", 8).
    stale_kv: bool,
    /// Its first prefix-cache lookup has been counted in the hit-rate counters. Every later
    /// first allocation (a resume after a recompute preemption) finds its own blocks again and
    /// is not a new lookup (vLLM #25780); one preempted before its first allocation has not
    /// looked up yet, so its status alone cannot tell. A fork child inherits it.
    looked_up: bool,
    /// Draft tokens (speculative decoding) whose KV the last allocation gave slots at
    /// positions `num_computed..num_computed + drafts.len()`: never hashed, cached or
    /// announced; resolved by [`KvCacheManager::accept_drafts`].
    drafts: Vec<u32>,
    /// Trailing blocks past `ceil((num_computed + drafts) / block_size)` kept by
    /// [`KvCacheManager::accept_drafts_keeping_blocks`] for the next allocation (private,
    /// never hashed until computed tokens fill them).
    spare_blocks: usize,
}

impl Sequence {
    /// Notes that the table entries from logical block `k` on were rewritten (copy-on-write,
    /// preemption, swap, a fresh first allocation): the next delta must report them again.
    fn table_rewritten_from(&mut self, k: usize) {
        self.table_reported = self.table_reported.min(k);
    }
}

/// Simple locked CPU block pool for swap space: ref counts plus a LIFO free list.
#[derive(Debug, Clone)]
struct CpuPool {
    refs: Vec<u32>,
    free: Vec<BlockId>,
}

impl CpuPool {
    fn new(n: u32) -> Self {
        Self {
            refs: vec![0; n as usize],
            free: (0..n).rev().collect(),
        }
    }
    fn used(&self) -> usize {
        self.refs.len() - self.free.len()
    }
}

/// What an allocation would do; computed without side effects, then applied.
#[derive(Debug, Clone)]
struct Plan {
    first: bool,
    /// The prefix hit per logical block: a device block, or [`NULL_BLOCK`] where the hit is
    /// on host (the load's device block is allocated by the call).
    hits: Vec<BlockId>,
    /// Blocks the hits take from the free pool: free cached device hits and host hits (each
    /// loaded into a fresh block; `ref_count(NULL_BLOCK)` is 0, so they count alike).
    hits_free: usize,
    context: usize,
    q: usize,
    fresh: usize,
    cow: bool,
}

pub(crate) fn drafts_pending(seq_id: SeqId, operation: &'static str) -> Error {
    Error::InvalidSequenceState {
        seq_id,
        state: "running with pending draft tokens",
        operation,
        expected: "without them (call accept_drafts first)",
    }
}

impl Plan {
    fn blocks_taken(&self) -> usize {
        self.hits_free + self.fresh + usize::from(self.cow)
    }
}

#[derive(Debug)]
struct State {
    seqs: SeqTable<Sequence>,
    cpu: CpuPool,
    /// The prefix cache's host tier (`None` with `num_host_blocks == 0`). Each planned load
    /// holds one extra reference on its device block until it is handed out, so the block
    /// is not reused before the executor has filled it.
    host: Option<Box<HostTier>>,
    counters: ManagerCounters,
    /// The highest table version any step output has carried: a new sequence's versions
    /// continue above it, so a reused id never repeats a version.
    table_versions: u64,
}

/// The paged KV cache manager. `Send + Sync`; every method locks one mutex over the
/// per-sequence state (see the module docs).
#[derive(Debug)]
pub struct KvCacheManager {
    cfg: CacheConfig,
    hasher: PrefixHasher,
    events: Arc<EventSink>,
    pool: BlockPool,
    state: Mutex<State>,
}

fn unknown(seq_id: SeqId) -> Error {
    Error::UnknownSequence { seq_id }
}

fn bad_state(
    seq_id: SeqId,
    status: SeqStatus,
    operation: &'static str,
    expected: &'static str,
) -> Error {
    Error::InvalidSequenceState {
        seq_id,
        state: status.name(),
        operation,
        expected,
    }
}

impl KvCacheManager {
    /// A manager over a fresh pool of `cfg.num_blocks` blocks. Errors: [`Error::InvalidConfig`]
    /// (see [`CacheConfig::validate`]). O(num_blocks + num_cpu_blocks).
    pub fn new(cfg: CacheConfig) -> Result<Self> {
        cfg.validate()?;
        let events = Arc::new(EventSink::new(cfg.enable_events));
        let pool = BlockPool::new(cfg.num_blocks, events.clone())?;
        let hasher = PrefixHasher::new(cfg.hash_algo, &cfg.hash_seed);
        let host = match cfg.num_host_blocks {
            0 => None,
            n => Some(Box::new(HostTier::new(
                n,
                cfg.host_admission_min_seen,
                cfg.host_eviction,
                cfg.num_blocks,
                cfg.enable_events,
            )?)),
        };
        let state = State {
            seqs: SeqTable::default(),
            cpu: CpuPool::new(cfg.num_cpu_blocks),
            host,
            counters: ManagerCounters::default(),
            table_versions: 0,
        };
        Ok(Self {
            cfg,
            hasher,
            events,
            pool,
            state: Mutex::new(state),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &CacheConfig {
        &self.cfg
    }

    /// The prefix hasher (algorithm + seed) this manager hashes blocks with.
    pub fn hasher(&self) -> &PrefixHasher {
        &self.hasher
    }

    /// The underlying block pool, for inspection (ref counts, hashes, free queue).
    pub fn pool(&self) -> &BlockPool {
        &self.pool
    }

    /// Registers a sequence with its prompt (finalized tokens, no blocks yet). Errors:
    /// [`Error::SequenceExists`]; [`Error::InvalidArgument`] for an empty prompt or a
    /// multimodal item with `len == 0` or an overflowing range. O(len(prompt)): the prompt is
    /// copied ([`Self::add_sequence_owned`] keeps a `Vec` without a copy).
    pub fn add_sequence(&self, seq: SeqId, prompt: &[u32], spec: SequenceSpec) -> Result<()> {
        self.add_sequence_owned(seq, prompt.to_vec(), spec)
    }

    /// [`Self::add_sequence`] taking the prompt buffer itself: it becomes the sequence's token
    /// buffer, so a caller that built it (the Python binding converting a numpy prompt) pays no
    /// second copy. Same errors, and a refused prompt is dropped.
    pub fn add_sequence_owned(
        &self,
        seq: SeqId,
        prompt: Vec<u32>,
        spec: SequenceSpec,
    ) -> Result<()> {
        validate_new_sequence(&prompt, &spec)?;
        let mut st = self.state.lock();
        if st.seqs.contains_key(&seq) {
            return Err(Error::SequenceExists { seq_id: seq });
        }
        let table_version = st.table_versions;
        st.seqs.insert(
            seq,
            Sequence {
                tokens: prompt,
                spec,
                status: SeqStatus::Running,
                num_computed: 0,
                blocks: Vec::new(),
                num_cached_blocks: 0,
                hashes: Vec::new(),
                table_reported: 0,
                table_version,
                stale_kv: false,
                looked_up: false,
                drafts: Vec::new(),
                spare_blocks: 0,
            },
        );
        Ok(())
    }

    /// Appends newly sampled (finalized) tokens; allowed in every state. Errors:
    /// [`Error::UnknownSequence`]; [`Error::InvalidSequenceState`] while draft tokens are
    /// pending (they would sit between the old tokens and the new ones). O(len(tokens)).
    pub fn append_tokens(&self, seq: SeqId, tokens: &[u32]) -> Result<()> {
        let mut st = self.state.lock();
        let s = st.seqs.get_mut(&seq).ok_or_else(|| unknown(seq))?;
        if !s.drafts.is_empty() {
            return Err(drafts_pending(seq, "append_tokens"));
        }
        s.tokens.extend_from_slice(tokens);
        Ok(())
    }

    /// Tokens that would be served from the prefix cache if `seq` were allocated now from
    /// scratch: the longest chain of cached full blocks, stopping at the first miss, capped at
    /// `num_tokens - 1` so the last token is always recomputed (its logits are needed). A
    /// multiple of `block_size`; 0 with prefix caching off. With a host tier the chain
    /// continues past the device hits into it (those blocks would be loaded, not recomputed).
    /// No observable side effects (block hashes are memoised). Errors: [`Error::UnknownSequence`]. O(hit blocks + 1) lookups,
    /// plus hashing of blocks not hashed before.
    pub fn lookup_prefix(&self, seq: SeqId) -> Result<usize> {
        let mut guard = self.state.lock();
        let st = &mut *guard;
        let s = st.seqs.get_mut(&seq).ok_or_else(|| unknown(seq))?;
        Ok(self.find_hits(s, st.host.as_deref()).len() * self.bs())
    }

    /// Exactly the number of blocks the next [`Self::allocate_slots`]`(seq, num_new_tokens)`
    /// would take from the free pool: fresh blocks, plus prefix hits on free (ref 0) cached
    /// blocks, plus one device block per host-tier hit (its load's destination), plus one if
    /// a copy-on-write is needed. Errors as `allocate_slots` except `OutOfBlocks`. No
    /// side effects. O(blocks of the sequence).
    pub fn num_blocks_needed(&self, seq: SeqId, num_new_tokens: usize) -> Result<usize> {
        let mut guard = self.state.lock();
        let st = &mut *guard;
        let s = st.seqs.get_mut(&seq).ok_or_else(|| unknown(seq))?;
        Ok(self
            .plan(seq, s, num_new_tokens, 0, st.host.as_deref())?
            .blocks_taken())
    }

    /// Schedules `q = min(num_new_tokens, num_tokens - num_computed)` tokens of `seq` and
    /// makes room for their KV.
    ///
    /// On the first allocation of a sequence (no blocks, nothing computed: new or preempted
    /// by recompute) the cached prefix is taken first ([`Self::lookup_prefix`]); a host-tier
    /// hit gets a fresh device block, listed in `new_block_ids`, and a planned load handed out
    /// with the next step ([`StepOutput::host_loads`], docs/design.md, "Host tier"). Blocks are
    /// added for `num_computed + q` slots; a partially filled last block shared with another
    /// sequence (ref > 1) is replaced by a private block and one `(src, dst)` copy is planned
    /// (full shared blocks are never copied). Then `num_computed += q` and every block now full
    /// of computed tokens is hashed and registered in the prefix cache (emitting
    /// [`KvEvent::BlockStored`]). A preempted sequence becomes running.
    ///
    /// Errors (state unchanged, bit for bit): [`Error::UnknownSequence`];
    /// [`Error::InvalidSequenceState`] for a swapped-out sequence; [`Error::InvalidArgument`]
    /// for `num_new_tokens == 0` or when no token is left to compute;
    /// [`Error::OutOfBlocks`] `{requested: blocks the call needs, available: free blocks}`.
    /// O(new blocks + blocks of the sequence) plus hashing of newly full blocks.
    pub fn allocate_slots(&self, seq: SeqId, num_new_tokens: usize) -> Result<SlotAllocation> {
        let mut guard = self.state.lock();
        let st = &mut *guard;
        let s = st.seqs.get_mut(&seq).ok_or_else(|| unknown(seq))?;
        let host = st.host.as_deref_mut();
        self.allocate_locked(seq, s, &mut st.counters, host, num_new_tokens, &[])
    }

    /// Speculative decoding's verify step: [`Self::allocate_slots`] plus lookahead slots for
    /// `draft_tokens` (k proposed tokens) right after the scheduled ones, in the same call.
    /// The drafts' KV is written at positions `num_computed .. num_computed + k` but they are
    /// not tokens of the sequence: nothing is hashed, cached or announced for them, and the
    /// sequence stays pending until [`Self::accept_drafts`] says how many were accepted.
    /// With no drafts this is `allocate_slots`.
    ///
    /// Errors (state unchanged): those of `allocate_slots` (`OutOfBlocks` counts the
    /// lookahead blocks too); [`Error::InvalidArgument`] (`draft_tokens`) when the scheduled
    /// tokens do not reach the sequence's last token (drafts follow it);
    /// [`Error::InvalidSequenceState`] when drafts are pending already. O(blocks + k).
    pub fn allocate_slots_with_drafts(
        &self,
        seq: SeqId,
        num_new_tokens: usize,
        draft_tokens: &[u32],
    ) -> Result<SlotAllocation> {
        let mut guard = self.state.lock();
        let st = &mut *guard;
        let s = st.seqs.get_mut(&seq).ok_or_else(|| unknown(seq))?;
        let host = st.host.as_deref_mut();
        self.allocate_locked(seq, s, &mut st.counters, host, num_new_tokens, draft_tokens)
    }

    /// Resolves the pending drafts of `seq` after verification: the first `num_accepted`
    /// (`m <= k`) become tokens of the sequence with their KV computed (the token the verify
    /// step samples after them is appended as usual, by [`Self::append_tokens`] or the next
    /// step); the rejected tail's slots are free for the next step, and every block that held
    /// only rejected drafts is released (tail-first; they were never hashed). Blocks now full
    /// of accepted tokens are hashed and cached (emitting [`KvEvent::BlockStored`]), exactly as
    /// if those tokens had been decoded one by one. Returns the released block ids, in
    /// release order.
    ///
    /// Errors (state unchanged): [`Error::UnknownSequence`]; [`Error::InvalidSequenceState`]
    /// when the sequence has no pending drafts; [`Error::InvalidArgument`] (`num_accepted`)
    /// for more accepted than proposed. O(k + released blocks) plus hashing of filled blocks.
    pub fn accept_drafts(&self, seq: SeqId, num_accepted: usize) -> Result<Vec<BlockId>> {
        self.accept_drafts_with(seq, num_accepted, true)
    }

    /// [`Self::accept_drafts`] that keeps the blocks which held only rejected drafts in the
    /// sequence's table, as spare lookahead blocks the next allocations fill before taking
    /// fresh ones: for a consumer whose copy of the block table only grows while a request
    /// runs (vLLM's model runner appends the new blocks of each step), where a released block
    /// would leave a stale entry behind. Nothing is released (the result is empty); spare
    /// blocks are private and unhashed, a fork does not share them, and preemption or free
    /// releases them with the rest. Same errors.
    pub fn accept_drafts_keeping_blocks(
        &self,
        seq: SeqId,
        num_accepted: usize,
    ) -> Result<Vec<BlockId>> {
        self.accept_drafts_with(seq, num_accepted, false)
    }

    fn accept_drafts_with(
        &self,
        seq: SeqId,
        num_accepted: usize,
        release: bool,
    ) -> Result<Vec<BlockId>> {
        let mut guard = self.state.lock();
        let st = &mut *guard;
        let s = st.seqs.get_mut(&seq).ok_or_else(|| unknown(seq))?;
        validate_accept(seq, s.status, s.drafts.len(), num_accepted)?;
        let keep = (s.num_computed + num_accepted).div_ceil(self.bs());
        let released: Vec<BlockId> = if release {
            s.blocks[keep..].iter().rev().copied().collect()
        } else {
            Vec::new()
        };
        if !released.is_empty() {
            // Cannot fail: lookahead blocks are private (ref 1) and held by this sequence.
            self.pool.free(&released)?;
        }
        let drafts = std::mem::take(&mut s.drafts);
        s.tokens.extend_from_slice(&drafts[..num_accepted]);
        s.num_computed += num_accepted;
        if release {
            s.blocks.truncate(keep);
            s.table_rewritten_from(keep);
        }
        s.spare_blocks = s.blocks.len() - keep;
        self.cache_full_blocks(s, st.host.as_deref_mut(), 0);
        Ok(released)
    }

    /// Draft tokens pending on `seq` (0 unless its last allocation had drafts that
    /// [`Self::accept_drafts`] has not resolved). Errors: [`Error::UnknownSequence`]. O(1).
    pub fn num_draft_tokens(&self, seq: SeqId) -> Result<usize> {
        let st = self.state.lock();
        Ok(st.seqs.get(&seq).ok_or_else(|| unknown(seq))?.drafts.len())
    }

    /// Forks `parent` into a new sequence `child` (parallel sampling, beam search): the child
    /// gets a copy of the parent's tokens, spec, computed count and block table, and every
    /// block's ref count goes up by one. Allocates nothing. Errors: [`Error::UnknownSequence`]
    /// (parent), [`Error::SequenceExists`] (child), [`Error::InvalidSequenceState`] for a
    /// swapped-out parent. O(tokens + blocks of the parent).
    pub fn fork(&self, parent: SeqId, child: SeqId) -> Result<()> {
        let mut st = self.state.lock();
        let p = st.seqs.get(&parent).ok_or_else(|| unknown(parent))?;
        if p.status == SeqStatus::Swapped {
            return Err(bad_state(parent, p.status, "fork", "running or preempted"));
        }
        if !p.drafts.is_empty() {
            return Err(drafts_pending(parent, "fork"));
        }
        if st.seqs.contains_key(&child) {
            return Err(Error::SequenceExists { seq_id: child });
        }
        let mut c = p.clone();
        // Spare lookahead blocks stay the parent's: the child's table ends with its tokens.
        c.blocks.truncate(c.blocks.len() - c.spare_blocks);
        c.spare_blocks = 0;
        // The child's table is new to every consumer of step outputs.
        c.table_reported = 0;
        c.table_version = st.table_versions;
        if !c.blocks.is_empty() {
            self.pool.incref(&c.blocks)?;
        }
        st.seqs.insert(child, c);
        Ok(())
    }

    /// Frees `seq` and forgets it: its blocks are released tail-first (so the deepest block of
    /// a cached chain becomes the first eviction candidate; cached blocks keep their hashes),
    /// CPU swap blocks are returned. Idempotent: returns `false` (and does nothing) for an
    /// unknown or already freed sequence. O(blocks of the sequence).
    pub fn free(&self, seq: SeqId) -> bool {
        let mut guard = self.state.lock();
        let st = &mut *guard;
        let Some(s) = st.seqs.remove(&seq) else {
            return false;
        };
        match s.status {
            SeqStatus::Swapped => cpu_release(&mut st.cpu, &s.blocks),
            _ => {
                let tail_first: Vec<BlockId> = s.blocks.iter().rev().copied().collect();
                if !tail_first.is_empty() {
                    // Cannot fail: the manager holds exactly these references.
                    let freed = self.pool.free(&tail_first);
                    debug_assert!(freed.is_ok(), "{freed:?}");
                }
            }
        }
        true
    }

    /// Preemption by recompute of a group of sequences, all-or-nothing: each releases its
    /// blocks tail-first (hashes stay, so the resumed prefill often hits its own prefix), keeps
    /// its tokens and restarts at `num_computed = 0`; the resumed prefill covers prompt plus all
    /// generated tokens. Already preempted sequences are left as they are. Errors (nothing
    /// changed): [`Error::UnknownSequence`], [`Error::InvalidArgument`] for a duplicate id,
    /// [`Error::InvalidSequenceState`] for a swapped-out sequence. O(blocks of the group).
    pub fn preempt_recompute(&self, seqs: &[SeqId]) -> Result<()> {
        let mut guard = self.state.lock();
        let st = &mut *guard;
        check_group(
            st,
            seqs,
            "preempt_recompute",
            |s| s != SeqStatus::Swapped,
            "running or preempted",
        )?;
        let mut tail_first = Vec::new();
        for id in seqs {
            tail_first.extend(st.seqs[id].blocks.iter().rev().copied());
        }
        if !tail_first.is_empty() {
            self.pool.free(&tail_first)?;
        }
        for id in seqs {
            let s = st.seqs.get_mut(id).expect("validated");
            if s.status == SeqStatus::Running {
                st.counters.preemptions += 1;
            }
            s.blocks.clear();
            s.spare_blocks = 0;
            s.table_rewritten_from(0);
            s.num_computed = 0;
            s.num_cached_blocks = 0;
            s.status = SeqStatus::Preempted;
            s.drafts.clear(); // their lookahead blocks went with the rest
            s.stale_kv = false; // its KV is computed again on resume
        }
        Ok(())
    }

    /// Swap preemption of a group: plans each distinct GPU block of the group's tables once
    /// onto a CPU swap block (group-internal sharing is kept as CPU ref counts), releases the
    /// GPU blocks tail-first and marks the sequences swapped. Returns the `(gpu, cpu)` copy
    /// plan in order of first appearance (sequence order, then table order).
    ///
    /// All-or-nothing. Errors: [`Error::UnknownSequence`]; [`Error::InvalidArgument`] for a
    /// duplicate id; [`Error::InvalidSequenceState`] unless every sequence is running;
    /// [`Error::OutOfSwapSpace`] `{requested: distinct blocks, available: free CPU blocks}`.
    /// O(blocks of the group).
    pub fn swap_out(&self, seqs: &[SeqId]) -> Result<Vec<(BlockId, BlockId)>> {
        let mut guard = self.state.lock();
        let st = &mut *guard;
        check_group(st, seqs, "swap_out", |s| s == SeqStatus::Running, "running")?;
        if let Some(&id) = seqs.iter().find(|id| !st.seqs[id].drafts.is_empty()) {
            return Err(drafts_pending(id, "swap_out"));
        }
        let mut order: Vec<BlockId> = Vec::new();
        let mut uses: HashMap<BlockId, u32> = HashMap::new();
        for id in seqs {
            for &b in &st.seqs[id].blocks {
                let n = uses.entry(b).or_insert(0);
                if *n == 0 {
                    order.push(b);
                }
                *n += 1;
            }
        }
        if order.len() > st.cpu.free.len() {
            return Err(Error::OutOfSwapSpace {
                requested: order.len(),
                available: st.cpu.free.len(),
            });
        }
        let mut tail_first = Vec::new();
        for id in seqs {
            tail_first.extend(st.seqs[id].blocks.iter().rev().copied());
        }
        if !tail_first.is_empty() {
            self.pool.free(&tail_first)?;
        }
        let mut map: HashMap<BlockId, BlockId> = HashMap::with_capacity(order.len());
        let mut plan = Vec::with_capacity(order.len());
        for &g in &order {
            let c = st.cpu.free.pop().expect("capacity checked");
            st.cpu.refs[c as usize] = uses[&g];
            map.insert(g, c);
            plan.push((g, c));
        }
        for id in seqs {
            let s = st.seqs.get_mut(id).expect("validated");
            s.blocks = s.blocks.iter().map(|b| map[b]).collect();
            s.table_rewritten_from(0);
            s.num_cached_blocks = 0;
            s.status = SeqStatus::Swapped;
        }
        st.counters.swaps_out_blocks += order.len() as u64;
        st.counters.preemptions += seqs.len() as u64;
        Ok(plan)
    }

    /// Brings a swapped-out group back: takes one fresh GPU block per distinct CPU block of the
    /// group (sharing kept as GPU ref counts), returns the CPU blocks and re-registers the
    /// full computed blocks in the prefix cache, unless the prefix cache was reset while they
    /// were out (their KV predates the reset: see [`Self::reset_prefix_cache`]). Returns the
    /// `(cpu, gpu)` copy plan in order of first appearance.
    ///
    /// All-or-nothing. Errors: [`Error::UnknownSequence`]; [`Error::InvalidArgument`] for a
    /// duplicate id; [`Error::InvalidSequenceState`] unless every sequence is swapped;
    /// [`Error::OutOfBlocks`] `{requested: distinct blocks, available}`. O(blocks of the group).
    pub fn swap_in(&self, seqs: &[SeqId]) -> Result<Vec<(BlockId, BlockId)>> {
        let mut guard = self.state.lock();
        let st = &mut *guard;
        check_group(st, seqs, "swap_in", |s| s == SeqStatus::Swapped, "swapped")?;
        let mut order: Vec<BlockId> = Vec::new();
        let mut seen: HashSet<BlockId> = HashSet::new();
        let mut extra_refs: Vec<BlockId> = Vec::new();
        for id in seqs {
            for &c in &st.seqs[id].blocks {
                if seen.insert(c) {
                    order.push(c);
                } else {
                    extra_refs.push(c);
                }
            }
        }
        let gpu = if order.is_empty() {
            Vec::new()
        } else {
            self.allocate_storing(order.len(), st.host.as_deref_mut())?
        };
        let map: HashMap<BlockId, BlockId> =
            order.iter().copied().zip(gpu.iter().copied()).collect();
        if !extra_refs.is_empty() {
            let extra: Vec<BlockId> = extra_refs.iter().map(|c| map[c]).collect();
            self.pool.incref(&extra)?;
        }
        for id in seqs {
            let s = st.seqs.get_mut(id).expect("validated");
            cpu_release(&mut st.cpu, &s.blocks);
            s.blocks = s.blocks.iter().map(|c| map[c]).collect();
            s.table_rewritten_from(0);
            s.num_cached_blocks = 0;
            s.status = SeqStatus::Running;
            // Re-registered, not recomputed: not a new use for the host tier's admission.
            self.cache_full_blocks(s, st.host.as_deref_mut(), usize::MAX);
        }
        if let Some(host) = st.host.as_deref_mut() {
            // Their KV arrives by the swap-in copy, run after the next step call's stores.
            for &d in &gpu {
                host.note_copied_in(d);
            }
        }
        st.counters.swaps_in_blocks += order.len() as u64;
        Ok(order.into_iter().zip(gpu).collect())
    }

    /// Drops every prefix-cache entry (emitting [`KvEvent::AllBlocksCleared`]), those of
    /// blocks swapped out to the CPU pool included: a swapped-out sequence's KV predates the
    /// reset, so after its swap-in none of its blocks is registered or announced (not even
    /// the blocks it fills later, whose parents are not cached) until a recompute preemption
    /// computes its KV again. The host tier is cleared too (one `AllBlocksCleared` covers
    /// both tiers); host blocks pinned by loads become free when their loads are released.
    /// Errors: [`Error::CacheInUse`] while any GPU block is referenced, a planned host load's
    /// destination included until the next step hands it out (nothing changed).
    /// O(num_blocks + num_host_blocks + sequences).
    pub fn reset_prefix_cache(&self) -> Result<()> {
        let mut guard = self.state.lock();
        self.pool.reset_prefix_cache()?;
        if let Some(host) = guard.host.as_deref_mut() {
            host.clear();
        }
        for s in guard.seqs.values_mut() {
            if s.status == SeqStatus::Swapped && s.num_computed > 0 {
                s.stale_kv = true;
            }
        }
        Ok(())
    }

    /// The sequence's block table: GPU block ids for running / preempted (empty) sequences, CPU
    /// swap-block ids for swapped ones. Errors: [`Error::UnknownSequence`]. O(blocks).
    pub fn block_table(&self, seq: SeqId) -> Result<Vec<BlockId>> {
        Ok(self
            .state
            .lock()
            .seqs
            .get(&seq)
            .ok_or_else(|| unknown(seq))?
            .blocks
            .clone())
    }

    /// Known (finalized) tokens of the sequence: prompt + appended. Errors:
    /// [`Error::UnknownSequence`]. O(1).
    pub fn num_tokens(&self, seq: SeqId) -> Result<usize> {
        Ok(self
            .state
            .lock()
            .seqs
            .get(&seq)
            .ok_or_else(|| unknown(seq))?
            .tokens
            .len())
    }

    /// Tokens whose KV has been scheduled (prefix hits included). Errors:
    /// [`Error::UnknownSequence`]. O(1).
    pub fn num_computed_tokens(&self, seq: SeqId) -> Result<usize> {
        Ok(self
            .state
            .lock()
            .seqs
            .get(&seq)
            .ok_or_else(|| unknown(seq))?
            .num_computed)
    }

    /// The sequence's status. Errors: [`Error::UnknownSequence`]. O(1).
    pub fn status(&self, seq: SeqId) -> Result<SeqStatus> {
        Ok(self
            .state
            .lock()
            .seqs
            .get(&seq)
            .ok_or_else(|| unknown(seq))?
            .status)
    }

    /// The sequence's token ids. Errors: [`Error::UnknownSequence`]. O(tokens).
    pub fn tokens(&self, seq: SeqId) -> Result<Vec<u32>> {
        Ok(self
            .state
            .lock()
            .seqs
            .get(&seq)
            .ok_or_else(|| unknown(seq))?
            .tokens
            .clone())
    }

    /// Number of registered sequences. O(1).
    pub fn num_sequences(&self) -> usize {
        self.state.lock().seqs.len()
    }

    /// Per sequence, in order: tokens known but not yet scheduled, `num_tokens -
    /// num_computed_tokens` (in every state; a preempted sequence owes all of its tokens).
    /// `i32` like the step's other per-sequence lengths (the scheduler's numpy `int32`).
    /// Errors: [`Error::UnknownSequence`] for the first unknown id. O(len(seqs)).
    pub fn num_uncomputed_tokens(&self, seqs: &[SeqId]) -> Result<Vec<i32>> {
        let st = self.state.lock();
        seqs.iter()
            .map(|id| {
                let s = st.seqs.get(id).ok_or_else(|| unknown(*id))?;
                Ok((s.tokens.len() - s.num_computed) as i32)
            })
            .collect()
    }

    /// Device blocks a group of sequences still has to take from the free pool so that every
    /// known token of every member has a KV slot: what scheduling all of their uncomputed
    /// tokens now, in the given order, would take (fresh blocks, prefix hits on free cached
    /// blocks, copy-on-write copies), with the group's own sharing counted once: a cached block
    /// touched by an earlier member, or a full block an earlier member would register, costs a
    /// later member nothing; a host-tier hit costs the device block it is loaded into. Swapped-out members count the distinct CPU blocks of their tables
    /// (what [`Self::swap_in`] takes). A scheduler reserves this for an admitted group
    /// (admission control) and for a swapped group before swapping it in. No side effects.
    ///
    /// Errors (nothing changed): [`Error::UnknownSequence`]; [`Error::InvalidArgument`] for an id
    /// listed twice. O(blocks of the group) plus hashing of full blocks not hashed before.
    pub fn num_blocks_owed(&self, seqs: &[SeqId]) -> Result<usize> {
        let mut guard = self.state.lock();
        let st = &mut *guard;
        check_group(st, seqs, "num_blocks_owed", |_| true, "any")?;
        let bs = self.bs();
        let caching = self.caching();
        let mut owed = 0;
        let mut swapped: HashSet<BlockId> = HashSet::new();
        // Effects of the earlier members: free cached blocks they touch, hashes they register,
        // references they drop from a shared last block by copying it.
        let mut touched: HashSet<BlockId> = HashSet::new();
        let mut registered: HashSet<BlockHash> = HashSet::new();
        let mut released: HashMap<BlockId, u32> = HashMap::new();
        for id in seqs {
            let s = st.seqs.get_mut(id).expect("validated");
            if s.status == SeqStatus::Swapped {
                swapped.extend(s.blocks.iter().copied());
                continue;
            }
            let len = s.tokens.len();
            if len == s.num_computed {
                continue;
            }
            let first = s.blocks.is_empty() && s.num_computed == 0;
            let held = if first {
                let mut hits = 0;
                if caching {
                    for k in 0..(len - 1) / bs {
                        let h = self.block_hash_at(s, k);
                        // A lookup prefers a copy in use: an earlier member's registered block
                        // (in use once it is scheduled) costs nothing, a free one costs a block.
                        if !registered.contains(&h) {
                            match self.pool.lookup(&h) {
                                Some(b) => {
                                    if self.pool.ref_count(b) == 0 && touched.insert(b) {
                                        owed += 1;
                                    }
                                }
                                // A host hit is loaded into a freshly allocated block.
                                None if st
                                    .host
                                    .as_ref()
                                    .is_some_and(|t| t.lookup(&HostKey::from(h)).is_some()) =>
                                {
                                    owed += 1;
                                }
                                None => break,
                            }
                        }
                        hits += 1;
                    }
                }
                hits
            } else {
                let last = s.blocks.last().copied();
                if let Some(b) = last.filter(|_| s.num_computed % bs != 0) {
                    let dropped = released.entry(b).or_insert(0);
                    if self.pool.ref_count(b) - *dropped > 1 {
                        *dropped += 1;
                        owed += 1;
                    }
                }
                s.blocks.len()
            };
            // Lookahead blocks of pending drafts may exceed what the finalized tokens need.
            owed += len.div_ceil(bs).saturating_sub(held);
            if caching && !s.stale_kv {
                for k in 0..len / bs {
                    registered.insert(self.block_hash_at(s, k));
                }
            }
        }
        Ok(owed + swapped.len())
    }

    /// One scheduler step in one call: for each sequence in order, append its new tokens (CSR
    /// slice of `append_tokens`) and [`Self::allocate_slots`] it; stop at the first failure,
    /// leaving that sequence unchanged (its appended tokens removed again) while the sequences
    /// before it keep their allocations. A malformed request (array lengths, CSR offsets, a
    /// sequence id given twice) is
    /// reported in `error` with nothing scheduled. O(total tokens scheduled + blocks of the
    /// scheduled sequences).
    pub fn step(&self, req: &StepRequest) -> StepOutput {
        self.step_with(req, StepOptions::default())
    }

    /// [`Self::step`] with [`StepOptions`] (e.g. without the dense block table).
    pub fn step_with(&self, req: &StepRequest, opts: StepOptions) -> StepOutput {
        self.step_with_drafts(req, &StepDrafts::default(), opts)
    }

    /// [`Self::step_with`] for speculative decoding: sequence `i` also gets lookahead slots for
    /// its draft tokens (`drafts`' CSR slice `i`), as [`Self::allocate_slots_with_drafts`]. Its
    /// query is then its scheduled tokens followed by the drafts (`query_start_loc`,
    /// `seq_lens`, `slot_mapping` and `input_ids` include them; `num_draft_tokens` says how
    /// many), and it stays pending until [`Self::accept_drafts`]. Malformed draft offsets are
    /// reported in `error` with nothing scheduled; a sequence whose drafts are refused stops
    /// the step like any failed allocation.
    pub fn step_with_drafts(
        &self,
        req: &StepRequest,
        drafts: &StepDrafts,
        opts: StepOptions,
    ) -> StepOutput {
        if self.cfg.num_host_blocks == 0 {
            return self.step_inner(req, drafts, opts);
        }
        // The executor has run the previous step's plans: blocks registered before now hold
        // their KV, and the loads handed out then are done.
        if let Some(host) = self.state.lock().host.as_mut() {
            host.begin_step();
        }
        let mut out = self.step_inner(req, drafts, opts);
        let mut guard = self.state.lock();
        if let Some(host) = guard.host.as_deref_mut() {
            host.release_in_flight();
            let HostTransfers { stores, loads } = self.hand_out(host);
            out.host_stores = stores
                .iter()
                .flat_map(|&(d, h)| [d as i32, h as i32])
                .collect();
            out.host_loads = loads
                .iter()
                .flat_map(|&(h, d)| [h as i32, d as i32])
                .collect();
        }
        out
    }

    /// The host-tier copies planned since the last hand-out, for a caller that allocates
    /// outside [`Self::step`] (which hands them out in [`StepOutput::host_stores`] /
    /// [`StepOutput::host_loads`]): stores as `(device, host)`, loads as `(host, device)`.
    /// The caller runs them in the step order (stores first, loads before the forward pass
    /// that reads the loaded blocks); the loads' host blocks stay pinned until the next step
    /// call returns. Empty without a host tier. O(plans).
    pub fn take_host_transfers(&self) -> HostTransfers {
        let mut guard = self.state.lock();
        match guard.host.as_deref_mut() {
            Some(host) => self.hand_out(host),
            None => HostTransfers::default(),
        }
    }

    fn step_inner(&self, req: &StepRequest, drafts: &StepDrafts, opts: StepOptions) -> StepOutput {
        // Sized for the common decode step (one token per sequence) so the hot loop rarely
        // reallocates; prefill chunks grow the token-indexed vectors as needed.
        let n = req.seq_ids.len();
        let mut out = StepOutput {
            query_start_loc: Vec::with_capacity(n + 1),
            new_block_indptr: Vec::with_capacity(n + 1),
            num_cached_tokens: Vec::with_capacity(n),
            context_lens: Vec::with_capacity(n),
            seq_lens: Vec::with_capacity(n),
            slot_mapping: Vec::with_capacity(if opts.skip_token_arrays { 0 } else { n }),
            input_ids: Vec::with_capacity(if opts.skip_token_arrays { 0 } else { n }),
            table_start: Vec::with_capacity(n),
            table_version: Vec::with_capacity(n),
            table_delta_indptr: Vec::with_capacity(n + 1),
            block_table_width: 1,
            ..Default::default()
        };
        out.query_start_loc.push(0);
        out.new_block_indptr.push(0);
        out.table_delta_indptr.push(0);
        if let Err(e) = validate_step(req).and_then(|()| validate_drafts(req, drafts)) {
            out.error = Some(e);
            return out;
        }
        let drafts_of = |i: usize| -> &[u32] {
            if drafts.indptr.is_empty() {
                &[]
            } else {
                &drafts.tokens[drafts.indptr[i] as usize..drafts.indptr[i + 1] as usize]
            }
        };
        let bs = self.bs();
        let mut guard = self.state.lock();
        let st = &mut *guard;
        // Resolve every id to its slot once; a sequence listed twice would get two overlapping
        // slot ranges in one step, so that is refused before anything is scheduled.
        let slots: Vec<Option<u32>> = req.seq_ids.iter().map(|&id| st.seqs.slot_of(id)).collect();
        if let Some(dup) = duplicate_id(&req.seq_ids, &slots, st.seqs.num_slots()) {
            out.error = Some(Error::InvalidArgument {
                arg: "seq_ids",
                value: dup.to_string(),
                reason: format!("sequence {dup} appears more than once in one step"),
            });
            return out;
        }
        // Size the token-indexed outputs once: a prefill of long prompts would otherwise grow
        // them by repeated doubling (copies and page faults inside the step).
        if !opts.skip_token_arrays {
            let mut max_tokens = 0usize;
            for (i, slot) in slots.iter().enumerate() {
                let Some(slot) = *slot else { break };
                let s = st.seqs.at_slot(slot);
                let appended = if req.append_indptr.is_empty() {
                    0
                } else {
                    (req.append_indptr[i + 1] - req.append_indptr[i]) as usize
                };
                max_tokens += (req.num_new_tokens[i] as usize)
                    .min((s.tokens.len() + appended).saturating_sub(s.num_computed))
                    + drafts_of(i).len();
            }
            out.slot_mapping.reserve(max_tokens);
            out.input_ids.reserve(max_tokens);
        }
        self.prehash_prompts(st, req, &slots);
        for (i, (&seq, &slot)) in req.seq_ids.iter().zip(&slots).enumerate() {
            let Some(slot) = slot else {
                out.error = Some(unknown(seq));
                break;
            };
            let s = st.seqs.at_slot_mut(slot);
            let old_len = s.tokens.len();
            if !req.append_indptr.is_empty() {
                let (a, b) = (
                    req.append_indptr[i] as usize,
                    req.append_indptr[i + 1] as usize,
                );
                s.tokens.extend_from_slice(&req.append_tokens[a..b]);
            }
            let alloc = match self.allocate_locked(
                seq,
                s,
                &mut st.counters,
                st.host.as_deref_mut(),
                req.num_new_tokens[i] as usize,
                drafts_of(i),
            ) {
                Ok(a) => a,
                Err(e) => {
                    s.tokens.truncate(old_len);
                    s.hashes.truncate(old_len / bs);
                    out.error = Some(e);
                    break;
                }
            };
            let ctx = alloc.num_context_tokens;
            let q_final = alloc.num_scheduled_tokens;
            // The query: the scheduled tokens, then the drafts in their lookahead slots.
            let q = q_final + alloc.num_draft_tokens;
            out.num_scheduled += 1;
            out.num_cached_tokens.push(alloc.num_cached_tokens as i32);
            if !drafts.indptr.is_empty() {
                out.num_draft_tokens.push(alloc.num_draft_tokens as i32);
            }
            out.query_start_loc.push(out.query_start_loc[i] + q as i32);
            out.context_lens.push(ctx as i32);
            out.seq_lens.push((ctx + q) as i32);
            if !opts.skip_token_arrays {
                // Block by block: each run of consecutive slots costs one division, not one per token.
                let mut pos = ctx;
                while pos < ctx + q {
                    let off = pos % bs;
                    let run = (bs - off).min(ctx + q - pos);
                    let base = i64::from(s.blocks[pos / bs]) * bs as i64 + off as i64;
                    out.slot_mapping.extend((0..run as i64).map(|j| base + j));
                    pos += run;
                }
                out.input_ids
                    .extend(s.tokens[ctx..ctx + q_final].iter().map(|&t| i64::from(t)));
                out.input_ids.extend(s.drafts.iter().map(|&t| i64::from(t)));
            }
            out.new_block_ids
                .extend(alloc.new_block_ids.iter().map(|&b| b as i32));
            out.new_block_indptr.push(out.new_block_ids.len() as i32);
            for (src, dst) in alloc.copies {
                out.copies.extend([src as i32, dst as i32]);
            }
            // The table delta: entries rewritten or added since this sequence's last report.
            let start = s.table_reported.min(s.blocks.len());
            s.table_version += 1;
            st.table_versions = st.table_versions.max(s.table_version);
            s.table_reported = s.blocks.len();
            out.table_start.push(start as i32);
            out.table_version.push(s.table_version);
            out.table_delta
                .extend(s.blocks[start..].iter().map(|&b| b as i32));
            out.table_delta_indptr.push(out.table_delta.len() as i32);
        }
        if opts.skip_block_table {
            out.block_table_width = 0;
            return out;
        }
        // The dense table, once the widest scheduled table is known (still under the lock).
        let scheduled = slots[..out.num_scheduled]
            .iter()
            .map(|s| s.expect("scheduled"));
        let width = scheduled
            .clone()
            .map(|slot| st.seqs.at_slot(slot).blocks.len())
            .max()
            .unwrap_or(0)
            .max(1);
        // Row by row, each entry written once (a zero-filled buffer written over would touch
        // every byte twice; for long, uneven contexts this table is most of a decode step).
        let mut dense = Vec::with_capacity(out.num_scheduled * width);
        for slot in scheduled {
            let blocks = &st.seqs.at_slot(slot).blocks;
            dense.extend(blocks.iter().map(|&b| b as i32));
            dense.resize(dense.len() + (width - blocks.len()), NULL_BLOCK as i32);
        }
        drop(guard);
        out.block_table = dense;
        out.block_table_width = width;
        out
    }

    /// A snapshot of usage and counters. O(blocks of running sequences) for `kv_utilization`.
    pub fn stats(&self) -> CacheStats {
        let st = self.state.lock();
        let bs = self.bs();
        // Fill of each distinct block over running sequences (fullest holder counts).
        let mut fill: HashMap<BlockId, usize> = HashMap::new();
        for s in st.seqs.values().filter(|s| s.status == SeqStatus::Running) {
            for (k, &b) in s.blocks.iter().enumerate() {
                let in_block = s.num_computed.saturating_sub(k * bs).min(bs);
                let e = fill.entry(b).or_insert(0);
                *e = (*e).max(in_block);
            }
        }
        let slots = fill.len() * bs;
        let kv_utilization = if slots == 0 {
            0.0
        } else {
            fill.values().sum::<usize>() as f64 / slots as f64
        };
        let used = self.pool.num_used();
        let c = st.counters;
        CacheStats {
            num_blocks: self.cfg.num_blocks,
            block_size: self.cfg.block_size,
            used,
            free: self.pool.num_free(),
            cached_free: self.pool.num_cached_free(),
            usage: used as f64 / self.pool.num_usable() as f64,
            kv_utilization,
            prefix_queries_tokens: c.prefix_queries_tokens,
            prefix_hits_tokens: c.prefix_hits_tokens,
            evictions: self.pool.counters().evictions,
            copies: c.copies,
            swaps_out_blocks: c.swaps_out_blocks,
            swaps_in_blocks: c.swaps_in_blocks,
            preemptions: c.preemptions,
            num_cpu_blocks: self.cfg.num_cpu_blocks,
            cpu_used: st.cpu.used(),
            num_host_blocks: self.cfg.num_host_blocks,
            host_used: st.host.as_deref().map_or(0, HostTier::num_used),
            host_hits_tokens: c.host_hits_tokens,
            host_stores_blocks: st.host.as_deref().map_or(0, |h| h.counters().stores),
            host_loads_blocks: st.host.as_deref().map_or(0, |h| h.counters().loads),
        }
    }

    /// The manager's running counters.
    pub fn counters(&self) -> ManagerCounters {
        self.state.lock().counters
    }

    /// Drains buffered KV events, oldest first (empty when events are disabled). Locking.
    pub fn take_events(&self) -> Vec<KvEvent> {
        self.events.drain()
    }

    /// Checks invariants 1–4 and 9 of docs/design.md: the pool's own (1–3), the host tier's
    /// (9, [`HostTier::check`]), plus: every GPU block's ref count equals the number of
    /// running sequences whose table holds it plus the planned host loads into it (so free + used + 1 ==
    /// num_blocks follows), tables never hold the null block and cover exactly
    /// `ceil(num_computed / block_size)` blocks, preempted sequences hold nothing, CPU ref
    /// counts match swapped tables, cached blocks carry the sequence's own chained hash, and
    /// chain closure (logical block k cached ⇒ block k-1 cached). With prefix caching off no
    /// block has a hash. Returns a message naming the first violation. O(num_blocks + blocks
    /// of all sequences).
    pub fn check_invariants(&self) -> std::result::Result<(), String> {
        let st = self.state.lock();
        self.pool.check_invariants()?;
        let bs = self.bs();
        let caching = self.cfg.enable_prefix_caching;
        let mut gpu_refs: HashMap<BlockId, u32> = HashMap::new();
        let mut cpu_refs = vec![0u32; st.cpu.refs.len()];
        if let Some(host) = st.host.as_deref() {
            let n = self.cfg.num_blocks;
            host.check(|d| d != NULL_BLOCK && d < n)?;
            // A planned load holds one reference on its destination, which carries the
            // loaded hash in the device prefix index.
            for &(h, d) in host.pending().1 {
                *gpu_refs.entry(d).or_insert(0) += 1;
                let key = host.key_of(h).map(|k| k.hash);
                if self.pool.block_hash(d) != key && key.is_some() {
                    return Err(format!(
                        "planned load ({h}, {d}): the device block does not carry the host block's hash"
                    ));
                }
            }
        }
        for (&id, s) in st.seqs.iter() {
            if s.num_computed > s.tokens.len() {
                return Err(format!(
                    "seq {id}: num_computed {} > num_tokens {}",
                    s.num_computed,
                    s.tokens.len()
                ));
            }
            match s.status {
                SeqStatus::Preempted | SeqStatus::Swapped if !s.drafts.is_empty() => {
                    return Err(format!("seq {id}: {} with pending drafts", s.status.name()));
                }
                SeqStatus::Preempted => {
                    if !s.blocks.is_empty() || s.num_computed != 0 {
                        return Err(format!(
                            "seq {id}: preempted but holds {} blocks",
                            s.blocks.len()
                        ));
                    }
                }
                SeqStatus::Swapped => {
                    for &c in &s.blocks {
                        let Some(r) = cpu_refs.get_mut(c as usize) else {
                            return Err(format!("seq {id}: CPU block {c} out of range"));
                        };
                        *r += 1;
                    }
                }
                SeqStatus::Running => {
                    let slots = s.num_computed + s.drafts.len();
                    if s.blocks.len() != slots.div_ceil(bs) + s.spare_blocks {
                        return Err(format!(
                            "seq {id}: {} blocks for {} computed tokens, {} drafts and {} spare blocks (block size {bs})",
                            s.blocks.len(),
                            s.num_computed,
                            s.drafts.len(),
                            s.spare_blocks
                        ));
                    }
                    if !s.drafts.is_empty() && s.num_computed != s.tokens.len() {
                        return Err(format!(
                            "seq {id}: drafts pending but {} of {} tokens computed",
                            s.num_computed,
                            s.tokens.len()
                        ));
                    }
                    // Lookahead blocks (only draft slots): private, never hashed.
                    for &b in &s.blocks[s.num_computed.div_ceil(bs).min(s.blocks.len())..] {
                        if self.pool.ref_count(b) != 1 || self.pool.block_hash(b).is_some() {
                            return Err(format!(
                                "seq {id}: lookahead block {b} is shared or hashed (ref {})",
                                self.pool.ref_count(b)
                            ));
                        }
                    }
                    let mut distinct = HashSet::new();
                    for (k, &b) in s.blocks.iter().enumerate() {
                        if b == NULL_BLOCK || b >= self.cfg.num_blocks {
                            return Err(format!(
                                "seq {id}: block table entry {k} is invalid block {b}"
                            ));
                        }
                        if !distinct.insert(b) {
                            return Err(format!("seq {id}: block {b} appears twice in its table"));
                        }
                        *gpu_refs.entry(b).or_insert(0) += 1;
                        let h = self.pool.block_hash(b);
                        if k > 0 && h.is_some() && self.pool.block_hash(s.blocks[k - 1]).is_none() {
                            return Err(format!(
                                "seq {id}: logical block {k} cached but block {} is not",
                                k - 1
                            ));
                        }
                        if caching && k < s.num_cached_blocks {
                            match (h, s.hashes.get(k)) {
                                (None, _) => {
                                    return Err(format!(
                                        "seq {id}: logical block {k} (block {b}) not cached"
                                    ))
                                }
                                (Some(h), Some(want)) if h != *want => {
                                    return Err(format!(
                                        "seq {id}: block {b} carries a foreign hash"
                                    ))
                                }
                                _ => {}
                            }
                        }
                    }
                    if s.stale_kv
                        && (s.num_cached_blocks != 0
                            || s.blocks.iter().any(|&b| self.pool.block_hash(b).is_some()))
                    {
                        return Err(format!(
                            "seq {id}: its KV predates the last reset but a block is cached"
                        ));
                    }
                    if caching && !s.stale_kv && s.num_cached_blocks != s.num_computed / bs {
                        return Err(format!(
                            "seq {id}: {} blocks cached, {} full computed blocks",
                            s.num_cached_blocks,
                            s.num_computed / bs
                        ));
                    }
                }
            }
        }
        for b in 0..self.cfg.num_blocks {
            let want = gpu_refs.get(&b).copied().unwrap_or(0);
            let got = self.pool.ref_count(b);
            if want != got {
                return Err(format!(
                    "block {b}: ref count {got}, held by {want} sequence(s)"
                ));
            }
            if !caching && self.pool.block_hash(b).is_some() {
                return Err(format!("block {b} has a hash with prefix caching off"));
            }
        }
        if cpu_refs != st.cpu.refs {
            return Err("CPU swap-block ref counts do not match swapped tables".into());
        }
        let cpu_free: HashSet<BlockId> = st.cpu.free.iter().copied().collect();
        if cpu_free.len() != st.cpu.free.len() {
            return Err("CPU free list holds a duplicate".into());
        }
        for (c, &r) in st.cpu.refs.iter().enumerate() {
            if (r == 0) != cpu_free.contains(&(c as BlockId)) {
                return Err(format!(
                    "CPU block {c}: ref {r} but free-list membership disagrees"
                ));
            }
        }
        Ok(())
    }

    // ---- internals -------------------------------------------------------------------------

    fn bs(&self) -> usize {
        self.cfg.block_size as usize
    }

    fn caching(&self) -> bool {
        self.cfg.enable_prefix_caching
    }

    /// Extra keys of logical block `k` (see [`SequenceSpec::block_keys`]).
    fn block_keys<'a>(&self, spec: &'a SequenceSpec, k: usize) -> Cow<'a, [ExtraKey]> {
        spec.block_keys(self.bs(), k)
    }

    /// Chained hash of full logical block `k` (memoised); requires `(k+1)*bs <= tokens`.
    fn block_hash_at(&self, s: &mut Sequence, k: usize) -> BlockHash {
        let bs = self.bs();
        // One allocation for the whole prompt, not a doubling per few blocks.
        s.hashes.reserve((k + 1).saturating_sub(s.hashes.len()));
        while s.hashes.len() <= k {
            let j = s.hashes.len();
            let keys = self.block_keys(&s.spec, j);
            let h = self
                .hasher
                .hash_block(s.hashes.last(), &s.tokens[j * bs..(j + 1) * bs], &keys);
            s.hashes.push(h);
        }
        s.hashes[k]
    }

    /// Hashes, ahead of the step's loop, the prompt blocks that the first allocations among
    /// `req`'s sequences will look up (what [`Self::find_hits`] hashes), two sequences at a
    /// time ([`PrefixHasher::extend_chains`]): only the memo of hashes changes, so the step
    /// itself behaves exactly as without it. Sequences with extra keys are left to the loop.
    /// Skipped unless at least two sequences ask for more than one token (a decode step).
    fn prehash_prompts(&self, st: &mut State, req: &StepRequest, slots: &[Option<u32>]) {
        let bs = self.bs();
        if !self.caching() || req.num_new_tokens.iter().filter(|&&n| n > 1).count() < 2 {
            return;
        }
        let mut taken: Vec<(u32, Vec<BlockHash>, usize)> = Vec::new();
        for (&slot, &n) in slots
            .iter()
            .map_while(|s| s.as_ref())
            .zip(&req.num_new_tokens)
        {
            let s = st.seqs.at_slot_mut(slot);
            let first = s.blocks.is_empty() && s.num_computed == 0;
            if n <= 1
                || !first
                || s.status == SeqStatus::Swapped
                || s.spec != SequenceSpec::default()
            {
                continue;
            }
            let want = (s.tokens.len() - 1) / bs;
            if s.hashes.len() < want {
                taken.push((slot, std::mem::take(&mut s.hashes), want));
            }
        }
        if taken.len() >= 2 {
            let seqs = &st.seqs;
            let mut jobs: Vec<ChainJob<'_>> = taken
                .iter_mut()
                .map(|(slot, hashes, want)| ChainJob {
                    hashes,
                    tokens: &seqs.at_slot(*slot).tokens,
                    want: *want,
                })
                .collect();
            self.hasher.extend_chains(bs, &mut jobs);
        }
        for (slot, hashes, _) in taken {
            st.seqs.at_slot_mut(slot).hashes = hashes;
        }
    }

    /// Longest chain of cached blocks for the sequence's tokens, capped at `num_tokens - 1`:
    /// per logical block a device hit, or with a host tier, where the device has none, a
    /// host hit (`NULL_BLOCK` in the first vector, `(block, host block)` in the second).
    fn find_hits(&self, s: &mut Sequence, host: Option<&HostTier>) -> Vec<BlockId> {
        let max_blocks = (s.tokens.len() - 1) / self.bs();
        if !self.caching() || max_blocks == 0 {
            return Vec::new();
        }
        // Hash every eligible block first (they are all hashed once computed anyway, and the
        // hashes are memoised), then resolve the chain under one pool lock hold.
        self.block_hash_at(s, max_blocks - 1);
        let mut hits = self.pool.lookup_chain(&s.hashes[..max_blocks]);
        if let Some(host) = host.filter(|_| hits.len() < max_blocks) {
            self.find_host_hits(&s.hashes[..max_blocks], &mut hits, host);
        }
        hits
    }

    /// Past the device chain `hits` of `hashes`: per block the device index first, then the
    /// host tier ([`NULL_BLOCK`] marks a host hit), until neither holds the hash. Out of
    /// line: without a host tier the hot path never comes here.
    #[cold]
    #[inline(never)]
    fn find_host_hits(&self, hashes: &[BlockHash], hits: &mut Vec<BlockId>, host: &HostTier) {
        for h in &hashes[hits.len()..] {
            if let Some(b) = self.pool.lookup(h) {
                hits.push(b);
            } else if host.lookup(&HostKey::from(*h)).is_some() {
                hits.push(NULL_BLOCK);
            } else {
                break;
            }
        }
    }

    /// The host hits of a first allocation's plan: `(logical block, host block)` for each
    /// [`NULL_BLOCK`] entry of `hits` (looked up again under the same lock as the plan).
    #[cold]
    #[inline(never)]
    fn host_hits_of(
        hits: &[BlockId],
        hashes: &[BlockHash],
        host: &HostTier,
    ) -> Vec<(usize, BlockId)> {
        hits.iter()
            .enumerate()
            .filter(|(_, &b)| b == NULL_BLOCK)
            .map(|(k, _)| {
                let key = HostKey::from(hashes[k]);
                (k, host.lookup(&key).expect("planned host hit"))
            })
            .collect()
    }

    /// Allocates `n` device blocks; with a host tier, the cached blocks the allocation
    /// evicts are offered to it for a store first ([`Self::store_evicted`]).
    fn allocate_storing(&self, n: usize, host: Option<&mut HostTier>) -> Result<Vec<BlockId>> {
        let Some(host) = host else {
            return self.pool.allocate(n);
        };
        let mut out = Vec::new();
        let mut evicted = Vec::new();
        self.pool
            .allocate_into_reporting(n, &mut out, &mut evicted)?;
        for (d, hash) in evicted {
            self.store_evicted(host, d, hash);
        }
        Ok(out)
    }

    /// Offers the device block `d`, whose hash `hash` the pool just evicted (its last device
    /// copy), to the host tier, and emits the host tier's events: `BlockRemoved` for a host
    /// block evicted to make room, `BlockStored` for the store.
    fn store_evicted(&self, host: &mut HostTier, d: BlockId, hash: BlockHash) {
        let key = HostKey::from(hash);
        let out = host.plan_store(d, key);
        if !self.events.enabled() {
            return;
        }
        let root = self.hasher.root();
        for e in host_store_events(host, &out, key, self.cfg.block_size, root) {
            self.events.push(e);
        }
    }

    /// Hands out the host tier's planned copies and drops the references the loads held on
    /// their device blocks (the executor fills them before anything later can reuse them).
    fn hand_out(&self, host: &mut HostTier) -> HostTransfers {
        hand_out_host_plans(&self.pool, host).0
    }

    fn plan(
        &self,
        seq: SeqId,
        s: &mut Sequence,
        num_new_tokens: usize,
        num_drafts: usize,
        host: Option<&HostTier>,
    ) -> Result<Plan> {
        if s.status == SeqStatus::Swapped {
            return Err(bad_state(
                seq,
                s.status,
                "allocate_slots",
                "running or preempted (swap it in first)",
            ));
        }
        // Lookahead only: no token scheduled, slots for drafts after the computed ones (an
        // asynchronous scheduler's slots for tokens whose ids are not known yet).
        let lookahead_only = num_new_tokens == 0 && num_drafts > 0;
        if num_new_tokens == 0 && !lookahead_only {
            return Err(Error::InvalidArgument {
                arg: "num_new_tokens",
                value: "0".into(),
                reason: "must schedule at least one token".into(),
            });
        }
        if !s.drafts.is_empty() {
            return Err(drafts_pending(seq, "allocate_slots"));
        }
        let bs = self.bs();
        let first = s.blocks.is_empty() && s.num_computed == 0;
        let hits = if first {
            self.find_hits(s, host)
        } else {
            Vec::new()
        };
        // Host hits (NULL_BLOCK, ref count 0) count like free device hits: one block each.
        let hits_free = hits
            .iter()
            .filter(|&&b| self.pool.ref_count(b) == 0)
            .count();
        let context = if first {
            hits.len() * bs
        } else {
            s.num_computed
        };
        let remaining = s.tokens.len() - context;
        if lookahead_only && (first || remaining > 0) {
            return Err(Error::InvalidArgument {
                arg: "num_new_tokens",
                value: "0".into(),
                reason: format!(
                    "lookahead slots alone follow the last computed token of a running sequence \
                     ({remaining} of sequence {seq}'s tokens uncomputed)"
                ),
            });
        }
        if remaining == 0 && !lookahead_only {
            return Err(Error::InvalidArgument {
                arg: "num_new_tokens",
                value: num_new_tokens.to_string(),
                reason: format!(
                    "sequence {seq} has no uncomputed token (all {} computed)",
                    s.tokens.len()
                ),
            });
        }
        let q = num_new_tokens.min(remaining);
        if num_drafts > 0 && q < remaining {
            return Err(Error::InvalidArgument {
                arg: "draft_tokens",
                value: format!("{num_drafts} token(s)"),
                reason: format!(
                    "drafts follow the last token: schedule all {remaining} uncomputed token(s) \
                     of sequence {seq} ({q} scheduled)"
                ),
            });
        }
        let table_len = if first { hits.len() } else { s.blocks.len() };
        // Spare lookahead blocks (kept after an acceptance) are filled before fresh ones.
        let fresh = (context + q + num_drafts)
            .div_ceil(bs)
            .saturating_sub(table_len);
        // The block the next token is written into, when partially filled: copied if shared.
        let cow = !first
            && context % bs != 0
            && s.blocks
                .get(context / bs)
                .is_some_and(|&b| self.pool.ref_count(b) > 1);
        Ok(Plan {
            first,
            hits,
            hits_free,
            context,
            q,
            fresh,
            cow,
        })
    }

    fn allocate_locked(
        &self,
        seq: SeqId,
        s: &mut Sequence,
        counters: &mut ManagerCounters,
        mut host: Option<&mut HostTier>,
        num_new_tokens: usize,
        drafts: &[u32],
    ) -> Result<SlotAllocation> {
        let plan = self.plan(seq, s, num_new_tokens, drafts.len(), host.as_deref())?;
        let need = plan.blocks_taken();
        // Check before any pool call so that a failure changes nothing (touching hits and then
        // failing would move them in the LRU).
        let available = self.pool.num_free();
        if need > available {
            return Err(Error::OutOfBlocks {
                requested: need,
                available,
            });
        }
        let host_hits = match host.as_deref() {
            Some(h) if plan.first => Self::host_hits_of(&plan.hits, &s.hashes, h),
            _ => Vec::new(),
        };
        // Host hits are pinned before the allocation, whose evictions may store to the host
        // tier and must not take a block this call loads from.
        if !host_hits.is_empty() {
            pin_host_hits(host.as_deref_mut(), &host_hits)?;
        }
        let device_hits: Cow<'_, [BlockId]> = if host_hits.is_empty() {
            Cow::Borrowed(&plan.hits)
        } else {
            Cow::Owned(
                plan.hits
                    .iter()
                    .copied()
                    .filter(|&b| b != NULL_BLOCK)
                    .collect(),
            )
        };
        if !device_hits.is_empty() {
            self.pool.touch(&device_hits)?;
        }
        let n_new = host_hits.len() + plan.fresh + usize::from(plan.cow);
        let new = if n_new == 0 {
            Vec::new()
        } else {
            let allocated = match host.as_deref_mut() {
                None => self.pool.allocate(n_new),
                Some(host) => self.allocate_storing(n_new, Some(host)),
            };
            match allocated {
                Ok(v) => v,
                Err(e) => {
                    // Only reachable if someone mutates the pool behind the manager's back.
                    if !device_hits.is_empty() {
                        let undo: Vec<BlockId> = device_hits.iter().rev().copied().collect();
                        let _ = self.pool.free(&undo);
                    }
                    if let Some(host) = host.as_deref_mut() {
                        for &(_, hb) in &host_hits {
                            host.unpin(hb);
                        }
                    }
                    return Err(e);
                }
            }
        };
        let mut copies = Vec::new();
        if plan.first {
            s.blocks = plan.hits.clone();
            if !host_hits.is_empty() {
                self.plan_loads(s, host.as_deref_mut(), &host_hits, &new)?;
            }
            s.table_rewritten_from(0);
            s.num_computed = plan.context;
            // Blocks from the first host hit on are registered below (the loaded ones
            // become resolvable on the device now).
            s.num_cached_blocks = host_hits.first().map_or(plan.hits.len(), |&(k, _)| k);
            // Counted once per sequence: a resume after a recompute preemption finds its own
            // blocks again, not a new lookup (vLLM #25780).
            if self.caching() && !s.looked_up {
                counters.prefix_queries_tokens += s.tokens.len() as u64;
                counters.prefix_hits_tokens += plan.context as u64;
                counters.host_hits_tokens += (host_hits.len() * self.bs()) as u64;
            }
            s.looked_up = true;
            if let Some(host) = host.as_deref_mut() {
                note_hits_seen(host, &s.hashes[..plan.hits.len()]);
            }
        }
        let mut fresh = new[host_hits.len()..].iter().copied();
        if plan.cow {
            let dst = fresh.next().expect("allocated");
            let last = plan.context / self.bs();
            let src = std::mem::replace(&mut s.blocks[last], dst);
            s.table_rewritten_from(last);
            // src is shared (ref > 1): this only drops our reference.
            self.pool.free(&[src])?;
            copies.push((src, dst));
            counters.copies += 1;
        }
        s.blocks.extend(fresh);
        s.num_computed += plan.q;
        s.status = SeqStatus::Running;
        s.drafts.extend_from_slice(drafts);
        s.spare_blocks = s.blocks.len() - (s.num_computed + drafts.len()).div_ceil(self.bs());
        // Only blocks full of computed, finalized tokens: drafts never reach the cache.
        self.cache_full_blocks(s, host, plan.hits.len());
        Ok(SlotAllocation {
            num_scheduled_tokens: plan.q,
            num_cached_tokens: if plan.first { plan.context } else { 0 },
            num_context_tokens: plan.context,
            new_block_ids: new,
            copies,
            num_draft_tokens: drafts.len(),
        })
    }

    /// Gives the loads' destinations (the first blocks of `new`, in table order) their table
    /// slots, plans the loads, and takes the reference each load holds until handed out.
    #[cold]
    #[inline(never)]
    fn plan_loads(
        &self,
        s: &mut Sequence,
        mut host: Option<&mut HostTier>,
        host_hits: &[(usize, BlockId)],
        new: &[BlockId],
    ) -> Result<()> {
        for (&(k, hb), &d) in host_hits.iter().zip(new) {
            s.blocks[k] = d;
            if let Some(host) = host.as_deref_mut() {
                host.plan_load(hb, d);
            }
        }
        self.pool.incref(&new[..host_hits.len()])
    }

    /// The host tier's bookkeeping of newly registered blocks `start..full` of `s`: each
    /// block's step and event metadata, and a use of each from `seen_from` on.
    #[inline(never)]
    fn note_registered(
        &self,
        s: &Sequence,
        host: &mut HostTier,
        start: usize,
        full: usize,
        seen_from: usize,
    ) {
        let bs = self.bs();
        let meta = host.keeps_meta();
        for k in start..full {
            let m = meta.then(|| BlockMeta {
                parent: k.checked_sub(1).map(|j| s.hashes[j]),
                tokens: s.tokens[k * bs..(k + 1) * bs].into(),
                extra_keys: self.block_keys(&s.spec, k).into_owned(),
            });
            host.note_registered(s.blocks[k], m);
            if k >= seen_from {
                host.note_seen(HostKey::from(s.hashes[k]));
            }
        }
    }

    /// Registers every block full of computed tokens that is not cached yet, and emits
    /// BlockStored events (consecutive blocks with equal extra keys share one event). With a
    /// host tier, notes each registered block's step (and event metadata) and counts a use,
    /// for admission, of each logical block from `seen_from` on (the prefix hits before it
    /// were counted as hits).
    fn cache_full_blocks(&self, s: &mut Sequence, host: Option<&mut HostTier>, seen_from: usize) {
        if !self.caching() || s.stale_kv {
            return;
        }
        let bs = self.bs();
        let full = s.num_computed / bs;
        let start = s.num_cached_blocks;
        if full <= start {
            return;
        }
        self.block_hash_at(s, full - 1);
        // One pool lock hold for every newly full block. Blocks already hashed (shared with a
        // sequence that cached them first) come back as not newly resolvable.
        let mut newly = Vec::with_capacity(full - start);
        let cached =
            self.pool
                .cache_blocks(&s.blocks[start..full], &s.hashes[start..full], &mut newly);
        debug_assert!(cached.is_ok(), "{cached:?}");
        s.num_cached_blocks = full;
        if let Some(host) = host {
            self.note_registered(s, host, start, full, seen_from);
        }
        if !self.events.enabled() {
            return;
        }
        let mut pending: Option<KvEvent> = None;
        for (k, &first) in (start..full).zip(&newly) {
            // Set semantics: announce a hash only when it becomes resolvable, not for a second
            // physical copy of it (two sequences that prefilled the same prompt in one step).
            if !first {
                continue;
            }
            let h = s.hashes[k];
            let keys = self.block_keys(&s.spec, k);
            let toks = &s.tokens[k * bs..(k + 1) * bs];
            if let Some(KvEvent::BlockStored {
                block_hashes,
                token_ids,
                extra_keys,
                ..
            }) = pending.as_mut()
            {
                if extra_keys.as_slice() == &*keys
                    && block_hashes.last() == k.checked_sub(1).map(|j| &s.hashes[j])
                {
                    block_hashes.push(h);
                    token_ids.extend_from_slice(toks);
                    continue;
                }
            }
            if let Some(ev) = pending.take() {
                self.events.push(ev);
            }
            pending = Some(KvEvent::BlockStored {
                block_hashes: vec![h],
                parent_block_hash: k.checked_sub(1).map(|j| s.hashes[j]),
                token_ids: toks.to_vec(),
                block_size: self.cfg.block_size,
                extra_keys: keys.into_owned(),
                hash_root: Some(self.hasher.root()),
                tier: Tier::Device,
            });
        }
        if let Some(ev) = pending {
            self.events.push(ev);
        }
    }
}

/// Checks the host-tier fields of a manager's configuration (both managers take the same
/// ones). Errors: [`Error::InvalidConfig`] naming `host_admission_min_seen` when it is 0, or
/// `num_host_blocks` above [`MAX_HOST_BLOCKS`] or set with prefix caching off (the host tier
/// keys blocks by their prefix hash).
pub(crate) fn validate_host_tier(
    num_host_blocks: u32,
    admission_min_seen: u32,
    enable_prefix_caching: bool,
) -> Result<()> {
    if admission_min_seen == 0 {
        return Err(Error::InvalidConfig {
            field: "host_admission_min_seen",
            value: "0".into(),
            reason: "must be at least 1 (1 stores every evicted block)".into(),
        });
    }
    if num_host_blocks > MAX_HOST_BLOCKS {
        return Err(Error::InvalidConfig {
            field: "num_host_blocks",
            value: num_host_blocks.to_string(),
            reason: format!("at most {MAX_HOST_BLOCKS} blocks"),
        });
    }
    if num_host_blocks > 0 && !enable_prefix_caching {
        return Err(Error::InvalidConfig {
            field: "num_host_blocks",
            value: num_host_blocks.to_string(),
            reason: "a host tier needs enable_prefix_caching: it keys blocks by the \
                     device tier's prefix hashes"
                .into(),
        });
    }
    Ok(())
}

/// The host tier's events of one store attempt ([`HostTier::plan_store`] of `key` gave
/// `out`): `BlockRemoved` for the host block evicted to make room, `BlockStored` for the
/// store (from the metadata the tier kept). Hashes are the keys' `hash`; both managers emit
/// these (the groups manager names the key's group beside them).
pub(crate) fn host_store_events(
    host: &HostTier,
    out: &StoreOutcome,
    key: HostKey,
    block_size: u32,
    root: BlockHash,
) -> impl Iterator<Item = KvEvent> {
    let removed = out.evicted.map(|old| KvEvent::BlockRemoved {
        block_hashes: vec![old.hash],
        tier: Tier::Host,
    });
    let stored = out.stored.map(|h| {
        let meta = host.host_meta(h);
        KvEvent::BlockStored {
            block_hashes: vec![key.hash],
            parent_block_hash: meta.and_then(|m| m.parent),
            token_ids: meta.map(|m| m.tokens.to_vec()).unwrap_or_default(),
            block_size,
            extra_keys: meta.map(|m| m.extra_keys.clone()).unwrap_or_default(),
            hash_root: Some(root),
            tier: Tier::Host,
        }
    });
    removed.into_iter().chain(stored)
}

/// Hands out `host`'s planned copies, with the group of each store, and drops the reference
/// each load held on its device block (taken when the load was planned, so nothing reuses the
/// block before the executor fills it). Shared by both managers. O(plans).
pub(crate) fn hand_out_host_plans(
    pool: &BlockPool,
    host: &mut HostTier,
) -> (HostTransfers, Vec<u32>) {
    let (plans, store_groups) = host.take_plans_with_groups();
    let loads = &plans.loads;
    if !loads.is_empty() {
        let held: Vec<BlockId> = loads.iter().rev().map(|&(_, d)| d).collect();
        let freed = pool.free(&held);
        debug_assert!(freed.is_ok(), "{freed:?}");
    }
    (plans, store_groups)
}

/// Pins the host blocks of a call's host hits (before its allocation may store to the tier).
#[cold]
#[inline(never)]
pub(crate) fn pin_host_hits(
    host: Option<&mut HostTier>,
    host_hits: &[(usize, BlockId)],
) -> Result<()> {
    if let Some(host) = host {
        for &(_, hb) in host_hits {
            host.pin(hb)?;
        }
    }
    Ok(())
}

/// Counts one use of each prefix-hit hash for the host tier's admission.
#[cold]
#[inline(never)]
pub(crate) fn note_hits_seen(host: &mut HostTier, hashes: &[BlockHash]) {
    for &h in hashes {
        host.note_seen(HostKey::from(h));
    }
}

/// Validates a group argument: known ids, no duplicates, every status accepted by `ok`.
fn check_group(
    st: &State,
    seqs: &[SeqId],
    operation: &'static str,
    ok: impl Fn(SeqStatus) -> bool,
    expected: &'static str,
) -> Result<()> {
    let mut seen = HashSet::with_capacity(seqs.len());
    for &id in seqs {
        if !seen.insert(id) {
            return Err(Error::InvalidArgument {
                arg: "seq_ids",
                value: id.to_string(),
                reason: "sequence listed twice in one group".into(),
            });
        }
        let s = st.seqs.get(&id).ok_or_else(|| unknown(id))?;
        if !ok(s.status) {
            return Err(bad_state(id, s.status, operation, expected));
        }
    }
    Ok(())
}

/// Drops one reference to each CPU block, tail-first; blocks reaching 0 return to the free list.
fn cpu_release(cpu: &mut CpuPool, table: &[BlockId]) {
    for &c in table.iter().rev() {
        let r = &mut cpu.refs[c as usize];
        *r -= 1;
        if *r == 0 {
            cpu.free.push(c);
        }
    }
}

/// Checks an `accept_drafts(seq, num_accepted)` call against the sequence's `pending` draft
/// tokens, shared by [`KvCacheManager`] and the KV cache groups manager.
///
/// # Errors
/// [`Error::InvalidSequenceState`] when no drafts are pending; [`Error::InvalidArgument`] when
/// `num_accepted > pending`.
pub(crate) fn validate_accept(
    seq: SeqId,
    status: SeqStatus,
    pending: usize,
    num_accepted: usize,
) -> Result<()> {
    if pending == 0 {
        return Err(Error::InvalidSequenceState {
            seq_id: seq,
            state: status.name(),
            operation: "accept_drafts",
            expected: "with pending draft tokens (allocated with drafts)",
        });
    }
    if num_accepted > pending {
        return Err(Error::InvalidArgument {
            arg: "num_accepted",
            value: num_accepted.to_string(),
            reason: format!("sequence {seq} has only {pending} draft token(s) pending"),
        });
    }
    Ok(())
}

/// Checks a new sequence's prompt (at least one token) and its multimodal items (len >= 1, a
/// range that fits in i64), shared by [`KvCacheManager`] and the KV cache groups manager.
pub(crate) fn validate_new_sequence(prompt: &[u32], spec: &SequenceSpec) -> Result<()> {
    if prompt.is_empty() {
        return Err(Error::InvalidArgument {
            arg: "prompt",
            value: "[]".into(),
            reason: "a sequence needs at least one token".into(),
        });
    }
    for item in &spec.mm_items {
        if item.len == 0
            || item.start.checked_add(item.len).is_none()
            || item.start > i64::MAX as u64
        {
            return Err(Error::InvalidArgument {
                arg: "mm_items",
                value: format!("start={} len={}", item.start, item.len),
                reason: "a multimodal item needs len >= 1 and a range that fits in i64".into(),
            });
        }
    }
    Ok(())
}

/// Checks a [`StepRequest`]'s array lengths and offsets (shared by [`KvCacheManager`] and the
/// KV cache groups manager).
pub(crate) fn validate_step(req: &StepRequest) -> Result<()> {
    let n = req.seq_ids.len();
    if req.num_new_tokens.len() != n {
        return Err(Error::InvalidArgument {
            arg: "num_new_tokens",
            value: format!("len {}", req.num_new_tokens.len()),
            reason: format!("must have one entry per sequence ({n})"),
        });
    }
    if req.append_indptr.is_empty() {
        if !req.append_tokens.is_empty() {
            return Err(Error::InvalidArgument {
                arg: "append_indptr",
                value: "[]".into(),
                reason: "append_tokens given without offsets".into(),
            });
        }
        return Ok(());
    }
    let p = &req.append_indptr;
    if p.len() != n + 1
        || p[0] != 0
        || p.windows(2).any(|w| w[0] > w[1])
        || p[n] as usize != req.append_tokens.len()
    {
        return Err(Error::InvalidArgument {
            arg: "append_indptr",
            value: format!("{p:?}"),
            reason: format!(
                "must be {} non-decreasing offsets from 0 to len(append_tokens) = {}",
                n + 1,
                req.append_tokens.len()
            ),
        });
    }
    Ok(())
}

pub(crate) fn validate_drafts(req: &StepRequest, drafts: &StepDrafts) -> Result<()> {
    let n = req.seq_ids.len();
    let p = &drafts.indptr;
    if p.is_empty() {
        if !drafts.tokens.is_empty() {
            return Err(Error::InvalidArgument {
                arg: "draft_indptr",
                value: "[]".into(),
                reason: "draft_tokens given without offsets".into(),
            });
        }
        return Ok(());
    }
    if p.len() != n + 1
        || p[0] != 0
        || p.windows(2).any(|w| w[0] > w[1])
        || p[n] as usize != drafts.tokens.len()
    {
        return Err(Error::InvalidArgument {
            arg: "draft_indptr",
            value: format!("{p:?}"),
            reason: format!(
                "must be {} non-decreasing offsets from 0 to len(draft_tokens) = {}",
                n + 1,
                drafts.tokens.len()
            ),
        });
    }
    Ok(())
}
