//! All or nothing: several leases of one deployment taken together, as one
//! guard.
//!
//! Two callers that take overlapping sets one lease at a time in the order
//! each was given can deadlock (Redisson's `MultiLock` does, when two callers
//! pass the same keys in opposite orders). Here a set whose leases all hash to
//! one cluster slot (always, on a standalone server or behind Sentinel) is
//! taken by one script call that grants every lease or none; a set spread over
//! several slots is taken one lease at a time in one global order — by slot,
//! then by key bytes — under one wait budget, and every lease already taken is
//! released when a later one is not granted. No caller ever holds part of a
//! set and waits for the rest in an order another caller reverses, and no
//! partial guard is ever returned.
//!
//! Each lease of a set stays an ordinary lease of its kind (one key, renewed,
//! verified and released by the scripts of a [`Lock`](crate::Lock) or a
//! [`FencedLock`](crate::FencedLock)); the [`MultiGuard`] holds one guard per
//! key and answers for the set.

use std::cell::RefCell;
use std::fmt;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use crossbeam_channel::Receiver;

use crate::cancel::CancelToken;
use crate::conn::{Conn, Connect};
use crate::core::acquire::{Attempts, dated};
use crate::error::{Error, Result};
use crate::guard::{Guard, ReleaseOutcome, Verifiable, sealed};
use crate::keys::key_slot;
use crate::lease::acquire::{
    Lease, history_kept, replicas_acknowledged, replication_kept, wait_for_replicas,
};
use crate::lease::deployment::{Deployment, bad_key_in};
use crate::lease::guard::{KeepAlive, LeaseGuard};
use crate::lease::kind::Wait;
use crate::lease::kind::{Fenced, Granted, Kind, Plain, check_token};
use crate::lease::{busy, parse_token, unexpected_acquire};
use crate::observe::Acquiring;
use crate::runtime::lease::SharedSignal;
use crate::runtime::renewal::Ops;
use crate::runtime::waiters::{self, Attempt, Failures, Order, WaitFor};
use crate::scripts;
use crate::token::{FencingToken, OwnerToken};

/// Several leases of one deployment, taken all together or not at all. Made
/// by [`Coordinator::lock_all`](crate::Coordinator::lock_all)
/// ([`MultiLock`]) and
/// [`Coordinator::fenced_lock_all`](crate::Coordinator::fenced_lock_all)
/// ([`FencedMultiLock`]); cheap to clone.
///
/// # Acquiring
///
/// The verbs are those of every primitive ([`Lease`]):
/// [`try_acquire`](MultiLease::try_acquire) (one attempt; `Ok(None)` when any
/// lease of the set is held by someone else),
/// [`acquire_timeout`](MultiLease::acquire_timeout) /
/// [`acquire_deadline`](MultiLease::acquire_deadline) (`Ok(None)` when the
/// wait runs out), [`acquire`](MultiLease::acquire) (`Err(Cancelled)` on
/// cancellation) and [`acquire_until`](MultiLease::acquire_until) (both).
///
/// When every key hashes to one cluster slot (always on a standalone server or
/// behind Sentinel), each attempt is one script call that grants every lease
/// or changes nothing, and a wait is woken by an invalidation of any of the
/// keys, or by a timer at the expiry of the lease that was found held. When
/// the keys span several slots of a cluster, the leases are taken one at a
/// time in the global order (by slot, then by key bytes), each with the wait
/// of its own primitive, all under the one deadline and cancellation token;
/// when one is not granted (held past the deadline, cancelled, an error),
/// every lease already taken is released before the call returns. If a lease
/// taken early was lost while a later one was waited for, the whole set is
/// released and taken again within the same budget.
///
/// With a [replication guard](crate::Replication) other than `Off`, the one
/// script call of a set in one slot is followed, in the same pipeline, by one
/// `WAIT` for all of its writes (`WAIT` counts every write the connection
/// made, so one acknowledgement covers every lease the script set, and a
/// lease found already granted to this owner by an earlier attempt too);
/// each member guard reports that count
/// ([`replicas_acknowledged`](LeaseGuard::replicas_acknowledged)). Under
/// `Require`, a set acknowledged by too few replicas (or granted by a primary
/// that lost acknowledged grants) is released whole and the call fails with
/// [`Error::NotReplicated`] (or [`Error::ReplicationHistoryLost`]) naming its
/// first key: no partial guard. In the global order, each lease is checked
/// as its primitive's is, and a failed check releases every lease already
/// taken.
///
/// # Observers
///
/// An [`Observer`](crate::Observer) hears of a set as of its leases, each
/// under its own key: an acquire call of a set reports one call per lease, in
/// the order the keys were given — an [`attempt`](crate::Observer::attempt)
/// for each when the call starts, a [`contended`](crate::Observer::contended)
/// for each lease an attempt found held (at most once per lease and call,
/// with the holder's TTL), and when the call ends either a
/// [`granted`](crate::Observer::granted) for each (its lease id and token,
/// every one with the wait of the whole call) or a
/// [`wait_ended`](crate::Observer::wait_ended) for each, with the one reason
/// of the call. Each lease is then watched as a single one is (renewals,
/// loss, release). What happens inside the call is not reported: a lease
/// taken in the global order and released because a later one was not
/// granted, or a set retaken because an early lease ran out, was never
/// handed over, and is never reported granted or released.
///
/// Attempts whose reply was lost are assumed granted: their connections are
/// killed and what they may have set deleted by owner in the background, as
/// for every primitive; a wait cancelled while its last attempt was in flight
/// releases what that attempt got.
///
/// # Time bounds
///
/// One attempt takes at most the node timeout (plus the connect timeout when
/// a connection must be opened) in one call, and that per lease in the global
/// order. A wait returns by its deadline plus the bound of the attempts in
/// flight, and the release of the leases already taken (each bounded by the
/// node timeout).
#[must_use = "a lease handle takes nothing until one of its acquire verbs is called"]
pub struct MultiLease<K: Kind> {
    dep: Arc<Deployment>,
    /// The leases, in the caller's order.
    members: Vec<Lease<K>>,
    /// The global order: indices into `members`, by slot, then key bytes.
    order: Vec<usize>,
    /// Every lease hashes to one slot and grants need no replication check:
    /// one script call per attempt.
    one_call: bool,
    grant: fn(&redis::Value) -> Result<K::Grant>,
    value: fn(&OwnerToken, &K::Grant) -> String,
}

/// Several plain [`Lock`](crate::Lock)s taken all together; see
/// [`MultiLease`].
pub type MultiLock = MultiLease<Plain>;

/// Several [`FencedLock`](crate::FencedLock)s taken all together, each grant
/// with its own fencing token; see [`MultiLease`].
pub type FencedMultiLock = MultiLease<Fenced>;

/// A held [`MultiLock`]: a [`MultiGuard`] of plain leases.
pub type MultiLockGuard = MultiGuard<Plain>;

/// A held [`FencedMultiLock`]: a [`MultiGuard`] of fenced leases, with a
/// fencing token per key.
pub type FencedMultiGuard = MultiGuard<Fenced>;

impl<K: Kind> Clone for MultiLease<K> {
    fn clone(&self) -> Self {
        MultiLease {
            dep: self.dep.clone(),
            members: self.members.clone(),
            order: self.order.clone(),
            one_call: self.one_call,
            grant: self.grant,
            value: self.value,
        }
    }
}

/// A granted set: the guard, when its first attempt that may have granted it
/// was sent, and when the grant's reply arrived.
type Grant<K> = (MultiGuard<K>, Instant, Instant);

impl MultiLease<Plain> {
    /// A set of plain locks, in the caller's order (validated by the
    /// coordinator: at least one, no key twice).
    pub(crate) fn plain(dep: Arc<Deployment>, members: Vec<Lease<Plain>>) -> Self {
        MultiLease::new(
            dep,
            members,
            |_| Ok(()),
            |owner, ()| owner.as_str().to_owned(),
        )
    }
}

impl MultiLease<Fenced> {
    /// A set of fenced locks, in the caller's order (validated by the
    /// coordinator: at least one, no key twice among leases and counters).
    pub(crate) fn fenced(dep: Arc<Deployment>, members: Vec<Lease<Fenced>>) -> Self {
        MultiLease::new(dep, members, |v| parse_token(v, "acquire"), fenced_value)
    }
}

impl<K: Kind> MultiLease<K> {
    fn new(
        dep: Arc<Deployment>,
        members: Vec<Lease<K>>,
        grant: fn(&redis::Value) -> Result<K::Grant>,
        value: fn(&OwnerToken, &K::Grant) -> String,
    ) -> Self {
        let slot = |i: &usize| key_slot(members[*i].physical_keys()[0].as_bytes());
        let mut order: Vec<usize> = (0..members.len()).collect();
        order.sort_by(|a, b| {
            (slot(a), members[*a].physical_keys()[0].as_bytes())
                .cmp(&(slot(b), members[*b].physical_keys()[0].as_bytes()))
        });
        let one_slot = order.iter().all(|i| slot(i) == slot(&order[0]));
        let one_call = one_slot || !dep.topology.is_cluster();
        MultiLease {
            dep,
            members,
            order,
            one_call,
            grant,
            value,
        }
    }

    /// The physical lease keys (with the coordinator's prefix), in the order
    /// they were given.
    pub fn keys(&self) -> impl Iterator<Item = &str> {
        self.members.iter().map(|m| m.physical_keys()[0].as_str())
    }

    /// Whether each attempt takes the whole set in one script call (every
    /// key in one cluster slot, or a deployment of one server); otherwise the
    /// leases are taken one at a time in the global order.
    pub fn is_one_call(&self) -> bool {
        self.one_call
    }

    /// One attempt at the whole set. Blocks for at most the node timeout
    /// per script call (plus the connect timeout when a connection must be
    /// opened); in the global order, one such attempt per lease, and the
    /// release of those taken when a later one is held.
    ///
    /// Returns `Ok(Some(guard))` when every lease was granted, `Ok(None)` when
    /// any of them is held by someone else (nothing of the set is then held).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a bad TTL (nothing sent);
    /// [`Error::BadKey`] when a key holds something a lease or counter cannot
    /// be (nothing changed); [`Error::FencingRegression`] for a token not
    /// above one already seen (the set is released); under
    /// [`Replication::Require`](crate::Replication::Require),
    /// [`Error::NotReplicated`] when too few replicas acknowledged the set
    /// (it is released) and [`Error::ReplicationHistoryLost`] once the
    /// primary lost acknowledged grants (nothing sent, or the set released);
    /// [`Error::Timeout`] /
    /// [`Error::Io`] when no reply came (what the attempt may have set is
    /// deleted in the background, and every lease already taken released);
    /// other transport, permission and server errors as they come.
    pub fn try_acquire(&self, ttl: Duration) -> Result<Option<MultiGuard<K>>> {
        self.run(ttl, Wait::Once)
    }

    /// Waits up to `wait` for the whole set; see [Acquiring](MultiLease#acquiring).
    /// A zero wait makes exactly one attempt; a wait too long for the clock
    /// (`Duration::MAX`) has no deadline.
    ///
    /// Returns `Ok(None)` when the wait runs out with some lease held by
    /// someone else (nothing of the set is then held).
    ///
    /// # Errors
    /// As [`try_acquire`](MultiLease::try_acquire); retryable errors only
    /// when the wait ran out after a failed attempt.
    pub fn acquire_timeout(&self, ttl: Duration, wait: Duration) -> Result<Option<MultiGuard<K>>> {
        self.run(ttl, Wait::within(self.dep.now(), wait))
    }

    /// Waits until `deadline`; see [`acquire_timeout`](MultiLease::acquire_timeout).
    /// A deadline already past makes exactly one attempt.
    ///
    /// # Errors
    /// As [`acquire_timeout`](MultiLease::acquire_timeout).
    pub fn acquire_deadline(
        &self,
        ttl: Duration,
        deadline: Instant,
    ) -> Result<Option<MultiGuard<K>>> {
        self.run(ttl, Wait::Until(Some(deadline), None))
    }

    /// Waits until the whole set is acquired or `cancel` is cancelled; see
    /// [Acquiring](MultiLease#acquiring).
    ///
    /// # Errors
    /// [`Error::Cancelled`] on cancellation (every lease already taken is
    /// released, and so is a grant to an attempt in flight at that moment);
    /// permanent errors as for [`try_acquire`](MultiLease::try_acquire).
    /// Retryable errors do not end this wait.
    pub fn acquire(&self, ttl: Duration, cancel: &CancelToken) -> Result<MultiGuard<K>> {
        self.run(ttl, Wait::Until(None, Some(cancel)))?
            .ok_or(Error::Cancelled)
    }

    /// Waits until the whole set is acquired, `deadline` passes (`Ok(None)`,
    /// or the last error after a failed attempt), or `cancel` is cancelled
    /// (`Err(Cancelled)`). A deadline already past makes exactly one attempt.
    ///
    /// # Errors
    /// As [`acquire`](MultiLease::acquire) and
    /// [`acquire_timeout`](MultiLease::acquire_timeout).
    pub fn acquire_until(
        &self,
        ttl: Duration,
        deadline: Instant,
        cancel: &CancelToken,
    ) -> Result<Option<MultiGuard<K>>> {
        self.run(ttl, Wait::Until(Some(deadline), Some(cancel)))
    }

    /// One acquire call, as observers hear it: the call of each lease of the
    /// set, all started together, each found held at most once, and all
    /// ending together with the set's result.
    fn run(&self, ttl: Duration, wait: Wait<'_>) -> Result<Option<MultiGuard<K>>> {
        let once = matches!(wait, Wait::Once);
        let mut seen: Vec<Option<Acquiring<'_>>> = match self.dep.observer() {
            Some(observer) => self
                .members
                .iter()
                .map(|m| {
                    let key = m.physical_keys()[0].as_str();
                    Some(Acquiring::start(
                        observer,
                        key,
                        K::PRIMITIVE,
                        !once,
                        self.dep.now(),
                    ))
                })
                .collect(),
            None => Vec::new(),
        };
        let result = self.run_seen(ttl, wait, &mut seen);
        if let Ok(Some(guard)) = &result {
            for member in &guard.members {
                member
                    .cell()
                    .observe_with(self.dep.observer(), K::PRIMITIVE);
            }
        }
        for (i, member) in seen.into_iter().enumerate() {
            Acquiring::finish(
                member,
                &result,
                once,
                self.dep.now(),
                |g: &MultiGuard<K>| {
                    let m = &g.members[i];
                    (m.lease_id(), K::token(m.grant()))
                },
            );
        }
        result
    }

    fn run_seen(
        &self,
        ttl: Duration,
        wait: Wait<'_>,
        seen: &mut [Option<Acquiring<'_>>],
    ) -> Result<Option<MultiGuard<K>>> {
        let ttl_ms = self.dep.check_ttl(ttl)?;
        if self.one_call {
            history_kept(&self.dep, self.members[0].physical_keys()[0].as_str())?;
        }
        let wait = wait.starting(self.dep.now())?;
        if self.one_call {
            self.at_once(ttl_ms, wait, seen)
        } else {
            self.in_order(ttl, wait, seen)
        }
    }

    /// The leases one at a time in the global order, each with its own
    /// primitive's wait under the one budget.
    fn in_order(
        &self,
        ttl: Duration,
        wait: Wait<'_>,
        seen: &mut [Option<Acquiring<'_>>],
    ) -> Result<Option<MultiGuard<K>>> {
        loop {
            let mut held: Vec<(usize, LeaseGuard<K>)> = Vec::with_capacity(self.members.len());
            for &i in &self.order {
                let got = match seen.get_mut(i) {
                    Some(seen) => self.members[i].run_seen(ttl, wait, seen),
                    None => self.members[i].run_seen(ttl, wait, &mut None),
                };
                match got {
                    Ok(Some(guard)) => held.push((i, guard)),
                    not_granted => {
                        // Every earlier lease goes before the call returns,
                        // the last taken first.
                        release_all(held.into_iter().rev().map(|(_, g)| g));
                        return not_granted.map(|_| None);
                    }
                }
            }
            held.sort_by_key(|(i, _)| *i);
            let guard = MultiGuard::new(self.dep.clone(), held.into_iter().map(|(_, g)| g));
            if !guard.is_lost() {
                return Ok(Some(guard));
            }
            // A lease taken early ran out while a later one was waited for:
            // the set was never held whole. Start again within the budget.
            drop(guard);
            let out_of_time = match wait {
                Wait::Once => true,
                Wait::Until(deadline, _) => deadline.is_some_and(|d| self.dep.now() >= d),
            };
            if out_of_time {
                return Ok(None);
            }
        }
    }

    /// The whole set in one script call per attempt (followed, under a
    /// replication guard, by one `WAIT` for all its writes).
    fn at_once(
        &self,
        ttl_ms: u64,
        wait: Wait<'_>,
        seen: &mut [Option<Acquiring<'_>>],
    ) -> Result<Option<MultiGuard<K>>> {
        let dep = &self.dep;
        let owner = OwnerToken::new();
        let leases: Vec<&str> = self.keys().collect();
        let (result, attempts) = match wait {
            Wait::Once => self.once(&owner, ttl_ms, seen),
            Wait::Until(deadline, cancel) => {
                let w = WaitFor {
                    keys: &leases,
                    deadline,
                    cancel,
                    attempt_timeout: dep.node_timeout() + dep.replication.timeout(),
                    settle: dep.connect_timeout,
                    failures: Failures::RideOut,
                    order: Order::Local,
                };
                let mut attempts = Attempts::default();
                let waited = waiters::wait_for(&*dep.topology, &w, |conn, d, _waiting| {
                    let started = dep.now();
                    let r = self.attempt(conn, &owner, ttl_ms, d, attempts.since(), seen);
                    if r.as_ref().is_err_and(Error::is_uncertain) {
                        attempts.unanswered(started, []);
                    }
                    if matches!(r, Ok(Attempt::Acquired(_))) {
                        attempts.granted(started);
                    }
                    r
                });
                attempts.went_out_on(waited.uncertain);
                (waited.result, attempts)
            }
        };
        // Attempts that got no reply may still arrive (see `core::acquire`):
        // their connections are killed, and what they may have set deleted by
        // owner unless a later attempt was granted.
        let acquired = matches!(result, Ok(Some(_)));
        if let Some(left) = attempts.finish(acquired) {
            dep.clean_up(
                &left.conns,
                left.delete
                    .then(|| scripts::MULTI_CLEAN_UP.eval(&leases, &[owner.as_str()])),
                leases[0],
                Duration::from_millis(ttl_ms),
            );
        }
        let Some((guard, sent, received)) = result? else {
            return Ok(None);
        };
        // One `WAIT` answered for the whole set: every lease was acknowledged
        // by as many replicas as the set.
        let acknowledged = guard.members[0].replicas_acknowledged();
        if let Err(e) = replication_kept(dep, guard.key(), acknowledged) {
            drop(guard);
            return Err(e);
        }
        for (lease, member) in self.members.iter().zip(&guard.members) {
            if let Err(e) = check_token::<K>(dep, lease.spec(), member.grant(), sent, received) {
                drop(guard);
                return Err(e);
            }
        }
        Ok(Some(guard))
    }

    /// One attempt on a pooled connection, and once more on a fresh one when
    /// the pooled one turned out dead (attempts are idempotent for their owner).
    fn once(
        &self,
        owner: &OwnerToken,
        ttl_ms: u64,
        seen: &mut [Option<Acquiring<'_>>],
    ) -> (
        Result<Option<Grant<K>>>,
        Attempts<crate::runtime::topology::Uncertain>,
    ) {
        let dep = &self.dep;
        let attempts = RefCell::new(Attempts::default());
        let deadline = dep.now() + dep.node_timeout() + dep.replication.timeout();
        let key = &self.members[0].physical_keys()[0];
        let started = std::cell::Cell::new(dep.now());
        let result = dep.on_key_fresh_retry(
            key,
            deadline,
            Connect::Own,
            |conn, deadline| {
                started.set(dep.now());
                let since = attempts.borrow().since();
                let r = self.attempt(conn, owner, ttl_ms, deadline, since, seen);
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

    /// Runs `multi_acquire` once (and the replication guard's `WAIT` after
    /// it); a lease found held is reported to its observed call.
    fn attempt(
        &self,
        conn: &mut Conn,
        owner: &OwnerToken,
        ttl_ms: u64,
        deadline: Instant,
        uncertain_since: Option<Instant>,
        seen: &mut [Option<Acquiring<'_>>],
    ) -> Result<Attempt<Grant<K>>> {
        let dep = &self.dep;
        let leases: Vec<&str> = self.keys().collect();
        let fences: Vec<&str> = self
            .members
            .iter()
            .filter_map(|m| m.physical_keys().get(1).map(String::as_str))
            .collect();
        let ttl = ttl_ms.to_string();
        let (keys, args) = acquire_call(&leases, &fences, owner.as_str(), &ttl);
        wait_for_replicas(dep, conn);
        let sent = dep.now();
        let reply: Result<Vec<redis::Value>> = conn
            .script(&scripts::MULTI_ACQUIRE, &keys, &args, "acquire", deadline)
            .map_err(|e| bad_key_in(e, &keys));
        let granted = matches!(reply.as_deref(), Ok([redis::Value::Int(1), ..]));
        let acknowledged = replicas_acknowledged(dep, conn, granted);
        let reply = reply?;
        let received = dep.now();
        match read_set(&reply, self.members.len())? {
            SetReply::Granted(tokens) => {
                // A lease found already ours was granted by an earlier
                // attempt whose reply was lost: the set counts from the
                // earliest such attempt.
                let sent = dated(uncertain_since, sent);
                let mut guards = Vec::with_capacity(tokens.len());
                for (lease, token) in self.members.iter().zip(tokens) {
                    let grant = (self.grant)(token)?;
                    let ops =
                        Ops::string_value(&lease.physical_keys()[0], (self.value)(owner, &grant));
                    let granted = Granted { grant, ops, sent };
                    guards.push(lease.guard(granted, ttl_ms, acknowledged));
                }
                let guard = MultiGuard::new(dep.clone(), guards);
                Ok(Attempt::Acquired((guard, sent, received)))
            }
            SetReply::Held { at, pttl } => {
                if let Some(seen) = at.and_then(|i| seen.get_mut(i)) {
                    Acquiring::busy(seen, Some(pttl));
                }
                Ok(Attempt::Busy(pttl))
            }
        }
    }
}

/// What one `multi_acquire` call answered.
#[derive(Debug, PartialEq)]
pub(crate) enum SetReply<'a> {
    /// Every lease granted: its token in the call's order (a plain lease's
    /// is not one).
    Granted(&'a [redis::Value]),
    /// A lease found held, by its index in the call's order when the script
    /// names it, and how long its holder has.
    Held {
        at: Option<usize>,
        pttl: Option<Duration>,
    },
}

/// Reads a `multi_acquire` call's reply over `leases` leases: `{1, token…}`
/// every lease granted, `{0, index, pttl}` one found held (nothing of the
/// set taken).
pub(crate) fn read_set(reply: &[redis::Value], leases: usize) -> Result<SetReply<'_>> {
    match reply {
        [redis::Value::Int(1), tokens @ ..] if tokens.len() == leases => {
            Ok(SetReply::Granted(tokens))
        }
        [
            redis::Value::Int(0),
            redis::Value::Int(held),
            redis::Value::Int(pttl),
        ] => Ok(SetReply::Held {
            at: usize::try_from(*held).ok().and_then(|i| i.checked_sub(1)),
            pttl: busy(*pttl),
        }),
        other => Err(unexpected_acquire(other)),
    }
}

/// The value a fenced lease of a set holds: `owner:token`.
pub(crate) fn fenced_value(owner: &OwnerToken, token: &FencingToken) -> String {
    format!("{}:{token}", owner.as_str())
}

/// The keys and arguments of one `multi_acquire` call for `owner`: the lease
/// keys, then (for fenced leases) their counters in the same order.
pub(crate) fn acquire_call<'a>(
    leases: &[&'a str],
    fences: &[&'a str],
    owner: &'a str,
    ttl_ms: &'a str,
) -> (Vec<&'a str>, [&'a str; 3]) {
    let kind = if fences.is_empty() { "plain" } else { "fenced" };
    let keys = leases.iter().chain(fences).copied().collect();
    (keys, [owner, ttl_ms, kind])
}

/// Releases `guards` in turn (each as its `Drop` does).
fn release_all<K: Kind>(guards: impl Iterator<Item = LeaseGuard<K>>) {
    for guard in guards {
        let key = guard.key().to_owned();
        match guard.release() {
            Ok(outcome) => log::debug!("released {key:?} of an incomplete set: {outcome:?}"),
            Err(e) => log::warn!("releasing {key:?} of an incomplete set failed: {e}"),
        }
    }
}

impl<K: Kind> fmt::Debug for MultiLease<K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut list = f.debug_list();
        for lease in &self.members {
            list.entry(lease);
        }
        list.finish()
    }
}

/// A held set of leases: one [`LeaseGuard`] per key, answering as one.
///
/// The set is *lost* as soon as any of its leases is (see
/// [Loss](LeaseGuard#loss)): [`is_lost`](MultiGuard::is_lost) turns true and
/// the [`lost_signal`](MultiGuard::lost_signal) closes then, and
/// [`remaining_estimate`](MultiGuard::remaining_estimate) is the least of the
/// members'. Dropping it releases every lease (each one best-effort command,
/// bounded by the node timeout, never panics);
/// [`release`](MultiGuard::release) does the same and reports what each found.
#[must_use = "if unused the leases are released immediately"]
pub struct MultiGuard<K: Kind> {
    dep: Arc<Deployment>,
    /// In the caller's order.
    members: Vec<LeaseGuard<K>>,
    signal: OnceLock<Receiver<()>>,
}

impl<K: Kind> MultiGuard<K> {
    fn new(dep: Arc<Deployment>, members: impl IntoIterator<Item = LeaseGuard<K>>) -> Self {
        MultiGuard {
            dep,
            members: members.into_iter().collect(),
            signal: OnceLock::new(),
        }
    }

    /// The physical keys of the set, in the order they were given. Does not
    /// block.
    pub fn keys(&self) -> impl Iterator<Item = &str> {
        self.members.iter().map(LeaseGuard::key)
    }

    /// The guard of each lease, in the order the keys were given: each has
    /// the verbs of a single guard (a renewal or release of one member alone
    /// is the caller's choice; the set is lost when any member is).
    pub fn members(&self) -> &[LeaseGuard<K>] {
        &self.members
    }

    /// The first key of the set, as it was given. Does not block.
    pub fn key(&self) -> &str {
        self.members[0].key()
    }

    /// Whether the set must be assumed lost: whether any of its leases is
    /// (see [Loss](LeaseGuard#loss)). Reads the lost flags and the monotonic
    /// clock; does not block or touch the network. Once true, stays true.
    pub fn is_lost(&self) -> bool {
        self.members.iter().any(LeaseGuard::is_lost)
    }

    /// A channel that never carries a message and disconnects the moment
    /// any lease of the set is lost or released, for `crossbeam_channel::select!`.
    ///
    /// The first call has the coordinator's renewal thread watch every lease,
    /// so that the channel closes at the earliest loss deadline even if nobody
    /// calls [`is_lost`](MultiGuard::is_lost); that thread never waits on the
    /// network. If it cannot be started, the set is flagged lost at once.
    pub fn lost_signal(&self) -> &Receiver<()> {
        self.signal.get_or_init(|| {
            let (tx, rx) = crossbeam_channel::bounded(0);
            let shared: Arc<SharedSignal> = Arc::new(parking_lot::Mutex::new(Some(tx)));
            let now = self.dep.now();
            for member in &self.members {
                // Starts the watch of each member's loss deadline.
                let _ = member.lost_signal();
                member.cell().close_on_loss(&shared, now);
            }
            rx
        })
    }

    /// How long the whole set can still be assumed held: the least of its
    /// leases' [`remaining_estimate`](LeaseGuard::remaining_estimate). Zero
    /// once lost. Does not touch the network.
    pub fn remaining_estimate(&self) -> Duration {
        self.members
            .iter()
            .map(LeaseGuard::remaining_estimate)
            .min()
            .unwrap_or_default()
    }

    /// Asks the servers whether every lease of the set is still held: one
    /// round trip per lease, each bounded by the node timeout. Returns
    /// `Some(the least server-side TTL)` when all are held, `None` (and the
    /// set is lost) when any is gone or someone else's; each member's bound
    /// shrinks to what its server has left, as
    /// [`LeaseGuard::verify_still_held`] does.
    ///
    /// # Errors
    /// The first transport or server error; the leases asked before it keep
    /// what their answers said.
    pub fn verify_still_held(&self) -> Result<Option<Duration>> {
        let mut least = Duration::MAX;
        for member in &self.members {
            match member.verify_still_held()? {
                Some(left) => least = least.min(left),
                None => return Ok(None),
            }
        }
        Ok(Some(least))
    }

    /// Sets every lease's expiry to `ttl` from now, if it is still held
    /// (never re-creating a missing key). One round trip per lease, each as
    /// [`LeaseGuard::reset_expiry`] (which waits for an extension of that
    /// lease already in flight); every lease is tried whatever the others
    /// answered.
    ///
    /// Returns `true` when every extension was confirmed, `false` when any
    /// lease was already lost (the set is then lost: stop the work).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a bad TTL (nothing sent); otherwise the
    /// first error a member's extension returned, after all were tried: the
    /// outcome of that one is unknown, and its guard assumes the worst of it.
    pub fn reset_expiry(&self, ttl: Duration) -> Result<bool> {
        self.dep.check_ttl(ttl)?;
        let mut held = true;
        let mut first_error = None;
        for member in &self.members {
            match member.reset_expiry(ttl) {
                Ok(extended) => held &= extended,
                Err(e) => {
                    first_error.get_or_insert(e);
                }
            }
        }
        match first_error {
            Some(e) => Err(e),
            None => Ok(held),
        }
    }

    /// Renews every lease of the set in the background until the returned
    /// [`MultiKeepAlive`] is dropped. Leases granted together are due
    /// together, and renewals due together on one server go out as one
    /// pipeline. The set is flagged lost when any renewal finds its lease
    /// gone, or at a lease's loss deadline when none of its renewals was
    /// confirmed in time. Does not block beyond one check of the ACL rights
    /// keep-alive needs (one round trip, once per coordinator).
    ///
    /// # Errors
    /// As [`LeaseGuard::keep_alive`]; nothing is renewed then.
    pub fn keep_alive(&self) -> Result<MultiKeepAlive<'_>> {
        let renewals = self
            .members
            .iter()
            .map(LeaseGuard::keep_alive)
            .collect::<Result<Vec<_>>>()?;
        Ok(MultiKeepAlive { renewals })
    }

    /// Releases every lease of the set that this guard still holds: one round
    /// trip per lease, each bounded by the node timeout. From the call on,
    /// the set counts as lost.
    ///
    /// Returns each lease's key and what its release found, in the order the
    /// keys were given ([`ReleaseOutcome::Uncertain`] when no reply came: that
    /// lease ends at its expiry at the latest); an error for a lease whose
    /// release could not be sent.
    pub fn release(self) -> Vec<(String, Result<ReleaseOutcome>)> {
        let mut members = self.members;
        members
            .drain(..)
            .map(|m| (m.key().to_owned(), m.release()))
            .collect()
    }
}

impl MultiGuard<Fenced> {
    /// Each lease's key and fencing token, in the order the keys were given.
    /// Does not block. Send the token of each resource with every write to it.
    pub fn fencing_tokens(&self) -> Vec<(&str, FencingToken)> {
        self.members
            .iter()
            .map(|m| (m.key(), m.fencing_token()))
            .collect()
    }

    /// The fencing token of the lease on `key`, given as to
    /// [`fenced_lock_all`](crate::Coordinator::fenced_lock_all) or as the
    /// physical key (with the prefix); `None` when the set has no such lease.
    /// Does not block.
    pub fn fencing_token(&self, key: &str) -> Option<FencingToken> {
        let prefixed = format!("{}{key}", self.dep.prefix);
        self.members
            .iter()
            .find(|m| m.key() == prefixed || m.key() == key)
            .map(|m| m.fencing_token())
    }
}

/// Renewal of every lease of a [`MultiGuard`] in the background, for as long
/// as it lives; see [`KeepAlive`] for each lease's. Dropping it stops the
/// renewals; it does not block.
#[must_use = "renewal stops as soon as the MultiKeepAlive is dropped"]
pub struct MultiKeepAlive<'a> {
    renewals: Vec<KeepAlive<'a>>,
}

impl MultiKeepAlive<'_> {
    /// Whether the set is lost (any lease of it). Does not block.
    pub fn is_lost(&self) -> bool {
        self.renewals.iter().any(KeepAlive::is_lost)
    }
}

impl fmt::Debug for MultiKeepAlive<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(&self.renewals).finish()
    }
}

/// The worst of the members' outcomes: `Released` only when every lease was.
fn worst(outcomes: &[ReleaseOutcome]) -> ReleaseOutcome {
    let rank = |o: &ReleaseOutcome| match o {
        ReleaseOutcome::Released => 0,
        ReleaseOutcome::Expired => 1,
        ReleaseOutcome::TakenOver => 2,
        _ => 3,
    };
    outcomes
        .iter()
        .copied()
        .max_by_key(rank)
        .unwrap_or(ReleaseOutcome::Released)
}

impl<K: Kind> sealed::Sealed for MultiGuard<K> {}

/// The set as one guard: each verb is the inherent method of the same name,
/// except `release`, which answers with the worst member outcome
/// (`Uncertain`, then `TakenOver`, then `Expired`; `Released` only when every
/// lease was), or the first error after every lease was tried.
impl<K: Kind> Guard for MultiGuard<K> {
    type KeepAlive<'a> = MultiKeepAlive<'a>;

    fn key(&self) -> &str {
        MultiGuard::key(self)
    }
    fn is_lost(&self) -> bool {
        MultiGuard::is_lost(self)
    }
    fn lost_signal(&self) -> &Receiver<()> {
        MultiGuard::lost_signal(self)
    }
    fn remaining_estimate(&self) -> Duration {
        MultiGuard::remaining_estimate(self)
    }
    fn reset_expiry(&self, ttl: Duration) -> Result<bool> {
        MultiGuard::reset_expiry(self, ttl)
    }
    fn keep_alive(&self) -> Result<MultiKeepAlive<'_>> {
        MultiGuard::keep_alive(self)
    }
    fn release(self) -> Result<ReleaseOutcome> {
        let mut outcomes = Vec::new();
        let mut first_error = None;
        for (_, r) in MultiGuard::release(self) {
            match r {
                Ok(o) => outcomes.push(o),
                Err(e) => {
                    first_error.get_or_insert(e);
                }
            }
        }
        match first_error {
            Some(e) => Err(e),
            None => Ok(worst(&outcomes)),
        }
    }
}

impl<K: Kind> Verifiable for MultiGuard<K> {
    fn verify_still_held(&self) -> Result<Option<Duration>> {
        MultiGuard::verify_still_held(self)
    }
}

impl<K: Kind> fmt::Debug for MultiGuard<K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MultiGuard")
            .field("members", &self.members)
            .field("lost", &self.is_lost())
            .field("remaining_estimate", &self.remaining_estimate())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_set_releases_as_its_worst_member() {
        use ReleaseOutcome::*;
        assert_eq!(worst(&[Released, Released]), Released);
        assert_eq!(worst(&[Released, Expired]), Expired);
        assert_eq!(worst(&[TakenOver, Expired, Released]), TakenOver);
        assert_eq!(worst(&[Expired, Uncertain, TakenOver]), Uncertain);
    }
}
