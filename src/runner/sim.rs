//! Finding nrt-sim, the simulated NeuronCore `--backend sim` runs on: its library, its
//! stand-in compiler and the compile driver's configuration for it. Both the device runner
//! ([`super::device`]) and [`super::open`] read it.

use std::path::PathBuf;

use crate::backend::neuron::compile::CompilerConfig;
use crate::backend::neuron::sim_neff::{NeffNames, ENV_NEFF_NAMES, NAMES_FLAG};
use crate::error::{Error, Result};

/// The file name of nrt-sim's shared library.
pub const SIM_LIBRARY_FILE: &str = "libnrt_sim.so";

/// The file name of nrt-sim's stand-in compiler (`src/bin/nrt-sim-neuronx-cc.rs`).
pub const SIM_COMPILER_FILE: &str = "nrt-sim-neuronx-cc";

/// The `git_hash` nrt-sim reports from `nrt_get_version`: how a loaded libnrt is recognised
/// as the simulator (whose NEFFs its stand-in compiler writes, see [`sim_compiler`]).
pub const SIM_GIT_HASH: &str = "nrt-sim";

/// The stand-in compiler `--backend sim` runs: the first of [`sim_library_beside_exe`]'s
/// directories holding [`SIM_COMPILER_FILE`] (cargo writes it to `target/<profile>/`, beside the
/// CLI and one level above a test binary), else the bare name, looked up on `PATH` by the
/// compile driver (which reports a clear error when it is nowhere).
pub fn sim_compiler() -> PathBuf {
    sim_library_beside_exe()
        .into_iter()
        .filter_map(|lib| lib.parent().map(|d| d.join(SIM_COMPILER_FILE)))
        .find(|p| p.is_file())
        .unwrap_or_else(|| PathBuf::from(SIM_COMPILER_FILE))
}

/// The compile driver's configuration for nrt-sim: the stand-in compiler ([`sim_compiler`]), the
/// default flags plus the naming convention (`names`, part of the cache key), and a cache of its
/// own (`$DEEPINFER_NEFF_CACHE` when set, else `<tmp>/deepinfer-nrt-sim-neff`: sim NEFFs are
/// cheap to remake and do not belong in the user's NEFF cache). One compiler process per CPU,
/// since the stand-in is quick and single-threaded.
pub fn sim_compiler_config(names: NeffNames) -> CompilerConfig {
    sim_compiler_config_flag(names.flag())
}

/// [`sim_compiler_config`] with the convention `NRT_SIM_NEFF_NAMES` names, else the default,
/// passed to the stand-in as given: a value naming no convention fails the compile with the
/// stand-in's message (at capture, where a `Result` is returned), never silently the default.
/// How `NRT_SIM_NEFF_NAMES=positional cargo test --workspace` runs every sim test under that
/// convention.
pub fn sim_compiler_config_from_env() -> CompilerConfig {
    let value = std::env::var(ENV_NEFF_NAMES)
        .ok()
        .map(|v| v.trim().to_string())
        .filter(|v| !v.is_empty())
        .unwrap_or_else(|| NeffNames::default().as_str().to_string());
    sim_compiler_config_flag(format!("{NAMES_FLAG}={value}"))
}

fn sim_compiler_config_flag(names_flag: String) -> CompilerConfig {
    let base = CompilerConfig::default();
    let cache_dir = if std::env::var_os("DEEPINFER_NEFF_CACHE").is_none_or(|v| v.is_empty()) {
        std::env::temp_dir().join("deepinfer-nrt-sim-neff")
    } else {
        base.cache_dir.clone()
    };
    let mut flags = base.flags.clone();
    flags.push(names_flag);
    CompilerConfig {
        program: sim_compiler(),
        flags,
        jobs: std::thread::available_parallelism().map_or(1, |n| n.get()),
        cache_dir,
        progress: false,
        ..base
    }
}

/// Where `--backend sim` looks for nrt-sim, in order: `NEURON_RT_LIB` when set, then
/// [`sim_library_beside_exe`].
pub fn sim_library_candidates() -> Vec<PathBuf> {
    let mut out = Vec::new();
    if let Some(p) = std::env::var_os(neuron_sys::NEURON_RT_LIB).filter(|v| !v.is_empty()) {
        out.push(PathBuf::from(p));
    }
    out.extend(sim_library_beside_exe());
    out
}

/// Where cargo puts nrt-sim's library relative to the running executable, in order: beside
/// it, in its `deps/` directory, then in its parent directory. A binary lives in
/// `target/<profile>/` beside the library; a test or bench lives in `target/<profile>/deps/`,
/// where `cargo test` also writes the library; an example lives one level below the library.
/// nrt-sim's own test helpers look here too, so the rule is written once.
pub fn sim_library_beside_exe() -> Vec<PathBuf> {
    let mut out = Vec::new();
    if let Ok(exe) = std::env::current_exe() {
        if let Some(dir) = exe.parent() {
            out.push(dir.join(SIM_LIBRARY_FILE));
            out.push(dir.join("deps").join(SIM_LIBRARY_FILE));
            if let Some(up) = dir.parent() {
                out.push(up.join(SIM_LIBRARY_FILE));
            }
        }
    }
    out
}

/// The first of [`sim_library_candidates`] that exists, or an error listing where it looked.
pub fn find_sim_library() -> Result<PathBuf> {
    let candidates = sim_library_candidates();
    candidates
        .iter()
        .find(|p| p.is_file())
        .cloned()
        .ok_or_else(|| {
            let places: Vec<String> = candidates.iter().map(|p| p.display().to_string()).collect();
            Error::Unavailable(format!(
                "nrt-sim ({SIM_LIBRARY_FILE}) not found; looked in {}. Build it with \
                 `cargo build -p nrt-sim`, or set NEURON_RT_LIB to its path, or use `--backend cpu`",
                places.join(", ")
            ))
        })
}
