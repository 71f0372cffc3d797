//! `deepinfer doctor`: what a Neuron run needs on this machine (libnrt, visible NeuronCores,
//! `neuronx-cc`), found or missing, the runtime's and the compiler's versions against the
//! minimums the graphs need ([`super::minimums`]), and for each missing or too old one how to
//! get it.
//!
//! It never initialises the runtime (that would claim NeuronCores) and never panics: libnrt is
//! only loaded (through `neuron-sys`, which holds every `unsafe`) and asked its version and core
//! count; `neuronx-cc` is found on `PATH` (the `which` crate) and asked `--version` through the
//! compile driver, so there is one implementation of running the compiler.

use std::ffi::OsStr;
use std::fmt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use neuron_sys::{Candidate, Error as NeuronError, Library};

use super::minimums;

/// How to install libnrt.
const FIX_LIBNRT: &str = "install the `aws-neuronx-runtime-lib` package from the AWS Neuron apt \
     (or yum) repository (`apt-get install aws-neuronx-runtime-lib`; on a Trainium host also \
     `aws-neuronx-dkms`, the driver), or set NEURON_RT_LIB to the path of libnrt.so.1; without \
     Neuron, run with `--backend cpu` or `--backend sim`";

/// How to install neuronx-cc.
const FIX_NEURONX_CC: &str = "install the compiler from the AWS Neuron pip repository: \
     `python -m pip install neuronx-cc --extra-index-url=https://pip.repos.neuron.amazonaws.com` \
     (it is a Python package, not an apt one), then put its `bin` directory on PATH";

/// How long `neuronx-cc --version` may take (it is a Python program; about a second).
const VERSION_TIMEOUT: Duration = Duration::from_secs(60);

/// Something the Neuron backend needs that is absent or unusable, and how to fix it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Missing {
    /// What is wrong, on one line.
    pub problem: String,
    /// What to do about it.
    pub fix: String,
}

/// libnrt as found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LibnrtInfo {
    /// What was loaded (`NEURON_RT_LIB`'s value, `libnrt.so.1`, or the install path).
    pub library: String,
    /// The file the loader mapped, when it can be told (from `/proc/self/maps`).
    pub file: Option<PathBuf>,
    /// `nrt_get_version`'s answer, when the runtime has it.
    pub version: Option<String>,
    /// Why and how to upgrade, when the version is below [`minimums::RUNTIME`] (or unknown).
    pub upgrade: Option<Missing>,
}

/// neuronx-cc as found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CompilerInfo {
    /// The executable found on `PATH`.
    pub path: PathBuf,
    /// The version line of `neuronx-cc --version`, or why it could not be had.
    pub version: Result<String, String>,
    /// Why and how to upgrade, when the version is below [`minimums::COMPILER`] (or unknown).
    pub upgrade: Option<Missing>,
}

/// What `deepinfer doctor` reports: one entry per thing a Neuron run needs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DoctorReport {
    /// The runtime library.
    pub libnrt: Result<LibnrtInfo, Missing>,
    /// NeuronCores visible to this process: `Ok(Some(n))` with `n > 0`, or `Ok(None)` when
    /// the runtime cannot count them (it lacks `nrt_get_visible_(v)nc_count`).
    pub neuron_cores: Result<Option<u32>, Missing>,
    /// The compiler.
    pub neuronx_cc: Result<CompilerInfo, Missing>,
}

impl DoctorReport {
    /// Whether everything `--backend neuron` needs was found, at a version new enough.
    pub fn neuron_ready(&self) -> bool {
        matches!(&self.libnrt, Ok(i) if i.upgrade.is_none())
            && self.neuron_cores.is_ok()
            && matches!(&self.neuronx_cc, Ok(i) if i.upgrade.is_none())
    }
}

impl fmt::Display for DoctorReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fn missing(f: &mut fmt::Formatter<'_>, label: &str, m: &Missing) -> fmt::Result {
            writeln!(f, "{label:<12} MISSING: {}. To fix: {}.", m.problem, m.fix)
        }
        match &self.libnrt {
            Ok(info) => {
                let status = if info.upgrade.is_some() {
                    "UPGRADE"
                } else {
                    "ok"
                };
                write!(f, "{:<12} {status}: {}", "libnrt", info.library)?;
                if let Some(file) = info
                    .file
                    .as_ref()
                    .filter(|p| p.as_os_str() != info.library.as_str())
                {
                    write!(f, " ({})", file.display())?;
                }
                match &info.version {
                    Some(v) => write!(f, ", version {v}")?,
                    None => write!(f, ", version unknown (no nrt_get_version)")?,
                }
                match &info.upgrade {
                    Some(u) => writeln!(f, ": {}. To fix: {}.", u.problem, u.fix)?,
                    None => writeln!(f, " (needs {})", minimums::RUNTIME)?,
                }
            }
            Err(m) => missing(f, "libnrt", m)?,
        }
        match &self.neuron_cores {
            Ok(Some(n)) => {
                write!(f, "{:<12} ok: {n} visible", "NeuronCores")?;
                match std::env::var("NEURON_RT_VISIBLE_CORES") {
                    Ok(v) => writeln!(f, " (NEURON_RT_VISIBLE_CORES={v})")?,
                    Err(_) => writeln!(f)?,
                }
            }
            Ok(None) => writeln!(
                f,
                "{:<12} ok: not counted (this libnrt has no nrt_get_visible_nc_count)",
                "NeuronCores"
            )?,
            Err(m) => missing(f, "NeuronCores", m)?,
        }
        match &self.neuronx_cc {
            Ok(info) => {
                let status = if info.upgrade.is_some() {
                    "UPGRADE"
                } else {
                    "ok"
                };
                write!(f, "{:<12} {status}: {}", "neuronx-cc", info.path.display())?;
                match &info.version {
                    Ok(v) => write!(f, ", version {v}")?,
                    Err(e) => write!(f, " (`--version` failed: {e})")?,
                }
                match &info.upgrade {
                    Some(u) => writeln!(f, ": {}. To fix: {}.", u.problem, u.fix),
                    None => writeln!(f, " (needs {})", minimums::COMPILER),
                }
            }
            Err(m) => missing(f, "neuronx-cc", m),
        }
    }
}

/// Checks this machine: libnrt from the usual places ([`Library::candidates`]) and
/// `neuronx-cc` on `PATH`. Never panics; never calls `nrt_init`.
pub fn doctor_report() -> DoctorReport {
    doctor_report_with(&Library::candidates(), std::env::var_os("PATH").as_deref())
}

/// [`doctor_report`] with the places to look given explicitly: libnrt `candidates`, and
/// `path` in `PATH`'s syntax for neuronx-cc.
pub fn doctor_report_with(candidates: &[Candidate], path: Option<&OsStr>) -> DoctorReport {
    let (libnrt, neuron_cores) = check_libnrt(candidates);
    DoctorReport {
        libnrt,
        neuron_cores,
        neuronx_cc: check_neuronx_cc(path),
    }
}

type CoresCheck = Result<Option<u32>, Missing>;

fn check_libnrt(candidates: &[Candidate]) -> (Result<LibnrtInfo, Missing>, CoresCheck) {
    let lib = match Library::load_from(candidates) {
        Ok(lib) => lib,
        Err(e) => {
            let problem = match &e {
                NeuronError::LibraryNotFound { tried } => {
                    let places: Vec<String> = tried
                        .iter()
                        .map(|t| format!("{}: {}", t.place, t.reason))
                        .collect();
                    format!("not found; tried {}", places.join("; "))
                }
                NeuronError::MissingSymbol { library, symbol } => {
                    format!(
                        "{library} is not a usable libnrt: required symbol `{symbol}` is missing"
                    )
                }
                other => other.to_string(),
            };
            let cores = Missing {
                problem: "cannot be counted without libnrt".into(),
                fix: "install libnrt first".into(),
            };
            return (
                Err(Missing {
                    problem,
                    fix: FIX_LIBNRT.into(),
                }),
                Err(cores),
            );
        }
    };
    let version = match lib.version() {
        Ok(v) => v.map(|v| v.to_string()),
        Err(e) => Some(format!("unknown ({e})")),
    };
    let upgrade = upgrade_advice("the runtime", version.as_deref(), &minimums::RUNTIME);
    let info = LibnrtInfo {
        library: lib.name().to_string(),
        file: mapped_file(lib.name()),
        version,
        upgrade,
    };
    let cores = match lib.visible_nc_count() {
        Ok(Some(0)) => Err(Missing {
            problem: "libnrt sees no NeuronCores".into(),
            fix: "run on a Trainium (trn1) instance with the Neuron driver (aws-neuronx-dkms) \
                  loaded, and check that NEURON_RT_VISIBLE_CORES does not exclude every core"
                .into(),
        }),
        Ok(n) => Ok(n),
        Err(e) => Err(Missing {
            problem: format!("counting NeuronCores failed: {e}"),
            fix: "check the Neuron driver (aws-neuronx-dkms) with `neuron-ls`".into(),
        }),
    };
    (Ok(info), cores)
}

/// The file the loader mapped for a library opened by bare soname (`libnrt.so.1`), found in
/// `/proc/self/maps`; a name with a `/` is returned as is. Best effort: `None` elsewhere.
fn mapped_file(name: &str) -> Option<PathBuf> {
    if name.contains('/') {
        return Some(PathBuf::from(name));
    }
    let stem = name.split(".so").next().filter(|s| !s.is_empty())?;
    let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
    maps.lines()
        .filter_map(|line| line.split_whitespace().nth(5))
        .filter(|p| p.starts_with('/'))
        .find(|p| {
            Path::new(p)
                .file_name()
                .and_then(OsStr::to_str)
                .is_some_and(|f| f.starts_with(&format!("{stem}.so")))
        })
        .map(PathBuf::from)
}

fn check_neuronx_cc(path: Option<&OsStr>) -> Result<CompilerInfo, Missing> {
    match find_on_path("neuronx-cc", path) {
        Some(exe) => {
            let version = run_version(&exe);
            let upgrade =
                upgrade_advice("the compiler", version.as_deref().ok(), &minimums::COMPILER);
            Ok(CompilerInfo {
                path: exe,
                version,
                upgrade,
            })
        }
        None => {
            let mut fix = FIX_NEURONX_CC.to_string();
            if let Some(venv) = neuron_venv_with_compiler(Path::new("/opt")) {
                fix = format!(
                    "it is installed in {} but not on PATH: `source {}/bin/activate`; or {fix}",
                    venv.display(),
                    venv.display()
                );
            }
            Err(Missing {
                problem: "`neuronx-cc` is not on PATH".into(),
                fix,
            })
        }
    }
}

/// Why and how to upgrade `what`, whose reported version is `version`, to meet `min`; `None`
/// when it is new enough. A version that cannot be read cannot be shown to meet the minimum,
/// so it gets the advice too.
pub fn upgrade_advice(
    what: &str,
    version: Option<&str>,
    min: &minimums::Minimum,
) -> Option<Missing> {
    let problem = match version.map(|v| (v, min.met_by(v))) {
        Some((_, Some(true))) => return None,
        Some((v, Some(false))) => format!(
            "{what}'s version {v} is older than {}, needed for {}",
            min.version_text(),
            min.reason
        ),
        Some((v, None)) => format!(
            "{what}'s version `{v}` cannot be read, so it cannot be shown to be at least {}, \
             needed for {}",
            min.version_text(),
            min.reason
        ),
        None => format!(
            "{what} does not report its version, so it cannot be shown to be at least {}, \
             needed for {}",
            min.version_text(),
            min.reason
        ),
    };
    Some(Missing {
        problem,
        fix: min.upgrade.to_string(),
    })
}

/// The first executable file called `name` in the directories of `path` (`PATH` syntax).
/// Empty entries are skipped (POSIX reads them as the current directory, which a doctor should
/// not trust); relative ones are taken from the current directory.
fn find_on_path(name: &str, path: Option<&OsStr>) -> Option<PathBuf> {
    let dirs = std::env::split_paths(path?).filter(|dir| !dir.as_os_str().is_empty());
    let path = std::env::join_paths(dirs).ok()?;
    let cwd = std::env::current_dir().unwrap_or_default();
    which::which_in(name, Some(path), cwd).ok()
}

/// A Neuron DLAMI virtual environment (`/opt/aws_neuronx_venv_*`) that has neuronx-cc.
fn neuron_venv_with_compiler(root: &Path) -> Option<PathBuf> {
    let mut venvs: Vec<PathBuf> = std::fs::read_dir(root)
        .ok()?
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .and_then(OsStr::to_str)
                .is_some_and(|n| n.starts_with("aws_neuronx_venv"))
        })
        .filter(|p| find_on_path("neuronx-cc", Some(p.join("bin").as_os_str())).is_some())
        .collect();
    venvs.sort();
    venvs.into_iter().next()
}

/// `<exe> --version`, parsed as the compile driver does (one implementation of running the
/// compiler, with its timeout and pipe handling), or why there is none.
fn run_version(exe: &Path) -> Result<String, String> {
    let cfg = super::compile::CompilerConfig {
        program: exe.to_path_buf(),
        timeout: VERSION_TIMEOUT,
        ..Default::default()
    };
    super::compile::compiler_version(&cfg).map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::OsString;

    fn empty_dir(tag: &str) -> PathBuf {
        let dir =
            std::env::temp_dir().join(format!("deepinfer-doctor-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("temp dir");
        dir
    }

    #[test]
    fn neither_libnrt_nor_neuronx_cc_reports_both_missing_with_fixes() {
        let dir = empty_dir("none");
        let candidates = [
            Candidate::new(
                "/nonexistent/deepinfer-doctor/libnrt.so.1",
                "from NEURON_RT_LIB",
            ),
            Candidate::new(dir.join("libnrt.so.1"), "test"),
        ];
        let path = OsString::from(dir.as_os_str());
        let report = doctor_report_with(&candidates, Some(&path));
        assert!(!report.neuron_ready());
        let lib = report.libnrt.as_ref().unwrap_err();
        assert!(
            lib.problem
                .contains("/nonexistent/deepinfer-doctor/libnrt.so.1"),
            "{lib:?}"
        );
        assert!(lib.fix.contains("aws-neuronx-runtime-lib"), "{lib:?}");
        assert!(report.neuron_cores.is_err());
        let cc = report.neuronx_cc.as_ref().unwrap_err();
        assert!(cc.fix.contains("neuronx-cc"), "{cc:?}");
        assert!(cc.fix.contains("pip"), "{cc:?}");

        let text = report.to_string();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 3, "{text}");
        assert!(
            lines[0].starts_with("libnrt") && lines[0].contains("MISSING"),
            "{text}"
        );
        assert!(
            lines[1].starts_with("NeuronCores") && lines[1].contains("MISSING"),
            "{text}"
        );
        assert!(
            lines[2].starts_with("neuronx-cc") && lines[2].contains("MISSING"),
            "{text}"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_wrong_library_is_reported_by_its_missing_symbol() {
        let candidates = [Candidate::new("libm.so.6", "test")];
        let report = doctor_report_with(&candidates, None);
        let lib = report.libnrt.as_ref().unwrap_err();
        assert!(lib.problem.contains("nrt_init"), "{lib:?}");
        assert!(!report.neuron_ready());
    }

    #[cfg(unix)]
    #[test]
    fn neuronx_cc_on_path_is_found_and_asked_its_version() {
        use std::os::unix::fs::PermissionsExt;
        let dir = empty_dir("cc");
        let exe = dir.join("neuronx-cc");
        std::fs::write(
            &exe,
            "#!/bin/sh\necho 'some banner'\necho 'NeuronX Compiler version 2.99.1.0+test'\n",
        )
        .expect("write fake compiler");
        std::fs::set_permissions(&exe, std::fs::Permissions::from_mode(0o755)).expect("chmod");
        let path =
            std::env::join_paths([PathBuf::from("/nonexistent-dir"), dir.clone()]).expect("PATH");
        let cc = check_neuronx_cc(Some(&path)).expect("found");
        assert_eq!(cc.path, exe);
        assert_eq!(cc.version.as_deref(), Ok("2.99.1.0+test"));
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// tests/fake-neuronx-cc copied into a fresh directory with its `version` file.
    #[cfg(unix)]
    fn fake_compiler(tag: &str, version: &str) -> PathBuf {
        let dir = empty_dir(tag);
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fake-neuronx-cc/neuronx-cc");
        std::fs::copy(script, dir.join("neuronx-cc")).expect("copy the fake compiler");
        std::fs::write(dir.join("version"), version).expect("write its version");
        dir
    }

    #[cfg(unix)]
    #[test]
    fn a_compiler_older_than_the_minimum_gets_upgrade_advice() {
        let dir = fake_compiler("cc-old", "2.17.194.0+0ab0e1b4");
        let path = OsString::from(dir.as_os_str());
        let cc = check_neuronx_cc(Some(&path)).expect("found");
        assert_eq!(cc.version.as_deref(), Ok("2.17.194.0+0ab0e1b4"));
        let advice = cc.upgrade.as_ref().expect("too old");
        assert!(advice.problem.contains("2.17.194.0"), "{advice:?}");
        assert!(advice.problem.contains("2.18.121"), "{advice:?}");
        assert!(
            advice.fix.contains("pip install --upgrade neuronx-cc"),
            "{advice:?}"
        );
        let report = DoctorReport {
            libnrt: Err(Missing {
                problem: "absent".into(),
                fix: "install".into(),
            }),
            neuron_cores: Ok(Some(2)),
            neuronx_cc: Ok(cc),
        };
        let text = report.to_string();
        let line = text.lines().find(|l| l.starts_with("neuronx-cc")).unwrap();
        assert!(
            line.contains("UPGRADE") && line.contains("pip install --upgrade"),
            "{text}"
        );
        assert_eq!(text.lines().count(), 3, "{text}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[cfg(unix)]
    #[test]
    fn a_compiler_at_or_above_the_minimum_is_ok() {
        for (tag, version) in [
            ("cc-min", "2.18.121.0+9e31e41a"),
            ("cc-new", "2.21.18209.0+043b1bf7"),
        ] {
            let dir = fake_compiler(tag, version);
            let path = OsString::from(dir.as_os_str());
            let cc = check_neuronx_cc(Some(&path)).expect("found");
            assert_eq!(cc.upgrade, None, "{version}");
            let _ = std::fs::remove_dir_all(&dir);
        }
    }

    #[test]
    fn a_runtime_older_than_2_30_50_gets_upgrade_advice() {
        let min = &minimums::RUNTIME;
        assert_eq!(upgrade_advice("the runtime", Some("2.34.0.0"), min), None);
        assert_eq!(upgrade_advice("the runtime", Some("2.30.50.0"), min), None);
        for old in [Some("2.29.40.0"), Some("2.22.19.0"), None] {
            let a = upgrade_advice("the runtime", old, min).expect("too old or unknown");
            assert!(a.problem.contains("2.30.50"), "{a:?}");
            assert!(a.problem.contains("4 GiB"), "{a:?}");
            assert!(a.fix.contains("aws-neuronx-runtime-lib"), "{a:?}");
        }
    }

    #[test]
    fn doctor_on_this_machine_does_not_panic() {
        let report = doctor_report();
        let text = report.to_string();
        assert_eq!(text.lines().count(), 3, "{text}");
        if report.libnrt.is_err() {
            assert!(!report.neuron_ready());
            assert!(text.contains("aws-neuronx-runtime-lib"), "{text}");
        }
    }
}
