//! The runtime's lifetime and what it says about itself: `nrt_init` / `nrt_close`, the
//! version struct, status names, and nrt-sim's counters hooks.

use std::ffi::{CStr, CString};
use std::sync::LazyLock;

use neuron_sys::sys::{self, nrt_framework_type_t, nrt_version_t, NRT_STATUS};

use crate::c_text::copy_c_chars;
use crate::config::Config;
use crate::fail::{Fail, Res};
use crate::identity::{nc_count, VERSION, VERSION_DETAIL, VERSION_GIT_HASH};
use crate::state::{hbm_used, state, Phase};

/// Starts the runtime with the fault configuration read from the environment. A second
/// `init` without [`close`] is `NRT_INVALID`, as is a malformed `NRT_SIM_*` value.
pub(crate) fn init(framework: nrt_framework_type_t) -> Res<()> {
    if framework == sys::NRT_FRAMEWORK_TYPE_INVALID {
        return Err(Fail::invalid("framework NRT_FRAMEWORK_TYPE_INVALID"));
    }
    // Read before taking the lock: the environment is the caller's to synchronise.
    let config = Config::from_env(|k| std::env::var(k).ok())?;
    let mut st = state();
    if st.phase == Phase::Running {
        return Err(Fail::invalid("nrt_init called again without nrt_close"));
    }
    st.phase = Phase::Running;
    st.config = config;
    st.executes_since_init = 0;
    st.loads_since_init = 0;
    Ok(())
}

/// Stops the runtime: every tensor, set and model still alive is released (their handles go
/// stale) and recorded in `live_at_last_close`. Tensor-info arrays stay valid.
pub(crate) fn close() -> Res<()> {
    let mut st = state();
    st.require_running("nrt_close")?;
    let live = st.live();
    let tensors = st.tensors.drain();
    let sets = st.sets.drain();
    let models = st.models.drain();
    st.settle_scratch();
    st.stats.live_at_last_close = Some(live);
    st.phase = Phase::Closed;
    // Freed after the lock is released, so freeing memory holds up no other thread.
    drop(st);
    drop((tensors, sets, models));
    Ok(())
}

/// NeuronCore `vnc`'s device memory as `(used, limit)`: every byte charged to it (tensors,
/// loaded models' code and the scratchpad, as counted in [`crate::counters::CoreMemory`]) and
/// its capacity (`NRT_SIM_HBM_BYTES`), what libnrt's `nrt_get_vnc_memory_stats` reports. Needs
/// a running runtime; a core past [`nc_count`] is `NRT_INVALID`.
pub(crate) fn memory_stats(vnc: u32) -> Res<(u64, u64)> {
    let st = state();
    st.require_running("nrt_get_vnc_memory_stats")?;
    if vnc >= nc_count() {
        return Err(Fail::invalid(format!(
            "NeuronCore {vnc} does not exist ({} are simulated)",
            nc_count()
        )));
    }
    Ok((hbm_used(vnc), st.config.hbm_bytes))
}

/// The version struct for a caller's buffer of `size` bytes, which must hold a whole
/// `nrt_version_t` (else `NRT_INVALID`).
pub(crate) fn version(size: usize) -> Res<nrt_version_t> {
    if size < std::mem::size_of::<nrt_version_t>() {
        return Err(Fail::invalid(format!(
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
    Ok(v)
}

/// The status names, NUL-terminated, built once and never freed.
static STATUS_STRINGS: LazyLock<Vec<(NRT_STATUS, CString)>> = LazyLock::new(|| {
    sys::STATUS_CODES
        .iter()
        .filter_map(|&(code, name)| CString::new(name).ok().map(|c| (code, c)))
        .collect()
});

/// What `nrt_get_status_as_str` answers for a status that has no name.
pub(crate) const UNKNOWN_STATUS: &CStr = c"NRT_STATUS_UNKNOWN";

/// The status's name (`"NRT_EXEC_BAD_INPUT"`), or [`UNKNOWN_STATUS`]; static, so the C
/// caller may keep the pointer and must not free it.
pub(crate) fn status_name(status: NRT_STATUS) -> &'static CStr {
    STATUS_STRINGS
        .iter()
        .find(|(c, _)| *c == status)
        .map_or(UNKNOWN_STATUS, |(_, s)| s.as_c_str())
}

/// The counters as JSON ([`crate::Counters`]), for `nrt_sim_counters_json`.
pub(crate) fn counters_json() -> Res<String> {
    serde_json::to_string(&state().counters())
        .map_err(|e| Fail::new(sys::NRT_FAILURE, e.to_string()))
}

/// Clears the cumulative counters, for `nrt_sim_reset_counters` and
/// [`crate::reset_counters`].
pub(crate) fn reset_counters() {
    state().reset_counters();
}
