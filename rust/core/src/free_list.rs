//! Lock-free LIFO of block ids: a tagged Treiber stack.
//!
//! Algorithm: R. K. Treiber, "Systems Programming: Coping with Parallelism", IBM Research
//! Report RJ 5118, 1986 — a singly linked stack whose head is swung with compare-and-swap.
//! The classic Treiber stack suffers from ABA: thread T reads head = A and A.next = B, other
//! threads pop A, pop B and push A back, and T's CAS(head: A → B) still succeeds, installing B,
//! which is no longer free. The fix used here is the tagged (counted) pointer of IBM System/370
//! and of heapless' `Treiber` pool: the head word packs the top index together with a
//! generation counter that every successful CAS increments, so T's CAS compares (A, g) against
//! (A, g + 3) and fails. Because the nodes are block ids into a fixed array, not heap pointers,
//! no memory is ever reclaimed and no hazard pointers or epochs are needed.
//!
//! Layout: `head: AtomicU64 = generation << 32 | top_id` (id 0 = empty, which is free because
//! the null block 0 is never pushed) and `next: [AtomicU32; capacity]`, one link per block id.
//! The links are atomics because a stale popper may read `next[A]` while a pusher rewrites it;
//! the read value is then discarded by the failing CAS.
//!
//! Progress: `push` and `pop` are lock-free (some thread's CAS succeeds in every round of
//! contention), not wait-free (a single thread may retry while others keep winning).
//! The 32-bit generation wraps after 2^32 successful operations; ABA would need a thread to
//! stall between its load and its CAS for exactly a multiple of 2^32 other operations.

use crate::sync::{AtomicU32, AtomicU64, Ordering};
use crate::BlockId;

/// Marks "no block" in the head and in links. Block 0 (the null block) is never stored.
const EMPTY: BlockId = 0;

#[inline]
fn pack(generation: u32, top: BlockId) -> u64 {
    (u64::from(generation) << 32) | u64::from(top)
}

#[inline]
fn unpack(word: u64) -> (u32, BlockId) {
    ((word >> 32) as u32, word as u32)
}

/// A lock-free LIFO stack of block ids in `1..capacity` (tagged Treiber stack, ABA-safe).
///
/// The stack does not check membership: the caller (the block pool) guarantees that an id is
/// pushed only while it is not already in the stack. It keeps no length; the pool tracks
/// capacity with its own free counter.
#[derive(Debug)]
pub struct FreeStack {
    /// `generation << 32 | top id`; top id 0 = empty.
    head: AtomicU64,
    /// `next[id]` = the id below `id` in the stack (0 = bottom). Index 0 unused.
    next: Box<[AtomicU32]>,
}

/// Outcome of one pop attempt against a given head snapshot (see [`FreeStack::try_pop_from`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PopAttempt {
    /// The stack was empty in the snapshot.
    Empty,
    /// The CAS succeeded; the id is now owned by the caller.
    Popped(BlockId),
    /// The head changed since the snapshot (another push/pop won); holds the current head.
    Retry(u64),
}

impl FreeStack {
    /// An empty stack able to hold ids `1..capacity`. O(capacity); a constructor.
    pub fn new(capacity: u32) -> Self {
        let next = (0..capacity).map(|_| AtomicU32::new(EMPTY)).collect();
        Self {
            head: AtomicU64::new(pack(0, EMPTY)),
            next,
        }
    }

    /// Number of id slots (`capacity` passed to [`FreeStack::new`]); valid ids are `1..capacity`.
    /// Wait-free (no shared state read).
    pub fn capacity(&self) -> u32 {
        self.next.len() as u32
    }

    /// Pushes `id` on top. Lock-free: one CAS per attempt, retried only when another thread
    /// changed the head in between.
    ///
    /// The caller must own `id` (it is not in the stack) and `id` must be in `1..capacity`;
    /// the pool validates ids before calling. Out-of-range or null ids are ignored, so no input
    /// can corrupt the stack.
    pub fn push(&self, id: BlockId) {
        let Some(link) = self.next.get(id as usize).filter(|_| id != EMPTY) else {
            return;
        };
        let mut head = self.head.load(Ordering::Relaxed);
        loop {
            let (generation, top) = unpack(head);
            link.store(top, Ordering::Relaxed);
            // Release: the link store above (and the caller's writes to the block) become
            // visible to the thread whose Acquire pop takes `id`.
            match self.head.compare_exchange_weak(
                head,
                pack(generation.wrapping_add(1), id),
                Ordering::Release,
                Ordering::Relaxed,
            ) {
                Ok(_) => return,
                Err(current) => {
                    head = current;
                    crate::sync::spin_hint();
                }
            }
        }
    }

    /// Pushes `ids` as if pushed one by one in order (so `ids.last()` ends on top), with a
    /// single successful CAS: the ids are linked to each other privately first (the caller
    /// owns them), then the chain is spliced onto the head. Lock-free, like [`FreeStack::push`].
    /// O(len). Ids must be distinct and owned by the caller; if any id is null or out of range,
    /// the ids are pushed one by one instead (invalid ones ignored).
    pub fn push_many(&self, ids: &[BlockId]) {
        let cap = self.capacity();
        if ids.iter().any(|&id| id == EMPTY || id >= cap) {
            ids.iter().for_each(|&id| self.push(id));
            return;
        }
        let (Some(&bottom), Some(&top)) = (ids.first(), ids.last()) else {
            return;
        };
        for pair in ids.windows(2) {
            self.next[pair[1] as usize].store(pair[0], Ordering::Relaxed);
        }
        let bottom_link = &self.next[bottom as usize];
        let mut head = self.head.load(Ordering::Relaxed);
        loop {
            let (generation, old_top) = unpack(head);
            bottom_link.store(old_top, Ordering::Relaxed);
            // Release publishes every link written above to the thread that pops them.
            match self.head.compare_exchange_weak(
                head,
                pack(generation.wrapping_add(1), top),
                Ordering::Release,
                Ordering::Relaxed,
            ) {
                Ok(_) => return,
                Err(current) => {
                    head = current;
                    crate::sync::spin_hint();
                }
            }
        }
    }

    /// Pops the top id, or `None` if the stack is empty. Lock-free (see [`FreeStack::push`]).
    pub fn pop(&self) -> Option<BlockId> {
        let mut head = self.load_head();
        loop {
            match self.try_pop_from(head) {
                PopAttempt::Empty => return None,
                PopAttempt::Popped(id) => return Some(id),
                PopAttempt::Retry(current) => {
                    head = current;
                    crate::sync::spin_hint();
                }
            }
        }
    }

    /// Pops up to `max` ids with a single successful CAS and appends them to `out` in the order
    /// that many [`FreeStack::pop`] calls would return them (top first). Returns how many were
    /// popped: fewer than `max` only when the stack held fewer. Lock-free, like `pop`. O(max).
    pub fn pop_many(&self, max: usize, out: &mut Vec<BlockId>) -> usize {
        if max == 0 {
            return 0;
        }
        let mut head = self.load_head();
        loop {
            match self.try_pop_many_from(head, max, out) {
                Ok(taken) => return taken,
                Err(current) => {
                    head = current;
                    crate::sync::spin_hint();
                }
            }
        }
    }

    /// One batch-pop attempt against the head snapshot `head`: walks up to `max` links down
    /// from the snapshot's top, then CASes the head past them. On success appends the ids to
    /// `out` (top first) and returns how many (0 when the snapshot was empty); on failure
    /// appends nothing and returns the current head. The walk is trusted only when the CAS
    /// succeeds: the tagged head then proves that no push or pop happened since the snapshot
    /// (each bumps the generation), so every link read belonged to the stack as it was. Like
    /// [`FreeStack::try_pop_from`], exposed so tests can replay a stale snapshot. Wait-free
    /// (`max` loads, one CAS).
    pub fn try_pop_many_from(
        &self,
        head: u64,
        max: usize,
        out: &mut Vec<BlockId>,
    ) -> Result<usize, u64> {
        let start = out.len();
        let (generation, top) = unpack(head);
        let mut cur = top;
        while cur != EMPTY && out.len() - start < max {
            out.push(cur);
            // A stale snapshot may read links being rewritten; the CAS below then fails.
            cur = self
                .next
                .get(cur as usize)
                .map_or(EMPTY, |l| l.load(Ordering::Relaxed));
        }
        let taken = out.len() - start;
        if taken == 0 {
            return Ok(0);
        }
        // Acquire on success pairs with the Release of the pushes that linked the chain.
        match self.head.compare_exchange(
            head,
            pack(generation.wrapping_add(1), cur),
            Ordering::Acquire,
            Ordering::Acquire,
        ) {
            Ok(_) => Ok(taken),
            Err(current) => {
                out.truncate(start);
                Err(current)
            }
        }
    }

    /// Snapshot of the tagged head word (`generation << 32 | top`). Wait-free (one load).
    /// Exposed with [`FreeStack::try_pop_from`] so tests can replay the ABA interleaving
    /// deterministically.
    pub fn load_head(&self) -> u64 {
        self.head.load(Ordering::Acquire)
    }

    /// One pop attempt against the head snapshot `head`: reads the link below the snapshot's
    /// top and CASes the head from `head` to (generation + 1, link). Wait-free (one load, one
    /// CAS). A stale snapshot always fails, even when the same id is on top again, because the
    /// generation differs: this is the ABA protection.
    pub fn try_pop_from(&self, head: u64) -> PopAttempt {
        let (generation, top) = unpack(head);
        let Some(link) = self.next.get(top as usize).filter(|_| top != EMPTY) else {
            return PopAttempt::Empty;
        };
        // May be stale if `top` was popped and re-pushed meanwhile; the CAS then fails.
        let below = link.load(Ordering::Relaxed);
        // Acquire on success pairs with the Release of the push that installed `top`.
        // Strong CAS: a failure always means the head really changed (deterministic replays).
        match self.head.compare_exchange(
            head,
            pack(generation.wrapping_add(1), below),
            Ordering::Acquire,
            Ordering::Acquire,
        ) {
            Ok(_) => PopAttempt::Popped(top),
            Err(current) => PopAttempt::Retry(current),
        }
    }

    /// The ids from top to bottom. Only meaningful while no other thread pushes or pops (tests,
    /// invariant checks); bounded by `capacity` steps so a concurrent change cannot loop it.
    /// Wait-free (bounded loads, no retries). O(len).
    pub fn snapshot(&self) -> Vec<BlockId> {
        let mut out = Vec::new();
        let (_, mut cur) = unpack(self.load_head());
        while cur != EMPTY && out.len() < self.next.len() {
            out.push(cur);
            cur = self
                .next
                .get(cur as usize)
                .map_or(EMPTY, |l| l.load(Ordering::Acquire));
        }
        out
    }

    /// Whether the stack is empty right now. Wait-free.
    pub fn is_empty(&self) -> bool {
        unpack(self.load_head()).1 == EMPTY
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn lifo_order() {
        let s = FreeStack::new(5);
        assert_eq!(s.pop(), None);
        for id in [1, 2, 3] {
            s.push(id);
        }
        assert_eq!(s.snapshot(), vec![3, 2, 1]);
        assert_eq!(s.pop(), Some(3));
        s.push(4);
        assert_eq!(s.pop(), Some(4));
        assert_eq!(s.pop(), Some(2));
        assert_eq!(s.pop(), Some(1));
        assert_eq!(s.pop(), None);
        assert!(s.is_empty());
    }

    #[test]
    fn push_many_equals_pushes_in_order() {
        let s = FreeStack::new(8);
        s.push(7);
        s.push_many(&[1, 2, 3]);
        assert_eq!(s.snapshot(), vec![3, 2, 1, 7]);
        assert_eq!(unpack(s.load_head()).0, 2, "one CAS for the whole batch");
        s.push_many(&[]);
        s.push_many(&[0, 5, 9]); // invalid ids: one by one, invalid ignored
        assert_eq!(s.snapshot(), vec![5, 3, 2, 1, 7]);
        assert_eq!(s.pop(), Some(5));
        assert_eq!(s.pop(), Some(3));
    }

    #[test]
    fn pop_many_equals_pops_in_order() {
        let s = FreeStack::new(10);
        for id in [4, 9, 2, 7, 1] {
            s.push(id);
        }
        let mut out = vec![42];
        assert_eq!(s.pop_many(3, &mut out), 3);
        assert_eq!(
            out,
            vec![42, 1, 7, 2],
            "appended top first after what out held"
        );
        assert_eq!(unpack(s.load_head()), (6, 9), "one CAS for the whole batch");
        assert_eq!(s.pop_many(0, &mut out), 0);
        assert_eq!(s.pop_many(5, &mut out), 2, "only two left");
        assert_eq!(out, vec![42, 1, 7, 2, 9, 4]);
        assert!(s.is_empty());
        assert_eq!(s.pop_many(4, &mut out), 0);
        assert_eq!(out.len(), 6);
        s.push(3);
        assert_eq!(s.pop(), Some(3));
    }

    /// A batch pop whose snapshot went stale (another thread popped 1 and 2 and pushed 1 back:
    /// same top id, new generation) fails without touching `out`, and must not install the
    /// link it read from the old chain (2, now owned elsewhere).
    #[test]
    fn stale_batch_pop_fails_aba() {
        let s = FreeStack::new(6);
        for id in [5, 4, 3, 2, 1] {
            s.push(id);
        }
        let stale = s.load_head();
        assert_eq!(s.pop(), Some(1));
        assert_eq!(s.pop(), Some(2));
        s.push(1);
        let mut out = vec![9];
        let current = s.try_pop_many_from(stale, 2, &mut out).unwrap_err();
        assert_eq!(out, vec![9], "a failed attempt appends nothing");
        assert_eq!(current, s.load_head());
        assert_eq!(s.try_pop_many_from(current, 2, &mut out), Ok(2));
        assert_eq!(out, vec![9, 1, 3]);
        assert_eq!(s.snapshot(), vec![4, 5], "2 must not reappear in the stack");
    }

    #[test]
    fn generation_counts_every_successful_operation() {
        let s = FreeStack::new(4);
        s.push(1);
        s.push(2);
        assert_eq!(s.pop(), Some(2));
        assert_eq!(unpack(s.load_head()), (3, 1));
    }

    /// The ABA interleaving replayed deterministically: T1 snapshots head (A on top, B below),
    /// then "other threads" pop A, pop B and push A. T1's CAS with the stale snapshot must fail;
    /// an untagged stack would install B as the head although B is now owned elsewhere.
    #[test]
    fn stale_head_after_pop_pop_push_fails_aba() {
        let s = FreeStack::new(5);
        s.push(3); // C
        s.push(2); // B
        s.push(1); // A on top: stack A, B, C
        let stale = s.load_head();
        assert_eq!(unpack(stale).1, 1);

        assert_eq!(s.pop(), Some(1));
        assert_eq!(s.pop(), Some(2)); // B now owned by "thread 2"
        s.push(1); // A back on top, its link now points at C
        assert_eq!(
            unpack(s.load_head()).1,
            1,
            "same top id as the stale snapshot"
        );

        match s.try_pop_from(stale) {
            PopAttempt::Retry(current) => {
                assert_eq!(current, s.load_head());
                assert_eq!(s.try_pop_from(current), PopAttempt::Popped(1));
            }
            other => panic!("stale CAS must fail, got {other:?}"),
        }
        assert_eq!(s.snapshot(), vec![3], "B must not reappear in the stack");
    }

    #[test]
    fn null_and_out_of_range_push_are_ignored() {
        let s = FreeStack::new(3);
        s.push(0);
        s.push(3);
        assert!(s.is_empty());
        s.push(2);
        assert_eq!(s.snapshot(), vec![2]);
    }
}
