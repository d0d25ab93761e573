//! The coordinator of the KV cache manager: what an allocation would do, decided before
//! anything changes. The longest prefix every group serves ([`KvCacheManager::find_hits`]),
//! the per-group plan of an allocation with its lookahead slots for drafts (take, release,
//! copy-on-write, window releases), and the demand simulation ([`Sim`]) that lets
//! [`KvCacheManager::num_blocks_owed`] plan a whole batch against the pool as the earlier
//! members will leave it. Nothing here mutates the manager's state or the pool.

use super::*;

/// Per-group plan of one allocation.
#[derive(Debug, Clone, Default)]
pub(super) struct GroupPlan {
    /// First allocation: the table prefix from the cache (nulls before the window).
    pub(super) hits: Vec<BlockId>,
    /// Logical indexes released out of the window.
    pub(super) release: Vec<usize>,
    pub(super) fresh: usize,
    pub(super) cow: bool,
    /// The new `live_from`.
    pub(super) live_from: usize,
    /// First allocation with external tokens: null entries after the hits, before the fresh
    /// blocks (a windowed group's blocks out of the window of the loaded context).
    pub(super) null_pad: usize,
    /// State group, later allocation that moves the live index: the logical index of the old
    /// live block, the copy source (kept in the table when its aligned state awaits its
    /// commit, else in `release`).
    pub(super) state_src: Option<usize>,
}

#[derive(Debug, Clone)]
pub(super) struct Plan {
    pub(super) first: bool,
    pub(super) context: usize,
    pub(super) q: usize,
    /// External tokens (loaded by a KV connector, no forward pass) among the `q` scheduled,
    /// right after the context; 0 for an ordinary allocation.
    pub(super) external: usize,
    /// Per group; inline for one group (no heap hop on its decode step).
    pub(super) groups: SmallVec<[GroupPlan; 1]>,
    pub(super) hits_free: usize,
    /// Blocks taken from and given back to the free pool, in all and per group.
    pub(super) take: usize,
    pub(super) release: usize,
    pub(super) per_group: SmallVec<[(usize, usize); 1]>,
}

impl Plan {
    pub(super) fn demand(&self) -> BlockDemand {
        BlockDemand {
            take: self.take,
            release: self.release,
            per_group: self.per_group.to_vec(),
        }
    }
}

pub(super) type FixedMap<K, V> = HashMap<K, V, foldhash::fast::FixedState>;

pub(super) type FixedSet<K> = HashSet<K, foldhash::fast::FixedState>;

/// The pool as an allocation will find it: the real pool plus the effects of earlier
/// (simulated) allocations. Empty for a single call, so a plan and the call agree exactly.
pub(super) struct Sim<'a> {
    pub(super) pool: &'a BlockPool,
    // Fixed-seed maps: a sim is built per allocation, and seeding each map (std's RandomState,
    // foldhash's per-map seed) cost a tenth of a one-group decode step.
    pub(super) refs: FixedMap<BlockId, u32>,
    /// Per key, the holders earlier members registered, in order ([`VIRTUAL`] for a block
    /// they take in the simulation); newer than every holder in the pool, and in use.
    pub(super) registered: FixedMap<BlockHash, Vec<BlockId>>,
    pub(super) evicted: FixedSet<BlockId>,
    pub(super) hashed: FixedSet<BlockId>,
    pub(super) uncached: usize,
    /// The LRU of cached free blocks, read from the pool on the first simulated eviction.
    pub(super) lru: Option<VecDeque<BlockId>>,
    /// Blocks that entered (`true`) or left the LRU before it was read.
    pub(super) lru_moves: Vec<(BlockId, bool)>,
    /// The earlier members' evictions may have stored blocks over host entries (more
    /// evictions than free host blocks): host hits are not counted on for later members.
    pub(super) host_unsure: bool,
}

impl<'a> Sim<'a> {
    pub(super) fn new(pool: &'a BlockPool) -> Self {
        Self {
            pool,
            refs: FixedMap::default(),
            registered: FixedMap::default(),
            evicted: FixedSet::default(),
            hashed: FixedSet::default(),
            uncached: pool.num_free() - pool.num_cached_free(),
            lru: None,
            lru_moves: Vec::new(),
            host_unsure: false,
        }
    }

    /// Whether nothing was simulated yet (the sim is the real pool).
    pub(super) fn is_empty(&self) -> bool {
        self.refs.is_empty() && self.registered.is_empty() && self.evicted.is_empty()
    }

    pub(super) fn refc(&self, b: BlockId) -> u32 {
        if b == VIRTUAL {
            return 1;
        }
        if self.refs.is_empty() {
            return self.pool.ref_count(b); // a single call's plan: no hashing
        }
        self.refs
            .get(&b)
            .copied()
            .unwrap_or_else(|| self.pool.ref_count(b))
    }

    /// The block a lookup of `key` finds, picked as the pool's index picks it under the
    /// simulated ref counts: the oldest holder in use, else the oldest holder. Holders the
    /// simulation registered come after the pool's own (less the evicted ones).
    pub(super) fn lookup(&self, key: &BlockHash) -> Option<BlockId> {
        if self.is_empty() {
            return self.pool.lookup(key);
        }
        let mut pooled = self.pool.holders(key);
        pooled.retain(|b| !self.evicted.contains(b));
        let added = self.registered.get(key).map_or(&[][..], Vec::as_slice);
        pooled
            .iter()
            .chain(added)
            .copied()
            .find(|&b| self.refc(b) > 0)
            .or_else(|| pooled.first().copied())
    }

    pub(super) fn is_hashed(&self, b: BlockId) -> bool {
        !self.evicted.contains(&b) && (self.pool.is_hashed(b) || self.hashed.contains(&b))
    }

    pub(super) fn lru_push(&mut self, b: BlockId) {
        match self.lru.as_mut() {
            Some(l) => l.push_back(b),
            None => self.lru_moves.push((b, true)),
        }
    }

    pub(super) fn lru_take(&mut self, b: BlockId) {
        match self.lru.as_mut() {
            Some(l) => l.retain(|&x| x != b),
            None => self.lru_moves.push((b, false)),
        }
    }

    /// Simulates one allocation's effects on the pool (releases, touches, `n` fresh blocks).
    pub(super) fn apply(
        &mut self,
        released: &[BlockId],
        touched: &[BlockId],
        n: usize,
        cow_src: &[BlockId],
    ) {
        for &b in released {
            let r = self.refc(b) - 1;
            self.refs.insert(b, r);
            if r == 0 {
                if self.is_hashed(b) {
                    self.lru_push(b);
                } else {
                    self.uncached += 1;
                }
            }
        }
        for &b in touched {
            let r = self.refc(b);
            if r == 0 {
                self.lru_take(b);
            }
            self.refs.insert(b, r + 1);
        }
        for &b in cow_src {
            let r = self.refc(b) - 1;
            self.refs.insert(b, r);
        }
        let from_uncached = n.min(self.uncached);
        self.uncached -= from_uncached;
        let mut rest = n - from_uncached;
        if rest == 0 {
            return;
        }
        if self.lru.is_none() {
            let fq = self.pool.free_queue();
            let mut l: VecDeque<BlockId> = fq[fq.len() - self.pool.num_cached_free()..]
                .iter()
                .copied()
                .collect();
            for (b, enter) in std::mem::take(&mut self.lru_moves) {
                if enter {
                    l.push_back(b);
                } else {
                    l.retain(|&x| x != b);
                }
            }
            self.lru = Some(l);
        }
        let l = self.lru.as_mut().expect("read");
        while rest > 0 {
            let Some(b) = l.pop_front() else { break };
            self.evicted.insert(b);
            self.refs.insert(b, 1);
            rest -= 1;
        }
    }
}

impl KvCacheManager {
    /// The longest prefix every group serves (tokens) and each group's table prefix for it.
    pub(super) fn find_hits(&self, s: &mut Seq, sim: &Sim<'_>) -> (usize, Vec<Vec<BlockId>>) {
        let ng = self.num_groups();
        let unit = self.unit;
        let cap = if s.hit_limit == usize::MAX {
            s.tokens.len() - 1
        } else {
            s.hit_limit.min(s.tokens.len())
        };
        // With hash lookahead a hit at p needs the keys of its blocks: p + k known tokens.
        let cap = cap.min(self.hashable_len(s));
        let mut l = cap / unit * unit;
        if !self.cfg.enable_prefix_caching || l == 0 {
            return (0, vec![Vec::new(); ng]);
        }
        // With a host tier a block is served from either tier (`HOST_HIT` in the table).
        let host_guard = self.host.as_ref().map(|h| h.lock());
        let host = host_guard.as_deref();
        // Full attention: the chain from the left.
        for g in 0..ng {
            let spec = self.cfg.groups[g];
            if spec.is_windowed() || !spec.prefix_cacheable {
                continue;
            }
            let bs = spec.block_size as usize;
            let n = if sim.is_empty() && l / bs > 0 {
                // The real pool: the chain in runs of doubling length, one lock hold each,
                // hashing only as far as the hits go. The blocks past the first miss are
                // hashed when they fill, so an admission the pool refuses (the head of a
                // full pool's queue, retried every step) hashes only its hit prefix.
                let (mut n, mut run) = (0, 32);
                while n < l / bs {
                    let end = (n + run).min(l / bs);
                    let keys: Vec<BlockHash> = (n..end).map(|j| self.key_at(s, g, j)).collect();
                    let hit = self.pool.lookup_chain(&keys).len();
                    n += hit;
                    if n < end {
                        break;
                    }
                    run *= 2;
                }
                n
            } else {
                let mut n = 0;
                while n < l / bs {
                    let key = self.key_at(s, g, n);
                    if sim.lookup(&key).is_none() {
                        break;
                    }
                    n += 1;
                }
                n
            };
            let n = match host {
                Some(_) => self.served_from(host, s, g, n, l / bs, sim),
                None => n,
            };
            l = l.min(n * bs / unit * unit);
        }
        // Windowed groups: shrink until every group agrees.
        loop {
            let mut changed = false;
            for g in 0..ng {
                let spec = self.cfg.groups[g];
                if !spec.is_windowed() || !spec.prefix_cacheable {
                    continue;
                }
                if spec.is_state() && s.state_from_load {
                    continue; // the state comes with the load
                }
                let p = self.window_hit(s, g, l, sim, host);
                if p < l {
                    l = p;
                    changed = true;
                }
            }
            if !changed || l == 0 {
                break;
            }
        }
        let mut hits = Vec::with_capacity(ng);
        for g in 0..ng {
            let spec = self.cfg.groups[g];
            if !spec.prefix_cacheable || (spec.is_state() && s.state_from_load) {
                // Fresh blocks for the hit's window, taken by the allocation (`plan`); a state
                // the load brings takes no hit block.
                hits.push(Vec::new());
                continue;
            }
            let (lo, hi) = spec.hit_blocks(l);
            let mut t = vec![NULL_BLOCK; lo];
            for j in lo..hi {
                let key = self.key_at(s, g, j);
                let b = sim.lookup(&key).unwrap_or(HOST_HIT);
                debug_assert!(
                    b != HOST_HIT || self.on_host(host, s, g, j, sim),
                    "checked present"
                );
                t.push(b);
            }
            hits.push(t);
        }
        (l, hits)
    }

    /// [`KvCacheManager::lookup_prefix_group`]: group `g` alone, at most `min(limit, num_tokens)`
    /// tokens, a multiple of the hit unit.
    pub(super) fn group_hit(&self, s: &mut Seq, g: usize, limit: usize) -> usize {
        let unit = self.unit;
        let l = limit.min(self.hashable_len(s)) / unit * unit;
        if !self.cfg.enable_prefix_caching || l == 0 {
            return 0;
        }
        let sim = Sim::new(&self.pool);
        let host_guard = self.host.as_ref().map(|h| h.lock());
        let host = host_guard.as_deref();
        let spec = self.cfg.groups[g];
        if !spec.prefix_cacheable {
            return 0;
        }
        if spec.is_windowed() {
            return self.window_hit(s, g, l, &sim, host);
        }
        let bs = spec.block_size as usize;
        let mut n = 0;
        while n < l / bs {
            let key = self.key_at(s, g, n);
            if sim.lookup(&key).is_none() {
                break;
            }
            n += 1;
        }
        let n = match host {
            Some(_) => self.served_from(host, s, g, n, l / bs, &sim),
            None => n,
        };
        n * bs / unit * unit
    }

    /// The largest hit-unit multiple `p <= l` at which windowed group `g` has every block of
    /// `[first_read(p), p)` cached (on the device, or with a host tier on either tier). Scans
    /// right to left; a miss at block `j` moves the candidate to the boundary at or below
    /// `j`'s start.
    pub(super) fn window_hit(
        &self,
        s: &mut Seq,
        g: usize,
        l: usize,
        sim: &Sim<'_>,
        host: Option<&HostSide>,
    ) -> usize {
        let spec = self.cfg.groups[g];
        let bs = spec.block_size as usize;
        let mut p = l;
        'outer: while p > 0 {
            let (lo, hi) = spec.hit_blocks(p);
            for j in (lo..hi).rev() {
                let key = self.key_at(s, g, j);
                // A state group's hits are served from the device only (a state is copied out
                // of its hit block by the same call, never loaded from the host tier).
                if sim.lookup(&key).is_none()
                    && (spec.is_state() || !self.on_host(host, s, g, j, sim))
                {
                    p = j * bs / self.unit * self.unit;
                    continue 'outer;
                }
            }
            return p;
        }
        0
    }

    pub(super) fn plan(
        &self,
        seq: SeqId,
        s: &mut Seq,
        num_new_tokens: usize,
        sim: &Sim<'_>,
    ) -> Result<Plan> {
        self.plan_with_drafts(seq, s, num_new_tokens, 0, sim)
    }

    /// The plan of an allocation of `num_new_tokens` plus `num_drafts` lookahead slots.
    /// Windowed groups release by the committed context only: the lookahead positions never
    /// move a window (the verify query's first row still reads from `first_read(context)`).
    #[inline(always)] // built in place in the caller's frame: a decode step moves no plan
    pub(super) fn plan_with_drafts(
        &self,
        seq: SeqId,
        s: &mut Seq,
        num_new_tokens: usize,
        num_drafts: usize,
        sim: &Sim<'_>,
    ) -> Result<Plan> {
        self.plan_external(seq, s, num_new_tokens, num_drafts, 0, 0, sim)
    }

    /// [`Self::plan_with_drafts`] whose first `external` scheduled tokens are loaded by a KV
    /// connector right after the prefix hit (a first allocation only, checked by the caller):
    /// a windowed group takes no block out of the window of `hit + external` (null entries
    /// there, as if the loaded context had been computed and released). `lookahead`: slots
    /// past the scheduled tokens and drafts whose tokens do not exist yet (spare blocks after
    /// the call; [`KvCacheManager::allocate_slots_with_lookahead`]).
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    pub(super) fn plan_external(
        &self,
        seq: SeqId,
        s: &mut Seq,
        num_new_tokens: usize,
        num_drafts: usize,
        external: usize,
        lookahead: usize,
        sim: &Sim<'_>,
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
        // A first allocation of no token adopts its prefix hit only (a scheduler replaying the
        // hit's last tokens for a group out of the prefix cache); refused below without a hit.
        let adopt_only = num_new_tokens == 0
            && num_drafts == 0
            && external == 0
            && !self.has_state
            && s.is_first();
        if num_new_tokens == 0 && !lookahead_only && !adopt_only {
            return Err(Error::InvalidArgument {
                arg: "num_new_tokens",
                value: "0".into(),
                reason: "must schedule at least one token".into(),
            });
        }
        if !s.drafts.is_empty() {
            return Err(drafts_pending(seq, "allocate_slots"));
        }
        // Draft slots of a state group are placeholder slots (tokens whose ids are not known
        // yet, written by the step in place): the state after them is kept, so they are never
        // rejected (`accept_drafts` keeping blocks); spare lookahead slots have no state.
        if self.has_state && lookahead > 0 && self.spec_blocks() == 0 {
            return Err(Error::InvalidArgument {
                arg: "num_lookahead",
                value: format!("{lookahead} token(s)"),
                reason: "lookahead slots (speculative decoding) are not supported with state \
                         groups without speculative state blocks (a state group's spare_blocks): a \
                         rejected draft cannot be rolled out of a recurrent state"
                    .into(),
            });
        }
        let k = self.spec_blocks();
        if k > 0 && external > 0 {
            return Err(Error::InvalidArgument {
                arg: "num_external_tokens",
                value: format!("{external} token(s)"),
                reason: format!(
                    "external loads are not supported with speculative state blocks \
                     (state groups' spare_blocks = {k}): a loaded state's spare blocks are not laid out"
                ),
            });
        }
        if k > 0 && num_drafts > k {
            return Err(Error::InvalidArgument {
                arg: "draft_tokens",
                value: format!("{num_drafts} token(s)"),
                reason: format!(
                    "a verify step writes one state per draft into the {k} speculative state \
                     block(s) (state groups' spare_blocks): at most {k} drafts"
                ),
            });
        }
        let first = s.is_first();
        let (context, hits): (usize, SmallVec<[Vec<BlockId>; 1]>) = if first {
            let (context, hits) = self.find_hits(s, sim);
            (context, SmallVec::from_vec(hits))
        } else {
            (s.num_computed, filled(self.num_groups()))
        };
        if adopt_only && (context == 0 || lookahead > 0) {
            return Err(Error::InvalidArgument {
                arg: "num_new_tokens",
                value: "0".into(),
                reason: "must schedule at least one token (a first allocation of none adopts a \
                         prefix hit, and the sequence has none)"
                    .into(),
            });
        }
        let remaining = s.tokens.len() - context;
        if external > remaining {
            return Err(Error::InvalidArgument {
                arg: "num_external_tokens",
                value: external.to_string(),
                reason: format!(
                    "sequence {seq} has {remaining} token(s) after its prefix hit of {context}"
                ),
            });
        }
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
        // Slots up to here: the scheduled tokens, then the lookahead slots of the drafts.
        let end = context + q + num_drafts + lookahead;
        let (mut take_all, mut release_all) = (0, 0);
        let mut per_group = SmallVec::new();
        let mut hit_free = FixedSet::default();
        let mut groups = SmallVec::new();
        for (g, hits) in hits.into_iter().enumerate() {
            let spec = self.cfg.groups[g];
            let bs = spec.block_size as usize;
            let t = &s.tables[g];
            let mut gp = GroupPlan::default();
            let (mut take, mut release) = (0, 0);
            if spec.is_state() {
                // The live state moves to block (end - 1) / bs; nothing else is taken. Slots
                // a settled placeholder ran past the computed tokens hold the state already:
                // it moves from there, and not back.
                let prev = s.state_end();
                let k = self.spec_blocks();
                // With speculative blocks lookahead slots (a drafter's own tokens, EAGLE /
                // MTP: no state layers) take no state block, as in vLLM's align mode.
                let end = if k > 0 { end - lookahead } else { end };
                let live = (end.max(prev) - 1) / bs;
                if k > 0 {
                    // Speculative blocks: `1 + k` for a first allocation, one per move; a
                    // column below the live one is held until the computed tokens pass its
                    // end (the runner copies an accepted aligned state there after the
                    // step), then released unless its state awaits its commit.
                    if first {
                        // The hit's state block, when free, counts as taken (as vLLM counts an
                        // evictable hit block), though it is only the copy source.
                        if let Some(&b) = hits.last() {
                            if b != NULL_BLOCK && sim.refc(b) == 0 && hit_free.insert(b) {
                                take += 1;
                            }
                        }
                        gp.null_pad = live - hits.len();
                        gp.fresh = 1 + k;
                        gp.hits = hits;
                    } else {
                        let floor = (context.max(1) - 1) / bs;
                        for j in 0..floor.min(t.blocks.len()) {
                            let b = t.blocks[j];
                            if b != NULL_BLOCK && !self.state_pending(s, g, j, prev) {
                                gp.release.push(j);
                                if sim.refc(b) == 1 {
                                    release += 1;
                                }
                            }
                        }
                        if (prev - 1) / bs != live {
                            gp.fresh = 1;
                        }
                    }
                    take += gp.fresh;
                    take_all += take;
                    release_all += release;
                    per_group.push((take, release));
                    groups.push(gp);
                    continue;
                }
                if first {
                    // The hit block is not taken: it is only the copy source of the fresh live
                    // block (copies run before any write of the step, so an eviction of it by
                    // this very call is harmless).
                    gp.null_pad = live - hits.len();
                    gp.fresh = 1;
                    gp.hits = hits;
                } else {
                    let old = (prev - 1) / bs;
                    if old != live {
                        gp.fresh = 1;
                        gp.state_src = Some(old);
                        if !self.state_pending(s, g, old, prev) {
                            gp.release.push(old);
                            if sim.refc(t.blocks[old]) == 1 {
                                release += 1;
                            }
                        }
                    }
                }
                take += gp.fresh;
                take_all += take;
                release_all += release;
                per_group.push((take, release));
                groups.push(gp);
                continue;
            }
            // Spare blocks past the slots (a group out of the prefix cache: vLLM's
            // speculative Mamba blocks outside its align mode).
            let spare = spec.spare_blocks as usize;
            if first {
                let mut hits = hits;
                // External tokens: nothing below the window of the loaded context is taken.
                // A group out of the prefix cache has no hit blocks: fresh ones from the
                // window of the hit (and loaded context) on.
                let keep = if (external > 0 || !spec.prefix_cacheable) && spec.is_windowed() {
                    self.keep_from(&spec, context + external) / bs
                } else {
                    0
                };
                for b in hits.iter_mut().take(keep) {
                    *b = NULL_BLOCK;
                }
                for &b in &hits {
                    if b == HOST_HIT {
                        take += 1; // loaded into a fresh block
                    } else if b != NULL_BLOCK
                        && b != VIRTUAL
                        && sim.refc(b) == 0
                        && hit_free.insert(b)
                    {
                        take += 1;
                    }
                }
                gp.live_from = spec.hit_blocks(context).0.max(keep);
                gp.null_pad = keep.saturating_sub(hits.len());
                gp.fresh = end.div_ceil(bs) + spare - hits.len() - gp.null_pad;
                gp.hits = hits;
            } else {
                let keep = self.keep_from(&spec, context) / bs;
                gp.live_from = t.live_from.max(keep);
                for j in t.live_from..keep.min(t.blocks.len()) {
                    let b = t.blocks[j];
                    if b != NULL_BLOCK {
                        gp.release.push(j);
                        if sim.refc(b) == 1 {
                            release += 1;
                        }
                    }
                }
                // Spare lookahead blocks (kept after an acceptance) are filled before fresh ones.
                gp.fresh = (end.div_ceil(bs) + spare).saturating_sub(t.blocks.len());
                // The block the next token goes into (spares may follow it).
                // (Not a block a rollback kept: its KV is rewritten in place.)
                gp.cow = context % bs != 0
                    && context >= s.rewrite_to
                    && t.blocks.get(context / bs).is_some_and(|&b| sim.refc(b) > 1);
            }
            take += gp.fresh + usize::from(gp.cow);
            take_all += take;
            release_all += release;
            per_group.push((take, release));
            groups.push(gp);
        }
        Ok(Plan {
            first,
            context,
            q,
            external,
            groups,
            hits_free: hit_free.len(),
            take: take_all,
            release: release_all,
            per_group,
        })
    }
}
