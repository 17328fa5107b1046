//! Throw-away certificate authorities for tests, the demo and local clusters (feature
//! `dev-certs`). Production certificates come from the operator's PKI (cert-manager in the chart).

use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, IsCa, KeyPair, KeyUsagePurpose,
};

use crate::{TlsFiles, TlsMaterial, TransportError};

/// A certificate and its key, PEM-encoded.
#[derive(Debug, Clone)]
pub struct IssuedPem {
    pub cert: String,
    pub key: String,
}

/// A self-signed CA that issues leaf certificates valid for both client and server auth.
pub struct DevCa {
    issuer: CertifiedIssuer<'static, KeyPair>,
}

impl std::fmt::Debug for DevCa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DevCa").finish_non_exhaustive()
    }
}

fn err(e: rcgen::Error) -> TransportError {
    TransportError::Tls(format!("certificate generation: {e}"))
}

impl DevCa {
    /// A fresh CA named `name`.
    pub fn new(name: &str) -> Result<Self, TransportError> {
        let mut params = CertificateParams::new(Vec::<String>::new()).map_err(err)?;
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, name);
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let key = KeyPair::generate().map_err(err)?;
        Ok(DevCa {
            issuer: CertifiedIssuer::self_signed(params, key).map_err(err)?,
        })
    }

    /// The CA certificate, PEM.
    pub fn ca_pem(&self) -> String {
        self.issuer.pem()
    }

    /// A leaf for `common_name`, valid for the DNS names / IP addresses in `sans`; a SAN with
    /// `://` in it is a URI (`kvsight://pod/<namespace>/<name>` grants a sidecar its pod name).
    pub fn issue(&self, common_name: &str, sans: &[&str]) -> Result<IssuedPem, TransportError> {
        self.issue_until(common_name, sans, None)
    }

    /// [`issue`](Self::issue) with the certificate's end of validity (default: far ahead).
    pub fn issue_until(
        &self,
        common_name: &str,
        sans: &[&str],
        not_after: Option<std::time::SystemTime>,
    ) -> Result<IssuedPem, TransportError> {
        let (uris, names): (Vec<&str>, Vec<&str>) = sans.iter().partition(|s| s.contains("://"));
        let mut params =
            CertificateParams::new(names.iter().map(|s| s.to_string()).collect::<Vec<_>>())
                .map_err(err)?;
        for uri in uris {
            let uri = rcgen::string::Ia5String::try_from(uri.to_owned()).map_err(err)?;
            params.subject_alt_names.push(rcgen::SanType::URI(uri));
        }
        if let Some(t) = not_after {
            params.not_after = time::OffsetDateTime::from(t);
        }
        params
            .distinguished_name
            .push(DnType::CommonName, common_name);
        params.extended_key_usages = vec![
            rcgen::ExtendedKeyUsagePurpose::ServerAuth,
            rcgen::ExtendedKeyUsagePurpose::ClientAuth,
        ];
        let key = KeyPair::generate().map_err(err)?;
        let cert = params.signed_by(&key, &self.issuer).map_err(err)?;
        Ok(IssuedPem {
            cert: cert.pem(),
            key: key.serialize_pem(),
        })
    }

    /// TLS material from an issued leaf, trusting this CA.
    pub fn material_of(&self, leaf: &IssuedPem) -> Result<TlsMaterial, TransportError> {
        TlsMaterial::from_pem(
            leaf.cert.as_bytes(),
            leaf.key.as_bytes(),
            self.ca_pem().as_bytes(),
        )
    }

    /// A leaf for `common_name` as ready-to-use TLS material trusting this CA.
    pub fn material(
        &self,
        common_name: &str,
        sans: &[&str],
    ) -> Result<TlsMaterial, TransportError> {
        let leaf = self.issue(common_name, sans)?;
        TlsMaterial::from_pem(
            leaf.cert.as_bytes(),
            leaf.key.as_bytes(),
            self.ca_pem().as_bytes(),
        )
    }

    /// Writes `ca.pem`, `<name>.pem` and `<name>-key.pem` for each leaf into `dir`.
    pub fn write_leaves(
        &self,
        dir: &Path,
        leaves: &[(&str, &[&str])],
    ) -> Result<(), TransportError> {
        let io = |e: std::io::Error| TransportError::Tls(format!("writing certificates: {e}"));
        std::fs::create_dir_all(dir).map_err(io)?;
        write_whole(&dir.join("ca.pem"), self.ca_pem().as_bytes()).map_err(io)?;
        for (name, sans) in leaves {
            let leaf = self.issue(name, sans)?;
            write_whole(&dir.join(format!("{name}.pem")), leaf.cert.as_bytes()).map_err(io)?;
            write_whole(&dir.join(format!("{name}-key.pem")), leaf.key.as_bytes()).map_err(io)?;
        }
        Ok(())
    }
}

/// Replaces `path` in one step (a sibling temporary file renamed over it). The folder's `ca.pem`
/// is written again for every leaf, while processes started with earlier leaves read it: a
/// truncate-then-write let one read an empty file ("CA bundle holds no certificate", seen in a
/// bench run starting three routers in a row).
fn write_whole(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    // Unique per process and call: two threads of one process may write the same folder.
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(format!(".tmp-{}-{n}", std::process::id()));
    std::fs::write(&tmp, bytes)?;
    std::fs::rename(&tmp, path)
}

/// TLS files laid out as the kubelet mounts a Secret — `tls.crt -> ..data/tls.crt`, `..data ->
/// ..vN` — so tests can renew certificates the way a cluster does. Removed on drop.
#[derive(Debug)]
pub struct SecretDir {
    root: PathBuf,
    version: u32,
}

impl SecretDir {
    /// An empty layout in a fresh folder under the system's temp dir; [`publish`](Self::publish)
    /// fills it.
    pub fn new(tag: &str) -> std::io::Result<Self> {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or_default();
        let root =
            std::env::temp_dir().join(format!("kvsight-tls-{tag}-{}-{nanos}", std::process::id()));
        std::fs::create_dir_all(&root)?;
        for name in ["tls.crt", "tls.key", "ca.crt"] {
            std::os::unix::fs::symlink(Path::new("..data").join(name), root.join(name))?;
        }
        Ok(SecretDir { root, version: 0 })
    }

    /// The three paths a program is configured with.
    pub fn files(&self) -> TlsFiles {
        TlsFiles {
            cert: self.root.join("tls.crt"),
            key: self.root.join("tls.key"),
            ca: self.root.join("ca.crt"),
        }
    }

    /// What the kubelet does on a Secret update: write a new folder, then swap `..data` to it
    /// with one rename.
    pub fn publish(&mut self, cert: &str, key: &str, ca: &str) -> std::io::Result<()> {
        self.version += 1;
        let folder = format!("..v{}", self.version);
        let dir = self.root.join(&folder);
        std::fs::create_dir(&dir)?;
        std::fs::write(dir.join("tls.crt"), cert)?;
        std::fs::write(dir.join("tls.key"), key)?;
        std::fs::write(dir.join("ca.crt"), ca)?;
        let tmp = self.root.join("..data_tmp");
        std::os::unix::fs::symlink(&folder, &tmp)?;
        std::fs::rename(&tmp, self.root.join("..data"))
    }

    /// [`publish`](Self::publish) a leaf of `ca` with `ca`'s certificate as the bundle.
    pub fn publish_leaf(&mut self, leaf: &IssuedPem, ca: &DevCa) -> std::io::Result<()> {
        self.publish(&leaf.cert, &leaf.key, &ca.ca_pem())
    }
}

impl Drop for SecretDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.root);
    }
}
