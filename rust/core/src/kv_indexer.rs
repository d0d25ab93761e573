//! A cluster-wide index of which worker holds which cached block, fed by the workers' KV events,
//! for KV-aware routing: "how many leading blocks of this request does each worker already
//! hold?".
//!
//! Every worker (an engine replica) publishes its [`KvEvent`]s in numbered batches (`seq` 0, 1,
//! 2, ... per worker). The indexer keeps, per worker, the set of block hashes that are
//! resolvable in that worker's prefix cache, and an inverted map hash → set of workers holding
//! it. A request's overlap with a worker is the number of its leading blocks that worker holds:
//! the prefix the worker's own lookup would serve from its cache, since a lookup stops at the
//! first missing block. Peers: the KV-aware routers of NVIDIA Dynamo (radix tree of block hashes
//! fed by engine events), llm-d's precise prefix-cache scorer and SGLang's cache-aware router;
//! vLLM V1 publishes the events consumed here (`BlockStored` / `BlockRemoved` /
//! `AllBlocksCleared`).
//!
//! Event contract. pagedkv managers emit set semantics per cache: `BlockStored` when a hash
//! becomes resolvable (once while it stays resolvable), `BlockRemoved` when it stops being
//! resolvable, `AllBlocksCleared` on a reset. The indexer keeps the same set semantics per
//! worker: a worker holds a hash or not. A `BlockStored` of a hash the worker holds already
//! changes nothing: vLLM's per-request `kv_cache_report_mode="full"` (vLLM PR #45261)
//! re-announces the prefix-cache hits of a request that way, with no `BlockRemoved` to match,
//! so counting stores would keep a hash after vLLM evicted it. A `BlockRemoved` drops the hash.
//! An engine that caches one hash in two physical blocks (vLLM can) and evicts one of them is
//! then under-reported until it stores the hash again: a missed hit, never a stale entry.
//!
//! Sequence numbers. A batch with the expected number is applied; an older one is a duplicate
//! and ignored; a newer one waits in a per-worker reorder buffer of at most `max_pending`
//! batches and is applied once the missing ones arrive. When a newer batch finds the buffer full
//! the missing batches are declared lost: the worker's entries are cleared (they may be stale:
//! a lost batch may have removed them), the buffered batches are applied from the oldest, and
//! the worker is marked as needing a resync ([`KvIndexer::needs_resync`]) until a snapshot of
//! its cache arrives ([`KvIndexer::apply_snapshot`]). The index of a worker is therefore always
//! a subset of that worker's cache as of its last applied batch, and equal to it while no batch
//! has been lost since the last snapshot (or since `seq` 0).
//!
//! Incarnations. Every registration of a worker id ([`KvIndexer::add_worker`], or a first batch
//! of an unknown id) gets a new [`Incarnation`] number, increasing over the indexer's life, and
//! starts a new sequence (its first batch may be `seq` 0 again). A worker removed and re-added
//! under the same id (a restarted replica) can still have batches of its old incarnation in
//! flight; a caller that names the incarnation a batch came from
//! ([`KvIndexer::apply_batch`]'s `incarnation`) has the old ones refused as
//! [`BatchOutcome::Stale`], so they neither enter the index nor move the new sequence on.
//!
//! Identity. Hashes of engines with different cache identities (chain seeds) never coincide,
//! so they never merge here; and a pagedkv engine's `BlockStored` names its hash root, which
//! must be the indexer's own for an [`HashSource::Engine`] worker (else the batch is refused:
//! its hashes could never match a query).
//!
//! Hash sources. A worker's events carry the worker's own block hashes. For pagedkv engines
//! configured with the indexer's hash algorithm and seed those are the hashes a query computes
//! ([`HashSource::Engine`]). For other engines (vLLM hashes with its own function) the indexer
//! recomputes each stored block's hash from the event's token ids, parent and extra keys with
//! its own [`PrefixHasher`] and keeps a per-worker map from the engine's hash to its own
//! ([`HashSource::Tokens`]).
//!
//! Cache salt on rehashed chains. A pagedkv manager mixes a sequence's cache salt into every
//! block's hash; vLLM mixes it into the first block only (the chain carries it on) and names it
//! only in that block's event. So for a [`HashSource::Tokens`] worker the indexer remembers the
//! salt of each chain it rehashed and applies it to a later event's blocks that name none:
//! a salted vLLM prefix is indexed under the hashes a salted query computes, and an unsalted
//! query never matches it.
//!
//! KV cache groups. A hybrid engine (sliding-window or chunked-local layers beside
//! full-attention ones) publishes each block once per KV cache group, each event naming its
//! group. Only a full-attention group's blocks serve a prefix: a sliding-window group holds
//! the blocks of the last window only and lets earlier ones go while the full-attention group
//! keeps them, so counting its residency as prefix residency (llm-d-router #2362) or its
//! removals as the worker's would misreport the overlap. A worker registered with its groups'
//! attention kinds ([`KvIndexer::add_worker_with_groups`]; default: one full-attention group)
//! has the events of its first full-attention group indexed and every other group's ignored
//! ([`KvIndexer::apply_group_batch`]); a worker without one holds nothing. Other full-attention
//! groups publish the same chain and are not read: an engine hit needs every group, so when
//! one of them evicts a block the indexed group still holds, the overlap over-reports until
//! that group lets the block go as well.
//!
//! Costs: applying a batch is O(blocks named in it) expected (a clear is O(blocks the worker
//! held), paid once per stored block, so amortised O(1) per block); a query is
//! O(blocks of the request × ⌈workers / 64⌉) plus O(workers) for the answer, independent of how
//! many blocks the workers hold.

pub mod vllm_event;

use crate::error::{Error, Result};
use crate::events::{KvEvent, Tier};
use crate::hashing::{BlockHash, ExtraKey, PrefixHasher};
use crate::kv_groups::AttentionKind;
use crate::request::SequenceSpec;
use foldhash::{HashMap, HashSet};
use std::borrow::Cow;
use std::collections::BTreeMap;
use std::sync::Arc;

/// Caller-chosen worker (engine replica) id.
pub type WorkerId = u64;

/// Number of one registration of a worker id (see the module docs): unique over the indexer's
/// life and increasing, so a later registration of an id has a larger one.
pub type Incarnation = u64;

/// Where a worker's hashes come from (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum HashSource {
    /// The event's block hashes are used as they are (pagedkv engines with the indexer's hash
    /// algorithm and seed).
    #[default]
    Engine,
    /// The indexer rehashes every stored block from its token ids, parent and extra keys (engines
    /// with another hash function, e.g. vLLM).
    Tokens,
}

impl HashSource {
    /// `"engine"` or `"tokens"`.
    pub fn name(self) -> &'static str {
        match self {
            HashSource::Engine => "engine",
            HashSource::Tokens => "tokens",
        }
    }

    /// Parses `"engine"` or `"tokens"`.
    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "engine" => Some(HashSource::Engine),
            "tokens" => Some(HashSource::Tokens),
            _ => None,
        }
    }
}

/// What [`KvIndexer::apply_batch`] did with a batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BatchOutcome {
    /// Applied (with any buffered batches that became contiguous).
    Applied,
    /// Newer than expected: kept in the reorder buffer.
    Buffered,
    /// Older than expected, or already buffered: ignored.
    Duplicate,
    /// Batches were lost: the worker's entries were cleared, the buffered batches applied, and
    /// the worker needs a resync.
    Gap,
    /// A batch of an incarnation of the worker that is no longer registered (the worker was
    /// removed, and maybe re-added since): ignored.
    Stale,
}

impl BatchOutcome {
    /// `"applied"`, `"buffered"`, `"duplicate"`, `"gap"` or `"stale"`.
    pub fn name(self) -> &'static str {
        match self {
            BatchOutcome::Applied => "applied",
            BatchOutcome::Buffered => "buffered",
            BatchOutcome::Duplicate => "duplicate",
            BatchOutcome::Gap => "gap",
            BatchOutcome::Stale => "stale",
        }
    }
}

/// A set of worker slots: bits 0..64 inline, the rest in a vector that stays empty (and
/// unallocated) for clusters of at most 64 workers.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct SlotSet {
    lo: u64,
    hi: Vec<u64>,
}

impl SlotSet {
    fn insert(&mut self, slot: usize) {
        if slot < 64 {
            self.lo |= 1 << slot;
        } else {
            let w = slot / 64 - 1;
            if self.hi.len() <= w {
                self.hi.resize(w + 1, 0);
            }
            self.hi[w] |= 1 << (slot % 64);
        }
    }

    fn remove(&mut self, slot: usize) {
        if slot < 64 {
            self.lo &= !(1 << slot);
        } else if let Some(word) = self.hi.get_mut(slot / 64 - 1) {
            *word &= !(1 << (slot % 64));
            while self.hi.last() == Some(&0) {
                self.hi.pop();
            }
        }
    }

    fn is_empty(&self) -> bool {
        self.lo == 0 && self.hi.iter().all(|&w| w == 0)
    }

    /// `self ∪ other`.
    fn union(&self, other: &SlotSet) -> SlotSet {
        let n = self.hi.len().max(other.hi.len());
        let word = |v: &Vec<u64>, i: usize| v.get(i).copied().unwrap_or(0);
        SlotSet {
            lo: self.lo | other.lo,
            hi: (0..n)
                .map(|i| word(&self.hi, i) | word(&other.hi, i))
                .collect(),
        }
    }

    /// `self ∩ other` into `keep` and `self \ other` into `drop`.
    fn split(&self, other: &SlotSet, keep: &mut SlotSet, drop: &mut SlotSet) {
        keep.lo = self.lo & other.lo;
        drop.lo = self.lo & !other.lo;
        keep.hi.clear();
        drop.hi.clear();
        for (i, &w) in self.hi.iter().enumerate() {
            let o = other.hi.get(i).copied().unwrap_or(0);
            keep.hi.push(w & o);
            drop.hi.push(w & !o);
        }
    }

    fn for_each(&self, mut f: impl FnMut(usize)) {
        for (base, word) in std::iter::once(self.lo)
            .chain(self.hi.iter().copied())
            .enumerate()
        {
            let mut w = word;
            while w != 0 {
                let bit = w.trailing_zeros() as usize;
                f(base * 64 + bit);
                w &= w - 1;
            }
        }
    }
}

/// A rehashed block of a [`HashSource::Tokens`] worker: its indexer-side hash and the cache
/// salt of its chain (inherited by child blocks whose event names no salt).
#[derive(Debug, Clone)]
struct LocalBlock {
    hash: BlockHash,
    salt: Option<Arc<str>>,
}

#[derive(Debug)]
struct Worker {
    id: WorkerId,
    incarnation: Incarnation,
    source: HashSource,
    /// Attention kind of each of its KV cache groups, in the engine's group order.
    groups: Vec<AttentionKind>,
    /// The group whose events are indexed: the first full-attention one (`None`: none).
    indexed_group: Option<u64>,
    /// Sequence number of the next batch to apply; `None` before the first batch.
    next_seq: Option<u64>,
    /// Indexer-side hashes held on the device ([`Tier::Device`] events).
    blocks: HashSet<BlockHash>,
    /// Indexer-side hashes held in the worker's host tier only as far as its
    /// [`Tier::Host`] events say (a hash may be in both sets).
    host_blocks: HashSet<BlockHash>,
    /// `HashSource::Tokens` only: engine hash → indexer hash and the chain's cache salt.
    engine_to_local: HashMap<BlockHash, LocalBlock>,
    pending: BTreeMap<u64, Vec<KvEvent>>,
    needs_resync: bool,
    gaps: u64,
}

/// Per-worker counters and state, for monitoring and tests.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerStatus {
    /// The worker's id.
    pub id: WorkerId,
    /// Its current registration.
    pub incarnation: Incarnation,
    /// Where its hashes come from.
    pub source: HashSource,
    /// Distinct block hashes held on the device.
    pub num_blocks: usize,
    /// Distinct block hashes held in the worker's host tier ([`Tier::Host`] events).
    pub num_host_blocks: usize,
    /// Sequence number of the next batch expected (`None` before the first).
    pub next_seq: Option<u64>,
    /// Batches waiting in the reorder buffer.
    pub num_pending: usize,
    /// Whether entries may be missing since a gap (until a snapshot).
    pub needs_resync: bool,
    /// Gaps detected so far.
    pub gaps: u64,
}

/// The cluster-wide block index. See the module docs for the contract and costs. Not
/// synchronised: wrap it in a lock to share it.
#[derive(Debug)]
pub struct KvIndexer {
    hasher: PrefixHasher,
    block_size: u32,
    max_pending: usize,
    holders: HashMap<BlockHash, SlotSet>,
    /// As `holders`, for the workers' host tiers.
    host_holders: HashMap<BlockHash, SlotSet>,
    slots: Vec<Option<Worker>>,
    slot_of: HashMap<WorkerId, usize>,
    next_incarnation: Incarnation,
}

fn bad(arg: &'static str, value: impl ToString, reason: impl Into<String>) -> Error {
    Error::InvalidArgument {
        arg,
        value: value.to_string(),
        reason: reason.into(),
    }
}

impl KvIndexer {
    /// An empty index for engines with `block_size` tokens per block hashing with `hasher`;
    /// `max_pending` is the per-worker reorder buffer in batches (0: any gap in the sequence
    /// numbers is a loss). Errors: `InvalidArgument` for `block_size == 0`.
    pub fn new(block_size: u32, hasher: PrefixHasher, max_pending: usize) -> Result<Self> {
        if block_size == 0 {
            return Err(bad("block_size", 0, "must be at least 1"));
        }
        Ok(Self {
            hasher,
            block_size,
            max_pending,
            holders: HashMap::default(),
            host_holders: HashMap::default(),
            slots: Vec::new(),
            slot_of: HashMap::default(),
            next_incarnation: 1,
        })
    }

    /// Tokens per block.
    pub fn block_size(&self) -> u32 {
        self.block_size
    }

    /// The hasher queries and [`HashSource::Tokens`] workers use.
    pub fn hasher(&self) -> &PrefixHasher {
        &self.hasher
    }

    /// Reorder buffer size, in batches per worker.
    pub fn max_pending(&self) -> usize {
        self.max_pending
    }

    /// Distinct block hashes held by at least one worker.
    pub fn num_hashes(&self) -> usize {
        self.holders.len()
    }

    /// Registered worker ids, in registration-slot order.
    pub fn worker_ids(&self) -> Vec<WorkerId> {
        self.slots.iter().flatten().map(|w| w.id).collect()
    }

    /// Registers `id` with its hash source and returns the new registration's
    /// [`Incarnation`] (larger than any earlier one: see the module docs); its batches start a
    /// new sequence. Errors: `InvalidArgument` if already registered. O(1). Workers are also
    /// registered (as [`HashSource::Engine`]) by their first batch.
    pub fn add_worker(&mut self, id: WorkerId, source: HashSource) -> Result<Incarnation> {
        self.add_worker_with_groups(id, source, &[AttentionKind::Full])
    }

    /// As [`Self::add_worker`], for a worker whose engine has KV cache groups of the attention
    /// kinds `groups` (in the engine's group order, as its events' group indexes count them):
    /// only its first full-attention group's events are indexed (see the module docs).
    /// Errors: `InvalidArgument` if already registered or for an empty `groups`. O(groups).
    pub fn add_worker_with_groups(
        &mut self,
        id: WorkerId,
        source: HashSource,
        groups: &[AttentionKind],
    ) -> Result<Incarnation> {
        if self.slot_of.contains_key(&id) {
            return Err(bad("worker_id", id, "worker is already registered"));
        }
        if groups.is_empty() {
            return Err(bad(
                "groups",
                "[]",
                "a worker has at least one KV cache group",
            ));
        }
        let slot = self.insert_worker(id, source, groups);
        Ok(self.slots[slot]
            .as_ref()
            .expect("registered slot")
            .incarnation)
    }

    /// The current [`Incarnation`] of worker `id`, `None` if unknown.
    pub fn incarnation(&self, id: WorkerId) -> Option<Incarnation> {
        self.worker(id).map(|w| w.incarnation)
    }

    /// The attention kinds of worker `id`'s KV cache groups, `None` if unknown.
    pub fn worker_groups(&self, id: WorkerId) -> Option<&[AttentionKind]> {
        self.worker(id).map(|w| w.groups.as_slice())
    }

    fn insert_worker(
        &mut self,
        id: WorkerId,
        source: HashSource,
        groups: &[AttentionKind],
    ) -> usize {
        let incarnation = self.next_incarnation;
        self.next_incarnation += 1;
        let indexed_group = groups
            .iter()
            .position(|k| *k == AttentionKind::Full)
            .map(|g| g as u64);
        let worker = Worker {
            id,
            incarnation,
            source,
            groups: groups.to_vec(),
            indexed_group,
            next_seq: None,
            blocks: HashSet::default(),
            host_blocks: HashSet::default(),
            engine_to_local: HashMap::default(),
            pending: BTreeMap::new(),
            needs_resync: false,
            gaps: 0,
        };
        // Reuse the lowest free slot so slot sets stay dense.
        let slot = match self.slots.iter().position(Option::is_none) {
            Some(s) => {
                self.slots[s] = Some(worker);
                s
            }
            None => {
                self.slots.push(Some(worker));
                self.slots.len() - 1
            }
        };
        self.slot_of.insert(id, slot);
        slot
    }

    /// Drops worker `id` and every entry it held (a dead or restarted worker). Returns whether
    /// it was registered. O(blocks it held).
    pub fn remove_worker(&mut self, id: WorkerId) -> bool {
        let Some(slot) = self.slot_of.remove(&id) else {
            return false;
        };
        self.clear_slot(slot);
        self.slots[slot] = None;
        true
    }

    /// State and counters of worker `id`, `None` if unknown.
    pub fn worker_status(&self, id: WorkerId) -> Option<WorkerStatus> {
        let w = self.worker(id)?;
        Some(WorkerStatus {
            id,
            incarnation: w.incarnation,
            source: w.source,
            num_blocks: w.blocks.len(),
            num_host_blocks: w.host_blocks.len(),
            next_seq: w.next_seq,
            num_pending: w.pending.len(),
            needs_resync: w.needs_resync,
            gaps: w.gaps,
        })
    }

    /// Whether worker `id` may miss entries since a lost batch (or since joining mid-stream)
    /// and should send a snapshot. `false` for unknown workers.
    pub fn needs_resync(&self, id: WorkerId) -> bool {
        self.worker(id).is_some_and(|w| w.needs_resync)
    }

    /// The indexer-side hashes worker `id` holds, sorted (for tests and snapshots); empty for
    /// unknown workers. O(blocks it holds · log).
    pub fn worker_hashes(&self, id: WorkerId) -> Vec<BlockHash> {
        let mut v: Vec<BlockHash> = self
            .worker(id)
            .map(|w| w.blocks.iter().copied().collect())
            .unwrap_or_default();
        v.sort_unstable();
        v
    }

    fn worker(&self, id: WorkerId) -> Option<&Worker> {
        self.slot_of.get(&id).and_then(|&s| self.slots[s].as_ref())
    }

    /// Checks a batch without changing anything: block sizes match the indexer's, an
    /// [`HashSource::Engine`] worker's `BlockStored` that names its hash root names this
    /// indexer's (same algorithm and seed: the same cache identity), and for a
    /// [`HashSource::Tokens`] worker every `BlockStored` carries `block_size` tokens per block.
    fn validate(&self, source: HashSource, events: &[KvEvent]) -> Result<()> {
        for (i, ev) in events.iter().enumerate() {
            if let KvEvent::BlockStored {
                block_hashes,
                token_ids,
                block_size,
                hash_root,
                ..
            } = ev
            {
                if let Some(root) =
                    hash_root.filter(|r| source == HashSource::Engine && *r != self.hasher.root())
                {
                    return Err(bad(
                        "events",
                        format!("BlockStored at index {i} with hash root {}", &root.to_hex()[..16]),
                        format!(
                            "the indexer's hash root is {}: the worker hashes with another algorithm or \
                             seed (another cache identity: model, tokenizer, chat template, adapter, \
                             KV dtype or RoPE); build the indexer with the worker's hash_algo and hash_seed",
                            &self.hasher.root().to_hex()[..16]
                        ),
                    ));
                }
                if *block_size != self.block_size {
                    return Err(bad(
                        "events",
                        format!("BlockStored at index {i} with block_size {block_size}"),
                        format!("the indexer's block_size is {}", self.block_size),
                    ));
                }
                let want = block_hashes.len() * self.block_size as usize;
                if source == HashSource::Tokens && token_ids.len() != want {
                    return Err(bad(
                        "events",
                        format!(
                            "BlockStored at index {i} with {} token ids",
                            token_ids.len()
                        ),
                        format!(
                            "{} blocks of {} tokens need {want} token ids to be rehashed",
                            block_hashes.len(),
                            self.block_size
                        ),
                    ));
                }
            }
        }
        Ok(())
    }

    /// Whether a batch or snapshot of worker `id` from `incarnation` (`None`: the current
    /// one) is of a registration that is gone: [`BatchOutcome::Stale`]. Errors:
    /// `InvalidArgument` for an incarnation never issued to this id (later than its current
    /// one, or never issued at all).
    fn is_stale(&self, id: WorkerId, incarnation: Option<Incarnation>) -> Result<bool> {
        let Some(inc) = incarnation else {
            return Ok(false);
        };
        let current = self.incarnation(id);
        if current == Some(inc) {
            return Ok(false);
        }
        if inc >= self.next_incarnation || current.is_some_and(|c| inc > c) {
            return Err(bad(
                "incarnation",
                inc,
                match current {
                    Some(c) => format!(
                        "worker {id} is at incarnation {c}; {inc} is not one of its registrations"
                    ),
                    None => format!("no registration of worker {id} had incarnation {inc}"),
                },
            ));
        }
        Ok(true)
    }

    /// Applies batch `seq` of worker `id` from its registration `incarnation` (`None`: the
    /// current one; an unknown worker is then registered as [`HashSource::Engine`]). A batch of
    /// an earlier incarnation, or of a removed worker, is [`BatchOutcome::Stale`] and changes
    /// nothing. See the module docs for the sequence-number rules. Errors (nothing changed):
    /// `InvalidArgument` for an `incarnation` never issued to `id`, for a `BlockStored` whose
    /// block size differs from the indexer's, for an `Engine` worker, whose `hash_root` is set
    /// and differs from the indexer's hasher's root (its hashes belong to another cache
    /// identity and would never match a query), or, for a `Tokens` worker, whose token count is
    /// not `blocks × block_size`.
    pub fn apply_batch(
        &mut self,
        id: WorkerId,
        incarnation: Option<Incarnation>,
        seq: u64,
        events: Vec<KvEvent>,
    ) -> Result<BatchOutcome> {
        if self.is_stale(id, incarnation)? {
            return Ok(BatchOutcome::Stale);
        }
        let source = self.worker(id).map_or(HashSource::Engine, |w| w.source);
        self.validate(source, &events)?;
        let slot = match self.slot_of.get(&id) {
            Some(&s) => s,
            None => self.insert_worker(id, HashSource::Engine, &[AttentionKind::Full]),
        };
        let max_pending = self.max_pending;
        let w = self.slots[slot].as_mut().expect("registered slot");
        let next = match w.next_seq {
            Some(n) => n,
            None => {
                // Joining mid-stream: earlier batches were never seen.
                w.needs_resync = seq != 0;
                seq
            }
        };
        if seq < next || w.pending.contains_key(&seq) {
            return Ok(BatchOutcome::Duplicate);
        }
        if seq > next {
            w.pending.insert(seq, events);
            if w.pending.len() <= max_pending {
                return Ok(BatchOutcome::Buffered);
            }
            w.gaps += 1;
            w.needs_resync = true;
            w.next_seq = w.pending.keys().next().copied();
            self.clear_slot(slot);
            self.drain_pending(slot);
            return Ok(BatchOutcome::Gap);
        }
        self.apply_events(slot, &events);
        self.slots[slot].as_mut().expect("registered slot").next_seq = Some(seq + 1);
        self.drain_pending(slot);
        Ok(BatchOutcome::Applied)
    }

    /// As [`Self::apply_batch`], for events that name their KV cache group (`None`: group 0,
    /// the only group of a one-group engine; an `AllBlocksCleared` clears every group): only
    /// the events of the worker's indexed group (its first full-attention group, see the
    /// module docs) and clears are applied, the others are left out before the batch is
    /// checked (another group may have another block size). An unknown worker is registered
    /// with one full-attention group, as by `apply_batch`. Errors and outcomes as
    /// `apply_batch`.
    pub fn apply_group_batch(
        &mut self,
        id: WorkerId,
        incarnation: Option<Incarnation>,
        seq: u64,
        events: Vec<(Option<u64>, KvEvent)>,
    ) -> Result<BatchOutcome> {
        let indexed = self.worker(id).map_or(Some(0), |w| w.indexed_group);
        let events = events
            .into_iter()
            .filter(|(g, e)| *e == KvEvent::AllBlocksCleared || indexed == Some(g.unwrap_or(0)))
            .map(|(_, e)| e)
            .collect();
        self.apply_batch(id, incarnation, seq, events)
    }

    /// Replaces worker `id`'s entries with `hashes` (indexer-side hashes: the worker's whole
    /// resolvable set) as of its batch `seq`; later batches continue from `seq + 1`, buffered
    /// ones up to `seq` are dropped. Clears the resync flag. Registers unknown workers as
    /// [`HashSource::Engine`]. Errors: `InvalidArgument` for a [`HashSource::Tokens`] worker
    /// (its engine hashes cannot be mapped without token ids), and for a `hash_root` (the root of
    /// the worker's hash chains, as its `BlockStored` events carry it) other than this indexer's
    /// (another cache identity: its hashes could never match a query), or an `incarnation`
    /// never issued to `id`. A snapshot of an earlier incarnation (`incarnation`, `None`: the
    /// current one) is [`BatchOutcome::Stale`] and changes nothing; otherwise
    /// [`BatchOutcome::Applied`]. O(len(hashes) + blocks held).
    pub fn apply_snapshot(
        &mut self,
        id: WorkerId,
        incarnation: Option<Incarnation>,
        seq: u64,
        hashes: &[BlockHash],
        hash_root: Option<BlockHash>,
    ) -> Result<BatchOutcome> {
        if self.is_stale(id, incarnation)? {
            return Ok(BatchOutcome::Stale);
        }
        if let Some(root) = hash_root.filter(|r| *r != self.hasher.root()) {
            return Err(bad(
                "hash_root",
                &root.to_hex()[..16],
                format!(
                    "the indexer's hash root is {}: the snapshot's worker hashes with another \
                     algorithm or seed (another cache identity)",
                    &self.hasher.root().to_hex()[..16]
                ),
            ));
        }
        if self
            .worker(id)
            .is_some_and(|w| w.source == HashSource::Tokens)
        {
            return Err(bad(
                "worker_id",
                id,
                "snapshots are for workers whose hash source is \"engine\"",
            ));
        }
        let slot = match self.slot_of.get(&id) {
            Some(&s) => s,
            None => self.insert_worker(id, HashSource::Engine, &[AttentionKind::Full]),
        };
        self.clear_slot(slot);
        for h in hashes {
            self.store(slot, Tier::Device, *h);
        }
        let w = self.slots[slot].as_mut().expect("registered slot");
        w.next_seq = Some(seq + 1);
        w.needs_resync = false;
        w.pending = w.pending.split_off(&(seq + 1));
        self.drain_pending(slot);
        Ok(BatchOutcome::Applied)
    }

    /// Applies buffered batches while the next expected one is there.
    fn drain_pending(&mut self, slot: usize) {
        loop {
            let w = self.slots[slot].as_mut().expect("registered slot");
            let Some(next) = w.next_seq else { return };
            let Some(events) = w.pending.remove(&next) else {
                return;
            };
            w.next_seq = Some(next + 1);
            self.apply_events(slot, &events);
        }
    }

    fn apply_events(&mut self, slot: usize, events: &[KvEvent]) {
        for ev in events {
            match ev {
                KvEvent::BlockStored {
                    block_hashes,
                    parent_block_hash,
                    token_ids,
                    extra_keys,
                    tier,
                    ..
                } => self.apply_stored(
                    slot,
                    *tier,
                    block_hashes,
                    parent_block_hash.as_ref(),
                    token_ids,
                    extra_keys,
                ),
                KvEvent::BlockRemoved { block_hashes, tier } => {
                    for h in block_hashes {
                        self.apply_removed(slot, *tier, h);
                    }
                }
                KvEvent::AllBlocksCleared => self.clear_slot(slot),
            }
        }
    }

    fn apply_stored(
        &mut self,
        slot: usize,
        tier: Tier,
        hashes: &[BlockHash],
        parent: Option<&BlockHash>,
        tokens: &[u32],
        extra: &[ExtraKey],
    ) {
        let w = self.slots[slot].as_ref().expect("registered slot");
        if w.source == HashSource::Engine {
            for h in hashes {
                self.store(slot, tier, *h);
            }
            return;
        }
        // Rehash from tokens, chaining from the parent's indexer-side hash. A parent the
        // indexer does not know (its store was lost) breaks the chain: the blocks are skipped,
        // which under-reports and never leaves a stale entry.
        let (mut local_parent, inherited_salt) = match parent {
            None => (None, None),
            Some(p) => match w.engine_to_local.get(p) {
                Some(l) => (Some(l.hash), l.salt.clone()),
                None => return,
            },
        };
        let keys = with_chain_salt(extra, inherited_salt.as_deref());
        let salt = keys.iter().find_map(|k| match k {
            ExtraKey::CacheSalt(s) => Some(Arc::<str>::from(s.as_str())),
            _ => None,
        });
        let bs = self.block_size as usize;
        for (i, h) in hashes.iter().enumerate() {
            let local =
                self.hasher
                    .hash_block(local_parent.as_ref(), &tokens[i * bs..(i + 1) * bs], &keys);
            let w = self.slots[slot].as_mut().expect("registered slot");
            let link = LocalBlock {
                hash: local,
                salt: salt.clone(),
            };
            w.engine_to_local.insert(*h, link);
            self.store(slot, tier, local);
            local_parent = Some(local);
        }
    }

    fn apply_removed(&mut self, slot: usize, tier: Tier, engine_hash: &BlockHash) {
        let w = self.slots[slot].as_mut().expect("registered slot");
        let local = match w.source {
            HashSource::Engine => *engine_hash,
            HashSource::Tokens => match w.engine_to_local.get(engine_hash) {
                Some(l) => l.hash,
                None => return,
            },
        };
        let blocks = match tier {
            Tier::Device => &mut w.blocks,
            Tier::Host => &mut w.host_blocks,
        };
        // Not held: stored before we joined, in a lost batch, or removed already.
        let held = blocks.remove(&local);
        // The engine -> indexer hash link serves both tiers: kept while either holds it.
        if w.source == HashSource::Tokens
            && !w.blocks.contains(&local)
            && !w.host_blocks.contains(&local)
        {
            w.engine_to_local.remove(engine_hash);
        }
        if held {
            self.unhold(slot, tier, &local);
        }
    }

    fn store(&mut self, slot: usize, tier: Tier, local: BlockHash) {
        let w = self.slots[slot].as_mut().expect("registered slot");
        let (blocks, holders) = match tier {
            Tier::Device => (&mut w.blocks, &mut self.holders),
            Tier::Host => (&mut w.host_blocks, &mut self.host_holders),
        };
        // A hash held already (re-announced) changes nothing: see the module docs.
        if blocks.insert(local) {
            holders.entry(local).or_default().insert(slot);
        }
    }

    fn unhold(&mut self, slot: usize, tier: Tier, local: &BlockHash) {
        let holders = match tier {
            Tier::Device => &mut self.holders,
            Tier::Host => &mut self.host_holders,
        };
        if let Some(set) = holders.get_mut(local) {
            set.remove(slot);
            if set.is_empty() {
                holders.remove(local);
            }
        }
    }

    /// Drops every entry of the worker in `slot`, both tiers (keeps its sequence state).
    fn clear_slot(&mut self, slot: usize) {
        let w = self.slots[slot].as_mut().expect("registered slot");
        let blocks = std::mem::take(&mut w.blocks);
        let host_blocks = std::mem::take(&mut w.host_blocks);
        w.engine_to_local.clear();
        for h in &blocks {
            self.unhold(slot, Tier::Device, h);
        }
        for h in &host_blocks {
            self.unhold(slot, Tier::Host, h);
        }
    }

    /// For every registered worker, how many leading blocks of `hashes` (a request's chained
    /// block hashes, in order) it holds: `(worker, blocks)` pairs in slot order, zeros
    /// included. O(len(hashes) × ⌈workers/64⌉ + workers).
    pub fn overlap_hashes(&self, hashes: &[BlockHash]) -> Vec<(WorkerId, usize)> {
        let depth = self.depths(hashes, |h| self.holders.get(h).map(Cow::Borrowed));
        self.slots
            .iter()
            .enumerate()
            .filter_map(|(s, w)| w.as_ref().map(|w| (w.id, depth[s])))
            .collect()
    }

    /// Per tier, for every registered worker: `(worker, device, any_tier)`, where `device` is
    /// [`Self::overlap_hashes`]'s figure (leading blocks held on the device) and `any_tier`
    /// the leading blocks held on the device or in the worker's host tier (a pagedkv lookup
    /// continues past its device hits into its host tier and loads those blocks instead of
    /// recomputing them: see docs/design.md, "Host tier"). `any_tier >= device`; in slot
    /// order, zeros included. O(len(hashes) × ⌈workers/64⌉ + workers).
    pub fn overlap_hashes_by_tier(&self, hashes: &[BlockHash]) -> Vec<(WorkerId, usize, usize)> {
        let device = self.depths(hashes, |h| self.holders.get(h).map(Cow::Borrowed));
        let any = self.depths(hashes, |h| {
            match (self.holders.get(h), self.host_holders.get(h)) {
                (None, None) => None,
                (Some(d), None) => Some(Cow::Borrowed(d)),
                (None, Some(x)) => Some(Cow::Borrowed(x)),
                (Some(d), Some(x)) => Some(Cow::Owned(d.union(x))),
            }
        });
        self.slots
            .iter()
            .enumerate()
            .filter_map(|(s, w)| w.as_ref().map(|w| (w.id, device[s], any[s])))
            .collect()
    }

    /// Per slot, how many leading hashes it holds, with `holders_of` giving the slots that
    /// hold one hash (`None`: no slot).
    fn depths<'a>(
        &'a self,
        hashes: &[BlockHash],
        holders_of: impl Fn(&BlockHash) -> Option<Cow<'a, SlotSet>>,
    ) -> Vec<usize> {
        let mut depth = vec![0usize; self.slots.len()];
        let mut active = match hashes.first().and_then(&holders_of) {
            Some(set) => set.into_owned(),
            None => SlotSet::default(),
        };
        let (mut keep, mut dropped) = (SlotSet::default(), SlotSet::default());
        // Invariant: every slot in `active` holds hashes[..k].
        let mut k = 1;
        while !active.is_empty() && k < hashes.len() {
            match holders_of(&hashes[k]) {
                None => break,
                Some(set) => {
                    active.split(&set, &mut keep, &mut dropped);
                    dropped.for_each(|s| depth[s] = k);
                    std::mem::swap(&mut active, &mut keep);
                }
            }
            k += 1;
        }
        active.for_each(|s| depth[s] = k);
        depth
    }

    /// Chained hashes of the first `num_blocks` full blocks of `tokens` with `spec`'s extra
    /// keys, exactly as a pagedkv manager with this hasher computes them. Errors:
    /// `InvalidArgument` if `tokens` has fewer than `num_blocks × block_size` tokens.
    pub fn block_hashes(
        &self,
        tokens: &[u32],
        spec: &SequenceSpec,
        num_blocks: usize,
    ) -> Result<Vec<BlockHash>> {
        let bs = self.block_size as usize;
        if tokens.len() < num_blocks * bs {
            return Err(bad(
                "num_blocks",
                num_blocks,
                format!(
                    "{} tokens hold {} full blocks",
                    tokens.len(),
                    tokens.len() / bs
                ),
            ));
        }
        let mut out: Vec<BlockHash> = Vec::with_capacity(num_blocks);
        for k in 0..num_blocks {
            let keys = spec.block_keys(bs, k);
            let h = self
                .hasher
                .hash_block(out.last(), &tokens[k * bs..(k + 1) * bs], &keys);
            out.push(h);
        }
        Ok(out)
    }

    /// Overlap of a request's prompt with every worker, in blocks: the request's blocks a
    /// manager could serve from its cache (the full blocks before the last prompt token, since
    /// the last token is always computed) hashed with `spec`, then [`Self::overlap_hashes`].
    /// An empty prompt overlaps nothing.
    pub fn overlap_tokens(&self, tokens: &[u32], spec: &SequenceSpec) -> Vec<(WorkerId, usize)> {
        let n = tokens.len().saturating_sub(1) / self.block_size as usize;
        let hashes = self
            .block_hashes(tokens, spec, n)
            .expect("n full blocks fit in the prompt");
        self.overlap_hashes(&hashes)
    }
}

/// `extra` as the keys of a block whose chain carries `salt`: unchanged if `extra` names a
/// cache salt already or the chain has none, else with `CacheSalt(salt)` placed where a
/// pagedkv sequence's keys put it (after its adapter keys), so the block hashes as a salted
/// pagedkv query hashes it.
fn with_chain_salt<'a>(extra: &'a [ExtraKey], salt: Option<&str>) -> Cow<'a, [ExtraKey]> {
    let Some(salt) = salt else {
        return Cow::Borrowed(extra);
    };
    if extra.iter().any(|k| matches!(k, ExtraKey::CacheSalt(_))) {
        return Cow::Borrowed(extra);
    }
    let at = extra
        .iter()
        .take_while(|k| matches!(k, ExtraKey::Adapter(_)))
        .count();
    let mut keys = extra.to_vec();
    keys.insert(at, ExtraKey::CacheSalt(salt.to_string()));
    Cow::Owned(keys)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(i: u8) -> BlockHash {
        BlockHash([i; 32])
    }

    fn stored(hs: &[u8]) -> KvEvent {
        KvEvent::BlockStored {
            block_hashes: hs.iter().map(|&i| h(i)).collect(),
            parent_block_hash: None,
            token_ids: Vec::new(),
            block_size: 4,
            extra_keys: Vec::new(),
            hash_root: None,
            tier: Tier::Device,
        }
    }

    fn removed(hs: &[u8]) -> KvEvent {
        KvEvent::BlockRemoved {
            block_hashes: hs.iter().map(|&i| h(i)).collect(),
            tier: Tier::Device,
        }
    }

    fn idx(max_pending: usize) -> KvIndexer {
        KvIndexer::new(4, PrefixHasher::default(), max_pending).unwrap()
    }

    fn overlap(ix: &KvIndexer, hs: &[u8]) -> Vec<(WorkerId, usize)> {
        ix.overlap_hashes(&hs.iter().map(|&i| h(i)).collect::<Vec<_>>())
    }

    fn on_host(ev: KvEvent) -> KvEvent {
        match ev {
            KvEvent::BlockStored {
                block_hashes,
                parent_block_hash,
                token_ids,
                block_size,
                extra_keys,
                hash_root,
                ..
            } => KvEvent::BlockStored {
                block_hashes,
                parent_block_hash,
                token_ids,
                block_size,
                extra_keys,
                hash_root,
                tier: Tier::Host,
            },
            KvEvent::BlockRemoved { block_hashes, .. } => KvEvent::BlockRemoved {
                block_hashes,
                tier: Tier::Host,
            },
            e => e,
        }
    }

    fn by_tier(ix: &KvIndexer, hs: &[u8]) -> Vec<(WorkerId, usize, usize)> {
        ix.overlap_hashes_by_tier(&hs.iter().map(|&i| h(i)).collect::<Vec<_>>())
    }

    #[test]
    fn host_residency_is_a_separate_figure() {
        let mut ix = idx(0);
        // Worker 7: blocks 1, 2 on the device, 3 only in its host tier. Worker 9: 1 on host.
        ix.apply_batch(7, None, 0, vec![stored(&[1, 2]), on_host(stored(&[2, 3]))])
            .unwrap();
        ix.apply_batch(9, None, 0, vec![on_host(stored(&[1]))])
            .unwrap();
        // Device figures unchanged by host events.
        assert_eq!(overlap(&ix, &[1, 2, 3]), vec![(7, 2), (9, 0)]);
        assert_eq!(by_tier(&ix, &[1, 2, 3]), vec![(7, 2, 3), (9, 0, 1)]);
        assert_eq!(ix.worker_status(7).unwrap().num_blocks, 2);
        assert_eq!(ix.worker_status(7).unwrap().num_host_blocks, 2);
        // A host removal leaves the device copy; a device removal leaves the host copy.
        ix.apply_batch(7, None, 1, vec![on_host(removed(&[2])), removed(&[1])])
            .unwrap();
        assert_eq!(by_tier(&ix, &[1, 2, 3]), vec![(7, 0, 0), (9, 0, 1)]);
        assert_eq!(by_tier(&ix, &[2, 3]), vec![(7, 1, 2), (9, 0, 0)]);
        // A reset clears both tiers.
        ix.apply_batch(7, None, 2, vec![KvEvent::AllBlocksCleared])
            .unwrap();
        assert_eq!(by_tier(&ix, &[2, 3]), vec![(7, 0, 0), (9, 0, 0)]);
        assert_eq!(ix.worker_status(7).unwrap().num_host_blocks, 0);
        assert_eq!(ix.num_hashes(), 0);
    }

    #[test]
    fn leading_overlap_per_worker() {
        let mut ix = idx(0);
        ix.apply_batch(7, None, 0, vec![stored(&[1, 2, 3])])
            .unwrap();
        ix.apply_batch(9, None, 0, vec![stored(&[1, 2]), stored(&[4])])
            .unwrap();
        assert_eq!(overlap(&ix, &[1, 2, 3, 4]), vec![(7, 3), (9, 2)]);
        // A hole stops the count even if later blocks are held.
        assert_eq!(overlap(&ix, &[4, 3]), vec![(7, 0), (9, 1)]);
        assert_eq!(overlap(&ix, &[5, 1]), vec![(7, 0), (9, 0)]);
        ix.apply_batch(7, None, 1, vec![removed(&[2])]).unwrap();
        assert_eq!(overlap(&ix, &[1, 2, 3]), vec![(7, 1), (9, 2)]);
        ix.apply_batch(9, None, 1, vec![KvEvent::AllBlocksCleared])
            .unwrap();
        assert_eq!(overlap(&ix, &[1, 2, 3]), vec![(7, 1), (9, 0)]);
        assert_eq!(ix.num_hashes(), 2);
    }

    /// llm-d-router #2362: a hybrid worker's sliding-window group holds the last window's
    /// blocks of a prefix only; counting them as prefix residency routes to a worker that
    /// cannot serve the prefix. Only the first full-attention group is indexed, wherever the
    /// engine orders it.
    #[test]
    fn only_a_full_attention_group_counts_toward_the_overlap() {
        let sw = AttentionKind::SlidingWindow { window: 8 };
        let mut ix = idx(0);
        ix.add_worker_with_groups(1, HashSource::Engine, &[sw, AttentionKind::Full])
            .unwrap();
        ix.add_worker_with_groups(2, HashSource::Engine, &[sw, AttentionKind::Full])
            .unwrap();
        ix.add_worker_with_groups(3, HashSource::Engine, &[sw])
            .unwrap();
        assert_eq!(ix.worker_groups(1), Some(&[sw, AttentionKind::Full][..]));
        // Worker 1 holds only the sliding-window blocks of the prefix (group 0).
        ix.apply_group_batch(1, None, 0, vec![(Some(0), stored(&[1, 2, 3]))])
            .unwrap();
        // Worker 2 holds the full-attention blocks (group 1), the window's too.
        ix.apply_group_batch(
            2,
            None,
            0,
            vec![(Some(1), stored(&[1, 2, 3])), (Some(0), stored(&[3]))],
        )
        .unwrap();
        ix.apply_group_batch(3, None, 0, vec![(Some(0), stored(&[1, 2, 3]))])
            .unwrap();
        assert_eq!(overlap(&ix, &[1, 2, 3]), vec![(1, 0), (2, 3), (3, 0)]);
        // The window moves on: group 0 lets its blocks go, the prefix stays.
        ix.apply_group_batch(2, None, 1, vec![(Some(0), removed(&[3]))])
            .unwrap();
        assert_eq!(overlap(&ix, &[1, 2, 3]), vec![(1, 0), (2, 3), (3, 0)]);
        ix.apply_group_batch(2, None, 2, vec![(Some(1), removed(&[2]))])
            .unwrap();
        assert_eq!(overlap(&ix, &[1, 2, 3]), vec![(1, 0), (2, 1), (3, 0)]);
        // A clear names no group and clears the worker.
        ix.apply_group_batch(2, None, 3, vec![(None, KvEvent::AllBlocksCleared)])
            .unwrap();
        assert_eq!(overlap(&ix, &[1]), vec![(1, 0), (2, 0), (3, 0)]);
        // Default workers: one full-attention group, group 0 (or unnamed).
        ix.apply_group_batch(
            4,
            None,
            0,
            vec![(None, stored(&[1])), (Some(1), stored(&[2]))],
        )
        .unwrap();
        assert_eq!(ix.worker_groups(4), Some(&[AttentionKind::Full][..]));
        assert_eq!(ix.worker_hashes(4), vec![h(1)]);
        assert!(ix
            .add_worker_with_groups(5, HashSource::Engine, &[])
            .unwrap_err()
            .to_string()
            .contains("at least one KV cache group"));
        assert!(ix.worker(5).is_none());
    }

    #[test]
    fn a_re_announced_block_is_held_once() {
        // vLLM's kv_cache_report_mode="full" stores a prefix hit's blocks again, with no
        // removal to match: the worker holds each hash or not, so one removal drops it.
        let mut ix = idx(0);
        ix.apply_batch(1, None, 0, vec![stored(&[1, 2]), stored(&[1, 2])])
            .unwrap();
        assert_eq!(overlap(&ix, &[1, 2]), vec![(1, 2)]);
        assert_eq!(ix.worker_status(1).unwrap().num_blocks, 2);
        ix.apply_batch(1, None, 1, vec![stored(&[1]), removed(&[1, 2])])
            .unwrap();
        assert_eq!(overlap(&ix, &[1, 2]), vec![(1, 0)]);
        assert_eq!(ix.num_hashes(), 0);
        // A removal of a hash not held (removed already) changes nothing.
        ix.apply_batch(1, None, 2, vec![stored(&[3]), removed(&[1])])
            .unwrap();
        assert_eq!(ix.worker_hashes(1), vec![h(3)]);
        // The same for a tokens worker, whose engine hashes map to rehashed ones.
        let mut ix = KvIndexer::new(2, PrefixHasher::default(), 0).unwrap();
        ix.add_worker(5, HashSource::Tokens).unwrap();
        let ev = || KvEvent::BlockStored {
            block_hashes: vec![h(100)],
            parent_block_hash: None,
            token_ids: vec![1, 2],
            block_size: 2,
            extra_keys: Vec::new(),
            hash_root: None,
            tier: Tier::Device,
        };
        ix.apply_batch(5, None, 0, vec![ev(), ev()]).unwrap();
        ix.apply_batch(5, None, 1, vec![removed(&[100])]).unwrap();
        assert_eq!(ix.worker_status(5).unwrap().num_blocks, 0);
        assert_eq!(
            ix.overlap_tokens(&[1, 2, 3], &SequenceSpec::default()),
            vec![(5, 0)]
        );
    }

    #[test]
    fn a_re_added_worker_refuses_its_old_incarnations_batches() {
        let mut ix = idx(0);
        let old = ix.add_worker(4, HashSource::Engine).unwrap();
        for seq in 0..3 {
            ix.apply_batch(4, Some(old), seq, vec![stored(&[seq as u8 + 1])])
                .unwrap();
        }
        assert!(ix.remove_worker(4));
        // A removed worker's late batch is stale, and does not register it again.
        assert_eq!(
            ix.apply_batch(4, Some(old), 3, vec![stored(&[9])]).unwrap(),
            BatchOutcome::Stale
        );
        assert!(ix.worker_ids().is_empty());
        let new = ix.add_worker(4, HashSource::Engine).unwrap();
        assert!(new > old);
        assert_eq!(ix.incarnation(4), Some(new));
        // The old incarnation's late batch after the re-add: refused, the new sequence intact.
        assert_eq!(
            ix.apply_batch(4, Some(old), 57, vec![stored(&[9])])
                .unwrap(),
            BatchOutcome::Stale
        );
        assert_eq!(
            ix.apply_snapshot(4, Some(old), 58, &[h(9)], None).unwrap(),
            BatchOutcome::Stale
        );
        let st = ix.worker_status(4).unwrap();
        assert_eq!((st.next_seq, st.num_blocks, st.incarnation), (None, 0, new));
        for seq in 0..2 {
            assert_eq!(
                ix.apply_batch(4, Some(new), seq, vec![stored(&[20 + seq as u8])])
                    .unwrap(),
                BatchOutcome::Applied
            );
        }
        assert_eq!(ix.worker_hashes(4), vec![h(20), h(21)]);
        assert!(!ix.needs_resync(4));
        // No incarnation: the current one.
        assert_eq!(
            ix.apply_batch(4, None, 2, vec![]).unwrap(),
            BatchOutcome::Applied
        );
        // An incarnation never issued to this id is a caller error, nothing changed.
        let other = ix.add_worker(8, HashSource::Engine).unwrap();
        assert!(ix.apply_batch(4, Some(other), 3, vec![]).is_err());
        assert!(ix.apply_batch(4, Some(other + 10), 3, vec![]).is_err());
        assert!(ix.apply_batch(77, Some(other + 10), 0, vec![]).is_err());
        assert!(ix
            .apply_snapshot(4, Some(other + 10), 3, &[], None)
            .is_err());
        assert_eq!(ix.worker_status(4).unwrap().next_seq, Some(3));
        // A first batch of an unknown id registers a new incarnation too.
        ix.apply_batch(30, None, 0, vec![]).unwrap();
        assert!(ix.incarnation(30).unwrap() > other);
    }

    #[test]
    fn reorder_buffer_then_gap() {
        let mut ix = idx(1);
        assert_eq!(
            ix.apply_batch(1, None, 0, vec![stored(&[1])]).unwrap(),
            BatchOutcome::Applied
        );
        assert_eq!(
            ix.apply_batch(1, None, 2, vec![stored(&[3])]).unwrap(),
            BatchOutcome::Buffered
        );
        assert_eq!(overlap(&ix, &[1, 2, 3]), vec![(1, 1)]);
        assert_eq!(
            ix.apply_batch(1, None, 1, vec![stored(&[2])]).unwrap(),
            BatchOutcome::Applied
        );
        assert_eq!(overlap(&ix, &[1, 2, 3]), vec![(1, 3)]);
        assert_eq!(
            ix.apply_batch(1, None, 1, vec![removed(&[1])]).unwrap(),
            BatchOutcome::Duplicate
        );
        // Batch 3 lost: 4 is buffered, 5 overflows the buffer -> gap.
        assert_eq!(
            ix.apply_batch(1, None, 4, vec![stored(&[4])]).unwrap(),
            BatchOutcome::Buffered
        );
        assert_eq!(
            ix.apply_batch(1, None, 5, vec![stored(&[5])]).unwrap(),
            BatchOutcome::Gap
        );
        assert!(ix.needs_resync(1));
        assert_eq!(ix.worker_hashes(1), vec![h(4), h(5)]);
        let st = ix.worker_status(1).unwrap();
        assert_eq!((st.next_seq, st.gaps, st.num_pending), (Some(6), 1, 0));
        ix.apply_snapshot(1, None, 6, &[h(1), h(4)], None).unwrap();
        assert!(!ix.needs_resync(1));
        assert_eq!(ix.worker_hashes(1), vec![h(1), h(4)]);
        assert_eq!(
            ix.apply_batch(1, None, 6, vec![]).unwrap(),
            BatchOutcome::Duplicate
        );
        assert_eq!(
            ix.apply_batch(1, None, 7, vec![]).unwrap(),
            BatchOutcome::Applied
        );
    }

    #[test]
    fn joining_mid_stream_needs_resync_and_remove_worker_drops_entries() {
        let mut ix = idx(0);
        ix.apply_batch(3, None, 10, vec![stored(&[1])]).unwrap();
        assert!(ix.needs_resync(3));
        assert!(ix.remove_worker(3));
        assert!(!ix.remove_worker(3));
        assert_eq!(ix.num_hashes(), 0);
        assert!(ix.worker_ids().is_empty());
    }

    #[test]
    fn many_workers_beyond_one_word() {
        let mut ix = idx(0);
        for w in 0..150u64 {
            let n = (w % 4) as u8;
            let hs: Vec<u8> = (1..=n).collect();
            ix.apply_batch(w, None, 0, vec![stored(&hs)]).unwrap();
        }
        let got = overlap(&ix, &[1, 2, 3, 4]);
        assert_eq!(got.len(), 150);
        for (w, d) in got {
            assert_eq!(d, (w % 4) as usize);
        }
        ix.remove_worker(130);
        assert_eq!(
            ix.apply_batch(1000, None, 0, vec![stored(&[1])]).unwrap(),
            BatchOutcome::Applied
        );
        // Slot 130 is reused by the new worker.
        assert_eq!(ix.worker_ids()[130], 1000);
    }

    #[test]
    fn tokens_source_rehashes_and_matches_queries() {
        let hasher = PrefixHasher::default();
        let mut ix = KvIndexer::new(2, hasher.clone(), 0).unwrap();
        ix.add_worker(5, HashSource::Tokens).unwrap();
        // Engine hashes unrelated to ours.
        let ev = KvEvent::BlockStored {
            block_hashes: vec![h(100), h(101)],
            parent_block_hash: None,
            token_ids: vec![1, 2, 3, 4],
            block_size: 2,
            extra_keys: Vec::new(),
            hash_root: None,
            tier: Tier::Device,
        };
        ix.apply_batch(5, None, 0, vec![ev]).unwrap();
        let child = KvEvent::BlockStored {
            block_hashes: vec![h(102)],
            parent_block_hash: Some(h(101)),
            token_ids: vec![5, 6],
            block_size: 2,
            extra_keys: Vec::new(),
            hash_root: None,
            tier: Tier::Device,
        };
        ix.apply_batch(5, None, 1, vec![child]).unwrap();
        let spec = SequenceSpec::default();
        assert_eq!(
            ix.overlap_tokens(&[1, 2, 3, 4, 5, 6, 7], &spec),
            vec![(5, 3)]
        );
        // The last token is never served from the cache.
        assert_eq!(ix.overlap_tokens(&[1, 2, 3, 4], &spec), vec![(5, 1)]);
        ix.apply_batch(5, None, 2, vec![removed(&[101])]).unwrap();
        assert_eq!(
            ix.overlap_tokens(&[1, 2, 3, 4, 5, 6, 7], &spec),
            vec![(5, 1)]
        );
        // A block whose parent is unknown is skipped.
        let orphan = KvEvent::BlockStored {
            block_hashes: vec![h(103)],
            parent_block_hash: Some(h(99)),
            token_ids: vec![9, 9],
            block_size: 2,
            extra_keys: Vec::new(),
            hash_root: None,
            tier: Tier::Device,
        };
        ix.apply_batch(5, None, 3, vec![orphan]).unwrap();
        assert_eq!(ix.worker_status(5).unwrap().num_blocks, 2);
        assert!(ix.apply_snapshot(5, None, 4, &[], None).is_err());
    }

    #[test]
    fn tokens_chain_keeps_the_salt_its_first_event_named() {
        // vLLM names a request's cache salt in its first block's event only; the chain carries
        // it. The indexer must index the child blocks as salted too.
        let salted = |hs: &[u8], parent: Option<u8>, toks: Vec<u32>, keys: Vec<ExtraKey>| {
            KvEvent::BlockStored {
                block_hashes: hs.iter().map(|&i| h(i)).collect(),
                parent_block_hash: parent.map(h),
                token_ids: toks,
                block_size: 2,
                extra_keys: keys,
                hash_root: None,
                tier: Tier::Device,
            }
        };
        let mut ix = KvIndexer::new(2, PrefixHasher::default(), 0).unwrap();
        ix.add_worker(7, HashSource::Tokens).unwrap();
        let adapter = ExtraKey::Adapter("lora-a".into());
        let salt = ExtraKey::CacheSalt("tenant".into());
        let first = salted(
            &[10, 11],
            None,
            vec![1, 2, 3, 4],
            vec![adapter.clone(), salt.clone()],
        );
        let child = salted(&[12], Some(11), vec![5, 6], vec![adapter.clone()]);
        ix.apply_batch(7, None, 0, vec![first, child]).unwrap();
        let tokens = [1, 2, 3, 4, 5, 6, 7];
        let spec = |keys: Vec<ExtraKey>| SequenceSpec {
            extra_keys: keys,
            mm_items: Vec::new(),
        };
        // Salted query (pagedkv puts the salt after the adapter on every block): all 3 blocks.
        let both = spec(vec![adapter.clone(), salt.clone()]);
        assert_eq!(ix.overlap_tokens(&tokens, &both), vec![(7, 3)]);
        // The same tokens without the salt, or with another salt, match nothing.
        assert_eq!(
            ix.overlap_tokens(&tokens, &spec(vec![adapter.clone()])),
            vec![(7, 0)]
        );
        let other = spec(vec![adapter.clone(), ExtraKey::CacheSalt("x".into())]);
        assert_eq!(ix.overlap_tokens(&tokens, &other), vec![(7, 0)]);
        // A grandchild inherits through the child; removing the child's engine hash removes
        // the salted block it was indexed under.
        let grandchild = salted(&[13], Some(12), vec![7, 8], vec![adapter.clone()]);
        ix.apply_batch(7, None, 1, vec![grandchild]).unwrap();
        assert_eq!(
            ix.overlap_tokens(&[1, 2, 3, 4, 5, 6, 7, 8, 9], &both),
            vec![(7, 4)]
        );
        ix.apply_batch(7, None, 2, vec![removed(&[12])]).unwrap();
        assert_eq!(
            ix.overlap_tokens(&[1, 2, 3, 4, 5, 6, 7, 8, 9], &both),
            vec![(7, 2)]
        );
        // An unsalted chain stays unsalted.
        let plain = salted(&[20], None, vec![9, 9], Vec::new());
        let plain_child = salted(&[21], Some(20), vec![9, 9], Vec::new());
        ix.apply_batch(7, None, 3, vec![plain, plain_child])
            .unwrap();
        assert_eq!(
            ix.overlap_tokens(&[9, 9, 9, 9, 0], &spec(Vec::new())),
            vec![(7, 2)]
        );
    }

    #[test]
    fn bad_batches_change_nothing() {
        let mut ix = idx(0);
        let wrong_bs = KvEvent::BlockStored {
            block_hashes: vec![h(1)],
            parent_block_hash: None,
            token_ids: vec![],
            block_size: 8,
            extra_keys: vec![],
            hash_root: None,
            tier: Tier::Device,
        };
        let err = ix
            .apply_batch(1, None, 0, vec![stored(&[2]), wrong_bs])
            .unwrap_err();
        assert!(err.to_string().contains("block_size 8"), "{err}");
        assert!(ix.worker_ids().is_empty());
        ix.add_worker(2, HashSource::Tokens).unwrap();
        let short = KvEvent::BlockStored {
            block_hashes: vec![h(1)],
            parent_block_hash: None,
            token_ids: vec![1],
            block_size: 4,
            extra_keys: vec![],
            hash_root: None,
            tier: Tier::Device,
        };
        assert!(ix.apply_batch(2, None, 0, vec![short]).is_err());
        assert_eq!(ix.worker_status(2).unwrap().next_seq, None);
        assert!(ix.add_worker(2, HashSource::Engine).is_err());
        assert!(KvIndexer::new(0, PrefixHasher::default(), 0).is_err());
    }

    #[test]
    fn events_of_another_cache_identity_are_refused() {
        use crate::hashing::HashAlgo;
        use crate::{CacheConfig, KvCacheManager};
        let events_with_seed = |seed: &[u8]| {
            let mut cfg = CacheConfig::new(32, 4);
            cfg.enable_events = true;
            cfg.hash_seed = seed.to_vec();
            let m = KvCacheManager::new(cfg).unwrap();
            m.add_sequence(1, (0..9).collect(), SequenceSpec::default())
                .unwrap();
            m.allocate_slots(1, 9).unwrap();
            let ev: Vec<KvEvent> = m.take_events().into_iter().map(|e| e.event).collect();
            assert!(
                matches!(&ev[0], KvEvent::BlockStored { hash_root: Some(r), .. }
                if *r == PrefixHasher::new(HashAlgo::Sha256, seed).root())
            );
            ev
        };
        let mut ix = KvIndexer::new(4, PrefixHasher::new(HashAlgo::Sha256, b"model-a"), 0).unwrap();
        let err = ix
            .apply_batch(1, None, 0, events_with_seed(b"model-b"))
            .unwrap_err();
        assert!(err.to_string().contains("hash root"), "{err}");
        assert!(ix.worker_ids().is_empty() && ix.num_hashes() == 0);
        let ok = events_with_seed(b"model-a");
        assert_eq!(
            ix.apply_batch(1, None, 0, ok).unwrap(),
            BatchOutcome::Applied
        );
        assert_eq!(ix.num_hashes(), 2);
        // A tokens worker is rehashed with the indexer's own hasher: its root is not checked.
        ix.add_worker(2, HashSource::Tokens).unwrap();
        let other = events_with_seed(b"model-b");
        assert_eq!(
            ix.apply_batch(2, None, 0, other).unwrap(),
            BatchOutcome::Applied
        );
        assert_eq!(ix.worker_status(2).unwrap().num_blocks, 2);
        // A snapshot names its worker's root too: a foreign one is refused, nothing changes.
        let foreign = PrefixHasher::new(HashAlgo::Sha256, b"model-b").root();
        let err = ix
            .apply_snapshot(1, None, 5, &[h(9)], Some(foreign))
            .unwrap_err();
        assert!(err.to_string().contains("hash root"), "{err}");
        assert_eq!(ix.worker_status(1).unwrap().num_blocks, 2);
        let own = ix.hasher.root();
        ix.apply_snapshot(1, None, 5, &[h(9)], Some(own)).unwrap();
        assert_eq!(ix.worker_status(1).unwrap().num_blocks, 1);
    }

    #[test]
    fn query_hashes_match_the_manager() {
        use crate::{CacheConfig, KvCacheManager};
        let mut cfg = CacheConfig::new(32, 4);
        cfg.enable_events = true;
        let m = KvCacheManager::new(cfg).unwrap();
        let prompt: Vec<u32> = (0..13).collect();
        let spec = SequenceSpec {
            extra_keys: vec![ExtraKey::CacheSalt("t".into())],
            mm_items: vec![crate::request::MmItem {
                item_hash: vec![1, 2],
                start: 3,
                len: 3,
            }],
        };
        m.add_sequence(1, prompt.clone(), spec.clone()).unwrap();
        m.allocate_slots(1, 13).unwrap();
        let mut ix = idx(0);
        let events = m.take_events().into_iter().map(|e| e.event).collect();
        ix.apply_batch(0, None, 0, events).unwrap();
        assert_eq!(ix.overlap_tokens(&prompt, &spec), vec![(0, 3)]);
        assert_eq!(
            ix.overlap_tokens(&prompt, &SequenceSpec::default()),
            vec![(0, 0)]
        );
    }
}
