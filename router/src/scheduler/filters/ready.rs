use super::Rejection;
use crate::scheduler::{Candidate, Ctx, Filter};
use kvsight_protocol::messages::Phase;

/// Only pods whose sidecar reports Ready (not Starting, Warming, Draining or Unhealthy), whose
/// reports are fresh, and that are not excluded for this request (a retry avoids the pod that
/// refused the connection).
pub struct Ready;

impl Filter for Ready {
    fn check(&self, ctx: &Ctx<'_>, c: &Candidate<'_>) -> Result<(), Rejection> {
        if c.pod.phase() != Phase::Ready || c.pod.is_stale(ctx.now) {
            Err(Rejection::NotReady)
        } else if ctx.req.exclude.iter().any(|k| k == &c.pod.key) {
            Err(Rejection::Excluded)
        } else {
            Ok(())
        }
    }
}
