//! A Sentinel deployment: the current primary's node. One `respire-sentinel`
//! thread per sentinel follows `+switch-master`; `respire-topology` acts on
//! it and every refresh interval asks every sentinel for the primary.

use std::sync::{Arc, Weak};
use std::time::Duration;

use crossbeam_channel::{Receiver, Sender};
use parking_lot::RwLock;

use crate::clock::Clock;
use crate::conn::cluster::NodeAddr;
use crate::conn::sentinel::{parse_master_addr, parse_switch};
use crate::conn::{Conn, ConnConfig, RoleCheck};
use crate::core::timing::resubscribe_after;
use crate::error::{Error, Result};
use crate::observe;
use crate::replication::ReplicationPoint;
use crate::runtime::server::Server;

use super::{MIN_REFRESH, Settings, Shape, Topology};

const SWITCH_CHANNEL: &str = "+switch-master";
const SENTINEL_READ_TIMEOUT: Duration = Duration::from_millis(250);
const SENTINEL_PING_EVERY: Duration = Duration::from_secs(5);

pub(super) struct Sentinel {
    pub(super) service: String,
    pub(super) sentinels: Vec<Arc<ConnConfig>>,
    /// The data nodes' settings (credentials, TLS); each primary's is this
    /// with its address.
    pub(super) template: Arc<ConnConfig>,
    pub(super) current: RwLock<(NodeAddr, Arc<Server>)>,
}

impl Topology {
    /// A Sentinel deployment: asks the sentinels in turn for the primary of
    /// `service`, connects to it (checking `ROLE`), and starts the threads
    /// that follow it.
    pub(crate) fn sentinel(
        sentinels: Vec<Arc<ConnConfig>>,
        service: &str,
        template: Arc<ConnConfig>,
        s: &Settings,
    ) -> Result<Arc<Topology>> {
        let describe = format!(
            "redis+sentinel://{}/{service}",
            sentinels
                .iter()
                .map(|c| c
                    .addr
                    .trim_start_matches("redis://")
                    .trim_start_matches("rediss://"))
                .collect::<Vec<_>>()
                .join(",")
        );
        let mut found = None;
        let mut errors: Vec<String> = Vec::new();
        let mut unknown = 0;
        for sentinel in &sentinels {
            let addr = match ask_master(sentinel, service, sentinel.connect_timeout, &mut None) {
                Ok(Some(addr)) => addr,
                Ok(None) => {
                    unknown += 1;
                    errors.push(format!("{} does not know {service:?}", sentinel.addr));
                    continue;
                }
                Err(e @ (Error::Auth { .. } | Error::Tls { .. })) => return Err(e),
                Err(e) => {
                    errors.push(format!("{}: {e}", sentinel.addr));
                    continue;
                }
            };
            let cfg = template.for_addr(&addr.host, addr.port, RoleCheck::Primary)?;
            match cfg.connect(cfg.connect_timeout, "respire") {
                Ok(conn) => {
                    found = Some((addr, Arc::new(cfg), conn));
                    break;
                }
                Err(e @ (Error::Auth { .. } | Error::Tls { .. } | Error::Permission(_))) => {
                    return Err(e);
                }
                Err(e) => errors.push(format!(
                    "{} named {addr} as the primary of {service:?}: {e}",
                    sentinel.addr
                )),
            }
        }
        let Some((addr, cfg, conn)) = found else {
            let why = if unknown == sentinels.len() {
                format!("no sentinel knows the service {service:?}")
            } else {
                format!("no primary of {service:?} could be reached")
            };
            return Err(Error::Topology(format!("{why}: {}", errors.join("; "))));
        };
        let (poke_tx, poke_rx) = crossbeam_channel::bounded(1);
        let (stop_tx, stop_rx) = crossbeam_channel::bounded::<()>(0);
        let pool = s.pool_size;
        let clock = s.clock.clone();
        let sentinel_cfgs = sentinels.clone();
        let topo = Topology::build(
            |this, counters, registry| {
                let node =
                    Topology::new_node(cfg, this, counters, registry, pool, &clock, s.timing);
                node.pool.seed(conn);
                Shape::Sentinel(Sentinel {
                    service: service.to_owned(),
                    sentinels: sentinel_cfgs,
                    template,
                    current: RwLock::new((addr, node)),
                })
            },
            describe,
            s,
            Some((poke_tx, stop_tx)),
        );
        let (events_tx, events_rx) = crossbeam_channel::unbounded();
        let thread_error = |source| Error::Thread {
            name: "respire-sentinel",
            source,
        };
        for (i, sentinel) in sentinels.iter().enumerate() {
            let (cfg, events, stop) = (sentinel.clone(), events_tx.clone(), stop_rx.clone());
            let service = service.to_owned();
            let node_timeout = s.timing.node_timeout;
            std::thread::Builder::new()
                .name(format!("respire-sentinel-{i}"))
                .spawn(move || follow_sentinel(&cfg, node_timeout, &service, &events, &stop))
                .map_err(thread_error)?;
        }
        let weak = Arc::downgrade(&topo);
        let interval = s.refresh;
        let thread_clock = s.clock.clone();
        std::thread::Builder::new()
            .name("respire-topology".into())
            .spawn(move || {
                sentinel_thread(
                    &weak,
                    &events_rx,
                    &poke_rx,
                    &stop_rx,
                    interval,
                    &*thread_clock,
                )
            })
            .map_err(|source| Error::Thread {
                name: "respire-topology",
                source,
            })?;
        Ok(topo)
    }

    /// Moves the current Sentinel primary to `addr` after checking `ROLE`
    /// there; true when it switched.
    fn switch_to(&self, addr: &NodeAddr) -> bool {
        let Shape::Sentinel(s) = &self.shape else {
            return false;
        };
        if s.current.read().0 == *addr {
            return false;
        }
        let cfg = match self.node_cfg(addr) {
            Ok(cfg) => cfg,
            Err(e) => {
                log::warn!("cannot use {addr} as the primary of {}: {e}", s.service);
                return false;
            }
        };
        // `INFO replication` in the setup round trip: the new primary's
        // history is judged now, so that a coordinator idle through several
        // switches still knows each history the acknowledged grants went
        // through (a server names only its own and its predecessor's).
        let info = redis::cmd("INFO").arg("replication").clone();
        let budget = self.timing.node_timeout.min(cfg.connect_timeout);
        let conn = match cfg.connect_with(budget, "respire", &[info]) {
            Ok(opened) => {
                if let Some(point) = opened.replies.first().and_then(replication_point) {
                    self.history.observe(&cfg.addr, &point, false);
                }
                opened.conn
            }
            Err(e) => {
                log::warn!(
                    "sentinels name {addr} as the primary of {}, but: {e}",
                    s.service
                );
                return false;
            }
        };
        let node = self.make_node(cfg);
        node.pool.seed(conn);
        let old = {
            let mut current = s.current.write();
            std::mem::replace(&mut *current, (addr.clone(), node.clone()))
        };
        if old.1.tracking_started()
            && let Err(e) = node.tracker()
        {
            log::warn!("cannot start the invalidation subscriber for {addr}: {e}");
        }
        old.1.retire();
        log::warn!(
            "the primary of {} switched from {} to {addr}",
            s.service,
            old.0
        );
        observe::switched(self.observer(), &self.describe, &old.0, addr);
        self.slots_changed(&|_| true);
        true
    }

    /// Asks every sentinel for the primary and follows a majority of those that
    /// answered.
    fn check_sentinels(&self, conns: &mut [Option<Conn>]) {
        let Shape::Sentinel(s) = &self.shape else {
            return;
        };
        let mut answers = Vec::with_capacity(s.sentinels.len());
        for (i, sentinel) in s.sentinels.iter().enumerate() {
            let budget = self.timing.node_timeout.min(sentinel.connect_timeout);
            match ask_master(sentinel, &s.service, budget, &mut conns[i]) {
                Ok(named) => answers.push(named),
                Err(e) => log::debug!("sentinel {}: {e}", sentinel.addr),
            }
        }
        if let Some(addr) = majority(&answers) {
            self.switch_to(addr);
        }
    }

    /// A `+switch-master` for our service.
    fn on_switch(&self, old: &NodeAddr, new: &NodeAddr, conns: &mut [Option<Conn>]) {
        let Shape::Sentinel(s) = &self.shape else {
            return;
        };
        let current = s.current.read().0.clone();
        if current == *new {
            return;
        }
        // A message naming the primary in use as the old one is followed at
        // once; any other (a sentinel that rejoined with a stale view) only
        // makes us ask them all.
        if current != *old || !self.switch_to(new) {
            self.check_sentinels(conns);
        }
    }
}

/// The replication history an `INFO replication` reply names, if it is a
/// primary's.
fn replication_point(reply: &redis::Value) -> Option<ReplicationPoint> {
    crate::reply::text(reply).and_then(ReplicationPoint::parse)
}

/// The primary named by more than half of the sentinels that answered, if
/// one is. `answers` holds one entry per sentinel that answered: the primary
/// it named, or `None` when it does not know the service (it counts among
/// those that answered, and names nobody).
fn majority(answers: &[Option<NodeAddr>]) -> Option<&NodeAddr> {
    let mut votes: Vec<(&NodeAddr, usize)> = Vec::new();
    for addr in answers.iter().flatten() {
        match votes.iter_mut().find(|(a, _)| *a == addr) {
            Some((_, n)) => *n += 1,
            None => votes.push((addr, 1)),
        }
    }
    votes.sort_by_key(|v| std::cmp::Reverse(v.1));
    votes
        .first()
        .filter(|(_, n)| n * 2 > answers.len())
        .map(|(addr, _)| *addr)
}

/// `SENTINEL GET-MASTER-ADDR-BY-NAME service` on the sentinel `cfg`, reusing
/// `conn` when it is open. `Ok(None)`: the sentinel does not know the service.
fn ask_master(
    cfg: &ConnConfig,
    service: &str,
    budget: Duration,
    conn: &mut Option<Conn>,
) -> Result<Option<NodeAddr>> {
    if conn.as_ref().is_some_and(Conn::is_broken) {
        *conn = None;
    }
    if conn.is_none() {
        *conn = Some(cfg.connect(budget, "respire-sentinel")?);
    }
    let c = conn.as_mut().expect("connected above");
    let cmd = redis::cmd("SENTINEL")
        .arg("GET-MASTER-ADDR-BY-NAME")
        .arg(service)
        .clone();
    match c.query::<redis::Value>(
        &cmd,
        "SENTINEL GET-MASTER-ADDR-BY-NAME",
        cfg.clock.now() + budget,
    ) {
        Ok(redis::Value::Nil) => Ok(None),
        Ok(v) => parse_master_addr(&v)
            .map(Some)
            .ok_or_else(|| Error::UnexpectedReply {
                op: "SENTINEL GET-MASTER-ADDR-BY-NAME",
                reply: format!("{v:?}"),
            }),
        Err(Error::Server { source, .. })
            if source
                .to_string()
                .to_ascii_lowercase()
                .contains("unknown command") =>
        {
            Err(Error::Topology(format!("{} is not a sentinel", cfg.addr)))
        }
        Err(e) => {
            if e.is_uncertain() {
                *conn = None;
            }
            Err(e)
        }
    }
}

fn stopped(stop: &Receiver<()>) -> bool {
    matches!(
        stop.try_recv(),
        Err(crossbeam_channel::TryRecvError::Disconnected)
    )
}

/// What a sentinel follower reports.
enum Event {
    /// `+switch-master` for our service.
    Switch { old: NodeAddr, new: NodeAddr },
    /// Subscribed again after a gap: messages may have been missed.
    Resubscribed,
}

/// `respire-topology` of a Sentinel deployment.
fn sentinel_thread(
    topo: &Weak<Topology>,
    events: &Receiver<Event>,
    poke: &Receiver<()>,
    stop: &Receiver<()>,
    interval: Duration,
    clock: &dyn Clock,
) {
    let count = match topo.upgrade().map(|t| match &t.shape {
        Shape::Sentinel(s) => s.sentinels.len(),
        _ => 0,
    }) {
        Some(n) => n,
        None => return,
    };
    let mut conns: Vec<Option<Conn>> = (0..count).map(|_| None).collect();
    let mut last = clock.now();
    loop {
        let next = last + interval;
        let mut switch = None;
        crossbeam_channel::select! {
            recv(events) -> e => match e {
                Ok(Event::Switch { old, new }) => switch = Some((old, new)),
                Ok(Event::Resubscribed) => {}
                Err(_) => return,
            },
            recv(poke) -> _ => {
                let since = clock.now().saturating_duration_since(last);
                if since < MIN_REFRESH {
                    std::thread::sleep(MIN_REFRESH - since);
                }
            }
            recv(stop) -> _ => return,
            recv(crossbeam_channel::at(next)) -> _ => {}
        }
        let Some(topo) = topo.upgrade() else {
            return;
        };
        match switch {
            Some((old, new)) => topo.on_switch(&old, &new, &mut conns),
            None => topo.check_sentinels(&mut conns),
        }
        drop(topo);
        last = clock.now();
        while poke.try_recv().is_ok() {}
    }
}

/// `respire-sentinel-N`: follows `+switch-master` on one sentinel, with
/// reconnects, until `stop` is disconnected.
fn follow_sentinel(
    cfg: &ConnConfig,
    node_timeout: Duration,
    service: &str,
    events: &Sender<Event>,
    stop: &Receiver<()>,
) {
    let mut failures = 0u32;
    let mut first = true;
    loop {
        if stopped(stop) {
            return;
        }
        match subscribe_switches(cfg, node_timeout, service, events, stop, &mut first) {
            Ok(()) => return,
            Err(e) => log::debug!("following {SWITCH_CHANNEL} on {}: {e}", cfg.addr),
        }
        failures = failures.saturating_add(1);
        if let Err(crossbeam_channel::RecvTimeoutError::Disconnected) =
            stop.recv_timeout(resubscribe_after(failures))
        {
            return;
        }
    }
}

/// One subscription; `Ok` when asked to stop.
fn subscribe_switches(
    cfg: &ConnConfig,
    node_timeout: Duration,
    service: &str,
    events: &Sender<Event>,
    stop: &Receiver<()>,
    first: &mut bool,
) -> Result<()> {
    let mut conn = cfg.connect_pubsub(cfg.connect_timeout, "respire-sentinel")?;
    let mut subscriber = conn.subscribe(SWITCH_CHANNEL, node_timeout, SENTINEL_READ_TIMEOUT)?;
    if !std::mem::take(first) {
        let _ = events.send(Event::Resubscribed);
    }
    subscriber.listen(SENTINEL_PING_EVERY, &|| stopped(stop), &mut |msg| {
        if msg.get_channel_name() != SWITCH_CHANNEL {
            return true;
        }
        let payload: String = msg.get_payload().unwrap_or_default();
        match parse_switch(&payload) {
            Some((name, old, new)) if name == service => {
                log::info!("{}: {SWITCH_CHANNEL} {payload}", cfg.addr);
                events.send(Event::Switch { old, new }).is_ok()
            }
            Some(_) => true,
            None => {
                log::debug!("unreadable {SWITCH_CHANNEL} message {payload:?}");
                true
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr(port: u16) -> Option<NodeAddr> {
        Some(NodeAddr {
            host: "127.0.0.1".to_owned(),
            port,
        })
    }

    #[test]
    fn a_primary_named_by_more_than_half_of_those_that_answered_is_followed() {
        assert_eq!(majority(&[addr(1)]), addr(1).as_ref());
        assert_eq!(majority(&[addr(1), addr(1), addr(2)]), addr(1).as_ref());
        assert_eq!(majority(&[addr(2), addr(1), addr(1)]), addr(1).as_ref());
        assert_eq!(
            majority(&[addr(1), addr(2), addr(2), None, addr(2)]),
            addr(2).as_ref()
        );
    }

    #[test]
    fn half_of_those_that_answered_or_fewer_move_nothing() {
        assert_eq!(majority(&[]), None);
        // Two sentinels that disagree (the third did not answer): a tie.
        assert_eq!(majority(&[addr(1), addr(2)]), None);
        assert_eq!(majority(&[addr(2), addr(1)]), None);
        assert_eq!(majority(&[addr(1), addr(1), addr(2), addr(2)]), None);
        // A sentinel that does not know the service answered, naming nobody.
        assert_eq!(majority(&[addr(1), None]), None);
        assert_eq!(majority(&[addr(1), None, None]), None);
        assert_eq!(majority(&[None, None, None]), None);
    }
}
