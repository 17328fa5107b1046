//! A test sidecar: a QUIC client with a certificate of the tests' dev CA, one framed stream to
//! the router.

use std::net::SocketAddr;
use std::time::Duration;

use kvsight_protocol::messages::RouterMessage;
use kvsight_transport::{FramedRecv, FramedSend, TlsMaterial, client};

pub struct Sidecar {
    pub conn: quinn::Connection,
    pub send: FramedSend,
    pub recv: FramedRecv,
    pub _endpoint: quinn::Endpoint,
}

/// Connects to the router's QUIC listener at `addr` and opens the stream.
pub async fn connect(tls: &TlsMaterial, addr: SocketAddr) -> anyhow::Result<Sidecar> {
    let endpoint = client("127.0.0.1:0".parse()?, tls)?;
    let conn = endpoint.connect(addr, "kvsight-router")?.await?;
    let (send, recv) = conn.open_bi().await?;
    Ok(Sidecar {
        conn,
        send: FramedSend::new(send),
        recv: FramedRecv::new(recv),
        _endpoint: endpoint,
    })
}

impl Sidecar {
    /// The router's next message, which must come within `limit` on an open stream.
    pub async fn next_within(&mut self, limit: Duration) -> RouterMessage {
        tokio::time::timeout(limit, self.recv.recv::<RouterMessage>())
            .await
            .expect("a router message in time")
            .expect("a frame")
            .expect("the stream is open")
    }
}
