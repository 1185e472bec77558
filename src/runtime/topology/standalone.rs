//! A standalone server: one `Node`; nothing changes.

use std::sync::Arc;

use crate::conn::{Conn, ConnConfig};

use super::{Settings, Shape, Topology};

impl Topology {
    /// One standalone server; `first` is the connection the builder made.
    pub(crate) fn standalone(
        cfg: Arc<ConnConfig>,
        first: Option<Conn>,
        s: &Settings,
    ) -> Arc<Topology> {
        let describe = cfg.addr.to_string();
        let pool = s.pool_size;
        let clock = s.clock.clone();
        let timing = s.timing;
        Topology::build(
            move |this, counters, registry| {
                let node = Topology::new_node(cfg, this, counters, registry, pool, &clock, timing);
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
}
