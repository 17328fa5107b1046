use crate::scheduler::{Candidate, Ctx, MatchUse, Scorer};

/// For a LoRA request: 1 where the adapter is already loaded (running or waiting requests use
/// it), 0 elsewhere, so requests for an adapter gather where it is warm. Neutral (1 everywhere)
/// for base-model requests.
pub struct LoraAffinity;

impl Scorer for LoraAffinity {
    fn match_use(&self) -> MatchUse {
        MatchUse::Ignores
    }

    fn scores(&self, ctx: &Ctx<'_>, cands: &[Candidate<'_>], out: &mut [f64]) {
        let Some(lora) = ctx.lora else {
            out.fill(1.0);
            return;
        };
        for (o, c) in out.iter_mut().zip(cands) {
            let loaded = c.pod.load.as_ref().is_some_and(|l| {
                l.load
                    .lora_running
                    .iter()
                    .chain(&l.load.lora_waiting)
                    .any(|a| a == lora)
            });
            *o = if loaded { 1.0 } else { 0.0 };
        }
    }
}
