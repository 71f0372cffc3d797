//! nrt-sim: a libnrt-compatible shared library (`libnrt_sim.so`) for tests.
//!
//! It exports the C functions `neuron_sys::Library` resolves — every one of
//! `neuron_sys::REQUIRED_SYMBOLS` and `neuron_sys::OPTIONAL_SYMBOLS`, with the signatures of
//! `neuron-sys/include/nrt_deepinfer.h` (checked at compile time against neuron-sys's
//! function-pointer types) — so tests take the real loading path: `dlopen`, `dlsym`, raw C
//! calls, tensor sets, slices, aliasing. Point `NEURON_RT_LIB` at it, or open it with
//! `neuron_sys::Library::open(path)`.
//!
//! # The compiler and the NEFF
//!
//! A NEFF for nrt-sim is its own container
//! ([`deepinfer::backend::neuron::sim_neff`]: magic, format version, the I/O names, deepinfer's
//! serialized `HloModuleProto`), written by the stand-in compiler `nrt-sim-neuronx-cc`, which
//! the compile driver runs exactly as it runs neuronx-cc (same command line, same NEFF cache).
//! The stand-in names the NEFF's tensors after the convention it is told to mimic
//! (`NRT_SIM_NEFF_NAMES` or its `--nrt-sim-neff-names` flag: `ours`, the HLO's
//! `neff_input_names` / `neff_output_names` verbatim; `must-alias`, the default, with
//! `.must_alias_input` on every aliased parameter; `positional`, `input{i}` / `output{i}`), so
//! the runner's binding by reported names is tested against each. `nrt_load` accepts nothing
//! else: raw HLO bytes are `NRT_INVALID`.
//!
//! `nrt_load` imports the HLO back into a graph
//! ([`deepinfer::backend::hlo::import::import_bytes`]); `nrt_execute` reads the bound input
//! bytes into candle tensors, runs [`deepinfer::backend::cpu::run`], and writes each output
//! into the bytes bound under its name. A tensor bound both as a cache-root input and as its
//! aliased output (the same `nrt_tensor_t*` in both sets) is updated in place: the output is
//! written into the bytes the input was read from, with no snapshot in between, and a view of
//! the parameter read after its update still sees the old value, as XLA specifies.
//!
//! # As strict as libnrt
//!
//! Every rule is always on, so every test that runs on nrt-sim runs against them:
//!
//! - **HBM per NeuronCore**: [`DEFAULT_HBM_BYTES`] (16 GiB, trn1) per core, or
//!   `NRT_SIM_HBM_BYTES`; a device allocation past it is `NRT_RESOURCE`. Slices allocate
//!   nothing; host tensors are not HBM. Each loaded model holds its code, DMA rings and
//!   collectives buffers, and each core one scratchpad, the largest of its models', as the
//!   runtime's device-memory guide describes
//!   ([`deepinfer::backend::neuron::footprint`], from the NEFF's HLO): a load that does not
//!   fit is `NRT_RESOURCE` naming the model. The counters report use, peak, capacity and
//!   scratchpad per core, and each model's charge.
//! - **The collectives bootstrap**: `nrt_load_collectives` with more than one device returns
//!   only once every rank of the group has entered the load of the same model, as libnrt's
//!   communicator setup needs; a rank left alone fails with `NRT_TIMEOUT` after
//!   `NRT_SIM_COLLECTIVE_TIMEOUT_MS`, naming the missing ranks (a runner that loads its ranks
//!   one after another hangs on a trn1; here it fails).
//! - **`nrt_tensor_memset`** sets device bytes without counting them as written: zeroing a
//!   cache root sends nothing over the bus.
//! - **Cores**: a device tensor remembers its NeuronCore (a slice its parent's), and executing a
//!   model with a tensor of another core bound is `NRT_INVALID` (libnrt refuses the set:
//!   "Tensor ... allocated on vnc 0 must be allocated on same vnc as model (1)").
//! - **Declared aliases only**: an input and an output bound to overlapping bytes must be a
//!   declared alias bound to the very same bytes, and two outputs may not overlap: otherwise
//!   `NRT_INVALID` (on a device the result would depend on the schedule).
//! - **Uninitialised memory**: fresh allocations hold [`FILL_BYTE`] (0xFF: NaN as f32/bf16, -1
//!   as i32), not zeros, so a read of never-written memory is visible.
//!
//! Sources and reasoning for each are in the `execute`, `tensor` and `config` modules.
//!
//! # What it reports
//!
//! | Call | Answer |
//! |---|---|
//! | `nrt_get_version` | [`VERSION`] = 2.34.0.0, `git_hash` `"nrt-sim"`, `rt_detail` naming the crate |
//! | `nrt_get_{total,visible}_{nc,vnc}_count` | [`nc_count`]: `NRT_SIM_NC_COUNT` (1 to 64), default 2 (a trn1.2xlarge) |
//! | `nrt_get_model_tensor_info` | inputs (usage input, parameter order) then outputs (usage output, result order): name, bytes, dtype code, shape |
//! | `nrt_get_status_as_str` | the name from neuron-sys's status table, or `NRT_STATUS_UNKNOWN` |
//!
//! **dtype codes**: the *hardware-code* encoding (`neuron_sys::sys::dtype::hw`: FLOAT32 =
//! 0xA, BFLOAT16 = 0x6, FLOAT16 = 0x7, INT32 = 0x8, UINT32 = 0x9, UINT8 = 0x3; a `pred`
//! is reported as UINT8, as libnrt does), see [`dtype_code`]. That is the table
//! `neuron_sys::sys::dtype::DtypeEncoding::for_runtime(2, 34)` picks for the version nrt-sim
//! reports, so a reader that follows neuron-sys's rule decodes it right. 2.34 is the
//! runtime whose headers the bindings' layouts were checked against.
//!
//! # Status codes for each misuse
//!
//! | Misuse | Status |
//! |---|---|
//! | any call (other than version, core counts, status names) before `nrt_init` | `NRT_UNINITIALIZED` (13) |
//! | … after `nrt_close` | `NRT_CLOSED` (14) |
//! | `nrt_init` twice without `nrt_close`; a malformed `NRT_SIM_*` value | `NRT_INVALID` (2) |
//! | a null, freed (use after free, double free) or foreign tensor / set / model handle | `NRT_INVALID_HANDLE` (3) |
//! | `nrt_tensor_free` / `nrt_destroy_tensor_set` of a freed handle (they return `void`) | recorded as `NRT_INVALID_HANDLE` in the counters, otherwise ignored |
//! | `nrt_tensor_get_size` of a freed tensor (returns `size_t`) | 0, recorded as `NRT_INVALID_HANDLE` |
//! | `nrt_free_model_tensor_info` twice, or of a pointer it did not return | `NRT_INVALID_HANDLE` |
//! | read / write / slice range outside the tensor; null buffer or out-pointer | `NRT_INVALID` |
//! | device tensor on a core outside `0..2`; unknown placement | `NRT_INVALID` |
//! | `nrt_get_tensor_from_tensor_set` of an unbound name | `NRT_FAILURE` (1), as libnrt reports it |
//! | tensor names of 256 bytes or more | `NRT_INVALID` |
//! | `nrt_load` of bytes that are not an nrt-sim NEFF (raw HLO, a real NEFF, corrupt, truncated, empty), or whose HLO cannot run | `NRT_INVALID` |
//! | `nrt_load` of an nrt-sim NEFF of another format version | `NRT_UNSUPPORTED_NEFF_VERSION` (10) |
//! | `nrt_load` on a core outside the visible ones | `NRT_LOAD_NOT_ENOUGH_NC` (9) |
//! | `nrt_execute` with an input or output not bound, or bound to a tensor of the wrong size | `NRT_INVALID` (libnrt: "input tensor name/size does not match the model"); nothing is written |
//! | `nrt_execute` with a freed tensor still bound in a set | `NRT_INVALID_HANDLE` |
//! | `nrt_execute` with a device tensor of another NeuronCore than the model's bound | `NRT_INVALID`; nothing is written |
//! | `nrt_execute` with an input and an output (not a declared alias on the same bytes), or two outputs, bound to overlapping bytes | `NRT_INVALID`; nothing is written |
//! | a device allocation past the core's HBM (`NRT_SIM_HBM_BYTES`, default 16 GiB) | `NRT_RESOURCE` (4) |
//! | the CPU backend rejects the data (say, a token id outside the vocabulary) | `NRT_EXEC_BAD_INPUT` (1002) |
//! | out of host memory for an allocation | `NRT_RESOURCE` (4) |
//! | a panic inside nrt-sim (a bug) | `NRT_FAILURE`, caught at the boundary |
//!
//! Every failure also increments `errors` in the counters and sets `last_error` to a
//! message naming the call, the status and what was wrong (`nrt_execute: NRT_INVALID (2):
//! input `kv_cache` is bound to a tensor of 16 bytes; model `decode_b1_c64` needs 130560
//! (f32 [272, 120])`), which is the first thing to look at when a test fails.
//!
//! Handles are generation-checked registry slots, not pointers (see the `handle` module):
//! misuse is detected and answered with a status, never undefined behaviour.
//!
//! # Faults on demand
//!
//! Read from the environment at `nrt_init` (each `nrt_init` re-reads them and restarts
//! their counts; libnrt reads its `NEURON_RT_*` variables there too). A malformed value
//! makes `nrt_init` fail with `NRT_INVALID`, so a typo cannot silently disable a fault.
//!
//! | Variable | Effect |
//! |---|---|
//! | `NRT_SIM_FAIL_EXECUTE=N` | the N-th execution (1-based, counting `nrt_execute` calls whose bindings validated) returns `NRT_EXEC_COMPLETED_WITH_ERR` (1004) and writes nothing; later ones succeed |
//! | `NRT_SIM_FAIL_LOAD=N` | the N-th load of a valid module (1-based) returns `NRT_RESOURCE` (4, what a real load that runs out of device memory returns); later ones succeed. `NRT_SIM_FAIL_LOAD=1` fails the first load |
//! | `NRT_SIM_SLOW_EXECUTE_MS=n` | every execution sleeps n ms after validating its bindings |
//! | `NRT_SIM_SLOW_EXECUTE_MODELS=a,b` | only executions of models whose name contains `a` or `b` sleep (with `NRT_SIM_FREE_EXECUTE`: a device step of a known length that leaves the host's CPUs free) |
//! | `NRT_SIM_FREE_EXECUTE=1` | executions validate their bindings (names, sizes, handles, cores, sharing) and return success without copying or computing anything: outputs are left as they were. For measuring host overhead |
//! | `NRT_SIM_HBM_BYTES=n` | each NeuronCore holds n bytes of device memory (default [`DEFAULT_HBM_BYTES`], 16 GiB); not a fault, but read with them |
//!
//! `0` or empty disables a variable. Because libnrt allows one `nrt_init` per process at a
//! time and tests run in threads, fault tests run in a child process with the variable set
//! (see `tests/faults.rs`).
//!
//! # Counters
//!
//! Two extra C functions, and a Rust reader for them:
//!
//! - `size_t nrt_sim_counters_json(char *buf, size_t len)`: the counters as JSON, written
//!   like `snprintf` (returns the full length; retry with a bigger buffer if it is `>= len`).
//! - `void nrt_sim_reset_counters(void)`: clears the cumulative counters.
//!
//! JSON rather than a `#[repr(C)]` struct because the counters are keyed by tensor and model
//! names. The fields are [`Counters`]: bytes written and read per tensor name (through
//! `nrt_tensor_write` / `nrt_tensor_read`), executions per model name and per live model
//! handle, live tensors / sets / models / info arrays / bytes, total bytes allocated, loads,
//! execute calls and failures, errors, invalid-handle uses, the last error, what was
//! alive at the last `nrt_close`, and device memory per NeuronCore (in use, peak, capacity). From
//! Rust, [`SimLibrary::open`] the same `.so` the test loaded and call [`SimLibrary::counters`] /
//! [`SimLibrary::reset`]; [`library_next_to_current_exe`] finds the file cargo built.
//!
//! # Limits
//!
//! - Each execution copies every input (weights included) into candle and every output back:
//!   fine for the tiny fixtures; use `NRT_SIM_FREE_EXECUTE` to measure host overhead alone.
//! - Device memory is host memory filled with [`FILL_BYTE`], counted against each core's HBM
//!   capacity; what a loaded model itself costs on a device (code, DMA rings, scratchpad) is not
//!   counted. Placement and cores are checked, not simulated.
//! - The NEFF names are whatever the chosen convention gives; which one neuronx-cc really
//!   follows for our HLO is not published (see `deepinfer::backend::hlo::MUST_ALIAS_SUFFIX`).
//! - No collectives and no asynchronous API (`nrta_*`), which neuron-sys does not bind.

#![deny(missing_docs)]
#![deny(clippy::unwrap_used)]
#![deny(unsafe_op_in_unsafe_fn)]
#![deny(clippy::undocumented_unsafe_blocks)]

// Modules by concern. Imports point one way, down this order (no module imports one above
// it, and none imports the crate root):
//   leaves:   identity, handle, counters, c_text, fault_child
//   fail (handle); config (fail); model_io (c_text, fail, identity); reader (counters)
//   state (config, counters, fail, handle, identity, model_io); boundary (fail, state);
//   device (fail, model_io, state)
//   safe bodies over the state: runtime, model, tensor, tensor_set, execute (and device)
//   ffi: the `extern "C"` shells over all of the above
mod bootstrap;
mod boundary;
mod c_text;
mod config;
mod counters;
mod device;
mod execute;
mod fail;
mod fault_child;
pub mod ffi;
mod handle;
mod identity;
mod model;
mod model_io;
mod reader;
mod runtime;
mod state;
mod tensor;
mod tensor_set;

pub use config::{
    DEFAULT_COLLECTIVE_TIMEOUT, DEFAULT_HBM_BYTES, ENV_COLLECTIVE_TIMEOUT_MS, ENV_FAIL_EXECUTE,
    ENV_FAIL_LOAD, ENV_FREE_EXECUTE, ENV_HBM_BYTES, ENV_SLOW_EXECUTE_MODELS, ENV_SLOW_EXECUTE_MS,
};
pub use counters::{CoreMemory, Counters, Live, ModelCounters};
pub use fault_child::{is_fault_child, run_test_in_child, CHILD_ENV};
pub use identity::{
    dtype_code, nc_count, DEFAULT_NC_COUNT, ENV_NC_COUNT, MAX_NC_COUNT, VERSION, VERSION_DETAIL,
    VERSION_GIT_HASH,
};
pub use reader::{library_next_to_current_exe, Error, SimLibrary};
pub use tensor::FILL_BYTE;

/// Clears the cumulative counters of the nrt-sim copy linked into the caller (the Rust
/// twin of `nrt_sim_reset_counters`; for a `dlopen`ed library use [`SimLibrary::reset`]).
pub fn reset_counters() {
    runtime::reset_counters();
}
