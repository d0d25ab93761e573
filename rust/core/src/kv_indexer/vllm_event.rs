//! vLLM's KV events in their wire form (msgpack-decoded arrays, read by position) as
//! [`KvEvent`]s for [`super::KvIndexer`].
//!
//! vLLM V1 publishes each event as an array whose first item names its type (newer releases
//! send maps, which `pagedkv.routing.wire` turns into this array form):
//!
//! - `["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
//!   lora_name, extra_keys, group_idx, kv_cache_spec_kind, kv_cache_spec_sliding_window,
//!   locality, ownership, session_id, lookahead_token_ids, ...]`
//! - `["BlockRemoved", block_hashes, medium, group_idx, ...]`
//! - `["AllBlocksCleared"]`
//!
//! Fields newer engines append are ignored. The rules, each of which under-reports rather than
//! ever letting a query match a block vLLM would not serve:
//!
//! - Block hashes are bytes (at most 32, zero-padded) or ints (signed or unsigned, 128 bits at
//!   most, little-endian in the first 16 bytes). Each engine uses one form, so the forms never
//!   meet in one worker's key space.
//! - Keys ([`stored_keys`]): the adapter key is `lora_name`, or `str(lora_id)` from engines
//!   that send no name; `extra_keys` is one tuple or None per block holding the LoRA name
//!   first (for a LoRA request), then the cache salt (stock vLLM names it in a request's first
//!   block only, the indexer carries it down the chain). A block with multimodal,
//!   prompt-embedding or unknown keys, another salt than the first, or without the LoRA name
//!   first, cuts the event before it (its later blocks chain from it).
//! - A block whose vLLM hash also covers the tokens after it (`lookahead_token_ids`) cuts the
//!   event the same way ([`lookahead_cut`]).
//! - Each event names its KV cache group (`group_idx`; absent or None: group 0, the only group
//!   of a one-group engine) ([`group_of`], [`parse_group_event`]). A hybrid model publishes
//!   each block once per group; the indexer keeps one full-attention group of the worker
//!   ([`super::KvIndexer::add_worker_with_groups`]), since a sliding-window group's residency
//!   is no prefix residency and its early removals would drop prefixes the full-attention
//!   group still holds.
//!
//! Malformed events (wrong types, one `extra_keys` entry per block violated...) are an
//! `InvalidArgument` error naming the event and why, so the caller can apply nothing.

use super::bad;
use crate::error::Result;
use crate::events::{KvEvent, Tier};
use crate::hashing::{BlockHash, ExtraKey};
use std::fmt;

/// One value of a decoded vLLM KV event, as a binding hands it over: the msgpack types, and
/// [`WireValue::Other`] for anything else (refused wherever a typed field is read).
#[derive(Debug, Clone, PartialEq)]
pub enum WireValue {
    /// msgpack nil (Python `None`).
    Nil,
    /// A boolean.
    Bool(bool),
    /// An integer; unsigned values above `i128::MAX` arrive as their two's-complement bits.
    Int(i128),
    /// A float.
    Float(f64),
    /// A UTF-8 string.
    Str(String),
    /// Raw bytes.
    Bytes(Vec<u8>),
    /// An array (a Python list or tuple).
    List(Vec<WireValue>),
    /// A value of another type: its type name and a printable form, for error messages.
    Other {
        /// Type name, e.g. `"dict"`.
        type_name: String,
        /// Printable form (the binding's `repr`).
        repr: String,
    },
}

impl WireValue {
    /// Python's name of the value's type (`"int"`, `"str"`, `"NoneType"`...).
    pub fn type_name(&self) -> &str {
        match self {
            WireValue::Nil => "NoneType",
            WireValue::Bool(_) => "bool",
            WireValue::Int(_) => "int",
            WireValue::Float(_) => "float",
            WireValue::Str(_) => "str",
            WireValue::Bytes(_) => "bytes",
            WireValue::List(_) => "list",
            WireValue::Other { type_name, .. } => type_name,
        }
    }

    fn is_nil(&self) -> bool {
        matches!(self, WireValue::Nil)
    }

    /// The text Python's `str()` gives a scalar (a string as it is, an int in decimal); the
    /// printed form for the rest.
    fn text(&self) -> String {
        match self {
            WireValue::Str(s) => s.clone(),
            other => other.to_string(),
        }
    }
}

/// Python-like `repr`, cut at 200 characters (error messages name the offending event).
impl fmt::Display for WireValue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut out = String::new();
        write_repr(self, &mut out);
        if out.chars().count() > 200 {
            out = out.chars().take(197).collect::<String>() + "...";
        }
        f.write_str(&out)
    }
}

fn write_repr(v: &WireValue, out: &mut String) {
    use std::fmt::Write;
    if out.len() > 400 {
        return; // enough for the 200 characters shown
    }
    match v {
        WireValue::Nil => out.push_str("None"),
        WireValue::Bool(b) => out.push_str(if *b { "True" } else { "False" }),
        WireValue::Int(i) => {
            let _ = write!(out, "{i}");
        }
        WireValue::Float(x) => {
            let _ = write!(out, "{x:?}");
        }
        WireValue::Str(s) => {
            let _ = write!(out, "'{}'", s.escape_default());
        }
        WireValue::Bytes(b) => {
            out.push_str("b'");
            for &c in b {
                if c.is_ascii_graphic() && c != b'\'' && c != b'\\' {
                    out.push(c as char);
                } else {
                    let _ = write!(out, "\\x{c:02x}");
                }
            }
            out.push('\'');
        }
        WireValue::List(items) => {
            out.push('[');
            for (k, item) in items.iter().enumerate() {
                if k > 0 {
                    out.push_str(", ");
                }
                write_repr(item, out);
            }
            out.push(']');
        }
        WireValue::Other { repr, .. } => out.push_str(repr),
    }
}

/// Field of a `BlockStored` / `BlockRemoved` holding `group_idx` (vLLM 0.33 order).
const STORED_GROUP_FIELD: usize = 9;
const REMOVED_GROUP_FIELD: usize = 3;
/// Field of a `BlockStored` / `BlockRemoved` holding `medium` (`"GPU"`, `"CPU"`, or None).
const STORED_MEDIUM_FIELD: usize = 6;
const REMOVED_MEDIUM_FIELD: usize = 2;
/// Fields of a `BlockStored`: `lora_id`, `lora_name`, `extra_keys`, `lookahead_token_ids`.
const LORA_ID_FIELD: usize = 5;
const LORA_NAME_FIELD: usize = 7;
const EXTRA_KEYS_FIELD: usize = 8;
const LOOKAHEAD_FIELD: usize = 15;

/// A block hash: bytes (at most 32, zero-padded to 32) or an int (its 128 bits little-endian
/// in the first 16 bytes). Err: why not.
pub fn wire_hash(v: &WireValue) -> std::result::Result<BlockHash, String> {
    let mut out = [0u8; 32];
    match v {
        WireValue::Bytes(b) if b.len() > 32 => Err(format!(
            "block hashes are at most 32 bytes, got <{} bytes>",
            b.len()
        )),
        WireValue::Bytes(b) => {
            out[..b.len()].copy_from_slice(b);
            Ok(BlockHash(out))
        }
        WireValue::Int(i) => {
            out[..16].copy_from_slice(&i.to_le_bytes());
            Ok(BlockHash(out))
        }
        other => Err(format!(
            "expected a block hash (bytes, or an int of at most 128 bits), got {other}"
        )),
    }
}

/// A list of block hashes ([`wire_hash`] each). Err: why not.
pub fn wire_hash_list(v: &WireValue) -> std::result::Result<Vec<BlockHash>, String> {
    match v {
        WireValue::List(items) => items.iter().map(wire_hash).collect(),
        other => Err(format!("expected a list of block hashes, got {other}")),
    }
}

/// [`wire_hash_list`] of a call argument `arg` (a snapshot's or a query's hashes): errors
/// are `InvalidArgument` naming `arg`.
pub fn hashes_arg(v: &WireValue, arg: &'static str) -> Result<Vec<BlockHash>> {
    wire_hash_list(v).map_err(|why| bad(arg, v, why))
}

fn token_list(v: &WireValue) -> std::result::Result<Vec<u32>, String> {
    let why = || format!("token_ids must be a list of ints in 0..=4294967295, got {v}");
    match v {
        WireValue::List(items) => items
            .iter()
            .map(|t| match t {
                WireValue::Int(i) => u32::try_from(*i).map_err(|_| why()),
                _ => Err(why()),
            })
            .collect(),
        _ => Err(why()),
    }
}

fn list_entries(
    v: &WireValue,
    why: impl Fn() -> String,
) -> std::result::Result<&[WireValue], String> {
    match v {
        WireValue::List(items) => Ok(items),
        _ => Err(why()),
    }
}

/// The extra keys of a `BlockStored` (`fields`: the whole event) as the keys a pagedkv query
/// hashes with, and how many of its `n_blocks` blocks can be rehashed with them (see the
/// module docs; the salt becomes [`ExtraKey::CacheSalt`], which the indexer carries down the
/// chain). Err: why the fields are malformed (a `lora_name` that is not a str, an
/// `extra_keys` that is not one tuple or None per block).
pub fn stored_keys(
    fields: &[WireValue],
    n_blocks: usize,
) -> std::result::Result<(Vec<ExtraKey>, usize), String> {
    let present = |i: usize| fields.get(i).filter(|v| !v.is_nil());
    let lora_name = match present(LORA_NAME_FIELD) {
        Some(WireValue::Str(name)) => Some(name.clone()),
        Some(other) => {
            return Err(format!(
                "lora_name must be a str or None, got {}",
                other.type_name()
            ))
        }
        None => None,
    };
    let adapter = match (&lora_name, present(LORA_ID_FIELD)) {
        (Some(name), _) => Some(name.clone()),
        (None, Some(id)) => Some(id.text()),
        (None, None) => None,
    };
    let mut keys: Vec<ExtraKey> = adapter.iter().cloned().map(ExtraKey::Adapter).collect();
    let Some(per_block) = present(EXTRA_KEYS_FIELD) else {
        return Ok((keys, n_blocks));
    };
    let entries = list_entries(per_block, || {
        "extra_keys must be a list with one tuple or None per block".to_string()
    })?;
    // One entry per block: with fewer, a block's own keys (a multimodal item) would be unknown.
    if entries.len() != n_blocks {
        return Err(format!(
            "extra_keys has {} entries for {n_blocks} blocks (one tuple or None per block)",
            entries.len()
        ));
    }
    let mut salt: Option<String> = None;
    let mut usable = n_blocks;
    'blocks: for (i, entry) in entries.iter().enumerate() {
        let parts: &[WireValue] = match entry {
            WireValue::Nil => &[],
            WireValue::List(parts) => parts,
            _ => return Err(format!("extra_keys[{i}] must be a tuple of keys or None")),
        };
        let mut rest = parts;
        if adapter.is_some() {
            // vLLM keys every block of a LoRA request by its name, first: a block without it
            // (or, when the event names the LoRA, with another name) was hashed otherwise.
            let first_is_name = match (rest.first(), &lora_name) {
                (Some(WireValue::Str(p)), Some(name)) => p == name,
                (Some(WireValue::Str(_)), None) => true,
                _ => false,
            };
            if !first_is_name {
                usable = i;
                break 'blocks;
            }
            rest = &rest[1..];
        }
        for part in rest {
            let same_salt = match (part, &salt) {
                (WireValue::Str(_), None) => i == 0,
                (WireValue::Str(p), Some(s)) => p == s,
                _ => false,
            };
            if !same_salt {
                usable = i;
                break 'blocks;
            }
            salt = Some(part.text());
        }
    }
    keys.extend(salt.map(ExtraKey::CacheSalt));
    Ok((keys, usable))
}

/// How many blocks of a `BlockStored` (`fields`: the whole event) precede the first one whose
/// hash also covers tokens after the block (`lookahead_token_ids`: one list per block, None
/// when lookahead hashing is off): a query hashing the block's own tokens would match where
/// vLLM needs the following tokens too. Err: why the field is malformed.
pub fn lookahead_cut(fields: &[WireValue], n_blocks: usize) -> std::result::Result<usize, String> {
    let Some(per_block) = fields.get(LOOKAHEAD_FIELD).filter(|v| !v.is_nil()) else {
        return Ok(n_blocks);
    };
    let malformed =
        || "lookahead_token_ids must be a list with one list of token ids per block".to_string();
    let entries = list_entries(per_block, malformed)?;
    if entries.len() != n_blocks {
        return Err(format!(
            "lookahead_token_ids has {} entries for {n_blocks} blocks",
            entries.len()
        ));
    }
    for (i, entry) in entries.iter().enumerate() {
        match entry {
            WireValue::Nil => {}
            WireValue::List(toks) if toks.is_empty() => {}
            WireValue::List(_) => return Ok(i),
            _ => return Err(malformed()),
        }
    }
    Ok(n_blocks)
}

/// The KV cache group an event names in its `group_idx` field (`at`): `None` when absent or
/// None (the only group of a one-group engine). Err: a `group_idx` that is not an int in
/// `0..=u64::MAX` or None.
pub fn group_of(fields: &[WireValue], at: usize) -> std::result::Result<Option<u64>, String> {
    match fields.get(at) {
        None | Some(WireValue::Nil) => Ok(None),
        Some(WireValue::Int(i)) if *i >= 0 && *i <= i128::from(u64::MAX) => Ok(Some(*i as u64)),
        Some(g @ WireValue::Bool(_)) => Err(format!("group_idx must be an int, got {g}")),
        Some(g) => Err(format!("group_idx must be an int >= 0 or None, got {g}")),
    }
}

/// The tier an event's `medium` field (`at`) names: absent, None or `"GPU"` is the device,
/// any other medium (`"CPU"`, the offloading connectors' host tier, or a slower one) is
/// [`Tier::Host`]: blocks the engine can load but does not hold on the device, which must not
/// count as device residency. Err: a medium that is not a str or None.
pub fn medium_of(fields: &[WireValue], at: usize) -> std::result::Result<Tier, String> {
    match fields.get(at) {
        None | Some(WireValue::Nil) => Ok(Tier::Device),
        Some(WireValue::Str(m)) if m.eq_ignore_ascii_case("gpu") => Ok(Tier::Device),
        Some(WireValue::Str(_)) => Ok(Tier::Host),
        Some(m) => Err(format!("medium must be a str or None, got {m}")),
    }
}

/// Whether an event belongs to the first KV cache group: its `group_idx` field (`at`) is
/// absent, None or 0. Err: as [`group_of`].
pub fn in_first_group(fields: &[WireValue], at: usize) -> std::result::Result<bool, String> {
    Ok(group_of(fields, at)?.unwrap_or(0) == 0)
}

/// Event `index` of a batch in the wire form, as the indexer's [`KvEvent`] of the first KV
/// cache group: as [`parse_group_event`], with `Ok(None)` for an event of another group.
pub fn parse_event(
    event: &WireValue,
    index: usize,
    batch_root: Option<BlockHash>,
) -> Result<Option<KvEvent>> {
    let (group, ev) = parse_group_event(event, index, batch_root)?;
    Ok((group.unwrap_or(0) == 0).then_some(ev))
}

/// Event `index` of a batch in the wire form, as the indexer's [`KvEvent`] with the KV cache
/// group it names (`None`: absent or None, and for `AllBlocksCleared`, which clears every
/// group): a `BlockStored` gets `batch_root` as its hash root (wire events carry none) and is
/// cut as the module docs say. Errors: `InvalidArgument` (arg `"events"`, naming the event and
/// its index) for anything malformed, whatever its group.
pub fn parse_group_event(
    event: &WireValue,
    index: usize,
    batch_root: Option<BlockHash>,
) -> Result<(Option<u64>, KvEvent)> {
    let malformed = |why: String| bad("events", format!("{event} at index {index}"), why);
    let WireValue::List(fields) = event else {
        return Err(malformed(
            "expected an event object or a [tag, fields...] list".into(),
        ));
    };
    let Some(WireValue::Str(tag)) = fields.first() else {
        return Err(malformed(
            "the first item must be the event type name".into(),
        ));
    };
    match tag.as_str() {
        "BlockStored" => {
            if fields.len() < 5 {
                return Err(malformed(
                    "BlockStored needs block_hashes, parent_block_hash, token_ids, block_size"
                        .into(),
                ));
            }
            // Read in full whatever its group, so a malformed event is refused alike.
            let group = group_of(fields, STORED_GROUP_FIELD).map_err(malformed)?;
            let tier = medium_of(fields, STORED_MEDIUM_FIELD).map_err(malformed)?;
            let mut block_hashes = wire_hash_list(&fields[1]).map_err(malformed)?;
            let parent_block_hash = match &fields[2] {
                WireValue::Nil => None,
                h => Some(wire_hash(h).map_err(malformed)?),
            };
            let mut token_ids = token_list(&fields[3]).map_err(malformed)?;
            let block_size = match &fields[4] {
                WireValue::Int(b) => u32::try_from(*b).ok(),
                _ => None,
            }
            .ok_or_else(|| {
                malformed(format!(
                    "block_size must be an int in 0..=4294967295, got {}",
                    fields[4]
                ))
            })?;
            let n = block_hashes.len();
            let (extra_keys, usable) = stored_keys(fields, n)
                .and_then(|(keys, usable)| Ok((keys, usable.min(lookahead_cut(fields, n)?))))
                .map_err(malformed)?;
            if usable < n && token_ids.len() == n * block_size as usize {
                block_hashes.truncate(usable);
                token_ids.truncate(usable * block_size as usize);
            }
            Ok((
                group,
                KvEvent::BlockStored {
                    block_hashes,
                    parent_block_hash,
                    token_ids,
                    block_size,
                    extra_keys,
                    hash_root: batch_root,
                    tier,
                },
            ))
        }
        "BlockRemoved" => {
            let hashes = fields
                .get(1)
                .ok_or_else(|| malformed("BlockRemoved needs block_hashes".into()))?;
            let block_hashes = wire_hash_list(hashes).map_err(malformed)?;
            let group = group_of(fields, REMOVED_GROUP_FIELD).map_err(malformed)?;
            let tier = medium_of(fields, REMOVED_MEDIUM_FIELD).map_err(malformed)?;
            Ok((group, KvEvent::BlockRemoved { block_hashes, tier }))
        }
        "AllBlocksCleared" => Ok((None, KvEvent::AllBlocksCleared)),
        _ => Err(malformed(
            "unknown event type (expected BlockStored, BlockRemoved or AllBlocksCleared)".into(),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use WireValue::{Int, List, Nil, Str};

    fn s(x: &str) -> WireValue {
        Str(x.into())
    }

    fn ints(xs: impl IntoIterator<Item = i128>) -> WireValue {
        List(xs.into_iter().map(Int).collect())
    }

    /// `["BlockStored", [11, 12], None, tokens 1..=8, 4, ...rest]` with `rest` from field 5.
    fn stored(rest: Vec<WireValue>) -> WireValue {
        let mut f = vec![s("BlockStored"), ints([11, 12]), Nil, ints(1..=8), Int(4)];
        f.extend(rest);
        List(f)
    }

    fn parsed(ev: &WireValue) -> KvEvent {
        parse_event(ev, 0, None).unwrap().unwrap()
    }

    fn reason(ev: &WireValue) -> String {
        parse_event(ev, 3, None).unwrap_err().to_string()
    }

    #[test]
    fn hashes_ints_and_bytes() {
        let mut want = [0u8; 32];
        want[..16].copy_from_slice(&(-1i128).to_le_bytes());
        assert_eq!(wire_hash(&Int(-1)).unwrap(), BlockHash(want));
        let mut short = [0u8; 32];
        short[..2].copy_from_slice(&[7, 8]);
        assert_eq!(
            wire_hash(&WireValue::Bytes(vec![7, 8])).unwrap(),
            BlockHash(short)
        );
        assert!(wire_hash(&WireValue::Bytes(vec![0; 33]))
            .unwrap_err()
            .contains("at most 32 bytes"));
        assert!(wire_hash(&s("ab")).is_err());
        assert!(wire_hash_list(&WireValue::Bytes(vec![1])).is_err());
        let err = hashes_arg(&s("x"), "block_hashes").unwrap_err().to_string();
        assert!(err.contains("block_hashes"), "{err}");
    }

    #[test]
    fn medium_names_the_tier() {
        let tier = |ev: &WireValue| match parsed(ev) {
            KvEvent::BlockStored { tier, .. } | KvEvent::BlockRemoved { tier, .. } => tier,
            other => panic!("{other:?}"),
        };
        assert_eq!(tier(&stored(vec![Nil, s("GPU")])), Tier::Device);
        assert_eq!(tier(&stored(vec![Nil, Nil])), Tier::Device);
        assert_eq!(tier(&stored(vec![])), Tier::Device);
        assert_eq!(tier(&stored(vec![Nil, s("CPU")])), Tier::Host);
        let removed = |m| List(vec![s("BlockRemoved"), ints([11]), m]);
        assert_eq!(tier(&removed(s("CPU"))), Tier::Host);
        assert_eq!(tier(&removed(s("GPU"))), Tier::Device);
        assert!(reason(&removed(Int(3))).contains("medium must be a str or None"));
    }

    #[test]
    fn stored_removed_cleared() {
        let root = Some(BlockHash([5; 32]));
        match parse_event(&stored(vec![Nil, s("GPU")]), 0, root)
            .unwrap()
            .unwrap()
        {
            KvEvent::BlockStored {
                block_hashes,
                parent_block_hash,
                token_ids,
                block_size,
                extra_keys,
                hash_root,
                ..
            } => {
                assert_eq!(block_hashes.len(), 2);
                assert_eq!(parent_block_hash, None);
                assert_eq!(token_ids, (1..=8).collect::<Vec<u32>>());
                assert_eq!((block_size, extra_keys, hash_root), (4, vec![], root));
            }
            other => panic!("{other:?}"),
        }
        let removed = List(vec![s("BlockRemoved"), ints([11]), s("GPU")]);
        assert!(
            matches!(parsed(&removed), KvEvent::BlockRemoved { block_hashes, .. } if block_hashes.len() == 1)
        );
        assert_eq!(
            parsed(&List(vec![s("AllBlocksCleared")])),
            KvEvent::AllBlocksCleared
        );
    }

    #[test]
    fn malformed_events_name_why() {
        assert!(reason(&s("BlockStored")).contains("[tag, fields...]"));
        assert!(reason(&List(vec![Int(1)])).contains("type name"));
        assert!(reason(&List(vec![s("BlockEvicted")])).contains("unknown event type"));
        assert!(reason(&List(vec![s("BlockStored"), ints([1])])).contains("needs block_hashes"));
        assert!(reason(&List(vec![s("BlockRemoved")])).contains("needs block_hashes"));
        let bad_tokens = List(vec![
            s("BlockStored"),
            ints([1]),
            Nil,
            List(vec![s("x")]),
            Int(4),
        ]);
        assert!(reason(&bad_tokens).contains("token_ids"));
        let neg_token = List(vec![s("BlockStored"), ints([1]), Nil, ints([-1]), Int(4)]);
        assert!(reason(&neg_token).contains("token_ids"));
        let bad_bs = List(vec![
            s("BlockStored"),
            ints([1]),
            Nil,
            ints([1]),
            WireValue::Bool(true),
        ]);
        assert!(reason(&bad_bs).contains("block_size"));
        let err = reason(&stored(vec![Nil, Nil, Int(5)]));
        assert!(
            err.contains("lora_name must be a str or None, got int"),
            "{err}"
        );
        assert!(err.contains("at index 3"), "{err}");
    }

    #[test]
    fn lora_name_and_salt_become_keys_and_cut_where_they_disagree() {
        let keys = |rest| match parsed(&stored(rest)) {
            KvEvent::BlockStored {
                extra_keys,
                block_hashes,
                token_ids,
                ..
            } => (extra_keys, block_hashes.len(), token_ids.len()),
            other => panic!("{other:?}"),
        };
        let name_salt = List(vec![s("sql"), s("tenant")]);
        let name = List(vec![s("sql")]);
        let got = keys(vec![
            Int(3),
            s("GPU"),
            s("sql"),
            List(vec![name_salt.clone(), name.clone()]),
        ]);
        assert_eq!(
            got,
            (
                vec![
                    ExtraKey::Adapter("sql".into()),
                    ExtraKey::CacheSalt("tenant".into())
                ],
                2,
                8
            )
        );
        // No name: str(lora_id) is the adapter key.
        let got = keys(vec![Int(7), Nil]);
        assert_eq!(got, (vec![ExtraKey::Adapter("7".into())], 2, 8));
        // The second block lacks the LoRA name: cut there.
        let got = keys(vec![
            Int(3),
            s("GPU"),
            s("sql"),
            List(vec![name.clone(), Nil]),
        ]);
        assert_eq!((got.1, got.2), (1, 4));
        // A multimodal pair in the second block: cut there.
        let mm = List(vec![List(vec![s("img"), Int(2)])]);
        let got = keys(vec![Nil, Nil, Nil, List(vec![Nil, mm])]);
        assert_eq!((got.0, got.1, got.2), (vec![], 1, 4));
        // Another salt in the second block: cut there.
        let got = keys(vec![
            Nil,
            Nil,
            Nil,
            List(vec![List(vec![s("a")]), List(vec![s("b")])]),
        ]);
        assert_eq!(got, (vec![ExtraKey::CacheSalt("a".into())], 1, 4));
        // One entry per block, else malformed.
        assert!(reason(&stored(vec![Nil, Nil, Nil, List(vec![Nil])]))
            .contains("1 entries for 2 blocks"));
        assert!(reason(&stored(vec![Nil, Nil, Nil, s("t")])).contains("extra_keys must be a list"));
        assert!(
            reason(&stored(vec![Nil, Nil, Nil, List(vec![Int(1), Nil])])).contains("extra_keys[0]")
        );
    }

    #[test]
    fn events_name_their_group() {
        let mut g = vec![Nil; 4];
        g.push(Int(3));
        assert_eq!(
            parse_group_event(&stored(g.clone()), 0, None).unwrap().0,
            Some(3)
        );
        g[4] = Nil;
        assert_eq!(parse_group_event(&stored(g), 0, None).unwrap().0, None);
        assert_eq!(parse_group_event(&stored(vec![]), 0, None).unwrap().0, None);
        let removed = List(vec![s("BlockRemoved"), ints([1]), Nil, Int(2)]);
        let (group, ev) = parse_group_event(&removed, 0, None).unwrap();
        assert_eq!(group, Some(2));
        assert!(matches!(ev, KvEvent::BlockRemoved { .. }));
        let cleared = List(vec![s("AllBlocksCleared")]);
        assert_eq!(
            parse_group_event(&cleared, 0, None).unwrap(),
            (None, KvEvent::AllBlocksCleared)
        );
    }

    #[test]
    fn lookahead_blocks_and_other_groups_are_left_out() {
        let mut rest = vec![Nil; 10];
        rest.push(List(vec![List(vec![]), ints([9])])); // field 15
        match parsed(&stored(rest.clone())) {
            KvEvent::BlockStored { block_hashes, .. } => assert_eq!(block_hashes.len(), 1),
            other => panic!("{other:?}"),
        }
        rest[10] = List(vec![List(vec![])]);
        assert!(reason(&stored(rest.clone())).contains("lookahead_token_ids has 1 entries"));
        rest[10] = List(vec![Int(1), Nil]);
        assert!(reason(&stored(rest)).contains("lookahead_token_ids must be"));
        // group_idx is field 9 of a BlockStored, 3 of a BlockRemoved.
        let mut g = vec![Nil; 4];
        g.push(Int(1));
        assert_eq!(parse_event(&stored(g.clone()), 0, None).unwrap(), None);
        g[4] = Int(0);
        assert!(parse_event(&stored(g.clone()), 0, None).unwrap().is_some());
        for bad_group in [
            WireValue::Bool(true),
            Int(-1),
            s("1"),
            WireValue::Float(1.5),
        ] {
            g[4] = bad_group.clone();
            assert!(reason(&stored(g.clone())).contains("group_idx"));
            let removed = List(vec![s("BlockRemoved"), ints([1]), Nil, bad_group]);
            assert!(reason(&removed).contains("group_idx"));
        }
        let other_group = List(vec![s("BlockRemoved"), ints([1]), Nil, Int(2)]);
        assert_eq!(parse_event(&other_group, 0, None).unwrap(), None);
        // Malformed tokens in another group's event: refused all the same.
        let mut f = vec![s("BlockStored"), ints([1]), Nil, s("x"), Int(4)];
        f.extend(vec![Nil; 4]);
        f.push(Int(2));
        assert!(parse_event(&List(f), 0, None).is_err());
    }

    #[test]
    fn repr_is_python_like_and_short() {
        let v = List(vec![
            s("a'b"),
            Nil,
            WireValue::Bool(false),
            WireValue::Bytes(vec![0, b'z']),
        ]);
        assert_eq!(v.to_string(), "['a\\'b', None, False, b'\\x00z']");
        assert!(ints(0..1000).to_string().ends_with("..."));
        assert!(ints(0..1000).to_string().chars().count() <= 200);
    }
}
