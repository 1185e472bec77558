//! One lease across the nodes of a group: its key and value on each node,
//! what each node did with it, and which nodes still count for it as the
//! node watchers' news comes in.

use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

/// What the group knows about one lease on one node.
#[derive(Debug, Default)]
pub(super) struct Slot {
    /// An acquire was sent: the node may hold the key.
    pub(super) sent: bool,
    /// The run id of the server that granted it.
    pub(super) granted_by: Option<Arc<str>>,
    /// The server restarted since the grant: it never counts again.
    pub(super) restarted: bool,
    /// A release got its answer: whether it deleted the key (`false`: the key
    /// had expired or belonged to another owner). Later releases repeat it.
    pub(super) released: Option<bool>,
}

/// One lease across the nodes: its key on each node (with that node's prefix),
/// its value, and what each node did with it. Shared by the guard and the jobs.
#[derive(Debug)]
pub(crate) struct NodeLease {
    keys: Vec<String>,
    value: String,
    pub(super) slots: Vec<Mutex<Slot>>,
}

impl NodeLease {
    pub(crate) fn new(keys: Vec<String>, value: String) -> Self {
        let slots = keys.iter().map(|_| Mutex::new(Slot::default())).collect();
        NodeLease { keys, value, slots }
    }

    /// The key on node `i`.
    pub(crate) fn key(&self, i: usize) -> &str {
        &self.keys[i]
    }

    /// The owner value every node holds the key with.
    pub(crate) fn value(&self) -> &str {
        &self.value
    }

    /// Whether node `i` counts for this lease: it confirmed the grant and has
    /// not restarted since.
    pub(crate) fn counts(&self, i: usize) -> bool {
        let slot = self.slots[i].lock();
        slot.granted_by.is_some() && !slot.restarted
    }

    /// How many nodes can still be counted on for a lease that is lost at
    /// `lost_at`: those that granted it and have not restarted since, unless
    /// they are down (`down[j]`: since when a node's watcher has lost its
    /// server) and could come back without the key and grant it again before
    /// `lost_at` (always, without a restart delay).
    pub(crate) fn counted(
        &self,
        down: &[Option<Instant>],
        restart_delay: Option<Duration>,
        lost_at: Instant,
    ) -> usize {
        let may_grant_again = |since: Instant| {
            restart_delay.is_none_or(|d| since.checked_add(d).is_none_or(|at| at < lost_at))
        };
        (0..self.slots.len())
            .filter(|&j| self.counts(j) && !down[j].is_some_and(may_grant_again))
            .count()
    }

    /// Node `i` now runs as `run_id`: if that is not the server that granted
    /// the lease, the node never counts for it again. Returns whether it
    /// stopped counting now.
    pub(crate) fn seen_run(&self, i: usize, run_id: &str) -> bool {
        let mut slot = self.slots[i].lock();
        match &slot.granted_by {
            Some(granted) if !slot.restarted && &**granted != run_id => {
                slot.restarted = true;
                true
            }
            _ => false,
        }
    }
}

/// What the node watchers know (each watches its server on an idle
/// connection of its own), and the judgement of a live lease that their news
/// prompts: a node counts for a lease while it granted it, has not restarted
/// since and, unless the restart delay keeps a restarted server from granting
/// anything before the lease's deadline, is not down.
#[derive(Debug)]
pub(crate) struct Watch {
    /// Per node: since when its watcher has lost the server, if it has.
    down: Vec<Option<Instant>>,
}

impl Watch {
    pub(crate) fn new(nodes: usize) -> Self {
        Watch {
            down: vec![None; nodes],
        }
    }

    /// Node `i`'s watcher lost its server at `now` (it keeps the first
    /// instant while the server stays away).
    pub(crate) fn went_away(&mut self, i: usize, now: Instant) {
        self.down[i].get_or_insert(now);
    }

    /// Node `i`'s watcher reached its server again, running as `run_id`:
    /// every lease in `leases` that another server granted on that node
    /// stops counting it. Returns how many did.
    pub(crate) fn came_back<'a>(
        &mut self,
        i: usize,
        run_id: &str,
        leases: impl IntoIterator<Item = &'a NodeLease>,
    ) -> usize {
        self.down[i] = None;
        leases.into_iter().filter(|l| l.seen_run(i, run_id)).count()
    }

    /// Whether a lease lost at `lost_at` can still be counted on by a
    /// quorum; `Err(counted)` when fewer than `quorum` nodes can.
    pub(crate) fn judge(
        &self,
        lease: &NodeLease,
        lost_at: Instant,
        restart_delay: Option<Duration>,
        quorum: usize,
    ) -> Result<(), usize> {
        let counted = lease.counted(&self.down, restart_delay, lost_at);
        if counted < quorum {
            Err(counted)
        } else {
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_node_counts_while_the_server_that_granted_runs() {
        let lease = NodeLease::new(vec!["a".into(), "b".into()], "v".into());
        assert!(!lease.counts(0), "no grant confirmed");
        assert!(!lease.seen_run(0, "one"), "nothing to lose");
        lease.slots[0].lock().granted_by = Some(Arc::from("one"));
        assert!(lease.counts(0));
        assert!(!lease.seen_run(0, "one"), "the same server");
        assert!(lease.counts(0));
        assert!(lease.seen_run(0, "two"), "another server now");
        assert!(!lease.counts(0));
        assert!(!lease.seen_run(0, "one"), "a restart is for good");
        assert!(!lease.counts(0));
        assert!(!lease.counts(1));
    }

    #[test]
    fn a_node_that_went_away_counts_only_if_the_restart_delay_outlasts_the_lease() {
        let t0 = Instant::now();
        let s = Duration::from_secs;
        let lease = NodeLease::new(vec!["a".into(), "b".into(), "c".into()], "v".into());
        for i in 0..3 {
            lease.slots[i].lock().granted_by = Some(Arc::from("one"));
        }
        let lost_at = t0 + s(10);
        assert_eq!(lease.counted(&[None; 3], None, lost_at), 3);
        let down = [Some(t0), None, None];
        assert_eq!(
            lease.counted(&down, None, lost_at),
            2,
            "no delay: it may grant at once"
        );
        assert_eq!(
            lease.counted(&down, Some(s(5)), lost_at),
            2,
            "back before the deadline"
        );
        assert_eq!(
            lease.counted(&down, Some(s(10)), lost_at),
            3,
            "back after it"
        );
        assert!(lease.seen_run(1, "two"));
        assert_eq!(
            lease.counted(&down, Some(s(10)), lost_at),
            2,
            "a restart is for good"
        );
    }

    #[test]
    fn the_watchers_news_judges_every_live_lease() {
        let t0 = Instant::now();
        let s = Duration::from_secs;
        let lease = NodeLease::new(vec!["a".into(), "b".into(), "c".into()], "v".into());
        for i in 0..3 {
            lease.slots[i].lock().granted_by = Some(Arc::from("one"));
        }
        let other = NodeLease::new(vec!["a".into(), "b".into(), "c".into()], "w".into());
        let lost_at = t0 + s(10);
        let mut watch = Watch::new(3);
        assert_eq!(watch.judge(&lease, lost_at, None, 2), Ok(()));
        watch.went_away(0, t0);
        watch.went_away(0, t0 + s(3));
        // Down since t0 (the first news), back after the deadline: counts.
        assert_eq!(watch.judge(&lease, lost_at, Some(s(10)), 2), Ok(()));
        watch.went_away(1, t0);
        assert_eq!(watch.judge(&lease, lost_at, Some(s(10)), 2), Ok(()));
        assert_eq!(watch.judge(&lease, lost_at, None, 2), Err(1));
        // Back as the same server: it counts again.
        assert_eq!(watch.came_back(0, "one", [&lease, &other]), 0);
        assert_eq!(watch.judge(&lease, lost_at, None, 2), Ok(()));
        // Back as another: only the lease it granted stops counting it, for good.
        assert_eq!(watch.came_back(1, "two", [&lease, &other]), 1);
        assert_eq!(watch.judge(&lease, lost_at, Some(s(10)), 3), Err(2));
        assert_eq!(watch.judge(&lease, lost_at, Some(s(10)), 2), Ok(()));
        assert_eq!(watch.came_back(1, "one", [&lease, &other]), 0);
        assert_eq!(watch.judge(&lease, lost_at, Some(s(10)), 3), Err(2));
    }
}
