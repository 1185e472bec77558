//! Which server holds a key: a standalone server, the primary a Sentinel
//! deployment names, or the owner of the key's slot in a Redis Cluster — and
//! how calls, renewals and waits follow it when it changes.
//!
//! - Standalone: one [`Server`]; nothing changes.
//! - Cluster: a slot map read from `CLUSTER SHARDS` (`CLUSTER SLOTS` on
//!   servers before 7.0) at start, refreshed every refresh interval by the
//!   `respire-topology` thread and at once after a `MOVED`. One node per
//!   primary. A call answered `MOVED` updates the map from the reply and is
//!   tried once more on the new owner; `ASK` is followed with `ASKING`;
//!   `TRYAGAIN` (a multi-key script while the slot's keys are split between
//!   two nodes) is tried again after a short pause while the call's deadline
//!   allows.
//! - Sentinel: the current primary's node. One `respire-sentinel` thread per
//!   sentinel follows `+switch-master` (RESP2 pub/sub with read timeouts);
//!   `respire-topology` acts on it when the message names the primary in use
//!   as the old one, and every refresh interval asks every sentinel for the
//!   primary (`SENTINEL GET-MASTER-ADDR-BY-NAME`) and follows a majority.
//!   Every connection to a data node checks `ROLE` in its setup round trip.
//!   On a switch the old node is retired (its pool closed), the new one gets
//!   a subscriber if the old had one, and every waiter is woken.
//!
//! When keys may have moved (slots changed owner, a new primary), the waiters
//! on them are woken — the old owner may never send an invalidation — and
//! every live lease on them is verified on its new server by that server's
//! executor, so one that is missing there is flagged lost at once rather
//! than at its deadline. A call whose reply came from a node retired in the
//! meantime is run once more on the current one.
//!
//! The facade (`mod.rs`) matches on a private enum with one variant per
//! flavour; each flavour's constructor, state and threads are in a file of
//! its own: `standalone.rs`, `cluster.rs` (the slot map and its refresh) and
//! `sentinel.rs` (following the primary).

mod cluster;
mod sentinel;
mod standalone;

use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use crossbeam_channel::Sender;

use crate::clock::Clock;
use crate::conn::cluster::{NodeAddr, Redirect, redirect};
use crate::conn::{Conn, ConnConfig, Connect, Identity, RoleCheck};
use crate::core::timing::{Timing, backoff};
use crate::error::{Error, Result};
use crate::keys::key_slot;
use crate::observe::{self, Observer};
use crate::replication::History;
use crate::runtime::lease::LiveLeases;
use crate::runtime::registry::Registry;
use crate::runtime::renewal::{
    self, Cell, Claims, Counters, DeploymentRenewal, Lanes, RenewalStats, unsent,
};
use crate::runtime::server::{Directory, Server, ServerJob};
use crate::runtime::tracking::Tracker;
use crate::runtime::waiters::{OnTracked, Route};

use cluster::{Cluster, NO_OWNER};
use sentinel::Sentinel;

/// The shortest refresh interval accepted.
pub(crate) const MIN_REFRESH: Duration = Duration::from_millis(10);
/// The pause before the `n`-th try again of a `TRYAGAIN`: 2 ms, doubling,
/// at most 50 ms.
fn try_again_pause(n: u32) -> Duration {
    backoff(n, Duration::from_millis(2), Duration::from_millis(50), 1.0)
}

/// A node, borrowed from a standalone deployment or owned from a map.
pub(crate) enum NodeRef<'a> {
    Borrowed(&'a Arc<Server>),
    Owned(Arc<Server>),
}

impl NodeRef<'_> {
    pub(crate) fn arc(&self) -> Arc<Server> {
        match self {
            NodeRef::Borrowed(n) => Arc::clone(n),
            NodeRef::Owned(n) => n.clone(),
        }
    }
}

impl std::ops::Deref for NodeRef<'_> {
    type Target = Arc<Server>;
    fn deref(&self) -> &Arc<Server> {
        match self {
            NodeRef::Borrowed(n) => n,
            NodeRef::Owned(n) => n,
        }
    }
}

/// Where a command that got no reply went: its server and connection.
#[derive(Clone)]
pub(crate) struct Uncertain {
    pub(crate) node: Arc<Server>,
    pub(crate) conn: Option<Identity>,
}

/// The settings every node of a deployment shares.
pub(crate) struct Settings {
    pub(crate) pool_size: usize,
    pub(crate) refresh: Duration,
    pub(crate) clock: Arc<dyn Clock>,
    /// The deployment's drift factor and node timeout.
    pub(crate) timing: Timing,
    /// Told of topology changes, the fall-back to polling and every lease.
    pub(crate) observer: Option<Arc<dyn Observer>>,
}

enum Shape {
    Standalone(Arc<Server>),
    Cluster(Cluster),
    Sentinel(Sentinel),
}

/// One deployment's servers and the runtime around them.
pub(crate) struct Topology {
    shape: Shape,
    registry: Arc<Registry>,
    renewal: DeploymentRenewal,
    counters: Arc<Counters>,
    clock: Arc<dyn Clock>,
    timing: Timing,
    pool_size: usize,
    /// Live leases, for re-verification after a change.
    live: LiveLeases<Cell>,
    /// Asks the topology thread to look again now.
    poke: Option<Sender<()>>,
    /// Dropped with the topology: its threads stop.
    _stop: Option<Sender<()>>,
    this: Weak<Topology>,
    describe: String,
    /// The replication history the replication guard vouches for; a
    /// Sentinel switch reads the new primary's into it.
    pub(crate) history: Arc<History>,
}

impl Topology {
    fn build(
        shape: impl FnOnce(&Weak<Topology>, &Arc<Counters>, &Arc<Registry>) -> Shape,
        describe: String,
        s: &Settings,
        threads: Option<(Sender<()>, Sender<()>)>,
    ) -> Arc<Topology> {
        let counters: Arc<Counters> = Arc::default();
        let registry = Arc::new(
            Registry::new(describe.clone(), s.clock.clone()).observed_by(s.observer.clone()),
        );
        let (poke, stop) = match threads {
            Some((poke, stop)) => (Some(poke), Some(stop)),
            None => (None, None),
        };
        Arc::new_cyclic(|this: &Weak<Topology>| {
            let lanes: Weak<dyn Lanes> = this.clone();
            Topology {
                shape: shape(this, &counters, &registry),
                registry: registry.clone(),
                renewal: renewal::renewal(s.clock.clone(), lanes),
                counters: counters.clone(),
                clock: s.clock.clone(),
                timing: s.timing,
                pool_size: s.pool_size,
                live: LiveLeases::new(),
                poke,
                _stop: stop,
                this: this.clone(),
                describe,
                history: Arc::default(),
            }
        })
    }

    fn new_node(
        cfg: Arc<ConnConfig>,
        this: &Weak<Topology>,
        counters: &Arc<Counters>,
        registry: &Arc<Registry>,
        s_pool: usize,
        clock: &Arc<dyn Clock>,
        timing: Timing,
    ) -> Arc<Server> {
        let dir: Weak<dyn Directory> = this.clone();
        Arc::new(Server::new(
            cfg,
            s_pool,
            dir,
            clock.clone(),
            timing,
            counters.clone(),
            registry.clone(),
        ))
    }

    fn make_node(&self, cfg: Arc<ConnConfig>) -> Arc<Server> {
        Topology::new_node(
            cfg,
            &self.this,
            &self.counters,
            &self.registry,
            self.pool_size,
            &self.clock,
            self.timing,
        )
    }

    /// The deployment's drift factor and node timeout.
    pub(crate) fn timing(&self) -> Timing {
        self.timing
    }

    /// What this deployment is, for messages.
    pub(crate) fn describe(&self) -> &str {
        &self.describe
    }

    /// The deployment's observer, if any.
    pub(crate) fn observer(&self) -> Option<&Arc<dyn Observer>> {
        self.registry.observer()
    }

    /// The renewal thread.
    pub(crate) fn renewal_thread(&self) -> &DeploymentRenewal {
        &self.renewal
    }

    pub(crate) fn stats(&self) -> RenewalStats {
        self.counters.stats()
    }

    /// The server of a standalone deployment.
    pub(crate) fn standalone_node(&self) -> Option<&Arc<Server>> {
        match &self.shape {
            Shape::Standalone(node) => Some(node),
            _ => None,
        }
    }

    /// Whether this is a Redis Cluster.
    pub(crate) fn is_cluster(&self) -> bool {
        matches!(self.shape, Shape::Cluster(_))
    }

    /// Whether this is a Sentinel deployment.
    pub(crate) fn is_sentinel(&self) -> bool {
        matches!(self.shape, Shape::Sentinel(_))
    }

    /// Every primary known now.
    pub(crate) fn primaries(&self) -> Vec<Arc<Server>> {
        match &self.shape {
            Shape::Standalone(node) => vec![node.clone()],
            Shape::Cluster(c) => c.map.read().nodes.clone(),
            Shape::Sentinel(s) => vec![s.current.read().1.clone()],
        }
    }

    /// The node that serves `key` now.
    pub(crate) fn node_for(&self, key: &str) -> Result<NodeRef<'_>> {
        match &self.shape {
            Shape::Standalone(node) => Ok(NodeRef::Borrowed(node)),
            Shape::Cluster(c) => {
                let slot = key_slot(key.as_bytes());
                let map = c.map.read();
                match map.owner[usize::from(slot)] {
                    NO_OWNER => {
                        drop(map);
                        self.suspect();
                        Err(Error::Topology(format!(
                            "no node of {} serves slot {slot} (of {key:?})",
                            self.describe
                        )))
                    }
                    idx => Ok(NodeRef::Owned(map.nodes[usize::from(idx)].clone())),
                }
            }
            Shape::Sentinel(s) => Ok(NodeRef::Owned(s.current.read().1.clone())),
        }
    }

    /// Remembers a lease granted here, to verify it after a change and to
    /// cut it when its server's clock runs ahead.
    pub(crate) fn register(&self, cell: &Arc<Cell>) {
        self.live.register(cell);
    }

    /// Runs `f` on a connection to the server that holds `key`, following
    /// redirections and a retired primary, within `deadline` (plus the connect
    /// timeout per connection opened with [`Connect::Own`]). Returns where a
    /// command that got no reply went.
    pub(crate) fn run<T>(
        &self,
        key: &str,
        deadline: Instant,
        connect: Connect,
        f: &mut dyn FnMut(&Server, &mut Conn, Instant) -> Result<T>,
    ) -> (Result<T>, Option<Uncertain>) {
        let mut node = match self.node_for(key) {
            Ok(node) => node,
            Err(e) => return (Err(e), None),
        };
        let mut deadline = deadline;
        let mut moved = false;
        let mut asking = false;
        let mut asks = 0;
        let mut reran = false;
        let mut try_agains = 0u32;
        loop {
            let tried = try_on(&node, &mut deadline, connect, asking, f);
            let (result, conn_id) = match tried {
                Ok(tried) => tried,
                Err(e) => {
                    if matches!(e, Error::Topology(_)) {
                        self.suspect();
                        // The node was retired while we looked it up.
                        if !reran && !matches!(self.shape, Shape::Standalone(_)) {
                            reran = true;
                            match self.node_for(key) {
                                Ok(n) => {
                                    node = n;
                                    continue;
                                }
                                Err(e) => return (Err(e), None),
                            }
                        }
                    }
                    return (Err(e), None);
                }
            };
            let err = match result {
                // A reply from a server that stopped being the primary while
                // the command ran: once more on the current one (every
                // command this crate sends is idempotent for its owner).
                Ok(_) if node.is_retired() && !reran => {
                    reran = true;
                    log::debug!(
                        "{} was retired during a call; running it again",
                        node.addr()
                    );
                    match self.node_for(key) {
                        Ok(n) => {
                            node = n;
                            asking = false;
                            continue;
                        }
                        Err(e) => return (Err(e), None),
                    }
                }
                Ok(v) => return (Ok(v), None),
                Err(e) if e.is_uncertain() => {
                    let lost = Uncertain {
                        node: node.arc(),
                        conn: conn_id,
                    };
                    return (Err(e), Some(lost));
                }
                Err(e) => e,
            };
            match redirect(&err, &node.host) {
                Some(Redirect::Moved { slot, addr }) if !moved => {
                    moved = true;
                    asking = false;
                    match self.moved(slot, &addr) {
                        Some(n) => node = NodeRef::Owned(n),
                        None => return (Err(err), None),
                    }
                }
                Some(Redirect::Ask { addr }) if asks < 2 => {
                    asks += 1;
                    match self.node_at(&addr) {
                        Some(n) => {
                            node = NodeRef::Owned(n);
                            asking = true;
                        }
                        None => return (Err(err), None),
                    }
                }
                Some(Redirect::TryAgain)
                    if self.clock.now() + try_again_pause(try_agains + 1) < deadline =>
                {
                    try_agains += 1;
                    std::thread::sleep(try_again_pause(try_agains));
                }
                _ => {
                    if let Error::Server { source, .. } = &err
                        && matches!(source.code(), Some("READONLY" | "MOVED" | "CLUSTERDOWN"))
                    {
                        self.suspect();
                    }
                    if matches!(err, Error::Topology(_)) {
                        self.suspect();
                    }
                    return (Err(err), None);
                }
            }
        }
    }

    /// Wakes the waiters and re-verifies the live leases on every slot
    /// `changed` names.
    fn slots_changed(&self, changed: &dyn Fn(u16) -> bool) {
        self.registry.wake_where(|key| changed(key_slot(key)));
        let cells = self
            .live
            .live_where(|c| changed(key_slot(c.key().as_bytes())));
        // Nothing the old server says about an extension counts from now on;
        // the verification on the new one bounds each lease by what it has
        // left there.
        // A claim whose command went to the server that holds the key now
        // stays: its answer counts.
        let now = self.clock.now();
        for cell in &cells {
            let current = self.node_for(cell.key()).ok().map(|n| n.cfg.server_id());
            cell.switched(now, current);
        }
        let mut by_node: Vec<(Arc<Server>, Vec<Arc<Cell>>)> = Vec::new();
        for cell in cells {
            let Ok(node) = self.node_for(cell.key()) else {
                continue;
            };
            match by_node.iter_mut().find(|(n, _)| Arc::ptr_eq(n, &node)) {
                Some((_, list)) => list.push(cell),
                None => by_node.push((node.arc(), vec![cell])),
            }
        }
        for (node, leases) in by_node {
            node.submit(ServerJob::Verify {
                leases,
                asking: false,
                hops: 0,
            });
        }
    }

    fn node_cfg(&self, addr: &NodeAddr) -> Result<Arc<ConnConfig>> {
        let template = match &self.shape {
            Shape::Cluster(c) => &c.seeds[0],
            Shape::Sentinel(s) => &s.template,
            Shape::Standalone(n) => &n.cfg,
        };
        let role = if self.is_sentinel() {
            RoleCheck::Primary
        } else {
            template.role
        };
        template.for_addr(&addr.host, addr.port, role).map(Arc::new)
    }
}

impl Lanes for Topology {
    fn dispatch(&self, batch: Claims) -> Vec<(u64, Option<Instant>)> {
        let retry = |_: &Cell| Some(self.clock.now() + Duration::from_millis(50));
        let mut undelivered = Vec::new();
        let mut by_node: Vec<(Arc<Server>, Claims)> = Vec::new();
        for item in batch {
            match self.node_for(item.0.key()).map(|n| n.arc()) {
                Ok(node) => match by_node.iter_mut().find(|(n, _)| Arc::ptr_eq(n, &node)) {
                    Some((_, list)) => list.push(item),
                    None => by_node.push((node, vec![item])),
                },
                Err(_) => undelivered.extend(unsent(vec![item], self.clock.now(), retry)),
            }
        }
        for (node, leases) in by_node {
            if let Some(leases) = node.submit_renewal(leases, false) {
                undelivered.extend(unsent(leases, self.clock.now(), retry));
            }
        }
        undelivered
    }
}

impl Directory for Topology {
    fn renewal(&self) -> &DeploymentRenewal {
        &self.renewal
    }

    fn moved(&self, slot: u16, addr: &NodeAddr) -> Option<Arc<Server>> {
        let Shape::Cluster(c) = &self.shape else {
            self.suspect();
            return None;
        };
        let node = self.node_at(addr)?;
        let changed = {
            let mut map = c.map.write();
            let idx = map.addrs.iter().position(|a| a == addr)?;
            let was = std::mem::replace(&mut map.owner[usize::from(slot)], idx as u16);
            was != idx as u16
        };
        if changed {
            log::debug!("slot {slot} of {} moved to {addr}", self.describe);
            observe::slots_moved(self.observer(), &self.describe, 1);
            self.slots_changed(&|s| s == slot);
        }
        self.suspect();
        Some(node)
    }

    fn current(&self, key: &str) -> Option<Arc<Server>> {
        self.node_for(key).ok().map(|n| n.arc())
    }

    fn clock_gained(
        &self,
        server: u64,
        addr: &str,
        gain: Duration,
        detected: Instant,
        spared: &[u64],
    ) {
        let cells = self.live.live_where(|c| {
            !spared.contains(&c.id())
                && self
                    .node_for(c.key())
                    .is_ok_and(|n| n.cfg.server_id() == server)
        });
        log::warn!(
            "the clock of {addr} ran up to {gain:?} ahead of this process's: {} lease(s) on it \
             count that much less time left",
            cells.len()
        );
        for cell in &cells {
            cell.clock_gained(gain, detected);
            self.renewal.touch(cell);
        }
        observe::server_clock_jumped(self.observer(), addr, gain, cells.len());
    }

    fn node_at(&self, addr: &NodeAddr) -> Option<Arc<Server>> {
        let Shape::Cluster(c) = &self.shape else {
            return None;
        };
        if let Some(i) = c.map.read().addrs.iter().position(|a| a == addr) {
            return Some(c.map.read().nodes[i].clone());
        }
        let cfg = match self.node_cfg(addr) {
            Ok(cfg) => cfg,
            Err(e) => {
                log::warn!("cannot reach cluster node {addr}: {e}");
                return None;
            }
        };
        let mut map = c.map.write();
        if let Some(i) = map.addrs.iter().position(|a| a == addr) {
            return Some(map.nodes[i].clone());
        }
        let node = self.make_node(cfg);
        map.nodes.push(node.clone());
        map.addrs.push(addr.clone());
        map.replicas.push(0);
        Some(node)
    }

    fn suspect(&self) {
        if let Some(poke) = &self.poke {
            let _ = poke.try_send(());
        }
    }
}

impl Route for Topology {
    type Uncertain = Uncertain;

    fn tracker(&self, key: &str) -> Result<Arc<Tracker>> {
        self.node_for(key)?.tracker()
    }

    fn registry(&self) -> &Arc<Registry> {
        &self.registry
    }

    fn attempt<T>(
        &self,
        key: &str,
        deadline: Instant,
        track: bool,
        f: &mut OnTracked<'_, T>,
    ) -> (Result<T>, Option<Uncertain>) {
        self.run(key, deadline, Connect::Own, &mut |node, conn, deadline| {
            if !track {
                return f(None, conn, deadline);
            }
            let tracker = node.tracker()?;
            // A server waited on for the first time (a slot moved to it, a
            // new primary): give its subscriber a moment to connect, so the
            // attempt arms tracking instead of polling once (at most half
            // the attempt's time).
            let now = self.clock.now();
            tracker.await_settled(now + deadline.saturating_duration_since(now) / 2);
            f(Some(&tracker), conn, deadline)
        })
    }
}

impl std::fmt::Debug for Topology {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.describe)
    }
}

/// One try of `f` on a pooled connection to `node`: its result and, when it
/// got no reply, what the server knows of the connection; or the pool's error
/// (nothing sent).
fn try_on<T>(
    node: &Server,
    deadline: &mut Instant,
    connect: Connect,
    asking: bool,
    f: &mut dyn FnMut(&Server, &mut Conn, Instant) -> Result<T>,
) -> Result<(Result<T>, Option<Identity>)> {
    let mut conn = node.pool.get(*deadline, connect)?;
    if connect == Connect::Own {
        *deadline += conn.connect_time();
    }
    if asking {
        conn.ask_next();
    }
    let result = f(node, &mut conn, *deadline);
    // Only a call that got no reply needs to say where it went.
    let id = if result.as_ref().is_err_and(Error::is_uncertain) {
        conn.identity().cloned()
    } else {
        None
    };
    Ok((result, id))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_try_again_pauses_2_ms_doubling_to_50_ms() {
        let pauses: Vec<Duration> = (1..=7).map(try_again_pause).collect();
        let expected = [2, 4, 8, 16, 32, 50, 50].map(Duration::from_millis);
        assert_eq!(pauses, expected);
    }
}
