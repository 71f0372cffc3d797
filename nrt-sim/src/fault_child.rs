//! Running one test in a fresh process with fault variables set.
//!
//! nrt-sim reads its `NRT_SIM_*` fault variables once, at `nrt_init`, and a process holds one
//! runtime; so a test that injects a fault runs in a child process of its own test binary. The
//! parent test calls [`run_test_in_child`] with the name of an `#[ignore]`d test, which does
//! nothing unless [`is_fault_child`] holds (so `cargo test -- --ignored` alone is harmless).

use std::process::Command;

/// Set in a child process started by [`run_test_in_child`].
pub const CHILD_ENV: &str = "NRT_SIM_TEST_CHILD";

/// Whether this process is a child started by [`run_test_in_child`].
pub fn is_fault_child() -> bool {
    std::env::var_os(CHILD_ENV).is_some()
}

/// Runs the `#[ignore]`d test `name` of the current test binary in a child process, with `env`
/// set and every other `NRT_SIM_*` variable removed, and panics unless it passed.
pub fn run_test_in_child(name: &str, env: &[(&str, &str)]) {
    let exe = std::env::current_exe().expect("the current test binary");
    let mut cmd = Command::new(exe);
    cmd.args([
        name,
        "--exact",
        "--ignored",
        "--nocapture",
        "--test-threads=1",
    ]);
    for (k, _) in std::env::vars_os() {
        if k.to_string_lossy().starts_with("NRT_SIM_") {
            cmd.env_remove(k);
        }
    }
    cmd.env(CHILD_ENV, "1").envs(env.iter().copied());
    let out = cmd.output().expect("spawn the test binary");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && stdout.contains("1 passed"),
        "child test {name} with {env:?} failed ({}):\n--- stdout\n{stdout}\n--- stderr\n{stderr}",
        out.status
    );
}
