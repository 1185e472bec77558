//! One Redis deployment as every single-deployment primitive sees it: its
//! servers (a standalone server, a Sentinel primary, or the primaries of a
//! cluster, each with its pool, subscriber and executor), key prefix, timing
//! settings and clock, the renewal thread, the replication guard, and the
//! fencing tokens seen so far (across failovers and slot moves). A
//! `Coordinator` is a cheap handle on one of these.
//!
//! Every command a primitive sends goes through [`Deployment::on_key`], which
//! picks the server that holds the key and follows the deployment when it
//! changes.

use std::fmt;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::clock::Clock;
use crate::conn::{Conn, Connect, Identity};
use crate::core::fences::{self, FenceBook, REMEMBERED_KEYS};
use crate::core::timing::Timing;
use crate::error::{Error, Result};
use crate::keys;
use crate::observe::Observer;
use crate::replication::{History, Replication};
use crate::runtime::renewal::{Cell, DeploymentRenewal, Ops, RenewalStats};
use crate::runtime::server::{Server, ServerJob};
use crate::runtime::topology::{Topology, Uncertain};

pub(crate) struct Deployment {
    pub(crate) topology: Arc<Topology>,
    pub(crate) prefix: String,
    pub(crate) clock: Arc<dyn Clock>,
    pub(crate) replication: Replication,
    /// The replication history the replication guard vouched for.
    pub(crate) history: Arc<History>,
    /// The connect timeout (the bound on opening a connection).
    pub(crate) connect_timeout: Duration,
    fences: Mutex<FenceBook>,
    keepalive_ok: OnceLock<()>,
    /// Renewal scripts whose rights were probed.
    probed: Mutex<Vec<&'static str>>,
}

/// Whether `INFO server`'s `redis_version` is 7.0 or later; the version
/// found, or `None` when the reply names none.
pub(crate) fn supported_version(info: &str) -> Option<(bool, String)> {
    let version = info
        .lines()
        .find_map(|l| l.trim_end().strip_prefix("redis_version:"))?;
    let major: u32 = version.split('.').next()?.parse().ok()?;
    Some((major >= 7, version.to_owned()))
}

impl Deployment {
    /// Refuses a server older than Redis 7.0, asking the server that holds
    /// `key` (`INFO server`, one round trip). A server that does not let the
    /// user run `INFO` is not judged.
    pub(crate) fn check_server_version(&self, key: &str) -> Result<()> {
        let deadline = self.now() + self.connect_timeout + self.node_timeout();
        let mut server = String::new();
        let (info, _) = self.on_key(key, deadline, Connect::Own, |conn, deadline| {
            server = conn.addr().to_owned();
            conn.query::<String>(redis::cmd("INFO").arg("server"), "INFO server", deadline)
        });
        let info = match info {
            Ok(info) => info,
            // Denied by the ACL (or refused otherwise): not judged.
            Err(e @ (Error::Permission(_) | Error::Server { .. })) => {
                log::debug!("the server's version cannot be read ({e}); not checked");
                return Ok(());
            }
            Err(e) => return Err(e),
        };
        match supported_version(&info) {
            Some((false, version)) => Err(Error::ServerTooOld { server, version }),
            _ => Ok(()),
        }
    }

    pub(crate) fn new(
        topology: Arc<Topology>,
        prefix: String,
        connect_timeout: Duration,
        replication: Replication,
        clock: Arc<dyn Clock>,
    ) -> Self {
        let history = topology.history.clone();
        let timing = topology.timing();
        Deployment {
            topology,
            prefix,
            clock,
            replication,
            history,
            connect_timeout,
            fences: Mutex::new(FenceBook::new(
                fences::horizon(timing.node_timeout, replication.timeout()),
                REMEMBERED_KEYS,
            )),
            keepalive_ok: OnceLock::new(),
            probed: Mutex::new(Vec::new()),
        }
    }

    /// Runs `f` on a connection to the server that holds `key` now, following
    /// redirections and failovers, finishing by `deadline` (plus the connect
    /// timeout per connection opened with [`Connect::Own`]). `f` gets the
    /// deadline to use. Returns where a command that got no reply went.
    pub(crate) fn on_key<T>(
        &self,
        key: &str,
        deadline: Instant,
        connect: Connect,
        mut f: impl FnMut(&mut Conn, Instant) -> Result<T>,
    ) -> (Result<T>, Option<Uncertain>) {
        self.topology
            .run(key, deadline, connect, &mut |_node: &Server, conn, d| {
                f(conn, d)
            })
    }

    /// [`on_key`](Deployment::on_key), once more on a fresh connection when
    /// the first try went out on a pooled connection that turned out dead
    /// (an I/O error: the server closed it while it was idle, as after a
    /// restart or an idle timeout): for commands that may run twice. `tried`
    /// hears each try's result and where a command that got no reply went.
    pub(crate) fn on_key_fresh_retry<T>(
        &self,
        key: &str,
        deadline: Instant,
        connect: Connect,
        mut f: impl FnMut(&mut Conn, Instant) -> Result<T>,
        mut tried: impl FnMut(&Result<T>, Option<Uncertain>),
    ) -> Result<T> {
        let mut result = Err(Error::Cancelled);
        for retry in [false, true] {
            let mut reused = false;
            let (r, lost) = self.on_key(key, deadline, connect, |conn, deadline| {
                reused = !conn.is_fresh();
                f(conn, deadline)
            });
            tried(&r, lost);
            result = r;
            if retry || !reused || !matches!(result, Err(Error::Io { .. })) {
                break;
            }
        }
        result
    }

    /// The deployment's drift factor and node timeout (its topology's).
    pub(crate) fn timing(&self) -> Timing {
        self.topology.timing()
    }

    pub(crate) fn node_timeout(&self) -> Duration {
        self.timing().node_timeout
    }

    pub(crate) fn now(&self) -> Instant {
        self.clock.now()
    }

    /// The renewal thread (watch, touch, forget a lease).
    pub(crate) fn runtime(&self) -> &DeploymentRenewal {
        self.topology.renewal_thread()
    }

    pub(crate) fn stats(&self) -> RenewalStats {
        self.topology.stats()
    }

    /// Remembers a new grant, so that it is verified after a failover or a
    /// slot move (Cluster and Sentinel deployments only).
    /// The coordinator's observer, if any.
    pub(crate) fn observer(&self) -> Option<&Arc<dyn Observer>> {
        self.topology.observer()
    }

    pub(crate) fn granted(&self, cell: &Arc<Cell>) {
        self.topology.register(cell);
    }

    /// Validates a TTL against the crate's limits and this deployment's
    /// timeouts; returns it in whole milliseconds.
    pub(crate) fn check_ttl(&self, ttl: Duration) -> Result<u64> {
        let ms = keys::ttl_ms(ttl)?;
        if !self.timing().usable_ttl(Duration::from_millis(ms)) {
            return Err(Error::InvalidArgument(format!(
                "ttl {ttl:?} is not longer than the node timeout ({:?}) plus clock drift: the \
                 lease would count as lost as soon as it was granted",
                self.timing().node_timeout
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
        let deadline = self.now() + self.node_timeout();
        self.on_key(&ops.keys[0], deadline, Connect::Own, |conn, deadline| {
            self.probe_keepalive(conn, ops, name, deadline)
        })
        .0
    }

    fn probe_keepalive(
        &self,
        conn: &mut Conn,
        ops: &Ops,
        name: &'static str,
        deadline: Instant,
    ) -> Result<()> {
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
        // An id no connection has: allowed ⇒ `:0`, denied ⇒ NOPERM. (Every
        // node of a cluster is assumed to have the same ACL.)
        let kill = Identity::nobody().kill_cmd();
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

    /// Hands the fencing-off of an unanswered extension to the executor of
    /// the server it went to.
    pub(crate) fn fence(
        &self,
        sent: Uncertain,
        lease: &Arc<Cell>,
        ticket: crate::core::lease::Ticket,
    ) {
        sent.node.submit(ServerJob::Fence {
            conn: sent.conn,
            lease: lease.clone(),
            ticket,
        });
    }

    /// Hands the clean-up after unanswered acquire attempts to the executors
    /// of the servers they went to: every connection they went out on is
    /// killed first (so that the clean-up cannot be overtaken by a late
    /// grant), then `cmd`, if any, runs there. Gives up once whatever they may
    /// have set has expired.
    pub(crate) fn clean_up(
        &self,
        sent: &[Uncertain],
        cmd: Option<redis::Cmd>,
        key: &str,
        ttl: Duration,
    ) {
        if sent.iter().any(|u| u.conn.is_none()) {
            log::debug!(
                "an unanswered acquire of {key:?} went out on a connection whose id is \
                 unknown; its clean-up may be overtaken"
            );
        }
        let give_up_at = self.now() + ttl + self.node_timeout();
        let mut by_node: Vec<(&Arc<Server>, Vec<Identity>)> = Vec::new();
        for u in sent {
            match by_node.iter_mut().find(|(n, _)| Arc::ptr_eq(n, &u.node)) {
                Some((_, conns)) => conns.extend(u.conn.clone()),
                None => by_node.push((&u.node, u.conn.clone().into_iter().collect())),
            }
        }
        for (node, conns) in by_node {
            node.submit(ServerJob::Cleanup {
                conns,
                cmd: cmd.clone(),
                key: key.to_owned(),
                give_up_at,
                hops: 0,
            });
        }
    }

    /// Hands `cmd` on `key` to the executor of the server that holds `key`,
    /// which sends it until it is answered or `give_up_at` passes.
    pub(crate) fn in_background(&self, key: &str, cmd: redis::Cmd, give_up_at: Instant) {
        match self.topology.node_for(key) {
            Ok(node) => {
                node.submit(ServerJob::Cleanup {
                    conns: Vec::new(),
                    cmd: Some(cmd),
                    key: key.to_owned(),
                    give_up_at,
                    hops: 0,
                });
            }
            Err(e) => log::warn!("no server to send a command on {key:?} to: {e}"),
        }
    }
}

/// Turns the scripts' BADKEY / BADFENCE / WRONGTYPE replies into [`Error::BadKey`]
/// on `key`; see [`bad_key_in`].
pub(crate) fn bad_key(err: Error, key: &str) -> Error {
    bad_key_in(err, &[key])
}

/// Turns the scripts' BADKEY / BADFENCE / WRONGTYPE replies into [`Error::BadKey`],
/// and BADARG into [`Error::InvalidArgument`]. A detail that starts with
/// `KEYS[n] ` names the script's `n`-th key: the error names `keys[n − 1]` and
/// the prefix is dropped; otherwise it names `keys[0]`.
pub(crate) fn bad_key_in(err: Error, keys: &[&str]) -> Error {
    match err {
        Error::Server { source, .. }
            if matches!(
                source.code(),
                Some("BADKEY" | "BADFENCE" | "WRONGTYPE" | "BADARG")
            ) =>
        {
            let detail = source.detail().unwrap_or("has the wrong type");
            let detail = detail.split(" script:").next().unwrap_or(detail).trim();
            let (index, detail) = script_key(detail);
            if source.code() == Some("BADARG") {
                return Error::InvalidArgument(format!("refused by the server: {detail}"));
            }
            let key = index
                .and_then(|n| keys.get(n))
                .or(keys.first())
                .copied()
                .unwrap_or_default();
            Error::BadKey {
                key: key.to_owned(),
                problem: detail.to_owned(),
            }
        }
        other => other,
    }
}

/// Splits a `KEYS[n] ` prefix off a script's error detail: the key's index
/// (from 0) and the rest.
fn script_key(detail: &str) -> (Option<usize>, &str) {
    let parsed = detail.strip_prefix("KEYS[").and_then(|rest| {
        let (n, rest) = rest.split_once("] ")?;
        let n: usize = n.parse().ok()?;
        Some((n.checked_sub(1)?, rest))
    });
    match parsed {
        Some((i, rest)) => (Some(i), rest),
        None => (None, detail),
    }
}

impl fmt::Debug for Deployment {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Deployment")
            .field("addr", &self.topology.describe())
            .field("key_prefix", &self.prefix)
            .field("node_timeout", &self.timing().node_timeout)
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn server(code_and_detail: &str) -> Error {
        let reply = format!("-{code_and_detail}\r\n");
        let source = redis::parse_redis_value(reply.as_bytes())
            .unwrap()
            .extract_error()
            .unwrap_err();
        Error::Server {
            op: "acquire",
            source,
        }
    }

    #[test]
    fn a_script_error_names_the_key_it_is_about() {
        let keys = ["{b}:w", "{b}:r", "{b}:q", "{b}:fence"];
        let e = bad_key_in(
            server("BADFENCE KEYS[4] has an expiry; a fencing counter must never expire"),
            &keys,
        );
        match e {
            Error::BadKey { key, problem } => {
                assert_eq!(key, "{b}:fence");
                assert_eq!(
                    problem,
                    "has an expiry; a fencing counter must never expire"
                );
            }
            other => panic!("{other:?}"),
        }
        let e = bad_key_in(server("BADKEY KEYS[2] holds a hash, not a set"), &keys);
        assert!(
            matches!(&e, Error::BadKey { key, problem } if key == "{b}:r" && problem == "holds a hash, not a set"),
            "{e:?}"
        );
        // Without an index, or an index out of range: the first key.
        let e = bad_key(server("BADKEY holds a list, not a lock"), "k");
        assert!(
            matches!(&e, Error::BadKey { key, problem } if key == "k" && problem == "holds a list, not a lock"),
            "{e:?}"
        );
        let e = bad_key_in(server("BADKEY KEYS[9] holds a list"), &keys);
        assert!(
            matches!(&e, Error::BadKey { key, .. } if key == "{b}:w"),
            "{e:?}"
        );
        let e = bad_key_in(server("BADARG ttl must be positive"), &keys);
        assert!(
            matches!(&e, Error::InvalidArgument(m) if m.contains("ttl must be positive")),
            "{e:?}"
        );
        let e = bad_key_in(server("OTHER something"), &keys);
        assert!(matches!(e, Error::Server { .. }));
    }
}

#[cfg(test)]
mod version_tests {
    use super::supported_version;

    #[test]
    fn redis_7_0_and_later_are_supported_and_older_servers_are_named() {
        let info = |v: &str| format!("# Server\r\nredis_version:{v}\r\nredis_mode:standalone\r\n");
        assert_eq!(
            supported_version(&info("7.0.15")),
            Some((true, "7.0.15".into()))
        );
        assert_eq!(
            supported_version(&info("7.2.4")),
            Some((true, "7.2.4".into()))
        );
        assert_eq!(
            supported_version(&info("8.0.0")),
            Some((true, "8.0.0".into()))
        );
        assert_eq!(
            supported_version(&info("6.2.14")),
            Some((false, "6.2.14".into()))
        );
        assert_eq!(
            supported_version(&info("5.0.7")),
            Some((false, "5.0.7".into()))
        );
        assert_eq!(supported_version("# Server\r\n"), None);
    }
}
