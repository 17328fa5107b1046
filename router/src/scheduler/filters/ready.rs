use crate::scheduler::{Candidate, Ctx, Filter};
use kvsight_protocol::messages::Phase;

/// Only pods whose sidecar reports Ready (not Starting, Warming, Draining or Unhealthy), whose
/// reports are fresh, and that are not excluded for this request (a retry avoids the pod that
/// refused the connection).
pub struct Ready;

impl Filter for Ready {
    fn name(&self) -> &'static str {
        "ready"
    }

    fn keep(&self, ctx: &Ctx<'_>, c: &Candidate<'_>) -> bool {
        c.pod.phase() == Phase::Ready
            && !c.pod.is_stale(ctx.now)
            && !ctx.req.exclude.iter().any(|k| k == &c.pod.key)
    }
}
