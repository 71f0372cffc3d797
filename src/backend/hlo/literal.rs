//! Graph literals to and from HLO's `LiteralProto`, one field per element type.
//!
//! f32, s32 and u32 values have repeated (packed) fields; the 8- and 16-bit types live in
//! `bytes` fields holding the values little-endian, back to back (XLA's `xla_data.proto`). A
//! value written to the wrong field reads back as an empty literal, which XLA rejects, so each
//! type's field is named exactly once, here.

use super::proto::{LiteralProto, ShapeProto};
use crate::error::{Error, Result};
use crate::graph::{DType, Literal};

/// The proto of `lit`, with `shape` (which must be the instruction's, layout included).
pub fn to_proto(lit: &Literal, shape: ShapeProto) -> LiteralProto {
    let mut l = LiteralProto {
        shape: Some(shape),
        ..Default::default()
    };
    match lit {
        Literal::F32(v) => l.f32s = v.clone(),
        Literal::I32(v) => l.s32s = v.clone(),
        Literal::U32(v) => l.u32s = v.clone(),
        Literal::BF16(v) => l.bf16s = v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        Literal::F16(v) => l.f16s = v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        Literal::F8E4M3(v) => l.f8e4m3fns = v.iter().map(|x| x.to_bits()).collect(),
        Literal::I8(v) => l.s8s = v.iter().map(|&x| x as u8).collect(),
    }
    l
}

/// The literal of `dtype` a proto holds; `what` names the instruction in errors.
pub fn from_proto(l: &LiteralProto, dtype: DType, what: &str) -> Result<Literal> {
    let pairs = |b: &[u8]| -> Vec<[u8; 2]> { b.chunks_exact(2).map(|c| [c[0], c[1]]).collect() };
    Ok(match dtype {
        DType::F32 => Literal::F32(l.f32s.clone()),
        DType::I32 => Literal::I32(l.s32s.clone()),
        DType::U32 => Literal::U32(l.u32s.clone()),
        DType::BF16 => Literal::BF16(
            pairs(&l.bf16s)
                .into_iter()
                .map(half::bf16::from_le_bytes)
                .collect(),
        ),
        DType::F16 => Literal::F16(
            pairs(&l.f16s)
                .into_iter()
                .map(half::f16::from_le_bytes)
                .collect(),
        ),
        DType::F8E4M3 => Literal::F8E4M3(
            l.f8e4m3fns
                .iter()
                .map(|&b| float8::F8E4M3::from_bits(b))
                .collect(),
        ),
        DType::I8 => Literal::I8(l.s8s.iter().map(|&b| b as i8).collect()),
        DType::U8 | DType::Bool => {
            return Err(Error::Internal(format!(
                "{what}: a constant of type {dtype} (deepinfer's graphs have none)"
            )))
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::hlo::emit::array_shape;
    use crate::backend::hlo::primitive_type;

    #[test]
    fn every_literal_type_round_trips_through_its_own_field() {
        let lits = [
            Literal::F32(vec![1.5, -2.0]),
            Literal::I32(vec![-3, 4]),
            Literal::U32(vec![5, u32::MAX]),
            Literal::BF16(vec![half::bf16::from_f32(1.5), half::bf16::from_f32(-1e30)]),
            Literal::F16(vec![
                half::f16::from_f32(0.25),
                half::f16::from_f32(-65504.0),
            ]),
            Literal::F8E4M3(vec![
                float8::F8E4M3::from_f32(448.0),
                float8::F8E4M3::from_f32(-0.015625),
            ]),
            Literal::I8(vec![-128, 127]),
        ];
        for lit in lits {
            let t = lit.dtype();
            let p = to_proto(&lit, array_shape(&[2], primitive_type(t)));
            // Exactly one field holds data: two values in a typed field, or their bytes.
            let fields = [
                p.f32s.len(),
                p.s32s.len(),
                p.u32s.len(),
                p.bf16s.len(),
                p.f16s.len(),
                p.f8e4m3fns.len(),
                p.s8s.len(),
            ];
            assert_eq!(fields.iter().filter(|&&n| n > 0).count(), 1, "{t}");
            assert_eq!(from_proto(&p, t, "c").unwrap(), lit, "{t}");
        }
    }
}
