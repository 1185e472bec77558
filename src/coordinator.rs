//! `Coordinator`: one Redis deployment, its connection pool, its key prefix and the
//! background threads; the factory for every single-deployment primitive.

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use parking_lot::Mutex;

use crate::conn::{ConnConfig, ConnSettings, Pool, Protocol, redact_url};
use crate::error::{Error, Result};
use crate::fenced::FencedLock;
use crate::keys;
use crate::lease;
use crate::lock::Lock;
use crate::runtime::renewal::{Renewal, RenewalStats};
use crate::runtime::tracking::Tracking;
use crate::scripts;
use crate::token::OwnerToken;

const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
const DEFAULT_NODE_TIMEOUT: Duration = Duration::from_millis(500);
const DEFAULT_POOL_SIZE: usize = 8;
const DEFAULT_DRIFT_FACTOR: f64 = 0.01;

/// A handle to one Redis deployment (a standalone server, or the primary of a
/// replicated one) for coordination.
///
/// Cheap to clone: clones share one connection pool, one renewal thread and one
/// invalidation subscriber. It is `Send + Sync`; use one per deployment for the
/// whole program. The background threads stop when the last clone and the last
/// guard made from it are dropped.
///
/// Creating a `Coordinator` connects once, so a wrong address, password, user or
/// TLS setting fails here rather than at the first lock.
#[derive(Clone)]
pub struct Coordinator {
    shared: Arc<Shared>,
}

pub(crate) struct Shared {
    pub(crate) pool: Pool,
    pub(crate) prefix: String,
    pub(crate) drift_factor: f64,
    renewal: Renewal,
    tracking: OnceLock<Tracking>,
    tracking_init: Mutex<()>,
    fences: Mutex<HashMap<String, u64>>,
    keepalive_ok: OnceLock<()>,
}

impl Coordinator {
    /// Connects with default settings.
    ///
    /// Accepts `redis://[user[:password]@]host[:port][/db]`, `rediss://…` (TLS,
    /// with the `tls` feature) and `unix:///path/to/socket[?db=N]`. Blocks for at
    /// most the connect timeout (2 s).
    ///
    /// # Errors
    /// [`Error::Config`] for a URL that does not parse, [`Error::Connect`] when the
    /// server cannot be reached in time, [`Error::Auth`] for refused credentials,
    /// [`Error::Tls`] when the TLS handshake fails.
    pub fn connect(url: &str) -> Result<Coordinator> {
        Coordinator::builder(url).build()
    }

    /// Starts configuring a coordinator for the deployment at `url` (see
    /// [`connect`](Coordinator::connect) for the URL forms).
    pub fn builder(url: &str) -> CoordinatorBuilder {
        CoordinatorBuilder {
            url: url.to_owned(),
            key_prefix: String::new(),
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            node_timeout: DEFAULT_NODE_TIMEOUT,
            pool_size: DEFAULT_POOL_SIZE,
            protocol: Protocol::Resp2,
            drift_factor: DEFAULT_DRIFT_FACTOR,
            username: None,
            password: None,
            database: None,
            #[cfg(feature = "tls")]
            tls: Default::default(),
        }
    }

    /// A plain mutex on one key (`SET NX PX`, compare-and-delete). No fencing: use
    /// it where a second holder would waste work, not corrupt data.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for an empty key. Nothing is sent to Redis.
    pub fn lock(&self, key: &str) -> Result<Lock> {
        let key = keys::physical(&self.shared.prefix, key, "lock key")?;
        Ok(Lock::new(self.shared.clone(), key))
    }

    /// A fenced lock: a lease key plus a counter that issues a strictly increasing
    /// fencing token with every grant.
    ///
    /// Both keys must hash to one Redis Cluster slot after the key prefix is added
    /// (give them a common hash tag: `{reports:daily}:lease`,
    /// `{reports:daily}:fence`). The counter is never expired, deleted or reset by
    /// this crate; do not touch it yourself.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for an empty key or the same key twice,
    /// [`Error::CrossSlot`] when the keys land in different slots. Nothing is sent
    /// to Redis.
    pub fn fenced_lock(&self, lease_key: &str, fence_key: &str) -> Result<FencedLock> {
        let lease = keys::physical(&self.shared.prefix, lease_key, "lease key")?;
        let fence = keys::physical(&self.shared.prefix, fence_key, "fence key")?;
        if lease == fence {
            return Err(Error::InvalidArgument(format!(
                "lease key and fence key are the same key {lease:?}"
            )));
        }
        keys::same_slot(&lease, &fence)?;
        Ok(FencedLock::new(self.shared.clone(), lease, fence))
    }

    /// The prefix added to every key.
    pub fn key_prefix(&self) -> &str {
        &self.shared.prefix
    }

    /// The longest any one command may take before it counts as failed.
    pub fn node_timeout(&self) -> Duration {
        self.shared.node_timeout()
    }

    /// The renewal thread's counters: round trips, renewals, failures, losses.
    pub fn renewal_stats(&self) -> RenewalStats {
        self.shared.renewal.stats()
    }

    /// The pool, settings and runtime behind this handle (for `RedlockGroup`).
    pub(crate) fn shared(&self) -> &Arc<Shared> {
        &self.shared
    }
}

impl fmt::Debug for Coordinator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Coordinator")
            .field("addr", &self.shared.pool.cfg.addr)
            .field("key_prefix", &self.shared.prefix)
            .field("node_timeout", &self.shared.node_timeout())
            .finish_non_exhaustive()
    }
}

impl Shared {
    pub(crate) fn node_timeout(&self) -> Duration {
        self.pool.cfg.node_timeout
    }

    pub(crate) fn renewal(&self) -> &Renewal {
        &self.renewal
    }

    /// The invalidation subscriber, started on first use.
    pub(crate) fn tracking(&self) -> Result<&Tracking> {
        if let Some(t) = self.tracking.get() {
            return Ok(t);
        }
        let _init = self.tracking_init.lock();
        if let Some(t) = self.tracking.get() {
            return Ok(t);
        }
        let t = Tracking::spawn(self.pool.cfg.clone()).map_err(|source| Error::Thread {
            name: "respire-tracker",
            source,
        })?;
        Ok(self.tracking.get_or_init(|| t))
    }

    pub(crate) fn check_ttl(&self, ttl: Duration) -> Result<u64> {
        lease::check_ttl(ttl, self.drift_factor, self.node_timeout())
    }

    /// Turns the scripts' BADKEY / BADFENCE / WRONGTYPE replies into [`Error::BadKey`].
    pub(crate) fn bad_key(&self, err: Error, key: &str) -> Error {
        bad_key(err, key)
    }

    /// Keep-alive kills connections whose renewal got no reply, so it needs
    /// `CLIENT ID` and `CLIENT KILL`. Checked once per coordinator.
    pub(crate) fn check_keepalive_rights(&self) -> Result<()> {
        if self.keepalive_ok.get().is_some() {
            return Ok(());
        }
        let timeout = self.node_timeout();
        let mut conn = self.pool.get(timeout)?;
        let probe = conn.client_id(timeout).and_then(|_| {
            // An id no connection has: allowed ⇒ `:0`, denied ⇒ NOPERM.
            conn.query::<i64>(
                redis::cmd("CLIENT")
                    .arg("KILL")
                    .arg("ID")
                    .arg(i64::MAX)
                    .arg("SKIPME")
                    .arg("yes"),
                "CLIENT KILL",
                timeout,
            )
        });
        match probe {
            Ok(_) => {
                let _ = self.keepalive_ok.set(());
                Ok(())
            }
            Err(Error::Permission(why)) => Err(Error::Permission(format!(
                "keep-alive needs the ACL rights to CLIENT ID and CLIENT KILL \
                 (to cut off a renewal that got no reply): {why}"
            ))),
            Err(e) => Err(e),
        }
    }

    /// Records a fencing token and refuses one that is not above every token this
    /// coordinator saw before for the same counter.
    pub(crate) fn note_token(&self, fence_key: &str, token: u64) -> Result<()> {
        let mut fences = self.fences.lock();
        let seen = fences.entry(fence_key.to_owned()).or_insert(0);
        if token <= *seen {
            let seen = *seen;
            drop(fences);
            log::error!(
                "fencing counter {fence_key:?} went back: issued {token} after {seen}; \
                 its history was lost (failover, restart without persistence, eviction)"
            );
            return Err(Error::FencingRegression {
                fence_key: fence_key.to_owned(),
                issued: token,
                seen,
            });
        }
        *seen = token;
        Ok(())
    }

    /// Best-effort delete of a lease that an attempt without a reply may have set.
    pub(crate) fn release_owner(&self, key: &str, owner: &OwnerToken) {
        let timeout = self.node_timeout();
        let result = self.pool.get(timeout).and_then(|mut conn| {
            conn.script::<i64>(
                &scripts::LEASE_RELEASE,
                &[key],
                &[owner.as_str(), "prefix"],
                "release",
                timeout,
            )
        });
        match result {
            Ok(1) => log::info!("released {key:?}, acquired by an attempt whose reply was lost"),
            Ok(_) => {}
            Err(e) => log::warn!(
                "could not clean up after an unanswered acquire of {key:?} ({e}); \
                 if it was granted, it ends at its expiry"
            ),
        }
    }
}

pub(crate) fn bad_key(err: Error, key: &str) -> Error {
    match err {
        Error::Server { source, .. }
            if matches!(source.code(), Some("BADKEY" | "BADFENCE" | "WRONGTYPE")) =>
        {
            let detail = source.detail().unwrap_or("has the wrong type").to_owned();
            let detail = detail
                .split(" script:")
                .next()
                .unwrap_or(&detail)
                .trim()
                .to_owned();
            Error::BadKey {
                key: key.to_owned(),
                problem: detail,
            }
        }
        other => other,
    }
}

/// Settings for a [`Coordinator`]; see [`Coordinator::builder`].
#[must_use = "call build() to connect"]
pub struct CoordinatorBuilder {
    url: String,
    key_prefix: String,
    connect_timeout: Duration,
    node_timeout: Duration,
    pool_size: usize,
    protocol: Protocol,
    drift_factor: f64,
    username: Option<String>,
    password: Option<String>,
    database: Option<i64>,
    #[cfg(feature = "tls")]
    tls: crate::conn::TlsMaterial,
}

impl CoordinatorBuilder {
    /// A prefix added to every key this coordinator touches, such as `"app:"`. It
    /// may not contain `{` or `}`, which would change the keys' cluster slots.
    /// Defaults to no prefix.
    pub fn key_prefix(mut self, prefix: &str) -> Self {
        self.key_prefix = prefix.to_owned();
        self
    }

    /// The longest a connection attempt may take (TCP, TLS handshake,
    /// authentication). Defaults to 2 s.
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// The longest any single command may take: the read and write timeout of
    /// every command, the bound on a guard's release on drop, and the margin by
    /// which a lease is declared lost before it can expire. Defaults to 500 ms.
    pub fn node_timeout(mut self, timeout: Duration) -> Self {
        self.node_timeout = timeout;
        self
    }

    /// The most command connections the pool opens (the renewal thread and the
    /// invalidation subscriber have their own). Defaults to 8.
    pub fn pool_size(mut self, size: usize) -> Self {
        self.pool_size = size;
        self
    }

    /// The RESP version of the command connections. Defaults to
    /// [`Protocol::Resp2`]. Invalidations always arrive over RESP2 pub/sub.
    pub fn protocol(mut self, protocol: Protocol) -> Self {
        self.protocol = protocol;
        self
    }

    /// The fraction of each TTL written off for clock-rate differences between
    /// this host and the server (plus 2 ms). Must be in `0.0..0.5`. Defaults to 0.01.
    pub fn drift_factor(mut self, factor: f64) -> Self {
        self.drift_factor = factor;
        self
    }

    /// The ACL user, overriding the URL's. Defaults to the URL's user, else `default`.
    pub fn username(mut self, user: &str) -> Self {
        self.username = Some(user.to_owned());
        self
    }

    /// The password, overriding the URL's. Defaults to the URL's password, else none.
    pub fn password(mut self, password: &str) -> Self {
        self.password = Some(password.to_owned());
        self
    }

    /// The database number, overriding the URL's. Defaults to the URL's, else 0.
    pub fn database(mut self, db: i64) -> Self {
        self.database = Some(db);
        self
    }

    /// The CA certificate (PEM) that signs the server's certificate, for
    /// `rediss://`. Defaults to the system's trust store.
    #[cfg(feature = "tls")]
    pub fn tls_ca_pem(mut self, pem: impl Into<Vec<u8>>) -> Self {
        self.tls.ca = Some(pem.into());
        self
    }

    /// A client certificate and its private key (PEM), for servers that require
    /// mutual TLS. Defaults to none.
    #[cfg(feature = "tls")]
    pub fn tls_client_cert_pem(
        mut self,
        cert: impl Into<Vec<u8>>,
        key: impl Into<Vec<u8>>,
    ) -> Self {
        self.tls.client = Some((cert.into(), key.into()));
        self
    }

    /// Checks the settings, connects once (blocking for at most the connect
    /// timeout), and starts the renewal thread.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a key prefix with braces, a drift factor
    /// outside `0.0..0.5` or a pool size of 0; [`Error::Config`] for a bad URL or
    /// zero timeouts; [`Error::Connect`], [`Error::Auth`], [`Error::Tls`] when the
    /// first connection fails.
    pub fn build(self) -> Result<Coordinator> {
        keys::check_prefix(&self.key_prefix)?;
        if !(0.0..0.5).contains(&self.drift_factor) {
            return Err(Error::InvalidArgument(format!(
                "drift factor {} is outside 0.0..0.5",
                self.drift_factor
            )));
        }
        if self.pool_size == 0 {
            return Err(Error::InvalidArgument("pool size is 0".into()));
        }
        let cfg = Arc::new(ConnConfig::new(ConnSettings {
            url: self.url,
            username: self.username,
            password: self.password,
            database: self.database,
            protocol: self.protocol,
            connect_timeout: self.connect_timeout,
            node_timeout: self.node_timeout,
            #[cfg(feature = "tls")]
            tls: self.tls,
        })?);
        let mut first = cfg.connect(cfg.connect_timeout, "respire")?;
        first.query::<String>(&redis::cmd("PING"), "PING", cfg.node_timeout)?;
        let pool = Pool::new(cfg.clone(), self.pool_size);
        pool.seed(first);
        let renewal = Renewal::spawn(cfg).map_err(|source| Error::Thread {
            name: "respire-renewal",
            source,
        })?;
        Ok(Coordinator {
            shared: Arc::new(Shared {
                pool,
                prefix: self.key_prefix,
                drift_factor: self.drift_factor,
                renewal,
                tracking: OnceLock::new(),
                tracking_init: Mutex::new(()),
                fences: Mutex::new(HashMap::new()),
                keepalive_ok: OnceLock::new(),
            }),
        })
    }
}

impl fmt::Debug for CoordinatorBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CoordinatorBuilder")
            .field("url", &redact_url(&self.url))
            .field("key_prefix", &self.key_prefix)
            .field("connect_timeout", &self.connect_timeout)
            .field("node_timeout", &self.node_timeout)
            .field("pool_size", &self.pool_size)
            .field("protocol", &self.protocol)
            .field("drift_factor", &self.drift_factor)
            .field("username", &self.username)
            .field("password", &self.password.as_ref().map(|_| "***"))
            .field("database", &self.database)
            .finish_non_exhaustive()
    }
}
