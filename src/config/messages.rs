//! The shapes of a config error, each naming the key and, where there is one, its value.
//!
//! Every rejection in the second phase is built here, so that all of them read alike after the
//! `config.json: ` that [`crate::Error::Config`] puts in front.

use std::fmt::Display;

use serde_json::Value;

use super::value;
use crate::error::Error;

/// `missing required key {key}`.
pub(super) fn missing(key: &str) -> Error {
    Error::Config(format!("missing required key {key}"))
}

/// `missing required key {key} ({why})`: a key that is required only in some configurations.
pub(super) fn missing_because(key: &str, why: &str) -> Error {
    Error::Config(format!("missing required key {key} ({why})"))
}

/// `{key} must be {expected}, got {got}`: the same words a wrong type gets in the first phase,
/// for a `null` that only the second phase knows is not allowed.
pub(super) fn wrong_type(key: &str, expected: &str, got: &Value) -> Error {
    Error::Config(format!("{key} {}", value::must_be(expected, got)))
}

/// `{key} {got}: {why}`: a value of the right type outside its range.
pub(super) fn invalid(key: &str, got: impl Display, why: &str) -> Error {
    Error::Config(format!("{key} {got}: {why}"))
}

/// `unsupported {key} {value} ({why})`: a setting deepinfer does not implement.
pub(super) fn unsupported(key: &str, value: impl Display, why: &str) -> Error {
    Error::Config(format!("unsupported {key} {value} ({why})"))
}
