//! Sight: how well this router's view predicts the engine's cache. Every pick predicts the prompt
//! tokens the chosen pod will find cached ([`crate::scheduler::Decision`]'s
//! `predicted_cached_tokens`); vLLM reports what it really found in the response's
//! `usage.prompt_tokens_details.cached_tokens` (with `--enable-prompt-tokens-details`) — in a
//! non-streamed answer's body, and in a streamed answer's last chunk when the client asked for
//! usage (`stream_options.include_usage`). [`UsageTap`] reads that number off the bytes the proxy
//! copies to the client, without holding the answer back, and the difference goes to
//! `kvsight_router_sight_error_tokens`.

use serde_json::Value;

/// Longest non-streamed body (bytes) kept to read its usage; a longer answer is not measured
/// (its bytes still reach the client).
pub const MAX_BODY_BYTES: usize = 1 << 20;
/// Longest SSE line kept; a longer line is skipped (usage chunks are a few hundred bytes).
pub const MAX_LINE_BYTES: usize = 64 << 10;

/// Watches one response body for the engine's cached prompt tokens.
#[derive(Debug)]
pub struct UsageTap {
    sse: bool,
    /// A non-streamed body so far, or a streamed body's current (incomplete) line.
    buf: Vec<u8>,
    /// `buf` outgrew its bound: the body (or the current line) is not measured.
    over: bool,
    /// The last value seen in a streamed body.
    cached: Option<u64>,
}

impl UsageTap {
    /// `sse`: the body is an event stream (else one JSON object).
    pub fn new(sse: bool) -> Self {
        UsageTap {
            sse,
            buf: Vec::new(),
            over: false,
            cached: None,
        }
    }

    /// Takes the next chunk of the body, as the client gets it.
    pub fn feed(&mut self, mut chunk: &[u8]) {
        if !self.sse {
            self.keep(chunk, MAX_BODY_BYTES);
            return;
        }
        while let Some(end) = chunk.iter().position(|&b| b == b'\n') {
            self.keep(&chunk[..end], MAX_LINE_BYTES);
            self.line();
            chunk = &chunk[end + 1..];
        }
        self.keep(chunk, MAX_LINE_BYTES);
    }

    /// The engine's cached prompt tokens, once the body has ended; `None` when it did not carry
    /// them (no usage asked for, the engine does not report details, an error, a cut stream).
    pub fn finish(mut self) -> Option<u64> {
        if self.sse {
            self.line();
            self.cached
        } else if self.over {
            None
        } else {
            serde_json::from_slice::<Value>(&self.buf)
                .ok()
                .and_then(|v| cached_tokens(&v))
        }
    }

    fn keep(&mut self, bytes: &[u8], bound: usize) {
        if self.over {
            return;
        }
        if self.buf.len() + bytes.len() > bound {
            self.over = true;
            self.buf = Vec::new();
        } else {
            self.buf.extend_from_slice(bytes);
        }
    }

    /// Ends the current SSE line: a `data:` line that mentions the field is parsed.
    fn line(&mut self) {
        let line = std::mem::take(&mut self.buf);
        if std::mem::take(&mut self.over) {
            return;
        }
        let Some(data) = line.strip_prefix(b"data:") else {
            return;
        };
        let data = data.trim_ascii();
        // Most chunks carry one token of text: parse only the ones that can hold the field.
        if !data.starts_with(b"{") || !contains(data, b"\"cached_tokens\"") {
            return;
        }
        if let Some(n) = serde_json::from_slice::<Value>(data)
            .ok()
            .and_then(|v| cached_tokens(&v))
        {
            self.cached = Some(n);
        }
    }
}

fn cached_tokens(v: &Value) -> Option<u64> {
    v.pointer("/usage/prompt_tokens_details/cached_tokens")?
        .as_u64()
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tap(sse: bool, chunks: &[&str]) -> Option<u64> {
        let mut t = UsageTap::new(sse);
        for c in chunks {
            t.feed(c.as_bytes());
        }
        t.finish()
    }

    #[test]
    fn a_json_body_split_anywhere() {
        let body = r#"{"id":"x","choices":[{"text":"hi \"cached_tokens\": 9"}],"usage":{"prompt_tokens":40,"completion_tokens":2,"prompt_tokens_details":{"cached_tokens":32}}}"#;
        for cut in [0, 1, 17, body.len() / 2, body.len()] {
            assert_eq!(tap(false, &[&body[..cut], &body[cut..]]), Some(32), "{cut}");
        }
    }

    #[test]
    fn the_usage_chunk_of_a_stream_with_lines_split_across_chunks() {
        let stream = "data: {\"choices\":[{\"text\":\"\\\"cached_tokens\\\": 3\"}]}\n\n\
                      data: {\"choices\":[],\"usage\":{\"prompt_tokens\":40,\"prompt_tokens_details\":{\"cached_tokens\":16}}}\r\n\r\n\
                      data: [DONE]\n\n";
        for cut in [5, 60, 100, stream.len() - 3] {
            assert_eq!(
                tap(true, &[&stream[..cut], &stream[cut..]]),
                Some(16),
                "{cut}"
            );
        }
    }

    #[test]
    fn no_number_without_details_or_when_too_long() {
        assert_eq!(tap(false, &[r#"{"usage":{"prompt_tokens":4}}"#]), None);
        assert_eq!(
            tap(true, &["data: {\"choices\":[]}\n\ndata: [DONE]\n\n"]),
            None
        );
        assert_eq!(tap(false, &[r#"{"error":"#]), None);
        let long = format!(
            r#"{{"t":"{}","usage":{{"prompt_tokens_details":{{"cached_tokens":1}}}}}}"#,
            "a".repeat(MAX_BODY_BYTES)
        );
        assert_eq!(tap(false, &[&long]), None);
        // An overlong line is skipped; the lines after it still count.
        let line = format!("data: {{\"t\":\"{}\"}}\n", "a".repeat(MAX_LINE_BYTES));
        let usage = "data: {\"usage\":{\"prompt_tokens_details\":{\"cached_tokens\":7}}}\n";
        assert_eq!(tap(true, &[&line, usage]), Some(7));
    }
}
