//! Feeds arbitrary bytes to the KV-event payload decoder and whatever decodes into the mirror.
//! vLLM (or anything else on that ZMQ port) must never be able to crash the sidecar.

use kvsight_sidecar::kv_events::decode::decode_batch;
use kvsight_sidecar::mirror::Mirror;

/// One input, as libFuzzer or the corpus replay hands it over.
pub fn run(data: &[u8]) {
    let Ok(batch) = decode_batch(data) else {
        return;
    };
    let mut mirror = Mirror::new(64).expect("valid size");
    for event in &batch.events {
        mirror.apply(event);
    }
    let _ = mirror.filter_mut().take_delta();
}
