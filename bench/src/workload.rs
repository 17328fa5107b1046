//! The six workloads: deterministic request streams, identical for every router.
//!
//! Each is shaped like a published benchmark and scaled by the cost model's `length_scale` (every
//! length) and by the counts given here. Prompts are built from the simulator's own text
//! generator and measured with the pods' own tokenizer, so a "1,500-token system prompt" is
//! 1,500 tokens on the pods. Arrivals are a Poisson process at the run's rate; everything random
//! is seeded, so two routers at one rate get byte-identical requests at identical offsets.

use std::fmt::Write as _;
use std::time::Duration;

use kvsight_sim::own_tokenizer::{SeededRng, guideline, paragraph, question};
use kvsight_tokenizer::ModelTokenizer;
use serde_json::{Value, json};

use crate::cost::CostModel;

/// The model name every pod serves.
pub const MODEL: &str = "bench-8b";

/// Which workload.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, clap::ValueEnum)]
#[clap(rename_all = "snake_case")]
pub enum Kind {
    /// The demo's batch: one 756-token preamble, short distinct questions.
    SharedPrefix,
    /// b2b-saas shaped: groups of users, each group with its own long system prompt.
    MultiTenant,
    /// Chat sessions whose history grows each turn (2–20 turns), interleaved.
    MultiTurn,
    /// inference-perf code-generation shaped: long shared tool prompts, many short turns.
    Agentic,
    /// No sharing at all: routing must not hurt.
    Unique,
    /// multi_tenant plus generations sent straight to one pod and a cold pod joining mid-run.
    MixedFaults,
    /// Eight tenants; after a calm phase one of them bursts at 5× its rate past the fleet's
    /// capacity while the others keep theirs (flow control's fair shares).
    NoisyNeighbor,
    /// Interactive and batch classes together past saturation (flow control's priorities).
    PriorityMix,
}

impl Kind {
    pub const ALL: [Kind; 6] = [
        Kind::SharedPrefix,
        Kind::MultiTenant,
        Kind::MultiTurn,
        Kind::Agentic,
        Kind::Unique,
        Kind::MixedFaults,
    ];

    /// The workloads that measure flow control (not in [`Self::ALL`]: they are run by name).
    pub const FLOW: [Kind; 2] = [Kind::NoisyNeighbor, Kind::PriorityMix];

    pub fn name(self) -> &'static str {
        match self {
            Kind::NoisyNeighbor => "noisy_neighbor",
            Kind::PriorityMix => "priority_mix",
            Kind::SharedPrefix => "shared_prefix",
            Kind::MultiTenant => "multi_tenant",
            Kind::MultiTurn => "multi_turn",
            Kind::Agentic => "agentic",
            Kind::Unique => "unique",
            Kind::MixedFaults => "mixed_faults",
        }
    }
}

/// One request of a run.
#[derive(Debug, Clone)]
pub struct Request {
    /// Offset of its arrival from the run's start.
    pub at: Duration,
    /// `/v1/completions` or `/v1/chat/completions`.
    pub path: &'static str,
    pub body: bytes::Bytes,
    /// Prompt tokens on the pods (their tokenizer, their chat template).
    pub prompt_tokens: u32,
    /// Who sends it: the tenant, the chat session or the agent's session (each request its own
    /// where nothing is shared). A gateway pinning clients to router replicas pins by this.
    pub key: u32,
    /// Headers the client sends with it (flow control's class and tenant).
    pub headers: Vec<(&'static str, String)>,
    /// The group its figures are reported in (`RunResult::groups`), if the workload has groups.
    pub group: Option<&'static str>,
}

/// One request body before arrival times are drawn.
#[derive(Debug, Clone)]
struct Body {
    path: &'static str,
    body: bytes::Bytes,
    prompt_tokens: u32,
    key: u32,
    headers: Vec<(&'static str, String)>,
    /// Its group, for workloads whose bodies are their groups' (priority_mix).
    group: Option<&'static str>,
}

impl Body {
    /// This body sent `at` into the run.
    fn request_at(&self, at: Duration) -> Request {
        Request {
            at,
            path: self.path,
            body: self.body.clone(),
            prompt_tokens: self.prompt_tokens,
            key: self.key,
            headers: self.headers.clone(),
            group: self.group,
        }
    }
}

/// noisy_neighbor's shape: tenants, the noisy one's share of the calm rate, the burst.
pub mod noisy {
    /// Tenants, the first of them noisy.
    pub const TENANTS: usize = 8;
    /// The noisy tenant's share of the calm rate; the seven others share the rest evenly.
    pub const NOISY_SHARE: f64 = 0.3;
    /// How many times its calm rate the noisy tenant sends during the burst.
    pub const BURST: f64 = 5.0;
    /// Simulated seconds of the calm phase, then of the burst.
    pub const CALM_S: f64 = 4.0;
    pub const BURST_S: f64 = 4.0;
}

/// The headers flow control reads.
pub const PRIORITY_HEADER: &str = "x-kvsight-priority";
pub const TENANT_HEADER: &str = "x-kvsight-tenant";

/// A workload at one rate: its requests, and what the cluster must look like for it.
#[derive(Debug, Clone)]
pub struct Plan {
    pub kind: Kind,
    pub rate: f64,
    pub requests: Vec<Request>,
}

/// A workload's shape at this bench's scale, before a rate is chosen.
#[derive(Debug, Clone)]
pub struct Workload {
    pub kind: Kind,
    /// Requests per run.
    pub count: usize,
    /// KV blocks per pod: the workload's shared prompts overflow one pod, fit the cluster.
    pub num_gpu_blocks: u32,
    /// Arrival rates (requests per simulated second), through and past saturation.
    pub rates: Vec<f64>,
    /// Distinct shared prompts (groups, agents, sessions) and their total tokens.
    pub shared_prompts: usize,
    pub shared_tokens: u64,
    /// The request bodies in arrival order (arrival times come with the rate).
    bodies: Vec<Body>,
}

/// Counts the tokens a completion prompt has on the pods.
fn completion_tokens(tok: &ModelTokenizer, text: &str) -> u32 {
    tok.encode_completion(text)
        .map_or(0, |ids| ids.len() as u32)
}

/// Text of at least `tokens` tokens from `rng`, whole paragraphs.
fn text_of(tok: &ModelTokenizer, rng: &mut SeededRng, tokens: u32, lead: &str) -> String {
    let mut s = String::from(lead);
    // Estimate first (about 4 characters a token here), then top up.
    while completion_tokens(tok, &s) < tokens {
        s.push_str(&paragraph(rng));
        s.push('\n');
    }
    s
}

/// A system prompt of at least `tokens` tokens: a role line and numbered guidelines.
fn system_prompt(tok: &ModelTokenizer, rng: &mut SeededRng, tokens: u32, who: &str) -> String {
    let mut s = format!("You are the assistant of {who}. Follow these guidelines:\n");
    let mut i = 1;
    loop {
        for _ in 0..8 {
            let _ = writeln!(s, "{i}. {}", guideline(rng));
            i += 1;
        }
        if completion_tokens(tok, &s) >= tokens {
            return s;
        }
    }
}

fn completion(prompt: &str, max_tokens: u32) -> Value {
    json!({
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": true,
        "stream": true,
        "stream_options": {"include_usage": true},
    })
}

fn chat(messages: &[(&str, &str)], max_tokens: u32) -> Value {
    let messages: Vec<Value> = messages
        .iter()
        .map(|(role, content)| json!({"role": role, "content": content}))
        .collect();
    json!({
        "model": MODEL,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": true,
        "stream": true,
        "stream_options": {"include_usage": true},
    })
}

/// A multi-tenant load's shape when not the published one (unscaled token lengths, scaled by
/// the cost model).
#[derive(Debug, Clone, Copy, Default, clap::Args)]
pub struct TenantShape {
    #[arg(long)]
    pub tenants: Option<usize>,
    #[arg(long)]
    pub system_tokens: Option<u32>,
    #[arg(long)]
    pub question_tokens: Option<u32>,
    #[arg(long)]
    pub output_tokens: Option<u32>,
}

/// Apps sending priority_mix's interactive requests.
const PRIORITY_APPS: usize = 4;

/// A streamed completion body.
fn completion_body(tok: &ModelTokenizer, prompt: &str, max_tokens: u32, key: usize) -> Body {
    Body {
        path: "/v1/completions",
        body: bytes::Bytes::from(completion(prompt, max_tokens).to_string()),
        prompt_tokens: completion_tokens(tok, prompt),
        key: key as u32,
        headers: Vec::new(),
        group: None,
    }
}

/// noisy_neighbor's bodies: multi_tenant's requests (system prompt, question, answer) for
/// [`noisy::TENANTS`] tenants, each tenant's in order (the noisy one four times as many), keyed
/// by tenant and naming it in a header; the plan draws the arrivals. Also the system prompts'
/// tokens.
fn noisy_bodies(
    tok: &ModelTokenizer,
    rng: &mut SeededRng,
    cost: &CostModel,
    per_tenant: usize,
) -> (Vec<Body>, u64) {
    let systems: Vec<String> = (0..noisy::TENANTS)
        .map(|g| system_prompt(tok, rng, cost.tokens(6000), &format!("tenant {g}")))
        .collect();
    let mut bodies = Vec::new();
    for (g, system) in systems.iter().enumerate() {
        let n = if g == 0 { 4 * per_tenant } else { per_tenant };
        for _ in 0..n {
            let lead = format!("User of tenant {g} asks: {}\n", question(rng));
            let q = text_of(tok, rng, cost.tokens(1200), &lead);
            let mut b = completion_body(tok, &format!("{system}\n{q}"), cost.tokens(1000), g);
            b.headers = vec![(TENANT_HEADER, format!("tenant-{g}"))];
            bodies.push(b);
        }
    }
    (bodies, prompts_tokens(tok, &systems))
}

/// priority_mix's bodies: half interactive ([`PRIORITY_APPS`] apps' 1,500-token system
/// prompts, short questions and answers), half batch (2,000-token documents summarised at
/// length), interleaved, each naming its class and tenant. Also the system prompts' tokens.
fn priority_bodies(
    tok: &ModelTokenizer,
    rng: &mut SeededRng,
    cost: &CostModel,
    count: usize,
) -> (Vec<Body>, u64) {
    let systems: Vec<String> = (0..PRIORITY_APPS)
        .map(|a| system_prompt(tok, rng, cost.tokens(6000), &format!("app {a}")))
        .collect();
    let mut bodies = Vec::with_capacity(count);
    for n in 0..count {
        let b = if rng.below(2) == 0 {
            let a = rng.below(PRIORITY_APPS);
            let lead = format!("A user of app {a} asks: {}\n", question(rng));
            let q = text_of(tok, rng, cost.tokens(400), &lead);
            let prompt = format!("{}\n{q}", systems[a]);
            let mut b = completion_body(tok, &prompt, cost.tokens(400), a);
            b.headers = vec![
                (PRIORITY_HEADER, "interactive".to_owned()),
                (TENANT_HEADER, format!("app-{a}")),
            ];
            b.group = Some("interactive");
            b
        } else {
            let p = text_of(tok, rng, cost.tokens(2000), &format!("Document {n}.\n"));
            let mut b = completion_body(tok, &p, cost.tokens(1000), PRIORITY_APPS + n);
            b.headers = vec![
                (PRIORITY_HEADER, "batch".to_owned()),
                (TENANT_HEADER, "batch".to_owned()),
            ];
            b.group = Some("batch");
            b
        };
        bodies.push(b);
    }
    (bodies, prompts_tokens(tok, &systems))
}

/// The tokens of `prompts` together, each as a completion prompt on the pods.
fn prompts_tokens(tok: &ModelTokenizer, prompts: &[String]) -> u64 {
    prompts
        .iter()
        .map(|s| u64::from(completion_tokens(tok, s)))
        .sum()
}

/// A chat request of `msgs` (role, content), keyed by `key`.
fn chat_body(tok: &ModelTokenizer, msgs: &[(&str, &str)], max_tokens: u32, key: usize) -> Body {
    let chat_msgs: Vec<_> = msgs
        .iter()
        .map(|(r, c)| kvsight_tokenizer::ChatMessage::new(*r, *c))
        .collect();
    let prompt_tokens = tok
        .encode_chat(&chat_msgs, true, &Default::default())
        .map_or(0, |ids| ids.len() as u32);
    Body {
        path: "/v1/chat/completions",
        body: bytes::Bytes::from(chat(msgs, max_tokens).to_string()),
        prompt_tokens,
        key: key as u32,
        headers: Vec::new(),
        group: None,
    }
}

/// A chat's messages: the system prompt, the (user, answer) turns so far, the user's new turn.
fn conversation<'a>(
    system: &'a str,
    history: &'a [(String, String)],
    user: &'a str,
) -> Vec<(&'a str, &'a str)> {
    let mut msgs = vec![("system", system)];
    for (u, a) in history {
        msgs.push(("user", u.as_str()));
        msgs.push(("assistant", a.as_str()));
    }
    msgs.push(("user", user));
    msgs
}

/// One workload's requests and what they share, before the cache is sized for them.
struct Generated {
    bodies: Vec<Body>,
    count: usize,
    shared_prompts: usize,
    shared_tokens: u64,
    rates: Vec<f64>,
}

/// Builds the request bodies, in order, and sizes the cache; `pods` is the cluster size;
/// `count` replaces the workload's requests per run.
pub fn build(
    kind: Kind,
    cost: &CostModel,
    tok: &ModelTokenizer,
    pods: usize,
    quick: bool,
    shape: TenantShape,
    count_override: Option<usize>,
) -> Workload {
    let mut rng = SeededRng::new(0x6265_6e63_6800 + kind as u64);
    let rng = &mut rng;
    // Requests per run: the full run (every router, every workload) must fit in 30 minutes on a
    // 2-core machine. At 300 per workload (360 for multi_tenant) it took 33 min 22 s; below
    // saturation every router is level, so counts were cut where a run is long for the little it
    // tells: unique (its low rate costs the most wall time) to 200, the others to 240–300.
    let count = |quick_count: usize, full: usize| {
        count_override.unwrap_or(if quick { quick_count } else { full })
    };
    let g = match kind {
        Kind::SharedPrefix => shared_prefix(tok, cost, count(200, 240)),
        Kind::MultiTenant | Kind::MixedFaults => {
            multi_tenant(tok, rng, cost, pods, shape, count(300, 300), kind)
        }
        Kind::MultiTurn => multi_turn(tok, rng, cost, count(200, 240)),
        Kind::Agentic => agentic(tok, rng, cost, pods, count(200, 240)),
        Kind::NoisyNeighbor => {
            let (bodies, shared) = noisy_bodies(tok, rng, cost, count(48, 96));
            Generated {
                count: bodies.len(),
                bodies,
                shared_prompts: noisy::TENANTS,
                shared_tokens: shared,
                // The calm rate: the burst adds (BURST - 1) × 0.3 of it, 2.2× in all.
                rates: vec![48.0],
            }
        }
        Kind::PriorityMix => {
            let count = count(240, 480);
            let (bodies, shared) = priority_bodies(tok, rng, cost, count);
            Generated {
                bodies,
                count,
                shared_prompts: PRIORITY_APPS,
                shared_tokens: shared,
                // Past saturation: the interactive half alone is within the fleet's capacity.
                rates: vec![192.0],
            }
        }
        Kind::Unique => unique(tok, rng, cost, count(200, 200)),
    };
    Workload {
        kind,
        count: g.count,
        num_gpu_blocks: gpu_blocks(cost, &g),
        rates: g.rates,
        shared_prompts: g.shared_prompts,
        shared_tokens: g.shared_tokens,
        bodies: g.bodies,
    }
}

/// KV blocks per pod: the shared prompts overflow one pod's cache (it holds half of them) and
/// fit the cluster's several times over; at least room for a few of the longest requests.
fn gpu_blocks(cost: &CostModel, g: &Generated) -> u32 {
    let bs = u64::from(cost.block_size);
    let longest = g
        .bodies
        .iter()
        .map(|b| u64::from(b.prompt_tokens))
        .max()
        .unwrap_or(1);
    let per_pod_tokens = (g.shared_tokens / 2).max(8 * longest);
    u32::try_from(per_pod_tokens.div_ceil(bs) + 1).unwrap_or(u32::MAX)
}

/// The demo's: 40 guidelines (≈ 756 tokens), then "Question n: name one factor."
fn shared_prefix(tok: &ModelTokenizer, cost: &CostModel, count: usize) -> Generated {
    let preamble = kvsight_sim::own_tokenizer::guidelines_preamble(40, 7);
    let bodies = (0..count)
        .map(|n| {
            let p = format!("{preamble}Question {n}: name one factor.");
            completion_body(tok, &p, cost.tokens(128), n)
        })
        .collect();
    Generated {
        bodies,
        count,
        shared_prompts: 1,
        shared_tokens: u64::from(completion_tokens(tok, &preamble)),
        rates: vec![64.0, 128.0, 192.0],
    }
}

/// b2b-saas: 150 groups × 5 users, 6k system prompt, 1.2k question, 1k output. Counts scaled
/// to 4 groups per pod; `shape` overrides them.
fn multi_tenant(
    tok: &ModelTokenizer,
    rng: &mut SeededRng,
    cost: &CostModel,
    pods: usize,
    shape: TenantShape,
    count: usize,
    kind: Kind,
) -> Generated {
    let groups = shape.tenants.unwrap_or(4 * pods);
    let system = cost.tokens(shape.system_tokens.unwrap_or(6000));
    let systems: Vec<String> = (0..groups)
        .map(|g| system_prompt(tok, rng, system, &format!("tenant {g}")))
        .collect();
    let mut bodies = Vec::with_capacity(count);
    for _ in 0..count {
        let g = rng.below(groups);
        let user = rng.below(5);
        let lead = format!("User {user} of tenant {g} asks: {}\n", question(rng));
        let q = text_of(
            tok,
            rng,
            cost.tokens(shape.question_tokens.unwrap_or(1200)),
            &lead,
        );
        bodies.push(completion_body(
            tok,
            &format!("{}\n{q}", systems[g]),
            cost.tokens(shape.output_tokens.unwrap_or(1000)),
            g,
        ));
    }
    Generated {
        bodies,
        count,
        shared_prompts: groups,
        shared_tokens: prompts_tokens(tok, &systems),
        // mixed_faults at the knee and past it: below saturation multi_tenant already shows
        // the routers level, and each mixed_faults run lasts as long as its slowest request
        // stuck behind the bypassing load (up to a minute), so a third rate would cost four
        // minutes of the full run's thirty.
        rates: if kind == Kind::MixedFaults {
            vec![64.0, 96.0]
        } else {
            vec![32.0, 64.0, 96.0]
        },
    }
}

/// ShareGPT-like sessions of 2–20 turns: a short shared system prompt, user turns of ≈ 200
/// tokens, answers of ≈ 400, 16 sessions interleaved at a time.
fn multi_turn(
    tok: &ModelTokenizer,
    rng: &mut SeededRng,
    cost: &CostModel,
    count: usize,
) -> Generated {
    let system = system_prompt(tok, rng, cost.tokens(400), "a support desk");
    // (history of (user, answer) turns, turns in all, session id)
    type Session = (Vec<(String, String)>, usize, usize);
    let mut sessions: Vec<Session> = Vec::new();
    let mut bodies: Vec<Body> = Vec::with_capacity(count);
    let mut total_sessions = 0;
    let mut shared = 0u64;
    while bodies.len() < count {
        while sessions.len() < 16 {
            let turns = 2 + rng.below(19);
            sessions.push((Vec::new(), turns, total_sessions));
            total_sessions += 1;
        }
        // A random live session takes the next turn: users do not take turns in order
        // (and a rotation would line sessions up with a round-robin router's pods).
        let idx = rng.below(sessions.len());
        let (history, _, session) = &mut sessions[idx];
        let lead = format!("{}\n", question(rng));
        let user = text_of(tok, rng, cost.tokens(200), &lead);
        let msgs = conversation(&system, history, &user);
        let b = chat_body(tok, &msgs, cost.tokens(400), *session);
        shared = shared.max(u64::from(b.prompt_tokens));
        bodies.push(b);
        let answer = text_of(tok, rng, cost.tokens(400), "");
        history.push((user, answer));
        if history.len() >= sessions[idx].1 {
            sessions.swap_remove(idx);
        }
    }
    Generated {
        bodies,
        count,
        shared_prompts: total_sessions,
        // Sessions alive at once hold their histories: 16 of up to 20 turns.
        shared_tokens: shared * 16 / 2,
        rates: vec![32.0, 64.0, 96.0],
    }
}

/// inference-perf code generation: agents with 3k–30k-token tool prompts, sessions of many
/// short turns (≈ 100-token instructions, ≈ 200-token answers).
fn agentic(
    tok: &ModelTokenizer,
    rng: &mut SeededRng,
    cost: &CostModel,
    pods: usize,
    count: usize,
) -> Generated {
    let agents = 2 * pods;
    let tools: Vec<String> = (0..agents)
        .map(|a| {
            let len = 3000 + (27_000 * a / agents.max(2).saturating_sub(1)) as u32;
            system_prompt(tok, rng, cost.tokens(len), &format!("coding agent {a}"))
        })
        .collect();
    // 3 sessions per agent at a time, each growing turn by turn, up to 12 turns.
    let mut histories: Vec<Vec<(String, String)>> = vec![Vec::new(); agents * 3];
    let mut bodies = Vec::with_capacity(count);
    for _ in 0..count {
        let s = rng.below(histories.len());
        let a = s / 3;
        if histories[s].len() >= 12 {
            histories[s].clear();
        }
        let lead = format!("Task: {}\n", question(rng));
        let user = text_of(tok, rng, cost.tokens(100), &lead);
        let msgs = conversation(&tools[a], &histories[s], &user);
        bodies.push(chat_body(tok, &msgs, cost.tokens(200), s));
        let answer = text_of(tok, rng, cost.tokens(200), "");
        histories[s].push((user, answer));
    }
    Generated {
        bodies,
        count,
        shared_prompts: agents,
        shared_tokens: prompts_tokens(tok, &tools),
        rates: vec![32.0, 64.0, 96.0],
    }
}

/// 2,000-token documents with nothing in common: routing must not hurt.
fn unique(tok: &ModelTokenizer, rng: &mut SeededRng, cost: &CostModel, count: usize) -> Generated {
    let mut bodies = Vec::with_capacity(count);
    for n in 0..count {
        let p = text_of(tok, rng, cost.tokens(2000), &format!("Document {n}.\n"));
        bodies.push(completion_body(tok, &p, cost.tokens(400), n));
    }
    Generated {
        bodies,
        count,
        shared_prompts: 0,
        shared_tokens: 0,
        rates: vec![24.0, 48.0, 72.0],
    }
}

impl Workload {
    /// The run at `rate` (simulated requests per second): Poisson arrivals, seeded by the
    /// workload and the rate, in wall-clock time.
    pub fn plan(&self, rate: f64, time_scale: f64) -> Plan {
        if self.kind == Kind::NoisyNeighbor {
            return self.noisy_plan(rate, time_scale);
        }
        let mut rng = SeededRng::new(0x6172_7269_7665 ^ rate.to_bits());
        let mut t = 0.0f64;
        let requests = self
            .bodies
            .iter()
            .map(|b| {
                // Exponential gaps: −ln(U) / rate, U uniform in (0, 1].
                let u = (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
                t += -(1.0 - u).ln() / rate;
                b.request_at(Duration::from_secs_f64(t * time_scale))
            })
            .collect();
        Plan {
            kind: self.kind,
            rate,
            requests,
        }
    }

    /// noisy_neighbor at calm rate `rate`: each tenant a Poisson process of its own — the noisy
    /// tenant at [`noisy::NOISY_SHARE`] of `rate` in the calm phase and [`noisy::BURST`] times
    /// that in the burst, every quiet tenant at its even share of the rest throughout. Groups:
    /// `quiet_calm`, `noisy_calm`, `quiet` (quiet tenants during the burst), `noisy`.
    fn noisy_plan(&self, rate: f64, time_scale: f64) -> Plan {
        let mut rng = SeededRng::new(0x6e6f_6973_7900 ^ rate.to_bits());
        let by_tenant: Vec<Vec<&Body>> = (0..noisy::TENANTS)
            .map(|g| self.bodies.iter().filter(|b| b.key as usize == g).collect())
            .collect();
        let quiet_rate = rate * (1.0 - noisy::NOISY_SHARE) / (noisy::TENANTS - 1) as f64;
        let mut arrivals: Vec<(f64, usize, &'static str)> = Vec::new();
        for g in 0..noisy::TENANTS {
            let phases = [
                (
                    0.0,
                    noisy::CALM_S,
                    if g == 0 { "noisy_calm" } else { "quiet_calm" },
                ),
                (
                    noisy::CALM_S,
                    noisy::CALM_S + noisy::BURST_S,
                    if g == 0 { "noisy" } else { "quiet" },
                ),
            ];
            for (i, (from, to, group)) in phases.into_iter().enumerate() {
                let r = match (g, i) {
                    (0, 0) => rate * noisy::NOISY_SHARE,
                    (0, _) => rate * noisy::NOISY_SHARE * noisy::BURST,
                    _ => quiet_rate,
                };
                let mut t = from;
                loop {
                    let u = (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
                    t += -(1.0 - u).ln() / r;
                    if t >= to {
                        break;
                    }
                    arrivals.push((t, g, group));
                }
            }
        }
        arrivals.sort_by(|a, b| a.0.total_cmp(&b.0));
        let mut next = [0usize; noisy::TENANTS];
        let requests = arrivals
            .into_iter()
            .map(|(t, g, group)| {
                let list = &by_tenant[g];
                let b = list[next[g] % list.len()];
                next[g] += 1;
                Request {
                    group: Some(group),
                    ..b.request_at(Duration::from_secs_f64(t * time_scale))
                }
            })
            .collect();
        Plan {
            kind: self.kind,
            rate,
            requests,
        }
    }
}
