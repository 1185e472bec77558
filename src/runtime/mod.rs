//! The only code that starts threads: the renewal thread and the invalidation
//! subscriber (one each per `Coordinator`), and the timing rules they follow.

pub(crate) mod clock;
pub(crate) mod renewal;
pub(crate) mod tracking;
pub(crate) mod waiters;
