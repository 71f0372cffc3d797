//! RoPE and YaRN: which object holds the parameters, and their defaults.
//!
//! transformers takes `rope_scaling or rope_parameters` (an empty `rope_scaling` counts as
//! absent), so the two objects stay JSON until one is chosen and only that one is read, as a
//! [`RawRope`]. Errors name its keys by their path (`rope_scaling.factor`).

use serde_json::{Map, Value};

use super::messages::{invalid, unsupported};
use super::raw::{self, RawConfig, RawRope};
use super::{RopeConfig, YarnConfig};
use crate::error::Result;

/// The RoPE object that was chosen, with the key it came from.
struct RopeObject {
    /// `rope_scaling` or `rope_parameters`.
    name: &'static str,
    keys: RawRope,
}

impl RopeObject {
    fn read(name: &'static str, object: &Map<String, Value>) -> Result<Self> {
        Ok(RopeObject {
            name,
            keys: raw::read(object, &format!("{name}."))?,
        })
    }

    /// `key` as errors name it: `rope_scaling.factor`.
    fn path(&self, key: &str) -> String {
        format!("{}.{key}", self.name)
    }
}

/// Resolves RoPE for a model whose context is `max_position_embeddings` long.
pub(super) fn rope(raw: &RawConfig, max_position_embeddings: usize) -> Result<RopeConfig> {
    // HF: `rope_parameters = rope_scaling or rope_parameters`.
    let chosen = match &raw.rope_scaling {
        Some(object) if !object.is_empty() => Some(("rope_scaling", object)),
        _ => raw
            .rope_parameters
            .as_ref()
            .map(|object| ("rope_parameters", object)),
    };
    let params = chosen
        .map(|(name, object)| RopeObject::read(name, object))
        .transpose()?;

    // RotaryEmbeddingConfigMixin: the object's rope_theta, else the top level's, else 10000.
    let (theta_key, theta) = match params
        .as_ref()
        .and_then(|p| p.keys.rope_theta.map(|t| (p.path("rope_theta"), t)))
    {
        Some(inner) => inner,
        None => ("rope_theta".to_string(), raw.rope_theta.unwrap_or(10_000.0)),
    };
    if theta <= 0.0 {
        return Err(invalid(&theta_key, theta, "must be positive"));
    }

    let partial_rotary_factors = params
        .iter()
        .map(|p| {
            (
                p.path("partial_rotary_factor"),
                p.keys.partial_rotary_factor,
            )
        })
        .chain(std::iter::once((
            "partial_rotary_factor".to_string(),
            raw.partial_rotary_factor,
        )));
    for (key, factor) in partial_rotary_factors {
        if let Some(f) = factor.filter(|&f| f != 1.0) {
            return Err(unsupported(
                &key,
                f,
                "deepinfer rotates the whole qk_rope_head_dim",
            ));
        }
    }

    let Some(params) = params else {
        return Ok(RopeConfig { theta, yarn: None });
    };
    // standardize_rope_params: `rope_type`, else `type`, else "default".
    let (type_key, rope_type) = match (&params.keys.rope_type, &params.keys.type_) {
        (Some(t), _) => ("rope_type", t.as_str()),
        (None, Some(t)) => ("type", t.as_str()),
        (None, None) => ("rope_type", "default"),
    };
    match rope_type {
        "default" => Ok(RopeConfig { theta, yarn: None }),
        "yarn" => Ok(RopeConfig {
            theta,
            yarn: Some(yarn(raw, &params, max_position_embeddings)?),
        }),
        other => Err(unsupported(
            &params.path(type_key),
            format!("{other:?}"),
            "deepinfer implements \"default\" and \"yarn\"",
        )),
    }
}

/// YaRN's parameters, with `_compute_yarn_parameters`' defaults.
fn yarn(raw: &RawConfig, p: &RopeObject, max_position_embeddings: usize) -> Result<YarnConfig> {
    if let Some(v) = &p.keys.attention_factor {
        return Err(unsupported(
            &p.path("attention_factor"),
            v,
            "deepinfer derives YaRN's attention scaling from mscale and mscale_all_dim",
        ));
    }
    // standardize_rope_params: a top-level original_max_position_embeddings wins over the
    // object's.
    yarn_keys(
        &p.keys,
        &|key| p.path(key),
        raw.original_max_position_embeddings,
        max_position_embeddings,
    )
}

/// YaRN's parameters from one RoPE object's `keys` (`path` names a key in errors), with
/// `_compute_yarn_parameters`' defaults: `original_max_position_embeddings` is `top_original`,
/// else the object's, else `max_position_embeddings`; `attention_factor` is the caller's.
pub(super) fn yarn_keys(
    keys: &RawRope,
    path: &dyn Fn(&str) -> String,
    top_original: Option<usize>,
    max_position_embeddings: usize,
) -> Result<YarnConfig> {
    if keys.truncate == Some(false) {
        return Err(unsupported(
            &path("truncate"),
            false,
            "deepinfer rounds YaRN's correction range like DeepSeek",
        ));
    }
    let original = top_original
        .or(keys.original_max_position_embeddings)
        .unwrap_or(max_position_embeddings);
    if original == 0 {
        return Err(invalid(
            &path("original_max_position_embeddings"),
            0,
            "must be at least 1",
        ));
    }
    // _compute_yarn_parameters: a missing factor is the context extension ratio.
    let factor = keys
        .factor
        .unwrap_or(max_position_embeddings as f64 / original as f64);
    if factor < 1.0 {
        return Err(invalid(&path("factor"), factor, "must be at least 1"));
    }
    // _compute_yarn_parameters: `get("beta_fast") or 32`, `get("beta_slow") or 1`.
    let beta_fast = keys.beta_fast.filter(|&b| b != 0.0).unwrap_or(32.0);
    let beta_slow = keys.beta_slow.filter(|&b| b != 0.0).unwrap_or(1.0);
    Ok(YarnConfig {
        factor,
        original_max_position_embeddings: original,
        beta_fast,
        beta_slow,
        mscale: keys.mscale,
        mscale_all_dim: keys.mscale_all_dim,
    })
}
