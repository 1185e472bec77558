//! What each node of a Redlock group answered: the evidence every Redlock
//! operation returns, and the text errors quote.

use std::fmt;
use std::time::Duration;

/// What one node answered to one step of a Redlock operation.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum NodeOutcome {
    /// The node did what was asked: set the key (acquire), moved its expiry
    /// (extend), or deleted it (release).
    Granted,
    /// Another owner holds the key on this node; `remaining` is its TTL when
    /// the node reported it.
    HeldByAnother {
        /// The other holder's remaining TTL (`None`: unknown or no expiry).
        remaining: Option<Duration>,
    },
    /// The key was not there: expired, deleted, or lost in a restart. For a
    /// release, also: no acquire of this lease was ever sent to the node.
    Missing,
    /// The node confirmed an extension but does not count toward the quorum,
    /// for the reason given (it restarted since the grant, or its grant was
    /// never confirmed).
    Uncounted(String),
    /// The command failed: connection refused or reset, or an error reply.
    Failed(String),
    /// No reply within the node timeout. The command may still be applied:
    /// the node's connection is replaced in the background, and the old one
    /// killed before anything else is sent to the node.
    TimedOut,
    /// Still unanswered when the outcome was decided. The command may still
    /// be applied; a grant is cleaned up by the release, which reaches the
    /// node after it.
    Abandoned,
    /// Nothing was sent, for the reason given (it restarted within the restart
    /// delay, the command waited behind earlier ones past its time, or there
    /// was nothing to do there).
    NotSent(String),
    /// Nothing was sent: the node has no connection right now, and its worker
    /// is reconnecting in the background (the reason is the last failure).
    /// Answered at once, without waiting for the connect. A release is still
    /// sent once the node is connected again.
    NotConnected(String),
}

impl fmt::Display for NodeOutcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            NodeOutcome::Granted => f.write_str("granted"),
            NodeOutcome::HeldByAnother {
                remaining: Some(left),
            } => write!(f, "held by another for {left:?}"),
            NodeOutcome::HeldByAnother { remaining: None } => f.write_str("held by another"),
            NodeOutcome::Missing => f.write_str("key missing"),
            NodeOutcome::Uncounted(why) => write!(f, "not counted: {why}"),
            NodeOutcome::Failed(why) => write!(f, "failed: {why}"),
            NodeOutcome::TimedOut => f.write_str("timed out"),
            NodeOutcome::Abandoned => f.write_str("no reply yet when the outcome was decided"),
            NodeOutcome::NotSent(why) => write!(f, "not sent: {why}"),
            NodeOutcome::NotConnected(why) => write!(f, "not connected: {why}"),
        }
    }
}

/// One node's part in a Redlock operation: which node, what it answered, and
/// how long it took.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct NodeReport {
    /// The node's address, without credentials.
    pub node: String,
    /// What it answered.
    pub outcome: NodeOutcome,
    /// From the send to the answer; `None` when nothing was sent or no answer
    /// came in time.
    pub latency: Option<Duration>,
}

/// `addr: outcome; addr: outcome` for messages.
pub(crate) fn summarize(nodes: &[NodeReport]) -> String {
    nodes
        .iter()
        .map(|n| format!("{}: {}", n.node, n.outcome))
        .collect::<Vec<_>>()
        .join("; ")
}
