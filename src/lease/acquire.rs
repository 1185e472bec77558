//! The handle every single-deployment primitive is, and the acquire verbs they
//! share: one attempt, bounded and cancellable waits, and the clean-up after
//! attempts whose reply was lost.

use std::cell::RefCell;
use std::fmt;
use std::marker::PhantomData;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::cancel::CancelToken;
use crate::conn::{Conn, Connect};
use crate::core::acquire::{Attempts, dated};
use crate::core::lease::LeaseCore;
use crate::error::{Error, Result};
use crate::lease::deployment::Deployment;
use crate::lease::guard::held::Handle;
use crate::lease::guard::{Backend, LeaseGuard, Single};
use crate::lease::kind::{Acquire, Granted, Kind, Try, Wait, check_token};
use crate::observe::Acquiring;
use crate::replication::Replication;
use crate::runtime::renewal::Cell;
use crate::runtime::topology::Uncertain;
use crate::runtime::waiters::{self, Attempt, Failures, WaitFor};
use crate::token::{HolderTag, OwnerToken};

/// A primitive of backend `B`, the handle its leases are acquired through:
/// [`Lock`](crate::Lock), [`FencedLock`](crate::FencedLock), the two sides of a
/// [`ReadWriteLease`](crate::ReadWriteLease) ([`ReadLease`](crate::ReadLease),
/// [`WriteLease`](crate::WriteLease)), [`Semaphore`](crate::Semaphore) and a
/// Redlock lock ([`RedlockGroup::lock`](crate::RedlockGroup::lock)) are this
/// type, with the same verbs. Cheap to clone.
///
/// # Acquiring
///
/// Every primitive has the same verbs:
///
/// - [`try_acquire`](Lease::try_acquire): one attempt, `Ok(None)` when held by
///   someone else.
/// - [`acquire_timeout`](Lease::acquire_timeout) /
///   [`acquire_deadline`](Lease::acquire_deadline): wait until acquired or the
///   wait runs out (`Ok(None)`); a zero wait is exactly one attempt, and
///   `Duration::MAX` waits without end.
/// - [`acquire`](Lease::acquire): wait until acquired or cancelled
///   ([`Error::Cancelled`]).
/// - [`acquire_until`](Lease::acquire_until): both.
///
/// A wait's first attempt is the one [`try_acquire`](Lease::try_acquire)
/// makes, so a wait that finds the primitive free costs what `try_acquire`
/// costs; a wait that starts while waiters of this process are queued on the
/// primitive makes none, and joins the queue behind them, and one on a
/// primitive that a wait in this process had to wait for within the last
/// second makes it 1 ms late
/// (see [`Fairness`](crate::Fairness) for who gets a lock next). Only when that attempt is not granted does the wait proper begin
/// (at once, with the next attempt): waits are woken by invalidations of the
/// keys whose change may free them (client tracking) and by a timer at the
/// earliest expiry that could free them, and do not poll unless tracking is
/// unavailable. How they ride out
/// failures that may pass and end at once on the others is the crate's one rule
/// for every wait: see [Waiting and cancellation](crate#waiting-and-cancellation).
/// A wait whose attempts
/// got no reply deletes, in the background, whatever they may have set, after
/// killing the connections they went out on (so the clean-up cannot be
/// overtaken by a late grant); a wait cancelled while its last attempt was in
/// flight releases what that attempt got.
///
/// # Time bounds
///
/// One attempt takes at most the node timeout, plus the connect timeout when it
/// has to open a connection (the first call, or after the server closed the
/// pooled ones); a script the server lost from its cache is sent again within
/// the same bound. A wait returns by its deadline plus at most one attempt's
/// bound (an attempt started just before the deadline is finished, so that its
/// grant is not left behind); cancellation interrupts it between attempts.
///
/// # Redlock
///
/// A Redlock lock ([`RedlockGroup::lock`](crate::RedlockGroup::lock)) has the
/// same verbs. One attempt is sent to every node at once and blocks until a
/// quorum decided it or the node timeout runs out, whichever is first; a slow
/// or unreachable minority does not delay a decided outcome (its answers are
/// abandoned, and cleaned up later by owner token), and a failed attempt is
/// released on every node in the background. `Ok(Some(guard))` when a quorum
/// granted with validity left, `Ok(None)` on contention (no quorum, and at
/// least one node reported another holder).
///
/// Independent servers share no invalidations, so a Redlock wait polls: after
/// each attempt that did not get the lock it sleeps a random pause between
/// half and all of a ceiling that starts at
/// [`RedlockOptions::retry_base`](crate::RedlockOptions::retry_base) and
/// doubles up to [`RedlockOptions::retry_max`](crate::RedlockOptions::retry_max)
/// (bounded retries with jitter, so that contending clients do not keep
/// colliding); a cancellation wakes the pause at once, and an attempt already
/// sent finishes first (a lock it got is released).
///
/// Its errors: [`Error::InvalidArgument`] for a zero TTL, one above
/// [`MAX_TTL`](crate::MAX_TTL), or one for which the node timeout is not well
/// below it (node timeout + drift must be under half the TTL);
/// [`Error::QuorumNotReached`] when no quorum granted and no node reported
/// another holder (nodes down, slow or failing), with every node's answer;
/// [`Error::Timeout`] when a quorum granted but the attempt took so long that
/// no validity was left; a node's error that trying again will not cure
/// ([`Error::Auth`], [`Error::Permission`], [`Error::BadKey`] for a key that
/// holds another type, an error reply, ...) when so many nodes failed that way
/// that no quorum can form without them. A wait returns retryable errors only
/// when it ran out after a failed attempt, by the crate's rule for waits.
#[must_use = "a lease handle takes nothing until one of its acquire verbs is called"]
pub struct Lease<B: Backend> {
    handle: B::Handle,
}

impl<B: Backend> Clone for Lease<B> {
    fn clone(&self) -> Self {
        Lease {
            handle: self.handle.clone(),
        }
    }
}

/// Every single-deployment kind is a backend: its guard holds a lease on one
/// deployment, its handle that deployment and the primitive's acquire logic.
impl<K: Kind> Backend for K {
    type Held = Single<K>;
    type Handle = SingleHandle<K>;
    const GUARD: &'static str = K::GUARD;
}

/// A single-deployment primitive's handle: its deployment, its acquire logic
/// and keys, and the holder its leases record.
#[allow(
    unreachable_pub,
    reason = "named by the public `Backend`, but nameable only in this crate"
)]
pub struct SingleHandle<K: Kind> {
    dep: Arc<Deployment>,
    spec: Arc<dyn Acquire<K::Grant>>,
    /// Who the leases it takes say holds them.
    holder: Option<HolderTag>,
    _kind: PhantomData<K>,
}

impl<K: Kind> Clone for SingleHandle<K> {
    fn clone(&self) -> Self {
        SingleHandle {
            dep: self.dep.clone(),
            spec: self.spec.clone(),
            holder: self.holder.clone(),
            _kind: PhantomData,
        }
    }
}

impl<K: Kind> Lease<K> {
    pub(crate) fn new(dep: Arc<Deployment>, spec: Arc<dyn Acquire<K::Grant>>) -> Self {
        Lease {
            handle: SingleHandle {
                dep,
                spec,
                holder: None,
                _kind: PhantomData,
            },
        }
    }

    /// This handle's holder on `other`, a handle made from it.
    pub(crate) fn keeping_holder<L: Kind>(&self, mut other: Lease<L>) -> Lease<L> {
        other.handle.holder = self.handle.holder.clone();
        other
    }

    pub(crate) fn physical_keys(&self) -> &[String] {
        self.handle.spec.keys()
    }

    pub(crate) fn deployment(&self) -> &Arc<Deployment> {
        &self.handle.dep
    }

    pub(crate) fn spec(&self) -> &dyn Acquire<K::Grant> {
        &*self.handle.spec
    }

    /// See [`SingleHandle::run_seen`].
    pub(crate) fn run_seen(
        &self,
        ttl: Duration,
        wait: Wait<'_>,
        seen: &mut Option<Acquiring<'_>>,
    ) -> Result<Option<LeaseGuard<K>>> {
        self.handle.run_seen(ttl, wait, seen)
    }

    /// See [`SingleHandle::guard`].
    pub(crate) fn guard(
        &self,
        g: Granted<K::Grant>,
        ttl_ms: u64,
        acknowledged: Option<u32>,
    ) -> LeaseGuard<K> {
        self.handle.guard(g, ttl_ms, acknowledged)
    }
}

impl<B: Backend> Lease<B> {
    pub(crate) fn from_handle(handle: B::Handle) -> Self {
        Lease { handle }
    }

    /// This handle, whose leases record `holder` as who holds them: a name
    /// for people and tools to read, such as `"host-a pid 4242"`, shown by
    /// [`Coordinator::inspect`](crate::Coordinator::inspect) and
    /// [`inspect_lease`](crate::Coordinator::inspect_lease) (and by
    /// `respire-lock status`) while a lease it took is held. Nothing is sent.
    ///
    /// It is stored in the lease's owner value, after the random owner id
    /// (`id@holder`, with `%` and `:` written `%25` and `%3A`), so the
    /// scripts compare it as they compare the id alone and no command is
    /// added: a lease with a holder costs a few more bytes per command, one
    /// without costs nothing. Anyone who can read the keys can read it: put
    /// no secret in it. It identifies, it does not authorise: two handles
    /// with the same holder still exclude each other.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for an empty holder, one longer than
    /// [`MAX_HOLDER_LEN`](crate::MAX_HOLDER_LEN) bytes or one with a control
    /// character; the handle is consumed and nothing else changes.
    pub fn with_holder(mut self, holder: &str) -> Result<Self> {
        *self.handle.holder_mut() = Some(HolderTag::new(holder)?);
        Ok(self)
    }

    /// The holder the leases this handle takes record, if any; see
    /// [`with_holder`](Lease::with_holder).
    pub fn holder(&self) -> Option<&str> {
        self.handle.holder().map(HolderTag::as_str)
    }

    /// One attempt. Blocks for at most the node timeout (plus the connect
    /// timeout when a connection must be opened; see [Time bounds](Lease#time-bounds)).
    ///
    /// Returns `Ok(Some(guard))` when granted, `Ok(None)` when someone else holds
    /// it.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a zero TTL, one above [`MAX_TTL`](crate::MAX_TTL)
    /// or one not longer than the node timeout plus drift (nothing sent);
    /// [`Error::BadKey`] when a key holds something the primitive cannot use
    /// (nothing changed); [`Error::FencingRegression`] for a fencing token not
    /// above one already seen (the grant is released); [`Error::Timeout`] /
    /// [`Error::Io`] when no reply came (what it may have set is deleted in the
    /// background); other transport, permission and server errors as they come.
    pub fn try_acquire(&self, ttl: Duration) -> Result<Option<LeaseGuard<B>>> {
        self.handle.run(ttl, Wait::Once)
    }

    /// Waits up to `wait`; see [Acquiring](Lease#acquiring). A zero wait makes
    /// exactly one attempt; a wait too long for the clock (`Duration::MAX`)
    /// has no deadline.
    ///
    /// Returns `Ok(None)` when the wait runs out after finding the primitive held.
    ///
    /// # Errors
    /// As [`try_acquire`](Lease::try_acquire); retryable errors only when the
    /// wait ran out after a failed attempt.
    pub fn acquire_timeout(&self, ttl: Duration, wait: Duration) -> Result<Option<LeaseGuard<B>>> {
        self.handle.run(ttl, Wait::within(self.handle.now(), wait))
    }

    /// Waits until `deadline`; see [`acquire_timeout`](Lease::acquire_timeout).
    /// A deadline already past makes exactly one attempt.
    ///
    /// # Errors
    /// As [`acquire_timeout`](Lease::acquire_timeout).
    pub fn acquire_deadline(
        &self,
        ttl: Duration,
        deadline: Instant,
    ) -> Result<Option<LeaseGuard<B>>> {
        self.handle.run(ttl, Wait::Until(Some(deadline), None))
    }

    /// Waits until acquired or `cancel` is cancelled; see [Acquiring](Lease#acquiring).
    ///
    /// # Errors
    /// [`Error::Cancelled`] on cancellation (never turned into "not acquired"; a
    /// grant to an attempt in flight at that moment is released); permanent
    /// errors as for [`try_acquire`](Lease::try_acquire). Retryable errors do
    /// not end this wait.
    pub fn acquire(&self, ttl: Duration, cancel: &CancelToken) -> Result<LeaseGuard<B>> {
        self.handle
            .run(ttl, Wait::Until(None, Some(cancel)))?
            .ok_or(Error::Cancelled)
    }

    /// Waits until acquired, `deadline` passes (`Ok(None)`, or the last error
    /// after a failed attempt), or `cancel` is cancelled (`Err(Cancelled)`) — a
    /// bounded wait the caller can also abort. A deadline already past makes
    /// exactly one attempt.
    ///
    /// # Errors
    /// As [`acquire`](Lease::acquire) and [`acquire_timeout`](Lease::acquire_timeout).
    pub fn acquire_until(
        &self,
        ttl: Duration,
        deadline: Instant,
        cancel: &CancelToken,
    ) -> Result<Option<LeaseGuard<B>>> {
        self.handle
            .run(ttl, Wait::Until(Some(deadline), Some(cancel)))
    }
}

impl<K: Kind> SingleHandle<K> {
    fn run(&self, ttl: Duration, wait: Wait<'_>) -> Result<Option<LeaseGuard<K>>> {
        let once = matches!(wait, Wait::Once);
        let start = |o| Acquiring::start(o, self.first_key(), K::PRIMITIVE, !once, self.dep.now());
        let mut seen = self.dep.observer().map(start);
        let result = self.run_seen(ttl, wait, &mut seen);
        if let Ok(Some(guard)) = &result {
            guard.cell().observe_with(self.dep.observer(), K::PRIMITIVE);
        }
        Acquiring::finish(seen, &result, once, self.dep.now(), |g| {
            (g.lease_id(), K::token(g.grant()))
        });
        result
    }

    /// The key observers are told of.
    fn first_key(&self) -> &str {
        &self.spec.keys()[0]
    }

    /// An acquire call whose attempts report contention to `seen`, and whose
    /// guard is not yet observed: the caller reports the grant and has the
    /// observer watch the lease from then on.
    pub(crate) fn run_seen(
        &self,
        ttl: Duration,
        wait: Wait<'_>,
        seen: &mut Option<Acquiring<'_>>,
    ) -> Result<Option<LeaseGuard<K>>> {
        let dep = &self.dep;
        let ttl_ms = dep.check_ttl(ttl)?;
        history_kept(dep, &self.spec.keys()[0])?;
        let wait = wait.starting(dep.now())?;
        let owner = OwnerToken::held_by(self.holder.as_ref());
        let (result, attempts) = match wait {
            Wait::Once => self.once(&owner, ttl_ms, seen),
            Wait::Until(deadline, cancel) => {
                let keys = self.spec.wait_keys();
                let w = WaitFor {
                    keys: &keys,
                    deadline,
                    cancel,
                    attempt_timeout: dep.node_timeout() + dep.replication.timeout(),
                    settle: dep.connect_timeout,
                    failures: Failures::RideOut,
                    order: self.spec.order(),
                };
                let mut attempts = Attempts::default();
                let waited = waiters::wait_for(&*dep.topology, &w, |conn, d, waiting| {
                    let started = dep.now();
                    let since = attempts.since();
                    let t = Try {
                        owner: &owner,
                        ttl_ms,
                        deadline: d,
                        sent: started,
                        waiting,
                        uncertain_since: since,
                    };
                    let r = self.attempt(conn, t);
                    if let Ok(Attempt::Busy(pttl)) = &r {
                        Acquiring::busy(seen, Some(*pttl));
                    }
                    if r.as_ref().is_err_and(Error::is_uncertain) {
                        attempts.unanswered(started, []);
                    }
                    if matches!(r, Ok(Attempt::Acquired(_))) {
                        attempts.granted(started);
                    }
                    r
                });
                if !matches!(waited.result, Ok(Some(_))) {
                    // Within the wait's own bound: its deadline plus one
                    // attempt.
                    let now = dep.now();
                    let by = deadline.map_or(now + dep.node_timeout(), |d| {
                        (d + w.attempt_timeout).min(now + dep.node_timeout())
                    });
                    self.spec.stopped_waiting(dep, &owner, by);
                }
                attempts.went_out_on(waited.uncertain);
                (waited.result, attempts)
            }
        };
        // Attempts that got no reply may still arrive (see `core::acquire`):
        // their connections are killed, and what they may have set deleted by
        // owner unless a later attempt was granted.
        let acquired = matches!(result, Ok(Some(_)));
        let left = attempts.finish(acquired);
        if let Some(left) = &left {
            dep.clean_up(
                &left.conns,
                left.delete.then(|| self.spec.clean_up(&owner)),
                &self.spec.keys()[0],
                Duration::from_millis(ttl_ms),
            );
        }
        let Some((mut guard, sent, received)) = result? else {
            return Ok(None);
        };
        // Granted after attempts that got no reply: one may still arrive
        // after a quick release and set the lease again, for nobody.
        if let Some(left) = left
            && !left.conns.is_empty()
        {
            guard.after_late_attempts(left.conns, self.spec.clean_up(&owner));
        }
        if let Err(e) = replication_kept(dep, guard.key(), guard.replicas_acknowledged()) {
            drop(guard);
            return Err(e);
        }
        if let Err(e) = check_token::<K>(dep, &*self.spec, guard.grant(), sent, received) {
            drop(guard);
            return Err(e);
        }
        Ok(Some(guard))
    }

    /// One attempt on a pooled connection, and once more on a fresh one when
    /// the pooled one turned out dead (attempts are idempotent for their owner).
    #[allow(
        clippy::type_complexity,
        reason = "a private helper's result and evidence"
    )]
    fn once(
        &self,
        owner: &OwnerToken,
        ttl_ms: u64,
        seen: &mut Option<Acquiring<'_>>,
    ) -> (
        Result<Option<(LeaseGuard<K>, Instant, Instant)>>,
        Attempts<Uncertain>,
    ) {
        let dep = &self.dep;
        let attempts = RefCell::new(Attempts::default());
        let now = dep.now();
        let deadline = now + dep.node_timeout() + dep.replication.timeout();
        let mut first = true;
        let started = std::cell::Cell::new(now);
        let result = dep.on_key_fresh_retry(
            &self.spec.keys()[0],
            deadline,
            Connect::Own,
            |conn, deadline| {
                // The attempt goes out now. The clock was read for the
                // deadline just before, with nothing waited for since when
                // the first try has a pooled connection: that read stands (an
                // earlier send time is the safe side). After a connect, a
                // redirect or a dead pooled connection, it is read again.
                if !std::mem::take(&mut first) || conn.is_fresh() {
                    started.set(dep.now());
                }
                let since = attempts.borrow().since();
                let t = Try {
                    owner,
                    ttl_ms,
                    deadline,
                    sent: started.get(),
                    waiting: false,
                    uncertain_since: since,
                };
                let r = self.attempt(conn, t);
                if let Ok(Attempt::Busy(pttl)) = &r {
                    Acquiring::busy(seen, Some(*pttl));
                }
                if matches!(r, Ok(Attempt::Acquired(_))) {
                    attempts.borrow_mut().granted(started.get());
                }
                r
            },
            |r, lost| {
                let unanswered = r.as_ref().is_err_and(Error::is_uncertain);
                attempts.borrow_mut().tried(unanswered, started.get(), lost);
            },
        );
        (result.map(Attempt::granted), attempts.into_inner())
    }

    #[allow(clippy::type_complexity, reason = "a private helper's result")]
    fn attempt(
        &self,
        conn: &mut Conn,
        t: Try<'_>,
    ) -> Result<Attempt<(LeaseGuard<K>, Instant, Instant)>> {
        let Try {
            ttl_ms,
            uncertain_since,
            ..
        } = t;
        wait_for_replicas(&self.dep, conn);
        let attempt = self.spec.attempt(&self.dep, conn, t);
        let granted = matches!(attempt, Ok(Attempt::Acquired(_)));
        let acknowledged = replicas_acknowledged(&self.dep, conn, granted);
        Ok(match attempt? {
            Attempt::Acquired(g) => {
                // Read only for a check that looks at it (a fencing token's
                // history): the other kinds do not pay for the clock.
                let received = if self.spec.counter().is_some() {
                    self.dep.now()
                } else {
                    g.sent
                };
                // A token is checked against the history from the earliest
                // attempt that may have drawn it (a repeated grant to this
                // owner returns the token an unanswered attempt drew).
                let sent = dated(uncertain_since, g.sent);
                Attempt::Acquired((self.guard(g, ttl_ms, acknowledged), sent, received))
            }
            Attempt::Busy(pttl) => Attempt::Busy(pttl),
        })
    }

    pub(crate) fn guard(
        &self,
        g: Granted<K::Grant>,
        ttl_ms: u64,
        acknowledged: Option<u32>,
    ) -> LeaseGuard<K> {
        let core = LeaseCore::granted(self.dep.timing(), g.sent, Duration::from_millis(ttl_ms));
        let key = g.ops.keys[0].clone();
        let cell = Arc::new(Cell::new(key, g.ops, core));
        self.dep.granted(&cell);
        LeaseGuard::new(self.dep.clone(), cell, g.grant, acknowledged)
    }
}

/// Refuses an acquire on `key`, sending nothing, once the deployment's
/// primary was found without grants replicas had acknowledged (under
/// `Require`): any token it would hand out may have been handed out before.
pub(crate) fn history_kept(dep: &Deployment, key: &str) -> Result<()> {
    match (dep.replication, dep.history.lost()) {
        (Replication::Require { .. }, Some(detail)) => Err(Error::ReplicationHistoryLost {
            key: key.to_owned(),
            detail,
        }),
        _ => Ok(()),
    }
}

/// Has the next script on `conn` followed, in the same pipeline, by the
/// `WAIT` the deployment's [`Replication`] asks for (and, under `Require`
/// behind Sentinel, by `INFO replication`). `WAIT` counts every write the
/// connection made, so it covers all the leases one script sets.
pub(crate) fn wait_for_replicas(dep: &Deployment, conn: &mut Conn) {
    match dep.replication {
        Replication::Off => {}
        Replication::Report { timeout } => {
            conn.wait_after_next(conn.replicas().unwrap_or(1), timeout, false)
        }
        Replication::Require { replicas, timeout } => {
            conn.wait_after_next(replicas, timeout, dep.topology.is_sentinel())
        }
    }
}

/// After a script armed by [`wait_for_replicas`]: how many replicas
/// acknowledged its writes (`None` under `Off`; 0 when `WAIT` did not
/// answer), with the primary's replication history judged under `Require`
/// (`granted`: whether the script granted).
pub(crate) fn replicas_acknowledged(
    dep: &Deployment,
    conn: &mut Conn,
    granted: bool,
) -> Option<u32> {
    let acknowledged = match dep.replication {
        Replication::Off => None,
        _ => Some(conn.take_waited().unwrap_or(0)),
    };
    if let (Some(point), Replication::Require { replicas, .. }) =
        (conn.take_history(), dep.replication)
    {
        let acknowledged = granted && acknowledged.unwrap_or(0) >= replicas;
        dep.history.observe(conn.addr(), &point, acknowledged);
    }
    acknowledged
}

/// Whether a grant on `key` that `acknowledged` replicas acknowledged may be
/// handed over under the deployment's [`Replication`]: under `Require`, not
/// when the primary lost acknowledged grants, nor with too few
/// acknowledgements. The caller releases what it got when it may not.
pub(crate) fn replication_kept(
    dep: &Deployment,
    key: &str,
    acknowledged: Option<u32>,
) -> Result<()> {
    let Replication::Require { replicas, .. } = dep.replication else {
        return Ok(());
    };
    if let Some(detail) = dep.history.lost() {
        log::warn!("{key:?} was granted on a primary that lost acknowledged grants; releasing it");
        return Err(Error::ReplicationHistoryLost {
            key: key.to_owned(),
            detail,
        });
    }
    let acknowledged = acknowledged.unwrap_or(0);
    if acknowledged < replicas {
        log::warn!(
            "{key:?} was granted with {acknowledged} of {replicas} required replica \
             acknowledgement(s); releasing it"
        );
        return Err(Error::NotReplicated {
            key: key.to_owned(),
            acknowledged,
            required: replicas,
        });
    }
    Ok(())
}

impl<B: Backend> fmt::Debug for Lease<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.handle.debug(f)
    }
}

#[allow(
    private_interfaces,
    reason = "a sealed trait's methods, named only in this crate"
)]
impl<K: Kind> Handle<K> for SingleHandle<K> {
    fn run(&self, ttl: Duration, wait: Wait<'_>) -> Result<Option<LeaseGuard<K>>> {
        SingleHandle::run(self, ttl, wait)
    }
    fn now(&self) -> Instant {
        self.dep.now()
    }
    fn holder(&self) -> Option<&HolderTag> {
        self.holder.as_ref()
    }
    fn holder_mut(&mut self) -> &mut Option<HolderTag> {
        &mut self.holder
    }
    fn debug(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.spec.debug(f)
    }
}
