//! The three Rust-side executors of the conformance suite. Each takes a prepared case and returns
//! its outputs as [`Array`]s, in the case's output order:
//!
//! - [`Executor::Cpu`]: the built graph on the CPU backend (`deepinfer::backend::cpu::run`);
//! - [`Executor::HloCpu`]: the graph emitted as HLO bytes, imported back, then run on the CPU
//!   backend: what nrt-sim does, without the FFI;
//! - [`Executor::NrtSim`]: the HLO bytes compiled by nrt-sim's stand-in compiler through the
//!   compile driver and NEFF cache, loaded into `libnrt_sim.so` through neuron-sys (`dlopen`,
//!   `nrt_load`, tensor sets bound by the names the NEFF reports, `nrt_execute`, reads): the path
//!   a Neuron device takes.
//!
//! The fourth executor, XLA, is `scripts/xla_conformance.py`; it reads the HLO bytes this file
//! writes (see [`hlo_out_dir`]).

use std::path::PathBuf;
use std::sync::Arc;

use candle_core::Tensor as CTensor;
use deepinfer::backend::cpu;
use deepinfer::backend::hlo::{emit, import};
use deepinfer::backend::neuron::compile::{compile_all, CompileJob, CompilerConfig};
use deepinfer::backend::neuron::sim_neff::NeffNames;
use deepinfer::graph::Graph;
use deepinfer::runner::{self, binding};
use neuron_sys::{Library, Model, Runtime, Tensor, TensorSet};

use super::case::{Array, Prepared};

/// One way of running a case.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Executor {
    Cpu,
    HloCpu,
    NrtSim,
}

impl Executor {
    /// The Rust-side executors, in report order.
    pub const ALL: [Executor; 3] = [Executor::Cpu, Executor::HloCpu, Executor::NrtSim];

    /// The name `known_failures` uses.
    pub fn name(self) -> &'static str {
        match self {
            Executor::Cpu => "cpu",
            Executor::HloCpu => "hlo_cpu",
            Executor::NrtSim => "nrt_sim",
        }
    }
}

/// Where each case's emitted module is written as `CASE.hlo.pb`: `$DEEPINFER_CONFORMANCE_OUT`
/// when set (scripts/test.sh points it at the directory `xla_conformance.py` reads), else
/// cargo's per-target scratch directory.
pub fn hlo_out_dir() -> PathBuf {
    std::env::var_os("DEEPINFER_CONFORMANCE_OUT")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("conformance-hlo"))
}

/// Emits the case's graph and writes the bytes to [`hlo_out_dir`].
pub fn emit_hlo(p: &Prepared<'_>) -> Result<Vec<u8>, String> {
    let module = emit::emit(&p.graph).map_err(|e| format!("emit: {e}"))?;
    let bytes = emit::to_bytes(&module);
    let dir = hlo_out_dir();
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let path = dir.join(format!("{}.hlo.pb", p.case.name));
    std::fs::write(&path, &bytes).map_err(|e| format!("{}: {e}", path.display()))?;
    Ok(bytes)
}

/// Runs `graph` on fresh copies of the case's inputs with the CPU backend. An aliased output
/// promises that its cache-root input tensor holds the new value afterwards; that is checked
/// too.
fn run_cpu(graph: &Graph, p: &Prepared<'_>) -> Result<Vec<Array>, String> {
    let inputs = p
        .inputs
        .iter()
        .map(Array::to_candle)
        .collect::<Result<Vec<CTensor>, _>>()?;
    let outs = cpu::run(graph, &inputs).map_err(|e| format!("cpu::run: {e}"))?;
    if outs.len() != p.expected.len() {
        return Err(format!(
            "{} outputs for {} declared",
            outs.len(),
            p.expected.len()
        ));
    }
    let mut got = Vec::with_capacity(outs.len());
    for ((t, want), decl) in outs.iter().zip(&p.expected).zip(graph.outputs()) {
        let a = Array::from_candle(t, want.dtype()).map_err(|e| format!("`{}`: {e}", decl.name))?;
        if let Some(k) = decl.aliases {
            let root = Array::from_candle(&inputs[k], want.dtype())?;
            if root.to_le_bytes() != a.to_le_bytes() {
                return Err(format!(
                    "`{}` aliases input `{}`, but after the run the input tensor holds other values",
                    decl.name,
                    graph.inputs()[k].name
                ));
            }
        }
        got.push(a);
    }
    Ok(got)
}

/// Executor (a): the built graph on the CPU backend.
pub fn cpu(p: &Prepared<'_>) -> Result<Vec<Array>, String> {
    run_cpu(&p.graph, p)
}

/// Executor (b): emit -> bytes -> import -> CPU backend. The imported graph must declare the
/// same inputs and outputs as the built one.
pub fn hlo_cpu(p: &Prepared<'_>, hlo: &[u8]) -> Result<Vec<Array>, String> {
    let g = import::import_bytes(hlo).map_err(|e| format!("import: {e}"))?;
    let sig = |g: &Graph| {
        let ins: Vec<_> = g
            .inputs()
            .iter()
            .map(|i| (i.name.clone(), i.role, i.shape.clone(), i.dtype))
            .collect();
        let outs: Vec<_> = g
            .outputs()
            .iter()
            .map(|o| (o.name.clone(), o.aliases))
            .collect();
        (ins, outs)
    };
    if sig(&g) != sig(&p.graph) {
        return Err(format!(
            "the imported graph's signature {:?} differs from the built one's {:?}",
            sig(&g),
            sig(&p.graph)
        ));
    }
    run_cpu(&g, p)
}

/// `libnrt_sim.so` loaded through neuron-sys, a runtime over its first core, and the compile
/// driver's configuration for nrt-sim's stand-in compiler (the one cargo built for this test).
pub struct Sim {
    rt: Runtime,
    compiler: CompilerConfig,
}

impl Sim {
    /// Opens the simulator cargo built next to this test binary. Not finding it is an error, not
    /// a reason to skip.
    pub fn open() -> Result<Sim, String> {
        let path = nrt_sim::library_next_to_current_exe().ok_or_else(|| {
            format!(
                "libnrt_sim.so not found next to {:?}: build it with `cargo build -p nrt-sim` \
                 (cargo test --workspace does)",
                std::env::current_exe().ok()
            )
        })?;
        let lib: Arc<Library> =
            Library::open(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        let rt = Runtime::shared(lib, 0, 1).map_err(|e| format!("nrt_init: {e}"))?;
        let compiler = CompilerConfig {
            program: env!("CARGO_BIN_EXE_nrt-sim-neuronx-cc").into(),
            ..runner::sim_compiler_config(NeffNames::default())
        };
        Ok(Sim { rt, compiler })
    }
}

/// Executor (c): the HLO bytes compiled by nrt-sim's stand-in compiler through the compile
/// driver and NEFF cache, loaded into nrt-sim, its tensors bound under the names the NEFF reports
/// (the device runner's rules). Each input is a device tensor written with `nrt_tensor_write`;
/// an aliased output is bound to its root's tensor (the same handle in both sets, as the device
/// runner binds a cache root); the others get their own tensors, read back after `nrt_execute`.
pub fn nrt_sim(sim: &Sim, p: &Prepared<'_>, hlo: &[u8]) -> Result<Vec<Array>, String> {
    let rt = &sim.rt;
    let job = CompileJob {
        name: p.graph.name().to_string(),
        hlo: hlo.to_vec(),
    };
    let neff = compile_all(&sim.compiler, std::slice::from_ref(&job))
        .map_err(|e| format!("compile: {e}"))?
        .pop()
        .ok_or("compile: no NEFF")?
        .neff;
    let model = Model::load(rt, &neff, Some(0), None).map_err(|e| format!("nrt_load: {e}"))?;
    let io = model
        .io()
        .map_err(|e| format!("nrt_get_model_tensor_info: {e}"))?;
    let names = binding::bind(
        &p.graph,
        &io.inputs().map(|t| t.name.clone()).collect::<Vec<_>>(),
        &io.outputs().map(|t| t.name.clone()).collect::<Vec<_>>(),
    )
    .map_err(|e| e.to_string())?;
    let mut ins = TensorSet::new(rt).map_err(|e| e.to_string())?;
    let mut outs = TensorSet::new(rt).map_err(|e| e.to_string())?;
    let mut in_tensors = Vec::with_capacity(p.inputs.len());
    for (decl, a) in p.graph.inputs().iter().zip(&p.inputs) {
        let bytes = a.to_le_bytes();
        let t = Tensor::device(rt, 0, bytes.len(), &decl.name)
            .map_err(|e| format!("input `{}`: {e}", decl.name))?;
        t.write(0, &bytes)
            .map_err(|e| format!("input `{}`: {e}", decl.name))?;
        ins.add(&names.inputs[in_tensors.len()], &t)
            .map_err(|e| format!("input `{}`: {e}", decl.name))?;
        in_tensors.push(t);
    }
    let mut out_tensors = Vec::with_capacity(p.expected.len());
    for (decl, want) in p.graph.outputs().iter().zip(&p.expected) {
        let t = match decl.aliases {
            Some(k) => in_tensors[k].clone(),
            None => {
                let size = want.shape.iter().product::<usize>() * want.dtype().size_in_bytes();
                Tensor::device(rt, 0, size, &decl.name)
                    .map_err(|e| format!("output `{}`: {e}", decl.name))?
            }
        };
        outs.add(&names.outputs[out_tensors.len()], &t)
            .map_err(|e| format!("output `{}`: {e}", decl.name))?;
        out_tensors.push(t);
    }
    model
        .execute(&ins, &outs)
        .map_err(|e| format!("nrt_execute: {e}"))?;
    p.expected
        .iter()
        .zip(&out_tensors)
        .zip(p.graph.outputs())
        .map(|((want, t), decl)| {
            let bytes = t
                .read_vec(0, t.size())
                .map_err(|e| format!("output `{}`: {e}", decl.name))?;
            Array::from_le_bytes(want.dtype(), &want.shape, &bytes)
                .map_err(|e| format!("output `{}`: {e}", decl.name))
        })
        .collect()
}
