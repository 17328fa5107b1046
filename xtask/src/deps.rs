//! `cargo xtask deps`: the crate graph stays one-way. Every dependency between workspace crates
//! counts, dev-dependencies included: a dev-dependency cycle (router → testbed → router, as it
//! once was) makes an edit to one crate rebuild the other's tests and hides which crate owns a
//! helper. A crate's dev-dependency on itself (to turn on one of its own features in its tests)
//! is not a cycle.

use std::collections::{BTreeMap, BTreeSet};
use std::process::Command;

use anyhow::{Context, Result, bail};

/// Crates that stand in front of or beside the router and the sidecar and must never depend on
/// either, in any section: the simulator is the engine both talk to (as Dynamo keeps its mocker
/// apart), the rest sit below them.
const BELOW_ROUTER_AND_SIDECAR: [&str; 5] = [
    "kvsight-protocol",
    "kvsight-tokenizer",
    "kvsight-process",
    "kvsight-harness",
    "kvsight-sim",
];

/// Crates that must not reach another, directly or through any workspace crate between, and why.
const NEVER_REACHES: [(&str, &str, &str); 3] = [
    (
        "kvsight-sim",
        "kvsight-transport",
        "the simulator speaks HTTP and ZMQ only and must not link QUIC or TLS",
    ),
    (
        "kvsight-process",
        "kvsight-transport",
        "process plumbing sits below the transport",
    ),
    (
        "kvsight-bench",
        "kvsight-testbed",
        "the bench runs real processes and needs none of the loopback test cluster",
    ),
];

/// Reads the workspace's crates from `cargo metadata` and fails on a cycle or a forbidden edge.
pub(crate) fn deps_check() -> Result<()> {
    let out = crate::stdout_of(
        "cargo metadata",
        Command::new(crate::cargo()).args([
            "metadata",
            "--format-version",
            "1",
            "--no-deps",
            "--locked",
        ]),
    )?;
    let meta: serde_json::Value = serde_json::from_slice(&out).context("parsing cargo metadata")?;
    let graph = workspace_graph(&meta)?;
    check(&graph)?;
    println!(
        "xtask deps: {} workspace crates, no dependency cycle (dev-dependencies included)",
        graph.len()
    );
    Ok(())
}

/// Workspace crate → the workspace crates it depends on (normal, build and dev), self excluded.
fn workspace_graph(meta: &serde_json::Value) -> Result<BTreeMap<String, BTreeSet<String>>> {
    let packages = meta["packages"]
        .as_array()
        .context("cargo metadata: no packages")?;
    let names: BTreeSet<&str> = packages.iter().filter_map(|p| p["name"].as_str()).collect();
    let mut graph = BTreeMap::new();
    for p in packages {
        let name = p["name"].as_str().context("a package without a name")?;
        let deps = p["dependencies"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|d| d["name"].as_str())
            .filter(|d| names.contains(d) && *d != name)
            .map(str::to_owned)
            .collect();
        graph.insert(name.to_owned(), deps);
    }
    Ok(graph)
}

fn check(graph: &BTreeMap<String, BTreeSet<String>>) -> Result<()> {
    if let Some(cycle) = find_cycle(graph) {
        bail!("dependency cycle: {}", cycle.join(" -> "));
    }
    for below in BELOW_ROUTER_AND_SIDECAR {
        for above in ["kvsight-router", "kvsight-sidecar"] {
            if graph.get(below).is_some_and(|d| d.contains(above)) {
                bail!("{below} depends on {above}; it must stay below both");
            }
        }
    }
    for (from, to, why) in NEVER_REACHES {
        if reaches(graph, from, to) {
            bail!("{from} reaches {to}: {why}");
        }
    }
    Ok(())
}

/// Whether `to` is among `from`'s dependencies, directly or through other workspace crates.
fn reaches(graph: &BTreeMap<String, BTreeSet<String>>, from: &str, to: &str) -> bool {
    let mut seen = BTreeSet::new();
    let mut todo = vec![from];
    while let Some(node) = todo.pop() {
        for dep in graph.get(node).into_iter().flatten() {
            if dep == to {
                return true;
            }
            if seen.insert(dep.as_str()) {
                todo.push(dep);
            }
        }
    }
    false
}

/// One cycle as the path `a -> b -> … -> a`, or `None` when the graph has none.
fn find_cycle(graph: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    #[derive(Clone, Copy, PartialEq)]
    enum Mark {
        Open,
        Done,
    }
    fn visit<'a>(
        node: &'a str,
        graph: &'a BTreeMap<String, BTreeSet<String>>,
        marks: &mut BTreeMap<&'a str, Mark>,
        path: &mut Vec<&'a str>,
    ) -> Option<Vec<String>> {
        match marks.get(node) {
            Some(Mark::Done) => return None,
            Some(Mark::Open) => {
                let start = path
                    .iter()
                    .position(|n| *n == node)
                    .expect("open on the path");
                let mut cycle: Vec<String> = path[start..].iter().map(|n| n.to_string()).collect();
                cycle.push(node.to_owned());
                return Some(cycle);
            }
            None => {}
        }
        marks.insert(node, Mark::Open);
        path.push(node);
        for dep in graph.get(node).into_iter().flatten() {
            if let Some(cycle) = visit(dep, graph, marks, path) {
                return Some(cycle);
            }
        }
        path.pop();
        marks.insert(node, Mark::Done);
        None
    }
    let mut marks = BTreeMap::new();
    for node in graph.keys() {
        if let Some(cycle) = visit(node, graph, &mut marks, &mut Vec::new()) {
            return Some(cycle);
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn graph(edges: &[(&str, &str)]) -> BTreeMap<String, BTreeSet<String>> {
        let mut g: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        for (a, b) in edges {
            g.entry((*a).to_owned())
                .or_default()
                .insert((*b).to_owned());
            g.entry((*b).to_owned()).or_default();
        }
        g
    }

    #[test]
    fn a_dev_dependency_cycle_is_found_and_named() {
        let g = graph(&[
            ("kvsight-router", "kvsight-testbed"),
            ("kvsight-testbed", "kvsight-router"),
            ("kvsight-testbed", "kvsight-protocol"),
        ]);
        let cycle = find_cycle(&g).expect("a cycle");
        assert_eq!(cycle.first(), cycle.last());
        assert!(cycle.contains(&"kvsight-router".to_owned()));
        assert!(cycle.contains(&"kvsight-testbed".to_owned()));
        assert!(check(&g).is_err());
    }

    #[test]
    fn a_one_way_graph_passes() {
        let g = graph(&[
            ("kvsight-testbed", "kvsight-router"),
            ("kvsight-testbed", "kvsight-sidecar"),
            ("kvsight-router", "kvsight-sim"),
            ("kvsight-sidecar", "kvsight-sim"),
            ("kvsight-sim", "kvsight-protocol"),
        ]);
        assert_eq!(find_cycle(&g), None);
        assert!(check(&g).is_ok());
    }

    #[test]
    fn the_simulator_may_not_depend_on_the_sidecar() {
        let g = graph(&[("kvsight-sim", "kvsight-sidecar")]);
        let e = check(&g).unwrap_err().to_string();
        assert!(e.contains("kvsight-sim depends on kvsight-sidecar"), "{e}");
    }

    #[test]
    fn the_simulator_may_not_reach_the_transport_through_another_crate() {
        let g = graph(&[
            ("kvsight-sim", "kvsight-process"),
            ("kvsight-process", "kvsight-transport"),
        ]);
        let e = check(&g).unwrap_err().to_string();
        assert!(e.contains("kvsight-sim reaches kvsight-transport"), "{e}");
        let g = graph(&[("kvsight-bench", "kvsight-testbed")]);
        assert!(check(&g).is_err());
    }

    #[test]
    fn this_workspace_is_one_way() {
        let out = Command::new(crate::cargo())
            .args([
                "metadata",
                "--format-version",
                "1",
                "--no-deps",
                "--offline",
            ])
            .current_dir(crate::workspace_root())
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let meta: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        let graph = workspace_graph(&meta).unwrap();
        assert!(graph.contains_key("kvsight-sim"), "{graph:?}");
        check(&graph).unwrap();
    }
}
