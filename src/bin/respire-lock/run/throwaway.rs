//! `--throwaway`: a private `redis-server` for one run.

use std::ffi::OsString;
use std::path::PathBuf;
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use rustix::process::{Pid, Signal};

use crate::supervise::{self, Guardian};

/// A `redis-server` on a free loopback port for one run, in a process group
/// of its own that the guardian kills (and whose directory it removes) if the
/// tool dies.
pub(super) struct ThrowawayServer {
    child: Child,
    port: u16,
    pub(super) dir: PathBuf,
}

impl ThrowawayServer {
    pub(super) fn start(guardian: &mut Guardian) -> Result<ThrowawayServer, String> {
        let program = supervise::resolve("redis-server".as_ref())
            .map_err(|e| format!("--throwaway needs redis-server: {e}"))?;
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map_err(|e| format!("cannot find a free port: {e}"))?
            .port();
        guardian
            .ensure_started()
            .map_err(|e| format!("cannot start the guardian: {e}"))?;
        let dir = std::env::temp_dir().join(format!("respire-lock-{}-{port}", std::process::id()));
        std::fs::create_dir_all(&dir).map_err(|e| format!("cannot create {dir:?}: {e}"))?;
        guardian.watch_dir(&dir);
        let args: Vec<OsString> = [
            "--port",
            &port.to_string(),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--daemonize",
            "no",
            "--dir",
        ]
        .iter()
        .map(OsString::from)
        .chain([dir.clone().into_os_string()])
        .collect();
        let child = supervise::command(program.as_os_str(), &args, None)
            .and_then(|mut cmd| {
                cmd.stdin(Stdio::null())
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .spawn()
            })
            .map_err(|e| format!("cannot start redis-server: {e}"))?;
        guardian.watch_group(child.id() as i32);
        let mut server = ThrowawayServer { child, port, dir };
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            if Instant::now() > deadline || matches!(server.child.try_wait(), Ok(Some(_))) {
                server.stop(guardian);
                return Err("the throwaway redis-server did not start within 10 s".into());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(server)
    }

    pub(super) fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    pub(super) fn stop(mut self, guardian: &mut Guardian) {
        let pgid = self.child.id() as i32;
        if let Some(pid) = Pid::from_raw(pgid) {
            let _ = rustix::process::kill_process_group(pid, Signal::KILL);
        }
        let _ = self.child.wait();
        supervise::wait_group_gone(pgid, Duration::from_secs(1));
        guardian.forget_group(pgid);
        let _ = std::fs::remove_dir_all(&self.dir);
        guardian.forget_dir(&self.dir);
    }
}
