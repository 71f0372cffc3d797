//! The struct layouts libnrt publishes for LP64 Linux. `neuron_sys::sys` already asserts
//! these at compile time (the crate does not build otherwise); this restates them where a
//! reader looks for tests.

#![cfg(target_pointer_width = "64")]

use std::mem::{align_of, offset_of, size_of};

use neuron_sys::sys::{
    nrt_tensor_info_array_t, nrt_tensor_info_t, nrt_version_t, GIT_HASH_LEN, NRT_TENSOR_NAME_MAX,
    RT_VERSION_DETAIL_LEN,
};

#[test]
fn tensor_info_is_296_bytes() {
    assert_eq!(size_of::<nrt_tensor_info_t>(), 296);
    assert_eq!(align_of::<nrt_tensor_info_t>(), 8);
    assert_eq!(
        [
            offset_of!(nrt_tensor_info_t, name),
            offset_of!(nrt_tensor_info_t, usage),
            offset_of!(nrt_tensor_info_t, size),
            offset_of!(nrt_tensor_info_t, dtype),
            offset_of!(nrt_tensor_info_t, shape),
            offset_of!(nrt_tensor_info_t, ndim),
        ],
        [0, 256, 264, 272, 280, 288]
    );
    assert_eq!(NRT_TENSOR_NAME_MAX, 256);
}

#[test]
fn tensor_info_array_is_a_header_and_a_flexible_array() {
    assert_eq!(size_of::<nrt_tensor_info_array_t>(), 8);
    assert_eq!(offset_of!(nrt_tensor_info_array_t, tensor_count), 0);
    assert_eq!(offset_of!(nrt_tensor_info_array_t, tensor_array), 8);
}

#[test]
fn version_is_224_bytes() {
    assert_eq!(size_of::<nrt_version_t>(), 224);
    assert_eq!(align_of::<nrt_version_t>(), 8);
    assert_eq!(
        [
            offset_of!(nrt_version_t, rt_major),
            offset_of!(nrt_version_t, rt_minor),
            offset_of!(nrt_version_t, rt_patch),
            offset_of!(nrt_version_t, rt_maintenance),
            offset_of!(nrt_version_t, rt_detail),
            offset_of!(nrt_version_t, git_hash),
        ],
        [0, 8, 16, 24, 32, 160]
    );
    assert_eq!((RT_VERSION_DETAIL_LEN, GIT_HASH_LEN), (128, 64));
}
