//! The exported C functions: libnrt's (every symbol `neuron_sys::Library` resolves, with the
//! signatures of `neuron-sys/include/nrt_deepinfer.h`) and nrt-sim's test hooks.
//!
//! Each function is a thin shell: it checks and converts the raw arguments (the only
//! `unsafe` here: reading the caller's strings and buffers, writing its out-pointers), calls
//! a safe body in the module of its concern (`runtime`, `model`, `tensor`, `tensor_set`,
//! `execute`) that returns a `Result` (a status and a message on failure), and runs it under
//! the boundary's guard (`boundary`), which turns a panic into `NRT_FAILURE` and records
//! every failure in the counters (`errors`, `last_error`), including failures of the `void`
//! functions (`nrt_close`, `nrt_tensor_free`, `nrt_destroy_tensor_set`), which cannot
//! return one.
//!
//! The signatures are checked at compile time against neuron-sys's function-pointer types
//! (the block at the end of this file), which bindgen derives from the same header: a
//! drifted parameter type fails the build here rather than corrupting a caller's stack.

use std::ffi::{c_char, c_int, c_void};
use std::panic::catch_unwind;
use std::ptr;

use neuron_sys::sys::{
    self, nrt_framework_type_t, nrt_model_t, nrt_tensor_info_array_t, nrt_tensor_placement_t,
    nrt_tensor_set_t, nrt_tensor_t, nrt_version_t, NRT_STATUS,
};

use crate::boundary::{catch, guard, guard_tallied, guard_value, guard_void, non_null, Tally};
use crate::c_text::opt_str;
use crate::fail::Fail;
use crate::handle::Handle;
use crate::identity::nc_count;
use crate::tensor::{Io, Window};
use crate::{execute, model, runtime, tensor, tensor_set};

// === Runtime ===

/// Initialises the simulated runtime and reads the `NRT_SIM_*` fault variables (see the
/// crate docs). A second `nrt_init` without `nrt_close` is `NRT_INVALID`; after
/// `nrt_close`, `nrt_init` may run again (with a fresh fault configuration).
///
/// # Safety
///
/// `fw_version` and `fal_version` are null or NUL-terminated strings (they are not read).
#[no_mangle]
pub unsafe extern "C" fn nrt_init(
    framework: nrt_framework_type_t,
    fw_version: *const c_char,
    fal_version: *const c_char,
) -> NRT_STATUS {
    let _ = (fw_version, fal_version);
    guard("nrt_init", || runtime::init(framework))
}

/// Closes the simulated runtime. Every tensor, tensor set and model still alive is
/// released and its handle goes stale (recorded in `live_at_last_close`); tensor-info
/// arrays stay valid until `nrt_free_model_tensor_info`.
///
/// # Safety
///
/// No other thread may be using handles of this runtime (they become invalid).
#[no_mangle]
pub unsafe extern "C" fn nrt_close() {
    guard_void("nrt_close", runtime::close)
}

/// Total NeuronCores: [`nc_count`] (`NRT_SIM_NC_COUNT`, default 2). Callable before `nrt_init`.
///
/// # Safety
///
/// `vnc_count` is null (then `NRT_INVALID`) or valid for writing one `u32`.
#[no_mangle]
pub unsafe extern "C" fn nrt_get_total_nc_count(vnc_count: *mut u32) -> NRT_STATUS {
    guard("nrt_get_total_nc_count", || {
        non_null(vnc_count, "vnc_count")?;
        // SAFETY: non-null and writable (the caller's contract).
        unsafe { vnc_count.write(nc_count()) };
        Ok(())
    })
}

/// Visible NeuronCores: [`nc_count`] (all of them). Callable before `nrt_init`.
///
/// # Safety
///
/// `vnc_count` is null (then `NRT_INVALID`) or valid for writing one `u32`.
#[no_mangle]
pub unsafe extern "C" fn nrt_get_visible_nc_count(vnc_count: *mut u32) -> NRT_STATUS {
    guard("nrt_get_visible_nc_count", || {
        non_null(vnc_count, "vnc_count")?;
        // SAFETY: non-null and writable (the caller's contract).
        unsafe { vnc_count.write(nc_count()) };
        Ok(())
    })
}

/// The newer spelling of [`nrt_get_total_nc_count`].
///
/// # Safety
///
/// `vnc_count` is null (then `NRT_INVALID`) or valid for writing one `u32`.
#[no_mangle]
pub unsafe extern "C" fn nrt_get_total_vnc_count(vnc_count: *mut u32) -> NRT_STATUS {
    // SAFETY: same contract.
    unsafe { nrt_get_total_nc_count(vnc_count) }
}

/// The newer spelling of [`nrt_get_visible_nc_count`].
///
/// # Safety
///
/// `vnc_count` is null (then `NRT_INVALID`) or valid for writing one `u32`.
#[no_mangle]
pub unsafe extern "C" fn nrt_get_visible_vnc_count(vnc_count: *mut u32) -> NRT_STATUS {
    // SAFETY: same contract.
    unsafe { nrt_get_visible_nc_count(vnc_count) }
}

/// NeuronCore `vnc`'s device memory (`runtime::memory_stats`): `bytes_used` and
/// `bytes_limit`. `stats_size_in` must hold the 16-byte struct; `*stats_size_out` is set to
/// the bytes written. Before `nrt_init`, or for a core that does not exist, `NRT_INVALID`.
///
/// # Safety
///
/// `stats` and `stats_size_out` are null (then `NRT_INVALID`) or valid for writing
/// `stats_size_in` bytes and one `size_t`.
#[no_mangle]
pub unsafe extern "C" fn nrt_get_vnc_memory_stats(
    vnc: u32,
    stats: *mut sys::nrt_vnc_memory_stats_t,
    stats_size_in: usize,
    stats_size_out: *mut usize,
) -> NRT_STATUS {
    guard("nrt_get_vnc_memory_stats", || {
        non_null(stats, "stats")?;
        non_null(stats_size_out, "stats_size_out")?;
        let size = std::mem::size_of::<sys::nrt_vnc_memory_stats_t>();
        if stats_size_in < size {
            return Err(Fail::invalid(format!(
                "stats_size_in {stats_size_in} is smaller than nrt_vnc_memory_stats_t ({size} bytes)"
            )));
        }
        let (used, limit) = runtime::memory_stats(vnc)?;
        let to_size = |b: u64| usize::try_from(b).unwrap_or(usize::MAX);
        // SAFETY: both non-null and writable for what is written (the caller's contract;
        // stats_size_in covers the struct).
        unsafe {
            stats.write(sys::nrt_vnc_memory_stats_t {
                bytes_used: to_size(used),
                bytes_limit: to_size(limit),
            });
            stats_size_out.write(size);
        }
        Ok(())
    })
}

/// Writes [`crate::VERSION`] (which selects the hardware-code dtype table in neuron-sys;
/// see [`crate::dtype_code`]). Callable before `nrt_init`. `size` must be at least
/// `sizeof(nrt_version_t)` (224); only that many bytes are written.
///
/// # Safety
///
/// `ver` is null (then `NRT_INVALID`) or valid for writing `size` bytes.
#[no_mangle]
pub unsafe extern "C" fn nrt_get_version(ver: *mut nrt_version_t, size: usize) -> NRT_STATUS {
    guard("nrt_get_version", || {
        non_null(ver, "ver")?;
        let v = runtime::version(size)?;
        // SAFETY: non-null and writable for `size >= size_of::<nrt_version_t>()` bytes (the
        // body checked the size); the caller's buffer has no alignment promise, hence
        // write_unaligned.
        unsafe { ver.write_unaligned(v) };
        Ok(())
    })
}

/// The status's name (`"NRT_EXEC_BAD_INPUT"`), or `"NRT_STATUS_UNKNOWN"`. The string is
/// static: the caller must not free it.
///
/// # Safety
///
/// None beyond the C ABI: any value is accepted.
#[no_mangle]
pub unsafe extern "C" fn nrt_get_status_as_str(status: NRT_STATUS) -> *const c_char {
    catch("nrt_get_status_as_str", || {
        Ok(runtime::status_name(status).as_ptr())
    })
    .unwrap_or(runtime::UNKNOWN_STATUS.as_ptr())
}

// === Models ===

/// Shared shell of the two load functions: `check_context` runs after the out-pointer check
/// and before the NEFF is looked at.
///
/// # Safety
///
/// As [`nrt_load`].
unsafe fn load_shell(
    call: &str,
    neff_bytes: *const c_void,
    size: usize,
    vnc: i32,
    vnc_count: i32,
    model: *mut *mut nrt_model_t,
    collectives: Option<model::CollectivesContext>,
) -> NRT_STATUS {
    guard_tallied(call, Tally::Load, || {
        non_null(model, "model")?;
        if let Some(c) = collectives {
            model::check_collectives_context(c.device_id, c.device_count)?;
        }
        if neff_bytes.is_null() || size == 0 {
            return Err(Fail::invalid("the NEFF is empty"));
        }
        // SAFETY: non-null, and readable for `size` bytes for the whole call (the caller's
        // contract); it is only read, and not kept after the call.
        let neff = unsafe { std::slice::from_raw_parts(neff_bytes.cast::<u8>(), size) };
        let h = model::load(neff, vnc, vnc_count, collectives)?;
        // SAFETY: non-null and writable (the caller's contract).
        unsafe { model.write(h.to_ptr()) };
        Ok(())
    })
}

/// Loads a NEFF, which for nrt-sim is its own container written by its stand-in compiler
/// (`deepinfer::backend::neuron::sim_neff`: the I/O names and deepinfer's serialized
/// `HloModuleProto`): the HLO is imported back into a graph, which `nrt_execute` runs on the CPU
/// backend. Anything else (raw HLO included) is `NRT_INVALID`; a container of another format
/// version `NRT_UNSUPPORTED_NEFF_VERSION`. `vnc` is `-1` (core 0) or a visible core;
/// `vnc_count` is `-1` or at least 1.
///
/// # Safety
///
/// `neff_bytes` is null or readable for `size` bytes; `model` is null (then
/// `NRT_INVALID`) or valid for writing one pointer.
#[no_mangle]
pub unsafe extern "C" fn nrt_load(
    neff_bytes: *const c_void,
    size: usize,
    vnc: i32,
    vnc_count: i32,
    model: *mut *mut nrt_model_t,
) -> NRT_STATUS {
    // SAFETY: the same contract.
    unsafe { load_shell("nrt_load", neff_bytes, size, vnc, vnc_count, model, None) }
}

/// [`nrt_load`] for a collectives NEFF: rank `ctx_device_id` of `ctx_device_count`. The models
/// of one graph loaded for the same device count form a group; an execution of one rank
/// blocks at each collective until every rank of the group executes the same step, and a
/// failure on one rank fails that step on all (see `execute`). Needs `NEURON_RT_ROOT_COMM_ID`
/// (`host:port`), as libnrt does; `ctx_device_id < ctx_device_count`, and a graph with
/// collectives must have `ctx_device_count` replicas.
///
/// # Safety
///
/// As [`nrt_load`].
#[no_mangle]
pub unsafe extern "C" fn nrt_load_collectives(
    neff_bytes: *const c_void,
    size: usize,
    vnc: i32,
    vnc_count: i32,
    ctx_device_id: u32,
    ctx_device_count: u32,
    model: *mut *mut nrt_model_t,
) -> NRT_STATUS {
    // SAFETY: the same contract.
    unsafe {
        load_shell(
            "nrt_load_collectives",
            neff_bytes,
            size,
            vnc,
            vnc_count,
            model,
            Some(model::CollectivesContext {
                device_id: ctx_device_id,
                device_count: ctx_device_count,
            }),
        )
    }
}

/// Unloads a model. A freed or foreign handle is `NRT_INVALID_HANDLE`.
///
/// # Safety
///
/// None beyond the C ABI: the handle is never dereferenced.
#[no_mangle]
pub unsafe extern "C" fn nrt_unload(model: *mut nrt_model_t) -> NRT_STATUS {
    guard("nrt_unload", || model::unload(Handle::from_ptr(model)))
}

/// The model's inputs (usage input, in parameter order), then its outputs (usage output,
/// in result order): names, byte sizes, dtype codes ([`crate::dtype_code`]), shapes. The
/// array belongs to the caller until [`nrt_free_model_tensor_info`].
///
/// # Safety
///
/// `tensor_info` is null (then `NRT_INVALID`) or valid for writing one pointer.
#[no_mangle]
pub unsafe extern "C" fn nrt_get_model_tensor_info(
    model: *mut nrt_model_t,
    tensor_info: *mut *mut nrt_tensor_info_array_t,
) -> NRT_STATUS {
    guard("nrt_get_model_tensor_info", || {
        non_null(tensor_info, "tensor_info")?;
        let p = model::tensor_info(Handle::from_ptr(model))?;
        // SAFETY: non-null and writable (the caller's contract).
        unsafe { tensor_info.write(p) };
        Ok(())
    })
}

/// Frees an array from [`nrt_get_model_tensor_info`]. A pointer nrt-sim did not hand out,
/// or one already freed, is `NRT_INVALID_HANDLE` (it is looked up by address, never
/// dereferenced). Allowed after `nrt_close`.
///
/// # Safety
///
/// None beyond the C ABI: the pointer is only compared.
#[no_mangle]
pub unsafe extern "C" fn nrt_free_model_tensor_info(
    tensor_info: *mut nrt_tensor_info_array_t,
) -> NRT_STATUS {
    guard("nrt_free_model_tensor_info", || {
        non_null(tensor_info, "tensor_info")?;
        model::free_tensor_info(tensor_info.addr())
    })
}

// === Tensors ===

/// Allocates `size` bytes filled with [`crate::FILL_BYTE`] (device memory is not cleared).
/// Device placement needs a visible core (`0 .. nc_count()`, see `NRT_SIM_NC_COUNT`) with room in its HBM
/// (`NRT_SIM_HBM_BYTES`, else `NRT_RESOURCE`); host and virtual placements ignore `vnc`. The
/// name (optional) is the key of the byte counters. Out of host memory is `NRT_RESOURCE`.
///
/// # Safety
///
/// `name` is null or a NUL-terminated string; `tensor` is null (then `NRT_INVALID`) or
/// valid for writing one pointer.
#[no_mangle]
pub unsafe extern "C" fn nrt_tensor_allocate(
    tensor_placement: nrt_tensor_placement_t,
    vnc: c_int,
    size: usize,
    name: *const c_char,
    tensor: *mut *mut nrt_tensor_t,
) -> NRT_STATUS {
    // SAFETY: null or NUL-terminated (the caller's contract).
    let name = unsafe { opt_str(name) };
    guard("nrt_tensor_allocate", || {
        non_null(tensor, "tensor")?;
        let h = tensor::allocate(tensor_placement, vnc, size, name)?;
        // SAFETY: non-null and writable (the caller's contract).
        unsafe { tensor.write(h.to_ptr()) };
        Ok(())
    })
}

/// A view of bytes `offset .. offset + size` of `tensor_source`, sharing its storage: writes
/// through either are visible through the other, and the storage lives until the last
/// tensor viewing it is freed (freeing the parent first is allowed). A range outside the
/// source is `NRT_INVALID`. Without a name, the slice is named `parent[start..end]`.
///
/// # Safety
///
/// `name` is null or a NUL-terminated string; `tensor_slice` is null (then `NRT_INVALID`)
/// or valid for writing one pointer.
#[no_mangle]
pub unsafe extern "C" fn nrt_tensor_allocate_slice(
    tensor_source: *const nrt_tensor_t,
    offset: usize,
    size: usize,
    name: *const c_char,
    tensor_slice: *mut *mut nrt_tensor_t,
) -> NRT_STATUS {
    // SAFETY: null or NUL-terminated (the caller's contract).
    let name = unsafe { opt_str(name) };
    guard("nrt_tensor_allocate_slice", || {
        non_null(tensor_slice, "tensor_slice")?;
        let h = tensor::slice(Handle::from_ptr(tensor_source), offset, size, name)?;
        // SAFETY: non-null and writable (the caller's contract).
        unsafe { tensor_slice.write(h.to_ptr()) };
        Ok(())
    })
}

/// Frees a tensor and nulls `*tensor`. A null `*tensor` is a no-op; a freed or foreign one
/// (double free, use after free) is recorded as `NRT_INVALID_HANDLE` in the counters and
/// otherwise ignored. The storage outlives the handle while slices view it.
///
/// # Safety
///
/// `tensor` is null or valid for reading and writing one pointer.
#[no_mangle]
pub unsafe extern "C" fn nrt_tensor_free(tensor: *mut *mut nrt_tensor_t) {
    guard_void("nrt_tensor_free", || {
        non_null(tensor, "tensor")?;
        // SAFETY: non-null and readable (the caller's contract).
        let t = unsafe { tensor.read() };
        if t.is_null() {
            return Ok(());
        }
        tensor::free(Handle::from_ptr(t))?;
        // SAFETY: non-null and writable (the caller's contract).
        unsafe { tensor.write(ptr::null_mut()) };
        Ok(())
    })
}

/// Copies bytes `offset .. offset + size` of the tensor into `buf`. Out of range is
/// `NRT_INVALID`; a freed tensor is `NRT_INVALID_HANDLE`. Counted in `tensor_bytes_read`.
///
/// # Safety
///
/// `buf` is valid for writing `size` bytes (it may be null when `size` is 0).
#[no_mangle]
pub unsafe extern "C" fn nrt_tensor_read(
    tensor: *const nrt_tensor_t,
    buf: *mut c_void,
    offset: usize,
    size: usize,
) -> NRT_STATUS {
    let call = "nrt_tensor_read";
    guard(call, || {
        if buf.is_null() && size > 0 {
            return Err(Fail::invalid("buf is null"));
        }
        let window = Window::open(call, Handle::from_ptr(tensor), offset, size, Io::Read)?;
        if size > 0 {
            window.with_bytes(|src| {
                // SAFETY: `buf` is writable for `size == src.len()` bytes (the caller's
                // contract) and cannot overlap nrt-sim's storage, whose address is never
                // handed out.
                unsafe { ptr::copy_nonoverlapping(src.as_ptr(), buf.cast::<u8>(), src.len()) }
            });
        }
        Ok(())
    })
}

/// Copies `size` bytes from `buf` into the tensor at `offset`. Out of range is
/// `NRT_INVALID`; a freed tensor is `NRT_INVALID_HANDLE`. Counted in
/// `tensor_bytes_written`.
///
/// # Safety
///
/// `buf` is valid for reading `size` bytes (it may be null when `size` is 0).
#[no_mangle]
pub unsafe extern "C" fn nrt_tensor_write(
    tensor: *mut nrt_tensor_t,
    buf: *const c_void,
    offset: usize,
    size: usize,
) -> NRT_STATUS {
    let call = "nrt_tensor_write";
    guard(call, || {
        if buf.is_null() && size > 0 {
            return Err(Fail::invalid("buf is null"));
        }
        let window = Window::open(call, Handle::from_ptr(tensor), offset, size, Io::Write)?;
        if size > 0 {
            window.with_bytes_mut(|dst| {
                // SAFETY: `buf` is readable for `size == dst.len()` bytes (the caller's
                // contract) and cannot overlap nrt-sim's storage, whose address is never
                // handed out.
                unsafe { ptr::copy_nonoverlapping(buf.cast::<u8>(), dst.as_mut_ptr(), dst.len()) }
            });
        }
        Ok(())
    })
}

/// Sets `size` bytes of the tensor at `offset` to the low byte of `value` (as C's `memset`
/// converts it), on the device: no bytes are counted in `tensor_bytes_written`. Out of range
/// is `NRT_INVALID`; a freed tensor is `NRT_INVALID_HANDLE`.
///
/// # Safety
///
/// None beyond the C ABI: the handle is never dereferenced.
#[no_mangle]
pub unsafe extern "C" fn nrt_tensor_memset(
    tensor: *mut nrt_tensor_t,
    offset: u64,
    value: c_int,
    size: usize,
) -> NRT_STATUS {
    let call = "nrt_tensor_memset";
    guard(call, || {
        let offset = usize::try_from(offset)
            .map_err(|_| Fail::invalid(format!("offset {offset} is out of range")))?;
        let window = Window::open(call, Handle::from_ptr(tensor), offset, size, Io::Fill)?;
        window.with_bytes_mut(|dst| dst.fill(value as u8));
        Ok(())
    })
}

/// The tensor's size in bytes; 0 for a freed or foreign tensor (recorded as
/// `NRT_INVALID_HANDLE`), since the C function has no status.
///
/// # Safety
///
/// None beyond the C ABI: the handle is never dereferenced.
#[no_mangle]
pub unsafe extern "C" fn nrt_tensor_get_size(tensor: *const nrt_tensor_t) -> usize {
    guard_value("nrt_tensor_get_size", 0, || {
        tensor::size(Handle::from_ptr(tensor))
    })
}

// === Tensor sets ===

/// An empty tensor set.
///
/// # Safety
///
/// `result` is null (then `NRT_INVALID`) or valid for writing one pointer.
#[no_mangle]
pub unsafe extern "C" fn nrt_allocate_tensor_set(result: *mut *mut nrt_tensor_set_t) -> NRT_STATUS {
    guard("nrt_allocate_tensor_set", || {
        non_null(result, "result")?;
        let h = tensor_set::allocate()?;
        // SAFETY: non-null and writable (the caller's contract).
        unsafe { result.write(h.to_ptr()) };
        Ok(())
    })
}

/// Destroys a set (not its tensors) and nulls `*tensor_set`. A null `*tensor_set` is a
/// no-op; a destroyed or foreign one is recorded as `NRT_INVALID_HANDLE`.
///
/// # Safety
///
/// `tensor_set` is null or valid for reading and writing one pointer.
#[no_mangle]
pub unsafe extern "C" fn nrt_destroy_tensor_set(tensor_set: *mut *mut nrt_tensor_set_t) {
    guard_void("nrt_destroy_tensor_set", || {
        non_null(tensor_set, "tensor_set")?;
        // SAFETY: non-null and readable (the caller's contract).
        let s = unsafe { tensor_set.read() };
        if s.is_null() {
            return Ok(());
        }
        tensor_set::destroy(Handle::from_ptr(s))?;
        // SAFETY: non-null and writable (the caller's contract).
        unsafe { tensor_set.write(ptr::null_mut()) };
        Ok(())
    })
}

/// Binds `tensor` under `tensor_name`, replacing an earlier binding of that name. The set
/// does not own the tensor: freeing it later leaves a stale entry, which `nrt_execute`
/// reports as `NRT_INVALID_HANDLE`. Names of 256 bytes or more are `NRT_INVALID`.
///
/// # Safety
///
/// `tensor_name` is null (then `NRT_INVALID`) or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn nrt_add_tensor_to_tensor_set(
    tensor_set: *mut nrt_tensor_set_t,
    tensor_name: *const c_char,
    tensor: *mut nrt_tensor_t,
) -> NRT_STATUS {
    // SAFETY: null or NUL-terminated (the caller's contract).
    let name = unsafe { opt_str(tensor_name) };
    guard("nrt_add_tensor_to_tensor_set", || {
        let name = name.ok_or_else(|| Fail::invalid("tensor_name is null"))?;
        tensor_set::add(Handle::from_ptr(tensor_set), name, Handle::from_ptr(tensor))
    })
}

/// The tensor bound under `tensor_name`. An unbound name is `NRT_FAILURE` (as libnrt
/// reports it).
///
/// # Safety
///
/// `tensor_name` is null (then `NRT_INVALID`) or a NUL-terminated string; `tensor` is null
/// (then `NRT_INVALID`) or valid for writing one pointer.
#[no_mangle]
pub unsafe extern "C" fn nrt_get_tensor_from_tensor_set(
    tensor_set: *mut nrt_tensor_set_t,
    tensor_name: *const c_char,
    tensor: *mut *mut nrt_tensor_t,
) -> NRT_STATUS {
    // SAFETY: null or NUL-terminated (the caller's contract).
    let name = unsafe { opt_str(tensor_name) };
    guard("nrt_get_tensor_from_tensor_set", || {
        non_null(tensor, "tensor")?;
        let name = name.ok_or_else(|| Fail::invalid("tensor_name is null"))?;
        let h = tensor_set::get(Handle::from_ptr(tensor_set), &name)?;
        // SAFETY: non-null and writable (the caller's contract).
        unsafe { tensor.write(h.to_ptr()) };
        Ok(())
    })
}

// === Execution ===

/// Runs the model: every input is looked up by name in `input_set` and every output in
/// `output_set`, their sizes checked, the graph run on the CPU backend, and each output
/// written into the tensor bound to it. A tensor bound both as a (cache-root) input and
/// as its aliased output holds the new value afterwards.
///
/// Statuses: an unbound input or output, or a binding of the wrong size, is `NRT_INVALID`
/// (nothing is written); a freed model, set or bound tensor is `NRT_INVALID_HANDLE`; an
/// error of the CPU backend is `NRT_EXEC_BAD_INPUT`; the execution chosen by
/// `NRT_SIM_FAIL_EXECUTE` is `NRT_EXEC_COMPLETED_WITH_ERR` (nothing is written).
///
/// # Safety
///
/// None beyond the C ABI: the handles are never dereferenced.
#[no_mangle]
pub unsafe extern "C" fn nrt_execute(
    model: *mut nrt_model_t,
    input_set: *const nrt_tensor_set_t,
    output_set: *mut nrt_tensor_set_t,
) -> NRT_STATUS {
    guard_tallied("nrt_execute", Tally::Execute, || {
        execute::execute(
            Handle::from_ptr(model),
            Handle::from_ptr(input_set),
            Handle::from_ptr(output_set),
        )
    })
}

// === nrt-sim's own hooks ===

/// Writes the counters as JSON ([`crate::Counters`]) into `buf`, truncated to `len - 1`
/// bytes plus a NUL, and returns the full length without the NUL (like `snprintf`): call
/// again with a larger buffer when the result is `>= len`. `buf` may be null with `len`
/// 0 to ask for the length. Returns 0 only if serialising failed.
///
/// # Safety
///
/// `buf` is null or valid for writing `len` bytes.
#[no_mangle]
pub unsafe extern "C" fn nrt_sim_counters_json(buf: *mut c_char, len: usize) -> usize {
    let Ok(json) = catch("nrt_sim_counters_json", runtime::counters_json) else {
        return 0;
    };
    if !buf.is_null() && len > 0 {
        let n = json.len().min(len - 1);
        // SAFETY: `buf` is writable for `len > n` bytes (the caller's contract); `json` is
        // our own string, so the two do not overlap.
        unsafe {
            ptr::copy_nonoverlapping(json.as_ptr().cast::<c_char>(), buf, n);
            buf.add(n).write(0);
        }
    }
    json.len()
}

/// Clears the cumulative counters (bytes read and written, executions, loads, errors,
/// `last_error`, `live_at_last_close`, total bytes allocated). Live counts are not reset.
///
/// # Safety
///
/// None beyond the C ABI.
#[no_mangle]
pub unsafe extern "C" fn nrt_sim_reset_counters() {
    let _ = catch_unwind(runtime::reset_counters);
}

// === Signatures: each export must have exactly neuron-sys's function-pointer type ===
const _: () = {
    let _: sys::nrt_init_fn = Some(nrt_init);
    let _: sys::nrt_close_fn = Some(nrt_close);
    let _: sys::nrt_load_fn = Some(nrt_load);
    let _: sys::nrt_load_collectives_fn = Some(nrt_load_collectives);
    let _: sys::nrt_unload_fn = Some(nrt_unload);
    let _: sys::nrt_get_total_nc_count_fn = Some(nrt_get_total_nc_count);
    let _: sys::nrt_get_visible_nc_count_fn = Some(nrt_get_visible_nc_count);
    let _: sys::nrt_get_total_vnc_count_fn = Some(nrt_get_total_vnc_count);
    let _: sys::nrt_get_visible_vnc_count_fn = Some(nrt_get_visible_vnc_count);
    let _: sys::nrt_allocate_tensor_set_fn = Some(nrt_allocate_tensor_set);
    let _: sys::nrt_destroy_tensor_set_fn = Some(nrt_destroy_tensor_set);
    let _: sys::nrt_add_tensor_to_tensor_set_fn = Some(nrt_add_tensor_to_tensor_set);
    let _: sys::nrt_get_tensor_from_tensor_set_fn = Some(nrt_get_tensor_from_tensor_set);
    let _: sys::nrt_execute_fn = Some(nrt_execute);
    let _: sys::nrt_tensor_allocate_fn = Some(nrt_tensor_allocate);
    let _: sys::nrt_tensor_free_fn = Some(nrt_tensor_free);
    let _: sys::nrt_tensor_read_fn = Some(nrt_tensor_read);
    let _: sys::nrt_tensor_write_fn = Some(nrt_tensor_write);
    let _: sys::nrt_tensor_memset_fn = Some(nrt_tensor_memset);
    let _: sys::nrt_tensor_get_size_fn = Some(nrt_tensor_get_size);
    let _: sys::nrt_tensor_allocate_slice_fn = Some(nrt_tensor_allocate_slice);
    let _: sys::nrt_get_model_tensor_info_fn = Some(nrt_get_model_tensor_info);
    let _: sys::nrt_free_model_tensor_info_fn = Some(nrt_free_model_tensor_info);
    let _: sys::nrt_get_version_fn = Some(nrt_get_version);
    let _: sys::nrt_get_status_as_str_fn = Some(nrt_get_status_as_str);
    let _: sys::nrt_get_vnc_memory_stats_fn = Some(nrt_get_vnc_memory_stats);
};

#[cfg(test)]
mod tests {
    use std::ffi::CStr;

    use super::*;

    #[test]
    fn status_strings_are_the_table_names() {
        let name = |s| {
            // SAFETY: any status is accepted; the result is a static NUL-terminated string.
            unsafe { CStr::from_ptr(nrt_get_status_as_str(s)) }
                .to_str()
                .unwrap()
        };
        assert_eq!(name(1002), "NRT_EXEC_BAD_INPUT");
        assert_eq!(name(0), "NRT_SUCCESS");
        assert_eq!(name(8), "NRT_STATUS_UNKNOWN");
    }
}
