//! The prefix cache's host tier under the KV cache manager (docs/design.md, "Host tier"): one [`HostTier`] of host blocks shared by every group, keyed by
//! [`HostKey`] `(plain chain hash, group)`, so a full-attention block and a sliding-window
//! block of the same tokens are different host entries.
//!
//! What groups add to one full-attention group's use of the tier (store events, pins and
//! hand-out are the same, `crate::manager`):
//! - **Store.** Each cached block the pool evicts (the last copy of its index key) is offered
//!   to the tier under the `(plain hash, group)` it was registered with ([`HostSide::dev_key`]).
//! - **Lookup.** A block of group `g` is *served* when the device holds its key or the host
//!   holds `(plain, g)`; the device lookup's rule (full attention: every block up to the hit;
//!   a windowed group: the blocks holding `[first_read(p), p)`) runs unchanged over that
//!   predicate, so a window group's host hit loads only its in-window blocks.
//! - **Load.** A host hit ([`HOST_HIT`] in a plan's table) takes one fresh device block, counted
//!   in `take`, gets a planned `(host, device)` copy of its group and is registered on the
//!   device at once; its host block is pinned and the device block holds one reference until
//!   the plans are handed out, as with one group.

use super::{
    GroupAllocation, GroupEvent, GroupPlan, GroupTable, KvCacheManager, Pending, Seq, Sim, VIRTUAL,
};
use crate::error::Result;
use crate::events::KvEvent;
use crate::hashing::BlockHash;
use crate::host_tier::{
    hand_out_host_plans, host_store_events, pin_host_hits, BlockMeta, HostKey, HostTier,
    HostTransfers,
};
use crate::pool::BlockPool;
use crate::BlockId;

/// Marks a host hit in a plan's table prefix (a device block is allocated for it); never a
/// real id (ids are below 2^28).
pub(super) const HOST_HIT: BlockId = u32::MAX - 1;

/// The planned host copies of the KV cache manager, handed out once per step: like
/// [`HostTransfers`] with the KV cache group of each copy (the executor copies between that
/// group's device cache and its host cache).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GroupHostTransfers {
    /// `(group, device block, host block)` stores: run first in a step.
    pub stores: Vec<(u32, BlockId, BlockId)>,
    /// `(group, host block, device block)` loads: run after stores and swaps, before
    /// copy-on-write and the forward pass.
    pub loads: Vec<(u32, BlockId, BlockId)>,
}

/// The host tier and what the KV cache manager keeps beside it (under its own mutex, taken
/// after the state lock).
#[derive(Debug)]
pub(super) struct HostSide {
    pub(super) tier: HostTier,
    /// Per device block, the host key of the `(plain hash, group)` it is registered under
    /// (set when the block is registered; read when the pool evicts it).
    pub(super) dev_key: Vec<Option<HostKey>>,
    /// The group of each planned load, in planning order (the tier's load plans carry block
    /// ids only; its stores carry their key's group).
    load_groups: Vec<u32>,
}

impl HostSide {
    pub(super) fn new(tier: HostTier, num_device_blocks: u32) -> Self {
        Self {
            tier,
            dev_key: vec![None; num_device_blocks as usize],
            load_groups: Vec::new(),
        }
    }

    /// Hands out the planned copies with their groups and drops the loads' device references.
    pub(super) fn hand_out(&mut self, pool: &BlockPool) -> GroupHostTransfers {
        let (HostTransfers { stores, loads }, store_groups) =
            hand_out_host_plans(pool, &mut self.tier);
        debug_assert_eq!(loads.len(), self.load_groups.len());
        GroupHostTransfers {
            stores: store_groups
                .into_iter()
                .zip(stores)
                .map(|(g, (d, h))| (g, d, h))
                .collect(),
            loads: self
                .load_groups
                .drain(..)
                .zip(loads)
                .map(|(g, (h, d))| (g, h, d))
                .collect(),
        }
    }

    /// Plans the load of pinned host block `h` into device block `d` of group `g`.
    pub(super) fn plan_load(&mut self, g: u32, h: BlockId, d: BlockId) {
        self.tier.plan_load(h, d);
        self.load_groups.push(g);
    }

    /// Drops every key of both the tier and the device-block map (prefix cache reset).
    pub(super) fn clear(&mut self) {
        self.tier.clear();
        self.dev_key.fill(None);
    }
}

impl KvCacheManager {
    /// The host key of logical block `k` of group `g`.
    pub(super) fn host_key_at(&self, s: &mut Seq, g: usize, k: usize) -> HostKey {
        HostKey::new(self.plain_at(s, self.class_of[g], k), g as u32)
    }

    /// Whether the host tier holds logical block `k` of group `g` (false without a tier).
    /// In a demand simulation whose earlier members' stores may have evicted host entries
    /// ([`Sim::host_unsure`]), none is counted on: a shorter hit never needs fewer blocks, so
    /// `num_blocks_owed` stays an upper bound (exact while no store can evict).
    pub(super) fn on_host(
        &self,
        host: Option<&HostSide>,
        s: &mut Seq,
        g: usize,
        k: usize,
        sim: &Sim<'_>,
    ) -> bool {
        match host {
            Some(_) if sim.host_unsure => false,
            Some(h) => {
                let key = self.host_key_at(s, g, k);
                h.tier.lookup(&key).is_some()
            }
            None => false,
        }
    }

    /// Past the `n` leading blocks of group `g` served already, the blocks up to `max` that
    /// either tier serves (device first), stopping at the first neither holds. Returns the new
    /// count. Out of line: without a host tier the lookup never comes here.
    #[cold]
    #[inline(never)]
    pub(super) fn served_from(
        &self,
        host: Option<&HostSide>,
        s: &mut Seq,
        g: usize,
        mut n: usize,
        max: usize,
        sim: &Sim<'_>,
    ) -> usize {
        while n < max {
            let key = self.key_at(s, g, n);
            if sim.lookup(&key).is_none() && !self.on_host(host, s, g, n, sim) {
                break;
            }
            n += 1;
        }
        n
    }

    /// Allocates `n` device blocks; with a host tier, each cached block the allocation evicts
    /// (its key's last device copy) is offered to the tier for a store, with the tier's events
    /// (group named) appended to `ev`.
    pub(super) fn allocate_storing(
        &self,
        n: usize,
        host: Option<&mut HostSide>,
        ev: &mut Vec<Pending>,
    ) -> Result<Vec<BlockId>> {
        let Some(host) = host else {
            return self.pool.allocate(n);
        };
        let mut out = Vec::with_capacity(n);
        let mut evicted = Vec::new();
        self.pool
            .allocate_into_reporting(n, &mut out, &mut evicted)?;
        // The device's `BlockRemoved` first, then the host tier's events.
        self.drain_pool(ev);
        for (d, _) in evicted {
            let Some(key) = host.dev_key[d as usize].take() else {
                continue;
            };
            let got = host.tier.plan_store(d, key);
            if self.cfg.enable_events {
                let bs = self.cfg.groups[key.group as usize].block_size;
                let root = self.hasher.root();
                for e in host_store_events(&host.tier, &got, key, bs, root) {
                    let group = match &e {
                        KvEvent::BlockRemoved { .. } => got.evicted.map(|k| k.group),
                        _ => Some(key.group),
                    };
                    ev.push(Pending::Group(GroupEvent { group, event: e }));
                }
            }
        }
        Ok(out)
    }

    /// The host tier's bookkeeping of blocks `picked` of group `g` just registered: their keys
    /// (for a later store), the step they were registered in (with event metadata), and, when
    /// `seen`, one use each for admission.
    pub(super) fn host_note_registered(
        &self,
        host: &mut HostSide,
        s: &mut Seq,
        g: usize,
        picked: &[usize],
        seen: bool,
    ) {
        let c = self.class_of[g];
        let bs = self.cfg.groups[g].block_size as usize;
        for &j in picked {
            let b = s.tables[g].blocks[j];
            let key = self.host_key_at(s, g, j);
            // A block keeps its first hash: only one registered under this key is mapped.
            if self.pool.block_hash(b) == Some(self.key_at(s, g, j)) {
                host.dev_key[b as usize] = Some(key);
            }
            let meta = host.tier.keeps_meta().then(|| BlockMeta {
                parent: j.checked_sub(1).map(|p| s.chains[c][p]),
                tokens: s.tokens[j * bs..(j + 1) * bs].into(),
                extra_keys: s.spec.block_keys(bs, j).into_owned(),
            });
            host.tier.note_registered(b, meta);
            if seen {
                host.tier.note_seen(key);
            }
        }
    }

    /// Pins the host block of every [`HOST_HIT`] in a first allocation's plan (before the
    /// allocation, whose evictions may store to the tier: a pinned block is never a store's
    /// destination). Returns `(group, logical block, host block)` per host hit, group by group
    /// in table order. Errors: none in practice (the hits were looked up under the same lock).
    pub(super) fn pin_loads(
        &self,
        host: &mut HostSide,
        s: &mut Seq,
        groups: &[GroupPlan],
    ) -> Result<Vec<(u32, usize, BlockId)>> {
        let mut loads = Vec::new();
        for (g, gp) in groups.iter().enumerate() {
            for (j, &b) in gp.hits.iter().enumerate() {
                if b == HOST_HIT {
                    let key = self.host_key_at(s, g, j);
                    let h = host.tier.lookup(&key).expect("planned host hit");
                    loads.push((g as u32, j, h));
                }
            }
        }
        let pins: Vec<(usize, BlockId)> = loads.iter().map(|&(_, j, h)| (j, h)).collect();
        pin_host_hits(Some(&mut host.tier), &pins)?;
        Ok(loads)
    }

    /// After the allocation: plans each host hit's load into the device block now in its
    /// table slot (one reference held on it until the hand-out), registers the loaded blocks
    /// on the device (their KV is there once the load runs, before the forward pass) and, when
    /// the lookup is counted, adds the tokens from the first loaded block on to
    /// `host_hits_tokens`.
    pub(super) fn finish_loads(
        &self,
        s: &mut Seq,
        loads: &[(u32, usize, BlockId)],
        counted: bool,
        ev: &mut Vec<Pending>,
    ) -> Result<()> {
        let mut dst = Vec::with_capacity(loads.len());
        {
            let mut host = self.host.as_ref().expect("host hits need a tier").lock();
            for &(g, j, h) in loads {
                let d = s.tables[g as usize].blocks[j];
                host.plan_load(g, h, d);
                dst.push(d);
            }
        }
        self.pool.incref(&dst)?;
        for g in 0..self.num_groups() {
            let picked: Vec<usize> = loads
                .iter()
                .filter(|l| l.0 as usize == g)
                .map(|l| l.1)
                .collect();
            self.register(s, g, &picked, ev, false);
        }
        if counted {
            let first = loads
                .iter()
                .map(|&(g, j, _)| j * self.cfg.groups[g as usize].block_size as usize)
                .min()
                .unwrap_or(s.num_computed);
            let hit = s.last_context;
            self.counters.lock().host_hits_tokens += hit.saturating_sub(first) as u64;
        }
        Ok(())
    }

    /// Counts one use, for admission, of every block a first allocation's prefix hit of
    /// `context` tokens serves (both tiers), in every group.
    pub(super) fn note_hits_seen(&self, s: &mut Seq, context: usize) {
        let Some(host) = self.host.as_ref() else {
            return;
        };
        let mut keys = Vec::new();
        for g in 0..self.num_groups() {
            let (lo, hi) = self.cfg.groups[g].hit_blocks(context);
            for j in lo..hi {
                keys.push(self.host_key_at(s, g, j));
            }
        }
        let mut host = host.lock();
        for key in keys {
            host.tier.note_seen(key);
        }
    }

    /// For [`Self::num_blocks_owed`]: the blocks a member's host hits are loaded into are
    /// registered (in use) for the members after it, as [`Self::finish_loads`] does.
    pub(super) fn sim_register_loads(
        &self,
        s: &mut Seq,
        g: usize,
        hits: &[BlockId],
        sim: &mut Sim<'_>,
    ) {
        for (j, &b) in hits.iter().enumerate() {
            if b == HOST_HIT {
                let key = self.key_at(s, g, j);
                sim.registered.entry(key).or_default().push(VIRTUAL);
            }
        }
    }

    /// The host tier's part of [`Self::check_invariants`]: the tier's own invariants
    /// ([`HostTier::check`], which covers the stores' groups); one group per planned load;
    /// each planned load holds
    /// one reference on its destination (added to `gpu_refs`), which carries the loaded
    /// block's index key in the device prefix index; every hashed device block's host key
    /// gives back its index key.
    pub(super) fn check_host(
        &self,
        host: &HostSide,
        gpu_refs: &mut std::collections::HashMap<BlockId, u32>,
    ) -> std::result::Result<(), String> {
        let n = self.cfg.num_blocks;
        host.tier.check(|d| d != crate::NULL_BLOCK && d < n)?;
        let loads = host.tier.pending().1;
        if loads.len() != host.load_groups.len() {
            return Err("planned host loads and their groups disagree in number".into());
        }
        for (&(h, d), &g) in loads.iter().zip(&host.load_groups) {
            *gpu_refs.entry(d).or_insert(0) += 1;
            if let Some(key) = host.tier.key_of(h) {
                let want = self.index_key(key.hash, key.group);
                if key.group != g || self.pool.block_hash(d) != Some(want) {
                    return Err(format!(
                        "planned load ({h}, {d}) of group {g}: the device block does not carry \
                         the host block's key"
                    ));
                }
            }
        }
        for b in 1..n {
            let Some(hash) = self.pool.block_hash(b) else {
                continue;
            };
            match host.dev_key[b as usize] {
                Some(k) if self.index_key(k.hash, k.group) == hash => {}
                other => {
                    return Err(format!(
                        "device block {b} is cached but its host key is {other:?}"
                    ))
                }
            }
        }
        Ok(())
    }

    /// The index key group `g` gives plain hash `plain` (as [`Self::key_at`] derives it): the
    /// plain hash with `g` XORed into bytes 0..4 (inside the 16 bytes the prefix index
    /// fingerprints) and 16..20 (zero in every xxh3-128 hash, so no two groups' xxh3 keys can
    /// be equal; for SHA-256 two keys of different groups agree only on a 224-bit partial
    /// collision). The group id joins the hash as vLLM's `BlockHashWithGroupId` appends it,
    /// without a second hash per block and group (that was most of a hybrid admission's CPU).
    pub(super) fn index_key(&self, plain: BlockHash, g: u32) -> BlockHash {
        let mut key = plain;
        for (i, b) in g.to_le_bytes().into_iter().enumerate() {
            key.0[i] ^= b;
            key.0[16 + i] ^= b;
        }
        key
    }
}

/// Puts a fresh block from `fresh` in every [`HOST_HIT`] slot of a first allocation's table
/// (the loads' destinations, taken before the group's copy-on-write and fresh blocks) and
/// reports them as newly taken.
pub(super) fn take_load_blocks(
    t: &mut GroupTable,
    ga: &mut GroupAllocation,
    fresh: &mut impl Iterator<Item = BlockId>,
) {
    for b in t.blocks.iter_mut().filter(|b| **b == HOST_HIT) {
        *b = fresh.next().expect("allocated");
        ga.new_block_ids.push(*b);
    }
}
