//! `respire-lock status`: who holds a key, read straight from Redis.
//!
//! The library has no call that reads another holder's lease, so this reads the
//! two keys `run` uses with the `redis` crate: one pipeline of `GET lease`,
//! `PTTL lease` and `GET fence`. It changes nothing.

use std::process::ExitCode;
use std::time::Duration;

use crate::args::{EXIT_USAGE, StatusArgs, Usage};
use crate::json::Object;
use crate::{EXIT_UNAVAILABLE, say, show};

/// The lease and fence keys of KEY, before the key prefix: `{KEY}:lease` and
/// `{KEY}:fence`, so that both hash to one cluster slot.
pub(crate) fn fenced_keys(key: &str) -> (String, String) {
    (format!("{{{key}}}:lease"), format!("{{{key}}}:fence"))
}

/// What the server holds for one lease.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct LeaseView {
    /// The lease key's value (`owner:token` for a fenced lease), `None` when free.
    pub(crate) value: Option<String>,
    /// The lease's remaining time-to-live; `None` when free or without expiry.
    pub(crate) ttl: Option<Duration>,
    /// The fence counter's value, when it was asked for and exists.
    pub(crate) fence: Option<String>,
}

impl LeaseView {
    /// From the replies to `GET lease`, `PTTL lease` and `GET fence`.
    fn from_replies(value: Option<String>, pttl: i64, fence: Option<String>) -> LeaseView {
        match (value, pttl) {
            // Expired between the GET and the PTTL.
            (Some(_), -2) | (None, _) => LeaseView {
                value: None,
                ttl: None,
                fence,
            },
            (Some(value), pttl) => LeaseView {
                value: Some(value),
                ttl: u64::try_from(pttl).ok().map(Duration::from_millis),
                fence,
            },
        }
    }

    /// The holder's fencing token: the number after the last `:` of the value.
    pub(crate) fn token(&self) -> Option<u64> {
        let (_, token) = self.value.as_deref()?.rsplit_once(':')?;
        token.parse().ok()
    }

    /// The highest token issued so far, from the fence counter.
    pub(crate) fn last_token(&self) -> Option<u64> {
        self.fence.as_deref()?.parse().ok()
    }
}

/// Reads a lease (and its fence counter) with one pipelined round trip, each
/// step bounded by `timeout`.
pub(crate) fn read_lease(
    url: &str,
    lease_key: &str,
    fence_key: Option<&str>,
    timeout: Duration,
) -> Result<LeaseView, String> {
    let client = redis::Client::open(url).map_err(|e| format!("invalid URL: {e}"))?;
    let mut conn = client
        .get_connection_with_timeout(timeout)
        .map_err(|e| format!("cannot connect: {e}"))?;
    conn.set_read_timeout(Some(timeout))
        .and_then(|()| conn.set_write_timeout(Some(timeout)))
        .map_err(|e| format!("cannot set timeouts: {e}"))?;
    let mut pipe = redis::pipe();
    pipe.cmd("GET").arg(lease_key).cmd("PTTL").arg(lease_key);
    match fence_key {
        Some(fence) => {
            pipe.cmd("GET").arg(fence);
            let (value, pttl, fence): (Option<String>, i64, Option<String>) = pipe
                .query(&mut conn)
                .map_err(|e| format!("cannot read {lease_key:?}: {e}"))?;
            Ok(LeaseView::from_replies(value, pttl, fence))
        }
        None => {
            let (value, pttl): (Option<String>, i64) = pipe
                .query(&mut conn)
                .map_err(|e| format!("cannot read {lease_key:?}: {e}"))?;
            Ok(LeaseView::from_replies(value, pttl, None))
        }
    }
}

pub(crate) fn main(args: StatusArgs) -> ExitCode {
    let Some(url) = &args.url else {
        Usage::new(
            "status needs a Redis deployment to ask: give --url or set REDIS_URL",
            Some("status"),
        )
        .print();
        return ExitCode::from(EXIT_USAGE);
    };
    let (lease, fence) = fenced_keys(&args.key);
    let lease_key = format!("{}{lease}", args.keys.prefix);
    let fence_key = format!("{}{fence}", args.keys.prefix);
    let view = match read_lease(url, &lease_key, Some(&fence_key), args.keys.node_timeout) {
        Ok(view) => view,
        Err(e) => {
            say(&format!("respire-lock: {e}"));
            return ExitCode::from(EXIT_UNAVAILABLE);
        }
    };
    if args.json {
        let ttl_ms = view
            .ttl
            .map(|t| u64::try_from(t.as_millis()).unwrap_or(u64::MAX));
        show(
            &Object::new()
                .str("key", &args.key)
                .str("lease_key", &lease_key)
                .str("fence_key", &fence_key)
                .bool("held", view.value.is_some())
                .opt_num("token", view.token())
                .opt_num("ttl_ms", ttl_ms)
                .opt_num("last_token", view.last_token())
                .finish(),
        );
    } else {
        show(&describe(&args.key, &view));
    }
    ExitCode::SUCCESS
}

/// The sentence `status` prints.
fn describe(key: &str, view: &LeaseView) -> String {
    let last = match (view.last_token(), &view.fence) {
        (Some(t), _) => format!("last fencing token issued: {t}"),
        (None, Some(raw)) => format!("the fence counter holds {raw:?}, not a number"),
        (None, None) => "no fencing token issued yet".into(),
    };
    if view.value.is_none() {
        return format!("{key}: free ({last})");
    }
    let holder = match view.token() {
        Some(t) => format!("fencing token {t}"),
        None => "a value without a fencing token".into(),
    };
    let expiry = match view.ttl {
        Some(ttl) => format!(
            "expires in {}",
            humantime::format_duration(Duration::from_millis(ttl.as_millis() as u64))
        ),
        None => "no expiry set".into(),
    };
    format!("{key}: held by {holder}, {expiry} ({last})")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn views_from_replies() {
        let held = LeaseView::from_replies(Some("0a1b:7".into()), 1500, Some("7".into()));
        assert_eq!(held.token(), Some(7));
        assert_eq!(held.ttl, Some(Duration::from_millis(1500)));
        assert_eq!(held.last_token(), Some(7));
        assert_eq!(
            describe("job", &held),
            "job: held by fencing token 7, expires in 1s 500ms (last fencing token issued: 7)"
        );

        let free = LeaseView::from_replies(None, -2, Some("7".into()));
        assert_eq!(free.value, None);
        assert_eq!(
            describe("job", &free),
            "job: free (last fencing token issued: 7)"
        );
        let expired_meanwhile = LeaseView::from_replies(Some("a:3".into()), -2, None);
        assert_eq!(expired_meanwhile.value, None);
        assert_eq!(
            describe("job", &expired_meanwhile),
            "job: free (no fencing token issued yet)"
        );

        let foreign = LeaseView::from_replies(Some("intruder".into()), -1, Some("x".into()));
        assert_eq!(foreign.token(), None);
        assert_eq!(foreign.ttl, None);
        assert_eq!(
            describe("job", &foreign),
            "job: held by a value without a fencing token, no expiry set \
             (the fence counter holds \"x\", not a number)"
        );
        assert_eq!(
            fenced_keys("job"),
            ("{job}:lease".into(), "{job}:fence".into())
        );
    }
}
