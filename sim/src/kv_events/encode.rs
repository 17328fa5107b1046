//! The msgpack encoding of [`EventBatch`], byte for byte what vLLM's msgspec encoder writes.
//!
//! msgspec's choices that a generic serde encoder would not reproduce, and why each is here:
//! - ints take the smallest form, with the unsigned markers for values >= 0 (`cc`..`cf`);
//! - floats are always float64 (`cb`), even when they would fit in float32;
//! - an `omit_defaults` struct encoded as a map gets a header sized for *every* field the struct
//!   declares (plus the tag) and the count is patched after omissions; so vLLM 0.33's
//!   `BlockStored` (15 fields + tag) always carries a `map16` header (`de 00 0b`), even with 11
//!   entries, while `BlockRemoved` (5 + tag) gets a `fixmap`;
//! - `array_like` structs (the batch, and every event before 0.24) keep trailing `None`s as nil:
//!   msgspec only omits defaults in map-shaped structs.

use std::io;

use rmp::encode::{self as mp, ValueWriteError};

use super::{BlockHash, BlockRemoved, BlockStored, EventBatch, ExtraKey, KvEvent};

/// Which vLLM generation's event layout to write. The batch envelope is the same in both: a
/// 3-element array `[ts, events, data_parallel_rank]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Layout {
    /// vLLM >= 0.24 (bytes as 0.33 writes them): each event a map, `"type"` first, then its
    /// fields in declaration order; fields with a `None` default omitted when `None`.
    #[default]
    Map,
    /// vLLM <= 0.23: each event a positional array, tag first, every field of 0.23 present
    /// (fields added after 0.23, such as `locality`, are not written).
    Array,
}

/// Why a batch could not be encoded. Writing to memory cannot fail, so in practice only a
/// collection too large for msgpack's 32-bit lengths ends up here.
#[derive(Debug, thiserror::Error)]
pub enum EncodeError {
    #[error("{what} has {len} elements, more than msgpack's 32-bit length allows")]
    TooLong { what: &'static str, len: usize },
    #[error("msgpack write failed: {0}")]
    Write(#[from] ValueWriteError<io::Error>),
    #[error("msgpack write failed: {0}")]
    Io(#[from] io::Error),
}

/// Number of entries vLLM 0.33's `BlockStored` map may hold: 15 fields + the `type` tag. msgspec
/// sizes the header from this, so it decides between `fixmap` and `map16`.
const BLOCK_STORED_MAX_ENTRIES: usize = 16;
/// 0.33's `BlockRemoved`: 5 fields + tag.
const BLOCK_REMOVED_MAX_ENTRIES: usize = 6;
const MAP_TAG_KEY: &str = "type";

/// Encodes `batch` as the msgpack payload of one PUB message.
pub fn encode_batch(batch: &EventBatch, layout: Layout) -> Result<Vec<u8>, EncodeError> {
    let mut out = Vec::with_capacity(64 + 64 * batch.events.len());
    mp::write_array_len(&mut out, 3)?;
    mp::write_f64(&mut out, batch.ts)?;
    write_array_len(&mut out, "events", batch.events.len())?;
    for event in &batch.events {
        write_event(&mut out, event, layout)?;
    }
    match batch.data_parallel_rank {
        Some(rank) => write_uint(&mut out, u64::from(rank))?,
        None => mp::write_nil(&mut out)?,
    }
    Ok(out)
}

/// Encodes one event alone (as it appears inside a batch's `events` array).
pub fn encode_event(event: &KvEvent, layout: Layout) -> Result<Vec<u8>, EncodeError> {
    let mut out = Vec::new();
    write_event(&mut out, event, layout)?;
    Ok(out)
}

fn write_event(out: &mut Vec<u8>, event: &KvEvent, layout: Layout) -> Result<(), EncodeError> {
    match (event, layout) {
        (KvEvent::BlockStored(e), Layout::Map) => write_stored_map(out, e),
        (KvEvent::BlockStored(e), Layout::Array) => write_stored_array(out, e),
        (KvEvent::BlockRemoved(e), Layout::Map) => write_removed_map(out, e),
        (KvEvent::BlockRemoved(e), Layout::Array) => write_removed_array(out, e),
        (KvEvent::AllBlocksCleared, Layout::Map) => {
            let mut map = MapWriter::begin(out, 1);
            map.key(MAP_TAG_KEY)?;
            mp::write_str(map.out, event.tag())?;
            map.finish();
            Ok(())
        }
        (KvEvent::AllBlocksCleared, Layout::Array) => {
            mp::write_array_len(out, 1)?;
            mp::write_str(out, event.tag())?;
            Ok(())
        }
    }
}

fn write_stored_map(out: &mut Vec<u8>, e: &BlockStored) -> Result<(), EncodeError> {
    let mut m = MapWriter::begin(out, BLOCK_STORED_MAX_ENTRIES);
    m.key(MAP_TAG_KEY)?;
    mp::write_str(m.out, "BlockStored")?;
    // Fields without a default in vLLM's struct are always present, nil or not.
    m.key("block_hashes")?;
    write_hashes(m.out, &e.block_hashes)?;
    m.key("parent_block_hash")?;
    write_opt(m.out, e.parent_block_hash.as_ref(), write_hash)?;
    m.key("token_ids")?;
    write_tokens(m.out, &e.token_ids)?;
    m.key("block_size")?;
    write_uint(m.out, u64::from(e.block_size))?;
    m.key("lora_id")?;
    write_opt(m.out, e.lora_id.as_ref(), |o, v| write_uint(o, *v))?;
    m.key("medium")?;
    write_opt(m.out, e.medium.as_deref(), write_str)?;
    m.key("lora_name")?;
    write_opt(m.out, e.lora_name.as_deref(), write_str)?;
    // Fields declared `= None`: msgspec's omit_defaults drops them when they equal None.
    if let Some(keys) = &e.extra_keys {
        m.key("extra_keys")?;
        write_extra_keys(m.out, keys)?;
    }
    m.omitted_or_uint("group_idx", e.group_idx.map(u64::from))?;
    m.omitted_or_str("kv_cache_spec_kind", e.kv_cache_spec_kind.as_deref())?;
    m.omitted_or_uint(
        "kv_cache_spec_sliding_window",
        e.kv_cache_spec_sliding_window.map(u64::from),
    )?;
    m.omitted_or_str("locality", e.locality.as_deref())?;
    m.omitted_or_str("ownership", e.ownership.as_deref())?;
    m.omitted_or_str("session_id", e.session_id.as_deref())?;
    if let Some(lists) = &e.lookahead_token_ids {
        m.key("lookahead_token_ids")?;
        write_array_len(m.out, "lookahead_token_ids", lists.len())?;
        for tokens in lists {
            write_tokens(m.out, tokens)?;
        }
    }
    m.finish();
    Ok(())
}

fn write_stored_array(out: &mut Vec<u8>, e: &BlockStored) -> Result<(), EncodeError> {
    // 0.23's BlockStored: tag + 11 fields, all positional.
    mp::write_array_len(out, 12)?;
    mp::write_str(out, "BlockStored")?;
    write_hashes(out, &e.block_hashes)?;
    write_opt(out, e.parent_block_hash.as_ref(), write_hash)?;
    write_tokens(out, &e.token_ids)?;
    write_uint(out, u64::from(e.block_size))?;
    write_opt(out, e.lora_id.as_ref(), |o, v| write_uint(o, *v))?;
    write_opt(out, e.medium.as_deref(), write_str)?;
    write_opt(out, e.lora_name.as_deref(), write_str)?;
    write_opt(out, e.extra_keys.as_ref(), |o, k| write_extra_keys(o, k))?;
    write_opt(out, e.group_idx.as_ref(), |o, v| {
        write_uint(o, u64::from(*v))
    })?;
    write_opt(out, e.kv_cache_spec_kind.as_deref(), write_str)?;
    write_opt(out, e.kv_cache_spec_sliding_window.as_ref(), |o, v| {
        write_uint(o, u64::from(*v))
    })?;
    Ok(())
}

fn write_removed_map(out: &mut Vec<u8>, e: &BlockRemoved) -> Result<(), EncodeError> {
    let mut m = MapWriter::begin(out, BLOCK_REMOVED_MAX_ENTRIES);
    m.key(MAP_TAG_KEY)?;
    mp::write_str(m.out, "BlockRemoved")?;
    m.key("block_hashes")?;
    write_hashes(m.out, &e.block_hashes)?;
    m.key("medium")?;
    write_opt(m.out, e.medium.as_deref(), write_str)?;
    m.omitted_or_uint("group_idx", e.group_idx.map(u64::from))?;
    m.omitted_or_str("locality", e.locality.as_deref())?;
    m.omitted_or_str("ownership", e.ownership.as_deref())?;
    m.finish();
    Ok(())
}

fn write_removed_array(out: &mut Vec<u8>, e: &BlockRemoved) -> Result<(), EncodeError> {
    // 0.23's BlockRemoved: tag, block_hashes, medium, group_idx.
    mp::write_array_len(out, 4)?;
    mp::write_str(out, "BlockRemoved")?;
    write_hashes(out, &e.block_hashes)?;
    write_opt(out, e.medium.as_deref(), write_str)?;
    write_opt(out, e.group_idx.as_ref(), |o, v| {
        write_uint(o, u64::from(*v))
    })?;
    Ok(())
}

/// A map whose header is written for `max_entries` (choosing fixmap or map16 as msgspec does) and
/// whose count is patched in [`MapWriter::finish`] once the omitted fields are known.
struct MapWriter<'a> {
    out: &'a mut Vec<u8>,
    header_at: usize,
    wide: bool,
    entries: usize,
}

impl<'a> MapWriter<'a> {
    fn begin(out: &'a mut Vec<u8>, max_entries: usize) -> Self {
        let header_at = out.len();
        // Our structs never approach 2^16 fields, so fixmap or map16 are the only cases.
        let wide = max_entries >= 16;
        if wide {
            out.extend_from_slice(&[0xde, 0, 0]);
        } else {
            out.push(0x80);
        }
        Self {
            out,
            header_at,
            wide,
            entries: 0,
        }
    }

    fn key(&mut self, name: &str) -> Result<(), EncodeError> {
        self.entries += 1;
        mp::write_str(self.out, name)?;
        Ok(())
    }

    /// `name: v`, or nothing for `None` (msgspec's omit_defaults on a `= None` field).
    fn omitted_or_uint(&mut self, name: &str, v: Option<u64>) -> Result<(), EncodeError> {
        let Some(v) = v else { return Ok(()) };
        self.key(name)?;
        write_uint(self.out, v)
    }

    /// `name: v`, or nothing for `None`, as [`MapWriter::omitted_or_uint`].
    fn omitted_or_str(&mut self, name: &str, v: Option<&str>) -> Result<(), EncodeError> {
        let Some(v) = v else { return Ok(()) };
        self.key(name)?;
        write_str(self.out, v)
    }

    fn finish(self) {
        // `entries` is bounded by the number of `key` calls in this file (< 16), so the casts
        // below cannot truncate.
        if self.wide {
            let count = (self.entries as u16).to_be_bytes();
            self.out[self.header_at + 1] = count[0];
            self.out[self.header_at + 2] = count[1];
        } else {
            self.out[self.header_at] = 0x80 | (self.entries as u8 & 0x0f);
        }
    }
}

fn len_u32(what: &'static str, len: usize) -> Result<u32, EncodeError> {
    u32::try_from(len).map_err(|_| EncodeError::TooLong { what, len })
}

fn write_array_len(out: &mut Vec<u8>, what: &'static str, len: usize) -> Result<(), EncodeError> {
    mp::write_array_len(out, len_u32(what, len)?)?;
    Ok(())
}

fn write_uint(out: &mut Vec<u8>, v: u64) -> Result<(), EncodeError> {
    mp::write_uint(out, v)?;
    Ok(())
}

fn write_str(out: &mut Vec<u8>, s: &str) -> Result<(), EncodeError> {
    len_u32("string", s.len())?;
    mp::write_str(out, s)?;
    Ok(())
}

fn write_bin(out: &mut Vec<u8>, b: &[u8]) -> Result<(), EncodeError> {
    len_u32("bytes", b.len())?;
    mp::write_bin(out, b)?;
    Ok(())
}

fn write_opt<T: ?Sized>(
    out: &mut Vec<u8>,
    value: Option<&T>,
    write: impl FnOnce(&mut Vec<u8>, &T) -> Result<(), EncodeError>,
) -> Result<(), EncodeError> {
    match value {
        Some(v) => write(out, v),
        None => Ok(mp::write_nil(out)?),
    }
}

fn write_hash(out: &mut Vec<u8>, h: &BlockHash) -> Result<(), EncodeError> {
    match h {
        BlockHash::Int(v) => write_uint(out, *v),
        BlockHash::Bytes(b) => write_bin(out, b),
    }
}

fn write_hashes(out: &mut Vec<u8>, hashes: &[BlockHash]) -> Result<(), EncodeError> {
    write_array_len(out, "block_hashes", hashes.len())?;
    hashes.iter().try_for_each(|h| write_hash(out, h))
}

fn write_tokens(out: &mut Vec<u8>, tokens: &[u32]) -> Result<(), EncodeError> {
    write_array_len(out, "token_ids", tokens.len())?;
    tokens
        .iter()
        .try_for_each(|t| write_uint(out, u64::from(*t)))
}

fn write_extra_keys(out: &mut Vec<u8>, keys: &[Option<Vec<ExtraKey>>]) -> Result<(), EncodeError> {
    write_array_len(out, "extra_keys", keys.len())?;
    for entry in keys {
        // Each entry is a Python tuple (msgpack array) or None.
        write_opt(out, entry.as_deref(), write_extra_tuple)?;
    }
    Ok(())
}

fn write_extra_tuple(out: &mut Vec<u8>, items: &[ExtraKey]) -> Result<(), EncodeError> {
    write_array_len(out, "extra_keys tuple", items.len())?;
    items.iter().try_for_each(|k| write_extra_key(out, k))
}

fn write_extra_key(out: &mut Vec<u8>, key: &ExtraKey) -> Result<(), EncodeError> {
    match key {
        ExtraKey::Nil => mp::write_nil(out)?,
        ExtraKey::Bool(b) => mp::write_bool(out, *b)?,
        ExtraKey::Int(v) => {
            mp::write_sint(out, *v)?;
        }
        ExtraKey::Float(v) => mp::write_f64(out, *v)?,
        ExtraKey::Str(s) => write_str(out, s)?,
        ExtraKey::Bytes(b) => write_bin(out, b)?,
        ExtraKey::Tuple(items) => write_extra_tuple(out, items)?,
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(bytes: &[u8]) -> String {
        bytes.iter().map(|b| format!("{b:02x}")).collect()
    }

    #[test]
    fn ints_take_msgspecs_minimal_unsigned_forms() {
        let mut out = Vec::new();
        for v in [
            0u64,
            127,
            128,
            255,
            256,
            65_535,
            65_536,
            u64::from(u32::MAX),
            1 << 32,
        ] {
            write_uint(&mut out, v).unwrap();
        }
        assert_eq!(
            hex(&out),
            "007fcc80ccffcd0100cdffffce00010000ceffffffffcf0000000100000000"
        );
    }

    #[test]
    fn extra_key_ints_are_signed_only_when_negative() {
        let key = ExtraKey::Tuple(vec![
            ExtraKey::Int(-1),
            ExtraKey::Int(-200),
            ExtraKey::Int(200),
        ]);
        let mut out = Vec::new();
        write_extra_key(&mut out, &key).unwrap();
        // Python msgspec: msgspec.msgpack.encode((-1, -200, 200)).hex()
        assert_eq!(hex(&out), "93ffd1ff38ccc8");
    }

    #[test]
    fn map_header_is_sized_for_all_declared_fields() {
        let stored =
            KvEvent::BlockStored(BlockStored::new(vec![BlockHash::Int(1)], None, vec![7], 1));
        let bytes = encode_event(&stored, Layout::Map).unwrap();
        // 8 entries present, but the header is map16 because 0.33 declares 16 possible entries.
        assert_eq!(&bytes[..3], &[0xde, 0x00, 0x08]);
        let removed = KvEvent::BlockRemoved(BlockRemoved::new(vec![BlockHash::Int(1)]));
        let bytes = encode_event(&removed, Layout::Map).unwrap();
        assert_eq!(bytes[0], 0x83);
    }

    #[test]
    fn array_layout_keeps_trailing_nils_and_skips_post_023_fields() {
        let stored = KvEvent::BlockStored(BlockStored {
            locality: Some("LOCAL".into()),
            ..BlockStored::new(vec![BlockHash::Bytes(vec![0xab; 2])], None, vec![], 1)
        });
        let bytes = encode_event(&stored, Layout::Array).unwrap();
        assert_eq!(bytes[0], 0x9c);
        assert!(hex(&bytes).ends_with("c0c0c0c0"), "{}", hex(&bytes));
        assert!(!hex(&bytes).contains(&hex(b"LOCAL")));
        assert!(hex(&bytes).contains("c402abab"));
    }
}
