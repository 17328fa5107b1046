//! Reading vLLM's `/metrics` exposition: the engine's own view of its load and cache.
//!
//! vLLM renamed metrics over time (`gpu_cache_usage_perc` → `kv_cache_usage_perc` and
//! `gpu_prefix_cache_*` → `prefix_cache_*` in 0.12); both generations are read and the new name
//! wins when both are present. With data parallelism one pod runs several engines (label
//! `engine`): counts are summed, and KV usage is the mean over engines, since each engine has its
//! own KV pool of the same size and requests are spread across them.

use std::collections::BTreeMap;

/// Why an exposition could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ScrapeError {
    #[error("line {line}: {why}")]
    Syntax { line: usize, why: String },
    #[error("no vLLM metrics in the exposition (is this vLLM's /metrics?)")]
    NotVllm,
}

/// `vllm:cache_config_info`'s labels that matter here.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CacheConfig {
    pub block_size: u32,
    pub num_gpu_blocks: u64,
    pub enable_prefix_caching: bool,
    pub prefix_caching_hash_algo: Option<String>,
}

/// `vllm:lora_requests_info`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LoraInfo {
    pub max_lora: Option<u32>,
    pub running: Vec<String>,
    pub waiting: Vec<String>,
}

/// One scrape, summed over engines.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct EngineMetrics {
    pub running: f64,
    pub waiting: f64,
    /// 0 – 1, mean over engines.
    pub kv_usage: f64,
    /// Tokens looked up in the prefix cache.
    pub prefix_cache_queries: f64,
    /// Tokens found in the prefix cache.
    pub prefix_cache_hits: f64,
    pub preemptions: f64,
    pub prompt_tokens: f64,
    pub generation_tokens: f64,
    /// `vllm:request_success_total`, all finish reasons.
    pub requests_finished: f64,
    /// Sum and count of `vllm:time_to_first_token_seconds`.
    pub ttft_seconds_sum: f64,
    pub ttft_count: f64,
    /// Sum of `vllm:request_prefill_kv_computed_tokens` (tokens actually prefilled, 0.14+).
    pub prefill_computed_tokens_sum: Option<f64>,
    pub cache_config: Option<CacheConfig>,
    pub lora: Option<LoraInfo>,
    /// Number of distinct `engine` label values seen (data-parallel ranks).
    pub engines: usize,
    /// Metrics kvsight reads that this exposition lacks (by their current vLLM name): the value
    /// read for them is a default, so a missing one is a blind spot an operator must hear of.
    pub missing: Vec<&'static str>,
}

/// The metrics [`parse`] reads and every vLLM since 0.14 exports (older names accepted where
/// vLLM renamed them); the LoRA info exists only with LoRA on.
pub const EXPECTED: [&str; 11] = [
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:num_preemptions_total",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:request_success_total",
    "vllm:request_prefill_kv_computed_tokens_sum",
    "vllm:cache_config_info",
];

impl EngineMetrics {
    /// Whether a cumulative counter went back since `earlier`: counters only grow within one
    /// vLLM process, so this is a restarted engine (whose cache is empty), even one that came back
    /// between two health checks.
    pub fn restarted_since(&self, earlier: &EngineMetrics) -> bool {
        let back = |now: f64, then: f64| now < then;
        back(self.prompt_tokens, earlier.prompt_tokens)
            || back(self.generation_tokens, earlier.generation_tokens)
            || back(self.requests_finished, earlier.requests_finished)
            || back(self.prefix_cache_queries, earlier.prefix_cache_queries)
    }
}

/// One sample line.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample<'a> {
    pub name: &'a str,
    pub labels: BTreeMap<&'a str, String>,
    pub value: f64,
}

/// Parses the Prometheus text format (what vLLM serves), skipping comments.
pub fn samples(text: &str) -> Result<Vec<Sample<'_>>, ScrapeError> {
    let mut out = Vec::new();
    for (i, raw) in text.lines().enumerate() {
        let line = raw.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let err = |why: &str| ScrapeError::Syntax {
            line: i + 1,
            why: why.to_owned(),
        };
        let name_end = line
            .find(|c: char| c == '{' || c.is_whitespace())
            .ok_or_else(|| err("no value"))?;
        let name = &line[..name_end];
        if !is_name(name, true) {
            return Err(err("invalid metric name"));
        }
        let mut rest = &line[name_end..];
        let mut labels = BTreeMap::new();
        if let Some(body) = rest.strip_prefix('{') {
            let (parsed, after) = parse_labels(body).map_err(|w| err(&w))?;
            labels = parsed;
            rest = after;
        }
        let value_str = rest
            .split_whitespace()
            .next()
            .ok_or_else(|| err("no value"))?;
        let value = parse_value(value_str).ok_or_else(|| err("value is not a number"))?;
        out.push(Sample {
            name,
            labels,
            value,
        });
    }
    Ok(out)
}

fn parse_value(s: &str) -> Option<f64> {
    match s {
        "+Inf" | "Inf" => Some(f64::INFINITY),
        "-Inf" => Some(f64::NEG_INFINITY),
        "NaN" => Some(f64::NAN),
        _ => s.parse().ok(),
    }
}

/// Whether `s` is a metric name (`[a-zA-Z_:][a-zA-Z0-9_:]*`) or, without colons, a label name.
fn is_name(s: &str, colon: bool) -> bool {
    let ok = |c: char, first: bool| {
        c.is_ascii_alphabetic() || c == '_' || (colon && c == ':') || (!first && c.is_ascii_digit())
    };
    let mut chars = s.chars();
    chars.next().is_some_and(|c| ok(c, true)) && chars.all(|c| ok(c, false))
}

/// Parses `k="v",k2="v2"}` (whitespace around names, `=` and commas allowed, a trailing comma
/// too) and returns the rest of the line after `}`. Anything else between labels is an error:
/// read leniently, a stray character became part of the next label's name, which was then
/// silently missing (found by fuzzing).
fn parse_labels(mut s: &str) -> Result<(BTreeMap<&str, String>, &str), String> {
    let mut labels = BTreeMap::new();
    loop {
        s = s.trim_start();
        if let Some(rest) = s.strip_prefix('}') {
            return Ok((labels, rest));
        }
        let eq = s.find('=').ok_or("label without '='")?;
        let key = s[..eq].trim_end();
        if !is_name(key, false) {
            return Err(format!("invalid label name {key:?}"));
        }
        let after = s[eq + 1..]
            .trim_start()
            .strip_prefix('"')
            .ok_or("label value not quoted")?;
        let mut value = String::new();
        let mut chars = after.char_indices();
        let end = loop {
            match chars.next() {
                Some((i, '"')) => break i,
                Some((_, '\\')) => match chars.next() {
                    Some((_, 'n')) => value.push('\n'),
                    Some((_, c)) => value.push(c),
                    None => return Err("unterminated escape".into()),
                },
                Some((_, c)) => value.push(c),
                None => return Err("unterminated label value".into()),
            }
        };
        labels.insert(key, value);
        s = after[end + 1..].trim_start();
        if let Some(rest) = s.strip_prefix(',') {
            s = rest;
        } else if !s.starts_with('}') {
            return Err("expected ',' or '}' after a label".into());
        }
    }
}

/// Reads the metrics kvsight uses from a vLLM exposition.
pub fn parse(text: &str) -> Result<EngineMetrics, ScrapeError> {
    let all = samples(text)?;
    let mut m = EngineMetrics::default();
    let mut seen_vllm = false;
    let mut engines = std::collections::BTreeSet::new();
    let mut kv_new = Vec::new();
    let mut kv_old = Vec::new();
    let (mut q_new, mut q_old, mut h_new, mut h_old) = (None, None, None, None);
    let add = |slot: &mut Option<f64>, v: f64| *slot = Some(slot.unwrap_or(0.0) + v);
    let mut found = [false; EXPECTED.len()];
    // vLLM keeps one `lora_requests_info` series per label set it ever reported, each valued
    // with the time it was last set: the newest is the current one, wherever it stands.
    let mut lora_at = f64::NEG_INFINITY;
    for s in &all {
        let Some(metric) = s.name.strip_prefix("vllm:") else {
            continue;
        };
        seen_vllm = true;
        // A renamed metric counts under its current name.
        let current = match metric {
            "gpu_cache_usage_perc" => "kv_cache_usage_perc",
            "gpu_prefix_cache_queries_total" => "prefix_cache_queries_total",
            "gpu_prefix_cache_hits_total" => "prefix_cache_hits_total",
            m => m,
        };
        if let Some(i) = EXPECTED.iter().position(|e| e[5..] == *current) {
            found[i] = true;
        }
        if let Some(e) = s.labels.get("engine") {
            engines.insert(e.clone());
        }
        match metric {
            "num_requests_running" => m.running += s.value,
            "num_requests_waiting" => m.waiting += s.value,
            "kv_cache_usage_perc" => kv_new.push(s.value),
            "gpu_cache_usage_perc" => kv_old.push(s.value),
            "prefix_cache_queries_total" => add(&mut q_new, s.value),
            "gpu_prefix_cache_queries_total" => add(&mut q_old, s.value),
            "prefix_cache_hits_total" => add(&mut h_new, s.value),
            "gpu_prefix_cache_hits_total" => add(&mut h_old, s.value),
            "num_preemptions_total" => m.preemptions += s.value,
            "prompt_tokens_total" => m.prompt_tokens += s.value,
            "generation_tokens_total" => m.generation_tokens += s.value,
            "request_success_total" => m.requests_finished += s.value,
            "time_to_first_token_seconds_sum" => m.ttft_seconds_sum += s.value,
            "time_to_first_token_seconds_count" => m.ttft_count += s.value,
            "request_prefill_kv_computed_tokens_sum" => {
                add(&mut m.prefill_computed_tokens_sum, s.value)
            }
            "cache_config_info" => m.cache_config = cache_config(&s.labels),
            "lora_requests_info" if s.value >= lora_at => {
                lora_at = s.value;
                m.lora = Some(lora_info(&s.labels));
            }
            _ => {}
        }
    }
    if !seen_vllm {
        return Err(ScrapeError::NotVllm);
    }
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
    m.kv_usage = if !kv_new.is_empty() {
        mean(&kv_new)
    } else if !kv_old.is_empty() {
        mean(&kv_old)
    } else {
        0.0
    };
    m.prefix_cache_queries = q_new.or(q_old).unwrap_or(0.0);
    m.prefix_cache_hits = h_new.or(h_old).unwrap_or(0.0);
    m.engines = engines.len().max(1);
    m.missing = EXPECTED
        .iter()
        .zip(found)
        .filter(|(_, f)| !f)
        .map(|(e, _)| *e)
        .collect();
    Ok(m)
}

fn cache_config(labels: &BTreeMap<&str, String>) -> Option<CacheConfig> {
    Some(CacheConfig {
        block_size: labels.get("block_size")?.parse().ok()?,
        num_gpu_blocks: labels.get("num_gpu_blocks")?.parse().ok()?,
        // Python's str(bool); anything else (e.g. "None") means off.
        enable_prefix_caching: labels.get("enable_prefix_caching")? == "True",
        prefix_caching_hash_algo: labels
            .get("prefix_caching_hash_algo")
            .filter(|a| *a != "None")
            .cloned(),
    })
}

fn lora_info(labels: &BTreeMap<&str, String>) -> LoraInfo {
    let list = |k: &str| {
        labels
            .get(k)
            .map(|v| {
                v.split(',')
                    .map(str::trim)
                    .filter(|s| !s.is_empty())
                    .map(str::to_owned)
                    .collect()
            })
            .unwrap_or_default()
    };
    LoraInfo {
        max_lora: labels.get("max_lora").and_then(|v| v.parse().ok()),
        running: list("running_lora_adapters"),
        waiting: list("waiting_lora_adapters"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_counter_going_back_is_a_restart_and_growth_is_not() {
        let before = EngineMetrics {
            prompt_tokens: 5_000.0,
            generation_tokens: 700.0,
            requests_finished: 40.0,
            prefix_cache_queries: 5_000.0,
            running: 3.0,
            ..EngineMetrics::default()
        };
        let grown = EngineMetrics {
            prompt_tokens: 5_100.0,
            running: 0.0,
            ..before.clone()
        };
        assert!(!grown.restarted_since(&before));
        // Gauges may drop freely; only counters tell.
        assert!(!before.restarted_since(&before));
        let fresh = EngineMetrics {
            prompt_tokens: 16.0,
            generation_tokens: 1.0,
            requests_finished: 1.0,
            prefix_cache_queries: 16.0,
            ..EngineMetrics::default()
        };
        assert!(fresh.restarted_since(&before));
    }

    #[test]
    fn label_escapes_and_odd_spacing() {
        let s = samples("m{a=\"x\\\"y\\\\z\\n\", b = \"\"} 1e3 1700000000\n").unwrap();
        assert_eq!(s[0].labels["a"], "x\"y\\z\n");
        assert_eq!(s[0].labels["b"], "");
        assert_eq!(s[0].value, 1000.0);
    }

    #[test]
    fn syntax_errors_name_the_line() {
        assert_eq!(
            samples("# ok\nm{a=\"x} 1").unwrap_err(),
            ScrapeError::Syntax {
                line: 2,
                why: "unterminated label value".into()
            }
        );
        assert!(matches!(
            samples("m 1\nx abc").unwrap_err(),
            ScrapeError::Syntax { line: 2, .. }
        ));
    }
}
