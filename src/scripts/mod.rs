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
        let mut cmd = redis::cmd("EVALSHA");
        cmd.arg(&self.sha).arg(keys.len()).arg(keys).arg(args);
        cmd
    }

    /// `EVAL code numkeys keys… args…` (also caches the script on the server).
    pub(crate) fn eval(&self, keys: &[&str], args: &[&str]) -> redis::Cmd {
        let mut cmd = redis::cmd("EVAL");
        cmd.arg(self.code).arg(keys.len()).arg(keys).arg(args);
        cmd
    }
}

macro_rules! script {
    ($ident:ident, $file:literal) => {
        pub(crate) static $ident: LazyLock<Script> =
            LazyLock::new(|| Script::new($file, include_str!($file)));
    };
}

script!(LOCK_ACQUIRE, "lock_acquire.lua");
script!(FENCED_ACQUIRE, "fenced_acquire.lua");
script!(LEASE_RELEASE, "lease_release.lua");
script!(LEASE_EXTEND, "lease_extend.lua");
script!(LEASE_VERIFY, "lease_verify.lua");
