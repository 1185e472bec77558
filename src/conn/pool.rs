//! A bounded pool of command connections to one server.

use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use crate::error::{Error, Result};

use super::config::ConnConfig;
use super::connection::Conn;

/// A bounded pool of command connections.
pub(crate) struct Pool {
    pub(crate) cfg: Arc<ConnConfig>,
    max: usize,
    state: Mutex<PoolState>,
    freed: Condvar,
}

struct PoolState {
    /// Boxed, so that lending and returning one moves a pointer rather than
    /// the whole connection struct on every lend and return.
    #[allow(clippy::vec_box, reason = "a lent connection moves as a pointer")]
    idle: Vec<Box<Conn>>,
    open: usize,
    /// The server is no longer the deployment's primary: nothing is handed out
    /// or kept any more.
    closed: bool,
}

impl Pool {
    pub(crate) fn new(cfg: Arc<ConnConfig>, max: usize) -> Self {
        Pool {
            cfg,
            max: max.max(1),
            state: Mutex::new(PoolState {
                idle: Vec::new(),
                open: 0,
                closed: false,
            }),
            freed: Condvar::new(),
        }
    }

    /// Puts a freshly made connection in the pool (used by the first connect).
    pub(crate) fn seed(&self, mut conn: Conn) {
        conn.fresh = false;
        let mut state = self.state.lock();
        state.open += 1;
        state.idle.push(Box::new(conn));
    }

    /// Takes an idle connection, or opens one while under the limit, or waits
    /// until `deadline` for one to be returned. How long opening one may take:
    /// with [`Connect::Own`] the connect timeout of its own (the caller then
    /// extends its command deadline by [`Pooled::connect_time`]); with
    /// [`Connect::Within`] whatever is left until `deadline`.
    pub(crate) fn get(&self, deadline: Instant, connect: Connect) -> Result<Pooled<'_>> {
        // Read only when the call has to wait: the common case takes an idle
        // connection and needs no clock.
        let mut started = None;
        let mut state = self.state.lock();
        loop {
            if state.closed {
                return Err(Error::Topology(format!(
                    "{} is no longer the deployment's primary",
                    self.cfg.addr
                )));
            }
            if let Some(conn) = state.idle.pop() {
                return Ok(Pooled {
                    pool: self,
                    conn: Some(conn),
                    connect_time: Duration::ZERO,
                });
            }
            if state.open < self.max {
                state.open += 1;
                drop(state);
                let budget = match connect {
                    Connect::Own => self.cfg.connect_timeout,
                    Connect::Within => deadline.saturating_duration_since(self.cfg.clock.now()),
                };
                let opened = self.cfg.clock.now();
                return match self.cfg.connect(budget, "respire") {
                    Ok(conn) => Ok(Pooled {
                        pool: self,
                        conn: Some(Box::new(conn)),
                        connect_time: self.cfg.clock.now().saturating_duration_since(opened),
                    }),
                    Err(e) => {
                        self.state.lock().open -= 1;
                        self.freed.notify_one();
                        Err(e)
                    }
                };
            }
            let started = *started.get_or_insert_with(|| self.cfg.clock.now());
            if self.freed.wait_until(&mut state, deadline).timed_out() {
                return Err(Error::PoolTimeout(
                    self.cfg.clock.now().saturating_duration_since(started),
                ));
            }
        }
    }

    /// Closes the idle connections and every one returned from now on, and
    /// refuses to hand out more (the server stopped being the primary).
    pub(crate) fn close(&self) {
        let mut state = self.state.lock();
        state.closed = true;
        let idle = std::mem::take(&mut state.idle);
        state.open -= idle.len();
        drop(state);
        drop(idle);
        self.freed.notify_all();
    }

    fn put(&self, mut conn: Box<Conn>) {
        conn.fresh = false;
        let mut state = self.state.lock();
        if state.closed {
            state.open -= 1;
            drop(state);
            drop(conn);
        } else if conn.is_broken() {
            // A connection that failed usually means the server restarted, failed
            // over or stalled: the idle ones are likely dead too, and a reply
            // arriving late on any of them must not be read as the next answer.
            let idle = std::mem::take(&mut state.idle);
            state.open -= 1 + idle.len();
            drop(state);
            // Dropping closes the sockets; done outside the lock.
            drop(conn);
            drop(idle);
        } else {
            state.idle.push(conn);
            drop(state);
        }
        self.freed.notify_one();
    }
}

/// How a pooled call may spend time opening a connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Connect {
    /// Up to the connect timeout, on top of the call's own deadline.
    Own,
    /// Only within the call's deadline (calls with a strict bound: release).
    Within,
}

/// A connection borrowed from the pool; returned on drop unless broken.
pub(crate) struct Pooled<'a> {
    pool: &'a Pool,
    conn: Option<Box<Conn>>,
    connect_time: Duration,
}

impl Pooled<'_> {
    /// How long opening this connection took (zero for an idle one).
    pub(crate) fn connect_time(&self) -> Duration {
        self.connect_time
    }
}

impl std::ops::Deref for Pooled<'_> {
    type Target = Conn;
    fn deref(&self) -> &Conn {
        self.conn.as_ref().expect("connection present until drop")
    }
}

impl std::ops::DerefMut for Pooled<'_> {
    fn deref_mut(&mut self) -> &mut Conn {
        self.conn.as_mut().expect("connection present until drop")
    }
}

impl Drop for Pooled<'_> {
    fn drop(&mut self) {
        if let Some(conn) = self.conn.take() {
            self.pool.put(conn);
        }
    }
}
