//! The neuronx-cc driver against a fake compiler (`tests/fake-neuronx-cc/neuronx-cc`, a shell
//! script): command line, parallelism and order, the NEFF cache (hits, keys, corruption), failures,
//! the timeout, a missing compiler, and the per-key lock across threads and processes.
//!
//! Each test gets its own directory (fake compiler + cache) and passes the fake by path, so tests
//! never touch the environment of this process and can run in parallel. The cross-process tests
//! re-run this test binary with the ignored test `child_process_entry` selected (`--exact
//! --ignored`) and a few `DEEPINFER_TEST_CHILD_*` variables set; a normal run reports that entry
//! as ignored, and running it without its parent fails.
#![cfg(unix)]

use std::collections::HashSet;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use deepinfer::backend::neuron::compile::{
    cache_key, compile_all, compiler_version, CompileJob, CompiledNeff, CompilerConfig,
    DEFAULT_FLAGS,
};
use deepinfer::error::CompileError;
use sha2::{Digest, Sha256};

const FAKE: &str = include_str!("fake-neuronx-cc/neuronx-cc");
const VERSION: &str = "2.99.1234.0+fakefake";

/// A test's directory: `fake/` (the compiler and its control files) and `cache/`.
struct Fake {
    root: PathBuf,
    program: PathBuf,
    /// Whether dropping this removes `root` (a second compiler in the same root does not).
    owner: bool,
}

impl Fake {
    fn new(test: &str) -> Fake {
        let root = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
            .join("compile_driver")
            .join(format!("{test}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let mut fake = Fake::in_dir(root.clone(), "fake", VERSION);
        fake.owner = true;
        std::fs::create_dir_all(fake.cache()).unwrap();
        fake
    }

    /// A second compiler (another version) under the same root.
    fn in_dir(root: PathBuf, sub: &str, version: &str) -> Fake {
        let dir = root.join(sub);
        std::fs::create_dir_all(&dir).unwrap();
        let program = dir.join("neuronx-cc");
        std::fs::write(&program, FAKE).unwrap();
        std::fs::set_permissions(&program, std::fs::Permissions::from_mode(0o755)).unwrap();
        std::fs::write(dir.join("version"), version).unwrap();
        std::fs::write(dir.join("mode"), "ok").unwrap();
        Fake {
            root,
            program,
            owner: false,
        }
    }

    fn dir(&self) -> &Path {
        self.program.parent().unwrap()
    }

    fn cache(&self) -> PathBuf {
        self.root.join("cache")
    }

    fn set_mode(&self, mode: &str) {
        std::fs::write(self.dir().join("mode"), mode).unwrap();
    }

    /// One entry per compile: (cwd, argv without the program).
    fn calls(&self) -> Vec<(String, Vec<String>)> {
        let log = std::fs::read_to_string(self.dir().join("calls.log")).unwrap_or_default();
        log.lines()
            .map(|l| {
                let mut it = l.split('\t').map(str::to_string);
                (it.next().unwrap(), it.collect())
            })
            .collect()
    }

    fn config(&self) -> CompilerConfig {
        CompilerConfig {
            program: self.program.clone(),
            jobs: 2,
            timeout: Duration::from_secs(20),
            cache_dir: self.cache(),
            progress: false,
            ..CompilerConfig::default()
        }
    }
}

impl Drop for Fake {
    fn drop(&mut self) {
        if self.owner && !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.root);
        }
    }
}

fn job(name: &str) -> CompileJob {
    CompileJob {
        name: name.to_string(),
        hlo: format!("hlo bytes of {name}").into_bytes(),
    }
}

/// What the fake writes for `hlo`.
fn expected_neff(hlo: &[u8]) -> Vec<u8> {
    let digest: String = Sha256::digest(hlo)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    format!("NEFF{digest}\n").into_bytes()
}

fn compile_one(cfg: &CompilerConfig, j: &CompileJob) -> Result<CompiledNeff, CompileError> {
    Ok(compile_all(cfg, std::slice::from_ref(j))?.remove(0))
}

/// Every file in the cache outside `work/`, relative to the cache, but the record of the
/// compiles' measured peak memory (not an entry; see `compile::jobs`).
fn cached_files(cache: &Path) -> Vec<String> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(cache).unwrap().flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if name == "work" || name == deepinfer::backend::neuron::compile::jobs::PEAK_FILE {
            continue;
        }
        if e.path().is_dir() {
            for f in std::fs::read_dir(e.path()).unwrap().flatten() {
                out.push(format!("{name}/{}", f.file_name().to_string_lossy()));
            }
        } else {
            out.push(name);
        }
    }
    out.sort();
    out
}

#[test]
fn command_line_is_exact() {
    let fake = Fake::new("command_line");
    let cfg = fake.config();
    assert_eq!(cfg.target, "trn1");
    assert_eq!(
        cfg.flags,
        [
            "--model-type=transformer",
            "--auto-cast=none",
            "-O1",
            "--enable-saturate-infinity"
        ]
    );
    let args = cfg.command_args(Path::new("/w/model.hlo.pb"), Path::new("/w/model.neff"));
    let args: Vec<_> = args.iter().map(|a| a.to_str().unwrap()).collect();
    assert_eq!(
        args,
        [
            "compile",
            "--framework=XLA",
            "--target=trn1",
            "/w/model.hlo.pb",
            "--output=/w/model.neff",
            "--model-type=transformer",
            "--auto-cast=none",
            "-O1",
            "--enable-saturate-infinity",
        ]
    );

    let j = job("decode_b1");
    let out = compile_one(&cfg, &j).unwrap();
    assert_eq!(out.name, "decode_b1");
    assert!(!out.cache_hit);
    assert_eq!(out.neff, expected_neff(&j.hlo));
    assert_eq!(out.key, cache_key(&j.hlo, "trn1", &cfg.flags, VERSION));
    assert_eq!(out.path, fake.cache().join(&out.key).join("model.neff"));

    // The compiler ran in its own scratch directory under the cache, with the exact argv.
    let calls = fake.calls();
    assert_eq!(calls.len(), 1);
    let (cwd, argv) = &calls[0];
    let work = std::fs::canonicalize(fake.cache().join("work")).unwrap();
    assert_eq!(Path::new(cwd).parent().unwrap(), work);
    let mut want = vec![
        "compile".to_string(),
        "--framework=XLA".to_string(),
        "--target=trn1".to_string(),
        format!("{cwd}/model.hlo.pb"),
        format!("--output={cwd}/model.neff"),
    ];
    want.extend(DEFAULT_FLAGS.iter().map(|f| f.to_string()));
    assert_eq!(argv, &want);
    assert!(
        !Path::new(cwd).exists(),
        "scratch directory removed after a success"
    );

    // The compile's peak memory was measured (the child's max RSS) and kept beside the cache.
    assert!(
        deepinfer::backend::neuron::compile::jobs::measured_peak(&fake.cache())
            .is_some_and(|b| b > 0)
    );
    // The entry: model.neff + meta.json, nothing else.
    assert_eq!(
        cached_files(&fake.cache()),
        [
            format!("{}.lock", out.key),
            format!("{}/meta.json", out.key),
            format!("{}/model.neff", out.key),
        ]
    );
    let meta: serde_json::Value = serde_json::from_slice(
        &std::fs::read(fake.cache().join(&out.key).join("meta.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(meta["name"], "decode_b1");
    assert_eq!(meta["key"], out.key.as_str());
    assert_eq!(meta["size"], out.neff.len() as u64);
    assert_eq!(meta["compiler_version"], VERSION);
    assert_eq!(meta["flags"], serde_json::json!(DEFAULT_FLAGS));
    assert!(meta["created_unix_secs"].as_u64().unwrap() > 0);
}

#[test]
fn parallel_compile_keeps_order_then_hits_the_cache() {
    let fake = Fake::new("parallel");
    let cfg = fake.config(); // jobs = 2
    let jobs: Vec<_> = (0..6)
        .map(|i| job(&format!("decode_b{}", 1 << i)))
        .collect();
    let out = compile_all(&cfg, &jobs).unwrap();
    assert_eq!(out.len(), jobs.len());
    for (o, j) in out.iter().zip(&jobs) {
        assert_eq!(o.name, j.name);
        assert_eq!(o.neff, expected_neff(&j.hlo));
        assert!(!o.cache_hit);
    }
    assert_eq!(fake.calls().len(), 6);

    let again = compile_all(&cfg, &jobs).unwrap();
    assert!(again.iter().all(|o| o.cache_hit));
    assert_eq!(
        again.iter().map(|o| &o.neff).collect::<Vec<_>>(),
        out.iter().map(|o| &o.neff).collect::<Vec<_>>()
    );
    assert_eq!(fake.calls().len(), 6, "no new compiler invocation on a hit");
    assert!(compile_all(&cfg, &[]).unwrap().is_empty());
}

#[test]
fn identical_graphs_in_one_call_compile_once() {
    let fake = Fake::new("identical");
    let a = job("a");
    let b = CompileJob {
        name: "b".into(),
        hlo: a.hlo.clone(),
    };
    let out = compile_all(&fake.config(), &[a, b]).unwrap();
    assert_eq!(fake.calls().len(), 1);
    assert_eq!(out[0].neff, out[1].neff);
    assert_eq!(out.iter().filter(|o| o.cache_hit).count(), 1);
}

#[test]
fn flags_target_and_version_are_part_of_the_key() {
    let fake = Fake::new("key");
    let cfg = fake.config();
    let j = job("g");
    let base = compile_one(&cfg, &j).unwrap();
    assert_eq!(fake.calls().len(), 1);

    let mut more_flags = cfg.clone();
    more_flags.flags.push("--verbose=35".into());
    let o = compile_one(&more_flags, &j).unwrap();
    assert!(!o.cache_hit);
    assert_ne!(o.key, base.key);
    assert_eq!(fake.calls().len(), 2);

    let mut reordered = cfg.clone();
    reordered.flags.reverse();
    assert!(!compile_one(&reordered, &j).unwrap().cache_hit);
    assert_eq!(fake.calls().len(), 3);

    let mut target = cfg.clone();
    target.target = "trn1n".into();
    let o = compile_one(&target, &j).unwrap();
    assert!(!o.cache_hit);
    assert_eq!(fake.calls().last().unwrap().1[2], "--target=trn1n");

    // Another compiler version, same cache directory.
    let other = Fake::in_dir(fake.root.clone(), "fake2", "2.100.0.0+other");
    let mut upgraded = cfg.clone();
    upgraded.program = other.program.clone();
    assert_eq!(compiler_version(&upgraded).unwrap(), "2.100.0.0+other");
    let o = compile_one(&upgraded, &j).unwrap();
    assert!(!o.cache_hit);
    assert_ne!(o.key, base.key);
    assert_eq!(other.calls().len(), 1);

    // The original configuration still hits.
    assert!(compile_one(&cfg, &j).unwrap().cache_hit);
    assert_eq!(fake.calls().len(), 4);
}

#[test]
fn version_is_parsed_and_cached_per_process() {
    let fake = Fake::new("version");
    let cfg = fake.config();
    assert_eq!(compiler_version(&cfg).unwrap(), VERSION);
    std::fs::write(fake.dir().join("version"), "changed").unwrap();
    assert_eq!(
        compiler_version(&cfg).unwrap(),
        VERSION,
        "run once per process"
    );
}

#[test]
fn corrupt_entries_are_detected_warned_and_recompiled() {
    let fake = Fake::new("corrupt");
    let cfg = fake.config();
    let j = job("decode_b8");
    let first = compile_one(&cfg, &j).unwrap();
    let neff_path = first.path.clone();
    let size = first.neff.len();

    // Truncated model.neff, seen by another process: the warning goes to its stderr.
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(&neff_path)
        .unwrap();
    f.set_len(10).unwrap();
    drop(f);
    let child = run_child(
        &fake,
        &[("PROGRAM", fake.program.to_str().unwrap())],
        "decode_b8",
        &j,
    );
    let child = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&child.stderr);
    let stdout = String::from_utf8_lossy(&child.stdout);
    assert!(child.status.success(), "child failed:\n{stdout}\n{stderr}");
    let want = format!(
        "NEFF cache entry {} for decode_b8 is corrupt (model.neff is 10 bytes, \
         meta.json says {size}); recompiling",
        first.key
    );
    // A `tracing` warning, which the child's subscriber writes to stderr.
    assert!(
        stderr
            .lines()
            .any(|l| l.contains("WARN") && l.ends_with(&want)),
        "stderr was:\n{stderr}"
    );
    assert!(stdout.contains("CHILD hit=false"), "stdout was:\n{stdout}");
    assert_eq!(fake.calls().len(), 2);
    assert_eq!(std::fs::read(&neff_path).unwrap(), first.neff);

    // Same size, different bytes: caught by the checksum.
    let mut bad = first.neff.clone();
    bad[0] ^= 0xff;
    std::fs::write(&neff_path, &bad).unwrap();
    let o = compile_one(&cfg, &j).unwrap();
    assert!(!o.cache_hit);
    assert_eq!(o.neff, first.neff);
    assert_eq!(o.warnings.len(), 1);
    assert!(o.warnings[0].contains("SHA-256 of model.neff does not match"));
    assert_eq!(fake.calls().len(), 3);

    // meta.json gone (a write interrupted between the two renames).
    std::fs::remove_file(neff_path.with_file_name("meta.json")).unwrap();
    let o = compile_one(&cfg, &j).unwrap();
    assert!(!o.cache_hit);
    assert!(o.warnings[0].contains("is corrupt (model.neff without meta.json"));
    assert_eq!(fake.calls().len(), 4);

    // Healthy again.
    let o = compile_one(&cfg, &j).unwrap();
    assert!(o.cache_hit && o.warnings.is_empty());
    assert_eq!(fake.calls().len(), 4);
}

#[test]
fn failure_names_the_graph_and_quotes_the_tail() {
    let fake = Fake::new("failure");
    let mut cfg = fake.config();
    cfg.jobs = 1;
    let jobs = [job("ok_first"), job("prefill_t128"), job("never_started")];
    compile_one(&cfg, &jobs[0]).unwrap(); // cached: the failing call will hit it
    fake.set_mode("fail");
    let err = compile_all(&cfg, &jobs).unwrap_err();
    let msg = err.to_string();
    let CompileError::CompilerFailed {
        graph,
        status,
        tail,
        workdir,
        ..
    } = &err
    else {
        panic!("wrong error: {msg}");
    };
    assert_eq!(graph, "prefill_t128");
    assert_eq!(status, "exit status: 1");
    assert!(msg.contains("neuronx-cc failed compiling prefill_t128 (exit status: 1)"));
    assert!(msg.contains("ERROR: [NCC_EVRF007] fake failure for model.hlo.pb"));
    assert!(msg.contains("fake neuronx-cc: diagnostic line 60"));
    assert!(tail.lines().count() <= 40);
    assert!(!tail.lines().any(|l| l.ends_with("diagnostic line 5")));
    assert!(workdir.join("compiler-output.txt").exists(), "logs kept");
    assert!(workdir.join("command.txt").exists());
    // No compile started after the failure, and nothing half-written was cached.
    assert_eq!(fake.calls().len(), 2);
    let cached = cached_files(&fake.cache());
    assert_eq!(
        cached.iter().filter(|f| f.ends_with("model.neff")).count(),
        1,
        "only ok_first is cached: {cached:?}"
    );
    assert!(cached.iter().all(|f| !f.contains(".tmp.")));

    // A fixed compiler succeeds, and the old scratch directory is cleaned up.
    fake.set_mode("ok");
    compile_all(&cfg, &jobs).unwrap();
    assert!(!workdir.exists());
}

#[test]
fn success_without_a_neff_is_an_error() {
    let fake = Fake::new("empty");
    fake.set_mode("empty");
    let err = compile_one(&fake.config(), &job("decode_b2")).unwrap_err();
    assert!(matches!(err, CompileError::NoOutput { .. }), "{err}");
    assert!(err
        .to_string()
        .contains("compiling decode_b2 but wrote no NEFF"));
}

#[test]
fn timeout_kills_the_compiler_and_its_children() {
    let fake = Fake::new("timeout");
    fake.set_mode("hang");
    let mut cfg = fake.config();
    cfg.timeout = Duration::from_secs(1);
    let start = Instant::now();
    let err = compile_one(&cfg, &job("decode_b64")).unwrap_err();
    assert!(start.elapsed() < Duration::from_secs(10));
    let msg = err.to_string();
    assert!(matches!(err, CompileError::Timeout { .. }), "{msg}");
    assert!(
        msg.contains("neuronx-cc timed out after 1 s compiling decode_b64"),
        "{msg}"
    );
    assert!(msg.contains("fake neuronx-cc: hanging"), "{msg}");

    // The compiler's own child (`sleep 30`) was killed too.
    let pid = std::fs::read_to_string(fake.dir().join("sleep.pid")).unwrap();
    let stat = format!("/proc/{}/stat", pid.trim());
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let alive = match std::fs::read_to_string(&stat) {
            // A zombie (state Z) is dead; its parent just has not reaped it yet.
            Ok(s) => !s
                .rsplit(')')
                .next()
                .unwrap_or("")
                .trim_start()
                .starts_with('Z'),
            Err(_) => false,
        };
        if !alive {
            break;
        }
        assert!(Instant::now() < deadline, "the compiler's child survived");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(cached_files(&fake.cache())
        .iter()
        .all(|f| !f.ends_with("model.neff")));
}

#[test]
fn missing_compiler_names_the_package_and_the_cpu_backend() {
    let fake = Fake::new("missing");
    let mut cfg = fake.config();
    cfg.program = fake.root.join("nowhere").join("neuronx-cc");
    let err = compile_one(&cfg, &job("decode_b16")).unwrap_err();
    let msg = err.to_string();
    assert!(
        matches!(err, CompileError::CompilerNotFound { .. }),
        "{msg}"
    );
    for want in [
        "decode_b16",
        "pip install neuronx-cc",
        "https://pip.repos.neuron.amazonaws.com",
        "AWS Neuron SDK",
        "`--backend cpu`",
        "`--backend sim`",
    ] {
        assert!(msg.contains(want), "{want:?} missing from: {msg}");
    }
    assert!(compiler_version(&cfg).is_err());
}

#[test]
fn driver_owned_flags_are_rejected() {
    let fake = Fake::new("bad_flags");
    for flag in ["--output=x.neff", "--target=trn2", "--framework", "-o"] {
        let mut cfg = fake.config();
        cfg.flags.push(flag.into());
        let err = compile_one(&cfg, &job("g")).unwrap_err();
        assert!(matches!(err, CompileError::InvalidConfig { .. }), "{err}");
        assert!(err.to_string().contains("cannot compile g"), "{err}");
    }
    assert!(fake.calls().is_empty());
}

#[test]
fn concurrent_threads_compile_a_graph_once() {
    let fake = Fake::new("threads");
    fake.set_mode("slow");
    let j = job("decode_b32");
    let handles: Vec<_> = (0..2)
        .map(|_| {
            let (cfg, j) = (fake.config(), j.clone());
            std::thread::spawn(move || compile_one(&cfg, &j).unwrap())
        })
        .collect();
    let outs: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    assert_eq!(fake.calls().len(), 1, "the lock lets one thread compile");
    assert_eq!(outs.iter().filter(|o| o.cache_hit).count(), 1);
    assert_eq!(outs[0].neff, outs[1].neff);
}

#[test]
fn concurrent_processes_compile_a_graph_once() {
    let fake = Fake::new("processes");
    fake.set_mode("slow");
    let j = job("decode_b128");
    // No PROGRAM: the children use the default `neuronx-cc`, found on PATH.
    let children: Vec<_> = (0..2)
        .map(|_| run_child(&fake, &[], "decode_b128", &j))
        .collect();
    let mut hits = Vec::new();
    for c in children {
        let out = c.wait_with_output().unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(
            out.status.success(),
            "child failed:\n{stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            stdout.contains("1 passed"),
            "the child entry did not run:\n{stdout}"
        );
        // libtest prints "test child_process_entry ... " on the same line.
        let line = stdout
            .lines()
            .find_map(|l| l.split_once("CHILD ").map(|(_, r)| r.to_string()))
            .unwrap_or_else(|| panic!("no result in:\n{stdout}"));
        hits.push(line.contains("hit=true"));
    }
    assert_eq!(fake.calls().len(), 1, "the lock lets one process compile");
    assert_eq!(hits.iter().filter(|h| **h).count(), 1);
    let keys: HashSet<_> = std::fs::read_dir(fake.cache())
        .unwrap()
        .flatten()
        .filter(|e| e.path().join("meta.json").exists())
        .map(|e| e.file_name())
        .collect();
    assert_eq!(keys.len(), 1);
}

/// Starts this test binary as a child that compiles one graph (see `child_process_entry`).
fn run_child(
    fake: &Fake,
    extra: &[(&str, &str)],
    name: &str,
    j: &CompileJob,
) -> std::process::Child {
    let path = std::env::join_paths(std::iter::once(fake.dir().to_path_buf()).chain(
        std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default()),
    ))
    .unwrap();
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args([
        "child_process_entry",
        "--exact",
        "--ignored",
        "--nocapture",
        "--test-threads=1",
    ])
    .env("PATH", path)
    .env("DEEPINFER_TEST_CHILD_CACHE", fake.cache())
    .env("DEEPINFER_TEST_CHILD_NAME", name)
    .env(
        "DEEPINFER_TEST_CHILD_HLO",
        String::from_utf8(j.hlo.clone()).unwrap(),
    )
    .env_remove("DEEPINFER_TEST_CHILD_PROGRAM")
    .stdin(Stdio::null())
    .stdout(Stdio::piped())
    .stderr(Stdio::piped());
    for (k, v) in extra {
        cmd.env(format!("DEEPINFER_TEST_CHILD_{k}"), v);
    }
    cmd.spawn().unwrap()
}

/// The child half of the cross-process tests: ignored in a normal run, started by `run_child`
/// with `--exact --ignored`. It compiles one graph into the given cache, prints the result on
/// stdout and the driver's `tracing` output on stderr.
#[test]
#[ignore = "child process entry; run by run_child for the cross-process tests"]
fn child_process_entry() {
    let cache = std::env::var("DEEPINFER_TEST_CHILD_CACHE").expect(
        "child_process_entry runs only as the child of a cross-process test (run_child sets \
         DEEPINFER_TEST_CHILD_CACHE); it has nothing to do on its own",
    );
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .without_time()
        .init();
    let mut cfg = CompilerConfig {
        cache_dir: cache.into(),
        progress: false,
        timeout: Duration::from_secs(20),
        ..CompilerConfig::default()
    };
    if let Ok(program) = std::env::var("DEEPINFER_TEST_CHILD_PROGRAM") {
        cfg.program = program.into();
    }
    let j = CompileJob {
        name: std::env::var("DEEPINFER_TEST_CHILD_NAME").unwrap(),
        hlo: std::env::var("DEEPINFER_TEST_CHILD_HLO")
            .unwrap()
            .into_bytes(),
    };
    let out = compile_one(&cfg, &j).unwrap();
    assert_eq!(out.neff, expected_neff(&j.hlo));
    println!("CHILD hit={} key={}", out.cache_hit, out.key);
}
