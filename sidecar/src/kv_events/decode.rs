//! Decoding vLLM's KV-event payloads, every layout vLLM 0.9 – 0.33 has published.
//!
//! vLLM encodes with msgspec: a batch is `[ts, events, data_parallel_rank]` (two elements before
//! 0.10), events are maps with `"type"` first since 0.24 and tagged positional arrays up to 0.23,
//! fields are appended release after release, and hashes are unsigned 64-bit integers or raw
//! bytes. We decode through a generic msgpack value and pick fields by name or position, so
//! unknown and extra fields are ignored and missing trailing fields take their defaults. A
//! payload we cannot make sense of is an error for that payload only; the caller counts and skips
//! it.

use rmpv::Value;

/// vLLM's identity of a block: its own hash, as an integer (default) or bytes
/// (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum VllmHash {
    Int(u64),
    Bytes(Vec<u8>),
}

impl VllmHash {
    /// A compact key for maps: the integer itself, or an xxh3 of the bytes (a pod uses one form
    /// for its whole life, so the two spaces never meet).
    pub fn key(&self) -> u64 {
        match self {
            VllmHash::Int(v) => *v,
            VllmHash::Bytes(b) => xxhash_rust::xxh3::xxh3_64(b),
        }
    }
}

/// One scheduler step's events.
#[derive(Debug, Clone, PartialEq)]
pub struct Batch {
    pub ts: f64,
    pub events: Vec<Event>,
    pub data_parallel_rank: Option<i64>,
}

/// One KV-cache event.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    Stored(Stored),
    Removed(Removed),
    AllCleared,
    /// An event type this build does not know (a newer vLLM); counted and ignored.
    Unknown(String),
}

/// `BlockStored`: consecutive full blocks of one request became cached.
#[derive(Debug, Clone, PartialEq)]
pub struct Stored {
    pub block_hashes: Vec<VllmHash>,
    pub parent_block_hash: Option<VllmHash>,
    /// The tokens of all these blocks, concatenated.
    pub token_ids: Vec<u32>,
    pub block_size: u32,
    pub lora_id: Option<i64>,
    pub medium: Option<String>,
    pub lora_name: Option<String>,
    /// One entry per block: the untagged extra keys vLLM hashed with it.
    pub extra_keys: Option<Vec<Option<Vec<Value>>>>,
    pub group_idx: Option<i64>,
    pub kv_cache_spec_kind: Option<String>,
}

/// `BlockRemoved`: blocks evicted from the cache.
#[derive(Debug, Clone, PartialEq)]
pub struct Removed {
    pub block_hashes: Vec<VllmHash>,
    pub medium: Option<String>,
    pub group_idx: Option<i64>,
}

/// Why a payload could not be decoded.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum DecodeError {
    #[error("payload is not msgpack: {0}")]
    NotMsgpack(String),
    #[error("payload has {0} bytes after the batch")]
    TrailingBytes(usize),
    #[error("batch is neither a 2/3-element array nor a map")]
    BadBatch,
    #[error("event {index}: {why}")]
    BadEvent { index: usize, why: String },
}

/// How deeply msgpack containers (arrays, maps) may nest in a payload, the batch itself counted. vLLM's deepest is an extra key inside a
/// block's list inside `extra_keys` inside an event inside the batch (six levels). rmpv's own
/// limit, 1,024, lets a 524-byte payload of nested maps recurse deep enough to overflow a 2 MiB
/// thread stack (a tokio worker's) in a debug build — the fuzz corpus holds one — and abort the
/// sidecar.
pub const MAX_NESTING: usize = 32;

/// Decodes one PUB payload.
pub fn decode_batch(payload: &[u8]) -> Result<Batch, DecodeError> {
    let mut rd = payload;
    // rmpv spends two units of its depth on a container (the value, then its items) and one on
    // a leaf.
    let value = rmpv::decode::read_value_with_max_depth(&mut rd, 2 * MAX_NESTING + 1)
        .map_err(|e| DecodeError::NotMsgpack(e.to_string()))?;
    if !rd.is_empty() {
        return Err(DecodeError::TrailingBytes(rd.len()));
    }
    let (ts, events, rank) = match &value {
        Value::Array(items) if (2..=3).contains(&items.len()) => {
            (&items[0], &items[1], items.get(2))
        }
        Value::Map(_) => (
            field(&value, "ts").ok_or(DecodeError::BadBatch)?,
            field(&value, "events").ok_or(DecodeError::BadBatch)?,
            field(&value, "data_parallel_rank"),
        ),
        _ => return Err(DecodeError::BadBatch),
    };
    let ts = ts
        .as_f64()
        .or_else(|| ts.as_i64().map(|i| i as f64))
        .ok_or(DecodeError::BadBatch)?;
    let Value::Array(raw) = events else {
        return Err(DecodeError::BadBatch);
    };
    let events = raw
        .iter()
        .enumerate()
        .map(|(index, e)| decode_event(e).map_err(|why| DecodeError::BadEvent { index, why }))
        .collect::<Result<_, _>>()?;
    Ok(Batch {
        ts,
        events,
        data_parallel_rank: rank.and_then(Value::as_i64),
    })
}

fn field<'a>(map: &'a Value, name: &str) -> Option<&'a Value> {
    map.as_map()?
        .iter()
        .find(|(k, _)| k.as_str() == Some(name))
        .map(|(_, v)| v)
        .filter(|v| !v.is_nil())
}

/// Field accessor over both layouts: by name in a map, by position in a tagged array.
struct Fields<'a> {
    value: &'a Value,
}

impl<'a> Fields<'a> {
    fn get(&self, name: &str, position: usize) -> Option<&'a Value> {
        match self.value {
            Value::Map(_) => field(self.value, name),
            Value::Array(items) => items.get(position).filter(|v| !v.is_nil()),
            _ => None,
        }
    }

    fn required(&self, name: &str, position: usize) -> Result<&'a Value, String> {
        self.get(name, position)
            .ok_or_else(|| format!("missing field {name}"))
    }
}

// Positions in the tagged-array layout (index 0 is the tag). Later vLLM versions append.
const STORED_POS: [(&str, usize); 10] = [
    ("block_hashes", 1),
    ("parent_block_hash", 2),
    ("token_ids", 3),
    ("block_size", 4),
    ("lora_id", 5),
    ("medium", 6),
    ("lora_name", 7),
    ("extra_keys", 8),
    ("group_idx", 9),
    ("kv_cache_spec_kind", 10),
];
const REMOVED_POS: [(&str, usize); 3] = [("block_hashes", 1), ("medium", 2), ("group_idx", 3)];

fn pos(table: &[(&str, usize)], name: &str) -> usize {
    table
        .iter()
        .find(|(n, _)| *n == name)
        .map_or(usize::MAX, |(_, p)| *p)
}

fn decode_event(value: &Value) -> Result<Event, String> {
    let tag = match value {
        Value::Map(_) => field(value, "type").and_then(Value::as_str),
        Value::Array(items) => items.first().and_then(Value::as_str),
        _ => None,
    }
    .ok_or("event has no type tag")?;
    let f = Fields { value };
    match tag {
        "BlockStored" => {
            let p = |n| pos(&STORED_POS, n);
            Ok(Event::Stored(Stored {
                block_hashes: hashes(f.required("block_hashes", p("block_hashes"))?)?,
                parent_block_hash: f
                    .get("parent_block_hash", p("parent_block_hash"))
                    .map(hash)
                    .transpose()?,
                token_ids: tokens(f.required("token_ids", p("token_ids"))?)?,
                block_size: f
                    .required("block_size", p("block_size"))?
                    .as_u64()
                    .and_then(|b| u32::try_from(b).ok())
                    .filter(|&b| b > 0)
                    .ok_or("block_size is not a positive integer")?,
                lora_id: f.get("lora_id", p("lora_id")).and_then(Value::as_i64),
                medium: string(f.get("medium", p("medium"))),
                lora_name: string(f.get("lora_name", p("lora_name"))),
                extra_keys: f
                    .get("extra_keys", p("extra_keys"))
                    .map(extra_keys)
                    .transpose()?,
                group_idx: f.get("group_idx", p("group_idx")).and_then(Value::as_i64),
                kv_cache_spec_kind: string(f.get("kv_cache_spec_kind", p("kv_cache_spec_kind"))),
            }))
        }
        "BlockRemoved" => {
            let p = |n| pos(&REMOVED_POS, n);
            Ok(Event::Removed(Removed {
                block_hashes: hashes(f.required("block_hashes", p("block_hashes"))?)?,
                medium: string(f.get("medium", p("medium"))),
                group_idx: f.get("group_idx", p("group_idx")).and_then(Value::as_i64),
            }))
        }
        "AllBlocksCleared" => Ok(Event::AllCleared),
        other => Ok(Event::Unknown(other.to_owned())),
    }
}

fn string(v: Option<&Value>) -> Option<String> {
    v.and_then(Value::as_str).map(str::to_owned)
}

fn hash(v: &Value) -> Result<VllmHash, String> {
    match v {
        Value::Integer(i) => i
            .as_u64()
            // msgspec writes non-negative ints; a negative one would come from a foreign encoder
            // that treats the 8 bytes as signed: keep the same bits.
            .or_else(|| i.as_i64().map(|s| s as u64))
            .map(VllmHash::Int)
            .ok_or_else(|| "hash integer out of range".to_owned()),
        Value::Binary(b) => Ok(VllmHash::Bytes(b.clone())),
        other => Err(format!("hash is neither int nor bytes: {other}")),
    }
}

fn hashes(v: &Value) -> Result<Vec<VllmHash>, String> {
    v.as_array()
        .ok_or("block_hashes is not a list")?
        .iter()
        .map(hash)
        .collect()
}

fn tokens(v: &Value) -> Result<Vec<u32>, String> {
    v.as_array()
        .ok_or("token_ids is not a list")?
        .iter()
        .map(|t| {
            t.as_u64()
                .and_then(|t| u32::try_from(t).ok())
                .ok_or_else(|| format!("token id {t} is not a u32"))
        })
        .collect()
}

fn extra_keys(v: &Value) -> Result<Vec<Option<Vec<Value>>>, String> {
    v.as_array()
        .ok_or("extra_keys is not a list")?
        .iter()
        .map(|entry| match entry {
            Value::Nil => Ok(None),
            Value::Array(keys) => Ok(Some(keys.clone())),
            // A single bare key (not wrapped in a tuple) from older encoders.
            other => Ok(Some(vec![other.clone()])),
        })
        .collect()
}
