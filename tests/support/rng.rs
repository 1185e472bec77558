//! The one random generator of the tests, and small helpers every test file
//! would otherwise write again: [`ms`] and [`percentile`].

use std::time::Duration;

/// The environment variable that replays a seeded test: its value is the
/// seed [`Rng::seeded`] printed.
pub(crate) const SEED_VARIABLE: &str = "RESPIRE_TEST_SEED";

/// A splitmix64 generator: random delays, choices and schedules, reproducible
/// from its seed.
#[derive(Clone, Debug)]
pub(crate) struct Rng {
    state: u64,
}

impl Rng {
    /// A generator with a fixed seed.
    pub(crate) fn new(seed: u64) -> Rng {
        Rng { state: seed }
    }

    /// A generator for the test `name`, seeded from [`SEED_VARIABLE`] when it
    /// is set, else from the operating system. The seed is printed (cargo
    /// shows it when the test fails) with the command that replays it.
    pub(crate) fn seeded(name: &str) -> (Rng, u64) {
        let seed = match std::env::var(SEED_VARIABLE) {
            Ok(value) => value
                .trim()
                .parse()
                .unwrap_or_else(|_| panic!("{SEED_VARIABLE}={value:?} is not a number")),
            // The standard library's hasher keys come from the operating
            // system's generator: no dependency for the crates that include
            // this support (the campaign, the benches).
            Err(_) => std::hash::BuildHasher::hash_one(
                &std::collections::hash_map::RandomState::new(),
                std::process::id(),
            ),
        };
        eprintln!("{name}: seed {seed} (replay with {SEED_VARIABLE}={seed})");
        (Rng::new(seed), seed)
    }

    /// The next 64 random bits.
    pub(crate) fn next(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// A number in `0..n` (`n` > 0).
    pub(crate) fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    /// An index into a slice of `len` (> 0) items.
    pub(crate) fn index(&mut self, len: usize) -> usize {
        (self.next() % len as u64) as usize
    }

    /// True `percent` times in a hundred.
    pub(crate) fn chance(&mut self, percent: u64) -> bool {
        self.next() % 100 < percent
    }

    /// One of `items` (not empty).
    pub(crate) fn pick<T: Copy>(&mut self, items: &[T]) -> T {
        items[self.index(items.len())]
    }

    /// A generator of its own for another thread or process, drawn from this one.
    pub(crate) fn fork(&mut self) -> Rng {
        Rng::new(self.next())
    }
}

/// `n` milliseconds.
pub(crate) fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

/// The `p`th percentile (`0.0..=1.0`, nearest rank) of `sorted`, which must
/// be sorted and not empty.
pub(crate) fn percentile<T: Copy>(sorted: &[T], p: f64) -> T {
    assert!(!sorted.is_empty(), "the percentile of nothing");
    let rank = ((sorted.len() as f64 * p).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1]
}
