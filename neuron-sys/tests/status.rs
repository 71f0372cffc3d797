//! Status codes, their names, the error text built from them, and the other enum constants,
//! held against `include/nrt_deepinfer.h` (the header the bindings come from): the crate
//! compile-time checks that each constant it has equals the header's, and these tests check
//! the other direction, that it has every one the header declares.

mod header;

use neuron_sys::sys::{self, STATUS_CODES};
use neuron_sys::{status_name, Error};

#[test]
fn the_status_table_is_the_headers_nrt_status_enum() {
    let declared = header::enum_values("NRT_STATUS");
    let table: Vec<(String, u32)> = STATUS_CODES
        .iter()
        .map(|&(code, name)| (name.to_string(), code))
        .collect();
    for (name, code) in &declared {
        assert!(
            table.contains(&(name.clone(), *code)),
            "the header declares {name} = {code}; STATUS_CODES lacks it"
        );
    }
    for (name, code) in &table {
        assert!(
            declared.contains(&(name.clone(), *code)),
            "STATUS_CODES has {name} = {code}; the header does not declare it"
        );
    }
    assert_eq!(table, declared, "same entries, in the header's order");
}

#[test]
fn the_status_table_is_ascending_with_one_name_per_code() {
    assert!(
        STATUS_CODES.windows(2).all(|w| w[0].0 < w[1].0),
        "STATUS_CODES is documented as strictly ascending: {STATUS_CODES:?}"
    );
    let mut names: Vec<&str> = STATUS_CODES.iter().map(|&(_, n)| n).collect();
    names.sort_unstable();
    names.dedup();
    assert_eq!(names.len(), STATUS_CODES.len(), "a name used twice");
    assert_eq!(STATUS_CODES[0], (sys::NRT_SUCCESS, "NRT_SUCCESS"));
}

#[test]
fn status_name_round_trips_and_every_other_code_is_unknown() {
    for &(code, name) in STATUS_CODES {
        assert_eq!(status_name(code), name, "code {code}");
    }
    // Every code up to past the highest known one, and the extremes (libnrt appends codes,
    // so an unknown one must get the placeholder, never a neighbour's name).
    let max = STATUS_CODES.iter().map(|&(c, _)| c).max().expect("codes");
    for code in (0..=max + 100).chain([i32::MAX as u32, u32::MAX]) {
        if !STATUS_CODES.iter().any(|&(c, _)| c == code) {
            assert_eq!(status_name(code), "NRT_STATUS_UNKNOWN", "code {code}");
        }
    }
}

#[test]
fn status_error_names_the_call_and_the_status() {
    let e = Error::status("nrt_execute", sys::NRT_EXEC_BAD_INPUT);
    assert_eq!(
        e.to_string(),
        "nrt_execute failed: NRT_EXEC_BAD_INPUT (status 1002)"
    );
    assert_eq!(e.status_code(), Some(1002));
    assert!(!e.is_library_missing());
    let e = Error::status("nrt_load", 4242);
    assert_eq!(
        e.to_string(),
        "nrt_load failed: NRT_STATUS_UNKNOWN (status 4242)"
    );
}

#[test]
fn every_other_enum_of_the_header_has_its_constant_in_sys() {
    // The names must be typed here (Rust cannot look a constant up by name); the values are
    // the crate's, and the header decides which names must exist.
    let constants: &[(&str, u32)] = &[
        (
            "NRT_TENSOR_PLACEMENT_DEVICE",
            sys::NRT_TENSOR_PLACEMENT_DEVICE,
        ),
        ("NRT_TENSOR_PLACEMENT_HOST", sys::NRT_TENSOR_PLACEMENT_HOST),
        (
            "NRT_TENSOR_PLACEMENT_VIRTUAL",
            sys::NRT_TENSOR_PLACEMENT_VIRTUAL,
        ),
        (
            "NRT_FRAMEWORK_TYPE_INVALID",
            sys::NRT_FRAMEWORK_TYPE_INVALID,
        ),
        ("NRT_FRAMEWORK_TYPE_NO_FW", sys::NRT_FRAMEWORK_TYPE_NO_FW),
        (
            "NRT_FRAMEWORK_TYPE_TENSORFLOW",
            sys::NRT_FRAMEWORK_TYPE_TENSORFLOW,
        ),
        (
            "NRT_FRAMEWORK_TYPE_PYTORCH",
            sys::NRT_FRAMEWORK_TYPE_PYTORCH,
        ),
        ("NRT_FRAMEWORK_TYPE_MXNET", sys::NRT_FRAMEWORK_TYPE_MXNET),
        (
            "NRT_FRAMEWORK_TYPE_PRECHECK",
            sys::NRT_FRAMEWORK_TYPE_PRECHECK,
        ),
        ("NRT_TENSOR_USAGE_INPUT", sys::NRT_TENSOR_USAGE_INPUT),
        ("NRT_TENSOR_USAGE_OUTPUT", sys::NRT_TENSOR_USAGE_OUTPUT),
    ];
    let mut declared = Vec::new();
    for e in [
        "nrt_tensor_placement_t",
        "nrt_framework_type_t",
        "nrt_tensor_usage_t",
    ] {
        declared.extend(header::enum_values(e));
    }
    for (name, value) in &declared {
        match constants.iter().find(|(n, _)| n == name) {
            Some(&(_, v)) => assert_eq!(v, *value, "sys::{name} differs from the header"),
            None => panic!("the header declares {name} = {value}; sys has no constant for it"),
        }
    }
    for (name, _) in constants {
        assert!(
            declared.iter().any(|(n, _)| n == name),
            "sys::{name} is not declared in the header"
        );
    }
}

#[test]
fn dtype_tables_and_the_encoding_rule() {
    use sys::dtype::{hw, sequential, DtypeEncoding};
    assert_eq!(DtypeEncoding::for_runtime(2, 29), DtypeEncoding::Sequential);
    assert_eq!(DtypeEncoding::for_runtime(2, 30), DtypeEncoding::Hw);
    assert_eq!(DtypeEncoding::for_runtime(3, 0), DtypeEncoding::Hw);
    // The same raw 1 means FLOAT32 in one table and UINT64 in the other: the element size
    // (size / prod(shape)) tells them apart.
    assert_eq!(DtypeEncoding::Sequential.name(1), Some("FLOAT32"));
    assert_eq!(DtypeEncoding::Hw.name(1), Some("UINT64"));
    assert_eq!(DtypeEncoding::Sequential.element_size(1), Some(4));
    assert_eq!(DtypeEncoding::Hw.element_size(1), Some(8));
    assert_eq!(DtypeEncoding::Hw.name(hw::FLOAT32), Some("FLOAT32"));
    assert_eq!(hw::FLOAT32, 0xA);
    assert_eq!(hw::BFLOAT16, 0x6);
    assert_eq!(sequential::BFLOAT16, 3);
    assert_eq!(DtypeEncoding::Hw.element_size(hw::BFLOAT16), Some(2));
    assert_eq!(DtypeEncoding::Hw.element_size(hw::FP8_E4), Some(1));
    assert_eq!(DtypeEncoding::Sequential.name(12), None);
    assert_eq!(DtypeEncoding::Hw.element_size(0), None);
}

#[test]
fn each_dtype_table_names_a_code_once_and_sizes_every_known_type() {
    use sys::dtype::DtypeEncoding::{self, Hw, Sequential};
    let table = |enc: DtypeEncoding| -> Vec<(u32, &'static str)> {
        (0..=255)
            .filter_map(|raw| enc.name(raw).map(|n| (raw, n)))
            .collect()
    };
    let (seq, hw) = (table(Sequential), table(Hw));
    // nrt-api.md §4: UNKNOWN plus 11 types sequentially; the hardware codes add FP32R and
    // three FP8 types.
    assert_eq!((seq.len(), hw.len()), (12, 16), "{seq:?} {hw:?}");
    for (enc, t) in [(Sequential, &seq), (Hw, &hw)] {
        let mut names: Vec<&str> = t.iter().map(|&(_, n)| n).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), t.len(), "{enc:?} names a type twice: {t:?}");
        for &(raw, name) in t {
            assert_eq!(
                enc.element_size(raw).is_some(),
                name != "UNKNOWN",
                "{enc:?} {name} ({raw})"
            );
        }
    }
    // A type has one size whichever table names it.
    for &(raw, name) in &seq {
        let &(hw_raw, _) = hw
            .iter()
            .find(|&&(_, n)| n == name)
            .unwrap_or_else(|| panic!("{name} is missing from the hardware table"));
        assert_eq!(
            Sequential.element_size(raw),
            Hw.element_size(hw_raw),
            "{name}"
        );
    }
}
