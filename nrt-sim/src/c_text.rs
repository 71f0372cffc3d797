//! C strings in and out: reading the caller's optional `const char *`, and filling the
//! fixed `char[N]` fields of the runtime's structs.
//!
//! A leaf module: both the version struct (`runtime`) and the tensor-info array
//! (`model_io`) fill C char arrays, and neither should import the other for it.

use std::ffi::{c_char, CStr};

/// Reads an optional C string (lossily: names are for messages and map keys).
///
/// # Safety
///
/// `p` is null or points to a NUL-terminated string readable for the whole call.
pub(crate) unsafe fn opt_str(p: *const c_char) -> Option<String> {
    if p.is_null() {
        return None;
    }
    // SAFETY: non-null and NUL-terminated (the caller's contract).
    Some(unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
}

/// Copies `text` into a C char array, truncated to leave a terminating NUL.
pub(crate) fn copy_c_chars(dst: &mut [c_char], text: &str) {
    let room = dst.len().saturating_sub(1);
    for (d, b) in dst.iter_mut().zip(text.bytes().take(room)) {
        *d = b as c_char;
    }
}
