//! docs/configuration.md's router tables are the router's real options: every flag with its
//! environment variable and default (read from the binary's own `--help`, since the flags live
//! in `main.rs`), and every config-file key with its default (from `RouterConfig::default()`
//! serialized, and a minimal pool for the keys of `pools[]`).

use kvsight_harness::reference::{Flag, Key, assert_none, check_flags, check_keys, page};
use kvsight_router::config::RouterConfig;
use serde_json::Value;

/// The flags `kvsight-router --help` lists: long name, `[env: …]` and `[default: …]`.
fn flags_from_help(help: &str) -> Vec<Flag> {
    let mut flags: Vec<Flag> = Vec::new();
    for line in help.lines() {
        let trimmed = line.trim_start();
        // An option line: `-x, --name <VALUE>  help…` or `--name  help…`.
        let long = trimmed
            .strip_prefix('-')
            .and_then(|_| trimmed.split_whitespace().find(|w| w.starts_with("--")));
        if let Some(long) = long {
            flags.push(Flag {
                long: long
                    .trim_start_matches('-')
                    .trim_end_matches(',')
                    .to_owned(),
                env: None,
                default: None,
            });
        }
        let Some(flag) = flags.last_mut() else {
            continue;
        };
        if let Some(env) = bracket(line, "[env: ") {
            flag.env = Some(env.split('=').next().unwrap_or_default().to_owned());
        }
        if let Some(default) = bracket(line, "[default: ") {
            flag.default = Some(default).filter(|d| !d.is_empty());
        }
    }
    flags.retain(|f| f.long != "help" && f.long != "version");
    flags
}

/// The text between `open` and the next `]` in `line`.
fn bracket(line: &str, open: &str) -> Option<String> {
    let start = line.find(open)? + open.len();
    let len = line[start..].find(']')?;
    Some(line[start..start + len].to_owned())
}

#[test]
fn the_configuration_reference_lists_every_router_flag_with_its_variable_and_default() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvsight-router"))
        .arg("--help")
        // The help shows a set variable's value in `[env: NAME=value]`: none set.
        .env_clear()
        .output()
        .expect("running kvsight-router --help");
    assert!(out.status.success(), "{out:?}");
    let help = String::from_utf8(out.stdout).unwrap();
    let flags = flags_from_help(&help);
    assert!(
        flags.iter().any(|f| f.long == "quic-listen"
            && f.env.as_deref() == Some("KVSIGHT_QUIC_LISTEN")
            && f.default.as_deref() == Some("0.0.0.0:4433")),
        "the help's format changed; read: {flags:#?}\n{help}"
    );
    let (path, text) = page();
    assert_none(&path, &check_flags(&text, "Router: command line", &flags));
}

/// Every leaf of `value` under `prefix`: objects are walked (an empty one is a leaf: a map
/// with no entries), anything else is a key with its value.
fn leaves(prefix: &str, value: &Value, out: &mut Vec<Key>) {
    match value {
        Value::Object(map) if !map.is_empty() => {
            for (k, v) in map {
                let path = if prefix.is_empty() {
                    k.clone()
                } else {
                    format!("{prefix}.{k}")
                };
                leaves(&path, v, out);
            }
        }
        Value::Null => out.push(Key {
            path: prefix.to_owned(),
            default: None,
        }),
        Value::String(s) => out.push(Key {
            path: prefix.to_owned(),
            default: Some(s.clone()),
        }),
        other => out.push(Key {
            path: prefix.to_owned(),
            default: Some(other.to_string()),
        }),
    }
}

#[test]
fn the_configuration_reference_lists_every_config_key_with_its_default() {
    let mut keys = Vec::new();
    leaves(
        "",
        &serde_json::to_value(RouterConfig::default()).unwrap(),
        &mut keys,
    );
    // A pool's keys, from the smallest valid pool: the two it sets are required.
    const REQUIRED: [&str; 2] = ["name", "models"];
    let minimal = RouterConfig::from_yaml("pools: [{name: p, models: [m]}]").unwrap();
    let pool = serde_json::to_value(&minimal).unwrap()["pools"][0].clone();
    let mut pool_keys = Vec::new();
    leaves("pools[]", &pool, &mut pool_keys);
    for key in &mut pool_keys {
        if REQUIRED.iter().any(|r| key.path == format!("pools[].{r}")) {
            key.default = None;
        }
    }
    keys.extend(pool_keys);
    assert!(
        keys.iter().any(|k| k.path == "scheduler.weights.prefix"),
        "{keys:#?}"
    );
    let (path, text) = page();
    assert_none(&path, &check_keys(&text, "Router: config file", &keys));
}
