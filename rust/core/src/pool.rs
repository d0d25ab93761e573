//! The block pool: per-block reference counts and prefix hashes, and the one logical free
//! queue of PagedAttention (Kwon et al., SOSP'23, §4.2–4.3) with the reuse order of vLLM V1's
//! `BlockPool`:
//!
//! ```text
//!   free queue (front → back) = [ uncached LIFO (FreeStack) | cached LRU (intrusive list) ]
//!   allocate takes from the front; an uncached freed block goes to the front (reused first,
//!   still warm); a cached freed block goes to the back and is evicted from the LRU front only
//!   when no uncached block is left; a prefix hit removes a cached free block in O(1).
//! ```
//!
//! Concurrency (what is lock-free, wait-free or locking, and why):
//! - The uncached free list is a tagged Treiber stack ([`FreeStack`]; Treiber 1986, with a
//!   generation-tagged head against ABA): lock-free push / pop.
//! - Capacity is a counter of free blocks (uncached + cached). An allocation first *reserves*
//!   its blocks by one CAS on that counter and only then pops, so a successful check can never
//!   be invalidated by another thread before the pop (no check-then-pop race), and the counter
//!   never goes negative. Freed blocks are pushed *before* the counter is raised, so every
//!   reserved unit is backed by a block that is physically in the stack or the LRU.
//! - Reference counts are atomics. Changes of a block without a hash are lock-free CAS / fetch
//!   operations. Transitions 1 → 0 and 0 → 1 of a block *with* a hash, the LRU, the hashes and
//!   the prefix index are guarded by one mutex, so a concurrent prefix hit can never observe a
//!   half-freed cached block.
//!
//! Caller contract shared by the lock-free calls: a thread only releases (`free`) or shares
//! (`incref`, `cache_block`) references it holds. Validation before any change then makes each
//! failed call change nothing; a caller that releases references held by another thread at the
//! same time can race past validation, in which case the CAS still never lets a count go below
//! zero and the call reports [`Error::RefCountUnderflow`].

use std::sync::Arc as StdArc;

use crate::error::{Error, Result};
use crate::events::{EventSink, KvEvent, Tier};
use crate::free_list::FreeStack;
use crate::hashing::BlockHash;
use crate::prefix_index::PrefixIndex;
use crate::sync::{
    spin_hint, AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Mutex, MutexGuard, Ordering,
};
use crate::{BlockId, NULL_BLOCK};

/// Largest accepted `num_blocks` (2^28): keeps the pool's own metadata (at most about 87 bytes
/// per block, prefix index included) near 22 GiB of address space, so an absurd configuration is an
/// error rather than an abort.
pub const MAX_BLOCKS: u32 = 1 << 28;

/// Uncached blocks released by one `free` call are pushed to the stack in chunks of this many.
const FREE_CHAIN: usize = 32;

/// What releasing one reference did to the block.
enum Released {
    /// The count is still above 0.
    StillReferenced,
    /// Reached 0 with a hash: appended to the cached LRU (under the lock).
    ToLru,
    /// Reached 0 without a hash: the caller queues it on the uncached stack.
    ToUncached,
}

/// Cumulative pool counters, all in blocks. Read with [`BlockPool::counters`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PoolCounters {
    /// Cached free blocks evicted (hash dropped) to satisfy an allocation.
    pub evictions: u64,
    /// Blocks handed out by [`BlockPool::allocate`].
    pub allocations: u64,
    /// References released by [`BlockPool::free`] (one per id passed, duplicates included).
    pub frees: u64,
    /// References taken by [`BlockPool::touch`] (prefix-cache hits, one per id passed).
    pub prefix_touches: u64,
}

/// State behind the pool's mutex: the prefix index (each block's hash and the blocks of each
/// hash) and the LRU of cached free blocks.
///
/// The LRU is an intrusive doubly linked list over block ids (`prev` / `next` arrays) with the
/// null block 0 as the sentinel: `next[0]` is the front (least recently freed), `prev[0]` the
/// back. Removal of any member is O(1).
#[derive(Debug)]
struct Locked {
    index: PrefixIndex,
    prev: Vec<BlockId>,
    next: Vec<BlockId>,
    in_lru: Vec<bool>,
    lru_len: usize,
}

impl Locked {
    fn new(num_blocks: u32) -> Self {
        let n = num_blocks as usize;
        Self {
            // Sized for every block at once: it never grows, so no step pays a rehash.
            index: PrefixIndex::new(num_blocks),
            prev: vec![NULL_BLOCK; n],
            next: vec![NULL_BLOCK; n],
            in_lru: vec![false; n],
            lru_len: 0,
        }
    }

    /// Appends `id` at the LRU back. O(1).
    fn lru_push_back(&mut self, id: BlockId) {
        let (i, back) = (id as usize, self.prev[0]);
        self.prev[i] = back;
        self.next[i] = NULL_BLOCK;
        self.next[back as usize] = id;
        self.prev[0] = id;
        self.in_lru[i] = true;
        self.lru_len += 1;
    }

    /// Unlinks `id` (which must be in the LRU). O(1).
    fn lru_remove(&mut self, id: BlockId) {
        let i = id as usize;
        let (p, n) = (self.prev[i], self.next[i]);
        self.next[p as usize] = n;
        self.prev[n as usize] = p;
        self.prev[i] = NULL_BLOCK;
        self.next[i] = NULL_BLOCK;
        self.in_lru[i] = false;
        self.lru_len -= 1;
    }

    /// Removes and returns the LRU front. O(1).
    fn lru_pop_front(&mut self) -> Option<BlockId> {
        let front = self.next[0];
        if front == NULL_BLOCK {
            return None;
        }
        self.lru_remove(front);
        Some(front)
    }

    /// LRU members front → back. O(len).
    fn lru_order(&self) -> Vec<BlockId> {
        let mut out = Vec::with_capacity(self.lru_len);
        let mut cur = self.next[0];
        while cur != NULL_BLOCK && out.len() <= self.prev.len() {
            out.push(cur);
            cur = self.next[cur as usize];
        }
        out
    }
}

/// A pool of `num_blocks` physical KV-cache blocks (block 0 is the null block) with reference
/// counts, prefix hashes, the free queue and the prefix index. `Send + Sync`; share it in an
/// `Arc`.
///
/// Memory: O(num_blocks) — about 71 to 87 bytes per block of metadata (22 for the pool's own
/// arrays, 49 to 65 for the prefix index, whose slot table rounds up to a power of two); KV
/// tensors live elsewhere.
#[derive(Debug)]
pub struct BlockPool {
    num_blocks: u32,
    /// Reference count per block; index 0 stays 0 forever.
    refs: Box<[AtomicU32]>,
    /// `hashed[id]` mirrors `Locked::index.hash_of(id).is_some()`; written only under the lock, read
    /// lock-free by `free` to decide whether a 1 → 0 transition needs the lock.
    hashed: Box<[AtomicBool]>,
    /// Free blocks without a hash, LIFO.
    uncached: FreeStack,
    /// Free capacity in blocks (uncached + cached free), minus outstanding reservations.
    free: AtomicUsize,
    /// Length of the cached LRU; written under the lock, read wait-free.
    cached_free: AtomicUsize,
    locked: Mutex<Locked>,
    /// Scratch of `free`'s duplicate check: `seen[id]` is the stamp of the last long `free`
    /// call that read `id` (see `BlockPool::next_stamp`).
    seen: Box<[AtomicU32]>,
    /// Source of the per-call stamps written to `seen`.
    stamps: AtomicU32,
    events: StdArc<EventSink>,
    evictions: AtomicU64,
    allocations: AtomicU64,
    frees: AtomicU64,
    prefix_touches: AtomicU64,
}

impl BlockPool {
    /// A pool of `num_blocks` blocks, all free and uncached; block 1 is allocated first, then
    /// 2, 3, … (fresh blocks are taken in ascending id order). Evictions are reported to
    /// `events` as [`KvEvent::BlockRemoved`], resets as [`KvEvent::AllBlocksCleared`].
    ///
    /// Errors: [`Error::InvalidConfig`] unless `2 <= num_blocks <= MAX_BLOCKS` (block 0 is the
    /// null block, so at least one usable block is needed). O(num_blocks); a constructor, so no
    /// concurrency claim applies.
    pub fn new(num_blocks: u32, events: StdArc<EventSink>) -> Result<Self> {
        if !(2..=MAX_BLOCKS).contains(&num_blocks) {
            return Err(Error::InvalidConfig {
                field: "num_blocks",
                value: num_blocks.to_string(),
                reason: format!(
                    "need 2..={MAX_BLOCKS} blocks (block 0 is the null block, so at least one usable block)"
                ),
            });
        }
        let n = num_blocks as usize;
        let uncached = FreeStack::new(num_blocks);
        // Push in descending order so block 1 is on top: fresh blocks come out 1, 2, 3, ...
        for id in (1..num_blocks).rev() {
            uncached.push(id);
        }
        Ok(Self {
            num_blocks,
            refs: (0..n).map(|_| AtomicU32::new(0)).collect(),
            hashed: (0..n).map(|_| AtomicBool::new(false)).collect(),
            uncached,
            free: AtomicUsize::new(n - 1),
            cached_free: AtomicUsize::new(0),
            locked: Mutex::new(Locked::new(num_blocks)),
            seen: (0..n).map(|_| AtomicU32::new(0)).collect(),
            stamps: AtomicU32::new(0),
            events,
            evictions: AtomicU64::new(0),
            allocations: AtomicU64::new(0),
            frees: AtomicU64::new(0),
            prefix_touches: AtomicU64::new(0),
        })
    }

    /// Total physical blocks, the null block included. Wait-free.
    pub fn num_blocks(&self) -> u32 {
        self.num_blocks
    }

    /// Usable blocks: `num_blocks - 1` (the null block is never capacity). Wait-free.
    pub fn num_usable(&self) -> usize {
        self.num_blocks as usize - 1
    }

    /// Free blocks (ref count 0: uncached + cached-evictable), in blocks. Wait-free (one load).
    /// While another thread is inside `allocate` / `touch` its reserved blocks already count as
    /// taken.
    pub fn num_free(&self) -> usize {
        self.free.load(Ordering::Acquire)
    }

    /// Free blocks that carry a hash (evictable prefix-cache blocks, the LRU length). Wait-free.
    pub fn num_cached_free(&self) -> usize {
        self.cached_free.load(Ordering::Acquire)
    }

    /// Blocks in use (ref count > 0): `num_usable() - num_free()`. Wait-free.
    pub fn num_used(&self) -> usize {
        self.num_usable().saturating_sub(self.num_free())
    }

    /// Reference count of `id`; 0 for the null block and for ids out of range. Wait-free.
    pub fn ref_count(&self, id: BlockId) -> u32 {
        if id == NULL_BLOCK {
            return 0;
        }
        self.refs
            .get(id as usize)
            .map_or(0, |r| r.load(Ordering::Acquire))
    }

    /// Reserves `n` blocks of free capacity by CAS on the free counter. Lock-free: a retry
    /// happens only when another thread changed the counter. Never lets it go below zero.
    fn reserve(&self, n: usize) -> Result<()> {
        let mut cur = self.free.load(Ordering::Acquire);
        loop {
            if cur < n {
                return Err(Error::OutOfBlocks {
                    requested: n,
                    available: cur,
                });
            }
            match self
                .free
                .compare_exchange_weak(cur, cur - n, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => return Ok(()),
                Err(now) => {
                    cur = now;
                    spin_hint();
                }
            }
        }
    }

    /// Allocates `n` blocks, all-or-nothing: each returned block has ref count 1 and no hash.
    /// Blocks come from the front of the free queue: uncached blocks in LIFO order first; only
    /// when none is left, cached free blocks are evicted from the LRU front (hash and index
    /// entry dropped, [`KvEvent::BlockRemoved`] emitted, counted in `evictions`). `n == 0`
    /// returns an empty vector.
    ///
    /// Errors: [`Error::OutOfBlocks`] `{ requested: n, available }` when fewer than `n` blocks
    /// are free; nothing is changed then.
    ///
    /// Progress: lock-free while uncached blocks are free (one CAS reservation, then one
    /// Treiber batch pop for all of them); locking when it must evict (one lock hold for all
    /// evictions). O(n).
    pub fn allocate(&self, n: usize) -> Result<Vec<BlockId>> {
        let mut out = Vec::new(); // sized once `n` is known to be free
        self.allocate_into(n, &mut out)?;
        Ok(out)
    }

    /// [`BlockPool::allocate`] appending the `n` block ids to `out` (in the order `allocate`
    /// returns them) instead of returning a new vector, so a caller that keeps a buffer (a
    /// sequence's block table, a binding's output) does not allocate. On error `out` is
    /// unchanged. Same progress and errors as `allocate`. O(n).
    pub fn allocate_into(&self, n: usize, out: &mut Vec<BlockId>) -> Result<()> {
        self.allocate_impl(n, out, None)
    }

    /// [`BlockPool::allocate_into`] that also reports, in `evicted`, each cached block it
    /// evicted whose hash stopped resolving (its last copy): `(block, hash)`, in eviction
    /// order. The host tier of the prefix cache stores those blocks' KV before they are
    /// overwritten (docs/design.md, "Host tier"). Same progress and errors; on error neither
    /// `out` nor `evicted` changes. O(n).
    pub fn allocate_into_reporting(
        &self,
        n: usize,
        out: &mut Vec<BlockId>,
        evicted: &mut Vec<(BlockId, BlockHash)>,
    ) -> Result<()> {
        self.allocate_impl(n, out, Some(evicted))
    }

    fn allocate_impl(
        &self,
        n: usize,
        out: &mut Vec<BlockId>,
        mut report: Option<&mut Vec<(BlockId, BlockHash)>>,
    ) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        self.reserve(n)?;
        let start = out.len();
        let end = start + n;
        out.reserve(n);
        while out.len() < end {
            let before = out.len();
            if self.uncached.pop_many(end - before, out) > 0 {
                for &id in &out[before..] {
                    self.refs[id as usize].store(1, Ordering::Release);
                }
                continue;
            }
            // No uncached block left: evict from the LRU front under the lock.
            let mut locked = self.locked.lock();
            let mut unresolvable = Vec::new();
            let mut evicted = 0u64;
            while out.len() < end {
                let Some(id) = locked.lru_pop_front() else {
                    break;
                };
                if out.len() + 1 < end {
                    // The next victim's index slot loads while this one is evicted.
                    let next = locked.next[0];
                    locked.index.prefetch_remove(next);
                }
                evicted += u64::from(self.evict_locked(
                    &mut locked,
                    id,
                    &mut unresolvable,
                    report.as_deref_mut(),
                ));
                self.refs[id as usize].store(1, Ordering::Release);
                out.push(id);
            }
            self.cached_free.store(locked.lru_len, Ordering::Release);
            self.evictions.fetch_add(evicted, Ordering::Relaxed);
            if !unresolvable.is_empty() {
                self.events.push(KvEvent::BlockRemoved {
                    block_hashes: unresolvable,
                    tier: Tier::Device,
                });
            }
            drop(locked);
            if out.len() < end {
                // Our reserved blocks exist but are in transit (another thread moving them
                // between the lists under the lock, or pushed to the stack after our pop):
                // retry the stack.
                spin_hint();
            }
        }
        self.allocations.fetch_add(n as u64, Ordering::Relaxed);
        Ok(())
    }

    /// Drops the hash of `id` (just unlinked from the LRU) and its index entry. Returns whether
    /// the block carried a hash (an eviction). When that was the hash's last copy, the hash no
    /// longer resolves and is pushed to `unresolvable` (the event contract is per hash, not per
    /// physical copy: see `events`).
    fn evict_locked(
        &self,
        locked: &mut Locked,
        id: BlockId,
        unresolvable: &mut Vec<BlockHash>,
        report: Option<&mut Vec<(BlockId, BlockHash)>>,
    ) -> bool {
        self.hashed[id as usize].store(false, Ordering::Release);
        let Some((hash, last)) = locked.index.remove(id) else {
            return false;
        };
        if let Some(r) = report.filter(|_| last) {
            r.push((id, hash));
        }
        // The removed hashes only feed a BlockRemoved event: not collected with events off.
        if last && self.events.enabled() {
            unresolvable.push(hash);
        }
        true
    }

    /// Validates one id argument: in `1..num_blocks`.
    fn check_id(&self, id: BlockId) -> Result<usize> {
        if id == NULL_BLOCK || id >= self.num_blocks {
            return Err(Error::InvalidBlockId {
                block_id: id,
                num_blocks: self.num_blocks,
            });
        }
        Ok(id as usize)
    }

    /// Takes one more reference on each of `ids` as prefix-cache hits (ids may repeat; each
    /// occurrence is one reference). Every id must carry a hash: a prefix hit is by definition
    /// a cached block, and refusing unhashed blocks means a stale id (looked up, then evicted
    /// and reallocated by another thread before the touch) is rejected instead of silently
    /// sharing another sequence's block. A block going 0 → 1 leaves the cached LRU in O(1) and
    /// consumes one unit of free capacity, exactly like an allocated block.
    ///
    /// Errors (nothing changed): [`Error::InvalidBlockId`] for the null block or an id out of
    /// range; [`Error::InvalidArgument`] for a block without a hash; [`Error::OutOfBlocks`]
    /// `{ requested: distinct free blocks among ids, available }` if the capacity reservation
    /// for them fails (only possible when a concurrent allocation reserved those blocks first
    /// and is about to evict them).
    ///
    /// Progress: locking (one lock hold), because it performs 0 → 1 transitions of hashed
    /// blocks. O(len · log len).
    pub fn touch(&self, ids: &[BlockId]) -> Result<()> {
        self.touch_impl(ids, None)
    }

    /// [`BlockPool::touch`] that also checks, under the same lock, that `ids[k]` still carries
    /// `hashes[k]`: the race-free form of "lookup, then touch" when other threads may evict
    /// and re-cache blocks in between.
    ///
    /// Errors (nothing changed): those of `touch`; [`Error::InvalidArgument`] if the lengths
    /// differ or a block carries another hash (or none). Locking. O(len · log len).
    pub fn touch_verified(&self, ids: &[BlockId], hashes: &[BlockHash]) -> Result<()> {
        if ids.len() != hashes.len() {
            return Err(Error::InvalidArgument {
                arg: "hashes",
                value: hashes.len().to_string(),
                reason: format!("need one hash per block id ({} ids)", ids.len()),
            });
        }
        self.touch_impl(ids, Some(hashes))
    }

    fn touch_impl(&self, ids: &[BlockId], expected: Option<&[BlockHash]>) -> Result<()> {
        if ids.is_empty() {
            return Ok(());
        }
        let mut locked = self.locked.lock();
        let mut revive = Vec::new();
        for (k, &id) in ids.iter().enumerate() {
            let i = self.check_id(id)?;
            let carried = locked.index.hash_of(id);
            let want = expected.map(|e| e[k]);
            let stray_free = self.refs[i].load(Ordering::Acquire) == 0 && !locked.in_lru[i];
            if carried.is_none() || (want.is_some() && carried != want) || stray_free {
                return Err(Error::InvalidArgument {
                    arg: "ids",
                    value: id.to_string(),
                    reason: format!(
                        "block {id} does not carry {} hash, so it is not a prefix-cache hit",
                        if want.is_some() { "the expected" } else { "a" }
                    ),
                });
            }
            if self.refs[i].load(Ordering::Acquire) == 0 {
                revive.push(id);
            }
        }
        revive.sort_unstable();
        revive.dedup();
        self.reserve(revive.len())?;
        for &id in &revive {
            locked.lru_remove(id);
        }
        self.cached_free.store(locked.lru_len, Ordering::Release);
        for &id in ids {
            // Every id is hashed, and a hashed block cannot go 1 -> 0 (nor be evicted) while
            // we hold the lock, so a plain increment is exact.
            self.refs[id as usize].fetch_add(1, Ordering::AcqRel);
        }
        drop(locked);
        self.prefix_touches
            .fetch_add(ids.len() as u64, Ordering::Relaxed);
        Ok(())
    }

    /// Takes one more reference on each of `ids` (fork: parallel sampling, beam search). Every
    /// id must already be referenced; allocates nothing.
    ///
    /// Errors (nothing changed): [`Error::InvalidBlockId`] for the null block or an id out of
    /// range; [`Error::InvalidArgument`] for a block with ref count 0.
    ///
    /// Progress: lock-free (validation loads, then one atomic increment per id). O(len).
    pub fn incref(&self, ids: &[BlockId]) -> Result<()> {
        for &id in ids {
            let i = self.check_id(id)?;
            if self.refs[i].load(Ordering::Acquire) == 0 {
                return Err(Error::InvalidArgument {
                    arg: "ids",
                    value: id.to_string(),
                    reason: format!("block {id} has ref count 0; incref needs a referenced block (use allocate or touch)"),
                });
            }
        }
        for &id in ids {
            self.refs[id as usize].fetch_add(1, Ordering::Relaxed);
        }
        Ok(())
    }

    /// Releases one reference on each of `ids`, in the given order (callers pass a sequence's
    /// blocks tail-first so the deepest block of a prefix chain is evicted first). A block
    /// reaching 0 without a hash goes to the front of the free queue (uncached LIFO); with a
    /// hash, to the back of the cached LRU.
    ///
    /// Errors (validated before any change, so nothing is changed): [`Error::InvalidBlockId`]
    /// for the null block or an id out of range; [`Error::RefCountUnderflow`] for a block whose
    /// ref count is smaller than the number of times it occurs in `ids` (a double free).
    ///
    /// Progress: lock-free for blocks without a hash and for hashed blocks whose count stays
    /// above 0; takes the lock (once, kept to the end of the call) at the first hashed block
    /// that reaches 0. O(len · log len) validation (a quadratic scan without allocation for
    /// len <= 16), then O(len).
    pub fn free(&self, ids: &[BlockId]) -> Result<()> {
        self.validate_free(ids)?;
        let mut guard: Option<MutexGuard<'_, Locked>> = None;
        // Uncached blocks reaching 0 are pushed in chunks with one CAS each (push_many keeps
        // the order of one-by-one pushes); the free counter is raised once at the end, after
        // every released block is physically queued, so reservations stay backed.
        let mut chain = [NULL_BLOCK; FREE_CHAIN];
        let mut chain_len = 0;
        let mut released = 0;
        let mut result = Ok(());
        for &id in ids {
            match self.release_one(id, &mut guard) {
                Ok(Released::StillReferenced) => {}
                Ok(Released::ToLru) => released += 1,
                Ok(Released::ToUncached) => {
                    released += 1;
                    chain[chain_len] = id;
                    chain_len += 1;
                    if chain_len == FREE_CHAIN {
                        self.uncached.push_many(&chain);
                        chain_len = 0;
                    }
                }
                Err(e) => {
                    result = Err(e);
                    break;
                }
            }
        }
        self.uncached.push_many(&chain[..chain_len]);
        if let Some(locked) = guard {
            self.cached_free.store(locked.lru_len, Ordering::Release);
        }
        if released > 0 {
            self.free.fetch_add(released, Ordering::AcqRel);
        }
        if result.is_ok() {
            self.frees.fetch_add(ids.len() as u64, Ordering::Relaxed);
        }
        result
    }

    /// Checks ids and that each block's ref count covers its multiplicity in `ids`.
    fn validate_free(&self, ids: &[BlockId]) -> Result<()> {
        let underflow = |id: BlockId, times: usize| {
            self.refs[id as usize].load(Ordering::Acquire) < times as u32
        };
        if ids.len() <= 16 {
            for &id in ids {
                self.check_id(id)?;
            }
            // Small batches, without allocating: a repeated id (rare) is counted in full.
            for (k, &id) in ids.iter().enumerate() {
                let times = if ids[..k].contains(&id) {
                    ids[..=k].iter().filter(|&&x| x == id).count()
                } else {
                    1
                };
                if underflow(id, times) {
                    return Err(Error::RefCountUnderflow { block_id: id });
                }
            }
            return Ok(());
        }
        // The common case (a sequence's table, each id once) in one O(len) pass: ids checked,
        // repeats looked for (see `next_stamp`), the first free block noted. Invalid ids are
        // reported before any underflow, as in the other paths.
        let stamp = self.next_stamp();
        let mut repeats = false;
        let mut first_free = None;
        for &id in ids {
            let i = self.check_id(id)?;
            if repeats {
                continue;
            }
            let slot = &self.seen[i];
            if slot.load(Ordering::Relaxed) == stamp {
                repeats = true;
                continue;
            }
            slot.store(stamp, Ordering::Relaxed);
            if first_free.is_none() && underflow(id, 1) {
                first_free = Some(id);
            }
        }
        if !repeats {
            return match first_free {
                Some(id) => Err(Error::RefCountUnderflow { block_id: id }),
                None => Ok(()),
            };
        }
        let mut sorted = ids.to_vec();
        sorted.sort_unstable();
        let mut start = 0;
        while start < sorted.len() {
            let id = sorted[start];
            let times = sorted[start..].iter().take_while(|&&x| x == id).count();
            if underflow(id, times) {
                return Err(Error::RefCountUnderflow { block_id: id });
            }
            start += times;
        }
        Ok(())
    }

    /// A stamp for the duplicate check of one long `free`: `validate_free` compares each id's
    /// `seen` slot with it, then sets the slot to it, so a repeat finds its own stamp. O(len),
    /// no allocation (this replaces a sort or a hash set).
    ///
    /// Exact for a call that no other thread's `free` overlaps on the same blocks. Otherwise
    /// the check may report a repeat wrongly (after 2^32 calls a stale stamp can match; the
    /// exact sort then decides) or miss one whose slot another thread freeing the same block
    /// overwrote; that thread holds references too, and the release loop's CAS still keeps
    /// every count from going below zero, as for any concurrent release.
    fn next_stamp(&self) -> u32 {
        self.stamps.fetch_add(1, Ordering::Relaxed).wrapping_add(1)
    }

    /// Decrements one ref count; queues the block when it reaches 0.
    fn release_one<'a>(
        &'a self,
        id: BlockId,
        guard: &mut Option<MutexGuard<'a, Locked>>,
    ) -> Result<Released> {
        let i = id as usize;
        let rc = &self.refs[i];
        let mut cur = rc.load(Ordering::Acquire);
        loop {
            if cur == 0 {
                // Only reachable when another thread released our references (see module docs).
                return Err(Error::RefCountUnderflow { block_id: id });
            }
            if cur == 1 && guard.is_none() && self.hashed[i].load(Ordering::Acquire) {
                // A hashed block's 1 -> 0 transition happens under the lock.
                *guard = Some(self.locked.lock());
                cur = rc.load(Ordering::Acquire);
                continue;
            }
            match rc.compare_exchange_weak(cur, cur - 1, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => break,
                Err(now) => cur = now,
            }
        }
        if cur != 1 {
            return Ok(Released::StillReferenced);
        }
        match guard.as_mut() {
            Some(locked) if locked.index.carries(id) => {
                locked.lru_push_back(id);
                Ok(Released::ToLru)
            }
            _ => Ok(Released::ToUncached),
        }
    }

    /// Whether block `id` carries a prefix hash (`false` for the null block and ids out of
    /// range). Wait-free: reads the flag mirrored from the locked hash table, for hot paths
    /// that only need to know, not the hash itself.
    pub fn is_hashed(&self, id: BlockId) -> bool {
        id != NULL_BLOCK
            && self
                .hashed
                .get(id as usize)
                .is_some_and(|h| h.load(Ordering::Acquire))
    }

    /// The hash `id` carries, if any (`None` for the null block and ids out of range).
    /// Locking (reads the hash table under the mutex). O(1).
    pub fn block_hash(&self, id: BlockId) -> Option<BlockHash> {
        if id == NULL_BLOCK || id >= self.num_blocks {
            return None;
        }
        self.locked.lock().index.hash_of(id)
    }

    /// Registers the full block `id` under `hash` in the prefix index. The block must be
    /// referenced (the caller holds a reference). If the block already carries a hash, nothing
    /// happens (its first hash stays). Returns `true` when `hash` became resolvable by this
    /// call (no other block carried it), `false` otherwise. Emits no event (the manager emits
    /// `BlockStored` with the token ids it knows, only for hashes that became resolvable).
    ///
    /// Errors (nothing changed): [`Error::InvalidBlockId`] for the null block or an id out of
    /// range; [`Error::InvalidArgument`] if the block's ref count is 0.
    ///
    /// Progress: locking (hash table and index). Expected O(1).
    pub fn cache_block(&self, id: BlockId, hash: BlockHash) -> Result<bool> {
        let i = self.check_id(id)?;
        let mut locked = self.locked.lock();
        if self.refs[i].load(Ordering::Acquire) == 0 {
            return Err(Error::InvalidArgument {
                arg: "id",
                value: id.to_string(),
                reason: format!(
                    "block {id} has ref count 0; only a referenced (filled) block can be cached"
                ),
            });
        }
        let Some(newly_resolvable) = locked.index.insert(id, hash) else {
            return Ok(false);
        };
        self.hashed[i].store(true, Ordering::Release);
        Ok(newly_resolvable)
    }

    /// [`BlockPool::cache_block`] for many blocks under one lock hold (a prefill caches every
    /// block it filled at once). `newly_resolvable` is cleared, then gets one flag per block:
    /// whether its hash became resolvable (`false` also for a block that already carried a
    /// hash, or an id repeated in `blocks`).
    ///
    /// Errors (nothing changed): [`Error::InvalidArgument`] if the two slices differ in length
    /// or a block's ref count is 0; [`Error::InvalidBlockId`] for the null block or an id out
    /// of range.
    ///
    /// Progress: locking (one lock hold). Expected O(len).
    pub fn cache_blocks(
        &self,
        blocks: &[BlockId],
        hashes: &[BlockHash],
        newly_resolvable: &mut Vec<bool>,
    ) -> Result<()> {
        if blocks.len() != hashes.len() {
            return Err(Error::InvalidArgument {
                arg: "hashes",
                value: format!("{} hashes", hashes.len()),
                reason: format!("expected one per block ({})", blocks.len()),
            });
        }
        newly_resolvable.clear();
        let mut locked = self.locked.lock();
        for &id in blocks {
            let i = self.check_id(id)?;
            if self.refs[i].load(Ordering::Acquire) == 0 {
                return Err(Error::InvalidArgument {
                    arg: "id",
                    value: id.to_string(),
                    reason: format!(
                        "block {id} has ref count 0; only a referenced (filled) block can be cached"
                    ),
                });
            }
        }
        for (k, (&id, &hash)) in blocks.iter().zip(hashes).enumerate() {
            if let Some(next) = hashes.get(k + 1) {
                // The next hash's home slot loads while this one is inserted.
                locked.index.prefetch_insert(next);
            }
            let first = match locked.index.insert(id, hash) {
                None => false, // already carries a hash (its first stays)
                Some(first) => {
                    self.hashed[id as usize].store(true, Ordering::Release);
                    first
                }
            };
            newly_resolvable.push(first);
        }
        Ok(())
    }

    /// Drops the hash and prefix-index entry of each of `ids` that carries one (vLLM's
    /// `BlockPool.evict_blocks`: KV found invalid): a referenced block stays referenced, a
    /// cached free block becomes an uncached free block (at the top of the stack, reused
    /// first). Ids without a hash, or repeated, are skipped. Emits [`KvEvent::BlockRemoved`]
    /// for the hashes no block carries any more. Returns the blocks that lost their hash, in
    /// `ids` order. Not counted as evictions.
    ///
    /// Errors (nothing changed): [`Error::InvalidBlockId`] for the null block or an id out of
    /// range.
    ///
    /// Progress: locking (one lock hold). O(len).
    pub fn uncache(&self, ids: &[BlockId]) -> Result<Vec<BlockId>> {
        for &id in ids {
            self.check_id(id)?;
        }
        let mut locked = self.locked.lock();
        let mut unresolvable = Vec::new();
        let mut dropped = Vec::new();
        for &id in ids {
            if !locked.index.carries(id) {
                continue;
            }
            let free = locked.in_lru[id as usize];
            if free {
                locked.lru_remove(id);
            }
            self.evict_locked(&mut locked, id, &mut unresolvable, None);
            if free {
                self.uncached.push(id);
            }
            dropped.push(id);
        }
        self.cached_free.store(locked.lru_len, Ordering::Release);
        if !unresolvable.is_empty() {
            self.events.push(KvEvent::BlockRemoved {
                block_hashes: unresolvable,
                tier: Tier::Device,
            });
        }
        Ok(dropped)
    }

    /// Every block carrying a hash, with its hash, in block-id order. Locking. O(num_blocks).
    pub fn cached_blocks(&self) -> Vec<(BlockId, BlockHash)> {
        let locked = self.locked.lock();
        locked.index.iter().map(|(h, b)| (b, h)).collect()
    }

    /// Number of blocks carrying a hash (referenced or free). Locking. O(1).
    pub fn num_hashed(&self) -> usize {
        self.locked.lock().index.len()
    }

    /// The longest prefix of `hashes` that resolves, as one block per hash (each chosen as
    /// [`BlockPool::lookup`] does), under one lock hold: a prefix-cache lookup of a whole
    /// prompt. No side effects. Expected O(hits + 1).
    pub fn lookup_chain(&self, hashes: &[BlockHash]) -> Vec<BlockId> {
        let locked = self.locked.lock();
        let mut hits = Vec::with_capacity(hashes.len());
        let in_use = |id: BlockId| self.refs[id as usize].load(Ordering::Acquire) > 0;
        for hash in hashes {
            let Some(hit) = locked.index.find(hash, in_use) else {
                break;
            };
            hits.push(hit);
        }
        hits
    }

    /// Every block carrying `hash`, oldest first: the order in which [`BlockPool::lookup`]
    /// looks for one in use. For a simulation that replays lookups under ref counts of its own
    /// (`KvCacheManager::num_blocks_owed`). No side effects. Locking. Expected O(1).
    pub fn holders(&self, hash: &BlockHash) -> Vec<BlockId> {
        let locked = self.locked.lock();
        locked.index.holders(hash).collect()
    }

    /// A block carrying `hash`, preferring one that is in use (ref > 0) so a hit does not take
    /// free capacity when it need not; `None` if no block carries it. No side effects.
    /// Locking. Expected O(1) (the candidates for one hash are almost always a single block).
    pub fn lookup(&self, hash: &BlockHash) -> Option<BlockId> {
        let locked = self.locked.lock();
        locked.index.find(hash, |id| {
            self.refs[id as usize].load(Ordering::Acquire) > 0
        })
    }

    /// Drops every hash and the whole prefix index; every cached free block becomes an
    /// uncached free block, queued after the blocks that were already uncached (in LRU order).
    /// Emits [`KvEvent::AllBlocksCleared`].
    ///
    /// Errors: [`Error::CacheInUse`] `{ blocks_in_use }` while any block is in use (ref > 0 or
    /// reserved by a concurrent allocation); nothing is changed then.
    ///
    /// Progress: locking (one lock hold; concurrent allocations wait on the lock meanwhile).
    /// O(num_blocks).
    pub fn reset_prefix_cache(&self) -> Result<()> {
        let mut locked = self.locked.lock();
        let in_use = self.num_used();
        if in_use > 0 {
            return Err(Error::CacheInUse {
                blocks_in_use: in_use,
            });
        }
        // Rebuild the stack as [old uncached order, then old LRU order] so the logical free
        // queue keeps its order. Blocks popped here stay counted in `free`; an allocator that
        // reserved one meanwhile waits on the lock and then finds it in the stack.
        let mut order = Vec::new();
        while let Some(id) = self.uncached.pop() {
            order.push(id);
        }
        while let Some(id) = locked.lru_pop_front() {
            order.push(id);
        }
        for id in 1..self.num_blocks {
            self.hashed[id as usize].store(false, Ordering::Release);
        }
        locked.index.clear();
        for &id in order.iter().rev() {
            self.uncached.push(id);
        }
        self.cached_free.store(0, Ordering::Release);
        self.events.push(KvEvent::AllBlocksCleared);
        Ok(())
    }

    /// The logical free queue, front → back: uncached blocks in LIFO order, then cached blocks
    /// from the LRU front (next to evict) to the back (most recently freed). For tests and
    /// invariant checks: exact only while no other thread frees or allocates. Locking. O(free).
    pub fn free_queue(&self) -> Vec<BlockId> {
        let locked = self.locked.lock();
        let mut out = self.uncached.snapshot();
        out.extend(locked.lru_order());
        out
    }

    /// Checks invariants 1–3 of docs/design.md (call while no other thread uses the pool):
    /// 1. free + Σ(ref > 0) + 1 == num_blocks, the free queue holds no duplicates, and the
    ///    free / cached-free counters match the lists;
    /// 2. a block is in the free queue ⇔ its ref count is 0 and it is not the null block; the
    ///    null block has ref 0; uncached-list blocks carry no hash, LRU blocks carry one;
    /// 3. a block has a hash ⇔ the prefix index maps that hash to it; no empty index entry;
    ///    the null block has no hash.
    ///
    /// Returns a message naming the first violation. Locking. O(num_blocks).
    pub fn check_invariants(&self) -> std::result::Result<(), String> {
        let locked = self.locked.lock();
        let n = self.num_blocks as usize;
        let stack = self.uncached.snapshot();
        let lru = locked.lru_order();
        let mut seen = vec![false; n];
        for &id in stack.iter().chain(lru.iter()) {
            let i = id as usize;
            if id == NULL_BLOCK || i >= n {
                return Err(format!("free queue holds invalid block {id}"));
            }
            if seen[i] {
                return Err(format!("block {id} appears twice in the free queue"));
            }
            seen[i] = true;
        }
        if lru.len() != locked.lru_len {
            return Err(format!(
                "LRU walk found {} blocks, lru_len says {}",
                lru.len(),
                locked.lru_len
            ));
        }
        let queued = stack.len() + lru.len();
        let free = self.num_free();
        if free != queued {
            return Err(format!(
                "free counter {free} != {queued} blocks in the free queue"
            ));
        }
        if self.num_cached_free() != lru.len() {
            return Err(format!(
                "cached-free counter {} != LRU length {}",
                self.num_cached_free(),
                lru.len()
            ));
        }
        if self.refs[0].load(Ordering::Acquire) != 0
            || locked.index.hash_of(NULL_BLOCK).is_some()
            || locked.in_lru[0]
        {
            return Err("null block has a ref count, a hash or an LRU slot".to_string());
        }
        let mut used = 0;
        for id in 1..self.num_blocks {
            let i = id as usize;
            let rc = self.refs[i].load(Ordering::Acquire);
            used += usize::from(rc > 0);
            if (rc == 0) != seen[i] {
                return Err(format!(
                    "block {id} has ref {rc} but in-free-queue = {}",
                    seen[i]
                ));
            }
            let hash = locked.index.hash_of(id);
            if hash.is_some() != self.hashed[i].load(Ordering::Acquire) {
                return Err(format!("block {id}: hashed flag disagrees with its hash"));
            }
            if locked.in_lru[i] != (rc == 0 && hash.is_some()) {
                return Err(format!(
                    "block {id}: in LRU = {} but ref {rc}, hash {}",
                    locked.in_lru[i],
                    hash.is_some()
                ));
            }
        }
        if free + used + 1 != n {
            return Err(format!("free {free} + used {used} + 1 != num_blocks {n}"));
        }
        // Invariant 3: each block's hash is in the hash → blocks table, and nothing else is.
        locked.index.check()
    }

    /// Cumulative counters (evictions, allocations, frees, prefix touches), in blocks.
    /// Wait-free (four relaxed loads; not a consistent snapshot under concurrency).
    pub fn counters(&self) -> PoolCounters {
        PoolCounters {
            evictions: self.evictions.load(Ordering::Relaxed),
            allocations: self.allocations.load(Ordering::Relaxed),
            frees: self.frees.load(Ordering::Relaxed),
            prefix_touches: self.prefix_touches.load(Ordering::Relaxed),
        }
    }
}
