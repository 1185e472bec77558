//! `RedlockGroup`: a lock that needs a majority of independent Redis servers,
//! after antirez's Redlock algorithm ("Distributed Locks with Redis", the
//! distributed-locks pattern page of the Redis documentation), with the limits
//! Kleppmann pointed out in "How to do distributed locking" and antirez's reply
//! "Is Redlock safe?". The public docs are on [`RedlockGroup`](crate::RedlockGroup).
//!
//! The fan-out runs on the per-node workers (`worker.rs`); the quorum
//! arithmetic is `core::quorum`, the checks that refuse an unsound group, TTL
//! or set of nodes are `core::redlock`'s, and each guard's bounds are a
//! `core::lease` like every other lease's. Here: the group (`mod.rs`), its
//! settings (`options.rs`), the fan-out and its evidence (`fanout.rs`), one
//! attempt (`attempt.rs`), the acquire handle (`lock.rs`), the reading of what
//! the nodes hold (`inspect.rs`), the guard and its renewal (`guard.rs`) and
//! the judgement of locks when a node goes away or restarts (`restarts.rs`).

mod attempt;
mod fanout;
mod guard;
mod inspect;
mod lock;
mod options;
mod restarts;
mod worker;

use std::fmt;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use crate::clock::Clock;
use crate::conn::ConnConfig;
use crate::coordinator::Coordinator;
use crate::core::redlock::{check_group, check_independent, check_round_trips};
use crate::core::timing::Timing;
use crate::error::{Error, Result};
use crate::lease::acquire::Lease;
use crate::token::HolderTag;
use worker::{Hello, NodeSettings, NodeWatcher, NodeWorker};

pub use attempt::RedlockAttempt;
pub use guard::{Redlock, RedlockGuard};
pub use inspect::{NodeInspection, RedlockInspection};
pub(crate) use lock::RedlockHandle;
pub use options::RedlockOptions;

use attempt::Evidence;
use guard::GroupRenewal;
use restarts::Restarts;
#[cfg(test)]
pub(crate) use worker::{confirm_kill, node_acquire};

/// A lock held by a majority of independent Redis servers: antirez's Redlock.
///
/// Made by [`RedlockGroup::connect`](crate::RedlockGroup::connect) from the URLs of an odd number (3 or
/// more) of standalone servers that fail independently, or by
/// [`RedlockGroup::new`](crate::RedlockGroup::new) from [`Coordinator`]s whose connection settings
/// (credentials, TLS, database, connect timeout) and key prefix it adopts;
/// cheap to clone. Each node's key is its key prefix plus the key.
///
/// # How an attempt works
///
/// The single-node acquire (`SET key token NX PX ttl`: the key is set to a
/// fresh 128-bit owner token if it is free, in one round trip with a `GET` and
/// a `PTTL` that tell a key of another type and the holder's time left) goes
/// to every node at once, each bounded by the
/// node timeout. The attempt returns as soon as the outcome is decided: a
/// quorum (`N/2 + 1`) granted, or too few nodes are left to reach one. A slow
/// or unreachable minority therefore does not slow a successful attempt down;
/// its commands are abandoned, and any grant they still make is deleted by the
/// release, which reaches each node after that node's acquire. The lock is
/// valid for `ttl − elapsed − (ttl × drift + 2 ms)`, measured on the local
/// monotonic clock from the first send. A failed attempt is released on every
/// node it reached, including nodes that failed or did not answer. Every
/// attempt reports what each node answered ([`NodeReport`](crate::NodeReport)).
///
/// Connections are never made inside an operation. Every node is connected
/// when the group is made, all at once, and after a failure its connection is
/// made again in the background (each try bounded by the connect timeout); a
/// node without a connection answers
/// [`NodeOutcome::NotConnected`](crate::NodeOutcome::NotConnected) at once.
/// So an attempt costs one round trip to the quorum's slowest node, however
/// far the nodes are: the scripts are checked with `SCRIPT EXISTS` when a
/// connection is made, and one the server lacks goes out as `EVAL` directly.
///
/// # Choosing the node timeout
///
/// The node timeout bounds one command on one node: an answer later than
/// that does not count. It must cover a round trip with room to spare, and it
/// costs validity: an attempt may take up to a node timeout, and a guard is
/// flagged lost one node timeout before its validity ends.
///
/// - **At least twice the slowest node's round trip.** The group measures
///   each node's round trip when it connects (the setup round trip, confirmed
///   by up to four more samples while it looks slow) and refuses a node timeout below
///   twice it with [`Error::NodeTimeoutTooShort`], naming the node, its round
///   trip and the node timeout it needs. Twice, because one round trip is the
///   floor of every command, and the second one absorbs the tail of the
///   link's latency (queueing, a retransmit, a busy server) and the `EVAL`
///   retry when a server lost its script cache. [`RedlockGroup::nodes`] shows
///   the measured round trips.
/// - **Far below the TTL.** A TTL is refused unless node timeout plus drift is
///   under half of it; aim for a node timeout of about 1% of the TTL or less.
///   antirez suggests 5–50 ms for a 10 s TTL with the nodes on one LAN.
///
/// The default, 50 ms, fits nodes up to 25 ms away: one data center, or zones
/// of one region. Across zones of distant regions, for example nodes in three
/// regions with round trips of 10, 35 and 60 ms from the client, use 150 ms
/// (more than twice 60 ms) with TTLs of 15 s or more: the worst attempt then
/// keeps `15 s − 150 ms − 152 ms` of validity, and `keep_alive` renews at
/// 7.5 s with ample time for a retry.
///
/// ```no_run
/// use std::time::Duration;
/// use respire_coordination::{RedlockGroup, RedlockOptions};
///
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let group = RedlockGroup::connect(
///     &["redis://us-east.example:6379", "redis://us-central.example:6379",
///       "redis://us-west.example:6379"],
///     RedlockOptions { node_timeout: Duration::from_millis(150), ..RedlockOptions::default() },
/// )?;
/// for node in group.nodes() {
///     println!("{}: round trip {:?}", node.addr, node.round_trip);
/// }
/// let guard = group.lock("invoice-run")?.acquire_timeout(Duration::from_secs(15), Duration::from_secs(5))?;
/// # drop(guard);
/// # Ok(()) }
/// ```
///
/// # What Redlock does not promise
///
/// - **No fencing.** Nothing increases with each grant, so a protected
///   resource cannot refuse a holder that paused (GC, swapping, `SIGSTOP`) or
///   whose packets were delayed past its validity while someone else got the
///   lock. Where a second holder would corrupt data, use one deployment with a
///   [`FencedLock`](crate::FencedLock) and a resource that checks the token.
/// - **No consensus.** Safety rests on timing assumptions: processes do not
///   pause longer than the validity margin, packets are not delayed past it,
///   and the servers' clocks advance at about the rate of the client's. A clock
///   jump on a server (a wrong NTP step, a manual change) expires keys early;
///   the drift allowance only covers rate differences.
/// - **Restarts forget.** A node that restarts without the key (no AOF, or
///   `appendfsync` other than `always`) comes back empty and can grant the lock
///   to a second client while the first still counts on it: two restarted
///   nodes of three, or three of five, make two holders.
///
/// # Restarts
///
/// antirez's rule: keep a crashed node out of the group for longer than the
/// longest TTL in use ("delayed restarts"), unless it persists every write with
/// `appendfsync always`. The group does two things about it:
///
/// - An extension never counts a node whose `run_id` changed since it granted
///   the lock (learned from `INFO` on every new connection; a restart always
///   breaks connections). Even with persistence, the group cannot tell
///   whether the restarted node kept the key.
/// - Each node has a watcher on an idle connection of its own. The moment
///   that connection fails (the server stopped, restarted or closed it, or,
///   pinged after 5 s of silence, did not answer), the watcher's first
///   connection cannot be made (the server may have gone away before the
///   watcher was there to see it) or the watcher finds a new `run_id`, every
///   live lock is judged again: a node
///   that went away counts no more for a lock unless the restart delay keeps
///   it from granting anything before the lock's loss deadline, and a node
///   that restarted never counts again. A lock that fewer than a quorum of
///   nodes count for is flagged lost at once. A killed server's connections
///   close with it, so the watcher wakes on its close and, unless this
///   process is stopped or starved of CPU at that moment, flags the lock well
///   before a restarted server takes commands (a restart takes tens of
///   milliseconds); only the restart delay makes that a guarantee. Without a
///   restart delay this flags a lock lost even when the node comes back with
///   its data, or only its connection was closed: the group cannot tell which
///   in time.
/// - With [`RedlockOptions::restart_delay`] set above your longest TTL, it
///   sends no acquire to a server whose uptime is below that delay: the rule
///   enforced by every client of this crate, whatever the operator does. It
///   reads the uptime, so it also protects clients that never saw the old
///   server.
///
/// Neither replaces persistence or an operator who delays restarts for
/// clients that do not use this crate.
///
/// # Waiting
///
/// Independent servers cannot share client-tracking invalidations, so the
/// bounded waits poll: bounded retries with jitter, as the Redlock page
/// advises (see [Redlock's waits](crate::Lease#redlock)). Like
/// every wait in this crate, they ride out failures that may pass and end at
/// once on permanent ones: see
/// [Waiting and cancellation](crate#waiting-and-cancellation).
///
/// ```no_run
/// use std::time::Duration;
/// use respire_coordination::{Error, RedlockGroup, RedlockOptions};
///
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let group = RedlockGroup::connect(
///     &["redis://10.0.0.1:6379", "redis://10.0.0.2:6379", "redis://10.0.0.3:6379"],
///     RedlockOptions { node_timeout: Duration::from_millis(20), ..RedlockOptions::default() },
/// )?;
/// match group.lock("invoice-run")?.acquire_timeout(Duration::from_secs(30), Duration::from_secs(5)) {
///     Ok(Some(guard)) => {
///         let _renewal = guard.keep_alive()?;
///         // ... work, checking guard.is_lost() ...
///         drop(_renewal);
///         guard.release()?;
///     }
///     Ok(None) => println!("someone else holds it"),
///     Err(Error::QuorumNotReached { nodes, .. }) => {
///         for node in nodes {
///             eprintln!("{}: {}", node.node, node.outcome);
///         }
///     }
///     Err(e) => return Err(e.into()),
/// }
/// # Ok(()) }
/// ```
///
/// # Threads and connections
///
/// Per group: one worker thread per node (`respire-node-N`), each with one
/// connection (named `respire-redlock` in `CLIENT LIST`), running that node's
/// share of every operation in order; and one renewal thread
/// (`respire-redlock`), started by the first
/// [`keep_alive`](crate::LeaseGuard::keep_alive) or
/// [`lost_signal`](crate::LeaseGuard::lost_signal) of one of its guards, that fires loss signals
/// and runs keep-alives without ever waiting on a node. While a node is
/// reconnecting, a connector thread (`respire-conn-N`) makes its new
/// connection and ends. One watcher thread per node (`respire-watch-N`) holds
/// an idle subscribed connection (named `respire-redlock-watch`) to notice at
/// once when the server goes away or restarts (see [Restarts](#restarts)). So
/// a group of 5 healthy nodes runs 10 threads, at most 1 renewal thread and 10
/// connections; the coordinators given to
/// [`RedlockGroup::new`] are not used for anything but their settings. The
/// threads stop when the last clone of the group and the last guard are
/// dropped, after finishing the releases already queued. Dropping that last
/// clone or guard blocks, at most a node timeout, until every node's worker
/// has sent what was queued on it (a release returns once a quorum answered;
/// the other nodes' releases may still be on their way): a program that ends
/// right after leaves no key behind on those nodes.
///
/// A calling thread waits for the nodes' answers parked
/// ([`std::thread::park_timeout`]), and a node that answers after the
/// outcome was decided still unparks it: a later [`std::thread::park`] of
/// that thread may return at once, a spurious wake-up that `park`'s own
/// contract already asks every caller to expect.
///
/// # ACL rights
///
/// On each node: `EVALSHA` and `EVAL` (the scripts, on the keys with the
/// node's prefix), `INFO` (independence checks and restart detection),
/// `CLIENT ID` and `CLIENT KILL` (a command that got no reply is fenced off by
/// killing its connection before anything else is sent; both are checked when
/// the group is made), and, optionally, `SCRIPT EXISTS` (without it a script
/// the server lacks costs one more round trip, once), `CLIENT SETNAME` and
/// `SUBSCRIBE` to the channel `respire-redlock-watch` (without it a restart is
/// noticed only by the next command sent to the node).
pub struct RedlockGroup {
    inner: Arc<Group>,
    /// Who the locks it takes say holds them.
    holder: Option<HolderTag>,
}

impl Clone for RedlockGroup {
    fn clone(&self) -> Self {
        self.inner.users.join();
        RedlockGroup {
            inner: self.inner.clone(),
            holder: self.holder.clone(),
        }
    }
}

impl Drop for RedlockGroup {
    fn drop(&mut self) {
        self.inner.users.leave(&self.inner);
    }
}

/// How many clones of a group and guards of its locks the program holds.
/// The group's own threads hold references to it too (the renewal thread
/// until it has read a released lease's `Forget`, a watcher reporting an
/// event), so the group's drop may run on one of them after the program has
/// moved on, or not at all before it exits. The drop of the program's last
/// clone or guard is where the program is done with the group: it waits
/// there until the nodes' workers have taken up what was queued.
pub(crate) struct Users(AtomicUsize);

impl Users {
    fn new() -> Self {
        Users(AtomicUsize::new(1))
    }

    /// One more clone or guard.
    pub(crate) fn join(&self) {
        self.0.fetch_add(1, Ordering::Relaxed);
    }

    /// A clone or guard is dropped; the last waits, at most a node timeout,
    /// for the workers to take up every job queued before.
    pub(crate) fn leave(&self, group: &Group) {
        if self.0.fetch_sub(1, Ordering::AcqRel) == 1 {
            worker::flush(&group.workers, group.now() + group.timing.node_timeout);
        }
    }
}

pub(crate) struct Group {
    /// Each node's key prefix.
    prefixes: Vec<String>,
    /// Each node's connection settings, for inspections (which open
    /// connections of their own).
    configs: Vec<Arc<ConnConfig>>,
    workers: Vec<NodeWorker>,
    options: RedlockOptions,
    /// The drift factor and node timeout of the options, which every part
    /// of the group reads.
    timing: Timing,
    quorum: usize,
    renewal: GroupRenewal,
    restarts: Restarts,
    /// The program's clones and guards.
    pub(crate) users: Users,
    /// The clock every part of the group reads: the one its nodes'
    /// connection settings carry (the monotonic clock).
    clock: Arc<dyn Clock>,
    /// Stop when the group is dropped.
    _watchers: Vec<NodeWatcher>,
}

/// One node of a [`RedlockGroup`], as its worker last saw it: see
/// [`RedlockGroup::nodes`].
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct RedlockNode {
    /// The node's address, without credentials.
    pub addr: String,
    /// The prefix added to keys on this node.
    pub key_prefix: String,
    /// The round trip measured when its current (or last) connection was
    /// made: the setup round trip (when the group was made, the fastest of
    /// up to five samples, more being taken while the fastest is too slow
    /// for the node timeout).
    pub round_trip: Option<Duration>,
    /// Whether it has a connection now; `false` while it reconnects.
    pub connected: bool,
    /// Why it is not connected, when it is not.
    pub last_error: Option<String>,
}

impl RedlockGroup {
    /// Makes a group over `nodes`, using each coordinator's connection
    /// settings (URL, credentials, TLS, database, connect timeout) and key
    /// prefix; not its pool, threads or node timeout (the group's is in
    /// `options`). The coordinators can be dropped afterwards.
    ///
    /// Connects to every node at once and blocks until all are connected (at
    /// most the longest connect timeout): one round trip after the handshake
    /// per node, plus up to four more samples on a node whose round trip looks
    /// too slow for the node timeout. Then starts one worker thread per node; the
    /// renewal thread starts later, when first needed.
    ///
    /// # Errors
    /// - [`Error::InvalidArgument`] for fewer than 3 nodes or an even number
    ///   (an even count tolerates no more failures than the odd count below
    ///   it), a zero node timeout, or a drift factor that is negative, NaN or
    ///   not below 1.
    /// - [`Error::NotIndependent`] for two nodes that are the same server (same
    ///   `run_id`), nodes sharing a replication id (a primary and its replica,
    ///   or replicas of one primary), or a node in Redis Cluster mode.
    /// - [`Error::NodeTimeoutTooShort`] when a node's round trip is more than
    ///   half the node timeout (see [Choosing the node
    ///   timeout](RedlockGroup#choosing-the-node-timeout)).
    /// - The first node's connect error ([`Error::Connect`], [`Error::Auth`],
    ///   [`Error::Tls`], ...), at once: a node whose independence cannot be
    ///   checked is not accepted. [`Error::Permission`] when a node's ACL
    ///   denies `INFO`, `CLIENT ID` or `CLIENT KILL`.
    /// - [`Error::Thread`] when a thread cannot be started.
    pub fn new(nodes: Vec<Coordinator>, options: RedlockOptions) -> Result<RedlockGroup> {
        let mut configs = Vec::with_capacity(nodes.len());
        for node in &nodes {
            let dep = node.deployment();
            let Some(server) = dep.topology.standalone_node() else {
                let what = if dep.topology.is_cluster() {
                    "a Redis Cluster deployment (cluster nodes share failover and slot \
                     ownership)"
                } else {
                    "a Sentinel deployment (its primary moves on failover)"
                };
                return Err(Error::NotIndependent(format!(
                    "{} is {what}; use standalone servers that fail independently",
                    dep.topology.describe()
                )));
            };
            configs.push((server.cfg.clone(), node.key_prefix().to_owned()));
        }
        drop(nodes);
        Group::start(configs, options)
    }

    /// Makes a group over the servers at `urls`, with the defaults of
    /// [`Coordinator::connect`] (connect timeout 2 s, no key prefix, the
    /// URL's credentials and database); as [`RedlockGroup::new`] otherwise.
    ///
    /// # Errors
    /// [`Error::Config`] for a URL that does not parse, then as
    /// [`RedlockGroup::new`](crate::RedlockGroup::new).
    pub fn connect(urls: &[&str], options: RedlockOptions) -> Result<RedlockGroup> {
        let configs = urls
            .iter()
            .map(|url| {
                Coordinator::builder(url)
                    .node_timeout(options.node_timeout.max(Duration::from_millis(1)))
                    .standalone_config()
            })
            .collect::<Result<Vec<_>>>()?;
        Group::start(configs, options)
    }

    /// How many nodes must agree: more than half.
    pub fn quorum(&self) -> usize {
        self.inner.quorum
    }

    /// The nodes, in the order given, as their workers see them now: address,
    /// key prefix, measured round trip, and whether they are connected.
    pub fn nodes(&self) -> Vec<RedlockNode> {
        self.inner.workers.iter().map(NodeWorker::status).collect()
    }

    /// The group's settings.
    pub fn options(&self) -> &RedlockOptions {
        &self.inner.options
    }

    /// One attempt, with every node's answer.
    ///
    /// Sends the acquire to every node at once and blocks until the outcome is
    /// decided — a quorum granted, or too few nodes are left to reach one — or
    /// the node timeout runs out, whichever is first. A slow or unreachable
    /// minority does not delay a decided outcome: its answers are abandoned
    /// (and cleaned up later by owner token). A failed attempt is released on
    /// every node in the background.
    ///
    /// # Errors
    /// Only [`Error::InvalidArgument`] for an empty key, a zero TTL, one above
    /// [`MAX_TTL`](crate::MAX_TTL), or one for which the node timeout is not
    /// well below it (node timeout + drift must be under half the TTL).
    /// Contention and node failures are in the returned attempt.
    pub fn attempt(&self, key: &str, ttl: Duration) -> Result<RedlockAttempt> {
        Group::attempt(&self.inner, key, ttl, Evidence::Both, self.holder.as_ref())
    }

    /// This group (a clone sharing its nodes and threads), whose locks record
    /// `holder` as who holds them on every node: a name for people and tools
    /// to read, such as `"host-a pid 4242"`. Stored in the lock's value after
    /// its random owner id, as [`Lease::with_holder`](crate::Lease::with_holder)
    /// stores it, and read by [`inspect`](RedlockGroup::inspect) (and on one
    /// node by [`Coordinator::inspect_lease`](crate::Coordinator::inspect_lease)). No
    /// command is added; put no secret in it. Nothing is sent.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for an empty holder, one longer than
    /// [`MAX_HOLDER_LEN`](crate::MAX_HOLDER_LEN) bytes or one with a control
    /// character; the group is consumed and nothing else changes.
    pub fn with_holder(mut self, holder: &str) -> Result<RedlockGroup> {
        self.holder = Some(HolderTag::new(holder)?);
        Ok(self)
    }

    /// The holder the locks this group takes record, if any; see
    /// [`with_holder`](RedlockGroup::with_holder).
    pub fn holder(&self) -> Option<&str> {
        self.holder.as_ref().map(HolderTag::as_str)
    }

    /// The lock `key` of this group: a [`Lease<Redlock>`](crate::Lease), with
    /// the five acquire verbs every lease has (see
    /// [Redlock's waits](crate::Lease#redlock)); its leases record this
    /// group's [`holder`](RedlockGroup::holder). Nothing is sent.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for an empty key.
    pub fn lock(&self, key: &str) -> Result<Lease<Redlock>> {
        if key.is_empty() {
            return Err(Error::InvalidArgument("the key is empty".into()));
        }
        Ok(Lease::from_handle(RedlockHandle::new(self.clone(), key)))
    }
}

impl Group {
    /// Checks the options, connects every node at once, checks what they
    /// found, and makes the group.
    fn start(
        nodes: Vec<(Arc<ConnConfig>, String)>,
        options: RedlockOptions,
    ) -> Result<RedlockGroup> {
        let timing = Timing {
            drift_factor: options.drift_factor,
            node_timeout: options.node_timeout,
        };
        check_group(nodes.len(), &timing)?;
        let settings = NodeSettings {
            timing,
            restart_delay: options.restart_delay,
        };
        let (hello_tx, hello_rx) = crossbeam_channel::unbounded();
        let mut workers = Vec::with_capacity(nodes.len());
        let mut prefixes = Vec::with_capacity(nodes.len());
        let mut longest = Duration::ZERO;
        let cfgs: Vec<Arc<ConnConfig>> = nodes.iter().map(|(cfg, _)| cfg.clone()).collect();
        // The nodes' configurations carry the clock their builder chose.
        let clock = cfgs
            .first()
            .map_or_else(crate::clock::system, |cfg| cfg.clock.clone());
        for (i, (cfg, prefix)) in nodes.into_iter().enumerate() {
            longest = longest.max(cfg.connect_timeout);
            let worker = NodeWorker::spawn(i, cfg, prefix.clone(), settings, hello_tx.clone())
                .map_err(|source| Error::Thread {
                    name: "respire-node",
                    source,
                })?;
            workers.push(worker);
            prefixes.push(prefix);
        }
        drop(hello_tx);
        // Each worker's connect is bounded by its connect timeout; the margin
        // only guards against a worker that never reports.
        let until = clock.now() + longest + Duration::from_secs(1);
        let mut hellos: Vec<Option<Hello>> = vec![None; workers.len()];
        for _ in 0..workers.len() {
            match hello_rx.recv_deadline(until) {
                Ok((i, Ok(hello))) => hellos[i] = Some(hello),
                // The first failure decides: the group cannot be made.
                Ok((_, Err(e))) => return Err(e),
                Err(_) => break,
            }
        }
        let (mut infos, mut round_trips) = (Vec::new(), Vec::new());
        for (w, hello) in workers.iter().zip(hellos) {
            let Some(hello) = hello else {
                return Err(Error::Connect {
                    addr: w.addr.clone(),
                    detail: format!("not connected within {longest:?}"),
                });
            };
            infos.push((w.addr.clone(), hello.info));
            round_trips.push((w.addr.as_str(), hello.round_trip));
        }
        check_independent(&infos)?;
        check_round_trips(round_trips.into_iter(), options.node_timeout)?;
        let quorum = workers.len() / 2 + 1;
        let n = workers.len();
        Ok(RedlockGroup {
            holder: None,
            inner: Arc::new_cyclic(|this: &Weak<Group>| Group {
                prefixes,
                configs: cfgs.clone(),
                workers,
                options,
                timing,
                quorum,
                renewal: guard::group_renewal(this.clone(), clock.clone()),
                restarts: Restarts::new(n),
                users: Users::new(),
                clock,
                _watchers: watchers(cfgs, timing.node_timeout, this),
            }),
        })
    }
}

/// One watcher per node, reporting to the group while it lives. A watcher that
/// cannot be started leaves its node's restarts to be noticed by the next
/// command sent there.
fn watchers(
    cfgs: Vec<Arc<ConnConfig>>,
    node_timeout: Duration,
    group: &Weak<Group>,
) -> Vec<NodeWatcher> {
    cfgs.into_iter()
        .enumerate()
        .filter_map(|(i, cfg)| {
            let addr = cfg.addr.to_string();
            NodeWatcher::spawn(i, cfg, node_timeout, group.clone())
                .inspect_err(|e| {
                    log::warn!("redlock node {addr}: cannot start its watcher thread: {e}")
                })
                .ok()
        })
        .collect()
}

impl Drop for Group {
    fn drop(&mut self) {
        // Queued releases (of guards dropped just before) still reach their
        // nodes before the program moves on, for at most a node timeout.
        let deadline = self.now() + self.timing.node_timeout;
        worker::stop(std::mem::take(&mut self.workers), deadline);
    }
}

impl fmt::Debug for RedlockGroup {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let nodes: Vec<&str> = self.inner.workers.iter().map(|w| &*w.addr).collect();
        f.debug_struct("RedlockGroup")
            .field("nodes", &nodes)
            .field("quorum", &self.inner.quorum)
            .field("options", &self.inner.options)
            .finish()
    }
}
