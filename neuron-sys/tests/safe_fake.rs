//! The safe level end to end against `examples/fake_libnrt.rs`, a stand-in libnrt that
//! records every lifetime violation (a call outside `nrt_init`..`nrt_close`, a tensor freed
//! while a set holds it, anything live at `nrt_close`). Real graphs run in nrt-sim's tests.
//!
//! One test function: libnrt is process-global (one `nrt_init` at a time).

use std::ffi::{c_char, CStr};
use std::path::PathBuf;
use std::sync::Arc;

use neuron_sys::{execute, Error, Library, Model, Runtime, Tensor, TensorSet, TensorUsage};

/// `target/<profile>/examples/libfake_libnrt.so`, next to this test's `deps/` directory.
fn fake_path() -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    let profile_dir = exe
        .parent()
        .and_then(|d| d.parent())
        .expect("target/<profile>");
    let file = format!(
        "{}fake_libnrt{}",
        std::env::consts::DLL_PREFIX,
        std::env::consts::DLL_SUFFIX
    );
    let path = profile_dir.join("examples").join(file);
    assert!(
        path.exists(),
        "{} is missing: run `cargo test -p neuron-sys` (which builds the examples), \
         or `cargo build -p neuron-sys --example fake_libnrt` first",
        path.display()
    );
    path
}

struct Hooks {
    lib: libloading::Library,
}

impl Hooks {
    fn open(path: &PathBuf) -> Hooks {
        // SAFETY: the fake library has no initialisers beyond Rust statics.
        let lib = unsafe { libloading::Library::new(path) }.expect("open fake libnrt");
        Hooks { lib }
    }

    fn violations(&self) -> String {
        let mut buf = vec![0 as c_char; 8192];
        // SAFETY: the hook's signature in examples/fake_libnrt.rs; `buf` has `len` bytes.
        unsafe {
            let f = self
                .lib
                .get::<unsafe extern "C" fn(*mut c_char, usize) -> usize>(b"fake_nrt_violations\0")
                .expect("hook");
            f(buf.as_mut_ptr(), buf.len());
            CStr::from_ptr(buf.as_ptr()).to_string_lossy().into_owned()
        }
    }

    fn live(&self) -> [usize; 3] {
        let mut out = [0usize; 3];
        // SAFETY: the hook's signature; `out` has three usize.
        unsafe {
            let f = self
                .lib
                .get::<unsafe extern "C" fn(*mut usize)>(b"fake_nrt_live\0")
                .expect("hook");
            f(out.as_mut_ptr());
        }
        out
    }
}

#[test]
fn runtime_models_tensors_and_sets_follow_libnrt_lifetimes() {
    let path = fake_path();
    let hooks = Hooks::open(&path);
    let lib = Library::open(&path).expect("fake libnrt loads");

    // === The library level ===
    let version = lib.version().expect("nrt_get_version").expect("present");
    assert_eq!((version.major, version.minor, version.patch), (2, 99, 1));
    assert_eq!(version.to_string(), "2.99.1.0 (fake)");
    assert_eq!(lib.visible_nc_count().unwrap(), Some(2));
    assert_eq!(
        lib.total_nc_count().unwrap(),
        None,
        "the fake has no total count"
    );
    assert!(!lib.has_symbol("nrt_get_status_as_str"));
    assert!(lib.has_symbol("nrt_tensor_allocate_slice"));
    assert!(lib.has_symbol("nrt_execute"));
    assert_eq!(lib.status_str(1002), None);

    // === Runtime: core range checked after nrt_init, which is then closed again ===
    let err = Runtime::new(lib.clone(), 1, 2).unwrap_err();
    assert!(matches!(err, Error::InvalidArgument { .. }), "{err}");
    assert!(err.to_string().contains("only 2 are visible"), "{err}");
    let rt = Runtime::new(lib.clone(), 0, 2).expect("nrt_init");
    assert!(matches!(
        Runtime::new(lib.clone(), 0, 2),
        Err(Error::AlreadyInitialized)
    ));
    let shared = Runtime::shared(lib.clone(), 0, 2).expect("shared");
    assert!(shared.same_as(&rt));
    assert!(matches!(
        Runtime::shared(lib.clone(), 0, 1),
        Err(Error::AlreadyInitialized)
    ));
    drop(shared);

    // === Tensors and slices ===
    let err = Tensor::device(&rt, 2, 16, "x").unwrap_err();
    assert!(
        err.to_string().contains("outside this runtime's cores"),
        "{err}"
    );
    let root = Tensor::device(&rt, 0, 64, "root").unwrap();
    assert_eq!(root.size(), 64);
    let bytes: Vec<u8> = (0..64).collect();
    root.write(0, &bytes).unwrap();
    let slice = root.slice(16, 16).unwrap();
    assert_eq!(slice.name(), "root[16..32]");
    assert_eq!(slice.offset_in_parent(), Some(16));
    assert_eq!(
        slice.read_vec(0, 16).unwrap(),
        (16..32).collect::<Vec<u8>>()
    );
    slice.write(4, &[200; 4]).unwrap();
    assert_eq!(root.read_vec(20, 4).unwrap(), vec![200; 4]);
    let err = slice.write(8, &[0; 16]).unwrap_err();
    assert_eq!(
        err.to_string(),
        "nrt_tensor_write: bytes 8..24 are outside the tensor's 16 bytes"
    );
    assert!(root.slice(60, 8).is_err());
    assert!(root.read(usize::MAX, &mut [0; 2]).is_err());
    drop(root);
    // The slice keeps its parent (and so the storage) alive.
    assert_eq!(slice.read_vec(4, 4).unwrap(), vec![200; 4]);
    assert_eq!(slice.parent().map(Tensor::size), Some(64));
    drop(slice);
    assert_eq!(hooks.live(), [0, 0, 0]);

    // === A model, its I/O, tensor sets, execute ===
    let model = Model::load(&rt, b"copy", Some(0), None).unwrap();
    let io = model.io().unwrap();
    let input = io.input("in").expect("input `in`");
    assert_eq!(
        (input.usage, input.size, input.dtype, input.shape.as_slice()),
        (TensorUsage::Input, 16, 0xA, &[4u32][..])
    );
    assert!(io.output("out").is_some());
    assert!(io.input("out").is_none());
    assert_eq!(io.inputs().count(), 1);

    let x = Tensor::device(&rt, 0, 16, "x").unwrap();
    let y = Tensor::device(&rt, 1, 16, "y").unwrap();
    let mut inputs = TensorSet::new(&rt).unwrap();
    let mut outputs = TensorSet::new(&rt).unwrap();
    inputs.add("in", &x).unwrap();
    outputs.add("out", &y).unwrap();
    x.write(0, &[7; 16]).unwrap();
    drop(x); // the set keeps it alive
    model.execute(&inputs, &outputs).unwrap();
    assert_eq!(y.read_vec(0, 16).unwrap(), vec![7; 16]);
    let got = outputs.get("out").unwrap().expect("bound");
    assert!(got.same_as(&y));
    assert!(outputs.get("nope").unwrap().is_none());
    assert!(inputs.contains("in") && inputs.len() == 1);

    // Replacing a binding releases the old tensor only after libnrt no longer holds it.
    let x2 = Tensor::device(&rt, 0, 16, "x2").unwrap();
    x2.write(0, &[9; 16]).unwrap();
    inputs.add("in", &x2).unwrap();
    execute(&model, &inputs, &outputs).unwrap();
    assert_eq!(y.read_vec(0, 16).unwrap(), vec![9; 16]);

    // === Errors from libnrt name the call and the status ===
    let bad = Model::load(&rt, b"bad-input", None, None).unwrap();
    let err = bad.execute(&inputs, &outputs).unwrap_err();
    assert_eq!(
        err.to_string(),
        "nrt_execute failed: NRT_EXEC_BAD_INPUT (status 1002)"
    );
    assert_eq!(err.status_code(), Some(1002));
    assert!(Model::load(&rt, b"", None, None).is_err());

    // === A failing release is recorded, not panicked on ===
    let failing = Model::load(&rt, b"unload-fails", None, None).unwrap();
    drop(failing);
    let deferred = rt.take_deferred_errors();
    assert_eq!(deferred.len(), 1, "{deferred:?}");
    assert_eq!(
        deferred[0].to_string(),
        "nrt_unload failed: NRT_FAILURE (status 1)"
    );
    assert!(rt.take_deferred_errors().is_empty());

    // === Teardown in an awkward order: the runtime handle goes first ===
    drop(rt);
    assert_ne!(
        hooks.live(),
        [0, 0, 0],
        "handles still alive keep the runtime open"
    );
    drop(bad);
    drop(model);
    drop(inputs); // x, x2 released here, after the set is destroyed
    drop(outputs);
    drop(got);
    drop(y);
    drop(x2);
    assert_eq!(hooks.live(), [0, 0, 0]);
    assert_eq!(hooks.violations(), "", "lifetime violations");

    // nrt_close ran (no Runtime is live), so a new one can initialise again.
    let rt = Runtime::new(Arc::clone(&lib), 0, 1).expect("re-init after close");
    drop(rt);
    assert_eq!(hooks.violations(), "", "lifetime violations");
}
