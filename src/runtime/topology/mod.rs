//! Which server holds a key: a standalone server, the primary a Sentinel
//! deployment names, or the owner of the key's slot in a Redis Cluster — and
//! how calls, renewals and waits follow it when it changes.
//!
//! - Standalone: one [`Node`]; nothing changes.
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

use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender};
use parking_lot::{Mutex, RwLock};

use crate::clock::Clock;
use crate::conn::cluster::{NodeAddr, Redirect, Shard, parse_shards, parse_slots, redirect};
use crate::conn::sentinel::{parse_master_addr, parse_switch};
use crate::conn::{Conn, ConnConfig, Connect, RoleCheck};
use crate::error::{Error, Result, is_noperm};
use crate::keys::{SLOTS, key_slot};
use crate::runtime::node::{Directory, Job, Node};
use crate::runtime::renewal::{Cell, Counters, Lanes, Renewal, RenewalStats};
use crate::runtime::waiters::{OnTracked, Registry, Route, Tracker};

/// The shortest refresh interval accepted.
pub(crate) const MIN_REFRESH: Duration = Duration::from_millis(10);
/// The longest pause between two tries of a `TRYAGAIN`.
const TRYAGAIN_MAX_PAUSE: Duration = Duration::from_millis(50);
const SWITCH_CHANNEL: &str = "+switch-master";
const SENTINEL_READ_TIMEOUT: Duration = Duration::from_millis(250);
const SENTINEL_PING_EVERY: Duration = Duration::from_secs(5);
const NO_OWNER: u16 = u16::MAX;

/// A node, borrowed from a standalone deployment or owned from a map.
pub(crate) enum NodeRef<'a> {
    Borrowed(&'a Arc<Node>),
    Owned(Arc<Node>),
}

impl NodeRef<'_> {
    pub(crate) fn arc(&self) -> Arc<Node> {
        match self {
            NodeRef::Borrowed(n) => Arc::clone(n),
            NodeRef::Owned(n) => n.clone(),
        }
    }
}

impl std::ops::Deref for NodeRef<'_> {
    type Target = Arc<Node>;
    fn deref(&self) -> &Arc<Node> {
        match self {
            NodeRef::Borrowed(n) => n,
            NodeRef::Owned(n) => n,
        }
    }
}

/// Where a command that got no reply went: its server and connection id.
#[derive(Clone)]
pub(crate) struct Uncertain {
    pub(crate) node: Arc<Node>,
    pub(crate) conn: Option<u64>,
}

/// The settings every node of a deployment shares.
pub(crate) struct Settings {
    pub(crate) pool_size: usize,
    pub(crate) refresh: Duration,
    pub(crate) clock: Arc<dyn Clock>,
}

struct SlotMap {
    /// Slot → index into `nodes` (`NO_OWNER`: not served).
    owner: Vec<u16>,
    nodes: Vec<Arc<Node>>,
    addrs: Vec<NodeAddr>,
    replicas: Vec<u32>,
}

struct Cluster {
    seeds: Vec<Arc<ConnConfig>>,
    map: RwLock<SlotMap>,
}

struct Sentinel {
    service: String,
    sentinels: Vec<Arc<ConnConfig>>,
    /// The data nodes' settings (credentials, TLS); each primary's is this
    /// with its address.
    template: Arc<ConnConfig>,
    current: RwLock<(NodeAddr, Arc<Node>)>,
}

enum Shape {
    Standalone(Arc<Node>),
    Cluster(Cluster),
    Sentinel(Sentinel),
}

/// Live leases, by weak reference, for re-verification after a change.
struct Live {
    cells: Vec<Weak<Cell>>,
    prune_at: usize,
}

/// One deployment's servers and the runtime around them.
pub(crate) struct Topology {
    shape: Shape,
    registry: Arc<Registry>,
    renewal: Renewal,
    counters: Arc<Counters>,
    clock: Arc<dyn Clock>,
    pool_size: usize,
    live: Option<Mutex<Live>>,
    /// Asks the topology thread to look again now.
    poke: Option<Sender<()>>,
    /// Dropped with the topology: its threads stop.
    _stop: Option<Sender<()>>,
    this: Weak<Topology>,
    describe: String,
}

impl Topology {
    fn build(
        shape: impl FnOnce(&Weak<Topology>, &Arc<Counters>, &Arc<Registry>) -> Shape,
        describe: String,
        s: &Settings,
        threads: Option<(Sender<()>, Sender<()>)>,
    ) -> Arc<Topology> {
        let counters: Arc<Counters> = Arc::default();
        let registry = Arc::new(Registry::new(describe.clone()));
        let topological = threads.is_some();
        let (poke, stop) = match threads {
            Some((poke, stop)) => (Some(poke), Some(stop)),
            None => (None, None),
        };
        Arc::new_cyclic(|this: &Weak<Topology>| {
            let lanes: Weak<dyn Lanes> = this.clone();
            Topology {
                shape: shape(this, &counters, &registry),
                registry: registry.clone(),
                renewal: Renewal::new(s.clock.clone(), lanes),
                counters: counters.clone(),
                clock: s.clock.clone(),
                pool_size: s.pool_size,
                live: topological.then(|| {
                    Mutex::new(Live {
                        cells: Vec::new(),
                        prune_at: 64,
                    })
                }),
                poke,
                _stop: stop,
                this: this.clone(),
                describe,
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
    ) -> Arc<Node> {
        let dir: Weak<dyn Directory> = this.clone();
        Arc::new(Node::new(
            cfg,
            s_pool,
            dir,
            clock.clone(),
            counters.clone(),
            registry.clone(),
        ))
    }

    fn make_node(&self, cfg: Arc<ConnConfig>) -> Arc<Node> {
        Topology::new_node(
            cfg,
            &self.this,
            &self.counters,
            &self.registry,
            self.pool_size,
            &self.clock,
        )
    }

    /// One standalone server; `first` is the connection the builder made.
    pub(crate) fn standalone(
        cfg: Arc<ConnConfig>,
        first: Option<Conn>,
        s: &Settings,
    ) -> Arc<Topology> {
        let describe = cfg.addr.to_string();
        let pool = s.pool_size;
        let clock = s.clock.clone();
        Topology::build(
            move |this, counters, registry| {
                let node = Topology::new_node(cfg, this, counters, registry, pool, &clock);
                if let Some(first) = first {
                    node.pool.seed(first);
                }
                Shape::Standalone(node)
            },
            describe,
            s,
            None,
        )
    }

    /// A Redis Cluster reached through `seeds`: reads the slot map from the
    /// first seed that answers, and starts the refresh thread.
    pub(crate) fn cluster(seeds: Vec<Arc<ConnConfig>>, s: &Settings) -> Result<Arc<Topology>> {
        let describe = format!(
            "redis+cluster://{}",
            seeds
                .iter()
                .map(|c| c
                    .addr
                    .trim_start_matches("redis://")
                    .trim_start_matches("rediss://"))
                .collect::<Vec<_>>()
                .join(",")
        );
        let mut shards = None;
        let mut first_error = None;
        for seed in &seeds {
            match read_shards(seed, seed.connect_timeout) {
                Ok(found) => {
                    shards = Some(found);
                    break;
                }
                // Credentials and rights are the same on every node.
                Err(e @ (Error::Auth { .. } | Error::Permission(_) | Error::Tls { .. })) => {
                    return Err(e);
                }
                Err(e) => {
                    log::debug!("cluster seed {} did not give the slot map: {e}", seed.addr);
                    first_error.get_or_insert(e);
                }
            }
        }
        let Some(shards) = shards else {
            return Err(first_error.unwrap_or_else(|| Error::Topology("no seed".into())));
        };
        let (poke_tx, poke_rx) = crossbeam_channel::bounded(1);
        let (stop_tx, stop_rx) = crossbeam_channel::bounded(0);
        let pool = s.pool_size;
        let clock = s.clock.clone();
        let template = seeds[0].clone();
        let mut bad = None;
        let topo = Topology::build(
            |this, counters, registry| {
                let mut map = SlotMap {
                    owner: vec![NO_OWNER; usize::from(SLOTS)],
                    nodes: Vec::new(),
                    addrs: Vec::new(),
                    replicas: Vec::new(),
                };
                for shard in &shards {
                    match template.for_addr(&shard.primary.host, shard.primary.port, template.role)
                    {
                        Ok(cfg) => {
                            let node = Topology::new_node(
                                Arc::new(cfg),
                                this,
                                counters,
                                registry,
                                pool,
                                &clock,
                            );
                            let idx = map.nodes.len() as u16;
                            map.nodes.push(node);
                            map.addrs.push(shard.primary.clone());
                            map.replicas.push(shard.replicas);
                            for &(a, b) in &shard.slots {
                                for slot in a..=b {
                                    map.owner[usize::from(slot)] = idx;
                                }
                            }
                        }
                        Err(e) => bad = Some(e),
                    }
                }
                Shape::Cluster(Cluster {
                    seeds: seeds.clone(),
                    map: RwLock::new(map),
                })
            },
            describe,
            s,
            Some((poke_tx, stop_tx)),
        );
        if let Some(e) = bad {
            return Err(e);
        }
        let weak = Arc::downgrade(&topo);
        let interval = s.refresh;
        std::thread::Builder::new()
            .name("respire-topology".into())
            .spawn(move || cluster_thread(&weak, &poke_rx, &stop_rx, interval))
            .map_err(|source| Error::Thread {
                name: "respire-topology",
                source,
            })?;
        Ok(topo)
    }

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
                let node = Topology::new_node(cfg, this, counters, registry, pool, &clock);
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
            std::thread::Builder::new()
                .name(format!("respire-sentinel-{i}"))
                .spawn(move || follow_sentinel(&cfg, &service, &events, &stop))
                .map_err(thread_error)?;
        }
        let weak = Arc::downgrade(&topo);
        let interval = s.refresh;
        std::thread::Builder::new()
            .name("respire-topology".into())
            .spawn(move || sentinel_thread(&weak, &events_rx, &poke_rx, &stop_rx, interval))
            .map_err(|source| Error::Thread {
                name: "respire-topology",
                source,
            })?;
        Ok(topo)
    }

    /// What this deployment is, for messages.
    pub(crate) fn describe(&self) -> &str {
        &self.describe
    }

    /// The renewal thread.
    pub(crate) fn renewal_thread(&self) -> &Renewal {
        &self.renewal
    }

    pub(crate) fn stats(&self) -> RenewalStats {
        self.counters.stats()
    }

    /// The server of a standalone deployment.
    pub(crate) fn standalone_node(&self) -> Option<&Arc<Node>> {
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
    pub(crate) fn primaries(&self) -> Vec<Arc<Node>> {
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

    /// Remembers a lease granted here, to verify it after a change (Cluster and
    /// Sentinel only).
    pub(crate) fn register(&self, cell: &Arc<Cell>) {
        if let Some(live) = &self.live {
            let mut live = live.lock();
            if live.cells.len() >= live.prune_at {
                live.cells
                    .retain(|w| w.upgrade().is_some_and(|c| !c.is_finished()));
                live.prune_at = (live.cells.len() * 2).max(64);
            }
            live.cells.push(Arc::downgrade(cell));
        }
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
        f: &mut dyn FnMut(&Node, &mut Conn, Instant) -> Result<T>,
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
        let mut pause = Duration::from_millis(2);
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
                Some(Redirect::TryAgain) if self.clock.now() + pause < deadline => {
                    std::thread::sleep(pause);
                    pause = (pause * 2).min(TRYAGAIN_MAX_PAUSE);
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
        let Some(live) = &self.live else {
            return;
        };
        let cells: Vec<Arc<Cell>> = live
            .lock()
            .cells
            .iter()
            .filter_map(Weak::upgrade)
            .filter(|c| !c.is_finished() && changed(key_slot(c.key().as_bytes())))
            .collect();
        // Nothing the old server says about an extension counts from now on;
        // the verification on the new one bounds each lease by what it has
        // left there.
        let now = self.clock.now();
        for cell in &cells {
            cell.switched(now);
        }
        let mut by_node: Vec<(Arc<Node>, Vec<Arc<Cell>>)> = Vec::new();
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
            node.submit(Job::Verify {
                leases,
                asking: false,
                hops: 0,
            });
        }
    }

    /// Replaces the slot map with `shards`; wakes and re-verifies what moved.
    fn apply_shards(&self, shards: &[Shard]) {
        let Shape::Cluster(c) = &self.shape else {
            return;
        };
        let mut retired = Vec::new();
        let mut changed = vec![false; usize::from(SLOTS)];
        let mut any = false;
        {
            let mut map = c.map.write();
            let mut owner = vec![NO_OWNER; usize::from(SLOTS)];
            let mut nodes = Vec::new();
            let mut addrs = Vec::new();
            let mut replicas = Vec::new();
            for shard in shards {
                let node = match map.addrs.iter().position(|a| *a == shard.primary) {
                    Some(i) => map.nodes[i].clone(),
                    None => match self.node_cfg(&shard.primary) {
                        Ok(cfg) => self.make_node(cfg),
                        Err(e) => {
                            log::warn!("cannot reach cluster node {}: {e}", shard.primary);
                            continue;
                        }
                    },
                };
                let idx = nodes.len() as u16;
                nodes.push(node);
                addrs.push(shard.primary.clone());
                replicas.push(shard.replicas);
                for &(a, b) in &shard.slots {
                    for slot in a..=b {
                        owner[usize::from(slot)] = idx;
                    }
                }
            }
            let addr_of =
                |m: &[NodeAddr], o: u16| (o != NO_OWNER).then(|| m[usize::from(o)].clone());
            for slot in 0..usize::from(SLOTS) {
                if addr_of(&map.addrs, map.owner[slot]) != addr_of(&addrs, owner[slot]) {
                    changed[slot] = true;
                    any = true;
                }
            }
            for (i, node) in map.nodes.iter().enumerate() {
                if !addrs.contains(&map.addrs[i]) {
                    retired.push(node.clone());
                }
            }
            *map = SlotMap {
                owner,
                nodes,
                addrs,
                replicas,
            };
        }
        for node in retired {
            log::info!(
                "{} no longer serves slots of {}",
                node.addr(),
                self.describe
            );
            node.retire();
        }
        if any {
            let count = changed.iter().filter(|c| **c).count();
            log::info!("{count} slot(s) of {} changed owner", self.describe);
            self.slots_changed(&|slot| changed[usize::from(slot)]);
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
        let conn = match cfg.connect(cfg.node_timeout.min(cfg.connect_timeout), "respire") {
            Ok(conn) => conn,
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
        self.slots_changed(&|_| true);
        true
    }

    /// Reads the slot map again from the first node that answers.
    fn refresh_cluster(&self, cached: &mut Option<(Arc<ConnConfig>, Conn)>) {
        let Shape::Cluster(c) = &self.shape else {
            return;
        };
        let mut candidates: Vec<Arc<ConnConfig>> = Vec::new();
        if let Some((cfg, _)) = cached {
            candidates.push(cfg.clone());
        }
        candidates.extend(c.map.read().nodes.iter().map(|n| n.cfg.clone()));
        candidates.extend(c.seeds.iter().cloned());
        for cfg in candidates {
            let reuse = cached
                .as_ref()
                .is_some_and(|(c, conn)| Arc::ptr_eq(c, &cfg) && !conn.is_broken());
            if !reuse {
                *cached = None;
                match cfg.connect(
                    cfg.node_timeout.min(cfg.connect_timeout),
                    "respire-topology",
                ) {
                    Ok(conn) => *cached = Some((cfg.clone(), conn)),
                    Err(e) => {
                        log::debug!("slot map refresh: {}: {e}", cfg.addr);
                        continue;
                    }
                }
            }
            let (cfg, conn) = cached.as_mut().expect("connected above");
            let host = cfg.host_port().map(|(h, _)| h).unwrap_or_default();
            match query_shards(conn, cfg, &host) {
                Ok(shards) if !shards.is_empty() => {
                    self.apply_shards(&shards);
                    return;
                }
                Ok(_) => log::debug!("slot map refresh: {} serves no slots", cfg.addr),
                Err(e) => log::debug!("slot map refresh: {}: {e}", cfg.addr),
            }
            *cached = None;
        }
        log::warn!("could not refresh the slot map of {}", self.describe);
    }

    /// Asks every sentinel for the primary and follows a majority of those that
    /// answered.
    fn check_sentinels(&self, conns: &mut [Option<Conn>]) {
        let Shape::Sentinel(s) = &self.shape else {
            return;
        };
        let mut votes: Vec<(NodeAddr, usize)> = Vec::new();
        let mut answered = 0;
        for (i, sentinel) in s.sentinels.iter().enumerate() {
            let budget = sentinel.node_timeout.min(sentinel.connect_timeout);
            match ask_master(sentinel, &s.service, budget, &mut conns[i]) {
                Ok(Some(addr)) => {
                    answered += 1;
                    match votes.iter_mut().find(|(a, _)| *a == addr) {
                        Some((_, n)) => *n += 1,
                        None => votes.push((addr, 1)),
                    }
                }
                Ok(None) => answered += 1,
                Err(e) => log::debug!("sentinel {}: {e}", sentinel.addr),
            }
        }
        votes.sort_by_key(|v| std::cmp::Reverse(v.1));
        if let Some((addr, n)) = votes.first()
            && n * 2 > answered
        {
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

impl Lanes for Topology {
    fn dispatch(&self, batch: Vec<Arc<Cell>>) -> Vec<(u64, Option<Instant>)> {
        let mut undelivered = Vec::new();
        if let Shape::Standalone(node) = &self.shape {
            let ids: Vec<u64> = batch.iter().map(|l| l.id()).collect();
            if !node.submit(Job::Renew {
                leases: batch,
                asking: false,
            }) {
                let retry = self.clock.now() + Duration::from_millis(50);
                undelivered.extend(ids.into_iter().map(|id| (id, Some(retry))));
            }
            return undelivered;
        }
        let mut by_node: Vec<(Arc<Node>, Vec<Arc<Cell>>)> = Vec::new();
        for lease in batch {
            match self.node_for(lease.key()) {
                Ok(node) => match by_node.iter_mut().find(|(n, _)| Arc::ptr_eq(n, &node)) {
                    Some((_, list)) => list.push(lease),
                    None => by_node.push((node.arc(), vec![lease])),
                },
                Err(_) => {
                    let retry = self.clock.now() + Duration::from_millis(50);
                    undelivered.push((lease.id(), Some(retry)));
                }
            }
        }
        for (node, leases) in by_node {
            let ids: Vec<u64> = leases.iter().map(|l| l.id()).collect();
            if !node.submit(Job::Renew {
                leases,
                asking: false,
            }) {
                let retry = self.clock.now() + Duration::from_millis(50);
                undelivered.extend(ids.into_iter().map(|id| (id, Some(retry))));
            }
        }
        undelivered
    }
}

impl Directory for Topology {
    fn renewal(&self) -> &Renewal {
        &self.renewal
    }

    fn moved(&self, slot: u16, addr: &NodeAddr) -> Option<Arc<Node>> {
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
            self.slots_changed(&|s| s == slot);
        }
        self.suspect();
        Some(node)
    }

    fn current(&self, key: &str) -> Option<Arc<Node>> {
        self.node_for(key).ok().map(|n| n.arc())
    }

    fn node_at(&self, addr: &NodeAddr) -> Option<Arc<Node>> {
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
        f: &mut OnTracked<'_, T>,
    ) -> (Result<T>, Option<Uncertain>) {
        self.run(key, deadline, Connect::Own, &mut |node, conn, deadline| {
            let tracker = node.tracker()?;
            // A server waited on for the first time (a slot moved to it, a
            // new primary): give its subscriber a moment to connect, so the
            // attempt arms tracking instead of polling once (at most half
            // the attempt's time).
            let now = Instant::now();
            tracker.await_settled(now + deadline.saturating_duration_since(now) / 2);
            f(&tracker, conn, deadline)
        })
    }
}

impl std::fmt::Debug for Topology {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.describe)
    }
}

/// One try of `f` on a pooled connection to `node`: its result and the
/// connection's id, or the pool's error (nothing sent).
fn try_on<T>(
    node: &Node,
    deadline: &mut Instant,
    connect: Connect,
    asking: bool,
    f: &mut dyn FnMut(&Node, &mut Conn, Instant) -> Result<T>,
) -> Result<(Result<T>, Option<u64>)> {
    let mut conn = node.pool.get(*deadline, connect)?;
    if connect == Connect::Own {
        *deadline += conn.connect_time();
    }
    if asking {
        conn.ask_next();
    }
    let id = conn.id();
    Ok((f(node, &mut conn, *deadline), id))
}

/// Connects to `cfg` and reads the slot map.
fn read_shards(cfg: &ConnConfig, budget: Duration) -> Result<Vec<Shard>> {
    let mut conn = cfg.connect(budget, "respire-topology")?;
    let host = cfg.host_port().map(|(h, _)| h).unwrap_or_default();
    let shards = query_shards(&mut conn, cfg, &host)?;
    if shards.is_empty() {
        return Err(Error::Topology(format!(
            "{} reports no slots served: the cluster is not formed",
            cfg.addr
        )));
    }
    Ok(shards)
}

/// `CLUSTER SHARDS`, or `CLUSTER SLOTS` where it is unknown, on `conn`.
fn query_shards(conn: &mut Conn, cfg: &ConnConfig, host: &str) -> Result<Vec<Shard>> {
    let deadline = Instant::now() + cfg.node_timeout;
    let cmd = redis::cmd("CLUSTER").arg("SHARDS").clone();
    match conn.query::<redis::Value>(&cmd, "CLUSTER SHARDS", deadline) {
        Ok(v) => parse_shards(&v, cfg.tls, host),
        Err(Error::Server { source, .. }) if is_not_cluster(&source) => {
            Err(Error::Topology(format!(
                "{} is not a Redis Cluster node (cluster support is disabled); connect to it \
                 with Coordinator::connect",
                cfg.addr
            )))
        }
        Err(Error::Server { source, .. })
            if source
                .to_string()
                .to_ascii_lowercase()
                .contains("unknown subcommand") =>
        {
            let cmd = redis::cmd("CLUSTER").arg("SLOTS").clone();
            let v: redis::Value = conn.query(&cmd, "CLUSTER SLOTS", deadline)?;
            parse_slots(&v, host)
        }
        Err(Error::Server { source, .. }) if is_noperm(&source) => Err(Error::Permission(format!(
            "reading the slot map of {} (CLUSTER SHARDS): {source}",
            cfg.addr
        ))),
        Err(e) => Err(e),
    }
}

fn is_not_cluster(err: &redis::RedisError) -> bool {
    err.to_string().contains("cluster support disabled")
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
        Instant::now() + budget,
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

/// `respire-topology` of a cluster: refreshes the slot map every `interval`
/// and when poked (after a `MOVED`), at most every [`MIN_REFRESH`].
fn cluster_thread(
    topo: &Weak<Topology>,
    poke: &Receiver<()>,
    stop: &Receiver<()>,
    interval: Duration,
) {
    let mut cached = None;
    let mut last = Instant::now();
    loop {
        let next = last + interval;
        crossbeam_channel::select! {
            recv(poke) -> _ => {}
            recv(stop) -> _ => return,
            recv(crossbeam_channel::at(next)) -> _ => {}
        }
        let since = last.elapsed();
        if since < MIN_REFRESH {
            std::thread::sleep(MIN_REFRESH - since);
        }
        let Some(topo) = topo.upgrade() else {
            return;
        };
        topo.refresh_cluster(&mut cached);
        drop(topo);
        last = Instant::now();
        while poke.try_recv().is_ok() {}
    }
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
) {
    let count = match topo.upgrade().map(|t| match &t.shape {
        Shape::Sentinel(s) => s.sentinels.len(),
        _ => 0,
    }) {
        Some(n) => n,
        None => return,
    };
    let mut conns: Vec<Option<Conn>> = (0..count).map(|_| None).collect();
    let mut last = Instant::now();
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
                let since = last.elapsed();
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
        last = Instant::now();
        while poke.try_recv().is_ok() {}
    }
}

/// `respire-sentinel-N`: follows `+switch-master` on one sentinel, with
/// reconnects, until `stop` is disconnected.
fn follow_sentinel(cfg: &ConnConfig, service: &str, events: &Sender<Event>, stop: &Receiver<()>) {
    let mut backoff = Duration::from_millis(50);
    let mut first = true;
    loop {
        if stopped(stop) {
            return;
        }
        match subscribe_switches(cfg, service, events, stop, &mut first) {
            Ok(()) => return,
            Err(e) => log::debug!("following {SWITCH_CHANNEL} on {}: {e}", cfg.addr),
        }
        if let Err(crossbeam_channel::RecvTimeoutError::Disconnected) = stop.recv_timeout(backoff) {
            return;
        }
        backoff = (backoff * 2).min(Duration::from_secs(2));
    }
}

/// One subscription; `Ok` when asked to stop.
fn subscribe_switches(
    cfg: &ConnConfig,
    service: &str,
    events: &Sender<Event>,
    stop: &Receiver<()>,
    first: &mut bool,
) -> Result<()> {
    let mut conn = cfg.connect_pubsub(cfg.connect_timeout, "respire-sentinel")?;
    let raw = conn.raw();
    let io = |op: &'static str| move |e: redis::RedisError| Error::Io { op, source: e };
    raw.set_read_timeout(Some(cfg.node_timeout.max(SENTINEL_READ_TIMEOUT)))
        .and_then(|()| raw.set_write_timeout(Some(cfg.node_timeout)))
        .map_err(io("setting socket timeouts"))?;
    let cmd = redis::cmd("SUBSCRIBE")
        .arg(SWITCH_CHANNEL)
        .get_packed_command();
    raw.send_packed_command(&cmd).map_err(io("SUBSCRIBE"))?;
    match raw
        .recv_response()
        .map_err(io("SUBSCRIBE"))?
        .extract_error()
    {
        Ok(redis::Value::Array(reply)) if matches!(reply.first(), Some(redis::Value::BulkString(k)) if k == b"subscribe") =>
            {}
        Ok(other) => {
            return Err(Error::UnexpectedReply {
                op: "SUBSCRIBE +switch-master",
                reply: format!("{other:?}"),
            });
        }
        Err(source) => {
            return Err(Error::Server {
                op: "SUBSCRIBE +switch-master",
                source,
            });
        }
    }
    let mut pubsub = raw.as_pubsub();
    pubsub
        .set_read_timeout(Some(SENTINEL_READ_TIMEOUT))
        .map_err(io("setting socket timeouts"))?;
    if !std::mem::take(first) {
        let _ = events.send(Event::Resubscribed);
    }
    let mut last_heard = Instant::now();
    loop {
        match pubsub.get_message() {
            Ok(msg) => {
                last_heard = Instant::now();
                if msg.get_channel_name() != SWITCH_CHANNEL {
                    continue;
                }
                let payload: String = msg.get_payload().unwrap_or_default();
                match parse_switch(&payload) {
                    Some((name, old, new)) if name == service => {
                        log::info!("{}: {SWITCH_CHANNEL} {payload}", cfg.addr);
                        if events.send(Event::Switch { old, new }).is_err() {
                            return Ok(());
                        }
                    }
                    Some(_) => {}
                    None => log::debug!("unreadable {SWITCH_CHANNEL} message {payload:?}"),
                }
            }
            Err(e) if e.is_timeout() => {
                if stopped(stop) {
                    return Ok(());
                }
                if last_heard.elapsed() >= SENTINEL_PING_EVERY {
                    pubsub.ping::<redis::Value>().map_err(io("PING"))?;
                    last_heard = Instant::now();
                }
            }
            Err(e) => return Err(io("receiving +switch-master")(e)),
        }
    }
}
