//! Status codes, their names, and the error text built from them.

use neuron_sys::sys::{self, STATUS_CODES};
use neuron_sys::{status_name, Error};

#[test]
fn every_published_status_has_its_name() {
    let expected: &[(u32, &str)] = &[
        (0, "NRT_SUCCESS"),
        (1, "NRT_FAILURE"),
        (2, "NRT_INVALID"),
        (3, "NRT_INVALID_HANDLE"),
        (4, "NRT_RESOURCE"),
        (5, "NRT_TIMEOUT"),
        (6, "NRT_HW_ERROR"),
        (7, "NRT_QUEUE_FULL"),
        (9, "NRT_LOAD_NOT_ENOUGH_NC"),
        (10, "NRT_UNSUPPORTED_NEFF_VERSION"),
        (11, "NRT_FAIL_HOST_MEM_ALLOC"),
        (13, "NRT_UNINITIALIZED"),
        (14, "NRT_CLOSED"),
        (15, "NRT_QUEUE_EMPTY"),
        (101, "NRT_EXEC_UNIT_UNRECOVERABLE"),
        (1002, "NRT_EXEC_BAD_INPUT"),
        (1003, "NRT_EXEC_COMPLETED_WITH_NUM_ERR"),
        (1004, "NRT_EXEC_COMPLETED_WITH_ERR"),
        (1005, "NRT_EXEC_NC_BUSY"),
        (1006, "NRT_EXEC_OOB"),
        (1100, "NRT_COLL_PENDING"),
        (1200, "NRT_EXEC_HW_ERR_COLLECTIVES"),
        (1201, "NRT_EXEC_HW_ERR_HBM_UE"),
        (1202, "NRT_EXEC_HW_ERR_NC_UE"),
        (1203, "NRT_EXEC_HW_ERR_DMA_ABORT"),
        (1204, "NRT_EXEC_SW_NQ_OVERFLOW"),
        (1205, "NRT_EXEC_HW_ERR_REPAIRABLE_HBM_UE"),
        (1206, "NRT_NETWORK_PROXY_FAILURE"),
    ];
    assert_eq!(STATUS_CODES, expected);
    for &(code, name) in expected {
        assert_eq!(status_name(code), name);
    }
    assert_eq!(sys::NRT_EXEC_BAD_INPUT, 1002);
    assert_eq!(sys::NRT_CLOSED, 14);
}

#[test]
fn unknown_codes_have_a_placeholder_name() {
    // 8 and 12 were never assigned; 999 and u32::MAX are not codes.
    for code in [8, 12, 999, 1007, u32::MAX] {
        assert_eq!(status_name(code), "NRT_STATUS_UNKNOWN", "code {code}");
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
fn enum_constants_have_the_published_values() {
    assert_eq!(sys::NRT_TENSOR_PLACEMENT_DEVICE, 0);
    assert_eq!(sys::NRT_TENSOR_PLACEMENT_HOST, 1);
    assert_eq!(sys::NRT_TENSOR_PLACEMENT_VIRTUAL, 2);
    assert_eq!(sys::NRT_FRAMEWORK_TYPE_INVALID, 0);
    assert_eq!(sys::NRT_FRAMEWORK_TYPE_NO_FW, 1);
    assert_eq!(sys::NRT_FRAMEWORK_TYPE_PRECHECK, 5);
    assert_eq!(sys::NRT_TENSOR_USAGE_INPUT, 0);
    assert_eq!(sys::NRT_TENSOR_USAGE_OUTPUT, 1);
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
