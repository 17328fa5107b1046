//! One run's figures, the results file and the markdown table.

use std::collections::BTreeMap;

use kvsight_sidecar::counters::PodCounters;
use serde::Serialize;

use crate::client::Outcome;

/// The figures of one router × workload × rate. `None` (JSON null) where a figure does not
/// apply (a router that predicts nothing) or could not be computed (no successful request).
#[derive(Debug, Clone, Serialize)]
pub struct RunResult {
    pub router: String,
    pub workload: String,
    /// Requests per simulated second.
    pub rate: f64,
    /// Processes of the router the clients spread their requests over, and how.
    pub router_replicas: usize,
    pub client_spread: &'static str,
    pub requests: usize,
    /// Cluster prefix-cache hit rate from the pods' own counters (hits / queries, tokens).
    pub hit_rate: Option<f64>,
    /// Time to first token and end to end, simulated seconds (wall time / time scale).
    pub ttft_p50_s: Option<f64>,
    pub ttft_p90_s: Option<f64>,
    pub ttft_p99_s: Option<f64>,
    pub e2e_p50_s: Option<f64>,
    pub e2e_p99_s: Option<f64>,
    /// Output tokens per simulated second over the run.
    pub output_tokens_per_s: f64,
    /// Share of requests that succeeded with a TTFT within the SLO.
    pub goodput: f64,
    pub preemptions: f64,
    /// Most requests served by one pod over fewest (null when a pod served none).
    pub max_min_share: Option<f64>,
    /// How unevenly the pods were loaded: coefficient of variation (standard deviation over
    /// mean) of the requests and of the prompt tokens each pod served.
    pub load_cov: LoadCov,
    /// kvsight only: requests that a replica sent to another pod than the one a different
    /// replica had sent the same tenant or session to within one load-report interval before.
    pub split_placements: Option<usize>,
    /// Requests that failed, not counting those shed (answered 429).
    pub errors: usize,
    /// Requests a router's flow control answered 429.
    pub shed: usize,
    /// Whether the router ran with flow control (`on`/`off`; peers have none: `off`).
    pub flow_control: &'static str,
    /// Per group of requests, for workloads that have groups (noisy_neighbor: `quiet`,
    /// `quiet_calm`, `noisy`, `noisy_calm`; priority_mix: `interactive`, `batch`).
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub groups: BTreeMap<String, Group>,
    /// Router CPU seconds (whole process group) per 1,000 requests.
    pub router_cpu_s_per_1k: f64,
    pub router_rss_mib: f64,
    /// Median TTFT through the router minus straight to a pod, one request at a time, wall ms.
    pub added_latency_ms: Option<f64>,
    /// Share of requests whose predicted cached prompt tokens equal the engine's.
    pub prediction_accuracy: Option<f64>,
    /// KV event published → applied to the router's filter, wall ms.
    pub staleness_p50_ms: Option<f64>,
    pub staleness_p99_ms: Option<f64>,
    /// The first error, to say what went wrong.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub first_error: Option<String>,
}

/// The figures of one group of a run's requests.
#[derive(Debug, Clone, Serialize)]
pub struct Group {
    pub requests: usize,
    pub shed: usize,
    /// Failed otherwise.
    pub errors: usize,
    /// Over the group's successful requests, simulated seconds.
    pub ttft_p50_s: Option<f64>,
    pub ttft_p90_s: Option<f64>,
    pub ttft_p99_s: Option<f64>,
    /// The group's output tokens per simulated second over the whole run.
    pub output_tokens_per_s: f64,
}

/// The coefficients of variation of [`RunResult::load_cov`].
#[derive(Debug, Clone, Copy, Serialize)]
pub struct LoadCov {
    pub requests: Option<f64>,
    pub prompt_tokens: Option<f64>,
}

/// Standard deviation over mean of `v` (population), `None` without a positive mean.
pub fn cov(v: &[f64]) -> Option<f64> {
    let n = v.len() as f64;
    let mean = v.iter().sum::<f64>() / n;
    if v.is_empty() || mean <= 0.0 {
        return None;
    }
    let var = v.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / n;
    Some(var.sqrt() / mean)
}

/// What the bench measured besides the client's outcomes.
pub struct RunInputs<'a> {
    pub router: &'a str,
    pub workload: &'a str,
    pub rate: f64,
    pub router_replicas: usize,
    pub client_spread: &'static str,
    pub split_placements: Option<usize>,
    pub outcomes: &'a [Outcome],
    /// Per pod: counters after minus before.
    pub pods: &'a [PodCounters],
    /// Wall seconds from the first send to the last answer.
    pub wall_s: f64,
    pub time_scale: f64,
    pub slo_wall_s: f64,
    pub cpu_s: f64,
    pub rss_bytes: u64,
    pub added_latency_ms: Option<f64>,
    pub predicts: bool,
    pub staleness_ms: Option<(f64, f64)>,
    /// Each request's group (in outcome order), when the workload has groups.
    pub groups: &'a [Option<&'static str>],
    pub flow_control: bool,
}

/// The `q` quantile (0–1) of `v` (nearest rank), `None` when empty.
pub fn quantile(v: &mut [f64], q: f64) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let idx = ((q * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1;
    Some(v[idx])
}

impl RunResult {
    pub fn new(i: &RunInputs<'_>) -> RunResult {
        let ok: Vec<&Outcome> = i.outcomes.iter().filter(|o| o.error.is_none()).collect();
        let scale = i.time_scale;
        let shed = i.outcomes.iter().filter(|o| o.shed()).count();
        let mut groups: BTreeMap<String, Group> = BTreeMap::new();
        let mut names: Vec<&'static str> = i.groups.iter().flatten().copied().collect();
        names.sort_unstable();
        names.dedup();
        for name in names {
            let members: Vec<&Outcome> = i
                .outcomes
                .iter()
                .zip(i.groups)
                .filter(|(_, g)| **g == Some(name))
                .map(|(o, _)| o)
                .collect();
            let mut t: Vec<f64> = members
                .iter()
                .filter(|o| o.error.is_none())
                .filter_map(|o| o.ttft_s)
                .map(|t| t / scale)
                .collect();
            let out: u64 = members
                .iter()
                .filter(|o| o.error.is_none())
                .map(|o| u64::from(o.completion_tokens))
                .sum();
            let shed = members.iter().filter(|o| o.shed()).count();
            groups.insert(
                name.to_owned(),
                Group {
                    requests: members.len(),
                    shed,
                    errors: members.iter().filter(|o| o.error.is_some()).count() - shed,
                    ttft_p50_s: quantile(&mut t, 0.5),
                    ttft_p90_s: quantile(&mut t, 0.9),
                    ttft_p99_s: quantile(&mut t, 0.99),
                    output_tokens_per_s: per_simulated_second(out, i.wall_s, scale),
                },
            );
        }
        let mut ttft: Vec<f64> = ok
            .iter()
            .filter_map(|o| o.ttft_s)
            .map(|t| t / scale)
            .collect();
        let mut e2e: Vec<f64> = ok.iter().map(|o| o.e2e_s / scale).collect();
        let total = crate::cluster::total(i.pods);
        let shares: Vec<f64> = i.pods.iter().map(|p| p.requests).collect();
        let (max, min) = shares
            .iter()
            .fold((f64::MIN, f64::MAX), |(a, b), &s| (a.max(s), b.min(s)));
        let predicted: Vec<(u32, u32)> = ok
            .iter()
            .filter_map(|o| Some((o.predicted_cached_tokens?, o.cached_tokens?)))
            .collect();
        let output: u64 = ok.iter().map(|o| u64::from(o.completion_tokens)).sum();
        let n = i.outcomes.len();
        RunResult {
            router: i.router.to_owned(),
            workload: i.workload.to_owned(),
            rate: i.rate,
            router_replicas: i.router_replicas,
            client_spread: i.client_spread,
            requests: n,
            hit_rate: total.hit_rate(),
            ttft_p50_s: quantile(&mut ttft, 0.5),
            ttft_p90_s: quantile(&mut ttft, 0.9),
            ttft_p99_s: quantile(&mut ttft, 0.99),
            e2e_p50_s: quantile(&mut e2e, 0.5),
            e2e_p99_s: quantile(&mut e2e, 0.99),
            output_tokens_per_s: per_simulated_second(output, i.wall_s, scale),
            goodput: if n == 0 {
                0.0
            } else {
                ok.iter()
                    .filter(|o| o.ttft_s.is_some_and(|t| t <= i.slo_wall_s))
                    .count() as f64
                    / n as f64
            },
            preemptions: total.preemptions,
            max_min_share: (min > 0.0).then(|| max / min),
            load_cov: LoadCov {
                requests: cov(&shares),
                prompt_tokens: cov(&i.pods.iter().map(|p| p.prompt_tokens).collect::<Vec<_>>()),
            },
            split_placements: i.split_placements,
            errors: n - ok.len() - shed,
            shed,
            flow_control: if i.flow_control { "on" } else { "off" },
            groups,
            router_cpu_s_per_1k: if n == 0 {
                0.0
            } else {
                i.cpu_s * 1000.0 / n as f64
            },
            router_rss_mib: i.rss_bytes as f64 / (1 << 20) as f64,
            added_latency_ms: i.added_latency_ms,
            prediction_accuracy: (i.predicts && !predicted.is_empty()).then(|| {
                predicted.iter().filter(|(p, c)| p == c).count() as f64 / predicted.len() as f64
            }),
            staleness_p50_ms: i.staleness_ms.map(|s| s.0),
            staleness_p99_ms: i.staleness_ms.map(|s| s.1),
            first_error: i
                .outcomes
                .iter()
                .filter(|o| !o.shed())
                .find_map(|o| o.error.clone()),
        }
    }
}

/// `1`, or `4 round_robin` / `4 pinned`.
fn replicas(r: &RunResult) -> String {
    if r.router_replicas <= 1 {
        "1".to_owned()
    } else {
        format!("{} {}", r.router_replicas, r.client_spread)
    }
}

fn f(v: Option<f64>, digits: usize) -> String {
    v.map_or_else(|| "–".to_owned(), |v| format!("{v:.digits$}"))
}

/// The markdown table of every run, grouped by workload and rate.
pub fn markdown(runs: &[RunResult]) -> String {
    let mut s = String::from(
        "| workload | rate | router | replicas | hit rate | TTFT p50 | TTFT p90 | TTFT p99 | e2e p50 | e2e p99 | out tok/s | goodput | preempt | max/min | load CoV | splits | errors | CPU s/1k | RSS MiB | added ms | Sight | stale p99 ms |\n\
         |---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    let mut groups: BTreeMap<(String, u64), Vec<&RunResult>> = BTreeMap::new();
    for r in runs {
        groups
            .entry((r.workload.clone(), (r.rate * 1000.0) as u64))
            .or_default()
            .push(r);
    }
    for ((workload, _), rs) in groups {
        for r in rs {
            s.push_str(&format!(
                "| {workload} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {:.0} | {:.2} | {:.0} | {} | {} | {} | {} | {:.2} | {:.0} | {} | {} | {} |\n",
                r.rate,
                r.router,
                replicas(r),
                f(r.hit_rate, 2),
                f(r.ttft_p50_s, 3),
                f(r.ttft_p90_s, 3),
                f(r.ttft_p99_s, 3),
                f(r.e2e_p50_s, 2),
                f(r.e2e_p99_s, 2),
                r.output_tokens_per_s,
                r.goodput,
                r.preemptions,
                f(r.max_min_share, 1),
                f(r.load_cov.requests, 2),
                r.split_placements.map_or_else(|| "–".to_owned(), |n| n.to_string()),
                r.errors,
                r.router_cpu_s_per_1k,
                r.router_rss_mib,
                f(r.added_latency_ms, 2),
                f(r.prediction_accuracy, 3),
                f(r.staleness_p99_ms, 1),
            ));
        }
    }
    if runs.iter().any(|r| !r.groups.is_empty()) {
        s.push_str(
            "\n| workload | rate | router | replicas | flow control | group | requests | shed | errors | TTFT p50 | TTFT p90 | TTFT p99 | out tok/s |\n\
             |---|---|---|---|---|---|---|---|---|---|---|---|---|\n",
        );
        for r in runs {
            for (name, g) in &r.groups {
                s.push_str(&format!(
                    "| {} | {} | {} | {} | {} | {name} | {} | {} | {} | {} | {} | {} | {:.0} |\n",
                    r.workload,
                    r.rate,
                    r.router,
                    replicas(r),
                    r.flow_control,
                    g.requests,
                    g.shed,
                    g.errors,
                    f(g.ttft_p50_s, 3),
                    f(g.ttft_p90_s, 3),
                    f(g.ttft_p99_s, 3),
                    g.output_tokens_per_s,
                ));
            }
        }
    }
    s
}

/// `count` over a run of `wall_s` wall seconds, per simulated second (0 for an empty run).
fn per_simulated_second(count: u64, wall_s: f64, time_scale: f64) -> f64 {
    if wall_s > 0.0 {
        count as f64 / (wall_s / time_scale)
    } else {
        0.0
    }
}
