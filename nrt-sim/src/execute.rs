//! Executing a model: resolving its inputs and outputs in the bound tensor sets (names,
//! sizes, handles), then copying the inputs out, running the graph on the CPU backend
//! (`device`) and copying each output into the tensor bound to it.
//!
//! Split in two so the state lock is held only while planning: the copies and the
//! arithmetic run on `Arc`s of the tensors' storage, unlocked.

use std::sync::Arc;

use deepinfer::graph::Graph;
use neuron_sys::sys;

use crate::config::{Config, ENV_FAIL_EXECUTE};
use crate::device;
use crate::fail::{Fail, Res};
use crate::handle::Handle;
use crate::model_io::IoDesc;
use crate::state::{lock_bytes, state, Storage, TensorSet};

/// A binding resolved for one execution: the storage window of the tensor bound to an
/// input or output.
struct Bound {
    storage: Arc<Storage>,
    offset: usize,
    size: usize,
}

/// What an execution needs once its bindings are validated (nothing borrowed from the
/// state, so the lock is released for the copies and the arithmetic).
struct Plan {
    graph: Graph,
    name: String,
    inputs: Vec<IoDesc>,
    outputs: Vec<IoDesc>,
    bound_in: Vec<Bound>,
    bound_out: Vec<Bound>,
    config: Config,
}

/// Resolves every input and output of the model in its set, checking names and sizes, and
/// counts the execution for `NRT_SIM_FAIL_EXECUTE` (which fails it here, before anything is
/// written).
fn plan(model: Handle, input_set: Handle, output_set: Handle) -> Res<Plan> {
    let mut st = state();
    st.require_running("nrt_execute")?;
    let plan = {
        let st = &*st;
        let m = st.model("model", model)?;
        let ins = st.set("input_set", input_set)?;
        let outs = st.set("output_set", output_set)?;
        let bind = |set: &TensorSet, d: &IoDesc, role: &str| -> Res<Bound> {
            let h = *set.get(&d.name).ok_or_else(|| {
                Fail::invalid(format!(
                    "{role} `{}` of model `{}` is not bound in the {role} set",
                    d.name, m.name
                ))
            })?;
            let t = st.tensor(&format!("the tensor bound to {role} `{}`", d.name), h)?;
            if t.size != d.size {
                return Err(Fail::invalid(format!(
                    "{role} `{}` is bound to a tensor of {} bytes; model `{}` needs {} \
                     ({} {:?})",
                    d.name, t.size, m.name, d.size, d.dtype, d.shape
                )));
            }
            Ok(Bound {
                storage: Arc::clone(&t.storage),
                offset: t.offset,
                size: t.size,
            })
        };
        let bound_in = m
            .inputs
            .iter()
            .map(|d| bind(ins, d, "input"))
            .collect::<Res<Vec<_>>>()?;
        let bound_out = m
            .outputs
            .iter()
            .map(|d| bind(outs, d, "output"))
            .collect::<Res<Vec<_>>>()?;
        Plan {
            graph: m.graph.clone(),
            name: m.name.clone(),
            inputs: m.inputs.clone(),
            outputs: m.outputs.clone(),
            bound_in,
            bound_out,
            config: st.config.clone(),
        }
    };
    st.executes_since_init += 1;
    if st.config.fail_execute == Some(st.executes_since_init) {
        return Err(Fail::new(
            sys::NRT_EXEC_COMPLETED_WITH_ERR,
            format!(
                "injected failure: execution {} ({}={})",
                st.executes_since_init, ENV_FAIL_EXECUTE, st.executes_since_init
            ),
        ));
    }
    Ok(plan)
}

/// Runs the model on the tensors bound in `input_set` and `output_set`. A binding error
/// (unbound, wrong size: `NRT_INVALID`; freed: `NRT_INVALID_HANDLE`) and an injected fault
/// write nothing; an error of the CPU backend is `NRT_EXEC_BAD_INPUT`.
pub(crate) fn execute(model: Handle, input_set: Handle, output_set: Handle) -> Res<()> {
    let p = plan(model, input_set, output_set)?;
    if let Some(d) = p.config.slow_execute {
        std::thread::sleep(d);
    }
    if !p.config.free_execute {
        // Every input is copied out before any output is written, so a tensor bound as
        // both (a cache root) is read whole first, and overlapping bindings behave as if
        // the execution read all inputs, then wrote all outputs.
        let input_bytes: Vec<Vec<u8>> = p
            .bound_in
            .iter()
            .map(|b| lock_bytes(&b.storage)[b.offset..b.offset + b.size].to_vec())
            .collect();
        let results = device::run(&p.graph, &p.inputs, &p.outputs, &input_bytes)?;
        for (b, bytes) in p.bound_out.iter().zip(&results) {
            lock_bytes(&b.storage)[b.offset..b.offset + b.size].copy_from_slice(bytes);
        }
    }
    let mut st = state();
    *st.stats.executions.entry(p.name).or_default() += 1;
    if let Ok(m) = st.models.get_mut(model) {
        m.executions += 1;
    }
    Ok(())
}
