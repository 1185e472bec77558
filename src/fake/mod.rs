//! An in-process fake Redis deployment for your own tests (feature
//! `test-util`): lease loss, missing replies, pauses and failovers in
//! milliseconds, without a server to install or real TTLs to wait out.
//!
//! A [`FakeDeployment`] listens on loopback TCP ports and answers RESP2 and
//! RESP3 from threads of its own, so a [`Coordinator`](crate::Coordinator)
//! connects to [`FakeDeployment::url`] as to any server and runs its real
//! connection code: `CLIENT TRACKING` and the invalidation subscription that
//! wake waiters, `EVALSHA` and `SCRIPT LOAD`, `TIME` read with every renewal,
//! `WAIT`, `INFO`, `ROLE`, `CLIENT ID`/`INFO`/`KILL` for fencing off a
//! connection whose reply never came. Behind the ports is the model server
//! the crate's own simulation checks the library against: it keeps data with
//! Redis 7.0's semantics (millisecond expiries on the server's clock, the
//! error texts a client sees) and runs the crate's Lua scripts in Lua 5.1,
//! as Redis does, so every primitive behaves as it does on Redis.
//!
//! The controls a test needs, each in place when the call returns:
//!
//! | Control | What happens |
//! |---|---|
//! | [`advance_clock`](FakeDeployment::advance_clock) | the server's clock jumps forward; keys expire by it |
//! | [`pause`](FakeDeployment::pause) / [`resume`](FakeDeployment::resume) | nothing is answered meanwhile (`SIGSTOP`) |
//! | [`drop_replies`](FakeDeployment::drop_replies) | commands run, their replies never come |
//! | [`delay_replies`](FakeDeployment::delay_replies) | commands run, their replies come late |
//! | [`lose_key`](FakeDeployment::lose_key) | a key is gone (eviction, an operator) |
//! | [`hold_replication`](FakeDeployment::hold_replication) then [`fail_over`](FakeDeployment::fail_over) | the replica, which missed the writes since, becomes the primary |
//! | [`restart`](FakeDeployment::restart) | the primary restarts without persistence |
//!
//! # Example: a worker stops writing when its lease is lost
//!
//! ```
//! use std::time::Duration;
//! use respire_coordination::{Coordinator, LockGuard};
//! use respire_coordination::fake::FakeDeployment;
//!
//! /// The code under test: writes batches while its lease holds.
//! fn worker(guard: &LockGuard, written: &mut Vec<u32>) {
//!     for batch in 0.. {
//!         if guard.is_lost() {
//!             return;
//!         }
//!         written.push(batch);
//!         // Wait for the next batch, or for the loss, whichever is first.
//!         let _ = guard.lost_signal().recv_timeout(Duration::from_millis(5));
//!     }
//! }
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let fake = FakeDeployment::start()?;
//! let coord = Coordinator::builder(&fake.url())
//!     .node_timeout(Duration::from_millis(100))
//!     .build()?;
//! let lock = coord.lock("reports")?;
//! let guard = lock.try_acquire(Duration::from_millis(500))?.expect("a free lock");
//! let _renewal = guard.keep_alive()?;
//!
//! // Someone deletes the lease while the worker writes: its next renewal
//! // finds the key gone.
//! fake.lose_key(guard.key());
//! let mut written = Vec::new();
//! worker(&guard, &mut written);
//! assert!(guard.is_lost());
//! let stopped_at = written.len();
//! // Nothing more is written once the loss is flagged.
//! worker(&guard, &mut written);
//! assert_eq!(written.len(), stopped_at);
//! # Ok(()) }
//! ```
//!
//! # What it is not
//!
//! - One database (`SELECT 0`), no `AUTH`, no TLS, no Cluster; with
//!   [`FakeDeployment::start_sentinel`] one sentinel and two data servers,
//!   of which the replica answers `ROLE`, `INFO` and `PING` and refuses
//!   every data command with `READONLY` (it serves no reads).
//! - The commands the crate sends and the data commands its scripts call
//!   (strings, hashes, sorted sets, bitmaps, expiries); anything else is an
//!   unknown command. In RESP3, nil is `_`, `HGETALL` a map, `ZSCORE` a
//!   double and a `WITHSCORES` range pairs of member and double; no other
//!   reply takes a RESP3-only shape.
//! - Tracking invalidates every key a command named (a script's `KEYS`),
//!   not only those it read: a waiter may wake for nothing, never sleep
//!   through a change.

mod resp;
mod world;

use std::net::TcpStream;
use std::sync::atomic::Ordering;
use std::time::Duration;

use world::{Threads, World};

/// An in-process fake Redis deployment on loopback ports (see the [module
/// documentation](self)).
///
/// Its threads (`respire-fake`, an acceptor per port and a reader per
/// connection) end when it is dropped, which closes every connection to it.
/// Every control blocks until the fake's thread has applied it; none fails
/// once the fake started (a fake whose thread is gone ignores them).
#[must_use = "if unused the fake stops at once"]
pub struct FakeDeployment {
    threads: Threads,
    url: String,
}

impl FakeDeployment {
    /// Starts a standalone server (with a hidden replica that
    /// [`fail_over`](Self::fail_over) promotes in its place, on the same
    /// address). Its clock starts at the machine's wall clock and runs with
    /// the machine's monotonic clock, plus what
    /// [`advance_clock`](Self::advance_clock) adds.
    ///
    /// # Errors
    ///
    /// An I/O error if no loopback port can be bound or no thread started.
    pub fn start() -> std::io::Result<FakeDeployment> {
        let threads = world::start(None)?;
        let url = format!("redis://127.0.0.1:{}", threads.acceptors[0].0);
        Ok(FakeDeployment { threads, url })
    }

    /// Starts a Sentinel deployment: a primary, a replica on a port of its
    /// own, and one sentinel that names the primary of `service` and
    /// publishes `+switch-master` when [`fail_over`](Self::fail_over) swaps
    /// them. [`url`](Self::url) is the `redis+sentinel://` URL.
    ///
    /// # Errors
    ///
    /// An I/O error if no loopback port can be bound or no thread started.
    pub fn start_sentinel(service: &str) -> std::io::Result<FakeDeployment> {
        let threads = world::start(Some(service.to_owned()))?;
        let url = format!(
            "redis+sentinel://127.0.0.1:{}/{service}",
            threads.acceptors[2].0
        );
        Ok(FakeDeployment { threads, url })
    }

    /// The URL to give [`Coordinator::connect`](crate::Coordinator::connect):
    /// `redis://127.0.0.1:port`, or `redis+sentinel://127.0.0.1:port/service`.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// `redis://` URL of the server that is the primary now (after a
    /// [`fail_over`](Self::fail_over) of a Sentinel deployment, the other
    /// data port): for a test's own connection that reads the truth, such
    /// as a key's `PTTL`.
    pub fn primary_url(&self) -> String {
        format!(
            "redis://127.0.0.1:{}",
            self.call(|w| w.primary_port()).unwrap_or_default()
        )
    }

    /// The primary's `run_id` (new after a restart or a failover).
    pub fn run_id(&self) -> String {
        self.call(|w| w.run_id()).unwrap_or_default()
    }

    /// The server's clock now, in milliseconds since the Unix epoch (what
    /// `TIME` answers).
    pub fn now_ms(&self) -> i64 {
        self.call(|w| w.now_ms()).unwrap_or_default()
    }

    /// Steps the server's clock forward by `by` (whole milliseconds), as an
    /// NTP step would: keys whose expiry it passes are gone at once (when a
    /// [`pause`](Self::pause) ends, if paused), and the `TIME` that renewals
    /// read shows the jump. Waiters tracking those keys are sent their
    /// invalidation.
    pub fn advance_clock(&self, by: Duration) {
        self.call(move |w| w.advance_clock(by));
    }

    /// Stops answering, as a server under `SIGSTOP` does: commands are read
    /// and held, connections still open, and the clock's effects (expiries)
    /// wait too. [`resume`](Self::resume) runs what was held, in order.
    pub fn pause(&self) {
        self.call(World::pause);
    }

    /// Ends a [`pause`](Self::pause): held commands run, keys past their
    /// expiry are gone.
    pub fn resume(&self) {
        self.call(World::resume);
    }

    /// The next `n` commands that touch keys (scripts and data commands, not
    /// `CLIENT`, `PING`, `TIME`, `INFO`, `ROLE`, `SCRIPT`, `WAIT` or pub/sub)
    /// run, but their replies never come: each one's connection then hears
    /// nothing more and runs nothing more, as a connection whose return path
    /// was cut, until the client closes it or a `CLIENT KILL` does. Adds to
    /// any drops still pending.
    pub fn drop_replies(&self, n: usize) {
        self.call(move |w| w.drop_replies(n));
    }

    /// The next `n` commands that touch keys (as
    /// [`drop_replies`](Self::drop_replies) counts them) run, and each reply
    /// is sent `by` later; later replies on the same connection wait behind
    /// it. Replaces any delay still pending.
    pub fn delay_replies(&self, n: usize, by: Duration) {
        self.call(move |w| w.delay_replies(n, by));
    }

    /// Deletes `key` without a command, as an eviction or an operator would
    /// (waiters tracking it are woken); true if it existed.
    pub fn lose_key(&self, key: &str) -> bool {
        let key = key.as_bytes().to_vec();
        self.call(move |w| w.lose_key(&key)).unwrap_or(false)
    }

    /// Stops the replica from applying writes: whatever the primary accepts
    /// from now on is what a [`fail_over`](Self::fail_over) loses.
    pub fn hold_replication(&self) {
        self.call(|w| w.hold_replication(true));
    }

    /// Lets the replica catch up and follow every write again (the default).
    pub fn resume_replication(&self) {
        self.call(|w| w.hold_replication(false));
    }

    /// Writes the replica has not applied (0 unless replication is held).
    pub fn replication_lag(&self) -> usize {
        self.call(|w| w.replication_lag()).unwrap_or(0)
    }

    /// Fails over to the replica: it becomes the primary with the data it
    /// had applied (writes held back by
    /// [`hold_replication`](Self::hold_replication) are lost), a new
    /// `run_id`, no scripts loaded; a new replica follows it; every
    /// connection to a data server is cut. On a standalone fake the new
    /// primary serves on the same address; with a sentinel it serves on the
    /// other data port, the sentinel names it and publishes `+switch-master`.
    pub fn fail_over(&self) {
        self.call(World::fail_over);
    }

    /// Restarts the primary without persistence (`--save ""`, no
    /// append-only file): no data, no scripts, a new `run_id`, every
    /// connection to it cut. The replica resyncs to the empty data set.
    pub fn restart(&self) {
        self.call(World::restart);
    }

    /// Runs `f` on the fake's thread and returns its result; `None` if the
    /// thread is gone.
    fn call<T: Send + 'static>(
        &self,
        f: impl FnOnce(&mut World) -> T + Send + 'static,
    ) -> Option<T> {
        let (tx, rx) = crossbeam_channel::bounded(1);
        let job = Box::new(move |w: &mut World| {
            let _ = tx.send(f(w));
        });
        self.threads.events.send(world::Event::Control(job)).ok()?;
        rx.recv().ok()
    }
}

impl std::fmt::Debug for FakeDeployment {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FakeDeployment")
            .field("url", &self.url)
            .finish_non_exhaustive()
    }
}

impl Drop for FakeDeployment {
    fn drop(&mut self) {
        self.call(World::stop);
        self.threads.stopping.store(true, Ordering::SeqCst);
        for (port, handle) in self.threads.acceptors.drain(..) {
            // Wakes the acceptor's blocking accept, which then sees the flag.
            let _ = TcpStream::connect(("127.0.0.1", port));
            let _ = handle.join();
        }
        if let Some(world) = self.threads.world.take() {
            let _ = world.join();
        }
    }
}
