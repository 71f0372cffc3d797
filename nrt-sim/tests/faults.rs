//! Faults on demand (`NRT_SIM_*`, read at `nrt_init`) and calls before `nrt_init`.
//!
//! Each case runs in a child process: the variables are read once per runtime, libnrt allows
//! one `nrt_init` at a time, and `std::env::set_var` in a multi-threaded test binary is not
//! safe. The public test spawns this same binary with the variable set and a filter naming
//! the `#[ignore]`d `child_*` test, which does nothing unless it runs as such a child.

mod common;

use std::time::{Duration, Instant};

use common::{tiny_neff, Sim, TinyBindings};
use neuron_sys::sys::{self, NRT_STATUS};
use neuron_sys::{Error, Runtime};
use nrt_sim::{is_fault_child as is_child, run_test_in_child as run_child};

const OK: NRT_STATUS = sys::NRT_SUCCESS;

#[test]
fn injected_execute_failure_fails_once_then_executions_recover() {
    run_child("child_execute_fault", &[(nrt_sim::ENV_FAIL_EXECUTE, "2")]);
}

#[test]
#[ignore = "runs in a child process started by its parent test"]
fn child_execute_fault() {
    if !is_child() {
        return;
    }
    let sim = Sim::open();
    let _rt = sim.runtime();
    let raw = sim.raw();
    let (s, model) = raw.load(&tiny_neff());
    assert_eq!(s, OK);
    let b = TinyBindings::new(&raw);

    assert_eq!(raw.execute(model, b.inputs, b.outputs), OK, "execution 1");
    let c1 = b.read_f32(&raw, b.c, 8);
    assert_eq!(c1, [1.0, 2.0, 3.0, 4.0, 1.0, 2.0, 3.0, 4.0]);
    // An execution whose bindings do not validate is not counted.
    assert_eq!(raw.execute(model, b.outputs, b.outputs), sys::NRT_INVALID);
    assert_eq!(
        raw.execute(model, b.inputs, b.outputs),
        sys::NRT_EXEC_COMPLETED_WITH_ERR,
        "execution 2 is the injected failure"
    );
    let c = sim.counters();
    let err = c.last_error.clone().unwrap();
    assert!(
        err.contains("injected failure: execution 2 (NRT_SIM_FAIL_EXECUTE=2)"),
        "{err}"
    );
    assert_eq!(
        b.read_f32(&raw, b.c, 8),
        c1,
        "a failed execution writes nothing"
    );
    assert_eq!((c.execute_calls, c.execute_failures), (3, 2));
    assert_eq!(c.executions_of("tiny"), 1);

    assert_eq!(raw.execute(model, b.inputs, b.outputs), OK, "execution 3");
    assert_eq!(raw.execute(model, b.inputs, b.outputs), OK, "execution 4");
    assert_eq!(b.read_f32(&raw, b.c, 8)[0], 3.0);
    assert_eq!(sim.counters().executions_of("tiny"), 3);
    b.free(&raw);
    assert_eq!(raw.unload(model), OK);
}

#[test]
fn injected_load_failure_fails_the_chosen_load_only() {
    run_child("child_load_fault", &[(nrt_sim::ENV_FAIL_LOAD, "1")]);
}

#[test]
#[ignore = "runs in a child process started by its parent test"]
fn child_load_fault() {
    if !is_child() {
        return;
    }
    let sim = Sim::open();
    let _rt = sim.runtime();
    let raw = sim.raw();
    let neff = tiny_neff();
    // A corrupt module fails on its own merits and is not counted.
    assert_eq!(raw.load(b"junk").0, sys::NRT_INVALID);
    let (s, m) = raw.load(&neff);
    assert_eq!(
        s,
        sys::NRT_RESOURCE,
        "the first valid load is the injected failure"
    );
    assert!(m.is_null());
    let c = sim.counters();
    assert!(c
        .last_error
        .as_ref()
        .unwrap()
        .contains("injected failure: load 1 (NRT_SIM_FAIL_LOAD=1)"));
    assert_eq!((c.loads, c.load_failures, c.live.models), (0, 2, 0));
    let (s, m) = raw.load(&neff);
    assert_eq!(s, OK, "later loads succeed");
    assert_eq!(sim.counters().loads, 1);
    assert_eq!(raw.unload(m), OK);
}

#[test]
fn slow_execute_sleeps_in_every_execution() {
    run_child(
        "child_slow_execute",
        &[(nrt_sim::ENV_SLOW_EXECUTE_MS, "300")],
    );
}

#[test]
#[ignore = "runs in a child process started by its parent test"]
fn child_slow_execute() {
    if !is_child() {
        return;
    }
    let sim = Sim::open();
    let _rt = sim.runtime();
    let raw = sim.raw();
    let (_, model) = raw.load(&tiny_neff());
    let b = TinyBindings::new(&raw);
    for _ in 0..2 {
        let start = Instant::now();
        assert_eq!(raw.execute(model, b.inputs, b.outputs), OK);
        assert!(
            start.elapsed() >= Duration::from_millis(300),
            "{:?}",
            start.elapsed()
        );
    }
    assert_eq!(
        b.read_f32(&raw, b.y, 4),
        [2.5, 4.5, 6.5, 8.5],
        "still computed"
    );
    // Validation comes first: a bad binding fails without the wait.
    let start = Instant::now();
    assert_eq!(raw.execute(model, b.outputs, b.outputs), sys::NRT_INVALID);
    assert!(start.elapsed() < Duration::from_millis(300));
    b.free(&raw);
    assert_eq!(raw.unload(model), OK);
}

#[test]
fn slow_execute_models_slows_only_the_models_named() {
    for models in ["decode, sample", "decode, tin"] {
        run_child(
            "child_slow_execute_models",
            &[
                (nrt_sim::ENV_SLOW_EXECUTE_MS, "300"),
                (nrt_sim::ENV_SLOW_EXECUTE_MODELS, models),
            ],
        );
    }
}

#[test]
#[ignore = "runs in a child process started by its parent test"]
fn child_slow_execute_models() {
    if !is_child() {
        return;
    }
    let sim = Sim::open();
    let _rt = sim.runtime();
    let raw = sim.raw();
    // The tiny NEFF's model is `tiny`: slowed when a name in the list is part of it.
    let models = std::env::var(nrt_sim::ENV_SLOW_EXECUTE_MODELS).unwrap();
    let slowed = models.split(',').any(|m| "tiny".contains(m.trim()));
    let (_, model) = raw.load(&tiny_neff());
    let b = TinyBindings::new(&raw);
    let start = Instant::now();
    assert_eq!(raw.execute(model, b.inputs, b.outputs), OK);
    let slept = start.elapsed() >= Duration::from_millis(300);
    assert_eq!(slept, slowed, "{models}: {:?}", start.elapsed());
    b.free(&raw);
    assert_eq!(raw.unload(model), OK);
}

#[test]
fn free_execute_validates_bindings_and_skips_the_arithmetic() {
    run_child("child_free_execute", &[(nrt_sim::ENV_FREE_EXECUTE, "1")]);
}

#[test]
#[ignore = "runs in a child process started by its parent test"]
fn child_free_execute() {
    if !is_child() {
        return;
    }
    let sim = Sim::open();
    let _rt = sim.runtime();
    let raw = sim.raw();
    let (_, model) = raw.load(&tiny_neff());
    let b = TinyBindings::new(&raw);
    for _ in 0..3 {
        assert_eq!(raw.execute(model, b.inputs, b.outputs), OK);
    }
    assert_eq!(b.read_f32(&raw, b.y, 4), [0.0; 4], "nothing computed");
    assert_eq!(b.read_f32(&raw, b.c, 8), [0.0; 8], "nothing written");
    assert_eq!(sim.counters().executions_of("tiny"), 3);
    // Bindings are still checked.
    assert_eq!(raw.execute(model, b.outputs, b.outputs), sys::NRT_INVALID);
    raw.free(b.h);
    assert_eq!(
        raw.execute(model, b.inputs, b.outputs),
        sys::NRT_INVALID_HANDLE
    );
    assert_eq!(raw.unload(model), OK);
}

#[test]
fn a_malformed_fault_variable_fails_nrt_init() {
    run_child(
        "child_malformed_variable",
        &[(nrt_sim::ENV_FAIL_EXECUTE, "second")],
    );
}

#[test]
#[ignore = "runs in a child process started by its parent test"]
fn child_malformed_variable() {
    if !is_child() {
        return;
    }
    nrt_init_fails_naming("NRT_SIM_FAIL_EXECUTE=\"second\" is not a positive integer");
}

/// In a child whose environment holds a malformed nrt-sim variable: `nrt_init` fails with
/// NRT_INVALID, leaves the runtime uninitialized, and its last error contains `why`.
fn nrt_init_fails_naming(why: &str) {
    let sim = Sim::open();
    let err = Runtime::new(sim.lib.clone(), 0, 1).unwrap_err();
    assert!(
        matches!(
            err,
            Error::Status {
                status: sys::NRT_INVALID,
                ..
            }
        ),
        "{err}"
    );
    let c = sim.counters();
    assert!(!c.initialized);
    let last = c.last_error.unwrap();
    assert!(last.contains(why), "{last}");
}

#[test]
fn a_malformed_core_count_fails_nrt_init() {
    run_child(
        "child_malformed_core_count",
        &[(nrt_sim::ENV_NC_COUNT, "65")],
    );
}

#[test]
#[ignore = "runs in a child process started by its parent test"]
fn child_malformed_core_count() {
    if !is_child() {
        return;
    }
    nrt_init_fails_naming("NRT_SIM_NC_COUNT=\"65\" is not a number of NeuronCores from 1 to 64");
}

#[test]
fn calls_before_nrt_init_are_uninitialized() {
    run_child("child_before_init", &[]);
}

#[test]
#[ignore = "runs in a child process started by its parent test"]
fn child_before_init() {
    if !is_child() {
        return;
    }
    let sim = Sim::open();
    let raw = sim.raw();
    // Version, core counts and status names work before nrt_init.
    assert!(sim.lib.version().unwrap().is_some());
    assert_eq!(sim.lib.visible_nc_count().unwrap(), Some(2));
    // Everything else is NRT_UNINITIALIZED.
    assert_eq!(raw.allocate(4, "t").0, sys::NRT_UNINITIALIZED);
    assert_eq!(raw.new_set().0, sys::NRT_UNINITIALIZED);
    assert_eq!(raw.load(&tiny_neff()).0, sys::NRT_UNINITIALIZED);
    let dangling = 0x1001 as common::TensorPtr;
    assert_eq!(raw.read(dangling, 0, &mut [0; 1]), sys::NRT_UNINITIALIZED);
    assert_eq!(
        raw.execute(dangling.cast(), dangling.cast(), dangling.cast()),
        sys::NRT_UNINITIALIZED
    );
    let errors = sim.counters().errors;
    raw.close();
    let c = sim.counters();
    assert_eq!(
        c.errors,
        errors + 1,
        "nrt_close before nrt_init is recorded"
    );
    assert!(c.last_error.unwrap().contains("nrt_close before nrt_init"));
    assert_eq!(raw.init(), OK);
    assert_eq!(raw.init(), sys::NRT_INVALID, "twice without nrt_close");
    let (s, t) = raw.allocate(4, "t");
    assert_eq!(s, OK);
    raw.free(t);
    raw.close();
    assert_eq!(raw.allocate(4, "t").0, sys::NRT_CLOSED);
    assert_eq!(raw.init(), OK, "nrt_init after nrt_close");
    raw.close();
}
