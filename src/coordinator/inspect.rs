//! Reading what a deployment holds under one base key, for every primitive
//! whose keys are laid out from a base `B`: the writer, readers and waiting
//! writers of a [`ReadWriteLease`](crate::ReadWriteLease) (`B:w`, `B:r`, `B:q`,
//! `B:fence`), a [`FencedLock`](crate::FencedLock) made on `B:w` and `B:fence`,
//! and the permits of a [`Semaphore`](crate::Semaphore) (`B:permits`,
//! `B:meta`). One pipelined round trip of reads; nothing is changed, expired
//! entries included (they are left for the next acquire to prune). A lease on
//! keys of the caller's choosing (a [`Lock`](crate::Lock), a
//! [`FencedLock`](crate::FencedLock) on any lease and fence keys, a Redlock
//! lock on one node) is read by [`Coordinator::inspect_lease`].
//!
//! Every holder found comes with the owner id its acquire drew and, when the
//! handle that took it was given one
//! ([`Lease::with_holder`](crate::Lease::with_holder),
//! [`RedlockGroup::with_holder`](crate::RedlockGroup::with_holder)), the
//! holder's identity, read from the owner value the lease already stores.

use std::time::{Duration, Instant};

use crate::conn::Connect;
use crate::coordinator::Coordinator;
use crate::error::{Error, Result};
use crate::keys;
use crate::lease::semaphore::{PermitHolder, parse_member};
use crate::token::{FencingToken, split_owner};

/// How the keys under one base are held right now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum HeldAs {
    /// Nothing holds them.
    Free,
    /// One exclusive holder: a writer of a read/write lease or a fenced lock
    /// on `B:w` (it has a fencing token), or a value without one (a
    /// [`Lock`](crate::Lock) or a Redlock lock on `B:w`).
    Exclusive,
    /// One or more readers of a read/write lease.
    Shared,
    /// One or more permits of a semaphore.
    Counted,
    /// Holders of more than one kind at once: keys written by programs that
    /// do not follow one layout.
    Mixed,
}

/// The exclusive holder of a lease key (`B:w`, or the key given to
/// [`Coordinator::inspect_lease`]).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct ExclusiveHolder {
    /// Its fencing token: `None` when the value is not `owner:token` (a plain
    /// lock or a Redlock lock on the key).
    pub fencing_token: Option<FencingToken>,
    /// How long until it expires on the server's clock (its `PTTL`), unless
    /// renewed; `None` for a key without expiry.
    pub remaining: Option<Duration>,
    /// The owner id its acquire drew (random, one per acquire call), or the
    /// whole value when it is not one this crate writes.
    pub owner: String,
    /// Who holds it, as the handle that took it was told
    /// ([`Lease::with_holder`](crate::Lease::with_holder),
    /// [`RedlockGroup::with_holder`](crate::RedlockGroup::with_holder));
    /// `None` when it was not.
    pub holder: Option<String>,
}

/// One reader of a read/write lease (a member of `B:r`).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct ReaderHolder {
    /// How long until it expires on the server's clock, unless renewed.
    pub remaining: Duration,
    /// The owner id its acquire drew.
    pub owner: String,
    /// Who holds it, as the handle that took it was told
    /// ([`Lease::with_holder`](crate::Lease::with_holder)); `None` when it
    /// was not.
    pub holder: Option<String>,
}

/// What a deployment holds under one base key, as read by
/// [`Coordinator::inspect`], or at one lease key, as read by
/// [`Coordinator::inspect_lease`].
///
/// The kind of lease that holds it: [`held_as`](Inspection::held_as) says
/// exclusive, shared or counted; an exclusive holder with a
/// [`fencing_token`](ExclusiveHolder::fencing_token) is a fenced lock or a
/// writer, one without is a plain [`Lock`](crate::Lock) or a Redlock lock on
/// this node.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Inspection {
    /// The base key with the coordinator's prefix.
    pub base: String,
    /// The holder of the exclusive key `B:w`, if any.
    pub exclusive: Option<ExclusiveHolder>,
    /// The unexpired readers of `B:r`, soonest to expire first.
    pub readers: Vec<ReaderHolder>,
    /// How many writers wait with an unexpired intent in `B:q` (they hold
    /// new readers back).
    pub waiting_writers: u32,
    /// The last write token issued from `B:fence`, `None` if none yet.
    pub last_write_token: Option<FencingToken>,
    /// The unexpired permits of `B:permits`, soonest to expire first.
    pub permits: Vec<PermitHolder>,
    /// The capacity stored in `B:meta`, `None` if none.
    pub capacity: Option<u32>,
    /// The last permit token issued from `B:meta`, `None` if none yet.
    pub last_permit_token: Option<FencingToken>,
    /// When the reads were sent, on this process's monotonic clock.
    pub read_at: Instant,
}

impl Inspection {
    /// How the keys are held, from the holders found.
    pub fn held_as(&self) -> HeldAs {
        let kinds = [
            self.exclusive.is_some(),
            !self.readers.is_empty(),
            !self.permits.is_empty(),
        ];
        match kinds {
            [false, false, false] => HeldAs::Free,
            [true, false, false] => HeldAs::Exclusive,
            [false, true, false] => HeldAs::Shared,
            [false, false, true] => HeldAs::Counted,
            _ => HeldAs::Mixed,
        }
    }
}

impl Coordinator {
    /// Reads, without changing anything, who holds the keys laid out from
    /// `base` (a key with a non-empty hash tag, as given to
    /// [`read_write_lease`](Coordinator::read_write_lease) or
    /// [`semaphore`](Coordinator::semaphore); the prefix is applied): the
    /// exclusive holder of `B:w` with its token and time left, the unexpired
    /// readers and waiting writers, the last write token, the unexpired
    /// permits, the stored capacity and the last permit token; each holder
    /// with its owner id and, where it records one, its holder's identity.
    ///
    /// Blocks for one pipelined round trip on the server that holds the base's
    /// slot, bounded by the node timeout (plus the connect timeout when a
    /// connection has to be opened); follows Cluster redirections and Sentinel
    /// switches like every command. Expiries are judged by the server's `TIME`
    /// in the same round trip. What it reports may change as soon as it
    /// returns: it is for reports and checks, never a reason to skip an
    /// acquire.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a base without a hash tag (nothing
    /// sent); [`Error::BadKey`] naming a key of another type or with a value
    /// no primitive writes; transport errors as for every command.
    pub fn inspect(&self, base: &str) -> Result<Inspection> {
        let dep = self.deployment();
        let base = keys::physical_base(&dep.prefix, base, "inspected base key")?;
        let [w, r, q, fence, permits, meta] =
            ["w", "r", "q", "fence", "permits", "meta"].map(|s| format!("{base}:{s}"));
        let mut pipe = redis::pipe();
        pipe.cmd("TIME")
            .cmd("GET")
            .arg(&w)
            .cmd("PTTL")
            .arg(&w)
            .cmd("ZRANGE")
            .arg(&r)
            .arg(0)
            .arg(-1)
            .arg("WITHSCORES")
            .cmd("ZRANGE")
            .arg(&q)
            .arg(0)
            .arg(-1)
            .arg("WITHSCORES")
            .cmd("GET")
            .arg(&fence)
            .cmd("ZRANGE")
            .arg(&permits)
            .arg(0)
            .arg(-1)
            .arg("WITHSCORES")
            .cmd("HMGET")
            .arg(&meta)
            .arg("capacity")
            .arg("fence");
        let read_at = dep.now();
        let deadline = read_at + dep.node_timeout();
        let replies = dep
            .on_key(&w, deadline, Connect::Own, |conn, deadline| {
                conn.pipeline(&pipe, "inspect", deadline)
            })
            .0?;
        let names = ["TIME", &w, &w, &r, &q, &fence, &permits, &meta];
        if replies.len() != names.len() {
            return Err(Error::Config(format!(
                "inspect: {} replies to {} reads",
                replies.len(),
                names.len()
            )));
        }
        let mut values = Vec::with_capacity(replies.len());
        for (value, key) in replies.into_iter().zip(names) {
            if let redis::Value::ServerError(e) = &value {
                return Err(Error::BadKey {
                    key: key.to_owned(),
                    problem: format!("cannot be read: {}", e.details().unwrap_or("error")),
                });
            }
            values.push(value);
        }
        let bad = |key: &str, problem: &str| Error::BadKey {
            key: key.to_owned(),
            problem: problem.to_owned(),
        };
        let time: Vec<String> = from(&values[0]).ok_or_else(|| bad("TIME", "unexpected reply"))?;
        let now_ms = match time.as_slice() {
            [s, us] => s
                .parse::<u64>()
                .ok()
                .zip(us.parse::<u64>().ok())
                .map(|(s, us)| s * 1000 + us / 1000)
                .ok_or_else(|| bad("TIME", "unexpected reply"))?,
            _ => return Err(bad("TIME", "unexpected reply")),
        };
        let left = |score: f64| Duration::from_millis((score as u64).saturating_sub(now_ms));
        let unexpired = |v: &redis::Value, key: &str| -> Result<Vec<(String, Duration)>> {
            let pairs = scored(v).ok_or_else(|| bad(key, "not a sorted set"))?;
            Ok(pairs
                .into_iter()
                .filter(|(_, score)| *score > now_ms as f64)
                .map(|(member, score)| (member, left(score)))
                .collect())
        };

        let exclusive = holder(&values[1], &values[2], &w)?;
        let readers = unexpired(&values[3], &r)?
            .into_iter()
            .map(|(member, remaining)| {
                let (owner, holder) = split_owner(&member);
                ReaderHolder {
                    remaining,
                    owner: owner.to_owned(),
                    holder,
                }
            })
            .collect();
        let waiting_writers = u32::try_from(unexpired(&values[4], &q)?.len()).unwrap_or(u32::MAX);
        let last_write_token = counter(&values[5], &fence)?;
        let mut holders = Vec::new();
        for (member, remaining) in unexpired(&values[6], &permits)? {
            let Some(permit) = parse_member(&member, remaining) else {
                return Err(bad(&permits, "a member that is not owner:slot:token"));
            };
            holders.push(permit);
        }
        let meta_fields: Vec<Option<String>> =
            from(&values[7]).ok_or_else(|| bad(&meta, "not a semaphore hash"))?;
        let capacity = match meta_fields.first().cloned().flatten() {
            Some(c) => Some(
                c.parse()
                    .map_err(|_| bad(&meta, "a capacity that is not a number"))?,
            ),
            None => None,
        };
        let last_permit_token = match meta_fields.get(1).cloned().flatten() {
            Some(t) => Some(FencingToken(
                t.parse()
                    .map_err(|_| bad(&meta, "a fence that is not a number"))?,
            )),
            None => None,
        };
        Ok(Inspection {
            base,
            exclusive,
            readers,
            waiting_writers,
            last_write_token,
            permits: holders,
            capacity,
            last_permit_token,
            read_at,
        })
    }
}

impl Coordinator {
    /// Reads, without changing anything, the lease at `lease_key` (the
    /// prefix is applied) whatever made it: a [`Lock`](crate::Lock), a
    /// [`FencedLock`](crate::FencedLock) on any lease and fence keys, or a
    /// Redlock lock on this one node; with `fence_key`, also the last token
    /// the fenced lock's counter issued. The holder, if any, is in
    /// [`exclusive`](Inspection::exclusive) (a fencing token only for a
    /// fenced lock's `owner:token` value; its owner id, its holder's
    /// identity when it records one, and its time left from the server's
    /// `PTTL`), the last token in
    /// [`last_write_token`](Inspection::last_write_token); `base` is the
    /// lease key with the prefix, and the other fields are empty.
    ///
    /// A [`RedlockGroup`](crate::RedlockGroup)'s lock is one such key on each
    /// node: [`RedlockGroup::inspect`](crate::RedlockGroup::inspect) reads
    /// every node of a group and names the owner a quorum holds; this call
    /// reads one node.
    ///
    /// Blocks for one pipelined round trip, as [`inspect`](Coordinator::inspect).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for an empty key, and [`Error::CrossSlot`]
    /// for a fence key in another cluster slot than the lease key (nothing
    /// sent); [`Error::BadKey`] naming a key of another type or a counter
    /// that is not one; transport errors as for every command.
    pub fn inspect_lease(&self, lease_key: &str, fence_key: Option<&str>) -> Result<Inspection> {
        let dep = self.deployment();
        let lease = keys::physical(&dep.prefix, lease_key, "inspected lease key")?;
        let fence = fence_key
            .map(|f| keys::physical(&dep.prefix, f, "inspected fence key"))
            .transpose()?;
        if let Some(fence) = &fence {
            keys::same_slot(&lease, fence)?;
        }
        let mut pipe = redis::pipe();
        pipe.cmd("GET").arg(&lease).cmd("PTTL").arg(&lease);
        if let Some(fence) = &fence {
            pipe.cmd("GET").arg(fence);
        }
        let read_at = dep.now();
        let deadline = read_at + dep.node_timeout();
        let replies = dep
            .on_key(&lease, deadline, Connect::Own, |conn, deadline| {
                conn.pipeline(&pipe, "inspect", deadline)
            })
            .0?;
        let expected = if fence.is_some() { 3 } else { 2 };
        if replies.len() != expected {
            return Err(Error::Config(format!(
                "inspect: {} replies to {expected} reads",
                replies.len()
            )));
        }
        let keys = [&lease, &lease, fence.as_ref().unwrap_or(&lease)];
        for (value, key) in replies.iter().zip(keys) {
            readable(value, key)?;
        }
        let exclusive = holder(&replies[0], &replies[1], &lease)?;
        let last_write_token = match &fence {
            Some(fence) => counter(&replies[2], fence)?,
            None => None,
        };
        Ok(Inspection {
            base: lease,
            exclusive,
            readers: Vec::new(),
            waiting_writers: 0,
            last_write_token,
            permits: Vec::new(),
            capacity: None,
            last_permit_token: None,
            read_at,
        })
    }
}

/// A read of `key` that did not fail: an error reply (a key of another
/// type) is [`Error::BadKey`].
pub(crate) fn readable(value: &redis::Value, key: &str) -> Result<()> {
    match value {
        redis::Value::ServerError(e) => Err(Error::BadKey {
            key: key.to_owned(),
            problem: format!("cannot be read: {}", e.details().unwrap_or("error")),
        }),
        _ => Ok(()),
    }
}

/// The holder of an exclusive key from its `GET` and `PTTL` replies: a
/// fencing token when the value is `owner:token`.
pub(crate) fn holder(
    value: &redis::Value,
    pttl: &redis::Value,
    key: &str,
) -> Result<Option<ExclusiveHolder>> {
    let bad = |problem: &str| Error::BadKey {
        key: key.to_owned(),
        problem: problem.to_owned(),
    };
    let value: Option<String> = from(value).ok_or_else(|| bad("not a string"))?;
    let pttl: i64 = from(pttl).ok_or_else(|| bad("unexpected PTTL reply"))?;
    Ok(match (value, pttl) {
        (None, _) | (Some(_), -2) => None,
        (Some(value), pttl) => {
            // `owner:token` for a fenced lease; an owner never holds a `:`.
            let (owner, token) = match value.rsplit_once(':') {
                Some((owner, t)) => match t.parse() {
                    Ok(t) => (owner, Some(FencingToken(t))),
                    Err(_) => (value.as_str(), None),
                },
                None => (value.as_str(), None),
            };
            let (owner, holder) = split_owner(owner);
            Some(ExclusiveHolder {
                fencing_token: token,
                remaining: u64::try_from(pttl).ok().map(Duration::from_millis),
                owner: owner.to_owned(),
                holder,
            })
        }
    })
}

/// The members and scores of `ZRANGE … WITHSCORES`: a flat list in RESP2,
/// a list of pairs in RESP3.
fn scored(value: &redis::Value) -> Option<Vec<(String, f64)>> {
    let redis::Value::Array(items) = value else {
        return None;
    };
    let score = |v: &redis::Value| match v {
        redis::Value::Double(d) => Some(*d),
        other => from::<String>(other)?.parse().ok(),
    };
    if items.iter().all(|i| matches!(i, redis::Value::Array(_))) {
        items
            .iter()
            .map(|pair| match pair {
                redis::Value::Array(p) if p.len() == 2 => Some((from(&p[0])?, score(&p[1])?)),
                _ => None,
            })
            .collect()
    } else {
        items
            .chunks(2)
            .map(|pair| match pair {
                [member, s] => Some((from(member)?, score(s)?)),
                _ => None,
            })
            .collect()
    }
}

/// A reply as `T`, `None` if it is not one.
fn from<T: redis::FromRedisValue>(value: &redis::Value) -> Option<T> {
    T::from_redis_value(value.clone()).ok()
}

/// A fence counter's value: none, or a non-negative integer.
fn counter(value: &redis::Value, key: &str) -> Result<Option<FencingToken>> {
    let text: Option<String> = from(value).ok_or_else(|| Error::BadKey {
        key: key.to_owned(),
        problem: "not a counter".into(),
    })?;
    text.map(|t| {
        t.parse().map(FencingToken).map_err(|_| Error::BadKey {
            key: key.to_owned(),
            problem: format!("holds {t:?}, not a counter"),
        })
    })
    .transpose()
}
