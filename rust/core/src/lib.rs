//! `pagedkv-core`: a paged KV-cache memory manager after PagedAttention (Kwon et al., SOSP'23).
//!
//! Layers (each module is one concept):
//! - [`sync`]: std / loom facade so the lock-free code is model-checked under `--cfg loom`.
//! - [`free_list`]: lock-free LIFO of uncached free blocks (tagged Treiber stack, ABA-safe).
//! - [`pool`]: the block pool: ref counts, free queue (LIFO uncached + LRU cached), capacity
//!   reservation, prefix index ownership.
//! - [`hashing`]: chained prefix hashing of full blocks with typed extra keys.
//! - `sha256_x2`: SHA-256 of two independent chains at once (SHA-NI, two lanes), for prefills.
//! - [`prefix_index`]: each block's hash and the hash → blocks multiset.
//! - `seq_table`: the manager's slab of sequences keyed by id.
//! - [`request`]: what callers hand the manager: sequence specs, step batches, drafts.
//! - [`kv_groups`]: KV cache groups (full attention, sliding window, chunked local): what each
//!   reads, and the configuration of several groups in one pool.
//! - [`manager`]: the KV cache manager: per-sequence block tables of one or several KV cache
//!   groups over one pool, slot allocation, prefix caching, fork / copy-on-write, preemption
//!   (recompute and swap), speculative lookahead, the batched scheduler-step entry point.
//! - [`host_tier`]: the prefix cache's host-memory tier (admission, eviction, copy plans);
//!   [`host_pool`]: that tier on its own for an offloading connector (stores in flight,
//!   load pins, all-or-nothing store preparation, bytes keys).
//! - [`block_tables`]: the consumer's side of the step outputs' block-table deltas: tables
//!   kept across steps in one buffer, updated in place.
//! - [`metrics`], [`events`]: counters and KV events for routers.
//! - [`kv_indexer`]: the routers' side of the events: which worker holds which block, and
//!   each worker's cached-prefix overlap with a request.

pub mod block_tables;
pub mod error;
pub mod events;
pub mod free_list;
pub mod hashing;
pub mod host_pool;
pub mod host_tier;
pub mod kv_groups;
pub mod kv_indexer;
pub mod manager;
pub mod metrics;
pub mod pool;
pub mod prefix_index;
pub mod request;
mod seq_table;
mod sha256_x2;
pub mod sync;

pub use error::{Error, Result};
pub use hashing::{BlockHash, ExtraKey, HashAlgo, PrefixHasher};
pub use kv_groups::{AttentionKind, CacheConfig, GroupSpec, MAX_BLOCK_SIZE};
pub use kv_indexer::{BatchOutcome, HashSource, KvIndexer, WorkerId, WorkerStatus};
pub use manager::{
    BlockDemand, GroupAllocation, GroupEvent, KvCacheManager, SlotAllocation, StepOptions,
    StepOutput,
};
pub use metrics::{CacheStats, ManagerCounters};
pub use request::{MmItem, SeqStatus, SequenceSpec, StepDrafts, StepRequest};

/// Physical block id. `0` is the null block: never allocated, hashed, ref-counted or counted
/// as capacity; padded block-table entries point at it.
pub type BlockId = u32;

/// Caller-chosen sequence (request or sample) id.
pub type SeqId = u64;

/// The null block id.
pub const NULL_BLOCK: BlockId = 0;
