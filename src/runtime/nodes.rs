//! The Redlock node workers: one thread per node of a `RedlockGroup`, each with
//! its own connection, running that node's share of every group operation in
//! the order the operations were issued.
//!
//! A group operation sends one job to every worker and waits for replies only
//! until its outcome is decided; a job still running then is finished (or times
//! out) in the background, and its connection is dropped if it got no reply.
//! Because one node's jobs run in order on one connection, the release of a
//! lease reaches a node after that lease's acquire, even when the acquire was
//! abandoned unanswered: a late grant is always cleaned up by owner token.
//!
//! A command that got no reply may still be applied later, on the connection it
//! went out on. So before anything else is sent to that node, the worker kills
//! that connection from its new one (`CLIENT KILL ID`) and waits for the
//! confirmation: one node's commands are applied in the order they were issued
//! or not at all, and a release can never be overtaken by the late acquire it
//! cleans up after. While the kill cannot be confirmed, nothing is sent there.
//! A release that waited past its deadline behind other jobs is still sent,
//! with a budget of its own, so a late grant does not outlive its clean-up.
//!
//! A node whose command failed at the transport level (refused, reset, no reply)
//! is rested for a short, growing while: acquires and extensions are answered
//! "not sent" without touching the network until the next try, so a dead or
//! blackholed node neither slows the group down nor piles up connections.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender};
use parking_lot::Mutex;

use crate::conn::{Conn, ConnConfig};
use crate::core::quorum::Vote;
use crate::error::{Error, Result};
use crate::report::NodeOutcome;
use crate::scripts;

/// What one job asks of its node.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Op {
    /// Set the key to the lease's value if it is free (`lock_acquire.lua`).
    Acquire { ttl_ms: u64 },
    /// Move the key's expiry if it still holds the value (`lease_extend.lua`).
    Extend { ttl_ms: u64 },
    /// Delete the key if it still holds the value (`lease_release.lua`).
    Release,
}

/// One node's answer to one job.
#[derive(Clone, Debug)]
pub(crate) struct Reply {
    pub(crate) node: usize,
    /// The job's tag, echoed.
    pub(crate) tag: u64,
    pub(crate) outcome: NodeOutcome,
    pub(crate) vote: Vote,
    /// From the send to the reply; `None` when nothing was sent.
    pub(crate) latency: Option<Duration>,
}

/// What the group knows about one lease on one node.
#[derive(Debug, Default)]
struct Slot {
    /// An acquire was sent: the node may hold the key.
    sent: bool,
    /// The run id of the server that granted it.
    granted_by: Option<Arc<str>>,
    /// The server restarted since the grant: it never counts again.
    restarted: bool,
}

/// One lease across the nodes: its key on each node (with that node's prefix),
/// its value, and what each node did with it. Shared by the guard and the jobs.
#[derive(Debug)]
pub(crate) struct NodeLease {
    keys: Vec<String>,
    value: String,
    slots: Vec<Mutex<Slot>>,
}

impl NodeLease {
    pub(crate) fn new(keys: Vec<String>, value: String) -> Self {
        let slots = keys.iter().map(|_| Mutex::new(Slot::default())).collect();
        NodeLease { keys, value, slots }
    }
}

/// One node's share of a group operation.
pub(crate) struct Job {
    pub(crate) op: Op,
    pub(crate) lease: Arc<NodeLease>,
    /// Not sent after this (but a release is); the command's own timeout ends here.
    pub(crate) deadline: Instant,
    /// Where the reply goes; `None` for fire-and-forget clean-up.
    pub(crate) reply: Option<Sender<Reply>>,
    /// Echoed in the reply, to tell fan-outs sharing one channel apart.
    pub(crate) tag: u64,
    /// Counted down when the job is finished, whatever its outcome.
    pub(crate) done: Option<Arc<Completion>>,
}

/// Runs a closure once every job of one fan-out is finished, and its decider
/// has had its say (it holds one count of its own).
pub(crate) struct Completion {
    remaining: std::sync::atomic::AtomicUsize,
    then: Mutex<Option<Box<dyn FnOnce() + Send>>>,
}

impl Completion {
    /// For `jobs` jobs plus the decider.
    pub(crate) fn new(jobs: usize) -> Arc<Completion> {
        Arc::new(Completion {
            remaining: std::sync::atomic::AtomicUsize::new(jobs + 1),
            then: Mutex::new(None),
        })
    }

    /// Sets what runs at the end (the decider calls this, then [`Completion::finish`]).
    pub(crate) fn then(&self, f: impl FnOnce() + Send + 'static) {
        *self.then.lock() = Some(Box::new(f));
    }

    /// One job, or the decider, is finished.
    pub(crate) fn finish(&self) {
        if self
            .remaining
            .fetch_sub(1, std::sync::atomic::Ordering::AcqRel)
            == 1
            && let Some(f) = self.then.lock().take()
        {
            f();
        }
    }
}

/// The handle on one worker thread; the thread finishes the queued jobs and
/// stops when the handle is dropped.
pub(crate) struct NodeWorker {
    tx: Sender<Job>,
    pub(crate) addr: String,
    /// Disconnects when the thread ends.
    ended: Receiver<()>,
    thread: std::thread::ThreadId,
}

/// Stops the workers after the jobs already queued (releases of dropped
/// guards), waiting for them until `deadline`; a worker dropping its own group
/// is not waited for.
pub(crate) fn stop(workers: Vec<NodeWorker>, deadline: Instant) {
    let me = std::thread::current().id();
    let waits: Vec<(Receiver<()>, std::thread::ThreadId)> =
        workers.into_iter().map(|w| (w.ended, w.thread)).collect();
    for (ended, thread) in waits {
        if thread != me {
            let _ = ended.recv_deadline(deadline);
        }
    }
}

impl NodeWorker {
    pub(crate) fn spawn(
        index: usize,
        cfg: Arc<ConnConfig>,
        restart_delay: Option<Duration>,
        warm_up: Duration,
    ) -> std::io::Result<NodeWorker> {
        let (tx, rx) = crossbeam_channel::unbounded();
        let addr = cfg.addr.to_string();
        let worker = Worker {
            index,
            cfg,
            rx,
            conn: None,
            run_id: None,
            started_by: None,
            restart_delay,
            failures: 0,
            down_until: None,
            last_error: String::new(),
            tainted: Vec::new(),
        };
        let (end_tx, ended) = crossbeam_channel::bounded::<()>(0);
        let handle = std::thread::Builder::new()
            .name(format!("respire-node-{index}"))
            .spawn(move || {
                let _end = end_tx;
                worker.run(warm_up);
            })?;
        Ok(NodeWorker {
            tx,
            addr,
            ended,
            thread: handle.thread().id(),
        })
    }

    /// Queues a job. If the thread is gone (it never panics, so only at
    /// shutdown), the reply says so.
    pub(crate) fn send(&self, index: usize, job: Job) {
        if let Err(e) = self.tx.send(job) {
            let job = e.into_inner();
            if let Some(reply) = job.reply {
                let _ = reply.try_send(Reply {
                    node: index,
                    tag: job.tag,
                    outcome: NodeOutcome::Failed("the node's worker thread stopped".into()),
                    vote: Vote::Unknown,
                    latency: None,
                });
            }
            if let Some(done) = job.done {
                done.finish();
            }
        }
    }
}

/// What `INFO server` says about a server.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct ServerInfo {
    pub(crate) run_id: Option<String>,
    pub(crate) uptime: Option<Duration>,
    pub(crate) replid: Option<String>,
    pub(crate) cluster: bool,
}

/// Reads the fields the group needs from an `INFO` reply.
pub(crate) fn parse_info(info: &str) -> ServerInfo {
    let mut out = ServerInfo::default();
    for line in info.lines() {
        let Some((name, value)) = line.trim().split_once(':') else {
            continue;
        };
        match name {
            "run_id" => out.run_id = Some(value.to_owned()),
            "uptime_in_seconds" => out.uptime = value.parse().ok().map(Duration::from_secs),
            "master_replid" => out.replid = Some(value.to_owned()),
            "cluster_enabled" => out.cluster = value == "1",
            _ => {}
        }
    }
    out
}

/// How long a node is rested after its `failures`-th failure in a row:
/// 25 ms, doubling, at most 1 s.
pub(crate) fn rest_after(failures: u32) -> Duration {
    let shift = failures.clamp(1, 7) - 1;
    (Duration::from_millis(25) * (1u32 << shift)).min(Duration::from_secs(1))
}

struct Worker {
    index: usize,
    cfg: Arc<ConnConfig>,
    rx: Receiver<Job>,
    conn: Option<Conn>,
    /// The run id of the server behind the current connection.
    run_id: Option<Arc<str>>,
    /// The latest the server behind the current connection can have started.
    started_by: Option<Instant>,
    restart_delay: Option<Duration>,
    failures: u32,
    down_until: Option<Instant>,
    last_error: String,
    /// Connections whose last command got no reply: killed (and the kill
    /// confirmed) before anything else is sent to the node.
    tainted: Vec<u64>,
}

impl Worker {
    fn run(mut self, warm_up: Duration) {
        if let Err(e) = self.connect(Instant::now() + warm_up) {
            log::debug!("redlock node {} not reachable yet: {e}", self.cfg.addr);
        }
        // After the handle is dropped, the jobs already queued (releases from
        // dropped guards) still run; then `recv` fails and the thread ends.
        while let Ok(mut job) = self.rx.recv() {
            let started = Instant::now();
            if matches!(job.op, Op::Release) && started >= job.deadline {
                // Behind other jobs past its deadline: a release is still worth
                // sending, so that a late grant does not outlive its clean-up.
                job.deadline = started + self.cfg.node_timeout;
            }
            let (outcome, vote, sent) = self.execute(&job);
            if let Some(reply) = job.reply {
                let _ = reply.try_send(Reply {
                    node: self.index,
                    tag: job.tag,
                    outcome,
                    vote,
                    latency: sent.then(|| started.elapsed()),
                });
            }
            if let Some(done) = job.done {
                done.finish();
            }
        }
    }

    /// Runs one job: returns its outcome, how it votes, and whether anything
    /// was sent.
    fn execute(&mut self, job: &Job) -> (NodeOutcome, Vote, bool) {
        let i = self.index;
        let (sent_before, restarted) = {
            let slot = job.lease.slots[i].lock();
            (slot.sent, slot.restarted)
        };
        match job.op {
            // FIFO: the acquire, if any, ran before this job, so `sent` is final.
            Op::Release if !sent_before => return (NodeOutcome::Missing, Vote::Yes, false),
            Op::Extend { .. } if !sent_before => {
                return not_sent("no acquire of this lease reached the node", Vote::No);
            }
            Op::Extend { .. } if restarted => {
                return not_sent("the node restarted since the grant", Vote::No);
            }
            _ => {}
        }
        let now = Instant::now();
        if now >= job.deadline {
            return not_sent(
                "still queued behind an earlier command when the node timeout ran out",
                Vote::Unknown,
            );
        }
        if !matches!(job.op, Op::Release)
            && let Some(until) = self.down_until
            && now < until
        {
            let why = format!(
                "the node is rested for {:?} after a failure ({})",
                until - now,
                self.last_error
            );
            return (NodeOutcome::NotSent(why), Vote::Unknown, false);
        }
        for retry in [false, true] {
            let reused = self.conn.is_some();
            if let Err(e) = self.connect(job.deadline) {
                self.fail(&e);
                return (failed(&e), Vote::Unknown, false);
            }
            if let Op::Acquire { .. } = job.op
                && let Some(why) = self.too_young(Instant::now())
            {
                return (NodeOutcome::NotSent(why), Vote::Unknown, false);
            }
            if let Op::Acquire { .. } = job.op {
                job.lease.slots[i].lock().sent = true;
            }
            let conn_id = self.conn.as_ref().and_then(Conn::id);
            let result = self.run_script(job, job.deadline);
            if result.as_ref().is_err_and(Error::is_uncertain) {
                match conn_id {
                    Some(id) => self.tainted.push(id),
                    None => log::warn!(
                        "redlock node {}: a command without a reply cannot be fenced off (CLIENT \
                         ID is denied); a later command may be overtaken by it",
                        self.cfg.addr
                    ),
                }
            }
            if self.conn.as_ref().is_some_and(Conn::is_broken) {
                self.conn = None;
            }
            match result {
                Ok((outcome, vote)) => {
                    self.failures = 0;
                    self.down_until = None;
                    return (outcome, vote, true);
                }
                // A connection that sat idle may have been closed by a server
                // restart: try once more on a fresh one. Every script here is
                // safe to repeat for the same owner.
                Err(Error::Io { .. }) if reused && !retry => continue,
                Err(e) => {
                    if e.is_uncertain() {
                        self.fail(&e);
                    }
                    return (failed(&e), Vote::Unknown, true);
                }
            }
        }
        unreachable!("the loop returns on its second pass")
    }

    fn run_script(&mut self, job: &Job, deadline: Instant) -> Result<(NodeOutcome, Vote)> {
        let i = self.index;
        let key = job.lease.keys[i].as_str();
        let value = job.lease.value.as_str();
        let conn = self.conn.as_mut().expect("connected before running");
        match job.op {
            Op::Acquire { ttl_ms } => {
                let reply: Vec<i64> = conn.script(
                    &scripts::LOCK_ACQUIRE,
                    &[key],
                    &[value, &ttl_ms.to_string()],
                    "acquire",
                    deadline,
                )?;
                match reply.as_slice() {
                    [1] => {
                        job.lease.slots[i].lock().granted_by = self.run_id.clone();
                        Ok((NodeOutcome::Granted, Vote::Yes))
                    }
                    [0, pttl] => Ok((
                        NodeOutcome::HeldByAnother {
                            remaining: u64::try_from(*pttl).ok().map(Duration::from_millis),
                        },
                        Vote::Held,
                    )),
                    other => Err(unexpected("acquire", other)),
                }
            }
            Op::Extend { ttl_ms } => {
                let reply: i64 = conn.script(
                    &scripts::LEASE_EXTEND,
                    &[key],
                    &[value, &ttl_ms.to_string()],
                    "extend",
                    deadline,
                )?;
                match reply {
                    1 => Ok(self.judge_extension(&job.lease)),
                    0 => Ok((NodeOutcome::Missing, Vote::No)),
                    _ => Ok((NodeOutcome::HeldByAnother { remaining: None }, Vote::Held)),
                }
            }
            Op::Release => {
                let reply: i64 = conn.script(
                    &scripts::LEASE_RELEASE,
                    &[key],
                    &[value, "exact"],
                    "release",
                    deadline,
                )?;
                Ok(match reply {
                    1 => (NodeOutcome::Granted, Vote::Yes),
                    0 => (NodeOutcome::Missing, Vote::Yes),
                    _ => (NodeOutcome::HeldByAnother { remaining: None }, Vote::Yes),
                })
            }
        }
    }

    /// An extension counts only on the server that granted the lease: one that
    /// restarted since may have lost the key and granted it to someone else.
    fn judge_extension(&self, lease: &NodeLease) -> (NodeOutcome, Vote) {
        let mut slot = lease.slots[self.index].lock();
        match (slot.granted_by.clone(), &self.run_id) {
            (Some(granted), Some(now)) if granted == *now => (NodeOutcome::Granted, Vote::Yes),
            (Some(granted), now) => {
                slot.restarted = true;
                let why = format!(
                    "the node restarted since the grant (run id {granted} is now {})",
                    now.as_deref().unwrap_or("unknown")
                );
                (NodeOutcome::Uncounted(why), Vote::No)
            }
            (None, _) => (
                NodeOutcome::Uncounted("its grant was never confirmed".into()),
                Vote::No,
            ),
        }
    }

    /// With a restart delay, a server that started less than that long ago
    /// takes no new leases (antirez's delayed restart, enforced by the client).
    fn too_young(&self, now: Instant) -> Option<String> {
        let delay = self.restart_delay?;
        let started_by = self.started_by?;
        let ready = started_by + delay;
        (now < ready).then(|| {
            format!(
                "the server started less than the restart delay ({delay:?}) ago; it takes \
                 leases again in {:?}",
                ready - now
            )
        })
    }

    /// Makes sure there is a usable connection, learning the server's run id
    /// and start time on every new one.
    fn connect(&mut self, deadline: Instant) -> Result<()> {
        if self.conn.as_ref().is_some_and(|c| !c.is_broken()) {
            return Ok(());
        }
        self.conn = None;
        let budget = deadline
            .saturating_duration_since(Instant::now())
            .max(Duration::from_millis(1));
        let mut conn = self.cfg.connect(budget, "respire-redlock")?;
        // Fence off the connections whose commands got no reply, so nothing
        // sent from now on can be overtaken by them.
        while let Some(&old) = self.tainted.last() {
            let kill = redis::cmd("CLIENT")
                .arg("KILL")
                .arg("ID")
                .arg(old)
                .arg("SKIPME")
                .arg("yes")
                .clone();
            conn.query::<i64>(
                &kill,
                "CLIENT KILL (fencing off an unanswered command)",
                deadline,
            )?;
            self.tainted.pop();
        }
        let asked = Instant::now();
        let info: String = conn.query(redis::cmd("INFO").arg("server"), "INFO server", deadline)?;
        let info = parse_info(&info);
        let run_id: Option<Arc<str>> = info.run_id.as_deref().map(Arc::from);
        if let (Some(old), Some(new)) = (&self.run_id, &run_id)
            && old != new
        {
            log::warn!(
                "redlock node {} restarted (run id {old} is now {new}); leases it granted \
                 before no longer count toward a quorum",
                self.cfg.addr
            );
        }
        self.run_id = run_id;
        // uptime_in_seconds is a difference of whole-second clock readings, up
        // to a second more than the true uptime: assume the latest start.
        self.started_by = info
            .uptime
            .and_then(|u| (asked + Duration::from_secs(1)).checked_sub(u));
        self.conn = Some(conn);
        Ok(())
    }

    fn fail(&mut self, e: &Error) {
        self.conn = None;
        self.failures = self.failures.saturating_add(1);
        self.down_until = Some(Instant::now() + rest_after(self.failures));
        self.last_error = e.to_string();
    }
}

fn not_sent(why: &str, vote: Vote) -> (NodeOutcome, Vote, bool) {
    (NodeOutcome::NotSent(why.to_owned()), vote, false)
}

fn failed(e: &Error) -> NodeOutcome {
    if e.is_timeout() {
        NodeOutcome::TimedOut
    } else {
        NodeOutcome::Failed(e.to_string())
    }
}

fn unexpected(op: &'static str, reply: &[i64]) -> Error {
    Error::UnexpectedReply {
        op,
        reply: format!("{reply:?}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rest_grows_and_is_capped() {
        let ms = Duration::from_millis;
        assert_eq!(rest_after(1), ms(25));
        assert_eq!(rest_after(2), ms(50));
        assert_eq!(rest_after(5), ms(400));
        assert_eq!(rest_after(7), ms(1000));
        assert_eq!(rest_after(u32::MAX), ms(1000));
    }

    #[test]
    fn parses_the_info_fields() {
        let info = "# Server\r\nredis_version:7.0.15\r\nrun_id:abc123\r\n\
                    uptime_in_seconds:42\r\n# Replication\r\nrole:master\r\n\
                    master_replid:def456\r\n# Cluster\r\ncluster_enabled:1\r\n";
        let parsed = parse_info(info);
        assert_eq!(parsed.run_id.as_deref(), Some("abc123"));
        assert_eq!(parsed.uptime, Some(Duration::from_secs(42)));
        assert_eq!(parsed.replid.as_deref(), Some("def456"));
        assert!(parsed.cluster);
        assert!(!parse_info("cluster_enabled:0\r\n").cluster);
    }
}
