//! KV cache groups: what each kind of attention layer reads, and the configuration of a
//! [`crate::manager::KvCacheManager`] whose groups share one block pool.
//!
//! Models that mix attention kinds (sliding-window layers interleaved with full-attention
//! ones, chunked-local layers) keep one block table per *KV cache group* (layers with the same
//! attention kind and page layout). Every group's pages come from one pool of equal-size pages,
//! so a block id names one page of every layer of one group. What a group must keep follows
//! from the first position a query reads ([`GroupSpec::first_read`]):
//! - full attention: a query at position `p` reads `[0, p]`;
//! - sliding window `W` (Beltagy et al., "Longformer", 2020; Gemma 2/3): `(p - W, p]`;
//! - chunked local `C` (Llama 4's local layers): `[floor(p / C) * C, p]`;
//! - state (Mamba / linear attention): no per-token KV; block `j` of a state group's table holds
//!   the recurrent state after token `(j + 1) * block_size`, and a sequence with `n` computed
//!   tokens keeps its live state in block `(n - 1) / block_size`. A query at `p` reads the state
//!   after `p` tokens, so a hit at `p` needs block `p / block_size - 1` (`first_read(p) = p - 1`).
//!
//! Positions are token indices, windows and chunks are in tokens, page sizes in bytes.

use crate::error::{Error, Result};
use crate::hashing::HashAlgo;
use crate::host_tier::HostEviction;

/// Largest supported block size in tokens.
pub const MAX_BLOCK_SIZE: u32 = 4096;

/// Largest accepted hit unit (the LCM of the groups' block sizes), in tokens: block sizes
/// whose LCM exceeds it would make prefix hits so coarse that caching is pointless
/// (vLLM #54607: block-size floors from the LCM of group sizes).
pub const MAX_HIT_UNIT: u32 = 1 << 16;

/// Largest block size in tokens of a group out of the prefix cache in a manager with prefix
/// caching off ([`CacheConfig::enable_prefix_caching`]): one block may then cover a whole
/// request (vLLM's Mamba groups outside its `align` cache mode, whose block size is the
/// model's context length). Nothing is hashed, so neither [`MAX_BLOCK_SIZE`] nor
/// [`MAX_HIT_UNIT`] applies; the hit unit must still fit in a `u32`.
pub const MAX_UNCACHED_BLOCK_SIZE: u32 = 1 << 24;

/// The attention kind of a KV cache group.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AttentionKind {
    /// Every query reads every earlier position.
    Full,
    /// A query at `p` reads `(p - window, p]` (`window` >= 1 tokens, the query included).
    SlidingWindow {
        /// Tokens a query reads back, itself included (>= 1).
        window: u32,
    },
    /// A query at `p` reads `[floor(p / chunk) * chunk, p]` (`chunk` >= 1 tokens).
    ChunkedLocal {
        /// Tokens per attention chunk (>= 1).
        chunk: u32,
    },
    /// A recurrent state per sequence (Mamba conv + SSM states, linear attention): block `j`
    /// holds the state after token `(j + 1) * block_size`; states are published to the prefix
    /// cache only by [`crate::KvCacheManager::commit_computed`] (the commit fence).
    State,
}

impl AttentionKind {
    /// `"full"`, `"sliding_window"` or `"chunked_local"`.
    pub fn name(self) -> &'static str {
        match self {
            AttentionKind::Full => "full",
            AttentionKind::SlidingWindow { .. } => "sliding_window",
            AttentionKind::ChunkedLocal { .. } => "chunked_local",
            AttentionKind::State => "state",
        }
    }
}

/// One KV cache group: its attention kind and page layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct GroupSpec {
    /// What a query of this group's layers reads.
    pub kind: AttentionKind,
    /// Tokens per block of this group, `1..=MAX_BLOCK_SIZE`.
    pub block_size: u32,
    /// Bytes one token takes in one layer of the group (K and V of every KV head:
    /// `2 * num_kv_heads * head_size * dtype_bytes`). A page is `block_size *
    /// bytes_per_token` bytes; every group's page must have the same size to share one pool.
    pub bytes_per_token: u64,
    /// Whether the group's full blocks are cached and serve prefix hits (true unless built
    /// with [`Self::uncached`]). A group that is not (a sliding window rebuilt by replaying a
    /// hit's last window, vLLM's bounded-replay sliding-window MLA) never registers a block and
    /// takes no part in hit lookup: a hit found by the other groups gives it fresh blocks for
    /// the hit's window (null below it).
    pub prefix_cacheable: bool,
    /// Spare blocks per sequence (0 unless built with [`Self::with_spare_blocks`]), for the
    /// states a speculative drafter's (MTP / EAGLE) drafts write: vLLM's
    /// `num_speculative_blocks`. Their meaning depends on the group:
    ///
    /// - a group out of the prefix cache ([`Self::uncached`]; vLLM's Mamba groups outside its
    ///   `align` cache mode): blocks a sequence holds past the ones its slots cover, in every
    ///   allocation: an allocation ending at slot `end` keeps `ceil(end / block_size) +
    ///   spare_blocks` blocks (less those released below the group's first read), counted by
    ///   admission like any other; they hold no token and are never cached;
    /// - a state group ([`AttentionKind::State`]; vLLM's Mamba groups in `align` mode): the
    ///   speculative state blocks. The group keeps `k` spare blocks after its live state's
    ///   block for the states a verify step writes after each draft, and draft slots of the
    ///   state groups become real drafts that `accept_drafts` may reject. Layout, with `n` the
    ///   slots of the latest allocation, drafts included (never below an earlier one's): the
    ///   live state's block at column `c = ceil(n / block_size) - 1`, the spares at `c + 1 ..=
    ///   c + k`; a first allocation takes `1 + k` blocks, an allocation that moves `c` takes
    ///   one (the spares left below the new `c` move, in order, to the end of the table; their
    ///   old columns become null); a column the live state left is held until an allocation's
    ///   computed tokens pass its end; only the states at a step's known end and at an
    ///   accepted end are published (docs/design/kv-cache-groups.md). Every state group of a
    ///   manager has the same value, at most [`MAX_STATE_SPARE_BLOCKS`], one block size, and
    ///   no swap space (`num_cpu_blocks == 0`), checked by [`CacheConfig::validate`].
    ///
    /// Any other group (full, sliding window or chunked local in the prefix cache) has none.
    pub spare_blocks: u32,
}

impl GroupSpec {
    /// A full-attention group.
    pub fn full(block_size: u32, bytes_per_token: u64) -> Self {
        Self {
            kind: AttentionKind::Full,
            block_size,
            bytes_per_token,
            prefix_cacheable: true,
            spare_blocks: 0,
        }
    }

    /// A sliding-window group of `window` tokens.
    pub fn sliding_window(block_size: u32, bytes_per_token: u64, window: u32) -> Self {
        Self {
            kind: AttentionKind::SlidingWindow { window },
            block_size,
            bytes_per_token,
            prefix_cacheable: true,
            spare_blocks: 0,
        }
    }

    /// A chunked-local group of `chunk` tokens.
    pub fn chunked_local(block_size: u32, bytes_per_token: u64, chunk: u32) -> Self {
        Self {
            kind: AttentionKind::ChunkedLocal { chunk },
            block_size,
            bytes_per_token,
            prefix_cacheable: true,
            spare_blocks: 0,
        }
    }

    /// A state group (Mamba / linear attention) aligned on `block_size` tokens: states are
    /// cacheable only after multiples of it. `bytes_per_token * block_size` is the page, which
    /// must equal the other groups' page (the state of every layer of the group must fit in it).
    pub fn state(block_size: u32, bytes_per_token: u64) -> Self {
        Self {
            kind: AttentionKind::State,
            block_size,
            bytes_per_token,
            prefix_cacheable: true,
            spare_blocks: 0,
        }
    }

    /// This group, not prefix-cacheable (see [`Self::prefix_cacheable`]); only a sliding-window
    /// or chunked-local group may be (checked by [`CacheConfig::validate`]).
    pub fn uncached(mut self) -> Self {
        self.prefix_cacheable = false;
        self
    }

    /// This group with `k` spare blocks per sequence (see [`Self::spare_blocks`]); only a group
    /// out of the prefix cache or a state group may have them (checked by
    /// [`CacheConfig::validate`]).
    pub fn with_spare_blocks(mut self, k: u32) -> Self {
        self.spare_blocks = k;
        self
    }

    /// Whether this is a state group ([`AttentionKind::State`]).
    pub fn is_state(&self) -> bool {
        matches!(self.kind, AttentionKind::State)
    }

    /// Page size in bytes (`block_size * bytes_per_token`), `None` on overflow.
    pub fn page_bytes(&self) -> Option<u64> {
        u64::from(self.block_size).checked_mul(self.bytes_per_token)
    }

    /// Whether the group reads only a bounded range before each query (sliding window,
    /// chunked local or state), so its older blocks can be released.
    pub fn is_windowed(&self) -> bool {
        !matches!(self.kind, AttentionKind::Full)
    }

    /// The first position a query at position `p` reads. Monotone non-decreasing in `p`.
    pub fn first_read(&self, p: usize) -> usize {
        match self.kind {
            AttentionKind::Full => 0,
            AttentionKind::SlidingWindow { window } => (p + 1).saturating_sub(window as usize),
            AttentionKind::ChunkedLocal { chunk } => p / chunk as usize * chunk as usize,
            AttentionKind::State => p.saturating_sub(1),
        }
    }

    /// Logical blocks `[lo, hi)` a prefix hit of `p` tokens (a multiple of the block size)
    /// needs present: the blocks holding `[first_read(p), p)`. For a sliding window that is
    /// the last `ceil((W - 1) / block_size)` blocks before `p` (fewer near the start); for a
    /// chunked-local group at a chunk boundary, none; for a state group, the one block
    /// `p / block_size - 1` (the state after `p` tokens).
    pub fn hit_blocks(&self, p: usize) -> (usize, usize) {
        let bs = self.block_size as usize;
        let hi = p / bs;
        (self.first_read(p).min(p) / bs, hi)
    }

    fn validate(&self, g: usize) -> Result<()> {
        let field = "groups";
        let max = if self.prefix_cacheable {
            MAX_BLOCK_SIZE
        } else {
            MAX_UNCACHED_BLOCK_SIZE
        };
        if self.block_size == 0 || self.block_size > max {
            return Err(Error::InvalidConfig {
                field: "block_size",
                value: format!("group {g} block_size {}", self.block_size),
                reason: format!(
                    "must be in 1..={MAX_BLOCK_SIZE} tokens (1..={MAX_UNCACHED_BLOCK_SIZE} for a \
                     group out of the prefix cache with prefix caching off)"
                ),
            });
        }
        if self.spare_blocks > 0 && self.prefix_cacheable && !self.is_state() {
            return Err(Error::InvalidConfig {
                field: "spare_blocks",
                value: format!("group {g} spare_blocks {}", self.spare_blocks),
                reason: "only a group out of the prefix cache or a state group holds spare \
                         blocks"
                    .into(),
            });
        }
        if self.bytes_per_token == 0 {
            return Err(Error::InvalidConfig {
                field,
                value: format!("group {g} bytes_per_token 0"),
                reason: "a token takes at least one byte".into(),
            });
        }
        match self.kind {
            AttentionKind::SlidingWindow { window: 0 } => Err(Error::InvalidConfig {
                field,
                value: format!("group {g} window 0"),
                reason: "a sliding window holds at least 1 token".into(),
            }),
            AttentionKind::ChunkedLocal { chunk: 0 } => Err(Error::InvalidConfig {
                field,
                value: format!("group {g} chunk 0"),
                reason: "a local-attention chunk holds at least 1 token".into(),
            }),
            AttentionKind::Full | AttentionKind::State if !self.prefix_cacheable => {
                Err(Error::InvalidConfig {
                    field: "prefix_cacheable",
                    value: format!("group {g} ({}) false", self.kind.name()),
                    reason: "only a sliding-window or chunked-local group can be left out of \
                             the prefix cache"
                        .into(),
                })
            }
            _ => Ok(()),
        }
    }
}

/// Configuration of a [`crate::manager::KvCacheManager`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CacheConfig {
    /// Physical blocks (pages) shared by every group, the null block 0 included; >= 2.
    pub num_blocks: u32,
    /// The KV cache groups, at least one.
    pub groups: Vec<GroupSpec>,
    /// Per model layer, the index of its group in `groups`. Every layer names a group and every
    /// group has at least one layer.
    pub layer_groups: Vec<u32>,
    /// Whether full blocks are hashed, cached and reused across sequences.
    pub enable_prefix_caching: bool,
    /// Retention interval of windowed groups, in tokens (0: dense, every full block of a
    /// windowed group is cached). Otherwise a multiple of [`Self::hit_unit`]: an out-of-window
    /// block stays cached for prefix reuse only if a hit at some multiple of this interval
    /// needs it, or it belongs to the window of a sequence's latest replayable point when the
    /// sequence is freed or preempted; every other out-of-window block is released uncached
    /// (reused first, so the transient window blocks of a long request never flush other
    /// requests' cached prefixes: vLLM #43447).
    pub retention_interval: u32,
    /// Hash function of the prefix cache (SHA-256 unless opted out).
    pub hash_algo: HashAlgo,
    /// Chain seed of the block hashes: processes that must agree on block hashes use the
    /// same seed.
    pub hash_seed: Vec<u8>,
    /// CPU swap-space blocks (0 disables swapping: every swap-out fails with `OutOfSwapSpace`).
    pub num_cpu_blocks: u32,
    /// Whether KV events are buffered for [`crate::manager::KvCacheManager::take_events`].
    pub enable_events: bool,
    /// Host-memory blocks of the prefix cache's second tier ([`crate::host_tier`]), shared by
    /// every group (0: no host tier, and nothing of it runs). Needs prefix caching on. Host
    /// block ids are `0..num_host_blocks`; the executor owns the host tensors.
    pub num_host_blocks: u32,
    /// Uses (registrations of computed blocks and prefix hits) a `(group, hash)` needs before
    /// the device pool's eviction of it stores it to the host tier; 1 stores every evicted
    /// block. At least 1.
    pub host_admission_min_seen: u32,
    /// Which host block a full host tier evicts for a store.
    pub host_eviction: HostEviction,
    /// Successor-aware hashing: tokens after each block that its chain key also covers
    /// (0: a block's key covers its own tokens only, today's hashes bit for bit). With `k > 0`
    /// block `j`'s key hashes tokens `[j * bs, (j + 1) * bs + k)`, so a block becomes cacheable
    /// only once the `k` tokens after it are known (prompt or appended), and a prefix hit of
    /// `p` tokens needs `p + k` known tokens. A drafter whose KV at a block's last position
    /// depends on the next token (EAGLE / MTP) then needs no recompute of a hit's last block.
    /// At most [`MAX_HASH_LOOKAHEAD_TOKENS`]; needs prefix caching on, and is refused with KV
    /// events, a host tier or state groups (their keys and events cover a block's own tokens).
    pub hash_lookahead_tokens: u32,
}

/// Largest [`CacheConfig::hash_lookahead_tokens`].
pub const MAX_HASH_LOOKAHEAD_TOKENS: u32 = 64;

/// Largest [`GroupSpec::spare_blocks`] of a state group (speculative state blocks).
pub const MAX_STATE_SPARE_BLOCKS: u32 = 16;

impl CacheConfig {
    /// One full-attention group: `num_blocks` blocks (the null block included) of
    /// `block_size` tokens, one layer (bytes per token do not matter to one group's
    /// bookkeeping and are 1); prefix caching on, SHA-256, an empty seed, no swap space,
    /// events off, no host tier. Not validated until [`Self::validate`] /
    /// [`crate::KvCacheManager::new`].
    pub fn new(num_blocks: u32, block_size: u32) -> Self {
        Self::with_groups(num_blocks, vec![GroupSpec::full(block_size, 1)], vec![0])
    }

    /// `num_blocks` pages for `groups`, with `layer_groups[i]` the group of layer `i`; prefix
    /// caching on, dense retention, SHA-256, an empty seed, no swap space, events off, no host
    /// tier. Not validated until [`Self::validate`] / [`crate::KvCacheManager::new`].
    pub fn with_groups(num_blocks: u32, groups: Vec<GroupSpec>, layer_groups: Vec<u32>) -> Self {
        Self {
            num_blocks,
            groups,
            layer_groups,
            enable_prefix_caching: true,
            retention_interval: 0,
            hash_algo: HashAlgo::Sha256,
            hash_seed: Vec::new(),
            num_cpu_blocks: 0,
            enable_events: false,
            num_host_blocks: 0,
            host_admission_min_seen: 2,
            host_eviction: HostEviction::Lru,
            hash_lookahead_tokens: 0,
        }
    }

    /// The state groups' spare blocks ([`GroupSpec::spare_blocks`]: speculative state blocks),
    /// 0 without a state group. Every state group of a valid config has the same value; this
    /// is the first state group's.
    pub fn state_spare_blocks(&self) -> u32 {
        self.groups
            .iter()
            .find(|g| g.is_state())
            .map_or(0, |g| g.spare_blocks)
    }

    /// The state groups' [`GroupSpec::spare_blocks`]' part of [`Self::validate`].
    fn validate_state_spare_blocks(&self) -> Result<()> {
        let mut states = self.groups.iter().enumerate().filter(|(_, g)| g.is_state());
        let Some((g0, first)) = states.next() else {
            return Ok(());
        };
        let k = first.spare_blocks;
        let refuse = |value: String, reason: String| {
            Err(Error::InvalidConfig {
                field: "spare_blocks",
                value,
                reason,
            })
        };
        if let Some((g, other)) = states.clone().find(|(_, g)| g.spare_blocks != k) {
            return refuse(
                format!(
                    "group {g0} spare_blocks {k}, group {g} spare_blocks {}",
                    other.spare_blocks
                ),
                "every state group must have the same spare blocks".into(),
            );
        }
        if k == 0 {
            return Ok(());
        }
        let value = format!("group {g0} spare_blocks {k}");
        if k > MAX_STATE_SPARE_BLOCKS {
            return refuse(
                value,
                format!("at most {MAX_STATE_SPARE_BLOCKS} on a state group"),
            );
        }
        if states.any(|(_, g)| g.block_size != first.block_size) {
            return refuse(
                value,
                "with speculative state blocks every state group must have one block size".into(),
            );
        }
        if self.num_cpu_blocks > 0 {
            return refuse(
                value,
                "speculative state blocks are not supported with swap space (a swapped \
                 sequence keeps its live state only)"
                    .into(),
            );
        }
        Ok(())
    }

    /// [`Self::hash_lookahead_tokens`]'s part of [`Self::validate`].
    fn validate_hash_lookahead(&self) -> Result<()> {
        let k = self.hash_lookahead_tokens;
        if k == 0 {
            return Ok(());
        }
        let refuse = |reason: String| {
            Err(Error::InvalidConfig {
                field: "hash_lookahead_tokens",
                value: k.to_string(),
                reason,
            })
        };
        if k > MAX_HASH_LOOKAHEAD_TOKENS {
            return refuse(format!("at most {MAX_HASH_LOOKAHEAD_TOKENS}"));
        }
        if !self.enable_prefix_caching {
            return refuse("needs prefix caching on (it shapes the prefix-cache keys)".into());
        }
        if self.enable_events {
            return refuse("not supported with KV events (a BlockStored event carries a block's own tokens only)".into());
        }
        if self.num_host_blocks > 0 {
            return refuse(
                "not supported with a host tier (its keys cover a block's own tokens only)".into(),
            );
        }
        if self.groups.iter().any(|g| g.is_state()) {
            return refuse("not supported with state groups".into());
        }
        Ok(())
    }

    /// The LCM of the groups' block sizes: prefix hits are multiples of it (every group's
    /// table must end a hit on a block boundary). `None` if it exceeds [`MAX_HIT_UNIT`].
    /// With prefix caching off no hit is ever served: the bound is then `u32::MAX`.
    pub fn hit_unit(&self) -> Option<u32> {
        let max = if self.enable_prefix_caching {
            u64::from(MAX_HIT_UNIT)
        } else {
            u64::from(u32::MAX)
        };
        let mut l: u64 = 1;
        for g in &self.groups {
            let b = u64::from(g.block_size.max(1));
            l = l / gcd(l, b) * b;
            if l > max {
                return None;
            }
        }
        Some(l as u32)
    }

    /// Checks every field. Errors: [`Error::InvalidConfig`] naming the field when
    /// `num_blocks < 2`; no group, a block size outside `1..=MAX_BLOCK_SIZE`, a window or chunk
    /// < 1, zero bytes per token; page sizes that differ between groups (they cannot share one
    /// pool); an LCM of block sizes above [`MAX_HIT_UNIT`] (with prefix caching off, above
    /// `u32::MAX`), a block size above [`MAX_BLOCK_SIZE`] with prefix caching on; no layer, a
    /// layer mapped to no group, a group without layers; a retention interval that is not a multiple of the hit
    /// unit; `num_host_blocks` above [`crate::host_tier::MAX_HOST_BLOCKS`] or set with prefix
    /// caching off (the host tier keys blocks by their prefix hash), or
    /// `host_admission_min_seen == 0`; `hash_lookahead_tokens` above
    /// [`MAX_HASH_LOOKAHEAD_TOKENS`], or set with prefix caching off, KV events, a host tier or
    /// a state group; spare blocks on a group neither out of the prefix cache nor a state
    /// group, state groups with different spare blocks, or state groups' spare blocks above
    /// [`MAX_STATE_SPARE_BLOCKS`], with state groups of different block sizes or with swap
    /// space (these name `spare_blocks`). A block size out of range names `block_size`.
    pub fn validate(&self) -> Result<()> {
        crate::host_tier::validate_host_tier(
            self.num_host_blocks,
            self.host_admission_min_seen,
            self.enable_prefix_caching,
        )?;
        self.validate_hash_lookahead()?;
        if self.num_blocks < 2 {
            return Err(Error::InvalidConfig {
                field: "num_blocks",
                value: self.num_blocks.to_string(),
                reason: "need at least 2 blocks (block 0 is the null block)".into(),
            });
        }
        if self.groups.is_empty() {
            return Err(Error::InvalidConfig {
                field: "groups",
                value: "[]".into(),
                reason: "need at least one KV cache group".into(),
            });
        }
        for (g, spec) in self.groups.iter().enumerate() {
            spec.validate(g)?;
            if self.enable_prefix_caching && spec.block_size > MAX_BLOCK_SIZE {
                return Err(Error::InvalidConfig {
                    field: "block_size",
                    value: format!("group {g} block_size {}", spec.block_size),
                    reason: format!(
                        "must be in 1..={MAX_BLOCK_SIZE} tokens with prefix caching on"
                    ),
                });
            }
        }
        self.validate_state_spare_blocks()?;
        if self.groups.iter().all(|g| !g.prefix_cacheable) {
            return Err(Error::InvalidConfig {
                field: "prefix_cacheable",
                value: "false for every group".into(),
                reason: "at least one group serves prefix hits".into(),
            });
        }
        let Some(page) = self.groups[0].page_bytes() else {
            let first = &self.groups[0];
            return Err(Error::InvalidConfig {
                field: "groups",
                value: format!(
                    "group 0 page {} x {} bytes",
                    first.block_size, first.bytes_per_token
                ),
                reason: "a page (block_size x bytes_per_token) must be at most 2^64 - 1 bytes"
                    .into(),
            });
        };
        for (g, spec) in self.groups.iter().enumerate() {
            if spec.page_bytes() != Some(page) {
                return Err(Error::InvalidConfig {
                    field: "groups",
                    value: format!(
                        "group {g} page {} x {} bytes",
                        spec.block_size, spec.bytes_per_token
                    ),
                    reason: format!(
                        "every group's page (block_size x bytes_per_token) must have the same size to share one pool; group 0's is {} x {} = {} bytes",
                        self.groups[0].block_size,
                        self.groups[0].bytes_per_token,
                        page
                    ),
                });
            }
        }
        let Some(unit) = self.hit_unit() else {
            return Err(Error::InvalidConfig {
                field: "groups",
                value: format!(
                    "block sizes {:?}",
                    self.groups.iter().map(|g| g.block_size).collect::<Vec<_>>()
                ),
                reason: if self.enable_prefix_caching {
                    format!("their least common multiple exceeds {MAX_HIT_UNIT} tokens")
                } else {
                    format!(
                        "their least common multiple exceeds {} tokens (prefix caching off)",
                        u32::MAX
                    )
                },
            });
        };
        if self.layer_groups.is_empty() {
            return Err(Error::InvalidConfig {
                field: "layer_groups",
                value: "[]".into(),
                reason: "need at least one layer".into(),
            });
        }
        for (layer, &g) in self.layer_groups.iter().enumerate() {
            if g as usize >= self.groups.len() {
                return Err(Error::InvalidConfig {
                    field: "layer_groups",
                    value: format!("layer {layer} -> group {g}"),
                    reason: format!(
                        "layer mapped to no group (groups are 0..{})",
                        self.groups.len()
                    ),
                });
            }
        }
        for g in 0..self.groups.len() {
            if !self.layer_groups.contains(&(g as u32)) {
                return Err(Error::InvalidConfig {
                    field: "layer_groups",
                    value: format!("group {g}"),
                    reason: "a group without layers".into(),
                });
            }
        }
        if self.retention_interval % unit != 0 {
            return Err(Error::InvalidConfig {
                field: "retention_interval",
                value: self.retention_interval.to_string(),
                reason: format!(
                    "must be 0 (dense) or a multiple of the hit unit {unit} (LCM of the block sizes)"
                ),
            });
        }
        Ok(())
    }
}

fn gcd(a: u64, b: u64) -> u64 {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

/// Whether logical block `k` of a windowed group is needed by a prefix hit at some multiple of
/// `interval` tokens (the sparse retention rule; `interval` > 0). A hit at `p` needs the
/// blocks holding `[first_read(p), p)`; the smallest candidate `p` after the block is the only
/// one to try, since `first_read` is monotone.
pub fn retained_at_interval(spec: &GroupSpec, k: usize, interval: usize) -> bool {
    let end = (k + 1) * spec.block_size as usize;
    let p = end.div_ceil(interval) * interval;
    spec.first_read(p) < end
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_read_of_each_kind() {
        let sw = GroupSpec::sliding_window(4, 8, 5);
        assert_eq!(sw.first_read(0), 0);
        assert_eq!(sw.first_read(4), 0);
        assert_eq!(sw.first_read(5), 1);
        assert_eq!(sw.first_read(9), 5);
        let cl = GroupSpec::chunked_local(4, 8, 6);
        assert_eq!(cl.first_read(5), 0);
        assert_eq!(cl.first_read(6), 6);
        assert_eq!(cl.first_read(13), 12);
        assert_eq!(GroupSpec::full(4, 8).first_read(100), 0);
    }

    #[test]
    fn hit_blocks_is_ceil_window_minus_one_over_block_size() {
        for w in 1..20u32 {
            let sw = GroupSpec::sliding_window(4, 8, w);
            for p in (40..80).step_by(4) {
                let (lo, hi) = sw.hit_blocks(p);
                assert_eq!(hi - lo, (w as usize - 1).div_ceil(4), "w={w} p={p}");
            }
        }
        let cl = GroupSpec::chunked_local(4, 8, 8);
        assert_eq!(cl.hit_blocks(16), (4, 4)); // a chunk boundary needs nothing
        assert_eq!(cl.hit_blocks(20), (4, 5));
    }

    #[test]
    fn retention_interval_rule() {
        let sw = GroupSpec::sliding_window(4, 8, 9); // a hit needs 2 blocks
        let kept: Vec<usize> = (0..8)
            .filter(|&k| retained_at_interval(&sw, k, 16))
            .collect();
        // hits at 16 need blocks 2, 3; at 32 blocks 6, 7.
        assert_eq!(kept, vec![2, 3, 6, 7]);
    }
}
