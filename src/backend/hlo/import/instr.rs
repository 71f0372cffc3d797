//! One entry instruction -> one graph value.
//!
//! Elementwise instructions map back through the op tables (the reverse lookups in
//! `opcodes`), each to the [`Tensor`] method of its family; nothing here lists which opcode is
//! which op. The remaining opcodes are one match arm each, and the structural lowerings are
//! recognised by their shape (see the module docs of [`super`]).

use super::{bad, dims, elem, Importer};
use crate::backend::hlo::emit::MASS_THRESHOLD;
use crate::backend::hlo::proto::HloInstructionProto;
use crate::backend::hlo::{
    literal, opcodes, COMPOSITE_ATTR, COMPOSITE_GROUP_ATTR, COMPOSITE_OPERANDS_ATTR,
};
use crate::error::Result;
use crate::graph::{BinaryOp, FourBit, Tensor, UnaryOp};

impl<'m> Importer<'m> {
    /// The s32 value of a scalar constant, looking through the broadcasts and reshapes that
    /// expanded it.
    fn scalar_constant(&self, id: i64) -> Result<i64> {
        let mut i = self.inst(id)?;
        while i.opcode == opcodes::BROADCAST || i.opcode == opcodes::RESHAPE {
            i = self.inst(
                *i.operand_ids
                    .first()
                    .ok_or_else(|| bad("broadcast without operand"))?,
            )?;
        }
        let lit = i
            .literal
            .as_ref()
            .filter(|_| i.opcode == opcodes::CONSTANT)
            .ok_or_else(|| bad(format!("{}: expected a constant", i.name)))?;
        lit.s32s
            .first()
            .map(|&v| v as i64)
            .ok_or_else(|| bad(format!("{}: expected an s32 constant", i.name)))
    }

    /// The group size of collective `i`: one group holding replicas `0..n` in order, the only
    /// form the emitter writes (a tensor-parallel graph's every rank).
    fn replicas(&self, i: &HloInstructionProto) -> Result<usize> {
        match &i.replica_groups[..] {
            [g] if g
                .replica_ids
                .iter()
                .copied()
                .eq(0..g.replica_ids.len() as i64)
                && !g.replica_ids.is_empty() =>
            {
                Ok(g.replica_ids.len())
            }
            groups => Err(bad(format!(
                "{}: replica groups {:?}: only one group of every replica in order is supported",
                i.name,
                groups.iter().map(|g| &g.replica_ids).collect::<Vec<_>>()
            ))),
        }
    }

    /// Whether `multiply` instruction `i` is silu's `multiply(x, logistic(x))`, the one
    /// composite of the unary table.
    fn is_silu(&self, i: &HloInstructionProto) -> Result<bool> {
        let second = self.inst(*i.operand_ids.get(1).ok_or_else(|| bad("multiply arity"))?)?;
        Ok(opcodes::unary(&second.opcode) == Some(UnaryOp::Sigmoid)
            && second.operand_ids.first() == i.operand_ids.first())
    }

    /// The last instruction of a composite's lowering read back as the op it names, from the
    /// operands its attribute lists (the run's other instructions are skipped; see
    /// `emit::threshold`).
    fn composite(&self, i: &HloInstructionProto, name: &str) -> Result<Tensor> {
        let attrs = i.frontend_attributes.as_ref().map(|f| &f.map);
        let ids: Vec<i64> = attrs
            .and_then(|a| a.get(COMPOSITE_OPERANDS_ATTR))
            .map(|s| {
                s.split(',')
                    .map(str::parse)
                    .collect::<std::result::Result<_, _>>()
            })
            .transpose()
            .map_err(|e| bad(format!("{}: composite operands: {e}", i.name)))?
            .unwrap_or_default();
        let arity = |n: usize| {
            bad(format!(
                "{}: {name} needs {n} operands in {COMPOSITE_OPERANDS_ATTR}, got {ids:?}",
                i.name
            ))
        };
        let four_bit = [FourBit::Int4, FourBit::E2m1]
            .into_iter()
            .find(|f| f.op_name() == name);
        match (name, four_bit) {
            (MASS_THRESHOLD, _) => {
                let [x, w, target] = ids[..] else {
                    return Err(arity(3));
                };
                self.val(x)?
                    .mass_threshold(&self.val(w)?, &self.val(target)?)
            }
            (_, Some(format)) => {
                let [codes, scales] = ids[..] else {
                    return Err(arity(2));
                };
                let group = attrs
                    .and_then(|a| a.get(COMPOSITE_GROUP_ATTR))
                    .and_then(|g| g.parse::<usize>().ok())
                    .ok_or_else(|| {
                        bad(format!(
                            "{}: {name} without a {COMPOSITE_GROUP_ATTR}",
                            i.name
                        ))
                    })?;
                let shape = i
                    .shape
                    .as_ref()
                    .ok_or_else(|| bad(format!("{}: no shape", i.name)))?;
                self.val(codes)?
                    .dequantize_4bit_to(&self.val(scales)?, group, format, elem(shape)?)
            }
            _ => Err(bad(format!("{}: unknown composite `{name}`", i.name))),
        }
    }

    /// The graph value of entry instruction `i`, whose operands are converted already.
    pub(super) fn convert(&mut self, i: &'m HloInstructionProto) -> Result<Tensor> {
        let attrs = i.frontend_attributes.as_ref().map(|f| &f.map);
        if let Some(name) = attrs.and_then(|a| a.get(COMPOSITE_ATTR)) {
            return self.composite(i, name);
        }
        let shape = Self::shape(i)?;
        let out_dims = if i.opcode == opcodes::TUPLE || i.opcode == opcodes::SORT {
            vec![]
        } else {
            dims(shape)?
        };
        let x = || self.operand(i, 0);
        // The op tables first: one instruction is one op, read back by its opcode. Silu's
        // `multiply` goes before them, as the table would read it as a plain `Mul`.
        if i.opcode == BinaryOp::Mul.hlo_opcode() && self.is_silu(i)? {
            return x()?.silu();
        }
        if let Some(op) = opcodes::unary(&i.opcode) {
            return x()?.unary(op);
        }
        if let Some(op) = opcodes::binary(&i.opcode) {
            return x()?.binary(op, &self.operand(i, 1)?);
        }
        Ok(match i.opcode.as_str() {
            opcodes::CONSTANT => {
                let lit = i
                    .literal
                    .as_ref()
                    .ok_or_else(|| bad(format!("{}: no literal", i.name)))?;
                let l = literal::from_proto(lit, elem(shape)?, &i.name)?;
                self.b.constant(l, out_dims)?
            }
            opcodes::IOTA => self.b.iota(
                out_dims,
                elem(shape)?,
                *i.dimensions.first().unwrap_or(&0) as usize,
            )?,
            opcodes::COMPARE => {
                let (a, c) = (self.operand(i, 0)?, self.operand(i, 1)?);
                let op = opcodes::comparison(&i.comparison_direction).ok_or_else(|| {
                    bad(format!(
                        "{}: comparison direction {:?}",
                        i.name, i.comparison_direction
                    ))
                })?;
                a.compare(op, &c)?
            }
            opcodes::SELECT => self
                .operand(i, 0)?
                .where_cond(&self.operand(i, 1)?, &self.operand(i, 2)?)?,
            opcodes::CONVERT => x()?.to_dtype(elem(shape)?)?,
            opcodes::RESHAPE => x()?.reshape(out_dims)?,
            opcodes::TRANSPOSE => {
                x()?.permute(&i.dimensions.iter().map(|&d| d as usize).collect::<Vec<_>>())?
            }
            opcodes::BROADCAST => {
                let x = x()?;
                let map: Vec<usize> = i.dimensions.iter().map(|&d| d as usize).collect();
                if map.windows(2).any(|w| w[0] >= w[1]) || map.len() != x.rank() {
                    return Err(bad(format!(
                        "{}: broadcast dimensions {map:?} are not increasing",
                        i.name
                    )));
                }
                // Put each operand dim where it maps, with 1s elsewhere, then expand.
                let mut padded = vec![1; out_dims.len()];
                for (k, &d) in map.iter().enumerate() {
                    padded[d] = x.dim(k);
                }
                x.reshape(padded)?.broadcast_as(out_dims)?
            }
            opcodes::SLICE => {
                let mut t = x()?;
                for (d, s) in i.slice_dimensions.iter().enumerate() {
                    if s.stride != 1 {
                        return Err(bad(format!("{}: strided slice", i.name)));
                    }
                    t = t.narrow(d, s.start as usize, (s.limit - s.start) as usize)?;
                }
                t
            }
            opcodes::CONCATENATE => {
                let ts = i
                    .operand_ids
                    .iter()
                    .map(|&o| self.val(o))
                    .collect::<Result<Vec<_>>>()?;
                let refs: Vec<&Tensor> = ts.iter().collect();
                self.b
                    .cat(&refs, *i.dimensions.first().unwrap_or(&0) as usize)?
            }
            opcodes::DOT => {
                let dn = i
                    .dot_dimension_numbers
                    .as_ref()
                    .ok_or_else(|| bad(format!("{}: no dot dimensions", i.name)))?;
                let a = self.operand(i, 0)?;
                let r = a.rank() as i64;
                let batch: Vec<i64> = (0..r - 2).collect();
                // The right operand contracts its second-to-last dim (`[k, n]`) or, as the
                // emitter writes a weight used as `[out, in]`, its last (`[n, k]`).
                let transposed = dn.rhs_contracting_dimensions == [r - 1];
                if dn.lhs_contracting_dimensions != [r - 1]
                    || !(transposed || dn.rhs_contracting_dimensions == [r - 2])
                    || dn.lhs_batch_dimensions != batch
                    || dn.rhs_batch_dimensions != batch
                {
                    return Err(bad(format!(
                        "{}: dot dimension numbers {dn:?} are not a batched matmul",
                        i.name
                    )));
                }
                let b = self.operand(i, 1)?;
                let b = if transposed { b.t()? } else { b };
                a.matmul_to(&b, elem(shape)?)?
            }
            opcodes::REDUCE => {
                let x = x()?;
                let d = *i
                    .dimensions
                    .first()
                    .ok_or_else(|| bad(format!("{}: no reduce dimension", i.name)))?
                    as usize;
                let combiner = self.called_root(i)?;
                let op = opcodes::reduction(combiner)
                    .ok_or_else(|| bad(format!("{}: reduce with {combiner}", i.name)))?;
                x.reduce(op, d)?
            }
            opcodes::ALL_REDUCE => {
                let combiner = self.called_root(i)?;
                let op = opcodes::reduction(combiner)
                    .ok_or_else(|| bad(format!("{}: all-reduce with {combiner}", i.name)))?;
                x()?.all_reduce(op, self.replicas(i)?)?
            }
            opcodes::ALL_GATHER => {
                let d = *i
                    .dimensions
                    .first()
                    .ok_or_else(|| bad(format!("{}: no all-gather dimension", i.name)))?
                    as usize;
                x()?.all_gather(d, self.replicas(i)?)?
            }
            opcodes::SORT => {
                // Only the (values, iota) descending sort of `topk`; resolved at its
                // get-tuple-element.
                self.operand(i, 0)?
            }
            opcodes::GET_TUPLE_ELEMENT => {
                let src = self.inst(*i.operand_ids.first().ok_or_else(|| bad("gte arity"))?)?;
                if src.opcode != opcodes::SORT
                    || i.tuple_index != 1
                    || self.called_root(src)? != opcodes::COMPARE
                {
                    return Err(bad(format!("{}: unsupported get-tuple-element", i.name)));
                }
                let keys = self.val(src.id)?;
                keys.topk(*keys.dims().last().unwrap_or(&1))?
            }
            opcodes::GATHER => {
                let gd = i
                    .gather_dimension_numbers
                    .as_ref()
                    .ok_or_else(|| bad(format!("{}: no gather dimensions", i.name)))?;
                let x = x()?;
                let idx_id = *i
                    .operand_ids
                    .get(1)
                    .ok_or_else(|| bad(format!("{}: gather without indices", i.name)))?;
                let idx_inst = self.inst(idx_id)?;
                if gd.collapsed_slice_dims.len() == 1 && gd.index_vector_dim == 1 {
                    let d = gd.collapsed_slice_dims[0] as usize;
                    let ids = self.operand(i, 1)?;
                    x.index_select(&ids.reshape([ids.dim(0)])?, d)?
                } else if idx_inst.opcode == opcodes::CONCATENATE {
                    let d = idx_inst
                        .operand_ids
                        .iter()
                        .position(|&o| {
                            self.inst(o)
                                .map(|c| c.opcode != opcodes::IOTA)
                                .unwrap_or(false)
                        })
                        .ok_or_else(|| {
                            bad(format!("{}: gather coordinates without ids", i.name))
                        })?;
                    let ids = self
                        .val(idx_inst.operand_ids[d])?
                        .reshape(out_dims.clone())?;
                    x.gather(&ids, d)?
                } else {
                    return Err(bad(format!("{}: unsupported gather form", i.name)));
                }
            }
            opcodes::SCATTER => {
                let idx = self.inst(*i.operand_ids.get(1).ok_or_else(|| bad("scatter arity"))?)?;
                if idx.opcode != opcodes::CONCATENATE || idx.operand_ids.len() != 2 {
                    return Err(bad(format!("{}: unsupported scatter indices", i.name)));
                }
                let rows = self.val(idx.operand_ids[0])?;
                let col = self.scalar_constant(idx.operand_ids[1])? as usize;
                let root = x()?;
                root.scatter_rows(&rows.reshape([rows.dim(0)])?, col, &self.operand(i, 2)?)?
            }
            op => return Err(bad(format!("{}: unsupported opcode `{op}`", i.name))),
        })
    }
}
