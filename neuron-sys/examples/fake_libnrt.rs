//! A tiny stand-in for libnrt, for neuron-sys's own tests (`tests/safe_fake.rs`): it
//! exports the symbols `neuron_sys::Library` resolves and checks the lifetime rules libnrt
//! relies on (no call before `nrt_init` or after `nrt_close`, no tensor freed while a set
//! holds it, nothing live at `nrt_close`), recording every violation.
//!
//! It is not the simulator (`nrt-sim` runs real graphs); a "NEFF" here is one of:
//! - `b"copy"`: input `in` (16 bytes: 4 f32 `[4]`) is copied to output `out`;
//! - `b"bad-input"`: `nrt_execute` fails with `NRT_EXEC_BAD_INPUT`;
//! - `b"unload-fails"`: like `copy`, but `nrt_unload` fails with `NRT_FAILURE`.
//!
//! Built by `cargo test` as `target/<profile>/examples/libfake_libnrt.so`.

#![allow(clippy::missing_safety_doc)]

use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

const SUCCESS: u32 = 0;
const FAILURE: u32 = 1;
const INVALID: u32 = 2;
const UNINITIALIZED: u32 = 13;
const EXEC_BAD_INPUT: u32 = 1002;
const IO_BYTES: usize = 16;

struct FakeTensor {
    storage: Arc<Mutex<Vec<u8>>>,
    offset: usize,
    size: usize,
}

struct FakeModel {
    neff: Vec<u8>,
}

#[derive(Default)]
struct State {
    initialized: bool,
    tensors: HashMap<usize, ()>,
    sets: HashMap<usize, HashMap<String, usize>>,
    models: HashMap<usize, ()>,
    violations: Vec<String>,
}

static STATE: Mutex<Option<State>> = Mutex::new(None);

fn state() -> MutexGuard<'static, Option<State>> {
    let mut g = STATE.lock().unwrap_or_else(PoisonError::into_inner);
    g.get_or_insert_with(State::default);
    g
}

macro_rules! st {
    ($g:ident) => {
        $g.as_mut().expect("initialised by state()")
    };
}

fn require_init(s: &mut State, call: &str) -> bool {
    if !s.initialized {
        s.violations
            .push(format!("{call} outside nrt_init..nrt_close"));
    }
    s.initialized
}

#[no_mangle]
pub extern "C" fn nrt_init(framework: u32, _fw: *const c_char, _fal: *const c_char) -> u32 {
    let mut g = state();
    let s = st!(g);
    if s.initialized {
        s.violations.push("nrt_init twice".into());
        return INVALID;
    }
    if framework != 1 {
        s.violations
            .push(format!("nrt_init with framework {framework}, not NO_FW"));
    }
    s.initialized = true;
    SUCCESS
}

#[no_mangle]
pub extern "C" fn nrt_close() {
    let mut g = state();
    let s = st!(g);
    if !s.initialized {
        s.violations.push("nrt_close without nrt_init".into());
    }
    let live = (s.tensors.len(), s.sets.len(), s.models.len());
    if live != (0, 0, 0) {
        s.violations.push(format!(
            "nrt_close with (tensors, sets, models) = {live:?} live"
        ));
    }
    s.initialized = false;
}

#[no_mangle]
pub unsafe extern "C" fn nrt_load(
    neff: *const c_void,
    size: usize,
    _vnc: i32,
    _count: i32,
    model: *mut *mut c_void,
) -> u32 {
    let mut g = state();
    let s = st!(g);
    if !require_init(s, "nrt_load") {
        return UNINITIALIZED;
    }
    // SAFETY: the caller passes `size` readable bytes.
    let neff = unsafe { std::slice::from_raw_parts(neff.cast::<u8>(), size) }.to_vec();
    let ptr = Box::into_raw(Box::new(FakeModel { neff }));
    s.models.insert(ptr as usize, ());
    // SAFETY: valid out-pointer from the caller.
    unsafe { *model = ptr.cast() };
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn nrt_unload(model: *mut c_void) -> u32 {
    let mut g = state();
    let s = st!(g);
    require_init(s, "nrt_unload");
    if s.models.remove(&(model as usize)).is_none() {
        s.violations.push("nrt_unload of an unknown model".into());
        return INVALID;
    }
    // SAFETY: created by nrt_load with Box::into_raw, removed from the live set once.
    let m = unsafe { Box::from_raw(model.cast::<FakeModel>()) };
    if m.neff == b"unload-fails" {
        FAILURE
    } else {
        SUCCESS
    }
}

fn new_tensor(s: &mut State, t: FakeTensor, out: *mut *mut c_void) {
    let ptr = Box::into_raw(Box::new(t));
    s.tensors.insert(ptr as usize, ());
    // SAFETY: valid out-pointer from the caller.
    unsafe { *out = ptr.cast() };
}

#[no_mangle]
pub unsafe extern "C" fn nrt_tensor_allocate(
    _placement: u32,
    _vnc: c_int,
    size: usize,
    _name: *const c_char,
    tensor: *mut *mut c_void,
) -> u32 {
    let mut g = state();
    let s = st!(g);
    if !require_init(s, "nrt_tensor_allocate") {
        return UNINITIALIZED;
    }
    let storage = Arc::new(Mutex::new(vec![0u8; size]));
    new_tensor(
        s,
        FakeTensor {
            storage,
            offset: 0,
            size,
        },
        tensor,
    );
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn nrt_tensor_allocate_slice(
    src: *const c_void,
    offset: usize,
    size: usize,
    _name: *const c_char,
    slice: *mut *mut c_void,
) -> u32 {
    let mut g = state();
    let s = st!(g);
    require_init(s, "nrt_tensor_allocate_slice");
    if !s.tensors.contains_key(&(src as usize)) {
        s.violations.push("slice of a dead tensor".into());
        return INVALID;
    }
    // SAFETY: a live tensor of ours.
    let src = unsafe { &*src.cast::<FakeTensor>() };
    if offset + size > src.size {
        return INVALID;
    }
    let t = FakeTensor {
        storage: src.storage.clone(),
        offset: src.offset + offset,
        size,
    };
    new_tensor(s, t, slice);
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn nrt_tensor_free(tensor: *mut *mut c_void) {
    let mut g = state();
    let s = st!(g);
    require_init(s, "nrt_tensor_free");
    // SAFETY: valid in/out pointer from the caller.
    let t = unsafe { *tensor };
    if s.tensors.remove(&(t as usize)).is_none() {
        s.violations
            .push("nrt_tensor_free of an unknown tensor".into());
        return;
    }
    if s.sets
        .values()
        .any(|set| set.values().any(|&v| v == t as usize))
    {
        s.violations
            .push("tensor freed while a tensor set holds it".into());
    }
    // SAFETY: created with Box::into_raw, removed from the live set once.
    drop(unsafe { Box::from_raw(t.cast::<FakeTensor>()) });
    // SAFETY: as above.
    unsafe { *tensor = std::ptr::null_mut() };
}

fn with_tensor<R>(call: &str, t: *const c_void, f: impl FnOnce(&FakeTensor) -> R) -> Option<R> {
    let mut g = state();
    let s = st!(g);
    require_init(s, call);
    if !s.tensors.contains_key(&(t as usize)) {
        s.violations.push(format!("{call} on an unknown tensor"));
        return None;
    }
    // SAFETY: a live tensor of ours.
    Some(f(unsafe { &*t.cast::<FakeTensor>() }))
}

#[no_mangle]
pub unsafe extern "C" fn nrt_tensor_read(
    t: *const c_void,
    buf: *mut c_void,
    offset: usize,
    size: usize,
) -> u32 {
    with_tensor("nrt_tensor_read", t, |t| {
        if offset + size > t.size {
            return INVALID;
        }
        let data = t.storage.lock().unwrap_or_else(PoisonError::into_inner);
        // SAFETY: the caller passes `size` writable bytes; the range was checked.
        unsafe {
            std::ptr::copy_nonoverlapping(
                data.as_ptr().add(t.offset + offset),
                buf.cast::<u8>(),
                size,
            )
        };
        SUCCESS
    })
    .unwrap_or(INVALID)
}

#[no_mangle]
pub unsafe extern "C" fn nrt_tensor_write(
    t: *mut c_void,
    buf: *const c_void,
    offset: usize,
    size: usize,
) -> u32 {
    with_tensor("nrt_tensor_write", t, |t| {
        if offset + size > t.size {
            return INVALID;
        }
        let mut data = t.storage.lock().unwrap_or_else(PoisonError::into_inner);
        // SAFETY: the caller passes `size` readable bytes; the range was checked.
        unsafe {
            std::ptr::copy_nonoverlapping(
                buf.cast::<u8>(),
                data.as_mut_ptr().add(t.offset + offset),
                size,
            )
        };
        SUCCESS
    })
    .unwrap_or(INVALID)
}

#[no_mangle]
pub unsafe extern "C" fn nrt_tensor_get_size(t: *const c_void) -> usize {
    with_tensor("nrt_tensor_get_size", t, |t| t.size).unwrap_or(0)
}

#[no_mangle]
pub unsafe extern "C" fn nrt_allocate_tensor_set(result: *mut *mut c_void) -> u32 {
    let mut g = state();
    let s = st!(g);
    if !require_init(s, "nrt_allocate_tensor_set") {
        return UNINITIALIZED;
    }
    let ptr = Box::into_raw(Box::new(0u8));
    s.sets.insert(ptr as usize, HashMap::new());
    // SAFETY: valid out-pointer.
    unsafe { *result = ptr.cast() };
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn nrt_destroy_tensor_set(set: *mut *mut c_void) {
    let mut g = state();
    let s = st!(g);
    require_init(s, "nrt_destroy_tensor_set");
    // SAFETY: valid in/out pointer.
    let p = unsafe { *set };
    if s.sets.remove(&(p as usize)).is_none() {
        s.violations
            .push("nrt_destroy_tensor_set of an unknown set".into());
        return;
    }
    // SAFETY: created with Box::into_raw, removed once.
    drop(unsafe { Box::from_raw(p.cast::<u8>()) });
    // SAFETY: as above.
    unsafe { *set = std::ptr::null_mut() };
}

#[no_mangle]
pub unsafe extern "C" fn nrt_add_tensor_to_tensor_set(
    set: *mut c_void,
    name: *const c_char,
    t: *mut c_void,
) -> u32 {
    let mut g = state();
    let s = st!(g);
    require_init(s, "nrt_add_tensor_to_tensor_set");
    if !s.tensors.contains_key(&(t as usize)) {
        s.violations
            .push("adding an unknown tensor to a set".into());
        return INVALID;
    }
    // SAFETY: NUL-terminated name from the caller.
    let name = unsafe { CStr::from_ptr(name) }
        .to_string_lossy()
        .into_owned();
    match s.sets.get_mut(&(set as usize)) {
        Some(map) => {
            map.insert(name, t as usize);
            SUCCESS
        }
        None => INVALID,
    }
}

#[no_mangle]
pub unsafe extern "C" fn nrt_get_tensor_from_tensor_set(
    set: *mut c_void,
    name: *const c_char,
    t: *mut *mut c_void,
) -> u32 {
    let mut g = state();
    let s = st!(g);
    require_init(s, "nrt_get_tensor_from_tensor_set");
    // SAFETY: NUL-terminated name from the caller.
    let name = unsafe { CStr::from_ptr(name) }
        .to_string_lossy()
        .into_owned();
    match s.sets.get(&(set as usize)).and_then(|m| m.get(&name)) {
        Some(&p) => {
            // SAFETY: valid out-pointer.
            unsafe { *t = p as *mut c_void };
            SUCCESS
        }
        None => FAILURE,
    }
}

#[no_mangle]
pub unsafe extern "C" fn nrt_execute(
    model: *mut c_void,
    inputs: *const c_void,
    outputs: *mut c_void,
) -> u32 {
    let (src, dst) = {
        let mut g = state();
        let s = st!(g);
        if !require_init(s, "nrt_execute") || !s.models.contains_key(&(model as usize)) {
            return INVALID;
        }
        // SAFETY: a live model of ours.
        if unsafe { &*model.cast::<FakeModel>() }.neff == b"bad-input" {
            return EXEC_BAD_INPUT;
        }
        let src = s
            .sets
            .get(&(inputs as usize))
            .and_then(|m| m.get("in"))
            .copied();
        let dst = s
            .sets
            .get(&(outputs as usize))
            .and_then(|m| m.get("out"))
            .copied();
        match (src, dst) {
            (Some(a), Some(b)) => (a, b),
            _ => return INVALID,
        }
    };
    let mut buf = [0u8; IO_BYTES];
    // SAFETY: both are live tensors found in the sets.
    let status =
        unsafe { nrt_tensor_read(src as *const c_void, buf.as_mut_ptr().cast(), 0, IO_BYTES) };
    if status != SUCCESS {
        return status;
    }
    // SAFETY: as above.
    unsafe { nrt_tensor_write(dst as *mut c_void, buf.as_ptr().cast(), 0, IO_BYTES) }
}

#[repr(C)]
struct InfoEntry {
    name: [c_char; 256],
    usage: u32,
    size: usize,
    dtype: u32,
    shape: *mut u32,
    ndim: u32,
}

#[repr(C)]
struct InfoArray {
    count: u64,
    entries: [InfoEntry; 2],
}

fn entry(name: &str, usage: u32, shape: *mut u32) -> InfoEntry {
    let mut n = [0 as c_char; 256];
    for (d, b) in n.iter_mut().zip(name.bytes()) {
        *d = b as c_char;
    }
    InfoEntry {
        name: n,
        usage,
        size: IO_BYTES,
        dtype: 0xA,
        shape,
        ndim: 1,
    }
}

#[no_mangle]
pub unsafe extern "C" fn nrt_get_model_tensor_info(
    _model: *mut c_void,
    info: *mut *mut c_void,
) -> u32 {
    let shapes = Box::into_raw(Box::new([4u32, 4u32]));
    // SAFETY: `shapes` is a fresh allocation of two u32.
    let (a, b) = unsafe { ((*shapes).as_mut_ptr(), (*shapes).as_mut_ptr().add(1)) };
    // Reversed order on purpose: callers must look entries up by name.
    let arr = InfoArray {
        count: 2,
        entries: [entry("out", 1, b), entry("in", 0, a)],
    };
    // SAFETY: valid out-pointer.
    unsafe { *info = Box::into_raw(Box::new(arr)).cast() };
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn nrt_free_model_tensor_info(info: *mut c_void) -> u32 {
    // SAFETY: created by nrt_get_model_tensor_info.
    let arr = unsafe { Box::from_raw(info.cast::<InfoArray>()) };
    // SAFETY: entries[1] ("in") points at the first of the two shape values.
    drop(unsafe { Box::from_raw(arr.entries[1].shape.cast::<[u32; 2]>()) });
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn nrt_get_visible_nc_count(n: *mut u32) -> u32 {
    // SAFETY: valid out-pointer.
    unsafe { *n = 2 };
    SUCCESS
}

#[repr(C)]
struct FakeVersion {
    nums: [u64; 4],
    detail: [c_char; 128],
    git: [c_char; 64],
}

#[no_mangle]
pub unsafe extern "C" fn nrt_get_version(v: *mut c_void, size: usize) -> u32 {
    if size != std::mem::size_of::<FakeVersion>() {
        return INVALID;
    }
    let mut git = [0 as c_char; 64];
    for (d, b) in git.iter_mut().zip(b"fake".iter()) {
        *d = *b as c_char;
    }
    // SAFETY: the caller passes a buffer of `size` bytes, checked above.
    unsafe {
        v.cast::<FakeVersion>().write(FakeVersion {
            nums: [2, 99, 1, 0],
            detail: [0; 128],
            git,
        })
    };
    SUCCESS
}

/// Test hook: the violations recorded so far, newline-separated, copied into `buf`
/// (truncated to `len`); returns how many there are.
#[no_mangle]
pub unsafe extern "C" fn fake_nrt_violations(buf: *mut c_char, len: usize) -> usize {
    let mut g = state();
    let s = st!(g);
    let text = s.violations.join("\n");
    let n = text.len().min(len.saturating_sub(1));
    // SAFETY: the caller passes `len` writable bytes.
    unsafe {
        std::ptr::copy_nonoverlapping(text.as_ptr().cast::<c_char>(), buf, n);
        *buf.add(n) = 0;
    }
    s.violations.len()
}

/// Test hook: live (tensors, sets, models).
#[no_mangle]
pub unsafe extern "C" fn fake_nrt_live(out: *mut usize) {
    let mut g = state();
    let s = st!(g);
    // SAFETY: the caller passes three writable usize.
    unsafe {
        *out = s.tensors.len();
        *out.add(1) = s.sets.len();
        *out.add(2) = s.models.len();
    }
}
