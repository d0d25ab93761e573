//! Prefix hashing: algorithm default, seeding, domain separation of extra keys, golden values.

use pagedkv_core::{BlockHash, ExtraKey, HashAlgo, PrefixHasher};
use std::collections::HashMap;

fn hex(h: &BlockHash) -> String {
    h.to_hex()
}

#[test]
fn default_is_sha256_with_empty_seed() {
    let h = PrefixHasher::default();
    assert_eq!(h.algo(), HashAlgo::Sha256);
    assert_eq!(HashAlgo::default(), HashAlgo::Sha256);
    assert!(h.seed().is_empty());
}

/// Pinned values, computed independently with Python's hashlib from the encoding documented in
/// `hashing.rs`, so two processes (or a Python router) agree on hashes.
#[test]
fn golden_sha256_values() {
    let h = PrefixHasher::new(HashAlgo::Sha256, b"");
    assert_eq!(
        hex(&h.root()),
        "f927dceff47f339f614f187f9514123c9a5ab618d1ab1de4c792f729d766d35d"
    );
    let tokens: Vec<u32> = (0..16).collect();
    let b0 = h.hash_block(None, &tokens, &[]);
    assert_eq!(
        hex(&b0),
        "8dbcdeeca31a2f852263942b5bec80d65e5c7f50859620d431fbc3a854c91396"
    );

    let seeded = PrefixHasher::new(HashAlgo::Sha256, b"seed");
    let salted = seeded.hash_block(None, &[1, 2, 3, 4], &[ExtraKey::CacheSalt("foo".into())]);
    assert_eq!(
        hex(&salted),
        "504f5e81de0d719546e5e93f7fb0105da2bcce83bca105b95bc5fde79cf321f4"
    );
}

#[test]
fn parent_none_chains_from_the_seeded_root() {
    let h = PrefixHasher::new(HashAlgo::Sha256, b"abc");
    let root = h.root();
    assert_eq!(
        h.hash_block(None, &[7, 8], &[]),
        h.hash_block(Some(&root), &[7, 8], &[])
    );
}

#[test]
fn seed_changes_hashes_same_seed_same_hash() {
    let toks: Vec<u32> = (100..116).collect();
    for algo in [HashAlgo::Sha256, HashAlgo::Xxh3_128] {
        let a = PrefixHasher::new(algo, b"one");
        let a2 = PrefixHasher::new(algo, b"one");
        let b = PrefixHasher::new(algo, b"two");
        assert_eq!(
            a.hash_block(None, &toks, &[]),
            a2.hash_block(None, &toks, &[])
        );
        assert_ne!(
            a.hash_block(None, &toks, &[]),
            b.hash_block(None, &toks, &[])
        );
        assert_ne!(a.root(), b.root());
        // A child hash depends on its parent.
        let p1 = a.hash_block(None, &toks, &[]);
        let p2 = a.hash_block(None, &[1; 16], &[]);
        assert_ne!(
            a.hash_block(Some(&p1), &toks, &[]),
            a.hash_block(Some(&p2), &toks, &[])
        );
    }
}

#[test]
fn xxh3_fills_sixteen_bytes_and_differs_from_sha256() {
    let x = PrefixHasher::new(HashAlgo::Xxh3_128, b"");
    let s = PrefixHasher::new(HashAlgo::Sha256, b"");
    let hx = x.hash_block(None, &[1, 2, 3], &[]);
    assert_eq!(&hx.0[16..], &[0u8; 16]);
    assert_ne!(&hx.0[..16], &[0u8; 16]);
    assert_ne!(hx, s.hash_block(None, &[1, 2, 3], &[]));
    assert_eq!(HashAlgo::from_name("xxh3_128"), Some(HashAlgo::Xxh3_128));
    assert_eq!(HashAlgo::from_name("sha256"), Some(HashAlgo::Sha256));
    assert_eq!(HashAlgo::from_name("md5"), None);
    assert_eq!(HashAlgo::Xxh3_128.name(), "xxh3_128");
}

#[test]
fn adapter_foo_and_salt_foo_differ() {
    let h = PrefixHasher::default();
    let t = [5u32; 16];
    let adapter = h.hash_block(None, &t, &[ExtraKey::Adapter("foo".into())]);
    let salt = h.hash_block(None, &t, &[ExtraKey::CacheSalt("foo".into())]);
    let tagged = h.hash_block(
        None,
        &t,
        &[ExtraKey::Tagged {
            tag: "foo".into(),
            value: vec![],
        }],
    );
    let mm = h.hash_block(
        None,
        &t,
        &[ExtraKey::Multimodal {
            item_hash: b"foo".to_vec(),
            offset: 0,
        }],
    );
    let none = h.hash_block(None, &t, &[]);
    let all = [adapter, salt, tagged, mm, none];
    for i in 0..all.len() {
        for j in i + 1..all.len() {
            assert_ne!(all[i], all[j], "{i} vs {j}");
        }
    }
}

#[test]
fn token_boundaries_are_not_ambiguous() {
    let h = PrefixHasher::default();
    // Same bytes split differently between tokens and keys must not collide.
    assert_ne!(
        h.hash_block(None, &[1, 2], &[]),
        h.hash_block(None, &[1], &[])
    );
    assert_ne!(h.hash_block(None, &[], &[]), h.hash_block(None, &[0], &[]));
    let k1 = ExtraKey::Tagged {
        tag: "ab".into(),
        value: b"c".to_vec(),
    };
    let k2 = ExtraKey::Tagged {
        tag: "a".into(),
        value: b"bc".to_vec(),
    };
    assert_ne!(
        h.hash_block(None, &[1], std::slice::from_ref(&k1)),
        h.hash_block(None, &[1], &[k2])
    );
    // Key order is part of the input.
    let a = ExtraKey::Adapter("x".into());
    assert_ne!(
        h.hash_block(None, &[1], &[a.clone(), k1.clone()]),
        h.hash_block(None, &[1], &[k1, a])
    );
}

/// Exhaustive over a small universe: every distinct (tokens, extra keys) input gets a distinct
/// hash, for both algorithms, i.e. the encoding is injective on it.
#[test]
fn extra_key_kinds_and_values_never_collide_exhaustive() {
    let strs = ["", "a", "b", "ab", "\u{0}", "foo"];
    let bytes: [&[u8]; 4] = [b"", b"a", b"\x00", b"ab"];
    let mut keys: Vec<ExtraKey> = Vec::new();
    for s in strs {
        keys.push(ExtraKey::Adapter(s.into()));
        keys.push(ExtraKey::CacheSalt(s.into()));
        for b in bytes {
            keys.push(ExtraKey::Tagged {
                tag: s.into(),
                value: b.to_vec(),
            });
        }
    }
    for b in bytes {
        for offset in [-1i64, 0, 1, 256] {
            keys.push(ExtraKey::Multimodal {
                item_hash: b.to_vec(),
                offset,
            });
        }
    }
    let mut key_lists: Vec<Vec<ExtraKey>> = vec![vec![]];
    for k in &keys {
        key_lists.push(vec![k.clone()]);
    }
    for a in keys.iter().step_by(3) {
        for b in keys.iter().step_by(5) {
            key_lists.push(vec![a.clone(), b.clone()]);
        }
    }
    let token_lists: Vec<Vec<u32>> = vec![
        vec![],
        vec![0],
        vec![1],
        vec![0, 0],
        vec![u32::MAX],
        vec![2, 1],
    ];
    for algo in [HashAlgo::Sha256, HashAlgo::Xxh3_128] {
        let h = PrefixHasher::new(algo, b"");
        let mut seen: HashMap<BlockHash, (usize, usize)> = HashMap::new();
        for (ti, t) in token_lists.iter().enumerate() {
            for (ki, ks) in key_lists.iter().enumerate() {
                let prev = seen.insert(h.hash_block(None, t, ks), (ti, ki));
                assert!(
                    prev.is_none(),
                    "{algo:?}: collision {prev:?} vs {:?}",
                    (ti, ki)
                );
            }
        }
        assert_eq!(seen.len(), token_lists.len() * key_lists.len());
    }
}

mod prop {
    use super::*;
    use proptest::prelude::*;

    fn key() -> impl Strategy<Value = ExtraKey> {
        prop_oneof![
            "[ab]{0,3}".prop_map(ExtraKey::Adapter),
            "[ab]{0,3}".prop_map(ExtraKey::CacheSalt),
            (proptest::collection::vec(0u8..3, 0..3), -2i64..3)
                .prop_map(|(item_hash, offset)| ExtraKey::Multimodal { item_hash, offset }),
            ("[ab]{0,2}", proptest::collection::vec(0u8..3, 0..3))
                .prop_map(|(tag, value)| ExtraKey::Tagged { tag, value }),
        ]
    }

    proptest! {
        /// Equal hashes iff equal inputs (within the generated space).
        #[test]
        fn different_inputs_different_hashes(
            t1 in proptest::collection::vec(0u32..3, 0..3),
            k1 in proptest::collection::vec(key(), 0..3),
            t2 in proptest::collection::vec(0u32..3, 0..3),
            k2 in proptest::collection::vec(key(), 0..3),
        ) {
            let h = PrefixHasher::default();
            let same_input = t1 == t2 && k1 == k2;
            prop_assert_eq!(h.hash_block(None, &t1, &k1) == h.hash_block(None, &t2, &k2), same_input);
        }
    }
}
