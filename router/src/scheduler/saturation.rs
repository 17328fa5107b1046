//! The saturation rule, judged in time (docs/decisions/0002-saturation-in-time.md).
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
//! Full is a hard filter while any pod is not full (preemption is worse than waiting), except
//! for the prompt's home ([`full_home_competes`]), which competes as a busy pod. Busy and
//! tight are signals, not verdicts: skipping a loaded pod that holds the prompt's prefix sends
//! the request to a sibling that must compute the whole prompt again, and under load that trade
//! feeds a death spiral of misses. So each candidate gets a predicted time to first token: the
//! prefill backlog ahead of it plus this request's own uncached tokens, at the pod's prefill
//! rate. A busy or tight pod competes only if it would start the request no later than the best
//! pod that is neither; competing pods are then ranked by the weighted scorers. When no pod is
//! free, every busy and tight pod competes (and when every pod is full, every pod): the backlog
//! is an estimate, a prefix cache is a fact, so the scorers decide, and only an outlier
//! ([`SATURATED_OUTLIER`]) is left out.
//!
//! A prompt's *home* ([`crate::homes`]) may start a little later than the best free pod and
//! still compete ([`home_slack`]): moving a prefix off its home costs its prefill at least
//! twice, now and for whichever prefix the copy evicts on the sibling.
//!
//! The backlog: the requests the pod reports waiting, each the size of the uncached prompts this
//! router recently sent there (requests of other routers and of no router are assumed alike), plus
//! the uncached tokens of what this router sent since that report. The rate: what the sidecar
//! measured while the pod had a queue, else the median of its siblings', else
//! [`DEFAULT_PREFILL_TOKENS_PER_S`]. The wait ahead is that backlog's time or, when longer, how
//! long this router's oldest streamed request on the pod has waited for its first token
//! ([`crate::pods::Pod::oldest_awaiting`]): a queue held up by KV blocks that long generations
//! hold (load that bypassed the router) looks short by its counts
//! (docs/decisions/0003-observed-wait-and-outlier-cut.md).

use super::{Candidate, Ctx};

/// Prefill rate assumed when no pod serving the model has measured one (tokens/s). Only the
/// ratio between pods matters when they share it.
pub const DEFAULT_PREFILL_TOKENS_PER_S: f64 = 10_000.0;

/// A busy home competes while it would start the prompt no later than the best free pod plus
/// this many of that pod's own prefills of it, scaled by the home's value: its predicted wait is
/// mostly its oldest stream's observed wait, which a few prefills do not cover, and a stuck
/// home's wait passes the slack within one slack's time (docs/decisions/0005-home-slack.md).
pub const HOME_SLACK_PREFILLS: f64 = 20.0;

/// When every pod is busy or full, a pod predicted to take more than this many times the
/// median of their predicted times to first token (plus one prefill of the whole prompt) is
/// left out: the pod whose queue stands still behind load the reports cannot explain. Only the
/// outlier: a tighter cut overrides the prefix term that keeps prompts on their caches
/// (docs/decisions/0003-observed-wait-and-outlier-cut.md).
pub const SATURATED_OUTLIER: f64 = 4.0;

/// Whether a full candidate still competes, as a busy one: the prompt's home. vLLM admits a
/// waiting request only when its blocks are free, and a home holding the prefix adds only the
/// prompt's own blocks, while a sibling must compute the whole prompt and evict another prefix
/// to hold it. A home whose prefix was evicted competes too, so each pod's set of prefixes stays
/// small (docs/decisions/0004-full-home-competes.md).
pub fn full_home_competes(c: &Candidate<'_>) -> bool {
    c.home > 0.0
}

/// Seconds a busy candidate may start the prompt after the best free pod and still compete:
/// for the prompt's home, [`HOME_SLACK_PREFILLS`] of the free pods' shortest own prefill of it
/// (`best_free_prefill`), scaled by the home's value; for any other pod nothing. A home under
/// KV pressure (tight or full) gets it only while the prompt's new blocks take less than half
/// the headroom `kvThreshold` keeps: a question's few blocks fit, a long prompt of its own would
/// push the pod into preemptions.
pub fn home_slack(ctx: &Ctx<'_>, c: &Candidate<'_>, best_free_prefill: f64) -> f64 {
    if c.home <= 0.0 {
        return 0.0;
    }
    if matches!(pressure(ctx, c), Pressure::Tight | Pressure::Full) {
        let headroom = (1.0 - ctx.cfg.saturation.kv_threshold).max(0.0)
            * c.pod.hello.engine.num_gpu_blocks as f64;
        if f64::from(c.new_blocks) >= 0.5 * headroom {
            return 0.0;
        }
    }
    HOME_SLACK_PREFILLS * best_free_prefill * c.home
}

/// The latest predicted time to first token at which a pod still competes for a new prefix's
/// room (`scorers::affinity`): the soonest candidate's plus [`HOME_SLACK_PREFILLS`] of the
/// shortest own prefill of the prompt — the slack the prefix's home will get once it has one.
/// Later pods get no room score: a pod whose queue stands still behind load the router cannot
/// explain serves fewer of its homes and looks roomiest (docs/decisions/0010-working-set-room.md).
pub fn room_cutoff(ctx: &Ctx<'_>, cands: &[Candidate<'_>]) -> f64 {
    let (best, prefill) = soonest(ctx, cands);
    best + HOME_SLACK_PREFILLS * prefill
}

/// The candidates' (matches resolved) smallest predicted time to first token and smallest own
/// prefill of the prompt, in seconds: what a home's slack is measured from.
pub fn soonest(ctx: &Ctx<'_>, cands: &[Candidate<'_>]) -> (f64, f64) {
    cands
        .iter()
        .fold((f64::INFINITY, f64::INFINITY), |(t, p), c| {
            (t.min(predicted_ttft(ctx, c)), p.min(own_prefill_s(ctx, c)))
        })
}

/// The cut of [`SATURATED_OUTLIER`] for these candidates (their matches resolved), in seconds.
pub fn saturated_cutoff(ctx: &Ctx<'_>, cands: &[Candidate<'_>]) -> f64 {
    let mut t: Vec<f64> = cands.iter().map(|c| predicted_ttft(ctx, c)).collect();
    let whole_prompt = f64::from(ctx.req.prompt_tokens) / ctx.fleet.prefill_tokens_per_s;
    median(&mut t).map_or(f64::INFINITY, |m| SATURATED_OUTLIER * (m + whole_prompt))
}

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

/// The pod's projected KV use, as a fraction of its cache, once the prompt's new blocks are in.
pub fn kv_after(c: &Candidate<'_>) -> f64 {
    let blocks = c.pod.hello.engine.num_gpu_blocks.max(1) as f64;
    c.projection.kv_usage + f64::from(c.new_blocks) / blocks
}

/// Flow control's room test: the pod is free by [`pressure`] (or only tight, with
/// `kv_headroom`) and its KV use with the prompt stays under `kv_ceiling`.
pub fn gate_room(ctx: &Ctx<'_>, c: &Candidate<'_>, kv_headroom: bool, kv_ceiling: f64) -> bool {
    let room = match pressure(ctx, c) {
        Pressure::Free => true,
        Pressure::Tight => kv_headroom,
        Pressure::Busy | Pressure::Full => false,
    };
    room && kv_after(c) <= kv_ceiling
}

/// Classifies the candidate on its match as it stands (a bound until resolved: nothing cached,
/// the most blocks the prompt can add, so `Free` on the bound is `Free` on the real match).
pub fn pressure(ctx: &Ctx<'_>, c: &Candidate<'_>) -> Pressure {
    let engine = &c.pod.hello.engine;
    let p = &c.projection;
    let kv_after = kv_after(c);
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
/// module docs): the wait ahead of it — the backlog at the pod's prefill rate, or as long as
/// this router's oldest streamed request there has waited for its first token, whichever is
/// longer — plus its own prefill. Uses the candidate's match as it stands: exact once resolved.
pub fn predicted_ttft(ctx: &Ctx<'_>, c: &Candidate<'_>) -> f64 {
    let per_request = c
        .pod
        .mean_uncached_tokens()
        .or(ctx.fleet.uncached_per_request)
        .unwrap_or(f64::from(ctx.req.prompt_tokens));
    let backlog = c.projection.queued_prefill_tokens(per_request) / prefill_rate(ctx, c);
    backlog.max(c.pod.oldest_awaiting(ctx.now).as_secs_f64()) + own_prefill_s(ctx, c)
}

/// Predicted seconds of the request's own prefill on the candidate's pod (its uncached tokens).
pub fn own_prefill_s(ctx: &Ctx<'_>, c: &Candidate<'_>) -> f64 {
    f64::from(c.uncached_tokens) / prefill_rate(ctx, c)
}
