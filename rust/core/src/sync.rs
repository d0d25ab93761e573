//! std / loom facade: every lock and atomic of the core (the pool's atomics and mutex, the
//! manager's state mutex, the event sink's buffer) comes from here, so the same source is
//! model-checked by loom under `RUSTFLAGS="--cfg loom"` (pattern from sharded-slab / tokio).

#[cfg(loom)]
pub(crate) use loom::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};
#[cfg(loom)]
#[allow(unused_imports)] // for modules that share state in tests and models
pub(crate) use loom::sync::Arc;

#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};
#[cfg(not(loom))]
#[allow(unused_imports)] // for modules that share state in tests and models
pub(crate) use std::sync::Arc;

#[cfg(loom)]
pub(crate) use loom::sync::atomic::AtomicBool;
#[cfg(not(loom))]
pub(crate) use std::sync::atomic::AtomicBool;

/// A mutex with one `lock()` signature for both backends: parking_lot normally (no poisoning,
/// small and fast when uncontended), `loom::sync::Mutex` under loom so the model checker sees
/// every lock acquisition.
#[derive(Debug, Default)]
pub(crate) struct Mutex<T> {
    #[cfg(not(loom))]
    inner: parking_lot::Mutex<T>,
    #[cfg(loom)]
    inner: loom::sync::Mutex<T>,
}

/// Guard returned by [`Mutex::lock`].
#[cfg(not(loom))]
pub(crate) type MutexGuard<'a, T> = parking_lot::MutexGuard<'a, T>;
/// Guard returned by [`Mutex::lock`].
#[cfg(loom)]
pub(crate) type MutexGuard<'a, T> = loom::sync::MutexGuard<'a, T>;

impl<T> Mutex<T> {
    /// A new unlocked mutex holding `value`.
    pub(crate) fn new(value: T) -> Self {
        #[cfg(not(loom))]
        let inner = parking_lot::Mutex::new(value);
        #[cfg(loom)]
        let inner = loom::sync::Mutex::new(value);
        Self { inner }
    }

    /// Blocks until the lock is held. Never panics: a poisoned loom mutex is entered anyway
    /// (the protected data has no invariant a panicking holder can break half-way that a
    /// later holder relies on for memory safety).
    pub(crate) fn lock(&self) -> MutexGuard<'_, T> {
        #[cfg(not(loom))]
        return self.inner.lock();
        #[cfg(loom)]
        return self.inner.lock().unwrap_or_else(|e| e.into_inner());
    }
}

/// Back-off hint inside a retry loop: a CPU spin hint normally; under loom a yield, so the
/// model checker schedules the thread that must make progress instead of exploring an
/// unbounded spin.
#[inline]
pub(crate) fn spin_hint() {
    #[cfg(not(loom))]
    std::hint::spin_loop();
    #[cfg(loom)]
    loom::thread::yield_now();
}
