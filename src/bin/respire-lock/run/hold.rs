//! Taking the lease on each kind of deployment (a fenced, shared or counted
//! lease on one deployment, a leadership, a Redlock quorum), running the
//! command under it and releasing it after; what holds KEY in another mode.

use std::process::ExitCode;
use std::time::{Duration, Instant};

use respire_coordination::{
    Backend, Coordinator, Error, Kind, Leadership, Lease, LeaseGuard, NodeOutcome, RedlockGroup,
    RedlockGuard, RedlockOptions, ReleaseOutcome,
};

use super::child::{Ended, Held};
use super::throwaway::ThrowawayServer;
use super::{Grant, Mode, Run, holder};
use crate::EXIT_UNAVAILABLE;
use crate::args::EXIT_USAGE;
use crate::endpoint;
use crate::losses::{self, Loss};

impl Run<'_> {
    pub(super) fn single(&mut self, url: &str) -> ExitCode {
        let args = self.args;
        let coord = match endpoint::connect(url, &args.keys, self.tls) {
            Ok(c) => c,
            Err(e) if endpoint::is_usage(&e) => {
                return self.report.error(EXIT_USAGE, &e.to_string());
            }
            Err(e) => return self.report.error(EXIT_UNAVAILABLE, &e.to_string()),
        };
        let base = endpoint::base(&args.key);
        let mode = match (args.shared, args.max) {
            (true, _) => Mode::Shared,
            (false, Some(n)) => Mode::Counted(n),
            (false, None) => Mode::Exclusive,
        };
        // Every lease of the run records who holds it.
        let who = holder(args);
        let code = match mode {
            Mode::Exclusive | Mode::Shared => {
                let rw = match coord.read_write_lease(&base) {
                    Ok(rw) => rw,
                    Err(e) => return self.report.error(EXIT_USAGE, &e.to_string()),
                };
                if mode == Mode::Exclusive {
                    let lease = match rw.write().with_holder(&who) {
                        Ok(l) => l,
                        Err(e) => return self.report.error(EXIT_USAGE, &e.to_string()),
                    };
                    self.hold(&coord, mode, &lease, |g| Grant {
                        lease_key: g.key().to_owned(),
                        token: Some(g.fencing_token().get()),
                        write_epoch: None,
                        slot: None,
                    })
                } else {
                    let lease = match rw.read().with_holder(&who) {
                        Ok(l) => l,
                        Err(e) => return self.report.error(EXIT_USAGE, &e.to_string()),
                    };
                    self.hold(&coord, mode, &lease, |g| Grant {
                        lease_key: g.key().to_owned(),
                        token: None,
                        write_epoch: Some(g.write_epoch().get()),
                        slot: None,
                    })
                }
            }
            Mode::Counted(n) => {
                let sem = match coord.semaphore(&base, n).and_then(|s| s.with_holder(&who)) {
                    Ok(s) => s,
                    Err(e) => return self.report.error(EXIT_USAGE, &e.to_string()),
                };
                self.hold(&coord, mode, &sem, |g| Grant {
                    lease_key: g.key().to_owned(),
                    token: Some(g.fencing_token().get()),
                    write_epoch: None,
                    slot: Some(g.slot()),
                })
            }
        };
        drop(coord);
        code
    }

    /// Takes `lease`, runs the command under it, releases it.
    fn hold<K: Kind>(
        &mut self,
        coord: &Coordinator,
        mode: Mode,
        lease: &Lease<K>,
        grant: impl Fn(&LeaseGuard<K>) -> Grant,
    ) -> ExitCode {
        let base = endpoint::base(&self.args.key);
        self.hold_lease(
            lease,
            mode.name(),
            |_| other_mode(coord, &base, mode),
            || coord.inspect(&base).map(drop).map_err(|e| e.to_string()),
            grant,
            |_| library_loss(),
        )
    }

    /// Takes `lease` (its wait judged by `conflict`, which says what holds
    /// KEY in another mode, and `probe`, which says whether the deployment
    /// answers), keeps it alive while the command runs, releases it.
    fn hold_lease<B: Backend>(
        &mut self,
        lease: &Lease<B>,
        mode: &str,
        conflict: impl FnMut(&LeaseGuard<B>) -> respire_coordination::Result<Option<String>>,
        probe: impl Fn() -> Result<(), String> + Sync,
        grant: impl Fn(&LeaseGuard<B>) -> Grant,
        why_lost: impl Fn(&LeaseGuard<B>) -> Loss,
    ) -> ExitCode {
        let ttl = self.args.ttl;
        let guard = match self.acquire(
            |deadline, cancel| match deadline {
                Some(d) if d <= Instant::now() => lease.try_acquire(ttl),
                Some(d) => lease.acquire_until(ttl, d, cancel),
                None => lease.acquire(ttl, cancel).map(Some),
            },
            conflict,
            |g| drop(g.release()),
            probe,
        ) {
            Ok(guard) => guard,
            Err(code) => return code,
        };
        let renewal = match guard.keep_alive() {
            Ok(r) => r,
            Err(e @ Error::InvalidArgument(_)) => {
                return self.report.error(EXIT_USAGE, &e.to_string());
            }
            Err(e) => return self.report.error(EXIT_UNAVAILABLE, &e.to_string()),
        };
        let grant = grant(&guard);
        self.report.acquired(&grant, mode, ttl);
        let why_lost = || why_lost(&guard);
        let held = Held {
            lost: guard.lost_signal(),
            remaining: &|| guard.remaining_estimate(),
            is_lost: &|| guard.is_lost(),
            why_lost: &why_lost,
        };
        let ended = self.run_child(&grant.env(), &held);
        drop(renewal);
        let (outcome, detail) = release_words(guard.release());
        self.report.released(outcome, detail.as_deref());
        self.finish(ended)
    }

    /// Starts a throwaway server, runs `body` on it, stops it.
    pub(super) fn on_throwaway(
        &mut self,
        body: impl FnOnce(&mut Self, &str) -> ExitCode,
    ) -> ExitCode {
        let server = match ThrowawayServer::start(self.guardian) {
            Ok(server) => server,
            Err(e) => return self.report.error(EXIT_UNAVAILABLE, &e),
        };
        self.report.throwaway(&server.url(), &server.dir);
        let code = body(self, &server.url());
        server.stop(self.guardian);
        code
    }

    /// Campaigns for NAME, runs the command while leader, resigns after;
    /// with `recampaign`, a lost leadership means campaigning again.
    pub(super) fn elect(&mut self, url: &str, value: &str, recampaign: bool) -> ExitCode {
        let args = self.args;
        let coord = match endpoint::connect(url, &args.keys, self.tls) {
            Ok(c) => c,
            Err(e) if endpoint::is_usage(&e) => {
                return self.report.error(EXIT_USAGE, &e.to_string());
            }
            Err(e) => return self.report.error(EXIT_UNAVAILABLE, &e.to_string()),
        };
        let election = match coord.election(&endpoint::base(&args.key)) {
            Ok(e) => e,
            Err(e) => return self.report.error(EXIT_USAGE, &e.to_string()),
        };
        let ttl = args.ttl;
        loop {
            let leadership = match self.acquire(
                |deadline, cancel| match deadline {
                    Some(d) if d <= Instant::now() => election.try_campaign(value, ttl),
                    Some(d) => election.campaign_until(value, ttl, d, cancel),
                    None => election.campaign(value, ttl, cancel).map(Some),
                },
                |_| Ok(None),
                |l: Leadership| drop(l.resign()),
                || election.leader().map(drop).map_err(|e| e.to_string()),
            ) {
                Ok(l) => l,
                Err(code) => return code,
            };
            let renewal = match leadership.keep_alive() {
                Ok(r) => r,
                Err(e @ Error::InvalidArgument(_)) => {
                    return self.report.error(EXIT_USAGE, &e.to_string());
                }
                Err(e) => return self.report.error(EXIT_UNAVAILABLE, &e.to_string()),
            };
            let term = leadership.term();
            let grant = Grant {
                lease_key: election.lease_key().to_owned(),
                token: Some(term.get()),
                write_epoch: None,
                slot: None,
            };
            self.report.acquired(&grant, "leader", ttl);
            let mut env = grant.env();
            env.push(("RESPIRE_LEADER_TERM", term.to_string()));
            env.push(("RESPIRE_LEADER_VALUE", value.to_owned()));
            let why_lost = library_loss;
            let held = Held {
                lost: leadership.lost_signal(),
                remaining: &|| leadership.remaining_estimate(),
                is_lost: &|| leadership.is_lost(),
                why_lost: &why_lost,
            };
            let ended = self.run_child(&env, &held);
            drop(renewal);
            let (outcome, detail) = release_words(leadership.resign());
            self.report.released(outcome, detail.as_deref());
            match ended {
                Ended::LeaseLost(_) | Ended::LostBeforeStart if recampaign => {
                    self.report.recampaign()
                }
                ended => return self.finish(ended),
            }
        }
    }

    pub(super) fn redlock(&mut self, urls: &[String]) -> ExitCode {
        let args = self.args;
        let options = RedlockOptions {
            node_timeout: args.keys.node_timeout,
            ..RedlockOptions::default()
        }
        .with_observer(losses::observer());
        // One coordinator per node: the group's settings, and the inspection
        // of what other modes hold there. A group is made only when every
        // node answers (their independence is checked then).
        let mut nodes = Vec::new();
        for url in urls {
            match endpoint::connect(url, &args.keys, self.tls) {
                Ok(c) => nodes.push(c),
                Err(e) if endpoint::is_usage(&e) => {
                    return self.report.error(EXIT_USAGE, &e.to_string());
                }
                Err(e) => return self.report.error(EXIT_UNAVAILABLE, &e.to_string()),
            }
        }
        let group = match RedlockGroup::new(nodes.clone(), options)
            .and_then(|g| g.with_holder(&holder(args)))
        {
            Ok(g) => g,
            Err(e) if endpoint::is_usage(&e) => {
                return self.report.error(EXIT_USAGE, &e.to_string());
            }
            Err(e) => return self.report.error(EXIT_UNAVAILABLE, &e.to_string()),
        };
        let lock = match group.lock(&endpoint::redlock_key(&args.key)) {
            Ok(lock) => lock,
            Err(e) => return self.report.error(EXIT_USAGE, &e.to_string()),
        };
        let base = endpoint::base(&args.key);
        let ttl = args.ttl;
        let lease_key = format!("{}{}", args.keys.prefix, endpoint::redlock_key(&args.key));
        self.hold_lease(
            &lock,
            "redlock",
            |g: &RedlockGuard| {
                // An exclusive run of one deployment can use any node, so the
                // group must hold the key on every node it reaches, not only
                // on a quorum. An acquire returns at a quorum; this extension
                // hears every node and says which ones hold it.
                let _ = g.extend_on_every_node(ttl);
                let evidence = g.last_evidence();
                for (i, n) in evidence.iter().enumerate() {
                    match &n.outcome {
                        // The node confirmed the extension: it holds this
                        // run's value.
                        NodeOutcome::Granted | NodeOutcome::Uncounted(_) => {}
                        NodeOutcome::HeldByAnother { .. } | NodeOutcome::Missing => {
                            return Ok(Some(format!(
                                "exclusive on {} (a fenced run there, or another Redlock run)",
                                n.node
                            )));
                        }
                        // No answer. What the node holds cannot tell this
                        // run's value from another Redlock run's, about to be
                        // deleted there: a node that answers an inspection
                        // counts as held, one that refuses connections runs
                        // no server.
                        _ => match nodes.get(i).map(|c| c.inspect(&base)) {
                            Some(Ok(_)) => {
                                return Ok(Some(format!(
                                    "unknown: {} did not confirm this run's grant ({})",
                                    n.node, n.outcome
                                )));
                            }
                            Some(Err(e)) => {
                                if let Some(why) = unread(&n.node, &e) {
                                    return Ok(Some(why));
                                }
                            }
                            None => {}
                        },
                    }
                }
                // What shared and counted runs hold on any reachable node.
                for (i, node) in nodes.iter().enumerate() {
                    match node.inspect(&base) {
                        Ok(ins) => {
                            if let Some(other) = describe_others(&ins, true) {
                                return Ok(Some(other));
                            }
                        }
                        Err(e) => {
                            let name = evidence
                                .get(i)
                                .map_or_else(|| format!("node {}", i + 1), |n| n.node.clone());
                            if let Some(why) = unread(&name, &e) {
                                return Ok(Some(why));
                            }
                        }
                    }
                }
                Ok(None)
            },
            || {
                let answering = nodes.iter().filter(|n| n.inspect(&base).is_ok()).count();
                if answering * 2 > nodes.len() {
                    Ok(())
                } else {
                    Err(format!(
                        "{answering} of {} nodes answer, no quorum",
                        nodes.len()
                    ))
                }
            },
            |_| Grant {
                lease_key: lease_key.clone(),
                token: None,
                write_epoch: None,
                slot: None,
            },
            redlock_loss,
        )
    }
}

/// What a release found, as the `released` event's outcome and detail.
fn release_words(
    released: respire_coordination::Result<ReleaseOutcome>,
) -> (&'static str, Option<String>) {
    match released {
        Ok(ReleaseOutcome::Released) => ("released", None),
        Ok(ReleaseOutcome::Expired) => ("expired", Some("the lease had expired before".into())),
        Ok(ReleaseOutcome::TakenOver) => (
            "taken_over",
            Some("another holder had the key; it was left alone".into()),
        ),
        Ok(ReleaseOutcome::Uncertain) => (
            "uncertain",
            Some("no reply; the lease ends at its expiry at the latest".into()),
        ),
        Ok(other) => ("uncertain", Some(format!("{other:?}"))),
        Err(e) => ("failed", Some(e.to_string())),
    }
}

/// What holds KEY in another mode than `mode`, if anything.
fn other_mode(
    coord: &Coordinator,
    base: &str,
    mode: Mode,
) -> respire_coordination::Result<Option<String>> {
    let ins = coord.inspect(base)?;
    Ok(match mode {
        Mode::Exclusive | Mode::Shared => (!ins.permits.is_empty())
            .then(|| format!("counted (--max), {} permit(s)", ins.permits.len())),
        Mode::Counted(_) => describe_others(&ins, false),
    })
}

/// Why a Redlock run backs off from `node`, whose keys it could not read
/// (`err`): anything may be held there, so the run takes it as held. `None`
/// for a node that refused the connection: no server runs there, and a
/// Redlock run holds every node it reaches.
fn unread(node: &str, err: &Error) -> Option<String> {
    let refused = matches!(err, Error::Connect { .. }) && !err.is_timeout();
    (!refused).then(|| format!("unknown: {node} did not say what it holds ({err})"))
}

/// The exclusive holder (unless `skip_exclusive`) or the readers of an
/// inspection, and with `skip_exclusive` its permits too, as a mode.
fn describe_others(ins: &respire_coordination::Inspection, skip_exclusive: bool) -> Option<String> {
    if !skip_exclusive && let Some(x) = &ins.exclusive {
        return Some(match x.fencing_token {
            Some(t) => format!("exclusive (fenced, token {t})"),
            None => "exclusive (--redlock)".into(),
        });
    }
    if !ins.readers.is_empty() {
        return Some(format!(
            "shared (--shared), {} holder(s)",
            ins.readers.len()
        ));
    }
    if skip_exclusive && !ins.permits.is_empty() {
        return Some(format!("counted (--max), {} permit(s)", ins.permits.len()));
    }
    None
}

/// The loss of the lease the command runs under, as the library reported
/// it (see [`losses`]).
fn library_loss() -> Loss {
    losses::first(Duration::from_secs(1)).unwrap_or_else(|| Loss {
        cause: "other",
        reason: "the library reported no cause within a second of the loss".into(),
    })
}

/// A Redlock loss in the library's words, with what each node last said.
fn redlock_loss(guard: &RedlockGuard) -> Loss {
    let mut loss = library_loss();
    let nodes: Vec<String> = guard
        .last_evidence()
        .iter()
        .map(|n| format!("{}: {}", n.node, n.outcome))
        .collect();
    loss.reason = format!("{} (nodes: {})", loss.reason, nodes.join("; "));
    loss
}
