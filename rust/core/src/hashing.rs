//! Chained prefix hashing of full blocks (owned by the manager/hashing work; this header fixes
//! the shared types).

/// A block's prefix hash: 32 bytes. SHA-256 fills all 32; xxh3-128 fills the first 16 and
/// leaves the rest zero.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockHash(pub [u8; 32]);

/// A typed extra key mixed into a block's hash. Each kind is hashed under its own tag so keys of
/// different kinds can never collide whatever their values.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum ExtraKey {
    /// Model or LoRA adapter identity.
    Adapter(String),
    /// Per-request cache salt (isolates tenants).
    CacheSalt(String),
    /// A multimodal item overlapping this block: the item's content hash and the offset, in
    /// tokens, of the item's first token relative to the block's first token (may be negative).
    Multimodal { item_hash: Vec<u8>, offset: i64 },
    /// Free-form tagged key.
    Tagged { tag: String, value: Vec<u8> },
}
