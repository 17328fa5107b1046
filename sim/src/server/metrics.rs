//! vLLM 0.33's Prometheus exposition, rendered from the engine's counters and the driver's
//! timings. Names, HELP texts, types, label sets, bucket bounds, `_created` lines and number
//! formatting follow what `prometheus_client` prints for vLLM (see
//! `fixtures/vllm/metrics-0.33.txt`), because the sidecar parses this text exactly as it parses
//! a real pod's.

use std::fmt::Write as _;
use std::time::Duration;

use super::SimConfig;
use crate::engine::EngineStats;

const TTFT_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];
const E2E_BUCKETS: &[f64] = &[
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
];
const FINISH_REASONS: [&str; 5] = ["stop", "length", "abort", "error", "repetition"];

#[derive(Debug, Clone)]
struct Histogram {
    bounds: Vec<f64>,
    counts: Vec<u64>,
    count: u64,
    sum: f64,
}

impl Histogram {
    fn new(bounds: Vec<f64>) -> Self {
        Self {
            counts: vec![0; bounds.len()],
            bounds,
            count: 0,
            sum: 0.0,
        }
    }

    fn observe(&mut self, v: f64) {
        for (bound, count) in self.bounds.iter().zip(&mut self.counts) {
            if v <= *bound {
                *count += 1;
            }
        }
        self.count += 1;
        self.sum += v;
    }
}

/// vLLM's `build_1_2_5_buckets(max_model_len)`: 1, 2, 5, 10, 20, 50, ... up to the limit.
fn buckets_1_2_5(max: usize) -> Vec<f64> {
    let mut out = Vec::new();
    let mut exp = 1u64;
    'outer: loop {
        for m in [1u64, 2, 5] {
            let v = m.saturating_mul(exp);
            if v > max as u64 {
                break 'outer;
            }
            out.push(v as f64);
        }
        exp = exp.saturating_mul(10);
    }
    out
}

/// The pod's metric state. Counters only grow; gauges are replaced by the driver after every
/// change.
#[derive(Debug)]
pub(crate) struct Metrics {
    model_name: String,
    block_size: usize,
    num_gpu_blocks: usize,
    enable_prefix_caching: bool,
    lora: Option<usize>,
    created: f64,
    stats: EngineStats,
    lora_running: Vec<String>,
    lora_waiting: Vec<String>,
    success: [u64; 5],
    ttft: Histogram,
    e2e: Histogram,
    prefill_computed: Histogram,
}

impl Metrics {
    pub(crate) fn new(config: &SimConfig, created: f64) -> Self {
        Self {
            model_name: config.model_name().to_owned(),
            block_size: config.engine.block_size,
            num_gpu_blocks: config.engine.num_gpu_blocks,
            enable_prefix_caching: config.engine.enable_prefix_caching,
            lora: (!config.lora_modules.is_empty()).then_some(config.max_loras),
            created,
            stats: EngineStats::default(),
            lora_running: Vec::new(),
            lora_waiting: Vec::new(),
            success: [0; 5],
            ttft: Histogram::new(TTFT_BUCKETS.to_vec()),
            e2e: Histogram::new(E2E_BUCKETS.to_vec()),
            prefill_computed: Histogram::new(buckets_1_2_5(config.engine.max_model_len)),
        }
    }

    pub(crate) fn update(
        &mut self,
        stats: EngineStats,
        running: Vec<String>,
        waiting: Vec<String>,
    ) {
        self.stats = stats;
        self.lora_running = running;
        self.lora_waiting = waiting;
    }

    pub(crate) fn first_token(&mut self, ttft: Duration, computed_prompt_tokens: usize) {
        self.ttft.observe(ttft.as_secs_f64());
        self.prefill_computed.observe(computed_prompt_tokens as f64);
    }

    pub(crate) fn e2e(&mut self, latency: Duration) {
        self.e2e.observe(latency.as_secs_f64());
    }

    pub(crate) fn finished(&mut self, reason: &str) {
        if let Some(i) = FINISH_REASONS.iter().position(|r| *r == reason) {
            self.success[i] += 1;
        }
    }

    /// The exposition text, as `GET /metrics` returns it.
    pub(crate) fn render(&self) -> String {
        let mut out = String::with_capacity(16 * 1024);
        self.render_load(&mut out);
        self.render_success(&mut out);
        self.render_latencies(&mut out);
        self.render_info(&mut out);
        out
    }

    /// The queue and KV gauges and the token and prefix-cache counters.
    fn render_load(&self, out: &mut String) {
        let base = format!("engine=\"0\",model_name=\"{}\"", escape(&self.model_name));
        let s = &self.stats;
        let gauge = |out: &mut String, name: &str, help: &str, v: f64| {
            header(out, name, help, "gauge");
            let _ = writeln!(out, "{name}{{{base}}} {}", fmt(v));
        };
        gauge(
            out,
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            s.running as f64,
        );
        gauge(
            out,
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            s.waiting as f64,
        );
        gauge(
            out,
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.",
            s.kv_cache_usage,
        );
        let counters = [
            (
                "vllm:prefix_cache_queries",
                "Prefix cache queries, in terms of number of queried tokens.",
                s.prefix_cache_queries,
            ),
            (
                "vllm:prefix_cache_hits",
                "Prefix cache hits, in terms of number of cached tokens.",
                s.prefix_cache_hits,
            ),
            (
                "vllm:num_preemptions",
                "Cumulative number of preemption from the engine.",
                s.num_preemptions,
            ),
            (
                "vllm:prompt_tokens",
                "Number of prefill tokens processed.",
                s.prompt_tokens,
            ),
            (
                "vllm:generation_tokens",
                "Number of generation tokens processed.",
                s.generation_tokens,
            ),
        ];
        for (name, help, v) in counters {
            header(out, &format!("{name}_total"), help, "counter");
            let _ = writeln!(out, "{name}_total{{{base}}} {}", fmt(v as f64));
            header(out, &format!("{name}_created"), help, "gauge");
            let _ = writeln!(out, "{name}_created{{{base}}} {}", fmt(self.created));
        }
    }

    /// Requests finished, by reason.
    fn render_success(&self, out: &mut String) {
        let help = "Count of successfully processed requests.";
        header(out, "vllm:request_success_total", help, "counter");
        for (reason, n) in FINISH_REASONS.iter().zip(self.success) {
            let _ = writeln!(
                out,
                "vllm:request_success_total{{engine=\"0\",finished_reason=\"{reason}\",model_name=\"{}\"}} {}",
                escape(&self.model_name),
                fmt(n as f64)
            );
        }
        header(out, "vllm:request_success_created", help, "gauge");
        for reason in FINISH_REASONS {
            let _ = writeln!(
                out,
                "vllm:request_success_created{{engine=\"0\",finished_reason=\"{reason}\",model_name=\"{}\"}} {}",
                escape(&self.model_name),
                fmt(self.created)
            );
        }
    }

    /// The time-to-first-token, end-to-end and prefill-computed histograms.
    fn render_latencies(&self, out: &mut String) {
        self.histogram(
            out,
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            &self.ttft,
        );
        self.histogram(
            out,
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            &self.e2e,
        );
        self.histogram(
            out,
            "vllm:request_prefill_kv_computed_tokens",
            "Histogram of new KV tokens computed during prefill (excluding cached tokens).",
            &self.prefill_computed,
        );
    }

    /// The cache configuration and, with LoRA, the adapters running and waiting.
    fn render_info(&self, out: &mut String) {
        header(
            out,
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            "gauge",
        );
        let _ = writeln!(
            out,
            "vllm:cache_config_info{{block_size=\"{}\",cache_dtype=\"auto\",enable_prefix_caching=\"{}\",engine=\"0\",gpu_memory_utilization=\"0.9\",num_cpu_blocks=\"None\",num_gpu_blocks=\"{}\",prefix_caching_hash_algo=\"sha256\"}} 1.0",
            self.block_size,
            if self.enable_prefix_caching {
                "True"
            } else {
                "False"
            },
            self.num_gpu_blocks
        );
        if let Some(max_lora) = self.lora {
            header(
                out,
                "vllm:lora_requests_info",
                "Running stats on lora requests.",
                "gauge",
            );
            let _ = writeln!(
                out,
                "vllm:lora_requests_info{{max_lora=\"{max_lora}\",running_lora_adapters=\"{}\",waiting_lora_adapters=\"{}\"}} {}",
                escape(&self.lora_running.join(",")),
                escape(&self.lora_waiting.join(",")),
                fmt(super::driver::wall_clock())
            );
        }
    }

    fn histogram(&self, out: &mut String, name: &str, help: &str, h: &Histogram) {
        let model = escape(&self.model_name);
        header(out, name, help, "histogram");
        for (bound, count) in h.bounds.iter().zip(&h.counts) {
            let _ = writeln!(
                out,
                "{name}_bucket{{engine=\"0\",le=\"{}\",model_name=\"{model}\"}} {}",
                fmt(*bound),
                fmt(*count as f64)
            );
        }
        let _ = writeln!(
            out,
            "{name}_bucket{{engine=\"0\",le=\"+Inf\",model_name=\"{model}\"}} {}",
            fmt(h.count as f64)
        );
        let _ = writeln!(
            out,
            "{name}_count{{engine=\"0\",model_name=\"{model}\"}} {}",
            fmt(h.count as f64)
        );
        let _ = writeln!(
            out,
            "{name}_sum{{engine=\"0\",model_name=\"{model}\"}} {}",
            fmt(h.sum)
        );
        header(out, &format!("{name}_created"), help, "gauge");
        let _ = writeln!(
            out,
            "{name}_created{{engine=\"0\",model_name=\"{model}\"}} {}",
            fmt(self.created)
        );
    }
}

fn header(out: &mut String, name: &str, help: &str, kind: &str) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
}

fn escape(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// `prometheus_client`'s `floatToGoString`: Python's `repr(float)`, switched to an exponent
/// sooner for large values, like Go's formatting.
pub(crate) fn fmt(v: f64) -> String {
    if v == f64::INFINITY {
        return "+Inf".to_owned();
    }
    if v == f64::NEG_INFINITY {
        return "-Inf".to_owned();
    }
    if v.is_nan() {
        return "NaN".to_owned();
    }
    let s = python_repr(v);
    if v > 0.0
        && let Some(dot) = s.find('.')
        && dot > 6
        && !s.contains('e')
    {
        let digits = format!("{}{}", &s[1..dot], &s[dot + 1..]);
        let mantissa = format!("{}.{}", &s[..1], digits);
        let mantissa = mantissa.trim_end_matches(['0', '.']);
        return format!("{mantissa}e+0{}", dot - 1);
    }
    s
}

/// Python's `repr(float)` for the values metrics take: shortest round-trip digits, `.0` on
/// integers, exponent form from 1e16 up and below 1e-4.
fn python_repr(v: f64) -> String {
    let a = v.abs();
    if a != 0.0 && !(1e-4..1e16).contains(&a) {
        // Rust's `{:e}` gives `1.5e-5`; Python writes `1.5e-05`.
        let s = format!("{v:e}");
        if let Some((m, e)) = s.split_once('e') {
            let (sign, digits) = e.strip_prefix('-').map_or(("+", e), |d| ("-", d));
            return format!("{m}e{sign}{digits:0>2}");
        }
        return s;
    }
    let s = format!("{v:?}");
    if s.contains('.') || s.contains('e') {
        s
    } else {
        format!("{s}.0")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn floats_format_like_prometheus_client() {
        assert_eq!(fmt(3.0), "3.0");
        assert_eq!(fmt(0.0421), "0.0421");
        assert_eq!(fmt(1.7959356628872044e9), "1.7959356628872044e+09");
        assert_eq!(fmt(1.7e9), "1.7e+09");
        assert_eq!(fmt(2560.0), "2560.0");
        assert_eq!(fmt(0.001), "0.001");
        assert_eq!(fmt(f64::INFINITY), "+Inf");
    }

    #[test]
    fn buckets_follow_1_2_5_up_to_the_context() {
        assert_eq!(
            buckets_1_2_5(8192),
            vec![
                1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0, 5000.0
            ]
        );
    }
}
