//! The one way a test skips itself. A test that cannot run here (a `../shared` fixture absent,
//! no Python, the own tokenizer not buildable) prints `skipped: <name>: <why>` and returns, so a
//! developer's machine without the fixtures still runs everything else, and `cargo xtask ci`
//! lists the skips. Under `CI=true` the same call panics instead: CI has the fixtures and Python
//! (`.ci/run` runs beside `../shared` and `cargo xtask ci` installs the venv), so a skip there
//! means a check silently stopped checking.

use std::fmt::Display;

/// Whether skipping is refused: `CI` is set to anything but `false`/`0`/empty (CI systems set
/// `CI=true`; `cargo xtask ci` sets it for its test step).
fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| !matches!(v.trim(), "" | "0" | "false"))
}

/// Records that `test` skips itself because of `why`: prints `skipped: <test>: <why>` locally,
/// panics with the same text under `CI=true`. The caller returns right after.
#[track_caller]
pub fn skip(test: &str, why: impl Display) {
    let line = format!("skipped: {test}: {why}");
    if in_ci() {
        panic!("{line} (CI=true: tests may not skip themselves in CI)");
    }
    eprintln!("{line}");
}

/// `Some(value)`, or `None` after [`skip`]ping `test` with the error: for a test whose
/// precondition is a fallible build or load, `let Some(x) = or_skip(test, build()) else { return };`.
#[track_caller]
pub fn or_skip<T, E: Display>(test: &str, result: Result<T, E>) -> Option<T> {
    match result {
        Ok(value) => Some(value),
        Err(e) => {
            skip(test, e);
            None
        }
    }
}
