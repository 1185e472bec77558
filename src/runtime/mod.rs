//! The only code that starts threads: the renewal thread and the invalidation
//! subscriber (one each per `Coordinator`), the Redlock node workers and renewal
//! thread (per `RedlockGroup`), and the timing rules they follow.

pub(crate) mod clock;
pub(crate) mod nodes;
pub(crate) mod redlock_renewal;
pub(crate) mod renewal;
pub(crate) mod timer;
pub(crate) mod tracking;
pub(crate) mod waiters;
