//! Which of a tensor-parallel model's ranks one process runs ([`RankSpan`], `--ranks`).

use crate::error::{Error, Result};

/// The ranks of a tensor-parallel model one process runs: global ranks `first .. first + count`
/// of the model's `tp`. One instance runs them all; several instances (a model too large for
/// one trn1.32xlarge) each run their share, and libnrt's collectives join them over EFA
/// (bootstrapped from `NEURON_RT_ROOT_COMM_ID`, rank 0's `host:port`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RankSpan {
    /// The global rank of this process's first NeuronCore.
    pub first: usize,
    /// How many ranks (NeuronCores) this process runs.
    pub count: usize,
}

impl std::str::FromStr for RankSpan {
    type Err = Error;

    /// `FIRST..END` (`--ranks 32..64`): ranks `FIRST` up to, not including, `END`.
    fn from_str(s: &str) -> Result<Self> {
        let bad = || {
            Error::InvalidInput(format!(
                "ranks `{s}`: expected FIRST..END with FIRST below END, such as 32..64"
            ))
        };
        let (a, b) = s.split_once("..").ok_or_else(bad)?;
        let (first, end): (usize, usize) = (
            a.trim().parse().map_err(|_| bad())?,
            b.trim().parse().map_err(|_| bad())?,
        );
        if first >= end {
            return Err(bad());
        }
        Ok(RankSpan {
            first,
            count: end - first,
        })
    }
}

impl std::fmt::Display for RankSpan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}..{}", self.first, self.first + self.count)
    }
}
