//! The Redlock choreography as sans-I/O state machines (antirez, "Distributed
//! Locks with Redis"; Kleppmann, "How to do distributed locking", on why a
//! command without a reply must be assumed applied).
//!
//! After quinn-proto's `Connection`: [`Node`] is one node's share of every
//! group operation. Jobs come in with [`Node::handle_job`], what the node's
//! connection brings back with [`Node::handle_result`],
//! [`Node::handle_connected`] and [`Node::handle_connect_failed`];
//! [`Node::poll`] says what to do next: answer a job, send a command, or make
//! a new connection. The runtime's node workers and the simulation drive this
//! one object, and count what it answers with [`Extension`], [`Release`] and
//! the quorum arithmetic of [`Tally`]. Nothing here reads a clock or touches a
//! socket.
//!
//! The rules it keeps:
//! - one node's jobs run in the order they came, one at a time, so the
//!   release of a lease reaches a node after that lease's acquire;
//! - a job still queued when its deadline passes (or with less time left than
//!   the node's round trip) is not sent, except a release, which gets a budget
//!   of its own so that a late grant does not outlive its clean-up;
//! - a command that got no reply taints its connection: a new one is made in
//!   the background, and the tainted one killed from it (the kill confirmed)
//!   before anything else is sent, unless the server restarted, which closed
//!   it ([`fences_for`]); until then acquires and extensions are answered
//!   "not connected" at once and releases wait, in order, to be sent;
//! - a release without a reply is sent again, a few times at most, each time
//!   on a new connection after the old one was killed;
//! - a node counts for a lease only while the server that granted it runs
//!   (same `run_id`).

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::core::lease::{Confirmed, Loss, Refusal, Ticket};
use crate::core::quorum::{AcquireVerdict, ExtendVerdict, Tally, Vote};
use crate::core::timing::{drift, retry_delay};
use crate::error::Error;
use crate::identity::Identity;
use crate::report::NodeOutcome;

/// A node timeout must be at least this many of the node's round trips.
pub(crate) const ROUND_TRIPS_PER_TIMEOUT: u32 = 2;

/// Releases a node keeps while it is not connected; beyond this, the oldest
/// are dropped (their leases then end at their expiry).
const MAX_DEFERRED: usize = 4096;

/// How many times a release that got no reply is sent again, each time on
/// a new connection after the old one was killed.
const RESENDS: u32 = 3;

/// What one job asks of its node.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Op {
    /// Set the key to the lease's value if it is free (`SET NX PX`, with `GET`
    /// and `PTTL` in the same round trip).
    Acquire { ttl_ms: u64 },
    /// Move the key's expiry if it still holds the value (`lease_extend.lua`).
    Extend { ttl_ms: u64 },
    /// Delete the key if it still holds the value (`lease_release.lua`).
    Release,
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
    /// A release got its answer: whether it deleted the key (`false`: the key
    /// had expired or belonged to another owner). Later releases repeat it.
    released: Option<bool>,
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

    /// The key on node `i`.
    pub(crate) fn key(&self, i: usize) -> &str {
        &self.keys[i]
    }

    /// The owner value every node holds the key with.
    pub(crate) fn value(&self) -> &str {
        &self.value
    }

    /// Whether node `i` counts for this lease: it confirmed the grant and has
    /// not restarted since.
    pub(crate) fn counts(&self, i: usize) -> bool {
        let slot = self.slots[i].lock();
        slot.granted_by.is_some() && !slot.restarted
    }

    /// How many nodes can still be counted on for a lease that is lost at
    /// `lost_at`: those that granted it and have not restarted since, unless
    /// they are down (`down[j]`: since when a node's watcher has lost its
    /// server) and could come back without the key and grant it again before
    /// `lost_at` (always, without a restart delay).
    pub(crate) fn counted(
        &self,
        down: &[Option<Instant>],
        restart_delay: Option<Duration>,
        lost_at: Instant,
    ) -> usize {
        let may_grant_again = |since: Instant| {
            restart_delay.is_none_or(|d| since.checked_add(d).is_none_or(|at| at < lost_at))
        };
        (0..self.slots.len())
            .filter(|&j| self.counts(j) && !down[j].is_some_and(may_grant_again))
            .count()
    }

    /// Node `i` now runs as `run_id`: if that is not the server that granted
    /// the lease, the node never counts for it again. Returns whether it
    /// stopped counting now.
    pub(crate) fn seen_run(&self, i: usize, run_id: &str) -> bool {
        let mut slot = self.slots[i].lock();
        match &slot.granted_by {
            Some(granted) if !slot.restarted && &**granted != run_id => {
                slot.restarted = true;
                true
            }
            _ => false,
        }
    }
}

/// What the node watchers know (each watches its server on an idle
/// connection of its own), and the judgement of a live lease that their news
/// prompts: a node counts for a lease while it granted it, has not restarted
/// since and, unless the restart delay keeps a restarted server from granting
/// anything before the lease's deadline, is not down.
#[derive(Debug)]
pub(crate) struct Watch {
    /// Per node: since when its watcher has lost the server, if it has.
    down: Vec<Option<Instant>>,
}

impl Watch {
    pub(crate) fn new(nodes: usize) -> Self {
        Watch {
            down: vec![None; nodes],
        }
    }

    /// Node `i`'s watcher lost its server at `now` (it keeps the first
    /// instant while the server stays away).
    pub(crate) fn went_away(&mut self, i: usize, now: Instant) {
        self.down[i].get_or_insert(now);
    }

    /// Node `i`'s watcher reached its server again, running as `run_id`:
    /// every lease in `leases` that another server granted on that node
    /// stops counting it. Returns how many did.
    pub(crate) fn came_back<'a>(
        &mut self,
        i: usize,
        run_id: &str,
        leases: impl IntoIterator<Item = &'a NodeLease>,
    ) -> usize {
        self.down[i] = None;
        leases.into_iter().filter(|l| l.seen_run(i, run_id)).count()
    }

    /// Whether a lease lost at `lost_at` can still be counted on by a
    /// quorum; `Err(counted)` when fewer than `quorum` nodes can.
    pub(crate) fn judge(
        &self,
        lease: &NodeLease,
        lost_at: Instant,
        restart_delay: Option<Duration>,
        quorum: usize,
    ) -> Result<(), usize> {
        let counted = lease.counted(&self.down, restart_delay, lost_at);
        if counted < quorum {
            Err(counted)
        } else {
            Ok(())
        }
    }
}

/// When a server started, at the latest, from its `INFO` uptime
/// (`uptime_in_seconds`) read by a request sent at `asked`: the uptime is a
/// difference of whole-second clock readings, up to a second more than the
/// true uptime, so the latest start is assumed.
pub(crate) fn started_by(asked: Instant, uptime: Option<Duration>) -> Option<Instant> {
    uptime.and_then(|u| (asked + Duration::from_secs(1)).checked_sub(u))
}

/// A node's reply to one command, as read off the wire.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum NodeReply {
    /// The acquire's `SET NX` set the key, or the key already holds this
    /// lease's value.
    Acquired,
    /// Another owner holds the key, for `pttl` more milliseconds (the
    /// server's `PTTL`).
    Held { pttl: i64 },
    /// The extension script's reply: 1 extended, 0 gone, other: someone
    /// else's.
    Extend(i64),
    /// The release script's reply: 1 deleted, 0 gone, other: someone else's.
    Release(i64),
}

/// How a node's worker runs its jobs.
#[derive(Clone, Copy, Debug)]
pub(crate) struct NodeSettings {
    /// The bound on one command; also the fresh budget of a late release.
    pub(crate) node_timeout: Duration,
    /// No acquire goes to a server that started less than this long ago.
    pub(crate) restart_delay: Option<Duration>,
}

/// One node's answer to one job.
#[derive(Debug)]
pub(crate) struct Answer {
    pub(crate) outcome: NodeOutcome,
    pub(crate) vote: Vote,
    /// Whether the command went out.
    pub(crate) sent: bool,
    /// It went out and got no reply: it may or may not have been applied.
    pub(crate) uncertain: bool,
    /// The node's failure, when trying again will not cure it.
    pub(crate) permanent: Option<Arc<Error>>,
}

impl Answer {
    fn of(outcome: NodeOutcome, vote: Vote, sent: bool) -> Answer {
        Answer {
            outcome,
            vote,
            sent,
            uncertain: false,
            permanent: None,
        }
    }

    fn not_sent(why: &str, vote: Vote) -> Answer {
        Answer::of(NodeOutcome::NotSent(why.to_owned()), vote, false)
    }
}

/// One node's share of a group operation; `J` is what the transport needs
/// to answer it (a reply channel, a fan-out id).
pub(crate) struct Job<J> {
    pub(crate) op: Op,
    pub(crate) lease: Arc<NodeLease>,
    /// Not sent after this (but a release is); the command's own timeout ends here.
    pub(crate) deadline: Instant,
    /// Taken when the job is answered; a release kept to send later has none.
    pub(crate) handle: Option<J>,
    /// How many times this release was sent without a reply.
    resends: u32,
}

impl<J> Job<J> {
    pub(crate) fn new(op: Op, lease: Arc<NodeLease>, deadline: Instant, handle: J) -> Self {
        Job {
            op,
            lease,
            deadline,
            handle: Some(handle),
            resends: 0,
        }
    }
}

/// What a node's transport does next.
pub(crate) enum Action<J> {
    /// Answer a job.
    Respond { handle: J, answer: Answer },
    /// Send the job's command on the current connection, bounded by
    /// `deadline`; then call [`Node::handle_result`].
    Send {
        op: Op,
        lease: Arc<NodeLease>,
        deadline: Instant,
    },
    /// Make a new connection in the background, killing the `tainted` ones
    /// from it (see [`fences_for`]) before it is used; then call
    /// [`Node::handle_connected`] (or [`Node::handle_connect_failed`] after
    /// each failed try).
    Connect {
        tainted: Vec<Identity>,
        run_id: Option<Arc<str>>,
    },
}

/// The connection in use.
struct Live {
    /// What the server knows of it, to kill it if a command on it gets no
    /// reply.
    id: Option<Identity>,
    /// The latest the server behind it can have started.
    started_by: Option<Instant>,
}

/// What a new connection found.
#[derive(Clone, Debug)]
pub(crate) struct Connected {
    /// What the server knows of the connection (`CLIENT ID`, and its
    /// address where `CLIENT INFO` gave it).
    pub(crate) id: Option<Identity>,
    pub(crate) run_id: Option<Arc<str>>,
    /// The latest the server can have started.
    pub(crate) started_by: Option<Instant>,
    pub(crate) round_trip: Duration,
}

/// One node of a Redlock group: its queue of jobs, its connection, the
/// connections to fence off, and the releases waiting for a connection.
pub(crate) struct Node<J> {
    index: usize,
    /// The node's address, for logs.
    name: String,
    settings: NodeSettings,
    queue: VecDeque<Job<J>>,
    /// Releases waiting for a connection, in the order they came.
    deferred: VecDeque<Job<J>>,
    /// The job whose command is out.
    in_flight: Option<Job<J>>,
    live: Option<Live>,
    /// A new connection is being made.
    connecting: bool,
    /// The run id of the server behind the last connection (kept while
    /// reconnecting, to tell a restart).
    run_id: Option<Arc<str>>,
    /// Connections whose last command got no reply: killed (and the kill
    /// confirmed) before anything else is sent to the node.
    tainted: Vec<Identity>,
    /// Why the node is not connected.
    why: String,
    /// The connect failure, when trying again will not cure it.
    permanent: Option<Arc<Error>>,
    /// The node's round trip as commands see it: the setup round trip, then
    /// the last answered command's. A command with less time left than this
    /// is not sent: its answer could not come in time, and its connection
    /// would be lost for it.
    round_trip: Option<Duration>,
    out: VecDeque<Action<J>>,
}

impl<J> Node<J> {
    /// Node `index`, connected as `first` says.
    pub(crate) fn new(
        index: usize,
        name: String,
        settings: NodeSettings,
        first: Connected,
    ) -> Self {
        let mut node = Node {
            index,
            name,
            settings,
            queue: VecDeque::new(),
            deferred: VecDeque::new(),
            in_flight: None,
            live: None,
            connecting: false,
            run_id: None,
            tainted: Vec::new(),
            why: String::new(),
            permanent: None,
            round_trip: None,
            out: VecDeque::new(),
        };
        node.adopt(first);
        node
    }

    /// Whether the node has a connection to use.
    pub(crate) fn is_connected(&self) -> bool {
        self.live.is_some()
    }

    /// Why the node is not connected.
    pub(crate) fn why(&self) -> &str {
        &self.why
    }

    /// Releases still waiting for a connection.
    pub(crate) fn deferred(&self) -> usize {
        self.deferred.len()
    }

    /// A job for this node, run after those before it.
    pub(crate) fn handle_job(&mut self, job: Job<J>) {
        self.queue.push_back(job);
    }

    /// What to do next at `now`; `None` while a command is out or nothing is
    /// queued.
    pub(crate) fn poll(&mut self, now: Instant) -> Option<Action<J>> {
        loop {
            if let Some(action) = self.out.pop_front() {
                return Some(action);
            }
            if self.in_flight.is_some() {
                return None;
            }
            let job = self.queue.pop_front()?;
            if let Some(send) = self.start(job, now) {
                return Some(send);
            }
        }
    }

    /// The command of the job out came back, `latency` after it was sent:
    /// its reply, or the error that kept it from one. `broken` says the
    /// connection can no longer be used.
    pub(crate) fn handle_result(
        &mut self,
        result: Result<NodeReply, Error>,
        broken: bool,
        latency: Duration,
    ) {
        let Some(mut job) = self.in_flight.take() else {
            return;
        };
        let answer = match result {
            Ok(reply) => {
                self.round_trip = Some(latency);
                self.judge(&job, reply)
            }
            Err(e) => {
                let uncertain = e.is_uncertain();
                if uncertain || broken {
                    self.disconnect(&e, uncertain);
                }
                Answer {
                    uncertain,
                    permanent: e.duplicate_permanent().map(Arc::new),
                    ..Answer::of(failed(&e), Vote::Unknown, true)
                }
            }
        };
        // A release without a reply goes out again once the connection it
        // used is killed: its outcome is then known, and a grant it was meant
        // to delete is gone.
        let resend = job.op == Op::Release && answer.uncertain && job.resends < RESENDS;
        self.respond(&mut job, answer);
        if resend {
            job.resends += 1;
            self.defer(job);
        }
    }

    /// A new connection is ready: every tainted connection was killed from it
    /// (the kills confirmed) or the server restarted. The releases that waited
    /// go first, in order, each with a budget of its own from `now`.
    pub(crate) fn handle_connected(&mut self, connected: Connected, now: Instant) {
        if let (Some(old), Some(new)) = (&self.run_id, &connected.run_id)
            && old != new
        {
            log::warn!(
                "redlock node {} restarted (run id {old} is now {new}); leases it granted \
                 before no longer count toward a quorum",
                self.name
            );
        }
        self.connecting = false;
        self.adopt(connected);
        let deadline = now + self.settings.node_timeout;
        while let Some(mut job) = self.deferred.pop_back() {
            job.deadline = deadline;
            self.queue.push_front(job);
        }
    }

    /// A try to connect failed with `e`; the transport tries again.
    pub(crate) fn handle_connect_failed(&mut self, e: &Error) {
        self.why = format!("reconnecting after: {e}");
        self.permanent = e.duplicate_permanent().map(Arc::new);
    }

    /// The transport stopped trying to connect (it could not start, or it is
    /// shutting down): the next job asks again.
    pub(crate) fn handle_connector_gone(&mut self, why: String) {
        self.connecting = false;
        if self.live.is_none() {
            self.why = why;
        }
    }

    fn adopt(&mut self, c: Connected) {
        let nt = self.settings.node_timeout;
        if c.round_trip * ROUND_TRIPS_PER_TIMEOUT > nt {
            log::warn!(
                "redlock node {}: round trip {:?} is more than half the node timeout {nt:?}; \
                 its answers may come too late to count",
                self.name,
                c.round_trip
            );
        }
        self.run_id = c.run_id;
        // Killed from the new connection (or the server restarted, which did).
        self.tainted.clear();
        self.permanent = None;
        self.why.clear();
        self.round_trip = Some(c.round_trip);
        self.live = Some(Live {
            id: c.id,
            started_by: c.started_by,
        });
    }

    /// The job at the head of the queue at `now`: answered at once, kept for
    /// later, or sent.
    fn start(&mut self, mut job: Job<J>, now: Instant) -> Option<Action<J>> {
        let release = job.op == Op::Release;
        if release && !self.time_for_one(job.deadline, now) {
            // Behind other jobs past its deadline (or too close to it): a
            // release is still worth sending, so that a late grant does not
            // outlive its clean-up.
            job.deadline = now + self.settings.node_timeout;
        }
        if self.live.is_none() && !self.connecting {
            self.connecting = true;
            self.out.push_back(Action::Connect {
                tainted: self.tainted.clone(),
                run_id: self.run_id.clone(),
            });
        }
        if self.live.is_none() && release && job.lease.slots[self.index].lock().sent {
            // The acquire went out: the release must follow it, once the node
            // is connected again (and the acquire's connection killed).
            let why = format!(
                "{}; the release is sent once the node is connected again",
                self.why
            );
            let answer = Answer {
                permanent: self.permanent.clone(),
                ..Answer::of(NodeOutcome::NotConnected(why), Vote::Unknown, false)
            };
            self.respond(&mut job, answer);
            self.defer(job);
            return None;
        }
        if let Some(answer) = self.answer_unsent(&job, now) {
            self.respond(&mut job, answer);
            return None;
        }
        if let Op::Acquire { .. } = job.op {
            job.lease.slots[self.index].lock().sent = true;
        }
        let send = Action::Send {
            op: job.op,
            lease: job.lease.clone(),
            deadline: job.deadline,
        };
        self.in_flight = Some(job);
        Some(send)
    }

    /// The answer of a job that is not sent, if it is not.
    fn answer_unsent(&self, job: &Job<J>, now: Instant) -> Option<Answer> {
        let (sent_before, restarted, released) = {
            let slot = job.lease.slots[self.index].lock();
            (slot.sent, slot.restarted, slot.released)
        };
        match job.op {
            // A release that waited for the connection was answered since.
            Op::Release if released.is_some() => {
                let outcome = if released == Some(true) {
                    NodeOutcome::Granted
                } else {
                    NodeOutcome::Missing
                };
                return Some(Answer::of(outcome, Vote::Yes, false));
            }
            // In order: the acquire, if any, ran before this job, so `sent` is final.
            Op::Release if !sent_before => {
                return Some(Answer::of(NodeOutcome::Missing, Vote::Yes, false));
            }
            Op::Extend { .. } if !sent_before => {
                return Some(Answer::not_sent(
                    "no acquire of this lease reached the node",
                    Vote::No,
                ));
            }
            Op::Extend { .. } if restarted => {
                return Some(Answer::not_sent(
                    "the node restarted since the grant",
                    Vote::No,
                ));
            }
            _ => {}
        }
        if now >= job.deadline {
            return Some(Answer::not_sent(
                "still queued behind an earlier command when the node timeout ran out",
                Vote::Unknown,
            ));
        }
        if !self.time_for_one(job.deadline, now) {
            return Some(Answer::not_sent(
                "still queued behind an earlier command with less of the node timeout \
                 left than the node's round trip",
                Vote::Unknown,
            ));
        }
        let Some(live) = &self.live else {
            return Some(Answer {
                permanent: self.permanent.clone(),
                ..Answer::of(
                    NodeOutcome::NotConnected(self.why.clone()),
                    Vote::Unknown,
                    false,
                )
            });
        };
        if let Op::Acquire { .. } = job.op
            && let Some(why) = self.too_young(live, now)
        {
            return Some(Answer::of(NodeOutcome::NotSent(why), Vote::Unknown, false));
        }
        None
    }

    /// What a reply to the job's command says, noted on the lease.
    fn judge(&self, job: &Job<J>, reply: NodeReply) -> Answer {
        let mut slot = job.lease.slots[self.index].lock();
        let (outcome, vote) = match (job.op, reply) {
            (Op::Acquire { .. }, NodeReply::Acquired) => {
                slot.granted_by = self.run_id.clone();
                (NodeOutcome::Granted, Vote::Yes)
            }
            (Op::Acquire { .. }, NodeReply::Held { pttl }) => (
                NodeOutcome::HeldByAnother {
                    remaining: u64::try_from(pttl).ok().map(Duration::from_millis),
                },
                Vote::Held,
            ),
            // An extension counts only on the server that granted the lease:
            // one that restarted since may have lost the key and granted it
            // to someone else.
            (Op::Extend { .. }, NodeReply::Extend(1)) => {
                match (slot.granted_by.clone(), &self.run_id) {
                    (Some(granted), Some(now)) if granted == *now => {
                        (NodeOutcome::Granted, Vote::Yes)
                    }
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
            (Op::Extend { .. }, NodeReply::Extend(0)) => (NodeOutcome::Missing, Vote::No),
            (Op::Extend { .. }, NodeReply::Extend(_)) => {
                (NodeOutcome::HeldByAnother { remaining: None }, Vote::Held)
            }
            (Op::Release, NodeReply::Release(code)) => {
                slot.released = Some(code == 1);
                let outcome = match code {
                    1 => NodeOutcome::Granted,
                    0 => NodeOutcome::Missing,
                    _ => NodeOutcome::HeldByAnother { remaining: None },
                };
                (outcome, Vote::Yes)
            }
            (op, reply) => {
                let why = format!("a reply {reply:?} to {op:?}");
                return Answer::of(NodeOutcome::Failed(why), Vote::Unknown, true);
            }
        };
        Answer::of(outcome, vote, true)
    }

    fn respond(&mut self, job: &mut Job<J>, answer: Answer) {
        if let Some(handle) = job.handle.take() {
            self.out.push_back(Action::Respond { handle, answer });
        }
    }

    fn defer(&mut self, job: Job<J>) {
        self.deferred.push_back(job);
        if self.deferred.len() > MAX_DEFERRED {
            self.deferred.pop_front();
            log::warn!(
                "redlock node {}: more than {MAX_DEFERRED} releases wait for a connection; \
                 the oldest is dropped (its lease ends at its expiry)",
                self.name
            );
        }
    }

    /// Whether a command sent at `now` can be answered by `deadline`. A
    /// round trip as long as the node timeout says nothing (every command is
    /// sent then, and one that times out has the link measured again by the
    /// reconnect).
    fn time_for_one(&self, deadline: Instant, now: Instant) -> bool {
        let left = deadline.saturating_duration_since(now);
        let nt = self.settings.node_timeout;
        !left.is_zero() && self.round_trip.is_none_or(|rtt| rtt >= nt || left >= rtt)
    }

    /// With a restart delay, a server that started less than that long ago
    /// takes no new leases (antirez's delayed restart, enforced by the client).
    fn too_young(&self, live: &Live, now: Instant) -> Option<String> {
        let delay = self.settings.restart_delay?;
        let ready = live.started_by? + delay;
        (now < ready).then(|| {
            format!(
                "the server started less than the restart delay ({delay:?}) ago; it takes \
                 leases again in {:?}",
                ready - now
            )
        })
    }

    /// The connection failed: drop it (marking it for a kill if its command
    /// may still be applied) and reconnect in the background.
    fn disconnect(&mut self, e: &Error, uncertain: bool) {
        let Some(live) = self.live.take() else {
            return;
        };
        if uncertain {
            match live.id {
                Some(id) => self.tainted.push(id),
                None => log::warn!(
                    "redlock node {}: a command without a reply cannot be fenced off (no \
                     CLIENT ID); a later command may be overtaken by it",
                    self.name
                ),
            }
        }
        log::warn!(
            "redlock node {}: {e}; reconnecting in the background",
            self.name
        );
        self.why = format!("reconnecting after: {e}");
        self.permanent = None;
        if !self.connecting {
            self.connecting = true;
            self.out.push_back(Action::Connect {
                tainted: self.tainted.clone(),
                run_id: self.run_id.clone(),
            });
        }
    }
}

/// The tainted connections a new connection must kill before it is used: all
/// of them, unless the server behind it is a new process (`run_id` changed),
/// whose start closed them and whose client ids mean nothing. Where a run id
/// is unknown they are all killed, each by its id and address (see
/// [`Identity`]), so a connection that took an id after a restart is spared.
pub(crate) fn fences_for<'a>(
    tainted: &'a [Identity],
    run_before: Option<&str>,
    run_now: Option<&str>,
) -> &'a [Identity] {
    let restarted = matches!((run_before, run_now), (Some(a), Some(b)) if a != b);
    if restarted { &[] } else { tainted }
}

fn failed(e: &Error) -> NodeOutcome {
    if e.is_timeout() {
        NodeOutcome::TimedOut
    } else {
        NodeOutcome::Failed(e.to_string())
    }
}

/// What an extension's verdict does to a lease's bounds (implemented by the
/// lease cell the guard, the renewal thread and the simulation share).
pub(crate) trait Bounds {
    /// Confirmed at `now`; what that did to the lease.
    fn extended(&self, ticket: Ticket, now: Instant) -> Confirmed;
    /// Too few nodes hold it: lost.
    fn refused(&self, ticket: Ticket, now: Instant, loss: Loss);
    /// No verdict: the worst case of the extension bounds the lease, and the
    /// claim stays.
    fn unanswered(&self, ticket: Ticket, now: Instant);
    /// Every node's share is finished: the claim is freed, the worst case
    /// kept.
    fn fenced(&self, ticket: Ticket, now: Instant);
}

/// One extension of a lease across the nodes: the answers counted as they
/// come, one verdict applied to the lease once it is decided (or at the
/// deadline), and the claim of an extension without a verdict freed once
/// every node's share is finished, from when each node runs a later
/// extension after this one or not at all.
#[derive(Debug)]
pub(crate) struct Extension {
    ticket: Ticket,
    tally: Tally,
    verdict: Option<ExtendVerdict>,
}

impl Extension {
    /// An extension claimed with `ticket`, sent to `targets` of `nodes`.
    pub(crate) fn new(ticket: Ticket, nodes: usize, targets: usize) -> Self {
        Extension {
            ticket,
            tally: Tally::new(nodes, targets),
            verdict: None,
        }
    }

    /// An extension claimed with `ticket` whose answers were counted in
    /// `tally`.
    pub(crate) fn counted(ticket: Ticket, tally: Tally) -> Self {
        Extension {
            ticket,
            tally,
            verdict: None,
        }
    }

    /// One node's answer.
    pub(crate) fn handle_answer(&mut self, vote: Vote, outcome: &NodeOutcome) {
        self.tally.add(vote, *outcome == NodeOutcome::Granted);
    }

    /// Whether the answers decide the verdict (a quorum, too few left, or
    /// every node answered) and it is not settled yet.
    pub(crate) fn is_due(&self) -> bool {
        self.verdict.is_none() && (self.tally.decided() || self.tally.outstanding == 0)
    }

    /// Every node's share is finished.
    pub(crate) fn is_finished(&self) -> bool {
        self.tally.outstanding == 0
    }

    /// Applies the verdict the answers so far reach to `lease` at `now` (at
    /// the decision, or at the deadline), once; `refusal` says why a refused
    /// one is lost.
    pub(crate) fn settle(
        &mut self,
        lease: &impl Bounds,
        now: Instant,
        refusal: impl FnOnce() -> String,
    ) -> ExtendVerdict {
        if let Some(verdict) = self.verdict {
            return verdict;
        }
        let verdict = self.tally.extend();
        match verdict {
            ExtendVerdict::Confirmed => {
                lease.extended(self.ticket, now);
            }
            ExtendVerdict::Refused => lease.refused(self.ticket, now, Loss::Other(refusal())),
            ExtendVerdict::Unknown => lease.unanswered(self.ticket, now),
        }
        self.verdict = Some(verdict);
        verdict
    }

    /// Every node's share is finished at `now`: an extension without a
    /// verdict frees its claim. Returns whether it did.
    pub(crate) fn finish(&self, lease: &impl Bounds, now: Instant) -> bool {
        let fence = self.verdict == Some(ExtendVerdict::Unknown);
        if fence {
            lease.fenced(self.ticket, now);
        }
        fence
    }
}

/// What the renewal thread needs of a lease besides its [`Bounds`].
pub(crate) trait Renewable: Bounds {
    /// The TTL renewals extend it by.
    fn ttl(&self) -> Duration;
    /// When it is lost unless an extension is confirmed first.
    fn lost_at(&self) -> Instant;
    /// Claims it for an extension to `ttl` sent at `now`.
    fn begin_extend(&self, now: Instant, ttl: Duration) -> Result<Ticket, Refusal>;
}

/// The renewal thread's extension of one lease by its TTL: claimed like any
/// extension, bounded by a node timeout (or the loss deadline, if sooner),
/// settled when its answers decide (it has no deadline of its own: every
/// node's job answers by its own), and planned again: as usual after a
/// verdict, after a retry delay when it reached none, and once more when
/// every node's share is finished and its claim freed.
#[derive(Debug)]
pub(crate) struct Renewal {
    extension: Extension,
    retry: Duration,
}

impl Renewal {
    /// Claims `lease` at `now` for a renewal sent to every one of `nodes`:
    /// the renewal and its deadline, or `None` when it cannot be claimed
    /// (lost, or the holder's own extension is in flight, whose end plans
    /// the lease again).
    pub(crate) fn begin(
        lease: &impl Renewable,
        now: Instant,
        node_timeout: Duration,
        nodes: usize,
    ) -> Option<(Renewal, Instant)> {
        let ttl = lease.ttl();
        let ticket = lease.begin_extend(now, ttl).ok()?;
        let deadline = (now + node_timeout).min(lease.lost_at());
        let renewal = Renewal {
            extension: Extension::new(ticket, nodes, nodes),
            retry: retry_delay(ttl),
        };
        Some((renewal, deadline))
    }

    /// One node's answer.
    pub(crate) fn handle_answer(&mut self, vote: Vote, outcome: &NodeOutcome) {
        self.extension.handle_answer(vote, outcome);
    }

    /// See [`Extension::is_due`].
    pub(crate) fn is_due(&self) -> bool {
        self.extension.is_due()
    }

    /// See [`Extension::is_finished`].
    pub(crate) fn is_finished(&self) -> bool {
        self.extension.is_finished()
    }

    /// Settles it (see [`Extension::settle`]): the verdict, and when to try
    /// again if it reached none.
    pub(crate) fn settle(
        &mut self,
        lease: &impl Bounds,
        now: Instant,
        refusal: impl FnOnce() -> String,
    ) -> (ExtendVerdict, Option<Instant>) {
        let verdict = self.extension.settle(lease, now, refusal);
        let retry = (verdict == ExtendVerdict::Unknown).then(|| now + self.retry);
        (verdict, retry)
    }

    /// Every node's share is finished (see [`Extension::finish`]): when to
    /// try again, if it freed a claim.
    pub(crate) fn finish(&self, lease: &impl Bounds, now: Instant) -> Option<Instant> {
        self.extension.finish(lease, now).then(|| now + self.retry)
    }
}

/// `ttl − elapsed − (ttl × drift + 2 ms)`, or zero.
pub(crate) fn validity(ttl: Duration, elapsed: Duration, drift_factor: f64) -> Duration {
    ttl.saturating_sub(elapsed + drift(ttl, drift_factor))
}

/// Whether an acquire attempt's answers give the lock: a quorum granted and
/// `validity` is left of the TTL.
pub(crate) fn acquired(tally: &Tally, validity: Duration) -> bool {
    tally.acquire() == AcquireVerdict::Granted && !validity.is_zero()
}

/// The release of one lease, over as many calls as it takes: which nodes
/// confirmed (and whether they deleted the key then), when a call's answers
/// are enough, and what the release amounts to.
#[derive(Clone, Debug)]
pub(crate) struct Release {
    /// Per node, once a release confirmed it: whether it deleted the key then.
    released: Vec<Option<bool>>,
    quorum: usize,
    /// The result, once a quorum confirmed.
    outcome: Option<bool>,
}

impl Release {
    pub(crate) fn new(nodes: usize) -> Self {
        Release {
            released: vec![None; nodes],
            quorum: nodes / 2 + 1,
            outcome: None,
        }
    }

    /// The result, once a quorum confirmed.
    pub(crate) fn outcome(&self) -> Option<bool> {
        self.outcome
    }

    /// The nodes this call sends the release to: those that have not
    /// confirmed.
    pub(crate) fn targets(&self) -> Vec<usize> {
        (0..self.released.len())
            .filter(|&i| self.released[i].is_none())
            .collect()
    }

    /// Whether this call's answers so far (`tally`, over the targets) decide
    /// the result, with the confirmations of earlier calls.
    pub(crate) fn is_decided(&self, tally: &Tally) -> bool {
        let yes = self.confirmed() + tally.yes;
        let deleted = self.deleted() + tally.changed;
        let q = self.quorum;
        deleted >= q || (yes >= q && deleted + tally.outstanding < q) || yes + tally.outstanding < q
    }

    /// Node `node` answered.
    pub(crate) fn handle_answer(&mut self, node: usize, vote: Vote, outcome: &NodeOutcome) {
        if vote == Vote::Yes {
            self.released[node] = Some(*outcome == NodeOutcome::Granted);
        }
    }

    /// The call's answers are in: `Ok` with the result (`true`: a quorum
    /// deleted the key) once a quorum confirmed, otherwise `Err` with how
    /// many did.
    pub(crate) fn conclude(&mut self) -> Result<bool, usize> {
        if let Some(outcome) = self.outcome {
            return Ok(outcome);
        }
        let yes = self.confirmed();
        if yes >= self.quorum {
            let outcome = self.deleted() >= self.quorum;
            self.outcome = Some(outcome);
            return Ok(outcome);
        }
        Err(yes)
    }

    /// The nodes that confirmed (for the simulation's checks).
    #[cfg(test)]
    pub(crate) fn confirmed_nodes(&self) -> Vec<usize> {
        (0..self.released.len())
            .filter(|&i| self.released[i].is_some())
            .collect()
    }

    fn confirmed(&self) -> usize {
        self.released.iter().flatten().count()
    }

    fn deleted(&self) -> usize {
        self.released.iter().filter(|r| **r == Some(true)).count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_node_counts_while_the_server_that_granted_runs() {
        let lease = NodeLease::new(vec!["a".into(), "b".into()], "v".into());
        assert!(!lease.counts(0), "no grant confirmed");
        assert!(!lease.seen_run(0, "one"), "nothing to lose");
        lease.slots[0].lock().granted_by = Some(Arc::from("one"));
        assert!(lease.counts(0));
        assert!(!lease.seen_run(0, "one"), "the same server");
        assert!(lease.counts(0));
        assert!(lease.seen_run(0, "two"), "another server now");
        assert!(!lease.counts(0));
        assert!(!lease.seen_run(0, "one"), "a restart is for good");
        assert!(!lease.counts(0));
        assert!(!lease.counts(1));
    }

    #[test]
    fn a_node_that_went_away_counts_only_if_the_restart_delay_outlasts_the_lease() {
        let t0 = Instant::now();
        let s = Duration::from_secs;
        let lease = NodeLease::new(vec!["a".into(), "b".into(), "c".into()], "v".into());
        for i in 0..3 {
            lease.slots[i].lock().granted_by = Some(Arc::from("one"));
        }
        let lost_at = t0 + s(10);
        assert_eq!(lease.counted(&[None; 3], None, lost_at), 3);
        let down = [Some(t0), None, None];
        assert_eq!(
            lease.counted(&down, None, lost_at),
            2,
            "no delay: it may grant at once"
        );
        assert_eq!(
            lease.counted(&down, Some(s(5)), lost_at),
            2,
            "back before the deadline"
        );
        assert_eq!(
            lease.counted(&down, Some(s(10)), lost_at),
            3,
            "back after it"
        );
        assert!(lease.seen_run(1, "two"));
        assert_eq!(
            lease.counted(&down, Some(s(10)), lost_at),
            2,
            "a restart is for good"
        );
    }

    #[test]
    fn the_watchers_news_judges_every_live_lease() {
        let t0 = Instant::now();
        let s = Duration::from_secs;
        let lease = NodeLease::new(vec!["a".into(), "b".into(), "c".into()], "v".into());
        for i in 0..3 {
            lease.slots[i].lock().granted_by = Some(Arc::from("one"));
        }
        let other = NodeLease::new(vec!["a".into(), "b".into(), "c".into()], "w".into());
        let lost_at = t0 + s(10);
        let mut watch = Watch::new(3);
        assert_eq!(watch.judge(&lease, lost_at, None, 2), Ok(()));
        watch.went_away(0, t0);
        watch.went_away(0, t0 + s(3));
        // Down since t0 (the first news), back after the deadline: counts.
        assert_eq!(watch.judge(&lease, lost_at, Some(s(10)), 2), Ok(()));
        watch.went_away(1, t0);
        assert_eq!(watch.judge(&lease, lost_at, Some(s(10)), 2), Ok(()));
        assert_eq!(watch.judge(&lease, lost_at, None, 2), Err(1));
        // Back as the same server: it counts again.
        assert_eq!(watch.came_back(0, "one", [&lease, &other]), 0);
        assert_eq!(watch.judge(&lease, lost_at, None, 2), Ok(()));
        // Back as another: only the lease it granted stops counting it, for good.
        assert_eq!(watch.came_back(1, "two", [&lease, &other]), 1);
        assert_eq!(watch.judge(&lease, lost_at, Some(s(10)), 3), Err(2));
        assert_eq!(watch.judge(&lease, lost_at, Some(s(10)), 2), Ok(()));
        assert_eq!(watch.came_back(1, "one", [&lease, &other]), 0);
        assert_eq!(watch.judge(&lease, lost_at, Some(s(10)), 3), Err(2));
    }

    #[test]
    fn a_server_is_assumed_to_have_started_as_late_as_its_uptime_allows() {
        let asked = Instant::now() + Duration::from_secs(100);
        let s = Duration::from_secs;
        assert_eq!(started_by(asked, Some(s(10))), Some(asked - s(9)));
        assert_eq!(started_by(asked, Some(s(0))), Some(asked + s(1)));
        assert_eq!(started_by(asked, None), None);
    }

    #[test]
    fn a_restarted_server_has_nothing_to_kill() {
        let t = [Identity::by_id(3), Identity::by_id(4)];
        assert_eq!(fences_for(&t, Some("a"), Some("a")), &t);
        assert_eq!(fences_for(&t, None, Some("a")), &t);
        assert!(fences_for(&t, Some("a"), Some("b")).is_empty());
    }

    fn node(now: Instant) -> Node<u32> {
        let settings = NodeSettings {
            node_timeout: Duration::from_millis(50),
            restart_delay: None,
        };
        let first = Connected {
            id: Some(Identity::by_id(7)),
            run_id: Some(Arc::from("r1")),
            started_by: None,
            round_trip: Duration::from_millis(1),
        };
        let _ = now;
        Node::new(0, "n0".into(), settings, first)
    }

    fn lease() -> Arc<NodeLease> {
        Arc::new(NodeLease::new(vec!["k".into()], "v".into()))
    }

    /// Queues an acquire of `l` with `deadline` and has it sent at `now`.
    fn send_acquire(n: &mut Node<u32>, l: &Arc<NodeLease>, deadline: Instant, now: Instant) {
        let op = Op::Acquire { ttl_ms: 1000 };
        n.handle_job(Job::new(op, l.clone(), deadline, 1));
        assert!(matches!(n.poll(now), Some(Action::Send { .. })));
    }

    #[test]
    fn an_unanswered_command_taints_and_the_release_waits_for_the_kill() {
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        let mut n = node(t0);
        let l = lease();
        send_acquire(&mut n, &l, t0 + ms(50), t0);
        assert!(n.poll(t0).is_none(), "one command out at a time");
        let timeout = Error::Timeout {
            op: "acquire",
            after: ms(50),
        };
        n.handle_result(Err(timeout), true, ms(50));
        let mut tainted = None;
        let mut answered = None;
        while let Some(a) = n.poll(t0 + ms(50)) {
            match a {
                Action::Connect { tainted: t, .. } => tainted = Some(t),
                Action::Respond { answer, .. } => answered = Some(answer.vote),
                Action::Send { .. } => panic!("nothing is sent while disconnected"),
            }
        }
        assert_eq!(tainted, Some(vec![Identity::by_id(7)]));
        assert_eq!(answered, Some(Vote::Unknown));
        n.handle_job(Job::new(Op::Release, l.clone(), t0 + ms(100), 2));
        match n.poll(t0 + ms(51)) {
            Some(Action::Respond { answer, .. }) => {
                assert!(!answer.sent);
                assert_eq!(answer.vote, Vote::Unknown);
            }
            _ => panic!("the release is answered at once"),
        }
        assert_eq!(n.deferred(), 1);
        let c = Connected {
            id: Some(Identity::by_id(8)),
            run_id: Some(Arc::from("r1")),
            started_by: None,
            round_trip: ms(1),
        };
        n.handle_connected(c, t0 + ms(500));
        assert!(
            matches!(n.poll(t0 + ms(500)), Some(Action::Send { op: Op::Release, deadline, .. }) if deadline == t0 + ms(550)),
            "the kept release goes out with a budget of its own"
        );
        n.handle_result(Ok(NodeReply::Release(1)), false, ms(1));
        assert!(
            n.poll(t0 + ms(501)).is_none(),
            "nobody waits for its answer"
        );
    }

    #[test]
    fn an_unanswered_release_goes_out_again_after_the_kill() {
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        let mut n = node(t0);
        let l = lease();
        send_acquire(&mut n, &l, t0 + ms(50), t0);
        n.handle_result(Ok(NodeReply::Acquired), false, ms(1));
        let _ = answers(&mut n, t0);
        n.handle_job(Job::new(Op::Release, l.clone(), t0 + ms(50), 2));
        assert!(matches!(
            n.poll(t0),
            Some(Action::Send {
                op: Op::Release,
                ..
            })
        ));
        let lost = Error::Timeout {
            op: "release",
            after: ms(50),
        };
        n.handle_result(Err(lost), true, ms(50));
        let tainted = reconnect_asked(&mut n, t0 + ms(50));
        assert_eq!(
            tainted,
            Some(vec![Identity::by_id(7)]),
            "its connection is killed first"
        );
        assert!(!n.is_connected());
        assert_eq!(n.deferred(), 1, "the release waits for the kill");
        let c = Connected {
            id: Some(Identity::by_id(8)),
            run_id: Some(Arc::from("r1")),
            started_by: None,
            round_trip: ms(1),
        };
        n.handle_connected(c, t0 + ms(100));
        assert!(n.is_connected());
        assert!(matches!(
            n.poll(t0 + ms(100)),
            Some(Action::Send {
                op: Op::Release,
                ..
            })
        ));
    }

    #[test]
    fn a_broken_connection_with_a_known_outcome_is_replaced_without_a_kill() {
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        let mut n = node(t0);
        let l = lease();
        send_acquire(&mut n, &l, t0 + ms(50), t0);
        let unreadable = Error::UnexpectedReply {
            op: "acquire",
            reply: "?".into(),
        };
        assert!(!unreadable.is_uncertain());
        n.handle_result(Err(unreadable), true, ms(1));
        let tainted = reconnect_asked(&mut n, t0 + ms(1));
        assert_eq!(tainted, Some(vec![]), "reconnects, with nothing to kill");
        assert!(!n.is_connected());
        assert!(n.why().contains("reconnecting"), "{}", n.why());
        assert_eq!(n.deferred(), 0);
    }

    /// What an extension did to a lease's bounds, in order.
    #[derive(Default)]
    struct Seen(std::cell::RefCell<Vec<&'static str>>);

    impl Bounds for Seen {
        fn extended(&self, _: Ticket, _: Instant) -> Confirmed {
            self.0.borrow_mut().push("extended");
            Confirmed::Held
        }
        fn refused(&self, _: Ticket, _: Instant, _: Loss) {
            self.0.borrow_mut().push("refused");
        }
        fn unanswered(&self, _: Ticket, _: Instant) {
            self.0.borrow_mut().push("unanswered");
        }
        fn fenced(&self, _: Ticket, _: Instant) {
            self.0.borrow_mut().push("fenced");
        }
    }

    fn ticket(now: Instant) -> Ticket {
        let timing = crate::core::timing::Timing {
            drift_factor: 0.01,
            node_timeout: Duration::from_millis(50),
        };
        let ttl = Duration::from_secs(10);
        let mut core = crate::core::lease::LeaseCore::granted(timing, now, ttl);
        core.begin_extend(now, ttl).expect("a claim")
    }

    #[test]
    fn an_extension_settles_once_and_frees_its_claim_only_without_a_verdict() {
        let now = Instant::now();
        let granted = NodeOutcome::Granted;
        let timed_out = NodeOutcome::TimedOut;
        // Three of five confirm: decided before the last two answer.
        let seen = Seen::default();
        let mut e = Extension::new(ticket(now), 5, 5);
        for _ in 0..3 {
            assert!(!e.is_due());
            e.handle_answer(Vote::Yes, &granted);
        }
        assert!(e.is_due() && !e.is_finished());
        assert_eq!(e.settle(&seen, now, String::new), ExtendVerdict::Confirmed);
        assert!(!e.is_due(), "settled once");
        e.handle_answer(Vote::Unknown, &timed_out);
        e.handle_answer(Vote::Unknown, &timed_out);
        assert!(e.is_finished());
        assert!(
            !e.finish(&seen, now),
            "a confirmed extension has no claim to free"
        );
        assert_eq!(*seen.0.borrow(), ["extended"]);

        // Two of three unanswered: no verdict, the worst case stands until
        // every node's share is finished.
        let seen = Seen::default();
        let mut e = Extension::new(ticket(now), 3, 3);
        e.handle_answer(Vote::Yes, &granted);
        e.handle_answer(Vote::Unknown, &timed_out);
        assert!(!e.is_due(), "the third node may still make a quorum");
        assert_eq!(e.settle(&seen, now, String::new), ExtendVerdict::Unknown);
        e.handle_answer(Vote::Unknown, &timed_out);
        assert_eq!(e.settle(&seen, now, String::new), ExtendVerdict::Unknown);
        assert!(e.finish(&seen, now));
        assert_eq!(*seen.0.borrow(), ["unanswered", "fenced"]);

        // Two of three refuse: lost.
        let seen = Seen::default();
        let mut e = Extension::new(ticket(now), 3, 3);
        e.handle_answer(Vote::No, &NodeOutcome::Missing);
        e.handle_answer(Vote::Held, &NodeOutcome::HeldByAnother { remaining: None });
        assert!(e.is_due());
        assert_eq!(
            e.settle(&seen, now, || "gone".into()),
            ExtendVerdict::Refused
        );
        assert_eq!(*seen.0.borrow(), ["refused"]);
    }

    #[test]
    fn an_acquire_needs_a_quorum_and_validity_left() {
        let mut t = Tally::new(3, 3);
        t.add(Vote::Yes, true);
        t.add(Vote::Yes, true);
        assert!(acquired(&t, Duration::from_millis(1)));
        assert!(!acquired(&t, Duration::ZERO), "the attempt used up the TTL");
        let mut t = Tally::new(3, 3);
        t.add(Vote::Yes, true);
        t.add(Vote::Unknown, false);
        t.add(Vote::Unknown, false);
        assert!(!acquired(&t, Duration::from_secs(1)));
    }

    /// Polls until the machine waits, returning what it answered.
    /// Runs `n`'s actions at `now`: the tainted connections of the reconnect
    /// it asked for, if it asked for one.
    fn reconnect_asked(n: &mut Node<u32>, now: Instant) -> Option<Vec<Identity>> {
        let mut tainted = None;
        while let Some(a) = n.poll(now) {
            if let Action::Connect { tainted: t, .. } = a {
                tainted = Some(t);
            }
        }
        tainted
    }

    fn answers(n: &mut Node<u32>, now: Instant) -> Vec<(u32, Answer)> {
        let mut out = Vec::new();
        while let Some(a) = n.poll(now) {
            if let Action::Respond { handle, answer } = a {
                out.push((handle, answer));
            }
        }
        out
    }

    #[test]
    fn an_extension_counts_only_on_the_server_that_granted() {
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        let mut n = node(t0);
        let l = lease();
        send_acquire(&mut n, &l, t0 + ms(50), t0);
        n.handle_result(Ok(NodeReply::Acquired), false, ms(1));
        assert_eq!(answers(&mut n, t0)[0].1.vote, Vote::Yes);
        assert!(l.counts(0));
        // The server restarts (with its data): a new run id.
        let e = Error::Timeout {
            op: "extend",
            after: ms(50),
        };
        n.handle_job(Job::new(
            Op::Extend { ttl_ms: 1000 },
            l.clone(),
            t0 + ms(60),
            2,
        ));
        assert!(matches!(n.poll(t0 + ms(10)), Some(Action::Send { .. })));
        n.handle_result(Err(e), true, ms(1));
        let _ = answers(&mut n, t0 + ms(11));
        let c = Connected {
            id: Some(Identity::by_id(1)),
            run_id: Some(Arc::from("r2")),
            started_by: None,
            round_trip: ms(1),
        };
        n.handle_connected(c, t0 + ms(20));
        n.handle_job(Job::new(
            Op::Extend { ttl_ms: 1000 },
            l.clone(),
            t0 + ms(70),
            3,
        ));
        assert!(matches!(n.poll(t0 + ms(20)), Some(Action::Send { .. })));
        n.handle_result(Ok(NodeReply::Extend(1)), false, ms(1));
        let got = answers(&mut n, t0 + ms(21));
        assert_eq!(got[0].1.vote, Vote::No, "{got:?}");
        assert!(matches!(got[0].1.outcome, NodeOutcome::Uncounted(_)));
        assert!(!l.counts(0), "a restart is for good");
        // Later extensions are not even sent there.
        n.handle_job(Job::new(Op::Extend { ttl_ms: 1000 }, l, t0 + ms(80), 4));
        let got = answers(&mut n, t0 + ms(22));
        assert!(!got[0].1.sent && got[0].1.vote == Vote::No, "{got:?}");
    }

    #[test]
    fn a_job_past_its_deadline_is_not_sent_but_a_release_is() {
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        let mut n = node(t0);
        let l = lease();
        n.handle_job(Job::new(
            Op::Acquire { ttl_ms: 1000 },
            l.clone(),
            t0 + ms(50),
            1,
        ));
        let late = t0 + ms(60);
        let got = answers(&mut n, late);
        assert!(!got[0].1.sent && got[0].1.vote == Vote::Unknown, "{got:?}");
        // Not sent: nothing to release, and the release says so at once.
        n.handle_job(Job::new(Op::Release, l.clone(), t0 + ms(50), 2));
        let got = answers(&mut n, late);
        assert!(!got[0].1.sent && got[0].1.vote == Vote::Yes, "{got:?}");
        // Sent: the release goes out past its deadline, with a budget of its own.
        send_acquire(&mut n, &l, late + ms(50), late);
        n.handle_result(Ok(NodeReply::Acquired), false, ms(1));
        let _ = answers(&mut n, late);
        n.handle_job(Job::new(Op::Release, l, late, 4));
        let later = late + ms(5);
        assert!(matches!(
            n.poll(later),
            Some(Action::Send { op: Op::Release, deadline, .. }) if deadline == later + ms(50)
        ));
    }

    #[test]
    fn a_release_counts_only_what_confirmed() {
        let mut r = Release::new(3);
        // One call: node 0 deleted the key, node 1 did not answer.
        let mut t = Tally::new(3, 3);
        t.add(Vote::Yes, true);
        t.add(Vote::Unknown, false);
        assert!(!r.is_decided(&t), "node 2 may still make a quorum");
        r.handle_answer(0, Vote::Yes, &NodeOutcome::Granted);
        r.handle_answer(1, Vote::Unknown, &NodeOutcome::TimedOut);
        assert_eq!(r.conclude(), Err(1), "one confirmation is not a quorum");
        assert_eq!(r.targets(), vec![1, 2]);
        // The next call counts node 0's confirmation from the first.
        let mut t = Tally::new(3, 2);
        t.add(Vote::Yes, true);
        assert!(r.is_decided(&t));
        r.handle_answer(2, Vote::Yes, &NodeOutcome::Granted);
        assert_eq!(r.conclude(), Ok(true));
        assert_eq!(r.outcome(), Some(true));
    }
    /// A connection to the node's first server (`r1`) with id `id`.
    fn connected(id: u64) -> Connected {
        Connected {
            id: Some(Identity::by_id(id)),
            run_id: Some(Arc::from("r1")),
            started_by: None,
            round_trip: Duration::from_millis(1),
        }
    }

    /// Acquires `l` on `n` at `now` (granted) and drops the answer.
    fn granted(n: &mut Node<u32>, l: &Arc<NodeLease>, now: Instant) {
        send_acquire(n, l, now + Duration::from_millis(50), now);
        n.handle_result(Ok(NodeReply::Acquired), false, Duration::from_millis(1));
        let _ = answers(n, now);
    }

    /// Sends an acquire of `l` that gets no reply: the node is disconnected,
    /// its connection to be killed, the acquire possibly applied.
    fn unanswered_acquire(n: &mut Node<u32>, l: &Arc<NodeLease>, now: Instant) {
        let ms = Duration::from_millis;
        send_acquire(n, l, now + ms(50), now);
        let timeout = Error::Timeout {
            op: "acquire",
            after: ms(50),
        };
        n.handle_result(Err(timeout), true, ms(50));
        let _ = answers(n, now + ms(50));
        assert!(!n.is_connected());
    }

    #[test]
    fn an_unanswered_release_is_sent_again_at_most_three_times() {
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        let mut n = node(t0);
        let l = lease();
        granted(&mut n, &l, t0);
        n.handle_job(Job::new(Op::Release, l, t0 + ms(50), 2));
        let mut now = t0;
        let mut sends = 0;
        for id in 8..20 {
            if !matches!(
                n.poll(now),
                Some(Action::Send {
                    op: Op::Release,
                    ..
                })
            ) {
                break;
            }
            sends += 1;
            let lost = Error::Timeout {
                op: "release",
                after: ms(50),
            };
            n.handle_result(Err(lost), true, ms(50));
            now += ms(50);
            let _ = answers(&mut n, now);
            n.handle_connected(connected(id), now);
        }
        assert_eq!(sends, 1 + RESENDS, "the first send and three more");
        assert_eq!(n.deferred(), 0, "nothing is kept after the last");
    }

    #[test]
    fn the_releases_kept_for_a_connection_get_one_node_timeout_from_it() {
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        let mut n = node(t0);
        let l = lease();
        unanswered_acquire(&mut n, &l, t0);
        n.handle_job(Job::new(Op::Release, l, t0 + ms(100), 2));
        let _ = answers(&mut n, t0 + ms(60));
        assert_eq!(n.deferred(), 1);
        n.handle_connected(connected(8), t0 + ms(500));
        assert!(matches!(
            n.poll(t0 + ms(510)),
            Some(Action::Send { op: Op::Release, deadline, .. }) if deadline == t0 + ms(550)
        ));
    }

    #[test]
    fn a_failure_to_reconnect_is_what_the_jobs_that_wait_report() {
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        let mut n = node(t0);
        let l = lease();
        unanswered_acquire(&mut n, &l, t0);
        let denied = Error::Permission("NOPERM no permissions to run 'client|kill'".into());
        n.handle_connect_failed(&denied);
        assert!(n.why().contains("NOPERM"), "{}", n.why());
        // An acquire of another lease, answered at once; the release of the
        // lease whose acquire went out, answered and kept.
        n.handle_job(Job::new(
            Op::Acquire { ttl_ms: 1000 },
            lease(),
            t0 + ms(100),
            2,
        ));
        n.handle_job(Job::new(Op::Release, l, t0 + ms(100), 3));
        let got = answers(&mut n, t0 + ms(60));
        assert_eq!(got.len(), 2, "{got:?}");
        for (_, answer) in &got {
            assert!(!answer.sent, "{answer:?}");
            assert!(
                matches!(&answer.outcome, NodeOutcome::NotConnected(why) if why.contains("NOPERM")),
                "{answer:?}"
            );
            assert!(
                matches!(answer.permanent.as_deref(), Some(Error::Permission(_))),
                "{answer:?}"
            );
        }
        assert_eq!(n.deferred(), 1);
    }

    #[test]
    fn a_node_whose_connector_stopped_asks_for_another_with_the_next_job() {
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        let mut n = node(t0);
        unanswered_acquire(&mut n, &lease(), t0);
        n.handle_connector_gone("the connector stopped".into());
        assert_eq!(n.why(), "the connector stopped");
        n.handle_job(Job::new(
            Op::Acquire { ttl_ms: 1000 },
            lease(),
            t0 + ms(100),
            2,
        ));
        assert_eq!(
            reconnect_asked(&mut n, t0 + ms(60)),
            Some(vec![Identity::by_id(7)]),
            "a new connector, still to kill the tainted connection"
        );
    }

    #[test]
    fn an_error_that_trying_again_will_not_cure_comes_with_the_answer() {
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        let mut n = node(t0);
        send_acquire(&mut n, &lease(), t0 + ms(50), t0);
        n.handle_result(Err(Error::Permission("NOPERM".into())), false, ms(1));
        let got = answers(&mut n, t0);
        let answer = &got[0].1;
        assert!(answer.sent && !answer.uncertain, "{answer:?}");
        assert_eq!(answer.vote, Vote::Unknown);
        assert!(
            matches!(answer.permanent.as_deref(), Some(Error::Permission(_))),
            "{answer:?}"
        );
        assert!(
            n.is_connected(),
            "an error reply leaves the connection usable"
        );
    }

    #[test]
    fn a_release_of_a_lease_released_meanwhile_repeats_the_answer_unsent() {
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        let mut n = node(t0);
        let l = lease();
        granted(&mut n, &l, t0);
        n.handle_job(Job::new(Op::Release, l.clone(), t0 + ms(50), 2));
        n.handle_job(Job::new(Op::Release, l, t0 + ms(50), 3));
        assert!(matches!(
            n.poll(t0),
            Some(Action::Send {
                op: Op::Release,
                ..
            })
        ));
        n.handle_result(Ok(NodeReply::Release(1)), false, ms(1));
        let got = answers(&mut n, t0 + ms(1));
        assert_eq!(got.len(), 2, "{got:?}");
        assert!(got[0].1.sent && got[0].1.outcome == NodeOutcome::Granted);
        assert!(!got[1].1.sent, "{got:?}");
        assert_eq!(got[1].1.outcome, NodeOutcome::Granted, "the key it deleted");
        assert_eq!(got[1].1.vote, Vote::Yes);
    }

    #[test]
    fn an_extension_of_a_lease_whose_acquire_never_reached_the_node_is_not_sent() {
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        let mut n = node(t0);
        let op = Op::Extend { ttl_ms: 1000 };
        n.handle_job(Job::new(op, lease(), t0 + ms(50), 1));
        let got = answers(&mut n, t0);
        assert_eq!(got.len(), 1, "answered at once: {got:?}");
        assert!(!got[0].1.sent, "{got:?}");
        assert_eq!(got[0].1.vote, Vote::No, "it cannot count");
    }

    #[test]
    fn an_extension_confirmed_by_the_server_that_granted_counts() {
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        let mut n = node(t0);
        let l = lease();
        granted(&mut n, &l, t0);
        n.handle_job(Job::new(
            Op::Extend { ttl_ms: 1000 },
            l.clone(),
            t0 + ms(60),
            2,
        ));
        assert!(matches!(n.poll(t0 + ms(10)), Some(Action::Send { .. })));
        n.handle_result(Ok(NodeReply::Extend(1)), false, ms(1));
        let got = answers(&mut n, t0 + ms(11));
        assert_eq!(got[0].1.vote, Vote::Yes, "{got:?}");
        assert_eq!(got[0].1.outcome, NodeOutcome::Granted);
        assert!(l.counts(0));
    }

    #[test]
    fn a_release_reply_says_whether_it_deleted_the_key() {
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        let cases = [
            (1, NodeOutcome::Granted),
            (0, NodeOutcome::Missing),
            (-1, NodeOutcome::HeldByAnother { remaining: None }),
        ];
        for (code, outcome) in cases {
            let mut n = node(t0);
            let l = lease();
            granted(&mut n, &l, t0);
            n.handle_job(Job::new(Op::Release, l, t0 + ms(50), 2));
            assert!(matches!(n.poll(t0), Some(Action::Send { .. })));
            n.handle_result(Ok(NodeReply::Release(code)), false, ms(1));
            let got = answers(&mut n, t0);
            assert_eq!(got[0].1.outcome, outcome, "reply {code}");
            assert_eq!(got[0].1.vote, Vote::Yes, "reply {code}: confirmed");
        }
    }

    #[test]
    fn at_most_a_bounded_number_of_releases_wait_for_a_connection() {
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        let mut n = node(t0);
        let l = lease();
        unanswered_acquire(&mut n, &l, t0);
        for h in 0..=MAX_DEFERRED {
            n.handle_job(Job::new(Op::Release, l.clone(), t0 + ms(100), h as u32));
        }
        assert_eq!(answers(&mut n, t0 + ms(60)).len(), MAX_DEFERRED + 1);
        assert_eq!(n.deferred(), MAX_DEFERRED, "the oldest is dropped");
    }

    #[test]
    fn a_command_with_less_time_left_than_the_round_trip_is_not_sent() {
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        let settings = NodeSettings {
            node_timeout: ms(50),
            restart_delay: None,
        };
        let first = Connected {
            round_trip: ms(10),
            ..connected(7)
        };
        let mut n = Node::new(0, "n0".into(), settings, first);
        let op = Op::Acquire { ttl_ms: 1000 };
        n.handle_job(Job::new(op, lease(), t0 + ms(5), 1));
        let got = answers(&mut n, t0);
        assert!(!got[0].1.sent && got[0].1.vote == Vote::Unknown, "{got:?}");
        n.handle_job(Job::new(op, lease(), t0 + ms(20), 2));
        assert!(matches!(n.poll(t0), Some(Action::Send { .. })));
    }

    #[test]
    fn a_server_younger_than_the_restart_delay_takes_no_acquire() {
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        let delay = Duration::from_secs(10);
        let settings = NodeSettings {
            node_timeout: ms(50),
            restart_delay: Some(delay),
        };
        let first = Connected {
            started_by: Some(t0),
            ..connected(7)
        };
        let mut n = Node::new(0, "n0".into(), settings, first);
        let op = Op::Acquire { ttl_ms: 1000 };
        let early = t0 + Duration::from_secs(1);
        n.handle_job(Job::new(op, lease(), early + ms(50), 1));
        let got = answers(&mut n, early);
        assert!(!got[0].1.sent, "{got:?}");
        assert!(
            matches!(&got[0].1.outcome, NodeOutcome::NotSent(why) if why.contains("restart delay")),
            "{got:?}"
        );
        let ready = t0 + delay;
        n.handle_job(Job::new(op, lease(), ready + ms(50), 2));
        assert!(
            matches!(n.poll(ready), Some(Action::Send { .. })),
            "as old as the delay: it takes leases again"
        );
    }

    /// A lease core behind the bounds and renewal traits.
    struct Held(Mutex<crate::core::lease::LeaseCore>);

    impl Bounds for Held {
        fn extended(&self, ticket: Ticket, now: Instant) -> Confirmed {
            self.0.lock().extended(ticket, now)
        }
        fn refused(&self, ticket: Ticket, _: Instant, loss: Loss) {
            self.0.lock().refused(ticket, loss);
        }
        fn unanswered(&self, ticket: Ticket, _: Instant) {
            self.0.lock().unanswered(ticket);
        }
        fn fenced(&self, ticket: Ticket, _: Instant) {
            self.0.lock().fenced(ticket);
        }
    }

    impl Renewable for Held {
        fn ttl(&self) -> Duration {
            self.0.lock().ttl()
        }
        fn lost_at(&self) -> Instant {
            self.0.lock().lost_at()
        }
        fn begin_extend(&self, now: Instant, ttl: Duration) -> Result<Ticket, Refusal> {
            self.0.lock().begin_extend(now, ttl)
        }
    }

    #[test]
    fn a_renewal_waits_a_node_timeout_settles_at_a_quorum_and_is_planned_again_without_one() {
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        let s = Duration::from_secs;
        let ttl = s(10);
        let timing = crate::core::timing::Timing {
            drift_factor: 0.01,
            node_timeout: ms(50),
        };
        let held = Held(Mutex::new(crate::core::lease::LeaseCore::granted(
            timing, t0, ttl,
        )));
        let granted = NodeOutcome::Granted;
        let timed_out = NodeOutcome::TimedOut;

        let now = t0 + s(5);
        let (mut r, deadline) = Renewal::begin(&held, now, ms(50), 3).expect("a claim");
        assert_eq!(deadline, now + ms(50));
        assert!(!r.is_due() && !r.is_finished());
        r.handle_answer(Vote::Yes, &granted);
        assert!(!r.is_due());
        r.handle_answer(Vote::Yes, &granted);
        assert!(r.is_due() && !r.is_finished());
        assert_eq!(
            r.settle(&held, now + ms(2), String::new),
            (ExtendVerdict::Confirmed, None)
        );
        assert_eq!(
            held.0.lock().valid_until(),
            now + ttl - drift(ttl, 0.01),
            "the bound moved"
        );
        r.handle_answer(Vote::Unknown, &timed_out);
        assert!(r.is_finished());
        assert_eq!(r.finish(&held, now + ms(3)), None);

        let now = t0 + s(6);
        let (mut r, _) = Renewal::begin(&held, now, ms(50), 3).expect("a claim");
        r.handle_answer(Vote::Yes, &granted);
        r.handle_answer(Vote::Unknown, &timed_out);
        assert!(!r.is_due(), "the third node may still make a quorum");
        r.handle_answer(Vote::Unknown, &timed_out);
        assert!(r.is_due() && r.is_finished());
        let settled = now + ms(50);
        assert_eq!(
            r.settle(&held, settled, String::new),
            (ExtendVerdict::Unknown, Some(settled + retry_delay(ttl)))
        );
        assert!(held.0.lock().is_claimed(), "the worst case stands");
        let finished = now + ms(60);
        assert_eq!(r.finish(&held, finished), Some(finished + retry_delay(ttl)));
        assert!(!held.0.lock().is_claimed());

        // Close to the loss deadline, that is the renewal's deadline.
        let late = held.0.lock().lost_at() - ms(10);
        let (_, deadline) = Renewal::begin(&held, late, ms(50), 3).expect("a claim");
        assert!(deadline < late + ms(50));
        assert_eq!(deadline, held.0.lock().lost_at());
    }

    #[test]
    fn validity_is_what_is_left_of_the_ttl_after_the_attempt_and_the_drift() {
        let ms = Duration::from_millis;
        let s = Duration::from_secs;
        assert_eq!(validity(s(10), s(1), 0.01), s(10) - s(1) - ms(102));
        assert_eq!(validity(s(1), s(2), 0.01), Duration::ZERO);
    }

    #[test]
    fn a_release_is_decided_once_no_answer_left_can_change_it() {
        // One call's answers: each vote, and whether that node deleted the key.
        type Answers = [(Vote, bool)];
        let call = |targets: usize, answers: &Answers| {
            let mut t = Tally::new(3, targets);
            for &(vote, deleted) in answers {
                t.add(vote, deleted);
            }
            t
        };
        let (yes, kept, lost) = (
            (Vote::Yes, true),
            (Vote::Yes, false),
            (Vote::Unknown, false),
        );
        let r = Release::new(3);
        assert_eq!(r.outcome(), None);
        let first_calls: [(&Answers, bool, &str); 6] = [
            (&[yes], false, "two more may delete"),
            (&[yes, yes], true, "a quorum deleted"),
            (
                &[yes, kept],
                false,
                "the third may make a quorum that deleted",
            ),
            (
                &[kept, kept],
                true,
                "a quorum confirmed; no quorum can delete",
            ),
            (&[lost, lost], true, "no quorum can confirm"),
            (&[kept, lost], false, "the third may make a quorum"),
        ];
        for (answers, decided, why) in first_calls {
            assert_eq!(r.is_decided(&call(3, answers)), decided, "{why}");
        }
        // A second call, to nodes 1 and 2, after node 0 confirmed.
        let mut deleted_before = Release::new(3);
        deleted_before.handle_answer(0, Vote::Yes, &NodeOutcome::Granted);
        assert!(deleted_before.is_decided(&call(2, &[yes])), "two deleted");
        assert!(
            !deleted_before.is_decided(&call(2, &[lost])),
            "node 2 may make a quorum"
        );
        let mut kept_before = Release::new(3);
        kept_before.handle_answer(0, Vote::Yes, &NodeOutcome::Missing);
        assert!(
            kept_before.is_decided(&call(2, &[kept])),
            "a quorum confirmed; no quorum can delete"
        );
        assert!(
            !kept_before.is_decided(&call(2, &[yes])),
            "node 2 may make a quorum that deleted"
        );
        kept_before.handle_answer(1, Vote::Yes, &NodeOutcome::Missing);
        assert_eq!(
            kept_before.conclude(),
            Ok(false),
            "confirmed, nothing deleted"
        );
        assert_eq!(kept_before.outcome(), Some(false));
    }
}
