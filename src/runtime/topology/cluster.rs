//! A Redis Cluster: the slot map read from `CLUSTER SHARDS` (`CLUSTER SLOTS`
//! on servers before 7.0), one node per primary, and the `respire-topology`
//! thread that refreshes the map every refresh interval and at once after a
//! `MOVED`.

use std::sync::{Arc, Weak};
use std::time::Duration;

use crossbeam_channel::Receiver;
use parking_lot::RwLock;

use crate::clock::Clock;
use crate::conn::cluster::{NodeAddr, Shard, parse_shards, parse_slots};
use crate::conn::{Conn, ConnConfig};
use crate::error::{Error, Result, is_noperm};
use crate::keys::SLOTS;
use crate::observe;
use crate::runtime::server::Server;

use super::{MIN_REFRESH, Settings, Shape, Topology};

pub(super) const NO_OWNER: u16 = u16::MAX;

pub(super) struct SlotMap {
    /// Slot → index into `nodes` (`NO_OWNER`: not served).
    pub(super) owner: Vec<u16>,
    pub(super) nodes: Vec<Arc<Server>>,
    pub(super) addrs: Vec<NodeAddr>,
    pub(super) replicas: Vec<u32>,
}

pub(super) struct Cluster {
    pub(super) seeds: Vec<Arc<ConnConfig>>,
    pub(super) map: RwLock<SlotMap>,
}

impl Topology {
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
            match read_shards(seed, seed.connect_timeout, s.timing.node_timeout) {
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
                                s.timing,
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
        let thread_clock = s.clock.clone();
        std::thread::Builder::new()
            .name("respire-topology".into())
            .spawn(move || cluster_thread(&weak, &poke_rx, &stop_rx, interval, &*thread_clock))
            .map_err(|source| Error::Thread {
                name: "respire-topology",
                source,
            })?;
        Ok(topo)
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
            observe::slots_moved(self.observer(), &self.describe, count);
            self.slots_changed(&|slot| changed[usize::from(slot)]);
        }
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
                    self.timing.node_timeout.min(cfg.connect_timeout),
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
            match query_shards(conn, cfg, &host, self.timing.node_timeout) {
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
}

/// Connects to `cfg` within `budget` and reads the slot map, waiting at most
/// `node_timeout` for it.
fn read_shards(cfg: &ConnConfig, budget: Duration, node_timeout: Duration) -> Result<Vec<Shard>> {
    let mut conn = cfg.connect(budget, "respire-topology")?;
    let host = cfg.host_port().map(|(h, _)| h).unwrap_or_default();
    let shards = query_shards(&mut conn, cfg, &host, node_timeout)?;
    if shards.is_empty() {
        return Err(Error::Topology(format!(
            "{} reports no slots served: the cluster is not formed",
            cfg.addr
        )));
    }
    Ok(shards)
}

/// `CLUSTER SHARDS`, or `CLUSTER SLOTS` where it is unknown, on `conn`,
/// answered within `node_timeout`.
fn query_shards(
    conn: &mut Conn,
    cfg: &ConnConfig,
    host: &str,
    node_timeout: Duration,
) -> Result<Vec<Shard>> {
    let deadline = cfg.clock.now() + node_timeout;
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

/// `respire-topology` of a cluster: refreshes the slot map every `interval`
/// and when poked (after a `MOVED`), at most every [`MIN_REFRESH`].
fn cluster_thread(
    topo: &Weak<Topology>,
    poke: &Receiver<()>,
    stop: &Receiver<()>,
    interval: Duration,
    clock: &dyn Clock,
) {
    let mut cached = None;
    let mut last = clock.now();
    loop {
        let next = last + interval;
        crossbeam_channel::select! {
            recv(poke) -> _ => {}
            recv(stop) -> _ => return,
            recv(crossbeam_channel::at(next)) -> _ => {}
        }
        let since = clock.now().saturating_duration_since(last);
        if since < MIN_REFRESH {
            std::thread::sleep(MIN_REFRESH - since);
        }
        let Some(topo) = topo.upgrade() else {
            return;
        };
        topo.refresh_cluster(&mut cached);
        drop(topo);
        last = clock.now();
        while poke.try_recv().is_ok() {}
    }
}
