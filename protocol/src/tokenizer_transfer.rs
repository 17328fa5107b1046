//! Moving a model's tokenizer files from a sidecar to a router in frame-sized chunks.
//!
//! The router must tokenize exactly as the engine does, and the pod's own model directory is the
//! only place that surely holds the right files; so sidecars hand them out on request. This
//! module cuts files into chunks and puts them back together, checking offsets and sizes so a
//! misbehaving peer cannot make the router allocate without bound.

use std::collections::BTreeMap;

use xxhash_rust::xxh3::Xxh3;

use crate::messages::{TokenizerChunk, TokenizerFile};

/// Bytes of file data per chunk: well under the frame limit, large enough to keep overhead low.
pub const CHUNK_BYTES: usize = 1 << 20;
/// Largest tokenizer (all files together) a router accepts.
pub const MAX_TOKENIZER_BYTES: u64 = 256 << 20;

/// Errors reassembling a tokenizer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TransferError {
    #[error(
        "chunk for {got_model:?}/{got_digest} arrived during the transfer of {model:?}/{digest}"
    )]
    Mixed {
        model: String,
        digest: String,
        got_model: String,
        got_digest: String,
    },
    #[error("chunk of {file:?} at offset {offset}, expected offset {expected}")]
    OutOfOrder {
        file: TokenizerFile,
        offset: u64,
        expected: u64,
    },
    #[error("chunk of {file:?} runs past the file's announced length {file_len}")]
    TooLong { file: TokenizerFile, file_len: u64 },
    #[error("tokenizer exceeds {MAX_TOKENIZER_BYTES} bytes")]
    TooLarge,
    #[error("transfer ended with {file:?} incomplete ({have} of {file_len} bytes)")]
    Incomplete {
        file: TokenizerFile,
        have: u64,
        file_len: u64,
    },
    #[error("received files hash to {actual}, the sidecar announced {announced}")]
    DigestMismatch { announced: String, actual: String },
}

/// A tokenizer's files as they travel.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TokenizerFiles {
    pub tokenizer_json: Vec<u8>,
    pub tokenizer_config: Option<Vec<u8>>,
    pub chat_template: Option<Vec<u8>>,
}

impl TokenizerFiles {
    fn iter(&self) -> impl Iterator<Item = (TokenizerFile, &[u8])> {
        [
            (TokenizerFile::TokenizerJson, Some(&self.tokenizer_json)),
            (
                TokenizerFile::TokenizerConfig,
                self.tokenizer_config.as_ref(),
            ),
            (TokenizerFile::ChatTemplate, self.chat_template.as_ref()),
        ]
        .into_iter()
        .filter_map(|(kind, data)| data.map(|d| (kind, d.as_slice())))
    }

    /// Hex digest over every file, tagged by kind, so a changed template changes the digest.
    pub fn digest(&self) -> String {
        let mut h = Xxh3::new();
        for (kind, data) in self.iter() {
            h.update(&[kind as u8]);
            h.update(&(data.len() as u64).to_le_bytes());
            h.update(data);
        }
        format!("{:032x}", h.digest128())
    }

    /// Total bytes of all files.
    pub fn total_bytes(&self) -> u64 {
        self.iter().map(|(_, d)| d.len() as u64).sum()
    }

    /// Cuts the files into chunks; the last chunk has `last = true`. An empty file still travels
    /// as one empty chunk so the receiver learns it exists.
    pub fn chunks(&self, model: &str) -> Vec<TokenizerChunk> {
        let digest = self.digest();
        let mut out = Vec::new();
        for (file, data) in self.iter() {
            let mut offset = 0usize;
            loop {
                let end = (offset + CHUNK_BYTES).min(data.len());
                out.push(TokenizerChunk {
                    model: model.to_owned(),
                    digest: digest.clone(),
                    file,
                    offset: offset as u64,
                    file_len: data.len() as u64,
                    last: false,
                    data: data[offset..end].to_vec(),
                });
                offset = end;
                if offset >= data.len() {
                    break;
                }
            }
        }
        if let Some(c) = out.last_mut() {
            c.last = true;
        }
        out
    }
}

/// Puts chunks back together. Feed chunks in the order they arrived; the final one returns the
/// verified files.
#[derive(Debug, Default)]
pub struct TokenizerAssembler {
    current: Option<(String, String)>,
    files: BTreeMap<TokenizerFile, (u64, Vec<u8>)>,
    total: u64,
}

impl TokenizerAssembler {
    /// A new, empty assembler.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a chunk. Returns the model name and its files when the transfer is complete and its
    /// digest checks out. Any error resets the assembler, so the next transfer starts clean.
    pub fn push(
        &mut self,
        chunk: TokenizerChunk,
    ) -> Result<Option<(String, TokenizerFiles)>, TransferError> {
        let result = self.push_inner(chunk);
        if !matches!(result, Ok(None)) {
            *self = Self::default();
        }
        result
    }

    fn push_inner(
        &mut self,
        chunk: TokenizerChunk,
    ) -> Result<Option<(String, TokenizerFiles)>, TransferError> {
        match &self.current {
            None => self.current = Some((chunk.model.clone(), chunk.digest.clone())),
            Some((model, digest)) if *model != chunk.model || *digest != chunk.digest => {
                return Err(TransferError::Mixed {
                    model: model.clone(),
                    digest: digest.clone(),
                    got_model: chunk.model,
                    got_digest: chunk.digest,
                });
            }
            Some(_) => {}
        }
        let (file_len, buf) = self
            .files
            .entry(chunk.file)
            .or_insert_with(|| (chunk.file_len, Vec::new()));
        if chunk.offset != buf.len() as u64 || chunk.file_len != *file_len {
            return Err(TransferError::OutOfOrder {
                file: chunk.file,
                offset: chunk.offset,
                expected: buf.len() as u64,
            });
        }
        if chunk.offset + chunk.data.len() as u64 > *file_len {
            return Err(TransferError::TooLong {
                file: chunk.file,
                file_len: *file_len,
            });
        }
        self.total += chunk.data.len() as u64;
        if self.total > MAX_TOKENIZER_BYTES {
            return Err(TransferError::TooLarge);
        }
        buf.extend_from_slice(&chunk.data);
        if !chunk.last {
            return Ok(None);
        }
        let mut files = TokenizerFiles::default();
        for (kind, (file_len, data)) in std::mem::take(&mut self.files) {
            if data.len() as u64 != file_len {
                return Err(TransferError::Incomplete {
                    file: kind,
                    have: data.len() as u64,
                    file_len,
                });
            }
            match kind {
                TokenizerFile::TokenizerJson => files.tokenizer_json = data,
                TokenizerFile::TokenizerConfig => files.tokenizer_config = Some(data),
                TokenizerFile::ChatTemplate => files.chat_template = Some(data),
            }
        }
        let actual = files.digest();
        if actual != chunk.digest {
            return Err(TransferError::DigestMismatch {
                announced: chunk.digest,
                actual,
            });
        }
        Ok(Some((chunk.model, files)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn files() -> TokenizerFiles {
        TokenizerFiles {
            tokenizer_json: (0..(CHUNK_BYTES * 2 + 17))
                .map(|i| (i % 251) as u8)
                .collect(),
            tokenizer_config: Some(br#"{"chat_template":"x"}"#.to_vec()),
            chat_template: None,
        }
    }

    #[test]
    fn chunks_reassemble_to_the_same_files() {
        let f = files();
        let chunks = f.chunks("m");
        assert_eq!(chunks.len(), 4, "3 chunks of tokenizer.json + 1 of config");
        let mut a = TokenizerAssembler::new();
        let mut done = None;
        for c in chunks {
            assert!(done.is_none(), "completed before the last chunk");
            done = a.push(c).unwrap();
        }
        let (model, got) = done.expect("complete after the last chunk");
        assert_eq!(model, "m");
        assert_eq!(got, f);
    }

    #[test]
    fn a_missing_chunk_is_an_error_not_a_corrupt_tokenizer() {
        let mut chunks = files().chunks("m");
        chunks.remove(1);
        let mut a = TokenizerAssembler::new();
        let errs: Vec<_> = chunks.into_iter().filter_map(|c| a.push(c).err()).collect();
        assert!(
            matches!(errs[0], TransferError::OutOfOrder { .. }),
            "{errs:?}"
        );
    }

    #[test]
    fn tampered_data_fails_the_digest() {
        let mut chunks = files().chunks("m");
        chunks[0].data[5] ^= 1;
        let mut a = TokenizerAssembler::new();
        let last = chunks.into_iter().map(|c| a.push(c)).last().unwrap();
        assert!(matches!(last, Err(TransferError::DigestMismatch { .. })));
    }

    #[test]
    fn digest_depends_on_the_template() {
        let a = files();
        let mut b = files();
        b.chat_template = Some(b"{{ x }}".to_vec());
        assert_ne!(a.digest(), b.digest());
    }
}
