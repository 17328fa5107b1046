//! Mutual TLS for QUIC: both sides present a certificate issued by the configured CA.
//!
//! The router requires a client certificate from its CA before a sidecar can say anything, so
//! nothing joins the pool without one; the sidecar verifies the router's certificate against the
//! same CA and the name it dialled. The crypto provider is chosen explicitly (ring) so a build that
//! links another provider through some dependency can never make the choice ambiguous at run time.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::DistinguishedName;
use rustls::RootCertStore;
use rustls::client::danger::HandshakeSignatureValid;
use rustls::server::WebPkiClientVerifier;
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use rustls_pki_types::{ServerName, UnixTime};

use crate::TransportError;
use kvsight_process::files::{DirWatch, WatchError, parent_dir, watch_dirs};

/// ALPN protocol id: a peer speaking anything else fails the handshake.
pub const ALPN: &[u8] = b"kvsight/1";

/// This side's certificate chain and key, and the CA that peers must be issued by.
#[derive(Debug)]
pub struct TlsMaterial {
    chain: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
    roots: Arc<RootCertStore>,
    /// The PEM text this was parsed from (cert, key, CA): what a file watch compares the files
    /// with, so it knows whether the material in use is the one on disk.
    pem: Arc<[Vec<u8>; 3]>,
    /// As a server: a DNS name every client certificate must also be valid for.
    peer_name: Option<ServerName<'static>>,
}

impl Clone for TlsMaterial {
    fn clone(&self) -> Self {
        TlsMaterial {
            chain: self.chain.clone(),
            key: self.key.clone_key(),
            roots: self.roots.clone(),
            pem: self.pem.clone(),
            peer_name: self.peer_name.clone(),
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
    pub fn from_pem(cert: &[u8], key_pem: &[u8], ca_pem: &[u8]) -> Result<Self, TransportError> {
        let chain = CertificateDer::pem_slice_iter(cert)
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| TransportError::Tls(format!("certificate: {e}")))?;
        if chain.is_empty() {
            return Err(TransportError::Tls(
                "certificate file holds no certificate".into(),
            ));
        }
        let key = PrivateKeyDer::from_pem_slice(key_pem)
            .map_err(|e| TransportError::Tls(format!("private key: {e}")))?;
        let mut roots = RootCertStore::empty();
        for ca in CertificateDer::pem_slice_iter(ca_pem) {
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
            pem: Arc::new([cert.to_vec(), key_pem.to_vec(), ca_pem.to_vec()]),
            peer_name: None,
        })
    }

    fn provider() -> Arc<rustls::crypto::CryptoProvider> {
        Arc::new(rustls::crypto::ring::default_provider())
    }

    /// As a server, also require every client certificate to be valid for the DNS name `name`
    /// (a SAN), not only to chain to the CA.
    ///
    /// Why: a CA is often shared (a company-wide cert-manager ClusterIssuer), and then every
    /// workload holding a client certificate from it could join the router's pool and receive
    /// user prompts. Pinning the sidecars' name keeps the pool to the sidecars' certificate.
    pub fn requiring_peer_name(mut self, name: &str) -> Result<Self, TransportError> {
        let name = ServerName::try_from(name.to_owned())
            .map_err(|e| TransportError::Tls(format!("peer name {name:?}: {e}")))?;
        self.peer_name = Some(name);
        Ok(self)
    }

    /// The router's side: requires a client certificate issued by the CA (and valid for the
    /// pinned name, see [`requiring_peer_name`](Self::requiring_peer_name)).
    pub fn server_config(&self) -> Result<rustls::ServerConfig, TransportError> {
        let chained =
            WebPkiClientVerifier::builder_with_provider(self.roots.clone(), Self::provider())
                .build()
                .map_err(|e| TransportError::Tls(format!("client verifier: {e}")))?;
        let verifier: Arc<dyn ClientCertVerifier> = match &self.peer_name {
            Some(name) => Arc::new(NamedClientVerifier {
                chained,
                name: name.clone(),
            }),
            None => chained,
        };
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

    /// Watches the files and hands every set that differs from the material in use (first
    /// `in_use`, then the last set applied) and parses to `apply`, which builds what it needs
    /// from it (and so rejects a key that does not match its certificate) and swaps it in.
    /// The files are compared once at start, so a renewal that landed while the process was
    /// starting (a sidecar may wait many minutes for its model) is not lost. `report` hears
    /// every outcome. Established connections keep the keys they were set up with; only new
    /// handshakes use the new material, which is all a renewal needs.
    ///
    /// Why: certificates expire. Without this, a cert-manager renewal is invisible to a running
    /// process, and after the old certificate's end every reconnect (a restarted router, a new
    /// replica, a network blip) fails the handshake — for the whole fleet at once. Restarting
    /// model pods to pick up a certificate would reload the model, minutes of GPU time each.
    pub fn watch(
        self,
        in_use: &TlsMaterial,
        mut apply: impl FnMut(TlsMaterial) -> Result<(), TransportError> + Send + 'static,
        mut report: impl FnMut(&TlsReload) + Send + 'static,
    ) -> Result<DirWatch, WatchError> {
        let dirs = [&self.cert, &self.key, &self.ca].map(|p| parent_dir(p));
        // Settings that are not in the files (the pinned peer name) carry over to reloads.
        let peer_name = in_use.peer_name.clone();
        let mut in_use = Some((*in_use.pem).clone());
        watch_dirs(&dirs, move || {
            let bytes = self.read();
            let outcome = match &bytes {
                Some(b) if Some(b) == in_use.as_ref() => TlsReload::Unchanged,
                // A file missing mid-swap: the next event (the swap's end) brings it back.
                None => TlsReload::Rejected("a TLS file cannot be read".into()),
                Some([cert, key, ca]) => {
                    let parsed = TlsMaterial::from_pem(cert, key, ca).map(|m| TlsMaterial {
                        peer_name: peer_name.clone(),
                        ..m
                    });
                    match parsed.and_then(&mut apply) {
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

/// The CA's verdict, then the pinned name: a certificate must pass both.
#[derive(Debug)]
struct NamedClientVerifier {
    chained: Arc<dyn ClientCertVerifier>,
    name: ServerName<'static>,
}

impl ClientCertVerifier for NamedClientVerifier {
    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        self.chained.root_hint_subjects()
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        let verified = self
            .chained
            .verify_client_cert(end_entity, intermediates, now)?;
        webpki::EndEntityCert::try_from(end_entity)
            .and_then(|cert| cert.verify_is_valid_for_subject_name(&self.name))
            .map_err(|_| {
                rustls::Error::InvalidCertificate(rustls::CertificateError::NotValidForName)
            })?;
        Ok(verified)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.chained.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.chained.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.chained.supported_verify_schemes()
    }
}
