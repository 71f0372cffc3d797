//! [`Op::Dequantize4Bit`](crate::graph::Op::Dequantize4Bit) as HLO: a mask, a shift and an
//! interleave, the code's value, inlined and tagged.
//!
//! The codes are widened to u32 (`convert`), each byte's low nibble cut out with an `and` and
//! its high nibble with a logical shift right: bit operations, exact on any engine (NeuronCore-v2
//! computes integer *arithmetic* in fp32; neither op is arithmetic, and nothing is multiplied).
//! The two are interleaved back into value order (a trailing dim of 1 each, `concatenate`, a
//! `reshape`). A code's value comes next, in the output's float type and exact in any of them:
//! - int4: the code converted and unbiased by 8;
//! - FP4 E2M1: the magnitude bits `m` (`and` 7) converted, and the magnitude
//!   `max(m / 2, m - 2, 2m - 8)` (0, 0.5, 1, 1.5, 2, 3, 4, 6 for m = 0..7: the subnormal
//!   halves, then each binade's line), times `1 - 2s` for the sign bit `s` (shift right 3).
//!   No table lookup (a gather over every weight) and no select.
//!
//! Each value is multiplied by its group's scale (converted to that type first, a no-op for
//! f32), expanded from `[.., groups]` with a `broadcast` and cut to the row's length with a
//! `slice`. Every float operation is exact but the scale's conversion and the last product,
//! each rounded once as the CPU kernel rounds them. A bf16 output (the 4-bit experts of a graph
//! that multiplies in bf16) so never holds the weight in f32.
//!
//! Like the mass threshold (`threshold.rs`), the run is tagged so the importer (and so nrt-sim)
//! reads it back as the one op: every instruction with `COMPOSITE_PART_ATTR`, the last with
//! `COMPOSITE_ATTR` (the format's [`FourBit::op_name`]), its two operands in
//! `COMPOSITE_OPERANDS_ATTR` and the group size in `COMPOSITE_GROUP_ATTR`.

use super::{array_shape, Emitter};
use crate::backend::hlo::proto::hlo_instruction_proto::SliceDimensions;
use crate::backend::hlo::proto::PrimitiveType;
use crate::backend::hlo::{opcodes, primitive_type, COMPOSITE_GROUP_ATTR};
use crate::graph::{BinaryOp, DType, FourBit};

impl Emitter<'_> {
    /// The values (of float type `out`) of `codes` (u8 `[.., half]`, `dims`) of `format` with
    /// `scales` (f32 `[.., groups]`), `group` values a scale; returns the instruction holding
    /// them.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn lower_dequantize_4bit(
        &mut self,
        codes: i64,
        scales: i64,
        dims: &[usize],
        groups: usize,
        group: usize,
        format: FourBit,
        out: DType,
    ) -> i64 {
        let first = self.entry.len();
        let root = self.unpack_4bit(codes, scales, (dims, groups, group), format, out);
        let extra = [(COMPOSITE_GROUP_ATTR, group.to_string())];
        self.tag_composite(first, format.op_name(), &[codes, scales], &extra);
        root
    }

    /// The run [`Emitter::lower_dequantize_4bit`] tags; `layout` is the codes' dims, the
    /// scales' count a row and the values a scale.
    fn unpack_4bit(
        &mut self,
        codes: i64,
        scales: i64,
        (dims, groups, group): (&[usize], usize, usize),
        format: FourBit,
        out: DType,
    ) -> i64 {
        let (u32_, ft) = (PrimitiveType::U32, primitive_type(out));
        let r = dims.len();
        let half = dims[r - 1];
        let with_last = |last: &[usize]| {
            let mut d = dims[..r - 1].to_vec();
            d.extend_from_slice(last);
            d
        };
        let packed = array_shape(dims, u32_);
        let splat = |e: &mut Self, dtype: DType, v: f64, shape: &[usize]| {
            let s = e.scalar(dtype, v);
            let t = if dtype == DType::U32 { u32_ } else { ft };
            e.push(opcodes::BROADCAST, array_shape(shape, t), &[s], |_| {})
        };
        let wide = self.push(opcodes::CONVERT, packed.clone(), &[codes], |_| {});
        let mask = splat(self, DType::U32, 15.0, dims);
        let four = splat(self, DType::U32, 4.0, dims);
        let low = self.push(
            BinaryOp::BitAnd.hlo_opcode(),
            packed.clone(),
            &[wide, mask],
            |_| {},
        );
        let high = self.push(BinaryOp::Shr.hlo_opcode(), packed, &[wide, four], |_| {});
        let column = array_shape(&with_last(&[half, 1]), u32_);
        let low = self.push(opcodes::RESHAPE, column.clone(), &[low], |_| {});
        let high = self.push(opcodes::RESHAPE, column, &[high], |_| {});
        let pairs = self.push(
            opcodes::CONCATENATE,
            array_shape(&with_last(&[half, 2]), u32_),
            &[low, high],
            |i| i.dimensions = vec![r as i64],
        );
        let values = with_last(&[2 * half]);
        let interleaved = self.push(
            opcodes::RESHAPE,
            array_shape(&values, u32_),
            &[pairs],
            |_| {},
        );
        let coded = self.code_values(interleaved, &values, format, out);
        // Each scale repeated over its group: [.., groups] -> [.., groups, 1] ->
        // [.., groups, group] -> [.., groups * group], then cut to the row.
        let one_each = with_last(&[groups, 1]);
        let scales = if out == DType::F32 {
            scales
        } else {
            let narrow = array_shape(&with_last(&[groups]), ft);
            self.push(opcodes::CONVERT, narrow, &[scales], |_| {})
        };
        let column = self.push(
            opcodes::RESHAPE,
            array_shape(&one_each, ft),
            &[scales],
            |_| {},
        );
        let spread = with_last(&[groups, group]);
        let repeated = self.broadcast(column, &one_each, &spread, ft);
        let flat_len = groups * group;
        let mut per_value = self.push(
            opcodes::RESHAPE,
            array_shape(&with_last(&[flat_len]), ft),
            &[repeated],
            |_| {},
        );
        if flat_len != 2 * half {
            let full = with_last(&[flat_len]);
            per_value = self.push(
                opcodes::SLICE,
                array_shape(&values, ft),
                &[per_value],
                |i| {
                    i.slice_dimensions = full
                        .iter()
                        .enumerate()
                        .map(|(d, &n)| SliceDimensions {
                            start: 0,
                            limit: if d == r - 1 { 2 * half } else { n } as i64,
                            stride: 1,
                        })
                        .collect();
                },
            );
        }
        self.push(
            BinaryOp::Mul.hlo_opcode(),
            array_shape(&values, ft),
            &[coded, per_value],
            |_| {},
        )
    }

    /// The value under `format` (in float type `out`) of every code of `codes` (u32, `shape`):
    /// exact arithmetic on small integers and halves (module docs).
    fn code_values(&mut self, codes: i64, shape: &[usize], format: FourBit, out: DType) -> i64 {
        let (u32_, ft) = (PrimitiveType::U32, primitive_type(out));
        let floats = array_shape(shape, ft);
        let splat = |e: &mut Self, dtype: DType, v: f64| {
            let s = e.scalar(dtype, v);
            let t = if dtype == DType::U32 { u32_ } else { ft };
            e.push(opcodes::BROADCAST, array_shape(shape, t), &[s], |_| {})
        };
        let binary = |e: &mut Self, op: BinaryOp, a: i64, b: i64| {
            let t = if op.int_only() { u32_ } else { ft };
            e.push(op.hlo_opcode(), array_shape(shape, t), &[a, b], |_| {})
        };
        match format {
            FourBit::Int4 => {
                let float = self.push(opcodes::CONVERT, floats, &[codes], |_| {});
                let eight = splat(self, out, 8.0);
                binary(self, BinaryOp::Sub, float, eight)
            }
            FourBit::E2m1 => {
                let seven = splat(self, DType::U32, 7.0);
                let three = splat(self, DType::U32, 3.0);
                let bits = binary(self, BinaryOp::BitAnd, codes, seven);
                let sign = binary(self, BinaryOp::Shr, codes, three);
                let m = self.push(opcodes::CONVERT, floats.clone(), &[bits], |_| {});
                let s = self.push(opcodes::CONVERT, floats, &[sign], |_| {});
                // max(m / 2, m - 2, 2m - 8)
                let (half, two, eight) = (
                    splat(self, out, 0.5),
                    splat(self, out, 2.0),
                    splat(self, out, 8.0),
                );
                let halves = binary(self, BinaryOp::Mul, m, half);
                let binade = binary(self, BinaryOp::Sub, m, two);
                let doubled = binary(self, BinaryOp::Mul, m, two);
                let top = binary(self, BinaryOp::Sub, doubled, eight);
                let magnitude = binary(self, BinaryOp::Max, halves, binade);
                let magnitude = binary(self, BinaryOp::Max, magnitude, top);
                // times 1 - 2s
                let one = splat(self, out, 1.0);
                let twice = binary(self, BinaryOp::Mul, s, two);
                let signum = binary(self, BinaryOp::Sub, one, twice);
                binary(self, BinaryOp::Mul, magnitude, signum)
            }
        }
    }
}
