//! Per-kind rules of the KV cache groups: which blocks a group must keep readable (a window's
//! first read position, with sparse retention the latest replayable point) and which full
//! blocks it caches at fill time. Full attention keeps and caches everything; sliding-window
//! and chunked-local groups answer from their [`GroupSpec`].

use super::*;

impl KvCacheManager {
    /// Speculative state blocks: the state groups' [`GroupSpec::spare_blocks`]
    /// ([`CacheConfig::state_spare_blocks`]; 0: none).
    pub(super) fn spec_blocks(&self) -> usize {
        self.cfg.state_spare_blocks() as usize
    }

    pub(super) fn sparse(&self) -> bool {
        self.cfg.enable_prefix_caching && self.cfg.retention_interval > 0
    }

    /// First token a windowed group must keep once KV is known up to `ctx`: the window of
    /// `ctx` itself, or with sparse retention the window of the older of the last two hit-unit
    /// boundaries at or below `ctx` (the latest replayable point).
    pub(super) fn keep_from(&self, spec: &GroupSpec, ctx: usize) -> usize {
        if !spec.is_windowed() {
            return 0;
        }
        if !self.sparse() {
            return spec.first_read(ctx);
        }
        let last = ctx / self.unit * self.unit;
        spec.first_read(last.saturating_sub(self.unit))
    }

    /// Whether the state in block `j` of state group `g` of `s` awaits its commit: it is
    /// the state after exactly `(j + 1) * block_size` tokens (an aligned step end: block `j`
    /// is not the live block, or the live block of a state after `state_end` tokens
    /// ([`Seq::state_end`]) with `state_end` aligned), above the sequence's publish floor,
    /// publishable by the retention rule, and not published yet. With speculative state
    /// blocks (a state group's [`GroupSpec::spare_blocks`]) the aligned end must instead be one
    /// of the sequence's marked ends ([`Seq::state_marks`]: a step's known end or an accepted
    /// end), wherever its column is: a state the accepted tokens ran past within one step, or
    /// that only drafts reached, is never pending.
    pub(super) fn state_pending(&self, s: &Seq, g: usize, j: usize, state_end: usize) -> bool {
        let spec = &self.cfg.groups[g];
        let bs = spec.block_size as usize;
        let end = (j + 1) * bs;
        let Some(&b) = s.tables[g].blocks.get(j) else {
            return false;
        };
        let written = if self.spec_blocks() > 0 {
            s.state_marks.contains(&end)
        } else {
            let live = state_end > 0 && j == (state_end - 1) / bs;
            !live || state_end == end
        };
        b != NULL_BLOCK
            && self.cfg.enable_prefix_caching
            && !s.stale_kv
            && end > s.publish_floor
            && end <= s.tainted_from
            && written
            && self.registers_at_fill(spec, j)
            && !self.pool.is_hashed(b)
    }

    /// Whether logical block `j` of a group is cached as soon as it is full (never for a group
    /// out of the prefix cache).
    pub(super) fn registers_at_fill(&self, spec: &GroupSpec, j: usize) -> bool {
        let n = self.cfg.retention_interval as usize;
        spec.prefix_cacheable && (!spec.is_windowed() || n == 0 || retained_at_interval(spec, j, n))
    }
}
