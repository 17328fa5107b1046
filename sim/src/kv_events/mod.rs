//! vLLM's KV-cache event stream, as it appears on the wire: the event types, the msgpack
//! encoding msgspec produces for them (both the map layout of vLLM >= 0.24 and the tagged-array
//! layout of <= 0.23), and a ZMQ publisher with vLLM's replay socket and fault knobs.
//!
//! The types mirror vLLM's `vllm/distributed/kv_events.py` field for field so that the sidecar,
//! which decodes them, cannot tell the simulator from a real engine. Decoding is deliberately not
//! here: the sidecar owns its decoder, and a second one in the testbed would only prove that two
//! pieces of our own code agree with each other. [`client`] is a minimal raw-frame reader for tests.

pub mod client;
mod encode;
mod publisher;

pub use encode::{EncodeError, Layout, encode_batch, encode_event};
pub use publisher::{
    END_SEQ, EndpointMode, KvEventPublisher, PublishError, PublisherConfig, ReplayLayout,
    offset_endpoint_port,
};

/// `medium` of blocks in GPU memory, the only medium the simulator has.
pub const MEDIUM_GPU: &str = "GPU";

/// A vLLM block hash as published: the low 64 bits of vLLM's digest as an unsigned int (the
/// default), or the raw digest bytes when `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum BlockHash {
    /// msgpack unsigned int, minimal width (values >= 2^32 are `cf` + 8 bytes).
    Int(u64),
    /// msgpack `bin`.
    Bytes(Vec<u8>),
}

/// One value inside an `extra_keys` tuple. vLLM types these as `Any` (LoRA name, cache salt,
/// `(mm_identifier, offset)` pairs, prompt-embedding digests), so the encoding must be free-form.
#[derive(Debug, Clone, PartialEq)]
pub enum ExtraKey {
    Nil,
    Bool(bool),
    /// Encoded as msgspec encodes Python ints: minimal width, unsigned forms for values >= 0.
    Int(i64),
    Float(f64),
    Str(String),
    Bytes(Vec<u8>),
    /// A nested tuple, e.g. `(mm_identifier, offset)`; encoded as a msgpack array.
    Tuple(Vec<ExtraKey>),
}

/// `BlockStored`: blocks that became resident (newly computed, or with vLLM 0.33 also reused from
/// the prefix cache). Fields appear in vLLM's declaration order; the comments say which vLLM
/// version introduced each one.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct BlockStored {
    pub block_hashes: Vec<BlockHash>,
    /// `None` for the first block of a sequence (encoded as nil, never omitted).
    pub parent_block_hash: Option<BlockHash>,
    /// The concatenated tokens of all blocks in `block_hashes`.
    pub token_ids: Vec<u32>,
    pub block_size: u32,
    /// Deprecated in vLLM but still always encoded (nil when `None`).
    pub lora_id: Option<u64>,
    /// 0.10.2+; always encoded (nil when `None`). See [`MEDIUM_GPU`].
    pub medium: Option<String>,
    /// 0.14+; always encoded (nil when `None`).
    pub lora_name: Option<String>,
    /// 0.18+: one entry per block; omitted from the map layout when `None`.
    pub extra_keys: Option<Vec<Option<Vec<ExtraKey>>>>,
    /// 0.20+; omitted from the map layout when `None`.
    pub group_idx: Option<u32>,
    /// 0.22+ (e.g. `"full_attention"`); omitted from the map layout when `None`.
    pub kv_cache_spec_kind: Option<String>,
    /// 0.22+; omitted from the map layout when `None`.
    pub kv_cache_spec_sliding_window: Option<u32>,
    /// 0.28+ (`"LOCAL"`/`"REMOTE"`); map layout only, omitted when `None`.
    pub locality: Option<String>,
    /// 0.30+; map layout only, omitted when `None`.
    pub ownership: Option<String>,
    /// 0.30+; map layout only, omitted when `None`.
    pub session_id: Option<String>,
    /// 0.33+: one token list per block; map layout only, omitted when `None`.
    pub lookahead_token_ids: Option<Vec<Vec<u32>>>,
}

impl BlockStored {
    /// A GPU store event with the fields every vLLM version has; later fields start as `None`
    /// and are set with struct-update syntax.
    pub fn new(
        block_hashes: Vec<BlockHash>,
        parent_block_hash: Option<BlockHash>,
        token_ids: Vec<u32>,
        block_size: u32,
    ) -> Self {
        Self {
            block_hashes,
            parent_block_hash,
            token_ids,
            block_size,
            medium: Some(MEDIUM_GPU.to_owned()),
            ..Self::default()
        }
    }
}

/// `BlockRemoved`: blocks evicted from the cache (vLLM usually sends one hash per event).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct BlockRemoved {
    pub block_hashes: Vec<BlockHash>,
    /// Always encoded (nil when `None`).
    pub medium: Option<String>,
    /// Omitted from the map layout when `None`.
    pub group_idx: Option<u32>,
    /// 0.28+; map layout only, omitted when `None`.
    pub locality: Option<String>,
    /// 0.30+; map layout only, omitted when `None`.
    pub ownership: Option<String>,
}

impl BlockRemoved {
    /// A GPU removal of `block_hashes`.
    pub fn new(block_hashes: Vec<BlockHash>) -> Self {
        Self {
            block_hashes,
            medium: Some(MEDIUM_GPU.to_owned()),
            ..Self::default()
        }
    }
}

/// One KV-cache event.
#[derive(Debug, Clone, PartialEq)]
pub enum KvEvent {
    BlockStored(BlockStored),
    BlockRemoved(BlockRemoved),
    /// Sent when the prefix cache is reset (`POST /reset_prefix_cache`).
    AllBlocksCleared,
}

impl KvEvent {
    /// The msgspec tag vLLM writes for this event (its Python class name).
    pub fn tag(&self) -> &'static str {
        match self {
            KvEvent::BlockStored(_) => "BlockStored",
            KvEvent::BlockRemoved(_) => "BlockRemoved",
            KvEvent::AllBlocksCleared => "AllBlocksCleared",
        }
    }
}

/// One scheduler step's events, the unit vLLM publishes under one sequence number.
#[derive(Debug, Clone, PartialEq)]
pub struct EventBatch {
    /// Wall-clock seconds since the Unix epoch (Python's `time.time()`), encoded as float64.
    pub ts: f64,
    pub events: Vec<KvEvent>,
    /// vLLM fills this with the publisher's DP rank (0 without data parallelism) when unset;
    /// `None` is encoded as nil.
    pub data_parallel_rank: Option<u32>,
}

impl EventBatch {
    pub fn new(ts: f64, events: Vec<KvEvent>) -> Self {
        Self {
            ts,
            events,
            data_parallel_rank: None,
        }
    }
}
