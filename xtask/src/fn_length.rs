//! `cargo xtask ci`'s check that no function outside tests runs over [`MAX_LINES`] lines: a
//! long orchestrator is split into named phases, so that a reader sees its steps before their
//! details. Test functions (files under a `tests/` folder, `tests.rs` modules and
//! `#[cfg(test)]` modules) may be as long as their story.
//!
//! The scan is lexical, not a parser: it skips comments, string, raw-string and character
//! literals, and counts a function from its `fn` line to the line of the brace that closes its
//! body.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};

/// The longest function body, in lines from `fn` to its closing brace.
pub(crate) const MAX_LINES: usize = 120;

/// One function that is too long.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Long {
    pub file: PathBuf,
    pub line: usize,
    pub name: String,
    pub lines: usize,
}

/// Fails naming every non-test function over [`MAX_LINES`] lines in the workspace's `*.rs`.
pub(crate) fn check(root: &Path) -> Result<()> {
    let mut long = Vec::new();
    let mut files = 0;
    for file in rust_files(root)? {
        let rel = file.strip_prefix(root).unwrap_or(&file);
        if is_test_path(rel) {
            continue;
        }
        files += 1;
        let text = std::fs::read_to_string(&file)
            .with_context(|| format!("reading {}", file.display()))?;
        long.extend(
            long_functions(&text, MAX_LINES)
                .into_iter()
                .map(|(line, name, lines)| Long {
                    file: rel.to_owned(),
                    line,
                    name,
                    lines,
                }),
        );
    }
    if !long.is_empty() {
        let list: Vec<String> = long
            .iter()
            .map(|l| {
                format!(
                    "{}:{} {} ({} lines)",
                    l.file.display(),
                    l.line,
                    l.name,
                    l.lines
                )
            })
            .collect();
        bail!(
            "functions over {MAX_LINES} lines (split them into named phases): {}",
            list.join(", ")
        );
    }
    println!("xtask fn-length: {files} files, no function over {MAX_LINES} lines outside tests");
    Ok(())
}

/// Test code by where it lives: a `tests/` folder (integration tests, the testbed's scenarios)
/// or a `tests.rs` module.
fn is_test_path(rel: &Path) -> bool {
    rel.components().any(|c| c.as_os_str() == "tests")
        || rel.file_name().is_some_and(|n| n == "tests.rs")
}

/// Every `*.rs` file git tracks (so `target/` and fetched trees never count).
fn rust_files(root: &Path) -> Result<Vec<PathBuf>> {
    let out = std::process::Command::new("git")
        .args([
            "ls-files",
            "--cached",
            "--others",
            "--exclude-standard",
            "*.rs",
        ])
        .current_dir(root)
        .output()
        .context("git ls-files")?;
    if !out.status.success() {
        bail!(
            "git ls-files failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| root.join(l))
        .filter(|p| p.exists())
        .collect())
}

/// `(line, name, lines)` of every function longer than `max` lines outside `#[cfg(test)]`
/// modules; lines are 1-based.
pub(crate) fn long_functions(text: &str, max: usize) -> Vec<(usize, String, usize)> {
    let code = blank_literals(text);
    let lines: Vec<&str> = code.lines().collect();
    let mut out = Vec::new();
    // Brace depth at which a `#[cfg(test)]` module opened; inside it nothing counts.
    let mut test_module: Option<i64> = None;
    let mut pending_cfg_test = false;
    // Open functions: (brace depth of their body, start line, name).
    let mut open: Vec<(i64, usize, String)> = Vec::new();
    // A `fn` seen whose body has not opened yet.
    let mut header: Option<(usize, String)> = None;
    let mut depth: i64 = 0;
    for (i, line) in lines.iter().enumerate() {
        let trimmed = line.trim_start();
        if trimmed.starts_with("#[cfg(test)]") {
            pending_cfg_test = true;
        }
        if let Some(name) = fn_name(trimmed) {
            header = Some((i + 1, name));
        }
        for ch in line.chars() {
            match ch {
                '{' => {
                    depth += 1;
                    if pending_cfg_test && trimmed.contains("mod ") && test_module.is_none() {
                        test_module = Some(depth);
                        pending_cfg_test = false;
                    }
                    if let Some((start, name)) = header.take() {
                        open.push((depth, start, name));
                    }
                }
                '}' => {
                    if open.last().is_some_and(|(d, _, _)| *d == depth) {
                        let (_, start, name) = open.pop().expect("checked");
                        let n = i + 1 - start + 1;
                        if n > max && test_module.is_none() {
                            out.push((start, name, n));
                        }
                    }
                    if test_module == Some(depth) {
                        test_module = None;
                    }
                    depth -= 1;
                }
                ';' if header.is_some() && open.last().is_none_or(|(d, _, _)| *d < depth + 1) => {
                    // A declaration without a body (a trait method).
                    header = None;
                }
                _ => {}
            }
        }
        if pending_cfg_test
            && !trimmed.starts_with("#[")
            && !trimmed.is_empty()
            && !trimmed.contains("mod ")
        {
            pending_cfg_test = false;
        }
    }
    out
}

/// The function name if `line` starts a function item.
fn fn_name(line: &str) -> Option<String> {
    let mut rest = line;
    for prefix in [
        "pub(crate) ",
        "pub(super) ",
        "pub ",
        "const ",
        "async ",
        "unsafe ",
        "extern \"C\" ",
    ] {
        rest = rest.strip_prefix(prefix).unwrap_or(rest);
    }
    for prefix in ["const ", "async ", "unsafe "] {
        rest = rest.strip_prefix(prefix).unwrap_or(rest);
    }
    let rest = rest.strip_prefix("fn ")?;
    let name: String = rest
        .chars()
        .take_while(|c| c.is_alphanumeric() || *c == '_')
        .collect();
    (!name.is_empty()).then_some(name)
}

/// `text` with every comment, string, raw string and character literal replaced by spaces
/// (newlines kept), so braces inside them do not count.
fn blank_literals(text: &str) -> String {
    let b: Vec<char> = text.chars().collect();
    let mut out = String::with_capacity(text.len());
    let mut i = 0;
    let blank = |c: char| if c == '\n' { '\n' } else { ' ' };
    while i < b.len() {
        let c = b[i];
        let next = b.get(i + 1).copied();
        if c == '/' && next == Some('/') {
            while i < b.len() && b[i] != '\n' {
                out.push(' ');
                i += 1;
            }
        } else if c == '/' && next == Some('*') {
            let mut nest = 0;
            while i < b.len() {
                if b[i] == '/' && b.get(i + 1) == Some(&'*') {
                    nest += 1;
                    out.push_str("  ");
                    i += 2;
                } else if b[i] == '*' && b.get(i + 1) == Some(&'/') {
                    nest -= 1;
                    out.push_str("  ");
                    i += 2;
                    if nest == 0 {
                        break;
                    }
                } else {
                    out.push(blank(b[i]));
                    i += 1;
                }
            }
        } else if c == 'r' && (next == Some('"') || next == Some('#')) && !ident_before(&b, i) {
            // A raw string: r"…", r#"…"#, …
            let mut j = i + 1;
            let mut hashes = 0;
            while b.get(j) == Some(&'#') {
                hashes += 1;
                j += 1;
            }
            if b.get(j) != Some(&'"') {
                out.push(c);
                i += 1;
                continue;
            }
            j += 1;
            loop {
                match b.get(j) {
                    None => break,
                    Some('"') if (1..=hashes).all(|k| b.get(j + k) == Some(&'#')) => {
                        j += 1 + hashes;
                        break;
                    }
                    _ => j += 1,
                }
            }
            for &ch in &b[i..j.min(b.len())] {
                out.push(blank(ch));
            }
            i = j;
        } else if c == '"' {
            out.push(' ');
            i += 1;
            while i < b.len() && b[i] != '"' {
                if b[i] == '\\' {
                    out.push(' ');
                    i += 1;
                }
                if i < b.len() {
                    out.push(blank(b[i]));
                    i += 1;
                }
            }
            out.push(' ');
            i += 1;
        } else if c == '\'' {
            // A character literal ('x', '\n', '\u{7b}'), or a lifetime ('a), which stays.
            let close = if next == Some('\\') {
                (i + 2..(i + 12).min(b.len())).find(|&k| b[k] == '\'')
            } else {
                (b.get(i + 2) == Some(&'\'')).then_some(i + 2)
            };
            match close {
                Some(end) => {
                    for _ in i..=end {
                        out.push(' ');
                    }
                    i = end + 1;
                }
                None => {
                    out.push(c);
                    i += 1;
                }
            }
        } else {
            out.push(c);
            i += 1;
        }
    }
    out
}

/// Whether `b[i]` continues an identifier (so an `r` there is not a raw string's prefix).
fn ident_before(b: &[char], i: usize) -> bool {
    i > 0 && (b[i - 1].is_alphanumeric() || b[i - 1] == '_')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_long_function_is_found_and_braces_in_literals_do_not_count() {
        let body: String = (0..10).map(|i| format!("    let x{i} = 1;\n")).collect();
        let text = format!(
            "fn short() {{\n    let s = \"{{{{\";\n}}\n\
             pub async fn long<'a>(x: &'a str) -> char {{\n{body}    let c = '{{';\n    let r = r#\"}}\"#;\n    // }}\n    c\n}}\n\
             trait T {{\n    fn decl(&self);\n}}\n\
             #[cfg(test)]\nmod tests {{\n    fn also_long() {{\n{body}    }}\n}}\n"
        );
        let found = long_functions(&text, 10);
        assert_eq!(found, vec![(4, "long".to_owned(), 16)], "{text}");
    }

    #[test]
    fn tests_live_in_tests_folders_and_modules() {
        assert!(is_test_path(Path::new("router/tests/proxy.rs")));
        assert!(is_test_path(Path::new("tests/src/cluster/mod.rs")));
        assert!(is_test_path(Path::new("router/src/scheduler/tests.rs")));
        assert!(!is_test_path(Path::new("router/src/proxy.rs")));
    }
}
