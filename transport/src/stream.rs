//! kvsight messages over one QUIC stream, framed by `kvsight_protocol::frame`.

use kvsight_protocol::frame::{self, FrameReader, WireMessage};

use crate::TransportError;

/// Largest read from the stream at once.
const READ_CHUNK: usize = 64 * 1024;

/// Sends framed messages.
#[derive(Debug)]
pub struct FramedSend {
    stream: quinn::SendStream,
    buf: Vec<u8>,
}

impl FramedSend {
    pub fn new(stream: quinn::SendStream) -> Self {
        FramedSend {
            stream,
            buf: Vec::new(),
        }
    }

    /// Sends one message; returns the bytes written (for `publish_bytes_total`).
    pub async fn send<M: WireMessage>(&mut self, msg: &M) -> Result<usize, TransportError> {
        self.buf.clear();
        frame::encode_into(msg, &mut self.buf)?;
        self.stream.write_all(&self.buf).await?;
        Ok(self.buf.len())
    }

    /// Ends the stream cleanly after what was sent.
    pub fn finish(&mut self) -> Result<(), TransportError> {
        self.stream
            .finish()
            .map_err(|_| TransportError::StreamClosed)
    }
}

/// Receives framed messages.
#[derive(Debug)]
pub struct FramedRecv {
    stream: quinn::RecvStream,
    reader: FrameReader,
}

impl FramedRecv {
    pub fn new(stream: quinn::RecvStream) -> Self {
        FramedRecv {
            stream,
            reader: FrameReader::default(),
        }
    }

    /// The next message, or `None` when the peer finished the stream between two frames.
    pub async fn recv<M: WireMessage>(&mut self) -> Result<Option<M>, TransportError> {
        loop {
            if let Some(msg) = self.reader.next_message::<M>()? {
                return Ok(Some(msg));
            }
            match self.stream.read_chunk(READ_CHUNK, true).await? {
                Some(chunk) => self.reader.push(&chunk.bytes),
                None => {
                    self.reader.finish()?;
                    return Ok(None);
                }
            }
        }
    }
}
