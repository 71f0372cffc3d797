//! The CPU backend's memory: whether a model fits this machine's RAM, told before a tensor is
//! read.
//!
//! The CPU backend holds every weight in RAM, in the form its kernels read (for a GGUF's
//! blocks, candle's repacked tiles, which can be larger than the file: see
//! `host::quantized`), and the KV cache. Read past the machine's memory, a model ends in the
//! kernel's OOM killer minutes into the load (the 16.7 GB V2-Lite-shaped Q8_0 GGUF did, at
//! 24 GiB, before its matrices were held once). So [`HostNeed::check`] compares what the load
//! will hold, computed from the checkpoint's headers ([`ModelWeights::predicted_bytes`]) and the
//! cache's size, with `MemAvailable` (the kernel's estimate of what can be allocated without
//! swapping), and refuses with the figures and what would fit (and warns within a tenth of it).
//!
//! It is an estimate: candle's tile sizes are modelled, not measured, and buffers of a step
//! (activations, the graph cache) and the allocator's slack come on top (the V2-Lite-shaped
//! Q4_K_M GGUF, predicted at 13.53 GiB, peaked at 14.98 GiB in `deepinfer bench` and at 16.3
//! GiB after a 4,096-token prefill, whose products of 32 rows or more give candle's AMX
//! kernels a third copy of each single `Q4_K` matrix). The check
//! therefore refuses only what cannot fit, and warns when the figure is within a tenth of
//! the available memory, where the load can still fail.

use std::fs;

use crate::config::ModelConfig;
use crate::deployment::RunnerConfig;
use crate::error::{Error, Result};
use crate::model::{ModelWeights, Precision};
use crate::weights::Checkpoint;

use super::{cache_bytes, gib, human_bytes};

/// What the CPU backend will hold in RAM for a model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostNeed {
    /// The weights as held ([`ModelWeights::predicted_bytes`]).
    pub weights: u64,
    /// The KV cache: `kv_blocks` blocks in the cache's dtype.
    pub kv_cache: u64,
    /// Blocks in the KV cache.
    pub kv_blocks: usize,
}

impl HostNeed {
    /// What loading `cfg` from `ckpt` in `precision` and running it with `runner` will hold;
    /// `None` where the weights are not estimated (DeepSeek-V4, see
    /// [`ModelWeights::predicted_bytes`]).
    pub fn compute(
        cfg: &ModelConfig,
        ckpt: &Checkpoint,
        precision: &Precision,
        runner: &RunnerConfig,
    ) -> Result<Option<Self>> {
        let Some(weights) = ModelWeights::predicted_bytes(cfg, ckpt, precision)? else {
            return Ok(None);
        };
        let (per_block, _) = cache_bytes(cfg, runner.block_size, runner.kv_dtype)?;
        Ok(Some(HostNeed {
            weights,
            kv_cache: per_block * runner.num_blocks as u64,
            kv_blocks: runner.num_blocks,
        }))
    }

    /// Weights and cache.
    pub fn total(&self) -> u64 {
        self.weights + self.kv_cache
    }

    /// An error naming the figures and what would fit when the model needs more than
    /// `available` bytes (`MemAvailable`; nothing is checked when it is unknown). `what` names
    /// the model (its path).
    pub fn check(&self, available: Option<u64>, what: &str) -> Result<()> {
        let Some(available) = available.filter(|&a| self.total() > a) else {
            return Ok(());
        };
        let fix = if self.weights > available {
            "the model in a smaller quantization (for a GGUF, a lower-bit type such as Q4_K_M), \
             or a machine with more memory"
        } else {
            "lower --max-batch, --max-len or --kv-blocks (the cache), or free memory"
        };
        Err(Error::InvalidInput(format!(
            "{what} does not fit this machine's RAM on the CPU backend: it would hold about {} \
             (the weights as its kernels read them {}, the KV cache {} in {} blocks) and {} is \
             available (MemAvailable in /proc/meminfo); what would fit: {fix}",
            gib(self.total()),
            gib(self.weights),
            human_bytes(self.kv_cache),
            self.kv_blocks,
            gib(available),
        )))
    }
}

/// Refuses, before a tensor is read, a model that the CPU backend would hold in more than this
/// machine's available memory ([`HostNeed::check`]), and warns when it would hold within a
/// tenth of it; `what` names it (its path). The figures are logged at `debug`.
pub fn check_cpu_load(
    cfg: &ModelConfig,
    ckpt: &Checkpoint,
    precision: &Precision,
    runner: &RunnerConfig,
    what: &str,
) -> Result<()> {
    let Some(need) = HostNeed::compute(cfg, ckpt, precision, runner)? else {
        return Ok(());
    };
    let available = mem_available();
    tracing::debug!(
        "{what}: the CPU backend will hold about {} of weights and {} of KV cache; {} available",
        human_bytes(need.weights),
        human_bytes(need.kv_cache),
        available.map_or_else(|| "unknown".to_string(), gib)
    );
    need.check(available, what)?;
    if let Some(available) = available.filter(|&a| need.total() > a / 10 * 9) {
        tracing::warn!(
            "{what}: about {} of {} available is close: the figure leaves out the allocator's \
             slack, a step's buffers and copies candle makes for prefill (1.5-2.8 GiB more on \
             a V2-Lite-shaped Q4_K_M), so the load may still run out of memory",
            gib(need.total()),
            gib(available)
        );
    }
    Ok(())
}

/// `MemAvailable` from `/proc/meminfo`, in bytes; `None` where it cannot be read (not Linux).
pub fn mem_available() -> Option<u64> {
    parse_mem_available(&fs::read_to_string("/proc/meminfo").ok()?)
}

fn parse_mem_available(meminfo: &str) -> Option<u64> {
    let line = meminfo.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let mut words = line.split_whitespace().skip(1);
    let n: u64 = words.next()?.parse().ok()?;
    match words.next() {
        Some("kB") | None => n.checked_mul(1024),
        Some(_) => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mem_available_is_read_in_kilobytes() {
        let text = "MemTotal:       32000000 kB\nMemFree:  100 kB\nMemAvailable:   24000000 kB\n";
        assert_eq!(parse_mem_available(text), Some(24_000_000 * 1024));
        assert_eq!(parse_mem_available("MemTotal: 1 kB\n"), None);
    }

    #[test]
    fn a_model_over_the_available_memory_is_refused_with_its_figures() {
        let need = HostNeed {
            weights: 17 << 30,
            kv_cache: 1 << 30,
            kv_blocks: 2048,
        };
        need.check(Some(19 << 30), "m.gguf").unwrap();
        need.check(None, "m.gguf").unwrap();
        let weights = need
            .check(Some(12 << 30), "m.gguf")
            .unwrap_err()
            .to_string();
        for part in [
            "m.gguf",
            "18.00 GiB",
            "17.00 GiB",
            "1.00 GiB in 2048 blocks",
            "12.00 GiB",
        ] {
            assert!(weights.contains(part), "{part} in {weights}");
        }
        assert!(weights.contains("smaller quantization"), "{weights}");
        let cache = need.check(Some((17 << 30) + (1 << 29)), "m.gguf");
        assert!(cache.unwrap_err().to_string().contains("--kv-blocks"));
    }
}
