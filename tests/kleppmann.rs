//! Kleppmann's paused-holder case, end to end: the example resource must refuse
//! every late write.

mod support;

#[path = "../examples/fenced_resource.rs"]
mod fenced_resource;

use support::TestServer;

#[test]
fn a_paused_holder_cannot_write_after_its_lease_ended() {
    let lock_server = TestServer::start();
    let store_server = TestServer::start();
    let report = fenced_resource::run_cycles(&lock_server.url(), &store_server.url(), 50)
        .expect("cycles ran");
    assert_eq!(report.stale_accepted, 0, "{report:?}");
    assert_eq!(report.stale_refused, 50, "{report:?}");
    assert_eq!(report.current_accepted, 100, "{report:?}");
    // The paused holder's own guard knew it had lost the lease.
    assert_eq!(report.stale_holder_saw_loss, 50, "{report:?}");
}
