//! The `neuronx-cc` driver: HLO bytes in, NEFF bytes out, through a verified on-disk cache.
//!
//! Every captured bucket is one `HloModuleProto`; [`compile_all`] turns a list of them into NEFFs,
//! running at most [`CompilerConfig::jobs`] compiler processes at once (plain std threads, each
//! waiting on one child process: the work is waiting, not computing, so neither rayon nor an
//! async runtime buys anything) and showing one progress bar.
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
//!
//! # The cache entry
//!
//! `<cache_dir>/<key>/model.neff` and `<cache_dir>/<key>/meta.json` (graph name, key, size and
//! SHA-256 of the NEFF, compiler version, target, flags, creation time). Each file is written to a
//! temporary file in the same directory, fsynced, then renamed over its final name; `meta.json` is
//! written last, so it is the commit record. A reader checks that the NEFF's size and SHA-256 match
//! `meta.json`; a truncated, partial or otherwise corrupt entry is reported on stderr
//! (`warning: NEFF cache entry <key> for <name> is corrupt (<why>); recompiling`) and recompiled.
//! A failed compile writes nothing into the cache. Rejected: libneuronxla's habit of caching
//! failures until `--retry_failed_compilation`; a timeout or an out-of-memory kill is often
//! transient, and retrying is the user's obvious next step.
//!
//! # Locking
//!
//! Two processes capturing the same model at once would compile every graph twice. So each key has
//! a lock file `<cache_dir>/<key>.lock`, locked exclusively with [`std::fs::File::lock`] while the
//! entry is checked, compiled and written; the second process waits, then finds the entry and
//! reuses it (its result says `cache_hit`). The lock is taken only after a lock-free lookup has
//! missed, so warm starts never wait on a compile of some other graph.
//!
//! The kernel drops the lock when its holder dies, so a crash or `kill -9` never leaves a stale
//! lock behind. Rejected: marker files created with `create_new` (libneuronxla's
//! `model.hlo_module.pb.lock`), which stay behind after a crash and block everyone until someone
//! deletes them by hand. Rejected: one lock for the whole cache, which would serialise unrelated
//! compiles across processes. Lock files are never deleted: deleting one while a process waits on
//! it would let a third process lock a fresh inode, and two processes would then hold "the" lock.
//! On a filesystem without file locks the driver warns and goes on unlocked; entries stay
//! consistent (writes are atomic), at worst a graph is compiled twice.
//!
//! # Scratch directories, timeouts
//!
//! Each compile runs in `<cache_dir>/work/<key>.<pid>/`: on the cache's filesystem (neuronx-cc's
//! artifacts are large; `/tmp` is often a small tmpfs) and private to the lock holder. It holds
//! the input, `command.txt` (the command line, to rerun by hand), `compiler-output.txt` (stdout and
//! stderr, interleaved) and whatever neuronx-cc writes. It is removed after a success and kept after
//! a failure, so the error can point at the logs; the next attempt at the same key removes it.
//!
//! A compiler that runs longer than [`CompilerConfig::timeout`] is killed, together with its
//! descendants (found through `/proc` on Linux: neuronx-cc is a Python driver that starts backend
//! processes). Rejected: putting each compiler in its own process group and killing the group,
//! because then a Ctrl-C in the terminal would no longer reach the compilers and they would
//! outlive deepinfer.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::ffi::OsString;
use std::fmt::Write as _;
use std::fs::{self, File, OpenOptions};
use std::io::{self, IsTerminal, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock, PoisonError};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::error::fmt_duration;
use crate::error::CompileError;

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

/// How long one compiler process may run before it is killed (one hour).
///
/// A hang guard, not a performance budget: a large MoE decode graph can legitimately take tens of
/// minutes at `-O1`.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(3600);

/// How many lines of the compiler's output an error quotes.
const TAIL_LINES: usize = 40;

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
    /// per 8 CPUs: each neuronx-cc is itself multi-threaded and needs several GB of memory.
    pub jobs: usize,
    /// Each compiler process is killed after this long (default [`DEFAULT_TIMEOUT`]).
    pub timeout: Duration,
    /// The NEFF cache root (default: [`CompilerConfig::default_cache_dir`]).
    pub cache_dir: PathBuf,
    /// Show a progress bar on stderr (default true; it is hidden anyway when stderr is not a
    /// terminal, so logs and CI output stay clean).
    pub progress: bool,
}

impl Default for CompilerConfig {
    fn default() -> Self {
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
        Self {
            program: PathBuf::from("neuronx-cc"),
            target: "trn1".to_string(),
            flags: DEFAULT_FLAGS.iter().map(|f| f.to_string()).collect(),
            jobs: (cpus / 8).max(1),
            timeout: DEFAULT_TIMEOUT,
            cache_dir: Self::default_cache_dir(),
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
    /// A human name (`decode_b8_ctx4096`), used in the progress bar, errors and `meta.json`.
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
    /// Warnings raised for this graph (already printed on stderr), e.g. a corrupt entry that was
    /// recompiled. Kept so that callers and tests can act on them.
    pub warnings: Vec<String>,
}

/// `meta.json`: what the entry holds and how it was made.
#[derive(Debug, Serialize, Deserialize)]
struct Meta {
    /// The graph that first produced the entry (content-addressed: others may share it).
    name: String,
    key: String,
    size: u64,
    sha256: String,
    compiler_version: String,
    target: String,
    flags: Vec<String>,
    hlo_size: u64,
    hlo_sha256: String,
    created_unix_secs: u64,
    deepinfer_version: String,
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
    let version = run_version(cfg, graphs)?;
    lock(versions).insert(cfg.program.clone(), version.clone());
    Ok(version)
}

fn run_version(cfg: &CompilerConfig, graphs: &str) -> Result<String, CompileError> {
    let failed = |status: String, output: String| CompileError::VersionFailed {
        program: cfg.program.clone(),
        graphs: graphs.to_string(),
        status,
        output,
    };
    let mut cmd = Command::new(program_path(&cfg.program));
    cmd.arg("--version")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = spawn(&mut cmd).map_err(|source| CompileError::CompilerNotFound {
        program: cfg.program.clone(),
        graphs: graphs.to_string(),
        source,
    })?;
    // Read both pipes on threads so a chatty compiler cannot fill one and block.
    let readers: Vec<_> = [
        child
            .stdout
            .take()
            .map(|r| Box::new(r) as Box<dyn Read + Send>),
        child
            .stderr
            .take()
            .map(|r| Box::new(r) as Box<dyn Read + Send>),
    ]
    .into_iter()
    .flatten()
    .map(|mut r| {
        std::thread::spawn(move || {
            let mut buf = Vec::new();
            let _ = r.read_to_end(&mut buf);
            buf
        })
    })
    .collect();
    let timeout = cfg.timeout.min(Duration::from_secs(300));
    let status = wait_with_timeout(&mut child, timeout)
        .map_err(|e| failed(format!("cannot wait for it: {e}"), String::new()))?;
    let mut text = String::new();
    for r in readers {
        text.push_str(&String::from_utf8_lossy(&r.join().unwrap_or_default()));
    }
    let Some(status) = status else {
        return Err(failed(
            format!("timed out after {}", fmt_duration(timeout)),
            tail_lines(&text, TAIL_LINES),
        ));
    };
    if !status.success() {
        return Err(failed(status.to_string(), tail_lines(&text, TAIL_LINES)));
    }
    parse_version(&text).ok_or_else(|| failed("printed no version".into(), text))
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
    hex(&h.finalize())
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
    let graphs = graph_list(jobs);
    cfg.check(&graphs)?;
    let version = version_for(cfg, &graphs)?;
    fs::create_dir_all(&cfg.cache_dir).map_err(|source| CompileError::Cache {
        graph: graphs.clone(),
        action: "create",
        path: cfg.cache_dir.clone(),
        source,
    })?;

    let bar = progress_bar(cfg, jobs.len());
    let ctx = Ctx {
        cfg,
        version: &version,
        bar: &bar,
        running: Mutex::new(BTreeMap::new()),
    };
    let next = AtomicUsize::new(0);
    let failed = AtomicBool::new(false);
    let results: Mutex<Vec<Option<Result<CompiledNeff, CompileError>>>> =
        Mutex::new((0..jobs.len()).map(|_| None).collect());
    let workers = cfg.jobs.max(1).min(jobs.len());
    std::thread::scope(|s| {
        for _ in 0..workers {
            s.spawn(|| {
                while !failed.load(Ordering::SeqCst) {
                    let i = next.fetch_add(1, Ordering::SeqCst);
                    let Some(job) = jobs.get(i) else { break };
                    ctx.started(i, &job.name);
                    let result = ctx.compile_one(job);
                    if result.is_err() {
                        failed.store(true, Ordering::SeqCst);
                    }
                    lock(&results)[i] = Some(result);
                    ctx.finished(i);
                }
            });
        }
    });
    bar.finish_and_clear();

    let results = results.into_inner().unwrap_or_else(PoisonError::into_inner);
    // Jobs are taken in index order, so every job before the first failure has a result.
    results
        .into_iter()
        .map_while(|r| r)
        .collect::<Result<Vec<_>, _>>()
}

/// What the workers share.
struct Ctx<'a> {
    cfg: &'a CompilerConfig,
    version: &'a str,
    bar: &'a ProgressBar,
    /// The graphs in flight, by job index, for the bar's message.
    running: Mutex<BTreeMap<usize, String>>,
}

/// A cache lookup's outcome.
enum Lookup {
    Hit(Vec<u8>),
    Missing,
    Corrupt(String),
}

impl Ctx<'_> {
    fn started(&self, i: usize, name: &str) {
        let mut running = lock(&self.running);
        running.insert(i, name.to_string());
        self.bar.set_message(join_names(running.values()));
    }

    fn finished(&self, i: usize) {
        let mut running = lock(&self.running);
        running.remove(&i);
        self.bar.set_message(join_names(running.values()));
        self.bar.inc(1);
    }

    fn warn(&self, warnings: &mut Vec<String>, msg: String) {
        self.bar.suspend(|| eprintln!("warning: {msg}"));
        warnings.push(msg);
    }

    fn compile_one(&self, job: &CompileJob) -> Result<CompiledNeff, CompileError> {
        let cfg = self.cfg;
        let key = cache_key(&job.hlo, &cfg.target, &cfg.flags, self.version);
        let entry = cfg.cache_dir.join(&key);
        let mut warnings = Vec::new();
        let done = |neff: Vec<u8>, cache_hit: bool, warnings: Vec<String>| CompiledNeff {
            name: job.name.clone(),
            key: key.clone(),
            neff,
            path: entry.join("model.neff"),
            cache_hit,
            warnings,
        };

        // Lock-free fast path: entries are renamed into place whole, so a hit is trustworthy.
        // A miss or an apparent corruption is decided again under the lock (a writer may be
        // halfway through replacing a corrupt entry).
        if let Lookup::Hit(neff) = read_entry(&entry, &key) {
            return Ok(done(neff, true, warnings));
        }

        let cache_err =
            |action: &'static str, path: &Path, source: io::Error| CompileError::Cache {
                graph: job.name.clone(),
                action,
                path: path.to_path_buf(),
                source,
            };
        let lock_path = cfg.cache_dir.join(format!("{key}.lock"));
        let lock_file = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&lock_path)
            .map_err(|e| cache_err("open the lock file", &lock_path, e))?;
        match try_lock(&lock_file) {
            Ok(()) => {}
            Err(fs::TryLockError::WouldBlock) => {
                self.bar
                    .set_message(format!("{} (waiting for another process)", job.name));
                lock_blocking(&lock_file).map_err(|e| cache_err("lock", &lock_path, e))?;
            }
            Err(fs::TryLockError::Error(e)) if e.kind() == io::ErrorKind::Unsupported => {
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
            Err(fs::TryLockError::Error(e)) => return Err(cache_err("lock", &lock_path, e)),
        }

        match read_entry(&entry, &key) {
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
                // meta.json first: without it the entry reads as missing, never as valid.
                for file in ["meta.json", "model.neff"] {
                    remove_if_exists(&entry.join(file))
                        .map_err(|e| cache_err("remove", &entry.join(file), e))?;
                }
            }
        }

        let neff = self.run_compiler(job, &key)?;
        self.write_entry(job, &key, &entry, &neff)?;
        drop(lock_file);
        Ok(done(neff, false, warnings))
    }

    /// Runs neuronx-cc on one graph in a fresh scratch directory; returns the NEFF bytes.
    fn run_compiler(&self, job: &CompileJob, key: &str) -> Result<Vec<u8>, CompileError> {
        let cfg = self.cfg;
        let cache_err =
            |action: &'static str, path: &Path, source: io::Error| CompileError::Cache {
                graph: job.name.clone(),
                action,
                path: path.to_path_buf(),
                source,
            };
        let work_root = cfg.cache_dir.join("work");
        fs::create_dir_all(&work_root).map_err(|e| cache_err("create", &work_root, e))?;
        // We hold the key's lock: earlier attempts' directories (kept for their logs) are ours.
        if let Ok(dir) = fs::read_dir(&work_root) {
            for e in dir.flatten() {
                if e.file_name()
                    .to_string_lossy()
                    .starts_with(&format!("{key}."))
                {
                    let _ = fs::remove_dir_all(e.path());
                }
            }
        }
        let workdir = work_root.join(format!("{key}.{}", std::process::id()));
        fs::create_dir_all(&workdir).map_err(|e| cache_err("create", &workdir, e))?;
        let workdir = fs::canonicalize(&workdir).unwrap_or(workdir);

        let input = workdir.join("model.hlo.pb");
        let output = workdir.join("model.neff");
        let log = workdir.join("compiler-output.txt");
        fs::write(&input, &job.hlo).map_err(|e| cache_err("write", &input, e))?;
        let args = cfg.command_args(&input, &output);
        let command = shell_command(&cfg.program, &args);
        let _ = fs::write(
            workdir.join("command.txt"),
            format!(
                "cd {}\n{command}\n",
                shell_quote(&workdir.to_string_lossy())
            ),
        );
        let out_file = File::create(&log).map_err(|e| cache_err("create", &log, e))?;
        let err_file = out_file
            .try_clone()
            .map_err(|e| cache_err("create", &log, e))?;

        let mut cmd = Command::new(program_path(&cfg.program));
        cmd.args(&args)
            .current_dir(&workdir)
            .stdin(Stdio::null())
            .stdout(out_file)
            .stderr(err_file);
        let mut child = spawn(&mut cmd).map_err(|source| CompileError::CompilerNotFound {
            program: cfg.program.clone(),
            graphs: job.name.clone(),
            source,
        })?;
        drop(cmd); // closes our copies of the log file handles
        let status = wait_with_timeout(&mut child, cfg.timeout)
            .map_err(|e| cache_err("wait for the compiler of", &workdir, e))?;
        let tail = || output_tail(&log, &workdir.join("log-neuron-cc.txt"));
        let Some(status) = status else {
            return Err(CompileError::Timeout {
                graph: job.name.clone(),
                timeout: cfg.timeout,
                tail: tail(),
                workdir,
            });
        };
        if !status.success() {
            return Err(CompileError::CompilerFailed {
                graph: job.name.clone(),
                status: status.to_string(),
                command,
                tail: tail(),
                workdir,
            });
        }
        match fs::read(&output) {
            Ok(neff) if !neff.is_empty() => {
                let _ = fs::remove_dir_all(&workdir);
                Ok(neff)
            }
            _ => Err(CompileError::NoOutput {
                graph: job.name.clone(),
                path: output,
                tail: tail(),
            }),
        }
    }

    /// Writes `model.neff`, then `meta.json`, each atomically.
    fn write_entry(
        &self,
        job: &CompileJob,
        key: &str,
        entry: &Path,
        neff: &[u8],
    ) -> Result<(), CompileError> {
        let cache_err =
            |action: &'static str, path: &Path, source: io::Error| CompileError::Cache {
                graph: job.name.clone(),
                action,
                path: path.to_path_buf(),
                source,
            };
        fs::create_dir_all(entry).map_err(|e| cache_err("create", entry, e))?;
        // Leftovers of a writer that died mid-write (we hold the lock: nobody else is writing).
        if let Ok(dir) = fs::read_dir(entry) {
            for e in dir.flatten() {
                if e.file_name().to_string_lossy().contains(".tmp.") {
                    let _ = fs::remove_file(e.path());
                }
            }
        }
        let meta = Meta {
            name: job.name.clone(),
            key: key.to_string(),
            size: neff.len() as u64,
            sha256: hex(&Sha256::digest(neff)),
            compiler_version: self.version.to_string(),
            target: self.cfg.target.clone(),
            flags: self.cfg.flags.clone(),
            hlo_size: job.hlo.len() as u64,
            hlo_sha256: hex(&Sha256::digest(&job.hlo)),
            created_unix_secs: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
            deepinfer_version: env!("CARGO_PKG_VERSION").to_string(),
        };
        let meta_json = serde_json::to_vec_pretty(&meta).expect("Meta always serializes");
        for (file, bytes) in [("model.neff", neff), ("meta.json", &meta_json[..])] {
            write_atomic(entry, file, bytes)
                .map_err(|e| cache_err("write", &entry.join(file), e))?;
        }
        // Make the renames durable; not every filesystem lets a directory be fsynced.
        if let Ok(dir) = File::open(entry) {
            let _ = dir.sync_all();
        }
        Ok(())
    }
}

// std's file locks (Rust 1.89+): no extra crate, and the kernel releases them if the process
// dies mid-compile.
fn try_lock(file: &File) -> Result<(), fs::TryLockError> {
    file.try_lock()
}

fn lock_blocking(file: &File) -> io::Result<()> {
    file.lock()
}

/// The compiler runs in a scratch directory, so a relative path with a directory part
/// (`tools/neuronx-cc`) is made absolute first; a bare name is still looked up on PATH.
fn program_path(program: &Path) -> PathBuf {
    if program.components().count() > 1 {
        std::path::absolute(program).unwrap_or_else(|_| program.to_path_buf())
    } else {
        program.to_path_buf()
    }
}

/// Reads and verifies one entry.
fn read_entry(entry: &Path, key: &str) -> Lookup {
    let meta_path = entry.join("meta.json");
    let neff_path = entry.join("model.neff");
    let meta_bytes = match fs::read(&meta_path) {
        Ok(b) => b,
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            return if neff_path.exists() {
                Lookup::Corrupt("model.neff without meta.json: a write was interrupted".into())
            } else {
                Lookup::Missing
            };
        }
        Err(e) => return Lookup::Corrupt(format!("cannot read meta.json: {e}")),
    };
    let meta: Meta = match serde_json::from_slice(&meta_bytes) {
        Ok(m) => m,
        Err(e) => return Lookup::Corrupt(format!("meta.json is not valid: {e}")),
    };
    if meta.key != key {
        return Lookup::Corrupt(format!("meta.json names key {}", meta.key));
    }
    let neff = match fs::read(&neff_path) {
        Ok(b) => b,
        Err(e) => return Lookup::Corrupt(format!("cannot read model.neff: {e}")),
    };
    if neff.len() as u64 != meta.size {
        return Lookup::Corrupt(format!(
            "model.neff is {} bytes, meta.json says {}",
            neff.len(),
            meta.size
        ));
    }
    if hex(&Sha256::digest(&neff)) != meta.sha256 {
        return Lookup::Corrupt("the SHA-256 of model.neff does not match meta.json".into());
    }
    Lookup::Hit(neff)
}

/// Writes `dir/name` through a temporary file in `dir`: write, fsync, rename.
fn write_atomic(dir: &Path, name: &str, bytes: &[u8]) -> io::Result<()> {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let tmp = dir.join(format!(
        ".{name}.tmp.{}.{}",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed)
    ));
    let result = (|| {
        let mut f = File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        drop(f);
        fs::rename(&tmp, dir.join(name))
    })();
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result
}

fn remove_if_exists(path: &Path) -> io::Result<()> {
    match fs::remove_file(path) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

/// Spawns, retrying briefly on ETXTBSY: a compiler script that was just written (an install in
/// progress, or a test's fake) can be "busy" while another thread's fork still holds it open.
fn spawn(cmd: &mut Command) -> io::Result<Child> {
    let mut attempts = 0;
    loop {
        match cmd.spawn() {
            Err(e) if e.kind() == io::ErrorKind::ExecutableFileBusy && attempts < 20 => {
                attempts += 1;
                std::thread::sleep(Duration::from_millis(25));
            }
            other => return other,
        }
    }
}

/// Waits for `child` for at most `timeout`; on timeout kills it and its descendants and returns
/// `None`.
fn wait_with_timeout(child: &mut Child, timeout: Duration) -> io::Result<Option<ExitStatus>> {
    let deadline = Instant::now() + timeout;
    let mut pause = Duration::from_millis(5);
    loop {
        if let Some(status) = child.try_wait()? {
            return Ok(Some(status));
        }
        let now = Instant::now();
        if now >= deadline {
            kill_tree(child);
            return Ok(None);
        }
        // Short polls first (a cache check or a failing compiler ends fast), then 100 ms.
        std::thread::sleep(pause.min(deadline - now));
        pause = (pause * 2).min(Duration::from_millis(100));
    }
}

/// Kills `child` and every process below it (best effort), then reaps `child`.
fn kill_tree(child: &mut Child) {
    let below = descendants(child.id());
    let _ = child.kill();
    if !below.is_empty() {
        // std can signal only its own children; `kill(1)` reaches the grandchildren.
        let _ = Command::new("kill")
            .arg("-KILL")
            .args(below.iter().map(u32::to_string))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
    }
    let _ = child.wait();
}

/// The pids below `root`, from `/proc/<pid>/stat` (Linux; elsewhere none are found).
fn descendants(root: u32) -> Vec<u32> {
    let Ok(dir) = fs::read_dir("/proc") else {
        return Vec::new();
    };
    let mut children: HashMap<u32, Vec<u32>> = HashMap::new();
    for e in dir.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
            continue;
        };
        let Ok(stat) = fs::read_to_string(e.path().join("stat")) else {
            continue;
        };
        // "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after the
        // last ')'.
        let ppid = stat
            .rfind(')')
            .and_then(|i| stat[i + 1..].split_whitespace().nth(1))
            .and_then(|s| s.parse::<u32>().ok());
        if let Some(ppid) = ppid {
            children.entry(ppid).or_default().push(pid);
        }
    }
    let mut found = Vec::new();
    let mut queue = VecDeque::from([root]);
    while let Some(p) = queue.pop_front() {
        for &c in children.get(&p).into_iter().flatten() {
            if !found.contains(&c) && c != root {
                found.push(c);
                queue.push_back(c);
            }
        }
    }
    found
}

/// The last lines of the compiler's captured output, or of its own log when it printed nothing.
fn output_tail(output: &Path, logfile: &Path) -> String {
    for path in [output, logfile] {
        let text = read_tail(path, 64 * 1024);
        if !text.trim().is_empty() {
            return tail_lines(&text, TAIL_LINES);
        }
    }
    "(the compiler printed nothing)".to_string()
}

/// The last `max` bytes of a file, lossily decoded; empty when unreadable.
fn read_tail(path: &Path, max: u64) -> String {
    let Ok(mut f) = File::open(path) else {
        return String::new();
    };
    let len = f.metadata().map_or(0, |m| m.len());
    let mut buf = Vec::new();
    if f.seek(SeekFrom::Start(len.saturating_sub(max))).is_ok() {
        let _ = f.read_to_end(&mut buf);
    }
    String::from_utf8_lossy(&buf).into_owned()
}

fn tail_lines(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.trim_end().lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

fn progress_bar(cfg: &CompilerConfig, n: usize) -> ProgressBar {
    if !cfg.progress || !io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::with_draw_target(Some(n as u64), ProgressDrawTarget::stderr());
    bar.set_style(bar_style());
    bar.set_prefix(format!(
        "compiling {n} graph{}",
        if n == 1 { "" } else { "s" }
    ));
    bar.enable_steady_tick(Duration::from_millis(200));
    bar
}

/// One line: spinner, "compiling N graphs", bar, finished/total, elapsed, the graphs in flight.
fn bar_style() -> ProgressStyle {
    ProgressStyle::with_template(
        "{spinner} {prefix} [{bar:30}] {pos}/{len} {elapsed_precise} {wide_msg}",
    )
    .expect("the template is valid (checked by a unit test)")
    .progress_chars("=> ")
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

fn hex(bytes: &[u8]) -> String {
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        let _ = write!(s, "{b:02x}");
    }
    s
}

/// "600 s", or "1.5 s" when not whole.
fn shell_quote(s: &str) -> String {
    let plain = |c: char| c.is_ascii_alphanumeric() || "-_=./,:+@%".contains(c);
    if !s.is_empty() && s.chars().all(plain) {
        s.to_string()
    } else {
        format!("'{}'", s.replace('\'', r"'\''"))
    }
}

fn shell_command(program: &Path, args: &[OsString]) -> String {
    std::iter::once(program.as_os_str())
        .chain(args.iter().map(OsString::as_os_str))
        .map(|a| shell_quote(&a.to_string_lossy()))
        .collect::<Vec<_>>()
        .join(" ")
}

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
    fn version_line_is_extracted() {
        let out = "NeuronX Compiler version 2.27.5334.0+f702b353\n\nPython version 3.13.7\n\
                   HWM version 2.27.5334.0+f702b353\nNumPy version 2.4.6\n";
        assert_eq!(parse_version(out).unwrap(), "2.27.5334.0+f702b353");
        assert_eq!(parse_version("weird 1.0\n").unwrap(), "weird 1.0");
        assert_eq!(parse_version(" \n"), None);
    }

    #[test]
    fn bar_template_parses() {
        let _ = bar_style();
    }

    #[test]
    fn tails_and_quoting() {
        let text: String = (1..=50).map(|i| format!("l{i}\n")).collect();
        let t = tail_lines(&text, 40);
        assert!(t.starts_with("l11\n") && t.ends_with("l50"));
        assert_eq!(shell_quote("--auto-cast=none"), "--auto-cast=none");
        assert_eq!(shell_quote("a b'c"), r"'a b'\''c'");
        assert_eq!(fmt_duration(Duration::from_secs(600)), "600 s");
        assert_eq!(fmt_duration(Duration::from_millis(1500)), "1.5 s");
    }
}
