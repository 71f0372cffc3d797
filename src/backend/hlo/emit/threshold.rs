//! [`Op::MassThreshold`](crate::graph::Op::MassThreshold) as HLO: a `call` of a bisection.
//!
//! The threshold is the largest value `t` whose weighted mass `sum(w[i] for x[i] >= t)`
//! reaches the target. The mass only falls as `t` rises, and the f32 values are ordered like
//! their *keys* (the bits with the sign bit flipped for positives, every bit flipped for
//! negatives), so the answer's key is built one bit at a time, from the top: set the bit if the
//! value of the key so far with that bit set still reaches the target. 32 steps of a compare
//! and a sum over the row find the exact value, with bit operations on the `[rows]` keys and
//! float compares on the values only: nothing is sorted (neuronx-cc turns a sort wider than
//! 16,384 into a top-k it refuses: aws-neuron/aws-neuron-sdk issue 1339), no integer is
//! multiplied or added, and a float compare is exact on every engine.
//!
//! A key whose value is NaN (the keys below -inf's and above +inf's) never passes, and a key
//! that ends on one (no value reaches the target) stands for -inf. A subnormal answer is
//! returned as 0, the value engines that flush subnormals (XLA's CPU does) find. The bisection is its own
//! computation, called once per op and emitted once per shape, and the call carries the
//! [`COMPOSITE_ATTR`] attribute so the importer (and nrt-sim) reads it back as the one op
//! rather than 32 steps of it; XLA, and neuronx-cc after inlining, run the body.

use super::{array_shape, Emitter};
use crate::backend::hlo::proto::{
    FrontendAttributes, HloComputationProto, PrimitiveType, ProgramShapeProto,
};
use crate::backend::hlo::{opcodes, COMPOSITE_ATTR};
use crate::graph::{BinaryOp, CmpOp, DType, ReduceOp};

/// The [`COMPOSITE_ATTR`] value of a mass threshold's `call`.
pub(crate) const MASS_THRESHOLD: &str = "mass_threshold";

impl Emitter<'_> {
    /// A `call` of the bisection for `[rows, n]` values `x`, weights `w` and `[rows]` targets.
    pub(super) fn lower_mass_threshold(
        &mut self,
        x: i64,
        w: i64,
        target: i64,
        rows: usize,
        n: usize,
    ) -> i64 {
        let body = match self.threshold_fns.get(&(rows, n)) {
            Some(&id) => id,
            None => {
                let id = self.threshold_body(rows, n);
                self.threshold_fns.insert((rows, n), id);
                id
            }
        };
        let map = [(COMPOSITE_ATTR.to_string(), MASS_THRESHOLD.to_string())].into();
        self.push(
            opcodes::CALL,
            array_shape(&[rows], PrimitiveType::F32),
            &[x, w, target],
            |i| {
                i.called_computation_ids = vec![body];
                i.frontend_attributes = Some(FrontendAttributes { map });
            },
        )
    }

    /// The bisection's computation; returns its id.
    fn threshold_body(&mut self, rows: usize, n: usize) -> i64 {
        // The body's instructions go to their own list; the entry's wait.
        let entry = std::mem::take(&mut self.entry);
        let f32_ = PrimitiveType::F32;
        let (row_f, row_u, row_p) = (
            array_shape(&[rows], f32_),
            array_shape(&[rows], PrimitiveType::U32),
            array_shape(&[rows], PrimitiveType::Pred),
        );
        let (mat_f, mat_p) = (
            array_shape(&[rows, n], f32_),
            array_shape(&[rows, n], PrimitiveType::Pred),
        );
        let params = [mat_f.clone(), mat_f.clone(), row_f.clone()];
        let [x, w, target] = [0, 1, 2].map(|k| {
            self.push(opcodes::PARAMETER, params[k].clone(), &[], |i| {
                i.parameter_number = k as i64
            })
        });
        let zero = self.scalar(DType::F32, 0.0);
        let zeros = self.push(opcodes::BROADCAST, mat_f.clone(), &[zero], |_| {});
        let row_const = |e: &mut Self, dtype: DType, v: f64| {
            let s = e.scalar(dtype, v);
            let shape = array_shape(&[rows], crate::backend::hlo::primitive_type(dtype));
            e.push(opcodes::BROADCAST, shape, &[s], |_| {})
        };
        let c31 = row_const(self, DType::U32, 31.0);
        let c1 = row_const(self, DType::U32, 1.0);
        let positive_mask = row_const(self, DType::U32, f64::from(0x8000_0000u32));
        let negative_mask = row_const(self, DType::U32, f64::from(u32::MAX));
        let neg_inf = row_const(self, DType::F32, f64::NEG_INFINITY);
        let xor = BinaryOp::BitXor.hlo_opcode();
        // The value of a key: flip the sign bit back (positives) or every bit (negatives).
        let value_of = |e: &mut Self, key: i64| {
            let top = e.push(
                BinaryOp::Shr.hlo_opcode(),
                row_u.clone(),
                &[key, c31],
                |_| {},
            );
            let positive = e.compare(CmpOp::Eq, top, c1, row_p.clone(), PrimitiveType::U32);
            let mask = e.push(
                opcodes::SELECT,
                row_u.clone(),
                &[positive, positive_mask, negative_mask],
                |_| {},
            );
            let bits = e.push(xor, row_u.clone(), &[key, mask], |_| {});
            e.push(opcodes::BITCAST_CONVERT, row_f.clone(), &[bits], |_| {})
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
            let not_nan = self.compare(CmpOp::Eq, t, t, row_p.clone(), f32_);
            let ok = self.push(
                BinaryOp::BitAnd.hlo_opcode(),
                row_p.clone(),
                &[reaches, not_nan],
                |_| {},
            );
            key = self.push(opcodes::SELECT, row_u.clone(), &[ok, cand, key], |_| {});
        }
        let t = value_of(self, key);
        // A subnormal answer is 0: where subnormals compare as zero (XLA's CPU flushes them),
        // every subnormal key passes whenever 0 does, so the search ends on the largest one.
        let magnitude = self.push("abs", row_f.clone(), &[t], |_| {});
        let tiny = row_const(self, DType::F32, f64::from(f32::MIN_POSITIVE));
        let subnormal = self.compare(CmpOp::Lt, magnitude, tiny, row_p.clone(), f32_);
        let zeros_r = row_const(self, DType::F32, 0.0);
        let t = self.push(
            opcodes::SELECT,
            row_f.clone(),
            &[subnormal, zeros_r, t],
            |_| {},
        );
        let nan = self.compare(CmpOp::Ne, t, t, row_p.clone(), f32_);
        let root = self.push(opcodes::SELECT, row_f.clone(), &[nan, neg_inf, t], |_| {});
        let instructions = std::mem::replace(&mut self.entry, entry);
        let id = self.id();
        self.callees.push(HloComputationProto {
            name: format!("{MASS_THRESHOLD}_{rows}x{n}.{id}"),
            instructions,
            program_shape: Some(ProgramShapeProto {
                parameters: params.to_vec(),
                result: Some(row_f),
                parameter_names: ["values", "weights", "target"].map(String::from).to_vec(),
            }),
            id,
            root_id: root,
        });
        id
    }
}
