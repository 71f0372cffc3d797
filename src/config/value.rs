//! How one `config.json` value is read: the deserializers that [`super::raw`]'s fields name in
//! `deserialize_with`, each saying in its error what it expected and what it found.
//!
//! serde's own messages name a Rust type ("invalid type: floating point 2048.5, expected usize");
//! these name the JSON a user should write ("must be a non-negative integer, got 2048.5"), and
//! [`super::raw::read`] puts the key's path in front. Each one takes the value as a
//! [`serde_json::Value`] and converts it, which keeps every reader to a line; a `Visitor` per
//! type was the rejected alternative: longer, and its messages are serde's ("invalid type: ...,
//! expected ...").
//!
//! A `null` reads like an absent key (`None`), as the module docs promise, except through
//! [`size_or_null`], which keeps the two apart for the required sizes: a missing one and a
//! `null` one get different errors, and `q_lora_rank` and `n_routed_experts` may be `null`.

use serde::de::{Deserialize, Deserializer, Error as _};
use serde_json::{Map, Value};

/// What a size must be, in the words of its error.
pub(super) const SIZE: &str = "a non-negative integer";
/// What a token id must be, in the words of its error.
const TOKEN_ID: &str = "a token id (a non-negative 32-bit integer)";

/// The text of a wrong-type error, after the key: `must be a string, got 3`.
pub(super) fn must_be(expected: &str, got: &Value) -> String {
    format!("must be {expected}, got {got}")
}

/// How a top-level value that is not an object is named in the error.
pub(super) fn kind(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// A non-negative integer that fits `usize`; `None` when absent or `null`.
pub(super) fn size<'de, D: Deserializer<'de>>(d: D) -> Result<Option<usize>, D::Error> {
    convert(d, SIZE, as_size)
}

/// A size that tells `null` from absent: `None` when absent, `Some(None)` when `null`.
pub(super) fn size_or_null<'de, D: Deserializer<'de>>(
    d: D,
) -> Result<Option<Option<usize>>, D::Error> {
    size(d).map(Some)
}

/// A finite number (JSON integers included); `None` when absent or `null`.
pub(super) fn number<'de, D: Deserializer<'de>>(d: D) -> Result<Option<f64>, D::Error> {
    convert(d, "a finite number", |v| {
        v.as_f64().filter(|x| x.is_finite())
    })
}

/// `true` or `false`; `None` when absent or `null`.
pub(super) fn flag<'de, D: Deserializer<'de>>(d: D) -> Result<Option<bool>, D::Error> {
    convert(d, "true or false", Value::as_bool)
}

/// A string; `None` when absent or `null`.
pub(super) fn string<'de, D: Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
    convert(d, "a string", |v| v.as_str().map(str::to_owned))
}

/// A JSON object, kept as JSON: RoPE's objects are read only once one of the two is chosen
/// (see [`super::rope`]). `None` when absent or `null`.
pub(super) fn object<'de, D: Deserializer<'de>>(
    d: D,
) -> Result<Option<Map<String, Value>>, D::Error> {
    convert(d, "an object", |v| v.as_object().cloned())
}

/// A token id; `None` when absent or `null`.
pub(super) fn token_id<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u32>, D::Error> {
    convert(d, TOKEN_ID, as_token_id)
}

/// A token id or a list of them (`eos_token_id` is either in the wild); `None` when absent or
/// `null`.
pub(super) fn token_ids<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Vec<u32>>, D::Error> {
    match Value::deserialize(d)? {
        Value::Null => Ok(None),
        Value::Array(items) => items
            .iter()
            .map(|item| {
                as_token_id(item).ok_or_else(|| {
                    D::Error::custom(must_be("a token id or a list of token ids", item))
                })
            })
            .collect::<Result<Vec<u32>, D::Error>>()
            .map(Some),
        one => as_token_id(&one)
            .map(|id| Some(vec![id]))
            .ok_or_else(|| D::Error::custom(must_be(TOKEN_ID, &one))),
    }
}

/// Reads the value, maps `null` to `None`, and converts the rest with `read`, failing with
/// [`must_be`]`(expected, value)` when `read` returns `None`.
fn convert<'de, D, T>(
    d: D,
    expected: &str,
    read: impl FnOnce(&Value) -> Option<T>,
) -> Result<Option<T>, D::Error>
where
    D: Deserializer<'de>,
{
    let value = Value::deserialize(d)?;
    if value.is_null() {
        return Ok(None);
    }
    read(&value)
        .map(Some)
        .ok_or_else(|| D::Error::custom(must_be(expected, &value)))
}

fn as_size(value: &Value) -> Option<usize> {
    value.as_u64().and_then(|n| usize::try_from(n).ok())
}

fn as_token_id(value: &Value) -> Option<u32> {
    value.as_u64().and_then(|n| u32::try_from(n).ok())
}
