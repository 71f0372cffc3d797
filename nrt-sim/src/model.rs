//! Models: loading a NEFF (nrt-sim's container: deepinfer's serialized HLO, imported back into
//! a graph, and the I/O names the stand-in compiler gave it), unloading, and the tensor-info
//! arrays that describe a model's inputs and outputs.

use std::sync::Arc;

use deepinfer::backend::cpu::Group;
use deepinfer::backend::hlo::import::import_bytes;
use deepinfer::backend::neuron::footprint;
use deepinfer::backend::neuron::sim_neff::{SimNeff, SimNeffError};
use neuron_sys::sys::{self, nrt_tensor_info_array_t};

use crate::bootstrap;
use crate::config::ENV_FAIL_LOAD;
use crate::fail::{Fail, Res};
use crate::handle::{Handle, Kind};
use crate::identity::nc_count;
use crate::model_io::{describe, InfoArray, IoDesc};
use crate::state::{state, ModelEntry, RankSeat};

/// The collectives context `nrt_load_collectives` was given: this rank's global device id and
/// the number of ranks.
#[derive(Debug, Clone, Copy)]
pub(crate) struct CollectivesContext {
    pub(crate) device_id: u32,
    pub(crate) device_count: u32,
}

/// Loads `neff` on cores `vnc .. vnc + vnc_count` (`-1`: core 0, the first free one, as libnrt
/// picks). A core outside the visible ones is `NRT_LOAD_NOT_ENOUGH_NC`; bytes that are not an
/// nrt-sim NEFF (raw HLO included) or whose HLO cannot run are `NRT_INVALID`, a container of
/// another format version `NRT_UNSUPPORTED_NEFF_VERSION`; the load chosen by `NRT_SIM_FAIL_LOAD`
/// is `NRT_RESOURCE`.
///
/// A graph with collectives must come through `nrt_load_collectives` (`collectives`), with a
/// device count equal to its replica count and `NEURON_RT_ROOT_COMM_ID` set, as libnrt needs to
/// bootstrap its collectives; each rank's model takes the seat of its device id in the group of
/// models of the same graph and device count (`NRT_INVALID` if that seat is taken). With more
/// than one device the load returns only once every rank has entered it (`NRT_TIMEOUT` after
/// `NRT_SIM_COLLECTIVE_TIMEOUT_MS` otherwise: see [`bootstrap`]).
pub(crate) fn load(
    neff: &[u8],
    vnc: i32,
    vnc_count: i32,
    collectives: Option<CollectivesContext>,
) -> Res<Handle> {
    let visible = i64::from(nc_count());
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
    check_collectives(&graph, collectives)?;
    let footprint = footprint::of_hlo_bytes(&container.hlo)
        .map_err(|e| Fail::invalid(format!("the NEFF's HLO: {e}")))?;
    if let Some(ctx) = collectives.filter(|c| c.device_count > 1) {
        // A seat already taken fails at once, not after the bootstrap's wait.
        let timeout = {
            let st = state();
            seat(&st, graph.name(), ctx)?;
            st.config.collective_timeout
        };
        bootstrap::wait_for_every_rank(graph.name(), ctx.device_id, ctx.device_count, timeout)?;
    }
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
    let rank = match collectives {
        Some(ctx) => Some(seat(&st, &name, ctx)?),
        None => None,
    };
    let core = vnc.max(0) as u32;
    let charge = st
        .charge_neff(core, footprint.private(), footprint.scratch)
        .map_err(|(need, used)| {
            Fail::new(
                sys::NRT_RESOURCE,
                format!(
                    "cannot load model `{name}` on NeuronCore {core}: its code and DMA rings \
                     ({} bytes), collectives buffers ({} bytes) and scratchpad ({} bytes, \
                     shared with the core's other models) need {need} more bytes; {used} of \
                     its {} bytes of device memory are in use (NRT_SIM_HBM_BYTES)",
                    footprint.code, footprint.collectives, footprint.scratch, st.config.hbm_bytes
                ),
            )
        })?;
    let Some(h) = st.models.insert(ModelEntry {
        graph,
        name,
        core,
        inputs,
        outputs,
        executions: 0,
        rank,
        charge,
    }) else {
        // The entry (and its private bytes, released on drop) is gone; the scratchpad may
        // have grown for it: back to the largest of the models still loaded.
        st.settle_scratch();
        return Err(Fail::new(sys::NRT_RESOURCE, "too many models"));
    };
    st.stats.loads += 1;
    Ok(h)
}

/// The collectives context of `nrt_load_collectives`: the device must be one of the
/// `ctx_device_count`.
pub(crate) fn check_collectives_context(ctx_device_id: u32, ctx_device_count: u32) -> Res<()> {
    if ctx_device_id >= ctx_device_count {
        return Err(Fail::invalid(format!(
            "ctx_device_id {ctx_device_id} is not below ctx_device_count {ctx_device_count}"
        )));
    }
    Ok(())
}

/// `NEURON_RT_ROOT_COMM_ID`: where libnrt's collectives bootstrap (`host:port` of rank 0).
pub const ENV_ROOT_COMM_ID: &str = "NEURON_RT_ROOT_COMM_ID";

/// A graph's collectives and the way it is loaded must agree: collectives need
/// `nrt_load_collectives` with as many devices as the graph's replicas, and the root
/// communicator's address.
fn check_collectives(graph: &deepinfer::graph::Graph, ctx: Option<CollectivesContext>) -> Res<()> {
    let ranks = graph.ranks();
    match ctx {
        None if ranks > 1 => Err(Fail::invalid(format!(
            "model `{}` has collectives over {ranks} ranks: load it with nrt_load_collectives",
            graph.name()
        ))),
        None => Ok(()),
        Some(c) => {
            if ranks > 1 && ranks != c.device_count as usize {
                return Err(Fail::invalid(format!(
                    "model `{}` has collectives over {ranks} ranks but was loaded with \
                     ctx_device_count {}",
                    graph.name(),
                    c.device_count
                )));
            }
            if ranks == 1 && c.device_count == 1 {
                return Ok(()); // nothing to bootstrap
            }
            let root = std::env::var(ENV_ROOT_COMM_ID).unwrap_or_default();
            let valid = root
                .rsplit_once(':')
                .is_some_and(|(host, port)| !host.is_empty() && port.parse::<u16>().is_ok());
            if !valid {
                return Err(Fail::invalid(format!(
                    "{ENV_ROOT_COMM_ID}={root:?}: collectives need the host:port of rank 0's \
                     root communicator (for one instance, e.g. localhost:61234)"
                )));
            }
            Ok(())
        }
    }
}

/// The seat of device `ctx.device_id` in the group of models named `name` loaded for
/// `ctx.device_count` devices: a new group for the first rank loaded, the existing one for the
/// others.
fn seat(st: &crate::state::State, name: &str, ctx: CollectivesContext) -> Res<RankSeat> {
    let mut group = None;
    for (_, m) in st.models.iter() {
        let Some(r) = m
            .rank
            .as_ref()
            .filter(|r| m.name == name && r.comm.size() == ctx.device_count as usize)
        else {
            continue;
        };
        if r.device_id == ctx.device_id {
            return Err(Fail::invalid(format!(
                "model `{name}` is already loaded for device {} of {}",
                ctx.device_id, ctx.device_count
            )));
        }
        group = Some(Arc::clone(r.comm.group()));
    }
    let group = group
        .unwrap_or_else(|| Group::new(ctx.device_count as usize, st.config.collective_timeout));
    let comm = group
        .rank(ctx.device_id as usize)
        .map_err(|e| Fail::invalid(e.to_string()))?;
    Ok(RankSeat {
        comm,
        device_id: ctx.device_id,
        steps: 0,
    })
}

/// Unloads a model; its handle goes stale.
pub(crate) fn unload(model: Handle) -> Res<()> {
    let mut st = state();
    st.require_running("nrt_unload")?;
    st.models
        .remove(model)
        .map_err(|why| Fail::handle("model", Kind::Model, why))?;
    st.settle_scratch();
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
