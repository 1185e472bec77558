//! Connecting, timeouts and socket options, and the command pool: the only code
//! that touches sockets.
//!
//! Every command runs with a read and write timeout. A connection on which any
//! command failed at the transport level (timeout, reset, EOF) is dropped, never
//! returned to the pool: a reply that arrives late would otherwise be read as the
//! answer to the next command.

use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};
use redis::{ConnectionAddr, ConnectionInfo, ConnectionLike, FromRedisValue, IntoConnectionInfo};

use crate::error::{Error, Result, is_noperm};
use crate::scripts::Script;

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

/// Everything needed to open a connection to one deployment.
pub(crate) struct ConnConfig {
    client: redis::Client,
    /// RESP2 always: invalidations are received as pub/sub messages.
    pubsub_client: redis::Client,
    pub(crate) addr: Arc<str>,
    pub(crate) tls: bool,
    pub(crate) connect_timeout: Duration,
    pub(crate) node_timeout: Duration,
}

impl fmt::Debug for ConnConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ConnConfig")
            .field("addr", &self.addr)
            .field("tls", &self.tls)
            .field("connect_timeout", &self.connect_timeout)
            .field("node_timeout", &self.node_timeout)
            .finish()
    }
}

/// Settings the builder collects for [`ConnConfig::new`].
pub(crate) struct ConnSettings {
    pub(crate) url: String,
    pub(crate) username: Option<String>,
    pub(crate) password: Option<String>,
    pub(crate) database: Option<i64>,
    pub(crate) protocol: Protocol,
    pub(crate) connect_timeout: Duration,
    pub(crate) node_timeout: Duration,
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
        if s.connect_timeout.is_zero() || s.node_timeout.is_zero() {
            return Err(Error::Config("timeouts must be greater than zero".into()));
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
        Ok(ConnConfig {
            client,
            pubsub_client,
            addr: addr_desc.into(),
            tls,
            connect_timeout: s.connect_timeout,
            node_timeout: s.node_timeout,
        })
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

    /// Opens a connection, spending at most `budget` (capped by the connect timeout).
    ///
    /// The connection is named `name` (`CLIENT SETNAME`, best effort) so that
    /// `CLIENT LIST` shows what each connection is for.
    pub(crate) fn connect(&self, budget: Duration, name: &str) -> Result<Conn> {
        self.open(&self.client, budget, name)
    }

    /// Opens a RESP2 connection for receiving invalidation messages.
    pub(crate) fn connect_pubsub(&self, budget: Duration, name: &str) -> Result<Conn> {
        self.open(&self.pubsub_client, budget, name)
    }

    fn open(&self, client: &redis::Client, budget: Duration, name: &str) -> Result<Conn> {
        let started = Instant::now();
        let budget = budget
            .min(self.connect_timeout)
            .max(Duration::from_millis(1));
        let inner = client
            .get_connection_with_timeout(budget)
            .map_err(|e| self.connect_error(e, budget))?;
        let mut conn = Conn {
            inner,
            addr: self.addr.clone(),
            timeout: None,
            tracking: None,
            broken: false,
        };
        // The first command also completes a TLS handshake and surfaces a
        // server that accepts connections but does not answer, so its transport
        // errors are connect errors.
        let left = budget
            .saturating_sub(started.elapsed())
            .max(Duration::from_millis(1));
        conn.set_timeout(left)?;
        let setname = redis::cmd("CLIENT").arg("SETNAME").arg(name).clone();
        match setname.query::<()>(&mut conn.inner) {
            Ok(()) => Ok(conn),
            Err(e) if e.kind() == redis::ErrorKind::Io || e.is_timeout() || e.is_io_error() => {
                Err(self.connect_error(e, budget))
            }
            Err(e) if e.code() == Some("NOAUTH") => Err(self.connect_error(e, budget)),
            Err(e) => {
                // An ACL without CLIENT SETNAME, or an old server: names are optional.
                log::debug!("cannot name connection: {e}");
                Ok(conn)
            }
        }
    }

    fn connect_error(&self, err: redis::RedisError, budget: Duration) -> Error {
        let addr = self.addr.to_string();
        if err.kind() == redis::ErrorKind::AuthenticationFailed
            || matches!(err.code(), Some("WRONGPASS" | "NOAUTH"))
        {
            return Error::Auth {
                addr,
                detail: err.detail().unwrap_or("credentials refused").to_owned(),
            };
        }
        if is_noperm(&err) {
            return Error::Permission(format!("connecting to {addr}: {err}"));
        }
        if self.tls {
            let text = err.to_string();
            if err.is_timeout() {
                return Error::Tls {
                    addr,
                    detail: format!(
                        "no TLS handshake within {budget:?}: the port does not speak TLS, \
                         or the server is not answering"
                    ),
                };
            }
            if !err.is_connection_refusal() && !text.contains("refused") {
                return Error::Tls { addr, detail: text };
            }
        }
        let detail = if err.is_timeout() {
            format!("timed out after {budget:?}")
        } else {
            err.to_string()
        };
        Error::Connect { addr, detail }
    }
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

/// A URL with any password replaced by `***`, for messages.
pub(crate) fn redact_url(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(scheme), Some(at)) if at > scheme => {
            let userinfo = &url[scheme + 3..at];
            let user = userinfo.split(':').next().unwrap_or("");
            if userinfo.contains(':') {
                format!("{}{user}:***{}", &url[..scheme + 3], &url[at..])
            } else {
                format!("{}***{}", &url[..scheme + 3], &url[at..])
            }
        }
        _ => url.to_owned(),
    }
}

/// One connection, with the state this crate keeps about it.
pub(crate) struct Conn {
    inner: redis::Connection,
    addr: Arc<str>,
    timeout: Option<Duration>,
    /// Client tracking on this connection, if turned on; dropped with it.
    pub(crate) tracking: Option<crate::runtime::waiters::Armed>,
    broken: bool,
}

impl Conn {
    /// Whether a transport failure made this connection unusable.
    pub(crate) fn is_broken(&self) -> bool {
        self.broken || !self.inner.is_open()
    }

    fn set_timeout(&mut self, timeout: Duration) -> Result<()> {
        let timeout = timeout.max(Duration::from_millis(1));
        if self.timeout != Some(timeout) {
            let r = self
                .inner
                .set_read_timeout(Some(timeout))
                .and_then(|()| self.inner.set_write_timeout(Some(timeout)));
            if let Err(e) = r {
                self.broken = true;
                return Err(Error::Io {
                    op: "setting socket timeouts",
                    source: e,
                });
            }
            self.timeout = Some(timeout);
        }
        Ok(())
    }

    /// Classifies an error; transport failures mark the connection broken.
    fn fail(&mut self, err: redis::RedisError, op: &'static str, timeout: Duration) -> Error {
        if err.is_timeout() {
            self.broken = true;
            return Error::Timeout { op, after: timeout };
        }
        if err.is_io_error() || err.is_connection_dropped() || err.is_unrecoverable_error() {
            self.broken = true;
            return Error::Io { op, source: err };
        }
        if is_noperm(&err) {
            return Error::Permission(format!("{op}: {err}"));
        }
        if matches!(err.code(), Some("NOAUTH" | "WRONGPASS")) {
            return Error::Auth {
                addr: self.addr.to_string(),
                detail: err.to_string(),
            };
        }
        Error::Server { op, source: err }
    }

    /// Runs one command with the given timeout.
    pub(crate) fn query<T: FromRedisValue>(
        &mut self,
        cmd: &redis::Cmd,
        op: &'static str,
        timeout: Duration,
    ) -> Result<T> {
        self.set_timeout(timeout)?;
        cmd.query(&mut self.inner)
            .map_err(|e| self.fail(e, op, timeout))
    }

    /// Runs a pipeline with the given timeout; each command's own error reply is
    /// returned in place, transport failures fail the whole call.
    pub(crate) fn pipeline(
        &mut self,
        pipe: &redis::Pipeline,
        op: &'static str,
        timeout: Duration,
    ) -> Result<Vec<redis::Value>> {
        self.set_timeout(timeout)?;
        let values: Vec<redis::Value> = pipe
            .query(&mut self.inner)
            .map_err(|e| self.fail(e, op, timeout))?;
        Ok(values)
    }

    /// Runs a script in one round trip (EVALSHA; EVAL when the server lacks it).
    pub(crate) fn script<T: FromRedisValue>(
        &mut self,
        script: &Script,
        keys: &[&str],
        args: &[&str],
        op: &'static str,
        timeout: Duration,
    ) -> Result<T> {
        match self.query(&script.evalsha(keys, args), op, timeout) {
            Err(Error::Server { source, .. }) if source.code() == Some("NOSCRIPT") => {
                log::debug!(
                    "script {} not cached on the server; sending it",
                    script.name
                );
                self.query(&script.eval(keys, args), op, timeout)
            }
            other => other,
        }
    }

    /// The server's id for this connection (`CLIENT ID`).
    pub(crate) fn client_id(&mut self, timeout: Duration) -> Result<u64> {
        self.query(
            &redis::cmd("CLIENT").arg("ID").clone(),
            "CLIENT ID",
            timeout,
        )
    }

    /// Gives the raw connection for pub/sub use.
    pub(crate) fn raw(&mut self) -> &mut redis::Connection {
        &mut self.inner
    }
}

/// A bounded pool of command connections.
pub(crate) struct Pool {
    pub(crate) cfg: Arc<ConnConfig>,
    max: usize,
    state: Mutex<PoolState>,
    freed: Condvar,
}

struct PoolState {
    idle: Vec<Conn>,
    open: usize,
}

impl Pool {
    pub(crate) fn new(cfg: Arc<ConnConfig>, max: usize) -> Self {
        Pool {
            cfg,
            max: max.max(1),
            state: Mutex::new(PoolState {
                idle: Vec::new(),
                open: 0,
            }),
            freed: Condvar::new(),
        }
    }

    /// Puts a freshly made connection in the pool (used by the first connect).
    pub(crate) fn seed(&self, conn: Conn) {
        let mut state = self.state.lock();
        state.open += 1;
        state.idle.push(conn);
    }

    /// Takes an idle connection, or opens one while under the limit, or waits for
    /// one to be returned. Waits at most `budget` for a free slot; opening a
    /// connection then takes at most `budget` (and the connect timeout) of its
    /// own, so that a wait for a slot never leaves a connect too little time.
    pub(crate) fn get(&self, budget: Duration) -> Result<Pooled<'_>> {
        self.take(Instant::now() + budget, Some(budget))
    }

    /// As [`get`](Pool::get), but everything, a connect included, is done
    /// within `budget` (for calls that promise a bound, like a guard's release).
    pub(crate) fn get_within(&self, budget: Duration) -> Result<Pooled<'_>> {
        self.take(Instant::now() + budget, None)
    }

    fn take(&self, deadline: Instant, connect_budget: Option<Duration>) -> Result<Pooled<'_>> {
        let started = Instant::now();
        let mut state = self.state.lock();
        loop {
            if let Some(conn) = state.idle.pop() {
                return Ok(Pooled {
                    pool: self,
                    conn: Some(conn),
                });
            }
            if state.open < self.max {
                state.open += 1;
                drop(state);
                let budget = connect_budget
                    .unwrap_or_else(|| deadline.saturating_duration_since(Instant::now()));
                return match self.cfg.connect(budget, "respire") {
                    Ok(conn) => Ok(Pooled {
                        pool: self,
                        conn: Some(conn),
                    }),
                    Err(e) => {
                        self.state.lock().open -= 1;
                        self.freed.notify_one();
                        Err(e)
                    }
                };
            }
            if self.freed.wait_until(&mut state, deadline).timed_out() {
                return Err(Error::PoolTimeout(started.elapsed()));
            }
        }
    }

    fn put(&self, conn: Conn) {
        let mut state = self.state.lock();
        if conn.is_broken() {
            // A connection that failed usually means the server restarted, failed
            // over or stalled: the idle ones are likely dead too, and a reply
            // arriving late on any of them must not be read as the next answer.
            let idle = std::mem::take(&mut state.idle);
            state.open -= 1 + idle.len();
            drop(state);
            // Dropping closes the sockets; done outside the lock.
            drop(conn);
            drop(idle);
        } else {
            state.idle.push(conn);
            drop(state);
        }
        self.freed.notify_one();
    }
}

/// A connection borrowed from the pool; returned on drop unless broken.
pub(crate) struct Pooled<'a> {
    pool: &'a Pool,
    conn: Option<Conn>,
}

impl std::ops::Deref for Pooled<'_> {
    type Target = Conn;
    fn deref(&self) -> &Conn {
        self.conn.as_ref().expect("connection present until drop")
    }
}

impl std::ops::DerefMut for Pooled<'_> {
    fn deref_mut(&mut self) -> &mut Conn {
        self.conn.as_mut().expect("connection present until drop")
    }
}

impl Drop for Pooled<'_> {
    fn drop(&mut self) {
        if let Some(conn) = self.conn.take() {
            self.pool.put(conn);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redacts_passwords() {
        assert_eq!(
            redact_url("redis://app:secret@host:6379/2"),
            "redis://app:***@host:6379/2"
        );
        assert_eq!(redact_url("redis://:secret@host"), "redis://:***@host");
        assert_eq!(redact_url("redis://secret@host"), "redis://***@host");
        assert_eq!(redact_url("redis://host:6379"), "redis://host:6379");
    }
}
