//! docs/configuration.md's sidecar table is the sidecar's real flag list: every flag, its
//! environment variable and its default, as clap defines them.

use clap::CommandFactory;
use kvsight_harness::reference::{Flag, assert_none, check_flags, page};
use kvsight_sidecar::config::Args;

#[test]
fn the_configuration_reference_lists_every_sidecar_flag_with_its_variable_and_default() {
    let flags: Vec<Flag> = Args::command()
        .get_arguments()
        .filter_map(|a| {
            let long = a.get_long()?;
            let default = a
                .get_default_values()
                .first()
                .map(|d| d.to_string_lossy().into_owned())
                .filter(|d| !d.is_empty());
            Some(Flag {
                long: long.to_owned(),
                env: a.get_env().map(|e| e.to_string_lossy().into_owned()),
                default,
            })
        })
        .collect();
    assert!(flags.len() > 10, "{flags:?}");
    let (path, text) = page();
    assert_none(&path, &check_flags(&text, "Sidecar: command line", &flags));
}
