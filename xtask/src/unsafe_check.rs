//! The workspace denies `unsafe_code`; one function may lift it (the sidecar's `malloc_trim`,
//! `sidecar/src/memory.rs`). `deny` rather than `forbid` is what lets that one attribute exist,
//! and this check is what keeps it one: any other `allow`/`expect` of `unsafe_code` in a source
//! file, or any manifest relaxing the lint, fails `cargo xtask ci`.

use std::path::Path;

use anyhow::{Context, Result, bail};

/// The only file allowed to lift the lint (relative to the workspace root, `/`-separated).
const ALLOWED: &str = "sidecar/src/memory.rs";

pub(crate) fn unsafe_confined(root: &Path) -> Result<()> {
    let mut files = Vec::new();
    crate::source_files(
        root,
        &|name| name.ends_with(".rs") || name == "Cargo.toml",
        &mut files,
    )?;
    let mut lifts = Vec::new();
    for path in &files {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let rel = path
            .strip_prefix(root)
            .unwrap_or(path)
            .to_string_lossy()
            .replace('\\', "/");
        lifts.extend(offences(&rel, &text));
    }
    if !lifts.is_empty() {
        bail!(
            "`unsafe_code` is lifted outside {ALLOWED}:\n  {}",
            lifts.join("\n  ")
        );
    }
    println!(
        "xtask unsafe: {} files read; `unsafe_code` is lifted only in {ALLOWED}",
        files.len()
    );
    Ok(())
}

/// Where `text` (the file at `rel`) lifts or relaxes the lint, as `file:line: line` strings.
fn offences(rel: &str, text: &str) -> Vec<String> {
    let manifest = rel.ends_with("Cargo.toml");
    text.lines()
        .enumerate()
        .filter(|(_, line)| {
            let code = line.split("//").next().unwrap_or("");
            if manifest {
                // The root's `unsafe_code = "deny"` is the rule itself.
                let l = line.split('#').next().unwrap_or("");
                l.contains("unsafe_code") && !(rel == "Cargo.toml" && l.contains("\"deny\""))
            } else {
                let attr = code.trim_start();
                rel != ALLOWED
                    && (attr.starts_with("#[") || attr.starts_with("#!["))
                    && code.contains("unsafe_code")
                    && (code.contains("allow(") || code.contains("expect("))
            }
        })
        .map(|(i, line)| format!("{rel}:{}: {}", i + 1, line.trim()))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::offences;

    #[test]
    fn only_the_memory_module_may_lift_the_lint() {
        let attr = "#[expect(unsafe_code, reason = \"ffi\")]\nfn f() {}\n";
        assert!(offences("sidecar/src/memory.rs", attr).is_empty());
        assert_eq!(
            offences("router/src/lib.rs", attr),
            ["router/src/lib.rs:1: #[expect(unsafe_code, reason = \"ffi\")]"]
        );
        assert_eq!(offences("a.rs", "#![allow(unsafe_code)]").len(), 1);
        // Mentioning the lint in a comment is not lifting it.
        assert!(offences("a.rs", "// no allow(unsafe_code) here").is_empty());
    }

    #[test]
    fn a_manifest_may_only_deny() {
        assert!(offences("Cargo.toml", "unsafe_code = \"deny\"").is_empty());
        assert_eq!(offences("Cargo.toml", "unsafe_code = \"allow\"").len(), 1);
        assert_eq!(
            offences("sidecar/Cargo.toml", "unsafe_code = \"deny\"").len(),
            1
        );
    }
}
