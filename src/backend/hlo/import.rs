//! `HloModuleProto` (as [`super::emit`] writes it) -> graph.
//!
//! `nrt-sim` uses this to run a "NEFF" that is our HLO on the CPU backend. Each HLO instruction
//! maps back to the graph op it came from; the few multi-instruction lowerings are recognized
//! by their structure (not by names or metadata): `multiply(x, logistic(x))` is `silu`,
//! `get-tuple-element(sort(x, iota), 1)` is a full descending top-k, a `gather` with one
//! collapsed dim is `index_select` and one with full coordinates is `gather`, and a `scatter`
//! whose indices are `concatenate(reshape(rows), broadcast(col))` is `scatter_rows`. So emit ->
//! import -> run gives bit-identical results to running the original graph.
//!
//! Anything else (a foreign module, a corrupt file) is an error naming the instruction, never a
//! panic.

use std::collections::HashMap;

use prost::Message;

use super::dtype_of;
use super::proto::{
    HloComputationProto, HloInstructionProto, HloModuleProto, PrimitiveType, ShapeProto,
};
use crate::error::{Error, Result};
use crate::graph::{DType, Graph, GraphBuilder, InputRole, Literal, Tensor};

fn bad(msg: impl Into<String>) -> Error {
    Error::InvalidInput(format!("HLO import: {}", msg.into()))
}

/// Parses serialized module bytes and imports them.
pub fn import_bytes(bytes: &[u8]) -> Result<Graph> {
    let module =
        HloModuleProto::decode(bytes).map_err(|e| bad(format!("not an HloModuleProto: {e}")))?;
    import(&module)
}

fn dims(s: &ShapeProto) -> Result<Vec<usize>> {
    s.dimensions
        .iter()
        .map(|&d| usize::try_from(d).map_err(|_| bad(format!("negative dimension {d}"))))
        .collect()
}

fn elem(s: &ShapeProto) -> Result<DType> {
    PrimitiveType::try_from(s.element_type)
        .ok()
        .and_then(dtype_of)
        .ok_or_else(|| bad(format!("unsupported element type {}", s.element_type)))
}

struct Importer<'m> {
    b: GraphBuilder,
    insts: HashMap<i64, &'m HloInstructionProto>,
    comps: HashMap<i64, &'m HloComputationProto>,
    values: HashMap<i64, Tensor>,
    /// Inputs by parameter number.
    params: Vec<Tensor>,
}

impl<'m> Importer<'m> {
    fn inst(&self, id: i64) -> Result<&'m HloInstructionProto> {
        self.insts
            .get(&id)
            .copied()
            .ok_or_else(|| bad(format!("unknown instruction id {id}")))
    }

    fn val(&self, id: i64) -> Result<Tensor> {
        self.values
            .get(&id)
            .cloned()
            .ok_or_else(|| bad(format!("instruction {id} used before it is defined")))
    }

    fn operand(&self, i: &HloInstructionProto, k: usize) -> Result<Tensor> {
        let id = *i
            .operand_ids
            .get(k)
            .ok_or_else(|| bad(format!("{}: missing operand {k}", i.name)))?;
        self.val(id)
    }

    fn shape(i: &HloInstructionProto) -> Result<&ShapeProto> {
        i.shape
            .as_ref()
            .ok_or_else(|| bad(format!("{}: no shape", i.name)))
    }

    /// The root opcode of a called scalar computation.
    fn called_root(&self, i: &HloInstructionProto) -> Result<&'m str> {
        let id = *i
            .called_computation_ids
            .first()
            .ok_or_else(|| bad(format!("{}: no called computation", i.name)))?;
        let c = self
            .comps
            .get(&id)
            .ok_or_else(|| bad(format!("{}: unknown computation {id}", i.name)))?;
        let root = c
            .instructions
            .iter()
            .find(|x| x.id == c.root_id)
            .ok_or_else(|| bad(format!("computation {} has no root", c.name)))?;
        Ok(root.opcode.as_str())
    }

    fn scalar_constant(&self, id: i64) -> Result<i64> {
        let mut i = self.inst(id)?;
        while i.opcode == "broadcast" || i.opcode == "reshape" {
            i = self.inst(
                *i.operand_ids
                    .first()
                    .ok_or_else(|| bad("broadcast without operand"))?,
            )?;
        }
        let lit = i
            .literal
            .as_ref()
            .filter(|_| i.opcode == "constant")
            .ok_or_else(|| bad(format!("{}: expected a constant", i.name)))?;
        lit.s32s
            .first()
            .map(|&v| v as i64)
            .ok_or_else(|| bad(format!("{}: expected an s32 constant", i.name)))
    }

    fn convert(&mut self, i: &'m HloInstructionProto) -> Result<Tensor> {
        let shape = Self::shape(i)?;
        let out_dims = if i.opcode == "tuple" || i.opcode == "sort" {
            vec![]
        } else {
            dims(shape)?
        };
        let x = || self.operand(i, 0);
        let binary = |f: fn(&Tensor, &Tensor) -> Result<Tensor>| -> Result<Tensor> {
            f(&self.operand(i, 0)?, &self.operand(i, 1)?)
        };
        Ok(match i.opcode.as_str() {
            "constant" => {
                let lit = i
                    .literal
                    .as_ref()
                    .ok_or_else(|| bad(format!("{}: no literal", i.name)))?;
                let l = match elem(shape)? {
                    DType::F32 => Literal::F32(lit.f32s.clone()),
                    DType::I32 => Literal::I32(lit.s32s.clone()),
                    DType::U32 => Literal::U32(lit.u32s.clone()),
                    other => return Err(bad(format!("{}: constant of type {other}", i.name))),
                };
                self.b.constant(l, out_dims)?
            }
            "iota" => self.b.iota(
                out_dims,
                elem(shape)?,
                *i.dimensions.first().unwrap_or(&0) as usize,
            )?,
            "negate" => x()?.neg()?,
            "abs" => x()?.abs()?,
            "exponential" => x()?.exp()?,
            "log" => x()?.log()?,
            "sqrt" => x()?.sqrt()?,
            "rsqrt" => x()?.rsqrt()?,
            "sine" => x()?.sin()?,
            "cosine" => x()?.cos()?,
            "tanh" => x()?.tanh()?,
            "logistic" => x()?.sigmoid()?,
            "multiply" => {
                let second =
                    self.inst(*i.operand_ids.get(1).ok_or_else(|| bad("multiply arity"))?)?;
                if second.opcode == "logistic"
                    && second.operand_ids.first() == i.operand_ids.first()
                {
                    x()?.silu()?
                } else {
                    binary(Tensor::mul)?
                }
            }
            "add" => binary(Tensor::add)?,
            "subtract" => binary(Tensor::sub)?,
            "divide" => binary(Tensor::div)?,
            "remainder" => binary(Tensor::rem)?,
            "maximum" => binary(Tensor::maximum)?,
            "minimum" => binary(Tensor::minimum)?,
            "xor" => binary(Tensor::bitxor)?,
            "and" => binary(Tensor::bitand)?,
            "shift-right-logical" => binary(Tensor::shr)?,
            "shift-left" => binary(Tensor::shl)?,
            "compare" => {
                let (a, c) = (self.operand(i, 0)?, self.operand(i, 1)?);
                match i.comparison_direction.as_str() {
                    "EQ" => a.eq(&c)?,
                    "NE" => a.ne(&c)?,
                    "LT" => a.lt(&c)?,
                    "LE" => a.le(&c)?,
                    "GT" => a.gt(&c)?,
                    "GE" => a.ge(&c)?,
                    d => return Err(bad(format!("{}: comparison direction {d:?}", i.name))),
                }
            }
            "select" => self
                .operand(i, 0)?
                .where_cond(&self.operand(i, 1)?, &self.operand(i, 2)?)?,
            "convert" => x()?.to_dtype(elem(shape)?)?,
            "reshape" => x()?.reshape(out_dims)?,
            "transpose" => {
                x()?.permute(&i.dimensions.iter().map(|&d| d as usize).collect::<Vec<_>>())?
            }
            "broadcast" => {
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
            "slice" => {
                let mut t = x()?;
                for (d, s) in i.slice_dimensions.iter().enumerate() {
                    if s.stride != 1 {
                        return Err(bad(format!("{}: strided slice", i.name)));
                    }
                    t = t.narrow(d, s.start as usize, (s.limit - s.start) as usize)?;
                }
                t
            }
            "concatenate" => {
                let ts = i
                    .operand_ids
                    .iter()
                    .map(|&o| self.val(o))
                    .collect::<Result<Vec<_>>>()?;
                let refs: Vec<&Tensor> = ts.iter().collect();
                self.b
                    .cat(&refs, *i.dimensions.first().unwrap_or(&0) as usize)?
            }
            "dot" => {
                let dn = i
                    .dot_dimension_numbers
                    .as_ref()
                    .ok_or_else(|| bad(format!("{}: no dot dimensions", i.name)))?;
                let a = self.operand(i, 0)?;
                let r = a.rank() as i64;
                let batch: Vec<i64> = (0..r - 2).collect();
                if dn.lhs_contracting_dimensions != [r - 1]
                    || dn.rhs_contracting_dimensions != [r - 2]
                    || dn.lhs_batch_dimensions != batch
                    || dn.rhs_batch_dimensions != batch
                {
                    return Err(bad(format!(
                        "{}: dot dimension numbers {dn:?} are not a batched matmul",
                        i.name
                    )));
                }
                a.matmul(&self.operand(i, 1)?)?
            }
            "reduce" => {
                let x = x()?;
                let d = *i
                    .dimensions
                    .first()
                    .ok_or_else(|| bad(format!("{}: no reduce dimension", i.name)))?
                    as usize;
                match self.called_root(i)? {
                    "add" => x.sum(d)?,
                    "maximum" => x.max(d)?,
                    "minimum" => x.min(d)?,
                    other => return Err(bad(format!("{}: reduce with {other}", i.name))),
                }
            }
            "sort" => {
                // Only the (values, iota) descending sort of `topk`; resolved at its
                // get-tuple-element.
                self.operand(i, 0)?
            }
            "get-tuple-element" => {
                let src = self.inst(*i.operand_ids.first().ok_or_else(|| bad("gte arity"))?)?;
                if src.opcode != "sort" || i.tuple_index != 1 || self.called_root(src)? != "compare"
                {
                    return Err(bad(format!("{}: unsupported get-tuple-element", i.name)));
                }
                let keys = self.val(src.id)?;
                keys.topk(*keys.dims().last().unwrap_or(&1))?
            }
            "gather" => {
                let gd = i
                    .gather_dimension_numbers
                    .as_ref()
                    .ok_or_else(|| bad(format!("{}: no gather dimensions", i.name)))?;
                let x = x()?;
                let idx_inst = self.inst(i.operand_ids[1])?;
                if gd.collapsed_slice_dims.len() == 1 && gd.index_vector_dim == 1 {
                    let d = gd.collapsed_slice_dims[0] as usize;
                    let ids = self.operand(i, 1)?;
                    x.index_select(&ids.reshape([ids.dim(0)])?, d)?
                } else if idx_inst.opcode == "concatenate" {
                    let d = idx_inst
                        .operand_ids
                        .iter()
                        .position(|&o| self.inst(o).map(|c| c.opcode != "iota").unwrap_or(false))
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
            "scatter" => {
                let idx = self.inst(*i.operand_ids.get(1).ok_or_else(|| bad("scatter arity"))?)?;
                if idx.opcode != "concatenate" || idx.operand_ids.len() != 2 {
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

/// Imports a module.
pub fn import(m: &HloModuleProto) -> Result<Graph> {
    let comps: HashMap<i64, &HloComputationProto> =
        m.computations.iter().map(|c| (c.id, c)).collect();
    let entry: &HloComputationProto = comps
        .get(&m.entry_computation_id)
        .copied()
        .ok_or_else(|| bad("no entry computation"))?;
    let aliased: HashMap<i64, usize> = m
        .input_output_alias
        .iter()
        .flat_map(|a| a.entries.iter())
        .filter_map(|e| {
            e.output_shape_index
                .first()
                .map(|&o| (e.parameter_number, o as usize))
        })
        .collect();
    let mut imp = Importer {
        b: GraphBuilder::new(if m.name.is_empty() {
            "imported"
        } else {
            &m.name
        }),
        insts: entry.instructions.iter().map(|i| (i.id, i)).collect(),
        comps,
        values: HashMap::new(),
        params: Vec::new(),
    };
    let mut params: Vec<&HloInstructionProto> = entry
        .instructions
        .iter()
        .filter(|i| i.opcode == "parameter")
        .collect();
    params.sort_by_key(|i| i.parameter_number);
    for (k, p) in params.iter().enumerate() {
        if p.parameter_number != k as i64 {
            return Err(bad(format!(
                "parameter numbers are not 0..{}",
                params.len()
            )));
        }
        let attrs = p.frontend_attributes.as_ref().map(|f| &f.map);
        let name = attrs
            .and_then(|a| a.get("neff_input_names"))
            .cloned()
            .unwrap_or_else(|| format!("input{k}"));
        let role = match attrs
            .and_then(|a| a.get("deepinfer_role"))
            .map(|s| s.as_str())
        {
            Some("weight") => InputRole::Weight,
            Some("cache_root") => InputRole::CacheRoot,
            _ if aliased.contains_key(&(k as i64)) => InputRole::CacheRoot,
            _ => InputRole::Metadata,
        };
        let shape = Importer::shape(p)?;
        let t = imp.b.input(name, role, dims(shape)?, elem(shape)?)?;
        imp.values.insert(p.id, t.clone());
        imp.params.push(t);
    }
    for i in &entry.instructions {
        if i.opcode == "parameter" {
            continue;
        }
        if i.id == entry.root_id && i.opcode == "tuple" {
            break;
        }
        let t = imp.convert(i)?;
        imp.values.insert(i.id, t);
    }
    let root = imp.inst(entry.root_id)?;
    let names: Vec<String> = root
        .frontend_attributes
        .as_ref()
        .and_then(|f| f.map.get("neff_output_names"))
        .map(|s| s.split(',').map(str::to_string).collect())
        .unwrap_or_else(|| {
            (0..root.operand_ids.len())
                .map(|k| format!("output{k}"))
                .collect()
        });
    let outs: Vec<i64> = if root.opcode == "tuple" {
        root.operand_ids.clone()
    } else {
        vec![root.id]
    };
    if names.len() != outs.len() {
        return Err(bad("neff_output_names does not match the root tuple"));
    }
    let by_output: HashMap<usize, i64> = aliased.iter().map(|(&p, &o)| (o, p)).collect();
    for (k, (id, name)) in outs.iter().zip(names).enumerate() {
        let v = imp.val(*id)?;
        match by_output.get(&k) {
            Some(&p) => {
                let param = imp
                    .params
                    .get(p as usize)
                    .ok_or_else(|| bad(format!("alias to unknown parameter {p}")))?;
                imp.b.output_aliased(name, &v, param)?
            }
            None => imp.b.output(name, &v)?,
        }
    }
    imp.b.finish()
}
