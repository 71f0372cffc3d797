//! The FFI boundary's guard: every `extern "C"` shell runs its body through [`guard`] (or a
//! sibling), which turns a panic into `NRT_FAILURE`, a [`Fail`] into its status, and records
//! every failure in the counters (`errors`, `last_error`), including failures of the `void`
//! functions, which cannot return one.
//!
//! Kept apart from the shells so the policy (what a panic becomes, what is counted) is
//! written once and tested without a C caller.

use std::panic::{catch_unwind, AssertUnwindSafe};

use neuron_sys::sys::{self, NRT_STATUS};

use crate::fail::{Fail, Res};
use crate::state::state;

/// Runs `f`, turning a panic into `NRT_FAILURE` with a message naming the panic.
pub(crate) fn catch<T>(call: &str, f: impl FnOnce() -> Res<T>) -> Res<T> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(payload) => {
            let what = payload
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "a non-string panic".into());
            Err(Fail::new(
                sys::NRT_FAILURE,
                format!("{call} panicked (caught at the FFI boundary): {what}"),
            ))
        }
    }
}

/// Records a failure in the counters. Never panics into C: recording itself is guarded.
pub(crate) fn record(call: &str, fail: &Fail) {
    let _ = catch_unwind(AssertUnwindSafe(|| state().record(call, fail)));
}

/// The status of a result, recording a failure.
pub(crate) fn status(call: &str, r: Res<()>) -> NRT_STATUS {
    match r {
        Ok(()) => sys::NRT_SUCCESS,
        Err(fail) => {
            record(call, &fail);
            fail.status
        }
    }
}

/// Runs a body that returns a status.
pub(crate) fn guard(call: &str, f: impl FnOnce() -> Res<()>) -> NRT_STATUS {
    status(call, catch(call, f))
}

/// Runs the body of a `void` function: failures are only recorded.
pub(crate) fn guard_void(call: &str, f: impl FnOnce() -> Res<()>) {
    let _ = guard(call, f);
}

/// Runs the body of a function that returns a value instead of a status (`size_t`): a
/// failure is recorded and answered with `fallback`.
pub(crate) fn guard_value<T>(call: &str, fallback: T, f: impl FnOnce() -> Res<T>) -> T {
    match catch(call, f) {
        Ok(v) => v,
        Err(fail) => {
            record(call, &fail);
            fallback
        }
    }
}

/// The calls with their own tallies in the counters, beside `errors`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Tally {
    /// `nrt_load` and `nrt_load_collectives`: failures are counted (`load_failures`).
    Load,
    /// `nrt_execute`: every call (`execute_calls`) and every failure (`execute_failures`).
    Execute,
}

/// [`guard`] for a tallied call: counts the call (executions only) before the body, and the
/// failure after it, whatever failed (an argument, a handle, an injected fault, a panic).
pub(crate) fn guard_tallied(call: &str, tally: Tally, f: impl FnOnce() -> Res<()>) -> NRT_STATUS {
    if tally == Tally::Execute {
        let _ = catch_unwind(|| state().stats.execute_calls += 1);
    }
    let r = catch(call, f);
    if r.is_err() {
        let _ = catch_unwind(|| {
            let mut st = state();
            match tally {
                Tally::Load => st.stats.load_failures += 1,
                Tally::Execute => st.stats.execute_failures += 1,
            }
        });
    }
    status(call, r)
}

/// `Ok` when `p` is not null (an out-pointer the caller must provide), else `NRT_INVALID`.
pub(crate) fn non_null<T>(p: *const T, what: &str) -> Res<()> {
    if p.is_null() {
        Err(Fail::invalid(format!("{what} is null")))
    } else {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_panic_becomes_nrt_failure() {
        let s = guard("test_call", || panic!("boom"));
        assert_eq!(s, sys::NRT_FAILURE);
        let r: Res<()> = catch("test_call", || panic!("{}", String::from("dynamic")));
        assert!(r.unwrap_err().msg.contains("dynamic"));
    }
}
