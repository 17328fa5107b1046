//! Length-prefixed frames: `u32` big-endian payload length, then a postcard payload.
//!
//! Decoding first checks that a whole frame is there (mini-redis' rule), refuses a length over
//! the limit as soon as the 4-byte header arrives (so a hostile peer cannot make us buffer
//! gigabytes), and only then parses. Every failure is a typed [`FrameError`], never a panic: the
//! caller closes that one connection and the process carries on.

use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::messages::{InvalidField, PROTOCOL_VERSION, RouterMessage, SidecarMessage};

/// Bytes of the length prefix.
pub const HEADER_LEN: usize = 4;
/// Largest payload accepted by default: room for a filter snapshot of ~12 million KV blocks.
pub const MAX_FRAME_LEN: usize = 16 << 20;

/// Why a frame could not be encoded or decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    #[error("frame of {len} bytes exceeds the limit of {max} bytes")]
    Oversized { len: usize, max: usize },
    #[error("malformed frame: {0}")]
    Malformed(String),
    #[error("frame has {0} bytes after its message")]
    TrailingBytes(usize),
    #[error(
        "protocol version mismatch: this side speaks version {ours}, the peer speaks version {theirs}"
    )]
    VersionMismatch { ours: u16, theirs: u16 },
    #[error("stream ended inside a frame ({0} bytes buffered)")]
    Truncated(usize),
    #[error("invalid message: {0}")]
    Invalid(#[from] InvalidField),
}

/// A message type that travels in frames. Its leading variants start with the protocol version,
/// which lets a decoder report a version mismatch even when the rest does not parse.
pub trait WireMessage: Serialize + DeserializeOwned {
    /// Variant indices whose first field is `protocol_version`.
    const VERSIONED_VARIANTS: &'static [u32];

    /// Range checks of the message's numbers, run by the decoder after parsing: postcard
    /// accepts any bit pattern for a float, and a peer must not be able to hand the other side
    /// NaN or a zero block size.
    fn validate(&self) -> Result<(), InvalidField>;
}

impl WireMessage for SidecarMessage {
    const VERSIONED_VARIANTS: &'static [u32] = &[0];

    fn validate(&self) -> Result<(), InvalidField> {
        SidecarMessage::validate(self)
    }
}

impl WireMessage for RouterMessage {
    const VERSIONED_VARIANTS: &'static [u32] = &[0, 1];

    fn validate(&self) -> Result<(), InvalidField> {
        RouterMessage::validate(self)
    }
}

/// Checks a peer's protocol version.
pub fn check_version(theirs: u16) -> Result<(), FrameError> {
    if theirs == PROTOCOL_VERSION {
        Ok(())
    } else {
        Err(FrameError::VersionMismatch {
            ours: PROTOCOL_VERSION,
            theirs,
        })
    }
}

/// Appends one frame holding `msg` to `out`.
pub fn encode_into<M: WireMessage>(msg: &M, out: &mut Vec<u8>) -> Result<(), FrameError> {
    let start = out.len();
    out.extend_from_slice(&[0; HEADER_LEN]);
    let result = postcard::to_extend(msg, std::mem::take(out));
    *out = result.map_err(|e| FrameError::Malformed(e.to_string()))?;
    let len = out.len() - start - HEADER_LEN;
    if len > MAX_FRAME_LEN {
        out.truncate(start);
        return Err(FrameError::Oversized {
            len,
            max: MAX_FRAME_LEN,
        });
    }
    out[start..start + HEADER_LEN].copy_from_slice(&(len as u32).to_be_bytes());
    Ok(())
}

/// One frame holding `msg`.
pub fn encode<M: WireMessage>(msg: &M) -> Result<Vec<u8>, FrameError> {
    let mut out = Vec::new();
    encode_into(msg, &mut out)?;
    Ok(out)
}

/// Decodes the first frame of `buf`: `Ok(None)` when more bytes are needed, otherwise the
/// message and the number of bytes it used.
pub fn decode<M: WireMessage>(buf: &[u8], max: usize) -> Result<Option<(M, usize)>, FrameError> {
    let Some(header) = buf.get(..HEADER_LEN) else {
        return Ok(None);
    };
    let len = u32::from_be_bytes(header.try_into().expect("4 bytes")) as usize;
    if len > max {
        return Err(FrameError::Oversized { len, max });
    }
    let Some(payload) = buf.get(HEADER_LEN..HEADER_LEN + len) else {
        return Ok(None);
    };
    decode_payload(payload).map(|m| Some((m, HEADER_LEN + len)))
}

/// Parses one whole payload (without its length prefix).
pub fn decode_payload<M: WireMessage>(payload: &[u8]) -> Result<M, FrameError> {
    match postcard::take_from_bytes::<M>(payload) {
        Ok((msg, [])) => {
            if let Some(theirs) = peek_version::<M>(payload) {
                check_version(theirs)?;
            }
            msg.validate()?;
            Ok(msg)
        }
        Ok((_, rest)) => {
            Err(peek_mismatch::<M>(payload).unwrap_or(FrameError::TrailingBytes(rest.len())))
        }
        Err(e) => Err(peek_mismatch::<M>(payload).unwrap_or(FrameError::Malformed(e.to_string()))),
    }
}

fn peek_mismatch<M: WireMessage>(payload: &[u8]) -> Option<FrameError> {
    peek_version::<M>(payload).and_then(|v| check_version(v).err())
}

/// Reads the protocol version of a versioned variant without parsing the rest.
fn peek_version<M: WireMessage>(payload: &[u8]) -> Option<u16> {
    let (variant, rest) = postcard::take_from_bytes::<u32>(payload).ok()?;
    if !M::VERSIONED_VARIANTS.contains(&variant) {
        return None;
    }
    postcard::take_from_bytes::<u16>(rest).ok().map(|(v, _)| v)
}

/// Buffers a byte stream and yields whole messages.
#[derive(Debug)]
pub struct FrameReader {
    buf: Vec<u8>,
    start: usize,
    max: usize,
}

impl Default for FrameReader {
    fn default() -> Self {
        Self::new(MAX_FRAME_LEN)
    }
}

impl FrameReader {
    /// A reader refusing payloads over `max` bytes.
    pub fn new(max: usize) -> Self {
        FrameReader {
            buf: Vec::new(),
            start: 0,
            max,
        }
    }

    /// Appends received bytes.
    pub fn push(&mut self, data: &[u8]) {
        if self.start > 0 && self.start >= self.buf.len() / 2 {
            // Drop consumed bytes once they are at least half the buffer: amortised O(1).
            self.buf.drain(..self.start);
            self.start = 0;
        }
        self.buf.extend_from_slice(data);
    }

    /// The next whole message, if one is buffered. After an error the stream is unusable.
    pub fn next_message<M: WireMessage>(&mut self) -> Result<Option<M>, FrameError> {
        match decode(&self.buf[self.start..], self.max)? {
            Some((msg, used)) => {
                self.start += used;
                Ok(Some(msg))
            }
            None => Ok(None),
        }
    }

    /// Call when the stream ended: an error if it ended inside a frame.
    pub fn finish(&self) -> Result<(), FrameError> {
        match self.buf.len() - self.start {
            0 => Ok(()),
            n => Err(FrameError::Truncated(n)),
        }
    }
}
