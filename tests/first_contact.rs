//! `deepinfer first-contact` end to end (issue 42, item 9): on nrt-sim it passes every step and
//! writes both reports; an injected load failure stops it at `capture` with the runtime's
//! status in the report; without Neuron it exits 2 after a report that says so.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value;

const STEPS: [&str; 7] = [
    "doctor", "plan", "check", "compile", "capture", "parity", "bench",
];

/// The simulator cargo builds beside the binaries (nrt-sim's cdylib).
fn nrt_sim_library() -> PathBuf {
    let exe = PathBuf::from(env!("CARGO_BIN_EXE_deepinfer"));
    let profile_dir = exe.parent().expect("the binary's directory");
    [
        profile_dir.join("deps/libnrt_sim.so"),
        profile_dir.join("libnrt_sim.so"),
    ]
    .into_iter()
    .find(|p| p.is_file())
    .expect("libnrt_sim.so not built: run `cargo test --workspace` (or `cargo build -p nrt-sim`)")
}

/// A fresh output directory for one test.
fn out_dir(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "deepinfer-first-contact-{tag}-{}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

fn first_contact(args: &[&str], out: &Path, env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_deepinfer"));
    cmd.arg("first-contact")
        .args(args)
        .arg("--out")
        .arg(out)
        .env_remove("NRT_SIM_FAIL_LOAD");
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().expect("run deepinfer first-contact")
}

fn report(out: &Path) -> Value {
    let text = std::fs::read_to_string(out.join("report.json")).expect("report.json written");
    serde_json::from_str(&text).expect("report.json is JSON")
}

fn steps(report: &Value) -> &Vec<Value> {
    report["steps"].as_array().expect("steps is an array")
}

#[test]
fn sim_run_passes_every_step_and_writes_both_reports() {
    let out = out_dir("pass");
    let sim = nrt_sim_library();
    let sim = sim.to_str().expect("a UTF-8 path");
    let run = first_contact(&["--sim"], &out, &[("NEURON_RT_LIB", sim)]);
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert_eq!(run.status.code(), Some(0), "{stderr}");
    let r = report(&out);
    assert_eq!(r["ok"], Value::Bool(true), "{r:#}");
    assert_eq!(r["backend"], "sim");
    assert_eq!(r["first_failure"], Value::Null);
    assert!(
        r["started"].as_str().is_some_and(|s| s.ends_with('Z')),
        "{r:#}"
    );
    let names: Vec<&str> = steps(&r)
        .iter()
        .filter_map(|s| s["name"].as_str())
        .collect();
    assert_eq!(names, STEPS);
    for s in steps(&r) {
        assert_eq!(s["ok"], Value::Bool(true), "{s:#}");
        assert!(s["seconds"].as_f64().is_some(), "{s:#}");
    }
    let parity = &steps(&r)[5]["figures"];
    let prompts = parity["prompts"].as_array().expect("parity prompts");
    assert_eq!(prompts.len(), 3, "{parity:#}");
    for p in prompts {
        assert_eq!(p["tokens_equal"], Value::Bool(true), "{parity:#}");
        assert!(p["max_abs_diff"].as_f64().is_some(), "{parity:#}");
    }
    assert!(parity["tolerance"].as_f64().is_some(), "{parity:#}");
    let compile = &steps(&r)[3]["figures"]["neffs"];
    let neffs = compile.as_array().expect("neffs");
    assert!(!neffs.is_empty(), "{compile:#}");
    // The stand-in compiler is a child process like neuronx-cc: its peak RSS is measured.
    for n in neffs
        .iter()
        .filter(|n| n["cache_hit"] == Value::Bool(false))
    {
        let rss = n["compiler_peak_rss_so_far"].as_u64().unwrap_or(0);
        assert!(rss > 0, "{n:#}");
    }
    // Each capture loads every NEFF compiled for its tp (the buckets' and the greedy graphs
    // the default model's sampler pays for).
    let captures = steps(&r)[4]["figures"]["captures"]
        .as_array()
        .expect("captures")
        .clone();
    for c in &captures {
        let compiled = neffs.iter().filter(|n| n["tp"] == c["tp"]).count();
        let greedy = neffs
            .iter()
            .filter(|n| n["tp"] == c["tp"])
            .filter(|n| {
                n["name"]
                    .as_str()
                    .unwrap_or("")
                    .starts_with("decode_greedy_b")
            })
            .count();
        assert!(greedy > 0, "{neffs:#?}");
        assert_eq!(c["graphs_loaded"].as_u64(), Some(compiled as u64), "{c:#}");
    }
    let bench = &steps(&r)[6]["figures"];
    let decode = bench["decode"].as_array().expect("decode");
    assert!(!decode.is_empty(), "{bench:#}");
    // The host's own time per replay: measured, and a part of the step.
    for d in decode {
        let host_us = d["host_us_per_replay"].as_f64().expect("host µs");
        let step_us = d["ms_per_step"].as_f64().expect("ms") * 1e3;
        assert!(host_us > 0.0 && host_us < step_us, "{d:#}");
    }
    let md = std::fs::read_to_string(out.join("report.md")).expect("report.md written");
    assert!(md.starts_with("PASS"), "{md}");
    let _ = std::fs::remove_dir_all(&out);
}

#[test]
fn a_failed_load_stops_at_capture_with_the_runtime_status() {
    let out = out_dir("fail-load");
    let sim = nrt_sim_library();
    let sim = sim.to_str().expect("a UTF-8 path");
    let run = first_contact(
        &["--sim"],
        &out,
        &[("NEURON_RT_LIB", sim), ("NRT_SIM_FAIL_LOAD", "1")],
    );
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert_eq!(run.status.code(), Some(1), "{stderr}");
    let r = report(&out);
    assert_eq!(r["ok"], Value::Bool(false), "{r:#}");
    assert_eq!(r["first_failure"], "capture", "{r:#}");
    let capture = &steps(&r)[4];
    assert_eq!(capture["name"], "capture");
    assert_eq!(capture["ok"], Value::Bool(false));
    assert!(
        capture["output"]
            .as_str()
            .is_some_and(|o| o.contains("NRT_RESOURCE")),
        "{capture:#}"
    );
    for s in &steps(&r)[..4] {
        assert_eq!(s["ok"], Value::Bool(true), "{s:#}");
    }
    for s in &steps(&r)[5..] {
        assert_eq!(s["ok"], Value::Bool(false), "{s:#}");
        assert_eq!(s["skipped"], Value::Bool(true), "{s:#}");
    }
    let md = std::fs::read_to_string(out.join("report.md")).expect("report.md written");
    assert!(md.starts_with("FAIL"), "{md}");
    assert!(md.contains("NRT_RESOURCE"), "{md}");
    let _ = std::fs::remove_dir_all(&out);
}

#[test]
fn without_neuron_it_exits_2_after_a_report_that_is_not_green() {
    let out = out_dir("no-neuron");
    let run = first_contact(
        &[],
        &out,
        &[(
            "NEURON_RT_LIB",
            "/nonexistent/deepinfer-first-contact/libnrt.so.1",
        )],
    );
    let stderr = String::from_utf8_lossy(&run.stderr);
    // This test assumes no libnrt here: on a machine with one (a trn1) the loader would find it.
    if Path::new("/opt/aws/neuron/lib/libnrt.so.1").exists() {
        return;
    }
    assert_eq!(run.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("libnrt") && stderr.contains("MISSING"),
        "{stderr}"
    );
    let r = report(&out);
    assert_eq!(r["ok"], Value::Bool(false), "{r:#}");
    assert_eq!(r["first_failure"], "doctor", "{r:#}");
    assert_eq!(r["backend"], "neuron");
    assert!(
        steps(&r)[1..]
            .iter()
            .all(|s| s["skipped"] == Value::Bool(true)),
        "{r:#}"
    );
    let _ = std::fs::remove_dir_all(&out);
}
