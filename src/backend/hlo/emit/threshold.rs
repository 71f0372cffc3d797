//! [`Op::MassThreshold`](crate::graph::Op::MassThreshold) as HLO: a bisection, inlined and
//! tagged.
//!
//! The threshold is the largest value `t` whose weighted mass `sum(w[i] for x[i] >= t)`
//! reaches the target. The mass only falls as `t` rises, and the f32 values are ordered like
//! their *keys* (the bits with the sign bit flipped for positives, every bit flipped for
//! negatives), so the answer's key is built one bit at a time, from the top: set the bit if the
//! value of the key so far with that bit set still reaches the target. 32 steps of a compare
//! and a sum over the row find the exact value. Nothing is sorted (neuronx-cc turns a sort
//! wider than 16,384 into a top-k it refuses: aws-neuron/aws-neuron-sdk issue 1339), no integer
//! is multiplied or added, and every float operation is exact.
//!
//! A key's value is computed by exact arithmetic, not reinterpreted
//! ([`crate::graph::order_key`]), so the search needs no NaN case: a target no value reaches
//! leaves the key at 0, whose value is -inf, and a target `<= 0` takes it to the top, +inf. A
//! subnormal answer comes out as 0, which is also what an engine that flushes subnormals (XLA's
//! CPU) computes.
//!
//! The instructions are written into the entry computation, each tagged with the frontend
//! attribute `COMPOSITE_PART_ATTR` and the last with `COMPOSITE_ATTR` naming the op and
//! `COMPOSITE_OPERANDS_ATTR` its three operands: the importer (and so nrt-sim) reads the
//! tagged run back as the one op; XLA and neuronx-cc run the instructions (frontend attributes
//! are metadata to them).

use super::{array_shape, Emitter};
use crate::backend::hlo::proto::{GatherDimensionNumbers, PrimitiveType};
use crate::backend::hlo::{literal, opcodes, primitive_type};
use crate::graph::order_key::exponent_scales;
use crate::graph::{BinaryOp, CmpOp, DType, Literal, ReduceOp};

/// The [`COMPOSITE_ATTR`](crate::backend::hlo::COMPOSITE_ATTR) value of a mass threshold.
pub(crate) const MASS_THRESHOLD: &str = "mass_threshold";

impl Emitter<'_> {
    /// The bisection for `[rows, n]` values `x`, weights `w` and `[rows]` targets; returns the
    /// instruction holding the `[rows]` thresholds.
    pub(super) fn lower_mass_threshold(
        &mut self,
        x: i64,
        w: i64,
        target: i64,
        rows: usize,
        n: usize,
    ) -> i64 {
        let first = self.entry.len();
        let root = self.bisection(x, w, target, rows, n);
        self.tag_composite(first, MASS_THRESHOLD, &[x, w, target], &[]);
        root
    }

    fn bisection(&mut self, x: i64, w: i64, target: i64, rows: usize, n: usize) -> i64 {
        let (f32_, u32_) = (PrimitiveType::F32, PrimitiveType::U32);
        let row_f = array_shape(&[rows], f32_);
        let row_u = array_shape(&[rows], u32_);
        let row_p = array_shape(&[rows], PrimitiveType::Pred);
        let mat_f = array_shape(&[rows, n], f32_);
        let mat_p = array_shape(&[rows, n], PrimitiveType::Pred);
        let row_const = |e: &mut Self, dtype: DType, v: f64| {
            let s = e.scalar(dtype, v);
            let shape = array_shape(&[rows], primitive_type(dtype));
            e.push(opcodes::BROADCAST, shape, &[s], |_| {})
        };
        let zero = self.scalar(DType::F32, 0.0);
        let zeros = self.push(opcodes::BROADCAST, mat_f.clone(), &[zero], |_| {});
        let table_shape = array_shape(&[256], f32_);
        let table = self.constant(
            literal::to_proto(&Literal::F32(exponent_scales()), table_shape.clone()),
            table_shape,
        );
        let c23 = row_const(self, DType::U32, 23.0);
        let c31 = row_const(self, DType::U32, 31.0);
        let c1 = row_const(self, DType::U32, 1.0);
        let byte = row_const(self, DType::U32, 255.0);
        let mantissa_mask = row_const(self, DType::U32, f64::from((1u32 << 23) - 1));
        let sign_mask = row_const(self, DType::U32, f64::from(0x7fff_ffffu32));
        let all_ones = row_const(self, DType::U32, f64::from(u32::MAX));
        let one = row_const(self, DType::F32, 1.0);
        let ulp = row_const(self, DType::F32, 1.0 / f64::from(1u32 << 23));
        let (xor, and, shr) = (
            BinaryOp::BitXor.hlo_opcode(),
            BinaryOp::BitAnd.hlo_opcode(),
            BinaryOp::Shr.hlo_opcode(),
        );
        // The value of a key, by arithmetic that is exact (see the module docs).
        let value_of = |e: &mut Self, key: i64| {
            let top = e.push(shr, row_u.clone(), &[key, c31], |_| {});
            let positive = e.compare(CmpOp::Eq, top, c1, row_p.clone(), u32_);
            let magnitude_bits = e.push(and, row_u.clone(), &[key, sign_mask], |_| {});
            let flipped = e.push(xor, row_u.clone(), &[key, all_ones], |_| {});
            let bits = e.push(
                opcodes::SELECT,
                row_u.clone(),
                &[positive, magnitude_bits, flipped],
                |_| {},
            );
            let shifted = e.push(shr, row_u.clone(), &[bits, c23], |_| {});
            let exponent = e.push(and, row_u.clone(), &[shifted, byte], |_| {});
            let index = e.push(
                opcodes::CONVERT,
                array_shape(&[rows], PrimitiveType::S32),
                &[exponent],
                |_| {},
            );
            let index = e.push(
                opcodes::RESHAPE,
                array_shape(&[rows, 1], PrimitiveType::S32),
                &[index],
                |_| {},
            );
            let scale = e.push(opcodes::GATHER, row_f.clone(), &[table, index], |i| {
                i.gather_dimension_numbers = Some(GatherDimensionNumbers {
                    collapsed_slice_dims: vec![0],
                    start_index_map: vec![0],
                    index_vector_dim: 1,
                    ..Default::default()
                });
                i.gather_slice_sizes = vec![1];
            });
            let mantissa = e.push(and, row_u.clone(), &[bits, mantissa_mask], |_| {});
            let mantissa = e.push(opcodes::CONVERT, row_f.clone(), &[mantissa], |_| {});
            let fraction = e.push(
                BinaryOp::Mul.hlo_opcode(),
                row_f.clone(),
                &[mantissa, ulp],
                |_| {},
            );
            let significand = e.push(
                BinaryOp::Add.hlo_opcode(),
                row_f.clone(),
                &[fraction, one],
                |_| {},
            );
            let magnitude = e.push(
                BinaryOp::Mul.hlo_opcode(),
                row_f.clone(),
                &[significand, scale],
                |_| {},
            );
            let negate = crate::graph::UnaryOp::Neg.hlo_opcode().unwrap_or("negate");
            let negative = e.push(negate, row_f.clone(), &[magnitude], |_| {});
            e.push(
                opcodes::SELECT,
                row_f.clone(),
                &[positive, magnitude, negative],
                |_| {},
            )
        };
        let mut key = row_const(self, DType::U32, 0.0);
        for bit in (0..32).rev() {
            let b = row_const(self, DType::U32, f64::from(1u32 << bit));
            let cand = self.push(xor, row_u.clone(), &[key, b], |_| {});
            let t = value_of(self, cand);
            let t_wide = self.push(opcodes::BROADCAST, mat_f.clone(), &[t], |i| {
                i.dimensions = vec![0]
            });
            let at_or_above = self.compare(CmpOp::Ge, x, t_wide, mat_p.clone(), f32_);
            let kept = self.push(
                opcodes::SELECT,
                mat_f.clone(),
                &[at_or_above, w, zeros],
                |_| {},
            );
            let mass = self.reduce(kept, &[rows, n], 1, ReduceOp::Sum, DType::F32);
            let reaches = self.compare(CmpOp::Ge, mass, target, row_p.clone(), f32_);
            key = self.push(
                opcodes::SELECT,
                row_u.clone(),
                &[reaches, cand, key],
                |_| {},
            );
        }
        value_of(self, key)
    }
}
