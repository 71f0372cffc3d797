//! What the simulator counts: the types, as plain serializable data.
//!
//! The counters cross the C boundary as JSON (`nrt_sim_counters_json`) rather than as a
//! `#[repr(C)]` struct: they include maps keyed by tensor and model names, which a fixed C
//! struct cannot carry without a second, pointer-chasing API. The JSON is this module's
//! [`Counters`] serialized, so a Rust reader gets the same type back (`reader`).
//!
//! This module imports nothing of the crate: the state fills these types
//! ([`Counters::of_this_copy`] lives beside it), the reader parses them, and neither arrow
//! points back here.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// Objects alive right now.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Live {
    /// Tensors (allocations and slices) not yet freed.
    pub tensors: u64,
    /// Tensor sets not yet destroyed.
    pub tensor_sets: u64,
    /// Models not yet unloaded.
    pub models: u64,
    /// `nrt_get_model_tensor_info` arrays not yet freed.
    pub tensor_info_arrays: u64,
    /// Bytes of storage the live tensors hold (an allocation counts once however many slices
    /// view it, and stays counted while a slice outlives its parent).
    pub bytes: u64,
}

/// One NeuronCore's device memory (HBM).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CoreMemory {
    /// The NeuronCore (relative to the visible ones).
    pub core: u32,
    /// Bytes in use on it now: live device tensors (an allocation counts once, however many
    /// slices view it) and what its loaded models hold (their private bytes and the shared
    /// scratchpad).
    pub used: u64,
    /// The most that was in use at once since the library was loaded or the counters reset.
    pub peak: u64,
    /// What it holds (`NRT_SIM_HBM_BYTES`, 16 GiB by default); an allocation past it fails with
    /// `NRT_RESOURCE`.
    pub capacity: u64,
    /// Of `used`, the shared scratchpad of the models loaded on it (the largest one's).
    pub scratch: u64,
}

/// One live model.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelCounters {
    /// The handle (`nrt_model_t*` as an integer).
    pub handle: u64,
    /// The model's name: the HLO module's name (the graph's, e.g. `decode_b1_c64`).
    pub name: String,
    /// Completed executions of this handle since load (or the last reset).
    pub executions: u64,
    /// The NeuronCore it is loaded on.
    pub core: u32,
    /// Its code, DMA rings and collectives buffers, held in its core's HBM while it is loaded
    /// (`deepinfer::backend::neuron::footprint`).
    pub private_bytes: u64,
    /// The scratchpad it needs; its core's shared scratchpad holds the largest of its models'.
    pub scratch_bytes: u64,
}

/// A snapshot of the simulator's counters.
///
/// Cumulative fields count since the library was loaded or [`crate::SimLibrary::reset`] (the C
/// function `nrt_sim_reset_counters`) was last called; `live` and `models` describe objects
/// and are never reset. The fault counters behind `NRT_SIM_FAIL_*` restart at each
/// `nrt_init` and are not affected by a reset either.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Counters {
    /// Between `nrt_init` and `nrt_close`.
    pub initialized: bool,
    /// Objects alive now.
    pub live: Live,
    /// Bytes requested by `nrt_tensor_allocate` (slices allocate nothing).
    pub total_bytes_allocated: u64,
    /// Successful `nrt_tensor_allocate` calls.
    pub tensors_allocated: u64,
    /// Bytes written with `nrt_tensor_write`, by the name the written tensor was allocated
    /// (or sliced) with; execution outputs are not counted here.
    pub tensor_bytes_written: BTreeMap<String, u64>,
    /// Bytes read with `nrt_tensor_read`, by tensor name.
    pub tensor_bytes_read: BTreeMap<String, u64>,
    /// Completed executions by model name (kept after the model is unloaded).
    pub executions: BTreeMap<String, u64>,
    /// Live models and their execution counts.
    pub models: Vec<ModelCounters>,
    /// Every `nrt_execute` call, failed ones included.
    pub execute_calls: u64,
    /// `nrt_execute` calls that did not return `NRT_SUCCESS` (injected faults included).
    pub execute_failures: u64,
    /// Successful loads.
    pub loads: u64,
    /// Failed loads (corrupt modules, injected faults, bad arguments).
    pub load_failures: u64,
    /// Calls that failed, of any function (a failing `void` function such as a double
    /// `nrt_tensor_free` counts too).
    pub errors: u64,
    /// Of those, calls given a null, freed or foreign handle (`NRT_INVALID_HANDLE`).
    pub invalid_handle_uses: u64,
    /// The last failure: `"<function>: <STATUS> (<code>): <why>"`.
    pub last_error: Option<String>,
    /// What was still alive (and then released) at the last `nrt_close`.
    pub live_at_last_close: Option<Live>,
    /// Device memory per NeuronCore: in use, peak and capacity.
    pub hbm: Vec<CoreMemory>,
}

impl Counters {
    /// Bytes written through `nrt_tensor_write` to tensors named `name`.
    pub fn bytes_written(&self, name: &str) -> u64 {
        self.tensor_bytes_written.get(name).copied().unwrap_or(0)
    }

    /// Bytes read through `nrt_tensor_read` from tensors named `name`.
    pub fn bytes_read(&self, name: &str) -> u64 {
        self.tensor_bytes_read.get(name).copied().unwrap_or(0)
    }

    /// The peak device memory of NeuronCore `core` (0 for a core nrt-sim does not have).
    pub fn hbm_peak(&self, core: u32) -> u64 {
        self.hbm
            .iter()
            .find(|m| m.core == core)
            .map_or(0, |m| m.peak)
    }

    /// Completed executions of models named `name`.
    pub fn executions_of(&self, name: &str) -> u64 {
        self.executions.get(name).copied().unwrap_or(0)
    }
}
