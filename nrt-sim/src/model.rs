//! Models: loading a NEFF (nrt-sim's container: deepinfer's serialized HLO, imported back into
//! a graph, and the I/O names the stand-in compiler gave it), unloading, and the tensor-info
//! arrays that describe a model's inputs and outputs.

use deepinfer::backend::hlo::import::import_bytes;
use deepinfer::backend::neuron::sim_neff::{SimNeff, SimNeffError};
use neuron_sys::sys::{self, nrt_tensor_info_array_t};

use crate::config::ENV_FAIL_LOAD;
use crate::fail::{Fail, Res};
use crate::handle::{Handle, Kind};
use crate::identity::VISIBLE_NC_COUNT;
use crate::model_io::{describe, InfoArray, IoDesc};
use crate::state::{state, ModelEntry};

/// Loads `neff` on cores `vnc .. vnc + vnc_count` (`-1`: core 0, the first free one, as libnrt
/// picks). A core outside the visible ones is `NRT_LOAD_NOT_ENOUGH_NC`; bytes that are not an
/// nrt-sim NEFF (raw HLO included) or whose HLO cannot run are `NRT_INVALID`, a container of
/// another format version `NRT_UNSUPPORTED_NEFF_VERSION`; the load chosen by `NRT_SIM_FAIL_LOAD`
/// is `NRT_RESOURCE`.
pub(crate) fn load(neff: &[u8], vnc: i32, vnc_count: i32) -> Res<Handle> {
    let visible = VISIBLE_NC_COUNT as i64;
    if vnc < -1 || i64::from(vnc) >= visible {
        return Err(Fail::new(
            sys::NRT_LOAD_NOT_ENOUGH_NC,
            format!("NeuronCore {vnc} requested; {visible} are visible"),
        ));
    }
    if vnc_count == 0 || vnc_count < -1 {
        return Err(Fail::invalid(format!("vnc_count {vnc_count}")));
    }
    if vnc >= 0 && vnc_count > 0 && i64::from(vnc) + i64::from(vnc_count) > visible {
        return Err(Fail::new(
            sys::NRT_LOAD_NOT_ENOUGH_NC,
            format!(
                "NeuronCores {vnc}..{} requested; {visible} are visible",
                vnc + vnc_count
            ),
        ));
    }
    state().require_running("nrt_load")?;
    // Decoded and imported without the lock: parsing a large module takes a while.
    let container = SimNeff::decode(neff).map_err(|e| match e {
        SimNeffError::UnsupportedVersion { .. } => {
            Fail::new(sys::NRT_UNSUPPORTED_NEFF_VERSION, e.to_string())
        }
        e => Fail::invalid(e.to_string()),
    })?;
    let graph = import_bytes(&container.hlo).map_err(|e| {
        Fail::invalid(format!(
            "the NEFF's HLO is not a module nrt-sim can run: {e}"
        ))
    })?;
    let (inputs, outputs) = describe(&graph, &container.inputs, &container.outputs)?;
    let mut st = state();
    st.require_running("nrt_load")?;
    st.loads_since_init += 1;
    if st.config.fail_load == Some(st.loads_since_init) {
        return Err(Fail::new(
            sys::NRT_RESOURCE,
            format!(
                "injected failure: load {} ({}={})",
                st.loads_since_init, ENV_FAIL_LOAD, st.loads_since_init
            ),
        ));
    }
    let name = graph.name().to_string();
    let h = st
        .models
        .insert(ModelEntry {
            graph,
            name,
            core: vnc.max(0) as u32,
            inputs,
            outputs,
            executions: 0,
        })
        .ok_or_else(|| Fail::new(sys::NRT_RESOURCE, "too many models"))?;
    st.stats.loads += 1;
    Ok(h)
}

/// The collectives context of `nrt_load_collectives`, which nrt-sim only checks: the device
/// must be one of the `ctx_device_count`.
pub(crate) fn check_collectives_context(ctx_device_id: u32, ctx_device_count: u32) -> Res<()> {
    if ctx_device_id >= ctx_device_count {
        return Err(Fail::invalid(format!(
            "ctx_device_id {ctx_device_id} is not below ctx_device_count {ctx_device_count}"
        )));
    }
    Ok(())
}

/// Unloads a model; its handle goes stale.
pub(crate) fn unload(model: Handle) -> Res<()> {
    let mut st = state();
    st.require_running("nrt_unload")?;
    st.models
        .remove(model)
        .map_err(|why| Fail::handle("model", Kind::Model, why))?;
    Ok(())
}

/// Builds the model's tensor-info array (inputs, then outputs) and registers it until
/// [`free_tensor_info`]; returns the pointer to hand to C.
pub(crate) fn tensor_info(model: Handle) -> Res<*mut nrt_tensor_info_array_t> {
    let mut st = state();
    st.require_running("nrt_get_model_tensor_info")?;
    let m = st.model("model", model)?;
    let descs: Vec<&IoDesc> = m.inputs.iter().chain(&m.outputs).collect();
    let array = InfoArray::new(&descs)?;
    let p = array.as_ptr();
    st.infos.insert(p.addr(), array);
    Ok(p)
}

/// Frees the tensor-info array at `addr`. An address [`tensor_info`] did not return, or one
/// already freed, is `NRT_INVALID_HANDLE`. Allowed after `nrt_close`.
pub(crate) fn free_tensor_info(addr: usize) -> Res<()> {
    let array = state().infos.remove(&addr).ok_or_else(|| {
        Fail::new(
            sys::NRT_INVALID_HANDLE,
            "tensor_info was not returned by nrt_get_model_tensor_info, or is already freed",
        )
    })?;
    // Freed here, after the lock is released.
    drop(array);
    Ok(())
}
