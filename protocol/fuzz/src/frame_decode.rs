//! Feeds arbitrary bytes to the frame decoder in both directions, and whatever decodes into the
//! filter code a router runs on it. Nothing may panic; a decoded message must re-encode to a
//! frame that decodes to the same message.

use kvsight_protocol::bloom::BloomFilter;
use kvsight_protocol::frame::{self, FrameReader, WireMessage};
use kvsight_protocol::messages::{RouterMessage, SidecarMessage};

fn drain<M: WireMessage + PartialEq + std::fmt::Debug>(data: &[u8], mut on: impl FnMut(&M)) {
    // Split the input at a data-chosen point to exercise reassembly as well.
    let cut = data
        .first()
        .map_or(0, |&b| usize::from(b) % (data.len() + 1));
    let mut reader = FrameReader::new(1 << 20);
    for piece in [&data[..cut], &data[cut..]] {
        reader.push(piece);
        // Each frame consumes at least 4 bytes, so this bound is never the limiting one.
        for _ in 0..=data.len() {
            match reader.next_message::<M>() {
                Ok(Some(msg)) => {
                    let again = frame::encode(&msg).expect("a decoded message re-encodes");
                    let (back, used) = frame::decode::<M>(&again, usize::MAX)
                        .expect("re-encoded frame decodes")
                        .expect("whole frame");
                    assert_eq!(used, again.len());
                    assert_eq!(back, msg);
                    on(&msg);
                }
                Ok(None) | Err(_) => break,
            }
        }
    }
}

/// One input, as libFuzzer or the corpus replay hands it over.
pub fn run(data: &[u8]) {
    let mut filter: Option<BloomFilter> = None;
    drain::<SidecarMessage>(data, |msg| match msg {
        SidecarMessage::CacheSnapshot(s) => filter = BloomFilter::from_snapshot(s).ok(),
        SidecarMessage::CacheDelta(d) => {
            if let Some(f) = filter.as_mut() {
                let _ = f.apply_delta(d);
                let _ = f.longest_prefix(&[1, 2, 3]);
            }
        }
        _ => {}
    });
    drain::<RouterMessage>(data, |_| {});
}
