//! `cargo xtask fleet`: what a router costs at fleet scale.
//!
//! A sidecar swarm ([`swarm`]: one process emulating N pods, each a sidecar publisher with its
//! own QUIC + mutual TLS connection to every router, publishing a real counting Bloom filter's
//! snapshot and deltas and load reports, and answering OpenAI requests on its own loopback
//! address through [`stub`]) feeds R real `kvsight-router` processes. The [`driver`] measures,
//! per N × R, each router's memory, the CPU of ingest alone (no requests), the view's staleness,
//! the bytes each router receives, and then, with requests at low load, the pick and the latency
//! the router adds.
//!
//! Names: pod `i` is [`pod_name`]`(i)` in namespace [`NAMESPACE`], on loopback address
//! [`pod_ip`]`(i)` (its QUIC source and its HTTP address, so the router's check that an
//! advertised URL names the connection's own address holds as in a cluster). Its certificate's
//! common name is the pod name and its DNS SANs are the pod name, `<pod>.<namespace>` and
//! [`SIDECAR_NAME`] (the name routers pin with `--sidecar-name`), so a rule tying the `Hello`'s
//! pod name to the certificate finds it there.

pub mod certs;
pub mod driver;
pub mod histogram;
pub mod stub;
pub mod swarm;

use std::net::Ipv4Addr;

/// The model every emulated pod serves.
pub const MODEL: &str = "fleet-model";
/// The namespace every emulated pod is in.
pub const NAMESPACE: &str = "fleet";
/// The DNS name every sidecar certificate carries and every router requires (`--sidecar-name`),
/// as the chart pins its sidecars' certificate.
pub const SIDECAR_NAME: &str = "kvsight-sidecar.fleet";
/// Tokens per KV block of the emulated engines.
pub const BLOCK_SIZE: u32 = 16;
/// Most pods one swarm can address (250 per third octet of 127.1.0.0/16).
pub const MAX_PODS: usize = 250 * 256;

/// Pod `i`'s name.
pub fn pod_name(i: usize) -> String {
    format!("fleet-{i:04}")
}

/// Pod `i`'s loopback address, 127.1.x.y (Linux routes all of 127.0.0.0/8 to `lo`).
pub fn pod_ip(i: usize) -> Ipv4Addr {
    assert!(i < MAX_PODS, "pod {i} is past {MAX_PODS}");
    Ipv4Addr::new(127, 1, (i / 250) as u8, (i % 250 + 1) as u8)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pod_addresses_are_distinct_loopback_addresses() {
        let ips: std::collections::HashSet<_> = (0..2_000).map(pod_ip).collect();
        assert_eq!(ips.len(), 2_000);
        assert!(ips.iter().all(|ip| ip.is_loopback()));
        assert_eq!(pod_ip(0), Ipv4Addr::new(127, 1, 0, 1));
        assert_eq!(pod_ip(250), Ipv4Addr::new(127, 1, 1, 1));
        assert_eq!(pod_name(7), "fleet-0007");
    }
}
