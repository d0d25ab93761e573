//! Allocation as the step loop and the single-sequence calls run it: a plan from the
//! coordinator carried out (releases, hits, fresh blocks, copy-on-write, host loads, the
//! blocks newly full cached), the common running step without a plan
//! ([`KvCacheManager::extend_running`]), and the resolution of speculative drafts.

use super::coordinator::Sim;
use super::*;

/// A [`SlotAllocation`] as the step loop uses it: the per-group parts inline for one group,
/// and one value reused for every sequence of a step ([`Alloc::reset`] keeps the vectors'
/// capacity), so a decode step neither allocates nor moves it per sequence.
#[derive(Debug, Default)]
pub(super) struct Alloc {
    pub(super) num_scheduled_tokens: usize,
    pub(super) num_cached_tokens: usize,
    pub(super) num_context_tokens: usize,
    pub(super) num_draft_tokens: usize,
    pub(super) groups: SmallVec<[GroupAllocation; 1]>,
}

impl Alloc {
    /// Empty, with one part per group of `num_groups`.
    pub(super) fn reset(&mut self, num_groups: usize) {
        self.num_scheduled_tokens = 0;
        self.num_cached_tokens = 0;
        self.num_context_tokens = 0;
        self.num_draft_tokens = 0;
        if self.groups.len() == num_groups {
            for g in &mut self.groups {
                g.new_block_ids.clear();
                g.copies.clear();
                g.released.clear();
                g.zero_blocks.clear();
            }
        } else {
            self.groups = filled(num_groups);
        }
    }
}

impl From<Alloc> for SlotAllocation {
    fn from(a: Alloc) -> Self {
        Self {
            num_scheduled_tokens: a.num_scheduled_tokens,
            num_cached_tokens: a.num_cached_tokens,
            num_context_tokens: a.num_context_tokens,
            num_draft_tokens: a.num_draft_tokens,
            groups: a.groups.into_vec(),
        }
    }
}

/// `n` default values in a one-inline `SmallVec`, built in the caller's frame (`collect`
/// from an iterator, then the move out of a call, cost a tenth of a one-group decode step).
#[inline(always)]
pub(super) fn filled<T: Default>(n: usize) -> SmallVec<[T; 1]> {
    if n == 1 {
        SmallVec::from_buf([T::default()])
    } else {
        (0..n).map(|_| T::default()).collect()
    }
}

impl KvCacheManager {
    pub(super) fn allocate_locked(
        &self,
        seq: SeqId,
        s: &mut Seq,
        num_new_tokens: usize,
        ev: &mut Vec<Pending>,
    ) -> Result<Alloc> {
        self.allocate_locked_with_drafts(seq, s, num_new_tokens, &[], ev)
    }

    pub(super) fn allocate_locked_with_drafts(
        &self,
        seq: SeqId,
        s: &mut Seq,
        num_new_tokens: usize,
        drafts: &[u32],
        ev: &mut Vec<Pending>,
    ) -> Result<Alloc> {
        let mut out = Alloc::default();
        self.allocate_reserving(seq, s, num_new_tokens, drafts, 0, ev, &mut out)?;
        Ok(out)
    }

    /// [`Self::allocate_locked_with_drafts`] into `out` (reset first), refused (nothing
    /// changed) unless `reserve` blocks stay free after it
    /// ([`StepOptions::reserve_blocks`]).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn allocate_reserving(
        &self,
        seq: SeqId,
        s: &mut Seq,
        num_new_tokens: usize,
        drafts: &[u32],
        reserve: usize,
        ev: &mut Vec<Pending>,
        out: &mut Alloc,
    ) -> Result<()> {
        out.reset(self.num_groups());
        if let Some(done) = self.extend_running(s, num_new_tokens, drafts, reserve, ev, out) {
            return done;
        }
        self.allocate_general(
            seq,
            s,
            num_new_tokens,
            drafts,
            reserve,
            0,
            false,
            0,
            ev,
            out,
        )
    }

    /// The general allocation (a plan, then its effects) of `num_new_tokens` tokens, the
    /// first `external` of them loaded by a KV connector right after the prefix hit (first
    /// allocation only); `staged`: the sequence is left [`SeqStatus::Loading`] with the
    /// blocks past its hit staged (nothing registered). `out` must be reset.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn allocate_general(
        &self,
        seq: SeqId,
        s: &mut Seq,
        num_new_tokens: usize,
        drafts: &[u32],
        reserve: usize,
        external: usize,
        staged: bool,
        lookahead: usize,
        ev: &mut Vec<Pending>,
        out: &mut Alloc,
    ) -> Result<()> {
        if s.status == SeqStatus::Loading {
            return Err(bad_state(
                seq,
                s.status,
                "allocate_slots",
                "running or preempted (commit_external its load first)",
            ));
        }
        // Only here, not in the block-count queries: an admission check asks what the whole
        // sequence needs (loaded tokens counted as new ones) before its external allocation.
        if s.state_from_load && s.is_first() && external == 0 {
            return Err(Error::InvalidArgument {
                arg: "num_external_tokens",
                value: "0".into(),
                reason: format!(
                    "sequence {seq}'s hit ignores its state groups (set_state_from_load): only \
                     an external load brings the state its first allocation starts from"
                ),
            });
        }
        let plan = {
            let sim = Sim::new(&self.pool);
            self.plan_external(
                seq,
                s,
                num_new_tokens,
                drafts.len(),
                external,
                lookahead,
                &sim,
            )?
        };
        let available = self.pool.num_free() + plan.release;
        let requested = plan.take.saturating_add(reserve);
        if requested > available {
            return Err(Error::OutOfBlocks {
                requested,
                available,
            });
        }
        out.num_scheduled_tokens = plan.q - plan.external;
        out.num_cached_tokens = if plan.first { plan.context } else { 0 };
        out.num_context_tokens = plan.context + plan.external;
        out.num_draft_tokens = drafts.len();
        // State groups: the slots the live state covers after the call (drafts are
        // placeholder slots there; a settled placeholder's slots are never given back).
        let state_end = if plan.first {
            plan.context + plan.q + drafts.len()
        } else {
            (plan.context + plan.q + drafts.len()).max(s.state_end())
        };
        // State groups: the blocks their live states move out of (read before the releases).
        let state_src: SmallVec<[Option<BlockId>; 1]> = plan
            .groups
            .iter()
            .enumerate()
            .map(|(g, gp)| gp.state_src.map(|j| s.tables[g].blocks[j]))
            .collect();
        // Release first (tail first), so the blocks given back can be taken again.
        let mut released = Vec::new();
        for (g, gp) in plan.groups.iter().enumerate() {
            for &j in gp.release.iter().rev() {
                let t = &mut s.tables[g];
                let b = std::mem::replace(&mut t.blocks[j], NULL_BLOCK);
                t.rewritten_from(j);
                released.push(b);
                out.groups[g].released.push(b);
            }
            s.tables[g].live_from = gp.live_from;
        }
        if !released.is_empty() {
            self.pool.free(&released)?;
        }
        // A state hit is only a copy source, released by the call (without speculative blocks)
        // or held at its column until the computed tokens pass its end (with them, as vLLM
        // holds it): then it is taken like any hit, before the fresh blocks are.
        let hold_state_hits = self.spec_blocks() > 0;
        let mut touched: Vec<BlockId> = plan
            .groups
            .iter()
            .enumerate()
            .filter(|(g, _)| hold_state_hits || !self.cfg.groups[*g].is_state())
            .flat_map(|(_, gp)| gp.hits.iter().copied())
            .filter(|&b| b != NULL_BLOCK && b != HOST_HIT)
            .collect();
        touched.sort_unstable();
        if !touched.is_empty() {
            self.pool.touch(&touched)?;
        }
        let n_new = plan.take - plan.hits_free;
        let mut host = self.host.as_ref().map(|h| h.lock());
        let loads = match host.as_deref_mut() {
            Some(h) if plan.first => self.pin_loads(h, s, &plan.groups)?,
            _ => Vec::new(),
        };
        let new = self.allocate_storing(n_new, host.as_deref_mut(), ev)?;
        drop(host);
        self.drain_pool(ev);
        let mut fresh = new.into_iter();
        for (g, gp) in plan.groups.into_iter().enumerate() {
            let t = &mut s.tables[g];
            let ga = &mut out.groups[g];
            if plan.first {
                t.scanned = gp.hits.len();
                t.blocks = gp.hits;
                t.reported = 0;
                if !loads.is_empty() {
                    host::take_load_blocks(t, ga, &mut fresh);
                }
                t.blocks.resize(t.blocks.len() + gp.null_pad, NULL_BLOCK);
            }
            if gp.cow {
                let dst = fresh.next().expect("allocated");
                let at = plan.context / self.cfg.groups[g].block_size as usize;
                let src = std::mem::replace(&mut t.blocks[at], dst);
                t.rewritten_from(at);
                self.pool.free(&[src])?;
                ga.copies.push((src, dst));
                ga.new_block_ids.push(dst);
            }
            let spec = self.cfg.groups[g];
            let k = self.spec_blocks();
            if spec.is_state() && k > 0 {
                // Speculative blocks: the live block at (end - 1) / bs, then k spares.
                let live = (state_end - 1) / spec.block_size as usize;
                if plan.first {
                    t.blocks.resize(live, NULL_BLOCK);
                    for i in 0..=k {
                        let b = fresh.next().expect("allocated");
                        t.blocks.push(b);
                        ga.new_block_ids.push(b);
                        if i == 0 && plan.context == 0 {
                            ga.zero_blocks.push(b);
                        }
                    }
                } else if gp.fresh == 1 {
                    // The live column moves: nulls up to it, the spares left below it move
                    // (in order) to the end, then one fresh block.
                    let prev_len = t.blocks.len();
                    if prev_len < live {
                        t.blocks.resize(live, NULL_BLOCK);
                    }
                    for j in prev_len - k..prev_len {
                        if j >= live {
                            break;
                        }
                        let b = std::mem::replace(&mut t.blocks[j], NULL_BLOCK);
                        t.rewritten_from(j);
                        t.blocks.push(b);
                        ga.new_block_ids.push(b);
                    }
                    let b = fresh.next().expect("allocated");
                    t.blocks.push(b);
                    ga.new_block_ids.push(b);
                }
                continue;
            }
            if spec.is_state() {
                // The live state's block at (end - 1) / bs (placeholder slots included);
                // null entries before it.
                let live = (state_end - 1) / spec.block_size as usize;
                if gp.fresh == 1 {
                    t.blocks.resize(live, NULL_BLOCK);
                    let b = fresh.next().expect("allocated");
                    t.blocks.push(b);
                    ga.new_block_ids.push(b);
                    match state_src[g] {
                        Some(src) if src != b => ga.copies.push((src, b)),
                        Some(_) => {} // released uncached and taken again: already in place
                        None if plan.first && plan.context == 0 => ga.zero_blocks.push(b),
                        None => {} // a prefix hit: copied below, once its block is loaded
                    }
                }
                continue;
            }
            // Sized once: a prompt's table would otherwise grow by repeated doubling.
            t.blocks.reserve(gp.fresh);
            ga.new_block_ids.reserve(gp.fresh);
            for _ in 0..gp.fresh {
                let b = fresh.next().expect("allocated");
                t.blocks.push(b);
                ga.new_block_ids.push(b);
            }
        }
        s.last_context = plan.context + plan.external;
        s.num_computed = plan.context + plan.q;
        s.status = if staged {
            s.loading_from = plan.context;
            SeqStatus::Loading
        } else {
            SeqStatus::Running
        };
        // Counted once per sequence: a resume after a recompute preemption finds its own
        // blocks again, not a new lookup (vLLM #25780).
        let lookup = plan.first && self.cfg.enable_prefix_caching && !s.looked_up;
        let copies: usize = out.groups.iter().map(|g| g.copies.len()).sum();
        if lookup || copies > 0 {
            let mut c = self.counters.lock();
            if lookup {
                c.prefix_queries_tokens += s.tokens.len() as u64;
                c.prefix_hits_tokens += plan.context as u64;
            }
            c.copies += copies as u64;
        }
        s.looked_up |= plan.first;
        if self.host.is_some() && plan.first {
            self.note_hits_seen(s, plan.context);
            if !loads.is_empty() {
                self.finish_loads(s, &loads, lookup, ev)?;
            }
        }
        s.drafts = drafts.to_vec();
        if self.has_state {
            s.state_slots = state_end;
            if self.spec_blocks() > 0 {
                self.mark_state_end(s, s.num_computed);
            }
        }
        if s.rewrite_to <= s.num_computed {
            s.rewrite_to = 0;
        }
        let covered = s.covered();
        for (g, t) in s.tables.iter_mut().enumerate() {
            let bs = self.cfg.groups[g].block_size as usize;
            t.spare = t.blocks.len() - covered.div_ceil(bs);
        }
        // Only blocks full of computed, finalized tokens: drafts never reach the cache.
        self.cache_full(s, ev, true);
        if self.has_state && plan.first && plan.context > 0 {
            self.release_state_hits(s, plan.context, out)?;
        }
        s.state_from_load = false;
        Ok(())
    }

    /// After a first allocation with a prefix hit of `context` tokens: each state group's hit
    /// block (the state after `context` tokens, at `context / bs - 1`, never taken from the
    /// pool: it stays cached where it was) is copied into the fresh live block and its table
    /// entry cleared (the copy runs before any write of the step). When the call's own
    /// allocation evicted the hit block and took it again as the live block, the state is in
    /// place already: no copy row. A hit block still cached and free moves to the young end
    /// of the LRU (taken and given back), as a hit on any other block would: a state many
    /// requests hit must not be the next one evicted. With speculative state blocks the hit
    /// block is taken with the other groups' hits instead and stays at its column (the copy
    /// row still runs) until an allocation's computed tokens pass its end, as vLLM holds it.
    fn release_state_hits(&self, s: &mut Seq, context: usize, out: &mut Alloc) -> Result<()> {
        let mut copies = 0u64;
        let mut refresh: SmallVec<[BlockId; 2]> = SmallVec::new();
        let k = self.spec_blocks();
        for (g, spec) in self.cfg.groups.iter().enumerate() {
            if !spec.is_state() {
                continue;
            }
            let bs = spec.block_size as usize;
            let t = &mut s.tables[g];
            let j = context / bs - 1;
            if t.blocks[j] == NULL_BLOCK {
                continue; // no hit state: a load brings it (`set_state_from_load`)
            }
            if k > 0 {
                // Speculative blocks: the hit stays held at its column (taken with the other
                // hits), released once an allocation's computed tokens pass its end.
                let src = t.blocks[j];
                let dst = t.blocks[t.blocks.len() - 1 - k];
                out.groups[g].copies.push((src, dst));
                copies += 1;
                continue;
            }
            let src = std::mem::replace(&mut t.blocks[j], NULL_BLOCK);
            let dst = *t.blocks.last().expect("live block");
            t.rewritten_from(j);
            if src != dst {
                out.groups[g].copies.push((src, dst));
                copies += 1;
                if self.pool.ref_count(src) == 0 && self.pool.is_hashed(src) {
                    refresh.push(src);
                }
            }
        }
        if copies > 0 {
            self.counters.lock().copies += copies;
        }
        refresh.sort_unstable();
        refresh.dedup();
        self.pool.touch(&refresh)?;
        self.pool.free(&refresh)
    }

    /// The common step of a running sequence (a decode, a prefill chunk) without the general
    /// plan, when it cannot differ from it: every group full attention (nothing leaves a
    /// window), no drafts pending or proposed, no shared last block to copy, blocks enough.
    /// `None` otherwise: the general path then decides, errors included. Same effects as the
    /// general path (the hybrid proptests drive both); it keeps a one-group decode step as cheap
    /// as a manager without groups (`cargo bench --bench one_group`).
    pub(super) fn extend_running(
        &self,
        s: &mut Seq,
        num_new_tokens: usize,
        drafts: &[u32],
        reserve: usize,
        ev: &mut Vec<Pending>,
        out: &mut Alloc,
    ) -> Option<Result<()>> {
        if !self.all_full
            || s.status != SeqStatus::Running
            || s.num_computed == 0
            || num_new_tokens == 0
            || !drafts.is_empty()
            || !s.drafts.is_empty()
            || s.rewrite_to > 0
        {
            return None;
        }
        let context = s.num_computed;
        let q = num_new_tokens.min(s.tokens.len() - context);
        if q == 0 {
            return None;
        }
        let end = context + q;
        let mut take = 0;
        for (t, spec) in s.tables.iter().zip(&self.cfg.groups) {
            let bs = spec.block_size as usize;
            let shared = |&b: &BlockId| self.pool.ref_count(b) > 1;
            if context % bs != 0 && t.blocks.get(context / bs).is_some_and(shared) {
                return None; // copy-on-write
            }
            take += end.div_ceil(bs).saturating_sub(t.blocks.len());
        }
        if take.saturating_add(reserve) > self.pool.num_free() {
            return None;
        }
        let new = if take == 0 {
            Vec::new()
        } else {
            let mut host = self.host.as_ref().map(|h| h.lock());
            match self.allocate_storing(take, host.as_deref_mut(), ev) {
                Ok(new) => new,
                Err(e) => return Some(Err(e)),
            }
        };
        if self.cfg.enable_events {
            self.drain_pool(ev);
        }
        out.num_scheduled_tokens = q;
        out.num_context_tokens = context;
        let mut fresh = new.into_iter();
        for ((t, spec), ga) in s
            .tables
            .iter_mut()
            .zip(&self.cfg.groups)
            .zip(&mut out.groups)
        {
            let blocks = end.div_ceil(spec.block_size as usize);
            while t.blocks.len() < blocks {
                let b = fresh.next().expect("allocated");
                t.blocks.push(b);
                ga.new_block_ids.push(b);
            }
            t.spare = t.blocks.len() - blocks;
        }
        s.last_context = context;
        s.num_computed = end;
        self.cache_full(s, ev, true);
        Some(Ok(()))
    }

    pub(super) fn accept_drafts_with(
        &self,
        seq: SeqId,
        num_accepted: usize,
        release: bool,
    ) -> Result<Vec<Vec<BlockId>>> {
        let mut guard = self.state.lock();
        let st = &mut *guard;
        let s = st.seqs.get_mut(&seq).ok_or_else(|| unknown(seq))?;
        validate_accept(seq, s.status, s.drafts.len(), num_accepted)?;
        let spec_blocks = self.spec_blocks() > 0;
        if self.has_state && !spec_blocks && release && num_accepted < s.drafts.len() {
            return Err(Error::InvalidArgument {
                arg: "num_accepted",
                value: num_accepted.to_string(),
                reason: format!(
                    "with state groups a draft slot is a placeholder whose state is kept: settle \
                     the {} draft(s) of sequence {seq} keeping their blocks",
                    s.drafts.len()
                ),
            });
        }
        let end = s.num_computed + num_accepted;
        let keep: Vec<usize> = (0..self.num_groups())
            .map(|g| {
                let spec = &self.cfg.groups[g];
                let need = end.div_ceil(spec.block_size as usize) + spec.spare_blocks as usize;
                // A group's spare blocks stay (never more than it holds).
                need.min(s.tables[g].blocks.len())
            })
            .collect();
        let mut released = vec![Vec::new(); self.num_groups()];
        // With speculative state blocks a state group's table stays as it is (its spares
        // follow the live column, which never moves back).
        let keeps_table = |g: usize| spec_blocks && self.cfg.groups[g].is_state();
        if release {
            for (g, t) in s.tables.iter().enumerate() {
                if !keeps_table(g) {
                    released[g] = t.blocks[keep[g]..].iter().rev().copied().collect();
                }
            }
            let all: Vec<BlockId> = released.iter().flatten().copied().collect();
            if !all.is_empty() {
                // Cannot fail: lookahead blocks are private (ref 1) and held by this sequence.
                self.pool.free(&all)?;
            }
        }
        for (g, t) in s.tables.iter_mut().enumerate() {
            if release && !keeps_table(g) {
                t.blocks.truncate(keep[g]);
                t.rewritten_from(keep[g]); // the next block there is a new one
            }
            let covered = end.div_ceil(self.cfg.groups[g].block_size as usize);
            t.spare = t.blocks.len() - covered.min(t.blocks.len());
        }
        let drafts = std::mem::take(&mut s.drafts);
        s.tokens.extend_from_slice(&drafts[..num_accepted]);
        s.num_computed = end;
        if spec_blocks {
            self.mark_state_end(s, end);
        }
        let mut ev = Vec::new();
        self.drain_pool(&mut ev);
        self.cache_full(s, &mut ev, true);
        self.absorb(st, ev);
        Ok(released)
    }

    /// Releases the blocks of `seq`'s windowed groups that no query from position
    /// `num_tokens` on reads, once the caller knows every forward pass whose query starts
    /// below `num_tokens` has completed (vLLM's `remove_skipped_blocks` on the settled-token
    /// basis: its scheduler prunes a finishing request's table this way, with asynchronous
    /// scheduling, before a KV connector reads it). The rule is the one an allocation applies
    /// when its context reaches `num_tokens` (the window of `num_tokens`, with sparse
    /// retention the latest replayable point), applied early. `num_tokens` is capped at the
    /// computed tokens; full-attention groups keep everything. Released blocks go back to the
    /// pool tail first (registered ones stay cached, evictable) and their table entries become
    /// null. Returns the ids released, one list per group.
    ///
    /// Errors (state unchanged): [`Error::UnknownSequence`]; [`Error::InvalidSequenceState`]
    /// unless running.
    pub fn release_skipped_blocks(
        &self,
        seq: SeqId,
        num_tokens: usize,
    ) -> Result<Vec<Vec<BlockId>>> {
        let mut guard = self.state.lock();
        let st = &mut *guard;
        let s = st.seqs.get_mut(&seq).ok_or_else(|| unknown(seq))?;
        if s.status != SeqStatus::Running {
            return Err(bad_state(
                seq,
                s.status,
                "release_skipped_blocks",
                "running",
            ));
        }
        let settled = num_tokens.min(s.num_computed);
        let mut released = vec![Vec::new(); self.num_groups()];
        for (g, t) in s.tables.iter_mut().enumerate() {
            let spec = self.cfg.groups[g];
            if spec.is_state() {
                continue; // its states leave by moves and commits
            }
            let keep =
                (self.keep_from(&spec, settled) / spec.block_size as usize).min(t.blocks.len());
            if keep <= t.live_from {
                continue;
            }
            for j in (t.live_from..keep).rev() {
                let b = std::mem::replace(&mut t.blocks[j], NULL_BLOCK);
                if b != NULL_BLOCK {
                    released[g].push(b);
                }
            }
            t.rewritten_from(t.live_from);
            t.live_from = keep;
        }
        // Every query still to come (or in flight) starts at or after `settled`.
        s.last_context = s.last_context.max(settled);
        let all: Vec<BlockId> = released.iter().flatten().copied().collect();
        if !all.is_empty() {
            // Cannot fail: the sequence holds every one of them.
            self.pool.free(&all)?;
        }
        Ok(released)
    }

    /// Speculative state blocks: marks `end` (a step's known end, or an accepted end) as an
    /// end whose state the runner writes into its own column when it is aligned, and prunes
    /// the marks whose columns no state group holds any more (or under the publish floor).
    pub(super) fn mark_state_end(&self, s: &mut Seq, end: usize) {
        let Some(g) = self.cfg.groups.iter().position(GroupSpec::is_state) else {
            return;
        };
        let bs = self.cfg.groups[g].block_size as usize;
        let t = &s.tables[g];
        let floor = s.publish_floor;
        s.state_marks.retain(|&mut e| {
            e > floor && t.blocks.get(e / bs - 1).is_some_and(|&b| b != NULL_BLOCK)
        });
        if end > 0 && end % bs == 0 && end > floor && !s.state_marks.contains(&end) {
            s.state_marks.push(end);
        }
    }

    /// Releases every GPU block the sequence holds, tail first, table by table.
    pub(super) fn release_all(&self, s: &Seq) {
        let tail_first = tail_first(s);
        if !tail_first.is_empty() {
            let freed = self.pool.free(&tail_first);
            debug_assert!(freed.is_ok(), "{freed:?}");
        }
    }
}
