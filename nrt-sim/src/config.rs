//! The fault and timing knobs (`NRT_SIM_*`), read from the environment at `nrt_init`.
//!
//! A malformed value is an error rather than "off", so a typo cannot silently turn a fault
//! test into a passing run.

use std::time::Duration;

use crate::fail::{Fail, Res};
use crate::identity::{ENV_NC_COUNT, MAX_NC_COUNT};

/// `NRT_SIM_FAIL_EXECUTE`.
pub const ENV_FAIL_EXECUTE: &str = "NRT_SIM_FAIL_EXECUTE";
/// `NRT_SIM_FAIL_LOAD`.
pub const ENV_FAIL_LOAD: &str = "NRT_SIM_FAIL_LOAD";
/// `NRT_SIM_SLOW_EXECUTE_MS`.
pub const ENV_SLOW_EXECUTE_MS: &str = "NRT_SIM_SLOW_EXECUTE_MS";
/// `NRT_SIM_SLOW_EXECUTE_MODELS`: which models `NRT_SIM_SLOW_EXECUTE_MS` slows.
pub const ENV_SLOW_EXECUTE_MODELS: &str = "NRT_SIM_SLOW_EXECUTE_MODELS";
/// `NRT_SIM_FREE_EXECUTE`.
pub const ENV_FREE_EXECUTE: &str = "NRT_SIM_FREE_EXECUTE";
/// `NRT_SIM_HBM_BYTES`: device memory per NeuronCore.
pub const ENV_HBM_BYTES: &str = "NRT_SIM_HBM_BYTES";
/// `NRT_SIM_COLLECTIVE_TIMEOUT_MS`: how long a rank waits at a collective for the others.
pub const ENV_COLLECTIVE_TIMEOUT_MS: &str = "NRT_SIM_COLLECTIVE_TIMEOUT_MS";

/// How long a rank waits at a collective unless `NRT_SIM_COLLECTIVE_TIMEOUT_MS` says otherwise:
/// long enough for the slowest rank of a CPU-backend step, short enough that a rank that never
/// executes fails the step instead of hanging it.
pub const DEFAULT_COLLECTIVE_TIMEOUT: Duration = Duration::from_secs(120);

/// Device memory per NeuronCore unless `NRT_SIM_HBM_BYTES` says otherwise: 16 GiB, a trn1
/// NeuronCore's share of its Trainium chip ("32 GiB of device memory (for storing model state)"
/// for the chip's two NeuronCore-v2, AWS's Trainium architecture page in aws-neuron-sdk).
pub const DEFAULT_HBM_BYTES: u64 = 16 << 30;

/// The fault and timing knobs, from the environment at `nrt_init`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Config {
    /// The execution (1-based, counting executions whose bindings validated) that fails.
    pub(crate) fail_execute: Option<u64>,
    /// The `nrt_load` (1-based, counting loads of valid modules) that fails.
    pub(crate) fail_load: Option<u64>,
    /// Sleep this long in every execution, after validation.
    pub(crate) slow_execute: Option<Duration>,
    /// Only in executions of models whose name contains one of these (all models when empty).
    pub(crate) slow_models: Vec<String>,
    /// Validate bindings, then return success without computing.
    pub(crate) free_execute: bool,
    /// Device memory per NeuronCore, in bytes.
    pub(crate) hbm_bytes: u64,
    /// How long a rank waits at a collective for the other ranks.
    pub(crate) collective_timeout: Duration,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            fail_execute: None,
            fail_load: None,
            slow_execute: None,
            slow_models: Vec::new(),
            free_execute: false,
            hbm_bytes: DEFAULT_HBM_BYTES,
            collective_timeout: DEFAULT_COLLECTIVE_TIMEOUT,
        }
    }
}

impl Config {
    /// Reads the `NRT_SIM_*` variables through `get`. A malformed value is `NRT_INVALID`.
    pub(crate) fn from_env(get: impl Fn(&str) -> Option<String>) -> Res<Config> {
        let bad = |var: &str, val: &str, want: &str| {
            Fail::invalid(format!("nrt_init: {var}={val:?} is not {want}"))
        };
        let nth = |var: &str| -> Res<Option<u64>> {
            match get(var).as_deref().map(str::trim) {
                None | Some("") | Some("0") => Ok(None),
                Some(v) => v
                    .parse::<u64>()
                    .map(Some)
                    .map_err(|_| bad(var, v, "a positive integer (1-based count)")),
            }
        };
        let slow = match get(ENV_SLOW_EXECUTE_MS).as_deref().map(str::trim) {
            None | Some("") | Some("0") => None,
            Some(v) => {
                Some(Duration::from_millis(v.parse::<u64>().map_err(|_| {
                    bad(ENV_SLOW_EXECUTE_MS, v, "a number of milliseconds")
                })?))
            }
        };
        let free = match get(ENV_FREE_EXECUTE).as_deref().map(str::trim) {
            None | Some("") | Some("0") | Some("false") => false,
            Some("1") | Some("true") => true,
            Some(v) => return Err(bad(ENV_FREE_EXECUTE, v, "0, 1, true or false")),
        };
        let hbm_bytes = match get(ENV_HBM_BYTES).as_deref().map(str::trim) {
            None | Some("") => DEFAULT_HBM_BYTES,
            Some(v) => v
                .parse::<u64>()
                .ok()
                .filter(|&n| n > 0)
                .ok_or_else(|| bad(ENV_HBM_BYTES, v, "a positive number of bytes"))?,
        };
        // Read (once per process) by the core-count calls, which work before nrt_init and
        // cannot fail on it; a malformed value is refused here instead of silently ignored.
        if let Some(v) = get(ENV_NC_COUNT) {
            let ok = v
                .trim()
                .parse::<u32>()
                .is_ok_and(|n| (1..=MAX_NC_COUNT).contains(&n));
            if !ok {
                return Err(bad(
                    ENV_NC_COUNT,
                    &v,
                    &format!("a number of NeuronCores from 1 to {MAX_NC_COUNT}"),
                ));
            }
        }
        let collective_timeout = match get(ENV_COLLECTIVE_TIMEOUT_MS).as_deref().map(str::trim) {
            None | Some("") => DEFAULT_COLLECTIVE_TIMEOUT,
            Some(v) => Duration::from_millis(v.parse::<u64>().ok().filter(|&n| n > 0).ok_or_else(
                || {
                    bad(
                        ENV_COLLECTIVE_TIMEOUT_MS,
                        v,
                        "a positive number of milliseconds",
                    )
                },
            )?),
        };
        Ok(Config {
            hbm_bytes,
            collective_timeout,
            fail_execute: nth(ENV_FAIL_EXECUTE)?,
            fail_load: nth(ENV_FAIL_LOAD)?,
            slow_execute: slow,
            slow_models: get(ENV_SLOW_EXECUTE_MODELS)
                .map(|v| {
                    v.split(',')
                        .map(str::trim)
                        .filter(|m| !m.is_empty())
                        .map(String::from)
                        .collect()
                })
                .unwrap_or_default(),
            free_execute: free,
        })
    }

    /// How long an execution of model `name` sleeps (see `slow_execute`).
    pub(crate) fn slow_for(&self, name: &str) -> Option<Duration> {
        let slowed =
            self.slow_models.is_empty() || self.slow_models.iter().any(|m| name.contains(m));
        self.slow_execute.filter(|_| slowed)
    }
}
