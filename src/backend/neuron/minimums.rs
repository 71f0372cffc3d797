//! The oldest Neuron runtime and compiler deepinfer's graphs need, why, and what to run to
//! upgrade: what `deepinfer doctor` checks the installed versions against.
//!
//! Versions compare as (major, minor, patch) triples of the version the tool itself reports:
//! `nrt_get_version` for the runtime library (2.30.50.0, not the SDK release 2.28 it ships in)
//! and the `NeuronX Compiler version` line of `neuronx-cc --version` for the compiler.

use std::fmt;

/// One minimum version and the reason it is needed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Minimum {
    /// The oldest version that works, (major, minor, patch).
    pub version: (u64, u64, u64),
    /// What fails below it, with its source.
    pub reason: &'static str,
    /// What to run to upgrade.
    pub upgrade: &'static str,
}

impl Minimum {
    /// Whether `version` (as its tool prints it) is at least this minimum; `None` when it
    /// cannot be read as a version.
    pub fn met_by(&self, version: &str) -> Option<bool> {
        parse_version_triple(version).map(|v| v >= self.version)
    }

    /// The minimum as text (`2.30.50`).
    pub fn version_text(&self) -> String {
        let (a, b, c) = self.version;
        format!("{a}.{b}.{c}")
    }
}

impl fmt::Display for Minimum {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, ">= {} for {}", self.version_text(), self.reason)
    }
}

/// The runtime library: tensors of 4 GiB or more (a KV root at `--max-len 4096`, V2 and V3 at
/// the serve defaults) first work in libnrt 2.30.50.0, Neuron SDK 2.28.0 ("Added support for
/// tensors larger than 4GB with 64-bit addressing"; before it the known issues said sizes >= 4 GB
/// overflow "leading to undefined behavior": aws-neuron-sdk
/// `release-notes/components/runtime.rst`). The same release moved `nrt_get_version` and the
/// tensor dtype codes into `nrt.h`, which `neuron-sys` reads by runtime version.
pub const RUNTIME: Minimum = Minimum {
    version: crate::backend::neuron::check::accepted::LARGE_TENSOR_RUNTIME,
    reason: "tensors of 4 GiB or more (first in Neuron SDK 2.28.0)",
    upgrade: "upgrade the runtime from the AWS Neuron repository: `sudo apt-get update && sudo \
              apt-get install --only-upgrade aws-neuronx-runtime-lib aws-neuronx-collectives \
              aws-neuronx-dkms` (yum: `sudo yum update aws-neuronx-runtime-lib \
              aws-neuronx-collectives aws-neuronx-dkms`), or set NEURON_RT_LIB to a newer \
              libnrt.so.1",
};

/// The compiler: our top-k (the MoE router's, and sampling's until it is rewritten) lowers to
/// HLO `sort`, which neuronx-cc did not support in 2024 and which AWS confirmed compiling on
/// neuronx-cc 2.18.121.0 (aws-neuron-sdk#868).
pub const COMPILER: Minimum = Minimum {
    version: (2, 18, 121),
    reason: "HLO sort, which our top-k lowers to (aws-neuron-sdk#868)",
    upgrade: "`python -m pip install --upgrade neuronx-cc \
              --extra-index-url=https://pip.repos.neuron.amazonaws.com` in the environment whose \
              neuronx-cc is on PATH",
};

/// The leading `MAJOR.MINOR[.PATCH]` of a version string (`2.30.50.0+abc`, `2.18`), ignoring
/// anything after the third number.
pub fn parse_version_triple(s: &str) -> Option<(u64, u64, u64)> {
    let core = s.trim().split(['+', ' ', '-']).next()?;
    let mut parts = core.split('.').map(|p| p.parse::<u64>().ok());
    let major = parts.next()??;
    let minor = parts.next()??;
    let patch = match parts.next() {
        Some(p) => p?,
        None => 0,
    };
    Some((major, minor, patch))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_parse_and_compare_as_triples() {
        assert_eq!(parse_version_triple("2.30.50.0"), Some((2, 30, 50)));
        assert_eq!(
            parse_version_triple("2.21.18209.0+043b1bf7"),
            Some((2, 21, 18209))
        );
        assert_eq!(parse_version_triple("2.18"), Some((2, 18, 0)));
        assert_eq!(parse_version_triple("unknown (no symbol)"), None);
        assert_eq!(parse_version_triple(""), None);
        assert_eq!(RUNTIME.met_by("2.34.0.0"), Some(true));
        assert_eq!(RUNTIME.met_by("2.30.50.0"), Some(true));
        assert_eq!(RUNTIME.met_by("2.30.49.0"), Some(false));
        assert_eq!(RUNTIME.met_by("2.29.40.0"), Some(false));
        assert_eq!(COMPILER.met_by("2.18.121.0+9e31e41a"), Some(true));
        assert_eq!(COMPILER.met_by("2.17.194.0"), Some(false));
        assert_eq!(COMPILER.met_by("weird"), None);
    }
}
