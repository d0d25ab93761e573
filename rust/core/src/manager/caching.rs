//! Prefix caching in the KV cache manager: the memoised plain chain hashes per block-size class,
//! the per-group index keys derived from them, registration of full blocks by the retention
//! rule, and the `BlockStored` events of newly resolvable keys.

use super::*;
use std::sync::atomic::Ordering::Relaxed;

/// The first 8 bytes of a hash: what [`KvCacheManager`]'s parent records keep.
pub(super) fn key64(h: &BlockHash) -> u64 {
    u64::from_le_bytes(h.0[..8].try_into().expect("8 bytes"))
}

impl KvCacheManager {
    /// Tokens of `s` its block keys can cover: all but the last
    /// [`CacheConfig::hash_lookahead_tokens`] (each key also hashes that many tokens after its
    /// block), so logical block `j` has a key once `(j + 1) * bs <= hashable_len`.
    pub(super) fn hashable_len(&self, s: &Seq) -> usize {
        s.tokens
            .len()
            .saturating_sub(self.cfg.hash_lookahead_tokens as usize)
    }

    /// Plain chain hash of logical block `k` of block-size class `c` (memoised). With hash
    /// lookahead `la`, it covers the block's tokens and the `la` tokens after it (the caller
    /// keeps `k` below `hashable_len / bs`).
    pub(super) fn plain_at(&self, s: &mut Seq, c: usize, k: usize) -> BlockHash {
        let bs = self.class_bs[c];
        let la = self.cfg.hash_lookahead_tokens as usize;
        while s.chains[c].len() <= k {
            let j = s.chains[c].len();
            let keys = s.spec.block_keys(bs, j);
            let h = self.hasher.hash_block(
                s.chains[c].last(),
                &s.tokens[j * bs..(j + 1) * bs + la],
                &keys,
            );
            s.chains[c].push(h);
        }
        s.chains[c][k]
    }

    /// Index key of logical block `k` of group `g`: its plain hash (memoised) with the group
    /// id mixed in by [`Self::index_key`]. Not memoised per group: the mix is a few XORs,
    /// cheaper than keeping 32 bytes per block and group.
    pub(super) fn key_at(&self, s: &mut Seq, g: usize, k: usize) -> BlockHash {
        let plain = self.plain_at(s, self.class_of[g], k);
        self.index_key(plain, g as u32)
    }

    /// Caches every newly full computed block the fill-time rule selects, per group.
    /// Nothing while the sequence is [`SeqStatus::Loading`]: its staged blocks wait for
    /// [`KvCacheManager::commit_external`].
    pub(super) fn cache_full(&self, s: &mut Seq, ev: &mut Vec<Pending>, seen: bool) {
        if !self.cfg.enable_prefix_caching || s.stale_kv || s.status == SeqStatus::Loading {
            return;
        }
        for g in 0..self.num_groups() {
            let spec = self.cfg.groups[g];
            if spec.is_state() {
                continue; // published by commit_computed only (the commit fence)
            }
            let full = s.num_computed.min(s.tainted_from).min(self.hashable_len(s))
                / spec.block_size as usize;
            let start = s.tables[g].scanned;
            if full <= start {
                continue;
            }
            s.tables[g].scanned = full;
            if g == 0 && !spec.is_windowed() && !self.cfg.enable_events && self.host.is_none() {
                // Group 0's index keys are the plain hashes, and a full-attention table holds
                // no null entry: register the run straight from the memo and the table (no
                // per-call vectors; the one-group hot path).
                self.plain_at(s, self.class_of[0], full - 1);
                let c = self.class_of[0];
                let mut newly = Vec::with_capacity(full - start);
                let cached = self.pool.cache_blocks(
                    &s.tables[0].blocks[start..full],
                    &s.chains[c][start..full],
                    &mut newly,
                );
                debug_assert!(cached.is_ok(), "{cached:?}");
                for j in start..full {
                    let parent = if j == 0 {
                        0
                    } else {
                        key64(&s.chains[c][j - 1])
                    };
                    self.parents[s.tables[0].blocks[j] as usize].store(parent, Relaxed);
                }
                continue;
            }
            let picked: Vec<usize> = (start..full)
                .filter(|&j| {
                    s.tables[g].blocks[j] != NULL_BLOCK && self.registers_at_fill(&spec, j)
                })
                .collect();
            self.register(s, g, &picked, ev, seen);
        }
    }

    /// With sparse retention, caches the full blocks a windowed group still holds (the latest
    /// replayable point) before the sequence lets them go.
    pub(super) fn cache_latest(&self, s: &mut Seq, ev: &mut Vec<Pending>) {
        if !self.sparse() || s.status != SeqStatus::Running || s.stale_kv {
            return;
        }
        for g in 0..self.num_groups() {
            let spec = self.cfg.groups[g];
            if !spec.is_windowed() || spec.is_state() || !spec.prefix_cacheable {
                continue;
            }
            let full = s.num_computed.min(s.tainted_from).min(self.hashable_len(s))
                / spec.block_size as usize;
            let t = &s.tables[g];
            let picked: Vec<usize> = (t.live_from..full)
                .filter(|&j| t.blocks[j] != NULL_BLOCK && !self.pool.is_hashed(t.blocks[j]))
                .collect();
            self.register(s, g, &picked, ev, true);
        }
    }

    /// Registers logical blocks `picked` of group `g` under their keys; emits `BlockStored`
    /// (plain hashes, consecutive blocks in one event) for keys that became resolvable.
    /// With a host tier, notes them there too (`seen`: one use each for its admission; not
    /// for blocks re-registered without being computed or hit again).
    pub(super) fn register(
        &self,
        s: &mut Seq,
        g: usize,
        picked: &[usize],
        ev: &mut Vec<Pending>,
        seen: bool,
    ) {
        if picked.is_empty() {
            return;
        }
        let keys: Vec<BlockHash> = picked.iter().map(|&j| self.key_at(s, g, j)).collect();
        let blocks: Vec<BlockId> = picked.iter().map(|&j| s.tables[g].blocks[j]).collect();
        let mut newly = Vec::with_capacity(picked.len());
        let cached = self.pool.cache_blocks(&blocks, &keys, &mut newly);
        debug_assert!(cached.is_ok(), "{cached:?}");
        for (&j, &b) in picked.iter().zip(&blocks) {
            let parent = match j.checked_sub(1) {
                Some(p) => key64(&self.key_at(s, g, p)),
                None => 0,
            };
            self.parents[b as usize].store(parent, Relaxed);
        }
        if let Some(host) = self.host.as_ref() {
            self.host_note_registered(&mut host.lock(), s, g, picked, seen);
        }
        if !self.cfg.enable_events {
            return;
        }
        let spec = self.cfg.groups[g];
        let bs = spec.block_size as usize;
        let c = self.class_of[g];
        let mut pending: Option<(usize, KvEvent)> = None;
        for (i, &j) in picked.iter().enumerate() {
            if !newly[i] {
                continue;
            }
            let plain = self.plain_at(s, c, j);
            let toks = &s.tokens[j * bs..(j + 1) * bs];
            let keys_j = s.spec.block_keys(bs, j).into_owned();
            if let Some((
                last_j,
                KvEvent::BlockStored {
                    block_hashes,
                    token_ids,
                    extra_keys,
                    ..
                },
            )) = pending.as_mut()
            {
                if *last_j + 1 == j && *extra_keys == keys_j {
                    block_hashes.push(plain);
                    token_ids.extend_from_slice(toks);
                    *last_j = j;
                    self.note_owner(keys[i], g, plain, ev);
                    continue;
                }
            }
            if let Some((_, e)) = pending.take() {
                ev.push(Pending::Group(GroupEvent {
                    group: Some(g as u32),
                    event: e,
                }));
            }
            let parent = j.checked_sub(1).map(|p| s.chains[c][p]);
            pending = Some((
                j,
                KvEvent::BlockStored {
                    block_hashes: vec![plain],
                    parent_block_hash: parent,
                    token_ids: toks.to_vec(),
                    block_size: spec.block_size,
                    extra_keys: keys_j,
                    hash_root: Some(self.hasher.root()),
                    tier: Tier::Device,
                },
            ));
            self.note_owner(keys[i], g, plain, ev);
        }
        if let Some((_, e)) = pending {
            ev.push(Pending::Group(GroupEvent {
                group: Some(g as u32),
                event: e,
            }));
        }
    }

    /// Remembers which group and plain hash an index key stands for (read by
    /// [`Self::absorb`] when the pool reports the key removed).
    pub(super) fn note_owner(
        &self,
        key: BlockHash,
        g: usize,
        plain: BlockHash,
        ev: &mut Vec<Pending>,
    ) {
        ev.push(Pending::Owner(key, g as u32, plain));
    }
}
