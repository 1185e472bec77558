//! The Redlock choreography as sans-I/O state machines (antirez, "Distributed
//! Locks with Redis"; Kleppmann, "How to do distributed locking", on why a
//! command without a reply must be assumed applied).
//!
//! After quinn-proto's `Connection`: [`Node`] is one node's share of every
//! group operation. Jobs come in with [`Node::handle_job`], what the node's
//! connection brings back with [`Node::handle_result`],
//! [`Node::handle_connected`] and [`Node::handle_connect_failed`];
//! [`Node::poll`] says what to do next: answer a job, send a command, or make
//! a new connection. The runtime's node workers and the simulation drive this
//! one object, and count what it answers with [`Extension`], [`Release`] and
//! the quorum arithmetic of [`Tally`](crate::core::quorum::Tally). Nothing
//! here reads a clock or touches a socket.
//!
//! The rules it keeps:
//! - one node's jobs run in the order they came, one at a time, so the
//!   release of a lease reaches a node after that lease's acquire;
//! - a job still queued when its deadline passes (or with less time left than
//!   the node's round trip) is not sent, except a release, which gets a budget
//!   of its own so that a late grant does not outlive its clean-up;
//! - a command that got no reply taints its connection: a new one is made in
//!   the background, and the tainted one killed from it (the kill confirmed)
//!   before anything else is sent, unless the server restarted, which closed
//!   it ([`fences_for`]); until then acquires and extensions are answered
//!   "not connected" at once and releases wait, in order, to be sent;
//! - a release without a reply is sent again, a few times at most, each time
//!   on a new connection after the old one was killed;
//! - a node counts for a lease only while the server that granted it runs
//!   (same `run_id`).

mod checks;
mod extension;
mod grant;
mod job;
mod node;
mod node_lease;
mod release;

pub(crate) use checks::{
    ServerInfo, check_group, check_independent, check_round_trips, check_ttl, parse_info,
};
pub(crate) use extension::{Extension, QuorumRenewal};
pub(crate) use grant::{acquired, validity};
pub(crate) use job::{Answer, Connected, Job, NodeReply, NodeSettings, Op};
pub(crate) use node::{Action, Node, ROUND_TRIPS_PER_TIMEOUT, fences_for, started_by};
pub(crate) use node_lease::{NodeLease, Watch};
pub(crate) use release::Release;
