//! The KV cache manager's invariant checker (docs/design.md, "KV cache groups"), run by the tests
//! after every operation; O(blocks held) and under the state lock.

use super::*;

impl KvCacheManager {
    /// Checks the invariants of docs/design.md ("KV cache groups") over every group: the pool's
    /// own; every block's ref count equals the running tables holding it; no block twice in a
    /// sequence's tables; each running table covers `ceil(num_computed / block_size)` logical
    /// blocks, with real blocks from the window of its last context on and null entries before
    /// its keep boundary (released as soon as unreadable), full-attention tables without nulls;
    /// a cached block carries its own group's key, the blocks the retention rule caches at fill
    /// time are cached, full-attention chains are closed; preempted sequences hold nothing;
    /// a sequence whose KV predates the last reset (swapped out then) has no block cached;
    /// CPU ref counts match swapped tables. Returns a message naming the first violation.
    pub fn check_invariants(&self) -> std::result::Result<(), String> {
        let mut guard = self.state.lock();
        let st = &mut *guard;
        self.pool.check_invariants()?;
        let caching = self.cfg.enable_prefix_caching;
        let mut gpu_refs: HashMap<BlockId, u32> = HashMap::new();
        let mut cpu_refs = vec![0u32; st.cpu.refs.len()];
        if let Some(host) = self.host.as_ref() {
            self.check_host(&host.lock(), &mut gpu_refs)?;
        }
        for blocks in st.deferred.values() {
            for &b in blocks {
                *gpu_refs.entry(b).or_insert(0) += 1;
            }
        }
        let ids: Vec<SeqId> = st.seqs.keys().copied().collect();
        for id in ids {
            let s = st.seqs.get_mut(&id).expect("listed");
            if s.num_computed > s.tokens.len() {
                return Err(format!("seq {id}: num_computed > num_tokens"));
            }
            match s.status {
                SeqStatus::Preempted | SeqStatus::Swapped if !s.drafts.is_empty() => {
                    return Err(format!("seq {id}: {} with pending drafts", s.status.name()));
                }
                SeqStatus::Preempted => {
                    if s.held().next().is_some() || s.num_computed != 0 {
                        return Err(format!("seq {id}: preempted but holds blocks"));
                    }
                }
                SeqStatus::Swapped => {
                    for c in s.held() {
                        match cpu_refs.get_mut(c as usize) {
                            Some(r) => *r += 1,
                            None => return Err(format!("seq {id}: CPU block {c} out of range")),
                        }
                    }
                }
                SeqStatus::Running | SeqStatus::Loading => {
                    if s.status == SeqStatus::Loading {
                        // Staged blocks: private, held, never registered.
                        for (g, t) in s.tables.iter().enumerate() {
                            let bs = self.cfg.groups[g].block_size as usize;
                            for &b in t.blocks.iter().skip(s.loading_from / bs) {
                                if b != NULL_BLOCK
                                    && (self.pool.ref_count(b) != 1
                                        || self.pool.block_hash(b).is_some())
                                {
                                    return Err(format!(
                                        "seq {id} group {g}: staged block {b} is shared or registered (ref {})",
                                        self.pool.ref_count(b)
                                    ));
                                }
                            }
                        }
                    }
                    if !s.drafts.is_empty() && s.num_computed != s.tokens.len() {
                        return Err(format!(
                            "seq {id}: drafts pending but {} of {} tokens computed",
                            s.num_computed,
                            s.tokens.len()
                        ));
                    }
                    if s.stale_kv && s.held().any(|b| self.pool.block_hash(b).is_some()) {
                        return Err(format!(
                            "seq {id}: its KV predates the last reset but a block is cached"
                        ));
                    }
                    let mut distinct = HashSet::new();
                    for g in 0..self.num_groups() {
                        let spec = self.cfg.groups[g];
                        let bs = spec.block_size as usize;
                        let t = s.tables[g].clone();
                        let slots = s.covered();
                        if t.blocks.len() != slots.div_ceil(bs) + t.spare {
                            return Err(format!(
                                "seq {id} group {g}: {} blocks for {} computed tokens, {} drafts and {} spare blocks",
                                t.blocks.len(),
                                s.num_computed,
                                s.drafts.len(),
                                t.spare
                            ));
                        }
                        // Lookahead blocks (only draft slots, or spare): private, never hashed.
                        // (A state group's live state past the computed tokens, a placeholder
                        // slot's, is checked with its table below.)
                        let lookahead_from = if spec.is_state() {
                            t.blocks.len()
                        } else {
                            slots.div_ceil(bs)
                        };
                        for &b in &t.blocks[lookahead_from..] {
                            if b == NULL_BLOCK
                                || self.pool.ref_count(b) != 1
                                || self.pool.block_hash(b).is_some()
                            {
                                return Err(format!(
                                    "seq {id} group {g}: lookahead block {b} is null, shared or hashed (ref {})",
                                    self.pool.ref_count(b)
                                ));
                            }
                        }
                        if spec.is_state() {
                            self.check_state_table(id, s, g, &mut distinct, &mut gpu_refs)?;
                            continue;
                        }
                        let read_from = spec.first_read(s.last_context) / bs;
                        let keep_from = if s.num_computed == s.last_context {
                            0
                        } else {
                            self.keep_from(&spec, s.last_context) / bs
                        };
                        for (j, &b) in t.blocks.iter().enumerate() {
                            if b == NULL_BLOCK {
                                if j >= read_from {
                                    return Err(format!(
                                        "seq {id} group {g}: entry {j} is null but a query from {} reads it",
                                        s.last_context
                                    ));
                                }
                                continue;
                            }
                            if j < keep_from.max(t.live_from) {
                                return Err(format!(
                                    "seq {id} group {g}: entry {j} (block {b}) is out of every future window but still held"
                                ));
                            }
                            if b >= self.cfg.num_blocks {
                                return Err(format!("seq {id} group {g}: invalid block {b}"));
                            }
                            if !distinct.insert(b) {
                                return Err(format!(
                                    "seq {id}: block {b} appears twice in its tables"
                                ));
                            }
                            *gpu_refs.entry(b).or_insert(0) += 1;
                            let h = self.pool.block_hash(b);
                            if (j + 1) * bs > s.num_computed {
                                continue; // not full yet
                            }
                            if (j + 1) * bs > s.tainted_from {
                                continue; // never registered (descends from invalid KV)
                            }
                            if (j + 1) * bs > self.hashable_len(s) {
                                continue; // its lookahead tokens are not known yet
                            }
                            let want = self.key_at(s, g, j);
                            match h {
                                Some(h) if h != want => {
                                    return Err(format!(
                                        "seq {id} group {g}: block {b} carries a foreign hash"
                                    ))
                                }
                                None if caching
                                    && !s.stale_kv
                                    && j < t.scanned
                                    && self.registers_at_fill(&spec, j) =>
                                {
                                    return Err(format!(
                                        "seq {id} group {g}: full block {j} (block {b}) not cached"
                                    ))
                                }
                                _ => {}
                            }
                            if !spec.is_windowed()
                                && h.is_some()
                                && j > 0
                                && self.pool.block_hash(t.blocks[j - 1]).is_none()
                            {
                                return Err(format!(
                                    "seq {id} group {g}: block {j} cached but block {} is not",
                                    j - 1
                                ));
                            }
                        }
                    }
                }
            }
        }
        for b in 1..self.cfg.num_blocks {
            let want = gpu_refs.get(&b).copied().unwrap_or(0);
            let got = self.pool.ref_count(b);
            if want != got {
                return Err(format!(
                    "block {b}: ref count {got}, held by {want} table(s)"
                ));
            }
            if !caching && self.pool.block_hash(b).is_some() {
                return Err(format!("block {b} has a hash with prefix caching off"));
            }
        }
        if cpu_refs != st.cpu.refs {
            return Err("CPU swap-block ref counts do not match swapped tables".into());
        }
        if st.cpu.free.len() != st.cpu.refs.iter().filter(|&&r| r == 0).count() {
            return Err("CPU free list disagrees with CPU ref counts".into());
        }
        Ok(())
    }

    /// State group `g` of running `s`: the live block at `(num_computed - 1) / bs` is held
    /// (published only when `num_computed` is aligned, under the key of exactly its prefix);
    /// every other held entry is an aligned state waiting for its commit (unpublished,
    /// publishable). Counts the held blocks into `gpu_refs`.
    fn check_state_table(
        &self,
        id: SeqId,
        s: &mut Seq,
        g: usize,
        distinct: &mut HashSet<BlockId>,
        gpu_refs: &mut HashMap<BlockId, u32>,
    ) -> std::result::Result<(), String> {
        let bs = self.cfg.groups[g].block_size as usize;
        let n = s.state_end();
        let live = (n > 0).then(|| (n - 1) / bs);
        // Speculative blocks: k spares right after the live column, and the columns from the
        // hold floor on kept (published or not) for the runner's copy of an accepted state.
        let k = self.spec_blocks();
        let hold = if k > 0 && s.last_context > 0 {
            (s.last_context - 1) / bs
        } else {
            usize::MAX
        };
        if let (true, Some(c)) = (k > 0, live) {
            let len = s.tables[g].blocks.len();
            if len != c + 1 + k {
                return Err(format!(
                    "seq {id} group {g}: {len} state entries for live column {c} and {k} speculative blocks"
                ));
            }
            for j in c + 1..len {
                let b = s.tables[g].blocks[j];
                if b == NULL_BLOCK || self.pool.ref_count(b) != 1 || self.pool.is_hashed(b) {
                    return Err(format!(
                        "seq {id} group {g}: speculative block {b} (entry {j}) is null, shared or hashed"
                    ));
                }
            }
        }
        for j in 0..s.tables[g].blocks.len() {
            let b = s.tables[g].blocks[j];
            if b == NULL_BLOCK {
                if Some(j) == live {
                    return Err(format!("seq {id} group {g}: live state entry {j} is null"));
                }
                continue;
            }
            if b >= self.cfg.num_blocks {
                return Err(format!("seq {id} group {g}: invalid block {b}"));
            }
            if !distinct.insert(b) {
                return Err(format!("seq {id}: block {b} appears twice in its tables"));
            }
            *gpu_refs.entry(b).or_insert(0) += 1;
            let h = self.pool.block_hash(b);
            if Some(j) == live {
                if let Some(h) = h {
                    if n != (j + 1) * bs || h != self.key_at(s, g, j) {
                        return Err(format!(
                            "seq {id} group {g}: live state block {b} published but not the state after {} tokens under its key",
                            (j + 1) * bs
                        ));
                    }
                }
                continue;
            }
            if k > 0 && live.is_some_and(|c| j > c || (j >= hold && j < c)) {
                continue; // a speculative block (checked above), or a held column
            }
            if h.is_some() {
                return Err(format!(
                    "seq {id} group {g}: published state block {b} (entry {j}) still held but not live"
                ));
            }
            if !self.state_pending(s, g, j, n) {
                return Err(format!(
                    "seq {id} group {g}: entry {j} (block {b}) is neither the live state nor an aligned state waiting for its commit"
                ));
            }
        }
        Ok(())
    }
}
