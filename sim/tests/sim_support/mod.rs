//! A minimal HTTP/1.1 client over a raw TCP socket, so the tests see the simulator's bytes
//! exactly as a client does (status, headers, de-chunked body, SSE framing untouched).

#![allow(dead_code, unreachable_pub)]

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::{Context, bail};
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Every request of the tests is bounded by this.
pub const WAIT: Duration = Duration::from_secs(20);

#[derive(Debug)]
pub struct Reply {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Reply {
    pub fn json(&self) -> anyhow::Result<Value> {
        serde_json::from_slice(&self.body)
            .with_context(|| format!("body is not JSON: {}", String::from_utf8_lossy(&self.body)))
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    /// The SSE `data:` payloads, checking that the body is nothing but `data: X\n\n` events.
    pub fn sse_events(&self) -> anyhow::Result<Vec<String>> {
        let text = self.text();
        let mut out = Vec::new();
        for event in text.split_terminator("\n\n") {
            let Some(data) = event.strip_prefix("data: ") else {
                bail!("not an SSE data event: {event:?}");
            };
            if data.contains('\n') {
                bail!("multi-line event: {event:?}");
            }
            out.push(data.to_owned());
        }
        if !text.ends_with("\n\n") {
            bail!("stream does not end with a blank line: {text:?}");
        }
        Ok(out)
    }
}

pub async fn request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    body: Option<&[u8]>,
) -> anyhow::Result<Reply> {
    tokio::time::timeout(WAIT, request_inner(addr, method, path, body))
        .await
        .context("HTTP request timed out")?
}

async fn request_inner(
    addr: SocketAddr,
    method: &str,
    path: &str,
    body: Option<&[u8]>,
) -> anyhow::Result<Reply> {
    let mut stream = TcpStream::connect(addr).await?;
    let body = body.unwrap_or_default();
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes()).await?;
    stream.write_all(body).await?;
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).await?;
    parse_response(&raw)
}

fn parse_response(raw: &[u8]) -> anyhow::Result<Reply> {
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .context("no end of headers")?;
    let head = std::str::from_utf8(&raw[..split])?;
    let mut lines = head.split("\r\n");
    let status_line = lines.next().context("no status line")?;
    let status: u16 = status_line
        .split(' ')
        .nth(1)
        .context("no status")?
        .parse()?;
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_owned(), v.trim().to_owned()))
        .collect();
    let mut body = raw[split + 4..].to_vec();
    let chunked = headers.iter().any(|(k, v)| {
        k.eq_ignore_ascii_case("transfer-encoding") && v.eq_ignore_ascii_case("chunked")
    });
    if chunked {
        body = dechunk(&body)?;
    }
    Ok(Reply {
        status,
        headers,
        body,
    })
}

fn dechunk(mut b: &[u8]) -> anyhow::Result<Vec<u8>> {
    let mut out = Vec::new();
    for _ in 0..1_000_000 {
        let line_end = b
            .windows(2)
            .position(|w| w == b"\r\n")
            .context("chunk size line")?;
        let size_str = std::str::from_utf8(&b[..line_end])?;
        let size = usize::from_str_radix(size_str.split(';').next().unwrap_or("").trim(), 16)?;
        b = &b[line_end + 2..];
        if size == 0 {
            return Ok(out);
        }
        if b.len() < size + 2 {
            bail!("truncated chunk");
        }
        out.extend_from_slice(&b[..size]);
        b = &b[size + 2..];
    }
    bail!("too many chunks")
}

pub async fn post_json(addr: SocketAddr, path: &str, body: &Value) -> anyhow::Result<Reply> {
    request(addr, "POST", path, Some(body.to_string().as_bytes())).await
}

pub async fn get(addr: SocketAddr, path: &str) -> anyhow::Result<Reply> {
    request(addr, "GET", path, None).await
}

/// The value of the first sample of `name` in a Prometheus text body.
pub fn metric(text: &str, name: &str) -> Option<f64> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .find(|l| l.starts_with(name) && l[name.len()..].starts_with(['{', ' ']))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}
