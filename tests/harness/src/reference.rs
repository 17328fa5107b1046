//! The configuration reference (`docs/configuration.md`) against the programs' real option and
//! key lists: each crate's test collects what its program accepts ([`Flag`]s, [`Key`]s) and
//! [`check_flags`] / [`check_keys`] compare them with a table of the page, returning one line
//! per difference (missing, stale, another variable, another default).
//!
//! A table is the first Markdown table under a `## ` heading. The first cell of a row names the
//! option in backticks; a default cell that starts with a value in backticks gives the exact
//! default, any other text means "no built-in value" (and says where the value comes from).

use std::path::PathBuf;

/// A command-line flag as the program defines it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Flag {
    /// Without the leading dashes.
    pub long: String,
    pub env: Option<String>,
    /// `None` when there is no built-in value (or it is empty).
    pub default: Option<String>,
}

/// A config-file key (a dotted path, `[]` for list items) and its default, as the program has
/// them. `default: None` for a required key or one without a value (`null`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Key {
    pub path: String,
    pub default: Option<String>,
}

/// `docs/configuration.md` of this workspace.
pub fn page() -> (PathBuf, String) {
    let path = crate::workspace_root().join("docs/configuration.md");
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    (path, text)
}

/// The rows (cells, trimmed) of the first table under the `## {heading}` section of `page`,
/// without its header and separator. Panics when the section or its table is missing.
pub fn table(page: &str, heading: &str) -> Vec<Vec<String>> {
    let mut lines = page
        .lines()
        .skip_while(|l| l.trim() != format!("## {heading}"));
    assert!(
        lines.next().is_some(),
        "docs/configuration.md has no section `## {heading}`"
    );
    let rows: Vec<Vec<String>> = lines
        .take_while(|l| !l.starts_with("## "))
        .skip_while(|l| !l.trim_start().starts_with('|'))
        .take_while(|l| l.trim_start().starts_with('|'))
        .skip(2)
        .map(cells)
        .collect();
    assert!(
        !rows.is_empty(),
        "docs/configuration.md, `## {heading}`: no table"
    );
    rows
}

/// A table row's cells; `\|` is a pipe inside a cell.
fn cells(line: &str) -> Vec<String> {
    let line = line.trim().trim_start_matches('|').trim_end_matches('|');
    let mut out = vec![String::new()];
    let mut chars = line.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '\\' if chars.peek() == Some(&'|') => {
                out.last_mut().unwrap().push('|');
                chars.next();
            }
            '|' => out.push(String::new()),
            _ => out.last_mut().unwrap().push(c),
        }
    }
    out.into_iter().map(|c| c.trim().to_owned()).collect()
}

/// The text of a cell's value: the `` `code` `` span it starts with, if it starts with one.
fn value(cell: &str) -> Option<String> {
    cell.starts_with('`').then(|| code(cell)).flatten()
}

/// The text of the first `` `code` `` span in a cell.
pub fn code(cell: &str) -> Option<String> {
    let start = cell.find('`')? + 1;
    let len = cell[start..].find('`')?;
    Some(cell[start..start + len].to_owned())
}

/// Whether two defaults agree: equal text, or equal numbers (`3` and `3.0`).
fn same_value(a: &str, b: &str) -> bool {
    a == b || matches!((a.parse::<f64>(), b.parse::<f64>()), (Ok(x), Ok(y)) if x == y)
}

fn describe(v: &Option<String>) -> String {
    v.as_ref()
        .map_or("no built-in value".to_owned(), |v| format!("`{v}`"))
}

/// Compares the `## {heading}` table (columns: flag, variable, default, …) with `flags`.
pub fn check_flags(page: &str, heading: &str, flags: &[Flag]) -> Vec<String> {
    let mut problems = Vec::new();
    let rows = table(page, heading);
    let documented: Vec<(String, Option<String>, Option<String>)> = rows
        .iter()
        .map(|r| {
            let long = code(&r[0])
                .unwrap_or_default()
                .trim_start_matches('-')
                .to_owned();
            let env = r.get(1).and_then(|c| code(c));
            let default = r.get(2).and_then(|c| value(c));
            (long, env, default)
        })
        .collect();
    for flag in flags {
        match documented.iter().find(|(l, _, _)| *l == flag.long) {
            None => problems.push(format!(
                "{heading}: missing `--{}` (env {}, default {})",
                flag.long,
                describe(&flag.env),
                describe(&flag.default)
            )),
            Some((_, env, default)) => {
                if *env != flag.env {
                    problems.push(format!(
                        "{heading}: `--{}`: the variable is {}, the reference says {}",
                        flag.long,
                        describe(&flag.env),
                        describe(env)
                    ));
                }
                let agree = match (default, &flag.default) {
                    (Some(d), Some(f)) => same_value(d, f),
                    (None, None) => true,
                    _ => false,
                };
                if !agree {
                    problems.push(format!(
                        "{heading}: `--{}`: the default is {}, the reference says {}",
                        flag.long,
                        describe(&flag.default),
                        describe(default)
                    ));
                }
            }
        }
    }
    for (long, _, _) in &documented {
        if !flags.iter().any(|f| f.long == *long) {
            problems.push(format!(
                "{heading}: stale `--{long}`: the program has no such flag"
            ));
        }
    }
    problems
}

/// Compares the `## {heading}` table (columns: key, default, …) with `keys`.
pub fn check_keys(page: &str, heading: &str, keys: &[Key]) -> Vec<String> {
    let mut problems = Vec::new();
    let rows = table(page, heading);
    let documented: Vec<(String, Option<String>)> = rows
        .iter()
        .map(|r| {
            (
                code(&r[0]).unwrap_or_default(),
                r.get(1).and_then(|c| value(c)),
            )
        })
        .collect();
    for key in keys {
        match documented.iter().find(|(p, _)| *p == key.path) {
            None => problems.push(format!(
                "{heading}: missing `{}` (default {})",
                key.path,
                describe(&key.default)
            )),
            Some((_, default)) => {
                let agree = match (default, &key.default) {
                    (Some(d), Some(k)) => same_value(d, k),
                    (None, None) => true,
                    _ => false,
                };
                if !agree {
                    problems.push(format!(
                        "{heading}: `{}`: the default is {}, the reference says {}",
                        key.path,
                        describe(&key.default),
                        describe(default)
                    ));
                }
            }
        }
    }
    for (path, _) in &documented {
        if !keys.iter().any(|k| k.path == *path) {
            problems.push(format!(
                "{heading}: stale `{path}`: the config has no such key"
            ));
        }
    }
    problems
}

/// Panics listing `problems`, if any, with where to fix them.
pub fn assert_none(path: &std::path::Path, problems: &[String]) {
    assert!(
        problems.is_empty(),
        "{} is out of date with the code:\n  {}",
        path.display(),
        problems.join("\n  ")
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    const PAGE: &str = "\
# t

## Flags

| flag | variable | default | meaning |
|---|---|---|---|
| `--listen` | `X_LISTEN` | `0.0.0.0:1` | where |
| `--old` | — | none | gone \\| really |

## Keys

| key | default | meaning |
|---|---|---|
| `a.b` | `3` | three |
| `a.c` | required | c |
";

    #[test]
    fn flags_missing_stale_and_different_are_named() {
        let flags = [
            Flag {
                long: "listen".into(),
                env: Some("X_LISTEN".into()),
                default: Some("0.0.0.0:2".into()),
            },
            Flag {
                long: "new".into(),
                env: None,
                default: None,
            },
        ];
        let p = check_flags(PAGE, "Flags", &flags);
        assert_eq!(p.len(), 3, "{p:#?}");
        assert!(
            p[0].contains("`--listen`: the default is `0.0.0.0:2`"),
            "{p:#?}"
        );
        assert!(p[1].contains("missing `--new`"), "{p:#?}");
        assert!(p[2].contains("stale `--old`"), "{p:#?}");
    }

    #[test]
    fn keys_compare_numbers_by_value() {
        let keys = [
            Key {
                path: "a.b".into(),
                default: Some("3.0".into()),
            },
            Key {
                path: "a.c".into(),
                default: None,
            },
        ];
        assert_eq!(check_keys(PAGE, "Keys", &keys), Vec::<String>::new());
        let p = check_keys(PAGE, "Keys", &keys[..1]);
        assert_eq!(p, ["Keys: stale `a.c`: the config has no such key"]);
    }

    #[test]
    fn escaped_pipes_stay_in_their_cell() {
        assert_eq!(cells("| `a` | x \\| y | z |"), ["`a`", "x | y", "z"]);
    }
}
