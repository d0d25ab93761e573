//! Fuzz target `hashing_extra_keys`: two arbitrary block-hash inputs (parent, tokens, typed
//! extra keys) and seeds. Checks:
//! - the canonical encoding of an extra-key list is injective: equal bytes ⇔ equal key lists,
//!   so keys of different kinds (adapter "x" vs cache salt "x" vs tagged "x") or with shifted
//!   field boundaries never encode alike, whatever their values;
//! - SHA-256 block hashes differ whenever the inputs differ (a collision here would be a
//!   SHA-256 collision, i.e. an encoding bug), and agree when they are equal;
//! - determinism: the same input hashed twice, or by a second hasher with the same algorithm
//!   and seed, gives the same hash, for SHA-256 and xxh3-128;
//! - different seeds give different SHA-256 roots and block hashes;
//! - xxh3-128 fills exactly the first 16 bytes.

#![no_main]

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use pagedkv_core::{BlockHash, ExtraKey, HashAlgo, PrefixHasher};

/// Arbitrary-derivable mirror of [`ExtraKey`].
#[derive(Arbitrary, Debug, Clone)]
enum Key {
    Adapter(String),
    CacheSalt(String),
    Multimodal(Vec<u8>, i64),
    Tagged(String, Vec<u8>),
}

impl Key {
    fn to_core(&self) -> ExtraKey {
        match self {
            Key::Adapter(s) => ExtraKey::Adapter(s.clone()),
            Key::CacheSalt(s) => ExtraKey::CacheSalt(s.clone()),
            Key::Multimodal(h, o) => ExtraKey::Multimodal {
                item_hash: h.clone(),
                offset: *o,
            },
            Key::Tagged(t, v) => ExtraKey::Tagged {
                tag: t.clone(),
                value: v.clone(),
            },
        }
    }
}

#[derive(Arbitrary, Debug)]
struct Block {
    parent: Option<[u8; 32]>,
    tokens: Vec<u32>,
    keys: Vec<Key>,
}

#[derive(Arbitrary, Debug)]
struct Input {
    a: Block,
    b: Block,
    seed_a: Vec<u8>,
    seed_b: Vec<u8>,
    /// Re-interpret a's first key's payload under every other kind.
    swap_kinds: bool,
}

fn encode(keys: &[ExtraKey]) -> Vec<u8> {
    let mut out = (keys.len() as u64).to_le_bytes().to_vec();
    for k in keys {
        k.encode_into(&mut out);
    }
    out
}

fn hash(h: &PrefixHasher, blk: &(Option<BlockHash>, Vec<u32>, Vec<ExtraKey>)) -> BlockHash {
    h.hash_block(blk.0.as_ref(), &blk.1, &blk.2)
}

fn core(b: &Block) -> (Option<BlockHash>, Vec<u32>, Vec<ExtraKey>) {
    (
        b.parent.map(BlockHash),
        b.tokens.clone(),
        b.keys.iter().map(Key::to_core).collect(),
    )
}

/// The same payload string under each kind: these must all differ pairwise.
fn same_payload_kinds(s: &str) -> Vec<ExtraKey> {
    vec![
        ExtraKey::Adapter(s.to_string()),
        ExtraKey::CacheSalt(s.to_string()),
        ExtraKey::Multimodal {
            item_hash: s.as_bytes().to_vec(),
            offset: 0,
        },
        ExtraKey::Tagged {
            tag: s.to_string(),
            value: Vec::new(),
        },
        ExtraKey::Tagged {
            tag: String::new(),
            value: s.as_bytes().to_vec(),
        },
    ]
}

fn run(input: Input) {
    let a = core(&input.a);
    let b = core(&input.b);

    // Encoding injectivity over key lists.
    assert_eq!(
        encode(&a.2) == encode(&b.2),
        a.2 == b.2,
        "extra-key encoding not injective"
    );

    let sha = PrefixHasher::new(HashAlgo::Sha256, &input.seed_a);
    let sha_again = PrefixHasher::new(HashAlgo::Sha256, &input.seed_a);
    let (ha, hb) = (hash(&sha, &a), hash(&sha, &b));
    // "No parent" means "the seed's root as parent" (a sequence's first block chains from the
    // root), so compare inputs with that substitution made.
    let norm = |x: &(Option<BlockHash>, Vec<u32>, Vec<ExtraKey>)| {
        (x.0.unwrap_or(sha.root()), x.1.clone(), x.2.clone())
    };
    assert_eq!(
        ha == hb,
        norm(&a) == norm(&b),
        "SHA-256 block hash equality != input equality"
    );
    assert_eq!(ha, hash(&sha_again, &a), "not deterministic");
    assert_eq!(ha, hash(&sha, &a), "not deterministic");

    // An explicit parent equal to the root must hash like "no parent" (that is the contract:
    // the first block chains from the root), and nothing else may.
    let via_root = (Some(sha.root()), a.1.clone(), a.2.clone());
    assert_eq!(
        hash(&sha, &via_root) == ha,
        a.0.is_none() || a.0 == Some(sha.root())
    );

    // Seeds: a different seed gives an unrelated hash family.
    let sha_b = PrefixHasher::new(HashAlgo::Sha256, &input.seed_b);
    assert_eq!(sha.root() == sha_b.root(), input.seed_a == input.seed_b);
    if a.0.is_none() {
        assert_eq!(hash(&sha_b, &a) == ha, input.seed_a == input.seed_b);
    }
    // A crafted parent equal to another seed's root is the only way to alias across seeds.
    if let (Some(p), None) = (a.0, b.0) {
        if p == sha_b.root() && a.1 == b.1 && a.2 == b.2 {
            assert_eq!(hash(&sha, &a), hash(&sha_b, &b));
        }
    }

    // xxh3-128: deterministic, 16 bytes used, never equal to the SHA-256 hash.
    let xx = PrefixHasher::new(HashAlgo::Xxh3_128, &input.seed_a);
    let xa = hash(&xx, &a);
    assert_eq!(
        xa,
        hash(&PrefixHasher::new(HashAlgo::Xxh3_128, &input.seed_a), &a)
    );
    assert!(xa.0[16..].iter().all(|&x| x == 0));
    assert_ne!(xa, ha);

    // Kinds never collide: one payload under every kind, pairwise distinct hashes.
    let payload = match input.a.keys.first() {
        Some(Key::Adapter(s) | Key::CacheSalt(s) | Key::Tagged(s, _)) => s.clone(),
        Some(Key::Multimodal(h, _)) => String::from_utf8_lossy(h).into_owned(),
        None => String::new(),
    };
    if input.swap_kinds || input.a.keys.is_empty() {
        let mut kinds = same_payload_kinds(&payload);
        // With an empty payload the two tagged forms are the same key; keep distinct keys only.
        kinds.dedup();
        let hashes: Vec<BlockHash> = kinds
            .iter()
            .map(|k| sha.hash_block(a.0.as_ref(), &a.1, std::slice::from_ref(k)))
            .collect();
        for i in 0..hashes.len() {
            for j in i + 1..hashes.len() {
                assert_ne!(
                    hashes[i], hashes[j],
                    "{:?} collides with {:?}",
                    kinds[i], kinds[j]
                );
            }
        }
        // No keys at all differs from any single key, even an empty one.
        let none = sha.hash_block(a.0.as_ref(), &a.1, &[]);
        assert!(!hashes.contains(&none));
    }
}

fuzz_target!(|input: Input| run(input));
