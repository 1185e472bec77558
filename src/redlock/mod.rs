//! `RedlockGroup`: a lock that needs a majority of independent Redis servers,
//! after antirez's Redlock algorithm ("Distributed Locks with Redis", the
//! distributed-locks pattern page of the Redis documentation), with the limits
//! Kleppmann pointed out in "How to do distributed locking" and antirez's reply
//! "Is Redlock safe?". The public docs are on [`RedlockGroup`](crate::RedlockGroup).
//!
//! The fan-out runs on the per-node workers of `runtime::nodes`; the quorum
//! arithmetic is `core::quorum`, and each guard's bounds are a `core::lease`
//! like every other lease's. Here: the group (`mod.rs`), its settings
//! (`options.rs`), the fan-out and its evidence (`fanout.rs`), one attempt
//! (`attempt.rs`), the guard and its renewal (`guard.rs`) and the independence
//! checks (`independence.rs`).

mod attempt;
mod fanout;
mod guard;
mod independence;
mod options;

use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::cancel::CancelToken;
use crate::coordinator::Coordinator;
use crate::error::{Error, Result};
use crate::runtime::nodes::{self, NodeWorker};

pub use attempt::RedlockAttempt;
pub use guard::{RedlockGuard, RedlockKeepAlive};
pub use options::RedlockOptions;

use guard::GroupRenewal;
use independence::check_independent;
use options::{check_options, random_unit, retry_pause};

/// A lock held by a majority of independent Redis servers: antirez's Redlock.
///
/// Made by [`RedlockGroup::new`](crate::RedlockGroup::new) from an odd number (3 or more) of
/// [`Coordinator`]s for standalone servers that fail independently; cheap to
/// clone. Each node's key is that coordinator's key prefix plus the key.
///
/// # How an attempt works
///
/// The single-node acquire script (set the key to a fresh 128-bit owner token
/// with `PX ttl` if it is free) goes to every node at once, each bounded by the
/// node timeout. The attempt returns as soon as the outcome is decided: a
/// quorum (`N/2 + 1`) granted, or too few nodes are left to reach one. A slow
/// or unreachable minority therefore does not slow a successful attempt down;
/// its commands are abandoned (their connections dropped when they time out)
/// and any grant they still make is deleted by the release, which reaches
/// each node after that node's acquire. The lock is valid for
/// `ttl − elapsed − (ttl × drift + 2 ms)`, measured on the local monotonic
/// clock from the first send. A failed attempt is released on every node it
/// reached, including nodes that failed or did not answer. Every attempt
/// reports what each node answered ([`NodeReport`](crate::NodeReport)).
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
///   the lock (learned from `INFO server` on every new connection; a restart
///   always breaks connections). Even with persistence, the group cannot tell
///   whether the restarted node kept the key.
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
/// advises (see [`acquire_timeout`](RedlockGroup::acquire_timeout)):
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
/// match group.acquire_timeout("invoice-run", Duration::from_secs(30), Duration::from_secs(5)) {
///     Ok(Some(mut guard)) => {
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
/// # Threads
///
/// Per group: one worker per node (`respire-node-N`), each with one
/// connection, running that node's share of every operation in order; and one
/// renewal thread (`respire-redlock`) that fires loss signals and runs
/// keep-alives. They stop when the last clone of the group and the last guard
/// are dropped, after finishing the releases already queued. A node whose
/// command failed at the transport level is rested for 25 ms, doubling up to
/// 1 s while it keeps failing: operations then count it as not answering
/// without waiting for it.
///
/// # ACL rights
///
/// `EVALSHA` and `EVAL` (the scripts), `INFO` (independence checks and restart
/// detection) and, optionally, `CLIENT SETNAME`.
#[derive(Clone)]
pub struct RedlockGroup {
    inner: Arc<Group>,
}

pub(crate) struct Group {
    nodes: Vec<Coordinator>,
    workers: Vec<NodeWorker>,
    options: RedlockOptions,
    quorum: usize,
    renewal: GroupRenewal,
}

impl RedlockGroup {
    /// Makes a group over `nodes`, after checking that they can form one.
    ///
    /// Blocks for one `INFO` round trip per node (each bounded by the node
    /// timeout), then starts one worker thread per node and one renewal thread.
    ///
    /// # Errors
    /// - [`Error::InvalidArgument`] for fewer than 3 nodes or an even number
    ///   (an even count tolerates no more failures than the odd count below
    ///   it), a zero node timeout, or a drift factor that is negative, NaN or
    ///   not below 1.
    /// - [`Error::NotIndependent`] for two nodes that are the same server (same
    ///   `run_id`), nodes sharing a replication id (a primary and its replica,
    ///   or replicas of one primary), or a node in Redis Cluster mode.
    /// - Transport errors from a node that does not answer `INFO`: a node whose
    ///   independence cannot be checked is not accepted.
    /// - [`Error::Thread`] when a thread cannot be started.
    pub fn new(nodes: Vec<Coordinator>, options: RedlockOptions) -> Result<RedlockGroup> {
        check_options(nodes.len(), &options)?;
        let mut infos = Vec::with_capacity(nodes.len());
        let mut cfgs = Vec::with_capacity(nodes.len());
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
            let deadline = Instant::now() + options.node_timeout;
            let mut conn = server.pool.get(deadline, crate::conn::Connect::Own)?;
            let deadline = deadline + conn.connect_time();
            let info: String = conn.query(&redis::cmd("INFO"), "INFO", deadline)?;
            infos.push((server.addr().to_owned(), nodes::parse_info(&info)));
            cfgs.push(server.cfg.clone());
        }
        check_independent(&infos)?;
        let thread_error = |source| Error::Thread {
            name: "respire-node",
            source,
        };
        let workers = cfgs
            .into_iter()
            .enumerate()
            .map(|(i, cfg)| {
                NodeWorker::spawn(i, cfg, options.restart_delay, options.node_timeout)
                    .map_err(thread_error)
            })
            .collect::<Result<Vec<_>>>()?;
        let quorum = nodes.len() / 2 + 1;
        Ok(RedlockGroup {
            inner: Arc::new_cyclic(|this| Group {
                nodes,
                workers,
                options,
                quorum,
                renewal: GroupRenewal::new(this.clone()),
            }),
        })
    }

    /// Connects a coordinator to each URL (default settings; see
    /// [`Coordinator::connect`]) and makes a group over them.
    ///
    /// # Errors
    /// Connection errors from any URL, then as [`RedlockGroup::new`](crate::RedlockGroup::new).
    pub fn connect(urls: &[&str], options: RedlockOptions) -> Result<RedlockGroup> {
        let nodes = urls
            .iter()
            .map(|url| Coordinator::connect(url))
            .collect::<Result<Vec<_>>>()?;
        RedlockGroup::new(nodes, options)
    }

    /// How many nodes must agree: more than half.
    pub fn quorum(&self) -> usize {
        self.inner.quorum
    }

    /// The nodes, in the order given.
    pub fn nodes(&self) -> &[Coordinator] {
        &self.inner.nodes
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
        Group::attempt(&self.inner, key, ttl)
    }

    /// One attempt. Blocks as [`attempt`](RedlockGroup::attempt) does: at most
    /// the node timeout.
    ///
    /// Returns `Ok(Some(guard))` when a quorum granted with validity left,
    /// `Ok(None)` on contention (no quorum, and at least one node reported
    /// another holder).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] as for [`attempt`](RedlockGroup::attempt);
    /// [`Error::QuorumNotReached`] when no quorum granted and no node reported
    /// another holder (nodes down, slow or failing), with every node's answer;
    /// [`Error::Timeout`] when a quorum granted but the attempt took so long
    /// that no validity was left.
    pub fn try_acquire(&self, key: &str, ttl: Duration) -> Result<Option<RedlockGuard>> {
        self.attempt(key, ttl)?.into_result()
    }

    /// Tries until acquired or `wait` runs out. A zero wait makes one attempt.
    ///
    /// Redlock cannot use client tracking across independent servers, so this
    /// polls: after each contended attempt it sleeps a random pause between half
    /// and all of a ceiling that starts at [`RedlockOptions::retry_base`] and
    /// doubles up to [`RedlockOptions::retry_max`] (bounded retries with
    /// jitter, so that contending clients do not keep colliding). Returns
    /// `Ok(None)` when the wait runs out.
    ///
    /// # Errors
    /// As [`try_acquire`](RedlockGroup::try_acquire): an attempt that fails for
    /// lack of nodes ends the wait with its error.
    pub fn acquire_timeout(
        &self,
        key: &str,
        ttl: Duration,
        wait: Duration,
    ) -> Result<Option<RedlockGuard>> {
        self.acquire_deadline(key, ttl, Instant::now() + wait)
    }

    /// Tries until acquired or `deadline`; see
    /// [`acquire_timeout`](RedlockGroup::acquire_timeout). A deadline already
    /// past makes one attempt.
    ///
    /// # Errors
    /// As [`try_acquire`](RedlockGroup::try_acquire).
    pub fn acquire_deadline(
        &self,
        key: &str,
        ttl: Duration,
        deadline: Instant,
    ) -> Result<Option<RedlockGuard>> {
        self.wait(key, ttl, Some(deadline), None)
    }

    /// Tries until acquired or `cancel` is cancelled, polling as
    /// [`acquire_timeout`](RedlockGroup::acquire_timeout) does; a cancellation
    /// wakes the pause at once.
    ///
    /// # Errors
    /// [`Error::Cancelled`] on cancellation (an attempt already sent finishes
    /// first, and a lock it got is released); otherwise as
    /// [`try_acquire`](RedlockGroup::try_acquire).
    pub fn acquire(&self, key: &str, ttl: Duration, cancel: &CancelToken) -> Result<RedlockGuard> {
        self.wait(key, ttl, None, Some(cancel))?
            .ok_or(Error::Cancelled)
    }

    /// Tries until acquired, `deadline` passes (`Ok(None)`), or `cancel` is
    /// cancelled, polling as [`acquire_timeout`](RedlockGroup::acquire_timeout)
    /// does; a cancellation wakes the pause at once.
    ///
    /// # Errors
    /// [`Error::Cancelled`] on cancellation (an attempt already sent finishes
    /// first, and a lock it got is released); otherwise as
    /// [`try_acquire`](RedlockGroup::try_acquire).
    pub fn acquire_until(
        &self,
        key: &str,
        ttl: Duration,
        deadline: Instant,
        cancel: &CancelToken,
    ) -> Result<Option<RedlockGuard>> {
        self.wait(key, ttl, Some(deadline), Some(cancel))
    }

    fn wait(
        &self,
        key: &str,
        ttl: Duration,
        deadline: Option<Instant>,
        cancel: Option<&CancelToken>,
    ) -> Result<Option<RedlockGuard>> {
        let never = crossbeam_channel::never();
        let cancelled = cancel.map_or(&never, CancelToken::receiver);
        let options = &self.inner.options;
        let mut tries = 0u32;
        let mut last_error: Option<Error>;
        let mut warned = false;
        loop {
            if cancel.is_some_and(CancelToken::is_cancelled) {
                return Err(Error::Cancelled);
            }
            match self.try_acquire(key, ttl) {
                Ok(Some(guard)) => {
                    if cancel.is_some_and(CancelToken::is_cancelled) {
                        drop(guard);
                        return Err(Error::Cancelled);
                    }
                    return Ok(Some(guard));
                }
                Ok(None) => last_error = None,
                Err(e) if e.is_retryable() => {
                    if !warned {
                        warned = true;
                        log::warn!(
                            "waiting for redlock {key:?}: {e}; retrying until the wait ends"
                        );
                    }
                    last_error = Some(e);
                }
                Err(e) => return Err(e),
            }
            let now = Instant::now();
            if deadline.is_some_and(|d| now >= d) {
                return match last_error {
                    Some(e) => Err(e),
                    None => Ok(None),
                };
            }
            tries = tries.saturating_add(1);
            let pause = retry_pause(tries, options.retry_base, options.retry_max, random_unit());
            let wake = deadline.map_or(now + pause, |d| d.min(now + pause));
            crossbeam_channel::select! {
                recv(cancelled) -> _ => return Err(Error::Cancelled),
                recv(crossbeam_channel::at(wake)) -> _ => {}
            }
        }
    }
}

impl Drop for Group {
    fn drop(&mut self) {
        // Queued releases (of guards dropped just before) still reach their
        // nodes before the program moves on, for at most a node timeout.
        let deadline = Instant::now() + self.options.node_timeout;
        nodes::stop(std::mem::take(&mut self.workers), deadline);
    }
}

impl fmt::Debug for RedlockGroup {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedlockGroup")
            .field(
                "nodes",
                &self
                    .inner
                    .workers
                    .iter()
                    .map(|w| w.addr.as_str())
                    .collect::<Vec<_>>(),
            )
            .field("quorum", &self.inner.quorum)
            .field("options", &self.inner.options)
            .finish()
    }
}
