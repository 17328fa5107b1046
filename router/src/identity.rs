//! Which sidecar may register which pod. A sidecar certificate from the CA proves it is a
//! sidecar; the pod names it may register come from its URI SANs (`kvsight://pod/<ns>/<name>`,
//! see `kvsight_transport::PeerCertificate`), unless `pods.identity: any`. A name a live
//! connection holds can be taken over only by a connection with the same certificate (the same
//! sidecar reconnecting before the router noticed the old connection was gone): another
//! certificate is refused, so a stolen certificate cannot replace a pod it was not issued for.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use kvsight_transport::PeerCertificate;

use crate::config::PodIdentityMode;

/// Why a sidecar may not register the name it sent.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IdentityError {
    #[error("the certificate grants no pod name (no kvsight://pod/<namespace>/<name> URI SAN)")]
    NoGrant,
    #[error("the certificate does not grant the pod name {pod}")]
    NotGranted { pod: String },
    #[error("pod {pod} is registered by a live connection with another certificate")]
    Taken { pod: String },
}

impl IdentityError {
    /// The `reason` label of `kvsight_router_sidecars_refused_total`.
    pub fn reason(&self) -> &'static str {
        match self {
            IdentityError::NoGrant | IdentityError::NotGranted { .. } => "identity",
            IdentityError::Taken { .. } => "name_taken",
        }
    }
}

/// Whether `cert` may register `namespace/name` under `mode`.
pub fn check_name(
    mode: PodIdentityMode,
    cert: Option<&PeerCertificate>,
    namespace: &str,
    name: &str,
) -> Result<(), IdentityError> {
    if mode == PodIdentityMode::Any {
        return Ok(());
    }
    match cert {
        Some(c) if c.allows(namespace, name) => Ok(()),
        Some(c) if !c.pods.is_empty() => Err(IdentityError::NotGranted {
            pod: format!("{namespace}/{name}"),
        }),
        _ => Err(IdentityError::NoGrant),
    }
}

/// The certificate each live pod name is held by.
#[derive(Debug, Default, Clone)]
pub struct Owners {
    held: Arc<Mutex<HashMap<String, Owner>>>,
}

#[derive(Debug)]
struct Owner {
    fingerprint: [u8; 32],
    /// Which claim holds the name: a replaced claim must not release its successor's.
    claim: u64,
}

/// A connection's hold on a pod name, released when dropped (the connection ended).
#[derive(Debug)]
pub struct Claim {
    held: Arc<Mutex<HashMap<String, Owner>>>,
    key: String,
    id: u64,
}

fn lock(m: &Mutex<HashMap<String, Owner>>) -> MutexGuard<'_, HashMap<String, Owner>> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Owners {
    /// Claims `key` for a connection with the certificate `fingerprint`: refused while another
    /// certificate's connection holds it.
    pub fn claim(&self, key: &str, fingerprint: [u8; 32]) -> Result<Claim, IdentityError> {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        let mut held = lock(&self.held);
        if held.get(key).is_some_and(|o| o.fingerprint != fingerprint) {
            return Err(IdentityError::Taken {
                pod: key.to_owned(),
            });
        }
        let id = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        held.insert(
            key.to_owned(),
            Owner {
                fingerprint,
                claim: id,
            },
        );
        Ok(Claim {
            held: self.held.clone(),
            key: key.to_owned(),
            id,
        })
    }

    /// Names held now.
    pub fn len(&self) -> usize {
        lock(&self.held).len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Drop for Claim {
    fn drop(&mut self) {
        let mut held = lock(&self.held);
        if held.get(&self.key).is_some_and(|o| o.claim == self.id) {
            held.remove(&self.key);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_name_moves_only_between_connections_of_one_certificate() {
        let owners = Owners::default();
        let first = owners.claim("ns/a", [1; 32]).unwrap();
        assert_eq!(
            owners.claim("ns/a", [2; 32]).unwrap_err(),
            IdentityError::Taken { pod: "ns/a".into() }
        );
        // The same certificate reconnecting takes the name over; the old claim's end keeps it.
        let second = owners.claim("ns/a", [1; 32]).unwrap();
        drop(first);
        assert!(owners.claim("ns/a", [2; 32]).is_err());
        drop(second);
        assert!(owners.claim("ns/a", [2; 32]).is_ok());
    }
}
