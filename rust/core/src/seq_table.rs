//! The manager's sequence table: sequences stored in a slab (`Vec` of slots) with a small
//! id → slot index beside it.
//!
//! Why not one `HashMap<SeqId, Sequence>`: the batched scheduler step touches every running
//! sequence once per step. With the slab, the hash probe walks a dense map of 16-byte entries
//! (id, slot) instead of buckets the size of a whole sequence record, and a step can resolve
//! all its ids to slots first, then detect a sequence listed twice with a bit per slot rather
//! than a second hash set.

use crate::SeqId;

/// Slab of `T` keyed by [`SeqId`]. Slots of removed entries are reused (LIFO), so slot
/// numbers stay below the peak number of live sequences.
#[derive(Debug, Clone)]
pub(crate) struct SeqTable<T> {
    index: foldhash::HashMap<SeqId, u32>,
    slots: Vec<Option<(SeqId, T)>>,
    vacant: Vec<u32>,
}

impl<T> Default for SeqTable<T> {
    fn default() -> Self {
        Self {
            index: foldhash::HashMap::default(),
            slots: Vec::new(),
            vacant: Vec::new(),
        }
    }
}

impl<T> SeqTable<T> {
    /// Number of live entries.
    pub(crate) fn len(&self) -> usize {
        self.index.len()
    }

    /// Number of slots ever used (an upper bound for every slot number handed out).
    pub(crate) fn num_slots(&self) -> usize {
        self.slots.len()
    }

    pub(crate) fn contains_key(&self, id: &SeqId) -> bool {
        self.index.contains_key(id)
    }

    /// The slot of `id`, if present.
    pub(crate) fn slot_of(&self, id: SeqId) -> Option<u32> {
        self.index.get(&id).copied()
    }

    pub(crate) fn get(&self, id: &SeqId) -> Option<&T> {
        let slot = *self.index.get(id)?;
        self.slots[slot as usize].as_ref().map(|(_, v)| v)
    }

    pub(crate) fn get_mut(&mut self, id: &SeqId) -> Option<&mut T> {
        let slot = *self.index.get(id)?;
        self.slots[slot as usize].as_mut().map(|(_, v)| v)
    }

    /// The entry in `slot`. Panics if the slot is vacant (callers pass slots from
    /// [`Self::slot_of`] under the same lock).
    pub(crate) fn at_slot(&self, slot: u32) -> &T {
        &self.slots[slot as usize]
            .as_ref()
            .expect("slot resolved under the same lock")
            .1
    }

    /// The entry in `slot`, mutably. Panics like [`Self::at_slot`].
    pub(crate) fn at_slot_mut(&mut self, slot: u32) -> &mut T {
        &mut self.slots[slot as usize]
            .as_mut()
            .expect("slot resolved under the same lock")
            .1
    }

    /// Inserts `id`; the caller has checked it is absent.
    pub(crate) fn insert(&mut self, id: SeqId, value: T) {
        debug_assert!(!self.index.contains_key(&id));
        let slot = match self.vacant.pop() {
            Some(slot) => {
                self.slots[slot as usize] = Some((id, value));
                slot
            }
            None => {
                self.slots.push(Some((id, value)));
                u32::try_from(self.slots.len() - 1).expect("fewer than 2^32 sequences")
            }
        };
        self.index.insert(id, slot);
    }

    pub(crate) fn remove(&mut self, id: &SeqId) -> Option<T> {
        let slot = self.index.remove(id)?;
        self.vacant.push(slot);
        self.slots[slot as usize].take().map(|(_, v)| v)
    }

    /// Live entries in slot order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (&SeqId, &T)> {
        self.slots
            .iter()
            .filter_map(|e| e.as_ref().map(|(k, v)| (k, v)))
    }

    pub(crate) fn keys(&self) -> impl Iterator<Item = &SeqId> {
        self.iter().map(|(k, _)| k)
    }

    pub(crate) fn values(&self) -> impl Iterator<Item = &T> {
        self.iter().map(|(_, v)| v)
    }

    /// Live entries in slot order, mutably.
    pub(crate) fn values_mut(&mut self) -> impl Iterator<Item = &mut T> {
        self.slots
            .iter_mut()
            .filter_map(|e| e.as_mut().map(|(_, v)| v))
    }
}

impl<T> std::ops::Index<&SeqId> for SeqTable<T> {
    type Output = T;
    fn index(&self, id: &SeqId) -> &T {
        self.get(id).expect("known sequence id")
    }
}

/// The first id listed twice in `ids`, given each id's slot (`None` = unknown id). Known ids
/// are checked with one bit per slot; unknown ids (rare: that step fails anyway) by a scan.
pub(crate) fn duplicate_id(
    ids: &[SeqId],
    slots: &[Option<u32>],
    num_slots: usize,
) -> Option<SeqId> {
    let mut seen = vec![false; num_slots];
    let mut unknown_ids: Vec<SeqId> = Vec::new();
    for (&id, slot) in ids.iter().zip(slots) {
        let dup = match slot {
            Some(slot) => std::mem::replace(&mut seen[*slot as usize], true),
            None if unknown_ids.contains(&id) => true,
            None => {
                unknown_ids.push(id);
                false
            }
        };
        if dup {
            return Some(id);
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::SeqTable;

    #[test]
    fn insert_get_remove_reuses_slots() {
        let mut t = SeqTable::default();
        t.insert(10, "a");
        t.insert(20, "b");
        assert_eq!(t.len(), 2);
        assert_eq!(t.slot_of(10), Some(0));
        assert_eq!(t.slot_of(20), Some(1));
        assert_eq!(t.remove(&10), Some("a"));
        assert_eq!(t.remove(&10), None);
        assert!(!t.contains_key(&10));
        t.insert(30, "c");
        assert_eq!(t.slot_of(30), Some(0), "vacant slot reused");
        assert_eq!(t.num_slots(), 2);
        *t.at_slot_mut(1) = "B";
        assert_eq!(t[&20], "B");
        let live: Vec<_> = t.iter().map(|(k, v)| (*k, *v)).collect();
        assert_eq!(live, vec![(30, "c"), (20, "B")]);
        assert_eq!(t.get(&99), None);
    }
}
