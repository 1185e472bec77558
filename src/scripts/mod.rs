//! The Lua scripts: one per state change, each run as a single EVALSHA (EVAL on
//! NOSCRIPT), so every operation is one round trip and atomic on the server.

use std::sync::LazyLock;

/// A script with its SHA1, computed once.
pub(crate) struct Script {
    pub(crate) name: &'static str,
    pub(crate) code: &'static str,
    pub(crate) sha: String,
}

impl Script {
    fn new(name: &'static str, code: &'static str) -> Self {
        let sha = redis::Script::new(code).get_hash().to_owned();
        Script { name, code, sha }
    }

    /// `EVALSHA sha numkeys keys… args…`
    pub(crate) fn evalsha(&self, keys: &[&str], args: &[&str]) -> redis::Cmd {
        call("EVALSHA", &self.sha, keys, args)
    }

    /// `EVAL code numkeys keys… args…` (also caches the script on the server).
    pub(crate) fn eval(&self, keys: &[&str], args: &[&str]) -> redis::Cmd {
        call("EVAL", self.code, keys, args)
    }
}

/// `name script numkeys keys… args…`, in buffers of the size it needs (no
/// growing them argument by argument).
fn call(name: &str, script: &str, keys: &[&str], args: &[&str]) -> redis::Cmd {
    let words = keys.iter().chain(args).map(|s| s.len()).sum::<usize>();
    // `numkeys` takes at most 20 digits.
    let mut cmd = redis::Cmd::with_capacity(
        3 + keys.len() + args.len(),
        name.len() + script.len() + 20 + words,
    );
    cmd.arg(name)
        .arg(script)
        .arg(keys.len())
        .arg(keys)
        .arg(args);
    cmd
}

macro_rules! script {
    ($(#[$attr:meta])* $ident:ident, $file:literal) => {
        $(#[$attr])*
        pub(crate) static $ident: LazyLock<Script> =
            LazyLock::new(|| Script::new($file, include_str!($file)));
    };
}

script!(FENCED_ACQUIRE, "fenced_acquire.lua");
script!(LEASE_RELEASE, "lease_release.lua");
script!(LEASE_EXTEND, "lease_extend.lua");
script!(LEASE_VERIFY, "lease_verify.lua");

// The lock whose waiters queue on the server (`Fairness::Fifo`).
script!(FIFO_ACQUIRE, "fifo_acquire.lua");
script!(FIFO_WITHDRAW, "fifo_withdraw.lua");

// The election (its campaign is `fenced_acquire` with a value key).
script!(ELECTION_LEADER, "election_leader.lua");
script!(ELECTION_PROCLAIM, "election_proclaim.lua");

// Several leases at once (their release, extension and verification are
// each lease's own).
script!(MULTI_ACQUIRE, "multi_acquire.lua");
script!(MULTI_CLEAN_UP, "multi_clean_up.lua");

// The reader/writer lease.
script!(RW_READ_ACQUIRE, "rw_read_acquire.lua");
script!(RW_READ_EXTEND, "rw_read_extend.lua");
script!(RW_READ_VERIFY, "rw_read_verify.lua");
script!(RW_READ_RELEASE, "rw_read_release.lua");
script!(RW_WRITE_ACQUIRE, "rw_write_acquire.lua");
script!(RW_WRITE_WITHDRAW, "rw_write_withdraw.lua");
script!(RW_WRITE_CLEAN_UP, "rw_write_clean_up.lua");

// The semaphore.
script!(SEM_ACQUIRE, "sem_acquire.lua");
script!(SEM_EXTEND, "sem_extend.lua");
script!(SEM_VERIFY, "sem_verify.lua");
script!(SEM_RELEASE, "sem_release.lua");
script!(SEM_SET_CAPACITY, "sem_set_capacity.lua");
script!(SEM_STATUS, "sem_status.lua");
