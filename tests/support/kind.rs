//! Which server the harness runs: Redis (the default) or Valkey, chosen by
//! `RESPIRE_TEST_SERVER`.
//!
//! `RESPIRE_TEST_SERVER=redis` (or unset) runs `redis-server` and `redis-cli`
//! from `PATH`. `RESPIRE_TEST_SERVER=valkey` runs `valkey-server` and
//! `valkey-cli` from `.deps/valkey-8.1.8/bin` in the repository, where
//! `scripts/install-deps` puts them, or else from `PATH`.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// The environment variable that picks the server.
pub(crate) const SERVER_VARIABLE: &str = "RESPIRE_TEST_SERVER";
/// Where `scripts/install-deps` puts the Valkey binaries, relative to the
/// repository root.
const VALKEY_DIR: &str = ".deps/valkey-8.1.8/bin";

/// The kind of server every process the harness starts runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ServerKind {
    /// `redis-server` and `redis-cli`.
    Redis,
    /// `valkey-server` and `valkey-cli`.
    Valkey,
}

impl ServerKind {
    /// The kind `RESPIRE_TEST_SERVER` names, read once per process.
    ///
    /// # Panics
    ///
    /// Panics if the variable holds anything but `redis` or `valkey`.
    pub(crate) fn current() -> ServerKind {
        static KIND: OnceLock<ServerKind> = OnceLock::new();
        *KIND.get_or_init(|| match std::env::var(SERVER_VARIABLE) {
            Err(std::env::VarError::NotPresent) => ServerKind::Redis,
            Ok(value) if value.is_empty() || value == "redis" => ServerKind::Redis,
            Ok(value) if value == "valkey" => ServerKind::Valkey,
            Ok(value) => panic!("{SERVER_VARIABLE} must be `redis` or `valkey`, not `{value}`"),
            Err(e) => panic!("{SERVER_VARIABLE} must be `redis` or `valkey`: {e}"),
        })
    }

    /// `redis` or `valkey`.
    pub(crate) fn name(self) -> &'static str {
        match self {
            ServerKind::Redis => "redis",
            ServerKind::Valkey => "valkey",
        }
    }

    /// The server program: a name looked up on `PATH` or a path.
    ///
    /// # Panics
    ///
    /// Panics, saying how to install it, if the Valkey server is neither in
    /// `.deps` nor on `PATH`.
    pub(crate) fn server_program(self) -> &'static Path {
        static VALKEY: OnceLock<PathBuf> = OnceLock::new();
        match self {
            ServerKind::Redis => Path::new("redis-server"),
            ServerKind::Valkey => VALKEY.get_or_init(|| valkey_program("valkey-server")),
        }
    }

    /// The command-line client (`redis-cli`, `valkey-cli`), found like
    /// [`ServerKind::server_program`].
    ///
    /// # Panics
    ///
    /// Panics as [`ServerKind::server_program`] does.
    pub(crate) fn cli_program(self) -> &'static Path {
        static VALKEY: OnceLock<PathBuf> = OnceLock::new();
        match self {
            ServerKind::Redis => Path::new("redis-cli"),
            ServerKind::Valkey => VALKEY.get_or_init(|| valkey_program("valkey-cli")),
        }
    }
}

/// `name` in `.deps/valkey-8.1.8/bin` of the repository this file belongs to
/// (looked for above the crate being built too: the campaign is a crate of
/// its own inside the repository), else `name` if `PATH` has it.
fn valkey_program(name: &str) -> PathBuf {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    for dir in manifest.ancestors() {
        let candidate = dir.join(VALKEY_DIR).join(name);
        if candidate.is_file() {
            return candidate;
        }
    }
    let on_path = std::env::var_os("PATH")
        .is_some_and(|path| std::env::split_paths(&path).any(|dir| dir.join(name).is_file()));
    if on_path {
        return PathBuf::from(name);
    }
    panic!(
        "{SERVER_VARIABLE}=valkey but {name} is neither in {} nor on PATH: \
         run scripts/install-deps",
        manifest.join(VALKEY_DIR).display()
    );
}
