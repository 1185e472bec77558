//! The renewal thread: one per deployment or Redlock group, started the first
//! time a guard needs it (its holder asked for the loss signal or a
//! keep-alive). It runs the pure `Schedule` over real time and never does I/O:
//! due renewals, claimed by the schedule (the one place a renewal begins), go
//! to a [`Dispatch`] (a connection's worker thread, or the nodes of a group),
//! whose replies come back as messages. So a guard's loss
//! signal closes at its deadline even while a renewal is blocked on a socket.
//!
//! It stops when its handle is dropped (the last coordinator clone, group
//! clone or guard is gone). [`RenewalThread`] is the front both kinds of
//! deployment hold: it starts the thread on first use and tells it of the
//! leases to watch.

use std::sync::{Arc, OnceLock};
use std::time::Instant;

use crossbeam_channel::{Receiver, Sender};
use parking_lot::Mutex;

use crate::clock::Clock;
use crate::core::executor::Claimed;
use crate::core::schedule::{Schedule, Watched};
use crate::error::Error;
use crate::runtime::lease::HasCell;

/// Where a renewal thread sends due renewals; implemented per deployment kind.
pub(crate) trait Dispatch: Send + 'static {
    type Lease: Watched + Clone + Send + 'static;
    type Reply: Send + 'static;
    /// Starts renewing `batch`, each lease claimed by the schedule; must not
    /// block on I/O. Replies arrive as [`Msg::Reply`] through
    /// [`Scheduler::send`], or on [`Dispatch::replies`]. Returns the renewals
    /// it completed at once, their claims given up (nothing sent): (lease id,
    /// when to retry).
    fn dispatch(
        &mut self,
        batch: Vec<Claimed<Self::Lease>>,
        now: Instant,
    ) -> Vec<(u64, Option<Instant>)>;
    /// A channel of replies of its own (the nodes of a group answer there).
    fn replies(&self) -> Receiver<Self::Reply> {
        crossbeam_channel::never()
    }
    /// Handles a reply; returns the renewals it completed: (lease id, when to
    /// retry if it failed).
    fn on_reply(&mut self, reply: Self::Reply, now: Instant) -> Vec<(u64, Option<Instant>)>;
}

/// What the renewal thread hears.
pub(crate) enum Msg<L, R> {
    /// Start watching a lease.
    Watch(L),
    /// A watched lease changed; plan it again.
    Touch(u64),
    /// A lease was released.
    Forget(u64),
    /// An executor's reply.
    Reply(R),
}

/// The handle; dropping it stops the thread.
pub(crate) struct Scheduler<L, R> {
    tx: Sender<Msg<L, R>>,
    _stop: Sender<()>,
}

impl<L: Send + 'static, R: Send + 'static> Scheduler<L, R> {
    /// Starts the thread, which hands due renewals to `dispatch`.
    pub(crate) fn spawn<D>(name: &str, clock: Arc<dyn Clock>, dispatch: D) -> std::io::Result<Self>
    where
        D: Dispatch<Lease = L, Reply = R>,
        L: Watched + Clone,
    {
        let (tx, rx) = crossbeam_channel::unbounded();
        let (stop_tx, stop_rx) = crossbeam_channel::bounded(0);
        std::thread::Builder::new()
            .name(name.to_owned())
            .spawn(move || run(&rx, &stop_rx, &*clock, dispatch))?;
        Ok(Scheduler { tx, _stop: stop_tx })
    }

    pub(crate) fn send(&self, msg: Msg<L, R>) {
        let _ = self.tx.send(msg);
    }
}

fn run<D: Dispatch>(
    rx: &Receiver<Msg<D::Lease, D::Reply>>,
    stop: &Receiver<()>,
    clock: &dyn Clock,
    mut dispatch: D,
) {
    let mut schedule: Schedule<D::Lease> = Schedule::default();
    let replies = dispatch.replies();
    loop {
        let timer = match schedule.next_due() {
            Some(at) => crossbeam_channel::at(at),
            None => crossbeam_channel::never(),
        };
        crossbeam_channel::select! {
            recv(rx) -> msg => match msg {
                Ok(msg) => {
                    handle(&mut schedule, &mut dispatch, msg, clock.now());
                    while let Ok(msg) = rx.try_recv() {
                        handle(&mut schedule, &mut dispatch, msg, clock.now());
                    }
                }
                Err(_) => return,
            },
            recv(replies) -> reply => {
                if let Ok(reply) = reply {
                    handle(&mut schedule, &mut dispatch, Msg::Reply(reply), clock.now());
                }
            },
            recv(stop) -> _ => return,
            recv(timer) -> _ => {}
        }
        let now = clock.now();
        let batch = schedule.due(now);
        if !batch.is_empty() {
            for (id, retry_at) in dispatch.dispatch(batch, now) {
                schedule.completed(id, now, retry_at);
            }
        }
    }
}

fn handle<D: Dispatch>(
    schedule: &mut Schedule<D::Lease>,
    dispatch: &mut D,
    msg: Msg<D::Lease, D::Reply>,
    now: Instant,
) {
    match msg {
        Msg::Watch(lease) => schedule.watch(lease, now),
        Msg::Touch(id) => schedule.touch(id, now),
        Msg::Forget(id) => schedule.forget(id),
        Msg::Reply(reply) => {
            for (id, retry_at) in dispatch.on_reply(reply, now) {
                schedule.completed(id, now, retry_at);
            }
        }
    }
}

/// The renewal thread of one deployment or Redlock group, started the first
/// time a lease is watched (see the module docs); its dispatcher is made by
/// `make` then (again after a start that failed).
pub(crate) struct RenewalThread<D: Dispatch> {
    name: &'static str,
    clock: Arc<dyn Clock>,
    make: Box<dyn Fn() -> D + Send + Sync>,
    scheduler: OnceLock<Scheduler<D::Lease, D::Reply>>,
    start: Mutex<()>,
}

impl<D: Dispatch> RenewalThread<D> {
    /// Not started yet: the thread will be named `name` and read `clock`.
    pub(crate) fn new(
        name: &'static str,
        clock: Arc<dyn Clock>,
        make: impl Fn() -> D + Send + Sync + 'static,
    ) -> Self {
        RenewalThread {
            name,
            clock,
            make: Box::new(make),
            scheduler: OnceLock::new(),
            start: Mutex::new(()),
        }
    }

    /// The running thread's handle, started now if needed.
    fn scheduler(&self) -> Result<&Scheduler<D::Lease, D::Reply>, Error>
    where
        D::Lease: Watched + Clone,
    {
        if let Some(s) = self.scheduler.get() {
            return Ok(s);
        }
        let _start = self.start.lock();
        if let Some(s) = self.scheduler.get() {
            return Ok(s);
        }
        let s =
            Scheduler::spawn(self.name, self.clock.clone(), (self.make)()).map_err(|source| {
                Error::Thread {
                    name: self.name,
                    source,
                }
            })?;
        Ok(self.scheduler.get_or_init(|| s))
    }

    /// Has the thread watch `lease` (its loss signal, its keep-alive),
    /// starting the thread if needed. A lease is marked watched by its first
    /// watch, so that touching or forgetting a lease nobody watches sends
    /// nothing.
    ///
    /// # Errors
    /// [`Error::Thread`] when the thread could not be started.
    pub(crate) fn watch(&self, lease: &D::Lease) -> Result<(), Error>
    where
        D::Lease: HasCell,
    {
        if lease.cell().watch() {
            self.scheduler()?.send(Msg::Watch(lease.clone()));
        }
        Ok(())
    }

    /// A watched lease changed: plan it again.
    pub(crate) fn touch(&self, lease: &impl HasCell) {
        if lease.cell().is_watched()
            && let Some(s) = self.scheduler.get()
        {
            s.send(Msg::Touch(lease.cell().id()));
        }
    }

    /// A watched lease was released.
    pub(crate) fn forget(&self, lease: &impl HasCell) {
        if lease.cell().is_watched()
            && let Some(s) = self.scheduler.get()
        {
            s.send(Msg::Forget(lease.cell().id()));
        }
    }

    /// Hands the thread a reply, if it runs.
    pub(crate) fn reply(&self, reply: D::Reply) {
        if let Some(s) = self.scheduler.get() {
            s.send(Msg::Reply(reply));
        }
    }
}
