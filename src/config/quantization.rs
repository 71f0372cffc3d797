//! `quantization_config`: the block size of an FP8 checkpoint's weight scales.
//!
//! DeepSeek-V3/R1 are published with `float8_e4m3fn` weights and one f32 scale per block
//! (`weight_scale_inv`), DeepSeek-V4 with one power-of-two scale per block (`scale`, F8_E8M0;
//! F32 in V4-Flash-Base); `weight_block_size` gives the block (`[128, 128]` in the published
//! files, but read, never assumed). Any other `quant_method` is refused here, before a weight
//! is read, rather than failing later on a dtype the loader cannot read.

use serde::Deserialize;
use serde_json::{Map, Value};

use super::messages::{invalid, unsupported};
use super::raw::read;
use super::value;
use crate::error::Result;

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct RawQuantization {
    #[serde(deserialize_with = "value::string")]
    quant_method: Option<String>,
    #[serde(deserialize_with = "value::string")]
    fmt: Option<String>,
    weight_block_size: Option<Vec<usize>>,
}

/// The `[rows, cols]` block of an FP8 checkpoint's scales, or `None` without
/// `quantization_config`.
pub(super) fn fp8_block(object: Option<&Map<String, Value>>) -> Result<Option<[usize; 2]>> {
    let Some(object) = object else {
        return Ok(None);
    };
    let q: RawQuantization = read(object, "quantization_config.")?;
    match q.quant_method.as_deref() {
        Some("fp8") => {}
        other => {
            return Err(unsupported(
                "quantization_config.quant_method",
                format!("{other:?}"),
                "deepinfer reads fp8 checkpoints with block scales, as DeepSeek publishes them",
            ))
        }
    }
    if let Some(fmt) = q.fmt.as_deref().filter(|f| *f != "e4m3") {
        return Err(unsupported(
            "quantization_config.fmt",
            format!("{fmt:?}"),
            "deepinfer reads e4m3 (float8_e4m3fn) weights",
        ));
    }
    match q.weight_block_size.as_deref() {
        Some(&[r, c]) if r > 0 && c > 0 => Ok(Some([r, c])),
        Some(other) => Err(invalid(
            "quantization_config.weight_block_size",
            format!("{other:?}"),
            "must be two positive sizes [rows, cols]",
        )),
        None => Err(invalid(
            "quantization_config.weight_block_size",
            "(missing)",
            "an fp8 checkpoint needs the block size of its weight scales",
        )),
    }
}
