//! Coordinators for the deployments the subcommands are pointed at: the URL,
//! the key options and the TLS files of the command line, and the key layout
//! every mode of `run` shares.

use respire_coordination::{Coordinator, CoordinatorBuilder, Error};

use crate::args::{KeyOptions, TlsOptions, Usage};

/// The base key of KEY, before the prefix: `{KEY}`. Every mode lays its keys
/// out under it (`{KEY}:w`, `{KEY}:r`, `{KEY}:q`, `{KEY}:fence`,
/// `{KEY}:permits`, `{KEY}:meta`, `{KEY}:slots`), so they all hash to one
/// cluster slot and see each other.
pub(crate) fn base(key: &str) -> String {
    format!("{{{key}}}")
}

/// The key a Redlock run sets on every node, before the nodes' prefix: the
/// exclusive key of the layout.
pub(crate) fn redlock_key(key: &str) -> String {
    format!("{}:w", base(key))
}

/// TLS material read from the files named on the command line.
#[derive(Clone, Default)]
pub(crate) struct Tls {
    ca: Option<Vec<u8>>,
    client: Option<(Vec<u8>, Vec<u8>)>,
}

impl Tls {
    /// Reads the files; a file that cannot be read is a usage error.
    pub(crate) fn read(options: &TlsOptions, subcommand: &str) -> Result<Tls, Usage> {
        crate::args::check_tls(options, subcommand)?;
        let read = |path: &std::path::Path, what: &str| {
            std::fs::read(path).map_err(|e| {
                Usage::new(
                    format!("cannot read the {what} {}: {e}", path.display()),
                    Some(subcommand),
                )
            })
        };
        let ca = options
            .tls_ca
            .as_deref()
            .map(|p| read(p, "--tls-ca file"))
            .transpose()?;
        let client = match (&options.tls_cert, &options.tls_key) {
            (Some(cert), Some(key)) => {
                Some((read(cert, "--tls-cert file")?, read(key, "--tls-key file")?))
            }
            _ => None,
        };
        Ok(Tls { ca, client })
    }

    /// Applies the material to a builder.
    #[cfg(feature = "tls")]
    fn apply(&self, mut builder: CoordinatorBuilder) -> CoordinatorBuilder {
        if let Some(ca) = &self.ca {
            builder = builder.tls_ca_pem(ca.clone());
        }
        if let Some((cert, key)) = &self.client {
            builder = builder.tls_client_cert_pem(cert.clone(), key.clone());
        }
        builder
    }

    /// Without the `tls` feature no material can be given (checked at parse
    /// time).
    #[cfg(not(feature = "tls"))]
    fn apply(&self, builder: CoordinatorBuilder) -> CoordinatorBuilder {
        let _ = (&self.ca, &self.client);
        builder
    }
}

/// Connects to the deployment at `url` with the key options and TLS files;
/// the losses of its leases are heard by [`losses`](crate::losses).
pub(crate) fn connect(url: &str, keys: &KeyOptions, tls: &Tls) -> Result<Coordinator, Error> {
    tls.apply(
        Coordinator::builder(url)
            .key_prefix(&keys.prefix)
            .node_timeout(keys.node_timeout)
            .observer(crate::losses::observer()),
    )
    .build()
}

/// Whether an error of the library is the caller's (a bad URL or setting)
/// rather than the deployment's.
pub(crate) fn is_usage(e: &Error) -> bool {
    matches!(
        e,
        Error::Config(_)
            | Error::InvalidArgument(_)
            | Error::NotIndependent(_)
            | Error::NodeTimeoutTooShort { .. }
            | Error::CapacityMismatch { .. }
    )
}
