use super::Rejection;
use crate::scheduler::{Candidate, Ctx, Filter};

/// Pods that serve the requested model (a served name or a LoRA adapter) and belong to the pool
/// (carry every label of its `podSelector`).
pub struct ServesModel;

impl Filter for ServesModel {
    fn check(&self, ctx: &Ctx<'_>, c: &Candidate<'_>) -> Result<(), Rejection> {
        let in_pool = ctx.req.pool.is_none_or(|pool| {
            pool.pod_selector
                .iter()
                .all(|(k, v)| c.pod.hello.pod.labels.get(k) == Some(v))
        });
        if c.pod.serves(ctx.req.model) && in_pool {
            Ok(())
        } else {
            Err(Rejection::OtherModel)
        }
    }
}
