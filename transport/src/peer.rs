//! What a peer's certificate says about it, once the handshake has verified it: a fingerprint
//! that tells one certificate from another, the pod names it may register, and when it expires.
//!
//! A pod name is granted by a URI SAN `kvsight://pod/<namespace>/<name>`; a name ending in `*`
//! grants every pod name with that prefix (`kvsight://pod/llm/llama-short-*`: the pods of one
//! Deployment, which Kubernetes names `<deployment>-<hash>-<suffix>`; `kvsight://pod/llm/*`:
//! every pod of the namespace). The Helm chart issues one such certificate per model server.

use std::time::{Duration, SystemTime};

use rustls_pki_types::CertificateDer;
use sha2::{Digest, Sha256};

/// The URI SAN prefix that grants pod names.
pub const POD_URI_PREFIX: &str = "kvsight://pod/";

/// The URI SAN granting the pod `namespace/name` (a `name` ending in `*` grants a prefix).
pub fn pod_uri(namespace: &str, name: &str) -> String {
    format!("{POD_URI_PREFIX}{namespace}/{name}")
}

/// One pod name a certificate grants.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodGrant {
    pub namespace: String,
    /// The name, or with `prefix` the start of every name granted.
    pub name: String,
    pub prefix: bool,
}

impl PodGrant {
    /// Whether this grant covers the pod `namespace/name`.
    pub fn allows(&self, namespace: &str, name: &str) -> bool {
        self.namespace == namespace
            && if self.prefix {
                name.len() > self.name.len() && name.starts_with(&self.name)
            } else {
                self.name == name
            }
    }
}

/// A verified peer certificate, as far as kvsight reads it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerCertificate {
    /// SHA-256 of the end-entity certificate's DER.
    pub fingerprint: [u8; 32],
    /// The pod names its URI SANs grant.
    pub pods: Vec<PodGrant>,
    /// The end of its validity.
    pub not_after: SystemTime,
}

impl PeerCertificate {
    /// Reads an end-entity certificate; `None` when it does not parse (the handshake already
    /// verified it, so that does not happen with a certificate rustls accepted).
    pub fn from_der(der: &[u8]) -> Option<Self> {
        let (_, cert) = x509_parser::parse_x509_certificate(der).ok()?;
        let pods = cert
            .subject_alternative_name()
            .ok()
            .flatten()
            .map(|san| {
                san.value
                    .general_names
                    .iter()
                    .filter_map(|g| match g {
                        x509_parser::extensions::GeneralName::URI(u) => parse_grant(u),
                        _ => None,
                    })
                    .collect()
            })
            .unwrap_or_default();
        let secs = cert.validity().not_after.timestamp();
        let not_after = if secs >= 0 {
            SystemTime::UNIX_EPOCH + Duration::from_secs(secs as u64)
        } else {
            SystemTime::UNIX_EPOCH
        };
        Some(PeerCertificate {
            fingerprint: Sha256::digest(der).into(),
            pods,
            not_after,
        })
    }

    /// The certificate a QUIC peer presented (its first, end-entity certificate).
    pub fn of(conn: &quinn::Connection) -> Option<Self> {
        let identity = conn.peer_identity()?;
        let chain = identity.downcast_ref::<Vec<CertificateDer<'static>>>()?;
        Self::from_der(chain.first()?.as_ref())
    }

    /// Whether a URI SAN grants the pod `namespace/name`.
    pub fn allows(&self, namespace: &str, name: &str) -> bool {
        self.pods.iter().any(|g| g.allows(namespace, name))
    }

    /// The fingerprint as lower-case hex, for logs.
    pub fn fingerprint_hex(&self) -> String {
        self.fingerprint
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect()
    }
}

/// `kvsight://pod/<namespace>/<name>` → a grant; anything else is not one.
fn parse_grant(uri: &str) -> Option<PodGrant> {
    let rest = uri.strip_prefix(POD_URI_PREFIX)?;
    let (namespace, name) = rest.split_once('/')?;
    if namespace.is_empty() || name.is_empty() || name.contains('/') {
        return None;
    }
    let (name, prefix) = match name.strip_suffix('*') {
        Some(p) if !p.contains('*') => (p, true),
        Some(_) => return None,
        None if name.contains('*') => return None,
        None => (name, false),
    };
    Some(PodGrant {
        namespace: namespace.to_owned(),
        name: name.to_owned(),
        prefix,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grants_name_one_pod_or_a_prefix_in_one_namespace() {
        let one = parse_grant("kvsight://pod/llm/pod-a").unwrap();
        assert!(one.allows("llm", "pod-a"));
        assert!(!one.allows("llm", "pod-ab"));
        assert!(!one.allows("other", "pod-a"));
        let many = parse_grant("kvsight://pod/llm/llama-*").unwrap();
        assert!(many.allows("llm", "llama-5d8f-x7k2q"));
        assert!(
            !many.allows("llm", "llama-"),
            "a prefix grants longer names only"
        );
        assert!(!many.allows("llm", "mistral-1"));
        let all = parse_grant("kvsight://pod/llm/*").unwrap();
        assert!(all.allows("llm", "anything") && !all.allows("other", "anything"));
        for bad in [
            "kvsight://pod/llm",
            "kvsight://pod//a",
            "kvsight://pod/llm/",
            "kvsight://pod/llm/**",
            "kvsight://pod/llm/a*b",
            "kvsight://pod/llm/a/b",
            "spiffe://pod/llm/a",
        ] {
            assert_eq!(parse_grant(bad), None, "{bad}");
        }
    }
}
