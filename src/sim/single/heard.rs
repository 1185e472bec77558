//! What an observer hears of the simulated leases, checked against the model
//! server: every lease's cell reports to a recording [`Observer`] (the
//! shipped calls in `runtime::lease`, where renewals are confirmed and losses
//! settled), and after every instant the checker reads what it heard:
//!
//! - a lease is reported lost at most once, and never after its holder let
//!   go of it;
//! - a watched lease (kept alive, or with a loss signal) that is lost has
//!   been reported lost by the end of that instant: no later than the guard
//!   says so, and so before the server drops it (the bound, which the loss
//!   precedes, is at or before the server's expiry);
//! - a renewal's margin is at most what the server had left when the
//!   extension was sent (read from the model server at the end of that
//!   instant): the guard's bound never grows while its extension is out, and
//!   it was at or before that expiry.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use super::{Cell, KeyKind, Req, World, key_name, members, permits, rw_keys, string_at};
use crate::observe::{LossEvent, Observer, Primitive, RenewalEvent};

/// One thing the observer heard.
#[derive(Clone, Copy, Debug)]
enum Heard {
    Renewed { lease: u64, margin: Duration },
    Lost { lease: u64 },
}

/// The recording observer, and what the checker keeps beside it.
#[derive(Default)]
pub(super) struct Hearing {
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    heard: Vec<Heard>,
    /// Every observed lease, to judge an event when it is heard.
    cells: HashMap<u64, Weak<Cell>>,
    /// Losses reported after their lease was finished.
    after_finish: Vec<u64>,
    /// Leases reported lost.
    lost: HashMap<u64, u32>,
    /// Per lease, the extension sent last: `None` until the end of the instant
    /// it was sent in, then the server's expiry of the lease at that moment
    /// (nanoseconds of client time; `None` inside when it was not held or is
    /// exempt).
    sent: HashMap<u64, Option<Option<f64>>>,
}

impl Hearing {
    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().expect("never poisoned")
    }
}

impl Observer for Hearing {
    fn renewed(&self, e: &RenewalEvent<'_>) {
        let lease = e.lease.get();
        let margin = e.margin;
        self.state().heard.push(Heard::Renewed { lease, margin });
    }

    fn lost(&self, e: &LossEvent<'_>) {
        let lease = e.lease.get();
        let mut s = self.state();
        if let Some(cell) = s.cells.get(&lease).and_then(Weak::upgrade)
            && cell.is_finished()
        {
            s.after_finish.push(lease);
        }
        s.heard.push(Heard::Lost { lease });
    }
}

/// How observers name the primitive of a key.
fn primitive(kind: KeyKind, value: &str) -> Primitive {
    match kind {
        KeyKind::Plain => Primitive::Lock,
        KeyKind::Fenced => Primitive::FencedLock,
        KeyKind::Permits(_) => Primitive::Semaphore,
        KeyKind::Rw { .. } if value.contains(':') => Primitive::Write,
        KeyKind::Rw { .. } => Primitive::Read,
    }
}

impl World {
    /// Has the recording observer hear of `cell`, a lease of `value` on `key`.
    pub(super) fn hear(&mut self, cell: &Arc<Cell>, key: usize, value: &str) {
        let observer: Arc<dyn Observer> = self.hearing.clone();
        cell.observe_with(Some(&observer), primitive(self.kinds[key], value));
        let mut s = self.hearing.state();
        s.cells.retain(|_, c| c.strong_count() > 0);
        s.cells.insert(cell.id(), Arc::downgrade(cell));
    }

    /// Notes the extensions `req` sends, if it is one.
    pub(super) fn hear_sent(&self, req: &Req) {
        let Req::Extend { items, .. } = req else {
            return;
        };
        for (key, value, _) in items {
            let mut held = self.users.iter().filter_map(|u| u.guard.as_ref());
            if let Some(g) = held.find(|g| g.key == *key && g.value == *value) {
                self.hearing.state().sent.insert(g.cell.id(), None);
            }
        }
    }

    /// The true time (nanoseconds of client time) at which the server drops
    /// `value`'s lease on `key`: a key it keeps while its clock, in whole
    /// milliseconds, is at or before the expiry; a permit while the clock is
    /// before its score. `None` when it does not hold it.
    pub(super) fn ends_at(&self, key: usize, value: &str) -> Option<f64> {
        let name = key_name(key);
        let ends = match self.kinds[key] {
            KeyKind::Permits(_) => permits(&self.server, key)
                .into_iter()
                .find(|(m, _)| *m == value)
                .map(|(_, score)| score.ceil()),
            KeyKind::Rw { .. } if !value.contains(':') => members(&self.server, rw_keys(key)[1])
                .into_iter()
                .find(|(m, _)| *m == value)
                .map(|(_, score)| score.ceil()),
            _ => match (string_at(&self.server, name), self.server.expiry(name)) {
                (Some(v), Some(at)) if v == value => Some((at + 1) as f64),
                _ => None,
            },
        };
        ends.map(|at| {
            let ahead = at - self.server.clock_ms();
            self.now.as_nanos() as f64 + ahead / self.server.rate() * 1e6
        })
    }

    /// The observer's invariants, at the end of an instant.
    pub(super) fn check_heard(&self) -> Result<(), String> {
        let now = self.at();
        let t = self.now;
        let mut hearing = self.hearing.state();
        if let Some(lease) = hearing.after_finish.first() {
            return Err(format!(
                "lease {lease} was reported lost after its holder let go of it ({t:?})"
            ));
        }
        let heard = std::mem::take(&mut hearing.heard);
        // What the server holds now, for the extensions sent in this instant.
        let mut ends = HashMap::new();
        for g in self.users.iter().filter_map(|u| u.guard.as_ref()) {
            let exempt = g.exposed || g.deleted.is_some() || g.stepped;
            let end = (!exempt).then(|| self.ends_at(g.key, &g.value)).flatten();
            ends.insert(g.cell.id(), end);
        }
        for (lease, sent) in &mut hearing.sent {
            if sent.is_none() {
                *sent = Some(ends.get(lease).copied().flatten());
            }
        }
        for h in heard {
            match h {
                Heard::Lost { lease } => {
                    let times = hearing.lost.entry(lease).or_default();
                    *times += 1;
                    if *times > 1 {
                        return Err(format!("lease {lease} was reported lost twice ({t:?})"));
                    }
                }
                Heard::Renewed { lease, margin } => {
                    let Some(Some(Some(end))) = hearing.sent.get(&lease) else {
                        continue;
                    };
                    let by = t.as_nanos() as f64 + margin.as_nanos() as f64;
                    if by > end + 1.0 {
                        return Err(format!(
                            "lease {lease} was renewed at {t:?} with a margin of {margin:?}, \
                             past what the server had left when the extension was sent (until \
                             {:?})",
                            Duration::from_nanos(*end as u64)
                        ));
                    }
                }
            }
        }
        for (u, user) in self.users.iter().enumerate() {
            let Some(g) = &user.guard else { continue };
            if g.cell.is_watched()
                && g.cell.peek_lost(now)
                && !g.cell.is_finished()
                && !hearing.lost.contains_key(&g.cell.id())
            {
                return Err(format!(
                    "user {u}: its watched lease {} is lost at {t:?} (lost at {:?}), but no \
                     observer heard of it",
                    g.cell.id(),
                    g.cell.lost_at().duration_since(self.origin)
                ));
            }
        }
        Ok(())
    }
}
