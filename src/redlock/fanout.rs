//! Sending one step of a Redlock operation to the nodes at once, counting their
//! answers until the outcome is decided, and reporting what each node said.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::Group;
use super::options::check_ttl;
use super::worker::{Completion, Job, Reply};
use crate::core::quorum::Tally;
use crate::core::redlock::{NodeLease, Op};
use crate::error::Result;
use crate::report::{NodeOutcome, NodeReport};

/// Where a fan-out's answers go.
pub(super) struct Route<'a> {
    /// The channel for answers (`None`: nobody waits).
    pub(super) reply: Option<&'a crossbeam_channel::Sender<Reply>>,
    /// Echoed in each answer.
    pub(super) tag: u64,
    /// Counted down as each node's share finishes.
    pub(super) done: Option<&'a Arc<Completion>>,
}

impl Group {
    pub(super) fn check_ttl(&self, ttl: Duration) -> Result<u64> {
        check_ttl(ttl, &self.options)
    }

    pub(super) fn all(&self) -> Vec<usize> {
        (0..self.workers.len()).collect()
    }

    pub(super) fn len(&self) -> usize {
        self.workers.len()
    }

    /// Queues `op` on each of the `targets`' workers.
    pub(super) fn send(
        &self,
        op: Op,
        lease: &Arc<NodeLease>,
        targets: &[usize],
        deadline: Instant,
        route: &Route<'_>,
    ) {
        for &i in targets {
            self.workers[i].send(
                i,
                Job {
                    op,
                    lease: lease.clone(),
                    deadline,
                    reply: route.reply.cloned(),
                    tag: route.tag,
                    done: route.done.cloned(),
                },
            );
        }
    }

    /// Sends `op` to the `targets` at once and collects answers until `decided`
    /// says the outcome is decided, every target answered, or `deadline`.
    pub(super) fn fan_out(
        &self,
        op: Op,
        lease: &Arc<NodeLease>,
        targets: &[usize],
        deadline: Instant,
        done: Option<&Arc<Completion>>,
        decided: impl Fn(&Tally) -> bool,
    ) -> (Vec<Option<Reply>>, Tally) {
        let n = self.len();
        // Room for every answer, so a late worker never blocks on it.
        let (tx, rx) = crossbeam_channel::bounded(n);
        let route = Route {
            reply: Some(&tx),
            tag: 0,
            done,
        };
        self.send(op, lease, targets, deadline, &route);
        drop(tx);
        let mut replies: Vec<Option<Reply>> = vec![None; n];
        let mut tally = Tally::new(n, targets.len());
        while tally.outstanding > 0 && !decided(&tally) {
            match rx.recv_deadline(deadline) {
                Ok(reply) => {
                    tally.add(reply.vote, reply.outcome == NodeOutcome::Granted);
                    let i = reply.node;
                    replies[i] = Some(reply);
                }
                Err(_) => break,
            }
        }
        (replies, tally)
    }

    /// Every node's report; targets without an answer are `Abandoned` (or
    /// `TimedOut` once the deadline passed), the others `skipped`.
    pub(super) fn reports(
        &self,
        replies: Vec<Option<Reply>>,
        targets: &[usize],
        deadline: Instant,
        skipped: &NodeOutcome,
    ) -> Vec<NodeReport> {
        let past = Instant::now() >= deadline;
        replies
            .into_iter()
            .enumerate()
            .map(|(i, reply)| {
                let node = self.workers[i].addr.clone();
                match reply {
                    Some(r) => NodeReport {
                        node,
                        outcome: r.outcome,
                        latency: r.latency,
                    },
                    None => NodeReport {
                        node,
                        outcome: if !targets.contains(&i) {
                            skipped.clone()
                        } else if past {
                            NodeOutcome::TimedOut
                        } else {
                            NodeOutcome::Abandoned
                        },
                        latency: None,
                    },
                }
            })
            .collect()
    }

    /// Queues a release of `lease` on every node without waiting: used after a
    /// failed attempt. Nodes that were never sent the acquire are skipped (by
    /// their workers, which run it after the acquire).
    pub(super) fn clean_up(&self, lease: &Arc<NodeLease>) {
        let deadline = Instant::now() + self.options.node_timeout;
        let route = Route {
            reply: None,
            tag: 0,
            done: None,
        };
        self.send(Op::Release, lease, &self.all(), deadline, &route);
    }
}
