//! `pagedkv.KVCacheGroupSpec`: one KV cache group (full attention, sliding window, chunked
//! local, state) of a `CacheConfig`, and the configuration-error helpers its fields share with
//! `CacheConfig`.

use crate::convert::{repr, type_name, uint};
use crate::errors::to_pyerr;
use pagedkv_core::kv_groups::MAX_STATE_SPARE_BLOCKS;
use pagedkv_core::{AttentionKind, Error, GroupSpec};
use pyo3::prelude::*;

/// An `InvalidConfigError` naming `field`.
pub(crate) fn config_error(
    py: Python<'_>,
    field: &'static str,
    value: String,
    reason: &str,
) -> PyErr {
    to_pyerr(
        py,
        &Error::InvalidConfig {
            field,
            value,
            reason: reason.into(),
        },
    )
}

/// A non-negative int field of a configuration, else `InvalidConfigError` naming it.
pub(crate) fn config_uint(obj: &Bound<'_, PyAny>, field: &'static str, max: u64) -> PyResult<u64> {
    uint(obj, field, max).map_err(|_| {
        config_error(
            obj.py(),
            field,
            repr(obj),
            &format!("expected an int in 0..={max}"),
        )
    })
}

/// One KV cache group: the attention kind of its layers and its page layout (frozen).
///
/// ``kind`` is ``"full"``, ``"sliding_window"`` (``window`` tokens: a query at position ``p``
/// reads ``(p - window, p]``), ``"chunked_local"`` (``chunk`` tokens: it reads from
/// ``floor(p / chunk) * chunk``) or ``"state"`` (Mamba / linear-attention recurrent states:
/// block ``j`` holds the state after token ``(j + 1) * block_size``, published to the prefix
/// cache only by ``KVCacheManager.commit_computed``; ``state_bytes``, if given, the bytes of
/// one state, at most the page). ``block_size`` is in tokens; ``bytes_per_token`` is what one
/// token takes in one layer of the group (``2 * num_kv_heads * head_size * dtype bytes``), so
/// a page is ``block_size * bytes_per_token`` bytes. Every group of a manager must have the
/// same page size (checked by ``CacheConfig``).
///
/// ``prefix_cacheable=False`` (a sliding-window or chunked-local group only) leaves the
/// group out of the prefix cache: it never registers a block nor limits a hit, and a hit gives
/// it fresh blocks for the hit's window (``KVCacheGroupSpec.prefix_cacheable``). Such a group
/// may hold ``spare_blocks`` blocks per sequence past its slots, and, in a ``CacheConfig``
/// with prefix caching off, have a block size up to ``MAX_UNCACHED_BLOCK_SIZE`` tokens.
///
/// ``spare_blocks`` (blocks, vLLM's ``num_speculative_blocks``: the states a speculative
/// drafter's drafts write) means, per kind: on a group out of the prefix cache, blocks past
/// its slots; on a ``"state"`` group, ``0..=16`` speculative state blocks after the live
/// state's block (the same on every state group of a manager, one block size, no swap space:
/// checked by ``CacheConfig``). See ``KVCacheGroupSpec.spare_blocks``.
///
/// Raises ``InvalidConfigError`` for an unknown kind, a missing or extra ``window`` /
/// ``chunk`` / ``state_bytes``, ``state_bytes`` of 0 or above the page, ``prefix_cacheable=False``
/// on a full or state group, ``spare_blocks`` above 0 on a group in the prefix cache other
/// than a state group or above 16 on a state group, or a value that is not a non-negative int.
#[pyclass(frozen, eq, module = "pagedkv._core", name = "KVCacheGroupSpec")]
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct PyGroupSpec {
    pub(crate) inner: GroupSpec,
}

#[pymethods]
impl PyGroupSpec {
    #[new]
    #[pyo3(signature = (kind, block_size, bytes_per_token, *, window = None, chunk = None, state_bytes = None, prefix_cacheable = true, spare_blocks = None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        kind: &Bound<'_, PyAny>,
        block_size: &Bound<'_, PyAny>,
        bytes_per_token: &Bound<'_, PyAny>,
        window: Option<&Bound<'_, PyAny>>,
        chunk: Option<&Bound<'_, PyAny>>,
        state_bytes: Option<&Bound<'_, PyAny>>,
        prefix_cacheable: bool,
        spare_blocks: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let kind_s: String = kind.extract().map_err(|_| {
            let reason = format!("expected a str, got {}", type_name(kind));
            config_error(py, "kind", repr(kind), &reason)
        })?;
        let bs = config_uint(block_size, "block_size", u64::from(u32::MAX))? as u32;
        let bpt = config_uint(bytes_per_token, "bytes_per_token", u64::MAX)?;
        let window = window.filter(|w| !w.is_none());
        let chunk = chunk.filter(|c| !c.is_none());
        let state_bytes = state_bytes.filter(|c| !c.is_none());
        let span = |o: Option<&Bound<'_, PyAny>>, field: &'static str| -> PyResult<u32> {
            match o {
                Some(o) => Ok(config_uint(o, field, u64::from(u32::MAX))? as u32),
                None => Err(config_error(
                    py,
                    field,
                    "None".into(),
                    &format!("a {kind_s} group needs {field}"),
                )),
            }
        };
        let extra = |o: Option<&Bound<'_, PyAny>>, field: &'static str| -> PyResult<()> {
            match o {
                Some(o) => Err(config_error(
                    py,
                    field,
                    repr(o),
                    &format!("a {kind_s} group takes no {field}"),
                )),
                None => Ok(()),
            }
        };
        if kind_s != "state" {
            extra(state_bytes, "state_bytes")?;
        }
        let inner = match kind_s.as_str() {
            "full" => {
                extra(window, "window")?;
                extra(chunk, "chunk")?;
                GroupSpec::full(bs, bpt)
            }
            "state" => {
                extra(window, "window")?;
                extra(chunk, "chunk")?;
                let spec = GroupSpec::state(bs, bpt);
                if let Some(sb) = state_bytes {
                    let n = config_uint(sb, "state_bytes", u64::MAX)?;
                    let page = spec.page_bytes().unwrap_or(u64::MAX);
                    if n == 0 {
                        return Err(config_error(
                            py,
                            "state_bytes",
                            n.to_string(),
                            "a state takes at least one byte",
                        ));
                    }
                    if n > page {
                        return Err(config_error(
                            py,
                            "state_bytes",
                            n.to_string(),
                            &format!("a state must fit in one page of {bs} x {bpt} = {page} bytes"),
                        ));
                    }
                }
                spec
            }
            "sliding_window" => {
                extra(chunk, "chunk")?;
                GroupSpec::sliding_window(bs, bpt, span(window, "window")?)
            }
            "chunked_local" => {
                extra(window, "window")?;
                GroupSpec::chunked_local(bs, bpt, span(chunk, "chunk")?)
            }
            _ => {
                return Err(config_error(
                    py,
                    "kind",
                    format!("{kind_s:?}"),
                    "expected \"full\", \"sliding_window\", \"chunked_local\" or \"state\"",
                ))
            }
        };
        if !prefix_cacheable {
            if !matches!(kind_s.as_str(), "sliding_window" | "chunked_local") {
                return Err(config_error(
                    py,
                    "prefix_cacheable",
                    "False".into(),
                    &format!(
                        "only a sliding-window or chunked-local group can be left out of the \
                         prefix cache, not a {kind_s} group"
                    ),
                ));
            }
            let spare = match spare_blocks.filter(|k| !k.is_none()) {
                Some(k) => config_uint(k, "spare_blocks", u64::from(u32::MAX))? as u32,
                None => 0,
            };
            return Ok(Self {
                inner: inner.uncached().with_spare_blocks(spare),
            });
        }
        if let Some(k) = spare_blocks.filter(|k| !k.is_none()) {
            if kind_s == "state" {
                // Speculative state blocks (the manager checks they agree across state groups).
                let k = config_uint(k, "spare_blocks", u64::from(MAX_STATE_SPARE_BLOCKS))? as u32;
                return Ok(Self {
                    inner: inner.with_spare_blocks(k),
                });
            }
            if config_uint(k, "spare_blocks", u64::from(u32::MAX))? > 0 {
                return Err(config_error(
                    py,
                    "spare_blocks",
                    repr(k),
                    "only a group out of the prefix cache (prefix_cacheable=False) or a state \
                     group holds spare blocks",
                ));
            }
        }
        Ok(Self { inner })
    }

    /// Whether the group's full blocks are cached and serve prefix hits. False: the group
    /// never registers a block and takes no part in hit lookup; a hit found by the other groups
    /// gives it fresh blocks for the hit's window (a sliding window rebuilt by replaying the
    /// hit's last window).
    #[getter]
    fn prefix_cacheable(&self) -> bool {
        self.inner.prefix_cacheable
    }

    /// Spare blocks per sequence (0 unless set), for the states a speculative drafter's (MTP /
    /// EAGLE) drafts write (vLLM's ``num_speculative_blocks``). On a group out of the prefix
    /// cache: blocks a sequence holds past those its slots cover, an allocation ending at slot
    /// ``end`` keeping ``ceil(end / block_size) + spare_blocks`` blocks of the group, counted
    /// by admission, never cached. On a state group: the speculative state blocks, ``k`` spare
    /// blocks after the live state's block for the states a verify step writes after each of
    /// its (at most ``k``) drafts, laid out and moved as vLLM's align-mode Mamba manager does
    /// (docs/design/kv-cache-groups.md, "Speculative state blocks"); every state group of a
    /// manager has the same value. Other groups have none.
    #[getter]
    fn spare_blocks(&self) -> u32 {
        self.inner.spare_blocks
    }

    /// ``"full"``, ``"sliding_window"``, ``"chunked_local"`` or ``"state"``.
    #[getter]
    fn kind(&self) -> &'static str {
        self.inner.kind.name()
    }

    /// Tokens per block.
    #[getter]
    fn block_size(&self) -> u32 {
        self.inner.block_size
    }

    /// Bytes one token takes in one layer of the group.
    #[getter]
    fn bytes_per_token(&self) -> u64 {
        self.inner.bytes_per_token
    }

    /// The sliding window in tokens, or None.
    #[getter]
    fn window(&self) -> Option<u32> {
        match self.inner.kind {
            AttentionKind::SlidingWindow { window } => Some(window),
            _ => None,
        }
    }

    /// The local-attention chunk in tokens, or None.
    #[getter]
    fn chunk(&self) -> Option<u32> {
        match self.inner.kind {
            AttentionKind::ChunkedLocal { chunk } => Some(chunk),
            _ => None,
        }
    }

    /// Page size in bytes (``block_size * bytes_per_token``; None on overflow).
    #[getter]
    fn page_bytes(&self) -> Option<u64> {
        self.inner.page_bytes()
    }

    fn __repr__(&self) -> String {
        let span = match self.inner.kind {
            AttentionKind::SlidingWindow { window } => format!(", window={window}"),
            AttentionKind::ChunkedLocal { chunk } => format!(", chunk={chunk}"),
            AttentionKind::Full | AttentionKind::State => String::new(),
        };
        let cached = if self.inner.prefix_cacheable {
            ""
        } else {
            ", prefix_cacheable=False"
        };
        let spare = match self.inner.spare_blocks {
            0 => String::new(),
            k => format!(", spare_blocks={k}"),
        };
        format!(
            "KVCacheGroupSpec({:?}, block_size={}, bytes_per_token={}{span}{cached}{spare})",
            self.inner.kind.name(),
            self.inner.block_size,
            self.inner.bytes_per_token
        )
    }
}
