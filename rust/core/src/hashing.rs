//! Chained prefix hashing of full blocks with typed extra keys.
//!
//! The hash of logical block `k` of a sequence is
//! `H(parent, tokens of block k, extra keys of block k)` where `parent` is the hash of block
//! `k-1` (for `k = 0` a root derived from the configurable chain seed). Two blocks therefore
//! share a hash only when their whole prefixes agree, which is what makes a hash usable as the
//! key of the prefix cache (PagedAttention, Kwon et al., SOSP'23, §4.4 "shared prefix"; the
//! chained-hash scheme follows vLLM V1 `hash_block_tokens`, here with a byte-exact, domain
//! separated encoding instead of pickling a tuple).
//!
//! Encoding (all integers little-endian, every variable-length field length-prefixed, so the
//! encoding is injective and no two different inputs feed the same bytes to `H`):
//! ```text
//! root  = H("pkv:rt:1" | u64 len(seed) | seed)
//! block = H("pkv:bk:1" | parent[32] | u32 n_tokens | u32 token* | u32 n_keys | key*)
//! key   = 0x01 | u64 len | adapter utf-8                  (ExtraKey::Adapter)
//!       | 0x02 | u64 len | salt utf-8                     (ExtraKey::CacheSalt)
//!       | 0x03 | u64 len | item_hash | i64 offset         (ExtraKey::Multimodal)
//!       | 0x04 | u64 len | tag utf-8 | u64 len | value    (ExtraKey::Tagged)
//! ```
//! The kind tag byte keeps, for example, "adapter foo" and "salt foo" apart.
//!
//! `H` is SHA-256 by default: a collision-resistant hash means nobody can craft a prompt whose
//! block collides with another tenant's cached block and read that tenant's KV. xxh3-128 is an
//! opt-in fast non-cryptographic alternative for trusted deployments.

use sha2::digest::generic_array::GenericArray;

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
    Multimodal {
        /// Content hash of the item (any bytes).
        item_hash: Vec<u8>,
        /// Item start minus block start, in tokens.
        offset: i64,
    },
    /// Free-form tagged key.
    Tagged {
        /// Name of the key's kind (for example `"mm"` or `"prompt_adapter"`).
        tag: String,
        /// The key's value bytes.
        value: Vec<u8>,
    },
}

impl ExtraKey {
    /// The kind tag byte this key is encoded under (see the module docs).
    pub fn kind_tag(&self) -> u8 {
        match self {
            ExtraKey::Adapter(_) => TAG_ADAPTER,
            ExtraKey::CacheSalt(_) => TAG_CACHE_SALT,
            ExtraKey::Multimodal { .. } => TAG_MULTIMODAL,
            ExtraKey::Tagged { .. } => TAG_TAGGED,
        }
    }

    /// Appends this key's canonical encoding (tag byte, length-prefixed fields) to `out`.
    pub fn encode_into(&self, out: &mut Vec<u8>) {
        out.push(self.kind_tag());
        match self {
            ExtraKey::Adapter(s) | ExtraKey::CacheSalt(s) => put_bytes(out, s.as_bytes()),
            ExtraKey::Multimodal { item_hash, offset } => {
                put_bytes(out, item_hash);
                out.extend_from_slice(&offset.to_le_bytes());
            }
            ExtraKey::Tagged { tag, value } => {
                put_bytes(out, tag.as_bytes());
                put_bytes(out, value);
            }
        }
    }
}

const TAG_ADAPTER: u8 = 0x01;
const TAG_CACHE_SALT: u8 = 0x02;
const TAG_MULTIMODAL: u8 = 0x03;
const TAG_TAGGED: u8 = 0x04;

/// Domain prefixes: root and block inputs can never be confused with each other (same length,
/// different bytes).
const DOMAIN_ROOT: &[u8; 8] = b"pkv:rt:1";
const DOMAIN_BLOCK: &[u8; 8] = b"pkv:bk:1";

/// Bytes before the tokens in a block input: domain, parent hash, token count. Kept short so
/// a 16-token block without extra keys is 112 bytes: two SHA-256 compressions, not three.
const HEADER_LEN: usize = 8 + 32 + 4;
/// Largest block (in tokens) hashed from a stack buffer.
const STACK_TOKENS: usize = 64;
/// The stack buffer: the largest fast-path input (header, 64 tokens, key count) plus SHA-256
/// padding, rounded up to whole 64-byte SHA-256 blocks.
const STACK_BUF: usize = (HEADER_LEN + 4 * STACK_TOKENS + 4 + 9).div_ceil(64) * 64;

/// SHA-256 initial hash value (FIPS 180-4 §5.3.3).
const SHA256_H0: [u32; 8] = [
    0x6a09_e667,
    0xbb67_ae85,
    0x3c6e_f372,
    0xa54f_f53a,
    0x510e_527f,
    0x9b05_688c,
    0x1f83_d9ab,
    0x5be0_cd19,
];

/// Length of a `len`-byte message after SHA-256 padding (FIPS 180-4 §5.1.1): a 0x80 byte,
/// zeros, and the 64-bit bit length, to a multiple of 64 bytes.
fn sha256_padded_len(len: usize) -> usize {
    (len + 9).div_ceil(64) * 64
}

/// SHA-256 of `buf[..len]`, computed in place: `buf` must hold at least
/// [`sha256_padded_len`]`(len)` bytes and be zero after `len`; the padding is written into it and
/// the compression function runs straight over the buffer. The same digest as the streaming
/// `Sha256::digest`, without its block buffering and copies (a 16-token block is 112 bytes, two
/// compressions, and this is the hot path of every prefill).
fn sha256_in_place(buf: &mut [u8], len: usize) -> [u8; 32] {
    let padded = sha256_pad(buf, len);
    let mut state = SHA256_H0;
    for block in buf[..padded].chunks_exact(64) {
        sha2::compress256(
            &mut state,
            std::slice::from_ref(GenericArray::from_slice(block)),
        );
    }
    sha256_digest_bytes(&state)
}

/// Writes SHA-256 padding after `buf[..len]` (which must be followed by zeros up to the padded
/// length) and returns the padded length.
fn sha256_pad(buf: &mut [u8], len: usize) -> usize {
    let padded = sha256_padded_len(len);
    debug_assert!(buf.len() >= padded && buf[len..padded].iter().all(|&b| b == 0));
    buf[len] = 0x80;
    buf[padded - 8..padded].copy_from_slice(&((len as u64) * 8).to_be_bytes());
    padded
}

/// The digest bytes of a final SHA-256 state (big-endian words).
fn sha256_digest_bytes(state: &[u32; 8]) -> [u8; 32] {
    let mut out = [0u8; 32];
    for (chunk, word) in out.chunks_exact_mut(4).zip(state) {
        chunk.copy_from_slice(&word.to_be_bytes());
    }
    out
}

/// One sequence's pending share of [`PrefixHasher::extend_chains`]: its memoised chain
/// `hashes` (blocks `0..hashes.len()` hashed) is to be extended to `want` blocks of `tokens`.
pub(crate) struct ChainJob<'a> {
    /// The chain so far; extended in place.
    pub hashes: &'a mut Vec<BlockHash>,
    /// The sequence's tokens (at least `want * block_size`).
    pub tokens: &'a [u32],
    /// Blocks the chain must cover afterwards.
    pub want: usize,
}

/// A token or key count as u32. Inputs are limited to fewer than 2^32 tokens and keys per block
/// (block sizes are at most 4096); larger counts saturate.
fn count(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

fn put_bytes(out: &mut Vec<u8>, bytes: &[u8]) {
    out.extend_from_slice(&(bytes.len() as u64).to_le_bytes());
    out.extend_from_slice(bytes);
}

/// The hash function behind [`PrefixHasher`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum HashAlgo {
    /// SHA-256 (FIPS 180-4): collision resistant; the default.
    #[default]
    Sha256,
    /// xxh3-128: about an order of magnitude faster, not collision resistant against an
    /// adversary; opt in only when every client is trusted.
    Xxh3_128,
}

impl HashAlgo {
    /// The algorithm's name as used in configs: `"sha256"` or `"xxh3_128"`.
    pub fn name(self) -> &'static str {
        match self {
            HashAlgo::Sha256 => "sha256",
            HashAlgo::Xxh3_128 => "xxh3_128",
        }
    }

    /// Parses `"sha256"` or `"xxh3_128"`; `None` for anything else.
    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "sha256" => Some(HashAlgo::Sha256),
            "xxh3_128" => Some(HashAlgo::Xxh3_128),
            _ => None,
        }
    }

    /// Digest of `buf[..len]`. `buf` must be zero after `len`, up to at least
    /// `sha256_padded_len(len)` bytes: SHA-256 writes its padding there.
    fn digest_padded(self, buf: &mut [u8], len: usize) -> BlockHash {
        match self {
            HashAlgo::Sha256 => BlockHash(sha256_in_place(buf, len)),
            HashAlgo::Xxh3_128 => {
                let mut out = [0u8; 32];
                out[..16].copy_from_slice(&xxhash_rust::xxh3::xxh3_128(&buf[..len]).to_le_bytes());
                BlockHash(out)
            }
        }
    }

    /// Digest of a heap-built input (the padding goes after its bytes).
    fn digest_vec(self, mut buf: Vec<u8>) -> BlockHash {
        let len = buf.len();
        buf.resize(sha256_padded_len(len), 0);
        self.digest_padded(&mut buf, len)
    }
}

/// Computes chained block hashes for one hash algorithm and chain seed.
///
/// Two processes with the same algorithm and seed compute identical hashes for identical
/// (prefix, tokens, extra keys); a different seed gives an unrelated hash family (so a
/// deployment can keep its cache keys private or partition caches). Cheap to clone; `Send` and
/// `Sync` (immutable after construction).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrefixHasher {
    algo: HashAlgo,
    seed: Vec<u8>,
    root: BlockHash,
}

impl Default for PrefixHasher {
    /// SHA-256 with an empty seed.
    fn default() -> Self {
        Self::new(HashAlgo::Sha256, &[])
    }
}

impl PrefixHasher {
    /// A hasher for `algo` whose chain starts from a root derived from `seed` (any bytes,
    /// including empty). O(len(seed)).
    pub fn new(algo: HashAlgo, seed: &[u8]) -> Self {
        let mut buf = Vec::with_capacity(sha256_padded_len(DOMAIN_ROOT.len() + 8 + seed.len()));
        buf.extend_from_slice(DOMAIN_ROOT);
        put_bytes(&mut buf, seed);
        let root = algo.digest_vec(buf);
        Self {
            algo,
            seed: seed.to_vec(),
            root,
        }
    }

    /// The hash algorithm.
    pub fn algo(&self) -> HashAlgo {
        self.algo
    }

    /// The chain seed.
    pub fn seed(&self) -> &[u8] {
        &self.seed
    }

    /// The seed-derived root that stands in for the parent of a sequence's first block.
    pub fn root(&self) -> BlockHash {
        self.root
    }

    /// Hash of one full block: `parent` is the previous block's hash (`None` for the first
    /// block of a sequence, which chains from [`Self::root`]), `tokens` the block's token ids
    /// (callers pass exactly `block_size` finalized tokens; the hasher itself accepts any
    /// length, and the length is part of the hashed bytes), `extra` the block's extra keys in
    /// a deterministic order (order matters). O(len(tokens) + total extra-key bytes); one
    /// SHA-256 of 112 bytes (two compressions) for a 16-token block without extra keys.
    pub fn hash_block(
        &self,
        parent: Option<&BlockHash>,
        tokens: &[u32],
        extra: &[ExtraKey],
    ) -> BlockHash {
        let parent = parent.unwrap_or(&self.root);
        // Fast path without a heap allocation for the common case (no extra keys, a block of
        // at most STACK_TOKENS tokens); same bytes as the general path below.
        if extra.is_empty() && tokens.len() <= STACK_TOKENS {
            let mut buf = [0u8; STACK_BUF];
            let len = encode_plain_block(&mut buf, parent, tokens);
            return self.algo.digest_padded(&mut buf, len);
        }
        let mut buf = Vec::with_capacity(sha256_padded_len(
            HEADER_LEN + 4 * tokens.len() + 4 + 32 * extra.len(),
        ));
        buf.extend_from_slice(DOMAIN_BLOCK);
        buf.extend_from_slice(&parent.0);
        buf.extend_from_slice(&count(tokens.len()).to_le_bytes());
        for t in tokens {
            buf.extend_from_slice(&t.to_le_bytes());
        }
        buf.extend_from_slice(&count(extra.len()).to_le_bytes());
        for key in extra {
            key.encode_into(&mut buf);
        }
        self.algo.digest_vec(buf)
    }
}

impl PrefixHasher {
    /// Extends the chains of several sequences without extra keys (block `k` of a job hashes
    /// tokens `k*block_size..(k+1)*block_size` under the hash of block `k-1`, or the root):
    /// the same hashes as [`Self::hash_block`] one block at a time. With SHA-256 on a CPU
    /// with the SHA extensions, two jobs are hashed at once (`sha256_x2`): a chain is
    /// sequential, but two chains are independent, and two interleaved compressions take
    /// about the time of one. `block_size` must not exceed 64 tokens for that path; otherwise,
    /// and for xxh3, jobs are hashed one block at a time. O(blocks hashed).
    pub(crate) fn extend_chains(&self, block_size: usize, jobs: &mut [ChainJob<'_>]) {
        let bs = block_size;
        for job in jobs.iter_mut() {
            job.hashes
                .reserve(job.want.saturating_sub(job.hashes.len()));
        }
        let two = self.algo == HashAlgo::Sha256
            && (1..=STACK_TOKENS).contains(&bs)
            && crate::sha256_x2::available();
        let pending = |j: &ChainJob<'_>| j.hashes.len() < j.want;
        // Longest chains first: the lanes then run out of work together, and the part hashed
        // in one lane at the end (the last chain's tail) is short.
        let mut order: Vec<usize> = (0..jobs.len()).filter(|&j| pending(&jobs[j])).collect();
        order.sort_by_key(|&j| std::cmp::Reverse(jobs[j].want - jobs[j].hashes.len()));
        let mut queue = order.into_iter();
        let mut lanes: [Option<usize>; 2] = [None, None];
        loop {
            for lane in lanes.iter_mut().filter(|l| l.is_none()) {
                *lane = queue.next();
            }
            match lanes {
                [None, None] => return,
                [Some(a), Some(b)] if two => {
                    let mut bufs = [[0u8; STACK_BUF]; 2];
                    let mut padded = 0;
                    for (buf, &j) in bufs.iter_mut().zip(&[a, b]) {
                        let job = &jobs[j];
                        let k = job.hashes.len();
                        let parent = job.hashes.last().unwrap_or(&self.root);
                        let len =
                            encode_plain_block(buf, parent, &job.tokens[k * bs..(k + 1) * bs]);
                        padded = sha256_pad(buf, len);
                    }
                    let mut states = [SHA256_H0; 2];
                    crate::sha256_x2::compress_x2(
                        &mut states,
                        [&bufs[0][..padded], &bufs[1][..padded]],
                    );
                    for (lane, state) in lanes.iter_mut().zip(&states) {
                        let j = lane.expect("both lanes busy");
                        jobs[j].hashes.push(BlockHash(sha256_digest_bytes(state)));
                        if !pending(&jobs[j]) {
                            *lane = None;
                        }
                    }
                }
                _ => {
                    // One job left (or no two-lane unit): one block of each busy lane.
                    for lane in lanes.iter_mut() {
                        let Some(j) = *lane else { continue };
                        let job = &mut jobs[j];
                        let k = job.hashes.len();
                        let h = self.hash_block(
                            job.hashes.last(),
                            &job.tokens[k * bs..(k + 1) * bs],
                            &[],
                        );
                        job.hashes.push(h);
                        if !pending(job) {
                            *lane = None;
                        }
                    }
                }
            }
        }
    }
}

/// Writes the block input of a block without extra keys (domain, parent, token count, tokens,
/// key count 0) into the zeroed `buf`; returns its length. `tokens.len() <= STACK_TOKENS`.
fn encode_plain_block(buf: &mut [u8; STACK_BUF], parent: &BlockHash, tokens: &[u32]) -> usize {
    buf[..8].copy_from_slice(DOMAIN_BLOCK);
    buf[8..40].copy_from_slice(&parent.0);
    buf[40..HEADER_LEN].copy_from_slice(&(tokens.len() as u32).to_le_bytes());
    for (chunk, t) in buf[HEADER_LEN..].chunks_exact_mut(4).zip(tokens) {
        chunk.copy_from_slice(&t.to_le_bytes());
    }
    // The trailing u32 key count (0) is already zero.
    HEADER_LEN + 4 * tokens.len() + 4
}

impl BlockHash {
    /// Lower-case hex of the 32 bytes (for logs, golden tests and events).
    pub fn to_hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sha2::{Digest, Sha256};

    /// The in-place SHA-256 is FIPS 180-4 SHA-256: same digest as the streaming implementation
    /// for every length around the one- / two- / three-block padding boundaries and beyond.
    #[test]
    fn in_place_sha256_matches_streaming_sha256() {
        for len in 0..=400usize {
            let msg: Vec<u8> = (0..len).map(|i| (i * 131 + len) as u8).collect();
            let mut buf = msg.clone();
            buf.resize(sha256_padded_len(len), 0);
            let want: [u8; 32] = Sha256::digest(&msg).into();
            assert_eq!(sha256_in_place(&mut buf, len), want, "length {len}");
        }
    }
}

#[cfg(test)]
mod chain_tests {
    use super::*;

    /// `extend_chains` gives every job exactly the chain `hash_block` gives one block at a
    /// time, for both algorithms, several block sizes, jobs of different lengths, jobs already
    /// partly or fully hashed, and a job list whose lanes free up at different times.
    #[test]
    fn extend_chains_matches_one_block_at_a_time() {
        for algo in [HashAlgo::Sha256, HashAlgo::Xxh3_128] {
            let hasher = PrefixHasher::new(algo, b"seed");
            for bs in [1usize, 3, 16, 64, 65] {
                let lens = [0usize, 1, 5, 2, 9, 9, 4, 0, 7];
                let tokens: Vec<Vec<u32>> = lens
                    .iter()
                    .enumerate()
                    .map(|(j, &n)| (0..n * bs + 3).map(|t| (t * 7 + j * 1000) as u32).collect())
                    .collect();
                let reference: Vec<Vec<BlockHash>> = tokens
                    .iter()
                    .zip(&lens)
                    .map(|(toks, &n)| {
                        let mut chain: Vec<BlockHash> = Vec::new();
                        for k in 0..n {
                            let h =
                                hasher.hash_block(chain.last(), &toks[k * bs..(k + 1) * bs], &[]);
                            chain.push(h);
                        }
                        chain
                    })
                    .collect();
                // Some chains start partly hashed (a memo from an earlier lookup).
                let mut chains: Vec<Vec<BlockHash>> = reference
                    .iter()
                    .enumerate()
                    .map(|(j, r)| r[..(j % 3).min(r.len())].to_vec())
                    .collect();
                let mut jobs: Vec<ChainJob<'_>> = chains
                    .iter_mut()
                    .zip(&tokens)
                    .zip(&lens)
                    .map(|((hashes, tokens), &want)| ChainJob {
                        hashes,
                        tokens,
                        want,
                    })
                    .collect();
                hasher.extend_chains(bs, &mut jobs);
                assert_eq!(chains, reference, "{algo:?}, block size {bs}");
            }
        }
    }
}
