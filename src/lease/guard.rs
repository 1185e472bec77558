//! The one guard family: [`LeaseGuard<B>`] over a sealed [`Backend`], after
//! `lock_api`'s `Mutex<R, T>` over `RawMutex`. The verbs every lease has — its
//! key, loss, loss signal, estimate, keep-alive, `Drop` and `Debug`, and the
//! one [`KeepAlive`] — are written here once over what a backend holds, and so
//! is `reset_expiry`'s claim on the lease (`extend_with`); what goes to the
//! servers (one extension's send and settling, `release`) is the backend's. The
//! single-deployment backend, one for every [`Kind`], is here too; Redlock's
//! is in `redlock/guard.rs`.

use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::Receiver;

use crate::conn::{Conn, Connect};
use crate::core::executor::ExtendReply;
use crate::core::extend::{ResetDone, ResetExpiry, ResetStep};
use crate::core::lease::{Loss, Ticket, Verdict};
use crate::core::timing::Timing;
use crate::error::{Error, Result};
use crate::guard::{Fencing, Guard, ReleaseOutcome, Verifiable, sealed as sealed_guard};
use crate::lease::deployment::{Deployment, bad_key_in};
use crate::lease::kind::{FencedKind, Kind};
use crate::observe::LeaseId;
use crate::replication::Replication;
use crate::runtime::lease::LeaseView;
use crate::runtime::renewal::Cell;
use crate::runtime::topology::Uncertain;
use crate::token::FencingToken;

/// What holds a lease: one deployment ([`Plain`](crate::Plain),
/// [`Fenced`](crate::Fenced), [`Read`](crate::Read), [`Write`](crate::Write),
/// [`Slot`](crate::Slot): every [`Kind`]) or a quorum of independent ones
/// ([`Redlock`](crate::Redlock)). Implemented by this crate's marker types
/// only; it names the backend of a [`LeaseGuard<B>`].
pub trait Backend: sealed::Sealed + Sized + Send + Sync + 'static {
    /// What a guard of this backend holds.
    #[doc(hidden)]
    type Held: held::Held;
    /// What a [`Lease`](crate::Lease) handle of this backend holds.
    #[doc(hidden)]
    type Handle: held::Handle<Self>;
    /// The guard's name, for `Debug`.
    #[doc(hidden)]
    const GUARD: &'static str;
}

pub(crate) mod sealed {
    /// Only this crate's backends implement [`Backend`](super::Backend).
    #[allow(
        unreachable_pub,
        reason = "a sealed supertrait: public, but nameable only here"
    )]
    pub trait Sealed {}
}

impl<K: Kind> sealed::Sealed for K {}

/// What a backend provides for the verbs [`LeaseGuard`] and
/// [`Lease`](crate::Lease) write once.
pub(crate) mod held {
    use std::fmt;
    use std::time::{Duration, Instant};

    use super::{Backend, LeaseGuard};
    use crate::core::extend::{ResetDone, ResetExpiry, ResetStep};
    use crate::core::lease::Ticket;
    use crate::core::timing::Timing;
    use crate::error::{Error, Result};
    use crate::guard::ReleaseOutcome;
    use crate::lease::kind::Wait;
    use crate::runtime::lease::LeaseView;
    use crate::token::HolderTag;

    /// One backend's acquire handle: what the five acquire verbs of
    /// [`Lease`](crate::Lease) run.
    #[allow(
        unreachable_pub,
        private_interfaces,
        reason = "named by the public `Backend`, but nameable only in this crate"
    )]
    pub trait Handle<B: Backend>: Clone + Send + Sync + 'static {
        /// One attempt (`Wait::Once`) or a wait, observed.
        fn run(&self, ttl: Duration, wait: Wait<'_>) -> Result<Option<LeaseGuard<B>>>;
        /// The instant now, by the injected clock.
        fn now(&self) -> Instant;
        /// The holder its leases record.
        fn holder(&self) -> Option<&HolderTag>;
        /// The holder its leases record, to set.
        fn holder_mut(&mut self) -> &mut Option<HolderTag>;
        /// Its type's name and fields, for `Debug`.
        fn debug(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result;
    }

    /// One `reset_expiry` call of a backend, after its TTL was checked: what
    /// [`LeaseGuard::extend_with`] sends under each claim it gets.
    #[allow(
        unreachable_pub,
        private_interfaces,
        reason = "named by the public `Backend`, but nameable only in this crate"
    )]
    pub trait Extender {
        /// The TTL it sets, as sent.
        fn ttl(&self) -> Duration;
        /// Sends the extension claimed under `ticket` and settles what came
        /// back: the next step, or the error that ends the call (with the
        /// extension's worst case kept in the lease's bound; the caller
        /// tells the renewal thread).
        fn send(&mut self, reset: &mut ResetExpiry, ticket: Ticket) -> Result<ResetStep>;
        /// The error for an end only this backend reaches.
        fn failed(&self, done: ResetDone) -> Error;
    }

    /// One backend's held lease: its lease cell and clock, its renewal
    /// thread, and the verbs that go to its servers.
    #[allow(
        unreachable_pub,
        private_interfaces,
        reason = "named by the public `Backend`, but nameable only in this crate"
    )]
    pub trait Held: Send + Sync + 'static {
        /// The lease's bounds, loss signal and claim on extensions.
        fn cell(&self) -> &dyn LeaseView;
        /// The instant now, by the injected clock.
        fn now(&self) -> Instant;
        /// The drift factor and node timeout.
        fn timing(&self) -> Timing;
        /// Has the renewal thread watch the lease's loss deadline.
        fn watch(&self) -> Result<()>;
        /// Tells the renewal thread the lease's deadlines moved.
        fn touch(&self);
        /// Whether keep-alive can run: its rights, where they are checked.
        fn check_keep_alive(&self) -> Result<()>;
        /// What one `reset_expiry` call sends.
        type Extend<'a>: Extender
        where
            Self: 'a;
        /// One `reset_expiry` call to `ttl`, once the TTL is checked (an
        /// error, nothing sent, when it is not valid).
        fn extender(&self, ttl: Duration) -> Result<Self::Extend<'_>>;
        /// The backend's `release`; the lease cell is finished first.
        fn release(&mut self) -> Result<ReleaseOutcome>;
        /// The guard was dropped (after its release, if one was due).
        fn dropped(&mut self) {}
        /// The grant's fields, for `Debug`.
        fn debug_grant(&self, _d: &mut fmt::DebugStruct<'_, '_>) {}
    }
}

use held::{Extender, Held};

/// A held lease of backend `B`: [`LockGuard`](crate::LockGuard),
/// [`FencedGuard`](crate::FencedGuard), [`ReadGuard`](crate::ReadGuard),
/// [`WriteGuard`](crate::WriteGuard), [`Permit`](crate::Permit) and
/// [`RedlockGuard`](crate::RedlockGuard) are this type, with the same verbs;
/// the backend only adds its own, such as
/// [`fencing_token`](LeaseGuard::fencing_token) or Redlock's
/// [`last_evidence`](LeaseGuard::last_evidence).
///
/// Dropping it releases the lease (once, best effort, bounded by the node
/// timeout, never panics); [`release`](LeaseGuard::release) does the same and
/// reports what happened.
///
/// # Loss
///
/// The guard is *lost* from the moment its loss deadline passes — the send time
/// of the grant or of the last *confirmed* extension, plus the TTL, minus clock
/// drift (`ttl × drift_factor + 2 ms`), minus the node timeout — or a command
/// finds the lease expired or held by someone else (for Redlock: no quorum
/// holds it any more, or a node its quorum needs went away or restarted and
/// may come back without it; see [Restarts](crate::RedlockGroup#restarts)).
/// While an extension is in flight, or after one got no reply, the guard
/// assumes its worst effect: a shorter TTL counts from its send time, a longer
/// one counts for nothing until confirmed (by a quorum, for Redlock). Loss is
/// permanent: once [`is_lost`](LeaseGuard::is_lost) returned true it never
/// returns false again, and the [`lost_signal`](LeaseGuard::lost_signal) is
/// closed by then.
#[must_use = "if unused the lease is released immediately"]
pub struct LeaseGuard<B: Backend> {
    held: B::Held,
}

impl<B: Backend> LeaseGuard<B> {
    pub(crate) fn from_held(held: B::Held) -> Self {
        LeaseGuard { held }
    }

    pub(crate) fn held(&self) -> &B::Held {
        &self.held
    }

    /// The key the lease is held on: for a single deployment the physical
    /// key, for Redlock the key without the nodes' prefixes.
    pub fn key(&self) -> &str {
        self.held.cell().key()
    }

    /// Whether the lease is lost (see [Loss](LeaseGuard#loss)) or released.
    /// Reads the lost flag and the monotonic clock; does not block or touch
    /// the network.
    pub fn is_lost(&self) -> bool {
        self.held.cell().is_lost(self.held.now())
    }

    /// A channel that disconnects when the lease is lost or released, for
    /// `crossbeam_channel::select!`; it never delivers a message.
    ///
    /// The first call has the renewal thread (the coordinator's, or the
    /// Redlock group's) watch the lease, so that the channel closes at the
    /// loss deadline even if nobody calls [`is_lost`](LeaseGuard::is_lost);
    /// that thread never waits on the network. If the thread cannot be
    /// started, the guard is flagged lost at once.
    pub fn lost_signal(&self) -> &Receiver<()> {
        let cell = self.held.cell();
        let rx = cell.signal(self.held.now());
        if let Err(e) = self.held.watch() {
            cell.mark_lost(
                self.held.now(),
                Loss::Other(format!("its loss deadline cannot be watched: {e}")),
            );
        }
        rx
    }

    /// How long the lease can still be assumed held: on the local monotonic
    /// clock, until the bound described under [Loss](LeaseGuard#loss) (without
    /// the node-timeout margin). Zero once lost or released. Does not touch
    /// the network.
    pub fn remaining_estimate(&self) -> Duration {
        self.held.cell().remaining(self.held.now())
    }

    /// Sets the lease's expiry to `ttl` from now, if it is still held. Never
    /// re-creates a missing key. For a Redlock lock, see
    /// [Redlock](#redlock-extensions) below.
    ///
    /// A lease held as one string key (a lock's, a fenced lock's, a leader's,
    /// a writer's) is extended without a script on a server that has `SET …
    /// IFEQ … GET` (Valkey 8.1 and later, recognized when the connection is
    /// made), and by the extension script elsewhere; both answer alike, and
    /// keep-alive renewals take the same path.
    ///
    /// Blocks for one round trip, after waiting (at most a node timeout) for an
    /// extension of this lease already in flight, such as a keep-alive renewal:
    /// extensions of one lease never overlap. When the deployment switched to
    /// another server while it ran (a failover, a slot that moved), the old
    /// server's confirmation does not count and the extension is sent once
    /// more, to the server the key lives on now: two round trips. Returns
    /// `true` when confirmed by the server the key lives on, `false` (and
    /// flags the guard lost) when the lease expired or was taken over, or the
    /// confirmation came after the loss deadline: stop the work.
    ///
    /// From the moment it is sent, a *shorter* `ttl` bounds the guard; a longer
    /// one counts only once confirmed. Under
    /// [`Replication::Require`](crate::Replication::Require), `WAIT` follows
    /// the extension in the same round trip (the call may take up to the
    /// replication timeout longer), and it counts only once the required
    /// replicas acknowledged it.
    ///
    /// # Errors
    /// [`Error::ExtensionNotReplicated`] under `Require` when too few replicas
    /// acknowledged the extension: it does not count (the bound stays where
    /// it was, or moves to the new expiry if that is shorter);
    /// [`Error::InvalidArgument`] for a bad TTL (nothing sent);
    /// [`Error::Timeout`] when an earlier extension's outcome is still unknown
    /// after a node timeout (nothing sent); [`Error::Topology`] when the
    /// server of the key changed again while the second send ran (the bound
    /// stays where it was; the lease may still be held); transport errors,
    /// after which the outcome is unknown: the guard keeps assuming the worst
    /// of it, and the connection it went out on is killed in the background
    /// before the lease can be extended again.
    ///
    /// # Redlock extensions
    /// A Redlock lock is extended on every node that still holds it, after
    /// waiting (at most a node timeout) for an extension in flight; the call
    /// blocks until a quorum confirmed, too few nodes are left, or the node
    /// timeout (or the current validity, if sooner) runs out. Only nodes that
    /// granted the lock and have not restarted since (same `run_id`) count.
    /// `true` with a new validity counted from the send; `false` (and the lock
    /// flagged lost) when no quorum holds it any more or none confirmed
    /// within the current validity. [`Error::QuorumNotReached`] when no
    /// verdict was reached because nodes failed or did not answer, while
    /// validity remains: the lock is not flagged lost but is bounded by this
    /// extension's worst case, and retrying may work.
    pub fn reset_expiry(&self, ttl: Duration) -> Result<bool> {
        self.extend_with(self.held.extender(ttl)?)
    }

    /// Claims the lease for one extension — waiting at most a node timeout
    /// for one in flight, such as a keep-alive renewal — and has `ext` send
    /// it under each claim it gets (once more when a server switch gave the
    /// first up).
    pub(crate) fn extend_with(&self, mut ext: impl Extender) -> Result<bool> {
        let held = &self.held;
        let cell = held.cell();
        let nt = held.timing().node_timeout;
        let mut reset = ResetExpiry::new(held.now(), ext.ttl(), nt);
        let mut step = reset.claim(cell, held.now());
        loop {
            step = match step {
                ResetStep::Send(ticket) => {
                    // A shorter TTL bounds the lease from now, and a send
                    // without a verdict keeps its worst case: the renewal
                    // thread must know either way.
                    held.touch();
                    match ext.send(&mut reset, ticket) {
                        Ok(step) => step,
                        Err(e) => {
                            held.touch();
                            return Err(e);
                        }
                    }
                }
                ResetStep::Wait(until) => {
                    cell.wait_unclaimed(until);
                    reset.claim(cell, held.now())
                }
                ResetStep::Done(done) => {
                    held.touch();
                    return match done {
                        ResetDone::Held => Ok(true),
                        ResetDone::Lost => Ok(false),
                        ResetDone::NotRun(held) => Ok(held),
                        ResetDone::StillClaimed => Err(Error::Timeout {
                            op: "reset expiry (waiting for an extension in flight)",
                            after: nt,
                        }),
                        other => Err(ext.failed(other)),
                    };
                }
            };
        }
    }

    /// Renews the lease in the background until the returned [`KeepAlive`] is
    /// dropped; see there for when loss is flagged. Does not block beyond one
    /// check of the ACL rights keep-alive needs (one round trip).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when the TTL is too short to renew at half of
    /// it with two node timeouts to spare; [`Error::Permission`] when the ACL
    /// user may not run the renewal script on the lease's keys (`EVALSHA`,
    /// `EVAL`), `CLIENT ID` or `CLIENT KILL`; transport errors from that check;
    /// [`Error::Thread`] when the renewal thread cannot be started.
    pub fn keep_alive(&self) -> Result<KeepAlive<'_>> {
        let cell = self.held.cell();
        let ttl = cell.ttl();
        let timing = self.held.timing();
        let min = timing.min_keepalive_ttl();
        if ttl < min {
            return Err(Error::InvalidArgument(format!(
                "ttl {ttl:?} is too short for keep-alive with a node timeout of {:?}: use at \
                 least {min:?}",
                timing.node_timeout
            )));
        }
        self.held.check_keep_alive()?;
        cell.add_keepalive();
        if let Err(e) = self.held.watch() {
            cell.remove_keepalive();
            return Err(e);
        }
        self.held.touch();
        Ok(KeepAlive { lease: &self.held })
    }

    /// Releases the lease if this guard still holds it. One round trip; takes
    /// at most the node timeout in all (getting a connection included). From
    /// the call on, the guard counts as lost.
    ///
    /// Returns what it found: [`ReleaseOutcome::Released`], `Expired`,
    /// `TakenOver` (the other holder keeps it), or `Uncertain` when the release
    /// was sent but no reply came (the lease then ends at its expiry at the
    /// latest). When the acquire that granted this lease had attempts that got
    /// no reply, one of them could still arrive and set the lease again now
    /// that it is free: their connections are killed in the background and
    /// what they may have set is deleted by owner.
    ///
    /// A Redlock lock is released on every node at once (deleted only where it
    /// still holds this guard's owner token), and the call blocks until a
    /// quorum decided it or the node timeout ran out: `Released` when a quorum
    /// deleted it, `TakenOver` when a quorum holds another owner's value,
    /// `Expired` when a quorum answered but it had lapsed on some of them, and
    /// `Uncertain` when no quorum confirmed (nodes failed, did not answer or
    /// were not connected). A node that had not answered keeps the release
    /// and sends it as soon as it is connected again, after any command of
    /// this lock still queued for it (so a late grant is deleted too), with a
    /// node timeout of its own.
    ///
    /// # Errors
    /// When nothing could be sent ([`Error::PoolTimeout`], [`Error::Connect`]
    /// and other retryable errors): the release is then sent again in the
    /// background until the server answers or the lease would have expired by
    /// itself. Server errors such as a missing ACL right.
    pub fn release(mut self) -> Result<ReleaseOutcome> {
        self.held.release()
    }
}

impl<B: Backend> sealed_guard::Sealed for LeaseGuard<B> {}

/// Each verb is the inherent method of the same name.
impl<B: Backend> Guard for LeaseGuard<B> {
    type KeepAlive<'a> = KeepAlive<'a>;

    fn key(&self) -> &str {
        LeaseGuard::key(self)
    }
    fn is_lost(&self) -> bool {
        LeaseGuard::is_lost(self)
    }
    fn lost_signal(&self) -> &Receiver<()> {
        LeaseGuard::lost_signal(self)
    }
    fn remaining_estimate(&self) -> Duration {
        LeaseGuard::remaining_estimate(self)
    }
    fn reset_expiry(&self, ttl: Duration) -> Result<bool> {
        LeaseGuard::reset_expiry(self, ttl)
    }
    fn keep_alive(&self) -> Result<KeepAlive<'_>> {
        LeaseGuard::keep_alive(self)
    }
    fn release(self) -> Result<ReleaseOutcome> {
        LeaseGuard::release(self)
    }
}

impl<B: Backend> Drop for LeaseGuard<B> {
    fn drop(&mut self) {
        if !self.held.cell().is_finished() {
            let key = self.held.cell().key().to_owned();
            match self.held.release() {
                Ok(outcome) => log::debug!("dropped lease {key:?}: {outcome:?}"),
                Err(e) => log::warn!(
                    "dropping lease {key:?}: release failed: {e}; it ends at its expiry at the \
                     latest"
                ),
            }
        }
        self.held.dropped();
    }
}

impl<B: Backend> fmt::Debug for LeaseGuard<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut d = f.debug_struct(B::GUARD);
        d.field("key", &self.key());
        self.held.debug_grant(&mut d);
        d.field("lost", &self.is_lost())
            .field("remaining_estimate", &self.remaining_estimate())
            .finish()
    }
}

/// Renews a lease in the background for as long as it lives.
///
/// Returned by `keep_alive()` on a guard, which it borrows: it always ends
/// before the guard does. While it lives, the renewal thread (the
/// coordinator's, or the Redlock group's) extends the lease by its TTL at half
/// the TTL (one pipelined round trip for all leases of a server due together;
/// to every node at once for Redlock), retries a failed renewal while time
/// remains, and the guard is flagged lost — `is_lost()` true and the loss
/// signal closed — at the loss deadline when no renewal was confirmed by then,
/// or at once when the key was found deleted or owned by someone else (for
/// Redlock: when a quorum no longer holds it). A renewal that got no reply is
/// assumed applied or not, whichever is worse, and its connection is killed
/// before the lease is extended again.
///
/// Dropping it stops renewal; the lease then runs out at its current expiry
/// unless renewed again. It does not block.
#[must_use = "renewal stops as soon as the KeepAlive is dropped"]
pub struct KeepAlive<'a> {
    lease: &'a dyn Kept,
}

/// What a [`KeepAlive`] reads and stops, whatever the backend.
trait Kept: Sync {
    fn key(&self) -> &str;
    fn is_lost(&self) -> bool;
    fn stop(&self);
}

impl<H: Held> Kept for H {
    fn key(&self) -> &str {
        self.cell().key()
    }
    fn is_lost(&self) -> bool {
        self.cell().is_lost(self.now())
    }
    fn stop(&self) {
        self.cell().remove_keepalive();
        self.touch();
    }
}

impl KeepAlive<'_> {
    /// Whether the lease is lost (same as the guard's `is_lost()`). Does not block.
    pub fn is_lost(&self) -> bool {
        self.lease.is_lost()
    }
}

impl Drop for KeepAlive<'_> {
    fn drop(&mut self) {
        self.lease.stop();
    }
}

impl fmt::Debug for KeepAlive<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KeepAlive")
            .field("key", &self.lease.key())
            .field("lost", &self.is_lost())
            .finish()
    }
}

/// A lease held on one deployment: the guard of every [`Kind`].
#[allow(
    unreachable_pub,
    reason = "named by the public `Backend`, but nameable only in this crate"
)]
pub struct Single<K: Kind> {
    dep: Arc<Deployment>,
    cell: Arc<Cell>,
    grant: K::Grant,
    acknowledged: Option<u32>,
    /// Earlier attempts of the acquire that got no reply, which may still
    /// arrive (their connections are being killed), and the delete by owner
    /// that undoes what one may set: the release sends it after their kill.
    late: Option<(Vec<Uncertain>, redis::Cmd)>,
}

impl<K: Kind> LeaseGuard<K> {
    pub(crate) fn new(
        dep: Arc<Deployment>,
        cell: Arc<Cell>,
        grant: K::Grant,
        acknowledged: Option<u32>,
    ) -> Self {
        LeaseGuard::from_held(Single {
            dep,
            cell,
            grant,
            acknowledged,
            late: None,
        })
    }

    /// Earlier attempts of the acquire got no reply on `sent`: a late one
    /// could set the lease again after the release, so the release has their
    /// connections killed and then runs `delete` (by owner).
    pub(crate) fn after_late_attempts(&mut self, sent: Vec<Uncertain>, delete: redis::Cmd) {
        self.held.late = Some((sent, delete));
    }

    pub(crate) fn cell(&self) -> &Arc<Cell> {
        &self.held.cell
    }

    pub(crate) fn grant(&self) -> &K::Grant {
        &self.held.grant
    }

    /// The lease's id, for observers.
    pub(crate) fn lease_id(&self) -> LeaseId {
        LeaseId(self.held.cell.id())
    }

    /// How many replicas acknowledged the grant within the replication
    /// guard's timeout (`WAIT`'s answer, pipelined after the grant), or `None`
    /// when the coordinator's [`Replication`](crate::Replication) is `Off`.
    /// Does not block. Says nothing of later extensions.
    pub fn replicas_acknowledged(&self) -> Option<u32> {
        self.held.acknowledged
    }

    /// Asks Redis whether the lease still holds this guard's owner token. One
    /// round trip, at most the node timeout (plus the connect timeout if a
    /// connection must be opened). Returns `Some(server-side TTL)` when held
    /// (`Duration::MAX` for a key without expiry), `None` (and flags the guard
    /// lost) when not. Only says what was true at one instant, with one
    /// lasting effect: when the server has less time left than the guard
    /// counted on (a failover to a replica that missed an extension), the
    /// guard's bound, [`remaining_estimate`](LeaseGuard::remaining_estimate)
    /// and loss deadline shrink to what the server has left, until a later
    /// extension is confirmed.
    ///
    /// # Errors
    /// Transport and server errors; the guard is unchanged.
    pub fn verify_still_held(&self) -> Result<Option<Duration>> {
        let ops = self.held.cell.extra();
        let (keys, args) = ops.verify_args();
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        self.run_check(ops.verify_script(), &keys, &args, "verify")
    }

    /// The value this guard's lease key holds while it is ours.
    pub(crate) fn lease_value(&self) -> &str {
        &self.held.cell.extra().member
    }

    /// Runs `script`, which answers as `lease_verify` does (`{1, pttl}` held,
    /// `{0}` gone, `{-1}` taken over), once within the node timeout (once
    /// more on a fresh connection when a pooled one was dead: the script must
    /// be idempotent), and applies the answer as a verification of the lease.
    pub(crate) fn run_check(
        &self,
        script: &crate::scripts::Script,
        keys: &[&str],
        args: &[&str],
        op: &'static str,
    ) -> Result<Option<Duration>> {
        let deadline = self.held.dep.now() + self.held.dep.node_timeout();
        let mut sent = self.held.dep.now();
        // A pooled connection the server closed (a restart): once more on a
        // fresh one, which is safe for an idempotent script.
        let dep = &self.held.dep;
        let reply = dep
            .on_key_fresh_retry(
                self.key(),
                deadline,
                Connect::Own,
                |conn, deadline| {
                    sent = self.held.dep.now();
                    conn.script::<Vec<i64>>(script, keys, args, op, deadline)
                },
                |_, _| {},
            )
            .map_err(|e| bad_key_in(e, keys))?;
        let now = self.held.dep.now();
        match Verdict::of(&reply) {
            Some(verdict) => {
                let left = match verdict {
                    Verdict::Held(left) => Some(left.unwrap_or(Duration::MAX)),
                    Verdict::Lost(_) => None,
                };
                self.held.cell.verified(verdict, sent, now);
                // A bound that shrank moves the loss deadline the renewal
                // thread watches.
                self.held.dep.runtime().touch(&self.held.cell);
                Ok(left)
            }
            None => Err(Error::UnexpectedReply {
                op,
                reply: format!("{reply:?}"),
            }),
        }
    }
}

/// One `reset_expiry` call of a single-deployment lease: the script (or,
/// where the server has it, `SET ... IFEQ`) on the key's server, followed by
/// `WAIT` under the replication guard's `Require`.
#[allow(
    unreachable_pub,
    reason = "named by the sealed `Held`, but nameable only in this crate"
)]
pub struct SingleExtend<'a, K: Kind> {
    single: &'a Single<K>,
    ttl_ms: u64,
    keys: Vec<&'a str>,
    args: Vec<String>,
    ifeq_cmd: Option<redis::Cmd>,
    acks: Option<(u32, Duration)>,
    /// The last reply, for an unreadable one's report.
    code: i64,
    /// What the last `WAIT` answered.
    acked: Option<u32>,
}

#[allow(
    private_interfaces,
    reason = "a sealed trait's methods, named only in this crate"
)]
impl<K: Kind> held::Extender for SingleExtend<'_, K> {
    fn ttl(&self) -> Duration {
        Duration::from_millis(self.ttl_ms)
    }

    fn send(&mut self, reset: &mut ResetExpiry, ticket: Ticket) -> Result<ResetStep> {
        let Single { dep, cell, .. } = self.single;
        let ops = cell.extra();
        let acks = self.acks;
        let deadline = dep.now() + dep.node_timeout() + acks.map_or(Duration::ZERO, |(_, t)| t);
        let keys = &self.keys;
        let args: Vec<&str> = self.args.iter().map(String::as_str).collect();
        let ifeq_cmd = self.ifeq_cmd.as_ref();
        let mut acked = None;
        // The transport runs a call that a server retired meanwhile answered
        // once more on the current one; an extension must not go again under
        // this claim (a switch gives it up, and a renewal may hold the next),
        // so the second run sends nothing.
        let mut answered = false;
        let (reply, lost): (Result<Option<i64>>, _) =
            dep.on_key(cell.key(), deadline, Connect::Own, |conn, deadline| {
                // Not under a claim a switch gave up meanwhile (a
                // redirection's second run included).
                if answered || !cell.dispatched(ticket, conn.server_id()) {
                    return Ok(None);
                }
                let asking = conn.is_asking();
                let arm = |conn: &mut Conn| {
                    if asking {
                        conn.ask_next();
                    }
                    if let Some((replicas, timeout)) = acks {
                        conn.wait_after_next(replicas, timeout, false);
                    }
                };
                // Without the script where the server can (see
                // `Ops::set_ifeq_cmd`); refused for want of memory, as the
                // script.
                let by_set = ifeq_cmd.filter(|_| conn.has_set_ifeq());
                let set = by_set.map(|cmd| {
                    arm(conn);
                    conn.command(cmd, "reset expiry", deadline, |v| ops.set_ifeq_code(v))
                });
                let reply = match set {
                    Some(reply) if !reply.as_ref().is_err_and(is_oom) => reply,
                    _ => {
                        arm(conn);
                        conn.script(ops.extend_script(), keys, &args, "reset expiry", deadline)
                    }
                };
                answered = reply.is_ok();
                acked = conn.take_waited();
                reply.map(Some)
            });
        self.acked = acked;
        let now = dep.now();
        match reply {
            Ok(Some(code)) => {
                self.code = code;
                let reply = match acks {
                    Some((replicas, _)) if code == 1 && acked.unwrap_or(0) < replicas => {
                        ExtendReply::Unreplicated
                    }
                    _ => ExtendReply::of(code),
                };
                Ok(reset.replied(&**cell, ticket, reply, now))
            }
            // Answered by a server retired meanwhile (the second run sent
            // nothing, or found no server to run on): the answer counts no
            // more.
            Ok(None) => Ok(reset.replaced(&**cell, ticket, now)),
            Err(_) if answered => Ok(reset.replaced(&**cell, ticket, now)),
            Err(e) if e.is_uncertain() => {
                cell.unanswered(ticket, now);
                match lost {
                    Some(sent) => dep.fence(sent, cell, ticket),
                    // Unreachable: a command without a reply went somewhere.
                    None => cell.fenced(ticket, now),
                }
                Err(e)
            }
            Err(e) => {
                cell.not_sent(ticket, now);
                Err(bad_key_in(e, keys))
            }
        }
    }

    fn failed(&self, done: ResetDone) -> Error {
        match done {
            ResetDone::Unreplicated => Error::ExtensionNotReplicated {
                key: self.single.cell.key().to_owned(),
                acknowledged: self.acked.unwrap_or(0),
                required: self.acks.map_or(0, |(n, _)| n),
            },
            ResetDone::SwitchedTwice => Error::Topology(
                "the server of the key changed twice while the extension ran; it was not \
                 counted"
                    .into(),
            ),
            _ => Error::UnexpectedReply {
                op: "reset expiry",
                reply: self.code.to_string(),
            },
        }
    }
}

#[allow(
    private_interfaces,
    reason = "a sealed trait's methods, named only in this crate"
)]
impl<K: Kind> Held for Single<K> {
    fn cell(&self) -> &dyn LeaseView {
        &*self.cell
    }

    fn now(&self) -> Instant {
        self.dep.now()
    }

    fn timing(&self) -> Timing {
        self.dep.timing()
    }

    fn watch(&self) -> Result<()> {
        self.dep.runtime().watch(&self.cell)
    }

    fn touch(&self) {
        self.dep.runtime().touch(&self.cell);
    }

    fn check_keep_alive(&self) -> Result<()> {
        self.dep.check_keepalive_rights(self.cell.extra())
    }

    type Extend<'a> = SingleExtend<'a, K>;

    fn extender(&self, ttl: Duration) -> Result<SingleExtend<'_, K>> {
        let ttl_ms = self.dep.check_ttl(ttl)?;
        let ops = self.cell.extra();
        let (keys, args) = ops.extend_args(ttl_ms);
        Ok(SingleExtend {
            single: self,
            ttl_ms,
            keys,
            args,
            ifeq_cmd: ops.set_ifeq_cmd(ttl_ms),
            // Under the replication guard's `Require`, `WAIT` follows the
            // script in the same round trip: the extension counts only once
            // enough replicas have it.
            acks: match self.dep.replication {
                Replication::Require { replicas, timeout } => Some((replicas, timeout)),
                _ => None,
            },
            code: 0,
            acked: None,
        })
    }

    fn release(&mut self) -> Result<ReleaseOutcome> {
        let start = self.dep.now();
        self.cell.finish(start);
        self.dep.runtime().forget(&self.cell);
        let deadline = start + self.dep.node_timeout();
        let ops = self.cell.extra();
        let keys = ops.key_refs();
        let args = ops.release_arg_refs();
        // A pooled connection the server closed (a restart): once more on a
        // fresh one within the same bound (deleting by owner is idempotent).
        let reply = self.dep.on_key_fresh_retry(
            self.cell.key(),
            deadline,
            Connect::Within,
            |conn, deadline| {
                conn.script::<i64>(
                    ops.release_script(),
                    &keys,
                    args.as_slice(),
                    "release",
                    deadline,
                )
            },
            |_, _| {},
        );
        // An earlier attempt of the acquire may still arrive and set the
        // lease again, now that it is free: once its connection is killed,
        // what it set is deleted by owner.
        if let Some((sent, delete)) = self.late.take() {
            self.dep
                .clean_up(&sent, Some(delete), self.cell.key(), self.cell.ttl());
        }
        let outcome = match reply {
            Ok(code) => Ok(ReleaseOutcome::of(code)),
            Err(e) if e.is_uncertain() => {
                log::warn!(
                    "release of {:?} is uncertain ({e}); it ends at its expiry at the latest",
                    self.cell.key()
                );
                Ok(ReleaseOutcome::Uncertain)
            }
            // Not sent (no connection could be made): the lease would stay
            // until its expiry, so the release is sent in the background
            // until then, as soon as the server answers again.
            Err(e) if e.is_retryable() => {
                // Past any expiry the lease can have: its last extension was
                // sent before now.
                let until = self.dep.now() + self.cell.ttl() + self.dep.node_timeout();
                log::warn!(
                    "release of {:?} could not be sent ({e}); trying again in the background",
                    self.cell.key()
                );
                self.dep.in_background(
                    self.cell.key(),
                    ops.release_script().eval(&keys, args.as_slice()),
                    until,
                );
                Err(e)
            }
            Err(e) => Err(bad_key_in(e, &keys)),
        };
        if let Some(w) = self.cell.watching() {
            w.released(
                self.cell.key(),
                self.cell.id(),
                outcome.as_ref().ok().copied(),
            );
        }
        outcome
    }

    fn debug_grant(&self, d: &mut fmt::DebugStruct<'_, '_>) {
        if !K::GRANT.is_empty() {
            d.field(K::GRANT, &self.grant);
        }
    }
}

impl<K: FencedKind> LeaseGuard<K> {
    /// The fencing token of this grant: above every token granted before it
    /// by the same counter (a fenced lock's; a read-write lease's writers'; a
    /// semaphore's, hence above every earlier holder's of this permit's slot)
    /// while the counter's history survives. Send it with every write to the
    /// protected resource (a permit's with its slot). Does not block.
    pub fn fencing_token(&self) -> FencingToken {
        K::fencing_token(self.grant())
    }
}

impl<K: Kind> Verifiable for LeaseGuard<K> {
    fn verify_still_held(&self) -> Result<Option<Duration>> {
        LeaseGuard::verify_still_held(self)
    }
}

impl<K: FencedKind> Fencing for LeaseGuard<K> {
    fn fencing_token(&self) -> FencingToken {
        LeaseGuard::fencing_token(self)
    }
}

/// A refusal for want of memory (`maxmemory` reached under `noeviction`).
fn is_oom(e: &Error) -> bool {
    matches!(e, Error::Server { source, .. } if source.code() == Some("OOM"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::manual::ManualClock;
    use crate::conn::{ConnConfig, ConnSettings, Protocol, RoleCheck};
    use crate::core::lease::LeaseCore;
    use crate::core::timing::Timing;
    use crate::lease::kind::Plain;
    use crate::runtime::topology::{Settings, Topology};
    use std::time::Instant;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    /// A deployment on a port nothing listens on, read through a manual clock.
    fn deployment(clock: Arc<ManualClock>) -> Arc<Deployment> {
        let cfg = ConnConfig::new(ConnSettings {
            url: "redis://127.0.0.1:1".into(),
            username: None,
            password: None,
            database: None,
            protocol: Protocol::Resp2,
            connect_timeout: ms(100),
            role: RoleCheck::None,
            clock: clock.clone(),
            extension_acks: None,
            #[cfg(feature = "tls")]
            tls: Default::default(),
        })
        .unwrap();
        let settings = Settings {
            pool_size: 1,
            refresh: ms(1_000),
            clock: clock.clone(),
            timing: Timing {
                drift_factor: 0.0,
                node_timeout: ms(100),
            },
            observer: None,
        };
        let topology = Topology::standalone(Arc::new(cfg), None, &settings);
        Arc::new(Deployment::new(
            topology,
            String::new(),
            ms(100),
            crate::Replication::Off,
            clock,
        ))
    }

    #[test]
    fn loss_follows_the_injected_clock_without_sleeping() {
        let clock = Arc::new(ManualClock::new());
        let dep = deployment(clock.clone());
        let t0: Instant = crate::clock::Clock::now(&*clock);
        let core = LeaseCore::granted(dep.timing(), t0, ms(1_000));
        let ops = crate::runtime::renewal::Ops::string_value("k", "o".into());
        let cell = Arc::new(Cell::new("k".into(), ops, core));
        let guard: LeaseGuard<Plain> = LeaseGuard::new(dep, cell, (), None);
        // Valid until 1000 − 2 (drift) ms; lost a node timeout (100 ms) before.
        assert_eq!(guard.remaining_estimate(), ms(998));
        clock.advance(ms(897));
        assert!(!guard.is_lost());
        assert_eq!(guard.remaining_estimate(), ms(101));
        clock.advance(ms(1));
        assert!(guard.is_lost());
        assert_eq!(guard.remaining_estimate(), Duration::ZERO);
        // The signal asked for after the loss is closed already.
        assert!(
            guard
                .lost_signal()
                .try_recv()
                .unwrap_err()
                .is_disconnected()
        );
        // Dropping it tries one release on the unreachable server and goes on.
        drop(guard);
    }
}
