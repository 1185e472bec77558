//! Copies of the running test binary as child processes: a test that needs a
//! second process (to kill it with SIGKILL, or to run participants apart)
//! re-runs itself alone with a role in an environment variable.

use std::io::{BufRead, BufReader};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::time::Instant;

/// A copy of this binary running `test` alone, with `child_env` set to `role`
/// and piped stdin and stdout. A child prints `@@tag rest` lines for
/// [`expect`](ChildProc::expect); closing its stdin tells it to stop.
pub(crate) struct ChildProc {
    child: Child,
    out: BufReader<ChildStdout>,
}

impl ChildProc {
    pub(crate) fn spawn(
        child_env: &str,
        test: &str,
        role: &str,
        env: &[(&str, String)],
    ) -> ChildProc {
        let mut cmd = Command::new(std::env::current_exe().unwrap());
        cmd.args([test, "--exact", "--nocapture", "--test-threads=1"])
            .env(child_env, role)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().unwrap();
        let out = BufReader::new(child.stdout.take().unwrap());
        ChildProc { child, out }
    }

    /// The next line the child prints that starts with `tag`.
    pub(crate) fn expect(&mut self, tag: &str) -> String {
        let mut line = String::new();
        loop {
            line.clear();
            let n = self.out.read_line(&mut line).unwrap();
            assert!(n > 0, "the child exited before printing {tag:?}");
            // The harness may print on the same line first.
            if let Some(at) = line.find(&format!("@@{tag}")) {
                return line[at + 2 + tag.len()..].trim().to_owned();
            }
        }
    }

    /// kill -9; returns when it was sent.
    pub(crate) fn kill9(&mut self) -> Instant {
        self.child.kill().unwrap();
        let at = Instant::now();
        self.child.wait().unwrap();
        at
    }

    /// Closes its stdin (the signal to stop) and waits for it to exit.
    pub(crate) fn finish(mut self) -> String {
        drop(self.child.stdin.take());
        let mut rest = String::new();
        for line in (&mut self.out).lines() {
            rest.push_str(&line.unwrap());
            rest.push('\n');
        }
        let status = self.child.wait().unwrap();
        assert!(status.success(), "child failed: {status:?}\n{rest}");
        rest
    }
}

impl Drop for ChildProc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub(crate) fn env(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| panic!("{name} is not set"))
}

/// In a child: blocks until the parent closes stdin (or kills this process).
pub(crate) fn block_on_stdin() {
    let mut sink = String::new();
    while std::io::stdin().read_line(&mut sink).unwrap_or(0) > 0 {}
}
