//! Serving the HTTP app on the client listener with bounds `axum::serve` does not offer: a
//! header read timeout, a cap on the request head's size and header count, and a cap on open
//! connections (one over it is answered 503 with `Retry-After` and closed), and a write timeout:
//! a client that takes no byte of its answer for `timeouts.clientWriteSeconds` has its
//! connection closed, which ends the request and aborts the pod's generation (a stalled reader
//! would otherwise hold both until `requestSeconds`). The bounds come from
//! the live config when a connection is accepted, so a reload applies to new connections. On
//! `stop` the listener closes, every connection finishes its current request (graceful
//! shutdown) and `serve` returns when all have closed.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Router;
use axum::response::IntoResponse;
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{debug, warn};

use crate::error::ApiError;
use crate::state::State;

/// Connections over `limits.connections` that are answered 503 at once; past this many such
/// answers in progress, further ones are closed unanswered (answering must not cost more than
/// the cap saves).
pub const MAX_REFUSING: usize = 64;

/// How long to wait after a failed `accept` (out of file descriptors, usually) before the next.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);

/// One open connection (HTTP or a sidecar's QUIC one), counted while it lives.
pub(crate) struct Slot(Arc<AtomicUsize>);

impl Slot {
    /// A slot when fewer than `max` are taken.
    pub(crate) fn take(count: &Arc<AtomicUsize>, max: usize) -> Option<Slot> {
        count
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < max).then_some(n + 1)
            })
            .ok()
            .map(|_| Slot(count.clone()))
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Serves `app` on `listener` until `stop`, then drains the open connections.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    state: Arc<State>,
    stop: CancellationToken,
) -> std::io::Result<()> {
    let conns = TaskTracker::new();
    let open = Arc::new(AtomicUsize::new(0));
    let refusing = Arc::new(AtomicUsize::new(0));
    loop {
        let tcp = tokio::select! {
            _ = stop.cancelled() => break,
            accepted = listener.accept() => match accepted {
                Ok((tcp, _)) => tcp,
                Err(e) => {
                    warn!(error = %e, "accepting a client connection failed");
                    tokio::time::sleep(ACCEPT_BACKOFF).await;
                    continue;
                }
            },
        };
        // Streams are many small writes: without TCP_NODELAY, Nagle + the client's delayed ACK
        // add ~40 ms to every SSE answer.
        let _ = tcp.set_nodelay(true);
        let live = state.live();
        let limits = &live.config.limits;
        let mut builder = http1::Builder::new();
        builder
            .timer(TokioTimer::new())
            .header_read_timeout(live.config.timeouts.header_read())
            .max_headers(limits.headers)
            .max_buf_size(limits.header_bytes);
        match Slot::take(&open, limits.connections) {
            Some(slot) => {
                let (app, state, stop) = (app.clone(), state.clone(), stop.clone());
                let io = TimedWrites::new(TokioIo::new(tcp), live.config.timeouts.client_write());
                conns.spawn(async move {
                    connection(builder, io, app, &state, stop).await;
                    drop(slot);
                });
            }
            None => {
                state.metrics.refused("connections");
                let limit = limits.connections;
                debug!(limit, "connection over the limit refused");
                // Over the cap of answers too: closing is the only bounded thing left.
                let Some(slot) = Slot::take(&refusing, MAX_REFUSING) else {
                    continue;
                };
                builder.keep_alive(false);
                conns.spawn(async move {
                    refuse(builder, tcp, limit).await;
                    drop(slot);
                });
            }
        }
    }
    conns.close();
    conns.wait().await;
    Ok(())
}

async fn connection(
    builder: http1::Builder,
    io: TimedWrites<TokioIo<TcpStream>>,
    app: Router,
    state: &State,
    stop: CancellationToken,
) {
    let service = TowerToHyperService::new(app);
    let conn = builder.serve_connection(io, service);
    let mut conn = std::pin::pin!(conn);
    let mut draining = false;
    let result = loop {
        tokio::select! {
            r = conn.as_mut() => break r,
            _ = stop.cancelled(), if !draining => {
                draining = true;
                conn.as_mut().graceful_shutdown();
            }
        }
    };
    if let Err(e) = result {
        // hyper enforces these bounds itself (closing, or answering 431); count them here.
        let reason = if e.is_timeout() {
            Some("header_read_time")
        } else if is_write_timeout(&e) {
            Some("client_write_time")
        } else if e.is_parse_too_large() {
            Some("header_bytes")
        } else {
            None
        };
        match reason {
            Some(reason) => {
                state.metrics.refused(reason);
                warn!(reason, error = %e, "client connection refused");
            }
            None => debug!(error = %e, "client connection ended with an error"),
        }
    }
}

/// Answers every request of a connection over the cap with 503 and closes it.
async fn refuse(builder: http1::Builder, tcp: TcpStream, limit: usize) {
    let service = hyper::service::service_fn(move |_req: hyper::Request<Incoming>| async move {
        Ok::<_, Infallible>(ApiError::TooManyConnections { limit }.into_response())
    });
    let _ = builder.serve_connection(TokioIo::new(tcp), service).await;
}

/// Whether a connection ended because the client stopped reading ([`TimedWrites`]).
fn is_write_timeout(e: &hyper::Error) -> bool {
    let mut src = std::error::Error::source(e);
    while let Some(inner) = src {
        if inner
            .downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::TimedOut)
        {
            return true;
        }
        src = inner.source();
    }
    false
}

/// A connection whose writes fail once one has waited `limit` for the client to take bytes.
/// Reads are untouched (an idle keep-alive connection is the header timeout's business).
pub struct TimedWrites<T> {
    inner: T,
    limit: Duration,
    /// Armed while a write waits for the client.
    stalled: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl<T> TimedWrites<T> {
    pub fn new(inner: T, limit: Duration) -> Self {
        TimedWrites {
            inner,
            limit,
            stalled: None,
        }
    }

    /// Turns a pending write into an error once it has waited `limit`.
    fn watch<R>(
        &mut self,
        cx: &mut Context<'_>,
        poll: Poll<std::io::Result<R>>,
    ) -> Poll<std::io::Result<R>> {
        if poll.is_ready() {
            self.stalled = None;
            return poll;
        }
        let limit = self.limit;
        let timer = self
            .stalled
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(limit)));
        match timer.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!("the client took no bytes for {limit:?}"),
            ))),
            Poll::Pending => Poll::Pending,
        }
    }
}

impl<T: hyper::rt::Read + Unpin> hyper::rt::Read for TimedWrites<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: hyper::rt::ReadBufCursor<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<T: hyper::rt::Write + Unpin> hyper::rt::Write for TimedWrites<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let poll = Pin::new(&mut self.inner).poll_write(cx, buf);
        self.watch(cx, poll)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        let poll = Pin::new(&mut self.inner).poll_flush(cx);
        self.watch(cx, poll)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        let poll = Pin::new(&mut self.inner).poll_shutdown(cx);
        self.watch(cx, poll)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        let poll = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        self.watch(cx, poll)
    }
}
