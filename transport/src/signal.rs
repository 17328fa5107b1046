//! The termination signal both binaries drain on.

/// Resolves on the first SIGTERM (what Kubernetes sends before killing a pod) or SIGINT
/// (Ctrl-C); off Unix, on Ctrl-C only.
///
/// Lives here because the sidecar and the router are the two binaries and this is the one
/// library both depend on; they must stop on exactly the same signals. When the SIGTERM handler
/// cannot be installed, Ctrl-C still works rather than the process never draining.
pub async fn termination() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = term.recv() => {}
                    _ = tokio::signal::ctrl_c() => {}
                }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}
