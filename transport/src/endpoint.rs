//! QUIC endpoints with kvsight's transport settings.
//!
//! Keep-alives every second and a five-second idle timeout: a router must notice a vanished pod
//! (node lost, network partition) within a few report intervals even when no FIN ever arrives.

use std::net::{SocketAddr, UdpSocket};
use std::sync::Arc;
use std::time::Duration;

use quinn::crypto::rustls::{QuicClientConfig, QuicServerConfig};

use crate::{TlsMaterial, TransportError};

/// Interval of QUIC keep-alive packets.
pub const KEEP_ALIVE: Duration = Duration::from_secs(1);
/// A connection with no packets for this long is closed.
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(5);

fn transport() -> Arc<quinn::TransportConfig> {
    let mut t = quinn::TransportConfig::default();
    t.keep_alive_interval(Some(KEEP_ALIVE));
    t.max_idle_timeout(Some(
        quinn::IdleTimeout::try_from(IDLE_TIMEOUT).expect("5 s is a valid QUIC idle timeout"),
    ));
    // One control stream per connection, opened by the sidecar.
    t.max_concurrent_bidi_streams(4u32.into());
    t.max_concurrent_uni_streams(0u32.into());
    Arc::new(t)
}

/// The router's QUIC server configuration: this material, kvsight's transport settings. Also
/// what a certificate reload swaps in (`Endpoint::set_server_config`).
pub fn server_config(tls: &TlsMaterial) -> Result<quinn::ServerConfig, TransportError> {
    let crypto = QuicServerConfig::try_from(tls.server_config()?)
        .map_err(|e| TransportError::Tls(format!("QUIC server crypto: {e}")))?;
    let mut cfg = quinn::ServerConfig::with_crypto(Arc::new(crypto));
    cfg.transport_config(transport());
    Ok(cfg)
}

/// The sidecar's QUIC client configuration (see [`server_config`]).
pub fn client_config(tls: &TlsMaterial) -> Result<quinn::ClientConfig, TransportError> {
    let crypto = QuicClientConfig::try_from(tls.client_config()?)
        .map_err(|e| TransportError::Tls(format!("QUIC client crypto: {e}")))?;
    let mut cfg = quinn::ClientConfig::new(Arc::new(crypto));
    cfg.transport_config(transport());
    Ok(cfg)
}

/// The router's endpoint on an already bound UDP socket (tests bind `127.0.0.1:0`).
pub fn server(socket: UdpSocket, tls: &TlsMaterial) -> Result<quinn::Endpoint, TransportError> {
    let runtime = quinn::default_runtime().ok_or(TransportError::NoRuntime)?;
    quinn::Endpoint::new(
        quinn::EndpointConfig::default(),
        Some(server_config(tls)?),
        socket,
        runtime,
    )
    .map_err(TransportError::Io)
}

/// The sidecar's endpoint, bound to `bind` (usually `0.0.0.0:0` or `[::]:0`).
pub fn client(bind: SocketAddr, tls: &TlsMaterial) -> Result<quinn::Endpoint, TransportError> {
    let cfg = client_config(tls)?;
    let mut endpoint = quinn::Endpoint::client(bind).map_err(TransportError::Io)?;
    endpoint.set_default_client_config(cfg);
    Ok(endpoint)
}
