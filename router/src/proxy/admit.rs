//! The pick for an attempt: through flow control's admission on a request's first attempt when
//! it is on, then the scheduler, hopping to the fallback pool when the prompt is too long.

use std::sync::Arc;
use std::time::Instant;

use super::attempt::Attempt;
use super::request::Prepared;
use crate::config::PoolConfig;
use crate::error::ApiError;
use crate::flow;
use crate::scheduler::{Decision, Gate, PickError, PickRequest, PromptHashes, Scheduler};
use crate::state::{Live, State};

/// A pick and the pool it was made in (the request's, or its fallback when the prompt was too
/// long for every pod of the request's pool).
pub(super) struct Placed<'a> {
    pub(super) decision: Decision,
    pub(super) pool: Option<&'a PoolConfig>,
}

/// Picks for the attempt. The first attempt of a request passes flow control when it is on
/// ([`flow`]): it may wait in this replica's queue, or be answered 429 at once; a retry was
/// admitted with its first attempt.
pub(super) async fn admit<'a>(
    state: &Arc<State>,
    live: &'a Live,
    req: &Arc<Prepared>,
    attempt: &Attempt<'a>,
) -> Result<Placed<'a>, ApiError> {
    if !live.config.flow_control.enabled || !attempt.spent.is_empty() {
        return pick(state, live, req, attempt, None);
    }
    let (prepared, pool) = (req.clone(), attempt.pool.map(|p| p.name.clone()));
    // Run when the request leaves the queue, in the config of that moment.
    let try_pick: flow::TryPick = Box::new(move |state, live, gate| {
        let pool = pool.as_deref().and_then(|n| live.config.pool(n));
        let placed = pick(state, live, &prepared, &Attempt::first(pool), Some(gate))?;
        Ok(flow::Admitted {
            decision: placed.decision,
            pool: placed.pool.map(|p| p.name.clone()),
            picked_at: Instant::now(),
        })
    });
    let ticket = flow::Ticket {
        model: &req.model,
        headers: &req.headers,
        prompt_tokens: u32::try_from(req.prompt.tokens.len()).unwrap_or(u32::MAX),
        body: &req.body,
        deadline: req.deadline,
    };
    let a = flow::admit(state, live, ticket, try_pick).await?;
    let pool = a.pool.as_deref().and_then(|n| live.config.pool(n));
    Ok(Placed {
        decision: a.decision,
        pool,
    })
}

/// Picks in the attempt's pool; a prompt too long for it goes to the pool's fallback, or —
/// without one — to a pod anyway, so the client gets vLLM's own 400 text. With a wait budget
/// (flow control's gate), [`ApiError::OverBudget`] when no pod can take the request within it.
fn pick<'a>(
    state: &State,
    live: &'a Live,
    prepared: &Prepared,
    attempt: &Attempt<'a>,
    gate: Option<Gate>,
) -> Result<Placed<'a>, ApiError> {
    let mut pool = attempt.pool;
    let mut hopped = false;
    loop {
        let req = PickRequest {
            model: &prepared.model,
            pool,
            prompt_tokens: u32::try_from(prepared.prompt.tokens.len()).unwrap_or(u32::MAX),
            tokens: Some(&prepared.prompt.tokens),
            cache_salt: prepared.cache_salt.as_deref(),
            exclude: &attempt.exclude,
        };
        match run_pick(state, live, &req, gate) {
            Ok(decision) => return Ok(Placed { decision, pool }),
            Err(PickError::NoReadyPod(m)) => return Err(ApiError::NoReadyPod(m)),
            Err(PickError::OverBudget { wait_s }) => return Err(ApiError::OverBudget { wait_s }),
            Err(PickError::TooLong { .. }) => {
                let fb = pool
                    .and_then(|p| p.fallback.as_deref())
                    .and_then(|n| live.config.pool(n));
                match fb {
                    Some(fb) if !hopped => {
                        state.metrics.retry("too_long_direct");
                        hopped = true;
                        pool = Some(fb);
                    }
                    _ => {
                        // No pool fits: let an engine say so in its own words.
                        let req = PickRequest {
                            prompt_tokens: 0,
                            tokens: None,
                            ..req
                        };
                        return run_pick(state, live, &req, gate)
                            .map(|decision| Placed { decision, pool })
                            .map_err(|e| match e {
                                PickError::OverBudget { wait_s } => ApiError::OverBudget { wait_s },
                                e => ApiError::NoReadyPod(e.to_string()),
                            });
                    }
                }
            }
        }
    }
}

fn run_pick(
    state: &State,
    live: &Live,
    req: &PickRequest<'_>,
    gate: Option<Gate>,
) -> Result<Decision, PickError> {
    let t = Instant::now();
    // Hashing happens between two short holds of the registry lock, not under it: the pods'
    // shapes rarely change in between, and the pick computes what a newcomer needs.
    let plan = Scheduler::hash_plan(&state.registry(), req);
    let mut hashes = PromptHashes::new(&plan, req.tokens);
    let result = {
        let mut reg = state.registry();
        match gate {
            None => live
                .scheduler
                .pick_prepared(&mut reg, req, &mut hashes, Instant::now()),
            Some(gate) => {
                live.scheduler
                    .pick_within(&mut reg, req, &mut hashes, Instant::now(), gate)
            }
        }
    };
    state
        .metrics
        .pick_seconds
        .observe(t.elapsed().as_secs_f64());
    if let Ok(d) = &result {
        state
            .metrics
            .saturation_skips
            .inc_by(d.saturation_skipped as u64);
        match d.placement_shared {
            Some(true) => state.metrics.placements("shared", 1),
            Some(false) => state.metrics.placements("unsent", 1),
            None => {}
        }
    }
    if let Ok(d) = &result
        && d.chain_len > 0
    {
        state
            .metrics
            .prefix_match_ratio
            .observe(d.matched_blocks as f64 / d.chain_len as f64);
    }
    result
}
