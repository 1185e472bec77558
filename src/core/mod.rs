//! The sans-I/O core: lease bounds, the executor's choreography (claim, send,
//! settle, fence, clean up), the renewal schedule, quorum arithmetic and
//! fencing-token order, as pure state machines over events and instants passed
//! in. Nothing here reads a clock, touches a socket or starts a thread; the
//! runtime drives it with real time and real connections, and the simulation
//! in `src/sim/` drives it with model ones (after quinn-proto and rustls,
//! whose protocol cores are fed events rather than sockets).

pub(crate) mod acquire;
pub(crate) mod executor;
pub(crate) mod extend;
pub(crate) mod fences;
pub(crate) mod lease;
pub(crate) mod quorum;
pub(crate) mod redlock;
pub(crate) mod schedule;
pub(crate) mod server_clock;
pub(crate) mod timing;
pub(crate) mod wait;
