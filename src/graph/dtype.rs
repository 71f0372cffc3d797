//! Element types a graph value can have.

use std::fmt;

/// The element type of a graph value.
///
/// Integers are 32-bit on purpose: neuronx-cc handles i32 better than i64, and every index in the
/// forward (token ids, positions, slots, expert ids) fits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    /// IEEE single precision: the CPU backend computes in it.
    F32,
    /// bfloat16, the storage type of most checkpoints.
    BF16,
    /// IEEE half precision.
    F16,
    /// 8-bit float, 4 exponent and 3 mantissa bits, finite only (`float8_e4m3fn`, max 448): the
    /// weight type of the published DeepSeek-V3/R1 checkpoints.
    F8E4M3,
    /// Signed 32-bit integer: ids, positions, slots, lengths.
    I32,
    /// Unsigned 32-bit integer with wrapping arithmetic: the sampler's counter-based generator.
    U32,
    /// Signed byte: weight-only quantized experts (a per-row f32 scale beside them).
    I8,
    /// Unsigned byte.
    U8,
    /// Boolean, the result of a comparison (HLO `pred`; stored as one byte on the CPU).
    Bool,
}

impl DType {
    /// Size of one element in bytes.
    pub fn size_in_bytes(self) -> usize {
        match self {
            DType::F32 | DType::I32 | DType::U32 => 4,
            DType::BF16 | DType::F16 => 2,
            DType::F8E4M3 | DType::I8 | DType::U8 | DType::Bool => 1,
        }
    }

    /// Whether the type is a floating-point type.
    pub fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::BF16 | DType::F16 | DType::F8E4M3)
    }

    /// Whether the type is a (wrapping) integer type.
    pub fn is_int(self) -> bool {
        matches!(self, DType::I32 | DType::U32 | DType::I8 | DType::U8)
    }

    /// Whether the type is a float narrower than f32: matmuls on it accumulate in f32, and
    /// norms, softmax and sampling widen it first.
    pub fn is_reduced_float(self) -> bool {
        matches!(self, DType::BF16 | DType::F16 | DType::F8E4M3)
    }

    /// The short lower-case name used in dumps and manifests (`f32`, `i32`, ...).
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::BF16 => "bf16",
            DType::F16 => "f16",
            DType::F8E4M3 => "f8e4m3fn",
            DType::I32 => "i32",
            DType::U32 => "u32",
            DType::I8 => "i8",
            DType::U8 => "u8",
            DType::Bool => "bool",
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}
