//! kvsight-transport: QUIC with mutual TLS and framed kvsight messages, the one transport the
//! sidecar (client) and the router (server) share.
//!
//! Why QUIC: one UDP port, TLS 1.3 built in, streams that do not block each other, and
//! keep-alive/idle-timeout semantics that detect a vanished peer without relying on a FIN.
//! Why mutual TLS: the router's pool is the set of pods that can prove they hold a certificate
//! from the configured CA; nothing else can register an address to receive user traffic.

mod endpoint;
mod peer;
mod stream;
mod tls;

#[cfg(feature = "dev-certs")]
pub mod dev_certs;

pub use endpoint::{
    IDLE_TIMEOUT, KEEP_ALIVE, SERVER_RECV_BUFFER, client, client_config, server, server_config,
};
pub use peer::{POD_URI_PREFIX, PeerCertificate, PodGrant, pod_uri};
pub use stream::{FramedRecv, FramedSend};
pub use tls::{ALPN, TlsFiles, TlsMaterial, TlsReload};

use kvsight_protocol::frame::FrameError;

/// Errors of the transport boundary.
#[derive(Debug, thiserror::Error)]
pub enum TransportError {
    #[error("TLS configuration: {0}")]
    Tls(String),
    #[error("socket: {0}")]
    Io(#[source] std::io::Error),
    #[error("no async runtime (call from inside tokio)")]
    NoRuntime,
    #[error("connecting: {0}")]
    Connect(#[from] quinn::ConnectError),
    #[error("connection: {0}")]
    Connection(#[from] quinn::ConnectionError),
    #[error("writing: {0}")]
    Write(#[from] quinn::WriteError),
    #[error("reading: {0}")]
    Read(#[from] quinn::ReadError),
    #[error("frame: {0}")]
    Frame(#[from] FrameError),
    #[error("stream already closed")]
    StreamClosed,
}
