//! How many neuronx-cc processes run at once: bounded by the cores and by the memory.
//!
//! Each neuronx-cc is itself multi-threaded, so the core term is one compile per 8 CPUs (what
//! the driver always did). A large MoE graph also takes many GB of host memory while it
//! compiles, and a trn1.2xlarge has 32 GB: more compiles at once than the memory holds end in
//! the kernel's OOM killer, or in swapping that makes all of them slower than one at a time.
//! So the default is
//!
//! ```text
//! jobs = max(1, min(cpus / 8, MemAvailable / peak))
//! ```
//!
//! - `MemAvailable` is read from `/proc/meminfo` when the configuration is built (the kernel's
//!   estimate of what can be allocated without swapping); where it cannot be read, only the
//!   cores bound the jobs.
//! - `peak` is *measured* when an earlier compile recorded one: after each neuronx-cc exits,
//!   the driver reads `getrusage(RUSAGE_CHILDREN)`'s max RSS (the largest resident set of any
//!   child process this process has waited for, neuronx-cc's own backend processes included
//!   once neuronx-cc has waited for them) and keeps the largest seen in
//!   `<cache_dir>/compile-peak-rss` (bytes, one decimal number). It is a per-process figure,
//!   not the sum over neuronx-cc's process tree at one instant, so it can understate a compile
//!   whose driver and backend both hold much at once; and it is the largest over every graph
//!   compiled so far, not the next graph's.
//! - Otherwise `peak` is [`GUESSED_COMPILE_PEAK`], a *guess* (16 GiB), not a measurement: no
//!   figure for DeepSeek graphs is published, and a guess on the high side only costs
//!   parallelism on the first run, where a low one can cost the machine.

use std::fs;
use std::path::Path;

use crate::plan::host::mem_available;

/// The peak memory of one compile assumed before any was measured: 16 GiB, a conservative
/// guess (see the module docs), not a measurement.
pub const GUESSED_COMPILE_PEAK: u64 = 16 << 30;

/// The file under the cache root recording the largest measured compile peak.
pub const PEAK_FILE: &str = "compile-peak-rss";

/// CPUs per compile for the core term.
const CPUS_PER_JOB: usize = 8;

/// The default number of compiles at once for a cache at `cache_dir` on this machine (see the
/// module docs).
pub fn default_jobs(cache_dir: &Path) -> usize {
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    let peak = measured_peak(cache_dir).unwrap_or(GUESSED_COMPILE_PEAK);
    jobs_for(cpus, mem_available(), peak)
}

/// `max(1, min(cpus / 8, available / peak))`, the memory term left out when `available` is
/// unknown.
pub fn jobs_for(cpus: usize, available: Option<u64>, peak: u64) -> usize {
    let by_cores = cpus / CPUS_PER_JOB;
    let by_memory = available.map_or(usize::MAX, |a| {
        usize::try_from(a / peak.max(1)).unwrap_or(usize::MAX)
    });
    by_cores.min(by_memory).max(1)
}

/// The largest compile peak recorded under `cache_dir`, in bytes.
pub fn measured_peak(cache_dir: &Path) -> Option<u64> {
    fs::read_to_string(cache_dir.join(PEAK_FILE))
        .ok()?
        .trim()
        .parse()
        .ok()
        .filter(|&n| n > 0)
}

/// The largest resident set of any child this process has waited for, in bytes (Linux).
pub fn children_peak_rss() -> Option<u64> {
    #[cfg(target_os = "linux")]
    {
        use nix::sys::resource::{getrusage, UsageWho};
        let usage = getrusage(UsageWho::RUSAGE_CHILDREN).ok()?;
        // Kilobytes on Linux.
        u64::try_from(usage.max_rss())
            .ok()
            .and_then(|kb| kb.checked_mul(1024))
            .filter(|&b| b > 0)
    }
    #[cfg(not(target_os = "linux"))]
    {
        None
    }
}

/// Records the children's peak (after a compile) under `cache_dir` when it exceeds the one
/// recorded. Best effort: a failure to write only loses the measurement.
pub fn record_peak(cache_dir: &Path) {
    let Some(peak) = children_peak_rss() else {
        return;
    };
    if measured_peak(cache_dir).is_some_and(|old| old >= peak) {
        return;
    }
    // Written whole and renamed, so a reader never sees half a number.
    let tmp = cache_dir.join(format!("{PEAK_FILE}.{}", std::process::id()));
    if fs::write(&tmp, format!("{peak}\n")).is_ok() {
        let _ = fs::rename(&tmp, cache_dir.join(PEAK_FILE));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memory_bounds_the_jobs_as_well_as_cores() {
        const GIB: u64 = 1 << 30;
        // trn1.32xlarge: 128 vCPUs, about 500 GiB free.
        assert_eq!(jobs_for(128, Some(500 * GIB), 16 * GIB), 16);
        assert_eq!(jobs_for(128, Some(100 * GIB), 16 * GIB), 6);
        // trn1.2xlarge: 8 vCPUs.
        assert_eq!(jobs_for(8, Some(30 * GIB), 16 * GIB), 1);
        // Never below one, whatever the memory; cores alone when it is unknown.
        assert_eq!(jobs_for(64, Some(GIB), 16 * GIB), 1);
        assert_eq!(jobs_for(64, None, 16 * GIB), 8);
        assert_eq!(jobs_for(2, None, 0), 1);
    }

    #[test]
    fn the_largest_peak_is_kept() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(measured_peak(dir.path()), None);
        fs::write(dir.path().join(PEAK_FILE), "1024\n").unwrap();
        assert_eq!(measured_peak(dir.path()), Some(1024));
        record_peak(dir.path());
        // This test process has waited for children only if others ran first; either way the
        // recorded figure never goes down.
        assert!(measured_peak(dir.path()).unwrap() >= 1024);
    }
}
