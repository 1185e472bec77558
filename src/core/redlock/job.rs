//! What goes into a node's machine and what it answers: the job and its
//! operation, the node's reply as read off the wire, the answer, and what a
//! new connection found.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::node_lease::NodeLease;
use crate::core::quorum::Vote;
use crate::core::timing::Timing;
use crate::error::Error;
use crate::identity::Identity;
use crate::report::NodeOutcome;

/// What one job asks of its node.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Op {
    /// Set the key to the lease's value if it is free (`SET NX PX`, then `GET`
    /// and `PTTL` when it found the key set).
    Acquire { ttl_ms: u64 },
    /// Move the key's expiry if it still holds the value (`lease_extend.lua`).
    Extend { ttl_ms: u64 },
    /// Delete the key if it still holds the value (`lease_release.lua`).
    Release,
}

/// A node's reply to one command, as read off the wire.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum NodeReply {
    /// The acquire's `SET NX` set the key, or the key already holds this
    /// lease's value.
    Acquired,
    /// Another owner holds the key, for `remaining` more (the server's
    /// `PTTL`; `None` for a key without an expiry).
    Held { remaining: Option<Duration> },
    /// The extension script's reply: 1 extended, 0 gone, other: someone
    /// else's.
    Extend(i64),
    /// The release script's reply: 1 deleted, 0 gone, other: someone else's.
    Release(i64),
}

/// How a node's worker runs its jobs.
#[derive(Clone, Copy, Debug)]
pub(crate) struct NodeSettings {
    /// The group's timing: its node timeout bounds one command and is the
    /// fresh budget of a late release.
    pub(crate) timing: Timing,
    /// No acquire goes to a server that started less than this long ago.
    pub(crate) restart_delay: Option<Duration>,
}

/// One node's answer to one job.
#[derive(Debug)]
pub(crate) struct Answer {
    pub(crate) outcome: NodeOutcome,
    pub(crate) vote: Vote,
    /// Whether the command went out.
    pub(crate) sent: bool,
    /// It went out and got no reply: it may or may not have been applied.
    pub(crate) uncertain: bool,
    /// The node's failure, when trying again will not cure it.
    pub(crate) permanent: Option<Arc<Error>>,
}

impl Answer {
    pub(crate) fn of(outcome: NodeOutcome, vote: Vote, sent: bool) -> Answer {
        Answer {
            outcome,
            vote,
            sent,
            uncertain: false,
            permanent: None,
        }
    }

    pub(super) fn not_sent(why: &str, vote: Vote) -> Answer {
        Answer::of(NodeOutcome::NotSent(why.to_owned()), vote, false)
    }
}

/// One node's share of a group operation; `J` is what the transport needs
/// to answer it (a reply channel, a fan-out id).
pub(crate) struct Job<J> {
    pub(crate) op: Op,
    pub(crate) lease: Arc<NodeLease>,
    /// Not sent after this (but a release is); the command's own timeout ends here.
    pub(crate) deadline: Instant,
    /// Taken when the job is answered; a release kept to send later has none.
    pub(crate) handle: Option<J>,
    /// How many times this release was sent without a reply.
    pub(super) resends: u32,
}

impl<J> Job<J> {
    pub(crate) fn new(op: Op, lease: Arc<NodeLease>, deadline: Instant, handle: J) -> Self {
        Job {
            op,
            lease,
            deadline,
            handle: Some(handle),
            resends: 0,
        }
    }
}

/// What a new connection found.
#[derive(Clone, Debug)]
pub(crate) struct Connected {
    /// What the server knows of the connection (`CLIENT ID`, and its
    /// address where `CLIENT INFO` gave it).
    pub(crate) id: Option<Identity>,
    pub(crate) run_id: Option<Arc<str>>,
    /// The latest the server can have started.
    pub(crate) started_by: Option<Instant>,
    pub(crate) round_trip: Duration,
}
