//! Restarts without the data (antirez, "Distributed Locks with Redis", the
//! section on restarts), as [Restarts](crate::RedlockGroup#restarts) tells
//! users: each watcher's news (`worker.rs`) about its node, judged against
//! every live lock by `core::redlock::Watch`, which the simulation runs too.

use std::sync::Arc;

use parking_lot::Mutex;

use super::Group;
use super::guard::RedlockLease;
use super::worker::NodeEvent;
use crate::core::redlock::Watch;
use crate::runtime::lease::LiveLeases;

/// The group's live locks, to judge when a node goes away or restarts, and
/// what its watchers know of each node.
pub(super) struct Restarts {
    pub(super) live: LiveLeases<RedlockLease>,
    watch: Mutex<Watch>,
}

impl Restarts {
    pub(super) fn new(nodes: usize) -> Self {
        Restarts {
            live: LiveLeases::new(),
            watch: Mutex::new(Watch::new(nodes)),
        }
    }
}

impl Group {
    /// A watcher's news about node `i`: every live lock is judged again.
    pub(super) fn node_event(&self, i: usize, event: NodeEvent) {
        let now = self.now();
        let leases = self.restarts.live.live_where(|_| true);
        let mut watch = self.restarts.watch.lock();
        let what = match &event {
            NodeEvent::Down => {
                watch.went_away(i, now);
                "went away"
            }
            NodeEvent::Up { run_id } => {
                let restarted = watch.came_back(i, run_id, leases.iter().map(|l| &**l.nodes()));
                if restarted == 0 {
                    // Back as the same server: no lock lost anything.
                    return;
                }
                log::warn!(
                    "redlock node {i} runs as {run_id} now, not as the server that granted \
                     {restarted} live lock(s): it restarted and no longer counts for them"
                );
                "restarted"
            }
        };
        let restart_delay = self.options.restart_delay;
        let short: Vec<(&Arc<RedlockLease>, usize)> = leases
            .iter()
            .filter_map(|lease| {
                let verdict = watch.judge(
                    lease.nodes(),
                    lease.cell.lost_at(),
                    restart_delay,
                    self.quorum,
                );
                verdict.err().map(|counted| (lease, counted))
            })
            .collect();
        drop(watch);
        for (lease, counted) in short {
            lease.lose_quorum(
                now,
                format!(
                    "only {counted} node(s) that granted it can still be counted on, fewer \
                     than the quorum of {}: node {i} {what} and may grant it again without \
                     the key",
                    self.quorum
                ),
            );
        }
    }
}
