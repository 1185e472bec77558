//! `Semaphore`: at most N holders of one deployment, each holding a slot in
//! 0..N and a fencing token, every permit expiring on the server's clock.
//!
//! Three keys under one base key `B` (which carries the hash tag): `B:permits`,
//! a sorted set of `owner:slot:token` members scored by their expiry (server
//! `TIME`); `B:meta`, a hash `{capacity, fence}` that never expires and also
//! indexes each holder (`holder:<owner>`); and `B:slots`, a bitmap of the slots
//! taken, so that an acquire finds the owner's permit and the lowest free slot
//! without scanning the permits (every operation is O(log n)). The
//! capacity is stored beside the permits, so participants cannot silently
//! disagree on it, and every permit expires, so a crashed holder cannot leak
//! one. Each grant draws a token from the `fence` counter: per slot, tokens
//! strictly increase, so a resource that keeps the highest token it accepted
//! per slot never accepts more than N writers at once, even from holders that
//! paused past their expiry (Kleppmann's fencing, one counter for N slots).

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use crate::conn::{Conn, Connect};
use crate::error::{Error, Result};
use crate::keys;
use crate::lease::acquire::Lease;
use crate::lease::deployment::{Deployment, bad_key_in};
use crate::lease::guard::LeaseGuard;
use crate::lease::kind::{Acquire, Granted, Slot, Try, WaitKeys};
use crate::lease::{busy, parse_token, unexpected_acquire};
use crate::runtime::renewal::Ops;
use crate::runtime::waiters::Attempt;
use crate::scripts::{self, Script};
use crate::token::{FencingToken, OwnerToken, split_owner};

/// The largest capacity a [`Semaphore`] accepts.
const MAX_CAPACITY: u32 = 10_000;

/// At most `capacity` holders at once on one deployment. Made by
/// [`Coordinator::semaphore`](crate::Coordinator::semaphore); cheap to clone.
/// Its verbs are those of every [`Lease`] ([`try_acquire`](Lease::try_acquire),
/// [`acquire_timeout`](Lease::acquire_timeout),
/// [`acquire_deadline`](Lease::acquire_deadline), [`acquire`](Lease::acquire),
/// [`acquire_until`](Lease::acquire_until)); each grant is a [`Permit`].
///
/// # Model
///
/// - The capacity is stored beside the permits by the first acquire. A handle
///   that declares another one gets [`Error::CapacityMismatch`] from every
///   acquire and nothing changes; [`set_capacity`](Lease::set_capacity) is the
///   only way to change it. Lowering it drains: permits beyond the new
///   capacity are never revoked, they stay until released or expired, and new
///   ones wait until fewer than the capacity remain.
/// - Every permit expires by its own score on the server's clock (`TIME`), so
///   client clocks cannot move it and a crashed holder frees its permit at its
///   expiry while the others renew. Expired permits are pruned by every
///   acquire; an expired permit never comes back, not even on extend (the
///   guard is then lost).
/// - Each permit holds the lowest free slot in `0..capacity`
///   ([`Permit::slot`](LeaseGuard::slot)) and a fencing token
///   ([`Permit::fencing_token`](LeaseGuard::fencing_token)) from the
///   semaphore's counter: tokens strictly increase across all grants, hence
///   per slot. A resource that refuses, per slot, a token lower than the
///   highest it accepted never accepts more than `capacity` writers, even
///   from holders that paused past their expiry. A token not above one this
///   coordinator already saw is refused ([`Error::FencingRegression`], the
///   permit released).
///
/// # Waiting
///
/// A full semaphore is busy (`Ok(None)` from [`try_acquire`](Lease::try_acquire)).
/// A waiting acquire is woken by changes of the permit set (a release, a
/// prune) and of the hash (a raised capacity), and by a timer at the moment
/// enough permits would have expired by themselves for one to be free; an
/// expiring score sends no invalidation, hence the timer. Within one process,
/// waiters are woken one at a time in arrival order; see [`Lease`] for the
/// rest (failures ridden out, cancellation, clean-up after lost replies).
///
/// A [`RedlockGroup`](crate::RedlockGroup) offers no semaphore: the permit set
/// needs one authority that orders every grant.
///
/// # Errors
///
/// As for every [`Lease`], plus [`Error::CapacityMismatch`], and
/// [`Error::BadKey`] naming the key when one holds something else (a hash
/// with an expiry, a capacity or counter field that is not an integer
/// included); nothing is changed then.
pub type Semaphore = Lease<Slot>;

/// A held [`Semaphore`] permit: a [`LeaseGuard`] with every guard method, its
/// [`slot`](LeaseGuard::slot) and [`fencing_token`](LeaseGuard::fencing_token).
/// Dropping it releases the permit (best effort, bounded by the node timeout,
/// never panics).
pub type Permit = LeaseGuard<Slot>;

/// One unexpired permit, as [`Semaphore::holders`](Lease::holders) and
/// [`Coordinator::inspect`](crate::Coordinator::inspect) report it.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct PermitHolder {
    /// Its slot.
    pub slot: u32,
    /// Its fencing token.
    pub fencing_token: FencingToken,
    /// How long until it expires, on the server's clock, unless renewed.
    pub remaining: Duration,
    /// The owner id its acquire drew (random, one per acquire call).
    pub owner: String,
    /// Who holds it, as the handle that took it was told
    /// ([`with_holder`](Lease::with_holder)); `None` when it was not.
    pub holder: Option<String>,
}

impl Lease<Slot> {
    /// The largest capacity a semaphore accepts.
    pub const MAX_CAPACITY: u32 = MAX_CAPACITY;

    fn sem(&self) -> &SemSpec {
        self.spec()
            .as_any()
            .and_then(|s| s.downcast_ref::<SemSpec>())
            .expect("a semaphore is always made with its own spec")
    }

    /// The capacity this handle declares (and its clones), as given to
    /// [`Coordinator::semaphore`](crate::Coordinator::semaphore) or set since by
    /// [`set_capacity`](Lease::set_capacity) through it. Does not touch the
    /// network.
    pub fn capacity(&self) -> u32 {
        self.sem().capacity.load(Ordering::Relaxed)
    }

    /// The physical key of the permit set (`B:permits`).
    pub fn permits_key(&self) -> &str {
        &self.physical_keys()[0]
    }

    /// The physical key of the hash that stores the capacity and the fencing
    /// counter (`B:meta`). Never expire, evict or delete it.
    pub fn meta_key(&self) -> &str {
        &self.physical_keys()[1]
    }

    /// The physical key of the bitmap of the slots taken (`B:slots`).
    pub fn slots_key(&self) -> &str {
        &self.physical_keys()[2]
    }

    /// How many permits could be granted now: the stored capacity (this
    /// handle's while none is stored) minus the unexpired permits, at least 0.
    /// One round trip, which also prunes expired permits; at most the node
    /// timeout (plus the connect timeout when a connection must be opened).
    /// Only says what was true at one instant.
    ///
    /// # Errors
    /// [`Error::CapacityMismatch`] when the stored capacity is not this
    /// handle's; [`Error::BadKey`] for keys of the wrong type or content;
    /// transport and server errors.
    pub fn available(&self) -> Result<u32> {
        let (stored, holders) = self.status()?;
        let declared = self.capacity();
        let capacity = match stored {
            Some(stored) if stored != declared => {
                return Err(Error::CapacityMismatch {
                    stored,
                    requested: declared,
                });
            }
            Some(stored) => stored,
            None => declared,
        };
        let held = u32::try_from(holders.len()).unwrap_or(u32::MAX);
        Ok(capacity.saturating_sub(held))
    }

    /// The unexpired permits, soonest to expire first. One round trip, which
    /// also prunes expired permits; bounded as [`available`](Lease::available).
    /// Only says what was true at one instant.
    ///
    /// # Errors
    /// [`Error::BadKey`] for keys of the wrong type or content; transport and
    /// server errors.
    pub fn holders(&self) -> Result<Vec<PermitHolder>> {
        Ok(self.status()?.1)
    }

    /// Stores a new capacity, on purpose: the only way to change it. Lowering
    /// it drains (permits beyond it stay until released or expired, and new
    /// ones wait until fewer than the new capacity remain); raising it wakes
    /// waiters at once. From then on this handle and its clones declare the
    /// new capacity; every other participant must be given it too, or its
    /// acquires fail with [`Error::CapacityMismatch`] (change the participants'
    /// configuration first, then call this once). One round trip, bounded as
    /// [`available`](Lease::available).
    ///
    /// Returns the capacity stored before, `None` if there was none.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for 0 or more than
    /// [`MAX_CAPACITY`](Lease::MAX_CAPACITY) (nothing sent); [`Error::BadKey`]
    /// for keys of the wrong type or content (nothing changed); transport
    /// errors, after which the capacity may or may not have changed and this
    /// handle keeps declaring the old one.
    pub fn set_capacity(&self, capacity: u32) -> Result<Option<u32>> {
        check_capacity(capacity)?;
        let dep = self.deployment();
        let [permits, meta, _] = &self.sem().keys;
        let deadline = dep.now() + dep.node_timeout();
        let capacity_arg = capacity.to_string();
        self.sem().setting.store(capacity, Ordering::SeqCst);
        let previous: Result<i64> = dep
            .on_key(meta, deadline, Connect::Own, |conn, deadline| {
                conn.script(
                    &scripts::SEM_SET_CAPACITY,
                    &[meta, permits],
                    &[&capacity_arg],
                    "set capacity",
                    deadline,
                )
            })
            .0
            .map_err(|e| bad_key_in(e, &[meta, permits]));
        if previous.is_ok() {
            self.sem().capacity.store(capacity, Ordering::SeqCst);
        }
        self.sem().setting.store(0, Ordering::SeqCst);
        Ok(u32::try_from(previous?).ok())
    }

    fn status(&self) -> Result<(Option<u32>, Vec<PermitHolder>)> {
        let dep = self.deployment();
        let [permits, meta, slots] = &self.sem().keys;
        let deadline = dep.now() + dep.node_timeout();
        let reply: Vec<redis::Value> = dep
            .on_key(permits, deadline, Connect::Own, |conn, deadline| {
                conn.script(
                    &scripts::SEM_STATUS,
                    &[permits, meta, slots],
                    &[],
                    "semaphore status",
                    deadline,
                )
            })
            .0
            .map_err(|e| bad_key_in(e, &[permits, meta, slots]))?;
        parse_status(&reply)
    }
}

impl LeaseGuard<Slot> {
    /// The slot this permit holds, in `0..capacity`: the lowest that was free
    /// when it was granted. No other unexpired permit holds it.
    pub fn slot(&self) -> u32 {
        self.grant().0
    }
}

/// Refuses a capacity outside 1..=MAX_CAPACITY.
pub(crate) fn check_capacity(capacity: u32) -> Result<()> {
    if capacity == 0 || capacity > MAX_CAPACITY {
        return Err(Error::InvalidArgument(format!(
            "semaphore capacity {capacity} is outside 1..={MAX_CAPACITY}"
        )));
    }
    Ok(())
}

/// The keys and acquire script of a [`Semaphore`].
pub(crate) struct SemSpec {
    /// Permits, meta, slots.
    keys: [String; 3],
    /// The capacity this handle declares; shared by its clones.
    capacity: AtomicU32,
    /// The capacity a `set_capacity` through this handle is storing, 0 when
    /// none is on its way.
    setting: AtomicU32,
}

impl SemSpec {
    /// A spec over given keys, for the simulation's model servers.
    #[cfg(test)]
    pub(crate) fn from_keys(keys: [String; 3], capacity: u32) -> SemSpec {
        SemSpec {
            keys,
            capacity: AtomicU32::new(capacity),
            setting: AtomicU32::new(0),
        }
    }

    /// Calls `send` with an attempt's script, keys (permits, meta, slots)
    /// and arguments (owner, TTL in milliseconds, the capacity it declares).
    pub(crate) fn request<R>(
        &self,
        owner: &str,
        ttl: &str,
        capacity: u32,
        send: impl FnOnce(&'static Script, &[&str], &[&str]) -> R,
    ) -> R {
        let [permits, meta, slots] = &self.keys;
        send(
            &scripts::SEM_ACQUIRE,
            &[permits, meta, slots],
            &[owner, ttl, &capacity.to_string()],
        )
    }

    /// Reads the script's reply to an attempt of `owner` sent at `sent`:
    /// `{1, slot, token}` granted, `{0, pttl}` all permits held.
    pub(crate) fn read(
        &self,
        reply: &[redis::Value],
        owner: &str,
        sent: Instant,
    ) -> Result<Attempt<Granted<(u32, FencingToken)>>> {
        match reply {
            [redis::Value::Int(1), redis::Value::Int(slot), token] => {
                let token = parse_token(token, "acquire")?;
                let slot = u32::try_from(*slot).map_err(|_| Error::UnexpectedReply {
                    op: "acquire",
                    reply: format!("slot {slot}"),
                })?;
                Ok(Attempt::Acquired(Granted {
                    grant: (slot, token),
                    ops: Ops::member(
                        self.keys.to_vec(),
                        format!("{owner}:{slot}:{token}"),
                        &scripts::SEM_EXTEND,
                        &scripts::SEM_VERIFY,
                        &scripts::SEM_RELEASE,
                    ),
                    sent,
                }))
            }
            [redis::Value::Int(0), redis::Value::Int(hint)] => Ok(Attempt::Busy(busy(*hint))),
            other => Err(unexpected_acquire(other)),
        }
    }

    /// Checks the base key and capacity; nothing is sent.
    pub(crate) fn new(dep: &Deployment, base: &str, capacity: u32) -> Result<SemSpec> {
        check_capacity(capacity)?;
        let base = keys::physical_base(&dep.prefix, base, "semaphore base key")?;
        let keys = [
            format!("{base}:permits"),
            format!("{base}:meta"),
            format!("{base}:slots"),
        ];
        keys::same_slot(&keys[0], &keys[1])?;
        keys::same_slot(&keys[0], &keys[2])?;
        Ok(SemSpec {
            keys,
            capacity: AtomicU32::new(capacity),
            setting: AtomicU32::new(0),
        })
    }
}

/// Makes the [`Semaphore`] handle for `base`.
pub(crate) fn semaphore(dep: &Arc<Deployment>, base: &str, capacity: u32) -> Result<Semaphore> {
    let spec = SemSpec::new(dep, base, capacity)?;
    Ok(Lease::new(dep.clone(), Arc::new(spec)))
}

/// Reads `CAPMISMATCH <stored> <requested>`.
fn capacity_mismatch(e: Error, keys: &[String; 3]) -> Error {
    if let Error::Server { source, .. } = &e
        && source.code() == Some("CAPMISMATCH")
    {
        let mut numbers = source
            .detail()
            .unwrap_or_default()
            .split_whitespace()
            .map(str::parse::<u32>);
        if let (Some(Ok(stored)), Some(Ok(requested))) = (numbers.next(), numbers.next()) {
            return Error::CapacityMismatch { stored, requested };
        }
    }
    bad_key_in(e, &[&keys[0], &keys[1], &keys[2]])
}

/// `owner:slot:token` → the permit it names, with `remaining` to go.
pub(crate) fn parse_member(member: &str, remaining: Duration) -> Option<PermitHolder> {
    let mut parts = member.rsplitn(3, ':');
    let token = parts.next()?.parse().ok()?;
    let slot = parts.next()?.parse().ok()?;
    let (owner, holder) = split_owner(parts.next()?);
    Some(PermitHolder {
        slot,
        fencing_token: FencingToken(token),
        remaining,
        owner: owner.to_owned(),
        holder,
    })
}

/// Reads `{capacity or -1, count, member, remaining_ms, …}`.
fn parse_status(reply: &[redis::Value]) -> Result<(Option<u32>, Vec<PermitHolder>)> {
    let unexpected = || Error::UnexpectedReply {
        op: "semaphore status",
        reply: format!("{reply:?}"),
    };
    let [
        redis::Value::Int(capacity),
        redis::Value::Int(count),
        rest @ ..,
    ] = reply
    else {
        return Err(unexpected());
    };
    if usize::try_from(*count).ok() != Some(rest.len() / 2) || rest.len() % 2 != 0 {
        return Err(unexpected());
    }
    let holders = rest
        .chunks(2)
        .map(|pair| match pair {
            [redis::Value::BulkString(m), redis::Value::Int(left)] => parse_member(
                std::str::from_utf8(m).ok()?,
                Duration::from_millis(u64::try_from(*left).unwrap_or(0)),
            ),
            _ => None,
        })
        .collect::<Option<Vec<_>>>()
        .ok_or_else(unexpected)?;
    Ok((u32::try_from(*capacity).ok(), holders))
}

impl Acquire<(u32, FencingToken)> for SemSpec {
    fn keys(&self) -> &[String] {
        &self.keys
    }

    fn wait_keys(&self) -> WaitKeys<'_> {
        // A release changes both; a raised capacity, the hash.
        WaitKeys::two(&self.keys[0], &self.keys[1])
    }

    fn attempt(
        &self,
        dep: &Deployment,
        conn: &mut Conn,
        t: Try<'_>,
    ) -> Result<Attempt<Granted<(u32, FencingToken)>>> {
        let ttl = t.ttl_ms.to_string();
        let mut capacity = self.capacity.load(Ordering::Relaxed);
        let mut again = false;
        let (sent, reply) = loop {
            // A repeated grant to this owner (an earlier attempt's whose reply
            // was lost) has its expiry moved to ttl from now if that is later,
            // so it holds for ttl from this send at least: `sent` stands. A
            // second send (the capacity changed meanwhile) is timed anew.
            let sent = if again { dep.now() } else { t.sent };
            let reply = self
                .request(t.owner.as_str(), &ttl, capacity, |script, keys, args| {
                    conn.script(script, keys, args, "acquire", t.deadline)
                })
                .map_err(|e| capacity_mismatch(e, &self.keys));
            match reply {
                // This handle's own `set_capacity` stored a new capacity while
                // the attempt was on its way (a raise wakes waiters before the
                // handle learns its reply): the refused attempt changed
                // nothing, and goes once more with the capacity the handle is
                // changing to.
                Err(Error::CapacityMismatch { stored, .. })
                    if !again
                        && stored != capacity
                        && (stored == self.capacity.load(Ordering::SeqCst)
                            || stored == self.setting.load(Ordering::SeqCst)) =>
                {
                    again = true;
                    capacity = stored;
                }
                reply => break (sent, reply),
            }
        };
        let reply: Vec<redis::Value> = reply?;
        self.read(&reply, t.owner.as_str(), sent)
    }

    /// The counter is the hash's `fence` field; the hash's name identifies it.
    fn counter(&self) -> Option<&str> {
        Some(&self.keys[1])
    }

    fn clean_up(&self, owner: &OwnerToken) -> redis::Cmd {
        let [permits, meta, slots] = &self.keys;
        scripts::SEM_RELEASE.eval(&[permits, meta, slots], &[owner.as_str(), "prefix"])
    }

    fn debug(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Semaphore")
            .field("permits_key", &self.keys[0])
            .field("meta_key", &self.keys[1])
            .field("slots_key", &self.keys[2])
            .field("capacity", &self.capacity.load(Ordering::Relaxed))
            .finish()
    }

    fn as_any(&self) -> Option<&dyn std::any::Any> {
        Some(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn capacities_outside_the_range_are_refused() {
        assert!(check_capacity(0).is_err());
        assert!(check_capacity(MAX_CAPACITY + 1).is_err());
        assert!(check_capacity(u32::MAX).is_err());
        check_capacity(1).unwrap();
        check_capacity(MAX_CAPACITY).unwrap();
    }

    #[test]
    fn members_and_status_replies_parse() {
        let left = Duration::from_secs(1);
        let permit = parse_member("0123abcd:7:100000000000000", left).unwrap();
        assert_eq!(
            (permit.slot, permit.fencing_token, permit.owner.as_str()),
            (7, FencingToken(100_000_000_000_000), "0123abcd")
        );
        assert_eq!(permit.holder, None);
        let named = parse_member("0123456789abcdef0123456789abcdef@host%3A1:2:3", left).unwrap();
        assert_eq!(
            (named.owner.as_str(), named.holder.as_deref()),
            ("0123456789abcdef0123456789abcdef", Some("host:1"))
        );
        assert_eq!(parse_member("7:1", left), None);
        assert_eq!(parse_member("o:x:1", left), None);
        use redis::Value::{BulkString, Int};
        let reply = [
            Int(3),
            Int(2),
            BulkString(b"a:0:5".to_vec()),
            Int(900),
            BulkString(b"b:2:6".to_vec()),
            Int(-3),
        ];
        let (cap, holders) = parse_status(&reply).unwrap();
        assert_eq!(cap, Some(3));
        assert_eq!(holders.len(), 2);
        assert_eq!(holders[0].slot, 0);
        assert_eq!(holders[0].remaining, Duration::from_millis(900));
        assert_eq!(holders[1].fencing_token, FencingToken(6));
        assert_eq!(holders[1].remaining, Duration::ZERO);
        assert_eq!(parse_status(&[Int(-1), Int(0)]).unwrap(), (None, vec![]));
        assert!(parse_status(&[Int(3), Int(1)]).is_err());
    }

    #[test]
    fn a_capacity_mismatch_reply_becomes_its_own_error() {
        let keys = [
            "{s}:permits".to_owned(),
            "{s}:meta".to_owned(),
            "{s}:slots".to_owned(),
        ];
        let source = redis::parse_redis_value(b"-CAPMISMATCH 3 5\r\n")
            .unwrap()
            .extract_error()
            .unwrap_err();
        let e = Error::Server {
            op: "acquire",
            source,
        };
        assert!(matches!(
            capacity_mismatch(e, &keys),
            Error::CapacityMismatch {
                stored: 3,
                requested: 5
            }
        ));
    }
}
