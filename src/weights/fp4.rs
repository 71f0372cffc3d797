//! FP4 weights in DeepSeek's published form (DeepSeek-V4's routed experts, `expert_dtype:
//! fp4`), read as stored: no f32 copy of an expert is ever made on the host.
//!
//! A matrix of `[out, in]` values is two tensors. `X.weight` holds the E2M1 codes two a byte
//! (I8 `[out, in / 2]` in the published files, U8 accepted; the even value in the low nibble,
//! as DeepSeek's `convert.py`, transformers' `Fp8Dequantize` and llama.cpp unpack it).
//! `X.scale` holds one F8_E8M0 scale per 32 inputs of a row (`[out, in / 32]`), a bare
//! power of two. The bytes are kept as they are (u8) and the scales widened to f32 (exact), the
//! form [`crate::graph::Op::Dequantize4Bit`] reads.

use candle_core::{Device, Tensor};
use safetensors::Dtype;

use super::{Checkpoint, Encoding};
// Inputs a scale covers (OCP MX's block, DeepSeek-V4's experts).
use crate::config::v4::FP4_GROUP as GROUP;
use crate::error::{Error, Result};

impl Checkpoint {
    /// The codes (u8 `[out, in / 2]`) and scales (f32 `[out, in / 32]`) of FP4 matrix `name`
    /// (`X.weight`, its scales `X.scale`) of `[out, in]` values. Errors name the tensor: a
    /// missing one, another shape or dtype, a non-finite scale.
    pub fn fp4(&self, name: &str, [out, inputs]: [usize; 2]) -> Result<(Tensor, Tensor)> {
        if !inputs.is_multiple_of(GROUP) {
            return Err(Error::Weights(format!(
                "tensor `{name}`: an FP4 matrix of {inputs} inputs, not a multiple of the \
                 {GROUP} a scale covers"
            )));
        }
        let entry = self.checked_entry(name, &[out, inputs / 2])?;
        if !matches!(entry.encoding, Encoding::Plain(Dtype::I8 | Dtype::U8)) {
            return Err(Error::Weights(format!(
                "tensor `{name}` is {}, but config.json's expert_dtype fp4 stores routed experts \
                 as FP4 codes two a byte (I8); set expert_dtype to how they are stored",
                entry.encoding
            )));
        }
        let codes = self.read_bytes(name, entry)?;
        let scales_name = scale_name(name);
        let of = format!("FP4 `{name}` of [{out}, {inputs}] values");
        let scales = self.scales(&scales_name, &[out, inputs / GROUP], &of, &[Dtype::F8_E8M0])?;
        let dev = &Device::Cpu;
        Ok((
            Tensor::from_vec(codes, (out, inputs / 2), dev)?,
            Tensor::from_vec(scales, (out, inputs / GROUP), dev)?,
        ))
    }
}

/// The scales of `X.weight` in DeepSeek's own naming, which V4 is published in: `X.scale`
/// (an FP4 matrix's, or an FP8 weight's block scales).
pub fn scale_name(name: &str) -> String {
    let stem = name.strip_suffix(".weight").unwrap_or(name);
    format!("{stem}.scale")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Writes a one-matrix checkpoint: `w.weight` (`dtype`, `shape`, `codes`) and `w.scale`.
    fn checkpoint(
        dtype: Dtype,
        shape: Vec<usize>,
        codes: &[u8],
        scales: &[u8],
        scale_shape: Vec<usize>,
    ) -> tempfile::TempDir {
        use safetensors::tensor::TensorView;
        let dir = tempfile::tempdir().unwrap();
        let views = vec![
            ("w.weight", TensorView::new(dtype, shape, codes).unwrap()),
            (
                "w.scale",
                TensorView::new(Dtype::F8_E8M0, scale_shape, scales).unwrap(),
            ),
        ];
        safetensors::serialize_to_file(views, None, &dir.path().join("model.safetensors")).unwrap();
        dir
    }

    #[test]
    fn codes_are_kept_and_scales_widened() {
        let codes: Vec<u8> = (0..32).map(|i| (i * 37 % 256) as u8).collect();
        let dir = checkpoint(Dtype::I8, vec![2, 16], &codes, &[127, 130], vec![2, 1]);
        let ckpt = Checkpoint::open(dir.path()).unwrap();
        let (c, s) = ckpt.fp4("w.weight", [2, 32]).unwrap();
        assert_eq!(c.flatten_all().unwrap().to_vec1::<u8>().unwrap(), codes);
        assert_eq!(
            s.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            vec![1.0, 8.0]
        );
    }

    #[test]
    fn a_wrong_tensor_is_named() {
        let codes = vec![0u8; 32];
        let err = |dir: &tempfile::TempDir, shape: [usize; 2]| {
            let ckpt = Checkpoint::open(dir.path()).unwrap();
            ckpt.fp4("w.weight", shape).unwrap_err().to_string()
        };
        let bf16 = checkpoint(Dtype::BF16, vec![2, 16], &[0; 64], &[127, 127], vec![2, 1]);
        let e = err(&bf16, [2, 32]);
        assert!(
            e.contains("`w.weight` is BF16") && e.contains("expert_dtype"),
            "{e}"
        );

        let nan = checkpoint(Dtype::I8, vec![2, 16], &codes, &[127, 255], vec![2, 1]);
        let e = err(&nan, [2, 32]);
        assert!(e.contains("`w.scale` holds a non-finite scale"), "{e}");

        let shape = checkpoint(Dtype::I8, vec![2, 16], &codes, &[127, 127], vec![1, 2]);
        let e = err(&shape, [2, 32]);
        assert!(
            e.contains("`w.scale` has shape [1, 2]") && e.contains("[2, 1]"),
            "{e}"
        );

        let e = err(&nan, [1, 64]);
        assert!(
            e.contains("`w.weight` has shape [2, 16], expected [1, 32]"),
            "{e}"
        );
    }
}
