//! `cargo xtask history-lint`: comments in `*.rs` say what the code does and why, in a few
//! lines; measurements, variants tried and how the code got here belong in `docs/decisions/`
//! (linked from the comment), `CHANGELOG.md` and git. A comment fails the lint when it carries
//!
//! - an issue number: `issue 16`, `issue #16`, `issues 12 and 16`, `pre-issue-13`;
//! - a work session: `the ninth session`, `session 3`, `3rd session`;
//! - a commit hash: a word of 7 to 40 lowercase hex digits with at least one digit and one letter;
//! - a measurement log: `measured`, or a count of runs (`three runs`, `5 interleaved runs`), with
//!   a figure (a decimal, a percentage, a duration, a `×`) on the same line or the next.
//!
//! Only comments are read (string literals, test vectors and identifiers are not), and words
//! are matched whole: `Session` as a type, an HTTP or chat session, `session_id`, certificates
//! "issued" by a CA and "the measured prefill rate" pass.
//!
//! [`PENDING`] lists files with history that their owners have yet to clean; they are reported
//! but do not fail the lint. Empty it as they are cleaned.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};

/// This file: its docs show what the rules catch.
const SELF: &str = "xtask/src/history_lint.rs";

/// Files still carrying history, cleaned by the people working on them (workspace-relative,
/// `/`-separated). Reported, not failed; an entry whose file is clean is reported as stale.
const PENDING: &[&str] = &[];

/// One offending comment line.
#[derive(Debug, PartialEq, Eq)]
struct Finding {
    line: usize,
    rule: &'static str,
    text: String,
}

pub(crate) fn history_lint(root: &Path) -> Result<()> {
    let mut files = Vec::new();
    collect(root, &mut files)?;
    files.sort();
    let mut failures = Vec::new();
    let mut pending = Vec::new();
    let mut stale = Vec::new();
    for path in &files {
        let rel = path
            .strip_prefix(root)
            .unwrap_or(path)
            .to_string_lossy()
            .replace('\\', "/");
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let found = if rel == SELF {
            Vec::new()
        } else {
            findings(&text)
        };
        let listed = PENDING.contains(&rel.as_str());
        if listed && found.is_empty() {
            stale.push(rel.clone());
        }
        let out = if listed { &mut pending } else { &mut failures };
        out.extend(
            found
                .into_iter()
                .map(|f| format!("{rel}:{}: {}: {}", f.line, f.rule, f.text.trim())),
        );
    }
    if !pending.is_empty() {
        println!(
            "xtask history-lint: {} lines of history in files pending cleanup (PENDING in xtask/src/history_lint.rs)",
            pending.len()
        );
    }
    for rel in &stale {
        println!(
            "xtask history-lint: {rel} is clean: remove it from PENDING in xtask/src/history_lint.rs"
        );
    }
    if !failures.is_empty() {
        bail!(
            "measurement history in code comments (move it to docs/decisions/ and link the record):\n  {}",
            failures.join("\n  ")
        );
    }
    println!(
        "xtask history-lint: {} .rs files read, no history in their comments outside {} pending files",
        files.len(),
        PENDING.len()
    );
    Ok(())
}

/// Every `.rs` file under `dir`, build output, fuzz corpora and VCS data left out.
fn collect(dir: &Path, out: &mut Vec<PathBuf>) -> Result<()> {
    for entry in std::fs::read_dir(dir).with_context(|| format!("listing {}", dir.display()))? {
        let entry = entry?;
        let path = entry.path();
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if entry.file_type()?.is_dir() {
            if !(name.starts_with('.') || name == "target" || name == "corpus") {
                collect(&path, out)?;
            }
        } else if name.ends_with(".rs") {
            out.push(path);
        }
    }
    Ok(())
}

/// The lines of `text`'s comments that break a rule, one finding per line (the first rule).
fn findings(text: &str) -> Vec<Finding> {
    let lines = comment_lines(text);
    let mut out = Vec::new();
    for (i, (line, comment)) in lines.iter().enumerate() {
        // The next comment line, when it directly follows: a figure may wrap onto it.
        let next = lines
            .get(i + 1)
            .filter(|(l, _)| *l == line + 1)
            .map_or("", |(_, c)| c.as_str());
        let rule = if issue_number(comment) {
            Some("issue number")
        } else if work_session(comment) {
            Some("work session")
        } else if commit_hash(comment) {
            Some("commit hash")
        } else if measurement(comment).is_some_and(|at| figure(&comment[at..]) || figure(next)) {
            Some("measurement log")
        } else {
            None
        };
        if let Some(rule) = rule {
            out.push(Finding {
                line: *line,
                rule,
                text: comment.clone(),
            });
        }
    }
    out
}

/// The text of every comment in Rust source, per line (1-based), strings and chars skipped.
fn comment_lines(text: &str) -> Vec<(usize, String)> {
    #[derive(Clone, Copy)]
    enum State {
        Code,
        Line,
        Block(u32),
        Str,
        Raw(usize),
    }
    let chars: Vec<char> = text.chars().collect();
    let mut out: Vec<(usize, String)> = Vec::new();
    let mut line = 1;
    let mut state = State::Code;
    let mut i = 0;
    let push = |out: &mut Vec<(usize, String)>, line: usize, c: char| match out.last_mut() {
        Some((l, s)) if *l == line => s.push(c),
        _ => out.push((line, c.to_string())),
    };
    while i < chars.len() {
        let c = chars[i];
        let next = chars.get(i + 1).copied();
        if c == '\n' {
            line += 1;
            if matches!(state, State::Line) {
                state = State::Code;
            }
            i += 1;
            continue;
        }
        match state {
            State::Code => {
                if c == '/' && next == Some('/') {
                    state = State::Line;
                    i += 2;
                    continue;
                }
                if c == '/' && next == Some('*') {
                    state = State::Block(1);
                    i += 2;
                    continue;
                }
                if c == '"' {
                    state = State::Str;
                } else if c == 'r' && (next == Some('"') || next == Some('#')) {
                    // r"…", r#"…"#, br#"…"#: count the hashes up to the quote.
                    let hashes = chars[i + 1..].iter().take_while(|&&h| h == '#').count();
                    if chars.get(i + 1 + hashes) == Some(&'"')
                        && (i == 0 || !chars[i - 1].is_alphanumeric() || chars[i - 1] == 'b')
                    {
                        state = State::Raw(hashes);
                        i += 2 + hashes;
                        continue;
                    }
                } else if c == '\'' {
                    // A char literal ('x', '\n', '\u{..}') is skipped; a lifetime is not one.
                    if next == Some('\\') {
                        let close = chars[i + 2..].iter().position(|&q| q == '\'');
                        i += close.map_or(1, |p| p + 3);
                        continue;
                    }
                    if chars.get(i + 2) == Some(&'\'') {
                        i += 3;
                        continue;
                    }
                }
                i += 1;
            }
            State::Line => {
                push(&mut out, line, c);
                i += 1;
            }
            State::Block(depth) => {
                if c == '*' && next == Some('/') {
                    state = if depth == 1 {
                        State::Code
                    } else {
                        State::Block(depth - 1)
                    };
                    i += 2;
                    continue;
                }
                if c == '/' && next == Some('*') {
                    state = State::Block(depth + 1);
                    i += 2;
                    continue;
                }
                push(&mut out, line, c);
                i += 1;
            }
            State::Str => {
                if c == '\\' {
                    i += 2;
                    continue;
                }
                if c == '"' {
                    state = State::Code;
                }
                i += 1;
            }
            State::Raw(hashes) => {
                if c == '"' && chars[i + 1..].iter().take(hashes).all(|&h| h == '#') {
                    // Needs all of its hashes: `"#` inside an r##"…"## string is text.
                    if chars[i + 1..].len() >= hashes {
                        state = State::Code;
                        i += 1 + hashes;
                        continue;
                    }
                }
                i += 1;
            }
        }
    }
    out
}

/// The comment's words, lowercased, with their byte offsets: runs of letters, digits and `_`.
fn words(text: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    let mut start = None;
    for (i, c) in text
        .char_indices()
        .chain(std::iter::once((text.len(), ' ')))
    {
        let word_char = c.is_alphanumeric() || c == '_';
        match (start, word_char) {
            (None, true) => start = Some(i),
            (Some(s), false) => {
                out.push((s, text[s..i].to_lowercase()));
                start = None;
            }
            _ => {}
        }
    }
    out
}

fn is_number(w: &str) -> bool {
    !w.is_empty() && w.chars().all(|c| c.is_ascii_digit())
}

/// `issue 16`, `issue #16`, `issues 12`, `issue-13`: the word `issue(s)`, then only spaces,
/// `#` or `-`, then a number.
fn issue_number(text: &str) -> bool {
    let lower = text.to_lowercase();
    words(&lower).iter().any(|(at, w)| {
        (w == "issue" || w == "issues") && {
            let rest = lower[at + w.len()..].trim_start_matches([' ', '#', '-']);
            rest.starts_with(|c: char| c.is_ascii_digit())
        }
    })
}

/// Ordinals that name a work session. "first", "second" and "third" are left out: they name
/// chat sessions in the bench's and the tests' comments ("the pod that served the first
/// session").
const ORDINALS: [&str; 17] = [
    "fourth",
    "fifth",
    "sixth",
    "seventh",
    "eighth",
    "ninth",
    "tenth",
    "eleventh",
    "twelfth",
    "thirteenth",
    "fourteenth",
    "fifteenth",
    "sixteenth",
    "seventeenth",
    "eighteenth",
    "nineteenth",
    "twentieth",
];

/// `the ninth session`, `3rd session`, `sixth-session code`, `session 3`, `sessions 2 and 3`.
fn work_session(text: &str) -> bool {
    let w = words(text);
    w.iter().enumerate().any(|(i, (at, word))| {
        if word != "session" && word != "sessions" {
            return false;
        }
        let before = i.checked_sub(1).map(|j| w[j].1.as_str());
        let ordinal = before.is_some_and(|b| {
            ORDINALS.contains(&b)
                || ["th", "rd"]
                    .iter()
                    .any(|s| b.strip_suffix(s).is_some_and(is_number))
        });
        let numbered = text[at + word.len()..]
            .trim_start_matches([' ', '#'])
            .starts_with(|c: char| c.is_ascii_digit());
        ordinal || numbered
    })
}

/// A word of 7 – 40 lowercase hex digits with both a digit and a letter (`2c447d2`), not
/// written as a `0x…` literal.
fn commit_hash(text: &str) -> bool {
    words(text).iter().any(|(at, _)| {
        let word: String = text[*at..]
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect();
        (7..=40).contains(&word.len())
            && word.chars().all(|c| matches!(c, '0'..='9' | 'a'..='f'))
            && word.chars().any(|c| c.is_ascii_digit())
            && word.chars().any(|c| c.is_ascii_lowercase())
            && !text[..*at].ends_with("0x")
    })
}

const COUNTS: [&str; 12] = [
    "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve",
    "several",
];

/// Where `measured` or a count of runs (`three runs`, `5 interleaved runs`, `2 of 11 runs`)
/// starts in `text`: the figures of a log follow it. Quoted `code` does not count (a tool's
/// output format such as libFuzzer's `Done 123 runs in 61 s`), nor a version (`vLLM 0.32 runs`).
fn measurement(text: &str) -> Option<usize> {
    let unquoted: String = text
        .split('`')
        .enumerate()
        .map(|(i, part)| {
            if i % 2 == 0 {
                part.to_owned()
            } else {
                " ".repeat(part.len() + 2)
            }
        })
        .collect::<Vec<_>>()
        .join("");
    let text = unquoted.as_str();
    let w = words(text);
    w.iter().enumerate().find_map(|(i, (at, word))| {
        if word == "measured" {
            return Some(*at);
        }
        if word != "runs" {
            return None;
        }
        // The count stands just before, or one word before ("five interleaved runs").
        let count = |j: usize| {
            let word = w[j].1.as_str();
            let after = &text[w[j].0 + word.len()..];
            let version = text[..w[j].0].ends_with('.')
                || after.starts_with('.') && after[1..].starts_with(|c: char| c.is_ascii_digit());
            !version && (is_number(word) || COUNTS.contains(&word))
        };
        let j = i.checked_sub(1)?;
        if count(j) {
            return Some(w[j].0);
        }
        let k = j.checked_sub(1)?;
        (w[j].1.chars().all(char::is_alphabetic) && count(k)).then_some(w[k].0)
    })
}

/// A figure: a decimal (`0.73`), a percentage, a duration (`1.2 s`, `40 ms`, `3 µs`) or `×`.
fn figure(text: &str) -> bool {
    let chars: Vec<char> = text.chars().collect();
    if chars.contains(&'×') {
        return true;
    }
    for (i, &c) in chars.iter().enumerate() {
        if !c.is_ascii_digit() || (i > 0 && chars[i - 1].is_ascii_digit()) {
            continue;
        }
        // A number starting here (not inside a word like `u32` or `h2`).
        if i > 0 && (chars[i - 1].is_alphabetic() || chars[i - 1] == '_') {
            continue;
        }
        let mut j = i;
        while j < chars.len() && (chars[j].is_ascii_digit() || chars[j] == ',') {
            j += 1;
        }
        if chars.get(j) == Some(&'.') && chars.get(j + 1).is_some_and(|d| d.is_ascii_digit()) {
            return true;
        }
        let rest: String = chars[j..].iter().collect();
        let rest = rest.trim_start();
        let unit_end = |unit: &str| {
            rest.strip_prefix(unit)
                .is_some_and(|r| !r.starts_with(|c: char| c.is_alphanumeric()))
        };
        if rest.starts_with('%') || ["s", "ms", "µs", "us"].into_iter().any(unit_end) {
            return true;
        }
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rules(src: &str) -> Vec<&'static str> {
        findings(src).into_iter().map(|f| f.rule).collect()
    }

    #[test]
    fn history_in_comments_is_found() {
        let cases = [
            ("// fixed for issue 16", "issue number"),
            ("/// Issue 13: a NaN decoded", "issue number"),
            ("// (the pre-issue-13 behaviour)", "issue number"),
            ("// see issue #7", "issue number"),
            ("//! in the ninth session's try", "work session"),
            ("// the sixth-session code", "work session"),
            ("// session 3 moved it", "work session"),
            ("// as of the 3rd session", "work session"),
            ("// at `2c447d2` it was slower", "commit hash"),
            ("// since 6615f7d", "commit hash"),
            ("// measured: hit rate 0.74 → 0.59", "measurement log"),
            (
                "/// Measured on the bench\n/// (TTFT p90 0.83 s)",
                "measurement log",
            ),
            ("// three runs each: 0.680 / 0.683", "measurement log"),
            ("// five interleaved runs gave 12 %", "measurement log"),
            ("/* issue 4's names */", "issue number"),
        ];
        for (src, rule) in cases {
            assert_eq!(rules(src), [rule], "{src}");
        }
    }

    #[test]
    fn legitimate_code_and_comments_pass() {
        let clean = [
            "struct Session<'a> { x: &'a str }",
            "let session = Session::new(); // one QUIC session per sidecar",
            "// A chat session's turns share its history.",
            "// the HTTP session ends when the client closes",
            "pub session_id: Option<String>, // vLLM's session_id",
            "// certificates issued by the configured CA",
            "// open issues are tracked elsewhere",
            "/// The sidecar's measured prefill rate, tokens/s.",
            "/// Median of the measured prefill rates.",
            "const V: &str = \"0000000d03030401040501a602d301010c\";",
            "assert_eq!(hex(&out), \"93ffd1ff38ccc8\"); // golden bytes",
            "let s = \"// issue 16 in a string is not a comment\";",
            "let r = r#\"issue 16 \"quoted\" // 2c447d2\"#;",
            "let c = '\"'; // a quote char, then a comment about nothing",
            "// 0x2c447d2f is a literal, not a commit",
            "// the defaced facade",
            "// a pod's prefill runs while the pod has a queue of 3",
            "// one run per request, 10 ms apart",
            "/// A default of 1.5, until the sidecar has measured a rate of its own",
            "// it runs 2 passes",
            "// vLLM >= 0.32 runs transformers 5 (since 1.5 s)",
            "// libFuzzer ends with `Done 123456 runs in 61 s`",
            "// the pod that served the first session, 0.5 s earlier",
        ];
        for src in clean {
            assert_eq!(rules(src), Vec::<&str>::new(), "{src}");
        }
    }

    #[test]
    fn comments_are_read_across_lines_and_block_nesting() {
        let src = "fn a() {}\n/* outer /* issue 3 */ still */\nlet x = \"/*\"; // ok\n";
        let f = findings(src);
        assert_eq!(f.len(), 1, "{f:?}");
        assert_eq!(f[0].line, 2);
        let strings =
            "let s = \"line one\n// not a comment, still the string\n\"; // measured 3.5 s";
        assert_eq!(rules(strings), ["measurement log"]);
        assert_eq!(findings(strings)[0].line, 3);
    }

    #[test]
    fn pending_files_exist() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
        for rel in PENDING {
            assert!(
                root.join(rel).is_file(),
                "PENDING lists a missing file: {rel}"
            );
        }
    }
}
