//! Cross-check against Python: `tests/python/check_tokenizer.py` computes token ids with the
//! Python `tokenizers` package and `jinja2` (configured as transformers configures it), and they
//! must equal the Rust ids, for the project's own tokenizer and for Phi-3. Needs
//! `$KVSIGHT_PYTHON` (a venv python with `tokenizers` and `jinja2`; `cargo xtask ci` makes it).

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use kvsight_protocol::tokenizer::{ChatExtras, ChatMessage, ModelTokenizer};
use kvsight_testbed::own_tokenizer;
use serde_json::{Value, json};

const SCRIPT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/python/check_tokenizer.py");
const PHI3_DIR: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../shared/fixtures/tokenizers/phi-3-mini"
);
/// Python startup plus loading a 32k-entry tokenizer takes a second or two; this only bounds a
/// hung interpreter.
const PYTHON_TIMEOUT: Duration = Duration::from_secs(120);

fn python(test: &str) -> Option<String> {
    match std::env::var("KVSIGHT_PYTHON") {
        Ok(p) if !p.is_empty() => Some(p),
        _ => {
            eprintln!("skipped: {test}: KVSIGHT_PYTHON unset");
            None
        }
    }
}

fn cases() -> Value {
    let preamble = own_tokenizer::guidelines_preamble(40, 7);
    json!([
        {"prompt": "What is the capital of France?"},
        {"prompt": "  spaces  and\ttabs\nand newlines\n\n"},
        {"prompt": "Unicode: café, naïve, 東京, emoji 🦀."},
        {"prompt": preamble},
        {"messages": [
            {"role": "user", "content": "What is the capital of France?"},
            {"role": "assistant", "content": "The capital of France is Paris."}
        ], "add_generation_prompt": true},
        {"messages": [
            {"role": "system", "content": preamble},
            {"role": "user", "content": "Which rule applies to a late invoice?"}
        ], "add_generation_prompt": true},
        {"messages": [
            {"role": "user", "content": [
                {"type": "text", "text": "First part."},
                {"type": "text", "text": " second part with  spaces "}
            ]},
            {"role": "assistant", "content": "Noted.\n"},
            {"role": "user", "content": "Thanks 🙂"}
        ], "add_generation_prompt": false}
    ])
}

/// Runs the Python reference on `dir` and returns its `(text, ids)` per case.
fn python_ids(python: &str, dir: &Path, cases: &Value) -> Vec<(String, Vec<u32>)> {
    let mut child = Command::new(python)
        .arg(SCRIPT)
        .arg(dir)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start $KVSIGHT_PYTHON");
    let input = serde_json::to_vec(cases).expect("json");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(&input)
        .expect("write cases");
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    let output = rx
        .recv_timeout(PYTHON_TIMEOUT)
        .expect("python reference timed out")
        .expect("python reference output");
    assert!(
        output.status.success(),
        "check_tokenizer.py failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let results: Vec<Value> = serde_json::from_slice(&output.stdout).expect("python json");
    results
        .into_iter()
        .map(|r| {
            let text = r["text"].as_str().expect("text").to_owned();
            let ids = r["ids"]
                .as_array()
                .expect("ids")
                .iter()
                .map(|v| u32::try_from(v.as_u64().expect("id")).expect("u32"))
                .collect();
            (text, ids)
        })
        .collect()
}

fn rust_ids(tok: &ModelTokenizer, cases: &Value) -> Vec<(String, Vec<u32>)> {
    cases
        .as_array()
        .expect("cases")
        .iter()
        .map(|case| {
            if let Some(prompt) = case["prompt"].as_str() {
                let ids = tok.encode_completion(prompt).expect("encode");
                (prompt.to_owned(), ids)
            } else {
                let messages: Vec<ChatMessage> =
                    serde_json::from_value(case["messages"].clone()).expect("messages");
                let agp = case["add_generation_prompt"].as_bool().unwrap_or(false);
                let extras = ChatExtras::default();
                let text = tok.render_chat(&messages, agp, &extras).expect("render");
                let ids = tok.encode_chat(&messages, agp, &extras).expect("encode");
                (text, ids)
            }
        })
        .collect()
}

fn load(dir: &Path) -> ModelTokenizer {
    let json = std::fs::read(dir.join("tokenizer.json")).expect("tokenizer.json");
    let config = std::fs::read(dir.join("tokenizer_config.json")).expect("config");
    ModelTokenizer::from_bytes(&json, Some(&config)).expect("tokenizer")
}

fn compare(dir: &Path, python: &str) {
    let cases = cases();
    let expected = python_ids(python, dir, &cases);
    let actual = rust_ids(&load(dir), &cases);
    assert_eq!(expected.len(), actual.len());
    for (i, (py, rs)) in expected.iter().zip(&actual).enumerate() {
        assert_eq!(rs.0, py.0, "case {i}: rendered text differs");
        assert_eq!(rs.1, py.1, "case {i}: token ids differ");
        assert!(!rs.1.is_empty(), "case {i}: no ids");
    }
}

#[test]
fn own_tokenizer_matches_python() {
    let Some(python) = python("own_tokenizer_matches_python") else {
        return;
    };
    let dir = own_tokenizer::ensure_dir().expect("own tokenizer");
    compare(&dir, &python);
}

#[test]
fn phi3_matches_python() {
    let test = "phi3_matches_python";
    let Some(python) = python(test) else {
        return;
    };
    let dir = PathBuf::from(PHI3_DIR);
    if !dir.join("tokenizer.json").is_file() {
        eprintln!("skipped: {test}: fixture {} absent", dir.display());
        return;
    }
    compare(&dir, &python);
}
