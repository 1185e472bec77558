//! `Coordinator`: one Redis deployment (a standalone server, a Sentinel
//! deployment or a Redis Cluster), its connection pools, its key prefix and the
//! background threads; the factory for every single-deployment primitive.
//! Reading what a deployment holds under one base key is `inspect.rs`.

pub(crate) mod inspect;

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use crate::clock::{self, Clock};
use crate::conn::url::{Auth, DEFAULT_PORT, ParsedTarget, parse_target};
use crate::conn::{ConnConfig, ConnSettings, Protocol, RoleCheck, TIMEOUTS_ZERO, redact_url};
use crate::core::timing::Timing;
use crate::error::{Error, Result};
use crate::keys;
use crate::lease::acquire::Lease;
use crate::lease::deployment::Deployment;
use crate::lease::election::Election;
use crate::lease::fenced::{FencedLock, FencedSpec};
use crate::lease::lock::{Lock, PlainSpec};
use crate::lease::multi::{FencedMultiLock, MultiLease, MultiLock};
use crate::lease::rwlease::{Preference, ReadWriteLease};
use crate::lease::semaphore::Semaphore;
use crate::observe::Observer;
use crate::replication::Replication;
use crate::runtime::renewal::RenewalStats;
use crate::runtime::topology::{MIN_REFRESH, Settings, Topology};

const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
const DEFAULT_NODE_TIMEOUT: Duration = Duration::from_millis(500);
const DEFAULT_POOL_SIZE: usize = 8;
const DEFAULT_DRIFT_FACTOR: f64 = 0.01;
const DEFAULT_REFRESH: Duration = Duration::from_secs(1);

/// A handle to one Redis deployment for coordination: a standalone server (or
/// the primary of a replicated one), a Sentinel deployment, or a Redis Cluster.
///
/// Cheap to clone: clones share the connection pools, the renewal thread and
/// the invalidation subscribers. It is `Send + Sync`; use one per deployment
/// for the whole program. The background threads stop when the last clone and
/// the last guard made from it are dropped.
///
/// Creating a `Coordinator` connects once, so a wrong address, password, user
/// or TLS setting fails here rather than at the first lock.
///
/// # Topologies
///
/// Every primitive works the same way on all three; see the crate
/// documentation's *Topologies* section for what each guarantees.
///
/// - [`connect`](Coordinator::connect) / [`builder`](Coordinator::builder):
///   one server, or a topology URL (`redis+cluster://h1,h2/`,
///   `redis+sentinel://s1,s2/service`).
/// - [`cluster`](Coordinator::cluster) / [`cluster_builder`](Coordinator::cluster_builder):
///   a Redis Cluster, from seed URLs.
/// - [`sentinel`](Coordinator::sentinel) / [`sentinel_builder`](Coordinator::sentinel_builder):
///   the primary that Sentinel names for a service.
#[derive(Clone)]
pub struct Coordinator {
    dep: Arc<Deployment>,
}

/// What a builder connects to.
#[derive(Clone)]
enum Target {
    /// A URL: one server, or a `redis+cluster://` / `redis+sentinel://` list.
    Url(String),
    Cluster(Vec<String>),
    Sentinel {
        sentinels: Vec<String>,
        service: String,
    },
}

impl Coordinator {
    /// Connects with default settings.
    ///
    /// Accepts `redis://[user[:password]@]host[:port][/db]`, `rediss://…` (TLS,
    /// with the `tls` feature) and `unix:///path/to/socket[?db=N]` for one
    /// server; `redis+cluster://[user[:password]@]host[:port],host[:port]…[/]`
    /// for a Redis Cluster (the hosts are seeds; the credentials are every
    /// node's); and `redis+sentinel://[user[:password]@]host[:port],…/service[/db]`
    /// for a Sentinel deployment (the hosts are sentinels, port 26379 by
    /// default; the credentials are the data nodes'; give the sentinels' own
    /// with [`sentinel_username`](CoordinatorBuilder::sentinel_username) and
    /// [`sentinel_password`](CoordinatorBuilder::sentinel_password)).
    /// `rediss+cluster://` and `rediss+sentinel://` use TLS throughout.
    ///
    /// Blocks for at most the connect timeout (2 s) for one server; see
    /// [`cluster`](Coordinator::cluster) and [`sentinel`](Coordinator::sentinel)
    /// for the topologies.
    ///
    /// # Errors
    /// [`Error::Config`] for a URL that does not parse, [`Error::Connect`] when the
    /// server cannot be reached in time, [`Error::Auth`] for refused credentials,
    /// [`Error::Tls`] when the TLS handshake fails, and for topologies as
    /// [`cluster`](Coordinator::cluster) and [`sentinel`](Coordinator::sentinel).
    pub fn connect(url: &str) -> Result<Coordinator> {
        Coordinator::builder(url).build()
    }

    /// Starts configuring a coordinator for the deployment at `url` (see
    /// [`connect`](Coordinator::connect) for the URL forms).
    pub fn builder(url: &str) -> CoordinatorBuilder {
        CoordinatorBuilder::new(Target::Url(url.to_owned()))
    }

    /// Connects to a Redis Cluster with default settings; see
    /// [`cluster_builder`](Coordinator::cluster_builder).
    ///
    /// # Errors
    /// As [`CoordinatorBuilder::build`].
    pub fn cluster(seeds: &[&str]) -> Result<Coordinator> {
        Coordinator::cluster_builder(seeds).build()
    }

    /// Starts configuring a coordinator for the Redis Cluster that `seeds`
    /// (`redis://` or `rediss://` URLs of any of its nodes) belong to.
    ///
    /// Building reads the slot map (`CLUSTER SHARDS`, or `CLUSTER SLOTS`
    /// before Redis 7) from the first seed that answers, each within the
    /// connect timeout, and starts the `respire-topology` thread that
    /// refreshes it. Every node is reached with the first seed's scheme, user,
    /// password and TLS settings (or the builder's). Each primary gets its own
    /// pool of [`pool_size`](CoordinatorBuilder::pool_size) connections, its
    /// own invalidation subscriber and its own renewal executor.
    pub fn cluster_builder(seeds: &[&str]) -> CoordinatorBuilder {
        CoordinatorBuilder::new(Target::Cluster(
            seeds.iter().map(|s| (*s).to_owned()).collect(),
        ))
    }

    /// Connects to the primary that Sentinel names for `service`, with default
    /// settings; see [`sentinel_builder`](Coordinator::sentinel_builder).
    ///
    /// # Errors
    /// As [`CoordinatorBuilder::build`].
    pub fn sentinel(sentinels: &[&str], service: &str) -> Result<Coordinator> {
        Coordinator::sentinel_builder(sentinels, service).build()
    }

    /// Starts configuring a coordinator for the primary that the sentinels at
    /// `sentinels` (`redis://` or `rediss://` URLs; a URL's user and password
    /// are that sentinel's) name for `service`.
    ///
    /// Building asks the sentinels in turn (each within the connect timeout)
    /// for the primary, connects to it and checks `ROLE`, then starts one
    /// `respire-sentinel` thread per sentinel (following `+switch-master`)
    /// and the `respire-topology` thread (asking every sentinel again every
    /// refresh interval). The data nodes are reached with the builder's user,
    /// password, database and TLS settings; the sentinels with their URLs' and
    /// the `sentinel_*` settings.
    pub fn sentinel_builder(sentinels: &[&str], service: &str) -> CoordinatorBuilder {
        CoordinatorBuilder::new(Target::Sentinel {
            sentinels: sentinels.iter().map(|s| (*s).to_owned()).collect(),
            service: service.to_owned(),
        })
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

    /// Several plain locks taken all together or not at all (see
    /// [`MultiLease`]): one script call per attempt when every key hashes to
    /// one cluster slot after the prefix (always on a standalone server or
    /// behind Sentinel), otherwise one lease at a time in a global order (by
    /// slot, then key bytes) under one wait budget. The keys may be given in
    /// any order; two callers with overlapping sets never deadlock.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for no key at all, an empty key, or the same
    /// key twice. Nothing is sent to Redis.
    pub fn lock_all<S: AsRef<str>>(&self, keys: &[S]) -> Result<MultiLock> {
        let members = keys
            .iter()
            .map(|k| self.lock(k.as_ref()))
            .collect::<Result<Vec<_>>>()?;
        distinct(members.iter().map(Lock::key))?;
        Ok(MultiLease::plain(self.dep.clone(), members))
    }

    /// Several fenced locks taken all together or not at all, each grant
    /// with its own fencing token (see [`MultiLease`] and
    /// [`fenced_lock`](Coordinator::fenced_lock)): `pairs` holds each lease key
    /// with its fence counter key, the two of a pair in one cluster slot.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for no pair at all, an empty key, or a key
    /// used twice (as a lease or a counter, in one pair or across pairs);
    /// [`Error::CrossSlot`] when a lease and its counter land in different
    /// slots. Nothing is sent to Redis.
    pub fn fenced_lock_all<A: AsRef<str>, B: AsRef<str>>(
        &self,
        pairs: &[(A, B)],
    ) -> Result<FencedMultiLock> {
        let members = pairs
            .iter()
            .map(|(lease, fence)| self.fenced_lock(lease.as_ref(), fence.as_ref()))
            .collect::<Result<Vec<_>>>()?;
        distinct(members.iter().flat_map(|m| [m.lease_key(), m.fence_key()]))?;
        Ok(MultiLease::fenced(self.dep.clone(), members))
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
        crate::lease::semaphore::semaphore(&self.dep, base, capacity)
    }

    /// A leader election (see [`Election`]): contenders campaign with a value
    /// to advertise, the winner leads with a term (a fencing token) until it
    /// resigns or loses its lease, and anyone can read or follow the leader.
    /// Its keys are `name:leader` (the lease), `name:term` (the term counter)
    /// and `name:value` (the advertised value), after the key prefix; the
    /// latter two never expire and are never deleted by this crate (the
    /// counter must not go back).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for an empty name or one without a non-empty
    /// hash tag (`{jobs}`, `{jobs}:scheduler`): the keys must share a cluster
    /// slot. Nothing is sent to Redis.
    pub fn election(&self, name: &str) -> Result<Election> {
        Election::new(&self.dep, name)
    }

    /// The prefix added to every key.
    pub fn key_prefix(&self) -> &str {
        &self.dep.prefix
    }

    /// The longest any one command may take before it counts as failed.
    pub fn node_timeout(&self) -> Duration {
        self.dep.node_timeout()
    }

    /// The replication guard every grant goes through.
    pub fn replication(&self) -> Replication {
        self.dep.replication
    }

    /// The renewal runtime's counters: round trips, renewals, failures, losses.
    pub fn renewal_stats(&self) -> RenewalStats {
        self.dep.stats()
    }

    /// The primaries this coordinator uses now, as `redis://host:port`: the
    /// standalone server, the current Sentinel primary, or every cluster
    /// primary in the slot map. Does not block on the network.
    pub fn primaries(&self) -> Vec<String> {
        self.dep
            .topology
            .primaries()
            .iter()
            .map(|n| n.addr().to_owned())
            .collect()
    }

    /// The deployment behind this handle.
    pub(crate) fn deployment(&self) -> &Arc<Deployment> {
        &self.dep
    }
}

impl fmt::Debug for Coordinator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Coordinator")
            .field("deployment", &self.dep.topology.describe())
            .field("key_prefix", &self.dep.prefix)
            .field("node_timeout", &self.dep.node_timeout())
            .finish_non_exhaustive()
    }
}

/// Settings for a [`Coordinator`]; see [`Coordinator::builder`],
/// [`Coordinator::cluster_builder`] and [`Coordinator::sentinel_builder`].
#[must_use = "call build() to connect"]
pub struct CoordinatorBuilder {
    target: Target,
    key_prefix: String,
    connect_timeout: Duration,
    /// The node timeout and the drift factor.
    timing: Timing,
    pool_size: usize,
    protocol: Protocol,
    username: Option<String>,
    password: Option<String>,
    database: Option<i64>,
    refresh: Duration,
    replication: Replication,
    sentinel_username: Option<String>,
    sentinel_password: Option<String>,
    node_tls: Option<bool>,
    observer: Option<Arc<dyn Observer>>,
    /// The clock every part of the deployment reads (the monotonic clock).
    clock: Arc<dyn Clock>,
    #[cfg(feature = "tls")]
    tls: crate::conn::TlsMaterial,
    #[cfg(feature = "tls")]
    sentinel_tls: Option<crate::conn::TlsMaterial>,
}

/// Refuses an empty key set and a key that comes twice.
fn distinct<'a>(keys: impl Iterator<Item = &'a str>) -> Result<()> {
    let mut seen = std::collections::HashSet::new();
    for key in keys {
        if !seen.insert(key) {
            return Err(Error::InvalidArgument(format!(
                "key {key:?} is given twice: each lease of a set needs keys of its own"
            )));
        }
    }
    if seen.is_empty() {
        return Err(Error::InvalidArgument(
            "a set of leases needs at least one key".into(),
        ));
    }
    Ok(())
}

impl CoordinatorBuilder {
    fn new(target: Target) -> Self {
        CoordinatorBuilder {
            target,
            key_prefix: String::new(),
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            timing: Timing {
                drift_factor: DEFAULT_DRIFT_FACTOR,
                node_timeout: DEFAULT_NODE_TIMEOUT,
            },
            pool_size: DEFAULT_POOL_SIZE,
            protocol: Protocol::Resp2,
            username: None,
            password: None,
            database: None,
            refresh: DEFAULT_REFRESH,
            replication: Replication::Off,
            sentinel_username: None,
            sentinel_password: None,
            node_tls: None,
            observer: None,
            clock: clock::system(),
            #[cfg(feature = "tls")]
            tls: Default::default(),
            #[cfg(feature = "tls")]
            sentinel_tls: None,
        }
    }

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
        self.timing.node_timeout = timeout;
        self
    }

    /// Tells `observer` what this coordinator's locks do: every acquire
    /// call, grant, contention, end of a wait, renewal, loss and release,
    /// Sentinel switches and cluster slot moves, and the fall-back to
    /// polling. See [`Observer`] for the threads it is called on and why it
    /// must not block. Without one, none of this costs anything. Defaults to
    /// no observer.
    pub fn observer(mut self, observer: Arc<dyn Observer>) -> Self {
        self.observer = Some(observer);
        self
    }

    /// The most command connections the pool opens — per primary of a
    /// cluster — (the renewal executors and the invalidation subscribers have
    /// their own). Defaults to 8.
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
        self.timing.drift_factor = factor;
        self
    }

    /// The ACL user of the data servers, overriding the URL's. Defaults to the
    /// URL's user (for a cluster, the first seed's), else `default`.
    pub fn username(mut self, user: &str) -> Self {
        self.username = Some(user.to_owned());
        self
    }

    /// The password of the data servers, overriding the URL's. Defaults to the
    /// URL's password (for a cluster, the first seed's), else none.
    pub fn password(mut self, password: &str) -> Self {
        self.password = Some(password.to_owned());
        self
    }

    /// The database number, overriding the URL's. Defaults to the URL's, else 0.
    /// A Redis Cluster has database 0 only.
    pub fn database(mut self, db: i64) -> Self {
        self.database = Some(db);
        self
    }

    /// How often a Cluster coordinator reads the slot map again, and a
    /// Sentinel coordinator asks every sentinel for the primary, besides
    /// doing so at once after a `MOVED` or a `+switch-master`. It bounds how
    /// long a change nobody is told of (a slot forcibly reassigned, a missed
    /// message) goes unnoticed. At least 10 ms. Defaults to 1 s; unused for a
    /// standalone server.
    pub fn topology_refresh(mut self, interval: Duration) -> Self {
        self.refresh = interval;
        self
    }

    /// Whether every grant waits for replicas to acknowledge it (`WAIT`
    /// pipelined after the acquire script); see [`Replication`]. Defaults to
    /// [`Replication::Off`].
    pub fn replication(mut self, replication: Replication) -> Self {
        self.replication = replication;
        self
    }

    /// The ACL user for the sentinels, overriding the sentinel URLs'.
    /// Defaults to each URL's user, else `default`. Sentinel deployments only.
    pub fn sentinel_username(mut self, user: &str) -> Self {
        self.sentinel_username = Some(user.to_owned());
        self
    }

    /// The password for the sentinels, overriding the sentinel URLs'.
    /// Defaults to each URL's password, else none. Sentinel deployments only.
    pub fn sentinel_password(mut self, password: &str) -> Self {
        self.sentinel_password = Some(password.to_owned());
        self
    }

    /// Whether the data servers of a Sentinel deployment are reached over TLS.
    /// Defaults to what the first sentinel URL uses (`rediss://` or not).
    /// Sentinel deployments only.
    pub fn node_tls(mut self, tls: bool) -> Self {
        self.node_tls = Some(tls);
        self
    }

    /// The CA certificate (PEM) that signs the data servers' certificates, for
    /// `rediss://`. Defaults to the system's trust store.
    #[cfg(feature = "tls")]
    #[cfg_attr(docsrs, doc(cfg(feature = "tls")))]
    pub fn tls_ca_pem(mut self, pem: impl Into<Vec<u8>>) -> Self {
        self.tls.ca = Some(pem.into());
        self
    }

    /// A client certificate and its private key (PEM), for data servers that
    /// require mutual TLS. Defaults to none.
    #[cfg(feature = "tls")]
    #[cfg_attr(docsrs, doc(cfg(feature = "tls")))]
    pub fn tls_client_cert_pem(
        mut self,
        cert: impl Into<Vec<u8>>,
        key: impl Into<Vec<u8>>,
    ) -> Self {
        self.tls.client = Some((cert.into(), key.into()));
        self
    }

    /// The CA certificate (PEM) that signs the sentinels' certificates.
    /// Defaults to the data servers' ([`tls_ca_pem`](Self::tls_ca_pem)).
    /// Sentinel deployments only.
    #[cfg(feature = "tls")]
    #[cfg_attr(docsrs, doc(cfg(feature = "tls")))]
    pub fn sentinel_tls_ca_pem(mut self, pem: impl Into<Vec<u8>>) -> Self {
        self.sentinel_tls.get_or_insert_with(Default::default).ca = Some(pem.into());
        self
    }

    /// A client certificate and key (PEM) for sentinels that require mutual
    /// TLS. Defaults to the data servers'
    /// ([`tls_client_cert_pem`](Self::tls_client_cert_pem)). Sentinel
    /// deployments only.
    #[cfg(feature = "tls")]
    #[cfg_attr(docsrs, doc(cfg(feature = "tls")))]
    pub fn sentinel_tls_client_cert_pem(
        mut self,
        cert: impl Into<Vec<u8>>,
        key: impl Into<Vec<u8>>,
    ) -> Self {
        self.sentinel_tls
            .get_or_insert_with(Default::default)
            .client = Some((cert.into(), key.into()));
        self
    }

    /// The shortest TTL that [`keep_alive`](crate::LeaseGuard::keep_alive)
    /// accepts with this builder's node timeout and drift factor: the renewal
    /// at half the TTL must come before the loss deadline with two node
    /// timeouts to spare (`(2 × node timeout + 2 ms) / (0.5 − drift factor)`;
    /// 2.045 s with the defaults). Does not connect.
    pub fn min_keep_alive_ttl(&self) -> Duration {
        self.timing.min_keepalive_ttl()
    }

    /// Checks the settings and connects once.
    ///
    /// Blocks for at most: the connect timeout for one server; the connect
    /// timeout plus the node timeout per seed tried for a cluster (the first
    /// that answers ends it); for Sentinel, the connect timeout plus the node
    /// timeout per sentinel tried, plus the connect timeout to the primary.
    ///
    /// # Errors
    /// - [`Error::InvalidArgument`] for a key prefix with braces, a drift
    ///   factor outside `0.0..0.5`, a pool size of 0, a refresh interval under
    ///   10 ms, a replication guard with a zero timeout or `replicas`, no seed
    ///   or sentinel, seeds with different schemes, a service name that is
    ///   empty, a database other than 0 for a cluster, or `sentinel_*` /
    ///   `node_tls` settings for a deployment that is not a Sentinel one.
    /// - [`Error::Config`] for a URL that does not parse or zero timeouts.
    /// - [`Error::Connect`], [`Error::Auth`], [`Error::Tls`] when the first
    ///   connection fails (auth and TLS failures end the search at once).
    /// - [`Error::Topology`] when no seed gives a slot map (a seed not in
    ///   cluster mode, a cluster not formed), no sentinel knows the service, a
    ///   URL names something that is not a sentinel, or the named primary is
    ///   not one (`ROLE`).
    /// - [`Error::ServerTooOld`] when the server (the one that holds the key
    ///   prefix, in a cluster) reports a Redis version before 7.0 (`INFO
    ///   server`, one more round trip; a user denied `INFO` is not judged).
    pub fn build(self) -> Result<Coordinator> {
        let target = self.check()?;
        let settings = Settings {
            pool_size: self.pool_size,
            refresh: self.refresh,
            clock: self.clock.clone(),
            timing: self.timing,
            observer: self.observer.clone(),
        };
        let role = match self.replication {
            Replication::Off => RoleCheck::None,
            _ => RoleCheck::Learn,
        };
        let topology = match target {
            ParsedTarget::Standalone(url) => {
                let cfg = Arc::new(ConnConfig::new(self.data_settings(url, role, None))?);
                let first = cfg.connect(cfg.connect_timeout, "respire")?;
                Topology::standalone(cfg, Some(first), &settings)
            }
            ParsedTarget::Cluster { seeds, auth } => self.cluster(seeds, auth, role, &settings)?,
            ParsedTarget::Sentinel {
                sentinels,
                service,
                auth,
                database,
            } => self.sentinel(sentinels, service, auth, database, &settings)?,
        };
        let dep = Arc::new(Deployment::new(
            topology,
            self.key_prefix,
            self.connect_timeout,
            self.replication,
            settings.clock,
        ));
        dep.check_server_version(&dep.prefix)?;
        Ok(Coordinator { dep })
    }

    /// Checks the settings and makes the connection config of the standalone
    /// server they name, without connecting; also returns the key prefix.
    /// A Redlock group's nodes are made this way: a Cluster or Sentinel target
    /// is refused with [`Error::NotIndependent`].
    pub(crate) fn standalone_config(self) -> Result<(Arc<ConnConfig>, String)> {
        match self.check()? {
            ParsedTarget::Standalone(url) => {
                let cfg = ConnConfig::new(self.data_settings(url, RoleCheck::None, None))?;
                Ok((Arc::new(cfg), self.key_prefix))
            }
            ParsedTarget::Cluster { .. } => Err(Error::NotIndependent(
                "a Redis Cluster deployment (cluster nodes share failover and slot \
                 ownership); use standalone servers that fail independently"
                    .into(),
            )),
            ParsedTarget::Sentinel { .. } => Err(Error::NotIndependent(
                "a Sentinel deployment (its primary moves on failover); use standalone \
                 servers that fail independently"
                    .into(),
            )),
        }
    }

    /// Checks every setting that needs no connection; returns the target with
    /// topology URLs taken apart.
    fn check(&self) -> Result<ParsedTarget> {
        keys::check_prefix(&self.key_prefix)?;
        if !(0.0..0.5).contains(&self.timing.drift_factor) {
            return Err(Error::InvalidArgument(format!(
                "drift factor {} is outside 0.0..0.5",
                self.timing.drift_factor
            )));
        }
        if self.pool_size == 0 {
            return Err(Error::InvalidArgument("pool size is 0".into()));
        }
        if self.refresh < MIN_REFRESH {
            return Err(Error::InvalidArgument(format!(
                "topology refresh interval {:?} is under {MIN_REFRESH:?}",
                self.refresh
            )));
        }
        match self.replication {
            Replication::Off => {}
            Replication::Report { timeout } | Replication::Require { timeout, .. }
                if timeout < Duration::from_millis(1) =>
            {
                return Err(Error::InvalidArgument(format!(
                    "replication timeout {timeout:?} is under 1 ms (WAIT 0 would block forever)"
                )));
            }
            Replication::Require { replicas: 0, .. } => {
                return Err(Error::InvalidArgument(
                    "Replication::Require needs at least 1 replica; use Off".into(),
                ));
            }
            _ => {}
        }
        let target = match &self.target {
            Target::Url(url) => parse_target(url)?,
            other => ParsedTarget::from(other),
        };
        if !matches!(target, ParsedTarget::Sentinel { .. })
            && (self.sentinel_username.is_some()
                || self.sentinel_password.is_some()
                || self.node_tls.is_some()
                || self.has_sentinel_tls())
        {
            return Err(Error::InvalidArgument(
                "sentinel_username, sentinel_password, sentinel_tls_* and node_tls apply to \
                 Sentinel deployments only"
                    .into(),
            ));
        }
        if self.timing.node_timeout.is_zero() {
            return Err(Error::Config(TIMEOUTS_ZERO.into()));
        }
        Ok(target)
    }

    fn cluster(
        &self,
        seeds: Vec<String>,
        auth: Option<Auth>,
        role: RoleCheck,
        settings: &Settings,
    ) -> Result<Arc<Topology>> {
        if seeds.is_empty() {
            return Err(Error::InvalidArgument("no cluster seed given".into()));
        }
        if let Some(db) = self.database
            && db != 0
        {
            return Err(Error::InvalidArgument(format!(
                "database {db}: a Redis Cluster has database 0 only"
            )));
        }
        let scheme = |u: &str| u.split("://").next().unwrap_or("").to_owned();
        let first = scheme(&seeds[0]);
        if let Some(other) = seeds.iter().find(|u| scheme(u) != first) {
            return Err(Error::InvalidArgument(format!(
                "cluster seeds use different schemes: {} and {}",
                redact_url(&seeds[0]),
                redact_url(other)
            )));
        }
        let cfgs = seeds
            .into_iter()
            .map(|url| {
                let cfg = ConnConfig::new(self.data_settings(url, role, auth.clone()))?;
                if cfg.host_port().is_none() {
                    return Err(Error::InvalidArgument(format!(
                        "cluster seed {} is not a TCP address",
                        cfg.addr
                    )));
                }
                Ok(Arc::new(cfg))
            })
            .collect::<Result<Vec<_>>>()?;
        // A cluster seed with a database in its URL is refused too.
        if let Some(db) = cfgs.iter().find_map(|c| c.database().filter(|d| *d != 0)) {
            return Err(Error::InvalidArgument(format!(
                "database {db}: a Redis Cluster has database 0 only"
            )));
        }
        Topology::cluster(cfgs, settings)
    }

    fn sentinel(
        &self,
        sentinels: Vec<String>,
        service: String,
        auth: Option<Auth>,
        database: Option<i64>,
        settings: &Settings,
    ) -> Result<Arc<Topology>> {
        if sentinels.is_empty() {
            return Err(Error::InvalidArgument("no sentinel given".into()));
        }
        if service.is_empty() {
            return Err(Error::InvalidArgument(
                "the Sentinel service name is empty".into(),
            ));
        }
        let sentinel_cfgs = sentinels
            .iter()
            .map(|url| ConnConfig::new(self.sentinel_settings(url)).map(Arc::new))
            .collect::<Result<Vec<_>>>()?;
        let tls = self.node_tls.unwrap_or(sentinel_cfgs[0].tls);
        let scheme = if tls { "rediss" } else { "redis" };
        // The data nodes' settings; each primary's address replaces
        // this placeholder before anything connects.
        let mut s = self.data_settings(
            format!("{scheme}://127.0.0.1:{DEFAULT_PORT}"),
            RoleCheck::Primary,
            auth,
        );
        if s.database.is_none() {
            s.database = database;
        }
        let template = Arc::new(ConnConfig::new(s)?);
        Topology::sentinel(sentinel_cfgs, &service, template, settings)
    }

    #[cfg(feature = "tls")]
    fn has_sentinel_tls(&self) -> bool {
        self.sentinel_tls.is_some()
    }

    #[cfg(not(feature = "tls"))]
    fn has_sentinel_tls(&self) -> bool {
        false
    }

    /// Connection settings for a data server at `url`; `auth` is user info
    /// from a topology URL, which the builder's own settings override.
    fn data_settings(&self, url: String, role: RoleCheck, auth: Option<Auth>) -> ConnSettings {
        let (user, pass) = auth.map_or((None, None), |a| (a.user, a.password));
        ConnSettings {
            url,
            username: self.username.clone().or(user),
            password: self.password.clone().or(pass),
            database: self.database,
            protocol: self.protocol,
            connect_timeout: self.connect_timeout,
            role,
            clock: self.clock.clone(),
            extension_acks: match self.replication {
                Replication::Require { replicas, timeout } => Some((replicas, timeout)),
                _ => None,
            },
            #[cfg(feature = "tls")]
            tls: self.tls.clone(),
        }
    }

    /// Connection settings for the sentinel at `url`.
    fn sentinel_settings(&self, url: &str) -> ConnSettings {
        ConnSettings {
            url: url.to_owned(),
            username: self.sentinel_username.clone(),
            password: self.sentinel_password.clone(),
            database: None,
            protocol: Protocol::Resp2,
            connect_timeout: self.connect_timeout,
            role: RoleCheck::None,
            clock: self.clock.clone(),
            extension_acks: None,
            #[cfg(feature = "tls")]
            tls: self
                .sentinel_tls
                .clone()
                .unwrap_or_else(|| self.tls.clone()),
        }
    }
}

impl From<&Target> for ParsedTarget {
    fn from(t: &Target) -> Self {
        match t {
            Target::Url(url) => ParsedTarget::Standalone(url.clone()),
            Target::Cluster(seeds) => ParsedTarget::Cluster {
                seeds: seeds.clone(),
                auth: None,
            },
            Target::Sentinel { sentinels, service } => ParsedTarget::Sentinel {
                sentinels: sentinels.clone(),
                service: service.clone(),
                auth: None,
                database: None,
            },
        }
    }
}

impl fmt::Debug for CoordinatorBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let target = match &self.target {
            Target::Url(url) => redact_url(url),
            Target::Cluster(seeds) => format!(
                "cluster {:?}",
                seeds.iter().map(|s| redact_url(s)).collect::<Vec<_>>()
            ),
            Target::Sentinel { sentinels, service } => format!(
                "sentinel {:?} service {service:?}",
                sentinels.iter().map(|s| redact_url(s)).collect::<Vec<_>>()
            ),
        };
        f.debug_struct("CoordinatorBuilder")
            .field("target", &target)
            .field("key_prefix", &self.key_prefix)
            .field("connect_timeout", &self.connect_timeout)
            .field("node_timeout", &self.timing.node_timeout)
            .field("pool_size", &self.pool_size)
            .field("protocol", &self.protocol)
            .field("drift_factor", &self.timing.drift_factor)
            .field("username", &self.username)
            .field("password", &self.password.as_ref().map(|_| "***"))
            .field("database", &self.database)
            .field("topology_refresh", &self.refresh)
            .field("replication", &self.replication)
            .field("observer", &self.observer.is_some())
            .field("sentinel_username", &self.sentinel_username)
            .field(
                "sentinel_password",
                &self.sentinel_password.as_ref().map(|_| "***"),
            )
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_builder_settings_are_refused_before_connecting() {
        let refused = |b: CoordinatorBuilder, why: &str| {
            let err = b.build().unwrap_err();
            assert!(
                matches!(&err, Error::InvalidArgument(m) if m.contains(why)),
                "{err}"
            );
        };
        refused(Coordinator::cluster_builder(&[]), "no cluster seed");
        refused(Coordinator::sentinel_builder(&[], "s"), "no sentinel");
        refused(
            Coordinator::sentinel_builder(&["redis://127.0.0.1:1"], ""),
            "service name is empty",
        );
        refused(
            Coordinator::cluster_builder(&["redis://127.0.0.1:1", "rediss://127.0.0.1:2"]),
            "different schemes",
        );
        refused(
            Coordinator::cluster_builder(&["redis://127.0.0.1:1"]).database(2),
            "database 0 only",
        );
        refused(
            Coordinator::cluster_builder(&["redis://127.0.0.1:1/2"]),
            "database 0 only",
        );
        refused(
            Coordinator::builder("redis://127.0.0.1:1").sentinel_password("x"),
            "Sentinel deployments only",
        );
        refused(
            Coordinator::builder("redis://127.0.0.1:1").node_tls(true),
            "Sentinel deployments only",
        );
        refused(
            Coordinator::builder("redis://127.0.0.1:1").topology_refresh(Duration::from_millis(1)),
            "refresh interval",
        );
        refused(
            Coordinator::builder("redis://127.0.0.1:1").replication(Replication::Report {
                timeout: Duration::ZERO,
            }),
            "under 1 ms",
        );
        refused(
            Coordinator::builder("redis://127.0.0.1:1").replication(Replication::Require {
                replicas: 0,
                timeout: Duration::from_millis(10),
            }),
            "at least 1 replica",
        );
    }

    #[test]
    fn zero_timeouts_are_refused_before_connecting() {
        // Port 1: a build that got as far as connecting would fail with
        // Error::Connect instead.
        let zero = |b: CoordinatorBuilder| {
            let err = b.build().unwrap_err();
            assert!(
                matches!(&err, Error::Config(m) if m == TIMEOUTS_ZERO),
                "{err}"
            );
        };
        zero(Coordinator::builder("redis://127.0.0.1:1").node_timeout(Duration::ZERO));
        zero(Coordinator::builder("redis://127.0.0.1:1").connect_timeout(Duration::ZERO));
        zero(Coordinator::cluster_builder(&["redis://127.0.0.1:1"]).node_timeout(Duration::ZERO));
        zero(
            Coordinator::sentinel_builder(&["redis://127.0.0.1:1"], "s")
                .node_timeout(Duration::ZERO),
        );
    }
}
