//! What opening a connection to one server needs: the URL, credentials, TLS
//! material, protocol, timeouts and what to ask `ROLE`.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use redis::{ConnectionAddr, ConnectionInfo, IntoConnectionInfo};

use crate::clock::Clock;
use crate::error::{Error, Result};

use super::url::redact_url;

/// Which RESP version the command connections speak.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Protocol {
    /// RESP2, which every Redis server speaks. The default.
    #[default]
    Resp2,
    /// RESP3 (`HELLO 3`), Redis 6 and later.
    Resp3,
}

/// TLS material for `rediss://` URLs, in PEM form.
#[cfg(feature = "tls")]
#[derive(Clone, Default)]
pub(crate) struct TlsMaterial {
    pub(crate) ca: Option<Vec<u8>>,
    pub(crate) client: Option<(Vec<u8>, Vec<u8>)>,
}

/// What [`Error::Config`] says of a connect or node timeout of zero.
pub(crate) const TIMEOUTS_ZERO: &str = "timeouts must be greater than zero";

/// Everything needed to open a connection to one server.
pub(crate) struct ConnConfig {
    pub(super) client: redis::Client,
    /// RESP2 always: invalidations are received as pub/sub messages.
    pub(super) pubsub_client: redis::Client,
    pub(crate) addr: Arc<str>,
    pub(crate) tls: bool,
    pub(crate) connect_timeout: Duration,
    /// Ask `ROLE` in the setup round trip and refuse a server that is not a
    /// primary (a Sentinel deployment's data nodes), or learn its replicas
    /// (the replication guard).
    pub(crate) role: RoleCheck,
    /// Under `Replication::Require`: how many replicas must acknowledge an
    /// extension (`WAIT` pipelined after it) before it counts, and how long
    /// `WAIT` may block. `None`: extensions count once the primary confirms.
    pub(crate) extension_acks: Option<(u32, Duration)>,
    /// The clock its deadlines are read on.
    pub(crate) clock: Arc<dyn Clock>,
    /// The settings it was made from, to reach other servers of the same
    /// deployment (cluster nodes, a new primary) the same way.
    settings: ConnSettings,
}

/// Whether the setup round trip asks `ROLE`, and what it does with the answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub(crate) enum RoleCheck {
    /// No `ROLE` (a standalone server without the replication guard).
    #[default]
    None,
    /// Learn how many replicas the server has (for `WAIT`).
    Learn,
    /// Learn them, and refuse a server that is not a primary.
    Primary,
}

impl fmt::Debug for ConnConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ConnConfig")
            .field("addr", &self.addr)
            .field("tls", &self.tls)
            .field("connect_timeout", &self.connect_timeout)
            .finish()
    }
}

/// Settings the builder collects for [`ConnConfig::new`].
#[derive(Clone)]
pub(crate) struct ConnSettings {
    pub(crate) url: String,
    pub(crate) username: Option<String>,
    pub(crate) password: Option<String>,
    pub(crate) database: Option<i64>,
    pub(crate) protocol: Protocol,
    pub(crate) connect_timeout: Duration,
    pub(crate) role: RoleCheck,
    /// The clock every deadline is read on (the deployment's).
    pub(crate) clock: Arc<dyn Clock>,
    /// See [`ConnConfig::extension_acks`].
    pub(crate) extension_acks: Option<(u32, Duration)>,
    #[cfg(feature = "tls")]
    pub(crate) tls: TlsMaterial,
}

impl ConnConfig {
    pub(crate) fn new(s: ConnSettings) -> Result<Self> {
        let info: ConnectionInfo = s
            .url
            .as_str()
            .into_connection_info()
            .map_err(|e| Error::Config(format!("{}: {e}", redact_url(&s.url))))?;
        let mut redis_info = info.redis_settings().clone();
        if let Some(user) = &s.username {
            redis_info = redis_info.set_username(user);
        }
        if let Some(password) = &s.password {
            redis_info = redis_info.set_password(password);
        }
        if let Some(db) = s.database {
            if db < 0 {
                return Err(Error::Config(format!("database {db} is negative")));
            }
            redis_info = redis_info.set_db(db);
        }
        redis_info = redis_info
            .set_protocol(match s.protocol {
                Protocol::Resp2 => redis::ProtocolVersion::RESP2,
                Protocol::Resp3 => redis::ProtocolVersion::RESP3,
            })
            .set_skip_set_lib_name();
        let keepalive = socket2::TcpKeepalive::new()
            .with_time(Duration::from_secs(30))
            .with_interval(Duration::from_secs(10));
        let tcp = redis::io::tcp::TcpSettings::default()
            .set_nodelay(true)
            .set_keepalive(keepalive);
        let addr_desc = describe_addr(info.addr(), redis_info.db());
        let tls = matches!(info.addr(), ConnectionAddr::TcpTls { .. });
        if s.connect_timeout.is_zero() {
            return Err(Error::Config(TIMEOUTS_ZERO.into()));
        }
        let pubsub_info = info
            .clone()
            .set_redis_settings(
                redis_info
                    .clone()
                    .set_protocol(redis::ProtocolVersion::RESP2),
            )
            .set_tcp_settings(tcp.clone());
        let info = info.set_redis_settings(redis_info).set_tcp_settings(tcp);
        let client = Self::client(info, tls, &s)?;
        let pubsub_client = Self::client(pubsub_info, tls, &s)?;
        // What the URL said is kept as settings, for the other servers of
        // the deployment (reached by address, without the URL's user info).
        let mut s = s;
        s.username = redis_settings_username(&client);
        s.password = redis_settings_password(&client);
        s.database = Some(redis_info_db(&client));
        Ok(ConnConfig {
            client,
            pubsub_client,
            addr: addr_desc.into(),
            tls,
            connect_timeout: s.connect_timeout,
            role: s.role,
            extension_acks: s.extension_acks,
            clock: s.clock.clone(),
            settings: s,
        })
    }

    /// The same settings (credentials, TLS, timeouts, database) for the server
    /// at `host:port` of the same deployment.
    pub(crate) fn for_addr(&self, host: &str, port: u16, role: RoleCheck) -> Result<Self> {
        let scheme = if self.tls { "rediss" } else { "redis" };
        let host = if host.contains(':') && !host.starts_with('[') {
            format!("[{host}]")
        } else {
            host.to_owned()
        };
        let mut s = self.settings.clone();
        s.url = format!("{scheme}://{host}:{port}");
        s.role = role;
        ConnConfig::new(s)
    }

    /// This server's id for lease claims: see [`server_id`].
    pub(crate) fn server_id(&self) -> u64 {
        server_id(&self.addr)
    }

    /// The database number it selects.
    pub(crate) fn database(&self) -> Option<i64> {
        self.settings.database
    }

    /// The host and port this configuration connects to, when it is TCP.
    pub(crate) fn host_port(&self) -> Option<(String, u16)> {
        let info: ConnectionInfo = self.settings.url.as_str().into_connection_info().ok()?;
        match info.addr() {
            ConnectionAddr::Tcp(host, port) | ConnectionAddr::TcpTls { host, port, .. } => Some((
                host.trim_start_matches('[')
                    .trim_end_matches(']')
                    .to_owned(),
                *port,
            )),
            _ => None,
        }
    }

    #[cfg(feature = "tls")]
    fn client(info: ConnectionInfo, tls: bool, s: &ConnSettings) -> Result<redis::Client> {
        if tls {
            // rustls needs a process-wide crypto provider; another part of the
            // program may have installed one already, which is fine.
            let _ = rustls::crypto::ring::default_provider().install_default();
            if s.tls.ca.is_some() || s.tls.client.is_some() {
                let certs =
                    redis::TlsCertificates {
                        client_tls: s.tls.client.clone().map(|(cert, key)| {
                            redis::ClientTlsConfig {
                                client_cert: cert,
                                client_key: key,
                            }
                        }),
                        root_cert: s.tls.ca.clone(),
                    };
                return redis::Client::build_with_tls(info, certs)
                    .map_err(|e| Error::Config(format!("tls certificates: {e}")));
            }
        }
        redis::Client::open(info).map_err(|e| Error::Config(e.to_string()))
    }

    #[cfg(not(feature = "tls"))]
    fn client(info: ConnectionInfo, tls: bool, _s: &ConnSettings) -> Result<redis::Client> {
        if tls {
            return Err(Error::Config(
                "rediss:// needs the crate's `tls` feature".into(),
            ));
        }
        redis::Client::open(info).map_err(|e| Error::Config(e.to_string()))
    }
}

fn redis_settings_username(client: &redis::Client) -> Option<String> {
    client
        .get_connection_info()
        .redis_settings()
        .username()
        .map(str::to_owned)
}

fn redis_settings_password(client: &redis::Client) -> Option<String> {
    client
        .get_connection_info()
        .redis_settings()
        .password()
        .map(str::to_owned)
}

fn redis_info_db(client: &redis::Client) -> i64 {
    client.get_connection_info().redis_settings().db()
}

fn describe_addr(addr: &ConnectionAddr, db: i64) -> String {
    let base = match addr {
        ConnectionAddr::Tcp(host, port) => format!("redis://{host}:{port}"),
        ConnectionAddr::TcpTls { host, port, .. } => format!("rediss://{host}:{port}"),
        ConnectionAddr::Unix(path) => format!("unix://{}", path.display()),
        other => other.to_string(),
    };
    if db == 0 {
        base
    } else {
        format!("{base}/{db}")
    }
}

/// An id for the server at `addr` (as a [`ConnConfig`] describes it), the
/// same for every connection to it: a claimed extension remembers the server
/// its command went to by it.
pub(crate) fn server_id(addr: &str) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::hash::DefaultHasher::new();
    addr.hash(&mut h);
    h.finish()
}
