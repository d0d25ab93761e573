//! The one error type of the core. Every public fallible call returns [`Result`]; a call that
//! returns `Err` has changed no state.

use crate::{BlockId, SeqId};

/// Errors returned by the block pool and the KV cache manager.
///
/// Each variant carries the offending values so that bindings can build a message that names
/// them. The Python bindings map every variant, exhaustively, to one exception class.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// Not enough free blocks (uncached + evictable cached) to satisfy an all-or-nothing
    /// allocation. `requested` and `available` are in blocks.
    #[error("out of KV cache blocks: requested {requested} block(s), {available} available")]
    OutOfBlocks { requested: usize, available: usize },
    /// Not enough free CPU (swap space) blocks for a swap-out. Units: blocks.
    #[error("out of CPU swap blocks: requested {requested} block(s), {available} available")]
    OutOfSwapSpace { requested: usize, available: usize },
    /// A block id outside `1..num_blocks` (the null block 0 is never a valid argument).
    #[error(
        "invalid block id {block_id}: valid ids are 1..={max} (0 is the null block)",
        max = .num_blocks.saturating_sub(1)
    )]
    InvalidBlockId { block_id: BlockId, num_blocks: u32 },
    /// A free that would take a block's reference count below 0: the block is free already, or
    /// listed in one call more times than it is referenced.
    #[error("reference count underflow: block {block_id} is freed more times than it is referenced (free already, or listed more times than its ref count)")]
    RefCountUnderflow { block_id: BlockId },
    /// The sequence id is not registered with the manager.
    #[error("unknown sequence id {seq_id}")]
    UnknownSequence { seq_id: SeqId },
    /// The sequence id is already registered.
    #[error("sequence id {seq_id} already exists")]
    SequenceExists { seq_id: SeqId },
    /// A configuration value is out of range; `field` names it, `reason` explains.
    #[error("invalid configuration: {field} = {value}: {reason}")]
    InvalidConfig {
        field: &'static str,
        value: String,
        reason: String,
    },
    /// A call argument is out of range for the current state (for example more new tokens
    /// than the sequence has known tokens). `arg` names the argument.
    #[error("invalid argument {arg} = {value}: {reason}")]
    InvalidArgument {
        arg: &'static str,
        value: String,
        reason: String,
    },
    /// The operation needs a sequence in another state (for example swapping in a sequence that
    /// is not swapped out).
    #[error("sequence {seq_id} is {state}; {operation} needs it {expected}")]
    InvalidSequenceState {
        seq_id: SeqId,
        state: &'static str,
        operation: &'static str,
        expected: &'static str,
    },
    /// Resetting the prefix cache while blocks are still referenced.
    #[error("cannot reset the prefix cache: {blocks_in_use} block(s) still in use")]
    CacheInUse { blocks_in_use: usize },
}

/// Result alias for the core.
pub type Result<T> = std::result::Result<T, Error>;
