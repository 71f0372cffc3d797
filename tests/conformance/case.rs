//! The conformance case format (`tests/conformance/*.json`, see the README there): reading a
//! case, building its graph through the public builder API, and comparing an executor's outputs
//! with the expected values.
//!
//! Everything here returns `Result<_, String>` rather than panicking, so one bad case is reported
//! next to the others instead of stopping the run.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use candle_core::{DType as CDType, Device, Tensor as CTensor};
use deepinfer::graph::{DType, FourBit, Graph, GraphBuilder, InputRole, Literal, Tensor};
use deepinfer::host::{candle_dtype, tensor_from_bytes};
use float8::F8E4M3;
use half::{bf16, f16};
use serde::Deserialize;
use serde_json::Value as Json;

/// The directory holding the case files.
pub fn case_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests")
        .join("conformance")
}

/// One `FAMILY.json` file.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CaseFile {
    /// The file's family (its stem).
    pub family: String,
    /// The script that wrote it.
    #[allow(dead_code)]
    pub generated_by: String,
    /// The cases, in file order.
    pub cases: Vec<Case>,
}

/// One case: a program, its inputs and its expected outputs.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Case {
    /// Unique across all files; also the graph's name and the HLO file's stem.
    pub name: String,
    /// What the case checks.
    #[allow(dead_code)]
    pub doc: String,
    /// Graph inputs, in parameter order.
    pub inputs: Vec<InputSpec>,
    /// Ops in order; each names its result and reads inputs or earlier results.
    pub program: Vec<Stmt>,
    /// Graph outputs, in result order, with their expected values.
    pub outputs: Vec<OutputSpec>,
    /// Executor name -> why the case fails there today (a bug to fix, not a tolerance).
    pub known_failures: BTreeMap<String, String>,
}

/// A declared input and its value.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct InputSpec {
    pub name: String,
    pub dtype: String,
    pub shape: Vec<usize>,
    /// `metadata`, `weight` or `cache_root`.
    pub role: String,
    pub data: Vec<Json>,
}

/// One op of a program. Attributes an op does not take are absent.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Stmt {
    pub out: String,
    pub op: String,
    pub args: Vec<String>,
    pub dtype: Option<String>,
    pub shape: Option<Vec<usize>>,
    pub dim: Option<usize>,
    pub perm: Option<Vec<usize>>,
    pub start: Option<usize>,
    pub len: Option<usize>,
    pub k: Option<usize>,
    pub col: Option<usize>,
    pub group: Option<usize>,
    pub data: Option<Vec<Json>>,
}

/// A declared output and its expected value.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OutputSpec {
    pub name: String,
    /// The program value returned.
    pub value: String,
    /// The cache-root input this output updates in place.
    pub aliases: Option<String>,
    pub dtype: String,
    pub shape: Vec<usize>,
    /// Float outputs only: `|got - want| <= atol + rtol * |want|`.
    pub atol: Option<f64>,
    pub rtol: Option<f64>,
    pub data: Vec<Json>,
}

/// Reads and parses one family's file. A missing or malformed file is an error.
pub fn load(family: &str) -> Result<CaseFile, String> {
    let path = case_dir().join(format!("{family}.json"));
    let text = std::fs::read_to_string(&path)
        .map_err(|e| format!("{}: {e} (a missing case file is a failure)", path.display()))?;
    let file: CaseFile =
        serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))?;
    if file.family != family {
        return Err(format!(
            "{}: says it is family `{}`",
            path.display(),
            file.family
        ));
    }
    Ok(file)
}

// === Values ===

/// The elements of an array, row-major, each in its own Rust type.
#[derive(Debug, Clone, PartialEq)]
pub enum Data {
    F32(Vec<f32>),
    BF16(Vec<bf16>),
    F16(Vec<f16>),
    F8E4M3(Vec<F8E4M3>),
    I32(Vec<i32>),
    U32(Vec<u32>),
    I8(Vec<i8>),
    U8(Vec<u8>),
    Bool(Vec<bool>),
}

/// A concrete array: an input, an expected output or what an executor returned.
#[derive(Debug, Clone, PartialEq)]
pub struct Array {
    pub shape: Vec<usize>,
    pub data: Data,
}

/// The graph dtype a case spells `name`. Adding a dtype to the suite is a new arm here and in
/// [`Data`]; the case files only gain data.
pub fn dtype(name: &str) -> Result<DType, String> {
    Ok(match name {
        "f32" => DType::F32,
        "bf16" => DType::BF16,
        "f16" => DType::F16,
        "f8e4m3fn" => DType::F8E4M3,
        "i32" => DType::I32,
        "u32" => DType::U32,
        "i8" => DType::I8,
        "u8" => DType::U8,
        "bool" => DType::Bool,
        other => return Err(format!("unknown dtype `{other}`")),
    })
}

fn f32_of(v: &Json) -> Result<f32, String> {
    match v {
        Json::Number(n) => n
            .as_f64()
            .map(|x| x as f32)
            .ok_or_else(|| format!("{n} is not a float")),
        Json::String(s) if s == "nan" => Ok(f32::NAN),
        Json::String(s) if s == "inf" => Ok(f32::INFINITY),
        Json::String(s) if s == "-inf" => Ok(f32::NEG_INFINITY),
        other => Err(format!(
            "{other} is not an f32 (a number, \"nan\", \"inf\" or \"-inf\")"
        )),
    }
}

/// A narrow float written as its f32 widening: the value must be exactly one of the type (`nan`
/// any NaN), so a case cannot ask for a value the type does not have (an f8e4m3fn infinity, a
/// bf16 with more than 8 significant bits) and have it silently rounded here.
fn narrow_of<T: Copy>(
    v: &Json,
    name: &str,
    from: impl Fn(f32) -> T,
    to: impl Fn(T) -> f32,
) -> Result<T, String> {
    let x = f32_of(v)?;
    let n = from(x);
    let back = to(n);
    if (x.is_nan() && back.is_nan()) || back.to_bits() == x.to_bits() {
        Ok(n)
    } else {
        Err(format!("{v} is not exactly a {name} value"))
    }
}

impl Array {
    /// Decodes a case's JSON values (see the README for the encoding).
    pub fn decode(dtype_name: &str, shape: &[usize], values: &[Json]) -> Result<Array, String> {
        let n: usize = shape.iter().product();
        if values.len() != n {
            return Err(format!(
                "{} values for shape {shape:?} ({n} elements)",
                values.len()
            ));
        }
        let int = |v: &Json| v.as_i64().ok_or_else(|| format!("{v} is not an integer"));
        let data = match dtype(dtype_name)? {
            DType::F32 => Data::F32(values.iter().map(f32_of).collect::<Result<_, _>>()?),
            DType::BF16 => Data::BF16(
                values
                    .iter()
                    .map(|v| narrow_of(v, "bf16", bf16::from_f32, bf16::to_f32))
                    .collect::<Result<_, _>>()?,
            ),
            DType::F16 => Data::F16(
                values
                    .iter()
                    .map(|v| narrow_of(v, "f16", f16::from_f32, f16::to_f32))
                    .collect::<Result<_, _>>()?,
            ),
            DType::F8E4M3 => Data::F8E4M3(
                values
                    .iter()
                    .map(|v| narrow_of(v, "f8e4m3fn", F8E4M3::from_f32, |x| x.to_f32()))
                    .collect::<Result<_, _>>()?,
            ),
            DType::I8 => Data::I8(
                values
                    .iter()
                    .map(|v| int(v).and_then(|i| i8::try_from(i).map_err(|e| e.to_string())))
                    .collect::<Result<_, _>>()?,
            ),
            DType::U8 => Data::U8(
                values
                    .iter()
                    .map(|v| int(v).and_then(|i| u8::try_from(i).map_err(|e| e.to_string())))
                    .collect::<Result<_, _>>()?,
            ),
            DType::I32 => Data::I32(
                values
                    .iter()
                    .map(|v| int(v).and_then(|i| i32::try_from(i).map_err(|e| e.to_string())))
                    .collect::<Result<_, _>>()?,
            ),
            DType::U32 => Data::U32(
                values
                    .iter()
                    .map(|v| int(v).and_then(|i| u32::try_from(i).map_err(|e| e.to_string())))
                    .collect::<Result<_, _>>()?,
            ),
            DType::Bool => Data::Bool(
                values
                    .iter()
                    .map(|v| v.as_bool().ok_or_else(|| format!("{v} is not a bool")))
                    .collect::<Result<_, _>>()?,
            ),
        };
        Ok(Array {
            shape: shape.to_vec(),
            data,
        })
    }

    /// The graph dtype of the elements.
    pub fn dtype(&self) -> DType {
        match self.data {
            Data::F32(_) => DType::F32,
            Data::BF16(_) => DType::BF16,
            Data::F16(_) => DType::F16,
            Data::F8E4M3(_) => DType::F8E4M3,
            Data::I32(_) => DType::I32,
            Data::U32(_) => DType::U32,
            Data::I8(_) => DType::I8,
            Data::U8(_) => DType::U8,
            Data::Bool(_) => DType::Bool,
        }
    }

    /// The elements of a float array as f32 (exact for the narrow types, whose outputs compare
    /// by their widening under the case's rule); `None` for integers and bools.
    fn widened(&self) -> Option<Vec<f32>> {
        match &self.data {
            Data::F32(v) => Some(v.clone()),
            Data::BF16(v) => Some(v.iter().map(|x| x.to_f32()).collect()),
            Data::F16(v) => Some(v.iter().map(|x| x.to_f32()).collect()),
            Data::F8E4M3(v) => Some(v.iter().map(|x| x.to_f32()).collect()),
            Data::I32(_) | Data::U32(_) | Data::I8(_) | Data::U8(_) | Data::Bool(_) => None,
        }
    }

    fn len(&self) -> usize {
        match &self.data {
            Data::F32(v) => v.len(),
            Data::BF16(v) => v.len(),
            Data::F16(v) => v.len(),
            Data::F8E4M3(v) => v.len(),
            Data::I32(v) => v.len(),
            Data::U32(v) => v.len(),
            Data::I8(v) => v.len(),
            Data::U8(v) => v.len(),
            Data::Bool(v) => v.len(),
        }
    }

    /// A fresh candle tensor holding the array in the candle dtype the CPU backend uses for its
    /// graph dtype (bools, i8 and u8 as one byte each: candle has no i8).
    pub fn to_candle(&self) -> Result<CTensor, String> {
        let dev = &Device::Cpu;
        let shape = self.shape.as_slice();
        match &self.data {
            Data::F32(v) => CTensor::from_slice(v, shape, dev),
            Data::BF16(v) => CTensor::from_slice(v, shape, dev),
            Data::F16(v) => CTensor::from_slice(v, shape, dev),
            Data::F8E4M3(v) => CTensor::from_slice(v, shape, dev),
            Data::I32(v) => CTensor::from_slice(v, shape, dev),
            Data::U32(v) => CTensor::from_slice(v, shape, dev),
            Data::U8(v) => CTensor::from_slice(v, shape, dev),
            Data::I8(_) => {
                return tensor_from_bytes(DType::I8, shape, &self.to_le_bytes())
                    .map_err(|e| format!("cannot build an i8 tensor: {e}"))
            }
            Data::Bool(v) => {
                let bytes: Vec<u8> = v.iter().map(|&b| u8::from(b)).collect();
                CTensor::from_vec(bytes, shape, dev)
            }
        }
        .map_err(|e| format!("cannot build a tensor: {e}"))
    }

    /// Reads a candle tensor the CPU backend returned as `dtype`.
    pub fn from_candle(t: &CTensor, dtype: DType) -> Result<Array, String> {
        let err = |e: candle_core::Error| e.to_string();
        let flat = t.flatten_all().map_err(err)?;
        let want: CDType = candle_dtype(dtype);
        if t.dtype() != want {
            return Err(format!(
                "a {:?} tensor where {dtype} was declared",
                t.dtype()
            ));
        }
        let data = match dtype {
            DType::F32 => Data::F32(flat.to_vec1().map_err(err)?),
            DType::BF16 => Data::BF16(flat.to_vec1().map_err(err)?),
            DType::F16 => Data::F16(flat.to_vec1().map_err(err)?),
            DType::F8E4M3 => Data::F8E4M3(flat.to_vec1().map_err(err)?),
            DType::I32 => Data::I32(flat.to_vec1().map_err(err)?),
            DType::U32 => Data::U32(flat.to_vec1().map_err(err)?),
            DType::I8 => Data::I8(
                flat.to_vec1::<u8>()
                    .map_err(err)?
                    .into_iter()
                    .map(|b| b as i8)
                    .collect(),
            ),
            DType::U8 => Data::U8(flat.to_vec1().map_err(err)?),
            DType::Bool => Data::Bool(bools(&flat.to_vec1::<u8>().map_err(err)?)?),
        };
        Ok(Array {
            shape: t.dims().to_vec(),
            data,
        })
    }

    /// Little-endian bytes, as a device tensor holds them (a bool is one byte, 0 or 1).
    pub fn to_le_bytes(&self) -> Vec<u8> {
        match &self.data {
            Data::F32(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            Data::BF16(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            Data::F16(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            Data::F8E4M3(v) => v.iter().map(|x| x.to_bits()).collect(),
            Data::I32(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            Data::U32(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            Data::I8(v) => v.iter().map(|&x| x as u8).collect(),
            Data::U8(v) => v.clone(),
            Data::Bool(v) => v.iter().map(|&b| u8::from(b)).collect(),
        }
    }

    /// The inverse of [`Array::to_le_bytes`].
    pub fn from_le_bytes(dtype: DType, shape: &[usize], bytes: &[u8]) -> Result<Array, String> {
        let n: usize = shape.iter().product();
        if bytes.len() != n * dtype.size_in_bytes() {
            return Err(format!("{} bytes for {n} elements of {dtype}", bytes.len()));
        }
        let words = || bytes.chunks_exact(4).map(|c| [c[0], c[1], c[2], c[3]]);
        let halves = || bytes.chunks_exact(2).map(|c| [c[0], c[1]]);
        let data = match dtype {
            DType::F32 => Data::F32(words().map(f32::from_le_bytes).collect()),
            DType::BF16 => Data::BF16(halves().map(bf16::from_le_bytes).collect()),
            DType::F16 => Data::F16(halves().map(f16::from_le_bytes).collect()),
            DType::F8E4M3 => Data::F8E4M3(bytes.iter().map(|&b| F8E4M3::from_bits(b)).collect()),
            DType::I32 => Data::I32(words().map(i32::from_le_bytes).collect()),
            DType::U32 => Data::U32(words().map(u32::from_le_bytes).collect()),
            DType::I8 => Data::I8(bytes.iter().map(|&b| b as i8).collect()),
            DType::U8 => Data::U8(bytes.to_vec()),
            DType::Bool => Data::Bool(bools(bytes)?),
        };
        Ok(Array {
            shape: shape.to_vec(),
            data,
        })
    }
}

/// Bytes that must each be 0 or 1.
fn bools(bytes: &[u8]) -> Result<Vec<bool>, String> {
    bytes
        .iter()
        .map(|&b| match b {
            0 => Ok(false),
            1 => Ok(true),
            other => Err(format!("a bool stored as byte {other}")),
        })
        .collect()
}

// === Building the graph ===

/// A case with its values decoded.
pub struct Prepared<'c> {
    pub case: &'c Case,
    pub graph: Graph,
    pub inputs: Vec<Array>,
    pub expected: Vec<Array>,
}

fn role(name: &str) -> Result<InputRole, String> {
    Ok(match name {
        "metadata" => InputRole::Metadata,
        "weight" => InputRole::Weight,
        "cache_root" => InputRole::CacheRoot,
        other => return Err(format!("unknown input role `{other}`")),
    })
}

fn need<T: Clone>(v: &Option<T>, op: &str, attr: &str) -> Result<T, String> {
    v.clone()
        .ok_or_else(|| format!("`{op}` needs the attribute `{attr}`"))
}

/// Appends one op to the graph through the public builder API.
fn apply(b: &GraphBuilder, st: &Stmt, args: &[Tensor]) -> Result<Tensor, String> {
    let op = st.op.as_str();
    let arity = |n: usize| -> Result<(), String> {
        if args.len() == n {
            Ok(())
        } else {
            Err(format!("`{op}` takes {n} arguments, not {}", args.len()))
        }
    };
    let dim = || need(&st.dim, op, "dim");
    let shape = || need(&st.shape, op, "shape");
    let result = match op {
        "constant" => {
            arity(0)?;
            let shape = shape()?;
            let values = need(&st.data, op, "data")?;
            let lit = match Array::decode(&need(&st.dtype, op, "dtype")?, &shape, &values)?.data {
                Data::F32(v) => Literal::F32(v),
                Data::BF16(v) => Literal::BF16(v),
                Data::F16(v) => Literal::F16(v),
                Data::F8E4M3(v) => Literal::F8E4M3(v),
                Data::I32(v) => Literal::I32(v),
                Data::U32(v) => Literal::U32(v),
                Data::I8(v) => Literal::I8(v),
                Data::U8(_) => return Err("there are no u8 literals".into()),
                Data::Bool(_) => return Err("there are no bool literals".into()),
            };
            b.constant(lit, shape)
        }
        "iota" => {
            arity(0)?;
            b.iota(shape()?, dtype(&need(&st.dtype, op, "dtype")?)?, dim()?)
        }
        "neg" | "abs" | "exp" | "log" | "sqrt" | "rsqrt" | "sin" | "cos" | "tanh" | "sigmoid"
        | "silu" => {
            arity(1)?;
            let x = &args[0];
            match op {
                "neg" => x.neg(),
                "abs" => x.abs(),
                "exp" => x.exp(),
                "log" => x.log(),
                "sqrt" => x.sqrt(),
                "rsqrt" => x.rsqrt(),
                "sin" => x.sin(),
                "cos" => x.cos(),
                "tanh" => x.tanh(),
                "sigmoid" => x.sigmoid(),
                _ => x.silu(),
            }
        }
        "add" | "sub" | "mul" | "div" | "rem" | "maximum" | "minimum" | "bitxor" | "bitand"
        | "shr" | "shl" => {
            arity(2)?;
            let (x, y) = (&args[0], &args[1]);
            match op {
                "add" => x.add(y),
                "sub" => x.sub(y),
                "mul" => x.mul(y),
                "div" => x.div(y),
                "rem" => x.rem(y),
                "maximum" => x.maximum(y),
                "minimum" => x.minimum(y),
                "bitxor" => x.bitxor(y),
                "bitand" => x.bitand(y),
                "shr" => x.shr(y),
                _ => x.shl(y),
            }
        }
        "eq" | "ne" | "lt" | "le" | "gt" | "ge" => {
            arity(2)?;
            let (x, y) = (&args[0], &args[1]);
            match op {
                "eq" => x.eq(y),
                "ne" => x.ne(y),
                "lt" => x.lt(y),
                "le" => x.le(y),
                "gt" => x.gt(y),
                _ => x.ge(y),
            }
        }
        "where" => {
            arity(3)?;
            args[0].where_cond(&args[1], &args[2])
        }
        "cast" => {
            arity(1)?;
            args[0].to_dtype(dtype(&need(&st.dtype, op, "dtype")?)?)
        }
        "broadcast" => {
            arity(1)?;
            args[0].broadcast_as(shape()?)
        }
        "reshape" => {
            arity(1)?;
            args[0].reshape(shape()?)
        }
        "permute" => {
            arity(1)?;
            args[0].permute(&need(&st.perm, op, "perm")?)
        }
        "slice" => {
            arity(1)?;
            args[0].narrow(
                dim()?,
                need(&st.start, op, "start")?,
                need(&st.len, op, "len")?,
            )
        }
        "concat" => {
            let refs: Vec<&Tensor> = args.iter().collect();
            b.cat(&refs, dim()?)
        }
        "matmul" => {
            arity(2)?;
            args[0].matmul(&args[1])
        }
        "matmul_to" => {
            arity(2)?;
            args[0].matmul_to(&args[1], dtype(&need(&st.dtype, op, "dtype")?)?)
        }
        "reduce_sum" | "reduce_max" | "reduce_min" => {
            arity(1)?;
            match op {
                "reduce_sum" => args[0].sum(dim()?),
                "reduce_max" => args[0].max(dim()?),
                _ => args[0].min(dim()?),
            }
        }
        "argmax" => {
            arity(1)?;
            args[0].argmax(dim()?)
        }
        "topk" => {
            arity(1)?;
            args[0].topk(need(&st.k, op, "k")?)
        }
        "mass_threshold" => {
            arity(3)?;
            args[0].mass_threshold(&args[1], &args[2])
        }
        "dequantize_int4" => {
            arity(2)?;
            args[0].dequantize_int4(&args[1], need(&st.group, op, "group")?)
        }
        "dequantize_e2m1" => {
            arity(2)?;
            let group = need(&st.group, op, "group")?;
            args[0].dequantize_4bit_to(&args[1], group, FourBit::E2m1, DType::F32)
        }
        "index_select" => {
            arity(2)?;
            args[0].index_select(&args[1], dim()?)
        }
        "gather" => {
            arity(2)?;
            args[0].gather(&args[1], dim()?)
        }
        "scatter_rows" => {
            arity(3)?;
            args[0].scatter_rows(&args[1], need(&st.col, op, "col")?, &args[2])
        }
        other => return Err(format!("unknown op `{other}`")),
    };
    result.map_err(|e| format!("the builder refused `{op}`: {e}"))
}

/// Decodes a case and builds its graph. The graph's outputs must have the expected dtypes and
/// shapes, so the reference and the graph agree on what is computed before any value is.
pub fn prepare(case: &Case) -> Result<Prepared<'_>, String> {
    let b = GraphBuilder::new(case.name.clone());
    let mut env: HashMap<&str, Tensor> = HashMap::new();
    let mut inputs = Vec::with_capacity(case.inputs.len());
    for i in &case.inputs {
        let a = Array::decode(&i.dtype, &i.shape, &i.data)
            .map_err(|e| format!("input `{}`: {e}", i.name))?;
        let t = b
            .input(i.name.clone(), role(&i.role)?, i.shape.clone(), a.dtype())
            .map_err(|e| format!("input `{}`: {e}", i.name))?;
        env.insert(&i.name, t);
        inputs.push(a);
    }
    for st in &case.program {
        let args = st
            .args
            .iter()
            .map(|a| {
                env.get(a.as_str())
                    .cloned()
                    .ok_or_else(|| format!("`{}` reads `{a}` before it is defined", st.out))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let t = apply(&b, st, &args).map_err(|e| format!("`{}`: {e}", st.out))?;
        if env.insert(&st.out, t).is_some() {
            return Err(format!("`{}` is defined twice", st.out));
        }
    }
    let mut expected = Vec::with_capacity(case.outputs.len());
    for o in &case.outputs {
        let get = |n: &str| {
            env.get(n)
                .ok_or_else(|| format!("output `{}` names unknown value `{n}`", o.name))
        };
        let v = get(&o.value)?;
        let want = Array::decode(&o.dtype, &o.shape, &o.data)
            .map_err(|e| format!("output `{}`: {e}", o.name))?;
        if v.dtype() != want.dtype() || v.dims() != want.shape.as_slice() {
            return Err(format!(
                "output `{}`: the graph computes {} {:?}, the case expects {} {:?}",
                o.name,
                v.dtype(),
                v.dims(),
                want.dtype(),
                want.shape
            ));
        }
        let float = want.dtype().is_float();
        if float != (o.atol.is_some() && o.rtol.is_some()) {
            return Err(format!(
                "output `{}`: float outputs state atol and rtol, others compare exactly",
                o.name
            ));
        }
        let declared = match &o.aliases {
            Some(root) => b.output_aliased(o.name.clone(), v, get(root)?),
            None => b.output(o.name.clone(), v),
        };
        declared.map_err(|e| format!("output `{}`: {e}", o.name))?;
        expected.push(want);
    }
    let graph = b.finish().map_err(|e| e.to_string())?;
    Ok(Prepared {
        case,
        graph,
        inputs,
        expected,
    })
}

// === Comparing ===

fn index_of(flat: usize, shape: &[usize]) -> Vec<usize> {
    let mut idx = vec![0; shape.len()];
    let mut rest = flat;
    for (d, &n) in shape.iter().enumerate().rev() {
        if n > 0 {
            idx[d] = rest % n;
            rest /= n;
        }
    }
    idx
}

/// Whether `got` is an acceptable value for `want` under `rule` (`(atol, rtol)` for floats,
/// `None` for exact). NaN must meet NaN, an infinity the same infinity, and a finite value a
/// finite value within tolerance: a NaN or inf where a number is expected always fails.
fn f32_ok(got: f32, want: f32, atol: f64, rtol: f64) -> bool {
    if want.is_nan() || got.is_nan() {
        return want.is_nan() && got.is_nan();
    }
    if want.is_infinite() || got.is_infinite() {
        return got == want;
    }
    let (g, w) = (f64::from(got), f64::from(want));
    (g - w).abs() <= atol + rtol * w.abs()
}

/// Notes every element where `got` and `want` differ.
fn exact<T: PartialEq + ToString>(got: &[T], want: &[T], bad: &mut Vec<(usize, String, String)>) {
    for (i, (a, b)) in got.iter().zip(want).enumerate() {
        if a != b {
            bad.push((i, a.to_string(), b.to_string()));
        }
    }
}

/// Compares one output; the error lists the first mismatches with their indices.
pub fn compare(got: &Array, want: &Array, spec: &OutputSpec) -> Result<(), String> {
    if got.shape != want.shape || got.dtype() != want.dtype() || got.len() != want.len() {
        return Err(format!(
            "`{}`: got {} {:?}, want {} {:?}",
            spec.name,
            got.dtype(),
            got.shape,
            want.dtype(),
            want.shape
        ));
    }
    let mut bad: Vec<(usize, String, String)> = Vec::new();
    if let (Some(g), Some(w)) = (got.widened(), want.widened()) {
        let (atol, rtol) = (spec.atol.unwrap_or(0.0), spec.rtol.unwrap_or(0.0));
        for (i, (&a, &b)) in g.iter().zip(&w).enumerate() {
            if !f32_ok(a, b, atol, rtol) {
                bad.push((i, format!("{a:?}"), format!("{b:?}")));
            }
        }
    } else {
        match (&got.data, &want.data) {
            (Data::I32(g), Data::I32(w)) => exact(g, w, &mut bad),
            (Data::U32(g), Data::U32(w)) => exact(g, w, &mut bad),
            (Data::I8(g), Data::I8(w)) => exact(g, w, &mut bad),
            (Data::U8(g), Data::U8(w)) => exact(g, w, &mut bad),
            (Data::Bool(g), Data::Bool(w)) => exact(g, w, &mut bad),
            _ => return Err(format!("`{}`: dtypes differ", spec.name)),
        }
    }
    if bad.is_empty() {
        return Ok(());
    }
    let rule = match (spec.atol, spec.rtol) {
        (Some(a), Some(r)) => format!("atol {a:e}, rtol {r:e}"),
        _ => "exact".to_string(),
    };
    let shown: Vec<String> = bad
        .iter()
        .take(6)
        .map(|(i, g, w)| format!("{:?}: got {g}, want {w}", index_of(*i, &want.shape)))
        .collect();
    Err(format!(
        "`{}`: {} of {} elements differ ({rule}): {}{}",
        spec.name,
        bad.len(),
        want.len(),
        shown.join("; "),
        if bad.len() > shown.len() { "; ..." } else { "" }
    ))
}
