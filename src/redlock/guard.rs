//! The Redlock backend of the one guard family ([`LeaseGuard<Redlock>`]),
//! its extensions, its release and its renewal: a transport of the bounds
//! every lease keeps (`core::lease`) and of how the nodes' answers add up to
//! a verdict and what the verdict does to those bounds
//! (`core::redlock::Extension`, `QuorumRenewal` and `Release`), which the
//! simulation drives too.
//!
//! The renewal thread (`respire-redlock`, started by the first guard that
//! needs it) hands due extensions to the node workers and counts their
//! answers as they come; it never waits on a node, so loss signals close on
//! time whatever the nodes do.

use std::collections::HashMap;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use crossbeam_channel::Receiver;
use parking_lot::Mutex;

use super::Group;
use super::fanout::Heard;
use super::worker::{Completion, Reply, ReplyTo, Route};
use crate::clock::Clock;
use crate::core::executor::Claimed;
use crate::core::extend::{ResetDone, ResetExpiry, ResetStep};
use crate::core::lease::{LeaseCore, Loss, Ticket};
use crate::core::quorum::{ExtendVerdict, Tally};
use crate::core::redlock::{Extension, NodeLease, Op, QuorumRenewal, Release};
use crate::core::timing::Timing;
use crate::error::{Error, Result};
use crate::guard::ReleaseOutcome;
use crate::lease::guard::held::{self, Held};
use crate::lease::guard::{Backend, LeaseGuard, sealed};
use crate::observe::{LeaseId, Primitive};
use crate::report::{NodeOutcome, NodeReport, summarize};
use crate::runtime::lease::{HasCell, LeaseCell, LeaseView};
use crate::runtime::scheduler::{Dispatch, RenewalThread};
use crate::token::FencingToken;

/// One Redlock lease, shared by its guard and the renewal thread.
pub(crate) struct RedlockLease {
    group: Arc<Group>,
    pub(super) cell: LeaseCell<Arc<NodeLease>>,
    /// Named by the group when read.
    evidence: Mutex<Vec<Heard>>,
}

impl RedlockLease {
    pub(super) fn nodes(&self) -> &Arc<NodeLease> {
        self.cell.extra()
    }

    /// Keeps every node's answer to an extension sent to all of them, by
    /// `deadline`, as the lock's evidence; returns them named.
    fn heard(&self, replies: Vec<Option<Reply>>, deadline: Instant) -> Vec<NodeReport> {
        let group = &self.group;
        let heard = group.answers(replies, &group.all(), deadline, &NodeOutcome::Abandoned);
        let nodes = group.named(&heard);
        *self.evidence.lock() = heard;
        nodes
    }

    /// Too few nodes can be counted on: the lock is lost from `now`, unless
    /// it was already.
    pub(super) fn lose_quorum(&self, now: Instant, why: String) {
        if self.cell.is_lost(now) {
            return;
        }
        log::warn!("redlock {:?} is lost: {why}", self.cell.key());
        self.cell.mark_lost(now, Loss::Other(why));
        self.group.renewal.touch(self);
    }
}

impl HasCell for RedlockLease {
    type Extra = Arc<NodeLease>;
    fn cell(&self) -> &LeaseCell<Arc<NodeLease>> {
        &self.cell
    }
}

/// The Redlock backend of [`LeaseGuard`]: a lease held on a quorum of
/// independent deployments ([`RedlockGroup`](crate::RedlockGroup)). Its guard
/// is a [`RedlockGuard`]; it has no fencing token.
#[derive(Debug)]
pub enum Redlock {}

impl sealed::Sealed for Redlock {}

impl Backend for Redlock {
    type Held = RedlockHeld;
    type Handle = super::RedlockHandle;
    const GUARD: &'static str = "RedlockGuard";
}

/// A held Redlock lock: a [`LeaseGuard`] with every guard verb, Redlock's
/// [`last_evidence`](LeaseGuard::last_evidence) and
/// [`extend_on_every_node`](LeaseGuard::extend_on_every_node). Its
/// [`reset_expiry`](LeaseGuard::reset_expiry) asks every node and counts a
/// quorum; its [`release`](LeaseGuard::release) deletes the lock on every node
/// that still holds it.
pub type RedlockGuard = LeaseGuard<Redlock>;

/// What a [`RedlockGuard`] holds: the lease, shared with the renewal thread,
/// and what the releases so far confirmed.
#[allow(
    unreachable_pub,
    reason = "named by the public `Backend`, but nameable only in this crate"
)]
pub struct RedlockHeld {
    inner: Arc<RedlockLease>,
    release: Release,
}

impl LeaseGuard<Redlock> {
    pub(super) fn granted(
        group: &Arc<Group>,
        key: &str,
        nodes: Arc<NodeLease>,
        sent: Instant,
        ttl: Duration,
        evidence: Vec<Heard>,
    ) -> RedlockGuard {
        let core = LeaseCore::granted(group.timing, sent, ttl);
        let inner = Arc::new(RedlockLease {
            group: group.clone(),
            cell: LeaseCell::new(key.to_owned(), nodes, core),
            evidence: Mutex::new(evidence),
        });
        group.restarts.live.register(&inner);
        (inner.cell).observe_with(group.options.observer.as_ref(), Primitive::Redlock);
        group.users.join();
        LeaseGuard::from_held(RedlockHeld {
            inner,
            release: Release::new(group.len()),
        })
    }

    fn lease(&self) -> &Arc<RedlockLease> {
        &self.held().inner
    }

    /// Every node's answer to the last operation on this lock (the acquire,
    /// an extension, or a release that reached no quorum). Does not block.
    pub fn last_evidence(&self) -> Vec<NodeReport> {
        let lease = self.lease();
        lease.group.named(&lease.evidence.lock())
    }

    /// [`reset_expiry`](LeaseGuard::reset_expiry), but the answers of every
    /// node are awaited, not only a quorum's: until each node answered or the
    /// node timeout (or the current validity, if sooner) ran out. Afterwards
    /// [`last_evidence`](LeaseGuard::last_evidence) says, for every node that
    /// answered in time, whether it holds this lock (`Granted`, or
    /// `Uncounted` for a node whose grant does not count), holds another
    /// owner's value (`HeldByAnother`) or nothing (`Missing`); a node that did
    /// not answer in time is `TimedOut`.
    ///
    /// For a caller that must know what each node holds, such as one that
    /// also uses the nodes one by one: `reset_expiry` returns at a quorum and
    /// leaves the slower nodes `Abandoned`. Blocks up to a node timeout when a
    /// node is slow or down. Returns and fails as
    /// [`reset_expiry`](LeaseGuard::reset_expiry) does.
    ///
    /// # Errors
    /// As [`reset_expiry`](LeaseGuard::reset_expiry).
    pub fn extend_on_every_node(&self, ttl: Duration) -> Result<bool> {
        self.extend_with(RedlockExtend::new(self.lease(), ttl, |_| false)?)
    }

    /// The lease's id and (no) fencing token, for observers.
    pub(super) fn observed(&self) -> (LeaseId, Option<FencingToken>) {
        (LeaseId(self.lease().cell.id()), None)
    }
}

/// One extension call of a Redlock lease: sent to every node, it stops
/// listening for answers once `decided` says so (or at the deadline).
#[allow(
    unreachable_pub,
    reason = "named by the sealed `Held`, but nameable only in this crate"
)]
pub struct RedlockExtend<'a> {
    lease: &'a Arc<RedlockLease>,
    ttl_ms: u64,
    decided: fn(&Tally) -> bool,
}

impl<'a> RedlockExtend<'a> {
    fn new(
        lease: &'a Arc<RedlockLease>,
        ttl: Duration,
        decided: fn(&Tally) -> bool,
    ) -> Result<Self> {
        Ok(RedlockExtend {
            lease,
            ttl_ms: lease.group.check_ttl(ttl)?,
            decided,
        })
    }
}

#[allow(
    private_interfaces,
    reason = "a sealed trait's methods, named only in this crate"
)]
impl held::Extender for RedlockExtend<'_> {
    fn ttl(&self) -> Duration {
        Duration::from_millis(self.ttl_ms)
    }

    fn send(&mut self, _reset: &mut ResetExpiry, ticket: Ticket) -> Result<ResetStep> {
        let lease = self.lease;
        let group = &lease.group;
        let cell = &lease.cell;
        let now = group.now();
        let deadline = (now + group.timing.node_timeout).min(cell.valid_until());
        let targets = group.all();
        let done = Completion::new(targets.len());
        let (replies, tally) = group.fan_out(
            Op::Extend {
                ttl_ms: self.ttl_ms,
            },
            lease.nodes(),
            &targets,
            deadline,
            Some(&done),
            self.decided,
        );
        let nodes = lease.heard(replies, deadline);
        let mut extension = Extension::counted(ticket, tally);
        let verdict = extension.settle(cell, group.now(), || refusal(&nodes));
        if verdict == ExtendVerdict::Unknown {
            // Released once every node's share is finished: from then on,
            // each node runs a later extension after this one or not at all.
            let lease = lease.clone();
            done.then(move || {
                extension.finish(&lease.cell, lease.group.now());
                lease.group.renewal.touch(&*lease);
            });
        }
        done.finish();
        let lost = cell.is_lost(group.now());
        match verdict {
            ExtendVerdict::Confirmed if !lost => Ok(ResetStep::Done(ResetDone::Held)),
            ExtendVerdict::Unknown if !lost => Err(Error::QuorumNotReached {
                op: "extend",
                confirmed: tally.yes,
                needed: tally.quorum,
                nodes,
            }),
            // Refused, or confirmed or unanswered past the lease's end.
            _ => Ok(ResetStep::Done(ResetDone::Lost)),
        }
    }

    /// Never reached: a quorum's extension ends held, lost or unknown.
    fn failed(&self, done: ResetDone) -> Error {
        Error::UnexpectedReply {
            op: "reset expiry",
            reply: format!("{done:?}"),
        }
    }
}

#[allow(
    private_interfaces,
    reason = "a sealed trait's methods, named only in this crate"
)]
impl Held for RedlockHeld {
    fn cell(&self) -> &dyn LeaseView {
        &self.inner.cell
    }

    fn now(&self) -> Instant {
        self.inner.group.now()
    }

    fn timing(&self) -> Timing {
        self.inner.group.timing
    }

    fn watch(&self) -> Result<()> {
        self.inner.group.renewal.watch(&self.inner)
    }

    fn touch(&self) {
        self.inner.group.renewal.touch(&*self.inner);
    }

    /// Nothing to check: the nodes' rights were checked when the group was made.
    fn check_keep_alive(&self) -> Result<()> {
        Ok(())
    }

    type Extend<'a> = RedlockExtend<'a>;

    fn extender(&self, ttl: Duration) -> Result<RedlockExtend<'_>> {
        RedlockExtend::new(&self.inner, ttl, Tally::decided)
    }

    fn release(&mut self) -> Result<ReleaseOutcome> {
        let lease = &self.inner;
        let group = &lease.group;
        lease.cell.finish(group.now());
        group.renewal.forget(&**lease);
        let targets = self.release.targets();
        let deadline = group.now() + group.timing.node_timeout;
        let release = &self.release;
        let (replies, _) =
            group.fan_out(Op::Release, lease.nodes(), &targets, deadline, None, |t| {
                release.is_decided(t)
            });
        for reply in replies.iter().flatten() {
            self.release
                .handle_answer(reply.node, reply.vote, &reply.outcome);
        }
        let skipped = NodeOutcome::NotSent("confirmed by an earlier release".into());
        let heard = group.answers(replies, &targets, deadline, &skipped);
        let outcome = match self.release.conclude() {
            Ok(true) => ReleaseOutcome::Released,
            Ok(false) if self.release.taken_over() => ReleaseOutcome::TakenOver,
            Ok(false) => ReleaseOutcome::Expired,
            Err(confirmed) => {
                log::warn!(
                    "release of redlock {:?} reached no quorum ({confirmed} of {} confirmed: \
                     {}); the nodes that did not answer keep it, and it ends at its expiry at \
                     the latest",
                    lease.cell.key(),
                    group.quorum,
                    summarize(&group.named(&heard))
                );
                ReleaseOutcome::Uncertain
            }
        };
        *lease.evidence.lock() = heard;
        if let Some(w) = lease.cell.watching() {
            w.released(lease.cell.key(), lease.cell.id(), Some(outcome));
        }
        Ok(outcome)
    }

    fn dropped(&mut self) {
        self.inner.group.users.leave(&self.inner.group);
    }
}

/// Why a refused extension's lock is lost.
fn refusal(nodes: &[NodeReport]) -> String {
    format!("no quorum holds it any more ({})", summarize(nodes))
}

impl Group {
    /// The instant now, by the group's clock.
    pub(super) fn now(&self) -> Instant {
        self.clock.now()
    }
}

/// The group's renewal thread, started on first use.
pub(crate) type GroupRenewal = RenewalThread<ToNodes>;

/// The renewal thread of `group`, not started yet.
pub(super) fn group_renewal(group: Weak<Group>, clock: Arc<dyn Clock>) -> GroupRenewal {
    RenewalThread::new("respire-redlock", clock, move || {
        let (tx, rx) = crossbeam_channel::unbounded();
        ToNodes {
            group: group.clone(),
            tx: ReplyTo::Channel(tx),
            rx,
            in_flight: HashMap::new(),
        }
    })
}

/// One renewal in flight: its answers so far.
struct InFlight {
    lease: Arc<RedlockLease>,
    renewal: QuorumRenewal,
    replies: Vec<Option<Reply>>,
    deadline: Instant,
}

/// The renewal thread's dispatcher: extensions go to the node workers, whose
/// answers come back on `rx` and are counted as they arrive.
pub(crate) struct ToNodes {
    group: Weak<Group>,
    /// The channel `rx` reads, as the jobs' reply route.
    tx: ReplyTo,
    rx: Receiver<Reply>,
    in_flight: HashMap<u64, InFlight>,
}

impl Dispatch for ToNodes {
    type Lease = Arc<RedlockLease>;
    type Reply = Reply;

    fn dispatch(
        &mut self,
        batch: Vec<Claimed<Arc<RedlockLease>>>,
        now: Instant,
    ) -> Vec<(u64, Option<Instant>)> {
        let mut done = Vec::new();
        let Some(group) = self.group.upgrade() else {
            batch
                .iter()
                .for_each(|(l, ticket, _)| l.cell.not_sent(*ticket, now));
            return done;
        };
        for (lease, ticket, ttl) in batch {
            let id = lease.cell.id();
            let Ok(ttl_ms) = group.check_ttl(ttl) else {
                lease.cell.not_sent(ticket, now);
                done.push((id, None));
                continue;
            };
            let nt = group.timing.node_timeout;
            let (renewal, deadline) =
                QuorumRenewal::new(&lease.cell, (ticket, ttl), now, nt, group.len());
            let route = Route {
                reply: Some(self.tx.clone()),
                tag: id,
                done: None,
            };
            let op = Op::Extend { ttl_ms };
            group.send(op, lease.nodes(), &group.all(), deadline, &route);
            let replies = vec![None; group.len()];
            let f = InFlight {
                lease,
                renewal,
                replies,
                deadline,
            };
            self.in_flight.insert(id, f);
        }
        done
    }

    fn replies(&self) -> Receiver<Reply> {
        self.rx.clone()
    }

    fn on_reply(&mut self, reply: Reply, now: Instant) -> Vec<(u64, Option<Instant>)> {
        let mut done = Vec::new();
        let id = reply.tag;
        let Some(f) = self.in_flight.get_mut(&id) else {
            return done;
        };
        f.renewal.handle_answer(reply.vote, &reply.outcome);
        let node = reply.node;
        f.replies[node] = Some(reply);
        if f.renewal.is_due() {
            let nodes = f.lease.heard(f.replies.clone(), f.deadline);
            let (verdict, retry) = f.renewal.settle(&f.lease.cell, now, || refusal(&nodes));
            if verdict == ExtendVerdict::Unknown {
                log::warn!(
                    "extending redlock {:?} reached no verdict ({}); retrying while time remains",
                    f.lease.cell.key(),
                    summarize(&nodes)
                );
            }
            done.push((id, retry));
        }
        if f.renewal.is_finished() {
            let f = self.in_flight.remove(&id).expect("present");
            // Every node's share is finished: later extensions run after it.
            if let Some(retry) = f.renewal.finish(&f.lease.cell, now) {
                done.push((id, Some(retry)));
            }
        }
        done
    }
}
