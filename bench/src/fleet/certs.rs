//! The fleet's certificates, from one throw-away CA (`kvsight_transport::dev_certs`): one leaf
//! per router (valid for loopback) and one per emulated pod, named as the module docs of
//! [`crate::fleet`] say.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use kvsight_transport::TlsFiles;
use kvsight_transport::dev_certs::DevCa;

use super::{NAMESPACE, SIDECAR_NAME, pod_ip, pod_name};

/// A folder of PEM files: `ca.pem`, `routers/router-J{,-key}.pem`, `pods/<pod>{,-key}.pem`.
#[derive(Debug, Clone)]
pub struct FleetCerts {
    pub dir: PathBuf,
}

impl FleetCerts {
    /// Issues leaves for `routers` routers and `pods` pods into `dir` (emptied first).
    pub fn issue(dir: &Path, routers: usize, pods: usize) -> Result<FleetCerts> {
        let _ = std::fs::remove_dir_all(dir);
        for sub in ["routers", "pods"] {
            std::fs::create_dir_all(dir.join(sub))
                .with_context(|| format!("creating {}", dir.join(sub).display()))?;
        }
        let ca = DevCa::new("kvsight-fleet-ca")?;
        std::fs::write(dir.join("ca.pem"), ca.ca_pem())?;
        let certs = FleetCerts {
            dir: dir.to_owned(),
        };
        for j in 0..routers {
            let name = router_name(j);
            let leaf = ca.issue(&name, &["127.0.0.1", "localhost", &name])?;
            certs.write(&certs.router(j), &leaf.cert, &leaf.key)?;
        }
        for i in 0..pods {
            let name = pod_name(i);
            let fqdn = format!("{name}.{NAMESPACE}");
            let ip = pod_ip(i).to_string();
            // The URI SAN grants the pod its name: routers check it (`pods.identity`).
            let grant = kvsight_transport::pod_uri(NAMESPACE, &name);
            let leaf = ca.issue(&name, &[&name, &fqdn, SIDECAR_NAME, &ip, &grant])?;
            certs.write(&certs.pod(i), &leaf.cert, &leaf.key)?;
        }
        Ok(certs)
    }

    fn write(&self, files: &TlsFiles, cert: &str, key: &str) -> Result<()> {
        std::fs::write(&files.cert, cert)?;
        std::fs::write(&files.key, key)?;
        Ok(())
    }

    /// Router `j`'s files.
    pub fn router(&self, j: usize) -> TlsFiles {
        self.files("routers", &router_name(j))
    }

    /// Pod `i`'s files.
    pub fn pod(&self, i: usize) -> TlsFiles {
        self.files("pods", &pod_name(i))
    }

    fn files(&self, sub: &str, name: &str) -> TlsFiles {
        let dir = self.dir.join(sub);
        TlsFiles {
            cert: dir.join(format!("{name}.pem")),
            key: dir.join(format!("{name}-key.pem")),
            ca: self.dir.join("ca.pem"),
        }
    }
}

/// Router `j`'s name: its router id, certificate and log.
pub fn router_name(j: usize) -> String {
    format!("router-{j}")
}
