//! What the simulated runtime says it is: its version, its NeuronCores and the dtype codes
//! it reports.
//!
//! A leaf module (it imports nothing of the crate) so that every other module can read these
//! facts without reaching back into the crate root, which only re-exports them.

use deepinfer::graph::DType;
use neuron_sys::sys::dtype::hw;

/// The runtime version `nrt_get_version` reports: `[major, minor, patch, maintenance]`.
/// 2.34 selects the hardware-code dtype table in neuron-sys (see [`dtype_code`]).
pub const VERSION: [u64; 4] = [2, 34, 0, 0];
/// `nrt_version_t::git_hash`: identifies the simulator (`deepinfer doctor` prints it).
pub const VERSION_GIT_HASH: &str = deepinfer::runner::SIM_GIT_HASH;
/// `nrt_version_t::rt_detail`.
pub const VERSION_DETAIL: &str = concat!(
    "nrt-sim ",
    env!("CARGO_PKG_VERSION"),
    ": deepinfer HLO on the CPU backend"
);
/// `NRT_SIM_NC_COUNT`: the simulated instance's NeuronCores, read once per process (the count
/// calls work before `nrt_init`, so it cannot wait for `nrt_init`'s configuration).
pub const ENV_NC_COUNT: &str = "NRT_SIM_NC_COUNT";
/// NeuronCores unless `NRT_SIM_NC_COUNT` says otherwise: a trn1.2xlarge's 2.
pub const DEFAULT_NC_COUNT: u32 = 2;
/// The most NeuronCores `NRT_SIM_NC_COUNT` may ask for (a trn2.48xlarge's 64 logical cores;
/// a trn1.32xlarge has 32).
pub const MAX_NC_COUNT: u32 = 64;

static NC_COUNT: std::sync::LazyLock<u32> = std::sync::LazyLock::new(|| {
    std::env::var(ENV_NC_COUNT)
        .ok()
        .and_then(|v| v.trim().parse::<u32>().ok())
        .filter(|n| (1..=MAX_NC_COUNT).contains(n))
        .unwrap_or(DEFAULT_NC_COUNT)
});

/// NeuronCores on the simulated instance: `NRT_SIM_NC_COUNT` (1 to [`MAX_NC_COUNT`]) as the
/// process first read it, else [`DEFAULT_NC_COUNT`] (a malformed value is refused by
/// `nrt_init`; the count calls, which work before it, fall back to the default). All of them are visible (core indices
/// `0..n`).
pub fn nc_count() -> u32 {
    *NC_COUNT
}

/// The `nrt_dtype_t` code nrt-sim reports for a graph dtype: the hardware-code encoding
/// (`neuron_sys::sys::dtype::hw`). `Bool` (HLO `pred`, one byte) is reported as UINT8.
pub fn dtype_code(dtype: DType) -> u32 {
    match dtype {
        DType::F32 => hw::FLOAT32,
        DType::BF16 => hw::BFLOAT16,
        DType::F16 => hw::FLOAT16,
        DType::F8E4M3 => hw::FP8_E4,
        DType::I8 => hw::INT8,
        DType::I32 => hw::INT32,
        DType::U32 => hw::UINT32,
        DType::U8 | DType::Bool => hw::UINT8,
    }
}
