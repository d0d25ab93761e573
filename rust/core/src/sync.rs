//! std / loom facade: lock-free code imports atomics and `Arc` from here so the same source is
//! model-checked by loom under `RUSTFLAGS="--cfg loom"` (pattern from sharded-slab / tokio).

#[cfg(loom)]
pub(crate) use loom::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};
#[cfg(loom)]
pub(crate) use loom::sync::Arc;

#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};
#[cfg(not(loom))]
pub(crate) use std::sync::Arc;
