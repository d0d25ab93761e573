//! What callers hand the KV cache manager: a sequence's cache identity besides its tokens
//! ([`SequenceSpec`], [`MmItem`]), its lifecycle state ([`SeqStatus`]), one scheduler step's
//! batch ([`StepRequest`]) and its speculative drafts ([`StepDrafts`]), with the checks the
//! manager runs on them before anything changes.

use crate::error::{Error, Result};
use crate::hashing::ExtraKey;
use crate::SeqId;
use std::borrow::Cow;

/// A multimodal item embedded in a sequence's tokens: its content hash and the token range
/// `[start, start + len)` it occupies. Every full block overlapping the range gets an
/// [`ExtraKey::Multimodal`] key (item hash + start offset relative to the block), so two
/// prompts with the same placeholder tokens but different images never share cached KV.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct MmItem {
    /// Content hash of the item (any bytes, typically a SHA-256 of the pixels / audio).
    pub item_hash: Vec<u8>,
    /// Position, in tokens, of the item's first token in the sequence.
    pub start: u64,
    /// Number of tokens the item occupies (>= 1).
    pub len: u64,
}

/// Per-sequence inputs to prefix hashing.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct SequenceSpec {
    /// Keys mixed into the hash of every block of the sequence, in this order: model / adapter
    /// identity ([`ExtraKey::Adapter`]), cache salt ([`ExtraKey::CacheSalt`]), tagged keys.
    pub extra_keys: Vec<ExtraKey>,
    /// Multimodal items; each adds a per-block key to the blocks it overlaps (after
    /// `extra_keys`, in this list's order).
    pub mm_items: Vec<MmItem>,
}

impl SequenceSpec {
    /// Extra keys hashed into logical block `k` (tokens `k*block_size..(k+1)*block_size`): the
    /// sequence keys, then one [`ExtraKey::Multimodal`] per item overlapping the block (offset =
    /// item start minus block start). The manager and [`crate::kv_indexer`] both hash with this,
    /// so a router computes the same block hashes as the engines. O(keys + items).
    pub fn block_keys(&self, block_size: usize, k: usize) -> Cow<'_, [ExtraKey]> {
        if self.mm_items.is_empty() {
            return Cow::Borrowed(&self.extra_keys);
        }
        let (lo, hi) = ((k * block_size) as u64, ((k + 1) * block_size) as u64);
        let mut keys = self.extra_keys.clone();
        for item in self
            .mm_items
            .iter()
            .filter(|m| m.start < hi && m.start + m.len > lo)
        {
            keys.push(ExtraKey::Multimodal {
                item_hash: item.item_hash.clone(),
                offset: item.start as i64 - lo as i64,
            });
        }
        Cow::Owned(keys)
    }
}

/// Where a sequence's KV lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SeqStatus {
    /// On the GPU (possibly with no blocks yet, before the first allocation).
    Running,
    /// Preempted by recompute: no blocks, tokens kept, `num_computed_tokens == 0`.
    Preempted,
    /// Swapped out: the block table holds CPU swap-block ids.
    Swapped,
    /// Waiting for an asynchronous load of external KV (a KV connector's transfer into
    /// *staged* blocks: held, never registered in the prefix cache, announced in an event or
    /// offered to the host tier) until [`crate::KvCacheManager::commit_external`].
    Loading,
}

impl SeqStatus {
    /// Lower-case name used in error messages (`"running"`, `"preempted"`, `"swapped"`,
    /// `"loading"`).
    pub fn name(self) -> &'static str {
        match self {
            SeqStatus::Running => "running",
            SeqStatus::Preempted => "preempted",
            SeqStatus::Swapped => "swapped",
            SeqStatus::Loading => "loading",
        }
    }
}

/// Input of the batched [`crate::KvCacheManager::step`]: one entry per sequence, processed in order.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StepRequest {
    /// Sequences to schedule.
    pub seq_ids: Vec<SeqId>,
    /// Per sequence, the most tokens to schedule (same length as `seq_ids`).
    pub num_new_tokens: Vec<u32>,
    /// CSR offsets into `append_tokens` (length `seq_ids.len() + 1`), or empty for no appends.
    pub append_indptr: Vec<u32>,
    /// Newly sampled tokens to append to each sequence before scheduling it.
    pub append_tokens: Vec<u32>,
}

/// Draft tokens of a speculative-decoding step ([`crate::KvCacheManager::step_with_drafts`]), CSR
/// over the request's sequences: sequence `i` proposes
/// `tokens[indptr[i]..indptr[i + 1]]`. Empty `indptr` (the default) means no drafts.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StepDrafts {
    /// CSR offsets into `tokens` (length `seq_ids.len() + 1`), or empty for no drafts.
    pub indptr: Vec<u32>,
    /// Proposed (draft) token ids, not yet verified.
    pub tokens: Vec<u32>,
}

pub(crate) fn drafts_pending(seq_id: SeqId, operation: &'static str) -> Error {
    Error::InvalidSequenceState {
        seq_id,
        state: "running with pending draft tokens",
        operation,
        expected: "without them (call accept_drafts first)",
    }
}

/// Checks an `accept_drafts(seq, num_accepted)` call against the sequence's `pending` draft
/// tokens, checked by the KV cache manager.
///
/// # Errors
/// [`Error::InvalidSequenceState`] when no drafts are pending; [`Error::InvalidArgument`] when
/// `num_accepted > pending`.
pub(crate) fn validate_accept(
    seq: SeqId,
    status: SeqStatus,
    pending: usize,
    num_accepted: usize,
) -> Result<()> {
    if pending == 0 {
        return Err(Error::InvalidSequenceState {
            seq_id: seq,
            state: status.name(),
            operation: "accept_drafts",
            expected: "with pending draft tokens (allocated with drafts)",
        });
    }
    if num_accepted > pending {
        return Err(Error::InvalidArgument {
            arg: "num_accepted",
            value: num_accepted.to_string(),
            reason: format!("sequence {seq} has only {pending} draft token(s) pending"),
        });
    }
    Ok(())
}

/// Checks a new sequence's prompt (at least one token) and its multimodal items (len >= 1, a
/// range that fits in i64), checked by the KV cache manager.
pub(crate) fn validate_new_sequence(prompt: &[u32], spec: &SequenceSpec) -> Result<()> {
    if prompt.is_empty() {
        return Err(Error::InvalidArgument {
            arg: "prompt",
            value: "[]".into(),
            reason: "a sequence needs at least one token".into(),
        });
    }
    for item in &spec.mm_items {
        if item.len == 0
            || item.start.checked_add(item.len).is_none()
            || item.start > i64::MAX as u64
        {
            return Err(Error::InvalidArgument {
                arg: "mm_items",
                value: format!("start={} len={}", item.start, item.len),
                reason: "a multimodal item needs len >= 1 and a range that fits in i64".into(),
            });
        }
    }
    Ok(())
}

/// Checks a [`StepRequest`]'s array lengths and offsets (checked by the
/// KV cache manager).
pub(crate) fn validate_step(req: &StepRequest) -> Result<()> {
    let n = req.seq_ids.len();
    if req.num_new_tokens.len() != n {
        return Err(Error::InvalidArgument {
            arg: "num_new_tokens",
            value: format!("len {}", req.num_new_tokens.len()),
            reason: format!("must have one entry per sequence ({n})"),
        });
    }
    if req.append_indptr.is_empty() {
        if !req.append_tokens.is_empty() {
            return Err(Error::InvalidArgument {
                arg: "append_indptr",
                value: "[]".into(),
                reason: "append_tokens given without offsets".into(),
            });
        }
        return Ok(());
    }
    let p = &req.append_indptr;
    if p.len() != n + 1
        || p[0] != 0
        || p.windows(2).any(|w| w[0] > w[1])
        || p[n] as usize != req.append_tokens.len()
    {
        return Err(Error::InvalidArgument {
            arg: "append_indptr",
            value: format!("{p:?}"),
            reason: format!(
                "must be {} non-decreasing offsets from 0 to len(append_tokens) = {}",
                n + 1,
                req.append_tokens.len()
            ),
        });
    }
    Ok(())
}

pub(crate) fn validate_drafts(req: &StepRequest, drafts: &StepDrafts) -> Result<()> {
    let n = req.seq_ids.len();
    let p = &drafts.indptr;
    if p.is_empty() {
        if !drafts.tokens.is_empty() {
            return Err(Error::InvalidArgument {
                arg: "draft_indptr",
                value: "[]".into(),
                reason: "draft_tokens given without offsets".into(),
            });
        }
        return Ok(());
    }
    if p.len() != n + 1
        || p[0] != 0
        || p.windows(2).any(|w| w[0] > w[1])
        || p[n] as usize != drafts.tokens.len()
    {
        return Err(Error::InvalidArgument {
            arg: "draft_indptr",
            value: format!("{p:?}"),
            reason: format!(
                "must be {} non-decreasing offsets from 0 to len(draft_tokens) = {}",
                n + 1,
                drafts.tokens.len()
            ),
        });
    }
    Ok(())
}
