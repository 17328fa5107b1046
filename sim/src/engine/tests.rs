//! Behaviour tests of the engine against vLLM's semantics: prefix-cache hit accounting, chain
//! separation by LoRA and salt, LRU eviction and its events, scheduling limits, preemption, the
//! cost model, reset and determinism, plus a property test over random workloads.

use std::collections::{BTreeMap, HashSet};
use std::time::Duration;

use proptest::prelude::*;

use super::*;

const MAX_STEPS: usize = 100_000;

fn base() -> EngineConfigBuilder {
    EngineConfig::builder()
        .compile_stall(Duration::ZERO)
        .max_model_len(1024)
        .num_gpu_blocks(512)
}

fn engine(builder: EngineConfigBuilder) -> Engine {
    Engine::new(builder.build().expect("valid config")).expect("engine")
}

/// Tokens `start..start+len`: distinct prompts share no block unless asked to.
fn prompt(start: u32, len: usize) -> Vec<u32> {
    (start..start + len as u32).collect()
}

/// Steps until idle (bounded), returning every step's output.
fn drain(engine: &mut Engine) -> Vec<StepOutput> {
    let mut steps = Vec::new();
    for _ in 0..MAX_STEPS {
        if !engine.has_work() {
            return steps;
        }
        steps.push(engine.step());
        engine
            .check_invariants()
            .expect("invariants hold after a step");
    }
    panic!("engine still busy after {MAX_STEPS} steps");
}

/// Submits one request, runs it to completion and returns its outputs.
fn run_one(engine: &mut Engine, request: Request) -> Vec<RequestOutput> {
    let id = request.id.clone();
    engine.submit(request).expect("accepted");
    drain(engine)
        .into_iter()
        .flat_map(|s| s.outputs)
        .filter(|o| o.id == id)
        .collect()
}

fn events(steps: &[StepOutput]) -> Vec<EngineKvEvent> {
    steps.iter().flat_map(|s| s.events.clone()).collect()
}

fn stored_hashes(events: &[EngineKvEvent]) -> Vec<u64> {
    events
        .iter()
        .flat_map(|e| match e {
            EngineKvEvent::BlockStored { block_hashes, .. } => block_hashes.clone(),
            _ => Vec::new(),
        })
        .collect()
}

/// A mirror that counts blocks per hash: exact when reused blocks are not re-announced.
#[derive(Default)]
struct Mirror {
    counts: BTreeMap<u64, usize>,
}

impl Mirror {
    fn apply(&mut self, event: &EngineKvEvent) -> Result<(), String> {
        match event {
            EngineKvEvent::BlockStored { block_hashes, .. } => {
                for h in block_hashes {
                    *self.counts.entry(*h).or_default() += 1;
                }
            }
            EngineKvEvent::BlockRemoved { block_hashes } => {
                for h in block_hashes {
                    let Some(n) = self.counts.get_mut(h) else {
                        return Err(format!("removed {h:#x} that was never stored"));
                    };
                    *n -= 1;
                    if *n == 0 {
                        self.counts.remove(h);
                    }
                }
            }
            EngineKvEvent::AllBlocksCleared => self.counts.clear(),
        }
        Ok(())
    }

    fn as_vec(&self) -> Vec<(u64, usize)> {
        self.counts.iter().map(|(&h, &n)| (h, n)).collect()
    }
}

#[test]
fn repeated_prompt_hits_exactly_its_full_blocks() {
    let mut e = engine(base());
    // 40 tokens = 2 full blocks of 16 + 8.
    let first = run_one(&mut e, Request::new("a", prompt(0, 40), 1));
    assert_eq!(first[0].num_cached_tokens, 0);
    let s = e.stats();
    assert_eq!((s.prefix_cache_queries, s.prefix_cache_hits), (40, 0));

    let second = run_one(&mut e, Request::new("b", prompt(0, 40), 1));
    assert_eq!(second[0].num_cached_tokens, 32);
    let s = e.stats();
    assert_eq!((s.prefix_cache_queries, s.prefix_cache_hits), (80, 32));
    assert_eq!(s.prompt_tokens, 80);
    assert_eq!(s.prompt_tokens_cached, 32);
}

#[test]
fn a_request_waiting_for_blocks_is_one_prefix_cache_query_counted_at_admission() {
    // 16 usable blocks of 4 tokens: "big" holds 10 to 12 of them, so "waits" (7 blocks) stays at
    // the head of the queue, looked up in every step, until "big" finishes.
    let mut e = engine(base().block_size(4).num_gpu_blocks(17).max_model_len(64));
    e.submit(Request::new("big", prompt(0, 40), 8)).expect("ok");
    e.step();
    e.submit(Request::new("waits", prompt(1000, 28), 1))
        .expect("ok");
    for _ in 0..3 {
        e.step();
        assert_eq!(e.stats().waiting, 1, "\"waits\" cannot get its blocks yet");
    }
    // Only the admitted request counts so far, as in vLLM 0.32 ("record at admission so
    // unscheduled lookups are not counted"); counting lookups would give 40 + 3 × 28.
    assert_eq!(e.stats().prefix_cache_queries, 40);
    drain(&mut e);
    let s = e.stats();
    assert_eq!((s.num_preemptions, s.finished_length), (0, 2));
    assert_eq!((s.prefix_cache_queries, s.prefix_cache_hits), (40 + 28, 0));
}

#[test]
fn fully_cached_prompt_still_recomputes_its_last_token() {
    let mut e = engine(base());
    run_one(&mut e, Request::new("a", prompt(0, 32), 1));
    // Both blocks are cached, but the hit is capped at (32 - 1) / 16 = 1 block.
    let again = run_one(&mut e, Request::new("b", prompt(0, 32), 1));
    assert_eq!(again[0].num_cached_tokens, 16);
    assert_eq!(e.stats().prefix_cache_hits, 16);
}

#[test]
fn caching_off_gives_no_hits_and_no_events() {
    let mut e = engine(base().enable_prefix_caching(false));
    e.submit(Request::new("a", prompt(0, 40), 20)).expect("ok");
    let mut steps = drain(&mut e);
    e.submit(Request::new("b", prompt(0, 40), 20)).expect("ok");
    steps.extend(drain(&mut e));
    assert!(events(&steps).is_empty());
    assert!(
        steps
            .iter()
            .flat_map(|s| &s.outputs)
            .all(|o| o.num_cached_tokens == 0)
    );
    let s = e.stats();
    assert_eq!((s.prefix_cache_queries, s.prefix_cache_hits), (0, 0));
    assert!(e.resident_block_hashes().is_empty());
    assert!(e.reset_prefix_cache());
    assert!(e.take_events().is_empty());
}

#[test]
fn lora_and_cache_salt_separate_chains() {
    let mut e = engine(base());
    let p = prompt(0, 40);
    let variant = |id: &str, lora: Option<&str>, salt: Option<&str>| Request {
        lora_name: lora.map(str::to_owned),
        lora_id: lora.map(|_| 1),
        cache_salt: salt.map(str::to_owned),
        ..Request::new(id, p.clone(), 1)
    };
    run_one(&mut e, variant("plain", None, None));
    assert_eq!(
        run_one(&mut e, variant("lora", Some("sql"), None))[0].num_cached_tokens,
        0
    );
    assert_eq!(
        run_one(&mut e, variant("salt", None, Some("t1")))[0].num_cached_tokens,
        0
    );
    assert_eq!(
        run_one(&mut e, variant("both", Some("sql"), Some("t1")))[0].num_cached_tokens,
        0
    );
    assert_eq!(
        run_one(&mut e, variant("lora2", Some("sql"), None))[0].num_cached_tokens,
        32
    );
    assert_eq!(
        run_one(&mut e, variant("salt2", None, Some("t1")))[0].num_cached_tokens,
        32
    );
    assert_eq!(
        run_one(&mut e, variant("other", None, Some("t2")))[0].num_cached_tokens,
        0
    );
    // 5 distinct chains of 2 blocks.
    assert_eq!(e.resident_block_hashes().len(), 10);
}

#[test]
fn block_stored_carries_chain_tokens_and_extra_keys() {
    let mut e = engine(base().emit_reused_stores(false));
    let req = Request {
        lora_name: Some("sql".into()),
        lora_id: Some(7),
        cache_salt: Some("t1".into()),
        ..Request::new("a", prompt(100, 40), 1)
    };
    e.submit(req).expect("ok");
    let evs = events(&drain(&mut e));
    let [
        EngineKvEvent::BlockStored {
            block_hashes,
            parent_block_hash,
            token_ids,
            block_size,
            lora_id,
            lora_name,
            extra_keys,
        },
    ] = evs.as_slice()
    else {
        panic!("expected one BlockStored, got {evs:?}");
    };
    assert_eq!(block_hashes.len(), 2);
    assert_eq!(*parent_block_hash, None);
    assert_eq!(*token_ids, prompt(100, 32));
    assert_eq!(*block_size, 16);
    assert_eq!(*lora_id, Some(7));
    assert_eq!(lora_name.as_deref(), Some("sql"));
    assert_eq!(
        *extra_keys,
        vec![
            Some(vec!["sql".to_owned(), "t1".to_owned()]),
            Some(vec!["sql".to_owned()])
        ]
    );
}

#[test]
fn decode_filled_blocks_are_stored_with_their_parent() {
    let mut e = engine(base().emit_reused_stores(false));
    // 20-token prompt, 12 outputs: the second block fills at token 32 during decode.
    e.submit(Request::new("a", prompt(0, 20), 13)).expect("ok");
    let steps = drain(&mut e);
    let evs = events(&steps);
    assert_eq!(evs.len(), 2, "{evs:?}");
    let (
        EngineKvEvent::BlockStored {
            block_hashes: first,
            ..
        },
        EngineKvEvent::BlockStored {
            block_hashes: second,
            parent_block_hash,
            token_ids,
            ..
        },
    ) = (&evs[0], &evs[1])
    else {
        panic!("expected two BlockStored, got {evs:?}");
    };
    assert_eq!(*parent_block_hash, Some(first[0]));
    assert_eq!(second.len(), 1);
    let generated: Vec<u32> = steps
        .iter()
        .flat_map(|s| &s.outputs)
        .flat_map(|o| o.new_token_ids.clone())
        .collect();
    let mut expected = prompt(16, 4);
    expected.extend_from_slice(&generated[..12]);
    assert_eq!(*token_ids, expected);
}

#[test]
fn eviction_is_lru_tail_first_and_emits_block_removed() {
    // 8 usable blocks of 4 tokens.
    let mut e = engine(
        base()
            .block_size(4)
            .num_gpu_blocks(9)
            .max_model_len(32)
            .emit_reused_stores(false),
    );
    let mut mirror = Mirror::default();
    e.submit(Request::new("a", prompt(0, 12), 1)).expect("ok");
    let a_events = events(&drain(&mut e));
    let a_hashes = stored_hashes(&a_events);
    assert_eq!(a_hashes.len(), 3);
    // 5 blocks come from the never-used part of the free queue: no eviction.
    e.submit(Request::new("b", prompt(1000, 20), 1))
        .expect("ok");
    let b_events = events(&drain(&mut e));
    assert!(
        !b_events
            .iter()
            .any(|ev| matches!(ev, EngineKvEvent::BlockRemoved { .. }))
    );
    // The next block taken is A's, and A freed its tail first.
    e.submit(Request::new("c", prompt(2000, 3), 1)).expect("ok");
    let c_events = events(&drain(&mut e));
    assert_eq!(
        c_events,
        vec![EngineKvEvent::BlockRemoved {
            block_hashes: vec![a_hashes[2]]
        }]
    );
    for ev in a_events.iter().chain(&b_events).chain(&c_events) {
        mirror.apply(ev).expect("consistent stream");
    }
    assert_eq!(mirror.as_vec(), e.resident_block_hash_counts());
    // A's first two blocks are still resident and hit.
    assert_eq!(
        run_one(&mut e, Request::new("a2", prompt(0, 12), 1))[0].num_cached_tokens,
        8
    );
}

#[test]
fn max_num_seqs_caps_running() {
    let mut e = engine(base().max_num_seqs(2));
    for i in 0..5 {
        e.submit(Request::new(format!("r{i}"), prompt(i * 100, 20), 4))
            .expect("ok");
    }
    for _ in 0..3 {
        e.step();
        assert!(e.stats().running <= 2);
    }
    let s = e.stats();
    assert_eq!((s.running, s.waiting), (2, 3));
    drain(&mut e);
    assert_eq!(e.stats().finished_length, 5);
}

#[test]
fn chunked_prefill_respects_the_token_budget() {
    let mut e = engine(base().max_num_batched_tokens(32));
    e.submit(Request::new("long", prompt(0, 100), 5))
        .expect("ok");
    let first_three: Vec<StepOutput> = (0..3).map(|_| e.step()).collect();
    for s in &first_three {
        assert_eq!(s.num_scheduled_tokens, 32);
        assert!(s.outputs.is_empty(), "no token before the prompt is done");
    }
    // A newcomer shares the budget with the last chunk (4 tokens left).
    e.submit(Request::new("short", prompt(500, 40), 5))
        .expect("ok");
    let s = e.step();
    assert_eq!(s.num_scheduled_tokens, 32);
    assert_eq!(s.outputs.len(), 1);
    assert!(s.outputs[0].first_token);
    for s in drain(&mut e) {
        assert!(s.num_scheduled_tokens <= 32);
    }
}

#[test]
fn block_exhaustion_preempts_and_everything_still_completes() {
    // 16 usable blocks of 4 = 64 token slots; 4 requests growing to 60 tokens each.
    let cfg = || base().block_size(4).num_gpu_blocks(17).max_model_len(64);
    let mut e = engine(cfg());
    let reqs: Vec<Request> = (0..4)
        .map(|i| Request::new(format!("r{i}"), prompt(i * 1000, 20), 40))
        .collect();
    for r in &reqs {
        e.submit(r.clone()).expect("ok");
    }
    let steps = drain(&mut e);
    let s = e.stats();
    assert!(s.num_preemptions > 0, "no preemption: {s:?}");
    assert_eq!(s.finished_length, 4);
    assert_eq!(s.generation_tokens, 160);
    // Preemption must not change what a request generates.
    for r in reqs {
        let together: Vec<u32> = steps
            .iter()
            .flat_map(|s| &s.outputs)
            .filter(|o| o.id == r.id)
            .flat_map(|o| o.new_token_ids.clone())
            .collect();
        let mut alone_engine = engine(cfg());
        let alone: Vec<u32> = run_one(&mut alone_engine, r)
            .into_iter()
            .flat_map(|o| o.new_token_ids)
            .collect();
        assert_eq!(together, alone);
    }
}

#[test]
fn step_duration_grows_with_uncached_tokens() {
    let mut e = engine(base().max_num_batched_tokens(4096));
    let ttft = |e: &mut Engine, id: &str, p: Vec<u32>| {
        e.submit(Request::new(id, p, 1)).expect("ok");
        let s = e.step();
        assert!(s.outputs[0].first_token);
        drain(e);
        s.duration
    };
    let cold_512 = ttft(&mut e, "a", prompt(0, 512));
    let cold_1000 = ttft(&mut e, "b", prompt(5000, 1000));
    let warm_512 = ttft(&mut e, "c", prompt(0, 512));
    assert!(cold_1000 > cold_512, "{cold_1000:?} vs {cold_512:?}");
    assert!(warm_512 < cold_512, "{warm_512:?} vs {cold_512:?}");
    // 10 ms base + 0.1 ms per seq + tokens / 10k tokens/s.
    assert_eq!(cold_512, Duration::from_micros(10_100 + 51_200));
}

#[test]
fn time_scale_shrinks_durations() {
    let mut e = engine(base().time_scale(0.5));
    e.submit(Request::new("a", prompt(0, 100), 1)).expect("ok");
    assert_eq!(
        e.step().duration,
        Duration::from_micros((10_100 + 10_000) / 2)
    );
}

#[test]
fn compile_stall_is_paid_once_per_new_bucket() {
    let stall = Duration::from_secs(2);
    let mut e = engine(base().compile_stall(stall));
    e.submit(Request::new("a", prompt(0, 100), 3)).expect("ok");
    let a = drain(&mut e);
    // Prefill of 100 (bucket 128) compiles, the first decode (bucket 1) compiles, the second not.
    let compiled: Vec<bool> = a.iter().map(|s| s.compiled_new_bucket).collect();
    assert_eq!(compiled, vec![true, true, false]);
    assert!(a[0].duration >= stall && a[1].duration >= stall && a[2].duration < stall);
    // Another 100-token prefill (different tokens, so uncached) reuses bucket 128.
    e.submit(Request::new("b", prompt(1000, 100), 1))
        .expect("ok");
    let b = e.step();
    assert!(!b.compiled_new_bucket);
    assert!(b.duration < stall);
    // 300 tokens is a new bucket (512).
    e.submit(Request::new("c", prompt(2000, 300), 1))
        .expect("ok");
    assert!(e.step().compiled_new_bucket);
}

#[test]
fn reset_emits_all_blocks_cleared_only_when_idle() {
    let mut e = engine(base());
    e.submit(Request::new("a", prompt(0, 40), 5)).expect("ok");
    e.step();
    assert!(
        !e.reset_prefix_cache(),
        "refused while a request holds blocks"
    );
    drain(&mut e);
    assert!(!e.resident_block_hashes().is_empty());
    assert!(e.reset_prefix_cache());
    assert!(e.resident_block_hashes().is_empty());
    e.submit(Request::new("b", prompt(0, 40), 1)).expect("ok");
    let s = e.step();
    assert_eq!(s.events.first(), Some(&EngineKvEvent::AllBlocksCleared));
    assert_eq!(s.outputs[0].num_cached_tokens, 0);
}

#[test]
fn reused_blocks_are_announced_again_when_configured() {
    for emit in [true, false] {
        let mut e = engine(base().emit_reused_stores(emit));
        e.submit(Request::new("a", prompt(0, 40), 1)).expect("ok");
        let first = stored_hashes(&events(&drain(&mut e)));
        e.submit(Request::new("b", prompt(0, 40), 1)).expect("ok");
        let second = events(&drain(&mut e));
        if emit {
            assert_eq!(
                second,
                vec![EngineKvEvent::BlockStored {
                    block_hashes: first.clone(),
                    parent_block_hash: None,
                    token_ids: prompt(0, 32),
                    block_size: 16,
                    lora_id: None,
                    lora_name: None,
                    extra_keys: vec![None, None],
                }]
            );
        } else {
            assert!(second.is_empty(), "{second:?}");
        }
    }
}

#[test]
fn block_hashes_differ_per_seed_and_use_the_full_u64_range() {
    let hashes = |seed| {
        let mut e = engine(base().seed(seed));
        e.submit(Request::new("a", prompt(0, 16 * 63 + 8), 1))
            .expect("ok");
        drain(&mut e);
        e.resident_block_hashes()
    };
    let a = hashes(1);
    let b = hashes(2);
    assert_eq!(a.len(), 63);
    let a_set: HashSet<u64> = a.iter().copied().collect();
    assert!(b.iter().all(|h| !a_set.contains(h)));
    assert!(a.iter().any(|&h| h >= 1 << 63));
}

#[test]
fn identical_requests_generate_identical_tokens() {
    let mut e = engine(base());
    e.submit(Request::new("x", prompt(0, 30), 8)).expect("ok");
    e.submit(Request::new("y", prompt(0, 30), 8)).expect("ok");
    e.submit(Request::new("z", prompt(1, 30), 8)).expect("ok");
    let steps = drain(&mut e);
    let tokens = |id: &str| -> Vec<u32> {
        steps
            .iter()
            .flat_map(|s| &s.outputs)
            .filter(|o| o.id == id)
            .flat_map(|o| o.new_token_ids.clone())
            .collect()
    };
    assert_eq!(tokens("x").len(), 8);
    assert_eq!(tokens("x"), tokens("y"));
    assert_ne!(tokens("x"), tokens("z"));
}

#[test]
fn same_seed_gives_identical_event_and_output_streams() {
    let run = |seed| {
        let mut e = engine(
            base()
                .seed(seed)
                .block_size(4)
                .num_gpu_blocks(40)
                .max_model_len(128),
        );
        for i in 0..30u32 {
            let shared = prompt((i % 3) * 1000, 12);
            let mut p = shared;
            p.extend(prompt(i * 7, 5 + (i as usize % 11)));
            e.submit(Request::new(format!("r{i}"), p, 1 + (i as usize % 9)))
                .expect("ok");
            if i % 4 == 0 {
                e.step();
            }
        }
        drain(&mut e)
    };
    let a = run(9);
    assert_eq!(a, run(9));
    assert_ne!(events(&a), events(&run(10)));
}

#[test]
fn eos_finishes_with_stop_unless_ignored() {
    let cfg = || base().vocab_size(4).eos_token_id(Some(2));
    let mut e = engine(cfg());
    let out = run_one(&mut e, Request::new("a", prompt(0, 10), 200));
    let last = out.last().expect("outputs");
    assert_eq!(last.finished, Some(FinishReason::Stop));
    assert_eq!(last.new_token_ids, vec![2]);
    assert!(out.len() < 200);
    let mut e = engine(cfg());
    let out = run_one(
        &mut e,
        Request {
            ignore_eos: true,
            ..Request::new("a", prompt(0, 10), 200)
        },
    );
    assert_eq!(out.len(), 200);
    assert_eq!(
        out.last().and_then(|o| o.finished),
        Some(FinishReason::Length)
    );
}

#[test]
fn max_tokens_is_clamped_to_the_context_window() {
    let mut e = engine(base().max_model_len(64));
    let out = run_one(&mut e, Request::new("a", prompt(0, 60), 1000));
    assert_eq!(out.len(), 4);
    assert_eq!(out[3].finished, Some(FinishReason::Length));
}

#[test]
fn prompt_length_errors_use_vllms_text() {
    let err = check_prompt_len(5000, 4096).expect_err("too long");
    assert_eq!(
        err.to_string(),
        "This model's maximum context length is 4096 tokens. However, your prompt contains 5000 \
         input tokens, which exceeds this limit even without any output tokens. Please reduce \
         the length of the input prompt. (parameter=input_tokens, value=5000)"
    );
    assert_eq!(err.param(), Some("input_tokens"));
    assert_eq!(
        check_prompt_len(4096, 4096)
            .expect_err("no room")
            .to_string(),
        "The decoder prompt (length 4096) plus the number of requested output tokens (at least \
         1) is longer than the maximum model length of 4096. Make sure that `max_model_len` is \
         no smaller than the number of text tokens (prompt + requested output tokens)."
    );
    assert_eq!(check_prompt_len(4095, 4096), Ok(()));
    let mut e = engine(base().max_model_len(64));
    assert!(matches!(
        e.submit(Request::new("a", prompt(0, 65), 1)),
        Err(EngineError::PromptLength(
            PromptLengthError::ExceedsContext { .. }
        ))
    ));
    assert!(matches!(
        e.submit(Request::new("a", Vec::new(), 1)),
        Err(EngineError::PromptLength(PromptLengthError::Empty))
    ));
    e.submit(Request::new("a", prompt(0, 10), 1)).expect("ok");
    assert_eq!(
        e.submit(Request::new("a", prompt(0, 10), 1)),
        Err(EngineError::DuplicateRequestId("a".into()))
    );
}

#[test]
fn abort_frees_blocks_and_forgets_the_request() {
    let mut e = engine(base());
    e.submit(Request::new("a", prompt(0, 40), 100)).expect("ok");
    e.submit(Request::new("b", prompt(100, 40), 100))
        .expect("ok");
    e.step();
    assert!(e.stats().kv_cache_usage > 0.0);
    assert!(e.abort("a"));
    assert!(e.abort("b"));
    assert!(!e.abort("a"));
    e.check_invariants().expect("invariants");
    let s = e.stats();
    assert_eq!(
        (s.running, s.waiting, s.kv_cache_usage, s.aborted),
        (0, 0, 0.0, 2)
    );
    assert!(!e.has_work());
    // Aborted blocks stay cached.
    assert_eq!(
        run_one(&mut e, Request::new("c", prompt(0, 40), 1))[0].num_cached_tokens,
        32
    );
}

#[test]
fn config_validation_names_the_field() {
    let err = EngineConfig::builder()
        .block_size(0)
        .build()
        .expect_err("invalid");
    assert!(err.to_string().contains("block_size"), "{err}");
    let err = EngineConfig::builder()
        .num_gpu_blocks(10)
        .max_model_len(4096)
        .build()
        .expect_err("too small");
    assert!(err.to_string().contains("num_gpu_blocks"), "{err}");
    let err = EngineConfig::builder()
        .time_scale(f64::NAN)
        .build()
        .expect_err("nan");
    assert!(err.to_string().contains("time_scale"), "{err}");
}

#[derive(Debug, Clone)]
enum Op {
    Submit {
        family: u32,
        shared_blocks: usize,
        tail: usize,
        max_tokens: usize,
        lora: bool,
        salt: bool,
    },
    Step,
    Abort(usize),
    /// Reset the prefix cache; `true` preempts running requests first.
    Reset(bool),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0..4u32, 0..6usize, 1..20usize, 1..30usize, any::<bool>(), any::<bool>()).prop_map(
            |(family, shared_blocks, tail, max_tokens, lora, salt)| Op::Submit {
                family,
                shared_blocks,
                tail,
                max_tokens,
                lora: lora && family % 2 == 0,
                salt: salt && family == 1,
            }
        ),
        5 => Just(Op::Step),
        1 => (0..64usize).prop_map(Op::Abort),
        1 => any::<bool>().prop_map(Op::Reset),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn random_workloads_keep_the_invariants(
        ops in proptest::collection::vec(op(), 1..120),
        num_gpu_blocks in 20..60usize,
        max_num_seqs in 1..8usize,
        budget in 8..64usize,
        emit_reused in any::<bool>(),
        seed in any::<u64>(),
    ) {
        let mut e = engine(
            EngineConfig::builder()
                .block_size(4)
                .num_gpu_blocks(num_gpu_blocks)
                .max_model_len(64)
                .max_num_seqs(max_num_seqs)
                .max_num_batched_tokens(budget)
                .emit_reused_stores(emit_reused)
                .seed(seed),
        );
        let mut mirror = Mirror::default();
        let mut ever_stored: HashSet<u64> = HashSet::new();
        let mut submitted = 0usize;
        let mut finished = 0usize;
        let mut aborted = 0usize;
        let mut apply = |events: &[EngineKvEvent], mirror: &mut Mirror| -> Result<(), TestCaseError> {
            for ev in events {
                match ev {
                    EngineKvEvent::BlockStored { block_hashes, .. } => {
                        ever_stored.extend(block_hashes.iter().copied());
                    }
                    EngineKvEvent::BlockRemoved { block_hashes } => {
                        for h in block_hashes {
                            prop_assert!(ever_stored.contains(h), "removed before stored");
                        }
                    }
                    EngineKvEvent::AllBlocksCleared => {}
                }
                if !emit_reused {
                    mirror.apply(ev).map_err(TestCaseError::fail)?;
                }
            }
            Ok(())
        };
        let check = |e: &Engine, mirror: &Mirror| -> Result<(), TestCaseError> {
            e.check_invariants().map_err(TestCaseError::fail)?;
            let s = e.stats();
            prop_assert!((0.0..=1.0).contains(&s.kv_cache_usage));
            prop_assert!(s.running <= max_num_seqs);
            prop_assert!(e.num_cached_blocks() < num_gpu_blocks);
            if !emit_reused {
                prop_assert_eq!(mirror.as_vec(), e.resident_block_hash_counts());
            }
            Ok(())
        };
        for op in ops {
            match op {
                Op::Submit { family, shared_blocks, tail, max_tokens, lora, salt } => {
                    let mut p = prompt(family * 10_000, shared_blocks * 4);
                    p.extend(prompt(50_000 + submitted as u32 * 100, tail));
                    let req = Request {
                        lora_name: lora.then(|| "ad".to_owned()),
                        cache_salt: salt.then(|| "s".to_owned()),
                        ..Request::new(format!("r{submitted}"), p, max_tokens)
                    };
                    e.submit(req).map_err(|err| TestCaseError::fail(err.to_string()))?;
                    submitted += 1;
                }
                Op::Step => {
                    let s = e.step();
                    prop_assert!(s.num_scheduled_tokens <= budget);
                    finished += s.outputs.iter().filter(|o| o.finished.is_some()).count();
                    apply(&s.events, &mut mirror)?;
                }
                Op::Abort(i) => {
                    if e.abort(&format!("r{i}")) {
                        aborted += 1;
                    }
                }
                Op::Reset(preempt) => {
                    let idle = e.stats().kv_cache_usage == 0.0;
                    prop_assert_eq!(e.reset_prefix_cache_with(preempt), idle || preempt);
                    let evs = e.take_events();
                    apply(&evs, &mut mirror)?;
                }
            }
            check(&e, &mirror)?;
        }
        for _ in 0..MAX_STEPS {
            if !e.has_work() {
                break;
            }
            let s = e.step();
            finished += s.outputs.iter().filter(|o| o.finished.is_some()).count();
            apply(&s.events, &mut mirror)?;
            check(&e, &mirror)?;
        }
        prop_assert!(!e.has_work(), "workload did not drain");
        prop_assert_eq!(finished + aborted, submitted);
        prop_assert_eq!(e.stats().kv_cache_usage, 0.0);
    }
}

#[test]
fn the_latest_started_request_is_preempted_and_resumes_first() {
    // 16 usable blocks of 4 tokens: two requests growing to 60 tokens cannot both fit.
    let mut e = engine(base().block_size(4).num_gpu_blocks(17).max_model_len(64));
    e.submit(Request::new("old", prompt(0, 20), 40))
        .expect("ok");
    e.step();
    e.submit(Request::new("new", prompt(1000, 20), 40))
        .expect("ok");
    let mut steps = 0;
    while e.stats().num_preemptions == 0 {
        e.step();
        steps += 1;
        assert!(steps < 1000, "no preemption");
    }
    e.check_invariants().expect("invariants");
    let s = e.stats();
    assert_eq!((s.running, s.waiting), (1, 1));
    assert!(e.contains("new"));
    // A third request arrives later: the preempted one is at the front and goes first.
    e.submit(Request::new("later", prompt(2000, 8), 1))
        .expect("ok");
    let rest = drain(&mut e);
    let finish_step = |id: &str| {
        rest.iter()
            .position(|s| s.outputs.iter().any(|o| o.id == id && o.finished.is_some()))
            .expect("finished")
    };
    let first_output = |id: &str| {
        rest.iter()
            .position(|s| s.outputs.iter().any(|o| o.id == id))
            .expect("produced output")
    };
    assert!(
        finish_step("old") < first_output("new"),
        "old keeps running until done"
    );
    assert!(
        first_output("new") <= first_output("later"),
        "FCFS after preemption"
    );
    // The resumed request's lookup is not a new prefix-cache query.
    assert_eq!(e.stats().prefix_cache_queries, 20 + 20 + 8);
}

#[test]
fn identical_blocks_filled_independently_are_cached_twice_like_vllm() {
    let mut e = engine(base().emit_reused_stores(false));
    // Same prompt, admitted in the same step: B hits A's first block, then both generate the
    // same tokens and each fills its own copy of the second block.
    e.submit(Request::new("a", prompt(0, 20), 20)).expect("ok");
    e.submit(Request::new("b", prompt(0, 20), 20)).expect("ok");
    let evs = events(&drain(&mut e));
    let stored = stored_hashes(&evs);
    assert_eq!(stored.len(), 3, "{evs:?}");
    assert_eq!(stored[1], stored[2]);
    assert!(e.resident_block_hash_counts().contains(&(stored[1], 2)));
    assert_eq!(e.num_cached_blocks(), 3);
    assert_eq!(e.resident_block_hashes().len(), 2);
}

#[test]
fn reset_with_running_requests_preempts_them_in_order() {
    let mut e = engine(base());
    e.submit(Request::new("a", prompt(0, 40), 10)).expect("ok");
    e.submit(Request::new("b", prompt(100, 40), 10))
        .expect("ok");
    e.step();
    assert!(!e.reset_prefix_cache());
    assert!(e.reset_prefix_cache_with(true));
    let s = e.stats();
    assert_eq!((s.running, s.waiting, s.num_preemptions), (0, 2, 2));
    assert!(e.resident_block_hashes().is_empty());
    let next = e.step();
    assert_eq!(next.events.first(), Some(&EngineKvEvent::AllBlocksCleared));
    // Both are recomputed from scratch, in their original order.
    let ids: Vec<&str> = next.outputs.iter().map(|o| o.id.as_str()).collect();
    assert_eq!(ids, ["a", "b"]);
    assert!(next.outputs.iter().all(|o| !o.first_token));
    drain(&mut e);
    assert_eq!(e.stats().finished_length, 2);
}

#[test]
fn per_request_report_mode_overrides_the_engine_default() {
    let mut e = engine(base().emit_reused_stores(false));
    run_one(&mut e, Request::new("a", prompt(0, 40), 1));
    e.submit(Request {
        report_reused_blocks: Some(true),
        ..Request::new("b", prompt(0, 40), 1)
    })
    .expect("ok");
    let evs = events(&drain(&mut e));
    assert_eq!(stored_hashes(&evs).len(), 2, "{evs:?}");
}

#[test]
fn an_uncached_freed_block_is_reused_before_any_cached_one() {
    // vLLM's `BlockPool.free_blocks`: a freed block without a hash (a partial tail) goes to the
    // front of the free queue, a cached one to the back. 8 usable blocks of 4 tokens.
    let mut e = engine(
        base()
            .block_size(4)
            .num_gpu_blocks(9)
            .max_model_len(32)
            .emit_reused_stores(false),
    );
    // X: 2 cached blocks. A: 2 cached blocks and a partial third, taken after X's.
    e.submit(Request::new("x", prompt(0, 8), 1)).expect("ok");
    let x = stored_hashes(&events(&drain(&mut e)));
    e.submit(Request::new("a", prompt(500, 10), 1)).expect("ok");
    drain(&mut e);
    // B needs 5 blocks: A's partial block and the 3 never used, then X's tail: one eviction.
    // Had the partial block gone to the back, X's first block would be evicted too.
    e.submit(Request::new("b", prompt(1000, 20), 1))
        .expect("ok");
    let removed: Vec<EngineKvEvent> = events(&drain(&mut e))
        .into_iter()
        .filter(|ev| matches!(ev, EngineKvEvent::BlockRemoved { .. }))
        .collect();
    assert_eq!(
        removed,
        vec![EngineKvEvent::BlockRemoved {
            block_hashes: vec![x[1]]
        }]
    );
    assert_eq!(
        run_one(&mut e, Request::new("x2", prompt(0, 12), 1))[0].num_cached_tokens,
        4
    );
}

#[test]
fn a_request_is_admitted_only_when_its_whole_prompt_fits() {
    // vLLM's `scheduler_reserve_full_isl` (on by default): with chunked prefill the admission
    // check is for the whole sequence, not the first chunk. 8 usable blocks of 4 tokens, a
    // 16-token budget; "big" needs 6 blocks while "small" holds 3.
    let mut e = engine(
        base()
            .block_size(4)
            .num_gpu_blocks(9)
            .max_model_len(32)
            .max_num_batched_tokens(16),
    );
    e.submit(Request::new("small", prompt(0, 9), 4))
        .expect("ok");
    e.step();
    e.submit(Request::new("big", prompt(1000, 24), 1))
        .expect("ok");
    // Its first chunk (4 blocks) would fit in the 5 free blocks; the whole prompt does not.
    e.step();
    let s = e.stats();
    assert_eq!((s.running, s.waiting), (1, 1));
    drain(&mut e);
    assert_eq!(e.stats().finished_length, 2);
    assert_eq!(e.stats().num_preemptions, 0);
}
