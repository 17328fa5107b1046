//! Mutual TLS for QUIC: both sides present a certificate issued by the configured CA.
//!
//! The router requires a client certificate from its CA before a sidecar can say anything, so
//! nothing joins the pool without one; the sidecar verifies the router's certificate against the
//! same CA and the name it dialled. The crypto provider is chosen explicitly (ring) so a build that
//! links another provider through some dependency can never make the choice ambiguous at run time.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::RootCertStore;
use rustls::server::WebPkiClientVerifier;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};

use crate::TransportError;
use crate::files::{DirWatch, WatchError, parent_dir, watch_dirs};

/// ALPN protocol id: a peer speaking anything else fails the handshake.
pub const ALPN: &[u8] = b"kvsight/1";

/// This side's certificate chain and key, and the CA that peers must be issued by.
#[derive(Debug)]
pub struct TlsMaterial {
    chain: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
    roots: Arc<RootCertStore>,
}

impl Clone for TlsMaterial {
    fn clone(&self) -> Self {
        TlsMaterial {
            chain: self.chain.clone(),
            key: self.key.clone_key(),
            roots: self.roots.clone(),
        }
    }
}

impl TlsMaterial {
    /// Reads PEM files: a certificate chain, its private key and the CA bundle.
    pub fn from_pem_files(cert: &Path, key: &Path, ca: &Path) -> Result<Self, TransportError> {
        let read = |p: &Path| {
            std::fs::read(p)
                .map_err(|e| TransportError::Tls(format!("reading {}: {e}", p.display())))
        };
        Self::from_pem(&read(cert)?, &read(key)?, &read(ca)?)
    }

    /// Parses PEM text: a certificate chain, its private key and the CA bundle.
    pub fn from_pem(cert: &[u8], key: &[u8], ca: &[u8]) -> Result<Self, TransportError> {
        let chain = CertificateDer::pem_slice_iter(cert)
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| TransportError::Tls(format!("certificate: {e}")))?;
        if chain.is_empty() {
            return Err(TransportError::Tls(
                "certificate file holds no certificate".into(),
            ));
        }
        let key = PrivateKeyDer::from_pem_slice(key)
            .map_err(|e| TransportError::Tls(format!("private key: {e}")))?;
        let mut roots = RootCertStore::empty();
        for ca in CertificateDer::pem_slice_iter(ca) {
            let ca = ca.map_err(|e| TransportError::Tls(format!("CA bundle: {e}")))?;
            roots
                .add(ca)
                .map_err(|e| TransportError::Tls(format!("CA certificate: {e}")))?;
        }
        if roots.is_empty() {
            return Err(TransportError::Tls("CA bundle holds no certificate".into()));
        }
        Ok(TlsMaterial {
            chain,
            key,
            roots: Arc::new(roots),
        })
    }

    fn provider() -> Arc<rustls::crypto::CryptoProvider> {
        Arc::new(rustls::crypto::ring::default_provider())
    }

    /// The router's side: requires a client certificate issued by the CA.
    pub fn server_config(&self) -> Result<rustls::ServerConfig, TransportError> {
        let verifier =
            WebPkiClientVerifier::builder_with_provider(self.roots.clone(), Self::provider())
                .build()
                .map_err(|e| TransportError::Tls(format!("client verifier: {e}")))?;
        let mut cfg = rustls::ServerConfig::builder_with_provider(Self::provider())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(|e| TransportError::Tls(e.to_string()))?
            .with_client_cert_verifier(verifier)
            .with_single_cert(self.chain.clone(), self.key.clone_key())
            .map_err(|e| TransportError::Tls(format!("certificate and key: {e}")))?;
        cfg.alpn_protocols = vec![ALPN.to_vec()];
        Ok(cfg)
    }

    /// The sidecar's side: presents its certificate, verifies the router's against the CA.
    pub fn client_config(&self) -> Result<rustls::ClientConfig, TransportError> {
        let mut cfg = rustls::ClientConfig::builder_with_provider(Self::provider())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(|e| TransportError::Tls(e.to_string()))?
            .with_root_certificates(self.roots.clone())
            .with_client_auth_cert(self.chain.clone(), self.key.clone_key())
            .map_err(|e| TransportError::Tls(format!("certificate and key: {e}")))?;
        cfg.alpn_protocols = vec![ALPN.to_vec()];
        Ok(cfg)
    }
}

/// Where one side's TLS material lives on disk: usually a mounted Secret (`tls.crt`, `tls.key`,
/// `ca.crt`) that cert-manager rewrites on every renewal.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
    pub ca: PathBuf,
}

/// What one look at changed TLS files did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TlsReload {
    /// New material is in use for new handshakes.
    Applied,
    /// The bytes are the ones in use (an event for another file, or a touch).
    Unchanged,
    /// The files do not make usable material (unreadable, not PEM, the key does not match the
    /// certificate, ...): the material in use stays.
    Rejected(String),
}

impl TlsReload {
    /// The metric label of this outcome.
    pub fn label(&self) -> &'static str {
        match self {
            TlsReload::Applied => "applied",
            TlsReload::Unchanged => "unchanged",
            TlsReload::Rejected(_) => "rejected",
        }
    }
}

impl TlsFiles {
    /// Reads and parses the three files.
    pub fn load(&self) -> Result<TlsMaterial, TransportError> {
        TlsMaterial::from_pem_files(&self.cert, &self.key, &self.ca)
    }

    fn read(&self) -> Option<[Vec<u8>; 3]> {
        Some([
            std::fs::read(&self.cert).ok()?,
            std::fs::read(&self.key).ok()?,
            std::fs::read(&self.ca).ok()?,
        ])
    }

    /// Watches the files and hands every changed, parseable set to `apply`, which builds what it
    /// needs from it (and so rejects a key that does not match its certificate) and swaps it in.
    /// `report` hears every outcome. Established connections keep the keys they were set up
    /// with; only new handshakes use the new material, which is all a renewal needs.
    ///
    /// Why: certificates expire. Without this, a cert-manager renewal is invisible to a running
    /// process, and after the old certificate's end every reconnect (a restarted router, a new
    /// replica, a network blip) fails the handshake — for the whole fleet at once. Restarting
    /// model pods to pick up a certificate would reload the model, minutes of GPU time each.
    pub fn watch(
        self,
        mut apply: impl FnMut(TlsMaterial) -> Result<(), TransportError> + Send + 'static,
        mut report: impl FnMut(&TlsReload) + Send + 'static,
    ) -> Result<DirWatch, WatchError> {
        let dirs = [&self.cert, &self.key, &self.ca].map(|p| parent_dir(p));
        let mut in_use = self.read();
        watch_dirs(&dirs, move || {
            let bytes = self.read();
            let outcome = match &bytes {
                Some(b) if Some(b) == in_use.as_ref() => TlsReload::Unchanged,
                // A file missing mid-swap: the next event (the swap's end) brings it back.
                None => TlsReload::Rejected("a TLS file cannot be read".into()),
                Some([cert, key, ca]) => {
                    match TlsMaterial::from_pem(cert, key, ca).and_then(&mut apply) {
                        Ok(()) => {
                            in_use = bytes.clone();
                            tracing::info!(cert = %self.cert.display(), "TLS material reloaded; new handshakes use it");
                            TlsReload::Applied
                        }
                        Err(e) => {
                            tracing::warn!(cert = %self.cert.display(), error = %e, "TLS files changed but cannot be used; keeping the material in use");
                            TlsReload::Rejected(e.to_string())
                        }
                    }
                }
            };
            report(&outcome);
        })
    }
}
