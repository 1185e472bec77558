//! Throwaway certificates made with the `openssl` command line tool.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// A CA, a server certificate for `127.0.0.1` and `localhost`, and a client
/// certificate, all PEM files in one directory.
#[derive(Debug, Clone)]
pub(crate) struct TlsFiles {
    /// The CA certificate that signed both other certificates.
    pub(crate) ca_cert: PathBuf,
    /// The CA's private key.
    pub(crate) ca_key: PathBuf,
    /// The server certificate (`serverAuth`, SAN `IP:127.0.0.1`, `DNS:localhost`).
    pub(crate) server_cert: PathBuf,
    /// The server's private key.
    pub(crate) server_key: PathBuf,
    /// The client certificate (`clientAuth`, CN `client`).
    pub(crate) client_cert: PathBuf,
    /// The client's private key (PKCS#8).
    pub(crate) client_key: PathBuf,
}

impl TlsFiles {
    /// Generates fresh P-256 keys and certificates valid for two days in `dir`.
    ///
    /// # Panics
    ///
    /// Panics if `openssl` is missing or fails.
    pub(crate) fn generate(dir: &Path) -> TlsFiles {
        let path = |name: &str| dir.join(name);
        let files = TlsFiles {
            ca_cert: path("ca.crt"),
            ca_key: path("ca.key"),
            server_cert: path("server.crt"),
            server_key: path("server.key"),
            client_cert: path("client.crt"),
            client_key: path("client.key"),
        };
        let server_ext = path("server.ext");
        let client_ext = path("client.ext");
        write(
            &server_ext,
            "basicConstraints=CA:FALSE\n\
             keyUsage=critical,digitalSignature\n\
             extendedKeyUsage=serverAuth\n\
             subjectAltName=IP:127.0.0.1,DNS:localhost\n",
        );
        write(
            &client_ext,
            "basicConstraints=CA:FALSE\n\
             keyUsage=critical,digitalSignature\n\
             extendedKeyUsage=clientAuth\n",
        );

        let mut ca = openssl();
        ca.args(["req", "-x509", "-new", "-nodes", "-days", "2"])
            .args(["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1"])
            .args(["-subj", "/CN=respire test CA"])
            .args(["-addext", "basicConstraints=critical,CA:TRUE"])
            .args(["-addext", "keyUsage=critical,keyCertSign,cRLSign"])
            .arg("-keyout")
            .arg(&files.ca_key)
            .arg("-out")
            .arg(&files.ca_cert);
        run(ca);
        files.sign(
            "localhost",
            2,
            &files.server_key,
            &files.server_cert,
            &server_ext,
        );
        files.sign(
            "client",
            3,
            &files.client_key,
            &files.client_cert,
            &client_ext,
        );
        files
    }

    /// Makes a key and a certificate for `cn` signed by the CA.
    fn sign(&self, cn: &str, serial: u32, key: &Path, cert: &Path, ext: &Path) {
        let csr = cert.with_extension("csr");
        let mut request = openssl();
        request
            .args(["req", "-new", "-nodes"])
            .args(["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1"])
            .arg("-subj")
            .arg(format!("/CN={cn}"))
            .arg("-keyout")
            .arg(key)
            .arg("-out")
            .arg(&csr);
        run(request);
        let mut signing = openssl();
        signing
            .args(["x509", "-req", "-days", "2"])
            .arg("-set_serial")
            .arg(serial.to_string())
            .arg("-in")
            .arg(&csr)
            .arg("-CA")
            .arg(&self.ca_cert)
            .arg("-CAkey")
            .arg(&self.ca_key)
            .arg("-extfile")
            .arg(ext)
            .arg("-out")
            .arg(cert);
        run(signing);
    }

    /// The CA certificate, PEM.
    pub(crate) fn ca_cert_pem(&self) -> Vec<u8> {
        read(&self.ca_cert)
    }

    /// The client certificate, PEM.
    pub(crate) fn client_cert_pem(&self) -> Vec<u8> {
        read(&self.client_cert)
    }

    /// The client's private key, PEM.
    pub(crate) fn client_key_pem(&self) -> Vec<u8> {
        read(&self.client_key)
    }

    /// CA and client certificate for `redis::Client::build_with_tls`.
    #[cfg(feature = "tls")]
    pub(crate) fn redis_certificates(&self) -> redis::TlsCertificates {
        redis::TlsCertificates {
            client_tls: Some(redis::ClientTlsConfig {
                client_cert: self.client_cert_pem(),
                client_key: self.client_key_pem(),
            }),
            root_cert: Some(self.ca_cert_pem()),
        }
    }
}

/// Installs rustls' ring crypto provider for this process unless one is
/// installed already; rustls needs one before the first TLS connection.
#[cfg(feature = "tls")]
pub(crate) fn install_crypto_provider() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}

fn openssl() -> Command {
    let mut cmd = Command::new("openssl");
    cmd.stdin(Stdio::null());
    cmd
}

fn run(mut cmd: Command) {
    let output = cmd
        .output()
        .unwrap_or_else(|e| panic!("cannot run openssl (is it installed?): {e}"));
    assert!(
        output.status.success(),
        "{cmd:?} failed with {}:\n{}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
}

fn write(path: &Path, contents: &str) {
    fs::write(path, contents).unwrap_or_else(|e| panic!("cannot write {}: {e}", path.display()));
}

fn read(path: &Path) -> Vec<u8> {
    fs::read(path).unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()))
}
