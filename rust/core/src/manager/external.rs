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
    /// Errors (state unchanged): [`Error::UnknownSequence`]; [`Error::InvalidSequenceState`]
    /// unless loading; [`Error::InvalidArgument`] (`num_valid_tokens`) outside `[H, H + E]`,
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
        self.absorb(st, ev);
        Ok(registered)
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
