//! Cache statistics: a point-in-time [`CacheStats`] snapshot and the manager's running
//! [`ManagerCounters`]. The metric set follows what serving stacks export (vLLM V1
//! `PrefixCacheStats` / `kv_cache_usage`): usage, prefix queries and hits in tokens,
//! evictions, plus the paged-memory specifics of this crate (copies, swaps, preemptions).

/// Running counters kept by the KV cache manager (monotone since construction; a failed call
/// never moves them). Plain integers updated under the manager's lock.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ManagerCounters {
    /// Tokens of sequences that went through a prefix lookup on their first allocation. A
    /// resume after a recompute preemption looks its own blocks up again and is not counted
    /// (nor are its hits), so a request without sharing reports a hit rate of 0 however often
    /// it is preempted (as vLLM counts since #25780).
    pub prefix_queries_tokens: u64,
    /// Of those, tokens served from the prefix cache.
    pub prefix_hits_tokens: u64,
    /// Copy-on-write block copies planned.
    pub copies: u64,
    /// Distinct GPU blocks planned out to CPU by swap-out.
    pub swaps_out_blocks: u64,
    /// Distinct CPU blocks planned back to GPU by swap-in.
    pub swaps_in_blocks: u64,
    /// Sequences preempted (recompute or swap), counted once per sequence per preemption.
    pub preemptions: u64,
    /// Of `prefix_hits_tokens`, tokens served from the host tier (loaded, not recomputed).
    /// Counted like `prefix_hits_tokens`, at a sequence's first lookup only, so it stays a
    /// part of the hit rate's numerator; a resume after a recompute preemption that loads its
    /// blocks from host again adds to `host_loads_blocks` (copies planned), not here.
    pub host_hits_tokens: u64,
}

/// A snapshot of the KV cache's state and counters, from [`crate::KvCacheManager::stats`].
///
/// Units: `num_blocks`, `used`, `free`, `cached_free`, `num_cpu_blocks`, `cpu_used`,
/// `evictions`, `copies`, `swaps_*`, `num_host_blocks`, `host_used`, `host_*_blocks` are
/// blocks; `host_hits_tokens` is tokens; `block_size` and `prefix_*` are tokens;
/// `usage` and `kv_utilization` are fractions in `[0, 1]`.
#[derive(Debug, Clone, PartialEq)]
pub struct CacheStats {
    /// Physical GPU blocks including the null block.
    pub num_blocks: u32,
    /// Tokens per block.
    pub block_size: u32,
    /// Blocks with ref count > 0.
    pub used: usize,
    /// Blocks with ref count 0 (uncached + cached-evictable); never counts the null block.
    pub free: usize,
    /// Free blocks that still carry a prefix hash (evictable, reusable by a prefix hit).
    pub cached_free: usize,
    /// `used / (num_blocks - 1)`.
    pub usage: f64,
    /// Token slots holding computed tokens ÷ allocated token slots, over the distinct blocks of
    /// live (GPU-resident) sequences; a block shared by several sequences counts once, with the
    /// fullest holder's fill. 0 when no block is allocated.
    pub kv_utilization: f64,
    /// See [`ManagerCounters::prefix_queries_tokens`].
    pub prefix_queries_tokens: u64,
    /// See [`ManagerCounters::prefix_hits_tokens`].
    pub prefix_hits_tokens: u64,
    /// Cached blocks evicted by allocations (from the pool's counters).
    pub evictions: u64,
    /// See [`ManagerCounters::copies`].
    pub copies: u64,
    /// See [`ManagerCounters::swaps_out_blocks`].
    pub swaps_out_blocks: u64,
    /// See [`ManagerCounters::swaps_in_blocks`].
    pub swaps_in_blocks: u64,
    /// See [`ManagerCounters::preemptions`].
    pub preemptions: u64,
    /// CPU (swap space) blocks.
    pub num_cpu_blocks: u32,
    /// CPU blocks holding swapped-out KV.
    pub cpu_used: usize,
    /// Host-tier blocks of the prefix cache (0: no host tier).
    pub num_host_blocks: u32,
    /// Host-tier blocks holding a cached block or pinned by a load.
    pub host_used: usize,
    /// See [`ManagerCounters::host_hits_tokens`].
    pub host_hits_tokens: u64,
    /// Device -> host copies planned (stores of evicted cached blocks).
    pub host_stores_blocks: u64,
    /// Host -> device copies planned (loads of host-tier prefix hits), every one: resumes
    /// after a recompute preemption included, so `host_loads_blocks * block_size` can exceed
    /// `host_hits_tokens` (see [`ManagerCounters::host_hits_tokens`]).
    pub host_loads_blocks: u64,
}

impl CacheStats {
    /// Prefix-cache hit rate in tokens (`prefix_hits_tokens / prefix_queries_tokens`), 0 when
    /// nothing was queried.
    pub fn prefix_hit_rate(&self) -> f64 {
        if self.prefix_queries_tokens == 0 {
            0.0
        } else {
            self.prefix_hits_tokens as f64 / self.prefix_queries_tokens as f64
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hit_rate_handles_zero_queries() {
        let mut s = CacheStats {
            num_blocks: 2,
            block_size: 1,
            used: 0,
            free: 1,
            cached_free: 0,
            usage: 0.0,
            kv_utilization: 0.0,
            prefix_queries_tokens: 0,
            prefix_hits_tokens: 0,
            evictions: 0,
            copies: 0,
            swaps_out_blocks: 0,
            swaps_in_blocks: 0,
            preemptions: 0,
            num_cpu_blocks: 0,
            cpu_used: 0,
            num_host_blocks: 0,
            host_used: 0,
            host_hits_tokens: 0,
            host_stores_blocks: 0,
            host_loads_blocks: 0,
        };
        assert_eq!(s.prefix_hit_rate(), 0.0);
        s.prefix_queries_tokens = 8;
        s.prefix_hits_tokens = 6;
        assert_eq!(s.prefix_hit_rate(), 0.75);
    }
}
