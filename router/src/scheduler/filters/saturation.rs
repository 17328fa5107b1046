use crate::scheduler::{Candidate, Ctx, Filter};

/// Skips saturated pods: projected waiting at the limit, every sequence slot taken, or projected
/// KV use (reported use + prompts sent since that report + this prompt's new blocks) over the
/// threshold. Pure prefix affinity would send a long prompt to the best cache match even when
/// that pod has no room, causing preemptions; this is what prevents it.
pub struct NotSaturated;

impl Filter for NotSaturated {
    fn name(&self) -> &'static str {
        "not_saturated"
    }

    fn keep(&self, ctx: &Ctx<'_>, c: &Candidate<'_>) -> bool {
        let sat = &ctx.cfg.saturation;
        let p = &c.projection;
        let engine = &c.pod.hello.engine;
        let after = p.kv_usage + f64::from(c.new_blocks) / engine.num_gpu_blocks.max(1) as f64;
        p.waiting < sat.max_waiting && p.running < engine.max_num_seqs && after <= sat.kv_threshold
    }
}
