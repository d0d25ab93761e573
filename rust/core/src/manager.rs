//! The KV cache manager: one or several KV cache groups (full attention, sliding window,
//! chunked local; see [`crate::kv_groups`]) with one block table per group per sequence, all
//! over one [`BlockPool`] of equal-size pages. One full-attention group is PagedAttention's
//! manager (Kwon et al., SOSP'23, §4.2–4.5: block tables, reference-counted sharing,
//! copy-on-write, recompute and swap preemption) with automatic prefix caching by chained block
//! hashes, observable behaviour as vLLM V1's `KVCacheManager`; a single group costs what a
//! manager without groups would (`cargo bench -p pagedkv-core --bench one_group`).
//!
//! What groups add to one full-attention group:
//! - **Release out of the window.** At each allocation of a sequence whose KV is known up to
//!   `context` tokens, a windowed group releases every block no query at `context` or later can
//!   read (table slot set to the null block). With sparse retention it holds on a little longer,
//!   to the window of the older of the last two hit-unit boundaries (the *latest replayable
//!   point*, so a request that extends the same turn and diverges inside its last block still
//!   hits: vLLM #57610).
//! - **Retention.** Full-attention blocks are cached once full. A
//!   windowed group with `retention_interval == 0` caches every full block too; with an interval
//!   `N`, only the blocks a hit at a multiple of `N` needs, plus, when the sequence is freed or
//!   preempted, the blocks it still holds (its latest replayable point). Everything else leaves
//!   uncached and is reused first, so a long request's transient window blocks do not push other
//!   requests' cached prefixes out of the LRU (the collapse of hybrid prefix hits to 0 in vLLM
//!   #48435, fixed there by a retention interval, #43447 / #52216).
//! - **Prefix lookup.** A hit is the longest prefix every group can serve, a multiple of the hit
//!   unit (LCM of block sizes): full-attention groups scan their chain left to right; a windowed
//!   group at a candidate `p` needs the blocks holding `[first_read(p), p)` present (for a
//!   sliding window, the last `ceil((W - 1) / block_size)` blocks before `p`), and the candidate
//!   shrinks until every group agrees.
//! - **Hashes keyed by group.** The plain chain hash of a block (what a single group and the
//!   routers compute) is the index key of group 0; group `g > 0` keys its blocks by the plain
//!   hash with `g` mixed in (XORed into two words, no second hash), so groups never share a
//!   cached page. Events carry the plain hashes and
//!   name their group ([`GroupEvent`]).
//! - **Exact demand.** An allocation takes `take` blocks from the free pool (fresh blocks, hits
//!   on free cached blocks, copy-on-write copies) and gives back `release` (out-of-window blocks
//!   it held alone); it succeeds exactly when `take <= free + release`, and
//!   [`KvCacheManager::num_blocks_needed`] returns both numbers before the call. An admission that
//!   predicts one number and takes another hangs or fails (vLLM #39734, #41282, #45856).
//!
//! Concurrency: one mutex over the per-sequence state per call (the [`crate::sync`] mutex, so
//! loom models see it), the pool's own hot paths lock-free; the
//! pool must not be mutated behind the manager's back. Every failing call changes nothing.
//!
//! Layout: this module is the facade (configuration, state, the public calls, the step loop,
//! events, stats); `coordinator` decides what an allocation would do (prefix hits, plans,
//! the demand simulation), `kinds` holds the per-kind rules, `allocation` carries plans out,
//! `caching` hashes and registers blocks, `host` is the host tier, `invariants` the checker.

use crate::error::{Error, Result};
use crate::events::{EventSink, KvEvent, Tier};
use crate::hashing::{BlockHash, ChainJob, PrefixHasher};
use crate::host_tier::HostTier;
use crate::kv_groups::{retained_at_interval, CacheConfig, GroupSpec};
use crate::metrics::{CacheStats, ManagerCounters};
use crate::pool::BlockPool;
use crate::request::{
    drafts_pending, validate_accept, validate_drafts, validate_new_sequence, validate_step,
    SeqStatus, SequenceSpec, StepDrafts, StepRequest,
};
use crate::seq_table::{duplicate_id, SeqTable};
use crate::sync::Mutex;
use crate::{BlockId, SeqId, NULL_BLOCK};
use smallvec::SmallVec;
use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;

mod allocation;
mod caching;
mod coordinator;
mod external;
mod host;
mod invariants;
mod kinds;

use allocation::{filled, Alloc};
use coordinator::{GroupPlan, Sim};
pub use host::GroupHostTransfers;
use host::{HostSide, HOST_HIT};

/// A block that exists only in a demand simulation (registered by an earlier member of a
/// group in [`KvCacheManager::num_blocks_owed`]); never a real id (ids are below 2^28).
const VIRTUAL: BlockId = u32::MAX;

/// A released table entry of a swapped-out sequence (CPU block ids start at 0, so the null
/// block id cannot mark it there).
pub const CPU_NULL: BlockId = u32::MAX;

/// A KV event of one group, or of every group (`group == None`: the cache was reset).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupEvent {
    /// The KV cache group the event is about; `None` for [`KvEvent::AllBlocksCleared`].
    pub group: Option<u32>,
    /// The event; its hashes are the plain chain hashes (as a manager of one full-attention group
    /// with the same seed and that group's block size computes them). Set semantics hold per group; the
    /// parent of a windowed group's `BlockStored` may not be cached (sparse retention).
    pub event: KvEvent,
}

/// What one call produced for the event buffer, applied in order by `absorb`.
#[derive(Debug)]
enum Pending {
    /// A group event for the caller.
    Group(GroupEvent),
    /// Index key `.0` now resolves and stands for group `.1`'s plain hash `.2`.
    Owner(BlockHash, u32, BlockHash),
    /// An event of the pool (keys, not plain hashes).
    Pool(KvEvent),
}

/// Blocks one allocation takes from and gives back to the free pool. It succeeds exactly
/// when `take <= free + release`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BlockDemand {
    /// Blocks taken: fresh blocks, prefix hits on free (ref 0) cached blocks, copy-on-write
    /// destinations, over every group.
    pub take: usize,
    /// Blocks given back: out-of-window blocks the sequence held alone (ref 1), released
    /// before the new ones are taken.
    pub release: usize,
    /// Per group, in group order, its part of `take` and of `release` (they sum to them).
    pub per_group: Vec<(usize, usize)>,
}

impl BlockDemand {
    /// `take - release`: the change of used blocks (negative when the call frees more than it
    /// takes).
    pub fn net(&self) -> isize {
        self.take as isize - self.release as isize
    }
}

/// One group's part of a [`SlotAllocation`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GroupAllocation {
    /// Blocks newly taken from the free pool for this group, in block-table order.
    pub new_block_ids: Vec<BlockId>,
    /// Copy-on-write `(src, dst)` pairs of this group (at most one).
    pub copies: Vec<(BlockId, BlockId)>,
    /// Blocks released out of the window by this call (their table slots now null); for a
    /// state group, its previous live state block when the live index moved and that state is
    /// not waiting for its commit, and the prefix-hit block the live state was copied from.
    pub released: Vec<BlockId>,
    /// State groups only: blocks taken for a fresh state (no prefix hit: a first allocation or
    /// a resume after a recompute preemption) that the executor must zero before the forward
    /// pass (after the copies). Empty for every other kind.
    pub zero_blocks: Vec<BlockId>,
}

/// The result of [`KvCacheManager::allocate_slots`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SlotAllocation {
    /// Tokens scheduled (the query length).
    pub num_scheduled_tokens: usize,
    /// Tokens served from the prefix cache (first allocation only; a multiple of the hit unit).
    pub num_cached_tokens: usize,
    /// Tokens with KV present before the scheduled ones.
    pub num_context_tokens: usize,
    /// Draft tokens given lookahead slots after the scheduled ones (positions
    /// `num_context_tokens + num_scheduled_tokens ..` `+ num_draft_tokens`), pending until
    /// [`KvCacheManager::accept_drafts`].
    pub num_draft_tokens: usize,
    /// Per group, in group order.
    pub groups: Vec<GroupAllocation>,
}

/// Output of [`KvCacheManager::step`]: flat arrays with a group dimension. `S` scheduled
/// sequences, `T` scheduled tokens, `G` groups.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StepOutput {
    /// Sequences scheduled (a prefix of the request).
    pub num_scheduled: usize,
    /// The failure that stopped processing (that sequence unchanged), if any.
    pub error: Option<Error>,
    /// `G`.
    pub num_groups: usize,
    /// Per scheduled seq: prefix-hit tokens of its first allocation, else 0.
    pub num_cached_tokens: Vec<i32>,
    /// Length `S + 1`: cumulative query lengths.
    pub query_start_loc: Vec<i32>,
    /// Per scheduled seq: context + query tokens.
    pub seq_lens: Vec<i32>,
    /// Per scheduled seq: tokens with KV present before this step.
    pub context_lens: Vec<i32>,
    /// Per scheduled token: its token id.
    pub input_ids: Vec<i64>,
    /// Per scheduled seq: draft tokens at the end of its query (lookahead slots); empty when
    /// the step had no drafts.
    pub num_draft_tokens: Vec<i32>,
    /// Row-major `G x T`: row `g` holds each token's slot in group `g`'s layers,
    /// `block_id * block_size_g + offset`.
    pub slot_mapping: Vec<i64>,
    /// Row-major `G x S x W`: each group's block tables, rows padded with (and released
    /// entries set to) the null block 0.
    pub block_table: Vec<i32>,
    /// `W`: the longest table over every group, at least 1.
    pub block_table_width: usize,
    /// Length `S * G + 1`: CSR offsets into `new_block_ids`, entry `k * G + g` for sequence
    /// `k`, group `g`.
    pub new_block_indptr: Vec<i32>,
    /// Blocks newly taken, per (sequence, group).
    pub new_block_ids: Vec<i32>,
    /// Copy-on-write plan, row-major `(group, src, dst)` triples; for a state group, the move
    /// of a live state into its new block (or from a prefix-hit block), applied in place of a
    /// copy-on-write: copies first, then `zero_blocks`, then the forward pass. Every source is
    /// read before any destination is written: a block one row releases may be another row's
    /// destination in the same step.
    pub copies: Vec<i32>,
    /// Fresh state blocks to zero, row-major `(group, block)` pairs (state groups only; applied
    /// after `copies`, before the forward pass).
    pub zero_blocks: Vec<i32>,
    /// Host-tier stores, row-major `(group, device block, host block)` triples: the executor
    /// copies these FIRST in the step (before swaps, host loads, copy-on-write and the forward
    /// pass), from group `group`'s device cache to its host cache. Planned by the allocations
    /// since the previous hand-out (docs/design.md, "Host tier"). Empty without a host tier.
    pub host_stores: Vec<i32>,
    /// Host-tier loads, row-major `(group, host block, device block)` triples: copied after
    /// the stores and swaps, before copy-on-write and the forward pass. Their host blocks stay
    /// pinned until the next step call returns. Empty without a host tier.
    pub host_loads: Vec<i32>,
    /// Length `S * G`, entry `k * G + g`: the first logical block of sequence `k`'s group-`g`
    /// table that changed since the last step output that reported it (0 for a table new to
    /// the outputs: first allocation, a resumed preemption, a swap-in, a fork child). Entries
    /// before it are unchanged since that output; the table is now `previous[..start]`
    /// followed by its slice of `table_delta`. Blocks released out of a window count as
    /// changed (their entries are the null block 0 in the delta), as do a copy-on-write's
    /// replaced entry and a table cut short by rejected drafts. The delta form of the block
    /// tables, for a consumer that keeps them across steps (per group, as
    /// [`crate::block_tables::BlockTables`] keeps one group's).
    pub table_start: Vec<i32>,
    /// Per scheduled seq: the version of its tables (every group's) this output reports, one
    /// more than its previous report's; a sequence's first report is above every version an
    /// earlier output of this manager carried, so versions never repeat under one id. A
    /// consumer holding version `v` may apply a delta only when this is `v + 1` (or its
    /// `table_start` is 0); otherwise it re-reads the tables ([`KvCacheManager::block_tables`]).
    pub table_version: Vec<u64>,
    /// Length `S * G + 1`: CSR offsets into `table_delta`, entry `k * G + g`.
    pub table_delta_indptr: Vec<i32>,
    /// Per (sequence, group), its table entries from `table_start` to its end (block ids).
    pub table_delta: Vec<i32>,
}

impl StepOutput {
    /// Row `k` (a scheduled sequence, `k < num_scheduled`) of group `g`'s dense block table:
    /// `block_table_width` entries, null-padded. Panics when the step was asked without the
    /// dense table ([`StepOptions::skip_block_table`]) or an index is out of range.
    pub fn block_table_row(&self, g: usize, k: usize) -> &[i32] {
        let w = self.block_table_width;
        let start = (g * self.num_scheduled + k) * w;
        &self.block_table[start..start + w]
    }
}

/// Options of [`KvCacheManager::step_with`]; the default is what [`KvCacheManager::step`]
/// returns.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StepOptions {
    /// Leave [`StepOutput::block_table`] empty (`block_table_width` 0): for callers that
    /// keep the tables from the deltas ([`StepOutput::table_start`] /
    /// [`StepOutput::table_delta`]); the dense `G x S x W` copy is O(groups x scheduled
    /// sequences x longest table) per step, most of a decode step's cost for long contexts.
    pub skip_block_table: bool,
    /// Leave the per-token arrays [`StepOutput::slot_mapping`] and
    /// [`StepOutput::input_ids`] empty: for callers that build them on the device from
    /// the block tables and positions, or that need only block ids (a scheduler).
    pub skip_token_arrays: bool,
    /// Blocks that must stay free after each sequence's allocation (an admission watermark,
    /// as vLLM's `KVCacheManager(watermark=)`): a sequence whose allocation would leave fewer
    /// fails with [`Error::OutOfBlocks`] `{requested: take + reserve_blocks, available: free
    /// + release}` and the step stops there, so admission control is the step itself (no
    /// separate [`KvCacheManager::num_blocks_needed`] call, one prefix lookup). 0: none.
    pub reserve_blocks: usize,
}

#[derive(Debug, Clone, Default)]
struct GroupTable {
    /// Logical block -> physical block, [`NULL_BLOCK`] where released or skipped.
    blocks: Vec<BlockId>,
    /// Entries below this are null (released or never taken).
    live_from: usize,
    /// Leading logical blocks the fill-time registration has considered.
    scanned: usize,
    /// Trailing blocks past `ceil((num_computed + drafts) / block_size)` kept by
    /// [`KvCacheManager::accept_drafts_keeping_blocks`] for the next allocations (private,
    /// unhashed).
    spare: usize,
    /// Leading entries a step output has reported and that have not changed since (the next
    /// table delta starts here).
    reported: usize,
}

impl GroupTable {
    /// Notes that the entries from logical block `k` on changed other than by appending.
    fn rewritten_from(&mut self, k: usize) {
        self.reported = self.reported.min(k);
    }
}

#[derive(Debug, Clone)]
struct Seq {
    tokens: Vec<u32>,
    spec: SequenceSpec,
    status: SeqStatus,
    num_computed: usize,
    /// Context of the last allocation: every query since reads from its window on.
    last_context: usize,
    /// Per group; inline for one group (no pointer chase per sequence in a step).
    tables: SmallVec<[GroupTable; 1]>,
    /// Per block-size class, the memo of plain chain hashes.
    chains: SmallVec<[Vec<BlockHash>; 1]>,
    /// Its KV predates the last prefix-cache reset (it was swapped out then): no block of any
    /// group is registered in the prefix cache until a recompute preemption computes the KV
    /// afresh (docs/design.md, "KV cache groups").
    stale_kv: bool,
    /// Its first prefix lookup is counted in the hit-rate counters (inherited by a fork
    /// child; a resume after a recompute preemption is not counted again, vLLM #25780).
    looked_up: bool,
    /// Pending draft tokens of a verify step, in lookahead slots at positions
    /// `num_computed .. num_computed + drafts.len()` of every group: never hashed, cached or
    /// announced; resolved by [`KvCacheManager::accept_drafts`].
    drafts: Vec<u32>,
    /// The version of its tables the last step output reported
    /// ([`StepOutput::table_version`]).
    table_version: u64,
    /// While [`SeqStatus::Loading`]: the first token of the external load (the local prefix
    /// hit before it); blocks from `loading_from / block_size` on are staged.
    loading_from: usize,
    /// Its tables hold blocks for the tokens up to here (past `num_computed`) that a
    /// [`KvCacheManager::rollback`] kept: the next allocations compute into them in place (no
    /// copy-on-write; they may be shared or still registered). 0 when none.
    rewrite_to: usize,
    /// Blocks holding tokens from here on are never registered ([`usize::MAX`]: none): some
    /// of its KV there descends from KV found invalid ([`KvCacheManager::evict_blocks`]), until
    /// a rollback to or below it or a recompute preemption.
    tainted_from: usize,
    /// The most tokens a first allocation may take from the prefix cache
    /// ([`KvCacheManager::set_hit_limit`]; [`usize::MAX`]: `num_tokens - 1`).
    hit_limit: usize,
    /// The first allocation's prefix hit ignores state groups: a KV connector loads the
    /// state at the end of the loaded tokens ([`KvCacheManager::set_state_from_load`]).
    state_from_load: bool,
    /// State groups: aligned state ends at or below this are never published (their steps'
    /// completion was not confirmed before a swap-out); 0 when none.
    publish_floor: usize,
    /// State groups: the slots the live state covers, placeholder slots included (see
    /// [`Seq::state_end`]); 0 when no placeholder slot ever ran past the computed tokens.
    state_slots: usize,
    /// State groups with speculative blocks (a state group's [`GroupSpec::spare_blocks`]): the
    /// aligned ends whose states the runner writes into their own column and that may be
    /// published (a step's known end, an accepted end); pruned as their columns leave.
    state_marks: SmallVec<[usize; 2]>,
}

impl Seq {
    /// Tokens its tables cover besides spare blocks: computed and draft slots, and the
    /// blocks a rollback kept.
    fn covered(&self) -> usize {
        (self.num_computed + self.drafts.len()).max(self.rewrite_to)
    }

    /// State groups: the token count the live state is the state after: the computed
    /// tokens, or further where placeholder slots (drafts of tokens whose ids were not known,
    /// an asynchronous scheduler's) ran past them and were settled keeping their blocks. The
    /// live state block is `(state_end - 1) / block_size`.
    fn state_end(&self) -> usize {
        self.state_slots.max(self.num_computed + self.drafts.len())
    }

    fn is_first(&self) -> bool {
        self.num_computed == 0 && self.tables.iter().all(|t| t.blocks.is_empty())
    }

    /// The blocks the tables hold: GPU ids, or CPU ids while swapped out.
    fn held(&self) -> impl Iterator<Item = BlockId> + '_ {
        let none = self.null_entry();
        self.tables
            .iter()
            .flat_map(|t| t.blocks.iter().copied())
            .filter(move |&b| b != none)
    }

    /// What a released table entry holds: the null block, or [`CPU_NULL`] while swapped.
    fn null_entry(&self) -> BlockId {
        if self.status == SeqStatus::Swapped {
            CPU_NULL
        } else {
            NULL_BLOCK
        }
    }
}

#[derive(Debug, Clone)]
struct CpuPool {
    refs: Vec<u32>,
    free: Vec<BlockId>,
}

#[derive(Debug)]
struct State {
    /// Per sequence id, in a slab: a step resolves every scheduled id to its slot once.
    seqs: SeqTable<Seq>,
    cpu: CpuPool,
    events: Vec<GroupEvent>,
    /// Index key -> (group, plain hash), for the keys that resolve (events on only): names
    /// the group of the pool's `BlockRemoved`.
    key_owner: HashMap<BlockHash, (u32, BlockHash)>,
    /// The highest table version any step output reported (a new sequence's first report is
    /// above it).
    table_versions: u64,
    /// Deferred releases: per handle, the blocks (tail first) kept referenced until
    /// [`KvCacheManager::release_deferred`].
    deferred: HashMap<u64, Vec<BlockId>>,
    /// The last handle given out (handles start at 1, never reused).
    last_deferred: u64,
}

/// The KV cache manager: one or several KV cache groups sharing one block pool (see the
/// module docs; [`CacheConfig::new`] is one full-attention group). `Send + Sync`.
#[derive(Debug)]
pub struct KvCacheManager {
    cfg: CacheConfig,
    /// Hit unit in tokens (LCM of block sizes).
    unit: usize,
    /// Every group is full attention (nothing ever leaves a window).
    all_full: bool,
    /// Some group is a state group ([`crate::kv_groups::AttentionKind::State`]).
    has_state: bool,
    /// Per group, its block-size class (groups of one block size share a plain chain).
    class_of: Vec<usize>,
    class_bs: Vec<usize>,
    hasher: PrefixHasher,
    pool_events: Arc<EventSink>,
    pool: BlockPool,
    state: Mutex<State>,
    /// Running counters, taken only under the state lock (lock order: state, then counters)
    /// and only when a call has something to count.
    counters: Mutex<ManagerCounters>,
    /// The prefix cache's host tier (`None` with `num_host_blocks == 0`: nothing of it runs),
    /// taken only under the state lock (lock order: state, host, counters).
    host: Option<Mutex<HostSide>>,
    /// Per block, the first 8 bytes of the index key of the block before it in the chain it
    /// was last registered in (0: the first block); written and read only under the state
    /// lock (atomics only to share the array). What [`Self::evict_blocks`] follows to the
    /// dependents of a block. 8 bytes per block: a prefix collision only unregisters one
    /// block too many.
    parents: Box<[std::sync::atomic::AtomicU64]>,
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
    /// A manager over a fresh pool of `cfg.num_blocks` pages shared by `cfg.groups`. Errors:
    /// [`Error::InvalidConfig`] (see [`CacheConfig::validate`]); nothing is built then.
    /// O(num_blocks + num_cpu_blocks).
    pub fn new(cfg: CacheConfig) -> Result<Self> {
        cfg.validate()?;
        let unit = cfg.hit_unit().expect("validated") as usize;
        let mut class_bs: Vec<usize> = Vec::new();
        let class_of = cfg
            .groups
            .iter()
            .map(|g| {
                let bs = g.block_size as usize;
                match class_bs.iter().position(|&b| b == bs) {
                    Some(c) => c,
                    None => {
                        class_bs.push(bs);
                        class_bs.len() - 1
                    }
                }
            })
            .collect();
        let pool_events = Arc::new(EventSink::new(cfg.enable_events));
        let pool = BlockPool::new(cfg.num_blocks, pool_events.clone())?;
        let host = match cfg.num_host_blocks {
            0 => None,
            n => {
                let tier = HostTier::new(
                    n,
                    cfg.host_admission_min_seen,
                    cfg.host_eviction,
                    cfg.num_blocks,
                    cfg.enable_events,
                )?;
                Some(Mutex::new(HostSide::new(tier, cfg.num_blocks)))
            }
        };
        let hasher = PrefixHasher::new(cfg.hash_algo, &cfg.hash_seed);
        let n_blocks = cfg.num_blocks as usize;
        let n = cfg.num_cpu_blocks;
        let state = State {
            seqs: SeqTable::default(),
            cpu: CpuPool {
                refs: vec![0; n as usize],
                free: (0..n).rev().collect(),
            },
            events: Vec::new(),
            key_owner: HashMap::new(),
            table_versions: 0,
            deferred: HashMap::new(),
            last_deferred: 0,
        };
        Ok(Self {
            all_full: cfg.groups.iter().all(|g| !g.is_windowed()),
            has_state: cfg.groups.iter().any(GroupSpec::is_state),
            cfg,
            unit,
            class_of,
            class_bs,
            hasher,
            pool_events,
            pool,
            state: Mutex::new(state),
            counters: Mutex::new(ManagerCounters::default()),
            host,
            parents: (0..n_blocks)
                .map(|_| std::sync::atomic::AtomicU64::new(0))
                .collect(),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &CacheConfig {
        &self.cfg
    }

    /// The prefix hasher (algorithm and seed of the plain chain hashes every group's keys
    /// derive from).
    pub fn hasher(&self) -> &PrefixHasher {
        &self.hasher
    }

    /// The shared block pool, for inspection.
    pub fn pool(&self) -> &BlockPool {
        &self.pool
    }

    /// Number of KV cache groups.
    pub fn num_groups(&self) -> usize {
        self.cfg.groups.len()
    }

    /// The hit unit in tokens: prefix hits are multiples of it (LCM of the block sizes).
    pub fn hit_unit(&self) -> usize {
        self.unit
    }

    /// Registers a sequence with its prompt. Errors: [`Error::SequenceExists`];
    /// [`Error::InvalidArgument`] for an empty prompt or a malformed multimodal item. O(prompt).
    pub fn add_sequence(&self, seq: SeqId, prompt: Vec<u32>, spec: SequenceSpec) -> Result<()> {
        validate_new_sequence(&prompt, &spec)?;
        let mut st = self.state.lock();
        if st.seqs.contains_key(&seq) {
            return Err(Error::SequenceExists { seq_id: seq });
        }
        let g = self.num_groups();
        let table_version = st.table_versions;
        st.seqs.insert(
            seq,
            Seq {
                tokens: prompt,
                spec,
                status: SeqStatus::Running,
                num_computed: 0,
                last_context: 0,
                tables: filled(g),
                chains: filled(self.class_bs.len()),
                stale_kv: false,
                looked_up: false,
                drafts: Vec::new(),
                table_version,
                loading_from: 0,
                rewrite_to: 0,
                tainted_from: usize::MAX,
                hit_limit: usize::MAX,
                state_from_load: false,
                publish_floor: 0,
                state_slots: 0,
                state_marks: SmallVec::new(),
            },
        );
        Ok(())
    }

    /// Appends finalized tokens. Errors: [`Error::UnknownSequence`];
    /// [`Error::InvalidSequenceState`] while draft tokens are pending or an external load is
    /// (see [`Self::allocate_external`]). O(tokens).
    pub fn append_tokens(&self, seq: SeqId, tokens: &[u32]) -> Result<()> {
        let mut st = self.state.lock();
        let s = st.seqs.get_mut(&seq).ok_or_else(|| unknown(seq))?;
        if !s.drafts.is_empty() {
            return Err(drafts_pending(seq, "append_tokens"));
        }
        if s.status == SeqStatus::Loading {
            return Err(bad_state(
                seq,
                s.status,
                "append_tokens",
                "not loading (commit_external first)",
            ));
        }
        s.tokens.extend_from_slice(tokens);
        Ok(())
    }

    /// Tokens a first allocation of `seq` would take from the prefix cache now: the longest
    /// prefix every group can serve, a multiple of the hit unit, at most `num_tokens - 1`
    /// (or the sequence's hit limit, [`Self::set_hit_limit`]).
    /// No side effects. Errors: [`Error::UnknownSequence`].
    pub fn lookup_prefix(&self, seq: SeqId) -> Result<usize> {
        let mut st = self.state.lock();
        let s = st.seqs.get_mut(&seq).ok_or_else(|| unknown(seq))?;
        let sim = Sim::new(&self.pool);
        Ok(self.find_hits(s, &sim).0)
    }

    /// The longest prefix of `seq`, at most `min(limit, num_tokens)` tokens (a multiple of the
    /// hit unit), that group `group` alone serves from the prefix cache: a full-attention group
    /// the chain of its cached blocks from the left, a windowed group the largest boundary
    /// whose window blocks are all cached. A hit every group serves is at most the smallest of
    /// them ([`Self::lookup_prefix`] reconciles them); a scheduler that reconciles the groups
    /// by its own rule (EAGLE / MTP drop the last block of some groups' hits) probes them one
    /// by one with this, then caps the allocation's hit with [`Self::set_hit_limit`]. 0 with
    /// prefix caching off. No side effects. Errors: [`Error::UnknownSequence`];
    /// [`Error::InvalidArgument`] (`group`) past the last group.
    pub fn lookup_prefix_group(&self, seq: SeqId, group: usize, limit: usize) -> Result<usize> {
        if group >= self.num_groups() {
            return Err(Error::InvalidArgument {
                arg: "group",
                value: group.to_string(),
                reason: format!("{} KV cache group(s)", self.num_groups()),
            });
        }
        let mut st = self.state.lock();
        let s = st.seqs.get_mut(&seq).ok_or_else(|| unknown(seq))?;
        Ok(self.group_hit(s, group, limit))
    }

    /// Sets the most tokens a first allocation of `seq` (and [`Self::lookup_prefix`]) may take
    /// from the prefix cache: `Some(limit)` caps the hit at `min(limit, num_tokens)` tokens
    /// (rounded down to the hit unit), `None` restores the default cap `num_tokens - 1`. A
    /// limit of `num_tokens` is for probing with `lookup_prefix` only: an allocation whose hit
    /// covers every token has nothing left to compute and fails. A drafter that needs the last
    /// block of a hit recomputed (EAGLE / MTP's hidden states) probes and then caps the hit one
    /// block shorter. Kept until set again (a recompute preemption's resume takes it too).
    /// Errors: [`Error::UnknownSequence`]. O(1).
    pub fn set_hit_limit(&self, seq: SeqId, limit: Option<usize>) -> Result<()> {
        let mut st = self.state.lock();
        let s = st.seqs.get_mut(&seq).ok_or_else(|| unknown(seq))?;
        s.hit_limit = limit.unwrap_or(usize::MAX);
        Ok(())
    }

    /// With `on`, the prefix hit of `seq`'s first allocation (and [`Self::lookup_prefix`])
    /// ignores state groups: the longest prefix the other groups serve, the state groups
    /// taking no hit block (no copy row, null entries up to the live block), because a KV
    /// connector loads the state after the loaded tokens into the live block (vLLM's
    /// divergent local hybrid hits under NIXL: the attention hit runs deeper than the last
    /// cached state). Only [`Self::allocate_external`] with external tokens may allocate then:
    /// an allocation without them is refused (the live state would have no source). Cleared by
    /// the first allocation and by `set_state_from_load(seq, false)`. A no-op without state
    /// groups. Errors: [`Error::UnknownSequence`]; [`Error::InvalidSequenceState`] unless
    /// the sequence holds no block (new, or preempted by recompute). O(1).
    pub fn set_state_from_load(&self, seq: SeqId, on: bool) -> Result<()> {
        let mut st = self.state.lock();
        let s = st.seqs.get_mut(&seq).ok_or_else(|| unknown(seq))?;
        if on && (!s.is_first() || !matches!(s.status, SeqStatus::Running | SeqStatus::Preempted)) {
            return Err(bad_state(
                seq,
                s.status,
                "set_state_from_load",
                "without blocks (new, or preempted by recompute)",
            ));
        }
        s.state_from_load = on && self.has_state;
        Ok(())
    }

    /// Exactly what the next [`Self::allocate_slots`]`(seq, num_new_tokens)` takes from and
    /// gives back to the free pool, over every group. Of a loading sequence
    /// ([`Self::allocate_external`]): what that allocation takes once its load is committed in
    /// full (the reservation of an in-flight load). Errors as `allocate_slots` except
    /// `OutOfBlocks` and the refusal of a first allocation without external tokens after
    /// [`Self::set_state_from_load`] (the demand is answered: an admission check asks it
    /// before the external allocation). No side effects.
    pub fn num_blocks_needed(&self, seq: SeqId, num_new_tokens: usize) -> Result<BlockDemand> {
        let mut st = self.state.lock();
        let s = st.seqs.get_mut(&seq).ok_or_else(|| unknown(seq))?;
        let sim = Sim::new(&self.pool);
        Ok(self.plan(seq, s, num_new_tokens, &sim)?.demand())
    }

    /// Free blocks a group of sequences needs so that scheduling all of their uncomputed tokens
    /// now, in the given order, succeeds for every member: the largest running total of
    /// `take - release` over the members (each member's allocation sees the pool as the earlier
    /// ones leave it: blocks they registered, touched, released or evicted), plus the distinct
    /// CPU blocks of swapped-out members (what swapping them in takes). With exactly this many
    /// blocks free every member's allocation succeeds (the peak is where the first one would
    /// fail). No side effects. Errors: [`Error::UnknownSequence`]; [`Error::InvalidArgument`] for an id listed
    /// twice.
    pub fn num_blocks_owed(&self, seqs: &[SeqId]) -> Result<usize> {
        let mut guard = self.state.lock();
        let st = &mut *guard;
        check_ids(st, seqs)?;
        let mut sim = Sim::new(&self.pool);
        let (mut net, mut peak) = (0isize, 0isize);
        let mut swapped: HashSet<BlockId> = HashSet::new();
        for id in seqs {
            let s = st.seqs.get_mut(id).expect("checked");
            if s.status == SeqStatus::Swapped {
                swapped.extend(s.held());
                continue;
            }
            if s.tokens.len() == s.num_computed {
                continue;
            }
            let n = s.tokens.len() - s.num_computed;
            let plan = self.plan(*id, s, n, &sim)?;
            net += plan.take as isize - plan.release as isize;
            peak = peak.max(net);
            // What the allocation does to the pool, for the members after it.
            let mut released = Vec::new();
            let mut touched = Vec::new();
            let mut cow_src = Vec::new();
            let mut fresh = 0;
            for (g, gp) in plan.groups.iter().enumerate() {
                let t = &s.tables[g];
                // Tail first, as the call releases them: the LRU order decides what is evicted.
                released.extend(gp.release.iter().rev().map(|&j| t.blocks[j]));
                if !self.cfg.groups[g].is_state() {
                    // (A state group's hit is only a copy source, never taken.)
                    touched.extend(
                        gp.hits
                            .iter()
                            .copied()
                            .filter(|&b| b != NULL_BLOCK && b != VIRTUAL && b != HOST_HIT),
                    );
                }
                if gp.cow {
                    cow_src.push(t.blocks[plan.context / self.cfg.groups[g].block_size as usize]);
                }
                // A host hit is loaded into a fresh block.
                let loads = gp.hits.iter().filter(|&&b| b == HOST_HIT).count();
                fresh += gp.fresh + usize::from(gp.cow) + loads;
            }
            touched.sort_unstable();
            touched.dedup();
            sim.apply(&released, &touched, fresh, &cow_src);
            if plan.first && self.has_state {
                // A state hit still free and cached moves to the young end of the LRU, as
                // the call does once it has planned the copy.
                for (g, gp) in plan.groups.iter().enumerate() {
                    if !self.cfg.groups[g].is_state() {
                        continue;
                    }
                    if let Some(&b) = gp.hits.last() {
                        if b != NULL_BLOCK
                            && b != VIRTUAL
                            && b != HOST_HIT
                            && sim.refc(b) == 0
                            && sim.is_hashed(b)
                        {
                            sim.lru_take(b);
                            sim.lru_push(b);
                        }
                    }
                }
            }
            if let Some(host) = self.host.as_ref() {
                let t = &host.lock().tier;
                sim.host_unsure |= sim.evicted.len() > t.num_blocks() as usize - t.num_used();
            }
            // Blocks it registers become hits (in use) for later members.
            if s.stale_kv {
                continue;
            }
            let end = plan.context + plan.q;
            for (g, gp) in plan.groups.iter().enumerate() {
                let spec = &self.cfg.groups[g];
                if spec.is_state() {
                    continue; // published by commit_computed only
                }
                let bs = spec.block_size as usize;
                let full = end.min(self.hashable_len(s)) / bs;
                let start = if plan.first {
                    gp.hits.len()
                } else {
                    s.tables[g].scanned
                };
                // Blocks it held before the call keep their ids (a later member's hit on one
                // adds a reference a sibling's release then sees); the new ones (fresh,
                // copy-on-write destination) are virtual.
                let cow_at = gp.cow.then_some(plan.context / bs);
                if self.host.is_some() {
                    self.sim_register_loads(s, g, &gp.hits, &mut sim);
                }
                for j in start..full {
                    if !self.registers_at_fill(spec, j) {
                        continue;
                    }
                    let b = if j < s.tables[g].blocks.len() && cow_at != Some(j) {
                        s.tables[g].blocks[j]
                    } else {
                        VIRTUAL
                    };
                    if b == NULL_BLOCK || (b != VIRTUAL && sim.is_hashed(b)) {
                        continue; // nothing to cache, or it keeps its first hash
                    }
                    if b != VIRTUAL {
                        sim.hashed.insert(b);
                    }
                    let key = self.key_at(s, g, j);
                    sim.registered.entry(key).or_default().push(b);
                }
            }
        }
        Ok(peak.max(0) as usize + swapped.len())
    }

    /// Schedules `q = min(num_new_tokens, uncomputed)` tokens of `seq` in every group: on a
    /// first allocation the cached prefix every group can serve is taken first; then each
    /// windowed group releases the blocks no query from the context on can read, every group
    /// gets blocks for `context + q` tokens (a shared partially filled last block is copied:
    /// copy-on-write), and newly full blocks are cached by the retention rule.
    ///
    /// `num_new_tokens == 0` on a first allocation takes the prefix hit only (a scheduler that
    /// recomputes the hit's last tokens for a group out of the prefix cache,
    /// [`crate::GroupSpec::prefix_cacheable`]).
    ///
    /// Errors (state unchanged): [`Error::UnknownSequence`]; [`Error::InvalidSequenceState`]
    /// (swapped out); [`Error::InvalidArgument`] (`num_new_tokens == 0` past a first allocation
    /// or without a prefix hit, nothing left);
    /// [`Error::OutOfBlocks`] `{requested: take, available: free + release}`.
    pub fn allocate_slots(&self, seq: SeqId, num_new_tokens: usize) -> Result<SlotAllocation> {
        let mut guard = self.state.lock();
        let st = &mut *guard;
        let s = st.seqs.get_mut(&seq).ok_or_else(|| unknown(seq))?;
        let mut out = Vec::new();
        let a = self.allocate_locked(seq, s, num_new_tokens, &mut out)?;
        self.absorb(st, out);
        Ok(a.into())
    }

    /// Speculative decoding's verify step: [`Self::allocate_slots`] plus lookahead slots for
    /// `draft_tokens` (`k` proposed tokens) right after the scheduled ones, in every group, in
    /// the same call. The drafts' KV is written at positions `num_computed .. num_computed + k`
    /// but they are not tokens of the sequence: nothing is hashed, cached or announced for
    /// them, and the sequence stays pending until [`Self::accept_drafts`]. A windowed group
    /// releases out of the window by the committed context only (the verify query's first
    /// token reads `W - 1` tokens back from it: the block a later query row no longer reads
    /// stays), never by the lookahead positions (vLLM #44082). With no drafts this is
    /// `allocate_slots`.
    ///
    /// Errors (state unchanged): those of `allocate_slots` (`OutOfBlocks` counts the
    /// lookahead blocks too); [`Error::InvalidArgument`] (`draft_tokens`) when the scheduled
    /// tokens do not reach the sequence's last token; [`Error::InvalidSequenceState`] when
    /// drafts are pending already.
    pub fn allocate_slots_with_drafts(
        &self,
        seq: SeqId,
        num_new_tokens: usize,
        draft_tokens: &[u32],
    ) -> Result<SlotAllocation> {
        let mut guard = self.state.lock();
        let st = &mut *guard;
        let s = st.seqs.get_mut(&seq).ok_or_else(|| unknown(seq))?;
        let mut out = Vec::new();
        let a = self.allocate_locked_with_drafts(seq, s, num_new_tokens, draft_tokens, &mut out)?;
        self.absorb(st, out);
        Ok(a.into())
    }

    /// [`Self::allocate_slots_with_drafts`] plus `num_lookahead` slots past the scheduled
    /// tokens and drafts, in every group, whose tokens do not exist yet (a drafter with its
    /// own forward pass, EAGLE / MTP, writes KV there): every group's table covers
    /// `context + q + drafts + num_lookahead` positions, the blocks past the scheduled tokens
    /// and drafts held as spare blocks (private, never hashed; the next allocations fill them
    /// before taking fresh ones; preemption or free releases them). Allowed mid-prompt (the
    /// slots then lie over known tokens not scheduled yet). With `num_lookahead == 0` this is
    /// `allocate_slots_with_drafts`. Same errors (`OutOfBlocks` counts the lookahead blocks).
    pub fn allocate_slots_with_lookahead(
        &self,
        seq: SeqId,
        num_new_tokens: usize,
        draft_tokens: &[u32],
        num_lookahead: usize,
    ) -> Result<SlotAllocation> {
        if num_lookahead == 0 {
            return self.allocate_slots_with_drafts(seq, num_new_tokens, draft_tokens);
        }
        let mut guard = self.state.lock();
        let st = &mut *guard;
        let s = st.seqs.get_mut(&seq).ok_or_else(|| unknown(seq))?;
        let mut ev = Vec::new();
        let mut out = Alloc::default();
        out.reset(self.num_groups());
        self.allocate_general(
            seq,
            s,
            num_new_tokens,
            draft_tokens,
            0,
            0,
            false,
            num_lookahead,
            &mut ev,
            &mut out,
        )?;
        self.absorb(st, ev);
        Ok(out.into())
    }

    /// Exactly what the next [`Self::allocate_slots_with_lookahead`] with `num_drafts` drafts
    /// and `num_lookahead` lookahead slots takes from and gives back to the free pool. Errors
    /// as that call except `OutOfBlocks`. No side effects.
    pub fn num_blocks_needed_with_lookahead(
        &self,
        seq: SeqId,
        num_new_tokens: usize,
        num_drafts: usize,
        num_lookahead: usize,
    ) -> Result<BlockDemand> {
        let mut st = self.state.lock();
        let s = st.seqs.get_mut(&seq).ok_or_else(|| unknown(seq))?;
        let sim = Sim::new(&self.pool);
        Ok(self
            .plan_external(seq, s, num_new_tokens, num_drafts, 0, num_lookahead, &sim)?
            .demand())
    }

    /// Exactly what the next [`Self::allocate_slots_with_drafts`] with `num_drafts` drafts
    /// takes from and gives back to the free pool. Errors as that call except `OutOfBlocks`.
    /// No side effects.
    pub fn num_blocks_needed_with_drafts(
        &self,
        seq: SeqId,
        num_new_tokens: usize,
        num_drafts: usize,
    ) -> Result<BlockDemand> {
        let mut st = self.state.lock();
        let s = st.seqs.get_mut(&seq).ok_or_else(|| unknown(seq))?;
        let sim = Sim::new(&self.pool);
        Ok(self
            .plan_with_drafts(seq, s, num_new_tokens, num_drafts, &sim)?
            .demand())
    }

    /// Resolves the pending drafts of `seq` after verification: the first `num_accepted`
    /// (`m <= k`) become tokens with their KV computed (the token the verify step samples
    /// after them is appended as usual); in every group the rejected tail's slots are free for
    /// the next step and each block that held only rejected drafts is released (tail first,
    /// never hashed). Blocks now full of accepted tokens are cached by the retention rule, as
    /// if the tokens had been decoded one by one. Nothing is released out of a window here:
    /// the next allocation does it from the committed context. Returns, per group, the
    /// released block ids in release order.
    ///
    /// Errors (state unchanged): [`Error::UnknownSequence`]; [`Error::InvalidSequenceState`]
    /// without pending drafts; [`Error::InvalidArgument`] (`num_accepted`) for more accepted
    /// than proposed.
    pub fn accept_drafts(&self, seq: SeqId, num_accepted: usize) -> Result<Vec<Vec<BlockId>>> {
        self.accept_drafts_with(seq, num_accepted, true)
    }

    /// [`Self::accept_drafts`] that keeps the blocks which held only rejected drafts as spare
    /// lookahead blocks the next allocations fill before taking fresh ones (for a consumer
    /// whose copy of the block tables only grows while a request runs). Nothing is released
    /// (every group's list is empty); spare blocks are private and unhashed, a fork does not
    /// share them, and preemption or free releases them with the rest. Same errors.
    pub fn accept_drafts_keeping_blocks(
        &self,
        seq: SeqId,
        num_accepted: usize,
    ) -> Result<Vec<Vec<BlockId>>> {
        self.accept_drafts_with(seq, num_accepted, false)
    }

    /// The commit fence of state groups: the caller declares that every forward pass of `seq`
    /// that computed positions below `num_tokens` has completed. Publishes (registers in the
    /// prefix index under the chain key of its aligned prefix, announces with `BlockStored`,
    /// notes for the host tier) each state block of `seq` still held whose state is the one
    /// after an aligned step end `e = (j + 1) * block_size <= num_tokens` (with a retention
    /// interval, only ends at its multiples), and releases the published blocks that are no
    /// longer live (cached). Returns how many blocks were published. A number below an earlier
    /// commit publishes nothing new; a sequence without state groups, not running, or with
    /// nothing pending: `Ok(0)`. States written by steps that end between alignment points
    /// are never published; a free, preemption or abort before the commit releases the pending
    /// states unpublished.
    ///
    /// Errors (state unchanged): [`Error::UnknownSequence`]; [`Error::InvalidArgument`]
    /// (`num_tokens`) above the sequence's computed tokens.
    pub fn commit_computed(&self, seq: SeqId, num_tokens: usize) -> Result<usize> {
        let mut guard = self.state.lock();
        let st = &mut *guard;
        let s = st.seqs.get(&seq).ok_or_else(|| unknown(seq))?;
        if num_tokens > s.num_computed {
            return Err(Error::InvalidArgument {
                arg: "num_tokens",
                value: num_tokens.to_string(),
                reason: format!(
                    "sequence {seq} has {} computed token(s): a commit covers computed positions \
                     only",
                    s.num_computed
                ),
            });
        }
        let mut ev = Vec::new();
        let published = self.commit_locked(st, seq, num_tokens, &mut ev)?;
        self.drain_pool(&mut ev);
        self.absorb(st, ev);
        Ok(published)
    }

    /// [`Self::commit_computed`] of every computed token of each of `seqs`, under one lock:
    /// what an engine calls once its step's forward pass over these sequences completed.
    /// Returns the blocks published over all of them. Errors (state unchanged):
    /// [`Error::UnknownSequence`] for the first id not held.
    pub fn commit_all_computed(&self, seqs: &[SeqId]) -> Result<usize> {
        let mut guard = self.state.lock();
        let st = &mut *guard;
        if let Some(&seq) = seqs.iter().find(|q| !st.seqs.contains_key(q)) {
            return Err(unknown(seq));
        }
        if !self.has_state {
            return Ok(0);
        }
        let mut ev = Vec::new();
        let mut published = 0;
        for &seq in seqs {
            let n = st.seqs[&seq].num_computed;
            published += self.commit_locked(st, seq, n, &mut ev)?;
        }
        self.drain_pool(&mut ev);
        self.absorb(st, ev);
        Ok(published)
    }

    /// The commit of `seq` (held, `num_tokens <= num_computed`) under the caller's lock.
    fn commit_locked(
        &self,
        st: &mut State,
        seq: SeqId,
        num_tokens: usize,
        ev: &mut Vec<Pending>,
    ) -> Result<usize> {
        let s = st.seqs.get_mut(&seq).ok_or_else(|| unknown(seq))?;
        if !self.has_state || s.status != SeqStatus::Running || s.num_computed == 0 {
            return Ok(0);
        }
        let mut published = 0;
        let mut released = Vec::new();
        for g in 0..self.num_groups() {
            let spec = self.cfg.groups[g];
            if !spec.is_state() {
                continue;
            }
            let bs = spec.block_size as usize;
            let live = (s.state_end() - 1) / bs;
            let upto = (num_tokens / bs).min(s.tables[g].blocks.len());
            let picked: Vec<usize> = (0..upto)
                .filter(|&j| self.state_pending(s, g, j, s.state_end()))
                .collect();
            published += picked.len();
            self.register(s, g, &picked, ev, true);
            // Aligned states at or below the commit that are no longer live: released (cached
            // when published), tail first. With speculative blocks only those under the
            // columns the last allocation holds (the runner may still copy an accepted
            // state into a column the live state left).
            let hold = if self.spec_blocks() > 0 {
                (s.last_context.max(1) - 1) / bs
            } else {
                usize::MAX
            };
            let t = &mut s.tables[g];
            for j in (0..upto.min(hold)).rev() {
                if j != live && t.blocks[j] != NULL_BLOCK {
                    released.push(std::mem::replace(&mut t.blocks[j], NULL_BLOCK));
                    t.rewritten_from(j);
                }
            }
        }
        if !released.is_empty() {
            // Cannot fail: the sequence holds every one of them.
            self.pool.free(&released)?;
        }
        Ok(published)
    }

    /// Registers every computed full block of `seq` the fill-time rule caches that is not
    /// cached yet, without allocating: with [`CacheConfig::hash_lookahead_tokens`] `k > 0`, the
    /// blocks whose `k` successor tokens were appended since the last allocation (a scheduler
    /// that caches them as soon as the sampled token is known, as vLLM does under speculative
    /// decoding). A no-op with `k = 0` (every computed full block is registered by its
    /// allocation). Errors (state unchanged): [`Error::UnknownSequence`].
    pub fn cache_computed(&self, seq: SeqId) -> Result<()> {
        let mut guard = self.state.lock();
        let st = &mut *guard;
        let s = st.seqs.get_mut(&seq).ok_or_else(|| unknown(seq))?;
        if self.cfg.hash_lookahead_tokens == 0 || s.status != SeqStatus::Running {
            return Ok(());
        }
        let mut ev = Vec::new();
        self.cache_full(s, &mut ev, true);
        self.drain_pool(&mut ev);
        self.absorb(st, ev);
        Ok(())
    }

    /// Draft tokens pending on `seq`. Errors: [`Error::UnknownSequence`].
    pub fn num_draft_tokens(&self, seq: SeqId) -> Result<usize> {
        let st = self.state.lock();
        Ok(st.seqs.get(&seq).ok_or_else(|| unknown(seq))?.drafts.len())
    }

    /// Forks `parent` into `child`: every group's table is shared (ref counts + 1), nothing
    /// allocated. Errors: [`Error::UnknownSequence`], [`Error::SequenceExists`],
    /// [`Error::InvalidSequenceState`] (swapped-out or loading parent).
    pub fn fork(&self, parent: SeqId, child: SeqId) -> Result<()> {
        let mut st = self.state.lock();
        let p = st.seqs.get(&parent).ok_or_else(|| unknown(parent))?;
        if matches!(p.status, SeqStatus::Swapped | SeqStatus::Loading) {
            return Err(bad_state(parent, p.status, "fork", "running or preempted"));
        }
        if !p.drafts.is_empty() {
            return Err(drafts_pending(parent, "fork"));
        }
        if self.has_state {
            return Err(Error::InvalidArgument {
                arg: "parent",
                value: parent.to_string(),
                reason: "fork is not supported with state groups (a recurrent state cannot be \
                         shared block by block)"
                    .into(),
            });
        }
        if st.seqs.contains_key(&child) {
            return Err(Error::SequenceExists { seq_id: child });
        }
        let mut c = p.clone();
        // Spare lookahead blocks stay the parent's: the child's tables end with its tokens.
        for t in &mut c.tables {
            let n = t.blocks.len() - t.spare;
            t.blocks.truncate(n);
            t.spare = 0;
            t.reported = 0; // new to the outputs
        }
        c.table_version = st.table_versions;
        let held: Vec<BlockId> = c.held().collect();
        if !held.is_empty() {
            self.pool.incref(&held)?;
        }
        st.seqs.insert(child, c);
        Ok(())
    }

    /// Frees `seq` and forgets it; with sparse retention its windowed blocks are cached first
    /// (its latest replayable point). A loading sequence's staged blocks are released
    /// unregistered (an abort while its load is in flight). Returns `false` for an unknown id.
    /// O(blocks).
    pub fn free(&self, seq: SeqId) -> bool {
        let mut guard = self.state.lock();
        let st = &mut *guard;
        let Some(mut s) = st.seqs.remove(&seq) else {
            return false;
        };
        let mut ev = Vec::new();
        if s.status == SeqStatus::Swapped {
            let held: Vec<BlockId> = s.held().collect();
            cpu_release(&mut st.cpu, &held);
        } else {
            self.cache_latest(&mut s, &mut ev);
            self.release_all(&s);
        }
        self.absorb(st, ev);
        true
    }

    /// Preemption by recompute, all-or-nothing over the group: every group's blocks are
    /// released (cached ones keep their hashes; with sparse retention the windowed blocks are
    /// cached first; a loading sequence's staged blocks are released unregistered: a failed
    /// load), tokens kept, `num_computed = 0`. Errors (nothing changed):
    /// [`Error::UnknownSequence`], [`Error::InvalidArgument`] (duplicate id),
    /// [`Error::InvalidSequenceState`] (swapped out).
    pub fn preempt_recompute(&self, seqs: &[SeqId]) -> Result<()> {
        self.preempt_with(seqs, None, "preempt")
    }

    /// [`Self::preempt_recompute`]; with `defer`, the blocks go there (tail first per member)
    /// instead of back to the pool. `op` names the call in errors (the Python method's name).
    fn preempt_with(
        &self,
        seqs: &[SeqId],
        mut defer: Option<&mut Vec<BlockId>>,
        op: &'static str,
    ) -> Result<()> {
        let mut guard = self.state.lock();
        let st = &mut *guard;
        let resumable = |s: SeqStatus| s != SeqStatus::Swapped;
        check_group(st, seqs, op, resumable, "running, loading or preempted")?;
        let running = seqs
            .iter()
            .filter(|id| st.seqs[id].status == SeqStatus::Running)
            .count();
        if running > 0 {
            self.counters.lock().preemptions += running as u64;
        }
        let mut ev = Vec::new();
        for id in seqs {
            let mut s = st.seqs.remove(id).expect("checked");
            self.cache_latest(&mut s, &mut ev);
            match defer.as_deref_mut() {
                Some(kept) => kept.extend(tail_first(&s)),
                None => self.release_all(&s),
            }
            for t in &mut s.tables {
                *t = GroupTable::default();
            }
            s.num_computed = 0;
            s.last_context = 0;
            s.status = SeqStatus::Preempted;
            s.stale_kv = false; // its KV is computed again on resume
            s.drafts.clear(); // their lookahead blocks went with the rest
            s.rewrite_to = 0;
            s.tainted_from = usize::MAX;
            s.publish_floor = 0;
            s.state_slots = 0;
            s.state_marks.clear();
            st.seqs.insert(*id, s);
        }
        self.absorb(st, ev);
        Ok(())
    }

    /// Swaps a group out: each distinct GPU block held by any group of any member is planned
    /// once onto a CPU block (null entries stay null), the GPU blocks are released. Returns
    /// the `(gpu, cpu)` plan in order of first appearance (member, group, table order).
    /// Errors (nothing changed): [`Error::UnknownSequence`], [`Error::InvalidArgument`]
    /// (duplicate id), [`Error::InvalidSequenceState`] (not running),
    /// [`Error::OutOfSwapSpace`].
    pub fn swap_out(&self, seqs: &[SeqId]) -> Result<Vec<(BlockId, BlockId)>> {
        let mut guard = self.state.lock();
        let st = &mut *guard;
        check_group(st, seqs, "swap_out", |s| s == SeqStatus::Running, "running")?;
        for id in seqs {
            if !st.seqs[id].drafts.is_empty() {
                return Err(drafts_pending(*id, "swap_out"));
            }
        }
        // State groups: the states waiting for their commit are released unpublished (they
        // leave the table, so they are not swapped), and the live state is never published.
        let stripped = if self.has_state {
            self.strip_pending_states(st, seqs)
        } else {
            Vec::new()
        };
        let mut order = Vec::new();
        let mut uses: HashMap<BlockId, u32> = HashMap::new();
        for id in seqs {
            let s = &st.seqs[id];
            if !s.drafts.is_empty() {
                return Err(drafts_pending(*id, "swap_out"));
            }
            for b in s.held() {
                let n = uses.entry(b).or_insert(0);
                if *n == 0 {
                    order.push(b);
                }
                *n += 1;
            }
        }
        if order.len() > st.cpu.free.len() {
            for &(id, g, j, b) in &stripped {
                st.seqs.get_mut(&id).expect("checked").tables[g].blocks[j] = b;
            }
            return Err(Error::OutOfSwapSpace {
                requested: order.len(),
                available: st.cpu.free.len(),
            });
        }
        for id in seqs {
            self.release_all(&st.seqs[id]);
        }
        let pending: Vec<BlockId> = stripped.iter().map(|&(_, _, _, b)| b).collect();
        if !pending.is_empty() {
            self.pool.free(&pending)?;
        }
        for id in seqs {
            if self.has_state {
                let s = st.seqs.get_mut(id).expect("checked");
                s.publish_floor = s.state_end();
            }
        }
        let mut map = HashMap::with_capacity(order.len());
        let mut plan = Vec::with_capacity(order.len());
        for &g in &order {
            let c = st.cpu.free.pop().expect("checked");
            st.cpu.refs[c as usize] = uses[&g];
            map.insert(g, c);
            plan.push((g, c));
        }
        for id in seqs {
            let s = st.seqs.get_mut(id).expect("checked");
            for t in &mut s.tables {
                for b in &mut t.blocks {
                    *b = if *b == NULL_BLOCK { CPU_NULL } else { map[b] };
                }
            }
            s.status = SeqStatus::Swapped;
        }
        let mut c = self.counters.lock();
        c.swaps_out_blocks += plan.len() as u64;
        c.preemptions += seqs.len() as u64;
        Ok(plan)
    }

    /// Swaps a group back in: one fresh GPU block per distinct CPU block, sharing kept; the
    /// full computed blocks are cached again by the retention rule, unless the prefix cache
    /// was reset while they were out (their KV predates the reset: see
    /// [`Self::reset_prefix_cache`]). Returns the `(cpu, gpu)`
    /// plan. Errors (nothing changed): [`Error::UnknownSequence`], [`Error::InvalidArgument`],
    /// [`Error::InvalidSequenceState`] (not swapped), [`Error::OutOfBlocks`].
    pub fn swap_in(&self, seqs: &[SeqId]) -> Result<Vec<(BlockId, BlockId)>> {
        let mut guard = self.state.lock();
        let st = &mut *guard;
        check_group(st, seqs, "swap_in", |s| s == SeqStatus::Swapped, "swapped")?;
        let mut order = Vec::new();
        let mut seen = HashSet::new();
        let mut extra = Vec::new();
        for id in seqs {
            let s = &st.seqs[id];
            for c in s.held() {
                if seen.insert(c) {
                    order.push(c);
                } else {
                    extra.push(c);
                }
            }
        }
        let mut ev = Vec::new();
        let gpu = {
            let mut host = self.host.as_ref().map(|h| h.lock());
            self.allocate_storing(order.len(), host.as_deref_mut(), &mut ev)?
        };
        self.drain_pool(&mut ev);
        let map: HashMap<BlockId, BlockId> =
            order.iter().copied().zip(gpu.iter().copied()).collect();
        if !extra.is_empty() {
            let e: Vec<BlockId> = extra.iter().map(|c| map[c]).collect();
            self.pool.incref(&e)?;
        }
        for id in seqs {
            let s = st.seqs.get_mut(id).expect("checked");
            let held: Vec<BlockId> = s.held().collect();
            cpu_release(&mut st.cpu, &held);
            for t in &mut s.tables {
                for b in &mut t.blocks {
                    *b = if *b == CPU_NULL { NULL_BLOCK } else { map[b] };
                }
                t.scanned = 0;
                t.reported = 0; // every entry has a new GPU id
            }
            s.status = SeqStatus::Running;
            self.cache_full(s, &mut ev, false);
        }
        if let Some(host) = self.host.as_ref() {
            // Their KV arrives by the swap-in copy, run after the next step call's stores.
            let mut host = host.lock();
            for &d in &gpu {
                host.tier.note_copied_in(d);
            }
        }
        self.absorb(st, ev);
        self.counters.lock().swaps_in_blocks += order.len() as u64;
        Ok(order.into_iter().zip(gpu).collect())
    }

    /// Drops every prefix-cache entry of every group (emitting [`KvEvent::AllBlocksCleared`]),
    /// those of blocks swapped out to the CPU pool included: a swapped-out sequence's KV
    /// predates the reset, so after its swap-in no block of it is registered or announced (not
    /// even the blocks it fills later, whose parents are not cached) until a recompute
    /// preemption computes its KV again. Errors: [`Error::CacheInUse`] while any GPU block is
    /// referenced (nothing changed). O(num_blocks + sequences).
    pub fn reset_prefix_cache(&self) -> Result<()> {
        let mut guard = self.state.lock();
        self.pool.reset_prefix_cache()?;
        if let Some(host) = self.host.as_ref() {
            host.lock().clear();
        }
        for s in guard.seqs.values_mut() {
            if s.status == SeqStatus::Swapped && s.num_computed > 0 {
                s.stale_kv = true;
            }
        }
        let mut ev = Vec::new();
        self.drain_pool(&mut ev);
        self.absorb(&mut guard, ev);
        Ok(())
    }

    /// The block tables of `seq`, one per group (null entries for released blocks; CPU ids
    /// while swapped, with [`CPU_NULL`] for released entries). Errors: [`Error::UnknownSequence`].
    pub fn block_tables(&self, seq: SeqId) -> Result<Vec<Vec<BlockId>>> {
        let st = self.state.lock();
        let s = st.seqs.get(&seq).ok_or_else(|| unknown(seq))?;
        Ok(s.tables.iter().map(|t| t.blocks.clone()).collect())
    }

    /// Blocks `seq` holds per group (non-null table entries: GPU blocks, or CPU blocks while
    /// swapped out). Errors: [`Error::UnknownSequence`].
    pub fn num_blocks_held(&self, seq: SeqId) -> Result<Vec<usize>> {
        let st = self.state.lock();
        let s = st.seqs.get(&seq).ok_or_else(|| unknown(seq))?;
        let none = s.null_entry();
        Ok(s.tables
            .iter()
            .map(|t| t.blocks.iter().filter(|&&b| b != none).count())
            .collect())
    }

    /// Per sequence, in order: tokens known but not yet scheduled, `num_tokens -
    /// num_computed_tokens` (in every state; a preempted sequence owes all of its tokens).
    /// `i32` like the step's other per-sequence lengths. Errors: [`Error::UnknownSequence`]
    /// for the first unknown id. O(len(seqs)).
    pub fn num_uncomputed_tokens(&self, seqs: &[SeqId]) -> Result<Vec<i32>> {
        let st = self.state.lock();
        seqs.iter()
            .map(|id| {
                let s = st.seqs.get(id).ok_or_else(|| unknown(*id))?;
                Ok((s.tokens.len() - s.num_computed) as i32)
            })
            .collect()
    }

    /// The manager's running counters (prefix queries and hits, copies, swaps, preemptions).
    pub fn counters(&self) -> ManagerCounters {
        let _st = self.state.lock();
        *self.counters.lock()
    }

    /// A snapshot of usage and counters over the whole pool (every group's pages).
    /// `block_size` is group 0's; `kv_utilization` is the computed tokens over the token
    /// slots of the distinct blocks running sequences hold (each block in its own group's
    /// block size, its fullest holder counting). O(blocks of running sequences).
    pub fn stats(&self) -> CacheStats {
        let st = self.state.lock();
        let mut fill: HashMap<BlockId, (usize, usize)> = HashMap::new();
        for s in st.seqs.values().filter(|s| s.status == SeqStatus::Running) {
            for (g, t) in s.tables.iter().enumerate() {
                let bs = self.cfg.groups[g].block_size as usize;
                for (k, &b) in t.blocks.iter().enumerate() {
                    if b == NULL_BLOCK {
                        continue;
                    }
                    let in_block = s.num_computed.saturating_sub(k * bs).min(bs);
                    let e = fill.entry(b).or_insert((0, bs));
                    e.0 = e.0.max(in_block);
                }
            }
        }
        let slots: usize = fill.values().map(|&(_, bs)| bs).sum();
        let kv_utilization = if slots == 0 {
            0.0
        } else {
            fill.values().map(|&(f, _)| f).sum::<usize>() as f64 / slots as f64
        };
        let used = self.pool.num_used();
        let host = self.host.as_ref().map(|h| h.lock());
        let c = *self.counters.lock();
        CacheStats {
            num_blocks: self.cfg.num_blocks,
            block_size: self.cfg.groups[0].block_size,
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
            cpu_used: st.cpu.refs.iter().filter(|&&r| r > 0).count(),
            num_host_blocks: self.cfg.num_host_blocks,
            host_used: host.as_ref().map_or(0, |h| h.tier.num_used()),
            host_hits_tokens: c.host_hits_tokens,
            host_stores_blocks: host.as_ref().map_or(0, |h| h.tier.counters().stores),
            host_loads_blocks: host.as_ref().map_or(0, |h| h.tier.counters().loads),
        }
    }

    /// Known tokens of `seq`. Errors: [`Error::UnknownSequence`].
    pub fn num_tokens(&self, seq: SeqId) -> Result<usize> {
        let st = self.state.lock();
        Ok(st.seqs.get(&seq).ok_or_else(|| unknown(seq))?.tokens.len())
    }

    /// The sequence's token ids (prompt and appended, drafts excluded). Errors:
    /// [`Error::UnknownSequence`]. O(tokens).
    pub fn tokens(&self, seq: SeqId) -> Result<Vec<u32>> {
        let st = self.state.lock();
        Ok(st
            .seqs
            .get(&seq)
            .ok_or_else(|| unknown(seq))?
            .tokens
            .clone())
    }

    /// Tokens of `seq` whose KV is (scheduled to be) written. Errors: [`Error::UnknownSequence`].
    pub fn num_computed_tokens(&self, seq: SeqId) -> Result<usize> {
        let st = self.state.lock();
        Ok(st.seqs.get(&seq).ok_or_else(|| unknown(seq))?.num_computed)
    }

    /// Status of `seq`. Errors: [`Error::UnknownSequence`].
    pub fn status(&self, seq: SeqId) -> Result<SeqStatus> {
        let st = self.state.lock();
        Ok(st.seqs.get(&seq).ok_or_else(|| unknown(seq))?.status)
    }

    /// Registered sequences.
    pub fn num_sequences(&self) -> usize {
        self.state.lock().seqs.len()
    }

    /// The host-tier copies planned since the last hand-out, for a caller that allocates
    /// outside [`Self::step`] (which hands them out in [`StepOutput::host_stores`] /
    /// [`StepOutput::host_loads`]): `(group, device, host)` stores and `(group, host,
    /// device)` loads, run in the step order (stores first, loads before the forward pass that
    /// reads the loaded blocks); the loads' host blocks stay pinned until the next step call
    /// returns. Empty without a host tier. O(plans).
    pub fn take_host_transfers(&self) -> GroupHostTransfers {
        let _st = self.state.lock();
        match self.host.as_ref() {
            Some(h) => h.lock().hand_out(&self.pool),
            None => GroupHostTransfers::default(),
        }
    }

    /// Drains the buffered group events, oldest first (empty with events off).
    pub fn take_events(&self) -> Vec<GroupEvent> {
        std::mem::take(&mut self.state.lock().events)
    }

    /// One scheduler step: for each sequence in order, append its tokens (CSR slice of
    /// `append_tokens`) and [`Self::allocate_slots`] it; stop at the first failure (that
    /// sequence unchanged, appended tokens removed again). A malformed request (lengths, CSR
    /// offsets, an id listed twice) schedules nothing. Returns every group's slot mapping and
    /// dense block tables. O(tokens scheduled x groups + G x S x W).
    pub fn step(&self, req: &StepRequest) -> StepOutput {
        self.step_with_drafts(req, &StepDrafts::default())
    }

    /// [`Self::step`] for speculative decoding: sequence `i` also gets lookahead slots for its
    /// draft tokens (`drafts`' CSR slice `i`), as [`Self::allocate_slots_with_drafts`]. Its
    /// query is then its scheduled tokens followed by the drafts (`query_start_loc`,
    /// `seq_lens`, `slot_mapping` and `input_ids` include them; `num_draft_tokens` says how
    /// many), and it stays pending until [`Self::accept_drafts`]. Malformed draft offsets are
    /// reported in `error` with nothing scheduled.
    pub fn step_with_drafts(&self, req: &StepRequest, drafts: &StepDrafts) -> StepOutput {
        self.step_with(req, drafts, StepOptions::default())
    }

    /// [`Self::step_with_drafts`] with [`StepOptions`]: without the dense block tables
    /// (callers keeping them from the table deltas) and / or the per-token arrays. O(tokens
    /// scheduled x groups + changed table entries), plus G x S x W for the dense tables.
    ///
    /// With a host tier, the step first marks the previous step's plans as run (blocks
    /// registered before it hold their KV; the loads handed out then are done and their host
    /// blocks unpinned when it returns) and hands out the copies planned since the last
    /// hand-out in [`StepOutput::host_stores`] / [`StepOutput::host_loads`].
    pub fn step_with(
        &self,
        req: &StepRequest,
        drafts: &StepDrafts,
        opts: StepOptions,
    ) -> StepOutput {
        let Some(host) = self.host.as_ref() else {
            return self.step_groups(req, drafts, opts);
        };
        {
            let _st = self.state.lock();
            host.lock().tier.begin_step();
        }
        let mut out = self.step_groups(req, drafts, opts);
        let _st = self.state.lock();
        let mut h = host.lock();
        h.tier.release_in_flight();
        let plans = h.hand_out(&self.pool);
        out.host_stores = plans
            .stores
            .iter()
            .flat_map(|&(g, d, hb)| [g as i32, d as i32, hb as i32])
            .collect();
        out.host_loads = plans
            .loads
            .iter()
            .flat_map(|&(g, hb, d)| [g as i32, hb as i32, d as i32])
            .collect();
        out
    }

    /// The scheduling part of [`Self::step_with`] (everything but the host tier's hand-out).
    fn step_groups(&self, req: &StepRequest, drafts: &StepDrafts, opts: StepOptions) -> StepOutput {
        // Sized for the common decode step (one token per sequence) so the hot loop rarely
        // reallocates; prefill chunks grow the token-indexed vectors as needed.
        let n = req.seq_ids.len();
        let ng = self.num_groups();
        let tokens = if opts.skip_token_arrays { 0 } else { n };
        let mut out = StepOutput {
            num_groups: ng,
            block_table_width: usize::from(!opts.skip_block_table),
            num_cached_tokens: Vec::with_capacity(n),
            query_start_loc: Vec::with_capacity(n + 1),
            seq_lens: Vec::with_capacity(n),
            context_lens: Vec::with_capacity(n),
            input_ids: Vec::with_capacity(tokens),
            slot_mapping: Vec::with_capacity(ng * tokens),
            new_block_indptr: Vec::with_capacity(n * ng + 1),
            table_start: Vec::with_capacity(n * ng),
            table_version: Vec::with_capacity(n),
            table_delta_indptr: Vec::with_capacity(n * ng + 1),
            ..Default::default()
        };
        out.query_start_loc.push(0);
        out.new_block_indptr.push(0);
        out.table_delta_indptr.push(0);
        if let Err(e) = validate_step(req).and_then(|()| validate_drafts(req, drafts)) {
            out.error = Some(e);
            return out;
        }
        let mut guard = self.state.lock();
        let st = &mut *guard;
        // Resolve every id to its slot once; a sequence listed twice would get two overlapping
        // slot ranges in one step, so that is refused before anything is scheduled.
        let seq_slots: Vec<Option<u32>> =
            req.seq_ids.iter().map(|&id| st.seqs.slot_of(id)).collect();
        if let Some(dup) = duplicate_id(&req.seq_ids, &seq_slots, st.seqs.num_slots()) {
            out.error = Some(Error::InvalidArgument {
                arg: "seq_ids",
                value: dup.to_string(),
                reason: format!("sequence {dup} appears more than once in one step"),
            });
            return out;
        }
        self.prehash_prompts(st, req, &seq_slots);
        let drafts_of = |i: usize| -> &[u32] {
            if drafts.indptr.is_empty() {
                &[]
            } else {
                &drafts.tokens[drafts.indptr[i] as usize..drafts.indptr[i + 1] as usize]
            }
        };
        // Size the token-indexed outputs once: a prefill of long prompts would otherwise grow
        // them by repeated doubling (copies and page faults inside the step).
        let mut max_tokens = 0usize;
        if !opts.skip_token_arrays {
            for (i, slot) in seq_slots.iter().enumerate() {
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
            out.slot_mapping.reserve(ng * max_tokens);
            out.input_ids.reserve(max_tokens);
        }
        // Group 0's slots go straight into the output; the other groups' rows follow it.
        let mut rows: Vec<Vec<i64>> = if opts.skip_token_arrays {
            Vec::new()
        } else {
            (1..ng).map(|_| Vec::with_capacity(max_tokens)).collect()
        };
        let mut ev = Vec::new();
        // One allocation record for the whole loop (reset per sequence, capacity kept).
        let mut alloc = Alloc::default();
        for (i, (&seq, &slot)) in req.seq_ids.iter().zip(&seq_slots).enumerate() {
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
            if let Err(e) = self.allocate_reserving(
                seq,
                s,
                req.num_new_tokens[i] as usize,
                drafts_of(i),
                opts.reserve_blocks,
                &mut ev,
                &mut alloc,
            ) {
                s.tokens.truncate(old_len);
                for c in 0..self.class_bs.len() {
                    let hashable = old_len.saturating_sub(self.cfg.hash_lookahead_tokens as usize);
                    s.chains[c].truncate(hashable / self.class_bs[c]);
                }
                out.error = Some(e);
                break;
            }
            let ctx = alloc.num_context_tokens;
            let q_final = alloc.num_scheduled_tokens;
            // The query: the scheduled tokens, then the drafts in their lookahead slots.
            let q = q_final + alloc.num_draft_tokens;
            out.num_scheduled += 1;
            out.num_cached_tokens.push(alloc.num_cached_tokens as i32);
            out.query_start_loc.push(out.query_start_loc[i] + q as i32);
            out.context_lens.push(ctx as i32);
            out.seq_lens.push((ctx + q) as i32);
            if !drafts.indptr.is_empty() {
                out.num_draft_tokens.push(alloc.num_draft_tokens as i32);
            }
            if !opts.skip_token_arrays {
                out.input_ids
                    .extend(s.tokens[ctx..ctx + q_final].iter().map(|&t| i64::from(t)));
                out.input_ids.extend(s.drafts.iter().map(|&t| i64::from(t)));
            }
            s.table_version += 1;
            st.table_versions = st.table_versions.max(s.table_version);
            out.table_version.push(s.table_version);
            for (g, ga) in alloc.groups.iter().enumerate() {
                let bs = self.cfg.groups[g].block_size as usize;
                let t = &mut s.tables[g];
                if !opts.skip_token_arrays {
                    // Block by block: one division per run of consecutive slots.
                    let row = if g == 0 {
                        &mut out.slot_mapping
                    } else {
                        &mut rows[g - 1]
                    };
                    if self.cfg.groups[g].is_state() {
                        // No per-token KV: the kernel finds the state from the block table.
                        row.resize(row.len() + q, -1);
                    }
                    let mut pos = if self.cfg.groups[g].is_state() {
                        ctx + q
                    } else {
                        ctx
                    };
                    while pos < ctx + q {
                        let off = pos % bs;
                        let run = (bs - off).min(ctx + q - pos);
                        let base = i64::from(t.blocks[pos / bs]) * bs as i64 + off as i64;
                        row.extend((0..run as i64).map(|j| base + j));
                        pos += run;
                    }
                }
                // The table delta: entries changed or added since this table's last report.
                let start = t.reported.min(t.blocks.len());
                t.reported = t.blocks.len();
                out.table_start.push(start as i32);
                out.table_delta
                    .extend(t.blocks[start..].iter().map(|&b| b as i32));
                out.table_delta_indptr.push(out.table_delta.len() as i32);
                out.new_block_ids
                    .extend(ga.new_block_ids.iter().map(|&b| b as i32));
                out.new_block_indptr.push(out.new_block_ids.len() as i32);
                for &(src, dst) in &ga.copies {
                    out.copies.extend([g as i32, src as i32, dst as i32]);
                }
                for &b in &ga.zero_blocks {
                    out.zero_blocks.extend([g as i32, b as i32]);
                }
            }
        }
        self.absorb(st, ev);
        for row in rows {
            out.slot_mapping.extend(row);
        }
        if opts.skip_block_table {
            return out;
        }
        let num_scheduled = out.num_scheduled;
        let scheduled = || {
            seq_slots[..num_scheduled]
                .iter()
                .map(|slot| st.seqs.at_slot(slot.expect("scheduled")))
        };
        let width = scheduled()
            .flat_map(|s| s.tables.iter().map(|t| t.blocks.len()))
            .max()
            .unwrap_or(0)
            .max(1);
        let mut dense = Vec::with_capacity(ng * num_scheduled * width);
        for g in 0..ng {
            for s in scheduled() {
                let t = &s.tables[g].blocks;
                dense.extend(t.iter().map(|&b| b as i32));
                dense.resize(dense.len() + width - t.len(), NULL_BLOCK as i32);
            }
        }
        out.block_table = dense;
        out.block_table_width = width;
        out
    }

    /// Hashes the prompt blocks of the step's first allocations before the loop, two chains at
    /// a time ([`PrefixHasher::extend_chains`]): their lookups and their cached blocks read
    /// these memoised plain hashes. Only when two or more prompts (without extra keys) arrive
    /// in one step; a lone prompt is hashed as its lookup goes.
    fn prehash_prompts(&self, st: &mut State, req: &StepRequest, slots: &[Option<u32>]) {
        if !self.cfg.enable_prefix_caching
            || self.cfg.hash_lookahead_tokens > 0 // (the two-lane hasher hashes plain blocks)
            || req.num_new_tokens.iter().filter(|&&n| n > 1).count() < 2
        {
            return;
        }
        for (c, &bs) in self.class_bs.iter().enumerate() {
            let mut taken: Vec<(u32, Vec<BlockHash>, usize)> = Vec::new();
            for (&slot, &n) in slots
                .iter()
                .map_while(|s| s.as_ref())
                .zip(&req.num_new_tokens)
            {
                let s = st.seqs.at_slot_mut(slot);
                if n <= 1
                    || !s.is_first()
                    || s.status == SeqStatus::Swapped
                    || s.spec != SequenceSpec::default()
                {
                    continue;
                }
                let want = (s.tokens.len() - 1) / bs;
                if s.chains[c].len() < want {
                    taken.push((slot, std::mem::take(&mut s.chains[c]), want));
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
                st.seqs.at_slot_mut(slot).chains[c] = hashes;
            }
        }
    }

    /// Moves the pool's pending events (evictions, resets) into `ev`, for `absorb` to
    /// translate into group events.
    fn drain_pool(&self, ev: &mut Vec<Pending>) {
        if !self.cfg.enable_events {
            return;
        }
        for e in self.pool_events.drain() {
            ev.push(Pending::Pool(e));
        }
    }

    /// Applies the events of one call in order: owner entries update the key table, pool
    /// events become group events (keys back to plain hashes), group events are buffered.
    fn absorb(&self, st: &mut State, ev: Vec<Pending>) {
        if !self.cfg.enable_events {
            return;
        }
        for e in ev {
            match e {
                Pending::Owner(key, g, plain) => {
                    st.key_owner.insert(key, (g, plain));
                }
                Pending::Pool(KvEvent::BlockRemoved { block_hashes, .. }) => {
                    let mut per_group: Vec<(u32, Vec<BlockHash>)> = Vec::new();
                    for key in block_hashes {
                        let Some((g, plain)) = st.key_owner.remove(&key) else {
                            continue;
                        };
                        match per_group.iter_mut().find(|(x, _)| *x == g) {
                            Some((_, v)) => v.push(plain),
                            None => per_group.push((g, vec![plain])),
                        }
                    }
                    for (g, hashes) in per_group {
                        st.events.push(GroupEvent {
                            group: Some(g),
                            event: KvEvent::BlockRemoved {
                                block_hashes: hashes,
                                tier: Tier::Device,
                            },
                        });
                    }
                }
                Pending::Pool(event) => {
                    if event == KvEvent::AllBlocksCleared {
                        st.key_owner.clear();
                    }
                    st.events.push(GroupEvent { group: None, event });
                }
                Pending::Group(e) => st.events.push(e),
            }
        }
    }
}

impl KvCacheManager {
    /// Takes the state blocks waiting for their commit (every held state block but the live
    /// one) out of the tables of `seqs`: `(seq, group, index, block)` per entry, still
    /// referenced (the caller releases or restores them).
    fn strip_pending_states(
        &self,
        st: &mut State,
        seqs: &[SeqId],
    ) -> Vec<(SeqId, usize, usize, BlockId)> {
        let mut out = Vec::new();
        for id in seqs {
            let s = st.seqs.get_mut(id).expect("checked");
            for (g, spec) in self.cfg.groups.iter().enumerate() {
                if !spec.is_state() || s.state_end() == 0 {
                    continue;
                }
                let live = (s.state_end() - 1) / spec.block_size as usize;
                let t = &mut s.tables[g];
                for j in 0..t.blocks.len() {
                    if j != live && t.blocks[j] != NULL_BLOCK {
                        out.push((*id, g, j, std::mem::replace(&mut t.blocks[j], NULL_BLOCK)));
                        t.rewritten_from(j);
                    }
                }
            }
        }
        out
    }
}

/// A group call's members checked in list order: the first duplicate, unknown id or member in
/// a state `ok` refuses is the error (`InvalidArgument`, `UnknownSequence`,
/// `InvalidSequenceState` naming `operation` and `expected`).
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

/// Each member listed once and known (no state required), as [`check_group`] checks them.
fn check_ids(st: &State, seqs: &[SeqId]) -> Result<()> {
    check_group(st, seqs, "", |_| true, "")
}

/// The GPU blocks `s` holds in release order: tail first, table by table.
fn tail_first(s: &Seq) -> Vec<BlockId> {
    let mut out = Vec::new();
    for t in &s.tables {
        out.extend(t.blocks.iter().rev().copied().filter(|&b| b != NULL_BLOCK));
    }
    out
}

fn cpu_release(cpu: &mut CpuPool, table: &[BlockId]) {
    for &c in table.iter().rev() {
        let r = &mut cpu.refs[c as usize];
        *r -= 1;
        if *r == 0 {
            cpu.free.push(c);
        }
    }
}
