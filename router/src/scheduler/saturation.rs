//! The saturation rule, measured in time.
//!
//! Three tests, each on the pod's projected load (its last report plus what this router sent
//! since):
//!
//! - *busy*: `maxWaiting` requests waiting, or every sequence slot (`max_num_seqs`) taken;
//! - *tight*: KV use, with this prompt's new blocks, over `kvThreshold` (the headroom running
//!   requests need to grow without preemption);
//! - *full*: KV use, with this prompt's new blocks, over the whole cache: the prompt cannot even
//!   be admitted without taking blocks from running requests.
//!
//! Full is a hard filter while any pod is not full: preemption is worse than waiting. Busy and
//! tight are signals, not verdicts: skipping a loaded pod that holds the prompt's prefix sends
//! the request to a sibling that must compute the whole prompt again, and under load that trade
//! fails — every miss adds a full prefill, queues grow, caches thrash, more requests miss (the
//! death spiral of routers that fall back to the shortest queue; measured in the bench). So each
//! candidate gets a predicted time to first token: the prefill backlog ahead of it plus this
//! request's own uncached tokens, at the pod's prefill rate. A busy or tight pod competes only if
//! it would start the request no later than the best pod that is neither; competing pods are then
//! ranked by the weighted scorers. When no pod is free, every busy and tight pod competes (and
//! when every pod is full, every pod): the scorers' queue, KV and running terms still prefer the
//! lighter ones, while the prefix term keeps each prompt where its cache is. Deciding those by
//! predicted time alone was measured to collapse just like the shortest queue (the backlog is an
//! estimate; a prefix cache is a fact).
//!
//! A prompt's *home* ([`crate::homes`], while the `affinity` weight is on) may start a little
//! later than the best free pod and still compete: by up to [`HOME_SLACK_PREFILLS`] of the free
//! pods' shortest own prefill of the prompt, scaled by how much of the prompt the home covers. Moving a prefix off its home
//! costs that prefill twice — once now, and once more for whichever prefix the copy evicts from
//! the sibling's cache (measured on issue 16's KV-starved load, with the home score: moves of a
//! tenant off its first pod fell from 178–228 to 32–40 of 480 requests).
//!
//! The backlog: the requests the pod reports waiting, each the size of the uncached prompts this
//! router recently sent there (requests of other routers and of no router are assumed alike), plus
//! the uncached tokens of what this router sent since that report. The rate: what the sidecar
//! measured while the pod had a queue (the speed at which it works a queue off), else the median
//! of its siblings', else [`DEFAULT_PREFILL_TOKENS_PER_S`].

use super::{Candidate, Ctx};

/// Prefill rate assumed when no pod serving the model has measured one (tokens/s). Only the
/// ratio between pods matters when they share it.
pub const DEFAULT_PREFILL_TOKENS_PER_S: f64 = 10_000.0;

/// A busy home competes while it would start the prompt no later than the best free pod plus
/// this many of that pod's own prefills of it, scaled by the home's value (module docs). Three:
/// on issue 16's load (`affinity: 3`), one prefill gave hit rates 0.671–0.686 (three runs),
/// three 0.692–0.699 (three), ten 0.692, 0.697 (two), with TTFT p90 no worse (0.88–1.33 s
/// against 1.19–2.13 s); sglang-router's 0.726 at 6.4 s.
pub const HOME_SLACK_PREFILLS: f64 = 3.0;

/// How loaded a candidate is for this request (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pressure {
    Free,
    /// Requests waiting at the limit, or every slot taken.
    Busy,
    /// KV use with this prompt over the threshold.
    Tight,
    /// KV use with this prompt over the whole cache.
    Full,
}

/// Classifies the candidate on its match as it stands (a bound until resolved: nothing cached,
/// the most blocks the prompt can add, so `Free` on the bound is `Free` on the real match).
pub fn pressure(ctx: &Ctx<'_>, c: &Candidate<'_>) -> Pressure {
    let engine = &c.pod.hello.engine;
    let p = &c.projection;
    let kv_after = p.kv_usage + f64::from(c.new_blocks) / engine.num_gpu_blocks.max(1) as f64;
    if kv_after > 1.0 {
        Pressure::Full
    } else if kv_after > ctx.cfg.saturation.kv_threshold {
        Pressure::Tight
    } else if p.waiting >= ctx.cfg.saturation.max_waiting || p.running >= engine.max_num_seqs {
        Pressure::Busy
    } else {
        Pressure::Free
    }
}

/// What the scheduler knows about the model's pods as a whole, for pods that lack a measurement.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Fleet {
    /// Median of the measured prefill rates, tokens/s.
    pub prefill_tokens_per_s: f64,
    /// Median of the pods' smoothed uncached tokens per routed request, if any was routed.
    pub uncached_per_request: Option<f64>,
}

impl Fleet {
    /// From the pods serving the request's model.
    pub fn of<'p>(pods: impl Iterator<Item = &'p crate::pods::Pod>) -> Fleet {
        let mut rates = Vec::new();
        let mut sizes = Vec::new();
        for p in pods {
            if let Some(r) = p
                .load
                .as_ref()
                .and_then(|l| l.load.prefill_tokens_per_s)
                .map(f64::from)
                .filter(|r| r.is_finite() && *r > 0.0)
            {
                rates.push(r);
            }
            if let Some(u) = p.mean_uncached_tokens() {
                sizes.push(u);
            }
        }
        Fleet {
            prefill_tokens_per_s: median(&mut rates).unwrap_or(DEFAULT_PREFILL_TOKENS_PER_S),
            uncached_per_request: median(&mut sizes),
        }
    }
}

fn median(v: &mut [f64]) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    Some(v[v.len() / 2])
}

fn prefill_rate(ctx: &Ctx<'_>, c: &Candidate<'_>) -> f64 {
    c.pod
        .load
        .as_ref()
        .and_then(|l| l.load.prefill_tokens_per_s)
        .map(f64::from)
        .filter(|r| r.is_finite() && *r > 0.0)
        .unwrap_or(ctx.fleet.prefill_tokens_per_s)
}

/// Predicted seconds from now to the request's first token on the candidate's pod (see the
/// module docs): the backlog ahead of it plus its own prefill. Uses the candidate's match as it
/// stands: exact once resolved.
pub fn predicted_ttft(ctx: &Ctx<'_>, c: &Candidate<'_>) -> f64 {
    let per_request = c
        .pod
        .mean_uncached_tokens()
        .or(ctx.fleet.uncached_per_request)
        .unwrap_or(f64::from(ctx.req.prompt_tokens));
    c.projection.queued_prefill_tokens(per_request) / prefill_rate(ctx, c) + own_prefill_s(ctx, c)
}

/// Predicted seconds of the request's own prefill on the candidate's pod (its uncached tokens).
pub fn own_prefill_s(ctx: &Ctx<'_>, c: &Candidate<'_>) -> f64 {
    f64::from(c.uncached_tokens) / prefill_rate(ctx, c)
}
