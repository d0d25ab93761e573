//! The host-memory second tier of the prefix cache: a pool of host blocks holding KV that the
//! device pool evicted, keyed by the same chained block hash, so that a later prefix lookup
//! loads the blocks back (a host -> device copy) instead of recomputing them.
//!
//! This module is the tier's bookkeeping only; the KV bytes live in the executor's host
//! tensors, and [`crate::KvCacheManager`] calls in here (docs/design.md, "Host tier"):
//!
//! - **Store.** When the device pool evicts the last device copy of a hash for reuse, the
//!   manager asks [`HostTier::plan_store`]: a hash seen at least `admission_min_seen` times
//!   and not on host yet gets a host block (a free one, else an unpinned one the eviction
//!   policy picks, [`HostEviction`]: LRU or ARC) and a `(device block, host block)` copy is
//!   planned. A planned store whose host block a later store of the same hand-out takes is
//!   withdrawn (its copy would be overwritten unread), so a hand-out holds at most one store
//!   per host block: the ones the policy keeps.
//! - **Load.** A prefix lookup continues past its device hits into this tier
//!   ([`HostTier::lookup`]); each host hit is pinned ([`HostTier::pin`]) and, once a device
//!   block is allocated for it, a `(host block, device block)` copy is planned
//!   ([`HostTier::plan_load`]).
//! - **Hand-out.** The planned copies are handed out once per scheduler step
//!   ([`HostTier::take_plans`]); a host block being loaded stays pinned (never evicted, never a
//!   store destination) until the step after the one that handed its load out
//!   ([`HostTier::release_in_flight`]).
//!
//! Admission follows TinyLFU's frequency filter (Einziger, Friedman and Manes, "TinyLFU: A
//! Highly Efficient Cache Admission Policy", ACM ToS 2017): a per-hash seen count, halved for
//! every hash when the table outgrows its bound (the "reset" that ages old counts), so one-off
//! blocks (a prompt used once) do not push reused ones out of the host tier.
//!
//! Keys. Blocks are keyed by [`HostKey`]: the block hash and its KV cache group, so a
//! full-attention block and a sliding-window block of the same tokens are different host
//! entries (a manager of one group uses group 0). The tier never looks inside a key.
//!
//! Host block ids are `0..num_blocks` (no null block: the kernels never read host blocks).
//! Not synchronised: the manager keeps it under its own mutex.

use crate::error::{Error, Result};
use crate::events::{KvEvent, Tier};
use crate::hashing::{BlockHash, ExtraKey};
use crate::pool::BlockPool;
use crate::BlockId;
use std::collections::{HashMap, VecDeque};

/// What the tier keys a block by: the block's device prefix-index key (its chained block
/// hash) and the KV cache group whose layers the KV belongs to (0 for a manager of one group).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct HostKey {
    /// The device prefix index's key of the block.
    pub hash: BlockHash,
    /// The KV cache group (index into the manager's groups).
    pub group: u32,
}

impl HostKey {
    /// The key of `hash` in KV cache group `group`.
    pub fn new(hash: BlockHash, group: u32) -> Self {
        Self { hash, group }
    }
}

impl From<BlockHash> for HostKey {
    /// The key of `hash` in group 0 (the only group of a manager of one group).
    fn from(hash: BlockHash) -> Self {
        Self { hash, group: 0 }
    }
}

/// Largest accepted number of host blocks (2^28, as for the device pool).
pub const MAX_HOST_BLOCKS: u32 = crate::pool::MAX_BLOCKS;

/// How the tier picks the host block to evict when it is full. Either way a pinned block (a
/// load planned or in flight) is never evicted. A block is *used* when it is stored, loaded
/// (pinned by a prefix hit) or re-evicted from the device while on host.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum HostEviction {
    /// Least recently used first.
    #[default]
    Lru,
    /// Adaptive Replacement Cache (Megiddo and Modha, "ARC: A Self-Tuning, Low Overhead
    /// Replacement Cache", FAST'03). Cached blocks are in one of two LRU lists: T1, used once
    /// since they were stored, and T2, used again since. Ghost lists B1 and B2 keep the keys
    /// (no KV) most recently evicted from each. Storing a key found in B1 raises T1's target
    /// size `p`, storing one found in B2 lowers it (each by `max(1, |other ghost| / |own
    /// ghost|)`), and such a key goes straight to T2. A full tier evicts T1's LRU block while
    /// `|T1| > p` (or `|T1| == p` for a key from B2), else T2's (the paper's REPLACE), into
    /// the matching ghost list; `|T1| + |B1| <= num_blocks` and
    /// `|on host| + |B1| + |B2| <= 2 num_blocks` (ghosts dropped LRU first). So a run of
    /// one-off blocks (a long prompt never asked for again) cycles through T1 and does not
    /// flush the blocks that came back (T2). Pinned blocks are out of both lists; a load's
    /// block rejoins at T2's back when its pin is released.
    Arc,
}

impl HostEviction {
    /// Every policy, in the order error messages list them.
    pub const ALL: [HostEviction; 2] = [HostEviction::Lru, HostEviction::Arc];

    /// `"lru"` or `"arc"`.
    pub fn name(self) -> &'static str {
        match self {
            HostEviction::Lru => "lru",
            HostEviction::Arc => "arc",
        }
    }

    /// Parses a [`Self::name`] (`"lru"`, `"arc"`); `None` for any other name.
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|e| e.name() == name)
    }
}

/// Marks a host block in no list (free or pinned).
const NO_LIST: u8 = u8::MAX;

/// ARC's adaptive target and ghost lists ([`HostEviction::Arc`]); empty with LRU.
#[derive(Debug, Clone, Default)]
struct ArcState {
    /// Target size of T1 in blocks (the paper's `p`), `0..=num_blocks`.
    target_t1: usize,
    /// Ghost key -> (its list: 0 = B1, 1 = B2; the stamp of its queue entry).
    ghosts: HashMap<HostKey, (u8, u64)>,
    /// Per ghost list, its keys LRU first with their stamps. An entry whose stamp `ghosts` no
    /// longer holds is stale (its key was stored again) and skipped.
    queues: [VecDeque<(HostKey, u64)>; 2],
    ghost_len: [usize; 2],
    next_stamp: u64,
}

impl ArcState {
    /// Appends `key` at the MRU end of ghost list `list`.
    fn push(&mut self, list: u8, key: HostKey) {
        self.next_stamp += 1;
        self.ghosts.insert(key, (list, self.next_stamp));
        self.queues[list as usize].push_back((key, self.next_stamp));
        self.ghost_len[list as usize] += 1;
    }

    /// Removes `key` from its ghost list; returns the list.
    fn take(&mut self, key: &HostKey) -> Option<u8> {
        let (list, _) = self.ghosts.remove(key)?;
        let l = list as usize;
        self.ghost_len[l] -= 1;
        // Compact once stale entries outnumber live ones (amortised O(1)).
        if self.queues[l].len() > 2 * self.ghost_len[l] + 64 {
            let ghosts = &self.ghosts;
            self.queues[l].retain(|(k, s)| ghosts.get(k) == Some(&(list, *s)));
        }
        Some(list)
    }

    /// Drops the LRU key of ghost list `list`; false when it is empty.
    fn pop_front(&mut self, list: u8) -> bool {
        while let Some((k, s)) = self.queues[list as usize].pop_front() {
            if self.ghosts.get(&k) == Some(&(list, s)) {
                self.ghosts.remove(&k);
                self.ghost_len[list as usize] -= 1;
                return true;
            }
        }
        false
    }
}

/// What a `BlockStored` event of a block carries besides its hash: the parent hash, the
/// block's token ids and extra keys. Kept only while KV events are enabled.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockMeta {
    /// Hash of the block before it in its chain (`None` for a first block).
    pub parent: Option<BlockHash>,
    /// The block's `block_size` token ids.
    pub tokens: Box<[u32]>,
    /// Extra keys hashed into the block.
    pub extra_keys: Vec<ExtraKey>,
}

/// Block-id pairs of copy plans: `(source, destination)`.
pub type BlockPairs = [(BlockId, BlockId)];

/// The copies the tier hands out at once ([`HostTier::take_plans`]), in planning order.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HostTransfers {
    /// `(device block, host block)` stores: run first in a step.
    pub stores: Vec<(BlockId, BlockId)>,
    /// `(host block, device block)` loads: run after stores and swaps, before
    /// copy-on-write and the forward pass.
    pub loads: Vec<(BlockId, BlockId)>,
}

/// What [`HostTier::plan_store`] did.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct StoreOutcome {
    /// The host block the device block is copied to, `None` when nothing was stored (not
    /// admitted, on host already, or every host block pinned).
    pub stored: Option<BlockId>,
    /// The key whose host block was evicted to make room (it is no longer on host).
    pub evicted: Option<HostKey>,
    /// The device block of a store into the same host block planned since the last hand-out
    /// (the evicted key's own store, or one into a block a reset freed): it is withdrawn, not
    /// handed out, since this store would overwrite its copy before anything read it.
    pub withdrawn: Option<BlockId>,
}

/// Marks a withdrawn entry of the planned stores (never a device block id: ids are below 2^28).
const WITHDRAWN: BlockId = BlockId::MAX;

/// Marks a host block without a store planned since the last hand-out.
const NO_STORE: u32 = u32::MAX;

/// Cumulative counters of the tier, in blocks.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HostCounters {
    /// Stores planned and not withdrawn (device -> host copies handed out or to be).
    pub stores: u64,
    /// Loads planned (host -> device copies).
    pub loads: u64,
    /// Host blocks evicted to make room for a store.
    pub evictions: u64,
}

/// The host tier: host blocks, their keys, the eviction lists of unpinned cached blocks, pins,
/// the seen counts of admission and the copies planned since the last hand-out. Memory: about
/// 80 bytes per host block plus the seen table (bounded by `2 × (device + host blocks)` keys),
/// with ARC ghost keys (at most `2 × num_blocks` less the keys on host, about `num_blocks` once
/// the tier is full; about 100 bytes each), and, with events on, one [`BlockMeta`] per cached
/// block of either tier.
#[derive(Debug, Clone)]
pub struct HostTier {
    num_blocks: u32,
    admission_min_seen: u32,
    eviction: HostEviction,
    /// Key of each host block (`None`: free, or pinned after a reset).
    key_of: Vec<Option<HostKey>>,
    /// Key -> its host block (one host copy per key).
    index: HashMap<HostKey, BlockId>,
    /// Two intrusive LRU lists over the unpinned cached host blocks, list `l` with sentinel
    /// `num_blocks + l`: `next[sentinel]` is its front (next to evict), `prev[sentinel]` its
    /// back (most recently used). LRU uses list 0 only; ARC keeps T1 in 0 and T2 in 1.
    prev: Vec<u32>,
    next: Vec<u32>,
    /// The list each host block is in ([`NO_LIST`]: free or pinned).
    list_of: Vec<u8>,
    list_len: [usize; 2],
    arc: ArcState,
    /// Host blocks without a key and without a pin, LIFO.
    free: Vec<BlockId>,
    /// Loads reading each host block that are planned or handed out and not yet released.
    pins: Vec<u32>,
    /// Admission counts per key (see the module docs), at most `seen_cap` keys.
    seen: HashMap<HostKey, u32>,
    seen_cap: usize,
    /// `(device block, host block)` copies planned since the last hand-out, a withdrawn one's
    /// device block set to [`WITHDRAWN`]; with `store_groups`, the group of each one's key.
    stores: Vec<(BlockId, BlockId)>,
    store_groups: Vec<u32>,
    /// Per host block, the index in `stores` of its store planned since the last hand-out
    /// ([`NO_STORE`]: none); at most one live store per host block, so a hand-out holds at most
    /// `num_blocks` stores.
    store_at: Vec<u32>,
    withdrawn: usize,
    /// `(host block, device block)` copies planned since the last hand-out.
    loads: Vec<(BlockId, BlockId)>,
    /// Host blocks of the loads handed out by the last hand-out: pinned until the next
    /// [`Self::release_in_flight`].
    in_flight: Vec<BlockId>,
    /// Step number (advanced by [`Self::begin_step`]) and, per device block, the step in
    /// which its hash was last registered: a block registered in the current step may not
    /// hold its KV yet (the forward pass that writes it has not run), so it is not stored.
    step: u64,
    registered_in: Vec<u64>,
    /// Event metadata per device block and per host block (empty with events off).
    device_meta: Vec<Option<BlockMeta>>,
    host_meta: Vec<Option<BlockMeta>>,
    counters: HostCounters,
}

impl HostTier {
    /// A tier of `num_blocks` host blocks (all free) beside a device pool of
    /// `num_device_blocks` blocks; `with_meta` keeps [`BlockMeta`] for KV events.
    ///
    /// Errors: [`Error::InvalidConfig`] for `num_blocks` outside `1..=MAX_HOST_BLOCKS`
    /// (`num_host_blocks`) or `admission_min_seen == 0` (`host_admission_min_seen`).
    /// O(num_blocks + num_device_blocks).
    pub fn new(
        num_blocks: u32,
        admission_min_seen: u32,
        eviction: HostEviction,
        num_device_blocks: u32,
        with_meta: bool,
    ) -> Result<Self> {
        if num_blocks == 0 || num_blocks > MAX_HOST_BLOCKS {
            return Err(Error::InvalidConfig {
                field: "num_host_blocks",
                value: num_blocks.to_string(),
                reason: format!("a host tier needs 1..={MAX_HOST_BLOCKS} blocks"),
            });
        }
        if admission_min_seen == 0 {
            return Err(Error::InvalidConfig {
                field: "host_admission_min_seen",
                value: "0".into(),
                reason: "must be at least 1 (1 stores every evicted block)".into(),
            });
        }
        let n = num_blocks as usize;
        let d = num_device_blocks as usize;
        // Each list's sentinel starts linked to itself.
        let mut links = vec![num_blocks; n + 2];
        links[n + 1] = num_blocks + 1;
        Ok(Self {
            num_blocks,
            admission_min_seen,
            eviction,
            key_of: vec![None; n],
            index: HashMap::with_capacity(n),
            prev: links.clone(),
            next: links,
            list_of: vec![NO_LIST; n],
            list_len: [0, 0],
            arc: ArcState::default(),
            // Block 0 is handed out first.
            free: (0..num_blocks).rev().collect(),
            pins: vec![0; n],
            seen: HashMap::new(),
            seen_cap: 2 * (n + d),
            stores: Vec::new(),
            store_groups: Vec::new(),
            store_at: vec![NO_STORE; n],
            withdrawn: 0,
            loads: Vec::new(),
            in_flight: Vec::new(),
            step: 1,
            registered_in: vec![0; d],
            device_meta: if with_meta { vec![None; d] } else { Vec::new() },
            host_meta: if with_meta { vec![None; n] } else { Vec::new() },
            counters: HostCounters::default(),
        })
    }

    /// Host blocks.
    pub fn num_blocks(&self) -> u32 {
        self.num_blocks
    }

    /// The admission threshold (seen count a key needs to be stored).
    pub fn admission_min_seen(&self) -> u32 {
        self.admission_min_seen
    }

    /// The eviction policy.
    pub fn eviction(&self) -> HostEviction {
        self.eviction
    }

    /// Host blocks holding a key or pinned by a load (`num_blocks - free`).
    pub fn num_used(&self) -> usize {
        self.num_blocks as usize - self.free.len()
    }

    /// Host blocks pinned by planned or handed-out loads.
    pub fn num_pinned(&self) -> usize {
        self.pins.iter().filter(|&&p| p > 0).count()
    }

    /// Cumulative counters.
    pub fn counters(&self) -> HostCounters {
        self.counters
    }

    /// The host block holding `key`, if any. No side effects. Expected O(1).
    pub fn lookup(&self, key: &HostKey) -> Option<BlockId> {
        self.index.get(key).copied()
    }

    /// The key host block `id` holds (`None` when free or out of range).
    pub fn key_of(&self, id: BlockId) -> Option<HostKey> {
        self.key_of.get(id as usize).copied().flatten()
    }

    /// The seen count of `key` (0 when never seen or aged out).
    pub fn seen_count(&self, key: &HostKey) -> u32 {
        self.seen.get(key).copied().unwrap_or(0)
    }

    /// The unpinned cached host blocks, front (next to evict) to back: with LRU the LRU
    /// order; with ARC T1's LRU order, then T2's. O(len).
    pub fn lru_order(&self) -> Vec<BlockId> {
        let mut out = self.list_order(0);
        out.extend(self.list_order(1));
        out
    }

    /// List `l`'s blocks, front to back (bounded walk: a corrupt list cannot loop forever).
    fn list_order(&self, l: usize) -> Vec<BlockId> {
        let s = self.num_blocks + l as u32;
        let mut out = Vec::with_capacity(self.list_len[l]);
        let mut cur = self.next[s as usize];
        while cur != s && out.len() <= self.key_of.len() {
            out.push(cur);
            cur = self.next[cur as usize];
        }
        out
    }

    /// Copies planned since the last hand-out: `(device, host)` stores (withdrawn ones left
    /// out) and `(host, device)` loads, in planning order. O(plans).
    pub fn pending(&self) -> (Vec<(BlockId, BlockId)>, &BlockPairs) {
        (self.live_stores().map(|(s, _)| s).collect(), &self.loads)
    }

    /// The planned stores not withdrawn, with the group of each one's key.
    fn live_stores(&self) -> impl Iterator<Item = ((BlockId, BlockId), u32)> + '_ {
        self.stores
            .iter()
            .zip(&self.store_groups)
            .filter(|(s, _)| s.0 != WITHDRAWN)
            .map(|(&s, &g)| (s, g))
    }

    /// Counts one use of `key` (a computed block registered, or a prefix hit) for admission.
    /// Ages every count (halves it, dropping zeros) when the table exceeds its bound.
    /// Amortised O(1).
    pub fn note_seen(&mut self, key: HostKey) {
        let c = self.seen.entry(key).or_insert(0);
        *c = c.saturating_add(1);
        while self.seen.len() > self.seen_cap {
            self.seen.retain(|_, c| {
                *c /= 2;
                *c > 0
            });
        }
    }

    /// Starts a scheduler step: blocks registered from now on belong to this step.
    pub fn begin_step(&mut self) {
        self.step += 1;
    }

    /// Notes that device block `device` was (re)registered under a hash now, with the event
    /// metadata when events are on. O(1).
    pub fn note_registered(&mut self, device: BlockId, meta: Option<BlockMeta>) {
        if let Some(slot) = self.registered_in.get_mut(device as usize) {
            *slot = self.step;
        }
        if let (Some(slot), Some(meta)) = (self.device_meta.get_mut(device as usize), meta) {
            *slot = Some(meta);
        }
    }

    /// Notes that device block `device` receives its KV by a copy the executor runs after the
    /// next step call's stores (a swap-in planned between step calls): that call must not
    /// store it (the store would read the block's old bytes), so it is stored from the step
    /// after on. Call after any [`Self::note_registered`] of it. O(1).
    pub fn note_copied_in(&mut self, device: BlockId) {
        if let Some(slot) = self.registered_in.get_mut(device as usize) {
            *slot = self.step + 1;
        }
    }

    /// Whether event metadata is kept (KV events on).
    pub fn keeps_meta(&self) -> bool {
        !self.host_meta.is_empty()
    }

    /// The event metadata of host block `id`, if kept.
    pub fn host_meta(&self, id: BlockId) -> Option<&BlockMeta> {
        self.host_meta.get(id as usize).and_then(Option::as_ref)
    }

    /// Plans storing the KV of device block `device`, whose hash `key` the device pool has
    /// just evicted (its last device copy) to reuse the block. Stored when `key` has been
    /// seen `admission_min_seen` times, is not on host already, and the block's KV was
    /// written before this step (see `registered_in`); a key on host already counts as used
    /// instead (LRU: to the back; ARC: to T2's back). The destination is a free host block,
    /// else the block [`HostEviction`] picks (evicted, reported in
    /// [`StoreOutcome::evicted`]); pinned blocks are never taken, so with every host block
    /// pinned nothing is stored (and nothing changes). When the victim's own store is still
    /// planned (not handed out), that store is withdrawn ([`StoreOutcome::withdrawn`]): one
    /// hand-out never copies into a host block twice, so an allocation evicting more blocks
    /// than the tier holds plans at most `num_blocks` stores, the ones the policy keeps.
    /// O(1) expected (amortised with ARC and with withdrawals).
    pub fn plan_store(&mut self, device: BlockId, key: HostKey) -> StoreOutcome {
        let mut out = StoreOutcome::default();
        if let Some(&h) = self.index.get(&key) {
            if self.list_of[h as usize] != NO_LIST {
                self.list_remove(h);
                self.list_push_back(h, self.reuse_list());
            }
            return out;
        }
        let written = self
            .registered_in
            .get(device as usize)
            .is_some_and(|&s| s < self.step);
        if !written || self.seen_count(&key) < self.admission_min_seen {
            return out;
        }
        if self.free.is_empty() && self.list_len == [0, 0] {
            return out; // every host block pinned
        }
        let ghost = match self.eviction {
            HostEviction::Lru => None,
            HostEviction::Arc => self.arc_ghost_hit(&key),
        };
        let h = match self.free.pop() {
            Some(h) => h,
            None => {
                let l = self.victim_list(ghost == Some(1));
                let h = self.list_pop_front(l).expect("a cached block to evict");
                let old = self.key_of[h as usize]
                    .take()
                    .expect("listed blocks hold a key");
                self.index.remove(&old);
                if self.eviction == HostEviction::Arc {
                    self.arc.push(l, old);
                }
                self.counters.evictions += 1;
                out.evicted = Some(old);
                h
            }
        };
        // A free block may still be the destination of a store planned before a reset or a
        // discard freed it; either way that copy would be overwritten by this one.
        out.withdrawn = self.withdraw_store(h);
        self.key_of[h as usize] = Some(key);
        self.index.insert(key, h);
        // A key back from a ghost list was used before: ARC's T2.
        self.list_push_back(h, u8::from(ghost.is_some()));
        if self.eviction == HostEviction::Arc {
            self.arc_trim_ghosts();
        }
        if self.keeps_meta() {
            self.host_meta[h as usize] = self.device_meta[device as usize].clone();
        }
        self.store_at[h as usize] = self.stores.len() as u32;
        self.stores.push((device, h));
        self.store_groups.push(key.group);
        self.counters.stores += 1;
        out.stored = Some(h);
        out
    }

    /// Withdraws the store into host block `h` planned since the last hand-out, if any (its
    /// key has just been evicted: the copy would only be overwritten); returns its device
    /// block. Compacts the plan list once withdrawn entries outnumber live ones (amortised
    /// O(1)).
    fn withdraw_store(&mut self, h: BlockId) -> Option<BlockId> {
        let i = std::mem::replace(&mut self.store_at[h as usize], NO_STORE);
        if i == NO_STORE {
            return None;
        }
        let d = std::mem::replace(&mut self.stores[i as usize].0, WITHDRAWN);
        self.withdrawn += 1;
        self.counters.stores -= 1;
        if self.withdrawn > self.stores.len() - self.withdrawn + 64 {
            let live: Vec<_> = self.live_stores().collect();
            self.stores = live.iter().map(|&(s, _)| s).collect();
            self.store_groups = live.iter().map(|&(_, g)| g).collect();
            self.withdrawn = 0;
            for (i, &(_, h)) in self.stores.iter().enumerate() {
                self.store_at[h as usize] = i as u32;
            }
        }
        Some(d)
    }

    /// Pins host block `h` for a load (it leaves the eviction lists: not evictable, not a
    /// store destination). Errors: [`Error::InvalidArgument`] unless `h` holds a key. O(1).
    pub fn pin(&mut self, h: BlockId) -> Result<()> {
        if self.key_of(h).is_none() {
            return Err(Error::InvalidArgument {
                arg: "host_block",
                value: h.to_string(),
                reason: "only a host block holding a cached block can be loaded".into(),
            });
        }
        if self.list_of[h as usize] != NO_LIST {
            self.list_remove(h);
        }
        self.pins[h as usize] += 1;
        Ok(())
    }

    /// Drops one pin of `h` (taken by [`Self::pin`] for a load that is then not planned).
    /// The last pin puts a cached block back as used (LRU: at the back; ARC: T2's back).
    pub fn unpin(&mut self, h: BlockId) {
        let i = h as usize;
        debug_assert!(self.pins[i] > 0, "unpin of unpinned host block {h}");
        self.pins[i] -= 1;
        if self.pins[i] == 0 {
            match self.key_of[i] {
                Some(_) => self.list_push_back(h, self.reuse_list()),
                None => self.free.push(h),
            }
        }
    }

    /// Drops `key` from the tier without evicting it (a store that failed: its host block never
    /// received the KV): no eviction counted, no ARC ghost. The block is free at once when
    /// unpinned, else when its last pin is released ([`Self::unpin`]). Returns the host block,
    /// `None` (nothing changed) when `key` is not on host. O(1).
    pub fn discard(&mut self, key: &HostKey) -> Option<BlockId> {
        let h = self.index.remove(key)?;
        let i = h as usize;
        self.key_of[i] = None;
        if let Some(m) = self.host_meta.get_mut(i) {
            *m = None;
        }
        if self.pins[i] == 0 {
            if self.list_of[i] != NO_LIST {
                self.list_remove(h);
            }
            self.free.push(h);
        }
        Some(h)
    }

    /// Plans the copy of pinned host block `h` into device block `device`.
    pub fn plan_load(&mut self, h: BlockId, device: BlockId) {
        debug_assert!(
            self.pins[h as usize] > 0,
            "load from unpinned host block {h}"
        );
        self.loads.push((h, device));
        self.counters.loads += 1;
    }

    /// Unpins the host blocks of the loads the previous hand-out gave out (the executor has
    /// run them: the contract is that it runs a step's plans before the next step call).
    pub fn release_in_flight(&mut self) {
        for h in std::mem::take(&mut self.in_flight) {
            self.unpin(h);
        }
    }

    /// Hands out the copies planned since the last hand-out (withdrawn stores left out). The
    /// loads' host blocks stay pinned until the next [`Self::release_in_flight`].
    pub fn take_plans(&mut self) -> HostTransfers {
        self.take_plans_with_groups().0
    }

    /// [`Self::take_plans`] with the KV cache group of each store's key, in store order.
    pub fn take_plans_with_groups(&mut self) -> (HostTransfers, Vec<u32>) {
        let (stores, groups): (Vec<_>, Vec<_>) = self.live_stores().unzip();
        for &(_, h) in &stores {
            self.store_at[h as usize] = NO_STORE;
        }
        self.stores.clear();
        self.store_groups.clear();
        self.withdrawn = 0;
        let loads = std::mem::take(&mut self.loads);
        self.in_flight.extend(loads.iter().map(|&(h, _)| h));
        (HostTransfers { stores, loads }, groups)
    }

    /// Drops every key (the prefix cache is reset): unpinned blocks become free, pinned ones
    /// become free when their loads are released. Planned copies stay planned (a store into
    /// a block that no longer holds a key is harmless). The seen counts are kept (they
    /// describe the workload, not cached KV); ARC's ghosts and target are reset.
    /// O(num_blocks).
    pub fn clear(&mut self) {
        while self.list_pop_front(0).is_some() {}
        while self.list_pop_front(1).is_some() {}
        self.arc = ArcState::default();
        self.index.clear();
        self.free.clear();
        for (i, key) in self.key_of.iter_mut().enumerate() {
            *key = None;
            if self.pins[i] == 0 {
                self.free.push(i as BlockId);
            }
        }
        self.free.reverse();
        for m in &mut self.host_meta {
            *m = None;
        }
    }

    /// Checks the tier's invariants (docs/design.md, "Invariants", 9): index and keys agree;
    /// every host block is exactly one of free (no key, no pin), cached in an eviction list
    /// (key, no pin; LRU uses one list) or pinned; no block is free and mapped; each block's
    /// pin count equals the planned and handed-out loads reading it; planned copies name
    /// valid blocks; ARC's ghosts are keys not on host, counted right, within their bounds
    /// (`|T1| + |B1| <= n`, `|on host| + |B1| + |B2| <= 2n`, `p <= n`). `device_ok` says
    /// whether a device id is valid. Returns the first violation. O(num_blocks + ghosts).
    pub fn check(&self, device_ok: impl Fn(BlockId) -> bool) -> std::result::Result<(), String> {
        self.check_held(device_ok, &[])
    }

    /// [`Self::check`] for an owner that also pins host blocks itself ([`Self::pin`] without
    /// a planned load, as [`crate::host_pool::HostPool`] does): `held[h]` is the number of
    /// such pins on block `h` (missing entries count 0), expected on top of the loads'.
    pub fn check_held(
        &self,
        device_ok: impl Fn(BlockId) -> bool,
        held: &[u32],
    ) -> std::result::Result<(), String> {
        let n = self.num_blocks as usize;
        let mut mapped = 0;
        for (i, key) in self.key_of.iter().enumerate() {
            if let Some(k) = key {
                mapped += 1;
                if self.index.get(k) != Some(&(i as BlockId)) {
                    return Err(format!(
                        "host block {i} holds a key the index maps elsewhere"
                    ));
                }
            }
        }
        if mapped != self.index.len() {
            return Err(format!(
                "host index has {} keys, {mapped} host blocks hold one",
                self.index.len()
            ));
        }
        let mut is_free = vec![false; n];
        for &h in &self.free {
            let i = h as usize;
            if i >= n || is_free[i] {
                return Err(format!("host free list holds {h} twice or out of range"));
            }
            is_free[i] = true;
        }
        for l in 0..2 {
            let walk = self.list_order(l);
            if walk.len() != self.list_len[l] {
                return Err(format!(
                    "host list {l} walk found {}, length {}",
                    walk.len(),
                    self.list_len[l]
                ));
            }
            if let Some(h) = walk.iter().find(|&&h| self.list_of[h as usize] != l as u8) {
                return Err(format!(
                    "host block {h} walked in list {l}, tagged otherwise"
                ));
            }
        }
        self.check_arc()?;
        let mut want_pins = vec![0u32; n];
        for (w, &h) in want_pins.iter_mut().zip(held) {
            *w = h;
        }
        for &(h, d) in &self.loads {
            if h as usize >= n || !device_ok(d) {
                return Err(format!("planned load ({h}, {d}) names an invalid block"));
            }
            want_pins[h as usize] += 1;
        }
        for &h in &self.in_flight {
            want_pins[h as usize] += 1;
        }
        self.check_stores(&device_ok)?;
        for i in 0..n {
            let (key, pinned) = (self.key_of[i].is_some(), self.pins[i] > 0);
            if self.pins[i] != want_pins[i] {
                return Err(format!(
                    "host block {i}: {} pin(s), {} load(s) planned or in flight or held",
                    self.pins[i], want_pins[i]
                ));
            }
            if is_free[i] && (key || pinned) {
                return Err(format!(
                    "host block {i} is free but mapped ({key}) or pinned ({pinned})"
                ));
            }
            if (self.list_of[i] != NO_LIST) != (key && !pinned) {
                return Err(format!(
                    "host block {i}: in list {} but key {key}, pinned {pinned}",
                    self.list_of[i]
                ));
            }
            if !is_free[i] && !key && !pinned {
                return Err(format!("host block {i} is neither free, cached nor pinned"));
            }
        }
        Ok(())
    }

    /// The planned stores (see [`Self::check`]): valid blocks, one group each, at most one
    /// live store per host block, indexed by `store_at`, withdrawn ones counted.
    fn check_stores(
        &self,
        device_ok: &impl Fn(BlockId) -> bool,
    ) -> std::result::Result<(), String> {
        let n = self.num_blocks as usize;
        if self.store_groups.len() != self.stores.len() {
            return Err("planned stores and their groups disagree in number".into());
        }
        let mut live = 0;
        for (i, &(d, h)) in self.stores.iter().enumerate() {
            if h as usize >= n {
                return Err(format!("planned store ({d}, {h}) names an invalid block"));
            }
            if d == WITHDRAWN {
                continue;
            }
            live += 1;
            if !device_ok(d) {
                return Err(format!("planned store ({d}, {h}) names an invalid block"));
            }
            if self.store_at[h as usize] != i as u32 {
                return Err(format!(
                    "planned store ({d}, {h}) is not the host block's one live store"
                ));
            }
        }
        let indexed = self.store_at.iter().filter(|&&i| i != NO_STORE).count();
        if indexed != live || live + self.withdrawn != self.stores.len() {
            return Err(format!(
                "{live} live planned stores, {indexed} indexed, {} withdrawn of {}",
                self.withdrawn,
                self.stores.len()
            ));
        }
        Ok(())
    }

    /// ARC's ghost structures against their invariants (see [`Self::check`]).
    fn check_arc(&self) -> std::result::Result<(), String> {
        let a = &self.arc;
        if self.eviction == HostEviction::Lru {
            if self.list_len[1] != 0 || !a.ghosts.is_empty() || a.target_t1 != 0 {
                return Err("LRU host tier with T2 blocks, ghosts or a target".into());
            }
            return Ok(());
        }
        let mut per = [0usize; 2];
        for (k, &(l, _)) in &a.ghosts {
            if self.index.contains_key(k) {
                return Err("a key is both on host and in a ghost list".into());
            }
            per[l as usize] += 1;
        }
        for (l, (queue, &keys)) in a.queues.iter().zip(&per).enumerate() {
            let live = queue
                .iter()
                .filter(|(k, s)| a.ghosts.get(k) == Some(&(l as u8, *s)))
                .count();
            if keys != a.ghost_len[l] || live != keys {
                return Err(format!(
                    "ghost list {l}: {keys} keys, {live} live queue entries, length {}",
                    a.ghost_len[l]
                ));
            }
        }
        let n = self.num_blocks as usize;
        let [b1, b2] = a.ghost_len;
        if a.target_t1 > n || self.list_len[0] + b1 > n || self.index.len() + b1 + b2 > 2 * n {
            return Err(format!(
                "ARC bounds: p {}, |T1| {} + |B1| {b1}, on host {} + |B2| {b2}, {n} blocks",
                a.target_t1,
                self.list_len[0],
                self.index.len()
            ));
        }
        Ok(())
    }

    /// The list a used cached block goes to: LRU's one list, ARC's T2.
    fn reuse_list(&self) -> u8 {
        match self.eviction {
            HostEviction::Lru => 0,
            HostEviction::Arc => 1,
        }
    }

    /// The list a full tier evicts from (its front), at least one list being non-empty: LRU's
    /// one list; ARC's REPLACE (T1 while `|T1| > p`, or `== p` for a key from B2; else T2,
    /// falling back to the other list when the chosen one is empty: all pinned).
    fn victim_list(&self, key_from_b2: bool) -> u8 {
        if self.eviction == HostEviction::Lru {
            return 0;
        }
        let (t1, p) = (self.list_len[0], self.arc.target_t1);
        let from_t1 = t1 > 0 && (t1 > p || (key_from_b2 && t1 == p));
        u8::from(!from_t1 && self.list_len[1] > 0)
    }

    /// ARC: a store of `key` found in a ghost list adapts the target (B1 raises it, B2 lowers
    /// it) and takes the key out; returns its list.
    fn arc_ghost_hit(&mut self, key: &HostKey) -> Option<u8> {
        let &(list, _) = self.arc.ghosts.get(key)?;
        let [b1, b2] = self.arc.ghost_len;
        let a = &mut self.arc;
        if list == 0 {
            a.target_t1 = (a.target_t1 + (b2 / b1).max(1)).min(self.num_blocks as usize);
        } else {
            a.target_t1 = a.target_t1.saturating_sub((b1 / b2).max(1));
        }
        a.take(key)
    }

    /// ARC: drops ghost keys, LRU first, until `|T1| + |B1| <= n` and
    /// `|on host| + |B1| + |B2| <= 2n`.
    fn arc_trim_ghosts(&mut self) {
        let n = self.num_blocks as usize;
        while self.list_len[0] + self.arc.ghost_len[0] > n && self.arc.pop_front(0) {}
        while self.index.len() + self.arc.ghost_len[0] + self.arc.ghost_len[1] > 2 * n
            && (self.arc.pop_front(1) || self.arc.pop_front(0))
        {}
    }

    fn list_push_back(&mut self, h: BlockId, l: u8) {
        let s = self.num_blocks as usize + l as usize;
        let (i, back) = (h as usize, self.prev[s]);
        self.prev[i] = back;
        self.next[i] = s as u32;
        self.next[back as usize] = h;
        self.prev[s] = h;
        self.list_of[i] = l;
        self.list_len[l as usize] += 1;
    }

    fn list_remove(&mut self, h: BlockId) {
        let i = h as usize;
        let (p, nx) = (self.prev[i], self.next[i]);
        self.next[p as usize] = nx;
        self.prev[nx as usize] = p;
        self.list_len[self.list_of[i] as usize] -= 1;
        self.list_of[i] = NO_LIST;
    }

    fn list_pop_front(&mut self, l: u8) -> Option<BlockId> {
        let s = self.num_blocks + u32::from(l);
        let front = self.next[s as usize];
        if front == s {
            return None;
        }
        self.list_remove(front);
        Some(front)
    }
}

// Manager-side helpers of the host tier (the KV cache manager's side of it).

/// Checks the host-tier fields of the manager's configuration. Errors: [`Error::InvalidConfig`] naming `host_admission_min_seen` when it is 0, or
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
/// store (from the metadata the tier kept). Hashes are the keys' `hash`; the manager emits
/// these with the key's group beside them.
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
/// block before the executor fills it). O(plans).
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

#[cfg(test)]
mod tests {
    use super::*;

    fn k(i: u8) -> HostKey {
        HostKey::new(BlockHash([i; 32]), 0)
    }

    /// A tier of `n` host blocks beside 8 device blocks, admission after `seen` uses, with
    /// every device block's KV written (a step has begun since).
    fn tier(n: u32, seen: u32) -> HostTier {
        let mut t = HostTier::new(n, seen, HostEviction::Lru, 8, false).unwrap();
        t.begin_step();
        t
    }

    #[test]
    fn rejects_bad_config() {
        let e = HostTier::new(0, 2, HostEviction::Lru, 8, false).unwrap_err();
        assert!(matches!(
            e,
            Error::InvalidConfig {
                field: "num_host_blocks",
                ..
            }
        ));
        let e = HostTier::new(4, 0, HostEviction::Lru, 8, false).unwrap_err();
        assert!(matches!(
            e,
            Error::InvalidConfig {
                field: "host_admission_min_seen",
                ..
            }
        ));
        assert_eq!(HostEviction::from_name("lru"), Some(HostEviction::Lru));
        assert_eq!(HostEviction::from_name("lfu"), None);
    }

    #[test]
    fn stores_only_after_the_admission_count() {
        let mut t = tier(4, 2);
        t.note_seen(k(1));
        assert_eq!(t.plan_store(3, k(1)), StoreOutcome::default());
        t.note_seen(k(1));
        assert_eq!(t.plan_store(3, k(1)).stored, Some(0));
        assert_eq!(t.lookup(&k(1)), Some(0));
        // On host already: nothing more.
        assert_eq!(t.plan_store(5, k(1)).stored, None);
        assert_eq!(t.pending().0, &[(3, 0)]);
        t.check(|d| d < 8).unwrap();
    }

    #[test]
    fn a_block_registered_in_this_step_is_not_stored() {
        let mut t = tier(4, 1);
        t.note_seen(k(1));
        t.note_registered(3, None);
        assert_eq!(t.plan_store(3, k(1)).stored, None);
        t.begin_step();
        assert_eq!(t.plan_store(3, k(1)).stored, Some(0));
    }

    #[test]
    fn evicts_least_recently_used_and_never_a_pinned_block() {
        let mut t = tier(2, 1);
        for i in 1..=3 {
            t.note_seen(k(i));
        }
        assert_eq!(t.plan_store(1, k(1)).stored, Some(0));
        assert_eq!(t.plan_store(2, k(2)).stored, Some(1));
        // Re-evicting k(1) from the device refreshes it: k(2) is now the LRU front.
        t.plan_store(4, k(1));
        assert_eq!(t.lru_order(), vec![1, 0]);
        // k(2)'s store into host block 1 is not handed out yet: k(3)'s replaces it.
        let out = t.plan_store(3, k(3));
        assert_eq!(
            out,
            StoreOutcome {
                stored: Some(1),
                evicted: Some(k(2)),
                withdrawn: Some(2),
            }
        );
        assert_eq!(t.lookup(&k(2)), None);
        // Pin both: nothing can be stored.
        t.pin(0).unwrap();
        t.pin(1).unwrap();
        t.plan_load(0, 5);
        t.plan_load(1, 6);
        t.note_seen(k(4));
        assert_eq!(t.plan_store(7, k(4)), StoreOutcome::default());
        t.check(|d| d < 8).unwrap();
        // Handed out, pins held until the next release.
        let HostTransfers { stores, loads } = t.take_plans();
        assert_eq!(stores, vec![(1, 0), (3, 1)]);
        assert_eq!(loads, vec![(0, 5), (1, 6)]);
        assert_eq!(t.num_pinned(), 2);
        assert_eq!(t.plan_store(7, k(4)).stored, None);
        t.release_in_flight();
        assert_eq!(t.num_pinned(), 0);
        assert_eq!(t.lru_order(), vec![0, 1]);
        assert_eq!(t.plan_store(7, k(4)).evicted, Some(k(1)));
        t.check(|d| d < 8).unwrap();
    }

    #[test]
    fn discard_frees_a_block_without_an_eviction() {
        let mut t = tier(2, 1);
        t.note_seen(k(1));
        t.note_seen(k(2));
        t.plan_store(1, k(1));
        t.plan_store(2, k(2));
        // Unpinned: free at once.
        assert_eq!(t.discard(&k(1)), Some(0));
        assert_eq!((t.lookup(&k(1)), t.num_used()), (None, 1));
        assert_eq!(t.discard(&k(1)), None);
        t.check(|d| d < 8).unwrap();
        // Pinned: free when the pin is released.
        t.pin(1).unwrap();
        assert_eq!(t.discard(&k(2)), Some(1));
        assert_eq!(t.num_used(), 1);
        t.unpin(1);
        assert_eq!((t.num_used(), t.counters().evictions), (0, 0));
        t.check(|d| d < 8).unwrap();
    }

    #[test]
    fn clear_frees_unpinned_blocks_and_pinned_ones_on_release() {
        let mut t = tier(3, 1);
        t.note_seen(k(1));
        t.note_seen(k(2));
        t.plan_store(1, k(1));
        t.plan_store(2, k(2));
        t.pin(0).unwrap();
        t.plan_load(0, 4);
        t.clear();
        assert_eq!((t.lookup(&k(1)), t.num_used()), (None, 1));
        t.check(|d| d < 8).unwrap();
        t.take_plans();
        t.release_in_flight();
        assert_eq!(t.num_used(), 0);
        assert!(t.pin(1).is_err());
        t.check(|d| d < 8).unwrap();
    }

    /// A tier of `n` host blocks with ARC, admission after one use, every device block written.
    fn arc_tier(n: u32) -> HostTier {
        let mut t = HostTier::new(n, 1, HostEviction::Arc, 8, false).unwrap();
        t.begin_step();
        t
    }

    /// Stores `key` (one use noted first) from device block 0; returns the evicted key.
    fn store(t: &mut HostTier, key: HostKey) -> Option<HostKey> {
        t.note_seen(key);
        let out = t.plan_store(0, key);
        t.check(|d| d < 8).unwrap();
        out.evicted
    }

    /// ARC's lists as (T1 keys, T2 keys, B1 keys, B2 keys), LRU first.
    fn arc_lists(t: &HostTier) -> [Vec<HostKey>; 4] {
        let keys = |l: usize| -> Vec<HostKey> {
            t.list_order(l)
                .iter()
                .map(|&h| t.key_of(h).unwrap())
                .collect()
        };
        let ghosts = |l: usize| -> Vec<HostKey> {
            t.arc.queues[l]
                .iter()
                .filter(|(k, s)| t.arc.ghosts.get(k) == Some(&(l as u8, *s)))
                .map(|&(k, _)| k)
                .collect()
        };
        [keys(0), keys(1), ghosts(0), ghosts(1)]
    }

    #[test]
    fn parses_every_policy_name() {
        for e in HostEviction::ALL {
            assert_eq!(HostEviction::from_name(e.name()), Some(e));
        }
        assert_eq!(HostEviction::from_name("arc"), Some(HostEviction::Arc));
        assert_eq!(HostEviction::from_name("ARC"), None);
    }

    #[test]
    fn arc_evicts_as_the_paper_replaces() {
        // Worked by hand with the FAST'03 algorithm, 3 host blocks, p = 0 at first
        // (A..F = k(1)..k(6); lists LRU first):
        //  1 A      miss, free block 0           T1 [A]
        //  2 B      miss, free block 1           T1 [A B]
        //  3 A      on host: used again          T1 [B]      T2 [A]
        //  4 C      miss, free block 2           T1 [B C]    T2 [A]
        //  5 D      miss, full: |T1| 2 > p 0     evict B (T1 LRU) -> B1 [B]; T1 [C D]
        //  6 E      miss: |T1| 2 > 0             evict C -> B1 [B C]; T1 [D E]; |T1|+|B1| = 4 > 3
        //                                        drops B1's LRU: B1 [C]
        //  7 C      in B1: p += max(|B2|/|B1|, 1) = 1; |T1| 2 > 1: evict D -> B1 [D];
        //                                        C to T2: T1 [E], T2 [A C]
        //  8 F      miss: |T1| 1 = p 1, F not from B2: evict T2's LRU A -> B2 [A];
        //                                        T1 [E F], T2 [C]
        //  9 A      in B2: p -= max(|B1|/|B2|, 1) = 0; |T1| 2 > 0: evict E -> B1 [D E];
        //                                        A to T2: T1 [F], T2 [C A]
        // LRU on the same sequence: 5 D evicts B ([A C D]), 6 E evicts A, the block used
        // twice ([C D E]), 7 C is on host ([D E C]), 8 F evicts D, 9 A evicts E: [C F A].
        let mut lru = tier(3, 1);
        let evicted: Vec<Option<HostKey>> = [1, 2, 1, 3, 4, 5, 3, 6, 1]
            .iter()
            .map(|&i| store(&mut lru, k(i)))
            .collect();
        let want = [
            None,
            None,
            None,
            None,
            Some(k(2)),
            Some(k(1)),
            None,
            Some(k(4)),
            Some(k(5)),
        ];
        assert_eq!(evicted, want);
        let mut t = arc_tier(3);
        let evicted: Vec<Option<HostKey>> = [1, 2, 1, 3, 4, 5, 3, 6, 1]
            .iter()
            .map(|&i| store(&mut t, k(i)))
            .collect();
        assert_eq!(
            evicted,
            vec![
                None,
                None,
                None,
                None,
                Some(k(2)),
                Some(k(3)),
                Some(k(4)),
                Some(k(1)),
                Some(k(5))
            ]
        );
        assert_eq!(
            arc_lists(&t),
            [vec![k(6)], vec![k(3), k(1)], vec![k(4), k(5)], vec![]]
        );
        assert_eq!(t.arc.target_t1, 0);
        // Block ids: A 0, B 1, C 2; D took B's, E C's, C D's, F A's, A E's.
        assert_eq!(
            (t.lookup(&k(6)), t.lookup(&k(3)), t.lookup(&k(1))),
            (Some(0), Some(1), Some(2))
        );
        assert_eq!(t.lru_order(), vec![0, 1, 2]);
        assert_eq!(t.counters().evictions, 5);
    }

    #[test]
    fn a_one_off_scan_does_not_flush_the_reused_blocks_under_arc() {
        for (eviction, kept) in [(HostEviction::Lru, false), (HostEviction::Arc, true)] {
            let mut t = HostTier::new(4, 1, eviction, 8, false).unwrap();
            t.begin_step();
            // A and B stored, then used again (re-evicted from the device).
            for i in [1, 2, 1, 2] {
                store(&mut t, k(i));
            }
            // A scan of 20 one-off blocks.
            for i in 10..30 {
                store(&mut t, k(i));
            }
            let on_host = t.lookup(&k(1)).is_some() && t.lookup(&k(2)).is_some();
            assert_eq!(on_host, kept, "{eviction:?}");
            // The last scan blocks are on host either way (LRU: all four slots).
            assert!(t.lookup(&k(29)).is_some() && t.lookup(&k(28)).is_some());
            assert_eq!(t.lookup(&k(27)).is_some(), !kept);
        }
    }

    #[test]
    fn arc_never_evicts_a_pinned_block_and_a_load_counts_as_reuse() {
        let mut t = arc_tier(2);
        store(&mut t, k(1));
        store(&mut t, k(2));
        // Pin A (in T1) for a load: the next store must take B.
        t.pin(0).unwrap();
        t.plan_load(0, 5);
        assert_eq!(store(&mut t, k(3)), Some(k(2)));
        // Pin C too: every block pinned, a store (even a ghost hit of B) changes nothing.
        t.pin(1).unwrap();
        t.plan_load(1, 6);
        let before = (arc_lists(&t), t.arc.target_t1);
        assert_eq!(t.plan_store(0, k(2)), StoreOutcome::default());
        assert_eq!((arc_lists(&t), t.arc.target_t1), before);
        t.check(|d| d < 8).unwrap();
        t.take_plans();
        t.release_in_flight();
        // Both loads released: A and C were used again, both in T2.
        assert_eq!(arc_lists(&t)[1], vec![k(1), k(3)]);
        t.clear();
        assert_eq!(arc_lists(&t), [vec![], vec![], vec![], vec![]]);
        t.check(|d| d < 8).unwrap();
    }

    #[test]
    fn arc_ghosts_stay_bounded_on_a_long_scan() {
        let mut t = arc_tier(4);
        for i in 0..200u32 {
            let mut key = [0u8; 32];
            key[..4].copy_from_slice(&i.to_le_bytes());
            let key = HostKey::new(BlockHash(key), 0);
            t.note_seen(key);
            t.plan_store(0, key);
        }
        t.check(|d| d < 8).unwrap();
        assert!(t.arc.ghost_len[0] + t.list_len[0] <= 4);
        assert!(t.arc.queues[0].len() <= 2 * t.arc.ghost_len[0] + 64 + 1);
    }

    #[test]
    fn seen_counts_age_when_the_table_is_full() {
        // Bound 2 * (1 + 8) = 18 keys.
        let mut t = tier(1, 2);
        for _ in 0..4 {
            t.note_seen(k(0));
        }
        for i in 1..=18 {
            t.note_seen(k(i));
        }
        // The 19th key halved every count: the one-off keys are gone, k(0) kept half.
        assert!(t.seen.len() <= 18);
        assert_eq!(t.seen_count(&k(0)), 2);
        assert_eq!(t.seen_count(&k(1)), 0);
    }

    /// The key of number `i` (any `u32`).
    fn key_n(i: u32) -> HostKey {
        let mut h = [0u8; 32];
        h[..4].copy_from_slice(&i.to_le_bytes());
        HostKey::new(BlockHash(h), i % 3)
    }

    #[test]
    fn one_hand_out_stores_at_most_what_the_tier_keeps() {
        // 60 evicted blocks offered to 8 host blocks before one hand-out: before the fix 60
        // stores were handed out, 52 of them overwritten by later ones of the same hand-out.
        for eviction in HostEviction::ALL {
            let mut t = HostTier::new(8, 1, eviction, 64, false).unwrap();
            t.begin_step();
            for i in 0..60 {
                t.note_seen(key_n(i));
                let out = t.plan_store(i, key_n(i));
                assert!(out.stored.is_some());
                assert_eq!(out.withdrawn, i.checked_sub(8), "{eviction:?} store {i}");
                t.check(|d| d < 64).unwrap();
            }
            assert_eq!(t.pending().0.len(), 8);
            let (HostTransfers { stores, loads }, groups) = t.take_plans_with_groups();
            assert!(loads.is_empty());
            // The policy keeps the 8 last stored (LRU; ARC: all in T1, a scan), each copied
            // once, in planning order, with its key's group.
            let want: Vec<(BlockId, BlockId)> = (52..60)
                .map(|i| (i, t.lookup(&key_n(i)).unwrap()))
                .collect();
            assert_eq!(stores, want, "{eviction:?}");
            assert_eq!(groups, (52..60).map(|i| i % 3).collect::<Vec<_>>());
            let c = t.counters();
            assert_eq!((c.stores, c.evictions), (8, 52), "{eviction:?}");
            t.check(|d| d < 64).unwrap();
            // A store after the hand-out evicts a block whose copy was handed out: nothing
            // is withdrawn.
            t.note_seen(key_n(60));
            let out = t.plan_store(60, key_n(60));
            assert_eq!((out.evicted, out.withdrawn), (Some(key_n(52)), None));
        }
    }

    #[test]
    fn a_store_into_a_block_a_reset_freed_withdraws_the_old_one() {
        let mut t = tier(2, 1);
        t.note_seen(k(1));
        t.note_seen(k(2));
        assert_eq!(t.plan_store(1, k(1)).stored, Some(0));
        t.clear();
        let out = t.plan_store(2, k(2));
        assert_eq!(
            (out.stored, out.evicted, out.withdrawn),
            (Some(0), None, Some(1))
        );
        t.check(|d| d < 8).unwrap();
        assert_eq!(t.take_plans().stores, vec![(2, 0)]);
    }

    #[test]
    fn withdrawn_entries_are_compacted() {
        // 1 host block, 1,000 stores before a hand-out: the plan list stays bounded.
        let mut t = HostTier::new(1, 1, HostEviction::Lru, 8, false).unwrap();
        t.begin_step();
        for i in 0..1000 {
            t.note_seen(key_n(i));
            t.plan_store(i % 8, key_n(i));
            assert!(t.stores.len() <= 2 + 64, "{}", t.stores.len());
        }
        t.check(|d| d < 8).unwrap();
        assert_eq!(t.take_plans().stores, vec![(999 % 8, 0)]);
        assert_eq!(t.counters().stores, 1);
    }
}
