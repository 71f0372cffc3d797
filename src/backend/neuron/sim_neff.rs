//! nrt-sim's NEFF container: what the stand-in compiler (`nrt-sim-neuronx-cc`) writes and
//! `libnrt_sim.so`'s `nrt_load` reads.
//!
//! A real NEFF is an opaque archive that only neuronx-cc writes and only libnrt reads. nrt-sim
//! runs our HLO on the CPU backend, so its "NEFF" carries that HLO, but wrapped in a container of
//! its own so that the device path is the real one end to end: lower -> compile driver (a
//! compiler process, the NEFF cache) -> `nrt_load` -> names read back with
//! `nrt_get_model_tensor_info`. `nrt_load` refuses anything else, raw HLO bytes included, so a
//! test cannot skip the compile step by accident.
//!
//! The container also carries the I/O names the NEFF reports, computed at "compile" time after
//! the naming convention the stand-in is told to mimic ([`NeffNames`]), so the runner's binding
//! by reported names ([`crate::runner::binding`]) is tested against each convention a real
//! toolchain may use.
//!
//! # Layout (all integers little-endian)
//!
//! | Field | Bytes |
//! |---|---|
//! | magic [`MAGIC`] | 8 |
//! | format version [`VERSION`] | u32 |
//! | input count, then per input: name length (u32), UTF-8 name | |
//! | output count, then per output: name length (u32), UTF-8 name | |
//! | HLO length (u64), the serialized `HloModuleProto` | |
//!
//! Nothing may follow the HLO. Names are checked (non-empty, shorter than libnrt's 256-byte
//! `NRT_TENSOR_NAME_MAX`, unique per direction) when the container is built and when it is read.

use prost::Message;

use crate::backend::hlo::import::{self, io_names};
use crate::backend::hlo::proto::HloModuleProto;
use crate::backend::hlo::MUST_ALIAS_SUFFIX;

/// The container's first 8 bytes.
pub const MAGIC: [u8; 8] = *b"NRTSNEFF";

/// The container format version this build writes and reads. Part of the stand-in compiler's
/// version line, so the NEFF cache never hands a container of another format to `nrt_load`.
pub const VERSION: u32 = 1;

/// The environment variable that chooses the naming convention ([`NeffNames::from_env`]).
pub const ENV_NEFF_NAMES: &str = "NRT_SIM_NEFF_NAMES";

/// The stand-in compiler's flag carrying the naming convention (`--nrt-sim-neff-names=ours`).
/// Passed as a flag rather than only through the environment because flags are part of the NEFF
/// cache key: containers named after different conventions must not share an entry.
pub const NAMES_FLAG: &str = "--nrt-sim-neff-names";

/// Names longer than this (in bytes) are refused: libnrt's `NRT_TENSOR_NAME_MAX` is 256 with the
/// terminating NUL.
pub const NAME_MAX: usize = 255;

/// Which I/O names a NEFF reports: the conventions a real toolchain is known to follow.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum NeffNames {
    /// The names of the HLO's `neff_input_names` / `neff_output_names` attributes, verbatim
    /// (`ours`).
    Ours,
    /// As [`NeffNames::Ours`], with [`MUST_ALIAS_SUFFIX`] on every parameter an output must
    /// alias, once (`must-alias`): what AWS's nkipy says neuronx-cc does ("Neuron compiler
    /// appends '.must_alias_input' to mutated params", aws-neuron/nkipy
    /// `nkipy/src/nkipy/core/backend/hlo.py`). The default.
    #[default]
    MustAlias,
    /// `input{i}` by parameter number and `output{i}` by result index (`positional`): what
    /// torch-neuronx and transformers-neuronx bind (aws-neuron/transformers-neuronx
    /// `src/transformers_neuronx/compiler.py`).
    Positional,
}

impl NeffNames {
    /// Every convention, for tests and messages.
    pub const ALL: [NeffNames; 3] = [NeffNames::Ours, NeffNames::MustAlias, NeffNames::Positional];

    /// The spelling used by [`ENV_NEFF_NAMES`] and [`NAMES_FLAG`].
    pub fn as_str(self) -> &'static str {
        match self {
            NeffNames::Ours => "ours",
            NeffNames::MustAlias => "must-alias",
            NeffNames::Positional => "positional",
        }
    }

    /// Parses [`NeffNames::as_str`]'s spelling.
    pub fn parse(s: &str) -> Result<NeffNames, SimNeffError> {
        NeffNames::ALL
            .into_iter()
            .find(|n| n.as_str() == s.trim())
            .ok_or_else(|| SimNeffError::UnknownNaming(s.to_string()))
    }

    /// [`ENV_NEFF_NAMES`] when set and non-empty, else the default. A value that names no
    /// convention is an error, so a typo cannot silently test the default.
    pub fn from_env() -> Result<NeffNames, SimNeffError> {
        match std::env::var(ENV_NEFF_NAMES) {
            Ok(v) if !v.trim().is_empty() => NeffNames::parse(&v),
            _ => Ok(NeffNames::default()),
        }
    }

    /// The stand-in compiler's flag selecting this convention.
    pub fn flag(self) -> String {
        format!("{NAMES_FLAG}={}", self.as_str())
    }

    /// The NEFF names of a module's inputs and outputs under this convention.
    pub fn apply(self, names: &import::IoNames) -> (Vec<String>, Vec<String>) {
        match self {
            NeffNames::Ours => (names.inputs.clone(), names.outputs.clone()),
            NeffNames::MustAlias => (
                names
                    .inputs
                    .iter()
                    .zip(&names.aliased)
                    .map(|(n, &a)| {
                        if a && !n.ends_with(MUST_ALIAS_SUFFIX) {
                            format!("{n}{MUST_ALIAS_SUFFIX}")
                        } else {
                            n.clone()
                        }
                    })
                    .collect(),
                names.outputs.clone(),
            ),
            NeffNames::Positional => (
                (0..names.inputs.len())
                    .map(|i| format!("input{i}"))
                    .collect(),
                (0..names.outputs.len())
                    .map(|i| format!("output{i}"))
                    .collect(),
            ),
        }
    }
}

/// Why bytes are not a usable nrt-sim NEFF, or a module cannot become one.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SimNeffError {
    /// The magic is wrong: not a container at all (raw HLO bytes, a real NEFF, garbage).
    #[error(
        "not an nrt-sim NEFF (the first bytes are not {:?}); HLO must be compiled by the \
         stand-in compiler (nrt-sim-neuronx-cc) through the compile driver first",
        String::from_utf8_lossy(&MAGIC)
    )]
    NotANeff,
    /// A container of another format version.
    #[error("nrt-sim NEFF format version {found}; this build reads version {VERSION}")]
    UnsupportedVersion {
        /// The version found.
        found: u32,
    },
    /// The bytes end inside a field.
    #[error("truncated nrt-sim NEFF: it ends inside {0}")]
    Truncated(&'static str),
    /// Bytes follow the HLO.
    #[error("{0} bytes follow the HLO in the nrt-sim NEFF")]
    TrailingBytes(usize),
    /// A tensor name that libnrt could not report.
    #[error("NEFF {direction} name {name:?}: {why}")]
    BadName {
        /// `input` or `output`.
        direction: &'static str,
        /// The name.
        name: String,
        /// What is wrong with it.
        why: &'static str,
    },
    /// The module cannot be read or imported.
    #[error("the HLO module cannot be compiled: {0}")]
    Hlo(String),
    /// A naming convention nobody follows.
    #[error(
        "{ENV_NEFF_NAMES}/{NAMES_FLAG}: {0:?} is not a naming convention (ours, must-alias, \
         positional)"
    )]
    UnknownNaming(String),
}

/// A decoded nrt-sim NEFF: the HLO and the names `nrt_get_model_tensor_info` reports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SimNeff {
    /// The serialized `HloModuleProto`.
    pub hlo: Vec<u8>,
    /// One name per HLO parameter, by parameter number.
    pub inputs: Vec<String>,
    /// One name per result, by index.
    pub outputs: Vec<String>,
}

fn check_names(direction: &'static str, names: &[String]) -> Result<(), SimNeffError> {
    let bad = |name: &str, why| SimNeffError::BadName {
        direction,
        name: name.to_string(),
        why,
    };
    for (i, n) in names.iter().enumerate() {
        if n.is_empty() {
            return Err(bad(n, "empty"));
        }
        if n.len() > NAME_MAX {
            return Err(bad(n, "longer than libnrt's 255-byte limit"));
        }
        if n.contains('\0') {
            return Err(bad(n, "contains a NUL byte"));
        }
        if names[..i].contains(n) {
            return Err(bad(n, "appears twice"));
        }
    }
    Ok(())
}

impl SimNeff {
    /// "Compiles" serialized HLO: checks that nrt-sim can run it (it imports) and names its I/O
    /// after `names`. What the stand-in compiler does.
    pub fn compile(hlo: &[u8], names: NeffNames) -> Result<SimNeff, SimNeffError> {
        let module = HloModuleProto::decode(hlo)
            .map_err(|e| SimNeffError::Hlo(format!("not an HloModuleProto: {e}")))?;
        import::import(&module).map_err(|e| SimNeffError::Hlo(e.to_string()))?;
        let io = io_names(&module).map_err(|e| SimNeffError::Hlo(e.to_string()))?;
        let (inputs, outputs) = names.apply(&io);
        check_names("input", &inputs)?;
        check_names("output", &outputs)?;
        Ok(SimNeff {
            hlo: hlo.to_vec(),
            inputs,
            outputs,
        })
    }

    /// The container's bytes.
    pub fn encode(&self) -> Vec<u8> {
        let names = self.inputs.iter().chain(&self.outputs);
        let mut out = Vec::with_capacity(
            32 + self.hlo.len() + names.clone().map(|n| n.len() + 4).sum::<usize>(),
        );
        out.extend_from_slice(&MAGIC);
        out.extend_from_slice(&VERSION.to_le_bytes());
        for list in [&self.inputs, &self.outputs] {
            out.extend_from_slice(&(list.len() as u32).to_le_bytes());
            for n in list {
                out.extend_from_slice(&(n.len() as u32).to_le_bytes());
                out.extend_from_slice(n.as_bytes());
            }
        }
        out.extend_from_slice(&(self.hlo.len() as u64).to_le_bytes());
        out.extend_from_slice(&self.hlo);
        out
    }

    /// Reads a container. Anything but a whole, well-formed container of this [`VERSION`] is an
    /// error (raw HLO bytes are [`SimNeffError::NotANeff`]).
    pub fn decode(bytes: &[u8]) -> Result<SimNeff, SimNeffError> {
        let mut r = Reader { bytes };
        if r.take(MAGIC.len(), "the magic").ok() != Some(&MAGIC[..]) {
            return Err(SimNeffError::NotANeff);
        }
        let version = r.u32("the version")?;
        if version != VERSION {
            return Err(SimNeffError::UnsupportedVersion { found: version });
        }
        let mut lists = [Vec::new(), Vec::new()];
        for (list, (what, direction)) in lists
            .iter_mut()
            .zip([("input names", "input"), ("output names", "output")])
        {
            let n = r.u32(what)?;
            for _ in 0..n {
                let len = r.u32(what)? as usize;
                let raw = r.take(len, what)?;
                let name = std::str::from_utf8(raw).map_err(|_| SimNeffError::BadName {
                    direction,
                    name: String::from_utf8_lossy(raw).into_owned(),
                    why: "not UTF-8",
                })?;
                list.push(name.to_string());
            }
        }
        let [inputs, outputs] = lists;
        check_names("input", &inputs)?;
        check_names("output", &outputs)?;
        let len = usize::try_from(r.u64("the HLO length")?)
            .map_err(|_| SimNeffError::Truncated("the HLO"))?;
        let hlo = r.take(len, "the HLO")?.to_vec();
        if !r.bytes.is_empty() {
            return Err(SimNeffError::TrailingBytes(r.bytes.len()));
        }
        Ok(SimNeff {
            hlo,
            inputs,
            outputs,
        })
    }
}

/// A cursor over the container's bytes.
struct Reader<'a> {
    bytes: &'a [u8],
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize, what: &'static str) -> Result<&'a [u8], SimNeffError> {
        if self.bytes.len() < n {
            return Err(SimNeffError::Truncated(what));
        }
        let (head, rest) = self.bytes.split_at(n);
        self.bytes = rest;
        Ok(head)
    }

    fn u32(&mut self, what: &'static str) -> Result<u32, SimNeffError> {
        let b = self.take(4, what)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn u64(&mut self, what: &'static str) -> Result<u64, SimNeffError> {
        let b = self.take(8, what)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_le_bytes(a))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::hlo::emit;
    use crate::graph::{DType, GraphBuilder, InputRole};

    /// `y = x + 1`, `c <- c + x` (aliased).
    fn module() -> Vec<u8> {
        let b = GraphBuilder::new("t");
        let x = b
            .input("x", InputRole::Metadata, vec![2], DType::F32)
            .unwrap();
        let c = b
            .input("c", InputRole::CacheRoot, vec![2], DType::F32)
            .unwrap();
        let y = x.affine(1.0, 1.0).unwrap();
        let c2 = c.add(&x).unwrap();
        b.output("y", &y).unwrap();
        b.output_aliased("c", &c2, &c).unwrap();
        emit::to_bytes(&emit::emit(&b.finish().unwrap()).unwrap())
    }

    #[test]
    fn each_convention_names_the_io() {
        let hlo = module();
        let names = |n| {
            let neff = SimNeff::compile(&hlo, n).unwrap();
            (neff.inputs, neff.outputs)
        };
        let v = |s: &[&str]| s.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(
            names(NeffNames::Ours),
            (v(&["x", "c.must_alias_input"]), v(&["y", "c"]))
        );
        // The emitter already wrote the suffix: the compiler convention adds it once.
        assert_eq!(
            names(NeffNames::MustAlias),
            (v(&["x", "c.must_alias_input"]), v(&["y", "c"]))
        );
        assert_eq!(
            names(NeffNames::Positional),
            (v(&["input0", "input1"]), v(&["output0", "output1"]))
        );
    }

    #[test]
    fn containers_round_trip_and_anything_else_is_refused() {
        let hlo = module();
        let neff = SimNeff::compile(&hlo, NeffNames::MustAlias).unwrap();
        let bytes = neff.encode();
        assert_eq!(SimNeff::decode(&bytes).unwrap(), neff);
        assert_eq!(SimNeff::decode(&hlo), Err(SimNeffError::NotANeff));
        assert_eq!(SimNeff::decode(b""), Err(SimNeffError::NotANeff));
        for cut in [9, 14, bytes.len() - 1] {
            assert!(
                matches!(
                    SimNeff::decode(&bytes[..cut]),
                    Err(SimNeffError::Truncated(_))
                ),
                "cut at {cut}"
            );
        }
        let mut longer = bytes.clone();
        longer.push(0);
        assert_eq!(
            SimNeff::decode(&longer),
            Err(SimNeffError::TrailingBytes(1))
        );
        let mut v2 = bytes.clone();
        v2[8] = 2;
        assert_eq!(
            SimNeff::decode(&v2),
            Err(SimNeffError::UnsupportedVersion { found: 2 })
        );
        let dup = SimNeff {
            hlo,
            inputs: vec!["a".into(), "a".into()],
            outputs: vec![],
        };
        assert!(matches!(
            SimNeff::decode(&dup.encode()),
            Err(SimNeffError::BadName { .. })
        ));
        assert!(SimNeff::compile(b"\xff\xff not hlo", NeffNames::Ours).is_err());
        assert_eq!(
            NeffNames::parse("positional").unwrap(),
            NeffNames::Positional
        );
        assert!(NeffNames::parse("input-i").is_err());
    }
}
