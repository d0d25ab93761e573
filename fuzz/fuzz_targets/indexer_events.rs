//! Fuzz target `indexer_events`: arbitrary vLLM wire events (value trees as a binding hands
//! them over) read by `kv_indexer::vllm_event::parse_event`, and arbitrary batches of two
//! incarnations of one worker applied to a `KvIndexer`. Checks:
//! - reading never panics, and an event it accepts is a `KvEvent` whose `BlockStored` has no
//!   more hashes than the wire event named;
//! - a batch the indexer refuses (`Err`) or calls stale changes nothing (hashes, status);
//! - set semantics: for an `engine` worker delivered in order, the indexer holds exactly the
//!   model set (stores insert, removals delete, a clear empties), however often a block is
//!   re-announced;
//! - after the worker is re-added, the old incarnation's batches are always `Stale`.

#![no_main]

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use pagedkv_core::events::KvEvent;
use pagedkv_core::kv_indexer::vllm_event::{parse_event, WireValue};
use pagedkv_core::{BatchOutcome, BlockHash, HashSource, KvIndexer, PrefixHasher};
use std::collections::BTreeSet;

/// Arbitrary-derivable mirror of [`WireValue`] (bounded depth via `arbitrary`'s size limit).
#[derive(Arbitrary, Debug, Clone)]
enum Value {
    Nil,
    Bool(bool),
    Int(i64),
    Float(f64),
    Str(String),
    Bytes(Vec<u8>),
    List(Vec<Value>),
}

impl Value {
    fn wire(&self) -> WireValue {
        match self {
            Value::Nil => WireValue::Nil,
            Value::Bool(b) => WireValue::Bool(*b),
            Value::Int(i) => WireValue::Int(i128::from(*i)),
            Value::Float(x) => WireValue::Float(*x),
            Value::Str(s) => WireValue::Str(s.clone()),
            Value::Bytes(b) => WireValue::Bytes(b.clone()),
            Value::List(v) => WireValue::List(v.iter().map(Value::wire).collect()),
        }
    }
}

/// A well-formed event over a small hash space, so stores and removals meet.
#[derive(Arbitrary, Debug, Clone)]
enum Op {
    Stored(Vec<u8>),
    Removed(Vec<u8>),
    Cleared,
    /// A raw wire event (mostly malformed).
    Raw(Value),
}

#[derive(Arbitrary, Debug)]
struct Input {
    raw: Vec<Value>,
    batches: Vec<Vec<Op>>,
    /// Batch index after which the worker is removed and re-added.
    restart_at: u8,
}

fn hash(i: u8) -> WireValue {
    WireValue::Int(i128::from(i % 16) + 1)
}

fn wire_op(op: &Op) -> WireValue {
    let s = |t: &str| WireValue::Str(t.into());
    match op {
        Op::Stored(hs) => WireValue::List(vec![
            s("BlockStored"),
            WireValue::List(hs.iter().map(|&h| hash(h)).collect()),
            WireValue::Nil,
            WireValue::List(vec![]),
            WireValue::Int(4),
        ]),
        Op::Removed(hs) => WireValue::List(vec![
            s("BlockRemoved"),
            WireValue::List(hs.iter().map(|&h| hash(h)).collect()),
        ]),
        Op::Cleared => WireValue::List(vec![s("AllBlocksCleared")]),
        Op::Raw(v) => v.wire(),
    }
}

fn key(i: u8) -> BlockHash {
    let mut out = [0u8; 32];
    out[..16].copy_from_slice(&(i128::from(i % 16) + 1).to_le_bytes());
    BlockHash(out)
}

fuzz_target!(|input: Input| {
    for (i, v) in input.raw.iter().enumerate() {
        let w = v.wire();
        if let Ok(Some(KvEvent::BlockStored { block_hashes, .. })) = parse_event(&w, i, None) {
            let named = match &w {
                WireValue::List(f) => match f.get(1) {
                    Some(WireValue::List(h)) => h.len(),
                    _ => usize::MAX,
                },
                _ => usize::MAX,
            };
            assert!(block_hashes.len() <= named);
        }
    }
    let mut ix = KvIndexer::new(4, PrefixHasher::default(), 0).unwrap();
    let mut inc = ix.add_worker(1, HashSource::Engine).unwrap();
    let mut old: Option<u64> = None;
    let mut model: BTreeSet<BlockHash> = BTreeSet::new();
    let mut seq = 0u64;
    for (b, ops) in input.batches.iter().enumerate().take(64) {
        if b == usize::from(input.restart_at) {
            assert!(ix.remove_worker(1));
            old = Some(inc);
            inc = ix.add_worker(1, HashSource::Engine).unwrap();
            model.clear();
            seq = 0;
        }
        let events: Result<Vec<_>, _> = ops
            .iter()
            .enumerate()
            .map(|(i, op)| parse_event(&wire_op(op), i, None))
            .collect();
        let before = (ix.worker_hashes(1), ix.worker_status(1));
        if let Some(o) = old {
            let stale = ix.apply_batch(1, Some(o), seq + 7, Vec::new()).unwrap();
            assert_eq!(stale, BatchOutcome::Stale);
            assert_eq!((ix.worker_hashes(1), ix.worker_status(1)), before);
        }
        let Ok(events) = events else { continue };
        let events: Vec<KvEvent> = events.into_iter().flatten().collect();
        match ix.apply_batch(1, Some(inc), seq, events.clone()) {
            Ok(outcome) => {
                assert_eq!(outcome, BatchOutcome::Applied);
                seq += 1;
                for op in ops {
                    match op {
                        Op::Stored(hs) => model.extend(hs.iter().map(|&h| key(h))),
                        Op::Removed(hs) => hs.iter().for_each(|&h| {
                            model.remove(&key(h));
                        }),
                        Op::Cleared => model.clear(),
                        Op::Raw(_) => {}
                    }
                }
                if ops.iter().all(|op| !matches!(op, Op::Raw(_))) {
                    assert_eq!(
                        ix.worker_hashes(1),
                        model.iter().copied().collect::<Vec<_>>()
                    );
                } else {
                    model = ix.worker_hashes(1).into_iter().collect(); // raw events applied too
                }
            }
            Err(_) => assert_eq!((ix.worker_hashes(1), ix.worker_status(1)), before),
        }
    }
});
