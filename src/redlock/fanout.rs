//! Sending one step of a Redlock operation to the nodes at once, counting their
//! answers until the outcome is decided, and reporting what each node said.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::Group;
use super::worker::{Completion, Gather, Job, Reply, ReplyTo, Route};
use crate::core::quorum::Tally;
use crate::core::redlock::{NodeLease, Op, check_ttl};
use crate::error::Result;
use crate::keys;
use crate::report::{NodeOutcome, NodeReport};

/// One node's answer as evidence, without the node's address: evidence is
/// kept for every operation and read seldom, so the address is added when it
/// is read ([`Group::named`]).
#[derive(Clone, Debug)]
pub(super) struct Heard {
    pub(super) outcome: NodeOutcome,
    pub(super) latency: Option<Duration>,
}

impl Group {
    pub(super) fn check_ttl(&self, ttl: Duration) -> Result<u64> {
        check_ttl(ttl, &self.timing)
    }

    /// `key` with each node's prefix, in the nodes' order; an empty key,
    /// named `what`, is [`Error::InvalidArgument`](crate::Error::InvalidArgument).
    pub(super) fn physical_keys(&self, key: &str, what: &str) -> Result<Vec<String>> {
        self.prefixes
            .iter()
            .map(|prefix| keys::physical(prefix, key, what))
            .collect()
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
        route: &Route,
    ) {
        for &i in targets {
            self.workers[i].send(
                i,
                Job {
                    op,
                    lease: lease.clone(),
                    deadline,
                    route: route.clone(),
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
        let gather = Gather::new(targets.len());
        let route = Route {
            reply: Some(ReplyTo::Gather(gather.clone())),
            tag: 0,
            done: done.cloned(),
        };
        self.send(op, lease, targets, deadline, &route);
        drop(route);
        let mut replies: Vec<Option<Reply>> = std::iter::repeat_with(|| None).take(n).collect();
        let mut tally = Tally::new(n, targets.len());
        while tally.outstanding > 0 && !decided(&tally) {
            let Some(reply) = gather.next(deadline, &*self.clock) else {
                break;
            };
            tally.add(reply.vote, reply.outcome == NodeOutcome::Granted);
            let i = reply.node;
            replies[i] = Some(reply);
        }
        (replies, tally)
    }

    /// Every node's answer; targets without an answer are `Abandoned` (or
    /// `TimedOut` once the deadline passed), the others `skipped`. Without
    /// the nodes' addresses, which [`Group::named`] adds when they are read.
    pub(super) fn answers(
        &self,
        replies: Vec<Option<Reply>>,
        targets: &[usize],
        deadline: Instant,
        skipped: &NodeOutcome,
    ) -> Vec<Heard> {
        let past = self.now() >= deadline;
        replies
            .into_iter()
            .enumerate()
            .map(|(i, reply)| match reply {
                Some(r) => Heard {
                    outcome: r.outcome,
                    latency: r.latency,
                },
                None => Heard {
                    outcome: if !targets.contains(&i) {
                        skipped.clone()
                    } else if past {
                        NodeOutcome::TimedOut
                    } else {
                        NodeOutcome::Abandoned
                    },
                    latency: None,
                },
            })
            .collect()
    }

    /// The answers as reports, each with its node's address.
    pub(super) fn named(&self, heard: &[Heard]) -> Vec<NodeReport> {
        heard
            .iter()
            .enumerate()
            .map(|(i, h)| NodeReport {
                node: self.workers[i].addr.clone(),
                outcome: h.outcome.clone(),
                latency: h.latency,
            })
            .collect()
    }

    /// Queues a release of `lease` on every node without waiting: used after a
    /// failed attempt. Nodes that were never sent the acquire are skipped (by
    /// their workers, which run it after the acquire).
    pub(super) fn clean_up(&self, lease: &Arc<NodeLease>) {
        let deadline = self.now() + self.timing.node_timeout;
        self.send(Op::Release, lease, &self.all(), deadline, &Route::default());
    }
}
