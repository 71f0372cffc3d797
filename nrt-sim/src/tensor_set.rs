//! Tensor sets: names bound to tensors, which `nrt_execute` looks its inputs and outputs up
//! in. A set does not own its tensors: freeing one leaves a stale binding, which
//! `nrt_execute` reports as `NRT_INVALID_HANDLE`.

use std::collections::HashMap;

use neuron_sys::sys;

use crate::fail::{Fail, Res};
use crate::handle::{Handle, Kind};
use crate::state::state;

/// An empty set.
pub(crate) fn allocate() -> Res<Handle> {
    let mut st = state();
    st.require_running("nrt_allocate_tensor_set")?;
    st.sets
        .insert(HashMap::new())
        .ok_or_else(|| Fail::new(sys::NRT_RESOURCE, "too many tensor sets"))
}

/// Destroys the set `*tensor_set` names (not its tensors); its handle goes stale.
pub(crate) fn destroy(set: Handle) -> Res<()> {
    let mut st = state();
    st.require_running("nrt_destroy_tensor_set")?;
    st.sets
        .remove(set)
        .map_err(|why| Fail::handle("*tensor_set", Kind::TensorSet, why))?;
    Ok(())
}

/// Binds `tensor` under `name`, replacing an earlier binding of that name. Names of
/// `NRT_TENSOR_NAME_MAX` bytes or more are `NRT_INVALID`.
pub(crate) fn add(set: Handle, name: String, tensor: Handle) -> Res<()> {
    if name.len() >= sys::NRT_TENSOR_NAME_MAX {
        return Err(Fail::invalid(format!(
            "tensor name is {} bytes; the limit is {}",
            name.len(),
            sys::NRT_TENSOR_NAME_MAX - 1
        )));
    }
    let mut st = state();
    st.require_running("nrt_add_tensor_to_tensor_set")?;
    st.tensor("tensor", tensor)?;
    st.sets
        .get_mut(set)
        .map_err(|why| Fail::handle("tensor_set", Kind::TensorSet, why))?
        .insert(name, tensor);
    Ok(())
}

/// The tensor bound under `name`. An unbound name is `NRT_FAILURE`, as libnrt reports it.
pub(crate) fn get(set: Handle, name: &str) -> Res<Handle> {
    let st = state();
    st.require_running("nrt_get_tensor_from_tensor_set")?;
    st.set("tensor_set", set)?
        .get(name)
        .copied()
        .ok_or_else(|| {
            Fail::new(
                sys::NRT_FAILURE,
                format!("no tensor named `{name}` in the set"),
            )
        })
}
