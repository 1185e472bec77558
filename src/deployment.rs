//! One Redis deployment as every single-deployment primitive sees it: its
//! connection pool, key prefix, timing settings and clock, the renewal runtime,
//! the invalidation subscriber, and the fencing tokens seen so far. A
//! `Coordinator` is a cheap handle on one of these.

use std::fmt;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::clock::Clock;
use crate::conn::{Connect, Pool};
use crate::core::fences::{FenceBook, REMEMBERED_KEYS};
use crate::core::timing::Timing;
use crate::error::{Error, Result};
use crate::keys;
use crate::runtime::renewal::{Cell, Job, Ops, RenewalStats, Runtime};
use crate::runtime::tracking::Tracking;

pub(crate) struct Deployment {
    pub(crate) pool: Pool,
    pub(crate) prefix: String,
    pub(crate) timing: Timing,
    pub(crate) clock: Arc<dyn Clock>,
    runtime: Arc<Runtime>,
    tracking: OnceLock<Tracking>,
    tracking_init: Mutex<()>,
    fences: Mutex<FenceBook>,
    keepalive_ok: OnceLock<()>,
    /// Renewal scripts whose rights were probed.
    probed: Mutex<Vec<&'static str>>,
}

impl Deployment {
    pub(crate) fn new(
        pool: Pool,
        prefix: String,
        drift_factor: f64,
        clock: Arc<dyn Clock>,
    ) -> Self {
        let cfg = pool.cfg.clone();
        let timing = Timing {
            drift_factor,
            node_timeout: cfg.node_timeout,
        };
        Deployment {
            runtime: Runtime::new(cfg, clock.clone()),
            pool,
            prefix,
            timing,
            clock,
            tracking: OnceLock::new(),
            tracking_init: Mutex::new(()),
            fences: Mutex::new(FenceBook::new(timing.node_timeout * 4, REMEMBERED_KEYS)),
            keepalive_ok: OnceLock::new(),
            probed: Mutex::new(Vec::new()),
        }
    }

    pub(crate) fn node_timeout(&self) -> Duration {
        self.timing.node_timeout
    }

    pub(crate) fn now(&self) -> Instant {
        self.clock.now()
    }

    pub(crate) fn runtime(&self) -> &Runtime {
        &self.runtime
    }

    pub(crate) fn stats(&self) -> RenewalStats {
        self.runtime.stats()
    }

    /// The invalidation subscriber, started on first use.
    pub(crate) fn tracking(&self) -> Result<&Tracking> {
        if let Some(t) = self.tracking.get() {
            return Ok(t);
        }
        let _init = self.tracking_init.lock();
        if let Some(t) = self.tracking.get() {
            return Ok(t);
        }
        let t = Tracking::spawn(self.pool.cfg.clone()).map_err(|source| Error::Thread {
            name: "respire-tracker",
            source,
        })?;
        Ok(self.tracking.get_or_init(|| t))
    }

    /// Validates a TTL against the crate's limits and this deployment's
    /// timeouts; returns it in whole milliseconds.
    pub(crate) fn check_ttl(&self, ttl: Duration) -> Result<u64> {
        let ms = keys::ttl_ms(ttl)?;
        if !self.timing.usable_ttl(Duration::from_millis(ms)) {
            return Err(Error::InvalidArgument(format!(
                "ttl {ttl:?} is not longer than the node timeout ({:?}) plus clock drift: the \
                 lease would count as lost as soon as it was granted",
                self.timing.node_timeout
            )));
        }
        Ok(ms)
    }

    /// Records a fencing token issued by an attempt sent at `sent` whose reply
    /// arrived at `received`, and refuses one that is not above a token whose
    /// reply this coordinator had received before that attempt was sent.
    pub(crate) fn note_token(
        &self,
        fence_key: &str,
        token: u64,
        sent: Instant,
        received: Instant,
    ) -> Result<()> {
        let checked = self.fences.lock().check(fence_key, token, sent, received);
        checked.map_err(|seen| {
            log::error!(
                "fencing counter {fence_key:?} went back: issued {token} after {seen}; its \
                 history was lost (failover, restart without persistence, eviction)"
            );
            Error::FencingRegression {
                fence_key: fence_key.to_owned(),
                issued: token,
                seen,
            }
        })
    }

    /// Keep-alive needs to renew the lease and to cut off a renewal that got
    /// no reply: `EVALSHA`/`EVAL` of the renewal script, `CLIENT ID` and
    /// `CLIENT KILL`. Probed once per coordinator (the script once per kind of
    /// lease; the acquire already showed the rights to write the key), changing
    /// nothing.
    pub(crate) fn check_keepalive_rights(&self, ops: &Ops) -> Result<()> {
        let name = ops.extend_script().name;
        if self.keepalive_ok.get().is_some() && self.probed.lock().contains(&name) {
            return Ok(());
        }
        let start = self.now();
        let mut deadline = start + self.node_timeout();
        let mut conn = self.pool.get(deadline, Connect::Own)?;
        deadline += conn.connect_time();
        let (keys, _) = ops.extend_args(1);
        // Not this lease's value: the script finds another owner and changes
        // nothing, but it runs with the same rights as a renewal.
        let probe = ["respire-keepalive-probe", "1"];
        let script: Result<i64> = conn
            .script(
                ops.extend_script(),
                &keys,
                &probe,
                "keep-alive check",
                deadline,
            )
            .map_err(|e| match e {
                Error::Permission(why) => Error::Permission(format!(
                    "keep-alive needs the ACL rights to EVALSHA and EVAL on {:?}: {why}",
                    keys.first().copied().unwrap_or_default()
                )),
                other => other,
            });
        script?;
        {
            let mut probed = self.probed.lock();
            if !probed.contains(&name) {
                probed.push(name);
            }
        }
        if self.keepalive_ok.get().is_some() {
            return Ok(());
        }
        if conn.id().is_none() {
            return Err(Error::Permission(
                "keep-alive needs the ACL rights to CLIENT ID and CLIENT KILL (to cut off a \
                 renewal that got no reply): CLIENT ID is denied"
                    .into(),
            ));
        }
        // An id no connection has: allowed ⇒ `:0`, denied ⇒ NOPERM.
        let kill = redis::cmd("CLIENT")
            .arg("KILL")
            .arg("ID")
            .arg(i64::MAX)
            .arg("SKIPME")
            .arg("yes")
            .clone();
        match conn.query::<i64>(&kill, "CLIENT KILL", deadline) {
            Ok(_) => {
                let _ = self.keepalive_ok.set(());
                Ok(())
            }
            Err(Error::Permission(why)) => Err(Error::Permission(format!(
                "keep-alive needs the ACL rights to CLIENT ID and CLIENT KILL (to cut off a \
                 renewal that got no reply): {why}"
            ))),
            Err(e) => Err(e),
        }
    }

    /// Hands the fencing-off of an unanswered extension to the executor.
    pub(crate) fn fence(
        &self,
        conn: Option<u64>,
        lease: &Arc<Cell>,
        ticket: crate::core::lease::Ticket,
    ) {
        self.runtime.submit(Job::Fence {
            conn,
            lease: lease.clone(),
            ticket,
        });
    }

    /// Hands the clean-up after unanswered acquire attempts to the executor:
    /// every connection they went out on is killed first (so that the clean-up
    /// cannot be overtaken by a late grant), then `cmd` runs. Gives up once
    /// whatever they may have set has expired.
    pub(crate) fn clean_up(
        &self,
        conns: &[Option<u64>],
        cmd: redis::Cmd,
        key: &str,
        ttl: Duration,
    ) {
        if conns.iter().any(Option::is_none) {
            log::debug!(
                "an unanswered acquire of {key:?} went out on a connection whose id is \
                 unknown; its clean-up may be overtaken"
            );
        }
        self.runtime.submit(Job::Cleanup {
            conns: conns.iter().flatten().copied().collect(),
            cmd,
            key: key.to_owned(),
            give_up_at: self.now() + ttl + self.node_timeout(),
        });
    }
}

/// Turns the scripts' BADKEY / BADFENCE / WRONGTYPE replies into [`Error::BadKey`].
pub(crate) fn bad_key(err: Error, key: &str) -> Error {
    match err {
        Error::Server { source, .. }
            if matches!(source.code(), Some("BADKEY" | "BADFENCE" | "WRONGTYPE")) =>
        {
            let detail = source.detail().unwrap_or("has the wrong type").to_owned();
            let detail = detail
                .split(" script:")
                .next()
                .unwrap_or(&detail)
                .trim()
                .to_owned();
            Error::BadKey {
                key: key.to_owned(),
                problem: detail,
            }
        }
        other => other,
    }
}

impl fmt::Debug for Deployment {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Deployment")
            .field("addr", &self.pool.cfg.addr)
            .field("key_prefix", &self.prefix)
            .field("node_timeout", &self.timing.node_timeout)
            .finish_non_exhaustive()
    }
}
