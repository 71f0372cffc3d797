//! The instance types a plan is made for: how many NeuronCores, how much HBM each, how much host
//! RAM.
//!
//! Numbers are AWS's, as gathered in `reference/deepseek-and-neuron-facts.md` §2 (from the
//! aws-neuron-sdk pages `about-neuron/arch/neuron-hardware/{trn1-arch,trn2-arch}.rst` and
//! `about-neuron/arch/neuron-features/logical-neuroncore-config.rst`):
//!
//! | instance | cores a rank can be | HBM per core | host RAM |
//! |---|---|---|---|
//! | trn1.2xlarge | 2 NeuronCore-v2 | 16 GiB | 32 GiB |
//! | trn1.32xlarge | 32 NeuronCore-v2 | 16 GiB | 512 GiB |
//! | trn2.48xlarge | 64 logical cores (LNC=2: two NeuronCore-v3 each) | 24 GiB | 2 TiB |
//!
//! trn2.48xlarge has 16 Trainium2 chips of 8 physical cores and 96 GiB of HBM as four 24 GiB
//! banks, each bank shared by the two physical cores of one logical core; at LNC=2 (the
//! default on trn2, and what NxDI's DeepSeek-V3 recipe requires) that is 64 logical cores of
//! 24 GiB, 1536 GiB in all. A plan counts logical cores as ranks. LNC=1 (128 cores of 12 GiB) is
//! not offered: NxDI reports DeepSeek-V3 running out of HBM there.

use std::fmt;
use std::str::FromStr;

use crate::error::{Error, Result};

/// One GiB.
const GIB: u64 = 1 << 30;

/// An instance type `deepinfer plan` knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Instance {
    /// One Trainium chip: 2 NeuronCore-v2 of 16 GiB, 32 GiB of host RAM. The smallest trn1, and
    /// the one V2-Lite is meant to fit.
    #[default]
    Trn1_2xlarge,
    /// 16 Trainium chips: 32 NeuronCore-v2 of 16 GiB, 512 GiB of host RAM.
    Trn1_32xlarge,
    /// 16 Trainium2 chips: 64 logical NeuronCores (LNC=2) of 24 GiB, 2 TiB of host RAM.
    Trn2_48xlarge,
}

impl Instance {
    /// Every known instance type, smallest first.
    pub const ALL: [Instance; 3] = [
        Instance::Trn1_2xlarge,
        Instance::Trn1_32xlarge,
        Instance::Trn2_48xlarge,
    ];

    /// The AWS name (`trn1.2xlarge`, ...).
    pub fn name(self) -> &'static str {
        match self {
            Instance::Trn1_2xlarge => "trn1.2xlarge",
            Instance::Trn1_32xlarge => "trn1.32xlarge",
            Instance::Trn2_48xlarge => "trn2.48xlarge",
        }
    }

    /// NeuronCores a rank can run on (logical cores on trn2): the most ranks one instance holds.
    pub fn cores(self) -> usize {
        match self {
            Instance::Trn1_2xlarge => 2,
            Instance::Trn1_32xlarge => 32,
            Instance::Trn2_48xlarge => 64,
        }
    }

    /// HBM one rank's core owns, in bytes.
    pub fn hbm_per_core(self) -> u64 {
        match self {
            Instance::Trn1_2xlarge | Instance::Trn1_32xlarge => 16 * GIB,
            Instance::Trn2_48xlarge => 24 * GIB,
        }
    }

    /// Physical NeuronCores behind one rank's core: the runtime's per-physical-core micro-code
    /// overhead is paid this many times (see [`super::neff`]).
    pub fn physical_per_core(self) -> u64 {
        match self {
            Instance::Trn1_2xlarge | Instance::Trn1_32xlarge => 1,
            Instance::Trn2_48xlarge => 2,
        }
    }

    /// The host's RAM, in bytes: what weight loading must stay under.
    pub fn host_ram(self) -> u64 {
        match self {
            Instance::Trn1_2xlarge => 32 * GIB,
            Instance::Trn1_32xlarge => 512 * GIB,
            Instance::Trn2_48xlarge => 2048 * GIB,
        }
    }
}

impl fmt::Display for Instance {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Instance {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        Instance::ALL
            .into_iter()
            .find(|i| i.name() == s)
            .ok_or_else(|| {
                Error::InvalidInput(format!(
                    "--instance {s}: expected one of {}",
                    Instance::ALL.map(Instance::name).join(", ")
                ))
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn totals_match_aws_tables() {
        let hbm = |i: Instance| i.hbm_per_core() * i.cores() as u64 / GIB;
        assert_eq!(hbm(Instance::Trn1_2xlarge), 32);
        assert_eq!(hbm(Instance::Trn1_32xlarge), 512);
        assert_eq!(hbm(Instance::Trn2_48xlarge), 1536);
        for i in Instance::ALL {
            assert_eq!(i.name().parse::<Instance>().unwrap(), i);
        }
        assert!("trn1.8xlarge".parse::<Instance>().is_err());
    }
}
