//! kvsight-protocol: the one definition of what crosses the wire between sidecars and routers,
//! so the two can never drift apart.
//!
//! - [`hash`]: the canonical chained block hash both sides compute from token ids;
//! - [`bloom`]: the Bloom filter of resident blocks, its snapshots and deltas;
//! - [`messages`]: the messages, one enum per direction, versioned by [`PROTOCOL_VERSION`];
//! - [`frame`]: length-prefixed postcard frames with a size limit and typed decode errors;
//! - [`openai`]: OpenAI request fields read the way vLLM's pydantic models read them;
//! - [`tokenizer_transfer`]: chunking a model's tokenizer files for the wire.
//!
//! Tokenizing exactly as vLLM does (so the router's chain equals the one the sidecar computes
//! from the engine's own token ids) is the crate `kvsight-tokenizer` beside this one.
//!
//! Like `quinn-proto` under `quinn`, this crate does no I/O at all: no tokio, no sockets, no
//! files. The sidecar and the router own their transports and drive these types.

pub mod bloom;
pub mod frame;
pub mod hash;
pub mod messages;
pub mod openai;
pub mod splitmix;
pub mod tokenizer_transfer;

pub use bloom::{BloomFilter, CountingFilter, FilterError, FilterParams};
pub use frame::{FrameError, FrameReader, WireMessage};
pub use hash::{ChainSeed, extend_chain, hash_chain};
pub use messages::*;
