//! The one way a test skips itself. A test that cannot run here (a `../shared` fixture absent,
//! no Python, the own tokenizer not buildable) prints `skipped: <name>: <why>` and returns, so a
//! developer's machine without the fixtures still runs everything else, and `cargo xtask ci`
//! lists the skips. Under `CI=true` the same call panics instead: CI has the fixtures and Python
//! (`.ci/run` runs beside `../shared` and `cargo xtask ci` installs the venv), so a skip there
//! means a check silently stopped checking.

use std::fmt::Display;

/// Whether skipping is refused: `CI` is set to anything but `false`/`0`/empty (CI systems set
/// `CI=true`; `.ci/run` exports it).
fn in_ci() -> bool {
    refuses_skips(std::env::var("CI").ok().as_deref())
}

fn refuses_skips(ci: Option<&str>) -> bool {
    ci.is_some_and(|v| !matches!(v.trim(), "" | "0" | "false"))
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

#[cfg(test)]
mod tests {
    use std::process::Command;

    use super::*;

    #[test]
    fn ci_values_that_refuse_skips() {
        for (ci, refused) in [
            (None, false),
            (Some(""), false),
            (Some("false"), false),
            (Some("0"), false),
            (Some("true"), true),
            (Some("1"), true),
        ] {
            assert_eq!(refuses_skips(ci), refused, "CI={ci:?}");
        }
    }

    /// Runs this very test again in a child process with `CI` set: the child skips, which must
    /// pass locally and fail under `CI=true` (the environment cannot be changed in-process here:
    /// `set_var` is unsafe and the workspace denies unsafe code).
    #[test]
    fn a_skip_passes_locally_and_fails_under_ci() {
        if std::env::var_os("KVSIGHT_HARNESS_SKIP_CHILD").is_some() {
            skip("child", "nothing to check here");
            return;
        }
        let run = |ci: &str| {
            Command::new(std::env::current_exe().unwrap())
                .args([
                    "--exact",
                    "skip::tests::a_skip_passes_locally_and_fails_under_ci",
                ])
                .args(["--nocapture", "--test-threads", "1"])
                .env("KVSIGHT_HARNESS_SKIP_CHILD", "1")
                .env("CI", ci)
                .output()
                .unwrap()
        };
        let local = run("false");
        let text = String::from_utf8_lossy(&local.stderr);
        assert!(local.status.success(), "{text}");
        assert!(
            text.contains("skipped: child: nothing to check here"),
            "{text}"
        );
        let ci = run("true");
        let text = String::from_utf8_lossy(&ci.stderr);
        assert!(!ci.status.success(), "{text}");
        assert!(
            text.contains("CI=true: tests may not skip themselves"),
            "{text}"
        );
    }
}
