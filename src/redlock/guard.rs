//! The Redlock guard, its extensions and its renewal.
//!
//! A guard's bounds are a `core::lease` like every other lease's: the validity
//! of the grant counts from the first send, an extension is claimed so that two
//! never overlap (a user's `extend` waits for a keep-alive renewal in flight,
//! and the other way round), a quorum's confirmation moves the bound, and an
//! extension that reached no verdict bounds the lock by its worst case — a
//! shorter TTL from its send time — until every node's share of it is
//! finished. Each node runs one lease's commands in order and fences off the
//! connection of a command that got no reply before sending another, so the
//! next extension cannot be overtaken on any node.
//!
//! How the nodes' answers add up to a verdict, and what the verdict does to
//! the bounds, is `core::redlock::Extension` (and, for a release,
//! `core::redlock::Release`), which the simulation drives too.
//!
//! The renewal thread (`respire-redlock`, started by the first guard that
//! needs it) hands due extensions to the node workers and counts their
//! answers as they come; it never waits on a node, so loss signals close on
//! time whatever the nodes do.

use std::collections::HashMap;
use std::fmt;
use std::marker::PhantomData;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use crossbeam_channel::Receiver;
use parking_lot::Mutex;

use super::Group;
use super::fanout::Heard;
use super::worker::{Completion, Reply, ReplyTo};
use crate::clock::Clock;
use crate::core::lease::{Confirmed, LeaseCore, Loss, Refusal, Ticket};
use crate::core::quorum::{ExtendVerdict, Tally};
use crate::core::redlock::{Bounds, Extension, NodeLease, Op, Release, Renewable, Renewal};
use crate::core::schedule::{Next, Watched};
use crate::error::{Error, Result};
use crate::guard::ReleaseOutcome;
use crate::observe::{LeaseId, Primitive};
use crate::report::{NodeOutcome, NodeReport, summarize};
use crate::runtime::lease::LeaseCell;
use crate::runtime::scheduler::{Dispatch, RenewalThread, Watchable};
use crate::token::FencingToken;

/// One Redlock lease, shared by its guard and the renewal thread.
pub(crate) struct RedlockLease {
    group: Arc<Group>,
    cell: LeaseCell<Arc<NodeLease>>,
    /// Named by the group when read.
    evidence: Mutex<Vec<Heard>>,
}

impl RedlockLease {
    pub(super) fn nodes(&self) -> &Arc<NodeLease> {
        self.cell.extra()
    }

    pub(super) fn is_finished(&self) -> bool {
        self.cell.is_finished()
    }

    pub(super) fn lost_at(&self) -> Instant {
        self.cell.lost_at()
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

impl Watched for Arc<RedlockLease> {
    fn id(&self) -> u64 {
        self.cell.id()
    }

    fn poll(&self, now: Instant) -> Next {
        self.cell.next(now)
    }
}

/// A held Redlock lock. Dropping it releases the lock on every node (once,
/// best effort, waiting at most the node timeout, never panicking);
/// [`release`](RedlockGuard::release) does the same and reports the result.
///
/// # Loss
///
/// The lock is lost when its loss deadline passes — the first send of the
/// grant or of the last confirmed extension, plus the TTL, minus drift, minus
/// the node timeout — or when a quorum no longer holds it, or when a node it
/// needs for its quorum goes away or restarts and may come back without it
/// (see [Restarts](crate::RedlockGroup#restarts)). While an extension
/// is in flight, or after one reached no verdict, the guard assumes its worst
/// effect (a shorter TTL counts from its send time; a longer one only once a
/// quorum confirmed it). Loss is permanent, and the loss signal is closed by
/// the time `is_lost()` returns true.
#[must_use = "if unused the lock is released immediately"]
pub struct RedlockGuard {
    inner: Arc<RedlockLease>,
    /// What the releases so far confirmed.
    release: Release,
}

impl RedlockGuard {
    pub(super) fn new(
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
        group.restarts.register(&inner);
        (inner.cell).observe_with(group.options.observer.as_ref(), Primitive::Redlock);
        group.users.join();
        RedlockGuard {
            inner,
            release: Release::new(group.len()),
        }
    }

    /// The key (without the nodes' prefixes).
    pub fn key(&self) -> &str {
        self.inner.cell.key()
    }

    /// How long the lock can still be assumed held: the TTL of the grant (or
    /// last confirmed extension) minus the time since it was *sent* and minus
    /// clock drift, on the local monotonic clock. Zero once lost or released.
    /// Does not touch the network.
    pub fn remaining_estimate(&self) -> Duration {
        self.inner.cell.remaining(self.inner.group.now())
    }

    /// Whether the lock is lost (see [Loss](RedlockGuard#loss)) or released.
    /// Does not block.
    pub fn is_lost(&self) -> bool {
        self.inner.cell.is_lost(self.inner.group.now())
    }

    /// A channel that disconnects when the lock is lost or released, for
    /// `crossbeam_channel::select!`. It never delivers a message.
    ///
    /// The first call has the group's renewal thread watch the lock, so that
    /// the channel closes at the loss deadline; that thread never waits on a
    /// node. If it cannot be started, the guard is flagged lost at once.
    pub fn lost_signal(&self) -> &Receiver<()> {
        let rx = self.inner.cell.signal(self.inner.group.now());
        if let Err(e) = self.inner.group.renewal.watch(&self.inner) {
            self.inner.cell.mark_lost(
                self.inner.group.now(),
                Loss::Other(format!("its loss deadline cannot be watched: {e}")),
            );
        }
        rx
    }

    /// Every node's answer to the last operation on this lock (the acquire,
    /// an extension, or a release).
    pub fn last_evidence(&self) -> Vec<NodeReport> {
        self.inner.group.named(&self.inner.evidence.lock())
    }

    /// Sets the lock's expiry to `ttl` from now on every node that still holds
    /// it. Never re-creates a missing key.
    ///
    /// Waits (at most a node timeout) for an extension of this lock already in
    /// flight, such as a keep-alive renewal: extensions of one lock never
    /// overlap. Then blocks until a quorum confirmed, too few nodes are left,
    /// or the node timeout (or the current validity, if sooner) runs out. Only
    /// nodes that granted the lock and have not restarted since (same
    /// `run_id`) count. Returns `true` with a new validity counted from the
    /// send, or `false` (and flags the lock lost) when no quorum holds it any
    /// more or no quorum confirmed within the current validity: stop the work.
    ///
    /// From the moment it is sent, a *shorter* `ttl` bounds the guard; a
    /// longer one counts only once a quorum confirmed it.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a TTL the group refuses;
    /// [`Error::Timeout`] when an earlier extension is still unresolved after
    /// a node timeout; [`Error::QuorumNotReached`] when no verdict was reached
    /// because nodes failed or did not answer, while validity remains (the
    /// lock is not flagged lost, but it is bounded by the worst case of this
    /// extension; retrying may work).
    pub fn extend(&self, ttl: Duration) -> Result<bool> {
        self.extend_hearing(ttl, Tally::decided)
    }

    /// [`extend`](Self::extend), but the answers of every node are awaited,
    /// not only a quorum's: until each node answered or the node timeout (or
    /// the current validity, if sooner) ran out. Afterwards
    /// [`last_evidence`](Self::last_evidence) says, for every node that
    /// answered in time, whether it holds this lock (`Granted`, or
    /// `Uncounted` for a node whose grant does not count), holds another
    /// owner's value (`HeldByAnother`) or nothing (`Missing`); a node that did
    /// not answer in time is `TimedOut`.
    ///
    /// For a caller that must know what each node holds, such as one that
    /// also uses the nodes one by one: [`extend`](Self::extend) returns at a
    /// quorum and leaves the slower nodes `Abandoned`. Blocks up to a node
    /// timeout when a node is slow or down. Returns and fails as
    /// [`extend`](Self::extend) does.
    ///
    /// # Errors
    /// As [`extend`](Self::extend).
    pub fn extend_on_every_node(&self, ttl: Duration) -> Result<bool> {
        self.extend_hearing(ttl, |_| false)
    }

    /// An extension that stops listening for answers once `decided` says so
    /// (or at the deadline).
    fn extend_hearing(&self, ttl: Duration, decided: impl Fn(&Tally) -> bool) -> Result<bool> {
        let group = &self.inner.group;
        let ttl_ms = group.check_ttl(ttl)?;
        let ttl = Duration::from_millis(ttl_ms);
        let cell = &self.inner.cell;
        let nt = group.timing.node_timeout;
        let waited = group.now() + nt;
        let ticket = loop {
            match cell.begin_extend(self.inner.group.now(), ttl) {
                Ok(ticket) => break ticket,
                Err(Refusal::Lost) => return Ok(false),
                Err(Refusal::Busy) => {
                    if !cell.wait_unclaimed(waited) {
                        return Err(Error::Timeout {
                            op: "extend (waiting for an extension in flight)",
                            after: nt,
                        });
                    }
                }
            }
        };
        group.renewal.touch(&self.inner);
        let now = self.inner.group.now();
        let deadline = (now + nt).min(cell.valid_until());
        let targets = group.all();
        let done = Completion::new(targets.len());
        let (replies, tally) = group.fan_out(
            Op::Extend { ttl_ms },
            self.inner.nodes(),
            &targets,
            deadline,
            Some(&done),
            decided,
        );
        let heard = group.answers(replies, &targets, deadline, &NodeOutcome::Abandoned);
        let nodes = group.named(&heard);
        *self.inner.evidence.lock() = heard;
        let mut extension = Extension::counted(ticket, tally);
        let verdict =
            extension.settle(&self.inner.cell, self.inner.group.now(), || refusal(&nodes));
        if verdict == ExtendVerdict::Unknown {
            // Released once every node's share is finished: from then on, each
            // node runs a later extension after this one or not at all.
            let lease = self.inner.clone();
            done.then(move || {
                extension.finish(&lease.cell, lease.group.now());
                lease.group.renewal.touch(&lease);
            });
        }
        done.finish();
        group.renewal.touch(&self.inner);
        match verdict {
            ExtendVerdict::Confirmed => Ok(!cell.is_lost(self.inner.group.now())),
            ExtendVerdict::Refused => Ok(false),
            ExtendVerdict::Unknown if cell.is_lost(self.inner.group.now()) => Ok(false),
            ExtendVerdict::Unknown => Err(Error::QuorumNotReached {
                op: "extend",
                confirmed: tally.yes,
                needed: tally.quorum,
                nodes,
            }),
        }
    }

    /// Extends the lock in the background until the returned
    /// [`RedlockKeepAlive`] is dropped: the group's renewal thread extends it
    /// by its TTL at half the TTL, retries a failed extension while time
    /// remains, and flags the lock lost — at its loss deadline — when no
    /// extension reached a quorum by then, or at once when a quorum no longer
    /// holds it.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when the TTL is too short to renew at half
    /// of it with two node timeouts to spare; [`Error::Thread`] when the
    /// renewal thread cannot be started.
    pub fn keep_alive(&self) -> Result<RedlockKeepAlive<'_>> {
        let cell = &self.inner.cell;
        let group = &self.inner.group;
        let min = group.timing.min_keepalive_ttl();
        if cell.ttl() < min {
            return Err(Error::InvalidArgument(format!(
                "ttl {:?} is too short for keep-alive with a node timeout of {:?}: use at \
                 least {min:?}",
                cell.ttl(),
                group.timing.node_timeout
            )));
        }
        cell.add_keepalive();
        if let Err(e) = group.renewal.watch(&self.inner) {
            cell.remove_keepalive();
            return Err(e);
        }
        group.renewal.touch(&self.inner);
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
    /// return it again without I/O. A node that had not answered by then still
    /// gets the release in the background, after any command of this lock
    /// still queued for it (so a late grant is deleted too).
    ///
    /// A node without a connection answers
    /// [`NodeOutcome::NotConnected`](crate::NodeOutcome::NotConnected) at once
    /// and does not count for this call. That is the case of a node whose
    /// acquire (or extension) got no reply: its connection is being replaced,
    /// and the old one killed, so that a late grant cannot land after the
    /// release. Its worker keeps the release and sends it as soon as the node
    /// is connected again, after the kill and however late, with a node
    /// timeout of its own; a later call to `release` counts the answer it got
    /// there without sending anything again.
    ///
    /// # Errors
    /// [`Error::QuorumNotReached`] when fewer than a quorum confirmed (nodes
    /// failed, did not answer or were not connected): call `release` again to
    /// retry the nodes that have not confirmed; otherwise the lock ends at its
    /// expiry, or earlier on the nodes that get the queued release.
    pub fn release(&mut self) -> Result<bool> {
        let group = &self.inner.group;
        self.inner.cell.finish(self.inner.group.now());
        group.renewal.forget(&self.inner);
        if let Some(outcome) = self.release.outcome() {
            return Ok(outcome);
        }
        let targets = self.release.targets();
        let deadline = group.now() + group.timing.node_timeout;
        let release = &self.release;
        let (replies, _) = group.fan_out(
            Op::Release,
            self.inner.nodes(),
            &targets,
            deadline,
            None,
            |t| release.is_decided(t),
        );
        for reply in replies.iter().flatten() {
            self.release
                .handle_answer(reply.node, reply.vote, &reply.outcome);
        }
        let skipped = NodeOutcome::NotSent("confirmed by an earlier release".into());
        let heard = group.answers(replies, &targets, deadline, &skipped);
        let result = match self.release.conclude() {
            Ok(held) => {
                *self.inner.evidence.lock() = heard;
                Ok(held)
            }
            Err(confirmed) => {
                let nodes = group.named(&heard);
                *self.inner.evidence.lock() = heard;
                Err(Error::QuorumNotReached {
                    op: "release",
                    confirmed,
                    needed: group.quorum,
                    nodes,
                })
            }
        };
        if let Some(w) = self.inner.cell.watching() {
            let outcome = result.as_ref().ok().map(|held| match held {
                true => ReleaseOutcome::Released,
                false => ReleaseOutcome::Expired,
            });
            w.released(self.key(), self.inner.cell.id(), outcome);
        }
        result
    }

    /// The lease's id and (no) fencing token, for observers.
    pub(super) fn observed(&self) -> (LeaseId, Option<FencingToken>) {
        (LeaseId(self.inner.cell.id()), None)
    }
}

/// Why a refused extension's lock is lost.
fn refusal(nodes: &[NodeReport]) -> String {
    format!("no quorum holds it any more ({})", summarize(nodes))
}

impl<X> Renewable for LeaseCell<X> {
    fn ttl(&self) -> Duration {
        LeaseCell::ttl(self)
    }

    fn lost_at(&self) -> Instant {
        LeaseCell::lost_at(self)
    }

    fn begin_extend(&self, now: Instant, ttl: Duration) -> std::result::Result<Ticket, Refusal> {
        LeaseCell::begin_extend(self, now, ttl)
    }
}

impl<X> Bounds for LeaseCell<X> {
    fn extended(&self, ticket: Ticket, now: Instant) -> Confirmed {
        LeaseCell::extended(self, ticket, now)
    }

    fn refused(&self, ticket: Ticket, now: Instant, loss: Loss) {
        LeaseCell::refused(self, ticket, now, loss);
    }

    fn unanswered(&self, ticket: Ticket, now: Instant) {
        LeaseCell::unanswered(self, ticket, now);
    }

    fn fenced(&self, ticket: Ticket, now: Instant) {
        LeaseCell::fenced(self, ticket, now);
    }
}

impl Drop for RedlockGuard {
    fn drop(&mut self) {
        self.release_on_drop();
        self.inner.group.users.leave(&self.inner.group);
    }
}

impl RedlockGuard {
    fn release_on_drop(&mut self) {
        if self.release.outcome().is_some() {
            return;
        }
        match self.release() {
            Ok(held) => log::debug!(
                "dropped redlock {:?} (still held until then: {held})",
                self.key()
            ),
            Err(e) => log::warn!(
                "dropping redlock {:?}: {e}; it ends at its expiry at the latest",
                self.key()
            ),
        }
    }
}

impl fmt::Debug for RedlockGuard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedlockGuard")
            .field("key", &self.key())
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
    inner: Arc<RedlockLease>,
    _guard: PhantomData<&'a ()>,
}

impl RedlockKeepAlive<'_> {
    /// Whether the lock is lost (same as the guard's `is_lost()`). Does not block.
    pub fn is_lost(&self) -> bool {
        self.inner.cell.is_lost(self.inner.group.now())
    }
}

impl Drop for RedlockKeepAlive<'_> {
    fn drop(&mut self) {
        self.inner.cell.remove_keepalive();
        self.inner.group.renewal.touch(&self.inner);
    }
}

impl fmt::Debug for RedlockKeepAlive<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedlockKeepAlive")
            .field("key", &self.inner.cell.key())
            .field("lost", &self.is_lost())
            .finish()
    }
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

impl Watchable for RedlockLease {
    fn mark_watched(&self) -> bool {
        self.cell.watch()
    }
    fn is_watched(&self) -> bool {
        self.cell.is_watched()
    }
    fn watch_id(&self) -> u64 {
        self.cell.id()
    }
}

/// One renewal in flight: its answers so far.
struct InFlight {
    lease: Arc<RedlockLease>,
    renewal: Renewal,
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
        batch: Vec<Arc<RedlockLease>>,
        now: Instant,
    ) -> Vec<(u64, Option<Instant>)> {
        let mut done = Vec::new();
        let Some(group) = self.group.upgrade() else {
            return done;
        };
        for lease in batch {
            let id = lease.cell.id();
            let ttl = lease.cell.ttl();
            let Ok(ttl_ms) = group.check_ttl(ttl) else {
                done.push((id, None));
                continue;
            };
            let nt = group.timing.node_timeout;
            let Some((renewal, deadline)) = Renewal::begin(&lease.cell, now, nt, group.len())
            else {
                done.push((id, None));
                continue;
            };
            let targets = group.all();
            let route = super::fanout::Route {
                reply: Some(&self.tx),
                tag: id,
                done: None,
            };
            group.send(
                Op::Extend { ttl_ms },
                lease.nodes(),
                &targets,
                deadline,
                &route,
            );
            self.in_flight.insert(
                id,
                InFlight {
                    lease,
                    renewal,
                    replies: vec![None; group.len()],
                    deadline,
                },
            );
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
            let group = &f.lease.group;
            let targets = group.all();
            let heard = group.answers(
                f.replies.clone(),
                &targets,
                f.deadline,
                &NodeOutcome::Abandoned,
            );
            let nodes = group.named(&heard);
            *f.lease.evidence.lock() = heard;
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
