//! The exported C functions: libnrt's (every symbol `neuron_sys::Library` resolves, with the
//! signatures of `neuron-sys/include/nrt_deepinfer.h`) and nrt-sim's test hooks.
//!
//! Each function is a thin shell: it turns the raw arguments into Rust values (the only
//! `unsafe` here: reading the caller's strings and buffers, writing its out-pointers), calls
//! a safe body that returns a `Result` (a status and a message on failure), and turns that
//! into a status. Bodies run under [`std::panic::catch_unwind`], so a panic becomes
//! `NRT_FAILURE` (and a `last_error` naming the panic) instead of unwinding into C. Every failure is recorded in the
//! counters (`errors`, `last_error`), including failures of the `void` functions
//! (`nrt_close`, `nrt_tensor_free`, `nrt_destroy_tensor_set`), which cannot return one.
//!
//! The signatures are checked at compile time against neuron-sys's function-pointer types
//! (the block at the end of this file), which bindgen derives from the same header: a
//! drifted parameter type fails the build here rather than corrupting a caller's stack.

use std::alloc::Layout;
use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::ptr::{self, NonNull};
use std::sync::{Arc, LazyLock, Mutex};

use deepinfer::backend::hlo::import::import_bytes;
use deepinfer::graph::Graph;
use neuron_sys::sys::{
    self, nrt_framework_type_t, nrt_model_t, nrt_tensor_info_array_t, nrt_tensor_info_t,
    nrt_tensor_placement_t, nrt_tensor_set_t, nrt_tensor_t, nrt_version_t, NRT_STATUS,
};

use crate::exec;
use crate::handle::{Handle, Kind};
use crate::state::{
    lock_bytes, state, Config, Fail, InfoAlloc, IoDesc, ModelEntry, Phase, Res, Storage,
    TensorEntry,
};
use crate::{
    dtype_code, TOTAL_NC_COUNT, VERSION, VERSION_DETAIL, VERSION_GIT_HASH, VISIBLE_NC_COUNT,
};

// === The guard ===

/// Runs `f`, turning a panic into `NRT_FAILURE`.
fn catch<T>(call: &str, f: impl FnOnce() -> Res<T>) -> Res<T> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(payload) => {
            let what = payload
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "a non-string panic".into());
            Err(Fail::new(
                sys::NRT_FAILURE,
                format!("{call} panicked (caught at the FFI boundary): {what}"),
            ))
        }
    }
}

/// Records a failure in the counters. Never panics into C: recording itself is guarded.
fn record(call: &str, fail: &Fail) {
    let _ = catch_unwind(AssertUnwindSafe(|| state().record(call, fail)));
}

/// The status of a result, recording a failure.
fn status(call: &str, r: Res<()>) -> NRT_STATUS {
    match r {
        Ok(()) => sys::NRT_SUCCESS,
        Err(fail) => {
            record(call, &fail);
            fail.status
        }
    }
}

/// Runs a body that returns a status.
fn guard(call: &str, f: impl FnOnce() -> Res<()>) -> NRT_STATUS {
    status(call, catch(call, f))
}

/// Runs the body of a `void` function: failures are only recorded.
fn guard_void(call: &str, f: impl FnOnce() -> Res<()>) {
    let _ = guard(call, f);
}

fn invalid(msg: impl Into<String>) -> Fail {
    Fail::new(sys::NRT_INVALID, msg)
}

/// `Ok` when `p` is not null (an out-pointer the caller must provide).
fn non_null<T>(p: *const T, what: &str) -> Res<()> {
    if p.is_null() {
        Err(invalid(format!("{what} is null")))
    } else {
        Ok(())
    }
}

/// Reads an optional C string.
///
/// # Safety
///
/// `p` is null or points to a NUL-terminated string readable for the whole call.
unsafe fn opt_str(p: *const c_char) -> Option<String> {
    if p.is_null() {
        return None;
    }
    // SAFETY: non-null and NUL-terminated (the caller's contract).
    Some(unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
}

/// `offset .. offset + len` within `0 .. size`, or `NRT_INVALID` naming the range.
fn check_range(what: &str, offset: usize, len: usize, size: usize) -> Res<()> {
    match offset.checked_add(len) {
        Some(end) if end <= size => Ok(()),
        _ => Err(invalid(format!(
            "{what}: bytes {offset}..{} are outside the tensor's {size} bytes",
            offset as u128 + len as u128
        ))),
    }
}

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
    guard("nrt_init", || {
        if framework == sys::NRT_FRAMEWORK_TYPE_INVALID {
            return Err(invalid("framework NRT_FRAMEWORK_TYPE_INVALID"));
        }
        // Read before taking the lock: the environment is the caller's to synchronise.
        let config = Config::from_env(|k| std::env::var(k).ok())?;
        let mut st = state();
        if st.phase == Phase::Running {
            return Err(invalid("nrt_init called again without nrt_close"));
        }
        st.phase = Phase::Running;
        st.config = config;
        st.executes_since_init = 0;
        st.loads_since_init = 0;
        Ok(())
    })
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
    guard_void("nrt_close", || {
        let mut st = state();
        st.require_running("nrt_close")?;
        let live = st.live();
        let tensors = st.tensors.drain();
        let sets = st.sets.drain();
        let models = st.models.drain();
        st.stats.live_at_last_close = Some(live);
        st.phase = Phase::Closed;
        drop(st);
        drop((tensors, sets, models));
        Ok(())
    })
}

/// Total NeuronCores: always [`TOTAL_NC_COUNT`]. Callable before `nrt_init`.
///
/// # Safety
///
/// `vnc_count` is null (then `NRT_INVALID`) or valid for writing one `u32`.
#[no_mangle]
pub unsafe extern "C" fn nrt_get_total_nc_count(vnc_count: *mut u32) -> NRT_STATUS {
    guard("nrt_get_total_nc_count", || {
        non_null(vnc_count, "vnc_count")?;
        // SAFETY: non-null and writable (the caller's contract).
        unsafe { vnc_count.write(TOTAL_NC_COUNT) };
        Ok(())
    })
}

/// Visible NeuronCores: always [`VISIBLE_NC_COUNT`]. Callable before `nrt_init`.
///
/// # Safety
///
/// `vnc_count` is null (then `NRT_INVALID`) or valid for writing one `u32`.
#[no_mangle]
pub unsafe extern "C" fn nrt_get_visible_nc_count(vnc_count: *mut u32) -> NRT_STATUS {
    guard("nrt_get_visible_nc_count", || {
        non_null(vnc_count, "vnc_count")?;
        // SAFETY: non-null and writable (the caller's contract).
        unsafe { vnc_count.write(VISIBLE_NC_COUNT) };
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

/// Writes [`VERSION`] (which selects the hardware-code dtype table in neuron-sys; see
/// [`crate::dtype_code`]). Callable before `nrt_init`. `size` must be at least
/// `sizeof(nrt_version_t)` (224); only that many bytes are written.
///
/// # Safety
///
/// `ver` is null (then `NRT_INVALID`) or valid for writing `size` bytes.
#[no_mangle]
pub unsafe extern "C" fn nrt_get_version(ver: *mut nrt_version_t, size: usize) -> NRT_STATUS {
    guard("nrt_get_version", || {
        non_null(ver, "ver")?;
        if size < std::mem::size_of::<nrt_version_t>() {
            return Err(invalid(format!(
                "size {size} is smaller than nrt_version_t ({} bytes)",
                std::mem::size_of::<nrt_version_t>()
            )));
        }
        let mut v = nrt_version_t {
            rt_major: VERSION[0],
            rt_minor: VERSION[1],
            rt_patch: VERSION[2],
            rt_maintenance: VERSION[3],
            rt_detail: [0; sys::RT_VERSION_DETAIL_LEN],
            git_hash: [0; sys::GIT_HASH_LEN],
        };
        copy_c_chars(&mut v.rt_detail, VERSION_DETAIL);
        copy_c_chars(&mut v.git_hash, VERSION_GIT_HASH);
        // SAFETY: non-null and writable for `size >= size_of::<nrt_version_t>()` bytes; the
        // caller's buffer has no alignment promise, hence write_unaligned.
        unsafe { ver.write_unaligned(v) };
        Ok(())
    })
}

/// Copies `text` into a C char array, truncated to leave a terminating NUL.
fn copy_c_chars(dst: &mut [c_char], text: &str) {
    let room = dst.len().saturating_sub(1);
    for (d, b) in dst.iter_mut().zip(text.bytes().take(room)) {
        *d = b as c_char;
    }
}

/// The status names, NUL-terminated, built once and never freed.
static STATUS_STRINGS: LazyLock<Vec<(NRT_STATUS, CString)>> = LazyLock::new(|| {
    sys::STATUS_CODES
        .iter()
        .filter_map(|&(code, name)| CString::new(name).ok().map(|c| (code, c)))
        .collect()
});

/// The status's name (`"NRT_EXEC_BAD_INPUT"`), or `"NRT_STATUS_UNKNOWN"`. The string is
/// static: the caller must not free it.
///
/// # Safety
///
/// None beyond the C ABI: any value is accepted.
#[no_mangle]
pub unsafe extern "C" fn nrt_get_status_as_str(status: NRT_STATUS) -> *const c_char {
    catch("nrt_get_status_as_str", || {
        Ok(STATUS_STRINGS
            .iter()
            .find(|(c, _)| *c == status)
            .map_or(c"NRT_STATUS_UNKNOWN".as_ptr(), |(_, s)| s.as_ptr()))
    })
    .unwrap_or(c"NRT_STATUS_UNKNOWN".as_ptr())
}

// === Models ===

/// Describes a graph's inputs and outputs as `nrt_get_model_tensor_info` reports them.
fn describe(graph: &Graph) -> Res<(Vec<IoDesc>, Vec<IoDesc>)> {
    let desc = |name: &str, usage, dtype: deepinfer::graph::DType, dims: &[usize]| {
        if name.len() >= sys::NRT_TENSOR_NAME_MAX {
            return Err(invalid(format!(
                "tensor name `{name}` is {} bytes; the runtime's limit is {}",
                name.len(),
                sys::NRT_TENSOR_NAME_MAX - 1
            )));
        }
        let shape = dims
            .iter()
            .map(|&d| u32::try_from(d))
            .collect::<Result<Vec<u32>, _>>()
            .map_err(|_| invalid(format!("tensor `{name}`: a dimension exceeds u32")))?;
        let size = dims
            .iter()
            .try_fold(dtype.size_in_bytes(), |acc, &d| acc.checked_mul(d))
            .ok_or_else(|| invalid(format!("tensor `{name}`: size overflows")))?;
        Ok(IoDesc {
            name: name.to_string(),
            usage,
            dtype,
            shape,
            size,
        })
    };
    let inputs = graph
        .inputs()
        .iter()
        .map(|d| {
            desc(
                &d.name,
                sys::NRT_TENSOR_USAGE_INPUT,
                d.dtype,
                d.shape.dims(),
            )
        })
        .collect::<Res<Vec<_>>>()?;
    let outputs = graph
        .outputs()
        .iter()
        .map(|o| {
            let n = graph.node(o.node);
            desc(
                &o.name,
                sys::NRT_TENSOR_USAGE_OUTPUT,
                n.dtype,
                n.shape.dims(),
            )
        })
        .collect::<Res<Vec<_>>>()?;
    Ok((inputs, outputs))
}

/// The body of `nrt_load` and `nrt_load_collectives`.
fn load(neff: &[u8], vnc: i32, vnc_count: i32) -> Res<Handle> {
    let visible = VISIBLE_NC_COUNT as i64;
    if vnc < -1 || i64::from(vnc) >= visible {
        return Err(Fail::new(
            sys::NRT_LOAD_NOT_ENOUGH_NC,
            format!("NeuronCore {vnc} requested; {visible} are visible"),
        ));
    }
    if vnc_count == 0 || vnc_count < -1 {
        return Err(invalid(format!("vnc_count {vnc_count}")));
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
    // Imported without the lock: parsing a large module takes a while.
    let graph = import_bytes(neff).map_err(|e| {
        invalid(format!(
            "not a NEFF nrt-sim can run (a deepinfer HloModuleProto): {e}"
        ))
    })?;
    let (inputs, outputs) = describe(&graph)?;
    let mut st = state();
    st.require_running("nrt_load")?;
    st.loads_since_init += 1;
    if st.config.fail_load == Some(st.loads_since_init) {
        return Err(Fail::new(
            sys::NRT_RESOURCE,
            format!(
                "injected failure: load {} ({}={})",
                st.loads_since_init,
                crate::ENV_FAIL_LOAD,
                st.loads_since_init
            ),
        ));
    }
    let name = graph.name().to_string();
    let h = st
        .models
        .insert(ModelEntry {
            graph,
            name,
            inputs,
            outputs,
            executions: 0,
        })
        .ok_or_else(|| Fail::new(sys::NRT_RESOURCE, "too many models"))?;
    st.stats.loads += 1;
    Ok(h)
}

/// Shared shell of the two load functions.
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
    extra: impl FnOnce() -> Res<()>,
) -> NRT_STATUS {
    let r = catch(call, || {
        non_null(model, "model")?;
        extra()?;
        if neff_bytes.is_null() || size == 0 {
            return Err(invalid("the NEFF is empty"));
        }
        // SAFETY: non-null, and readable for `size` bytes for the whole call (the caller's
        // contract); it is only read, and not kept after the call.
        let neff = unsafe { std::slice::from_raw_parts(neff_bytes.cast::<u8>(), size) };
        let h = load(neff, vnc, vnc_count)?;
        // SAFETY: non-null and writable (the caller's contract).
        unsafe { model.write(h.to_ptr()) };
        Ok(())
    });
    if r.is_err() {
        let _ = catch_unwind(|| state().stats.load_failures += 1);
    }
    status(call, r)
}

/// Loads a "NEFF", which for nrt-sim is deepinfer's serialized `HloModuleProto` (the
/// `NAME.hlo.pb` that `deepinfer lower` writes): it is imported back into a graph, which
/// `nrt_execute` runs on the CPU backend. Bytes that are not such a module are
/// `NRT_INVALID`. `vnc` is `-1` or a visible core; `vnc_count` is `-1` or at least 1.
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
    unsafe {
        load_shell("nrt_load", neff_bytes, size, vnc, vnc_count, model, || {
            Ok(())
        })
    }
}

/// [`nrt_load`] for a collectives NEFF. nrt-sim has no collectives: the context arguments
/// are only checked (`ctx_device_id < ctx_device_count`).
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
    let extra = || {
        if ctx_device_id >= ctx_device_count {
            return Err(invalid(format!(
                "ctx_device_id {ctx_device_id} is not below ctx_device_count {ctx_device_count}"
            )));
        }
        Ok(())
    };
    // SAFETY: the same contract.
    unsafe {
        load_shell(
            "nrt_load_collectives",
            neff_bytes,
            size,
            vnc,
            vnc_count,
            model,
            extra,
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
    guard("nrt_unload", || {
        let mut st = state();
        st.require_running("nrt_unload")?;
        st.models
            .remove(Handle::from_ptr(model))
            .map_err(|why| Fail::handle("model", Kind::Model, why))?;
        Ok(())
    })
}

/// Builds the C array `nrt_get_model_tensor_info` returns: a `u64` count, then the entries.
fn info_array(descs: &[&IoDesc]) -> Res<InfoAlloc> {
    let entries = Layout::array::<nrt_tensor_info_t>(descs.len())
        .map_err(|_| Fail::new(sys::NRT_RESOURCE, "too many tensors"))?;
    let (layout, offset) = Layout::new::<u64>()
        .extend(entries)
        .map_err(|_| Fail::new(sys::NRT_RESOURCE, "too many tensors"))?;
    let layout = layout.pad_to_align();
    // The header is the C struct's `uint64_t tensor_count`, the entries its flexible array.
    debug_assert_eq!(
        offset,
        std::mem::offset_of!(nrt_tensor_info_array_t, tensor_array)
    );
    // SAFETY: the layout has a non-zero size (at least the 8-byte header).
    let raw = unsafe { std::alloc::alloc_zeroed(layout) };
    let ptr = NonNull::new(raw).ok_or_else(|| Fail::new(sys::NRT_RESOURCE, "out of memory"))?;
    let mut shapes = Vec::with_capacity(descs.len());
    // SAFETY: `ptr` is a fresh allocation of `layout`, 8-aligned, with room for the header.
    unsafe { ptr.as_ptr().cast::<u64>().write(descs.len() as u64) };
    for (i, d) in descs.iter().enumerate() {
        let mut shape: Box<[u32]> = d.shape.clone().into_boxed_slice();
        let shape_ptr = if shape.is_empty() {
            ptr::null_mut()
        } else {
            shape.as_mut_ptr()
        };
        let mut name = [0 as c_char; sys::NRT_TENSOR_NAME_MAX];
        copy_c_chars(&mut name, &d.name);
        let info = nrt_tensor_info_t {
            name,
            usage: d.usage,
            size: d.size,
            dtype: dtype_code(d.dtype),
            shape: shape_ptr,
            ndim: d.shape.len() as u32,
        };
        // SAFETY: entry `i` lies within the allocation (offset + i * size_of < layout.size)
        // and is aligned (offset and the entry size are multiples of 8).
        unsafe {
            ptr.as_ptr()
                .add(offset)
                .cast::<nrt_tensor_info_t>()
                .add(i)
                .write(info)
        };
        // The boxed slice's heap data does not move when the box does.
        shapes.push(shape);
    }
    Ok(InfoAlloc {
        ptr,
        layout,
        _shapes: shapes,
    })
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
        let mut st = state();
        st.require_running("nrt_get_model_tensor_info")?;
        let m = st.model("model", Handle::from_ptr(model))?;
        let descs: Vec<&IoDesc> = m.inputs.iter().chain(&m.outputs).collect();
        let alloc = info_array(&descs)?;
        let p = alloc.ptr;
        st.infos.insert(p.as_ptr().addr(), alloc);
        // SAFETY: non-null and writable (the caller's contract).
        unsafe { tensor_info.write(p.as_ptr().cast()) };
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
        let alloc = state().infos.remove(&tensor_info.addr()).ok_or_else(|| {
            Fail::new(
                sys::NRT_INVALID_HANDLE,
                "tensor_info was not returned by nrt_get_model_tensor_info, or is \
                     already freed",
            )
        })?;
        // SAFETY: allocated by info_array with exactly this layout, removed from the
        // registry above, so freed once.
        unsafe { std::alloc::dealloc(alloc.ptr.as_ptr(), alloc.layout) };
        Ok(())
    })
}

// === Tensors ===

/// Allocates `size` zeroed bytes. Device placement needs a visible core (`0 ..
/// VISIBLE_NC_COUNT`); host and virtual placements ignore `vnc`. The name (optional) is
/// the key of the byte counters. Out of memory is `NRT_RESOURCE`.
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
        match tensor_placement {
            sys::NRT_TENSOR_PLACEMENT_DEVICE => {
                if vnc < 0 || vnc as u32 >= VISIBLE_NC_COUNT {
                    return Err(invalid(format!(
                        "device tensor on NeuronCore {vnc}; {VISIBLE_NC_COUNT} are visible"
                    )));
                }
            }
            sys::NRT_TENSOR_PLACEMENT_HOST | sys::NRT_TENSOR_PLACEMENT_VIRTUAL => {}
            other => return Err(invalid(format!("unknown placement {other}"))),
        }
        state().require_running("nrt_tensor_allocate")?;
        let mut bytes = Vec::new();
        bytes
            .try_reserve_exact(size)
            .map_err(|_| Fail::new(sys::NRT_RESOURCE, format!("cannot allocate {size} bytes")))?;
        bytes.resize(size, 0);
        let entry = TensorEntry {
            storage: Arc::new(Storage {
                bytes: Mutex::new(bytes),
            }),
            offset: 0,
            size,
            name: name.unwrap_or_default(),
            placement: tensor_placement,
        };
        let mut st = state();
        st.require_running("nrt_tensor_allocate")?;
        let h = st
            .tensors
            .insert(entry)
            .ok_or_else(|| Fail::new(sys::NRT_RESOURCE, "too many tensors"))?;
        st.stats.total_bytes_allocated += size as u64;
        st.stats.tensors_allocated += 1;
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
        let mut st = state();
        st.require_running("nrt_tensor_allocate_slice")?;
        let src = st.tensor("tensor_source", Handle::from_ptr(tensor_source))?;
        check_range("slice", offset, size, src.size)?;
        let entry = TensorEntry {
            storage: Arc::clone(&src.storage),
            offset: src.offset + offset,
            size,
            name: name.unwrap_or_else(|| format!("{}[{offset}..{}]", src.name, offset + size)),
            placement: src.placement,
        };
        let h = st
            .tensors
            .insert(entry)
            .ok_or_else(|| Fail::new(sys::NRT_RESOURCE, "too many tensors"))?;
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
        let mut st = state();
        st.require_running("nrt_tensor_free")?;
        let entry = st
            .tensors
            .remove(Handle::from_ptr(t))
            .map_err(|why| Fail::handle("*tensor", Kind::Tensor, why))?;
        drop(st);
        drop(entry);
        // SAFETY: non-null and writable (the caller's contract).
        unsafe { tensor.write(ptr::null_mut()) };
        Ok(())
    })
}

/// Resolves a tensor's storage window for a read or write, and counts the bytes.
fn io_window(
    call: &str,
    tensor: Handle,
    offset: usize,
    size: usize,
    write: bool,
) -> Res<(Arc<Storage>, usize)> {
    let mut st = state();
    st.require_running(call)?;
    let t = st.tensor("tensor", tensor)?;
    check_range(call, offset, size, t.size)?;
    let (storage, start, name) = (Arc::clone(&t.storage), t.offset + offset, t.name.clone());
    let map = if write {
        &mut st.stats.bytes_written
    } else {
        &mut st.stats.bytes_read
    };
    *map.entry(name).or_default() += size as u64;
    Ok((storage, start))
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
    guard("nrt_tensor_read", || {
        if buf.is_null() && size > 0 {
            return Err(invalid("buf is null"));
        }
        let (storage, start) = io_window(
            "nrt_tensor_read",
            Handle::from_ptr(tensor),
            offset,
            size,
            false,
        )?;
        let bytes = lock_bytes(&storage);
        let src = &bytes[start..start + size];
        if size > 0 {
            // SAFETY: `buf` is writable for `size` bytes (the caller's contract) and cannot
            // overlap nrt-sim's storage, whose address is never handed out.
            unsafe { ptr::copy_nonoverlapping(src.as_ptr(), buf.cast::<u8>(), size) };
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
    guard("nrt_tensor_write", || {
        if buf.is_null() && size > 0 {
            return Err(invalid("buf is null"));
        }
        let (storage, start) = io_window(
            "nrt_tensor_write",
            Handle::from_ptr(tensor),
            offset,
            size,
            true,
        )?;
        let mut bytes = lock_bytes(&storage);
        let dst = &mut bytes[start..start + size];
        if size > 0 {
            // SAFETY: `buf` is readable for `size` bytes (the caller's contract) and cannot
            // overlap nrt-sim's storage, whose address is never handed out.
            unsafe { ptr::copy_nonoverlapping(buf.cast::<u8>(), dst.as_mut_ptr(), size) };
        }
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
    let r = catch("nrt_tensor_get_size", || {
        let st = state();
        st.require_running("nrt_tensor_get_size")?;
        Ok(st.tensor("tensor", Handle::from_ptr(tensor))?.size)
    });
    match r {
        Ok(n) => n,
        Err(fail) => {
            record("nrt_tensor_get_size", &fail);
            0
        }
    }
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
        let mut st = state();
        st.require_running("nrt_allocate_tensor_set")?;
        let h = st
            .sets
            .insert(HashMap::new())
            .ok_or_else(|| Fail::new(sys::NRT_RESOURCE, "too many tensor sets"))?;
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
        let mut st = state();
        st.require_running("nrt_destroy_tensor_set")?;
        st.sets
            .remove(Handle::from_ptr(s))
            .map_err(|why| Fail::handle("*tensor_set", Kind::TensorSet, why))?;
        drop(st);
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
        let name = name.ok_or_else(|| invalid("tensor_name is null"))?;
        if name.len() >= sys::NRT_TENSOR_NAME_MAX {
            return Err(invalid(format!(
                "tensor name is {} bytes; the limit is {}",
                name.len(),
                sys::NRT_TENSOR_NAME_MAX - 1
            )));
        }
        let mut st = state();
        st.require_running("nrt_add_tensor_to_tensor_set")?;
        let t = Handle::from_ptr(tensor);
        st.tensor("tensor", t)?;
        st.sets
            .get_mut(Handle::from_ptr(tensor_set))
            .map_err(|why| Fail::handle("tensor_set", Kind::TensorSet, why))?
            .insert(name, t);
        Ok(())
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
        let name = name.ok_or_else(|| invalid("tensor_name is null"))?;
        let st = state();
        st.require_running("nrt_get_tensor_from_tensor_set")?;
        let h = *st
            .set("tensor_set", Handle::from_ptr(tensor_set))?
            .get(&name)
            .ok_or_else(|| {
                Fail::new(
                    sys::NRT_FAILURE,
                    format!("no tensor named `{name}` in the set"),
                )
            })?;
        // SAFETY: non-null and writable (the caller's contract).
        unsafe { tensor.write(h.to_ptr()) };
        Ok(())
    })
}

// === Execution ===

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

/// Resolves every input and output of the model in its set, checking names and sizes.
fn plan(model: Handle, input_set: Handle, output_set: Handle) -> Res<Plan> {
    let mut st = state();
    st.require_running("nrt_execute")?;
    let plan = {
        let st = &*st;
        let m = st.model("model", model)?;
        let ins = st.set("input_set", input_set)?;
        let outs = st.set("output_set", output_set)?;
        let bind = |set: &HashMap<String, Handle>, d: &IoDesc, role: &str| -> Res<Bound> {
            let h = *set.get(&d.name).ok_or_else(|| {
                invalid(format!(
                    "{role} `{}` of model `{}` is not bound in the {role} set",
                    d.name, m.name
                ))
            })?;
            let t = st.tensor(&format!("the tensor bound to {role} `{}`", d.name), h)?;
            if t.size != d.size {
                return Err(invalid(format!(
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
                st.executes_since_init,
                crate::ENV_FAIL_EXECUTE,
                st.executes_since_init
            ),
        ));
    }
    Ok(plan)
}

/// The body of `nrt_execute`.
fn execute(model: Handle, input_set: Handle, output_set: Handle) -> Res<()> {
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
        let results = exec::run(&p.graph, &p.inputs, &p.outputs, &input_bytes)?;
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
    let _ = catch_unwind(|| state().stats.execute_calls += 1);
    let r = catch("nrt_execute", || {
        execute(
            Handle::from_ptr(model),
            Handle::from_ptr(input_set),
            Handle::from_ptr(output_set),
        )
    });
    if r.is_err() {
        let _ = catch_unwind(|| state().stats.execute_failures += 1);
    }
    status("nrt_execute", r)
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
    let json = catch("nrt_sim_counters_json", || {
        serde_json::to_string(&state().counters())
            .map_err(|e| Fail::new(sys::NRT_FAILURE, e.to_string()))
    });
    let Ok(json) = json else { return 0 };
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
    let _ = catch_unwind(|| state().reset_counters());
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
    let _: sys::nrt_tensor_get_size_fn = Some(nrt_tensor_get_size);
    let _: sys::nrt_tensor_allocate_slice_fn = Some(nrt_tensor_allocate_slice);
    let _: sys::nrt_get_model_tensor_info_fn = Some(nrt_get_model_tensor_info);
    let _: sys::nrt_free_model_tensor_info_fn = Some(nrt_free_model_tensor_info);
    let _: sys::nrt_get_version_fn = Some(nrt_get_version);
    let _: sys::nrt_get_status_as_str_fn = Some(nrt_get_status_as_str);
};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_panic_becomes_nrt_failure() {
        let s = guard("test_call", || panic!("boom"));
        assert_eq!(s, sys::NRT_FAILURE);
        let r: Res<()> = catch("test_call", || panic!("{}", String::from("dynamic")));
        assert!(r.unwrap_err().msg.contains("dynamic"));
    }

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
