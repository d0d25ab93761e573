//! The host tier on its own, shaped for a scheduler-side offloading manager (vLLM's
//! `OffloadingManager`; Python `pagedkv.HostBlockPool`): lookups of block-key chains, loads
//! pinned until they complete, stores prepared (host blocks chosen, evictions made) and then
//! completed or rolled back.
//!
//! The blocks, their keys, admission and eviction are [`HostTier`]'s (the tier the manager
//! uses); this module adds what an asynchronous offloading connector needs on top: a *store in
//! flight* state (the host block is allocated but the KV is not copied yet: neither readable
//! nor evictable), load pins that are checked on release, all-or-nothing store preparation,
//! and bytes keys of any length ([`key_of_bytes`]).
//!
//! Order within a chain. Keys are passed head (first block of the prompt) to tail; the pool
//! enters them into the eviction order tail first, so when the tier is full a chain loses its
//! tail before its head (a prefix lookup cannot use a tail whose head is gone).
//!
//! Every method checks its whole input before it changes anything: a refused call
//! ([`KeyRefused`], or `None` from [`HostPool::prepare_store`]) leaves the blocks, keys and
//! pins as they were. Not synchronised: the owner keeps it under its own lock.

use crate::error::Result;
use crate::hashing::{BlockHash, HashAlgo, PrefixHasher};
use crate::host_tier::{HostEviction, HostKey, HostTier};
use crate::BlockId;
use std::collections::{HashMap, HashSet};

/// The "device blocks" the tier is told it sits beside. This pool has no device pool: the
/// number only sizes the tier's seen table (`2 x (host + device blocks)` keys, so at least
/// 64,000 keys, the size of vLLM's store-threshold tracker); the tier's "KV written" check
/// reads device block 0, which never registers, so it always passes.
const SEEN_DEVICE_BLOCKS: u32 = 32_000;

/// The group id marking a key that was hashed (not a 36-byte vLLM offload key).
pub const HASHED_GROUP: u32 = u32::MAX;

/// Chain seed of the SHA-256 that turns a key of another length into a [`HostKey`].
const KEY_DOMAIN: &[u8] = b"pagedkv.HostBlockPool.key";

/// The host key of `bytes`. A 36-byte key (vLLM's `OffloadKey`: a 32-byte block hash then the
/// KV cache group as 4 big-endian bytes) maps exactly to `(hash, group)`; any other key (or a
/// group of [`HASHED_GROUP`]) maps to the SHA-256 of its bytes under a fixed domain seed, in
/// group [`HASHED_GROUP`] (collision resistant; the pool keeps such a key's bytes to report it
/// back). O(len).
pub fn key_of_bytes(bytes: &[u8]) -> HostKey {
    if bytes.len() == 36 {
        let group = u32::from_be_bytes(bytes[32..].try_into().expect("4 bytes"));
        if group != HASHED_GROUP {
            let hash: [u8; 32] = bytes[..32].try_into().expect("32 bytes");
            return HostKey::new(BlockHash(hash), group);
        }
    }
    let mut seeded = Vec::with_capacity(KEY_DOMAIN.len() + bytes.len());
    seeded.extend_from_slice(KEY_DOMAIN);
    seeded.extend_from_slice(bytes);
    let hash = PrefixHasher::new(HashAlgo::Sha256, &seeded).root();
    HostKey::new(hash, HASHED_GROUP)
}

/// Cumulative counters of a [`HostPool`], in blocks.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HostPoolCounters {
    /// Keys given a host block by [`HostPool::prepare_store`].
    pub stores_prepared: u64,
    /// Stores completed with success (their keys became readable).
    pub stores_completed: u64,
    /// Stores completed with failure (their keys dropped).
    pub stores_failed: u64,
    /// Blocks pinned by [`HostPool::prepare_load`].
    pub loads: u64,
    /// Readable keys evicted to make room for a store.
    pub evictions: u64,
    /// Candidates of the [`HostPool::prepare_store`] calls that returned `None`.
    pub stores_refused: u64,
}

/// Where a key is ([`HostPool::state`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KeyState {
    /// Not on host.
    Absent = 0,
    /// A store is in flight: allocated, KV not written yet (not readable, not evictable).
    Storing = 1,
    /// Readable (evictable unless pinned by a load).
    Readable = 2,
}

/// What [`HostPool::prepare_store`] decided.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StorePlan {
    /// Indices into the offered keys of the keys to copy, head to tail (each key once: its
    /// first offer).
    pub indices: Vec<usize>,
    /// The host block of each key to copy.
    pub blocks: Vec<BlockId>,
    /// The bytes of the keys evicted to make room, in eviction order.
    pub evicted: Vec<Vec<u8>>,
}

/// A call refused because of one of its keys; nothing was changed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeyRefused {
    /// Index of the first refused key in the call's keys.
    pub index: usize,
    /// Why, e.g. `"no load of this key is in flight"`.
    pub reason: &'static str,
}

impl KeyRefused {
    const NOT_READABLE: &'static str = "not readable on host (absent or still storing)";
    const NO_LOAD: &'static str = "no load of this key is in flight";
    const NO_STORE: &'static str = "no store of this key is in flight";

    fn at(index: usize, reason: &'static str) -> Self {
        Self { index, reason }
    }
}

/// Host blocks with stores in flight and load pins over a [`HostTier`] (see the module docs).
/// A block is *free*, *storing*, *readable* (evictable unless pinned) or *pinned* by loads.
/// Memory: the tier's, plus 5 bytes per host block and the bytes of the hashed keys on host.
#[derive(Debug, Clone)]
pub struct HostPool {
    tier: HostTier,
    /// Bytes of the hashed keys on host (see [`key_of_bytes`]).
    originals: HashMap<HostKey, Box<[u8]>>,
    /// Per host block: a store is in flight (allocated, KV not written yet).
    storing: Vec<bool>,
    /// Per host block: loads prepared and not completed.
    load_pins: Vec<u32>,
    /// Host blocks storing or load-pinned (neither evictable nor store destinations).
    held: usize,
    counters: HostPoolCounters,
}

impl HostPool {
    /// A pool of `num_blocks` free host blocks (ids `0..num_blocks`); a key is stored once it
    /// has been offered `admission_min_seen` times (1: every offer); full, it evicts by
    /// `eviction`.
    ///
    /// Errors: [`crate::Error::InvalidConfig`] for `num_blocks` outside
    /// `1..=MAX_HOST_BLOCKS` (`num_host_blocks`) or `admission_min_seen == 0`
    /// (`host_admission_min_seen`). O(num_blocks).
    pub fn new(num_blocks: u32, admission_min_seen: u32, eviction: HostEviction) -> Result<Self> {
        let tier = HostTier::new(
            num_blocks,
            admission_min_seen,
            eviction,
            SEEN_DEVICE_BLOCKS,
            false,
        )?;
        let n = num_blocks as usize;
        Ok(Self {
            tier,
            originals: HashMap::new(),
            storing: vec![false; n],
            load_pins: vec![0; n],
            held: 0,
            counters: HostPoolCounters::default(),
        })
    }

    /// Host blocks.
    pub fn num_blocks(&self) -> u32 {
        self.tier.num_blocks()
    }

    /// Offers a key needs before it is stored.
    pub fn admission_min_seen(&self) -> u32 {
        self.tier.admission_min_seen()
    }

    /// The eviction policy.
    pub fn eviction(&self) -> HostEviction {
        self.tier.eviction()
    }

    /// Host blocks holding a key (readable or storing).
    pub fn num_used(&self) -> usize {
        self.tier.num_used()
    }

    /// Host blocks storing or pinned by loads (not evictable).
    pub fn num_held(&self) -> usize {
        self.held
    }

    /// Cumulative counters.
    pub fn counters(&self) -> HostPoolCounters {
        self.counters
    }

    /// Where key `bytes` is. No side effects. O(len).
    pub fn state(&self, bytes: &[u8]) -> KeyState {
        self.state_of(&key_of_bytes(bytes))
    }

    fn state_of(&self, key: &HostKey) -> KeyState {
        match self.tier.lookup(key) {
            None => KeyState::Absent,
            Some(h) if self.storing[h as usize] => KeyState::Storing,
            Some(_) => KeyState::Readable,
        }
    }

    /// Number of leading `keys` (head to tail) that are readable. No side effects.
    pub fn lookup(&self, keys: &[&[u8]]) -> usize {
        keys.iter()
            .take_while(|k| self.state(k) == KeyState::Readable)
            .count()
    }

    /// The bytes of `key` (exact keys rebuilt, hashed ones from [`Self::originals`]).
    fn key_bytes(&self, key: &HostKey) -> Vec<u8> {
        if key.group == HASHED_GROUP {
            return self
                .originals
                .get(key)
                .map(|b| b.to_vec())
                .unwrap_or_default();
        }
        let mut out = Vec::with_capacity(36);
        out.extend_from_slice(&key.hash.0);
        out.extend_from_slice(&key.group.to_be_bytes());
        out
    }

    fn hold(&mut self, h: BlockId) {
        let i = h as usize;
        if !self.storing[i] && self.load_pins[i] == 0 {
            self.held += 1;
        }
    }

    fn release(&mut self, h: BlockId) {
        let i = h as usize;
        if !self.storing[i] && self.load_pins[i] == 0 {
            self.held -= 1;
        }
    }

    /// Pins the blocks of `keys` (each readable; a key may be pinned more than once, one
    /// [`Self::complete_load`] each) for loads; returns their host blocks, one per key. They
    /// are not evicted until completed. Errors (nothing pinned): [`KeyRefused`] at the first
    /// key that is not readable. O(keys).
    pub fn prepare_load(
        &mut self,
        keys: &[&[u8]],
    ) -> std::result::Result<Vec<BlockId>, KeyRefused> {
        let mut blocks = Vec::with_capacity(keys.len());
        for (i, k) in keys.iter().enumerate() {
            match self.tier.lookup(&key_of_bytes(k)) {
                Some(h) if !self.storing[h as usize] => blocks.push(h),
                _ => return Err(KeyRefused::at(i, KeyRefused::NOT_READABLE)),
            }
        }
        for &h in &blocks {
            self.hold(h);
            self.load_pins[h as usize] += 1;
            self.tier.pin(h).expect("a readable block holds a key");
        }
        self.counters.loads += blocks.len() as u64;
        Ok(blocks)
    }

    /// Releases one load pin per key, tail first (back into the eviction order as used).
    /// Errors (nothing released): [`KeyRefused`] at the first key without a load pin left (not
    /// on host, or more completes than prepares). O(keys).
    pub fn complete_load(&mut self, keys: &[&[u8]]) -> std::result::Result<(), KeyRefused> {
        let mut blocks = Vec::with_capacity(keys.len());
        let mut taken: HashMap<BlockId, u32> = HashMap::new();
        for (i, k) in keys.iter().enumerate() {
            let Some(h) = self.tier.lookup(&key_of_bytes(k)) else {
                return Err(KeyRefused::at(i, KeyRefused::NO_LOAD));
            };
            let t = taken.entry(h).or_insert(0);
            if *t >= self.load_pins[h as usize] {
                return Err(KeyRefused::at(i, KeyRefused::NO_LOAD));
            }
            *t += 1;
            blocks.push(h);
        }
        for &h in blocks.iter().rev() {
            self.load_pins[h as usize] -= 1;
            self.release(h);
            self.tier.unpin(h);
        }
        Ok(())
    }

    /// Marks the readable, unpinned blocks of `keys` used, tail first (the eviction policy's
    /// "use": LRU moves them to the back). Other keys are ignored. O(keys).
    pub fn touch(&mut self, keys: &[&[u8]]) {
        for k in keys.iter().rev() {
            let k = key_of_bytes(k);
            if let Some(h) = self.tier.lookup(&k) {
                let i = h as usize;
                if !self.storing[i] && self.load_pins[i] == 0 {
                    // On host already: plan_store only records the use.
                    self.tier.plan_store(0, k);
                }
            }
        }
    }

    /// Prepares storing `keys` (head to tail, repeated keys count once). Each offer counts
    /// toward admission. A key not on host whose seen count reached `admission_min_seen` is a
    /// store candidate; keys on host (readable or storing) are not stored again. `None`
    /// (nothing allocated, nothing evicted; only the offers counted) when the candidates do
    /// not fit in the free and evictable blocks, not counting the offered keys already on
    /// host, which are never evicted by their own offer. Otherwise every candidate gets a host
    /// block (free, else the eviction policy's victim) and is *storing* until
    /// [`Self::complete_store`]; the offered readable keys are used (as [`Self::touch`]).
    /// O(keys) expected.
    pub fn prepare_store(&mut self, keys: &[&[u8]]) -> Option<StorePlan> {
        let min_seen = self.tier.admission_min_seen();
        let hosts: Vec<HostKey> = keys.iter().map(|k| key_of_bytes(k)).collect();
        let mut seen = HashSet::with_capacity(keys.len());
        let mut candidates = Vec::new();
        let mut protect = Vec::new();
        for (i, k) in hosts.iter().enumerate() {
            if !seen.insert(*k) {
                continue;
            }
            // Admission is decided right after the key's own offer is counted (noting later
            // keys may age this count).
            self.tier.note_seen(*k);
            if self.tier.seen_count(k) == 0 {
                // This very offer aged the table and was halved away: count it again.
                self.tier.note_seen(*k);
            }
            match self.tier.lookup(k) {
                Some(h) if !self.storing[h as usize] && self.load_pins[h as usize] == 0 => {
                    protect.push(h);
                }
                Some(_) => {}
                None if self.tier.seen_count(k) >= min_seen => candidates.push(i),
                None => {}
            }
        }
        let room = self.tier.num_blocks() as usize - self.held - protect.len();
        if candidates.len() > room {
            self.counters.stores_refused += candidates.len() as u64;
            return None;
        }
        // Offered keys on host stay out of the eviction lists while the candidates are placed.
        for &h in protect.iter().rev() {
            self.tier.pin(h).expect("a listed block holds a key");
        }
        let mut plan = StorePlan::default();
        let mut placed = Vec::with_capacity(candidates.len());
        for &i in candidates.iter().rev() {
            let k = hosts[i];
            // Admitted above; noting a later key may have aged this count since: restore it
            // (an admission decision is not undone halfway through one call).
            while self.tier.seen_count(&k) < min_seen {
                self.tier.note_seen(k);
            }
            let out = self.tier.plan_store(0, k);
            let h = out.stored.expect("room was checked");
            if let Some(old) = out.evicted {
                plan.evicted.push(self.key_bytes(&old));
                self.originals.remove(&old);
                self.counters.evictions += 1;
            }
            if k.group == HASHED_GROUP {
                self.originals.insert(k, keys[i].into());
            }
            self.tier.pin(h).expect("a stored block holds a key");
            self.hold(h);
            self.storing[h as usize] = true;
            placed.push((i, h));
        }
        for &h in protect.iter().rev() {
            self.tier.unpin(h);
        }
        // The tier's copy plans are the manager's business; this pool's caller copies.
        let _ = self.tier.take_plans();
        placed.reverse();
        plan.indices = placed.iter().map(|&(i, _)| i).collect();
        plan.blocks = placed.iter().map(|&(_, h)| h).collect();
        self.counters.stores_prepared += plan.indices.len() as u64;
        Some(plan)
    }

    /// Ends the stores of `keys`: with `success` their blocks become readable and evictable
    /// (entered tail first), else they are dropped and their blocks freed. Errors (nothing
    /// changed): [`KeyRefused`] at the first key without a store in flight (absent, readable
    /// already, or repeated). O(keys).
    pub fn complete_store(
        &mut self,
        keys: &[&[u8]],
        success: bool,
    ) -> std::result::Result<(), KeyRefused> {
        let hosts: Vec<HostKey> = keys.iter().map(|k| key_of_bytes(k)).collect();
        let mut blocks = Vec::with_capacity(keys.len());
        let mut done = HashSet::with_capacity(keys.len());
        for (i, k) in hosts.iter().enumerate() {
            match self.tier.lookup(k) {
                Some(h) if self.storing[h as usize] && done.insert(h) => blocks.push(h),
                _ => return Err(KeyRefused::at(i, KeyRefused::NO_STORE)),
            }
        }
        for (&h, k) in blocks.iter().zip(&hosts).rev() {
            self.storing[h as usize] = false;
            self.release(h);
            if !success {
                self.tier.discard(k);
                self.originals.remove(k);
            }
            self.tier.unpin(h);
        }
        let n = blocks.len() as u64;
        if success {
            self.counters.stores_completed += n;
        } else {
            self.counters.stores_failed += n;
        }
        Ok(())
    }

    /// Drops every block, stores and loads in flight included (their completions must not come
    /// afterwards: they are refused). The counters are kept. O(num_blocks).
    pub fn reset(&mut self) {
        let fresh = Self::new(
            self.tier.num_blocks(),
            self.tier.admission_min_seen(),
            self.tier.eviction(),
        )
        .expect("the same config was accepted");
        *self = Self {
            counters: self.counters,
            ..fresh
        };
    }

    /// Checks the pool's invariants: the tier's own ([`HostTier::check_held`], every host block
    /// pinned exactly once per store in flight and per load pin, and by nothing else); `held`
    /// counts the storing or load-pinned blocks; those hold a key; the hashed keys kept are the
    /// hashed keys on host. Returns the first violation. O(num_blocks).
    pub fn check(&self) -> std::result::Result<(), String> {
        let n = self.storing.len();
        if self.load_pins.len() != n || n != self.tier.num_blocks() as usize {
            return Err("per-block vectors and the tier disagree in size".into());
        }
        let pins: Vec<u32> = (0..n)
            .map(|h| u32::from(self.storing[h]) + self.load_pins[h])
            .collect();
        self.tier.check_held(|_| true, &pins)?;
        let mut held = 0;
        let mut hashed = 0;
        for (h, &pinned) in pins.iter().enumerate() {
            let key = self.tier.key_of(h as BlockId);
            if let Some(k) = key {
                if k.group == HASHED_GROUP {
                    hashed += 1;
                    if !self.originals.contains_key(&k) {
                        return Err(format!("host block {h}: hashed key without its bytes"));
                    }
                }
            }
            if pinned > 0 {
                held += 1;
                if key.is_none() {
                    return Err(format!(
                        "host block {h} is storing or pinned but holds no key"
                    ));
                }
            }
        }
        if held != self.held {
            return Err(format!("{held} host blocks held, counted {}", self.held));
        }
        if hashed != self.originals.len() {
            return Err(format!(
                "{} hashed keys kept, {hashed} on host",
                self.originals.len()
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A vLLM-style offload key: a 32-byte block hash of byte `i`, then `group` big-endian.
    fn key(i: u8, group: u32) -> Vec<u8> {
        let mut k = vec![i; 32];
        k.extend_from_slice(&group.to_be_bytes());
        k
    }

    fn keys(v: &[Vec<u8>]) -> Vec<&[u8]> {
        v.iter().map(Vec::as_slice).collect()
    }

    /// Prepares and completes storing `v`; returns the plan.
    fn stored(p: &mut HostPool, v: &[Vec<u8>]) -> StorePlan {
        let plan = p.prepare_store(&keys(v)).expect("room");
        let to_store: Vec<&[u8]> = plan.indices.iter().map(|&i| v[i].as_slice()).collect();
        p.complete_store(&to_store, true).unwrap();
        p.check().unwrap();
        plan
    }

    fn pool(n: u32) -> HostPool {
        HostPool::new(n, 1, HostEviction::Lru).unwrap()
    }

    #[test]
    fn keys_of_36_bytes_are_exact_others_hashed() {
        let k = key(7, 3);
        assert_eq!(key_of_bytes(&k), HostKey::new(BlockHash([7; 32]), 3));
        let hashed = key_of_bytes(&key(7, HASHED_GROUP));
        assert_eq!(hashed.group, HASHED_GROUP);
        assert_ne!(hashed.hash, BlockHash([7; 32]));
        assert_ne!(key_of_bytes(b"a"), key_of_bytes(b"b"));
        assert_eq!(key_of_bytes(b"a"), key_of_bytes(b"a"));
    }

    #[test]
    fn store_lookup_load_and_tail_first_eviction() {
        let mut p = pool(4);
        let chain: Vec<Vec<u8>> = (0..4).map(|i| key(i, 0)).collect();
        let plan = p.prepare_store(&keys(&chain)).unwrap();
        assert_eq!(plan.indices, vec![0, 1, 2, 3]);
        let mut sorted = plan.blocks.clone();
        sorted.sort_unstable();
        assert_eq!((sorted, plan.evicted.len()), (vec![0, 1, 2, 3], 0));
        assert_eq!(p.lookup(&keys(&chain)), 0);
        assert_eq!(p.state(&chain[0]), KeyState::Storing);
        p.complete_store(&keys(&chain), true).unwrap();
        assert_eq!(p.lookup(&keys(&chain)), 4);
        assert_eq!(
            p.prepare_load(&keys(&chain[..2])).unwrap(),
            plan.blocks[..2]
        );
        // Full: the unpinned tail goes first, the pinned head stays.
        let plan = stored(&mut p, &[key(10, 0), key(11, 0)]);
        assert_eq!(plan.evicted, vec![chain[3].clone(), chain[2].clone()]);
        p.complete_load(&keys(&chain[..2])).unwrap();
        assert_eq!(p.lookup(&keys(&chain)), 2);
        p.check().unwrap();
        let c = p.counters();
        assert_eq!(
            c,
            HostPoolCounters {
                stores_prepared: 6,
                stores_completed: 6,
                stores_failed: 0,
                loads: 2,
                evictions: 2,
                stores_refused: 0,
            }
        );
    }

    #[test]
    fn a_failed_store_is_rolled_back_and_hashed_keys_come_back_as_their_bytes() {
        let mut p = pool(2);
        let odd: Vec<Vec<u8>> = vec![
            b"a".to_vec(),
            b"a much longer key than thirty-six bytes, hashed".to_vec(),
            key(1, HASHED_GROUP),
        ];
        let plan = p.prepare_store(&keys(&odd[..2])).unwrap();
        assert_eq!(plan.indices, vec![0, 1]);
        p.complete_store(&keys(&odd[..1]), false).unwrap();
        assert_eq!(
            (p.state(&odd[0]), p.state(&odd[1]), p.num_used()),
            (KeyState::Absent, KeyState::Storing, 1)
        );
        p.complete_store(&keys(&odd[1..2]), true).unwrap();
        stored(&mut p, &odd[2..]);
        let plan = stored(&mut p, &[key(5, 0)]);
        assert_eq!(plan.evicted, vec![odd[1].clone()]);
        assert_eq!(p.counters().stores_failed, 1);
        p.check().unwrap();
    }

    #[test]
    fn prepare_store_is_all_or_nothing_and_never_evicts_held_or_offered_blocks() {
        let mut p = pool(3);
        stored(&mut p, &[key(0, 0)]);
        p.prepare_load(&keys(&[key(0, 0)])).unwrap();
        p.prepare_store(&keys(&[key(1, 0)])).unwrap();
        let probe: Vec<Vec<u8>> = (0..5).map(|i| key(i, 0)).collect();
        let states = |p: &HostPool| -> Vec<KeyState> { probe.iter().map(|k| p.state(k)).collect() };
        let before = (p.num_used(), p.num_held(), states(&p));
        // One free block, two candidates: refused; nothing changed but the offers counted.
        assert_eq!(p.prepare_store(&keys(&[key(3, 0), key(4, 0)])), None);
        assert_eq!((p.num_used(), p.num_held(), states(&p)), before);
        assert_eq!(p.counters().stores_refused, 2);
        stored(&mut p, &[key(2, 0)]);
        // key(2) offered with a new key is not evicted by its own offer; pinned key(0) and
        // storing key(1) are not either: no room.
        assert_eq!(p.prepare_store(&keys(&[key(2, 0), key(3, 0)])), None);
        p.check().unwrap();
    }

    #[test]
    fn admission_after_two_offers() {
        let mut p = HostPool::new(4, 2, HostEviction::Arc).unwrap();
        let k = [key(0, 0)];
        assert_eq!(
            p.prepare_store(&keys(&k)).unwrap().indices,
            Vec::<usize>::new()
        );
        assert_eq!(p.prepare_store(&keys(&k)).unwrap().indices, vec![0]);
        p.check().unwrap();
    }

    #[test]
    fn refused_calls_name_the_key_and_change_nothing() {
        let mut p = pool(3);
        stored(&mut p, &[key(0, 0)]);
        p.prepare_store(&keys(&[key(1, 0)])).unwrap();
        p.prepare_load(&keys(&[key(0, 0)])).unwrap();
        let snap = |p: &HostPool| {
            let s: Vec<KeyState> = (0..4).map(|i| p.state(&key(i, 0))).collect();
            (p.num_used(), p.num_held(), s, p.counters())
        };
        let before = snap(&p);
        let (k0, k1, k9) = (key(0, 0), key(1, 0), key(9, 0));
        let refused = |r: std::result::Result<(), KeyRefused>| r.unwrap_err();
        assert_eq!(
            p.prepare_load(&[&k0, &k9]).unwrap_err(),
            KeyRefused::at(1, KeyRefused::NOT_READABLE)
        );
        assert_eq!(p.prepare_load(&[&k1]).unwrap_err().index, 0);
        assert_eq!(refused(p.complete_load(&[&k0, &k0])).index, 1);
        assert_eq!(refused(p.complete_load(&[&k9])).reason, KeyRefused::NO_LOAD);
        assert_eq!(
            refused(p.complete_store(&[&k0], true)).reason,
            KeyRefused::NO_STORE
        );
        assert_eq!(refused(p.complete_store(&[&k1, &k1], true)).index, 1);
        assert_eq!(snap(&p), before);
        p.check().unwrap();
        p.complete_load(&[&k0]).unwrap();
        assert!(p.complete_load(&[&k0]).is_err());
        p.complete_store(&[&k1], true).unwrap();
        assert!(p.complete_store(&[&k1], true).is_err());
        p.check().unwrap();
    }

    #[test]
    fn reset_drops_everything_in_flight_and_keeps_the_counters() {
        let mut p = pool(2);
        stored(&mut p, &[key(0, 0)]);
        p.prepare_load(&keys(&[key(0, 0)])).unwrap();
        p.prepare_store(&keys(&[key(1, 0)])).unwrap();
        let counters = p.counters();
        p.reset();
        assert_eq!((p.num_used(), p.num_held(), p.counters()), (0, 0, counters));
        assert!(p.complete_load(&keys(&[key(0, 0)])).is_err());
        assert!(p.complete_store(&keys(&[key(1, 0)]), true).is_err());
        stored(&mut p, &[key(2, 0), key(3, 0)]);
    }

    #[test]
    fn the_check_finds_a_broken_held_count() {
        let mut p = pool(2);
        stored(&mut p, &[key(0, 0)]);
        p.prepare_load(&keys(&[key(0, 0)])).unwrap();
        p.check().unwrap();
        p.held = 0;
        assert!(p.check().unwrap_err().contains("held"));
        p.held = 1;
        p.load_pins[0] += 1;
        assert!(p.check().is_err());
    }
}
