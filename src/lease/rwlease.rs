//! `ReadWriteLease`: many readers or one fenced writer on one deployment, with
//! writer preference so that a steady stream of readers cannot starve writers.
//!
//! Four keys under one base key `B` (which carries the hash tag, so all four
//! share a cluster slot): `B:w` the writer's lease (`owner:token`, `PX`), `B:r`
//! the readers (a sorted set, each reader scored by its own expiry on the
//! server's clock), `B:q` the intents of waiting writers (a sorted set scored by
//! the intent's expiry) and `B:fence` the write counter, which never expires.
//! Writers are fenced as a [`FencedLock`](crate::FencedLock) is (Kleppmann,
//! "How to do distributed locking", 2016); readers learn the last write's token.

use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::conn::{Conn, Connect};
use crate::core::timing::Timing;
use crate::error::{Error, Result};
use crate::keys;
use crate::lease::acquire::Lease;
use crate::lease::deployment::{Deployment, bad_key_in};
use crate::lease::guard::LeaseGuard;
use crate::lease::kind::{Acquire, Granted, Read, Try, WaitKeys, Write};
use crate::lease::{busy, parse_token, token_grant, unexpected_acquire};
use crate::runtime::renewal::Ops;
use crate::runtime::waiters::Attempt;
use crate::scripts::{self, Script};
use crate::token::{FencingToken, OwnerToken};

/// The read side of a [`ReadWriteLease`]: its verbs are those of every
/// [`Lease`], and each grant is a [`ReadGuard`]. Cheap to clone.
///
/// A read attempt is busy while a writer holds the lease, and — under
/// [`Preference::Writer`] — while a waiting writer's intent holds new readers
/// back. A waiting reader is woken by changes of the writer's lease and of the
/// intents, and by a timer at the moment the writer's lease or the latest
/// intent would expire by itself.
pub type ReadLease = Lease<Read>;

/// The write side of a [`ReadWriteLease`]: its verbs are those of every
/// [`Lease`], and each grant is a [`WriteGuard`] with a fencing token. Cheap to
/// clone.
///
/// A write attempt is busy while another writer holds the lease or any reader
/// holds an unexpired read lease. Inside a wait (every verb but
/// [`try_acquire`](Lease::try_acquire)), every busy attempt after the first
/// (which is the plain one `try_acquire` makes, and follows at once when it
/// was not granted) records this writer's *intent*, which holds new readers back under [`Preference::Writer`]; the
/// intent is refreshed while the writer waits and withdrawn when the wait ends
/// without the lease (timed out, cancelled, failed), which wakes the readers
/// it held back. The withdrawal fits in the wait's
/// [time bound](Lease#time-bounds) (its deadline plus one attempt): when the
/// server does not answer in that time, the wait returns anyway and the
/// withdrawal is sent in the background until the intent would have expired
/// by itself. A waiting writer is woken by changes of the writer's lease and
/// of the reader set, and by a timer at the moment the current writer's lease
/// or the last reader would expire by itself (or its intent needs refreshing).
pub type WriteLease = Lease<Write>;

/// A held read lease and the write epoch it saw
/// ([`write_epoch`](LeaseGuard::write_epoch)): a [`LeaseGuard`] with every
/// guard method. It expires by its own score, whatever the other readers do.
/// Dropping it releases it (best effort, bounded by the node timeout, never
/// panics).
pub type ReadGuard = LeaseGuard<Read>;

/// A held write lease and its fencing token
/// ([`fencing_token`](LeaseGuard::fencing_token)): a [`LeaseGuard`] with every
/// guard method. Dropping it releases it (best effort, bounded by the node
/// timeout, never panics).
pub type WriteGuard = LeaseGuard<Write>;

/// Which side a [`ReadWriteLease`] lets go first when both wait. Every
/// participant of one lease should use the same; a reader follows its own
/// handle's preference.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Preference {
    /// A waiting writer holds new readers back (current readers finish), so
    /// writers are not starved by readers that keep overlapping. The default.
    #[default]
    Writer,
    /// Readers ignore waiting writers, and writers record no intent: readers
    /// never wait for a writer that does not hold the lease yet, but a stream
    /// of overlapping readers can keep writers out indefinitely.
    Reader,
}

impl Preference {
    fn as_arg(self) -> &'static str {
        match self {
            Preference::Writer => "writer",
            Preference::Reader => "reader",
        }
    }
}

/// Many readers or one writer on one deployment. Made by
/// [`Coordinator::read_write_lease`](crate::Coordinator::read_write_lease) or
/// [`Coordinator::read_write_lease_with`](crate::Coordinator::read_write_lease_with);
/// cheap to clone.
///
/// [`read`](ReadWriteLease::read) and [`write`](ReadWriteLease::write) give the
/// two sides, each with the same five verbs as every primitive
/// ([`try_acquire`](Lease::try_acquire), [`acquire_timeout`](Lease::acquire_timeout),
/// [`acquire_deadline`](Lease::acquire_deadline), [`acquire`](Lease::acquire),
/// [`acquire_until`](Lease::acquire_until)); see [`Lease`] for how they wait,
/// what they ride out and what they return.
///
/// # Model
///
/// - Any number of readers share the lease; a writer excludes readers and
///   other writers. Every lease expires: each reader by its own score on the
///   server's clock (`TIME`), so a crashed reader stops counting at its own
///   expiry while the others renew, and client clocks cannot move it.
/// - Writers are fenced exactly like a [`FencedLock`](crate::FencedLock): each
///   grant increments the persistent counter `B:fence` and carries the new
///   token ([`WriteGuard::fencing_token`](LeaseGuard::fencing_token)); a token
///   not above one this coordinator already saw is refused
///   ([`Error::FencingRegression`], the lease released). Readers get the
///   *write epoch* ([`ReadGuard::write_epoch`](LeaseGuard::write_epoch)): the
///   token of the last writer, so data stamped with a higher token was written
///   after the read lease was granted.
/// - Under [`Preference::Writer`] (the default) a writer that waits records an
///   intent that holds back *new* readers; current readers are never revoked.
///   The intent lives `min(ttl, max(3 × node timeout, 1 s))`, is refreshed
///   while the writer waits, and is withdrawn when its wait ends without the
///   lease — waking the readers it held back — or dropped when it gets the
///   lease. A waiting writer that crashes holds readers back for at most the
///   intent's lifetime. [`try_acquire`](Lease::try_acquire) of a writer records
///   no intent.
///
/// # What it does not do
///
/// No upgrade from read to write, no downgrade, no reentrancy. An upgrade
/// would wait for the other readers while holding a read lease, so two readers
/// upgrading at once would each wait for the other until their leases expired;
/// release the read lease and acquire the write lease instead (and check the
/// write epoch against the data when it matters). A downgrade would hand a
/// fenced writer's lease to an unfenced reader without a gap, which a resource
/// checking tokens could not tell from a stale writer. Each acquire is a new
/// owner, so a second acquire by the holder is simply another participant: a
/// writer that acquires again waits for itself until its first lease ends.
///
/// A [`RedlockGroup`](crate::RedlockGroup) offers no reader/writer lease: the
/// reader set and the intents need one authority that orders every change.
///
/// # Errors
///
/// As for every [`Lease`], plus [`Error::BadKey`] naming the key when one of
/// the four holds something else (a fence counter with an expiry or a
/// non-integer value included); nothing is changed then.
#[derive(Clone)]
#[must_use = "a lease handle takes nothing until `read()` or `write()` and an acquire verb are called"]
pub struct ReadWriteLease {
    read: ReadLease,
    write: WriteLease,
    preference: Preference,
}

impl ReadWriteLease {
    pub(crate) fn new(
        dep: &Arc<Deployment>,
        base: &str,
        preference: Preference,
    ) -> Result<ReadWriteLease> {
        let base = keys::physical_base(&dep.prefix, base, "read/write lease base key")?;
        let keys = [
            format!("{base}:w"),
            format!("{base}:r"),
            format!("{base}:q"),
            format!("{base}:fence"),
        ];
        for key in &keys[1..] {
            keys::same_slot(&keys[0], key)?;
        }
        Ok(ReadWriteLease {
            read: Lease::new(
                dep.clone(),
                Arc::new(ReadSpec::new(keys.clone(), preference)),
            ),
            write: Lease::new(
                dep.clone(),
                Arc::new(WriteSpec::new(keys, preference, dep.timing())),
            ),
            preference,
        })
    }

    /// The read side: a handle whose verbs give [`ReadGuard`]s. Does not block.
    pub fn read(&self) -> ReadLease {
        self.read.clone()
    }

    /// The write side: a handle whose verbs give [`WriteGuard`]s. Does not block.
    pub fn write(&self) -> WriteLease {
        self.write.clone()
    }

    /// Which side goes first when both wait.
    pub fn preference(&self) -> Preference {
        self.preference
    }

    /// The physical key of the writer's lease (`B:w`).
    pub fn writer_key(&self) -> &str {
        &self.read.physical_keys()[0]
    }

    /// The physical key of the reader set (`B:r`).
    pub fn readers_key(&self) -> &str {
        &self.read.physical_keys()[1]
    }

    /// The physical key of the waiting writers' intents (`B:q`).
    pub fn intents_key(&self) -> &str {
        &self.read.physical_keys()[2]
    }

    /// The physical key of the write counter (`B:fence`). Never expire, evict,
    /// reset or delete it.
    pub fn fence_key(&self) -> &str {
        &self.read.physical_keys()[3]
    }
}

impl fmt::Debug for ReadWriteLease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ReadWriteLease")
            .field("writer_key", &self.writer_key())
            .field("readers_key", &self.readers_key())
            .field("intents_key", &self.intents_key())
            .field("fence_key", &self.fence_key())
            .field("preference", &self.preference)
            .finish()
    }
}

impl LeaseGuard<Read> {
    /// The write epoch: the fencing token of the last writer granted before
    /// this read lease (0 if none ever was). Data stamped with a higher token
    /// was written after this read lease was granted.
    pub fn write_epoch(&self) -> FencingToken {
        *self.grant()
    }
}

/// The lifetime of a waiting writer's intent: at most its TTL (a crashed waiter
/// holds readers back no longer than a crashed holder would), else three node
/// timeouts but at least a second, so a refresh always arrives in time.
pub(crate) fn intent_ms(ttl_ms: u64, node_timeout: Duration) -> u64 {
    let floor = (node_timeout.as_millis() as u64)
        .saturating_mul(3)
        .max(1_000);
    ttl_ms.min(floor)
}

/// Reads a busy reply's wait hint.
fn busy_hint(value: &redis::Value, op: &'static str) -> Result<Option<Duration>> {
    match value {
        redis::Value::Int(ms) => Ok(busy(*ms)),
        other => Err(Error::UnexpectedReply {
            op,
            reply: format!("{other:?}"),
        }),
    }
}

/// Reads the write epoch, a token string that may be "0".
fn parse_epoch(value: &redis::Value) -> Result<FencingToken> {
    match value {
        redis::Value::BulkString(b) if b == b"0" => Ok(FencingToken(0)),
        other => parse_token(other, "acquire"),
    }
}

fn script_error(e: Error, keys: &[String]) -> Error {
    let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
    bad_key_in(e, &keys)
}

/// The read side's keys and acquire script.
pub(crate) struct ReadSpec {
    /// Writer, readers, intents, fence.
    keys: [String; 4],
    preference: Preference,
}

impl ReadSpec {
    pub(crate) fn new(keys: [String; 4], preference: Preference) -> ReadSpec {
        ReadSpec { keys, preference }
    }

    /// Calls `send` with an attempt's script, keys (writer, readers,
    /// intents, fence) and arguments (owner, TTL in milliseconds,
    /// preference).
    pub(crate) fn request<R>(
        &self,
        owner: &str,
        ttl: &str,
        send: impl FnOnce(&'static Script, &[&str], &[&str]) -> R,
    ) -> R {
        let [w, r, q, fence] = &self.keys;
        send(
            &scripts::RW_READ_ACQUIRE,
            &[w, r, q, fence],
            &[owner, ttl, self.preference.as_arg()],
        )
    }

    /// Reads the script's reply to an attempt of `owner` sent at `sent`:
    /// `{1, epoch}` granted (the write epoch it joined), `{0, pttl}` held.
    pub(crate) fn read(
        &self,
        reply: &[redis::Value],
        owner: &str,
        sent: Instant,
    ) -> Result<Attempt<Granted<FencingToken>>> {
        match reply {
            [redis::Value::Int(1), epoch] => Ok(Attempt::Acquired(Granted {
                grant: parse_epoch(epoch)?,
                ops: Ops::member(
                    vec![self.keys[1].clone()],
                    owner.to_owned(),
                    &scripts::RW_READ_EXTEND,
                    &scripts::RW_READ_VERIFY,
                    &scripts::RW_READ_RELEASE,
                ),
                sent,
            })),
            [redis::Value::Int(0), hint] => Ok(Attempt::Busy(busy_hint(hint, "acquire")?)),
            other => Err(unexpected_acquire(other)),
        }
    }
}

impl Acquire<FencingToken> for ReadSpec {
    fn keys(&self) -> &[String] {
        &self.keys
    }

    fn wait_keys(&self) -> WaitKeys<'_> {
        match self.preference {
            Preference::Writer => WaitKeys::two(&self.keys[0], &self.keys[2]),
            Preference::Reader => WaitKeys::one(&self.keys[0]),
        }
    }

    fn attempt(
        &self,
        _dep: &Deployment,
        conn: &mut Conn,
        t: Try<'_>,
    ) -> Result<Attempt<Granted<FencingToken>>> {
        // A repeated grant to this owner (an earlier attempt's whose reply was
        // lost) has its expiry moved to ttl from now if that is later, so it
        // holds for ttl from this send at least: `sent` stands.
        let ttl = t.ttl_ms.to_string();
        let reply: Vec<redis::Value> =
            self.request(t.owner.as_str(), &ttl, |script, keys, args| {
                conn.script(script, keys, args, "acquire", t.deadline)
                    .map_err(|e| script_error(e, &self.keys))
            })?;
        self.read(&reply, t.owner.as_str(), t.sent)
    }

    fn clean_up(&self, owner: &OwnerToken) -> redis::Cmd {
        scripts::RW_READ_RELEASE.eval(&[&self.keys[1]], &[owner.as_str(), "exact"])
    }

    fn debug(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ReadLease")
            .field("readers_key", &self.keys[1])
            .field("writer_key", &self.keys[0])
            .field("preference", &self.preference)
            .finish()
    }
}

/// The write side's keys and acquire script.
pub(crate) struct WriteSpec {
    /// Writer, readers, intents, fence.
    keys: [String; 4],
    preference: Preference,
    /// The deployment's timing; its node timeout sets the intent's lifetime.
    timing: Timing,
}

impl WriteSpec {
    pub(crate) fn new(keys: [String; 4], preference: Preference, timing: Timing) -> WriteSpec {
        WriteSpec {
            keys,
            preference,
            timing,
        }
    }

    /// The lifetime of the intent an attempt records, in milliseconds: under
    /// writer preference, inside a wait; else 0 (none).
    pub(crate) fn intent(&self, ttl_ms: u64, waiting: bool) -> u64 {
        match self.preference {
            Preference::Writer if waiting => intent_ms(ttl_ms, self.timing.node_timeout),
            _ => 0,
        }
    }

    /// Calls `send` with an attempt's script, keys (writer, readers,
    /// intents, fence) and arguments (owner, TTL and intent in
    /// milliseconds).
    pub(crate) fn request<R>(
        &self,
        owner: &str,
        ttl: &str,
        intent: u64,
        send: impl FnOnce(&'static Script, &[&str], &[&str]) -> R,
    ) -> R {
        let [w, r, q, fence] = &self.keys;
        send(
            &scripts::RW_WRITE_ACQUIRE,
            &[w, r, q, fence],
            &[owner, ttl, &intent.to_string()],
        )
    }

    /// Reads the script's reply to an attempt of `owner` sent at `sent`
    /// with `intent`: `{1, token}` granted, `{0, pttl}` held. A waiting
    /// writer comes back in time to refresh its intent.
    pub(crate) fn read(
        &self,
        reply: &[redis::Value],
        owner: &str,
        sent: Instant,
        intent: u64,
    ) -> Result<Attempt<Granted<FencingToken>>> {
        match reply {
            [redis::Value::Int(1), token] => token_grant(token, &self.keys[0], owner, sent),
            [redis::Value::Int(0), hint] => {
                let hint = busy_hint(hint, "acquire")?;
                if intent == 0 {
                    return Ok(Attempt::Busy(hint));
                }
                // Come back in time to refresh the intent (the script does once
                // a quarter of it has passed), even if nothing changes before.
                let refresh = Duration::from_millis(intent / 2);
                Ok(Attempt::Busy(Some(
                    hint.map_or(refresh, |h| h.min(refresh)),
                )))
            }
            other => Err(unexpected_acquire(other)),
        }
    }
}

impl Acquire<FencingToken> for WriteSpec {
    fn keys(&self) -> &[String] {
        &self.keys
    }

    fn wait_keys(&self) -> WaitKeys<'_> {
        WaitKeys::two(&self.keys[0], &self.keys[1])
    }

    fn attempt(
        &self,
        _dep: &Deployment,
        conn: &mut Conn,
        t: Try<'_>,
    ) -> Result<Attempt<Granted<FencingToken>>> {
        let intent = self.intent(t.ttl_ms, t.waiting);
        // A repeated grant to this owner (an earlier attempt's whose reply was
        // lost) has its expiry moved to ttl from now if that is later, so it
        // holds for ttl from this send at least: `sent` stands.
        let ttl = t.ttl_ms.to_string();
        let reply: Vec<redis::Value> =
            self.request(t.owner.as_str(), &ttl, intent, |script, keys, args| {
                conn.script(script, keys, args, "acquire", t.deadline)
                    .map_err(|e| script_error(e, &self.keys))
            })?;
        self.read(&reply, t.owner.as_str(), t.sent, intent)
    }

    fn counter(&self) -> Option<&str> {
        Some(&self.keys[3])
    }

    fn clean_up(&self, owner: &OwnerToken) -> redis::Cmd {
        scripts::RW_WRITE_CLEAN_UP.eval(&[&self.keys[0], &self.keys[2]], &[owner.as_str()])
    }

    fn stopped_waiting(&self, dep: &Deployment, owner: &OwnerToken, by: Instant) {
        if self.preference != Preference::Writer {
            return;
        }
        let q = &self.keys[2];
        let now = dep.now();
        let deadline = by.min(now + dep.node_timeout());
        if deadline > now {
            let (withdrawn, _) = dep.on_key(q, deadline, Connect::Within, |conn, deadline| {
                conn.script::<i64>(
                    &scripts::RW_WRITE_WITHDRAW,
                    &[q],
                    &[owner.as_str()],
                    "withdraw intent",
                    deadline,
                )
            });
            match withdrawn {
                Ok(n) => {
                    log::debug!("withdrew a waiting writer's intent on {q:?}: {n}");
                    return;
                }
                Err(e) if !e.is_retryable() && !e.is_uncertain() => {
                    log::warn!(
                        "could not withdraw a waiting writer's intent on {q:?} ({e}); it \
                         holds new readers back until it expires"
                    );
                    return;
                }
                Err(e) => log::debug!(
                    "withdrawing a waiting writer's intent on {q:?}: {e}; retrying in the \
                     background"
                ),
            }
        }
        // The wait's bound leaves no time (its last attempt ran to the end)
        // or the server did not answer in it: the server's executor sends the
        // withdrawal (it is idempotent) until the intent would have expired
        // by itself.
        let longest_intent = Duration::from_millis(intent_ms(u64::MAX, self.timing.node_timeout));
        dep.in_background(
            q,
            scripts::RW_WRITE_WITHDRAW.eval(&[q.as_str()], &[owner.as_str()]),
            now + longest_intent,
        );
    }

    fn debug(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WriteLease")
            .field("writer_key", &self.keys[0])
            .field("fence_key", &self.keys[3])
            .field("preference", &self.preference)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_intent_never_outlives_the_ttl_and_lasts_long_enough_to_refresh() {
        let nt = Duration::from_millis(500);
        assert_eq!(intent_ms(30_000, nt), 1_500);
        assert_eq!(intent_ms(1_000, nt), 1_000);
        assert_eq!(intent_ms(800, nt), 800);
        assert_eq!(intent_ms(30_000, Duration::from_millis(100)), 1_000);
    }

    #[test]
    fn the_write_epoch_may_be_zero_but_a_token_may_not() {
        let zero = redis::Value::BulkString(b"0".to_vec());
        assert_eq!(parse_epoch(&zero).unwrap(), FencingToken(0));
        assert!(parse_token(&zero, "acquire").is_err());
        let big = redis::Value::BulkString(b"100000000000000".to_vec());
        assert_eq!(
            parse_epoch(&big).unwrap(),
            FencingToken(100_000_000_000_000)
        );
        assert!(parse_epoch(&redis::Value::BulkString(b"-1".to_vec())).is_err());
    }
}
