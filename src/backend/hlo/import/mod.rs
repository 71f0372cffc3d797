//! `HloModuleProto` (as [`super::emit`] writes it) -> graph.
//!
//! `nrt-sim` uses this to run the HLO its NEFF container carries on the CPU backend. Each HLO
//! instruction maps back to the graph op it came from; the few multi-instruction lowerings are
//! recognized by their structure (not by names or metadata): `multiply(x, logistic(x))` is `silu`,
//! `get-tuple-element(sort(x, iota), 1)` is a full descending top-k, a `gather` with one
//! collapsed dim is `index_select` and one with full coordinates is `gather`, and a `scatter`
//! whose indices are `concatenate(reshape(rows), broadcast(col))` is `scatter_rows`. So emit ->
//! import -> run gives bit-identical results to running the original graph.
//!
//! Anything else (a foreign module, a corrupt file) is an error naming the instruction, never a
//! panic.
//!
//! This file reads the module: its entry computation, the parameters (names and roles), the
//! root tuple (output names) and the input/output aliases. Each instruction's conversion to a
//! graph value is in `instr.rs`.

mod instr;

use std::collections::HashMap;

use prost::Message;

use super::proto::{
    HloComputationProto, HloInstructionProto, HloModuleProto, PrimitiveType, ShapeProto,
};
use super::{
    dtype_of, opcodes, COMPOSITE_PART_ATTR, INPUT_NAMES_ATTR, MUST_ALIAS_SUFFIX, OUTPUT_NAMES_ATTR,
    ROLE_ATTR,
};
use crate::error::{Error, Result};
use crate::graph::{DType, Graph, GraphBuilder, InputRole, Tensor};

/// The error for a module this importer cannot read. Every import error is built here, so
/// retargeting them is a one-line change.
fn bad(msg: impl Into<String>) -> Error {
    Error::InvalidInput(format!("HLO import: {}", msg.into()))
}

/// Parses serialized module bytes and imports them.
pub fn import_bytes(bytes: &[u8]) -> Result<Graph> {
    let module =
        HloModuleProto::decode(bytes).map_err(|e| bad(format!("not an HloModuleProto: {e}")))?;
    import(&module)
}

/// A module's NEFF input and output names exactly as its frontend attributes give them
/// (`neff_input_names` per parameter, `neff_output_names` on the root), with the defaults a
/// framework assumes where an attribute is absent (`input{k}`, `output{k}`), and which
/// parameters an output must alias. What a compiler reads to name a NEFF's tensors.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IoNames {
    /// One name per parameter, by parameter number.
    pub inputs: Vec<String>,
    /// One name per element of the root tuple (one for a non-tuple root).
    pub outputs: Vec<String>,
    /// Per parameter: whether an output must alias it.
    pub aliased: Vec<bool>,
}

/// A module's entry computation and its parameters by parameter number, which must be
/// `0..n`.
fn entry_parameters(
    m: &HloModuleProto,
) -> Result<(&HloComputationProto, Vec<&HloInstructionProto>)> {
    let entry = m
        .computations
        .iter()
        .find(|c| c.id == m.entry_computation_id)
        .ok_or_else(|| bad("no entry computation"))?;
    let mut params: Vec<&HloInstructionProto> = entry
        .instructions
        .iter()
        .filter(|i| i.opcode == opcodes::PARAMETER)
        .collect();
    params.sort_by_key(|i| i.parameter_number);
    if params
        .iter()
        .enumerate()
        .any(|(k, p)| p.parameter_number != k as i64)
    {
        return Err(bad(format!(
            "parameter numbers are not 0..{}",
            params.len()
        )));
    }
    Ok((entry, params))
}

/// Reads [`IoNames`] from a module (without importing its computation).
pub fn io_names(m: &HloModuleProto) -> Result<IoNames> {
    let (entry, params) = entry_parameters(m)?;
    let inputs = params
        .iter()
        .enumerate()
        .map(|(k, p)| {
            p.frontend_attributes
                .as_ref()
                .and_then(|f| f.map.get(INPUT_NAMES_ATTR))
                .cloned()
                .unwrap_or_else(|| format!("input{k}"))
        })
        .collect::<Vec<_>>();
    let root = entry
        .instructions
        .iter()
        .find(|i| i.id == entry.root_id)
        .ok_or_else(|| bad("the entry computation has no root"))?;
    let count = if root.opcode == opcodes::TUPLE {
        root.operand_ids.len()
    } else {
        1
    };
    let outputs: Vec<String> = match root
        .frontend_attributes
        .as_ref()
        .and_then(|f| f.map.get(OUTPUT_NAMES_ATTR))
    {
        Some(s) => s.split(',').map(str::to_string).collect(),
        None => (0..count).map(|k| format!("output{k}")).collect(),
    };
    if outputs.len() != count {
        return Err(bad(format!(
            "{OUTPUT_NAMES_ATTR} names {} outputs; the root has {count}",
            outputs.len()
        )));
    }
    let mut aliased = vec![false; inputs.len()];
    for e in m.input_output_alias.iter().flat_map(|a| a.entries.iter()) {
        let slot = usize::try_from(e.parameter_number)
            .ok()
            .and_then(|p| aliased.get_mut(p))
            .ok_or_else(|| bad(format!("alias to unknown parameter {}", e.parameter_number)))?;
        *slot = true;
    }
    Ok(IoNames {
        inputs,
        outputs,
        aliased,
    })
}

/// The dimension sizes of an array shape.
fn dims(s: &ShapeProto) -> Result<Vec<usize>> {
    s.dimensions
        .iter()
        .map(|&d| usize::try_from(d).map_err(|_| bad(format!("negative dimension {d}"))))
        .collect()
}

/// The graph dtype of an array shape.
fn elem(s: &ShapeProto) -> Result<DType> {
    PrimitiveType::try_from(s.element_type)
        .ok()
        .and_then(dtype_of)
        .ok_or_else(|| bad(format!("unsupported element type {}", s.element_type)))
}

/// The state of one import: the graph being built and the module's instructions by id.
struct Importer<'m> {
    b: GraphBuilder,
    insts: HashMap<i64, &'m HloInstructionProto>,
    comps: HashMap<i64, &'m HloComputationProto>,
    values: HashMap<i64, Tensor>,
    /// Inputs by parameter number.
    params: Vec<Tensor>,
}

impl<'m> Importer<'m> {
    /// Entry instruction `id`.
    fn inst(&self, id: i64) -> Result<&'m HloInstructionProto> {
        self.insts
            .get(&id)
            .copied()
            .ok_or_else(|| bad(format!("unknown instruction id {id}")))
    }

    /// The graph value of converted instruction `id`.
    fn val(&self, id: i64) -> Result<Tensor> {
        self.values
            .get(&id)
            .cloned()
            .ok_or_else(|| bad(format!("instruction {id} used before it is defined")))
    }

    /// The graph value of `i`'s operand `k`.
    fn operand(&self, i: &HloInstructionProto, k: usize) -> Result<Tensor> {
        let id = *i
            .operand_ids
            .get(k)
            .ok_or_else(|| bad(format!("{}: missing operand {k}", i.name)))?;
        self.val(id)
    }

    /// `i`'s result shape.
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
}

/// Imports a module.
pub fn import(m: &HloModuleProto) -> Result<Graph> {
    let comps: HashMap<i64, &HloComputationProto> =
        m.computations.iter().map(|c| (c.id, c)).collect();
    let (entry, params) = entry_parameters(m)?;
    let io = io_names(m)?;
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
    for (k, (p, name)) in params.iter().zip(&io.inputs).enumerate() {
        let attrs = p.frontend_attributes.as_ref().map(|f| &f.map);
        // The emitter suffixes an aliased parameter's NEFF name; the graph input is the plain
        // name, so emit -> import is the identity.
        let name = match name.strip_suffix(MUST_ALIAS_SUFFIX) {
            Some(base) if io.aliased[k] => base.to_string(),
            _ => name.clone(),
        };
        let role = match attrs
            .and_then(|a| a.get(ROLE_ATTR))
            .and_then(|s| InputRole::from_name(s))
        {
            Some(role @ (InputRole::Weight | InputRole::CacheRoot | InputRole::Carried)) => role,
            // Metadata, or no role (a foreign module): an aliased parameter is a cache root.
            _ if io.aliased[k] => InputRole::CacheRoot,
            _ => InputRole::Metadata,
        };
        let shape = Importer::shape(p)?;
        let t = imp.b.input(name, role, dims(shape)?, elem(shape)?)?;
        imp.values.insert(p.id, t.clone());
        imp.params.push(t);
    }
    for i in &entry.instructions {
        let part = i
            .frontend_attributes
            .as_ref()
            .is_some_and(|f| f.map.contains_key(COMPOSITE_PART_ATTR));
        if i.opcode == opcodes::PARAMETER || part {
            continue;
        }
        if i.id == entry.root_id && i.opcode == opcodes::TUPLE {
            break;
        }
        let t = imp.convert(i)?;
        imp.values.insert(i.id, t);
    }
    let root = imp.inst(entry.root_id)?;
    let outs: Vec<i64> = if root.opcode == opcodes::TUPLE {
        root.operand_ids.clone()
    } else {
        vec![root.id]
    };
    let by_output: HashMap<usize, i64> = aliased.iter().map(|(&p, &o)| (o, p)).collect();
    for (k, (id, name)) in outs.iter().zip(io.outputs).enumerate() {
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
