//! KV loaded from outside the manager (a KV connector: a prefill node's KV pulled by a decode
//! node, a store or offload tier): slots for external tokens after the local prefix hit,
//! loaded synchronously (registered at allocation, as if computed) or asynchronously into
//! *staged* blocks that nothing outside the sequence sees (no prefix match, no index entry,
//! no `BlockStored`, no host-tier store) until [`KvCacheManager::commit_external`] registers
//! the valid part.

use super::*;

impl KvCacheManager {
    /// First allocation of `seq` with `num_external_tokens` (`E`) tokens loaded by a KV
    /// connector right after its local prefix hit `H` (taken as [`Self::allocate_slots`]
    /// takes it), then `num_new_tokens` (`n`) to compute: every group gets blocks for `H + E +
    /// n` tokens (a windowed group none below the window of `H + E`: null entries, as if the
    /// loaded context had been computed), and the result reports `num_cached_tokens = H`,
    /// `num_context_tokens = H + E`, `num_scheduled_tokens = n` (the forward pass computes
    /// positions `H + E ..`). `n` is capped at the tokens left after `H + E`.
    ///
    /// `staged == false` (a synchronous load, finished before the forward pass): the loaded
    /// blocks are registered now, exactly as `allocate_slots(seq, E + n)` would.
    /// `staged == true` (an asynchronous load; `n` must be 0): the sequence becomes
    /// [`SeqStatus::Loading`] with its blocks from `H` on *staged*: held, never matched by a
    /// prefix lookup, registered, announced or offered to the host tier, until
    /// [`Self::commit_external`]; until then it refuses allocation, steps, fork, swap-out and
    /// appends ([`Error::InvalidSequenceState`]); [`Self::free`] and
    /// [`Self::preempt_recompute`] release its staged blocks unregistered.
    /// `reserve_blocks`: blocks that must stay free after the call (the reservations of other
    /// in-flight loads), as [`StepOptions::reserve_blocks`].
    ///
    /// State groups: the live block is at column `(H + E + n - 1) / block_size` (null entries
    /// before it; a prefix hit's state is its copy source, as for [`Self::allocate_slots`]);
    /// the connector writes the loaded state there. A staged live block is never matched or
    /// published while loading; [`Self::commit_external`] publishes it (when `H + E` is
    /// block-aligned) once the load completed in full. A synchronous load's states are
    /// published by the step's commit ([`Self::commit_computed`]), as any allocation's.
    ///
    /// Errors (state unchanged): [`Error::UnknownSequence`]; [`Error::InvalidSequenceState`]
    /// unless the sequence holds no block (new, or preempted by recompute);
    /// [`Error::InvalidArgument`] (`num_external_tokens` past the last token, a positive
    /// `num_new_tokens` with `staged`, nothing to allocate); [`Error::OutOfBlocks`]
    /// `{requested: take + reserve_blocks, available: free + release}`.
    pub fn allocate_external(
        &self,
        seq: SeqId,
        num_external_tokens: usize,
        num_new_tokens: usize,
        staged: bool,
        reserve_blocks: usize,
    ) -> Result<SlotAllocation> {
        let mut guard = self.state.lock();
        let st = &mut *guard;
        let s = st.seqs.get_mut(&seq).ok_or_else(|| unknown(seq))?;
        check_external(seq, s, num_new_tokens, staged)?;
        let mut ev = Vec::new();
        let mut out = Alloc::default();
        out.reset(self.num_groups());
        self.allocate_general(
            seq,
            s,
            num_external_tokens + num_new_tokens,
            &[],
            reserve_blocks,
            num_external_tokens,
            staged,
            0,
            &mut ev,
            &mut out,
        )?;
        self.absorb(st, ev);
        Ok(out.into())
    }

    /// Exactly what [`Self::allocate_external`]`(seq, num_external_tokens, num_new_tokens,
    /// ..)` takes from and gives back to the free pool (staged or not: the same blocks).
    /// Errors as that call except `OutOfBlocks`. No side effects.
    pub fn num_blocks_needed_external(
        &self,
        seq: SeqId,
        num_external_tokens: usize,
        num_new_tokens: usize,
    ) -> Result<BlockDemand> {
        let mut st = self.state.lock();
        let s = st.seqs.get_mut(&seq).ok_or_else(|| unknown(seq))?;
        check_external(seq, s, num_new_tokens, false)?;
        let sim = Sim::new(&self.pool);
        Ok(self
            .plan_external(
                seq,
                s,
                num_external_tokens + num_new_tokens,
                0,
                num_external_tokens,
                0,
                &sim,
            )?
            .demand())
    }

    /// Ends the asynchronous load of a [`SeqStatus::Loading`] sequence (vLLM's `cache_blocks`
    /// after `finished_recving`): its KV is valid up to `num_valid_tokens` (`H <=
    /// num_valid_tokens <= H + E`; less than `H + E` after a partial failure), it becomes
    /// running with that many computed tokens, and the full blocks below it are registered
    /// now (index entries, `BlockStored` events, host-tier notes), as if computed. Blocks past
    /// `ceil(num_valid_tokens / block_size)` stay in its tables as spare blocks (private,
    /// unregistered) the next allocations compute into first. Returns the blocks registered
    /// (table entries that carry a hash now and did not before, over every group).
    ///
    /// With state groups the loaded live state is published as well (when `H + E` is
    /// block-aligned; counted in the return value), and only a load valid in full commits: a
    /// failed one is freed or preempted (its staged state is released unregistered), since
    /// no earlier recurrent state is held to roll back to.
    ///
    /// Errors (state unchanged): [`Error::UnknownSequence`]; [`Error::InvalidSequenceState`]
    /// unless loading; [`Error::InvalidArgument`] (`num_valid_tokens`) outside `[H, H + E]`,
    /// below `H + E` with state groups,
    /// or when a windowed group's window at `num_valid_tokens` reads blocks the load never
    /// took (below the window of `H + E`): preempt the sequence (recompute) instead.
    pub fn commit_external(&self, seq: SeqId, num_valid_tokens: usize) -> Result<usize> {
        let mut guard = self.state.lock();
        let st = &mut *guard;
        let s = st.seqs.get_mut(&seq).ok_or_else(|| unknown(seq))?;
        if s.status != SeqStatus::Loading {
            return Err(bad_state(seq, s.status, "commit_external", "loading"));
        }
        let (lo, hi) = (s.loading_from, s.num_computed);
        if !(lo..=hi).contains(&num_valid_tokens) {
            return Err(Error::InvalidArgument {
                arg: "num_valid_tokens",
                value: num_valid_tokens.to_string(),
                reason: format!(
                    "sequence {seq} loads tokens {lo}..{hi}: the valid count is in [{lo}, {hi}]"
                ),
            });
        }
        if self.has_state && num_valid_tokens < hi {
            return Err(Error::InvalidArgument {
                arg: "num_valid_tokens",
                value: num_valid_tokens.to_string(),
                reason: format!(
                    "sequence {seq} loads a recurrent state (state group) after token {hi}: a \
                     load with state groups is valid in full or not at all (free or preempt \
                     the sequence to recompute it)"
                ),
            });
        }
        self.check_window_held(seq, s, num_valid_tokens)?;
        let hashed_before = self.hashed_entries(s);
        s.status = SeqStatus::Running;
        s.num_computed = num_valid_tokens;
        s.last_context = num_valid_tokens;
        s.loading_from = 0;
        for (g, t) in s.tables.iter_mut().enumerate() {
            let bs = self.cfg.groups[g].block_size as usize;
            t.spare = t.blocks.len() - num_valid_tokens.div_ceil(bs);
        }
        let mut ev = Vec::new();
        self.cache_full(s, &mut ev, true);
        let registered = self.hashed_entries(s) - hashed_before;
        // State groups: the load wrote the live state (after `num_valid_tokens`): it is
        // published now when that end is aligned, as a step's commit would publish it.
        let published = self.commit_locked(st, seq, num_valid_tokens, &mut ev)?;
        self.drain_pool(&mut ev);
        self.absorb(st, ev);
        Ok(registered + published)
    }

    /// Tokens of `seq` being loaded into staged blocks (`H + E - H` while
    /// [`SeqStatus::Loading`], else 0). Errors: [`Error::UnknownSequence`].
    pub fn num_staged_tokens(&self, seq: SeqId) -> Result<usize> {
        let st = self.state.lock();
        let s = st.seqs.get(&seq).ok_or_else(|| unknown(seq))?;
        Ok(if s.status == SeqStatus::Loading {
            s.num_computed - s.loading_from
        } else {
            0
        })
    }

    /// Truncates the computed range of running `seq` to `num_computed_tokens` (`n`): KV past
    /// `n` is to be computed again (vLLM's scheduler after a failed or partial load, or its
    /// rewind of the last token of a full external hit). The tables keep every block (the
    /// model runner keeps its block table): the next allocations compute into the kept blocks
    /// in place, without copy-on-write, before taking fresh ones.
    ///
    /// `poisoned == false`: the KV of the kept blocks is valid (a rewind); their registrations
    /// stay. `poisoned == true`: the KV from `n` on is invalid: every registered block of
    /// `seq`'s tables holding a token at or after `n` (logical blocks from `n / block_size`
    /// on, every group) is unregistered with its dependents, as [`Self::evict_blocks`] does;
    /// its recomputed blocks are registered again as they fill. Returns the blocks
    /// unregistered (0 unless poisoned).
    ///
    /// Errors (state unchanged): [`Error::UnknownSequence`]; [`Error::InvalidSequenceState`]
    /// unless running without pending drafts; [`Error::InvalidArgument`]
    /// (`num_computed_tokens`) above the computed tokens, or when a windowed group's window
    /// at `n` reads blocks it released or never took (preempt the sequence instead).
    pub fn rollback(
        &self,
        seq: SeqId,
        num_computed_tokens: usize,
        poisoned: bool,
    ) -> Result<usize> {
        let n = num_computed_tokens;
        let mut guard = self.state.lock();
        let st = &mut *guard;
        let s = st.seqs.get_mut(&seq).ok_or_else(|| unknown(seq))?;
        if s.status != SeqStatus::Running {
            return Err(bad_state(seq, s.status, "rollback", "running"));
        }
        if self.has_state && n < s.num_computed {
            return Err(Error::InvalidArgument {
                arg: "num_computed_tokens",
                value: n.to_string(),
                reason: "a rollback cannot restore an earlier recurrent state of a state group \
                         (preempt the sequence instead)"
                    .into(),
            });
        }
        if !s.drafts.is_empty() {
            return Err(drafts_pending(seq, "rollback"));
        }
        if n > s.num_computed {
            return Err(Error::InvalidArgument {
                arg: "num_computed_tokens",
                value: n.to_string(),
                reason: format!(
                    "sequence {seq} has {} computed token(s); a rollback only lowers it",
                    s.num_computed
                ),
            });
        }
        self.check_window_held(seq, s, n).map_err(|e| match e {
            Error::InvalidArgument { value, reason, .. } => Error::InvalidArgument {
                arg: "num_computed_tokens",
                value,
                reason,
            },
            e => e,
        })?;
        let mut seeds = Vec::new();
        if poisoned {
            for (g, t) in s.tables.iter().enumerate() {
                let bs = self.cfg.groups[g].block_size as usize;
                seeds.extend(
                    t.blocks
                        .iter()
                        .skip(n / bs)
                        .copied()
                        .filter(|&b| b != NULL_BLOCK && self.pool.is_hashed(b)),
                );
            }
        }
        s.rewrite_to = s.rewrite_to.max(s.num_computed);
        s.num_computed = n;
        s.last_context = n;
        if s.rewrite_to <= n {
            s.rewrite_to = 0;
        }
        if n <= s.tainted_from {
            s.tainted_from = usize::MAX;
        }
        for (g, t) in s.tables.iter_mut().enumerate() {
            let bs = self.cfg.groups[g].block_size as usize;
            t.scanned = t.scanned.min(n / bs);
        }
        let mut ev = Vec::new();
        let dropped = self.evict_closure(st, &seeds, &mut ev);
        // Its own KV is valid below `n` and recomputed from there: nothing of it is tainted.
        st.seqs.get_mut(&seq).expect("known").tainted_from = usize::MAX;
        self.absorb(st, ev);
        Ok(dropped)
    }

    /// Drops the prefix-cache registration of each of `block_ids` that carries one (vLLM's
    /// `BlockPool.evict_blocks`: their KV is invalid) and of every registered block whose
    /// chain descends from one of them (its recorded parent key is one that lost a holder
    /// here, transitively): a recomputed ancestor registered again under the same key must
    /// not make stale descendants reachable. Held blocks stay held (their holders'
    /// registrations of later blocks stop until a rollback to or below them, or a recompute
    /// preemption); cached free blocks become plain free blocks. `BlockRemoved` for the keys
    /// that no longer resolve; the host tier forgets the keys of the blocks dropped here.
    /// Unregistered ids are skipped. Returns the blocks unregistered (dependents included).
    ///
    /// Descent follows each group's own chain of registered keys: blocks of other groups at
    /// later positions, and chains through blocks a windowed group never registered (sparse
    /// retention), are not followed (a [`Self::rollback`] with `poisoned` covers its own
    /// tables in every group).
    ///
    /// Errors (nothing changed): [`Error::InvalidBlockId`] for the null block or an id out of
    /// range. O(num_blocks + blocks held).
    pub fn evict_blocks(&self, block_ids: &[BlockId]) -> Result<usize> {
        for &b in block_ids {
            if b == NULL_BLOCK || b >= self.cfg.num_blocks {
                return Err(Error::InvalidBlockId {
                    block_id: b,
                    num_blocks: self.cfg.num_blocks,
                });
            }
        }
        let mut guard = self.state.lock();
        let st = &mut *guard;
        let mut ev = Vec::new();
        let dropped = self.evict_closure(st, block_ids, &mut ev);
        self.absorb(st, ev);
        Ok(dropped)
    }

    /// Unregisters `seeds` (valid ids) with their dependents; taints the sequences holding
    /// them; the host tier forgets them. Returns how many blocks lost their hash.
    fn evict_closure(&self, st: &mut State, seeds: &[BlockId], ev: &mut Vec<Pending>) -> usize {
        use std::sync::atomic::Ordering::Relaxed;
        let mut keys: Vec<u64> = Vec::new();
        let mut evict: Vec<BlockId> = Vec::new();
        let mut taken: HashSet<BlockId> = HashSet::new();
        let mut seen: HashSet<u64> = HashSet::new();
        for &b in seeds {
            if let Some(h) = self.pool.block_hash(b) {
                if taken.insert(b) {
                    evict.push(b);
                    let k = caching::key64(&h);
                    if seen.insert(k) {
                        keys.push(k);
                    }
                }
            }
        }
        if evict.is_empty() {
            return 0;
        }
        let mut children: HashMap<u64, Vec<(BlockId, u64)>> = HashMap::new();
        for (b, h) in self.pool.cached_blocks() {
            let parent = self.parents[b as usize].load(Relaxed);
            if parent != 0 {
                children
                    .entry(parent)
                    .or_default()
                    .push((b, caching::key64(&h)));
            }
        }
        while let Some(k) = keys.pop() {
            for &(c, ck) in children.get(&k).map_or(&[][..], Vec::as_slice) {
                if taken.insert(c) {
                    evict.push(c);
                    if seen.insert(ck) {
                        keys.push(ck);
                    }
                }
            }
        }
        let dropped = self.pool.uncache(&evict).expect("valid ids");
        if let Some(host) = self.host.as_ref() {
            let mut host = host.lock();
            for &b in &dropped {
                if let Some(key) = host.dev_key[b as usize].take() {
                    host.tier.discard(&key);
                }
            }
        }
        // Holders stop registering from the first block that lost its hash.
        let lost: HashSet<BlockId> = dropped.iter().copied().collect();
        for s in st.seqs.values_mut() {
            if s.status == SeqStatus::Swapped {
                continue; // CPU ids: its GPU copies were released at the swap-out
            }
            let mut from = usize::MAX;
            for (g, t) in s.tables.iter().enumerate() {
                let bs = self.cfg.groups[g].block_size as usize;
                if let Some(j) = t.blocks.iter().position(|b| lost.contains(b)) {
                    from = from.min(j * bs);
                }
            }
            if from < s.tainted_from.min(s.num_computed) {
                s.tainted_from = from;
                for (g, t) in s.tables.iter_mut().enumerate() {
                    let bs = self.cfg.groups[g].block_size as usize;
                    t.scanned = t.scanned.min(from / bs);
                }
            }
        }
        self.drain_pool(ev);
        dropped.len()
    }

    /// Frees `seq` (forgets it, as [`Self::free`]) but keeps its blocks referenced under the
    /// returned handle until [`Self::release_deferred`] (vLLM's `pop_blocks_for_free` on a
    /// node whose worker may still read them: asynchronous scheduling on a KV consumer). Its
    /// blocks stay counted as used and keep their registrations (still prefix hits); with
    /// sparse retention its windowed blocks are cached first, as by `free`; a loading
    /// sequence's staged blocks are kept unregistered. Handles start at 1 and are never
    /// reused.
    ///
    /// Errors (nothing changed): [`Error::UnknownSequence`]; [`Error::InvalidSequenceState`]
    /// for a swapped-out sequence (it holds no GPU block: [`Self::free`] it).
    pub fn free_deferred(&self, seq: SeqId) -> Result<u64> {
        let mut guard = self.state.lock();
        let st = &mut *guard;
        let s = st.seqs.get(&seq).ok_or_else(|| unknown(seq))?;
        if s.status == SeqStatus::Swapped {
            return Err(bad_state(
                seq,
                s.status,
                "free_deferred",
                "running, loading or preempted",
            ));
        }
        let mut s = st.seqs.remove(&seq).expect("known");
        let mut ev = Vec::new();
        self.cache_latest(&mut s, &mut ev);
        let blocks = tail_first(&s);
        let handle = Self::defer(st, blocks);
        self.absorb(st, ev);
        Ok(handle)
    }

    /// [`Self::preempt_recompute`] of a group whose blocks stay referenced under the returned
    /// handle (every member's, tail first per member) until [`Self::release_deferred`]: the
    /// members are preempted at once (a re-admitted one allocates afresh) while a worker may
    /// still read their old blocks. Same errors as `preempt_recompute`.
    pub fn preempt_deferred(&self, seqs: &[SeqId]) -> Result<u64> {
        let mut blocks = Vec::new();
        self.preempt_with(seqs, Some(&mut blocks), "preempt_deferred")?;
        Ok(Self::defer(&mut self.state.lock(), blocks))
    }

    /// Releases the blocks of a deferred release, in the order kept (tail first), as a free
    /// of their holder would have; returns how many. Errors (nothing changed):
    /// [`Error::InvalidArgument`] (`handle`) for a handle never given out or released already.
    pub fn release_deferred(&self, handle: u64) -> Result<usize> {
        let mut guard = self.state.lock();
        let st = &mut *guard;
        let blocks = st
            .deferred
            .remove(&handle)
            .ok_or_else(|| bad_handle(handle))?;
        if !blocks.is_empty() {
            let freed = self.pool.free(&blocks);
            debug_assert!(freed.is_ok(), "{freed:?}");
        }
        let mut ev = Vec::new();
        self.drain_pool(&mut ev);
        self.absorb(st, ev);
        Ok(blocks.len())
    }

    /// The blocks a deferred release keeps, in release order. Errors:
    /// [`Error::InvalidArgument`] (`handle`) for a handle not pending.
    pub fn deferred_blocks(&self, handle: u64) -> Result<Vec<BlockId>> {
        let st = self.state.lock();
        st.deferred
            .get(&handle)
            .cloned()
            .ok_or_else(|| bad_handle(handle))
    }

    /// Blocks kept by every pending deferred release (a block kept twice counts twice).
    pub fn num_deferred_blocks(&self) -> usize {
        self.state.lock().deferred.values().map(Vec::len).sum()
    }

    fn defer(st: &mut State, blocks: Vec<BlockId>) -> u64 {
        st.last_deferred += 1;
        st.deferred.insert(st.last_deferred, blocks);
        st.last_deferred
    }

    /// `InvalidArgument` unless every windowed group holds the blocks a query at
    /// `context` reads (`[first_read(context), context)`, and every entry after them).
    pub(super) fn check_window_held(&self, seq: SeqId, s: &Seq, context: usize) -> Result<()> {
        for (g, t) in s.tables.iter().enumerate() {
            let spec = self.cfg.groups[g];
            if !spec.is_windowed() {
                continue;
            }
            let from = spec.first_read(context) / spec.block_size as usize;
            if let Some(j) = (from..t.blocks.len()).find(|&j| t.blocks[j] == NULL_BLOCK) {
                return Err(Error::InvalidArgument {
                    arg: "num_valid_tokens",
                    value: context.to_string(),
                    reason: format!(
                        "group {g} of sequence {seq} reads logical block {j} from token \
                         {context} on, but holds no block there (released out of the window \
                         or never loaded): preempt the sequence to recompute it"
                    ),
                });
            }
        }
        Ok(())
    }

    /// Table entries of `s` (every group) that carry a hash.
    fn hashed_entries(&self, s: &Seq) -> usize {
        s.tables
            .iter()
            .flat_map(|t| t.blocks.iter())
            .filter(|&&b| self.pool.is_hashed(b))
            .count()
    }
}

/// The checks of an external allocation besides those of an ordinary one.
fn check_external(seq: SeqId, s: &Seq, n: usize, staged: bool) -> Result<()> {
    if !s.is_first() || !matches!(s.status, SeqStatus::Running | SeqStatus::Preempted) {
        return Err(bad_state(
            seq,
            s.status,
            "allocate_external",
            "without blocks (new, or preempted by recompute)",
        ));
    }
    if staged && n > 0 {
        return Err(Error::InvalidArgument {
            arg: "num_new_tokens",
            value: n.to_string(),
            reason: "a staged (asynchronous) load computes nothing before commit_external".into(),
        });
    }
    Ok(())
}

fn bad_handle(handle: u64) -> Error {
    Error::InvalidArgument {
        arg: "handle",
        value: handle.to_string(),
        reason: "no deferred release is pending under this handle (never given out, or \
                 released already)"
            .into(),
    }
}
