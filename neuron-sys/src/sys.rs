//! Raw libnrt types and constants: the `sys` level.
//!
//! Types (handles, `#[repr(C)]` structs, function-pointer types) are re-exported from the
//! generated [`crate::bindings`]. Constants are written here by hand, as `u32` values, so
//! they stay the published values whichever header the bindings were generated from
//! (codes are appended across SDK releases, and an older installed header would lack some).
//! With the committed bindings, a compile-time check ties each constant to the header
//! `include/nrt_deepinfer.h`.
//!
//! Enums are plain `u32` constants, never Rust enums: libnrt may return values this crate
//! has never heard of, and transmuting those into a Rust enum would be undefined behaviour.
//!
//! Layouts are those of LP64 Linux (x86_64, aarch64), the only platforms libnrt ships for;
//! the asserts at the bottom pin every size and offset this crate relies on to the published
//! layout, independently of bindgen's own layout tests (which, in system-header mode, would
//! only compare the installed header with itself).

#![allow(non_camel_case_types)]

pub use crate::bindings::{
    nrt_add_tensor_to_tensor_set_fn, nrt_allocate_tensor_set_fn, nrt_close_fn,
    nrt_destroy_tensor_set_fn, nrt_dtype_t, nrt_execute_fn, nrt_framework_type_t,
    nrt_free_model_tensor_info_fn, nrt_get_model_tensor_info_fn, nrt_get_status_as_str_fn,
    nrt_get_tensor_from_tensor_set_fn, nrt_get_total_nc_count_fn, nrt_get_total_vnc_count_fn,
    nrt_get_version_fn, nrt_get_visible_nc_count_fn, nrt_get_visible_vnc_count_fn,
    nrt_get_vnc_memory_stats_fn, nrt_init_fn, nrt_load_collectives_fn, nrt_load_fn, nrt_model,
    nrt_model_t, nrt_tensor, nrt_tensor_allocate_fn, nrt_tensor_allocate_slice_fn,
    nrt_tensor_free_fn, nrt_tensor_get_size_fn, nrt_tensor_info, nrt_tensor_info_array,
    nrt_tensor_info_array_t, nrt_tensor_info_t, nrt_tensor_memset_fn, nrt_tensor_placement_t,
    nrt_tensor_read_fn, nrt_tensor_set_t, nrt_tensor_t, nrt_tensor_usage_t, nrt_tensor_write_fn,
    nrt_unload_fn, nrt_version, nrt_version_t, nrt_vnc_memory_stats, nrt_vnc_memory_stats_t,
    NRT_STATUS,
};

/// Declares the status codes once: the constants, [`status_name`], [`STATUS_CODES`], and
/// (with the committed bindings) a compile-time check against the header.
macro_rules! status_codes {
    ($($(#[doc = $doc:literal])* $name:ident = $value:literal,)*) => {
        $(
            $(#[doc = $doc])*
            pub const $name: NRT_STATUS = $value;
        )*

        /// Every status code this crate knows, with its name, in ascending order.
        pub const STATUS_CODES: &[(NRT_STATUS, &str)] = &[$(($value, stringify!($name)),)*];

        /// The name of a status code (`NRT_EXEC_BAD_INPUT` for 1002), or
        /// `"NRT_STATUS_UNKNOWN"` for a code this crate does not know (libnrt appends new
        /// codes across releases; `Library::status_str` may know it).
        pub fn status_name(status: NRT_STATUS) -> &'static str {
            match status {
                $($value => stringify!($name),)*
                _ => "NRT_STATUS_UNKNOWN",
            }
        }

        #[cfg(not(neuron_sys_system_bindings))]
        const _: () = {
            $(assert!($name == crate::bindings::$name, concat!(stringify!($name), " differs from include/nrt_deepinfer.h"));)*
        };
    };
}

status_codes! {
    /// Success.
    NRT_SUCCESS = 0,
    /// A failure with no more specific code (also: name missing from a tensor set).
    NRT_FAILURE = 1,
    /// Invalid argument: bad NEFF, or an input tensor name or size that does not match the model.
    NRT_INVALID = 2,
    /// Invalid handle.
    NRT_INVALID_HANDLE = 3,
    /// A resource (memory, cores) could not be allocated.
    NRT_RESOURCE = 4,
    /// Timed out (an execution longer than `NEURON_RT_EXEC_TIMEOUT`).
    NRT_TIMEOUT = 5,
    /// Hardware failure.
    NRT_HW_ERROR = 6,
    /// The execution input queue is full.
    NRT_QUEUE_FULL = 7,
    /// Not enough free NeuronCores to load the NEFF.
    NRT_LOAD_NOT_ENOUGH_NC = 9,
    /// The NEFF's version is not supported by this runtime.
    NRT_UNSUPPORTED_NEFF_VERSION = 10,
    /// Host memory allocation failed (kept for compatibility; not returned by new runtimes).
    NRT_FAIL_HOST_MEM_ALLOC = 11,
    /// Called before `nrt_init`.
    NRT_UNINITIALIZED = 13,
    /// Called after `nrt_close`.
    NRT_CLOSED = 14,
    /// A queue had no data (2026 headers).
    NRT_QUEUE_EMPTY = 15,
    /// The execution unit hit a fatal error and needs a reset (`NRT_EXEC_UNIT_DISABLED` in
    /// some 2026 headers).
    NRT_EXEC_UNIT_UNRECOVERABLE = 101,
    /// Invalid input submitted to an execution.
    NRT_EXEC_BAD_INPUT = 1002,
    /// The execution completed with numerical errors (NaN).
    NRT_EXEC_COMPLETED_WITH_NUM_ERR = 1003,
    /// The execution completed with other errors.
    NRT_EXEC_COMPLETED_WITH_ERR = 1004,
    /// The NeuronCore is in use by another model or process.
    NRT_EXEC_NC_BUSY = 1005,
    /// An indirect copy or embedding update was out of bounds (2026 headers).
    NRT_EXEC_OOB = 1006,
    /// A collective operation is still pending.
    NRT_COLL_PENDING = 1100,
    /// Stuck in a collective operation (possibly a hardware error on another worker).
    NRT_EXEC_HW_ERR_COLLECTIVES = 1200,
    /// An unrepairable uncorrectable HBM error.
    NRT_EXEC_HW_ERR_HBM_UE = 1201,
    /// A parity error in NeuronCore on-chip memory.
    NRT_EXEC_HW_ERR_NC_UE = 1202,
    /// A DMA engine hit an unrecoverable error.
    NRT_EXEC_HW_ERR_DMA_ABORT = 1203,
    /// Software notification queue overflow.
    NRT_EXEC_SW_NQ_OVERFLOW = 1204,
    /// A repairable uncorrectable HBM error.
    NRT_EXEC_HW_ERR_REPAIRABLE_HBM_UE = 1205,
    /// An EFA network proxy operation failed.
    NRT_NETWORK_PROXY_FAILURE = 1206,
}

// === nrt_tensor_placement_t ===

/// Device (HBM) memory of one NeuronCore.
pub const NRT_TENSOR_PLACEMENT_DEVICE: nrt_tensor_placement_t = 0;
/// DMA-able host memory (deprecated; at most 4 MB). Allocate with NeuronCore `-1`.
pub const NRT_TENSOR_PLACEMENT_HOST: nrt_tensor_placement_t = 1;
/// Host virtual memory (legacy, Inferentia v1; absent from the 2.34 headers).
pub const NRT_TENSOR_PLACEMENT_VIRTUAL: nrt_tensor_placement_t = 2;

// === nrt_framework_type_t ===

/// Invalid framework.
pub const NRT_FRAMEWORK_TYPE_INVALID: nrt_framework_type_t = 0;
/// No framework: what a standalone engine passes to `nrt_init` (with `""`, `""`).
pub const NRT_FRAMEWORK_TYPE_NO_FW: nrt_framework_type_t = 1;
/// TensorFlow.
pub const NRT_FRAMEWORK_TYPE_TENSORFLOW: nrt_framework_type_t = 2;
/// PyTorch.
pub const NRT_FRAMEWORK_TYPE_PYTORCH: nrt_framework_type_t = 3;
/// MXNet.
pub const NRT_FRAMEWORK_TYPE_MXNET: nrt_framework_type_t = 4;
/// Neuron node precheck (2026 headers).
pub const NRT_FRAMEWORK_TYPE_PRECHECK: nrt_framework_type_t = 5;

// === nrt_tensor_usage_t ===

/// The NEFF tensor is an input.
pub const NRT_TENSOR_USAGE_INPUT: nrt_tensor_usage_t = 0;
/// The NEFF tensor is an output.
pub const NRT_TENSOR_USAGE_OUTPUT: nrt_tensor_usage_t = 1;

// === Struct sizes ===

/// Length of [`nrt_tensor_info_t::name`], including the terminating NUL.
pub const NRT_TENSOR_NAME_MAX: usize = 256;
/// Length of [`nrt_version_t::rt_detail`].
pub const RT_VERSION_DETAIL_LEN: usize = 128;
/// Length of [`nrt_version_t::git_hash`].
pub const GIT_HASH_LEN: usize = 64;

#[cfg(not(neuron_sys_system_bindings))]
const _: () = {
    assert!(NRT_TENSOR_PLACEMENT_DEVICE == crate::bindings::NRT_TENSOR_PLACEMENT_DEVICE);
    assert!(NRT_TENSOR_PLACEMENT_HOST == crate::bindings::NRT_TENSOR_PLACEMENT_HOST);
    assert!(NRT_TENSOR_PLACEMENT_VIRTUAL == crate::bindings::NRT_TENSOR_PLACEMENT_VIRTUAL);
    assert!(NRT_FRAMEWORK_TYPE_INVALID == crate::bindings::NRT_FRAMEWORK_TYPE_INVALID);
    assert!(NRT_FRAMEWORK_TYPE_NO_FW == crate::bindings::NRT_FRAMEWORK_TYPE_NO_FW);
    assert!(NRT_FRAMEWORK_TYPE_TENSORFLOW == crate::bindings::NRT_FRAMEWORK_TYPE_TENSORFLOW);
    assert!(NRT_FRAMEWORK_TYPE_PYTORCH == crate::bindings::NRT_FRAMEWORK_TYPE_PYTORCH);
    assert!(NRT_FRAMEWORK_TYPE_MXNET == crate::bindings::NRT_FRAMEWORK_TYPE_MXNET);
    assert!(NRT_FRAMEWORK_TYPE_PRECHECK == crate::bindings::NRT_FRAMEWORK_TYPE_PRECHECK);
    assert!(NRT_TENSOR_USAGE_INPUT == crate::bindings::NRT_TENSOR_USAGE_INPUT);
    assert!(NRT_TENSOR_USAGE_OUTPUT == crate::bindings::NRT_TENSOR_USAGE_OUTPUT);
    assert!(NRT_TENSOR_NAME_MAX == crate::bindings::NRT_TENSOR_NAME_MAX as usize);
    assert!(RT_VERSION_DETAIL_LEN == crate::bindings::RT_VERSION_DETAIL_LEN as usize);
    assert!(GIT_HASH_LEN == crate::bindings::GIT_HASH_LEN as usize);
};

/// Element type codes of NEFF tensors, as `nrt_get_model_tensor_info` reports them in
/// [`nrt_tensor_info_t::dtype`].
///
/// ⚠ Two incompatible encodings exist, and the field is kept raw because of it:
///
/// - [`sequential`](dtype::sequential): runtime headers from the first publication (2022) up to 2.29.x number
///   the types 0..=11 (`FLOAT32 = 1`).
/// - [`hw`](dtype::hw): from SDK 2.28 / runtime headers after 2.29 the enum moved to `nrt.h` and uses
///   hardware codes (`FLOAT32 = 0xA`, `UINT64 = 0x1`, plus FP8 codes).
///
/// Which encoding a given runtime *returns* is not documented, and the runtime may report
/// FP8 as int8. Pick the table by [`DtypeEncoding::for_runtime`](dtype::DtypeEncoding::for_runtime) and cross-check with the
/// element size (`size / prod(shape)`): raw 1 with 4-byte elements is sequential FLOAT32,
/// raw 1 with 8-byte elements is hw UINT64.
pub mod dtype {
    /// The sequential encoding (runtime headers ≤ 2.29.x).
    pub mod sequential {
        use crate::sys::nrt_dtype_t;
        /// Unknown.
        pub const UNKNOWN: nrt_dtype_t = 0;
        /// 32-bit float.
        pub const FLOAT32: nrt_dtype_t = 1;
        /// 16-bit IEEE float.
        pub const FLOAT16: nrt_dtype_t = 2;
        /// bfloat16.
        pub const BFLOAT16: nrt_dtype_t = 3;
        /// 8-bit signed integer.
        pub const INT8: nrt_dtype_t = 4;
        /// 8-bit unsigned integer.
        pub const UINT8: nrt_dtype_t = 5;
        /// 16-bit signed integer.
        pub const INT16: nrt_dtype_t = 6;
        /// 16-bit unsigned integer.
        pub const UINT16: nrt_dtype_t = 7;
        /// 32-bit signed integer.
        pub const INT32: nrt_dtype_t = 8;
        /// 32-bit unsigned integer.
        pub const UINT32: nrt_dtype_t = 9;
        /// 64-bit signed integer.
        pub const INT64: nrt_dtype_t = 10;
        /// 64-bit unsigned integer.
        pub const UINT64: nrt_dtype_t = 11;
    }

    /// The hardware-code encoding (runtime headers after 2.29.x).
    pub mod hw {
        use crate::sys::nrt_dtype_t;
        /// Unknown / invalid.
        pub const UNKNOWN: nrt_dtype_t = 0x0;
        /// 64-bit unsigned integer.
        pub const UINT64: nrt_dtype_t = 0x1;
        /// 8-bit signed integer.
        pub const INT8: nrt_dtype_t = 0x2;
        /// 8-bit unsigned integer.
        pub const UINT8: nrt_dtype_t = 0x3;
        /// 16-bit signed integer.
        pub const INT16: nrt_dtype_t = 0x4;
        /// 16-bit unsigned integer.
        pub const UINT16: nrt_dtype_t = 0x5;
        /// bfloat16.
        pub const BFLOAT16: nrt_dtype_t = 0x6;
        /// 16-bit IEEE float.
        pub const FLOAT16: nrt_dtype_t = 0x7;
        /// 32-bit signed integer.
        pub const INT32: nrt_dtype_t = 0x8;
        /// 32-bit unsigned integer.
        pub const UINT32: nrt_dtype_t = 0x9;
        /// 32-bit float.
        pub const FLOAT32: nrt_dtype_t = 0xA;
        /// 32-bit float, round-to-nearest variant.
        pub const FP32R: nrt_dtype_t = 0xB;
        /// 64-bit signed integer.
        pub const INT64: nrt_dtype_t = 0xC;
        /// FP8 E3.
        pub const FP8_E3: nrt_dtype_t = 0xD;
        /// FP8 E4.
        pub const FP8_E4: nrt_dtype_t = 0xE;
        /// FP8 E5.
        pub const FP8_E5: nrt_dtype_t = 0xF;
    }

    /// Which of the two dtype tables a raw code belongs to.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum DtypeEncoding {
        /// [`sequential`]: runtime ≤ 2.29.x.
        Sequential,
        /// [`hw`]: runtime after 2.29.x.
        Hw,
    }

    impl DtypeEncoding {
        /// The encoding a runtime of version `major.minor` is expected to use (the rule
        /// derived from the public headers: sequential up to 2.29, hardware codes after).
        /// Not documented by AWS: cross-check with [`DtypeEncoding::element_size`].
        pub fn for_runtime(major: u64, minor: u64) -> Self {
            if (major, minor) <= (2, 29) {
                DtypeEncoding::Sequential
            } else {
                DtypeEncoding::Hw
            }
        }

        /// The type's name (`"FLOAT32"`), or `None` for a code outside the table.
        pub fn name(self, raw: u32) -> Option<&'static str> {
            Some(match self {
                DtypeEncoding::Sequential => match raw {
                    sequential::UNKNOWN => "UNKNOWN",
                    sequential::FLOAT32 => "FLOAT32",
                    sequential::FLOAT16 => "FLOAT16",
                    sequential::BFLOAT16 => "BFLOAT16",
                    sequential::INT8 => "INT8",
                    sequential::UINT8 => "UINT8",
                    sequential::INT16 => "INT16",
                    sequential::UINT16 => "UINT16",
                    sequential::INT32 => "INT32",
                    sequential::UINT32 => "UINT32",
                    sequential::INT64 => "INT64",
                    sequential::UINT64 => "UINT64",
                    _ => return None,
                },
                DtypeEncoding::Hw => match raw {
                    hw::UNKNOWN => "UNKNOWN",
                    hw::UINT64 => "UINT64",
                    hw::INT8 => "INT8",
                    hw::UINT8 => "UINT8",
                    hw::INT16 => "INT16",
                    hw::UINT16 => "UINT16",
                    hw::BFLOAT16 => "BFLOAT16",
                    hw::FLOAT16 => "FLOAT16",
                    hw::INT32 => "INT32",
                    hw::UINT32 => "UINT32",
                    hw::FLOAT32 => "FLOAT32",
                    hw::FP32R => "FP32R",
                    hw::INT64 => "INT64",
                    hw::FP8_E3 => "FP8_E3",
                    hw::FP8_E4 => "FP8_E4",
                    hw::FP8_E5 => "FP8_E5",
                    _ => return None,
                },
            })
        }

        /// Bytes per element of a raw code in this encoding, or `None` for UNKNOWN or a
        /// code outside the table.
        pub fn element_size(self, raw: u32) -> Option<usize> {
            let name = self.name(raw)?;
            Some(match name {
                "INT8" | "UINT8" | "FP8_E3" | "FP8_E4" | "FP8_E5" => 1,
                "INT16" | "UINT16" | "FLOAT16" | "BFLOAT16" => 2,
                "INT32" | "UINT32" | "FLOAT32" | "FP32R" => 4,
                "INT64" | "UINT64" => 8,
                _ => return None,
            })
        }
    }
}

// === Layout: the published LP64 numbers (nrt-api.md §5; S6's bindgen layout asserts) ===
#[cfg(target_pointer_width = "64")]
const _: () = {
    use std::mem::{align_of, offset_of, size_of};

    assert!(size_of::<NRT_STATUS>() == 4);
    assert!(size_of::<nrt_tensor_placement_t>() == 4);
    assert!(size_of::<nrt_framework_type_t>() == 4);
    assert!(size_of::<nrt_tensor_usage_t>() == 4);
    assert!(size_of::<nrt_dtype_t>() == 4);

    assert!(size_of::<nrt_tensor_info_t>() == 296);
    assert!(align_of::<nrt_tensor_info_t>() == 8);
    assert!(offset_of!(nrt_tensor_info_t, name) == 0);
    assert!(offset_of!(nrt_tensor_info_t, usage) == 256);
    assert!(offset_of!(nrt_tensor_info_t, size) == 264);
    assert!(offset_of!(nrt_tensor_info_t, dtype) == 272);
    assert!(offset_of!(nrt_tensor_info_t, shape) == 280);
    assert!(offset_of!(nrt_tensor_info_t, ndim) == 288);

    assert!(size_of::<nrt_tensor_info_array_t>() == 8);
    assert!(align_of::<nrt_tensor_info_array_t>() == 8);
    assert!(offset_of!(nrt_tensor_info_array_t, tensor_count) == 0);
    assert!(offset_of!(nrt_tensor_info_array_t, tensor_array) == 8);

    assert!(size_of::<nrt_version_t>() == 224);
    assert!(align_of::<nrt_version_t>() == 8);
    assert!(offset_of!(nrt_version_t, rt_major) == 0);
    assert!(offset_of!(nrt_version_t, rt_minor) == 8);
    assert!(offset_of!(nrt_version_t, rt_patch) == 16);
    assert!(offset_of!(nrt_version_t, rt_maintenance) == 24);
    assert!(offset_of!(nrt_version_t, rt_detail) == 32);
    assert!(offset_of!(nrt_version_t, git_hash) == 160);

    assert!(size_of::<nrt_vnc_memory_stats_t>() == 16);
    assert!(offset_of!(nrt_vnc_memory_stats_t, bytes_used) == 0);
    assert!(offset_of!(nrt_vnc_memory_stats_t, bytes_limit) == 8);
};
