//! KV cache events for routers (the schema serving routers consume: a block stored with its
//! hash chain, a block removed, everything cleared). Events are buffered in an [`EventSink`]
//! and drained by the caller.
//!
//! The contract has set semantics per cache: replaying the stream into a set of hashes
//! (insert on `BlockStored`, remove on `BlockRemoved`, clear on `AllBlocksCleared`) gives, after
//! every operation, exactly the hashes that a prefix lookup in this cache resolves.
//! - `BlockStored` announces a hash when it becomes resolvable: the first physical copy of it
//!   is registered. A second copy (two sequences that prefilled the same prompt in one step, a
//!   swapped-in copy of a block that is still cached) announces nothing.
//! - `BlockRemoved` announces a hash when it stops being resolvable: its last copy is evicted.
//! - Each hash is announced at most once between its becoming and its ceasing to be
//!   resolvable, and a `BlockStored`'s `parent_block_hash` is resolvable when the event is sent
//!   (or `None` for a sequence's first block).
//!
//! Identity: every `BlockStored` a manager emits carries its `hash_root`, the root of its hash
//! chains ([`crate::hashing::PrefixHasher::root`], a digest of the hash algorithm's domain and
//! the chain seed). Block hashes of managers with different roots never coincide; the reference
//! engine seeds the chain with its cache identity (model weights, tokenizer, chat template,
//! adapter, KV dtype, RoPE), so the root tells a router which engines may share blocks, and
//! [`crate::kv_indexer::KvIndexer`] refuses events whose root is not its own.

use crate::hashing::{BlockHash, ExtraKey};
use crate::sync::Mutex;

/// The tier of the prefix cache an event is about: the device pool (the blocks the kernels
/// read) or the host-memory second tier ([`crate::host_tier`]). The set semantics of the
/// contract hold per tier: a hash can be resolvable on the device, on the host, or both, and
/// each tier announces its own `BlockStored` / `BlockRemoved`. vLLM's events name the same
/// thing `medium` (`"GPU"` / `"CPU"`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Tier {
    /// The device block pool.
    #[default]
    Device,
    /// The host-memory tier.
    Host,
}

impl Tier {
    /// `"device"` or `"host"`.
    pub fn name(self) -> &'static str {
        match self {
            Tier::Device => "device",
            Tier::Host => "host",
        }
    }

    /// Parses `"device"` or `"host"`.
    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "device" => Some(Tier::Device),
            "host" => Some(Tier::Host),
            _ => None,
        }
    }
}

/// One KV cache event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvEvent {
    /// Hashes became resolvable in the prefix cache. `block_hashes[i]` belongs to the block
    /// holding `token_ids[i*block_size..(i+1)*block_size]`; `parent_block_hash` is the hash of
    /// the block before the first one (`None` for the first block of a sequence).
    BlockStored {
        block_hashes: Vec<BlockHash>,
        parent_block_hash: Option<BlockHash>,
        token_ids: Vec<u32>,
        block_size: u32,
        extra_keys: Vec<ExtraKey>,
        /// Root of the emitting manager's hash chains ([`crate::hashing::PrefixHasher::root`]):
        /// names its hash algorithm and seed (the engine's cache identity). `None` for events
        /// from engines that do not say (vLLM's wire events).
        hash_root: Option<BlockHash>,
        /// The tier in which the hashes became resolvable.
        tier: Tier,
    },
    /// Hashes stopped being resolvable in `tier`: the last block carrying each there was
    /// evicted.
    BlockRemoved {
        block_hashes: Vec<BlockHash>,
        /// The tier the hashes left.
        tier: Tier,
    },
    /// The prefix cache was reset: every tier (device and host) is empty.
    AllBlocksCleared,
}

/// A buffer of [`KvEvent`]s. Locking (the [`crate::sync`] mutex, so loom models see it);
/// disabled sinks drop events without locking.
#[derive(Debug, Default)]
pub struct EventSink {
    enabled: bool,
    buf: Mutex<Vec<KvEvent>>,
}

impl EventSink {
    /// A sink that records events when `enabled`, and drops them otherwise.
    pub fn new(enabled: bool) -> Self {
        Self {
            enabled,
            buf: Mutex::new(Vec::new()),
        }
    }

    /// Whether events are recorded.
    pub fn enabled(&self) -> bool {
        self.enabled
    }

    /// Records one event (no-op when disabled). Locking.
    pub fn push(&self, event: KvEvent) {
        if self.enabled {
            self.buf.lock().push(event);
        }
    }

    /// Takes every buffered event, oldest first. Locking.
    pub fn drain(&self) -> Vec<KvEvent> {
        std::mem::take(&mut *self.buf.lock())
    }
}
