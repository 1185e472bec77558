//! `RedlockGroup`: a lock that needs a majority of independent Redis servers,
//! after antirez's Redlock algorithm ("Distributed Locks with Redis", the
//! distributed-locks pattern page of the Redis documentation), with the limits
//! Kleppmann pointed out in "How to do distributed locking" and antirez's reply
//! "Is Redlock safe?". The public docs are on [`RedlockGroup`].
//!
//! The fan-out runs on the per-node workers of `runtime::nodes`; this file
//! holds the quorum and validity rules, the guard and the checks.

use std::fmt;
use std::marker::PhantomData;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use crossbeam_channel::Receiver;
use parking_lot::Mutex;

use crate::cancel::CancelToken;
use crate::coordinator::Coordinator;
use crate::error::{Error, Result};
use crate::keys;
use crate::lease::LeaseState;
use crate::runtime::clock;
use crate::runtime::nodes::{self, Job, NodeLease, NodeWorker, Op, Reply, ServerInfo, Vote};
use crate::runtime::redlock_renewal::{GroupRenewal, Renewable, Renewed};
use crate::token::OwnerToken;

/// Settings of a [`RedlockGroup`]. Build it with struct update syntax:
///
/// ```
/// use std::time::Duration;
/// use respire_coordination::RedlockOptions;
///
/// let options = RedlockOptions {
///     node_timeout: Duration::from_millis(20),
///     ..RedlockOptions::default()
/// };
/// assert_eq!(options.drift_factor, 0.01);
/// ```
#[derive(Clone, Debug, PartialEq)]
pub struct RedlockOptions {
    /// The longest one node may take to answer one command (including a
    /// reconnect). It must be well below every TTL used: a TTL is refused
    /// unless the node timeout plus drift is under half of it. Defaults to
    /// 50 ms.
    pub node_timeout: Duration,
    /// The fraction of each TTL written off for clock-rate differences between
    /// this host and the servers (plus 2 ms). Must be in `0.0..1.0` (and not
    /// NaN). Defaults to 0.01.
    pub drift_factor: f64,
    /// When set, no acquire is sent to a server that started less than this
    /// long ago (from `uptime_in_seconds` in `INFO server`, read on every new
    /// connection, counted as if the server started up to a second later), so that a node restarted without its data cannot grant
    /// a lock that another client may still hold. Set it above your longest
    /// TTL. Defaults to `None`.
    pub restart_delay: Option<Duration>,
    /// The first pause of the bounded waits between attempts; each pause is
    /// random between half and all of a ceiling that starts here and doubles.
    /// Defaults to 10 ms.
    pub retry_base: Duration,
    /// The largest ceiling of the pauses between attempts. Defaults to 200 ms.
    pub retry_max: Duration,
}

impl Default for RedlockOptions {
    fn default() -> Self {
        RedlockOptions {
            node_timeout: Duration::from_millis(50),
            drift_factor: 0.01,
            restart_delay: None,
            retry_base: Duration::from_millis(10),
            retry_max: Duration::from_millis(200),
        }
    }
}

/// What one node answered to one step of a Redlock operation.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum NodeOutcome {
    /// The node did what was asked: set the key (acquire), moved its expiry
    /// (extend), or deleted it (release).
    Granted,
    /// Another owner holds the key on this node; `remaining` is its TTL when
    /// the node reported it.
    HeldByAnother {
        /// The other holder's remaining TTL (`None`: unknown or no expiry).
        remaining: Option<Duration>,
    },
    /// The key was not there: expired, deleted, or lost in a restart. For a
    /// release, also: no acquire of this lease was ever sent to the node.
    Missing,
    /// The node confirmed an extension but does not count toward the quorum,
    /// for the reason given (it restarted since the grant, or its grant was
    /// never confirmed).
    Uncounted(String),
    /// The command failed: connection refused or reset, or an error reply.
    Failed(String),
    /// No reply within the node timeout. The command may still be applied;
    /// the connection was dropped.
    TimedOut,
    /// Still unanswered when the outcome was decided. The command may still
    /// be applied; a grant is cleaned up by the release, which reaches the
    /// node after it.
    Abandoned,
    /// Nothing was sent, for the reason given (the node failed moments ago and
    /// is rested, it restarted within the restart delay, or there was nothing
    /// to do there).
    NotSent(String),
}

impl fmt::Display for NodeOutcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            NodeOutcome::Granted => f.write_str("granted"),
            NodeOutcome::HeldByAnother {
                remaining: Some(left),
            } => write!(f, "held by another for {left:?}"),
            NodeOutcome::HeldByAnother { remaining: None } => f.write_str("held by another"),
            NodeOutcome::Missing => f.write_str("key missing"),
            NodeOutcome::Uncounted(why) => write!(f, "not counted: {why}"),
            NodeOutcome::Failed(why) => write!(f, "failed: {why}"),
            NodeOutcome::TimedOut => f.write_str("timed out"),
            NodeOutcome::Abandoned => f.write_str("no reply yet when the outcome was decided"),
            NodeOutcome::NotSent(why) => write!(f, "not sent: {why}"),
        }
    }
}

/// One node's part in a Redlock operation: which node, what it answered, and
/// how long it took.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct NodeReport {
    /// The node's address, without credentials.
    pub node: String,
    /// What it answered.
    pub outcome: NodeOutcome,
    /// From the send to the answer; `None` when nothing was sent or no answer
    /// came in time.
    pub latency: Option<Duration>,
}

/// `addr: outcome; addr: outcome` for messages.
pub(crate) fn summarize(nodes: &[NodeReport]) -> String {
    nodes
        .iter()
        .map(|n| format!("{}: {}", n.node, n.outcome))
        .collect::<Vec<_>>()
        .join("; ")
}

/// A lock held by a majority of independent Redis servers: antirez's Redlock.
///
/// Made by [`RedlockGroup::new`] from an odd number (3 or more) of
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
/// reports what each node answered ([`NodeReport`]).
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

struct Group {
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
        for node in &nodes {
            let shared = node.shared();
            let timeout = options.node_timeout;
            let mut conn = shared.pool.get(timeout)?;
            let info: String = conn.query(&redis::cmd("INFO"), "INFO", timeout)?;
            infos.push((shared.pool.cfg.addr.to_string(), nodes::parse_info(&info)));
        }
        check_independent(&infos)?;
        let thread_error = |source| Error::Thread {
            name: "respire-node",
            source,
        };
        let workers = nodes
            .iter()
            .enumerate()
            .map(|(i, node)| {
                NodeWorker::spawn(
                    i,
                    node.shared().pool.cfg.clone(),
                    options.restart_delay,
                    options.node_timeout,
                )
                .map_err(thread_error)
            })
            .collect::<Result<Vec<_>>>()?;
        let renewal = GroupRenewal::spawn().map_err(|source| Error::Thread {
            name: "respire-redlock",
            source,
        })?;
        let quorum = nodes.len() / 2 + 1;
        Ok(RedlockGroup {
            inner: Arc::new(Group {
                nodes,
                workers,
                options,
                quorum,
                renewal,
            }),
        })
    }

    /// Connects a coordinator to each URL (default settings; see
    /// [`Coordinator::connect`]) and makes a group over them.
    ///
    /// # Errors
    /// Connection errors from any URL, then as [`RedlockGroup::new`].
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
        self.inner.attempt(&self.inner, key, ttl)
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
        loop {
            if cancel.is_some_and(CancelToken::is_cancelled) {
                return Err(Error::Cancelled);
            }
            if let Some(guard) = self.try_acquire(key, ttl)? {
                if cancel.is_some_and(CancelToken::is_cancelled) {
                    drop(guard);
                    return Err(Error::Cancelled);
                }
                return Ok(Some(guard));
            }
            let now = Instant::now();
            if deadline.is_some_and(|d| now >= d) {
                return Ok(None);
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

/// Votes counted so far in one fan-out.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Count {
    /// Nodes that did what was asked (release: the lease is gone there).
    yes: usize,
    /// Of those, nodes that answered `Granted` (release: deleted it now).
    granted: usize,
    /// Nodes whose answer is unusable (failed, timed out, not sent).
    unknown: usize,
    /// Nodes not heard from yet.
    outstanding: usize,
}

impl Count {
    fn new(targets: usize) -> Self {
        Count {
            outstanding: targets,
            ..Count::default()
        }
    }

    fn add(&mut self, reply: &Reply) {
        self.outstanding = self.outstanding.saturating_sub(1);
        match reply.vote {
            Vote::Yes => {
                self.yes += 1;
                if reply.outcome == NodeOutcome::Granted {
                    self.granted += 1;
                }
            }
            Vote::No => {}
            Vote::Unknown => self.unknown += 1,
        }
    }

    /// A quorum said yes, or not enough nodes are left for one.
    fn decided(&self, quorum: usize) -> bool {
        self.yes >= quorum || self.yes + self.outstanding < quorum
    }
}

impl Group {
    fn check_ttl(&self, ttl: Duration) -> Result<u64> {
        check_ttl(ttl, &self.options)
    }

    fn all(&self) -> Vec<usize> {
        (0..self.workers.len()).collect()
    }

    /// Sends `op` to the `targets` at once and collects answers until `done`
    /// says the outcome is decided, every target answered, or `deadline`.
    fn fan_out(
        &self,
        op: Op,
        lease: &Arc<NodeLease>,
        targets: &[usize],
        deadline: Instant,
        done: impl Fn(&Count) -> bool,
    ) -> (Vec<Option<Reply>>, Count) {
        let n = self.workers.len();
        // Room for every answer, so a late worker never blocks on it.
        let (tx, rx) = crossbeam_channel::bounded(n);
        for &i in targets {
            self.workers[i].send(
                i,
                Job {
                    op,
                    lease: lease.clone(),
                    deadline,
                    reply: Some(tx.clone()),
                },
            );
        }
        drop(tx);
        let mut replies: Vec<Option<Reply>> = vec![None; n];
        let mut count = Count::new(targets.len());
        while count.outstanding > 0 && !done(&count) {
            match rx.recv_deadline(deadline) {
                Ok(reply) => {
                    count.add(&reply);
                    let i = reply.node;
                    replies[i] = Some(reply);
                }
                Err(_) => break,
            }
        }
        (replies, count)
    }

    /// Every node's report; targets without an answer are `Abandoned` (or
    /// `TimedOut` once the deadline passed), the others `skipped`.
    fn reports(
        &self,
        replies: Vec<Option<Reply>>,
        targets: &[usize],
        deadline: Instant,
        skipped: &NodeOutcome,
    ) -> Vec<NodeReport> {
        let past = Instant::now() >= deadline;
        replies
            .into_iter()
            .enumerate()
            .map(|(i, reply)| {
                let node = self.workers[i].addr.clone();
                match reply {
                    Some(r) => NodeReport {
                        node,
                        outcome: r.outcome,
                        latency: r.latency,
                    },
                    None => NodeReport {
                        node,
                        outcome: if !targets.contains(&i) {
                            skipped.clone()
                        } else if past {
                            NodeOutcome::TimedOut
                        } else {
                            NodeOutcome::Abandoned
                        },
                        latency: None,
                    },
                }
            })
            .collect()
    }

    /// Queues a release of `lease` on every node without waiting: used after a
    /// failed attempt. Nodes that were never sent the acquire are skipped.
    fn clean_up(&self, lease: &Arc<NodeLease>) {
        let deadline = Instant::now() + self.options.node_timeout;
        for (i, worker) in self.workers.iter().enumerate() {
            worker.send(
                i,
                Job {
                    op: Op::Release,
                    lease: lease.clone(),
                    deadline,
                    reply: None,
                },
            );
        }
    }

    fn attempt(&self, this: &Arc<Group>, key: &str, ttl: Duration) -> Result<RedlockAttempt> {
        let ttl_ms = self.check_ttl(ttl)?;
        if key.is_empty() {
            return Err(Error::InvalidArgument("redlock key is empty".into()));
        }
        let keys = self
            .nodes
            .iter()
            .map(|c| format!("{}{key}", c.key_prefix()))
            .collect();
        let owner = OwnerToken::new();
        let lease = Arc::new(NodeLease::new(keys, owner.as_str().to_owned()));
        let quorum = self.quorum;
        let targets = self.all();
        let sent = Instant::now();
        let deadline = sent + self.options.node_timeout;
        let (replies, count) =
            self.fan_out(Op::Acquire { ttl_ms }, &lease, &targets, deadline, |c| {
                c.decided(quorum)
            });
        let elapsed = sent.elapsed();
        let nodes = self.reports(replies, &targets, deadline, &NodeOutcome::Abandoned);
        let ttl = Duration::from_millis(ttl_ms);
        let validity = validity(ttl, elapsed, self.options.drift_factor);
        let guard = if count.yes >= quorum && !validity.is_zero() {
            let inner = Arc::new(GuardInner {
                group: this.clone(),
                state: LeaseState::new(
                    key.to_owned(),
                    lease.value().to_owned(),
                    sent,
                    ttl_ms,
                    self.options.drift_factor,
                    self.options.node_timeout,
                ),
                lease,
                evidence: Mutex::new(nodes.clone()),
            });
            let weak: Weak<dyn Renewable> = Arc::downgrade(&inner) as Weak<dyn Renewable>;
            self.renewal.track(inner.state.id, weak);
            Some(RedlockGuard {
                inner,
                released: vec![None; self.workers.len()],
                outcome: None,
            })
        } else {
            self.clean_up(&lease);
            None
        };
        Ok(RedlockAttempt {
            guard,
            nodes,
            elapsed,
            validity: if count.yes >= quorum {
                validity
            } else {
                Duration::ZERO
            },
            quorum,
            granted: count.yes,
        })
    }

    /// Extends `g` by `ttl`; a quorum must confirm within its validity. The
    /// wait for answers also ends at `until` (the keep-alive passes the loss
    /// deadline, so that it can flag the loss on time).
    fn extend(&self, g: &GuardInner, ttl: Duration, until: Option<Instant>) -> Result<bool> {
        let ttl_ms = self.check_ttl(ttl)?;
        let state = &g.state;
        if state.flagged_lost() {
            return Ok(false);
        }
        let now = Instant::now();
        let valid_until = state.valid_until();
        if now >= valid_until {
            state.mark_lost("its validity ended before the extension");
            return Ok(false);
        }
        let quorum = self.quorum;
        let targets = self.all();
        let deadline = (now + self.options.node_timeout)
            .min(valid_until)
            .min(until.unwrap_or(valid_until));
        let sent = Instant::now();
        let (replies, count) =
            self.fan_out(Op::Extend { ttl_ms }, &g.lease, &targets, deadline, |c| {
                c.decided(quorum)
            });
        let decided = Instant::now();
        let nodes = self.reports(replies, &targets, deadline, &NodeOutcome::Abandoned);
        *g.evidence.lock() = nodes.clone();
        if count.yes >= quorum && decided < valid_until {
            state.confirm(sent, ttl_ms);
            self.renewal.reschedule(state.id);
            return Ok(true);
        }
        if decided >= valid_until || count.yes + count.unknown + count.outstanding < quorum {
            state.mark_lost(&format!(
                "no quorum confirmed the extension within its validity ({})",
                summarize(&nodes)
            ));
            return Ok(false);
        }
        Err(Error::QuorumNotReached {
            op: "extend",
            confirmed: count.yes,
            needed: quorum,
            nodes,
        })
    }
}

/// The result of one [`RedlockGroup::attempt`]: the guard if a quorum granted,
/// and what every node answered.
#[must_use = "if unused, an acquired lock is released immediately"]
pub struct RedlockAttempt {
    guard: Option<RedlockGuard>,
    nodes: Vec<NodeReport>,
    elapsed: Duration,
    validity: Duration,
    quorum: usize,
    granted: usize,
}

impl RedlockAttempt {
    /// Whether the lock was acquired.
    pub fn is_acquired(&self) -> bool {
        self.guard.is_some()
    }

    /// Whether any node reported another holder.
    pub fn is_contended(&self) -> bool {
        self.nodes
            .iter()
            .any(|n| matches!(n.outcome, NodeOutcome::HeldByAnother { .. }))
    }

    /// The guard, when acquired.
    pub fn guard(&self) -> Option<&RedlockGuard> {
        self.guard.as_ref()
    }

    /// Takes the guard out, when acquired.
    pub fn into_guard(self) -> Option<RedlockGuard> {
        self.guard
    }

    /// Every node's answer, in the group's order.
    pub fn nodes(&self) -> &[NodeReport] {
        &self.nodes
    }

    /// How many nodes granted before the outcome was decided.
    pub fn granted(&self) -> usize {
        self.granted
    }

    /// How many nodes had to grant.
    pub fn quorum(&self) -> usize {
        self.quorum
    }

    /// From the first send to the decision, on the local monotonic clock.
    pub fn elapsed(&self) -> Duration {
        self.elapsed
    }

    /// `ttl − elapsed − (ttl × drift + 2 ms)` at the decision; zero when no
    /// quorum granted.
    pub fn validity(&self) -> Duration {
        self.validity
    }

    /// What [`RedlockGroup::try_acquire`] returns for this attempt: the guard,
    /// `None` on contention, or the error that kept a quorum from forming.
    ///
    /// # Errors
    /// As [`RedlockGroup::try_acquire`].
    pub fn into_result(self) -> Result<Option<RedlockGuard>> {
        if self.guard.is_some() {
            return Ok(self.guard);
        }
        if self.is_contended() {
            return Ok(None);
        }
        if self.granted >= self.quorum {
            return Err(Error::Timeout {
                op: "acquire (the attempt used up the lease's validity)",
                after: self.elapsed,
            });
        }
        Err(Error::QuorumNotReached {
            op: "acquire",
            confirmed: self.granted,
            needed: self.quorum,
            nodes: self.nodes,
        })
    }
}

impl fmt::Debug for RedlockAttempt {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedlockAttempt")
            .field("acquired", &self.is_acquired())
            .field("granted", &self.granted)
            .field("quorum", &self.quorum)
            .field("elapsed", &self.elapsed)
            .field("validity", &self.validity)
            .field("nodes", &self.nodes)
            .finish()
    }
}

/// A held Redlock lock. Dropping it releases the lock on every node (once,
/// best effort, waiting at most the node timeout, never panicking);
/// [`release`](RedlockGuard::release) does the same and reports the result.
#[must_use = "if unused the lock is released immediately"]
pub struct RedlockGuard {
    inner: Arc<GuardInner>,
    /// Per node, once a release confirmed it: whether it deleted the key then.
    released: Vec<Option<bool>>,
    /// The result of the release that reached a quorum.
    outcome: Option<bool>,
}

struct GuardInner {
    group: Arc<Group>,
    state: LeaseState,
    lease: Arc<NodeLease>,
    evidence: Mutex<Vec<NodeReport>>,
}

impl Renewable for GuardInner {
    fn state(&self) -> &LeaseState {
        &self.state
    }

    fn renew(&self) -> Renewed {
        let lost_at = self.state.lost_at();
        if Instant::now() >= lost_at {
            return Renewed::Failed;
        }
        match self.group.extend(self, self.state.ttl(), Some(lost_at)) {
            Ok(true) => Renewed::Yes,
            Ok(false) => Renewed::Lost,
            Err(e) => {
                log::warn!("extending redlock {:?} failed: {e}", self.state.key);
                Renewed::Failed
            }
        }
    }
}

impl RedlockGuard {
    /// The key (without the nodes' prefixes).
    pub fn key(&self) -> &str {
        &self.inner.state.key
    }

    /// How long the lock can still be assumed held: the TTL of the grant (or
    /// last confirmed extension) minus the time since it was *sent* and minus
    /// clock drift, on the local monotonic clock. Zero once lost or released.
    /// Does not touch the network.
    pub fn remaining_estimate(&self) -> Duration {
        if self.inner.state.flagged_lost() {
            return Duration::ZERO;
        }
        self.inner.state.remaining()
    }

    /// Whether the lock is lost: its local loss deadline (validity end minus
    /// the node timeout) passed without a confirmed extension, an extension
    /// found no quorum, or it was released. Does not block.
    pub fn is_lost(&self) -> bool {
        self.inner.state.is_lost()
    }

    /// A channel that disconnects when the lock is lost or released, for
    /// `crossbeam_channel::select!`; the group's renewal thread closes it at
    /// the loss deadline. It never delivers a message.
    pub fn lost_signal(&self) -> &Receiver<()> {
        self.inner.state.loss_signal()
    }

    /// Every node's answer to the last operation on this lock (the acquire,
    /// an extension, or a release).
    pub fn last_evidence(&self) -> Vec<NodeReport> {
        self.inner.evidence.lock().clone()
    }

    /// Sets the lock's expiry to `ttl` from now on every node that still holds
    /// it. Never re-creates a missing key.
    ///
    /// Blocks until a quorum confirmed, too few nodes are left, or the node
    /// timeout (or the current validity, if sooner) runs out. Only nodes that
    /// granted the lock and have not restarted since (same `run_id`) count.
    /// Returns `true` with a new validity counted from the send, or `false`
    /// (and flags the lock lost) when no quorum confirmed within the current
    /// validity: stop the work.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a TTL the group refuses;
    /// [`Error::QuorumNotReached`] when no quorum confirmed because nodes
    /// failed or did not answer, while validity remains (the lock is not
    /// flagged lost; the local deadline still applies, and retrying may work).
    pub fn extend(&self, ttl: Duration) -> Result<bool> {
        self.inner.group.extend(&self.inner, ttl, None)
    }

    /// Extends the lock in the background until the returned
    /// [`RedlockKeepAlive`] is dropped: the group's renewal thread extends it
    /// by its TTL at half the TTL, retries a failed extension while time
    /// remains, and flags the lock lost — before its validity ends, at the
    /// validity end minus the node timeout — when no extension reached a
    /// quorum, or at once when a quorum no longer holds it.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when the TTL is too short to renew at half
    /// of it with a node timeout to spare.
    pub fn keep_alive(&self) -> Result<RedlockKeepAlive<'_>> {
        let state = &self.inner.state;
        let options = &self.inner.group.options;
        let min = clock::min_keepalive_ttl(options.drift_factor, options.node_timeout);
        if state.ttl() < min {
            return Err(Error::InvalidArgument(format!(
                "ttl {:?} is too short for keep-alive with a node timeout of {:?}: use at \
                 least {min:?}",
                state.ttl(),
                options.node_timeout
            )));
        }
        state.add_keepalive();
        self.inner.group.renewal.reschedule(state.id);
        Ok(RedlockKeepAlive {
            inner: self.inner.clone(),
            _guard: PhantomData,
        })
    }

    /// Releases the lock on every node that has not confirmed yet (deleting it
    /// only where it still holds this guard's owner token).
    ///
    /// From the first call on, the guard no longer reports ownership
    /// (`is_lost()` is true). Blocks until the result is decided or the node
    /// timeout runs out. Returns `true` when a quorum confirmed and the lock
    /// was still held on a quorum (deleted there now), `false` when a quorum
    /// confirmed but the lock had already expired or been taken over on some
    /// of them: it lapsed before the release. After a result, further calls
    /// return it again without I/O.
    ///
    /// # Errors
    /// [`Error::QuorumNotReached`] when fewer than a quorum confirmed (nodes
    /// failed or did not answer): call `release` again to retry the nodes that
    /// have not confirmed; otherwise the lock ends at its expiry.
    pub fn release(&mut self) -> Result<bool> {
        let group = &self.inner.group;
        let state = &self.inner.state;
        state.finish();
        group.renewal.forget(state.id);
        if let Some(outcome) = self.outcome {
            return Ok(outcome);
        }
        let quorum = group.quorum;
        let targets: Vec<usize> = (0..self.released.len())
            .filter(|&i| self.released[i].is_none())
            .collect();
        let prior_yes = self.released.iter().flatten().count();
        let prior_deleted = self.released.iter().filter(|r| **r == Some(true)).count();
        let deadline = Instant::now() + group.options.node_timeout;
        let (replies, _) = group.fan_out(Op::Release, &self.inner.lease, &targets, deadline, |c| {
            let yes = prior_yes + c.yes;
            let deleted = prior_deleted + c.granted;
            deleted >= quorum
                || (yes >= quorum && deleted + c.outstanding < quorum)
                || yes + c.outstanding < quorum
        });
        for reply in replies.iter().flatten() {
            if reply.vote == Vote::Yes {
                self.released[reply.node] = Some(reply.outcome == NodeOutcome::Granted);
            }
        }
        let skipped = NodeOutcome::NotSent("confirmed by an earlier release".into());
        let nodes = group.reports(replies, &targets, deadline, &skipped);
        *self.inner.evidence.lock() = nodes.clone();
        let yes = self.released.iter().flatten().count();
        let deleted = self.released.iter().filter(|r| **r == Some(true)).count();
        if yes >= quorum {
            let outcome = deleted >= quorum;
            self.outcome = Some(outcome);
            return Ok(outcome);
        }
        Err(Error::QuorumNotReached {
            op: "release",
            confirmed: yes,
            needed: quorum,
            nodes,
        })
    }
}

impl Drop for RedlockGuard {
    fn drop(&mut self) {
        if self.outcome.is_some() {
            return;
        }
        match self.release() {
            Ok(held) => log::debug!(
                "dropped redlock {:?} (still held until then: {held})",
                self.inner.state.key
            ),
            Err(e) => log::warn!(
                "dropping redlock {:?}: {e}; it ends at its expiry at the latest",
                self.inner.state.key
            ),
        }
    }
}

impl fmt::Debug for RedlockGuard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedlockGuard")
            .field("key", &self.inner.state.key)
            .field("lost", &self.is_lost())
            .field("remaining_estimate", &self.remaining_estimate())
            .finish()
    }
}

/// Extends a [`RedlockGuard`] in the background for as long as it lives.
///
/// Returned by [`RedlockGuard::keep_alive`], which it borrows: it always ends
/// before the guard does. Dropping it stops the extensions (the lock then runs
/// out at its current validity unless extended again); it does not block.
#[must_use = "extensions stop as soon as the RedlockKeepAlive is dropped"]
pub struct RedlockKeepAlive<'a> {
    inner: Arc<GuardInner>,
    _guard: PhantomData<&'a ()>,
}

impl RedlockKeepAlive<'_> {
    /// Whether the lock is lost (same as the guard's `is_lost()`). Does not block.
    pub fn is_lost(&self) -> bool {
        self.inner.state.is_lost()
    }
}

impl Drop for RedlockKeepAlive<'_> {
    fn drop(&mut self) {
        self.inner.state.remove_keepalive();
        self.inner.group.renewal.reschedule(self.inner.state.id);
    }
}

impl fmt::Debug for RedlockKeepAlive<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedlockKeepAlive")
            .field("key", &self.inner.state.key)
            .field("lost", &self.inner.state.is_lost())
            .finish()
    }
}

/// `ttl − elapsed − (ttl × drift + 2 ms)`, or zero.
fn validity(ttl: Duration, elapsed: Duration, drift_factor: f64) -> Duration {
    ttl.saturating_sub(elapsed + clock::drift(ttl, drift_factor))
}

/// Refuses a node count or options that cannot make a sound group.
fn check_options(nodes: usize, options: &RedlockOptions) -> Result<()> {
    if nodes < 3 {
        return Err(Error::InvalidArgument(format!(
            "a redlock group needs at least 3 nodes, got {nodes}: with fewer, one failure \
             stops it or one node decides alone"
        )));
    }
    if nodes.is_multiple_of(2) {
        return Err(Error::InvalidArgument(format!(
            "a redlock group needs an odd number of nodes, got {nodes}: its quorum of {} \
             tolerates no more failures than {} nodes do",
            nodes / 2 + 1,
            nodes - 1
        )));
    }
    let f = options.drift_factor;
    if f.is_nan() || !(0.0..1.0).contains(&f) {
        return Err(Error::InvalidArgument(format!(
            "drift factor {f} must be at least 0 and below 1"
        )));
    }
    if options.node_timeout.is_zero() {
        return Err(Error::InvalidArgument("node timeout is zero".into()));
    }
    Ok(())
}

/// Refuses a TTL the node timeout is not well below: a worst-case attempt
/// (one that waits out the node timeout) must keep at least half the lease.
fn check_ttl(ttl: Duration, options: &RedlockOptions) -> Result<u64> {
    let ms = keys::ttl_ms(ttl)?;
    let ttl = Duration::from_millis(ms);
    let drift = clock::drift(ttl, options.drift_factor);
    if options.node_timeout + drift >= ttl / 2 {
        return Err(Error::InvalidArgument(format!(
            "node timeout {:?} is not well below ttl {ttl:?}: node timeout plus drift \
             ({drift:?}) must be under half the ttl, so that an attempt that waits out a \
             slow node keeps most of its validity",
            options.node_timeout
        )));
    }
    Ok(ms)
}

/// Refuses nodes that would fail together: one server twice, one replication
/// history twice, or a cluster node.
fn check_independent(infos: &[(String, ServerInfo)]) -> Result<()> {
    for (addr, info) in infos {
        if info.cluster {
            return Err(Error::NotIndependent(format!(
                "{addr} runs in Redis Cluster mode; use standalone servers that fail \
                 independently (cluster nodes share failover and slot ownership)"
            )));
        }
    }
    for (i, (a, ia)) in infos.iter().enumerate() {
        for (b, ib) in &infos[i + 1..] {
            if ia.run_id.is_some() && ia.run_id == ib.run_id {
                return Err(Error::NotIndependent(format!(
                    "{a} and {b} are the same server (run id {})",
                    ia.run_id.as_deref().unwrap_or_default()
                )));
            }
            if ia.replid.is_some() && ia.replid == ib.replid {
                return Err(Error::NotIndependent(format!(
                    "{a} and {b} share replication id {}: one replicates the other, or both \
                     replicate one primary",
                    ia.replid.as_deref().unwrap_or_default()
                )));
            }
        }
    }
    Ok(())
}

/// The pause before retry number `tries` (from 1): random between half and all
/// of `base × 2^(tries − 1)`, capped at `max`. `unit` is in `0.0..1.0`.
fn retry_pause(tries: u32, base: Duration, max: Duration, unit: f64) -> Duration {
    let shift = tries.clamp(1, 16) - 1;
    let ceiling = base.saturating_mul(1u32 << shift).min(max);
    ceiling.mul_f64(0.5 + 0.5 * unit.clamp(0.0, 1.0))
}

/// A random number in `0.0..1.0` from the OS generator (0.5 if it fails).
fn random_unit() -> f64 {
    let mut b = [0u8; 4];
    if getrandom::fill(&mut b).is_err() {
        return 0.5;
    }
    f64::from(u32::from_le_bytes(b)) / (f64::from(u32::MAX) + 1.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    fn reply(vote: Vote, outcome: NodeOutcome) -> Reply {
        Reply {
            node: 0,
            outcome,
            vote,
            latency: None,
        }
    }

    #[test]
    fn quorum_is_decided_as_soon_as_possible() {
        // 5 nodes, quorum 3.
        let mut c = Count::new(5);
        c.add(&reply(Vote::Yes, NodeOutcome::Granted));
        c.add(&reply(Vote::Yes, NodeOutcome::Granted));
        assert!(!c.decided(3));
        c.add(&reply(Vote::Yes, NodeOutcome::Granted));
        assert!(c.decided(3), "three grants decide, two nodes still out");

        let mut c = Count::new(5);
        c.add(&reply(Vote::No, NodeOutcome::Missing));
        c.add(&reply(Vote::Unknown, NodeOutcome::TimedOut));
        assert!(!c.decided(3));
        c.add(&reply(Vote::No, NodeOutcome::Missing));
        assert!(c.decided(3), "two nodes left cannot make three");
        assert_eq!(c.yes + c.outstanding, 2);
    }

    #[test]
    fn validity_is_ttl_minus_elapsed_minus_drift() {
        assert_eq!(validity(ms(10_000), ms(30), 0.01), ms(10_000 - 30 - 102));
        assert_eq!(validity(ms(100), ms(99), 0.01), Duration::ZERO);
    }

    #[test]
    fn options_are_checked() {
        let ok = RedlockOptions::default();
        assert!(check_options(3, &ok).is_ok());
        assert!(check_options(5, &ok).is_ok());
        for n in [0, 1, 2, 4, 6] {
            assert!(check_options(n, &ok).is_err(), "{n} nodes");
        }
        for f in [-0.01, f64::NAN, 1.0, 2.0, f64::INFINITY] {
            let o = RedlockOptions {
                drift_factor: f,
                ..RedlockOptions::default()
            };
            assert!(check_options(3, &o).is_err(), "drift {f}");
        }
        let zero = RedlockOptions {
            node_timeout: Duration::ZERO,
            ..RedlockOptions::default()
        };
        assert!(check_options(3, &zero).is_err());
    }

    #[test]
    fn the_node_timeout_must_be_well_below_the_ttl() {
        let o = RedlockOptions {
            node_timeout: ms(200),
            ..RedlockOptions::default()
        };
        assert!(check_ttl(ms(300), &o).is_err());
        assert!(check_ttl(ms(400), &o).is_err());
        assert!(check_ttl(ms(500), &o).is_ok());
        assert!(check_ttl(Duration::ZERO, &o).is_err());
    }

    #[test]
    fn independence_is_checked() {
        let info = |run: &str, repl: &str| ServerInfo {
            run_id: Some(run.into()),
            uptime: None,
            replid: Some(repl.into()),
            cluster: false,
        };
        let ok = vec![
            ("a".to_owned(), info("1", "x")),
            ("b".to_owned(), info("2", "y")),
            ("c".to_owned(), info("3", "z")),
        ];
        assert!(check_independent(&ok).is_ok());
        let mut same = ok.clone();
        same[2].1.run_id = Some("1".into());
        let e = check_independent(&same).unwrap_err().to_string();
        assert!(e.contains("a and c are the same server"), "{e}");
        let mut replica = ok.clone();
        replica[1].1.replid = Some("z".into());
        let e = check_independent(&replica).unwrap_err().to_string();
        assert!(e.contains("share replication id"), "{e}");
        let mut cluster = ok;
        cluster[0].1.cluster = true;
        let e = check_independent(&cluster).unwrap_err().to_string();
        assert!(e.contains("Cluster"), "{e}");
    }

    #[test]
    fn retry_pauses_are_jittered_and_bounded() {
        let (base, max) = (ms(10), ms(200));
        assert_eq!(retry_pause(1, base, max, 0.0), ms(5));
        assert_eq!(retry_pause(1, base, max, 1.0), ms(10));
        assert_eq!(retry_pause(3, base, max, 0.0), ms(20));
        assert_eq!(retry_pause(30, base, max, 1.0), ms(200));
        let seen: std::collections::HashSet<_> = (0..100)
            .map(|_| retry_pause(2, base, max, random_unit()))
            .collect();
        assert!(seen.len() > 10);
        assert!(seen.iter().all(|d| *d >= ms(10) && *d <= ms(20)));
    }

    #[test]
    fn summaries_name_every_node() {
        let nodes = vec![
            NodeReport {
                node: "redis://a:1".into(),
                outcome: NodeOutcome::Granted,
                latency: None,
            },
            NodeReport {
                node: "redis://b:2".into(),
                outcome: NodeOutcome::Failed("refused".into()),
                latency: None,
            },
        ];
        assert_eq!(
            summarize(&nodes),
            "redis://a:1: granted; redis://b:2: failed: refused"
        );
        let e = Error::QuorumNotReached {
            op: "acquire",
            confirmed: 1,
            needed: 2,
            nodes,
        };
        assert!(
            e.to_string()
                .starts_with("quorum not reached: 1 of 2 nodes for acquire, 2 needed"),
            "{e}"
        );
    }
}
