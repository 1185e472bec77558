//! `Election`: leader election on one deployment, as a fenced lease whose
//! fencing token is the leader's term, and the value the leader advertises
//! beside it.
//!
//! After etcd's `concurrency.Election` (campaign, proclaim, resign, leader,
//! observe) and Curator's `LeaderLatch`, on the lease machinery every other
//! primitive uses: a campaign is a fenced acquire whose script also writes the
//! value key, a [`Leadership`] is a [`FencedGuard`], and
//! [`observe`](Election::observe) waits like an acquire does, woken by
//! invalidations of the election's keys (Martin Kleppmann, "How to do
//! distributed locking", 2016, for why the term must fence the leader's
//! writes).
//!
//! Keys, for an election named `N` (which carries a hash tag): `N:leader` (the
//! lease, `owner:term`, with the TTL), `N:term` (the fence counter, never
//! expires) and `N:value` (`term:value`, never expires; it counts only while
//! the lease holds the same term, so one left behind by an earlier leader is
//! never read as the current one's).

use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::Receiver;

use crate::cancel::CancelToken;
use crate::conn::{Conn, Connect};
use crate::error::{Error, Result};
use crate::guard::{Fencing, Guard, ReleaseOutcome, Verifiable, sealed};
use crate::keys;
use crate::lease::acquire::Lease;
use crate::lease::deployment::{Deployment, bad_key_in};
use crate::lease::fenced::{FencedGuard, FencedSpec};
use crate::lease::guard::KeepAlive;
use crate::lease::kind::Fenced;
use crate::lease::parse_token;
use crate::runtime::backoff::failure_pause;
use crate::runtime::waiters::{self, Attempt, Failures, Order, WaitFor};
use crate::scripts;
use crate::token::FencingToken;

/// A leader election on one deployment. Made by
/// [`Coordinator::election`](crate::Coordinator::election); cheap to clone.
///
/// Contenders [`campaign`](Election::campaign) with the value they want to
/// advertise (an address, a node name); the one that wins gets a
/// [`Leadership`], a fenced lease whose fencing token is its *term*: strictly
/// greater for every later leader. Everyone can read the current leader's
/// value and term ([`leader`](Election::leader)) or follow every change
/// ([`observe`](Election::observe)).
///
/// # What it guarantees
///
/// At most one *non-lost* leadership at a time, under the same assumptions as
/// every lease of this crate (see [Lease loss](crate#lease-loss)): a leader
/// that paused or lost its connection is flagged lost *before* the server's
/// expiry lets another contender win. What a paused leader does after it wakes
/// up and before it looks is fenced by its term: give the term with every write
/// to the resource the leader controls, and have the resource refuse terms
/// lower than the highest it accepted. Like every single-deployment primitive,
/// it is only as monotonic as the term counter's history (a failover to a
/// replica that missed increments, a restart without persistence, eviction).
///
/// # Why not on a Redlock group
///
/// A term is a fencing token, and fencing tokens need one linearisable counter
/// that every grant increments. A [`RedlockGroup`](crate::RedlockGroup) has no
/// such counter: each node would keep its own, a majority of nodes can grant
/// while the others fall behind, and a node that restarts without its data can
/// hand out a term again, so two leaders could carry the same term or a later
/// leader a lower one. Taking the maximum over a majority does not cure it (two
/// overlapping majorities can each see a different maximum while a grant is
/// in flight). Without a trustworthy term there is nothing to fence a
/// paused leader with, so this crate offers elections on one deployment only;
/// for a quorum, use consensus (etcd, ZooKeeper, Consul).
#[derive(Clone)]
#[must_use = "an election handle campaigns for nothing until a campaign verb is called"]
pub struct Election {
    dep: Arc<Deployment>,
    name: String,
    /// Lease, term counter, value.
    keys: [String; 3],
}

/// The current leader of an [`Election`], as [`leader`](Election::leader)
/// and [`observe`](Election::observe) report it.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct Leader {
    /// The leader's term: the fencing token of its grant.
    pub term: FencingToken,
    /// The value it advertises (its campaign's, or its last
    /// [`proclaim`](Leadership::proclaim)ed one), or `None` when the lease was
    /// set by something else than a campaign (such as a
    /// [`FencedLock`](crate::FencedLock) on the same keys).
    pub value: Option<String>,
}

/// What one read of the election's keys found, and how long the leader's
/// lease has left on the server (`None`: no leader, or no expiry).
struct Read {
    leader: Option<Leader>,
    pttl: Option<Duration>,
}

impl Election {
    pub(crate) fn new(dep: &Arc<Deployment>, name: &str) -> Result<Election> {
        let base = keys::physical_base(&dep.prefix, name, "election name")?;
        Ok(Election {
            dep: dep.clone(),
            name: name.to_owned(),
            keys: [
                format!("{base}:leader"),
                format!("{base}:term"),
                format!("{base}:value"),
            ],
        })
    }

    /// The election's name, as given.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The physical lease key (`owner:term` while someone leads).
    pub fn lease_key(&self) -> &str {
        &self.keys[0]
    }

    /// The physical term counter key (never expires, never deleted).
    pub fn term_key(&self) -> &str {
        &self.keys[1]
    }

    /// The physical key of the advertised value (`term:value`).
    pub fn value_key(&self) -> &str {
        &self.keys[2]
    }

    /// The fenced lease a campaign for `value` takes.
    fn lease(&self, value: &str) -> Lease<Fenced> {
        let [lease, term, value_key] = self.keys.clone();
        Lease::new(
            self.dep.clone(),
            Arc::new(FencedSpec::advertising(
                lease,
                term,
                value_key,
                value.to_owned(),
            )),
        )
    }

    fn leadership(&self, guard: FencedGuard) -> Leadership {
        Leadership {
            guard,
            election: self.clone(),
        }
    }

    /// One campaign attempt: leads with `value` if nobody does. Blocks for at
    /// most the node timeout (plus the connect timeout when a connection must
    /// be opened). The value is set in the same script call as the lease, so
    /// nobody ever reads this term with another value.
    ///
    /// Returns `Ok(Some(leadership))` when elected, `Ok(None)` when someone
    /// else leads.
    ///
    /// # Errors
    /// As [`Lease::try_acquire`]: [`Error::InvalidArgument`] for a bad TTL
    /// (nothing sent); [`Error::BadKey`] when a key holds something else
    /// (nothing changed); [`Error::FencingRegression`] for a term not above
    /// one already seen (the lease is released); transport errors when no
    /// reply came (what the attempt may have set is deleted in the
    /// background).
    pub fn try_campaign(&self, value: &str, ttl: Duration) -> Result<Option<Leadership>> {
        Ok(self
            .lease(value)
            .try_acquire(ttl)?
            .map(|g| self.leadership(g)))
    }

    /// Campaigns for up to `wait`: woken when the leader's lease changes
    /// (client tracking) or at its expiry, as every acquire (see
    /// [Acquiring](Lease#acquiring)). A zero wait is exactly one attempt.
    ///
    /// Returns `Ok(None)` when the wait ran out while someone else led.
    ///
    /// # Errors
    /// As [`try_campaign`](Election::try_campaign); failures that may pass
    /// are ridden out, and returned only when the wait ran out after one.
    pub fn campaign_timeout(
        &self,
        value: &str,
        ttl: Duration,
        wait: Duration,
    ) -> Result<Option<Leadership>> {
        Ok(self
            .lease(value)
            .acquire_timeout(ttl, wait)?
            .map(|g| self.leadership(g)))
    }

    /// Campaigns until elected or `cancel` is cancelled; see
    /// [`campaign_timeout`](Election::campaign_timeout) for what wakes it.
    ///
    /// # Errors
    /// [`Error::Cancelled`] on cancellation (a grant to an attempt in flight
    /// then is given back); permanent errors as for
    /// [`try_campaign`](Election::try_campaign). Failures that may pass do not
    /// end it.
    pub fn campaign(&self, value: &str, ttl: Duration, cancel: &CancelToken) -> Result<Leadership> {
        self.lease(value)
            .acquire(ttl, cancel)
            .map(|g| self.leadership(g))
    }

    /// Campaigns until elected, `deadline` passes (`Ok(None)`) or `cancel` is
    /// cancelled (`Err(Cancelled)`).
    ///
    /// # Errors
    /// As [`campaign`](Election::campaign) and
    /// [`campaign_timeout`](Election::campaign_timeout).
    pub fn campaign_until(
        &self,
        value: &str,
        ttl: Duration,
        deadline: Instant,
        cancel: &CancelToken,
    ) -> Result<Option<Leadership>> {
        Ok(self
            .lease(value)
            .acquire_until(ttl, deadline, cancel)?
            .map(|g| self.leadership(g)))
    }

    /// The current leader: its term and value, or `None` when nobody leads
    /// (a lease that expired on the server counts as none). One read-only
    /// script call, at most the node timeout (plus the connect timeout when a
    /// connection must be opened; once more on a fresh connection when a
    /// pooled one turned out dead).
    ///
    /// # Errors
    /// Transport errors (never turned into "no leader"); [`Error::BadKey`]
    /// when the lease key holds something that is not a leader's lease.
    pub fn leader(&self) -> Result<Option<Leader>> {
        let deadline = self.dep.now() + self.dep.node_timeout();
        self.dep
            .on_key_fresh_retry(
                &self.keys[0],
                deadline,
                Connect::Own,
                |conn, deadline| self.read(conn, deadline),
                |_, _| {},
            )
            .map(|r| r.leader)
    }

    /// Follows the leader: a blocking iterator that yields the current leader
    /// (or `None`: nobody leads) first, then every change — a new leader, a
    /// new value [`proclaim`](Leadership::proclaim)ed, nobody leading any
    /// more. See [`LeaderChanges`] for what wakes it and how it fails.
    pub fn observe(&self) -> LeaderChanges {
        LeaderChanges {
            election: self.clone(),
            last: None,
            highest: None,
            failures: 0,
            cancel: None,
        }
    }

    /// Reads the election's keys once on `conn` (arming client tracking for
    /// both when the connection has it on).
    fn read(&self, conn: &mut Conn, deadline: Instant) -> Result<Read> {
        let keys = [self.keys[0].as_str(), self.keys[2].as_str()];
        let reply: Vec<redis::Value> = conn
            .script(&scripts::ELECTION_LEADER, &keys, &[], "leader", deadline)
            .map_err(|e| bad_key_in(e, &keys))?;
        let unexpected = || Error::UnexpectedReply {
            op: "leader",
            reply: format!("{reply:?}"),
        };
        match reply.as_slice() {
            [redis::Value::Int(0)] => Ok(Read {
                leader: None,
                pttl: None,
            }),
            [redis::Value::Int(1), term, value, redis::Value::Int(pttl)] => {
                let term = parse_token(term, "leader")?;
                let value = match value {
                    redis::Value::Nil => None,
                    redis::Value::BulkString(b) => Some(String::from_utf8_lossy(b).into_owned()),
                    redis::Value::SimpleString(s) => Some(s.clone()),
                    _ => return Err(unexpected()),
                };
                Ok(Read {
                    leader: Some(Leader { term, value }),
                    pttl: u64::try_from(*pttl).ok().map(Duration::from_millis),
                })
            }
            _ => Err(unexpected()),
        }
    }
}

impl fmt::Debug for Election {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Election")
            .field("lease_key", &self.keys[0])
            .field("term_key", &self.keys[1])
            .field("value_key", &self.keys[2])
            .finish()
    }
}

/// Being the leader of an [`Election`]: a [`FencedGuard`] whose fencing token
/// is the term, with the value it advertises.
///
/// Every guard method is the guard's own ([`as_guard`](Leadership::as_guard)
/// gives the guard itself): loss is flagged at the loss deadline or when a
/// command finds the lease gone (see [Loss](crate::LeaseGuard#loss)), and is
/// permanent. Dropping it resigns (one best-effort release, bounded by the node
/// timeout, never panics); [`resign`](Leadership::resign) does the same and
/// reports what it found.
#[must_use = "if unused the leadership is resigned immediately"]
pub struct Leadership {
    guard: FencedGuard,
    election: Election,
}

impl Leadership {
    /// The term: the fencing token of this grant, strictly greater than every
    /// earlier leader's. Give it with every write to what the leader controls.
    pub fn term(&self) -> FencingToken {
        self.guard.fencing_token()
    }

    /// The election this leadership belongs to.
    pub fn election(&self) -> &Election {
        &self.election
    }

    /// The guard underneath, for code written against
    /// [`LeaseGuard`](crate::LeaseGuard).
    pub fn as_guard(&self) -> &FencedGuard {
        &self.guard
    }

    /// Advertises `value` instead of the current one, if this leadership still
    /// holds the lease: one script call that checks the lease's owner and term
    /// and sets the value in the same step, at most the node timeout (once
    /// more on a fresh connection when a pooled one turned out dead; setting
    /// the same value twice is harmless).
    ///
    /// Returns `true` when set; `false` when the leadership is lost — nothing
    /// is sent when it was already lost here, and when the server found the
    /// lease gone or held by another the guard is flagged lost — and the value
    /// is left as it was. Like a verification, a confirmed proclamation that
    /// finds less time left on the server than the guard counted on shrinks
    /// the guard's bound.
    ///
    /// # Errors
    /// [`Error::BadKey`] when the value key holds something else (nothing
    /// changed); transport errors, after which the value may or may not have
    /// changed (either way it belongs to this term, and counts only while
    /// this term leads).
    pub fn proclaim(&self, value: &str) -> Result<bool> {
        if self.guard.is_lost() {
            return Ok(false);
        }
        let keys = [self.election.lease_key(), self.election.value_key()];
        let term = self.term().to_string();
        let args = [self.guard.lease_value(), term.as_str(), value];
        let held = self
            .guard
            .run_check(&scripts::ELECTION_PROCLAIM, &keys, &args, "proclaim")?;
        Ok(held.is_some())
    }

    /// Gives the leadership up: deletes the lease if it is still ours, so
    /// that a waiting contender is woken and can win at once. One round trip,
    /// at most the node timeout; from the call on, this leadership counts as
    /// lost.
    ///
    /// # Errors
    /// As [`LeaseGuard::release`](crate::LeaseGuard::release): `Uncertain` (no
    /// reply) is an `Ok` outcome, and the lease then ends at its expiry at the
    /// latest.
    pub fn resign(self) -> Result<ReleaseOutcome> {
        self.guard.release()
    }

    /// Whether the leadership is lost; see
    /// [`LeaseGuard::is_lost`](crate::LeaseGuard::is_lost). Does not block.
    pub fn is_lost(&self) -> bool {
        self.guard.is_lost()
    }

    /// A channel that disconnects when the leadership is lost or resigned; see
    /// [`LeaseGuard::lost_signal`](crate::LeaseGuard::lost_signal).
    pub fn lost_signal(&self) -> &Receiver<()> {
        self.guard.lost_signal()
    }

    /// Renews the lease in the background until the returned [`KeepAlive`]
    /// is dropped; see [`LeaseGuard::keep_alive`](crate::LeaseGuard::keep_alive).
    ///
    /// # Errors
    /// As [`LeaseGuard::keep_alive`](crate::LeaseGuard::keep_alive).
    pub fn keep_alive(&self) -> Result<KeepAlive<'_>> {
        self.guard.keep_alive()
    }

    /// Sets the lease's expiry to `ttl` from now if it is still held; see
    /// [`LeaseGuard::reset_expiry`](crate::LeaseGuard::reset_expiry).
    ///
    /// # Errors
    /// As [`LeaseGuard::reset_expiry`](crate::LeaseGuard::reset_expiry).
    pub fn reset_expiry(&self, ttl: Duration) -> Result<bool> {
        self.guard.reset_expiry(ttl)
    }

    /// How long the leadership can still be assumed held; see
    /// [`LeaseGuard::remaining_estimate`](crate::LeaseGuard::remaining_estimate).
    pub fn remaining_estimate(&self) -> Duration {
        self.guard.remaining_estimate()
    }

    /// Asks the server whether this leadership still holds the lease; see
    /// [`LeaseGuard::verify_still_held`](crate::LeaseGuard::verify_still_held).
    ///
    /// # Errors
    /// As [`LeaseGuard::verify_still_held`](crate::LeaseGuard::verify_still_held).
    pub fn verify_still_held(&self) -> Result<Option<Duration>> {
        self.guard.verify_still_held()
    }
}

impl sealed::Sealed for Leadership {}

/// A leadership is a guard like any other: [`release`](Guard::release) is
/// [`resign`](Leadership::resign) and the fencing token is the term.
impl Guard for Leadership {
    type KeepAlive<'a> = KeepAlive<'a>;

    fn key(&self) -> &str {
        self.guard.key()
    }
    fn is_lost(&self) -> bool {
        Leadership::is_lost(self)
    }
    fn lost_signal(&self) -> &Receiver<()> {
        Leadership::lost_signal(self)
    }
    fn remaining_estimate(&self) -> Duration {
        Leadership::remaining_estimate(self)
    }
    fn reset_expiry(&self, ttl: Duration) -> Result<bool> {
        Leadership::reset_expiry(self, ttl)
    }
    fn keep_alive(&self) -> Result<KeepAlive<'_>> {
        Leadership::keep_alive(self)
    }
    fn release(self) -> Result<ReleaseOutcome> {
        self.resign()
    }
}

impl Fencing for Leadership {
    fn fencing_token(&self) -> FencingToken {
        self.term()
    }
}

impl Verifiable for Leadership {
    fn verify_still_held(&self) -> Result<Option<Duration>> {
        Leadership::verify_still_held(self)
    }
}

impl fmt::Debug for Leadership {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Leadership")
            .field("lease_key", &self.election.lease_key())
            .field("term", &self.term())
            .field("lost", &self.is_lost())
            .field("remaining_estimate", &self.remaining_estimate())
            .finish()
    }
}

/// The leader changes of an [`Election`], from
/// [`observe`](Election::observe): a blocking iterator of
/// `Result<Option<Leader>>`, where `Ok(None)` means nobody leads.
///
/// The first item is the current state; each later one differs from the item
/// before it (another term, another value, or leader ↔ nobody). Between items
/// it sleeps until one of the election's keys changes (client tracking, as
/// every wait of this crate: one invalidation subscriber per server, no
/// polling) or the leader's lease reaches its expiry on the server (expiry
/// notifications can come late); only where tracking is unavailable (denied
/// by the ACL, or while the subscriber reconnects) does it poll, every
/// 50–150 ms. A change that comes and goes between two reads is not seen.
///
/// It never reports a term lower than one it reported: a read that finds one
/// (the term counter's history was lost: failover, restart without
/// persistence) yields [`Error::FencingRegression`] once, and the iterator goes
/// on waiting for a term above the highest it reported.
///
/// A read that fails (the server is down, a timeout) yields that error at once
/// rather than the last leader it knew; the next call tries again after a
/// short, growing pause (10 ms doubling to 1 s) and yields the state it then
/// finds, even if unchanged. A server that stops answering is noticed when a
/// read fails, or when the invalidation subscriber's ping goes unanswered (a
/// few seconds).
///
/// The iterator ends (`None`) only once the token given to
/// [`cancel_on`](LeaderChanges::cancel_on) is cancelled;
/// [`next_until`](LeaderChanges::next_until) also returns `None` when its
/// deadline passes with nothing to report.
pub struct LeaderChanges {
    election: Election,
    /// The last state read and reported (leader, or nobody), `None` before
    /// the first and after an error.
    last: Option<Option<Leader>>,
    /// The highest term reported.
    highest: Option<FencingToken>,
    /// Failed reads in a row.
    failures: u32,
    cancel: Option<CancelToken>,
}

impl LeaderChanges {
    /// Ends the iterator once `cancel` is cancelled (a blocked `next` returns
    /// `None` at once).
    pub fn cancel_on(mut self, cancel: CancelToken) -> Self {
        self.cancel = Some(cancel);
        self
    }

    /// The next change, waiting until `deadline` at most: `None` when the
    /// deadline passed with nothing to report, or on cancellation. A deadline
    /// already past makes one read.
    pub fn next_until(&mut self, deadline: Instant) -> Option<Result<Option<Leader>>> {
        self.next_change(Some(deadline))
    }

    fn next_change(&mut self, deadline: Option<Instant>) -> Option<Result<Option<Leader>>> {
        let never = crossbeam_channel::never();
        let cancelled = self.cancel.as_ref().map_or(&never, |c| c.receiver());
        if self.cancel.as_ref().is_some_and(CancelToken::is_cancelled) {
            return None;
        }
        if self.failures > 0 {
            let pause = self.election.dep.now() + failure_pause(self.failures);
            let wake = deadline.map_or(pause, |d| d.min(pause));
            crossbeam_channel::select! {
                recv(cancelled) -> _ => return None,
                recv(crossbeam_channel::at(wake)) -> _ => {}
            }
        }
        let dep = &self.election.dep;
        let keys = [
            self.election.keys[0].as_str(),
            self.election.keys[2].as_str(),
        ];
        let w = WaitFor {
            keys: &keys,
            deadline,
            cancel: self.cancel.as_ref(),
            attempt_timeout: dep.node_timeout(),
            settle: dep.connect_timeout,
            failures: Failures::Report,
            order: Order::Race,
        };
        let last = &self.last;
        let waited = waiters::wait_for(&*dep.topology, &w, |conn, d, _tracked| {
            let read = self.election.read(conn, d)?;
            if last.as_ref() == Some(&read.leader) {
                // Nothing new: sleep until a key changes or the lease's
                // expiry.
                return Ok(Attempt::Busy(read.pttl));
            }
            Ok(Attempt::Acquired(read.leader))
        });
        match waited.result {
            Ok(Some(leader)) => {
                self.failures = 0;
                if let (Some(l), Some(h)) = (&leader, self.highest)
                    && l.term < h
                {
                    // Reported once: the same state reads as nothing new.
                    self.last = Some(leader.clone());
                    return Some(Err(Error::FencingRegression {
                        fence_key: self.election.keys[1].clone(),
                        issued: l.term.get(),
                        seen: h.get(),
                    }));
                }
                if let Some(l) = &leader {
                    self.highest = Some(l.term);
                }
                self.last = Some(leader.clone());
                Some(Ok(leader))
            }
            Ok(None) | Err(Error::Cancelled) => None,
            Err(e) => {
                self.failures = self.failures.saturating_add(1);
                self.last = None;
                Some(Err(e))
            }
        }
    }
}

impl Iterator for LeaderChanges {
    type Item = Result<Option<Leader>>;

    /// Blocks until the next change (see [`LeaderChanges`]); `None` only on
    /// cancellation.
    fn next(&mut self) -> Option<Self::Item> {
        self.next_change(None)
    }
}

impl fmt::Debug for LeaderChanges {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LeaderChanges")
            .field("election", &self.election)
            .field("last", &self.last)
            .field("highest", &self.highest)
            .finish_non_exhaustive()
    }
}
