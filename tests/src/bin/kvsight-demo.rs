//! `kvsight-demo` (run by `cargo xtask demo`): starts a loopback cluster — vllm-sim pods, one
//! sidecar each, a router, throw-away mutual-TLS certificates — runs the three endpoint-picking
//! experiments and prints a verdict per experiment. Exit status 0 when every expectation holds,
//! 1 when one fails, 2 when the cluster could not run, 64 on a bad flag.

use clap::Parser;
use kvsight_testbed::demo::{self, DemoOptions};

/// Prove kvsight routes on what pods really hold, against the engines' own counters.
#[derive(Debug, Parser)]
#[command(name = "kvsight-demo", version)]
struct Args {
    /// Number of vllm-sim pods (each with its sidecar).
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u16).range(2..=16))]
    pods: u16,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    json: bool,
    /// Leave the cluster running after the experiments, until Ctrl-C.
    #[arg(long)]
    serve: bool,
}

#[tokio::main]
async fn main() {
    let args = Args::try_parse().unwrap_or_else(|e| {
        let usage = e.use_stderr();
        let _ = e.print();
        std::process::exit(if usage { 64 } else { 0 });
    });
    // Components log warnings and errors only: the table is the output.
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "warn,quinn=error,quinn_proto=error".into()),
        )
        .init();
    let options = DemoOptions {
        pods: usize::from(args.pods),
    };
    if !args.json {
        eprintln!(
            "kvsight-demo: starting {} vllm-sim pods, {} sidecars and a router on loopback…",
            options.pods, options.pods
        );
    }
    let mut cluster = match demo::start_cluster(&options).await {
        Ok(c) => c,
        Err(e) => {
            eprintln!("kvsight-demo: the cluster did not start: {e}");
            std::process::exit(2);
        }
    };
    let report = match demo::run_experiments(&mut cluster).await {
        Ok(r) => r,
        Err(e) => {
            eprintln!("kvsight-demo: {e}");
            std::process::exit(2);
        }
    };
    if args.json {
        println!("{}", report.to_json());
    } else {
        print!("{}", report.to_table());
    }
    if args.serve {
        // Installed before the cluster is announced: a Ctrl-C that comes before its handler
        // would kill the process without stopping the cluster (the test sends one as soon as
        // the router answers).
        let interrupted = kvsight_process::signal::termination();
        println!("router: {}", cluster.routers[0].url());
        println!(
            "router admin (/metrics, /debug/pods): {}",
            cluster.routers[0].admin_url()
        );
        for pod in &cluster.pods {
            println!(
                "{}: vllm {} sidecar {}",
                pod.spec.name,
                pod.vllm_url(),
                pod.sidecar().url()
            );
        }
        println!(
            "model: {}; try: curl -s {}/v1/completions -H 'content-type: application/json' \
             -H 'x-kvsight-debug: 1' -d '{{\"model\":\"{}\",\"prompt\":\"Hello\",\"max_tokens\":8}}'",
            demo::MODEL,
            cluster.routers[0].url(),
            demo::MODEL
        );
        println!("Ctrl-C stops the cluster.");
        interrupted.await;
    }
    let ok = report.ok();
    cluster.shutdown().await;
    std::process::exit(if ok { 0 } else { 1 });
}
