//! `nrt-sim-neuronx-cc`: the stand-in `neuronx-cc` for nrt-sim.
//!
//! It takes the command line the compile driver gives neuronx-cc
//! (`compile --framework=XLA --target=<t> <model.hlo.pb> --output=<model.neff> <flags...>`, and
//! `--version`), checks that nrt-sim can run the module and writes nrt-sim's NEFF container
//! ([`deepinfer::backend::neuron::sim_neff`]) with the I/O names of the convention chosen by
//! `--nrt-sim-neff-names=<ours|must-alias|positional>`, else `NRT_SIM_NEFF_NAMES`, else
//! `must-alias`. So `--backend sim` and the simulator tests run the real compile driver and NEFF
//! cache, as `--backend neuron` does.
//!
//! Like neuronx-cc (an argparse program) it refuses arguments it does not know, and reports
//! failures on stderr with a non-zero exit status.
//!
//! # Slowing it down, holding it, failing it
//!
//! A real neuronx-cc takes minutes to hours per graph; tests of what happens meanwhile (a
//! server answering while its larger buckets compile) say which graphs are slow:
//!
//! - `--nrt-sim-delay=PATTERN:MS` (or `NRT_SIM_COMPILE_DELAY=PATTERN:MS,...`): sleep `MS`
//!   milliseconds before compiling a matching graph;
//! - `--nrt-sim-hold=PATTERN:PATH` (or `NRT_SIM_COMPILE_HOLD=PATTERN:PATH,...`): wait until the
//!   file `PATH` exists (what a test uses to force an order, without timing);
//! - `--nrt-sim-fail=PATTERN` (or `NRT_SIM_COMPILE_FAIL=PATTERN,...`): fail a matching graph.
//!
//! `PATTERN` is `*` (every graph), a graph's name (the HLO module's: `decode_b4_c64`), or the
//! start of one up to an underscore (`decode_b4` matches `decode_b4_c64` and `decode_b4_c32`,
//! not `decode_b16_c64`). The flags are part of the NEFF cache key, as every flag is; the
//! variables are not, so with them use a fresh cache (`DEEPINFER_NEFF_CACHE`): a cached NEFF
//! is never compiled again.

#![deny(clippy::unwrap_used)]

use std::path::PathBuf;
use std::process::ExitCode;

use deepinfer::backend::neuron::compile::DEFAULT_FLAGS;
use deepinfer::backend::neuron::sim_neff::{NeffNames, SimNeff, NAMES_FLAG, VERSION};

/// Flags neuronx-cc takes that change nothing here (prefixes of `--flag=value` forms included).
const IGNORED_FLAG_PREFIXES: &[&str] = &[
    "--model-type=",
    "--auto-cast=",
    "--auto-cast-type=",
    "-O",
    "--enable-saturate-infinity",
    "--enable-mixed-precision-accumulation",
    "--verbose",
    "--target=",
];

/// What one `compile` invocation asks for.
struct Job {
    input: PathBuf,
    output: PathBuf,
    names: NeffNames,
    knobs: Knobs,
}

/// The delay, hold and failure knobs (see the module docs), flags and environment together.
#[derive(Default)]
struct Knobs {
    delay: Vec<(String, u64)>,
    hold: Vec<(String, PathBuf)>,
    fail: Vec<String>,
}

const DELAY_FLAG: &str = "--nrt-sim-delay=";
const HOLD_FLAG: &str = "--nrt-sim-hold=";
const FAIL_FLAG: &str = "--nrt-sim-fail=";

impl Knobs {
    /// Adds one flag's value (`what` says which knob).
    fn add(&mut self, what: &str, value: &str) -> Result<(), String> {
        let split = || {
            value
                .rsplit_once(':')
                .filter(|(p, _)| !p.is_empty())
                .ok_or_else(|| format!("{what}: expected PATTERN:VALUE, got {value:?}"))
        };
        match what {
            "delay" => {
                let (p, ms) = split()?;
                let ms = ms
                    .parse()
                    .map_err(|_| format!("delay: {ms:?} is not a number of milliseconds"))?;
                self.delay.push((p.to_string(), ms));
            }
            "hold" => {
                // A path may hold ':' itself; the pattern may not.
                let (p, path) = value
                    .split_once(':')
                    .filter(|(p, path)| !p.is_empty() && !path.is_empty())
                    .ok_or_else(|| format!("hold: expected PATTERN:PATH, got {value:?}"))?;
                self.hold.push((p.to_string(), PathBuf::from(path)));
            }
            _ => self.fail.push(value.to_string()),
        }
        Ok(())
    }

    /// Adds the environment's knobs.
    fn add_env(&mut self) -> Result<(), String> {
        for (var, what) in [
            ("NRT_SIM_COMPILE_DELAY", "delay"),
            ("NRT_SIM_COMPILE_HOLD", "hold"),
            ("NRT_SIM_COMPILE_FAIL", "fail"),
        ] {
            let Ok(v) = std::env::var(var) else { continue };
            for item in v.split(',').map(str::trim).filter(|i| !i.is_empty()) {
                self.add(what, item).map_err(|e| format!("{var}: {e}"))?;
            }
        }
        Ok(())
    }

    /// Sleeps, waits or fails as the knobs say for graph `name`.
    fn apply(&self, name: &str) -> Result<(), String> {
        for (p, ms) in &self.delay {
            if matches(p, name) {
                std::thread::sleep(std::time::Duration::from_millis(*ms));
            }
        }
        for (p, path) in &self.hold {
            if matches(p, name) {
                while !path.exists() {
                    std::thread::sleep(std::time::Duration::from_millis(20));
                }
            }
        }
        match self.fail.iter().find(|p| matches(p, name)) {
            Some(p) => Err(format!("{name} fails on purpose ({FAIL_FLAG}{p})")),
            None => Ok(()),
        }
    }
}

/// Whether `pattern` names graph `name` (see the module docs).
fn matches(pattern: &str, name: &str) -> bool {
    pattern == "*"
        || name == pattern
        || name
            .strip_prefix(pattern)
            .is_some_and(|rest| rest.starts_with('_'))
}

/// Parses the arguments after `compile`.
fn parse(args: &[String]) -> Result<Job, String> {
    let mut input = None;
    let mut output = None;
    let mut names = None;
    let mut framework = None;
    let mut knobs = Knobs::default();
    knobs.add_env()?;
    for a in args {
        if let Some(v) = a.strip_prefix(DELAY_FLAG) {
            knobs.add("delay", v)?;
        } else if let Some(v) = a.strip_prefix(HOLD_FLAG) {
            knobs.add("hold", v)?;
        } else if let Some(v) = a.strip_prefix(FAIL_FLAG) {
            knobs.add("fail", v)?;
        } else if let Some(v) = a.strip_prefix("--output=") {
            output = Some(PathBuf::from(v));
        } else if let Some(v) = a.strip_prefix(&format!("{NAMES_FLAG}=")) {
            names = Some(NeffNames::parse(v).map_err(|e| e.to_string())?);
        } else if let Some(v) = a.strip_prefix("--framework=") {
            framework = Some(v.to_string());
        } else if DEFAULT_FLAGS.contains(&a.as_str())
            || IGNORED_FLAG_PREFIXES.iter().any(|p| a.starts_with(p))
        {
            // Accepted and meaningless for a container of HLO.
            continue;
        } else if a.starts_with('-') {
            return Err(format!("unrecognized argument: {a}"));
        } else if input.replace(PathBuf::from(a)).is_some() {
            return Err(format!("more than one input file ({a})"));
        }
    }
    if framework.as_deref() != Some("XLA") {
        return Err(format!(
            "--framework must be XLA (got {})",
            framework.as_deref().unwrap_or("none")
        ));
    }
    let names = match names {
        Some(n) => n,
        None => NeffNames::from_env().map_err(|e| e.to_string())?,
    };
    Ok(Job {
        input: input.ok_or("no input file")?,
        output: output.ok_or("no --output=<path>")?,
        names,
        knobs,
    })
}

fn compile(job: &Job) -> Result<(), String> {
    let hlo = std::fs::read(&job.input)
        .map_err(|e| format!("cannot read {}: {e}", job.input.display()))?;
    if !(job.knobs.delay.is_empty() && job.knobs.hold.is_empty() && job.knobs.fail.is_empty()) {
        use prost::Message;
        let module = deepinfer::backend::hlo::proto::HloModuleProto::decode(hlo.as_slice())
            .map_err(|e| format!("{} is not an HloModuleProto: {e}", job.input.display()))?;
        job.knobs.apply(&module.name)?;
    }
    let neff = SimNeff::compile(&hlo, job.names).map_err(|e| e.to_string())?;
    std::fs::write(&job.output, neff.encode())
        .map_err(|e| format!("cannot write {}: {e}", job.output.display()))
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("--version") => {
            // The compile driver keys its cache on this line: the container version is in it.
            println!(
                "NeuronX Compiler version nrt-sim-{}+neff{VERSION}",
                env!("CARGO_PKG_VERSION")
            );
            ExitCode::SUCCESS
        }
        Some("compile") => match parse(&args[1..]).and_then(|job| compile(&job)) {
            Ok(()) => {
                println!("Compiler status PASS");
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("ERROR: nrt-sim-neuronx-cc: {e}");
                ExitCode::FAILURE
            }
        },
        _ => {
            eprintln!(
                "usage: nrt-sim-neuronx-cc --version | compile --framework=XLA --target=<t> \
                 <model.hlo.pb> --output=<model.neff> [{NAMES_FLAG}=<ours|must-alias|positional>] \
                 [neuronx-cc flags]"
            );
            ExitCode::from(2)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patterns_match_whole_name_parts() {
        assert!(matches("*", "prefill_t16_c64"));
        assert!(matches("decode_b4", "decode_b4_c64"));
        assert!(matches("decode_b4_c64", "decode_b4_c64"));
        assert!(!matches("decode_b4", "decode_b48_c64"));
        assert!(!matches("decode_b1", "decode_b16_c64"));
    }

    #[test]
    fn knobs_parse_and_fail_on_purpose() {
        let mut k = Knobs::default();
        k.add("delay", "decode_b4:5").unwrap();
        k.add("hold", "decode_b2:/tmp/a:b").unwrap();
        k.add("fail", "prefill").unwrap();
        assert_eq!(k.delay, [("decode_b4".to_string(), 5)]);
        assert_eq!(k.hold[0].1, PathBuf::from("/tmp/a:b"));
        assert!(k.add("delay", "decode_b4:soon").is_err());
        assert!(k.add("hold", ":/tmp/x").is_err());
        assert!(k.apply("decode_b4_c64").is_ok());
        assert!(k.apply("prefill_t16_c64").is_err());
    }
}
