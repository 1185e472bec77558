//! `Coordinator`: one Redis deployment, its connection pool, its key prefix and the
//! background threads; the factory for every single-deployment primitive.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use crate::acquire::Lease;
use crate::clock;
use crate::conn::{ConnConfig, ConnSettings, Pool, Protocol, redact_url};
use crate::deployment::Deployment;
use crate::error::{Error, Result};
use crate::fenced::{FencedLock, FencedSpec};
use crate::keys;
use crate::lock::{Lock, PlainSpec};
use crate::runtime::renewal::RenewalStats;
use crate::rwlease::{Preference, ReadWriteLease};
use crate::semaphore::Semaphore;

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
    dep: Arc<Deployment>,
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
        let key = keys::physical(&self.dep.prefix, key, "lock key")?;
        Ok(Lease::new(self.dep.clone(), Arc::new(PlainSpec::new(key))))
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
        let lease = keys::physical(&self.dep.prefix, lease_key, "lease key")?;
        let fence = keys::physical(&self.dep.prefix, fence_key, "fence key")?;
        if lease == fence {
            return Err(Error::InvalidArgument(format!(
                "lease key and fence key are the same key {lease:?}"
            )));
        }
        keys::same_slot(&lease, &fence)?;
        Ok(Lease::new(
            self.dep.clone(),
            Arc::new(FencedSpec::new(lease, fence)),
        ))
    }

    /// A reader/writer lease with writer preference: many readers or one
    /// fenced writer, and a waiting writer holds new readers back (see
    /// [`ReadWriteLease`]). Its four keys are `base:w`, `base:r`, `base:q` and
    /// `base:fence`, after the key prefix.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a base key without a non-empty hash tag
    /// (`{reports}`, `{reports}:daily`): the keys must share a cluster slot,
    /// and the crate does not wrap a key in braces behind the caller's back.
    /// Nothing is sent to Redis.
    pub fn read_write_lease(&self, base: &str) -> Result<ReadWriteLease> {
        ReadWriteLease::new(&self.dep, base, Preference::Writer)
    }

    /// A reader/writer lease with the given [`Preference`]; see
    /// [`read_write_lease`](Coordinator::read_write_lease). Every participant
    /// of one lease should use the same preference.
    ///
    /// # Errors
    /// As [`read_write_lease`](Coordinator::read_write_lease).
    pub fn read_write_lease_with(
        &self,
        base: &str,
        preference: Preference,
    ) -> Result<ReadWriteLease> {
        ReadWriteLease::new(&self.dep, base, preference)
    }

    /// A semaphore of `capacity` permits (see [`Semaphore`]). Its keys are
    /// `base:permits`, `base:meta` and `base:slots`, after the key prefix. Every participant
    /// must declare the same capacity: the first acquire stores it, and an
    /// acquire that declares another gets [`Error::CapacityMismatch`].
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a capacity of 0 or above
    /// [`Semaphore::MAX_CAPACITY`] (10,000), or a base key without a non-empty
    /// hash tag. Nothing is sent to Redis.
    pub fn semaphore(&self, base: &str, capacity: u32) -> Result<Semaphore> {
        crate::semaphore::semaphore(&self.dep, base, capacity)
    }

    /// The prefix added to every key.
    pub fn key_prefix(&self) -> &str {
        &self.dep.prefix
    }

    /// The longest any one command may take before it counts as failed.
    pub fn node_timeout(&self) -> Duration {
        self.dep.node_timeout()
    }

    /// The renewal runtime's counters: round trips, renewals, failures, losses.
    pub fn renewal_stats(&self) -> RenewalStats {
        self.dep.stats()
    }

    /// The deployment behind this handle.
    pub(crate) fn deployment(&self) -> &Arc<Deployment> {
        &self.dep
    }
}

impl fmt::Debug for Coordinator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Coordinator")
            .field("addr", &self.dep.pool.cfg.addr)
            .field("key_prefix", &self.dep.prefix)
            .field("node_timeout", &self.dep.node_timeout())
            .finish_non_exhaustive()
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
        let drift_factor = self.drift_factor;
        let pool_size = self.pool_size;
        let (cfg, key_prefix) = self.config()?;
        let first = cfg.connect(cfg.connect_timeout, "respire")?;
        let pool = Pool::new(cfg, pool_size);
        pool.seed(first);
        Ok(Coordinator {
            dep: Arc::new(Deployment::new(
                pool,
                key_prefix,
                drift_factor,
                clock::system(),
            )),
        })
    }

    /// Checks the settings and makes the connection config, without
    /// connecting; also returns the key prefix.
    pub(crate) fn config(self) -> Result<(Arc<ConnConfig>, String)> {
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
        Ok((cfg, self.key_prefix))
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
