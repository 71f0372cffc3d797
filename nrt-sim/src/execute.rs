//! Executing a model: resolving its inputs and outputs in the bound tensor sets (names,
//! sizes, handles, cores, shared storage), then running the graph on the CPU backend
//! (`device`) straight from the bound storage and writing each output into the tensor bound to
//! it.
//!
//! # What a binding may not do
//!
//! - **Another core.** Every device tensor bound must live on the model's NeuronCore:
//!   `NRT_INVALID`. libnrt refuses such a set at execution ("Tensor input249 allocated on vnc 0
//!   must be allocated on same vnc as model (1)", logged by
//!   `NMGR:dlr_check_tensor_set_on_same_vtpb_v2`; huggingface/optimum-neuron PRs #267 and #725).
//!   The status it returns is not published;
//!   `nrt_status.h` files tensor-set mismatches ("input tensor name/size mismatch") under
//!   `NRT_INVALID`, and `nrt_tensor_copy` between device tensors of two cores is `NRT_INVALID`
//!   too, so nrt-sim answers `NRT_INVALID`.
//! - **Undeclared sharing.** An input and an output whose bytes overlap must be a declared
//!   alias (the output must-aliases that input) bound to the very same bytes; two outputs may
//!   not overlap at all. Otherwise `NRT_INVALID`. libnrt does not check this (nkipy's qwen3
//!   example binds one tensor as input `x` and output `output0` and runs), but the result on
//!   a device is whatever the schedule makes of it: NxD notes the aliases are "needed to avoid
//!   overwrite on the buffers when reusing the same buffers for inputs and outputs", and nkipy
//!   inserts copies because "inputs and outputs occupy separate memory regions". nrt-sim used to
//!   hide it by copying every input before writing any output.
//!
//! # In place
//!
//! The outputs are written into the bound storage, an aliased output into the very bytes its
//! input was read from. The CPU backend cannot compute on the caller's bytes (candle owns its
//! storage), so each input is still read into a candle tensor before the graph runs; but nrt-sim
//! no longer relies on that copy for a defined result (there is no separate snapshot of the
//! inputs, and the rules above leave a declared alias as the only bytes an input and an output
//! share), and inside the graph the root is updated in place with XLA's semantics: the graph
//! reads the parameter's old value and the output holds the new one, whatever the order of the
//! reads and the update (`deepinfer::backend::cpu::run`, which used to return the new value
//! through a view of the root read after the update).
//!
//! Split in two so the state lock is held only while planning: the copies and the
//! arithmetic run on `Arc`s of the tensors' storage, unlocked.

use std::sync::Arc;

use deepinfer::backend::cpu::RankComm;
use deepinfer::graph::Graph;
use neuron_sys::sys;

use crate::config::{Config, ENV_FAIL_EXECUTE};
use crate::device::{self, Bound};
use crate::fail::{Fail, Res};
use crate::handle::Handle;
use crate::model_io::IoDesc;
use crate::state::{state, TensorSet};

/// The bytes shared by input `i` and output `o` (or by two outputs) must be a declared alias,
/// bound to the very same bytes; see the module docs.
fn check_sharing(
    model: &str,
    inputs: &[Bound],
    outputs: &[Bound],
    aliases: &[Option<usize>],
) -> Res<()> {
    for (o, out) in outputs.iter().enumerate() {
        for (i, inp) in inputs.iter().enumerate() {
            if !out.overlaps(inp) {
                continue;
            }
            let declared = aliases[o] == Some(i);
            if !(declared && out.same_bytes(inp)) {
                return Err(Fail::invalid(format!(
                    "input `{}` and output `{}` of model `{model}` are bound to overlapping \
                     bytes (tensors `{}` and `{}`){}",
                    inp.name,
                    out.name,
                    inp.tensor,
                    out.tensor,
                    if declared {
                        "; an aliased pair must be bound to the same bytes"
                    } else {
                        " but the model declares no alias between them: on a device the \
                         result would depend on the schedule"
                    }
                )));
            }
        }
        if let Some(other) = outputs[..o].iter().find(|b| b.overlaps(out)) {
            return Err(Fail::invalid(format!(
                "outputs `{}` and `{}` of model `{model}` are bound to overlapping bytes \
                 (tensors `{}` and `{}`)",
                other.name, out.name, other.tensor, out.tensor
            )));
        }
    }
    Ok(())
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
///
/// For a rank of a collectives group it also takes the execution's step number (under the same
/// lock), returned whether or not the plan succeeds, since a failure must fail that step.
fn plan(
    model: Handle,
    input_set: Handle,
    output_set: Handle,
) -> (Option<(RankComm, u64)>, Res<Plan>) {
    let mut st = state();
    let rank = st
        .models
        .get_mut(model)
        .ok()
        .and_then(|m| m.rank.as_mut())
        .map(|seat| {
            seat.steps += 1;
            (seat.comm.clone(), seat.steps - 1)
        });
    (rank, plan_locked(&mut st, model, input_set, output_set))
}

fn plan_locked(
    st: &mut crate::state::State,
    model: Handle,
    input_set: Handle,
    output_set: Handle,
) -> Res<Plan> {
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
            if let Some(core) = t.core().filter(|&c| c != m.core) {
                return Err(Fail::invalid(format!(
                    "{role} `{}` is bound to tensor `{}` allocated on NeuronCore {core}; model \
                     `{}` is loaded on NeuronCore {} (libnrt: a tensor must be allocated on the \
                     same vnc as the model)",
                    d.name, t.name, m.name, m.core
                )));
            }
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
                name: d.name.clone(),
                tensor: t.name.clone(),
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
        let aliases: Vec<Option<usize>> = m.graph.outputs().iter().map(|o| o.aliases).collect();
        check_sharing(&m.name, &bound_in, &bound_out, &aliases)?;
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
///
/// A rank of a collectives group meets the other ranks at each collective of the graph. When
/// its execution fails for any reason (those above included), the step fails on every rank:
/// ranks waiting at a collective return at once with `NRT_EXEC_HW_ERR_COLLECTIVES`, as do
/// ranks that arrive later; a rank that never arrives fails the step after
/// `NRT_SIM_COLLECTIVE_TIMEOUT_MS`. The next execution starts clean.
pub(crate) fn execute(model: Handle, input_set: Handle, output_set: Handle) -> Res<()> {
    let (rank, plan) = plan(model, input_set, output_set);
    let result = plan.and_then(|p| execute_planned(model, p, rank.as_ref()));
    if let (Err(e), Some((comm, step))) = (&result, &rank) {
        comm.fail(*step, &e.to_string());
    }
    result
}

fn execute_planned(model: Handle, p: Plan, rank: Option<&(RankComm, u64)>) -> Res<()> {
    if let Some(d) = p.config.slow_for(&p.name) {
        std::thread::sleep(d);
    }
    if !p.config.free_execute {
        // Straight from and into the bound storage: no snapshot of the inputs (see the module
        // docs for why that is now safe, and what an aliased output means).
        device::run(
            &p.graph,
            &p.inputs,
            &p.outputs,
            &p.bound_in,
            &p.bound_out,
            rank,
        )?;
    }
    let mut st = state();
    *st.stats.executions.entry(p.name).or_default() += 1;
    if let Ok(m) = st.models.get_mut(model) {
        m.executions += 1;
    }
    Ok(())
}
