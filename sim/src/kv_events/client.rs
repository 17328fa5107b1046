//! A minimal raw-frame client for tests: a SUB that returns `(topic, seq, payload)` and a DEALER
//! that performs one replay. It checks framing only; payloads stay bytes, since decoding them is
//! the sidecar's job and the golden/pyzmq tests judge the encoding.

use std::time::Duration;

use bytes::Bytes;
use zeromq::{DealerSocket, Socket, SocketRecv, SocketSend, SubSocket, ZmqError, ZmqMessage};

use super::{END_SEQ, ReplayLayout};

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("zmq: {0}")]
    Zmq(#[from] ZmqError),
    #[error("nothing received within {0:?}")]
    Timeout(Duration),
    #[error("malformed message: {0}")]
    Malformed(String),
    #[error("replay sent more than {0} batches without an end marker")]
    TooManyBatches(usize),
}

/// One message as it arrived, frames split out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frames {
    /// The topic frame (always present live; `None` in the old replay layout).
    pub topic: Option<Bytes>,
    pub seq: u64,
    pub payload: Bytes,
}

fn seq_of(frame: &[u8]) -> Result<u64, ClientError> {
    let bytes: [u8; 8] = frame
        .try_into()
        .map_err(|_| ClientError::Malformed(format!("seq frame of {} bytes", frame.len())))?;
    Ok(u64::from_be_bytes(bytes))
}

/// A SUB socket connected to a publisher.
pub struct Subscriber {
    socket: SubSocket,
}

impl Subscriber {
    /// Connects to `endpoint` and subscribes to `topic` (a prefix; `""` is everything).
    pub async fn connect(endpoint: &str, topic: &str) -> Result<Self, ClientError> {
        let mut socket = SubSocket::new();
        socket.connect(endpoint).await?;
        socket.subscribe(topic).await?;
        Ok(Self { socket })
    }

    /// Binds `endpoint` (for a publisher in connect mode) and subscribes to `topic`; returns the
    /// resolved endpoint too.
    pub async fn bind(endpoint: &str, topic: &str) -> Result<(Self, String), ClientError> {
        let mut socket = SubSocket::new();
        let bound = socket.bind(endpoint).await?;
        socket.subscribe(topic).await?;
        Ok((Self { socket }, bound.to_string()))
    }

    /// Adds another topic prefix.
    pub async fn subscribe(&mut self, topic: &str) -> Result<(), ClientError> {
        Ok(self.socket.subscribe(topic).await?)
    }

    /// The next `[topic, seq, payload]` message.
    pub async fn recv(&mut self, timeout: Duration) -> Result<Frames, ClientError> {
        let message = tokio::time::timeout(timeout, self.socket.recv())
            .await
            .map_err(|_| ClientError::Timeout(timeout))??;
        let frames = message.into_vec();
        let [topic, seq, payload] = frames.as_slice() else {
            return Err(ClientError::Malformed(format!(
                "{} frames on PUB, expected 3",
                frames.len()
            )));
        };
        Ok(Frames {
            topic: Some(topic.clone()),
            seq: seq_of(seq)?,
            payload: payload.clone(),
        })
    }
}

/// Asks the replay socket at `endpoint` for every batch from `start_seq` on and returns them in
/// order, checking every frame against `layout` and stopping at the end marker. Bounded by
/// `timeout` per reply and by `max_batches`.
pub async fn replay(
    endpoint: &str,
    start_seq: u64,
    layout: ReplayLayout,
    timeout: Duration,
    max_batches: usize,
) -> Result<Vec<Frames>, ClientError> {
    let mut socket = DealerSocket::new();
    socket.connect(endpoint).await?;
    let request = ZmqMessage::try_from(vec![
        Bytes::new(),
        Bytes::copy_from_slice(&start_seq.to_be_bytes()),
    ])
    .map_err(|_| ClientError::Malformed("empty request".into()))?;
    socket.send(request).await?;

    let mut batches = Vec::new();
    loop {
        let reply = tokio::time::timeout(timeout, socket.recv())
            .await
            .map_err(|_| ClientError::Timeout(timeout))??;
        let frames = reply.into_vec();
        let (topic, seq, payload) = match (layout, frames.as_slice()) {
            (ReplayLayout::New, [delim, topic, seq, payload]) if delim.is_empty() => {
                (Some(topic.clone()), seq, payload)
            }
            (ReplayLayout::Old, [delim, seq, payload]) if delim.is_empty() => (None, seq, payload),
            _ => {
                return Err(ClientError::Malformed(format!(
                    "{layout:?} replay reply of {} frames: {frames:?}",
                    frames.len()
                )));
            }
        };
        if seq.as_ref() == END_SEQ {
            if !payload.is_empty() || topic.as_ref().is_some_and(|t| !t.is_empty()) {
                return Err(ClientError::Malformed(format!(
                    "end marker with content: {frames:?}"
                )));
            }
            return Ok(batches);
        }
        if batches.len() == max_batches {
            return Err(ClientError::TooManyBatches(max_batches));
        }
        batches.push(Frames {
            topic,
            seq: seq_of(seq)?,
            payload: payload.clone(),
        });
    }
}
