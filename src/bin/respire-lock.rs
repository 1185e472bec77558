//! `respire-lock`: `flock(1)` for a fleet.
fn main() {}
