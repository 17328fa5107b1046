//! Mutual TLS for QUIC: both sides present a certificate issued by the configured CA.
//!
//! The router requires a client certificate from its CA before a sidecar can say anything, so
//! nothing joins the pool without one; the sidecar verifies the router's certificate against the
//! same CA and the name it dialled. The crypto provider is chosen explicitly (ring) so a build that
//! links another provider through some dependency can never make the choice ambiguous at run time.

use std::path::Path;
use std::sync::Arc;

use rustls::RootCertStore;
use rustls::server::WebPkiClientVerifier;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};

use crate::TransportError;

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
