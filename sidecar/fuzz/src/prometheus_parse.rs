//! Feeds arbitrary text to the parser of vLLM's `/metrics` exposition (the Prometheus text
//! format) and what it reads into the load report the sidecar sends. Nothing may panic, and:
//! - the samples, written back in the text format, parse to the same samples (names, labels
//!   with their escapes, values bit for bit);
//! - whatever an exposition says, the load report built from it passes the router's
//!   validation (`Load::validate`), so a hostile `/metrics` cannot get a sidecar's reports
//!   refused or carry NaN into a router's thresholds.

use std::fmt::Write as _;

use kvsight_protocol::messages::{CacheView, Phase};
use kvsight_sidecar::load::build_load;
use kvsight_sidecar::scrape::{Sample, parse, samples};

/// A sample line in the text format.
fn write_sample(out: &mut String, s: &Sample<'_>) {
    out.push_str(s.name);
    if !s.labels.is_empty() {
        out.push('{');
        for (k, v) in &s.labels {
            let v = v
                .replace('\\', "\\\\")
                .replace('"', "\\\"")
                .replace('\n', "\\n");
            let _ = write!(out, "{k}=\"{v}\",");
        }
        out.push('}');
    }
    let value = match s.value {
        v if v.is_nan() => "NaN".to_owned(),
        f64::INFINITY => "+Inf".to_owned(),
        f64::NEG_INFINITY => "-Inf".to_owned(),
        // Rust prints the shortest text that parses back to the same f64.
        v => format!("{v:?}"),
    };
    let _ = writeln!(out, " {value}");
}

fn same(a: &Sample<'_>, b: &Sample<'_>) -> bool {
    a.name == b.name
        && a.labels == b.labels
        && (a.value.to_bits() == b.value.to_bits() || (a.value.is_nan() && b.value.is_nan()))
}

/// One input, as libFuzzer or the corpus replay hands it over.
pub fn run(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let all = match samples(text) {
        Ok(all) => all,
        Err(_) => {
            assert!(parse(text).is_err(), "parse accepts what samples refuses");
            return;
        }
    };
    let mut again = String::new();
    for s in &all {
        write_sample(&mut again, s);
    }
    let back = samples(&again).expect("written samples parse");
    assert_eq!(back.len(), all.len(), "{again:?}");
    for (a, b) in all.iter().zip(&back) {
        assert!(same(a, b), "{a:?} became {b:?} through {again:?}");
    }

    let Ok(m) = parse(text) else {
        return;
    };
    assert!(m.engines >= 1);
    for inflight in [0, 3] {
        for prefill in [None, Some(1.5)] {
            let load = build_load(&m, Phase::Ready, CacheView::Exact, inflight, prefill);
            if let Err(e) = load.validate() {
                panic!("the load report of {m:?} is refused: {e}");
            }
        }
    }
    let _ = m.restarted_since(&m);
}
