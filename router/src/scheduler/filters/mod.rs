//! Filters: a pod either may take the request or may not (ready, serves the model, fits the
//! window). Saturation is not a filter: a busy or full pod may still be the best place for a
//! request, which only a comparison with its siblings can tell (see `scheduler::saturation`).

mod model;
mod ready;
mod window;

pub use model::ServesModel;
pub use ready::Ready;
pub use window::FitsWindow;

/// Why a filter refused a pod. The scheduler answers differently by reason: a request that only
/// [`Rejection::TooLong`] pods could serve is a context-length error (the proxy may resend it
/// to a fallback pool), anything else is "no ready pod".
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rejection {
    /// The pod does not serve the model, or is outside the request's pool.
    OtherModel,
    /// Not Ready, or its reports went stale.
    NotReady,
    /// Excluded for this request (a retry avoids the pod that refused the connection).
    Excluded,
    /// The prompt does not fit the pod's (or the pool's) context window.
    TooLong,
}
