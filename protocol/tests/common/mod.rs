//! What the protocol's tests share. (The harness crate depends on the protocol, so the
//! protocol's own tests cannot use it.)

use kvsight_protocol::messages::EngineFacts;

/// A vLLM 0.33 engine: block size 16, 1,000 GPU blocks, prefix caching on, 256 sequences, a
/// 4,096-token window, 2,048 batched tokens. The pinned frame bytes in vectors.rs encode it.
pub(crate) fn engine() -> EngineFacts {
    EngineFacts {
        block_size: 16,
        num_gpu_blocks: 1000,
        prefix_caching: true,
        max_num_seqs: 256,
        max_model_len: 4096,
        max_num_batched_tokens: Some(2048),
        engine_version: "0.33.0".into(),
    }
}
