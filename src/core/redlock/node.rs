//! One node of a Redlock group as a state machine: its queue of jobs, its
//! connection, the connections to fence off and the releases waiting for a
//! connection; what its transport does next ([`Action`]).

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::job::{Answer, Connected, Job, NodeReply, NodeSettings, Op};
use super::node_lease::NodeLease;
use crate::core::quorum::Vote;
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

/// When a server started, at the latest, from its `INFO` uptime
/// (`uptime_in_seconds`) read by a request sent at `asked`: the uptime is a
/// difference of whole-second clock readings, up to a second more than the
/// true uptime, so the latest start is assumed.
pub(crate) fn started_by(asked: Instant, uptime: Option<Duration>) -> Option<Instant> {
    uptime.and_then(|u| (asked + Duration::from_secs(1)).checked_sub(u))
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
        let deadline = now + self.settings.timing.node_timeout;
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
        let nt = self.settings.timing.node_timeout;
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
            job.deadline = now + self.settings.timing.node_timeout;
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
            (Op::Acquire { .. }, NodeReply::Held { remaining }) => {
                (NodeOutcome::HeldByAnother { remaining }, Vote::Held)
            }
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
        let nt = self.settings.timing.node_timeout;
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::timing::Timing;

    /// A group's timing with this node timeout (nodes ignore the drift).
    fn timing(node_timeout: Duration) -> Timing {
        Timing {
            drift_factor: 0.0,
            node_timeout,
        }
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
            timing: timing(Duration::from_millis(50)),
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

    /// Polls until the machine waits, returning what it answered.
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
            timing: timing(ms(50)),
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
            timing: timing(ms(50)),
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
}
