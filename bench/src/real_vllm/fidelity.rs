//! The differential: identical request traces sent to a real vLLM engine and to `vllm-sim` of the
//! same shape (block size, a pool small enough to evict and preempt, `max_num_seqs`, the token
//! budget, prefix caching, the same tokenizer and chat template), compared request by request
//! and KV event by KV event.
//!
//! - The serial trace (one request at a time, `max_tokens` 1 so every cached block holds prompt
//!   tokens only) must agree exactly: each request's `cached_tokens`, the prefix-cache counters
//!   and the whole KV-event sequence, compared as canonical block hashes (the engines' own hashes
//!   differ by design).
//! - The concurrent trace (a closed loop of several clients, long enough outputs to run out of
//!   blocks) must agree on the hit rate within 0.02 and on preemptions within 20 %; the
//!   running/waiting gauges sampled over time are printed side by side.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use kvsight_protocol::hash::{ChainSeed, block_hash};
use kvsight_sim::own_tokenizer::{SeededRng, guidelines_preamble, paragraph, question};
use serde_json::{Value, json};

use super::{Engine, EngineShape, Options, Subscriber, engine_exposition, post};

/// The engine shape both sides run with: 47 usable blocks of 32 tokens (1 504 token slots), so
/// the serial trace's working set overflows the cache and the concurrent trace's eight clients
/// outgrow it.
pub const SHAPE: EngineShape = EngineShape {
    block_size: 32,
    num_gpu_blocks: Some(48),
    max_num_seqs: 8,
    max_num_batched_tokens: Some(512),
    max_model_len: 1024,
};

/// Clients in flight during the concurrent trace.
pub const CLIENTS: usize = 8;
/// Requests of the concurrent trace.
const CONCURRENT_REQUESTS: usize = 480;

/// What the differential measured.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct Fidelity {
    pub serial_requests: usize,
    pub serial_cached_tokens_equal: bool,
    pub serial_events_equal: bool,
    /// Requests whose cached tokens agreed.
    pub serial_cached_agree: usize,
    pub serial_cached_tokens_vllm: u64,
    pub serial_cached_tokens_sim: u64,
    /// Per-block events (stored + removed) each side published.
    pub serial_events_vllm: usize,
    pub serial_events_sim: usize,
    /// Of vLLM's per-block events, the evictions (`BlockRemoved`).
    pub serial_evictions_vllm: usize,
    pub serial_first_event_difference: Option<String>,
    pub serial_first_cached_difference: Option<String>,
    /// `vllm:prefix_cache_queries` and `_hits` over the serial trace, (vLLM, sim).
    pub serial_queries: (f64, f64),
    pub serial_hits: (f64, f64),
    pub concurrent_requests: usize,
    pub hit_rate_sim: f64,
    pub hit_rate_vllm: f64,
    pub preemptions_sim: f64,
    pub preemptions_vllm: f64,
    pub concurrent_queries: (f64, f64),
    pub concurrent_hits: (f64, f64),
    pub gauges_vllm: Gauges,
    pub gauges_sim: Gauges,
    /// Seconds each side took for the concurrent trace.
    pub concurrent_seconds: (f64, f64),
    /// Concurrent requests whose `cached_tokens` agreed (which request waits or is preempted
    /// depends on timing, so this is a figure, not a verdict).
    pub concurrent_cached_agree: usize,
    /// Blocks stored and evicted during the concurrent trace, (vLLM, sim), and the stored
    /// blocks both sides have in common by canonical hash, as multisets (blocks filled by
    /// generated tokens differ: each engine generates its own).
    pub concurrent_stored: (usize, usize),
    pub concurrent_evicted: (usize, usize),
    pub concurrent_stored_common: usize,
    /// Whether every request's prompt tokenized to the same length on both sides.
    pub prompt_tokens_equal: bool,
}

impl Fidelity {
    /// The concurrent verdicts of the done-when: hit rate within 0.02, preemptions within 20 %
    /// of vLLM's (and some preemption at all, or the trace did not test it).
    pub fn hit_rate_ok(&self) -> bool {
        (self.hit_rate_sim - self.hit_rate_vllm).abs() <= 0.02
    }

    pub fn preemptions_ok(&self) -> bool {
        self.preemptions_vllm > 0.0
            && (self.preemptions_sim - self.preemptions_vllm).abs() <= 0.2 * self.preemptions_vllm
    }
}

/// Running/waiting sampled over the concurrent trace.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct Gauges {
    pub samples: usize,
    pub mean_running: f64,
    pub mean_waiting: f64,
    pub max_waiting: f64,
    /// Share of samples with a request waiting.
    pub waiting_share: f64,
}

/// One request of a trace: the endpoint and the body without `model`.
#[derive(Debug, Clone)]
struct TraceReq {
    label: String,
    chat: bool,
    body: Value,
}

/// One engine's answer: (prompt tokens, cached tokens).
type Usage = (u64, u64);

/// Runs both traces on a real engine and a simulated one; `model_dir` holds the tiny model and
/// its tokenizer.
pub async fn run(
    opts: &Options,
    http: &reqwest::Client,
    name: &str,
    model_dir: &Path,
    logs: &Path,
) -> Result<Fidelity> {
    let mut engine = Engine::new(90)?;
    engine.start(opts, name, model_dir, logs, &SHAPE, None)?;
    let sim = start_sim(name, model_dir)?;
    let t = Instant::now();
    engine.wait_healthy(http).await?;
    println!(
        "real-vllm: fidelity: the engine answers /health after {:.0} s",
        t.elapsed().as_secs_f64()
    );
    let sim_url = sim.base_url();
    let (sim_pub, sim_replay) = (
        sim.kv_endpoint()
            .context("sim without KV events")?
            .to_owned(),
        sim.replay_endpoint()
            .context("sim without replay")?
            .to_owned(),
    );
    // Both subscribers import vLLM (tens of seconds each): started side by side.
    let (kv, replay) = (
        format!("tcp://127.0.0.1:{}", engine.kv_port),
        format!("tcp://127.0.0.1:{}", engine.replay_port),
    );
    let (a, b) = tokio::join!(
        Subscriber::start(opts, &kv, &replay),
        Subscriber::start(opts, &sim_pub, &sim_replay)
    );
    let (mut sub_vllm, mut sub_sim) = (a?, b?);
    let vllm_url = engine.url();
    let result = compare(http, name, &vllm_url, &sim_url, &mut sub_vllm, &mut sub_sim).await;
    sub_vllm.stop().await;
    sub_sim.stop().await;
    if let Some(p) = engine.proc.take() {
        p.stop(Duration::from_secs(10)).await;
    }
    sim.shutdown(Duration::from_secs(1)).await;
    result
}

async fn compare(
    http: &reqwest::Client,
    name: &str,
    vllm: &str,
    sim: &str,
    sub_vllm: &mut Subscriber,
    sub_sim: &mut Subscriber,
) -> Result<Fidelity> {
    let mut f = Fidelity::default();
    // Anything published before the trace (nothing is expected) is not part of it.
    sub_vllm.events().await?;
    sub_sim.events().await?;

    let serial = serial_trace();
    f.serial_requests = serial.len();
    let before = (counters(http, vllm).await?, counters(http, sim).await?);
    let (a, b) = tokio::join!(
        send_serial(http, vllm, name, &serial),
        send_serial(http, sim, name, &serial)
    );
    let (uv, us) = (a?, b?);
    let after = (counters(http, vllm).await?, counters(http, sim).await?);
    f.serial_queries = (after.0.0 - before.0.0, after.1.0 - before.1.0);
    f.serial_hits = (after.0.1 - before.0.1, after.1.1 - before.1.1);
    f.prompt_tokens_equal = uv.iter().zip(&us).all(|(a, b)| a.0 == b.0);
    for (i, (v, s)) in uv.iter().zip(&us).enumerate() {
        f.serial_cached_tokens_vllm += v.1;
        f.serial_cached_tokens_sim += s.1;
        if v == s {
            f.serial_cached_agree += 1;
        } else if f.serial_first_cached_difference.is_none() {
            f.serial_first_cached_difference = Some(format!(
                "request {i} ({}): vLLM (prompt, cached) {v:?}, sim {s:?}",
                serial[i].label
            ));
        }
    }
    f.serial_cached_tokens_equal = f.serial_cached_agree == serial.len();
    let serial_log = (
        settled_events(sub_vllm).await?,
        settled_events(sub_sim).await?,
    );
    let ev = (
        canonical(&serial_log.0, SHAPE.block_size).context("vLLM's events")?,
        canonical(&serial_log.1, SHAPE.block_size).context("the simulator's events")?,
    );
    f.serial_events_vllm = ev.0.len();
    f.serial_events_sim = ev.1.len();
    f.serial_evictions_vllm =
        ev.0.iter()
            .filter(|e| matches!(e, BlockEvent::Removed(_)))
            .count();
    f.serial_events_equal = ev.0 == ev.1;
    if !f.serial_events_equal {
        let i =
            ev.0.iter()
                .zip(&ev.1)
                .position(|(a, b)| a != b)
                .unwrap_or(ev.0.len().min(ev.1.len()));
        let window = |v: &[BlockEvent]| -> String {
            v.iter()
                .skip(i.saturating_sub(2))
                .take(6)
                .map(|e| e.to_string())
                .collect::<Vec<_>>()
                .join(" ")
        };
        f.serial_first_event_difference = Some(format!(
            "at block event {i} of {}/{}: vLLM … {} …; sim … {} …",
            ev.0.len(),
            ev.1.len(),
            window(&ev.0),
            window(&ev.1)
        ));
    }

    // Concurrent: both engines get the same trace at once (the simulator costs no CPU to speak
    // of), the gauges sampled on both until both are done.
    let trace = concurrent_trace();
    f.concurrent_requests = trace.len();
    let before = (counters(http, vllm).await?, counters(http, sim).await?);
    let (done_v, done_s) = (
        Arc::new(AtomicBool::new(false)),
        Arc::new(AtomicBool::new(false)),
    );
    let sampler_v = tokio::spawn(sample_gauges(http.clone(), vllm.to_owned(), done_v.clone()));
    let sampler_s = tokio::spawn(sample_gauges(http.clone(), sim.to_owned(), done_s.clone()));
    // Each side's gauges are sampled while its own trace runs.
    let (a, b) = tokio::join!(
        async {
            let r = send_concurrent(http, vllm, name, &trace).await;
            done_v.store(true, Ordering::SeqCst);
            r
        },
        async {
            let r = send_concurrent(http, sim, name, &trace).await;
            done_s.store(true, Ordering::SeqCst);
            r
        }
    );
    let (gv, gs) = (sampler_v.await?, sampler_s.await?);
    let ((uv, tv), (us, ts)) = (a?, b?);
    let after = (counters(http, vllm).await?, counters(http, sim).await?);
    f.concurrent_cached_agree = uv.iter().zip(&us).filter(|(a, b)| a == b).count();
    let ev = (
        canonical_from(&serial_log.0, &settled_events(sub_vllm).await?)
            .context("vLLM's concurrent events")?,
        canonical_from(&serial_log.1, &settled_events(sub_sim).await?)
            .context("the simulator's concurrent events")?,
    );
    let count = |v: &[BlockEvent], stored: bool| {
        v.iter()
            .filter(|e| matches!(e, BlockEvent::Stored(_)) == stored)
            .count()
    };
    f.concurrent_stored = (count(&ev.0, true), count(&ev.1, true));
    f.concurrent_evicted = (count(&ev.0, false), count(&ev.1, false));
    let mut theirs: HashMap<u64, usize> = HashMap::new();
    for e in &ev.1 {
        if let BlockEvent::Stored(h) = e {
            *theirs.entry(*h).or_default() += 1;
        }
    }
    for e in &ev.0 {
        if let BlockEvent::Stored(h) = e
            && let Some(n) = theirs.get_mut(h)
            && *n > 0
        {
            *n -= 1;
            f.concurrent_stored_common += 1;
        }
    }
    f.concurrent_seconds = (tv, ts);
    f.gauges_vllm = gv;
    f.gauges_sim = gs;
    f.prompt_tokens_equal &= uv.iter().zip(&us).all(|(a, b)| a.0 == b.0);
    let rate = |u: &[Usage]| {
        let (p, c) = u.iter().fold((0, 0), |acc, x| (acc.0 + x.0, acc.1 + x.1));
        c as f64 / p.max(1) as f64
    };
    f.hit_rate_vllm = rate(&uv);
    f.hit_rate_sim = rate(&us);
    f.preemptions_vllm = after.0.2 - before.0.2;
    f.preemptions_sim = after.1.2 - before.1.2;
    f.concurrent_queries = (after.0.0 - before.0.0, after.1.0 - before.1.0);
    f.concurrent_hits = (after.0.1 - before.0.1, after.1.1 - before.1.1);
    Ok(f)
}

/// The simulated pod: the differential's shape, the model's tokenizer files, vLLM 0.32's
/// defaults (reused blocks are not announced again: `kv_cache_report_mode` is "incremental").
fn start_sim(name: &str, model_dir: &Path) -> Result<kvsight_sim::server::SimPodHandle> {
    use kvsight_sim::engine::{CostModel, EngineConfig};
    use kvsight_sim::server::{SimConfig, SimPod, TokenizerFiles};
    let engine = EngineConfig::builder()
        .block_size(SHAPE.block_size as usize)
        .num_gpu_blocks(SHAPE.num_gpu_blocks.unwrap_or(4096) as usize)
        .max_num_seqs(SHAPE.max_num_seqs as usize)
        .max_num_batched_tokens(SHAPE.max_num_batched_tokens.unwrap_or(2048) as usize)
        .max_model_len(SHAPE.max_model_len as usize)
        .emit_reused_stores(false)
        .cost(CostModel {
            // About what the tiny model's steps take on one CPU core (a few milliseconds), so
            // that requests arrive between steps as often on both sides.
            prefill_tokens_per_s: 200_000.0,
            decode_base: Duration::from_micros(2_000),
            decode_per_seq: Duration::from_micros(100),
            decode_per_kv_token: Duration::ZERO,
            compile_stall: Duration::ZERO,
        })
        .build()?;
    let config = SimConfig {
        engine,
        served_model_names: vec![name.to_owned()],
        kv_events: Some(kvsight_sim::kv_events::PublisherConfig::loopback("")),
        enable_prompt_tokens_details: true,
        tokenizer: Some(TokenizerFiles::from_dir(model_dir)?),
        tokenizer_dialect: kvsight_tokenizer::Dialect::Transformers5,
        ..SimConfig::default()
    };
    // SimPod::start runs the pod on its own thread and runtime; block_in_place keeps this
    // runtime's worker free meanwhile.
    let handle = tokio::task::block_in_place(|| {
        tokio::runtime::Handle::current().block_on(SimPod::start(config))
    })?;
    Ok(handle)
}

/// (`prefix_cache_queries`, `prefix_cache_hits`, `num_preemptions`) of an engine.
async fn counters(http: &reqwest::Client, url: &str) -> Result<(f64, f64, f64)> {
    let text = engine_exposition(http, url).await?;
    let samples = kvsight_sidecar::scrape::samples(&text)?;
    let sum = |n: &str| {
        samples
            .iter()
            .filter(|s| s.name == n)
            .map(|s| s.value)
            .sum::<f64>()
    };
    Ok((
        sum("vllm:prefix_cache_queries_total"),
        sum("vllm:prefix_cache_hits_total"),
        sum("vllm:num_preemptions_total"),
    ))
}

async fn send_one(http: &reqwest::Client, url: &str, name: &str, r: &TraceReq) -> Result<Usage> {
    let mut body = r.body.clone();
    body["model"] = json!(name);
    let path = if r.chat {
        "/v1/chat/completions"
    } else {
        "/v1/completions"
    };
    let (v, _) = post(http, &format!("{url}{path}"), &body)
        .await
        .with_context(|| format!("{} on {url}", r.label))?;
    let usage = &v["usage"];
    Ok((
        usage["prompt_tokens"]
            .as_u64()
            .context("no prompt_tokens")?,
        usage["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap_or(0),
    ))
}

async fn send_serial(
    http: &reqwest::Client,
    url: &str,
    name: &str,
    trace: &[TraceReq],
) -> Result<Vec<Usage>> {
    let mut out = Vec::with_capacity(trace.len());
    for r in trace {
        out.push(send_one(http, url, name, r).await?);
    }
    Ok(out)
}

/// A closed loop of [`CLIENTS`] clients taking the trace's requests in order; the usages in
/// trace order and the seconds it took.
async fn send_concurrent(
    http: &reqwest::Client,
    url: &str,
    name: &str,
    trace: &[TraceReq],
) -> Result<(Vec<Usage>, f64)> {
    let t = Instant::now();
    let trace = Arc::new(trace.to_vec());
    let next = Arc::new(AtomicUsize::new(0));
    let results = Arc::new(std::sync::Mutex::new(vec![None; trace.len()]));
    let mut tasks = Vec::new();
    for _ in 0..CLIENTS {
        let (http, url, name) = (http.clone(), url.to_owned(), name.to_owned());
        let (trace, next, results) = (trace.clone(), next.clone(), results.clone());
        tasks.push(tokio::spawn(async move {
            loop {
                let i = next.fetch_add(1, Ordering::SeqCst);
                let Some(r) = trace.get(i) else {
                    return Ok::<(), anyhow::Error>(());
                };
                let u = send_one(&http, &url, &name, r).await?;
                results.lock().expect("results lock")[i] = Some(u);
            }
        }));
    }
    for t in tasks {
        t.await??;
    }
    let results = results.lock().expect("results lock").clone();
    let usages = results
        .into_iter()
        .map(|u| u.context("a request was not answered"))
        .collect::<Result<Vec<_>>>()?;
    Ok((usages, t.elapsed().as_secs_f64()))
}

/// Samples `vllm:num_requests_running` and `_waiting` every 100 ms until `done`.
async fn sample_gauges(http: reqwest::Client, url: String, done: Arc<AtomicBool>) -> Gauges {
    let mut g = Gauges::default();
    let (mut running, mut waiting, mut waiting_samples) = (0.0, 0.0, 0usize);
    // Bounded: the concurrent trace is given at most this long.
    let deadline = Instant::now() + Duration::from_secs(900);
    while !done.load(Ordering::SeqCst) && Instant::now() < deadline {
        if let Ok(text) = engine_exposition(&http, &url).await
            && let Ok(samples) = kvsight_sidecar::scrape::samples(&text)
        {
            let get = |n: &str| {
                samples
                    .iter()
                    .filter(|s| s.name == n)
                    .map(|s| s.value)
                    .sum::<f64>()
            };
            let (r, w) = (
                get("vllm:num_requests_running"),
                get("vllm:num_requests_waiting"),
            );
            g.samples += 1;
            running += r;
            waiting += w;
            g.max_waiting = g.max_waiting.max(w);
            waiting_samples += usize::from(w > 0.0);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let n = g.samples.max(1) as f64;
    g.mean_running = running / n;
    g.mean_waiting = waiting / n;
    g.waiting_share = waiting_samples as f64 / n;
    g
}

/// Every event the subscriber decodes, read once the stream has been quiet for three polls.
async fn settled_events(sub: &mut Subscriber) -> Result<Vec<Value>> {
    let mut all = Vec::new();
    let mut quiet = 0;
    for _ in 0..100 {
        let batch = sub.events().await?;
        if batch.is_empty() {
            quiet += 1;
            if quiet == 3 {
                return Ok(all);
            }
        } else {
            quiet = 0;
            all.extend(batch);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    bail!("the KV-event stream never went quiet")
}

/// The canonical events of `later`, whose parents may have been stored in `earlier`.
fn canonical_from(earlier: &[Value], later: &[Value]) -> Result<Vec<BlockEvent>> {
    let all: Vec<Value> = earlier.iter().chain(later).cloned().collect();
    let mut events = canonical(&all, SHAPE.block_size)?;
    let skip = canonical(earlier, SHAPE.block_size)?.len();
    Ok(events.split_off(skip))
}

/// One block's event in canonical terms.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum BlockEvent {
    Stored(u64),
    Removed(u64),
    Cleared,
}

impl std::fmt::Display for BlockEvent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            BlockEvent::Stored(h) => write!(f, "+{:04x}", h >> 48),
            BlockEvent::Removed(h) => write!(f, "-{:04x}", h >> 48),
            BlockEvent::Cleared => write!(f, "clear"),
        }
    }
}

/// The events as one per block, each engine hash replaced by the canonical hash of the block's
/// chain (recomputed from the token ids and the parent, as the sidecar does).
fn canonical(events: &[Value], block_size: u32) -> Result<Vec<BlockEvent>> {
    let bs = block_size as usize;
    let mut canon: HashMap<String, u64> = HashMap::new();
    let mut out = Vec::new();
    for ev in events {
        if let Some(stored) = ev["stored"].as_array() {
            let lora = ev["lora_name"].as_str();
            let mut prev = match ev["parent"].as_str() {
                None => ChainSeed {
                    lora,
                    cache_salt: None,
                }
                .root(),
                Some(p) => *canon
                    .get(p)
                    .with_context(|| format!("a stored block's parent {p} was never stored"))?,
            };
            let tokens: Vec<u32> = ev["tokens"]
                .as_array()
                .context("no tokens")?
                .iter()
                .map(|t| t.as_u64().map(|t| t as u32).context("token id"))
                .collect::<Result<_>>()?;
            if tokens.len() != stored.len() * bs {
                bail!(
                    "{} tokens for {} blocks of {bs}",
                    tokens.len(),
                    stored.len()
                );
            }
            for (h, chunk) in stored.iter().zip(tokens.chunks_exact(bs)) {
                prev = block_hash(prev, chunk);
                canon.insert(h.as_str().context("hash")?.to_owned(), prev);
                out.push(BlockEvent::Stored(prev));
            }
        } else if let Some(removed) = ev["removed"].as_array() {
            for h in removed {
                let h = h.as_str().context("hash")?;
                let c = canon
                    .get(h)
                    .with_context(|| format!("removed block {h} was never stored"))?;
                out.push(BlockEvent::Removed(*c));
            }
        } else if ev["cleared"] == true {
            canon.clear();
            out.push(BlockEvent::Cleared);
        }
    }
    Ok(out)
}

fn completion(label: String, prompt: String, max_tokens: u32) -> TraceReq {
    TraceReq {
        label,
        chat: false,
        body: json!({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                     "ignore_eos": true}),
    }
}

fn chat(label: String, messages: &[Value], max_tokens: u32) -> TraceReq {
    TraceReq {
        label,
        chat: true,
        body: json!({"messages": messages, "max_tokens": max_tokens, "temperature": 0.0,
                     "ignore_eos": true}),
    }
}

/// A multi-turn chat's request bodies: each turn resends the conversation so far.
fn chat_turns(label: &str, seed: u64, turns: usize, max_tokens: u32) -> Vec<TraceReq> {
    let mut rng = SeededRng::new(seed);
    let mut messages = vec![
        json!({"role": "system", "content": format!("You are assistant {label}. Keep answers short.")}),
    ];
    let mut out = Vec::new();
    for turn in 0..turns {
        messages.push(json!({"role": "user", "content": paragraph(&mut rng)}));
        out.push(chat(format!("{label} turn {turn}"), &messages, max_tokens));
        messages.push(json!({"role": "assistant", "content": question(&mut rng)}));
    }
    out
}

/// The serial trace: three shared preambles asked in turn, two chats growing turn by turn,
/// unique documents in between, and the early prompts again once the working set has
/// overflowed the cache, so LRU eviction decides which of them still hit. `max_tokens` 1: only
/// prompt blocks are ever cached, so both sides store the same token ids.
fn serial_trace() -> Vec<TraceReq> {
    let mut rng = SeededRng::new(33);
    let preambles: Vec<String> = (0..3).map(|p| guidelines_preamble(12, 500 + p)).collect();
    let questions: Vec<String> = (0..4).map(|_| question(&mut rng)).collect();
    let chats = [chat_turns("A", 1, 4, 1), chat_turns("B", 2, 4, 1)];
    let mut out = Vec::new();
    for q in 0..2 {
        for (p, pre) in preambles.iter().enumerate() {
            out.push(completion(
                format!("preamble {p} question {q}"),
                format!("{pre}{}", questions[q]),
                1,
            ));
        }
        out.extend(chats[0][2 * q..2 * q + 2].iter().cloned());
        out.push(completion(
            format!("unique {q}"),
            format!("Document {q}. {}", paragraph(&mut rng)),
            1,
        ));
    }
    for n in 2..8 {
        out.push(completion(
            format!("unique {n}"),
            format!(
                "Document {n}. {} {}",
                paragraph(&mut rng),
                paragraph(&mut rng)
            ),
            1,
        ));
        if n % 2 == 0 {
            out.push(chats[1][n / 2 - 1].clone());
        }
    }
    for q in 2..4 {
        for (p, pre) in preambles.iter().enumerate() {
            out.push(completion(
                format!("preamble {p} question {q}"),
                format!("{pre}{}", questions[q]),
                1,
            ));
        }
        out.extend(chats[0][q..q + 1].iter().cloned());
    }
    out.push(chats[1][3].clone());
    out
}

/// The concurrent trace: shared preambles (four tenants), chats, and unique prompts in a fixed
/// interleaving, each with 24-96 output tokens so running requests outgrow the pool.
fn concurrent_trace() -> Vec<TraceReq> {
    let mut rng = SeededRng::new(77);
    let preambles: Vec<String> = (0..4).map(|p| guidelines_preamble(8, 900 + p)).collect();
    let mut chats: Vec<std::vec::IntoIter<TraceReq>> = (0..8)
        .map(|c| {
            let mut r = SeededRng::new(1000 + c);
            let max = 24 + 8 * r.below(9) as u32;
            chat_turns(&format!("C{c}"), 2000 + c, 6, max).into_iter()
        })
        .collect();
    let mut out = Vec::with_capacity(CONCURRENT_REQUESTS);
    let mut n = 0;
    while out.len() < CONCURRENT_REQUESTS {
        let max_tokens = 24 + 8 * rng.below(10) as u32;
        match rng.below(10) {
            0..=4 => {
                let p = rng.below(preambles.len());
                out.push(completion(
                    format!("tenant {p} #{n}"),
                    format!("{}{}", preambles[p], question(&mut rng)),
                    max_tokens,
                ));
            }
            5..=7 => {
                let c = rng.below(chats.len());
                match chats[c].next() {
                    Some(r) => out.push(r),
                    None => continue,
                }
            }
            _ => out.push(completion(
                format!("unique #{n}"),
                format!("Note {n}. {}", paragraph(&mut rng)),
                max_tokens,
            )),
        }
        n += 1;
    }
    out
}

/// Writes the figures as JSON (`target/real-vllm/fidelity.json`) and as the markdown page.
pub fn write(f: &Fidelity, json_path: &Path, doc: Option<&PathBuf>, version: &str) -> Result<()> {
    if let Some(dir) = json_path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::write(json_path, serde_json::to_string_pretty(f)? + "\n")?;
    let Some(doc) = doc else {
        return Ok(());
    };
    let yes = |b: bool| if b { "yes" } else { "**no**" };
    let g = |g: &Gauges| {
        format!(
            "{:.2} | {:.2} | {:.0} | {:.2} | {}",
            g.mean_running, g.mean_waiting, g.max_waiting, g.waiting_share, g.samples
        )
    };
    let text = format!(
        "# Simulator fidelity: vllm-sim against a real vLLM\n\n\
         Written by `cargo xtask real-vllm` (the differential step of `kvsight-bench real-vllm`);\n\
         the same figures are in `target/real-vllm/fidelity.json`. What the simulator models and\n\
         what it does not: `sim/README.md`.\n\n\
         Both engines: vLLM {version} (CPU build) with a tiny random-weight Llama around the\n\
         project's own tokenizer, and `vllm-sim` with the same tokenizer files; block size {bs},\n\
         `--num-gpu-blocks-override {blocks}` ({usable} usable blocks), `--max-num-seqs {seqs}`,\n\
         `--max-num-batched-tokens {budget}`, `--max-model-len {len}`, prefix caching on.\n\n\
         ## Serial trace (exact agreement required)\n\n\
         {sr} requests one at a time (`max_tokens` 1): three shared preambles asked in turn, two\n\
         multi-turn chats, unique documents, and the early prompts again after the working set\n\
         overflowed the cache.\n\n\
         | figure | vLLM | vllm-sim | equal |\n|---|---|---|---|\n\
         | requests whose `cached_tokens` agree | {sa} of {sr} | | {ce} |\n\
         | cached prompt tokens in all | {cv} | {cs} | |\n\
         | KV events (per block, canonical hash, in order) | {ev} ({evict} evictions) | {es} | {ee} |\n\
         | `vllm:prefix_cache_queries` | {qv} | {qs} | {qe} |\n\
         | `vllm:prefix_cache_hits` | {hv} | {hs} | {he} |\n\n\
         {fd}\
         ## Concurrent trace\n\n\
         {cr} requests, {clients} clients in a closed loop, 24-96 output tokens each (`ignore_eos`):\n\
         four shared preambles, eight six-turn chats, unique notes. Both engines got the trace\n\
         at the same time.\n\n\
         | figure | vLLM | vllm-sim | verdict |\n|---|---|---|---|\n\
         | hit rate (Σ cached / Σ prompt tokens) | {rv:.4} | {rs:.4} | {rok} (within 0.02) |\n\
         | `vllm:num_preemptions` | {pv} | {ps} | {pok} (within 20 %) |\n\
         | `vllm:prefix_cache_queries` | {cqv} | {cqs} | |\n\
         | `vllm:prefix_cache_hits` | {chv} | {chs} | |\n\
         | requests whose `cached_tokens` agree | {ca} of {cr} | | |\n\
         | blocks stored (in common by canonical hash) | {stv} ({stc}) | {sts} ({stc}) | |\n\
         | blocks evicted | {evv} | {evs} | |\n\
         | seconds | {tv:.1} | {ts:.1} | |\n\n\
         Blocks filled by generated tokens hold each engine's own tokens, so only prompt blocks\n\
         can be in common; which request waits or is preempted depends on timing, so the\n\
         per-request and per-block figures of this trace are not verdicts.\n\n\
         Running and waiting, sampled every 100 ms:\n\n\
         | engine | mean running | mean waiting | max waiting | share of samples waiting | samples |\n\
         |---|---|---|---|---|---|\n\
         | vLLM | {gv} |\n| vllm-sim | {gs} |\n",
        bs = SHAPE.block_size,
        blocks = SHAPE.num_gpu_blocks.unwrap_or(0),
        usable = SHAPE.num_gpu_blocks.unwrap_or(1) - 1,
        seqs = SHAPE.max_num_seqs,
        budget = SHAPE.max_num_batched_tokens.unwrap_or(0),
        len = SHAPE.max_model_len,
        sr = f.serial_requests,
        sa = f.serial_cached_agree,
        ce = yes(f.serial_cached_tokens_equal),
        cv = f.serial_cached_tokens_vllm,
        cs = f.serial_cached_tokens_sim,
        ev = f.serial_events_vllm,
        evict = f.serial_evictions_vllm,
        es = f.serial_events_sim,
        ee = yes(f.serial_events_equal),
        qv = f.serial_queries.0,
        qs = f.serial_queries.1,
        qe = yes(f.serial_queries.0 == f.serial_queries.1),
        hv = f.serial_hits.0,
        hs = f.serial_hits.1,
        he = yes(f.serial_hits.0 == f.serial_hits.1),
        fd = match (
            &f.serial_first_cached_difference,
            &f.serial_first_event_difference
        ) {
            (None, None) => String::new(),
            (a, b) => format!(
                "First differences: {}; {}.\n\n",
                a.as_deref().unwrap_or("cached tokens none"),
                b.as_deref().unwrap_or("events none")
            ),
        },
        cr = f.concurrent_requests,
        clients = CLIENTS,
        rv = f.hit_rate_vllm,
        rs = f.hit_rate_sim,
        rok = yes(f.hit_rate_ok()),
        pv = f.preemptions_vllm,
        ps = f.preemptions_sim,
        pok = yes(f.preemptions_ok()),
        cqv = f.concurrent_queries.0,
        cqs = f.concurrent_queries.1,
        chv = f.concurrent_hits.0,
        chs = f.concurrent_hits.1,
        ca = f.concurrent_cached_agree,
        stv = f.concurrent_stored.0,
        sts = f.concurrent_stored.1,
        stc = f.concurrent_stored_common,
        evv = f.concurrent_evicted.0,
        evs = f.concurrent_evicted.1,
        tv = f.concurrent_seconds.0,
        ts = f.concurrent_seconds.1,
        gv = g(&f.gauges_vllm),
        gs = g(&f.gauges_sim),
    );
    std::fs::write(doc, text)?;
    Ok(())
}
