//! The optional replication guard: `WAIT` after every grant (and, under
//! `Require`, after every extension).

use std::time::Duration;

use parking_lot::Mutex;

/// Whether grants wait for replicas to acknowledge them.
///
/// Redis replicates asynchronously: a grant the primary acknowledged can be
/// lost in a failover to a replica that had not received it, and the new
/// primary can then grant the same lease again, or issue a fencing token
/// again. With `Report` or `Require`, every acquire attempt pipelines `WAIT
/// n timeout` right after its script on the same connection (one round trip;
/// `WAIT` covers everything the primary had written when that connection's
/// last command ran, so a grant found in place from an earlier attempt is
/// covered too), and the guard tells how many replicas acknowledged
/// ([`LeaseGuard::replicas_acknowledged`](crate::LeaseGuard::replicas_acknowledged)).
///
/// An acknowledgement narrows the window but is not consensus: a replica can
/// acknowledge and still not be the one promoted, and `WAIT` says nothing of
/// persistence. In particular Sentinel may promote a server that restarted
/// with an old copy of the data: a server configured without persistence
/// (`save ""`, no AOF) still loads, when it restarts, the RDB file its last
/// full synchronisation as a replica left on disk (`repl-diskless-load
/// disabled` and `rdb-del-sync-files no`, both defaults), comes back as a
/// primary holding that old data, and Sentinel can pick it in its next
/// failover (it does not look at the role a replica reports), then resync
/// every other server from it. The acknowledged grants since that RDB are
/// then gone from every server, and their fencing tokens are issued again.
/// No client can prevent that: a server without persistence that Sentinel
/// may promote must not come back by itself after a crash (the sync RDB is
/// not persistence; `rdb-del-sync-files yes` removes it, and the server then
/// comes back empty, which loses even more if promoted).
///
/// Under `Require` on a Sentinel deployment, the coordinator detects it: each
/// attempt also reads the primary's replication history (`INFO
/// replication`: its replication ids and offsets), the coordinator remembers
/// the point of the last grant replicas acknowledged, and a primary whose
/// history does not contain that point fails the grant with
/// [`Error::ReplicationHistoryLost`](crate::Error::ReplicationHistoryLost)
/// (the grant is released); so does every later acquire through that
/// coordinator, at once and sending nothing, since any token it would hand
/// out may have been handed out before. The limits of that check:
///
/// - It knows only what this coordinator saw acknowledged: a coordinator
///   built after the loss, or one that never had a grant acknowledged before
///   it, accepts the history as it finds it, and tokens issued to it may
///   repeat tokens issued before the loss.
/// - A primary remembers one earlier replication id: two failovers in a row
///   with no attempt of this coordinator in between look like a loss (the
///   error is then a false alarm).
/// - It judges replication histories, not persistence: a primary restarted
///   from its own AOF starts a new history (a new replication id, offset 0)
///   and is reported the same way, although with `appendfsync always` it
///   lost nothing.
/// - A user without the right to run `INFO` gets no check (logged at debug
///   level).
///
/// Each attempt may take up to `timeout` longer (the node timeout plus
/// `timeout` bounds it).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Replication {
    /// No `WAIT` (the default): grants are acknowledged by the primary alone.
    #[default]
    Off,
    /// `WAIT` for every replica the primary listed in `ROLE` when the
    /// connection was made, for at most `timeout`; the guard reports how many
    /// acknowledged. Nothing is refused.
    Report {
        /// How long `WAIT` may block, at least 1 ms.
        timeout: Duration,
    },
    /// `WAIT` for `replicas` acknowledgements, for at most `timeout`; a grant
    /// with fewer is released at once and the acquire fails with
    /// [`Error::NotReplicated`](crate::Error::NotReplicated). Extensions
    /// (every renewal pipeline, `reset_expiry`) are followed by `WAIT` too,
    /// and one with fewer acknowledgements does not count: the guard's bound
    /// stays where it was, so it never passes what the required replicas
    /// hold, and a guard whose replicas stop acknowledging is flagged lost at
    /// the last acknowledged extension's bound (see the crate docs on
    /// failovers and partitions).
    Require {
        /// How many replicas must acknowledge each grant, at least 1.
        replicas: u32,
        /// How long `WAIT` may block, at least 1 ms.
        timeout: Duration,
    },
}

impl Replication {
    /// How long `WAIT` may add to an attempt.
    pub(crate) fn timeout(&self) -> Duration {
        match self {
            Replication::Off => Duration::ZERO,
            Replication::Report { timeout } | Replication::Require { timeout, .. } => *timeout,
        }
    }
}

/// A primary's place in its replication history, from `INFO replication`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct ReplicationPoint {
    /// `master_replid`: the history the primary writes now.
    replid: String,
    /// `master_repl_offset`: bytes written into its history so far.
    offset: u64,
    /// `master_replid2` and `second_repl_offset`: the history it continued
    /// when it became a primary, which it shares with its old primary up to
    /// (not including) that offset.
    previous: Option<(String, u64)>,
}

impl ReplicationPoint {
    /// Reads the reply to `INFO replication`; `None` unless it comes from a
    /// primary and names its history.
    pub(crate) fn parse(info: &str) -> Option<ReplicationPoint> {
        let field = |name: &str| {
            info.lines().find_map(|line| {
                line.trim_end()
                    .strip_prefix(name)
                    .and_then(|rest| rest.strip_prefix(':'))
            })
        };
        if field("role")? != "master" {
            return None;
        }
        let replid = field("master_replid")?.to_owned();
        let offset = field("master_repl_offset")?.parse().ok()?;
        let previous = match (field("master_replid2"), field("second_repl_offset")) {
            (Some(id), Some(until)) if id.bytes().any(|b| b != b'0') => {
                until.parse().ok().map(|until| (id.to_owned(), until))
            }
            _ => None,
        };
        Some(ReplicationPoint {
            replid,
            offset,
            previous,
        })
    }

    /// Whether this history contains `offset` of the history `replid`.
    fn contains(&self, replid: &str, offset: u64) -> bool {
        (self.replid == replid && offset <= self.offset)
            || self
                .previous
                .as_ref()
                .is_some_and(|(id, until)| id == replid && offset < *until)
    }
}

/// What a coordinator knows of its primary's replication history: the point
/// of the last grant replicas acknowledged (named in the history of the
/// primary it last heard from), and whether a primary was found without it.
#[derive(Debug, Default)]
pub(crate) struct History {
    state: Mutex<HistoryState>,
}

#[derive(Debug, Default)]
struct HistoryState {
    /// The point of the last acknowledged grant.
    anchor: Option<Anchor>,
    /// Why the history is deemed lost, once it is: it stays so.
    lost: Option<String>,
}

/// An offset, and the replication ids of the primaries seen to hold it
/// (offsets continue across a promotion, under a new id), newest last.
#[derive(Debug)]
struct Anchor {
    replids: Vec<String>,
    offset: u64,
}

/// How many replication ids an [`Anchor`] keeps.
const ANCHOR_REPLIDS: usize = 8;

impl History {
    /// Judges what one attempt read on `addr` right after its script:
    /// `point`, and whether replicas acknowledged the attempt's grant.
    pub(crate) fn observe(&self, addr: &str, point: &ReplicationPoint, acknowledged: bool) {
        let mut state = self.state.lock();
        if state.lost.is_some() {
            return;
        }
        if let Some(anchor) = &mut state.anchor {
            if !anchor
                .replids
                .iter()
                .any(|replid| point.contains(replid, anchor.offset))
            {
                let why = format!(
                    "{addr} is the primary, but its replication history ({}) does not contain \
                     offset {} of {}, where replicas had acknowledged a grant",
                    describe(point),
                    anchor.offset,
                    anchor.replids.join(" or ")
                );
                log::error!("{why}: fencing tokens issued since may be issued again");
                state.lost = Some(why);
                return;
            }
            if !acknowledged {
                // The same point, in the history this primary writes now.
                if !anchor.replids.contains(&point.replid) {
                    if anchor.replids.len() == ANCHOR_REPLIDS {
                        anchor.replids.remove(0);
                    }
                    anchor.replids.push(point.replid.clone());
                }
                return;
            }
        }
        if acknowledged {
            state.anchor = Some(Anchor {
                replids: vec![point.replid.clone()],
                offset: point.offset,
            });
        }
    }

    /// Why the history is deemed lost, if it is.
    pub(crate) fn lost(&self) -> Option<String> {
        self.state.lock().lost.clone()
    }
}

fn describe(point: &ReplicationPoint) -> String {
    match &point.previous {
        Some((id, until)) => format!(
            "{} up to offset {}, continuing {id} before offset {until}",
            point.replid, point.offset
        ),
        None => format!("{} up to offset {}", point.replid, point.offset),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(replid: &str, offset: u64, previous: Option<(&str, u64)>) -> String {
        let (id2, until) = previous.unwrap_or(("0000000000000000000000000000000000000000", 0));
        let until = if previous.is_some() {
            until.to_string()
        } else {
            "-1".to_owned()
        };
        format!(
            "# Replication\r\nrole:master\r\nconnected_slaves:1\r\nmaster_replid:{replid}\r\n\
             master_replid2:{id2}\r\nmaster_repl_offset:{offset}\r\nsecond_repl_offset:{until}\r\n"
        )
    }

    fn point(replid: &str, offset: u64, previous: Option<(&str, u64)>) -> ReplicationPoint {
        ReplicationPoint::parse(&info(replid, offset, previous)).expect("a primary's INFO")
    }

    #[test]
    fn parses_a_primary_and_ignores_a_replica() {
        assert_eq!(
            point("aa", 120, Some(("bb", 100))),
            ReplicationPoint {
                replid: "aa".into(),
                offset: 120,
                previous: Some(("bb".into(), 100)),
            }
        );
        assert_eq!(point("aa", 5, None).previous, None);
        let replica = info("aa", 5, None).replace("role:master", "role:slave");
        assert_eq!(ReplicationPoint::parse(&replica), None);
    }

    #[test]
    fn a_promotion_that_kept_the_acknowledged_point_passes_and_one_that_did_not_is_lost() {
        let h = History::default();
        h.observe("p", &point("aa", 500, None), true);
        // The deposed primary writes on; unacknowledged attempts move nothing.
        h.observe("p", &point("aa", 900, None), false);
        // The replica that acknowledged offset 500 was promoted at 600.
        h.observe("q", &point("bb", 650, Some(("aa", 601))), false);
        // And again, with no acknowledged grant in between.
        h.observe("p", &point("cc", 700, Some(("bb", 680))), false);
        // The deposed primary promoted back: its own history still holds it.
        h.observe("p", &point("aa", 950, None), false);
        assert_eq!(h.lost(), None);
        // A server restarted from an old RDB: a new id, continuing an older point.
        h.observe("r", &point("dd", 400, Some(("cc", 401))), false);
        let why = h.lost().expect("the point is not in that history");
        assert!(why.contains("offset 500"), "{why}");
        // It stays lost.
        h.observe("q", &point("cc", 900, None), true);
        assert!(h.lost().is_some());
    }

    #[test]
    fn nothing_is_judged_before_a_grant_is_acknowledged() {
        let h = History::default();
        h.observe("p", &point("aa", 500, None), false);
        h.observe("r", &point("zz", 10, None), false);
        assert_eq!(h.lost(), None);
        h.observe("r", &point("zz", 20, None), true);
        h.observe("r", &point("yy", 20, Some(("zz", 15))), false);
        assert!(h.lost().is_some());
    }
}
