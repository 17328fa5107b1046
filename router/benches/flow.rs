//! Flow control's own cost per request: classifying it (headers, rules, an API key's hash) and
//! one pass through the queue (join, then leave as the next in order) while the queue holds
//! 1,000 requests of 64 tenants in three priority bands, the shape of a saturated replica.
//! Besides criterion's means, prints the p50 and p99 of 20,000 single join-and-leave turns.
//!
//! `cargo bench -p kvsight-router --bench flow`

use std::hint::black_box;
use std::time::{Duration, Instant};

use axum::http::{HeaderMap, HeaderValue};
use criterion::{Criterion, criterion_group, criterion_main};
use kvsight_router::config::RouterConfig;
use kvsight_router::flow::classify;
use kvsight_router::flow::queue::{Join, Queue};
use tokio::time::Instant as TokioInstant;

const QUEUED: usize = 1000;
const TENANTS: usize = 64;

fn join(i: usize, now: TokioInstant) -> Join<u64> {
    Join {
        lane: "m".into(),
        priority: (i % 3) as i32,
        tenant: format!("tenant-{}", i % TENANTS),
        cost: 500 + (i % 7) as u64 * 100,
        bytes: 4096,
        deadline: now + Duration::from_secs(30 + (i % 11) as u64),
        payload: i as u64,
    }
}

/// A queue of `QUEUED` entries.
fn full_queue(now: TokioInstant) -> Queue<u64> {
    let mut q = Queue::default();
    for i in 0..QUEUED {
        q.push(join(i, now), now);
    }
    q
}

/// One request's turn: it joins, and the entry next in order leaves.
fn turn(q: &mut Queue<u64>, i: usize, now: TokioInstant) {
    let j = join(i, now);
    black_box(q.tokens_ahead(&j));
    q.push(j, now);
    let id = q.peek("m").expect("not empty").id;
    black_box(q.dispatch(id, now));
}

fn bench(c: &mut Criterion) {
    let now = TokioInstant::now();
    let mut q = full_queue(now);
    let mut i = QUEUED;
    c.bench_function("flow_queue_join_and_leave_1000_queued", |b| {
        b.iter(|| {
            turn(&mut q, i, now);
            i += 1;
        })
    });
    let mut q = full_queue(now);
    let mut times = Vec::with_capacity(20_000);
    for k in 0..20_000 {
        let t = Instant::now();
        turn(&mut q, QUEUED + k, now);
        times.push(t.elapsed());
    }
    times.sort();
    println!(
        "flow_queue_join_and_leave_1000_queued: p50 {:?} p99 {:?} over {} turns",
        times[times.len() / 2],
        times[times.len() * 99 / 100],
        times.len()
    );

    let cfg = RouterConfig::from_yaml(
        "flowControl:\n  enabled: true\n  rules:\n    - {model: a, class: batch}\n    - {model: b, tenant: etl}\n    - {model: bench-8b, class: interactive}\n",
    )
    .unwrap()
    .flow_control;
    let mut headers = HeaderMap::new();
    headers.insert(
        "authorization",
        HeaderValue::from_static("Bearer sk-0123456789abcdef0123456789abcdef"),
    );
    headers.insert("content-type", HeaderValue::from_static("application/json"));
    c.bench_function("flow_classify_rule_and_api_key", |b| {
        b.iter(|| black_box(classify(&cfg, black_box("bench-8b"), &headers)))
    });
}

criterion_group!(benches, bench);
criterion_main!(benches);
