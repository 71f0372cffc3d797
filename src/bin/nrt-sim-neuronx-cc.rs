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
}

/// Parses the arguments after `compile`.
fn parse(args: &[String]) -> Result<Job, String> {
    let mut input = None;
    let mut output = None;
    let mut names = None;
    let mut framework = None;
    for a in args {
        if let Some(v) = a.strip_prefix("--output=") {
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
    })
}

fn compile(job: &Job) -> Result<(), String> {
    let hlo = std::fs::read(&job.input)
        .map_err(|e| format!("cannot read {}: {e}", job.input.display()))?;
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
