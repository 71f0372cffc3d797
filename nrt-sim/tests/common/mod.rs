//! Shared helpers: load `libnrt_sim.so` the way libnrt is loaded, serialise the tests of one
//! binary (the simulated runtime is process-global), build NEFFs, call the raw C API, and
//! run a test in a child process with fault variables set.
#![allow(dead_code)]

use std::ffi::{c_void, CString};
use std::path::{Path, PathBuf};
use std::ptr;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError};

use deepinfer::backend::hlo;
use deepinfer::backend::neuron::sim_neff::{NeffNames, SimNeff};
use deepinfer::export::{lower, LowerOptions, Manifest};
use deepinfer::graph::{DType, GraphBuilder, InputRole};
use neuron_sys::sys::{self, nrt_model_t, nrt_tensor_set_t, nrt_tensor_t, NRT_STATUS};
use neuron_sys::{Api, Library, Runtime};
use nrt_sim::{Counters, SimLibrary};

/// `target/<profile>/libnrt_sim.so`, which cargo builds before this package's integration
/// tests (it is the package's cdylib).
pub fn sim_path() -> PathBuf {
    nrt_sim::library_next_to_current_exe().unwrap_or_else(|| {
        panic!(
            "libnrt_sim.so not found next to {:?}: run the tests with `cargo test -p nrt-sim` \
             (or `cargo build -p nrt-sim` first)",
            std::env::current_exe()
        )
    })
}

/// The library loaded through neuron-sys (as libnrt would be) and its test hooks.
pub struct Sim {
    pub lib: Arc<Library>,
    pub hooks: SimLibrary,
}

impl Sim {
    pub fn open() -> Sim {
        let path = sim_path();
        Sim {
            lib: Library::open(&path).expect("neuron-sys loads libnrt_sim.so"),
            hooks: SimLibrary::open(&path).expect("nrt-sim hooks"),
        }
    }

    pub fn api(&self) -> &Api {
        self.lib.api()
    }

    pub fn counters(&self) -> Counters {
        self.hooks.counters().expect("counters")
    }

    /// The runtime, initialised over both simulated cores.
    pub fn runtime(&self) -> Runtime {
        Runtime::shared(self.lib.clone(), 0, 2).expect("nrt_init")
    }

    pub fn raw(&self) -> Raw<'_> {
        Raw { api: self.api() }
    }
}

/// One test at a time per process: the simulated runtime and its counters are global.
pub fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Thin wrappers over the raw C entry points, returning the status (and out-values).
pub struct Raw<'a> {
    pub api: &'a Api,
}

pub type TensorPtr = *mut nrt_tensor_t;
pub type SetPtr = *mut nrt_tensor_set_t;
pub type ModelPtr = *mut nrt_model_t;

impl Raw<'_> {
    pub fn allocate(&self, size: usize, name: &str) -> (NRT_STATUS, TensorPtr) {
        self.allocate_on(sys::NRT_TENSOR_PLACEMENT_DEVICE, 0, size, name)
    }

    pub fn allocate_on(
        &self,
        placement: u32,
        vnc: i32,
        size: usize,
        name: &str,
    ) -> (NRT_STATUS, TensorPtr) {
        let name = CString::new(name).unwrap();
        let mut t = ptr::null_mut();
        // SAFETY: valid name and out-pointer.
        let s =
            unsafe { (self.api.nrt_tensor_allocate)(placement, vnc, size, name.as_ptr(), &mut t) };
        (s, t)
    }

    pub fn slice(&self, src: TensorPtr, offset: usize, size: usize) -> (NRT_STATUS, TensorPtr) {
        let f = self.api.nrt_tensor_allocate_slice.expect("slice exported");
        let mut t = ptr::null_mut();
        // SAFETY: null name is allowed; valid out-pointer.
        let s = unsafe { f(src, offset, size, ptr::null(), &mut t) };
        (s, t)
    }

    pub fn write(&self, t: TensorPtr, offset: usize, data: &[u8]) -> NRT_STATUS {
        // SAFETY: `data` is readable for its length.
        unsafe {
            (self.api.nrt_tensor_write)(t, data.as_ptr().cast::<c_void>(), offset, data.len())
        }
    }

    pub fn read(&self, t: TensorPtr, offset: usize, buf: &mut [u8]) -> NRT_STATUS {
        // SAFETY: `buf` is writable for its length.
        unsafe {
            (self.api.nrt_tensor_read)(t, buf.as_mut_ptr().cast::<c_void>(), offset, buf.len())
        }
    }

    pub fn size(&self, t: TensorPtr) -> usize {
        // SAFETY: the handle is never dereferenced by nrt-sim.
        unsafe { (self.api.nrt_tensor_get_size)(t) }
    }

    /// Frees through a copy of the handle, so the caller's copy stays (stale) for misuse
    /// tests.
    pub fn free(&self, t: TensorPtr) {
        let mut p = t;
        // SAFETY: valid in/out pointer.
        unsafe { (self.api.nrt_tensor_free)(&mut p) };
    }

    pub fn new_set(&self) -> (NRT_STATUS, SetPtr) {
        let mut s = ptr::null_mut();
        // SAFETY: valid out-pointer.
        let st = unsafe { (self.api.nrt_allocate_tensor_set)(&mut s) };
        (st, s)
    }

    pub fn destroy_set(&self, s: SetPtr) {
        let mut p = s;
        // SAFETY: valid in/out pointer.
        unsafe { (self.api.nrt_destroy_tensor_set)(&mut p) };
    }

    pub fn add(&self, set: SetPtr, name: &str, t: TensorPtr) -> NRT_STATUS {
        let name = CString::new(name).unwrap();
        // SAFETY: valid name.
        unsafe { (self.api.nrt_add_tensor_to_tensor_set)(set, name.as_ptr(), t) }
    }

    pub fn get(&self, set: SetPtr, name: &str) -> (NRT_STATUS, TensorPtr) {
        let name = CString::new(name).unwrap();
        let mut t = ptr::null_mut();
        // SAFETY: valid name and out-pointer.
        let s = unsafe { (self.api.nrt_get_tensor_from_tensor_set)(set, name.as_ptr(), &mut t) };
        (s, t)
    }

    pub fn load(&self, neff: &[u8]) -> (NRT_STATUS, ModelPtr) {
        let mut m = ptr::null_mut();
        // SAFETY: `neff` is readable for its length; valid out-pointer.
        let s = unsafe {
            (self.api.nrt_load)(neff.as_ptr().cast::<c_void>(), neff.len(), 0, -1, &mut m)
        };
        (s, m)
    }

    pub fn unload(&self, m: ModelPtr) -> NRT_STATUS {
        // SAFETY: the handle is never dereferenced by nrt-sim.
        unsafe { (self.api.nrt_unload)(m) }
    }

    pub fn execute(&self, m: ModelPtr, inputs: SetPtr, outputs: SetPtr) -> NRT_STATUS {
        // SAFETY: the handles are never dereferenced by nrt-sim.
        unsafe { (self.api.nrt_execute)(m, inputs, outputs) }
    }

    pub fn init(&self) -> NRT_STATUS {
        // SAFETY: NUL-terminated strings.
        unsafe { (self.api.nrt_init)(sys::NRT_FRAMEWORK_TYPE_NO_FW, c"".as_ptr(), c"".as_ptr()) }
    }

    pub fn close(&self) {
        // SAFETY: no arguments.
        unsafe { (self.api.nrt_close)() }
    }
}

// === NEFFs ===

/// A small graph exercising three dtypes and an in-place root:
/// `y = 2x + f32(h)` and `c <- c + x` (broadcast over c's two rows; aliased, must-alias).
///
/// | name | usage | dtype | shape |
/// |---|---|---|---|
/// | `x` | input | f32 | [4] |
/// | `h` | input | bf16 | [4] |
/// | `c` | input (cache root) | f32 | [2, 4] |
/// | `y` | output | f32 | [4] |
/// | `c` | output (aliases input `c`) | f32 | [2, 4] |
///
/// As a NEFF (see [`neff_of`]) the input `c` is named [`C_IN`].
pub fn tiny_neff() -> Vec<u8> {
    neff_of(&tiny_hlo())
}

/// The NEFF name of the tiny graph's aliased input `c` (the emitter's `.must_alias_input`).
pub const C_IN: &str = "c.must_alias_input";

/// Serialized HLO wrapped in nrt-sim's NEFF container, named as the HLO names its I/O (what the
/// stand-in compiler writes under `NRT_SIM_NEFF_NAMES=ours`).
pub fn neff_of(hlo: &[u8]) -> Vec<u8> {
    SimNeff::compile(hlo, NeffNames::Ours)
        .expect("the stand-in compiler accepts the module")
        .encode()
}

/// The NEFF of a lowered graph's `.hlo.pb` file.
pub fn neff_file(path: &Path) -> Vec<u8> {
    neff_of(&std::fs::read(path).expect("lowered HLO"))
}

/// The tiny graph's HLO (see [`tiny_neff`]).
pub fn tiny_hlo() -> Vec<u8> {
    let b = GraphBuilder::new("tiny");
    let x = b
        .input("x", InputRole::Metadata, vec![4], DType::F32)
        .unwrap();
    let h = b
        .input("h", InputRole::Metadata, vec![4], DType::BF16)
        .unwrap();
    let c = b
        .input("c", InputRole::CacheRoot, vec![2, 4], DType::F32)
        .unwrap();
    let y = x
        .affine(2.0, 0.0)
        .unwrap()
        .add(&h.to_dtype(DType::F32).unwrap())
        .unwrap();
    let c2 = c.broadcast_add(&x).unwrap();
    b.output("y", &y).unwrap();
    b.output_aliased("c", &c2, &c).unwrap();
    let g = b.finish().unwrap();
    hlo::emit::to_bytes(&hlo::emit::emit(&g).unwrap())
}

pub fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

pub fn f32s(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

/// The largest `|a[i] - b[i]|`, or an error naming the first index where either side is NaN
/// or infinite, or the lengths when they differ.
///
/// Non-finite values are refused rather than compared: folding `|a - b|` with `f32::max`
/// skips a NaN (`max(x, NaN)` is `x`), so all-NaN outputs would "match" anything, and
/// `inf - inf` is NaN again. A test that expects a non-finite value states it exactly.
pub fn max_abs_diff(a: &[f32], b: &[f32]) -> Result<f32, String> {
    if a.len() != b.len() {
        return Err(format!("lengths differ: {} vs {}", a.len(), b.len()));
    }
    let mut max = 0.0f32;
    for (i, (&x, &y)) in a.iter().zip(b).enumerate() {
        if !x.is_finite() || !y.is_finite() {
            return Err(format!("element {i} is not finite: {x} vs {y}"));
        }
        max = max.max((x - y).abs());
    }
    Ok(max)
}

pub fn bf16_bytes(v: &[f32]) -> Vec<u8> {
    v.iter()
        .flat_map(|&x| half::bf16::from_f32(x).to_le_bytes())
        .collect()
}

/// The tiny model's three input tensors and the output `y`, bound in two raw sets, with
/// `c` bound in both (the in-place root).
pub struct TinyBindings {
    pub x: TensorPtr,
    pub h: TensorPtr,
    pub c: TensorPtr,
    pub y: TensorPtr,
    pub inputs: SetPtr,
    pub outputs: SetPtr,
}

impl TinyBindings {
    /// x = [1, 2, 3, 4], h = [0.5; 4], c = 0, y = 0 (written: fresh device memory is not
    /// zeroed).
    pub fn new(raw: &Raw<'_>) -> TinyBindings {
        let t = |size, name| {
            let (s, t) = raw.allocate(size, name);
            assert_eq!(s, sys::NRT_SUCCESS);
            t
        };
        let (x, h, c, y) = (t(16, "x"), t(8, "h"), t(32, "c"), t(16, "y"));
        assert_eq!(raw.write(x, 0, &f32_bytes(&[1.0, 2.0, 3.0, 4.0])), 0);
        assert_eq!(raw.write(h, 0, &bf16_bytes(&[0.5; 4])), 0);
        assert_eq!(raw.write(c, 0, &[0u8; 32]), 0);
        assert_eq!(raw.write(y, 0, &[0u8; 16]), 0);
        let (s1, inputs) = raw.new_set();
        let (s2, outputs) = raw.new_set();
        assert_eq!((s1, s2), (0, 0));
        for (name, t) in [("x", x), ("h", h), (C_IN, c)] {
            assert_eq!(raw.add(inputs, name, t), 0);
        }
        assert_eq!(raw.add(outputs, "y", y), 0);
        assert_eq!(raw.add(outputs, "c", c), 0);
        TinyBindings {
            x,
            h,
            c,
            y,
            inputs,
            outputs,
        }
    }

    pub fn read_f32(&self, raw: &Raw<'_>, t: TensorPtr, len: usize) -> Vec<f32> {
        let mut buf = vec![0u8; len * 4];
        assert_eq!(raw.read(t, 0, &mut buf), 0);
        f32s(&buf)
    }

    pub fn free(self, raw: &Raw<'_>) {
        raw.destroy_set(self.inputs);
        raw.destroy_set(self.outputs);
        for t in [self.x, self.h, self.c, self.y] {
            raw.free(t);
        }
    }
}

/// `fixtures/tiny-v3` lowered once per test process: ctx 64, decode batches 1 and 4, with
/// the inputs and CPU outputs of the step after `reference.json`'s token ids.
///
/// Written under cargo's `CARGO_TARGET_TMPDIR` (`target/tmp/`) and overwritten by each
/// run, not deleted: several tests of the process read it, in no fixed order.
pub fn lowered_tiny_v3() -> &'static (PathBuf, Manifest) {
    static LOWERED: OnceLock<(PathBuf, Manifest)> = OnceLock::new();
    LOWERED.get_or_init(|| {
        let fixture = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("..")
            .join("fixtures")
            .join("tiny-v3");
        let reference: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(fixture.join("reference.json")).unwrap())
                .unwrap();
        let tokens: Vec<u32> = reference["token_ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
        let out = Path::new(env!("CARGO_TARGET_TMPDIR")).join("nrt-sim-tiny-v3");
        let manifest = lower(
            &fixture,
            &out,
            &LowerOptions {
                batch_sizes: vec![1, 4],
                ctx: 64,
                inputs_from_token_ids: Some(tokens),
                precision: Default::default(),
                dots: deepinfer::model::Dots::DEVICE,
                split_sampler: false,
                speculative: false,
            },
        )
        .expect("lower tiny-v3");
        (out, manifest)
    })
}
