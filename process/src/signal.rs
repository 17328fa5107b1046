//! The termination signal both binaries drain on.

use std::future::Future;

/// Installs the handlers at once and returns a future that resolves on the first SIGTERM (what
/// Kubernetes sends before killing a pod) or SIGINT (Ctrl-C); off Unix, on Ctrl-C only.
///
/// Call it before binding or announcing a port: a signal that arrives before its handler is
/// installed takes the default action and kills the process without a drain (an async fn would
/// install only when first polled, after whatever the caller did in between). Must be called
/// within a tokio runtime. On Unix both handlers are installed by this call; only the fallbacks
/// (neither could be installed, or not Unix) wait on `ctrl_c`, which installs when first polled.
///
/// Lives here because the sidecar and the router are the two binaries and this is the one
/// library both depend on; they must stop on exactly the same signals. When a handler cannot be
/// installed, the other signal still works rather than the process never draining.
pub fn termination() -> impl Future<Output = ()> + Send + 'static {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        let term = signal(SignalKind::terminate());
        let int = signal(SignalKind::interrupt());
        async move {
            match (term, int) {
                (Ok(mut term), Ok(mut int)) => {
                    tokio::select! {
                        _ = term.recv() => {}
                        _ = int.recv() => {}
                    }
                }
                (Ok(mut term), Err(_)) => {
                    term.recv().await;
                }
                (Err(_), Ok(mut int)) => {
                    int.recv().await;
                }
                (Err(_), Err(_)) => {
                    let _ = tokio::signal::ctrl_c().await;
                }
            }
        }
    }
    #[cfg(not(unix))]
    {
        async {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}

/// Runs `then` once, on the first termination signal (see [`termination`]), from a task of its
/// own: the one wiring of a signal to a drain that both binaries use. The handlers are
/// installed by this call, so call it before binding a port. Must be called within a tokio
/// runtime.
pub fn on_termination(then: impl FnOnce() + Send + 'static) {
    let terminated = termination();
    tokio::spawn(async move {
        terminated.await;
        tracing::info!("termination signal: draining");
        then();
    });
}
