//! Cross-check against Python: `tests/python/check_tokenizer.py` computes token ids with the
//! Python `tokenizers` package and `jinja2` (configured as transformers configures it), and they
//! must equal the Rust ids, for the project's own tokenizer and for Phi-3. Needs
//! `$KVSIGHT_PYTHON` (a venv python with `tokenizers` and `jinja2`; `cargo xtask ci` makes it).
//! When that python also has transformers 4.x (vLLM's pin), the ids are also checked against
//! transformers' own `apply_chat_template` + `encode`, vLLM's actual path.

use std::io::Write as _;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use kvsight_sim::own_tokenizer;
use kvsight_tokenizer::{ChatExtras, ChatMessage, ModelTokenizer};
use serde_json::{Value, json};

const SCRIPT: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../tests/python/check_tokenizer.py"
);
/// Phi-3-mini's tokenizer folder, under `../shared`.
const PHI3_DIR: &str = "fixtures/tokenizers/phi-3-mini";
/// Python startup plus loading a 32k-entry tokenizer takes a second or two; this only bounds a
/// hung interpreter.
const PYTHON_TIMEOUT: Duration = Duration::from_secs(120);

fn python(test: &str) -> Option<String> {
    match std::env::var("KVSIGHT_PYTHON") {
        Ok(p) if !p.is_empty() => Some(p),
        _ => {
            kvsight_harness::skip(test, "KVSIGHT_PYTHON unset");
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
        ], "add_generation_prompt": false},
        {"messages": [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "The answer is "}
        ], "continue_final_message": true}
    ])
}

/// Runs the Python reference on `dir` and returns its `(text, ids)` per case.
fn python_ids(
    python: &str,
    dir: &Path,
    cases: &Value,
    template: Option<&Path>,
    reference: Reference,
) -> Vec<(String, Vec<u32>)> {
    let mut command = Command::new(python);
    command.arg(SCRIPT);
    if reference == Reference::Transformers {
        command.arg("--transformers");
    }
    command.arg(dir);
    if let Some(template) = template {
        command.arg("-").arg(template);
    }
    let mut child = command
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
                let extras = ChatExtras {
                    tools: case["tools"].as_array().cloned(),
                    continue_final_message: case["continue_final_message"]
                        .as_bool()
                        .unwrap_or(false),
                    ..ChatExtras::default()
                };
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

/// Which Python computes the expected ids.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Reference {
    /// `tokenizers` + `jinja2`, re-implementing transformers' rules (always available in CI).
    Reimplementation,
    /// transformers itself (`AutoTokenizer`, `apply_chat_template`), when installed.
    Transformers,
}

/// `$KVSIGHT_PYTHON` if it can import transformers 4.x (vLLM pins `< 5`), else prints why not.
fn python_with_transformers(test: &str) -> Option<String> {
    let python = python(test)?;
    let output = kvsight_harness::or_skip(
        test,
        Command::new(&python)
            .args(["-c", "import transformers; print(transformers.__version__)"])
            .stderr(Stdio::null())
            .output()
            .map_err(|e| format!("running $KVSIGHT_PYTHON: {e}")),
    )?;
    let version = String::from_utf8_lossy(&output.stdout).trim().to_owned();
    if !output.status.success() || !version.starts_with("4.") {
        kvsight_harness::skip(test, "transformers 4.x not installed in $KVSIGHT_PYTHON");
        return None;
    }
    Some(python)
}

fn compare(dir: &Path, python: &str, reference: Reference) {
    compare_with(dir, python, &load(dir), &cases(), None, reference);
}

fn compare_with(
    dir: &Path,
    python: &str,
    tok: &ModelTokenizer,
    cases: &Value,
    template: Option<&Path>,
    reference: Reference,
) {
    let expected = python_ids(python, dir, cases, template, reference);
    let actual = rust_ids(tok, cases);
    assert_eq!(expected.len(), actual.len());
    for (i, (py, rs)) in expected.iter().zip(&actual).enumerate() {
        assert_eq!(rs.0, py.0, "case {i}: rendered text differs");
        assert_eq!(rs.1, py.1, "case {i}: token ids differ");
        assert!(!rs.1.is_empty(), "case {i}: no ids");
    }
}

/// The Python that computes `reference`'s ids, or `None` (after printing the skip line).
fn python_for(test: &str, reference: Reference) -> Option<String> {
    match reference {
        Reference::Reimplementation => python(test),
        Reference::Transformers => python_with_transformers(test),
    }
}

/// The project's own tokenizer against `reference`.
fn own_against(test: &str, reference: Reference) {
    let Some(python) = python_for(test, reference) else {
        return;
    };
    let dir = own_tokenizer::ensure_dir().expect("own tokenizer");
    compare(&dir, &python, reference);
}

/// Phi-3's tokenizer (a `../shared` fixture) against `reference`.
fn phi3_against(test: &str, reference: Reference) {
    let Some(python) = python_for(test, reference) else {
        return;
    };
    let Some(dir) = kvsight_harness::fixture_or_skip(test, PHI3_DIR) else {
        return;
    };
    compare(&dir, &python, reference);
}

#[test]
fn own_tokenizer_matches_python() {
    own_against("own_tokenizer_matches_python", Reference::Reimplementation);
}

#[test]
fn own_tokenizer_matches_transformers() {
    own_against(
        "own_tokenizer_matches_transformers",
        Reference::Transformers,
    );
}

#[test]
fn phi3_matches_python() {
    phi3_against("phi3_matches_python", Reference::Reimplementation);
}

#[test]
fn phi3_matches_transformers() {
    phi3_against("phi3_matches_transformers", Reference::Transformers);
}

/// A template of our own that exercises what real templates use (namespace, slicing, loop
/// attributes, Python string methods, filters, tojson with and without indent, tool calls,
/// printing of dicts and lists); minijinja must render it exactly as jinja2 does.
const FEATURE_TEMPLATE: &str = r#"{%- set ns = namespace(system='', turns=0) -%}
{%- if messages and messages[0]['role'] == 'system' -%}
  {%- set ns.system = messages[0]['content'] | trim -%}
  {%- set rest = messages[1:] -%}
{%- else -%}
  {%- set rest = messages -%}
{%- endif -%}
{{ bos_token }}
{%- if tools is not none %}
<|system|>
{{ ns.system }}
Tools:
{% for tool in tools %}
- {{ tool | tojson }}
- {{ tool | tojson(indent=4) }}
{% endfor %}
<|end|>
{%- elif ns.system %}
<|system|>
{{ ns.system }}<|end|>
{%- endif %}
{% for message in rest %}
  {%- set ns.turns = ns.turns + 1 %}
  {%- if message.role == 'user' %}
<|user|>
{{ message.content }}{% if loop.last %} ({{ loop.index }}/{{ loop.length }}, first={{ loop.first }}){% endif %}<|end|>
  {%- elif message.role == 'assistant' %}
<|assistant|>
    {%- if message.tool_calls is defined %}
      {%- for call in message.tool_calls %}
{{ call.function.name }}({{ call.function.arguments | tojson }}) {{ call.function.arguments }}
      {%- endfor %}
    {%- else %}
{{ message.content.strip() }}
    {%- endif %}<|end|>
  {%- elif message.role == 'tool' %}
<|user|>
[tool {{ message.tool_call_id }}] {{ message.content }}<|end|>
  {%- else %}
{{ raise_exception('bad role ' ~ message.role) }}
  {%- endif %}
{% endfor %}
{%- if add_generation_prompt %}
<|assistant|>
{% endif %}
turns={{ ns.turns }} {% for k, v in {'a': 1, 'b': [1, 2]}.items() %}{{ k }}={{ v }};{% endfor %}
{{ 'Hello World'.split(' ') | join('|') }} {{ 'abc'.startswith('a') }} {{ 'x,y'.replace(',', ';') }} {{ [3, 1, 2] | sort | list }} {{ 'abc'[::-1] }} {{ 7 // 2 }} {{ 7 % 3 }} {{ 2 ** 3 }} {{ 'a' in 'cat' }} {{ messages | length }} {{ (messages | map(attribute='role') | list) }} {{ messages[-1].content | upper }} {{ 'x' if none is none }} {{ 1.5 * 2 }} {{ 10 / 4 }} {{ 'A b'.lower().title() }} {{ '  pad '.rstrip() }}|{{ ' pad '.lstrip() }}| {{ 'a-b-c'.split('-', 1) }} {{ messages[0].get('name', 'anon') }} {{ range(3) | list }} {{ 'é' | length }}
"#;

#[test]
fn template_features_render_as_in_jinja2() {
    let Some(python) = python("template_features_render_as_in_jinja2") else {
        return;
    };
    let dir = own_tokenizer::ensure_dir().expect("own tokenizer");
    let template_path = own_tokenizer::target_dir().join(format!(
        "kvsight-feature-template-{}.jinja",
        std::process::id()
    ));
    std::fs::write(&template_path, FEATURE_TEMPLATE).expect("write template");
    let cases = json!([{
        "messages": [
            {"role": "system", "content": "  Be brief.  "},
            {"role": "user", "content": "What's the weather in \"Oslo\"?"},
            {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function",
                "function": {"name": "weather",
                    "arguments": "{\"city\": \"Oslo\", \"units\": [\"C\", 1, 2.5, true, null]}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "12 C"},
            {"role": "assistant", "content": "  It is 12 C.  "},
            {"role": "user", "content": [{"type": "text", "text": "Thanks"}, {"type": "text", "text": "bye"}]}
        ],
        "add_generation_prompt": true,
        "tools": [{"type": "function", "function": {"name": "weather",
            "description": "Get <weather> & 'stuff'",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
    }]);
    let tok = load(&dir).with_chat_template(FEATURE_TEMPLATE);
    compare_with(
        &dir,
        &python,
        &tok,
        &cases,
        Some(&template_path),
        Reference::Reimplementation,
    );
    if let Some(python) = python_with_transformers("template_features_render_as_in_jinja2") {
        compare_with(
            &dir,
            &python,
            &tok,
            &cases,
            Some(&template_path),
            Reference::Transformers,
        );
    }
    let _ = std::fs::remove_file(&template_path);
}
