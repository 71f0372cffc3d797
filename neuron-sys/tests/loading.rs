//! Finding and opening libnrt, without libnrt: the error paths, and the symbol lists against
//! the header.

mod header;

use neuron_sys::{Candidate, Error, Library, OPTIONAL_SYMBOLS, REQUIRED_SYMBOLS};

#[test]
fn nothing_found_lists_every_place_tried_and_how_to_get_libnrt() {
    let candidates = [
        Candidate::new(
            "/nonexistent/deepinfer-test/libnrt.so.1",
            "from NEURON_RT_LIB",
        ),
        Candidate::new(
            "libdeepinfer-test-no-such-lib.so.1",
            "dynamic loader search path",
        ),
    ];
    let err = Library::load_from(&candidates).unwrap_err();
    assert!(err.is_library_missing());
    let Error::LibraryNotFound { tried } = &err else {
        panic!("expected LibraryNotFound, got {err:?}");
    };
    assert_eq!(tried.len(), 2);
    assert!(tried[0]
        .place
        .contains("/nonexistent/deepinfer-test/libnrt.so.1"));
    assert!(tried[0].place.contains("NEURON_RT_LIB"));
    assert!(tried[1]
        .place
        .contains("libdeepinfer-test-no-such-lib.so.1"));
    let text = err.to_string();
    assert!(
        text.contains("/nonexistent/deepinfer-test/libnrt.so.1"),
        "{text}"
    );
    assert!(
        text.contains("libdeepinfer-test-no-such-lib.so.1"),
        "{text}"
    );
    assert!(text.contains("aws-neuronx-runtime-lib"), "{text}");
    assert!(text.contains("NEURON_RT_LIB"), "{text}");
    assert!(text.contains("--backend cpu"), "{text}");
    // One line: what a user sees when `--backend neuron` cannot start.
    assert_eq!(text.lines().count(), 1, "{text}");
}

#[test]
fn default_candidates_are_the_documented_order() {
    let c = Library::candidates();
    let paths: Vec<String> = c
        .iter()
        .map(|c| c.path.to_string_lossy().into_owned())
        .collect();
    let n = paths.len();
    assert!(n >= 2);
    assert_eq!(paths[n - 2], "libnrt.so.1");
    assert_eq!(paths[n - 1], "/opt/aws/neuron/lib/libnrt.so.1");
    if let Some(env) = std::env::var_os("NEURON_RT_LIB").filter(|v| !v.is_empty()) {
        assert_eq!(n, 3);
        assert_eq!(c[0].path, env);
    } else {
        assert_eq!(n, 2);
    }
}

#[cfg(target_os = "linux")]
#[test]
fn a_library_that_is_not_libnrt_reports_the_first_missing_symbol() {
    for wrong in ["libm.so.6", "libc.so.6"] {
        let err = Library::open(wrong).unwrap_err();
        match &err {
            Error::MissingSymbol { library, symbol } => {
                assert_eq!(library, wrong);
                assert_eq!(*symbol, "nrt_init");
            }
            other => panic!("{wrong}: expected MissingSymbol, got {other:?}"),
        }
        let text = err.to_string();
        assert!(text.contains("`nrt_init`"), "{text}");
        assert!(text.contains(wrong), "{text}");
    }
}

#[cfg(target_os = "linux")]
#[test]
fn a_wrong_library_after_a_missing_one_stops_the_search() {
    // The first candidate is absent, the second opens but is not libnrt: the error is about
    // the second, not a "not found" that would hide it.
    let candidates = [
        Candidate::new("/nonexistent/libnrt.so.1", "test"),
        Candidate::new("libm.so.6", "test"),
        Candidate::new("/nonexistent/other/libnrt.so.1", "test"),
    ];
    let err = Library::load_from(&candidates).unwrap_err();
    assert!(
        matches!(
            err,
            Error::MissingSymbol {
                symbol: "nrt_init",
                ..
            }
        ),
        "{err:?}"
    );
}

#[test]
fn the_symbol_lists_are_exactly_the_headers_functions() {
    // Every function include/nrt_deepinfer.h declares (and derives a pointer type for) is
    // resolved, as required or optional, and nothing else: a misspelt optional name would
    // otherwise resolve to nothing on every runtime without an error.
    let declared = header::functions_with_pointer_types();
    for f in &declared {
        let n = REQUIRED_SYMBOLS
            .iter()
            .chain(OPTIONAL_SYMBOLS)
            .filter(|s| *s == f)
            .count();
        assert_eq!(n, 1, "{f}: in the symbol lists {n} times, expected once");
    }
    for s in REQUIRED_SYMBOLS.iter().chain(OPTIONAL_SYMBOLS) {
        assert!(
            declared.iter().any(|f| f == s),
            "{s} is resolved but the header declares no such function"
        );
    }
    // Resolved first, so a library that is not libnrt is reported as missing `nrt_init`.
    assert_eq!(REQUIRED_SYMBOLS[0], "nrt_init");
}
