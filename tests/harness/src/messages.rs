//! Protocol messages as tests, benches and examples build them by hand: a pod's `Hello` and an
//! idle Ready `Load` with ordinary values, adjusted with struct update syntax
//! (`Hello { instance_id: 7, ..messages::hello("pod-0", url) }`) instead of spelling out every
//! field each time.

use std::collections::BTreeMap;

use kvsight_protocol::messages::{EngineFacts, Hello, Load, PROTOCOL_VERSION, PodIdentity};

/// The model every sample pod serves.
pub const MODEL: &str = "m";

/// A vLLM 0.33 engine: block size 16, 1,000 GPU blocks, prefix caching on, 256 sequences,
/// a 4,096-token window.
pub fn engine() -> EngineFacts {
    EngineFacts {
        block_size: 16,
        num_gpu_blocks: 1000,
        prefix_caching: true,
        max_num_seqs: 256,
        max_model_len: 4096,
        max_num_batched_tokens: None,
        engine_version: "0.33.0".into(),
    }
}

/// Pod `name` in namespace `ns` at `url`, serving [`MODEL`] on [`engine`], no labels, no LoRA
/// adapters, no tokenizer, reporting every minute (so a pod registered by hand does not go stale
/// during a test).
pub fn hello(name: &str, url: &str) -> Hello {
    Hello {
        protocol_version: PROTOCOL_VERSION,
        instance_id: 1,
        pod: PodIdentity {
            name: name.into(),
            namespace: "ns".into(),
            url: url.into(),
            labels: BTreeMap::new(),
        },
        engine: engine(),
        models: vec![MODEL.into()],
        lora_adapters: vec![],
        tokenizer: None,
        sidecar_version: "test".into(),
        load_interval_ms: 60_000,
    }
}

/// A fresh report of a Ready pod with nothing running, nothing waiting and an empty cache.
pub fn idle_load() -> Load {
    Load::idle()
}
