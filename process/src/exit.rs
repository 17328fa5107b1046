//! How the binaries end: the exit code for a wrong configuration and the one block that builds
//! the runtime, runs the program on it and turns the outcome into an exit code, so the router,
//! the sidecar and the simulator report failures alike.

use std::fmt::Display;
use std::future::Future;
use std::process::ExitCode;

/// BSD `EX_USAGE`: the configuration (flags, environment, config file) is wrong, so restarting
/// will not help; a supervisor can tell it from a crash.
pub const EXIT_CONFIG: u8 = 64;

/// Prints `<program>: <message>` and returns [`EXIT_CONFIG`].
pub fn config_error(program: &str, message: impl Display) -> ExitCode {
    eprintln!("{program}: {message}");
    ExitCode::from(EXIT_CONFIG)
}

/// Builds `runtime` (with every driver enabled), runs `serve` on it to the end and maps the
/// outcome: `Ok` exits 0; an error `is_config` accepts exits [`EXIT_CONFIG`] after
/// `<program>: configuration error: <error>`; any other error, or a runtime that cannot be built,
/// exits 1 after `<program>: <error>` (`{:#}`, so an `anyhow` error prints its causes).
pub fn run_to_exit<E: Display>(
    program: &str,
    mut runtime: tokio::runtime::Builder,
    serve: impl Future<Output = Result<(), E>>,
    is_config: impl FnOnce(&E) -> bool,
) -> ExitCode {
    let runtime = match runtime.enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("{program}: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(serve) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) if is_config(&e) => {
            config_error(program, format_args!("configuration error: {e:#}"))
        }
        Err(e) => {
            eprintln!("{program}: {e:#}");
            ExitCode::FAILURE
        }
    }
}
