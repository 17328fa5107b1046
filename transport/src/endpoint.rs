//! QUIC endpoints with kvsight's transport settings.
//!
//! Keep-alives every second and a five-second idle timeout: a router must notice a vanished pod
//! (node lost, network partition) within a few report intervals even when no FIN ever arrives.

use std::net::{SocketAddr, UdpSocket};
use std::sync::Arc;
use std::time::Duration;

use quinn::crypto::rustls::{QuicClientConfig, QuicServerConfig};

use crate::{TlsMaterial, TransportError};

/// Receive buffer the router asks the kernel for on its UDP socket (Linux caps it at
/// `net.core.rmem_max`). Every sidecar sends its filter snapshot the moment it connects, and when
/// a router starts in front of a fleet they all connect at once: a thousand pods' snapshots
/// (about 160 KB each at 125,000 KV blocks) arrive within a second or two, and behind the
/// usual 208 KB default the kernel drops most of them. See
/// `docs/decisions/0200-router-udp-receive-buffer.md`.
pub const SERVER_RECV_BUFFER: usize = 8 << 20;

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

/// The router's endpoint on an already bound UDP socket (tests bind `127.0.0.1:0`), its receive
/// buffer enlarged towards [`SERVER_RECV_BUFFER`].
pub fn server(socket: UdpSocket, tls: &TlsMaterial) -> Result<quinn::Endpoint, TransportError> {
    enlarge_recv_buffer(&socket, SERVER_RECV_BUFFER);
    let runtime = quinn::default_runtime().ok_or(TransportError::NoRuntime)?;
    quinn::Endpoint::new(
        quinn::EndpointConfig::default(),
        Some(server_config(tls)?),
        socket,
        runtime,
    )
    .map_err(TransportError::Io)
}

/// Asks for a receive buffer of `want` bytes and returns what the kernel reports (Linux grants
/// twice the asked size, capped at twice `net.core.rmem_max`). Less than asked is logged with the
/// sysctl that limits it: the endpoint still works, but a fleet reconnecting at once loses
/// datagrams.
fn enlarge_recv_buffer(socket: &UdpSocket, want: usize) -> Option<usize> {
    let sock = socket2::SockRef::from(socket);
    if let Err(e) = sock.set_recv_buffer_size(want) {
        tracing::warn!(error = %e, want, "cannot set the UDP receive buffer");
    }
    let got = sock.recv_buffer_size().ok()?;
    if got < want {
        tracing::warn!(
            bytes = got,
            wanted = want,
            "UDP receive buffer smaller than asked: raise net.core.rmem_max on the node, or a fleet reconnecting at once loses snapshots"
        );
    }
    Some(got)
}

/// The sidecar's endpoint, bound to `bind` (usually `0.0.0.0:0` or `[::]:0`).
pub fn client(bind: SocketAddr, tls: &TlsMaterial) -> Result<quinn::Endpoint, TransportError> {
    let cfg = client_config(tls)?;
    let mut endpoint = quinn::Endpoint::client(bind).map_err(TransportError::Io)?;
    endpoint.set_default_client_config(cfg);
    Ok(endpoint)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_receive_buffer_grows_past_the_default() {
        let socket = UdpSocket::bind("127.0.0.1:0").unwrap();
        let before = socket2::SockRef::from(&socket).recv_buffer_size().unwrap();
        let got = enlarge_recv_buffer(&socket, before * 4).unwrap();
        // Capped by net.core.rmem_max, which may equal the default on a stock kernel.
        assert!(got >= before, "{got} < {before}");
    }
}
