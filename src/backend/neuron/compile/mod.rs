//! The `neuronx-cc` driver: HLO bytes in, NEFF bytes out, through a verified on-disk cache.
//!
//! Every captured bucket is one `HloModuleProto`; [`compile_all`] turns a list of them into NEFFs,
//! running at most [`CompilerConfig::jobs`] compiler processes at once (plain std threads, each
//! waiting on one child process: the work is waiting, not computing, so neither rayon nor an
//! async runtime buys anything) and reporting progress as a [`Progress`] span (the binary draws
//! it as a bar; see [`super::progress`] for why a span and not a callback).
//!
//! By concern:
//! - this module: the public API ([`CompilerConfig`], [`CompileJob`], [`CompiledNeff`],
//!   [`compile_all`], [`compiler_version`], [`cache_key`]) and the order of one graph's compile:
//!   look up, lock, look up again, compile, write;
//! - `cache`: the entries, their verified reads and atomic writes, and the per-key lock;
//! - `process`: running neuronx-cc: scratch directories, the timeout, killing the process
//!   tree, the output tails errors quote.
//!
//! The cache's layout (`<cache_dir>/<key>/{model.neff,meta.json}`, `<key>.lock`) and locking are
//! documented in `compile/cache.rs`, scratch directories (`<cache_dir>/work/`) and the timeout in
//! `compile/process.rs`.
//!
//! # The command line
//!
//! ```text
//! neuronx-cc compile --framework=XLA --target=trn1 <workdir>/model.hlo.pb --output=<workdir>/model.neff <flags...>
//! ```
//!
//! run with `<workdir>` as its working directory (neuronx-cc writes `log-neuron-cc.txt` and its
//! intermediate artifacts into its cwd). This is transformers-neuronx's order exactly
//! (`['neuronx-cc', 'compile', '--framework=XLA', '--target=trn1', hlo_path, '--output=' + neff, *flags]`,
//! `cwd=` a scratch directory), and torch-neuronx and libneuronxla also append the user flags
//! last. The user flags go *after* the input on purpose: neuronx-cc parses its command line with
//! argparse, and a multi-valued option such as `--pipeline compile SaveTemps` or
//! `--internal-enable-dge-levels vector_dynamic_offsets` placed just before the positional input
//! would swallow the input path as one more value. Flags are argv elements, not shell words: pass
//! `--tensorizer-options=--enable-ccop-compute-overlap --cc-pipeline-tiling-factor=2` as one
//! string, with no quotes.
//!
//! # The cache key
//!
//! The key is the hex SHA-256 of, in order: a domain tag (`deepinfer-neff-cache-v1`), the HLO
//! bytes, the target, the number of flags, each flag, and the compiler's version line; every
//! variable-length field is preceded by its length as a little-endian u64. The framing makes the
//! key unambiguous: `["-O1", "--x"]` and `["-O1 --x"]` hash differently, as do a flag moved from
//! the end of one field to the start of the next. Flags are hashed in the order given (argparse
//! lets a later flag override an earlier one, so order can matter).
//!
//! The version is the `NeuronX Compiler version <v>` line of `neuronx-cc --version`, not its whole
//! output: the other lines (Python, NumPy versions) do not change the NEFF and would split the
//! cache between virtualenvs that share one compiler. Upgrading the compiler in place changes the
//! line, so stale NEFFs are never reused.
//!
//! Rejected: hashing the text form of the HLO (NxD's `sha256(str(module))[:20]`): our bytes are
//! already deterministic, and a 20-hex-digit truncation buys nothing. Rejected: reusing
//! libneuronxla's layout (`neuronxcc-<version>/MODULE_<hash>+<md5(flags)[:8]>`): its graph hash is
//! not public, and it joins flags into one string, so it is ambiguous. Rejected: keying on the
//! compiler's path or mtime: the version says what matters and survives reinstalls to new paths.

mod cache;
pub mod jobs;
mod process;

use std::collections::{BTreeMap, HashMap};
use std::ffi::OsString;
use std::fmt::Write as _;
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock, PoisonError};
use std::time::Duration;

use sha2::{Digest, Sha256};

use super::progress::Progress;
use crate::error::CompileError;
use cache::{CacheIo, Lookup};

/// The flags every graph is compiled with unless the user overrides them.
///
/// These are NxD's `ModelBuilder` defaults (`append_default_compiler_flags`), which NxDI's MoE
/// models also pass; transformers-neuronx passes the first two:
/// - `--model-type=transformer`: the transformer-specific optimisations every framework asks for.
/// - `--auto-cast=none`: older compilers cast FP32 matmuls to BF16 by default; we want the
///   dtypes the graph says, so the CPU backend stays the reference.
/// - `-O1`: what every framework uses; `-O2` (the compiler's default) costs compile time.
/// - `--enable-saturate-infinity`: on trn1 turns +-inf into +-MAX in computations that would
///   otherwise produce NaN (attention masks). NxD's default set, and NxDI's MoE models, pass it.
///
/// Left out on purpose: `--tensorizer-options=...` and `--internal-*` (undocumented, change
/// between releases), `--enable-mixed-precision-accumulation` (on by default in current
/// compilers), `--verbose=35` (console noise only, but it would still split the cache).
pub const DEFAULT_FLAGS: &[&str] = &[
    "--model-type=transformer",
    "--auto-cast=none",
    "-O1",
    "--enable-saturate-infinity",
];

/// How long one compiler process may run before it is killed (one hour), unless
/// `--compile-timeout` (`crate::deployment::Limits::compile_timeout`) says otherwise.
///
/// A hang guard, not a performance budget: a large MoE decode graph can legitimately take tens of
/// minutes at `-O1` (`lower --check neuron` prints an estimate per graph).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(3600);

/// How `neuronx-cc` is found, run, and where its NEFFs are cached.
///
/// Built once, at capture (`Default` reads the environment then, never later); every field is
/// public so the CLI can override any of them.
#[derive(Debug, Clone)]
pub struct CompilerConfig {
    /// The compiler executable; a bare name is looked up on `PATH` (default `neuronx-cc`).
    pub program: PathBuf,
    /// The `--target` (default `trn1`); part of the cache key.
    pub target: String,
    /// Extra flags, one argv element each, appended after `--output` (default [`DEFAULT_FLAGS`]);
    /// part of the cache key, in order.
    pub flags: Vec<String>,
    /// At most this many compiler processes run at once (0 is treated as 1). The default is one
    /// per 8 CPUs (each neuronx-cc is itself multi-threaded), and no more than the available
    /// memory holds at the measured (else guessed) peak of one compile ([`jobs::default_jobs`]).
    pub jobs: usize,
    /// Each compiler process is killed after this long (default [`DEFAULT_TIMEOUT`]).
    pub timeout: Duration,
    /// The NEFF cache root (default: [`CompilerConfig::default_cache_dir`]).
    pub cache_dir: PathBuf,
    /// Report progress as a [`Progress`] span (default true). The binary draws it as a bar on
    /// stderr only when stderr is a terminal, so logs and CI output stay clean either way.
    pub progress: bool,
}

impl Default for CompilerConfig {
    fn default() -> Self {
        let cache_dir = Self::default_cache_dir();
        Self {
            program: PathBuf::from("neuronx-cc"),
            target: "trn1".to_string(),
            flags: DEFAULT_FLAGS.iter().map(|f| f.to_string()).collect(),
            jobs: jobs::default_jobs(&cache_dir),
            timeout: DEFAULT_TIMEOUT,
            cache_dir,
            progress: true,
        }
    }
}

impl CompilerConfig {
    /// The default cache root: `$DEEPINFER_NEFF_CACHE`, else `$XDG_CACHE_HOME/deepinfer/neff`,
    /// else `$HOME/.cache/deepinfer/neff` (else `<tmp>/deepinfer-neff` when even `HOME` is unset).
    ///
    /// NEFFs are derived data, so they belong in the user's cache directory, not next to the
    /// model; the override lets a fleet share one directory.
    pub fn default_cache_dir() -> PathBuf {
        let var = |name: &str| {
            std::env::var_os(name)
                .filter(|v| !v.is_empty())
                .map(PathBuf::from)
        };
        if let Some(dir) = var("DEEPINFER_NEFF_CACHE") {
            return dir;
        }
        // The XDG spec says a relative value must be ignored.
        if let Some(dir) = var("XDG_CACHE_HOME").filter(|d| d.is_absolute()) {
            return dir.join("deepinfer").join("neff");
        }
        if let Some(home) = var("HOME") {
            return home.join(".cache").join("deepinfer").join("neff");
        }
        std::env::temp_dir().join("deepinfer-neff")
    }

    /// The compiler's arguments (after the program name) for one graph.
    ///
    /// Public so that tests and a dry-run mode can show exactly what will run; see the module
    /// docs for why the flags come last.
    pub fn command_args(&self, input: &Path, output: &Path) -> Vec<OsString> {
        let mut args: Vec<OsString> = vec![
            "compile".into(),
            "--framework=XLA".into(),
            format!("--target={}", self.target).into(),
            input.as_os_str().to_owned(),
        ];
        let mut out = OsString::from("--output=");
        out.push(output.as_os_str());
        args.push(out);
        args.extend(self.flags.iter().map(OsString::from));
        args
    }

    /// Rejects flags that would fight the driver's own arguments.
    fn check(&self, graphs: &str) -> Result<(), CompileError> {
        let invalid = |msg: String| {
            Err(CompileError::InvalidConfig {
                graphs: graphs.to_string(),
                msg,
            })
        };
        if self.target.is_empty() || self.target.contains(char::is_whitespace) {
            return invalid(format!(
                "target {:?} is not a neuronx-cc target",
                self.target
            ));
        }
        for flag in &self.flags {
            let owned = ["--output", "-o", "--target", "--framework"];
            if owned
                .iter()
                .any(|o| flag == o || flag.starts_with(&format!("{o}=")))
            {
                return invalid(format!(
                    "flag {flag:?} is set by the driver itself; use the target setting instead \
                     of --target, and drop --output/--framework from the flags"
                ));
            }
        }
        Ok(())
    }
}

/// One graph to compile: a name for messages and the serialized `HloModuleProto`.
#[derive(Debug, Clone)]
pub struct CompileJob {
    /// A human name (`decode_b8_ctx4096`), used in progress reports, errors and `meta.json`.
    pub name: String,
    /// The serialized `HloModuleProto`, exactly the bytes neuronx-cc reads.
    pub hlo: Vec<u8>,
}

/// One compiled graph, in the same position as its [`CompileJob`].
#[derive(Debug, Clone)]
pub struct CompiledNeff {
    /// The job's name.
    pub name: String,
    /// The cache key (hex SHA-256; see the module docs).
    pub key: String,
    /// The NEFF bytes, verified against `meta.json`.
    pub neff: Vec<u8>,
    /// Where the NEFF lives in the cache (for tools such as `neuron-profile`).
    pub path: PathBuf,
    /// True when this call did not run the compiler: the entry was in the cache, or another
    /// process or thread compiled it while this one waited on the lock.
    pub cache_hit: bool,
    /// Warnings raised for this graph (already reported as `tracing` warnings), e.g. a corrupt
    /// entry that was recompiled. Kept so that callers and tests can act on them.
    pub warnings: Vec<String>,
}

/// The version line of `cfg.program --version` (`2.21.18209.0+043b1bf7`), run once per program
/// per process.
///
/// Part of every cache key, so a compiler upgrade never reuses an old NEFF. Cached because
/// starting neuronx-cc (a Python program) takes about a second.
pub fn compiler_version(cfg: &CompilerConfig) -> Result<String, CompileError> {
    version_for(cfg, "any graph")
}

fn version_for(cfg: &CompilerConfig, graphs: &str) -> Result<String, CompileError> {
    static VERSIONS: OnceLock<Mutex<HashMap<PathBuf, String>>> = OnceLock::new();
    let versions = VERSIONS.get_or_init(Default::default);
    if let Some(v) = lock(versions).get(&cfg.program) {
        return Ok(v.clone());
    }
    // Not holding the mutex while the compiler runs; two threads may both ask, harmlessly.
    let text = process::version_output(cfg, graphs)?;
    let version = parse_version(&text).ok_or_else(|| CompileError::VersionFailed {
        program: cfg.program.clone(),
        graphs: graphs.to_string(),
        status: "printed no version".into(),
        output: text,
    })?;
    lock(versions).insert(cfg.program.clone(), version.clone());
    Ok(version)
}

/// The value of the `NeuronX Compiler version <v>` line; failing that, the whole trimmed output
/// (still a correct cache-key ingredient, only less shareable).
fn parse_version(text: &str) -> Option<String> {
    const PREFIX: &str = "NeuronX Compiler version";
    let line = text
        .lines()
        .find_map(|l| l.trim().strip_prefix(PREFIX).map(str::trim))
        .filter(|v| !v.is_empty());
    match line {
        Some(v) => Some(v.to_string()),
        None => Some(text.trim().to_string()).filter(|t| !t.is_empty()),
    }
}

/// The cache key of one graph: hex SHA-256 over length-framed HLO bytes, target, flags and
/// compiler version (see the module docs).
///
/// Public so that tools can find an entry without compiling, and tests can check the framing.
pub fn cache_key(hlo: &[u8], target: &str, flags: &[String], compiler_version: &str) -> String {
    let mut h = Sha256::new();
    let mut field = |bytes: &[u8]| {
        h.update((bytes.len() as u64).to_le_bytes());
        h.update(bytes);
    };
    field(b"deepinfer-neff-cache-v1");
    field(hlo);
    field(target.as_bytes());
    field(&(flags.len() as u64).to_le_bytes());
    for flag in flags {
        field(flag.as_bytes());
    }
    field(compiler_version.as_bytes());
    hex::encode(h.finalize())
}

/// Compiles every job (or takes it from the cache) and returns the NEFFs in input order.
///
/// At most `cfg.jobs` compilers run at once. On the first failure no new compile starts; the ones
/// already running finish (their NEFFs are cached, so the rerun after a fix is cheaper) and the
/// failure of the earliest failing job is returned. Nothing half-written is left in the cache.
pub fn compile_all(
    cfg: &CompilerConfig,
    jobs: &[CompileJob],
) -> Result<Vec<CompiledNeff>, CompileError> {
    if jobs.is_empty() {
        return Ok(Vec::new());
    }
    let results: Mutex<Vec<Option<Result<CompiledNeff, CompileError>>>> =
        Mutex::new((0..jobs.len()).map(|_| None).collect());
    let failed = AtomicBool::new(false);
    run_jobs(cfg, jobs, &failed, true, &|i, result| {
        lock(&results)[i] = Some(result);
    })?;
    let results = results.into_inner().unwrap_or_else(PoisonError::into_inner);
    // Jobs are taken in index order, so every job before the first failure has a result.
    results
        .into_iter()
        .map_while(|r| r)
        .collect::<Result<Vec<_>, _>>()
}

/// Compiles every job (or takes it from the cache), handing each result to `done` (with the
/// job's index) as soon as it is ready, in whatever order they finish: what a background
/// capture needs, where each bucket joins as soon as its own NEFF is there. Unlike
/// [`compile_all`], a failure does not stop the other jobs; `cancel` does (set it and no new
/// compile starts; those running finish). When the compiler cannot even be set up (no
/// version, no cache directory), every job gets that error.
pub fn compile_each(
    cfg: &CompilerConfig,
    jobs: &[CompileJob],
    cancel: &AtomicBool,
    done: &(dyn Fn(usize, Result<CompiledNeff, CompileError>) + Sync),
) {
    if let Err(e) = run_jobs(cfg, jobs, cancel, false, done) {
        let msg = e.to_string();
        for (i, job) in jobs.iter().enumerate() {
            done(
                i,
                Err(CompileError::InvalidConfig {
                    graphs: job.name.clone(),
                    msg: msg.clone(),
                }),
            );
        }
    }
}

/// The workers of [`compile_all`] and [`compile_each`]: checks the configuration, finds the
/// compiler's version and the cache, then runs at most `cfg.jobs` compiles at once, handing each
/// result to `done`, until the jobs run out or `stop` is set (by the caller, or with
/// `stop_on_failure` by the first failure). An error only when nothing could start.
fn run_jobs(
    cfg: &CompilerConfig,
    jobs: &[CompileJob],
    stop: &AtomicBool,
    stop_on_failure: bool,
    done: &(dyn Fn(usize, Result<CompiledNeff, CompileError>) + Sync),
) -> Result<(), CompileError> {
    if jobs.is_empty() {
        return Ok(());
    }
    let graphs = graph_list(jobs);
    cfg.check(&graphs)?;
    let version = version_for(cfg, &graphs)?;
    fs::create_dir_all(&cfg.cache_dir).map_err(|source| CompileError::Cache {
        graph: graphs.clone(),
        action: "create",
        path: cfg.cache_dir.clone(),
        source,
    })?;

    let progress = if cfg.progress {
        let n = jobs.len();
        Progress::start(
            &format!("compiling {n} graph{}", if n == 1 { "" } else { "s" }),
            n,
        )
    } else {
        Progress::hidden()
    };
    let ctx = Ctx {
        cfg,
        version: &version,
        progress,
        running: Mutex::new(BTreeMap::new()),
        done: AtomicUsize::new(0),
    };
    let next = AtomicUsize::new(0);
    let workers = cfg.jobs.max(1).min(jobs.len());
    std::thread::scope(|s| {
        for _ in 0..workers {
            s.spawn(|| {
                while !stop.load(Ordering::SeqCst) {
                    let i = next.fetch_add(1, Ordering::SeqCst);
                    let Some(job) = jobs.get(i) else { break };
                    ctx.started(i, &job.name);
                    let result = ctx.compile_one(job);
                    if result.is_err() && stop_on_failure {
                        stop.store(true, Ordering::SeqCst);
                    }
                    done(i, result);
                    ctx.finished(i);
                }
            });
        }
    });
    drop(ctx); // ends the progress span
    Ok(())
}

/// What the workers share.
struct Ctx<'a> {
    cfg: &'a CompilerConfig,
    version: &'a str,
    progress: Progress,
    /// The graphs in flight, by job index, for the progress reports.
    running: Mutex<BTreeMap<usize, String>>,
    /// Jobs finished so far (compiled, cached or failed).
    done: AtomicUsize,
}

impl Ctx<'_> {
    fn started(&self, i: usize, name: &str) {
        let mut running = lock(&self.running);
        running.insert(i, name.to_string());
        self.progress.update(
            self.done.load(Ordering::SeqCst),
            &join_names(running.values()),
        );
    }

    fn finished(&self, i: usize) {
        let mut running = lock(&self.running);
        running.remove(&i);
        let done = self.done.fetch_add(1, Ordering::SeqCst) + 1;
        self.progress.update(done, &join_names(running.values()));
    }

    fn warn(&self, warnings: &mut Vec<String>, msg: String) {
        tracing::warn!("{msg}");
        warnings.push(msg);
    }

    /// One graph: a lock-free lookup, then under the key's lock a second lookup, the compile
    /// and the write (see [`cache`] for why in that order).
    fn compile_one(&self, job: &CompileJob) -> Result<CompiledNeff, CompileError> {
        let cfg = self.cfg;
        let key = cache_key(&job.hlo, &cfg.target, &cfg.flags, self.version);
        let entry = cache::entry_dir(&cfg.cache_dir, &key);
        let mut warnings = Vec::new();
        let done = |neff: Vec<u8>, cache_hit: bool, warnings: Vec<String>| CompiledNeff {
            name: job.name.clone(),
            key: key.clone(),
            neff,
            path: entry.join(cache::NEFF_FILE),
            cache_hit,
            warnings,
        };
        let io = |e: CacheIo| e.into_error(&job.name);

        // Lock-free fast path: entries are renamed into place whole, so a hit is trustworthy.
        // A miss or an apparent corruption is decided again under the lock (a writer may be
        // halfway through replacing a corrupt entry).
        if let Lookup::Hit(neff) = cache::read_entry(&entry, &key) {
            return Ok(done(neff, true, warnings));
        }

        let key_lock = cache::lock_key(&cfg.cache_dir, &key, || {
            self.progress.update(
                self.done.load(Ordering::SeqCst),
                &format!("{} (waiting for another process)", job.name),
            );
        })
        .map_err(io)?;
        if !key_lock.is_locked() {
            self.warn(
                &mut warnings,
                format!(
                    "the NEFF cache at {} does not support file locks; compiling {} \
                     unlocked (another process may compile it too)",
                    cfg.cache_dir.display(),
                    job.name
                ),
            );
        }

        match cache::read_entry(&entry, &key) {
            Lookup::Hit(neff) => return Ok(done(neff, true, warnings)),
            Lookup::Missing => {}
            Lookup::Corrupt(why) => {
                self.warn(
                    &mut warnings,
                    format!(
                        "NEFF cache entry {key} for {} is corrupt ({why}); recompiling",
                        job.name
                    ),
                );
                cache::remove_entry(&entry).map_err(io)?;
            }
        }

        let neff = process::run_compiler(cfg, job, &key)?;
        let meta = cache::Meta::new(job, &key, &neff, self.version, cfg);
        cache::write_entry(&entry, &meta, &neff).map_err(io)?;
        drop(key_lock);
        Ok(done(neff, false, warnings))
    }
}

fn join_names<'a>(names: impl Iterator<Item = &'a String>) -> String {
    names.map(String::as_str).collect::<Vec<_>>().join(", ")
}

/// The job names for messages, shortened when there are many.
fn graph_list(jobs: &[CompileJob]) -> String {
    const SHOWN: usize = 8;
    let mut s = jobs
        .iter()
        .take(SHOWN)
        .map(|j| j.name.as_str())
        .collect::<Vec<_>>()
        .join(", ");
    if jobs.len() > SHOWN {
        let _ = write!(s, " and {} more", jobs.len() - SHOWN);
    }
    s
}

/// Locks a mutex whose data stays valid even if a holder panicked.
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_framing_is_unambiguous() {
        let f = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let k = cache_key(b"hlo", "trn1", &f(&["-O1", "--x"]), "2.0");
        assert_eq!(k.len(), 64);
        assert_ne!(k, cache_key(b"hlo", "trn1", &f(&["-O1 --x"]), "2.0"));
        assert_ne!(k, cache_key(b"hlo", "trn1", &f(&["--x", "-O1"]), "2.0"));
        assert_ne!(k, cache_key(b"hlo", "trn1", &f(&["-O1", "--x"]), "2.1"));
        assert_ne!(k, cache_key(b"hlo", "trn2", &f(&["-O1", "--x"]), "2.0"));
        assert_ne!(k, cache_key(b"hl", "otrn1", &f(&["-O1", "--x"]), "2.0"));
        assert_eq!(k, cache_key(b"hlo", "trn1", &f(&["-O1", "--x"]), "2.0"));
    }

    #[test]
    fn key_is_lowercase_hex_sha256() {
        // The framing of an empty everything, hashed by hand: the key format must not drift
        // (entries on disk are found by it).
        let mut h = Sha256::new();
        for field in [
            &b"deepinfer-neff-cache-v1"[..],
            b"",
            b"",
            &0u64.to_le_bytes(),
            b"",
        ] {
            h.update((field.len() as u64).to_le_bytes());
            h.update(field);
        }
        let want: String = h.finalize().iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(cache_key(b"", "", &[], ""), want);
    }

    #[test]
    fn version_line_is_extracted() {
        let out = "NeuronX Compiler version 2.27.5334.0+f702b353\n\nPython version 3.13.7\n\
                   HWM version 2.27.5334.0+f702b353\nNumPy version 2.4.6\n";
        assert_eq!(parse_version(out).unwrap(), "2.27.5334.0+f702b353");
        assert_eq!(parse_version("weird 1.0\n").unwrap(), "weird 1.0");
        assert_eq!(parse_version(" \n"), None);
    }

    #[test]
    fn graph_lists_are_shortened() {
        let jobs: Vec<CompileJob> = (0..10)
            .map(|i| CompileJob {
                name: format!("g{i}"),
                hlo: Vec::new(),
            })
            .collect();
        assert_eq!(graph_list(&jobs[..2]), "g0, g1");
        assert_eq!(
            graph_list(&jobs),
            "g0, g1, g2, g3, g4, g5, g6, g7 and 2 more"
        );
    }
}
