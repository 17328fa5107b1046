//! The messages sidecars and routers exchange, one enum per direction.
//!
//! Compatibility rule: `Hello` is variant 0 of [`SidecarMessage`] and `protocol_version` is its
//! first field, forever; likewise `Welcome`/`Refused` lead [`RouterMessage`]. A peer of another
//! version can therefore always read the version and refuse with an error naming both, even when
//! the rest of the message no longer parses (see [`crate::frame`]).

use serde::{Deserialize, Serialize};

pub use crate::bloom::{CacheDelta, CacheSnapshot};

/// Version of everything in this crate that crosses the wire, including the canonical hash.
pub const PROTOCOL_VERSION: u16 = 3;

/// Sidecar → router.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum SidecarMessage {
    /// First message on every connection.
    Hello(Hello),
    /// The pod's load, at the scrape interval and at once on a phase change.
    Load(Load),
    /// The whole filter: after `Hello` on every (re)connect and after any doubt.
    CacheSnapshot(CacheSnapshot),
    /// What changed since the previous version.
    CacheDelta(CacheDelta),
    /// One piece of the model's tokenizer, answering [`RouterMessage::TokenizerRequest`].
    TokenizerChunk(TokenizerChunk),
    /// The sidecar is going away; the connection closes after this.
    Goodbye(Goodbye),
    /// Requests other router replicas just sent to this pod (their [`RouterMessage::Routed`]),
    /// relayed as they arrive.
    Placements(Placements),
    /// After the snapshot on every (re)connect: where prefixes were placed on this pod lately,
    /// by any router, so a router that (re)started knows each prefix's home as the running
    /// replicas do.
    RecentPlacements(RecentPlacements),
}

/// Router → sidecar.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum RouterMessage {
    /// Accepts a `Hello`.
    Welcome(Welcome),
    /// Refuses a `Hello`; the connection closes after this.
    Refused(Refused),
    /// How many requests this router replica has in flight on the pod right now.
    Inflight(Inflight),
    /// Asks for the model's tokenizer (the router has none for it, or a different digest).
    TokenizerRequest(TokenizerRequest),
    /// The router's filter no longer matches the deltas (a bug or corruption): send a snapshot.
    ResyncRequest,
    /// The router is shutting down.
    Goodbye(Goodbye),
    /// This router just sent a request to the pod: the sidecar relays it to every other router
    /// replica, so that where a prefix was placed reaches all of them before the pod's own
    /// events and reports can show it.
    Routed(Routed),
}

/// Who the pod is and what its engine can do. Sent once per connection.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Hello {
    /// Must stay the first field (see the module docs).
    pub protocol_version: u16,
    /// Random per sidecar process start: tells a restarted sidecar from a reconnect.
    pub instance_id: u64,
    pub pod: PodIdentity,
    pub engine: EngineFacts,
    /// Served model names (vLLM's `--served-model-name`), the first is the primary.
    pub models: Vec<String>,
    /// LoRA adapters the engine serves (their names are model names too).
    pub lora_adapters: Vec<String>,
    /// Identifies the tokenizer the sidecar can hand out, if it has one.
    pub tokenizer: Option<TokenizerInfo>,
    /// The sidecar's build, for logs and `/debug/pods`.
    pub sidecar_version: String,
    /// Milliseconds between `Load` reports: a router treats the pod as stale (no traffic) after
    /// three intervals without one.
    pub load_interval_ms: u32,
}

/// Where the pod is.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PodIdentity {
    pub name: String,
    pub namespace: String,
    /// The vLLM base URL routers send requests to, e.g. `http://10.0.3.7:8000`.
    pub url: String,
    /// The pod's labels that routers select pools by (e.g. `kvsight.io/pool=long`), from the
    /// downward API. Sorted, so the encoding is deterministic.
    pub labels: std::collections::BTreeMap<String, String>,
}

/// The engine's limits as vLLM reports them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EngineFacts {
    /// Tokens per KV block: the `B` of the canonical hash.
    pub block_size: u32,
    pub num_gpu_blocks: u64,
    pub prefix_caching: bool,
    pub max_num_seqs: u32,
    pub max_model_len: u32,
    /// Per-step token budget, when known.
    pub max_num_batched_tokens: Option<u32>,
    /// vLLM's version string, e.g. `0.33.0`.
    pub engine_version: String,
}

/// A tokenizer's identity: routers fetch it only when they lack this digest.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TokenizerInfo {
    /// Hex digest over every file of the tokenizer.
    pub digest: String,
    /// Total bytes of all files.
    pub total_bytes: u64,
}

/// Lifecycle of a pod as its sidecar sees it. Only `Ready` pods receive traffic.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Phase {
    /// Waiting for vLLM to answer `/health`.
    Starting,
    /// Running the warm-up plan: compile stalls are being absorbed.
    Warming,
    Ready,
    /// SIGTERM received: finishing what runs, accepting nothing new.
    Draining,
    /// vLLM stopped answering `/health`.
    Unhealthy,
}

impl Phase {
    /// Lower-case name used in metrics labels and JSON.
    pub fn as_str(self) -> &'static str {
        match self {
            Phase::Starting => "starting",
            Phase::Warming => "warming",
            Phase::Ready => "ready",
            Phase::Draining => "draining",
            Phase::Unhealthy => "unhealthy",
        }
    }

    /// Every phase, for exporting a gauge per phase.
    pub const ALL: [Phase; 5] = [
        Phase::Starting,
        Phase::Warming,
        Phase::Ready,
        Phase::Draining,
        Phase::Unhealthy,
    ];
}

/// How far the sidecar's mirror of the KV cache can be trusted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum CacheView {
    /// Every event since the last reset was seen.
    Exact,
    /// Events were missed and are being replayed.
    Recovering,
    /// Events were missed for good; the view was rebuilt and may lack blocks until they are
    /// stored again (under-reports hits, never invents them).
    Lost,
}

/// The pod's load, sampled from vLLM's own metrics.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Load {
    /// Increases by one per report on a connection.
    pub seq: u64,
    /// Milliseconds between sampling vLLM's metrics and sending this report. The router
    /// subtracts it from the arrival time to know which of its own sends the sample already
    /// includes, without comparing clocks across machines.
    pub sample_age_ms: u32,
    pub phase: Phase,
    pub cache_view: CacheView,
    /// `vllm:num_requests_running`.
    pub running: u32,
    /// `vllm:num_requests_waiting`.
    pub waiting: u32,
    /// `vllm:kv_cache_usage_perc`, 0 – 1.
    pub kv_usage: f32,
    /// running + waiting minus every router's reported in-flight count, never negative: the load
    /// that bypassed the routers.
    pub unrouted: u32,
    /// `vllm:prefix_cache_queries_total` (tokens).
    pub prefix_cache_queries: u64,
    /// `vllm:prefix_cache_hits_total` (tokens).
    pub prefix_cache_hits: u64,
    /// `vllm:num_preemptions_total`.
    pub preemptions: u64,
    /// Measured prefill throughput in tokens per second, when enough samples exist.
    pub prefill_tokens_per_s: Option<f32>,
    /// LoRA adapters with running requests.
    pub lora_running: Vec<String>,
    /// LoRA adapters with waiting requests.
    pub lora_waiting: Vec<String>,
}

/// Asks for the tokenizer of a model.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TokenizerRequest {
    pub model: String,
}

/// Which tokenizer file a chunk belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum TokenizerFile {
    /// HF `tokenizer.json`.
    TokenizerJson,
    /// HF `tokenizer_config.json` (special tokens, usually the chat template).
    TokenizerConfig,
    /// A separate `chat_template.jinja`, when the model has one.
    ChatTemplate,
}

/// One piece of one tokenizer file. Tokenizers can exceed a frame (Gemma's is over 30 MiB), so
/// files travel in chunks of at most [`crate::tokenizer_transfer::CHUNK_BYTES`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TokenizerChunk {
    pub model: String,
    pub digest: String,
    pub file: TokenizerFile,
    pub offset: u64,
    pub file_len: u64,
    /// Whether this is the final chunk of the final file.
    pub last: bool,
    #[serde(with = "serde_bytes")]
    pub data: Vec<u8>,
}

/// Accepts a sidecar.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Welcome {
    /// Must stay the first field.
    pub protocol_version: u16,
    /// The router replica's name, for the sidecar's logs and metrics.
    pub router_id: String,
}

/// Refuses a sidecar, naming why.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Refused {
    /// Must stay the first field.
    pub protocol_version: u16,
    pub reason: String,
}

/// A router's in-flight requests on the pod it reports to.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Inflight {
    pub seq: u64,
    pub requests: u32,
}

/// Most blocks of a chain carried in a placement. Longer prompts travel as their leading blocks:
/// 8,192 blocks are 131,072 tokens at a block size of 16.
pub const MAX_PLACEMENT_BLOCKS: usize = 8192;

/// Most placements in one [`Placements`] message.
pub const MAX_PLACEMENTS: usize = 1024;

/// A prompt's canonical block-hash chain (see [`crate::hash`]), as little-endian 8-byte words:
/// the hashes are uniformly random, so a varint would take 10 bytes for each.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct PackedChain(#[serde(with = "serde_bytes")] Vec<u8>);

impl PackedChain {
    /// Packs at most [`MAX_PLACEMENT_BLOCKS`] leading hashes of `chain`.
    pub fn new(chain: &[u64]) -> Self {
        let kept = &chain[..chain.len().min(MAX_PLACEMENT_BLOCKS)];
        PackedChain(kept.iter().flat_map(|h| h.to_le_bytes()).collect())
    }

    /// The words as they came, judged only when the message is decoded ([`Routed`]'s and
    /// [`Placements`]' checks).
    pub fn from_le_bytes(bytes: Vec<u8>) -> Self {
        PackedChain(bytes)
    }

    /// The hashes, in chain order.
    pub fn hashes(&self) -> impl ExactSizeIterator<Item = u64> + '_ {
        self.0
            .chunks_exact(8)
            .map(|w| u64::from_le_bytes(w.try_into().expect("8-byte words")))
    }

    pub fn len(&self) -> usize {
        self.0.len() / 8
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    fn validate(&self, field: &'static str) -> Result<(), InvalidField> {
        if !self.0.len().is_multiple_of(8) {
            return invalid(field, format!("{} bytes is not whole hashes", self.0.len()));
        }
        in_range(field, self.len() as u64, 0, MAX_PLACEMENT_BLOCKS as u64)
    }
}

/// What a router sent a pod: the prompt's chain at the pod's block size, the KV blocks it newly
/// takes there and the prompt tokens the pod is predicted to compute (as the router's own
/// projection counts them).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Routed {
    pub chain: PackedChain,
    pub new_blocks: u32,
    pub uncached_tokens: u32,
}

/// Placements on this pod by other router replicas.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Placements {
    pub entries: Vec<Placement>,
}

/// One relayed [`Routed`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Placement {
    /// Milliseconds between the sidecar receiving the placement and sending it on: with half
    /// the connection's round trip, how long ago it was made, without comparing clocks.
    pub age_ms: u32,
    pub routed: Routed,
}

/// Placements on this pod remembered by its sidecar (see [`SidecarMessage::RecentPlacements`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RecentPlacements {
    pub entries: Vec<RecentPlacement>,
}

/// What a home needs of one placement: the prompt's chain hashes at
/// [`crate::hash::prefix_depths`] of its length.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RecentPlacement {
    /// Milliseconds since the sidecar received it.
    pub age_ms: u32,
    /// Blocks in the placed prompt's chain.
    pub chain_len: u32,
    /// The chain's hash at each of `prefix_depths(chain_len)`, in order.
    pub depths: PackedChain,
}

impl RecentPlacement {
    /// The remembered part of `routed`'s chain.
    pub fn of(routed: &Routed, age_ms: u32) -> Self {
        let chain: Vec<u64> = routed.chain.hashes().collect();
        let depths: Vec<u64> = crate::hash::prefix_depths(chain.len())
            .map(|d| chain[d])
            .collect();
        RecentPlacement {
            age_ms,
            chain_len: u32::try_from(chain.len()).unwrap_or(u32::MAX),
            depths: PackedChain::new(&depths),
        }
    }

    /// `(chain index, hash)` of each remembered depth.
    pub fn marks(&self) -> impl Iterator<Item = (usize, u64)> + '_ {
        crate::hash::prefix_depths(self.chain_len as usize).zip(self.depths.hashes())
    }

    fn validate(&self) -> Result<(), InvalidField> {
        in_range(
            "RecentPlacements.entries.chain_len",
            self.chain_len.into(),
            0,
            MAX_PLACEMENT_BLOCKS as u64,
        )?;
        let want = crate::hash::prefix_depths(self.chain_len as usize).count();
        if self.depths.len() != want {
            return invalid(
                "RecentPlacements.entries.depths",
                format!(
                    "{} hashes for a chain of {} blocks (want {want})",
                    self.depths.len(),
                    self.chain_len
                ),
            );
        }
        self.depths.validate("RecentPlacements.entries.depths")
    }
}

/// Why a peer is leaving.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Goodbye {
    pub reason: CloseReason,
    pub message: String,
}

/// Reasons for closing a connection; also the QUIC application close codes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum CloseReason {
    /// Ordinary shutdown.
    Shutdown,
    /// The pod drained and is leaving the pool.
    Drained,
    /// The peer speaks another protocol version.
    VersionMismatch,
    /// The peer sent something this side could not decode or did not expect.
    ProtocolViolation,
}

impl CloseReason {
    /// The QUIC application error code for this reason.
    pub fn code(self) -> u32 {
        match self {
            CloseReason::Shutdown => 0,
            CloseReason::Drained => 1,
            CloseReason::VersionMismatch => 2,
            CloseReason::ProtocolViolation => 3,
        }
    }

    /// The reason for a QUIC application error code, if known.
    pub fn from_code(code: u64) -> Option<Self> {
        Some(match code {
            0 => CloseReason::Shutdown,
            1 => CloseReason::Drained,
            2 => CloseReason::VersionMismatch,
            3 => CloseReason::ProtocolViolation,
            _ => return None,
        })
    }
}

/// A decoded message carrying a number no honest peer sends (NaN, a negative rate, a zero block
/// size…). The frame decoder refuses it like a malformed frame, so the caller closes that one
/// connection: a sidecar reporting a NaN KV use would otherwise never look saturated, and a block
/// size of zero would make every prompt one endless block.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {reason}")]
pub struct InvalidField {
    /// The field's path in the message, e.g. `Load.kv_usage`.
    pub field: &'static str,
    pub reason: String,
}

/// Largest KV block size accepted in a `Hello`. vLLM's are 16–256, hybrid models' a few
/// thousand at most; far above both, and small enough that one block's hash input stays bounded.
pub const MAX_BLOCK_SIZE: u32 = 1 << 16;
/// Longest report interval accepted in a `Hello`: an hour (sidecars report every second or so).
pub const MAX_LOAD_INTERVAL_MS: u32 = 3_600_000;

fn invalid(field: &'static str, reason: impl Into<String>) -> Result<(), InvalidField> {
    Err(InvalidField {
        field,
        reason: reason.into(),
    })
}

fn in_range(field: &'static str, v: u64, lo: u64, hi: u64) -> Result<(), InvalidField> {
    if (lo..=hi).contains(&v) {
        Ok(())
    } else {
        invalid(field, format!("{v} is outside {lo} ..= {hi}"))
    }
}

/// Longest string a `Hello` may carry (a URL, a model name, a label value, a version). A frame
/// may be 16 MiB; a router keeps every `Hello` for as long as its pod is connected.
pub const MAX_HELLO_STRING: usize = 2048;
/// Most entries in each of a `Hello`'s lists (models, LoRA adapters, labels).
pub const MAX_HELLO_LIST: usize = 1024;

fn bounded_str(field: &'static str, v: &str) -> Result<(), InvalidField> {
    if v.len() <= MAX_HELLO_STRING {
        Ok(())
    } else {
        invalid(field, format!("{} bytes, over {MAX_HELLO_STRING}", v.len()))
    }
}

fn bounded_list<'a>(
    field: &'static str,
    items: impl ExactSizeIterator<Item = &'a str>,
) -> Result<(), InvalidField> {
    if items.len() > MAX_HELLO_LIST {
        return invalid(
            field,
            format!("{} entries, over {MAX_HELLO_LIST}", items.len()),
        );
    }
    for v in items {
        bounded_str(field, v)?;
    }
    Ok(())
}

impl Hello {
    /// Checks every number against what a real engine can report, and every string and list
    /// against [`MAX_HELLO_STRING`] and [`MAX_HELLO_LIST`].
    pub fn validate(&self) -> Result<(), InvalidField> {
        let p = &self.pod;
        bounded_str("Hello.pod.name", &p.name)?;
        bounded_str("Hello.pod.namespace", &p.namespace)?;
        bounded_str("Hello.pod.url", &p.url)?;
        bounded_list("Hello.pod.labels", p.labels.keys().map(String::as_str))?;
        bounded_list("Hello.pod.labels", p.labels.values().map(String::as_str))?;
        bounded_list("Hello.models", self.models.iter().map(String::as_str))?;
        bounded_list(
            "Hello.lora_adapters",
            self.lora_adapters.iter().map(String::as_str),
        )?;
        bounded_str("Hello.sidecar_version", &self.sidecar_version)?;
        bounded_str("Hello.engine.engine_version", &self.engine.engine_version)?;
        if let Some(t) = &self.tokenizer {
            bounded_str("Hello.tokenizer.digest", &t.digest)?;
        }
        let e = &self.engine;
        in_range(
            "Hello.engine.block_size",
            e.block_size.into(),
            1,
            MAX_BLOCK_SIZE.into(),
        )?;
        in_range(
            "Hello.engine.max_num_seqs",
            e.max_num_seqs.into(),
            1,
            u32::MAX.into(),
        )?;
        in_range(
            "Hello.engine.max_model_len",
            e.max_model_len.into(),
            1,
            u32::MAX.into(),
        )?;
        if let Some(t) = e.max_num_batched_tokens {
            in_range(
                "Hello.engine.max_num_batched_tokens",
                t.into(),
                1,
                u32::MAX.into(),
            )?;
        }
        in_range(
            "Hello.load_interval_ms",
            self.load_interval_ms.into(),
            1,
            MAX_LOAD_INTERVAL_MS.into(),
        )
    }
}

impl Load {
    /// The first report of a Ready pod with nothing running, nothing waiting, an empty cache
    /// and no prefill rate measured yet: the base tests and simulators change fields of.
    pub fn idle() -> Self {
        Load {
            seq: 1,
            sample_age_ms: 0,
            phase: Phase::Ready,
            cache_view: CacheView::Exact,
            running: 0,
            waiting: 0,
            kv_usage: 0.0,
            unrouted: 0,
            prefix_cache_queries: 0,
            prefix_cache_hits: 0,
            preemptions: 0,
            prefill_tokens_per_s: None,
            lora_running: vec![],
            lora_waiting: vec![],
        }
    }

    /// `kv_usage` must be a fraction and the prefill rate a finite, positive number: the router
    /// compares both with thresholds, and every comparison with NaN is false.
    pub fn validate(&self) -> Result<(), InvalidField> {
        if !(0.0..=1.0).contains(&self.kv_usage) {
            return invalid(
                "Load.kv_usage",
                format!("{} is not a fraction in 0 ..= 1", self.kv_usage),
            );
        }
        if let Some(r) = self.prefill_tokens_per_s
            && !(r.is_finite() && r > 0.0)
        {
            return invalid(
                "Load.prefill_tokens_per_s",
                format!("{r} is not a finite positive rate"),
            );
        }
        Ok(())
    }
}

impl CacheSnapshot {
    /// The filter's size is in range and the bits are exactly that size.
    pub fn validate(&self) -> Result<(), InvalidField> {
        self.params
            .check_snapshot(self.bits.len())
            .or_else(|e| invalid("CacheSnapshot.params", e.to_string()))
    }
}

impl CacheDelta {
    /// A delta leads from one version to the next (the gap coding already made `toggles`
    /// strictly increasing).
    pub fn validate(&self) -> Result<(), InvalidField> {
        if self.base_version.checked_add(1) != Some(self.version) {
            return invalid(
                "CacheDelta.version",
                format!(
                    "{} does not follow base_version {}",
                    self.version, self.base_version
                ),
            );
        }
        Ok(())
    }
}

impl TokenizerChunk {
    /// The chunk lies inside its file, and the file inside the transfer limit.
    pub fn validate(&self) -> Result<(), InvalidField> {
        let max = crate::tokenizer_transfer::MAX_TOKENIZER_BYTES;
        in_range("TokenizerChunk.file_len", self.file_len, 0, max)?;
        match self.offset.checked_add(self.data.len() as u64) {
            Some(end) if end <= self.file_len => Ok(()),
            _ => invalid(
                "TokenizerChunk.offset",
                format!(
                    "{} + {} bytes passes the file's end at {}",
                    self.offset,
                    self.data.len(),
                    self.file_len
                ),
            ),
        }
    }
}

impl SidecarMessage {
    /// Range checks of every numeric field; the frame decoder runs them on every message.
    pub fn validate(&self) -> Result<(), InvalidField> {
        match self {
            SidecarMessage::Hello(h) => h.validate(),
            SidecarMessage::Load(l) => l.validate(),
            SidecarMessage::CacheSnapshot(s) => s.validate(),
            SidecarMessage::CacheDelta(d) => d.validate(),
            SidecarMessage::TokenizerChunk(c) => c.validate(),
            SidecarMessage::Goodbye(_) => Ok(()),
            SidecarMessage::Placements(p) => {
                in_range(
                    "Placements.entries",
                    p.entries.len() as u64,
                    0,
                    MAX_PLACEMENTS as u64,
                )?;
                p.entries
                    .iter()
                    .try_for_each(|e| e.routed.chain.validate("Placements.entries.routed.chain"))
            }
            SidecarMessage::RecentPlacements(r) => {
                in_range(
                    "RecentPlacements.entries",
                    r.entries.len() as u64,
                    0,
                    MAX_PLACEMENTS as u64,
                )?;
                r.entries.iter().try_for_each(RecentPlacement::validate)
            }
        }
    }
}

impl RouterMessage {
    /// A placement's chain is whole hashes and not too long; every other numeric field of a
    /// router's message is valid whatever its value (sequence numbers, counts, versions checked
    /// separately).
    pub fn validate(&self) -> Result<(), InvalidField> {
        match self {
            RouterMessage::Routed(r) => r.chain.validate("Routed.chain"),
            RouterMessage::Welcome(_)
            | RouterMessage::Refused(_)
            | RouterMessage::Inflight(_)
            | RouterMessage::TokenizerRequest(_)
            | RouterMessage::ResyncRequest
            | RouterMessage::Goodbye(_) => Ok(()),
        }
    }
}
