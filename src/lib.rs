//! Blocking Redis coordination primitives.
