//! Loading, tensors, slices, tensor sets and their misuse, through the C ABI of
//! `libnrt_sim.so` loaded by `neuron_sys::Library::open` (the path libnrt takes).

mod common;

use common::{serial, Sim};
use neuron_sys::sys::dtype::DtypeEncoding;
use neuron_sys::sys::{self, NRT_STATUS};
use neuron_sys::{Tensor, TensorSet, OPTIONAL_SYMBOLS, REQUIRED_SYMBOLS};

const OK: NRT_STATUS = sys::NRT_SUCCESS;

#[test]
fn exports_every_symbol_neuron_sys_resolves() {
    let _g = serial();
    let sim = Sim::open();
    for name in REQUIRED_SYMBOLS.iter().chain(OPTIONAL_SYMBOLS) {
        assert!(sim.lib.has_symbol(name), "{name} is not exported");
    }
    let v = sim.lib.version().unwrap().expect("nrt_get_version");
    assert_eq!(
        [v.major, v.minor, v.patch, v.maintenance],
        nrt_sim::VERSION,
        "{v}"
    );
    assert_eq!(v.git_hash, "nrt-sim");
    assert!(v.detail.starts_with("nrt-sim "), "{}", v.detail);
    // The version selects the hardware-code dtype table, which is what nrt-sim reports.
    assert_eq!(
        DtypeEncoding::for_runtime(v.major, v.minor),
        DtypeEncoding::Hw
    );
    assert_eq!(sim.lib.visible_nc_count().unwrap(), Some(2));
    assert_eq!(sim.lib.total_nc_count().unwrap(), Some(2));
    assert_eq!(
        sim.lib.status_str(1002).as_deref(),
        Some("NRT_EXEC_BAD_INPUT")
    );
    assert_eq!(
        sim.lib.status_str(4242).as_deref(),
        Some("NRT_STATUS_UNKNOWN")
    );
}

#[test]
fn allocate_write_read_slice_and_bind() {
    let _g = serial();
    let sim = Sim::open();
    sim.hooks.reset();
    let rt = sim.runtime();
    let before = sim.counters();
    assert!(before.initialized);

    let root = Tensor::device(&rt, 1, 64, "root").unwrap();
    assert_eq!(root.size(), 64);
    let bytes: Vec<u8> = (0..64).collect();
    root.write(0, &bytes).unwrap();
    assert_eq!(root.read_vec(0, 64).unwrap(), bytes);
    assert_eq!(root.read_vec(60, 4).unwrap(), vec![60, 61, 62, 63]);

    // A slice shares the parent's storage, both ways.
    let slice = root.slice(16, 16).unwrap();
    assert_eq!(slice.size(), 16);
    assert_eq!(slice.read_vec(0, 4).unwrap(), vec![16, 17, 18, 19]);
    slice.write(4, &[200; 4]).unwrap();
    assert_eq!(root.read_vec(20, 4).unwrap(), vec![200; 4]);
    root.write(16, &[7]).unwrap();
    assert_eq!(slice.read_vec(0, 1).unwrap(), vec![7]);
    let nested = slice.slice(8, 8).unwrap();
    nested.write(0, &[9; 8]).unwrap();
    assert_eq!(root.read_vec(24, 8).unwrap(), vec![9; 8]);

    let host = Tensor::host(&rt, 8, "host").unwrap();
    host.write(0, &[1; 8]).unwrap();

    // Counters: bytes by tensor name (slices under their own names), live objects.
    let c = sim.counters();
    assert_eq!(c.bytes_written("root"), 64 + 1);
    assert_eq!(c.bytes_read("root"), 64 + 4 + 4 + 8);
    assert_eq!(c.bytes_written("root[16..32]"), 4);
    assert_eq!(c.bytes_read("root[16..32]"), 4 + 1);
    assert_eq!(c.bytes_written("host"), 8);
    assert_eq!(c.live.tensors, before.live.tensors + 4);
    assert_eq!(
        c.live.bytes,
        before.live.bytes + 64 + 8,
        "slices allocate nothing"
    );
    assert_eq!(c.total_bytes_allocated, before.total_bytes_allocated + 72);

    // Tensor sets bind by name; one tensor may sit in several sets.
    let mut a = TensorSet::new(&rt).unwrap();
    let mut b = TensorSet::new(&rt).unwrap();
    a.add("kv", &root).unwrap();
    b.add("kv", &root).unwrap();
    b.add("meta", &slice).unwrap();
    assert!(a.get("kv").unwrap().unwrap().same_as(&root));
    assert!(b.get("meta").unwrap().unwrap().same_as(&slice));
    assert!(
        a.get("unknown").unwrap().is_none(),
        "an unbound name is None"
    );
    assert_eq!(sim.counters().live.tensor_sets, before.live.tensor_sets + 2);

    // The parent may go first: the storage lives while a slice views it.
    drop((a, b));
    drop(root);
    assert_eq!(nested.read_vec(0, 2).unwrap(), vec![9, 9]);
    assert_eq!(sim.counters().live.bytes, before.live.bytes + 64 + 8);
    drop((slice, nested, host));
    let after = sim.counters();
    assert_eq!(after.live.tensors, before.live.tensors);
    assert_eq!(after.live.tensor_sets, before.live.tensor_sets);
    assert_eq!(after.live.bytes, before.live.bytes);
    assert_eq!(
        after.errors,
        before.errors + 1,
        "only the lookup of `unknown` failed: {:?}",
        after.last_error
    );
}

#[test]
fn memset_sets_bytes_on_the_device_and_sends_none_over_the_bus() {
    let _g = serial();
    let sim = Sim::open();
    sim.hooks.reset();
    let rt = sim.runtime();
    let t = Tensor::device(&rt, 0, 64, "zeroed").unwrap();
    // Fresh device memory is not cleared: nrt_tensor_memset is what clears it.
    assert_eq!(t.read_vec(0, 64).unwrap(), vec![nrt_sim::FILL_BYTE; 64]);
    t.fill(8, 0, 16).unwrap();
    let mut want = vec![nrt_sim::FILL_BYTE; 64];
    want[8..24].fill(0);
    assert_eq!(t.read_vec(0, 64).unwrap(), want);
    // Through a slice, at the slice's offset; C's memset takes the value's low byte.
    let s = t.slice(32, 16).unwrap();
    let memset = sim.api().nrt_tensor_memset.expect("nrt_tensor_memset");
    // SAFETY: a live tensor handle of nrt-sim; the range lies within it.
    let status = unsafe { memset(s.as_raw(), 4, 0x1AB, 4) };
    assert_eq!(status, OK);
    want[36..40].fill(0xAB);
    assert_eq!(t.read_vec(0, 64).unwrap(), want);
    // SAFETY: as above; the range is checked by nrt-sim, not dereferenced.
    let status = unsafe { memset(t.as_raw(), 60, 0, 8) };
    assert_eq!(status, sys::NRT_INVALID, "past the end");
    assert!(
        t.fill(60, 0, 8).is_err(),
        "the safe level checks the range too"
    );
    let c = sim.counters();
    assert_eq!(c.bytes_written("zeroed"), 0, "nothing crossed the bus");
    assert_eq!(c.bytes_written("zeroed[32..48]"), 0);
}

/// `nrt_get_vnc_memory_stats` reports each core's bytes in use, tensors included, and its
/// capacity (16 GiB, trn1's, by default), as libnrt 2.27.23 and later do.
#[test]
fn memory_stats_count_each_cores_bytes_and_capacity() {
    let _g = serial();
    let sim = Sim::open();
    let rt = sim.runtime();
    let before = rt
        .memory_stats(1)
        .unwrap()
        .expect("nrt_get_vnc_memory_stats");
    assert_eq!(before.limit, nrt_sim::DEFAULT_HBM_BYTES);
    let t = Tensor::device(&rt, 1, 4096, "counted").unwrap();
    let after = rt.memory_stats(1).unwrap().expect("stats");
    assert_eq!(after.used, before.used + 4096);
    assert_eq!(rt.memory_stats(0).unwrap().expect("stats").used, 0);
    drop(t);
    assert_eq!(rt.memory_stats(1).unwrap().expect("stats"), before);
    let stats = sim.api().nrt_get_vnc_memory_stats.expect("symbol");
    let mut raw = sys::nrt_vnc_memory_stats_t {
        bytes_used: 0,
        bytes_limit: 0,
    };
    let mut filled = 0usize;
    // SAFETY: valid out-pointers; nrt-sim checks the core and the size, not dereferencing more.
    let status = unsafe { stats(7, &mut raw, 16, &mut filled) };
    assert_eq!(status, sys::NRT_INVALID, "no such core");
    // SAFETY: as above; a size smaller than the struct is refused before anything is written.
    let status = unsafe { stats(0, &mut raw, 8, &mut filled) };
    assert_eq!(status, sys::NRT_INVALID, "too small a struct");
}

#[test]
fn misuse_is_a_status_never_a_crash() {
    let _g = serial();
    let sim = Sim::open();
    let _rt = sim.runtime();
    let raw = sim.raw();
    let errors = |sim: &Sim| sim.counters().errors;

    let (s, t) = raw.allocate(32, "victim");
    assert_eq!(s, OK);
    let (s, set) = raw.new_set();
    assert_eq!(s, OK);

    // === Out of bounds: NRT_INVALID, nothing touched ===
    let mut buf = [0u8; 8];
    assert_eq!(raw.read(t, 28, &mut buf), sys::NRT_INVALID);
    assert_eq!(raw.write(t, 30, &[1; 8]), sys::NRT_INVALID);
    assert_eq!(
        raw.read(t, usize::MAX, &mut buf),
        sys::NRT_INVALID,
        "offset overflow"
    );
    assert_eq!(raw.slice(t, 16, 17).0, sys::NRT_INVALID);
    assert_eq!(raw.slice(t, usize::MAX, 2).0, sys::NRT_INVALID);
    assert!(sim
        .counters()
        .last_error
        .unwrap()
        .contains("outside the tensor's 32 bytes"));
    assert_eq!(raw.read(t, 0, &mut buf), OK);
    assert_eq!(
        buf,
        [nrt_sim::FILL_BYTE; 8],
        "fresh allocations hold the fill pattern, and the failed write wrote nothing"
    );
    // SAFETY: a null buffer with a non-zero size is rejected before any access.
    let s = unsafe { (sim.api().nrt_tensor_read)(t, std::ptr::null_mut(), 0, 4) };
    assert_eq!(s, sys::NRT_INVALID);

    // === Bad allocation arguments ===
    assert_eq!(
        raw.allocate_on(0, 2, 8, "core 2").0,
        sys::NRT_INVALID,
        "2 cores visible"
    );
    assert_eq!(raw.allocate_on(0, -1, 8, "core -1").0, sys::NRT_INVALID);
    assert_eq!(raw.allocate_on(7, 0, 8, "placement 7").0, sys::NRT_INVALID);
    let (s, h) = raw.allocate_on(sys::NRT_TENSOR_PLACEMENT_HOST, -1, 8, "host");
    assert_eq!(s, OK, "host placement ignores the core");
    raw.free(h);
    assert_eq!(raw.allocate(usize::MAX, "huge").0, sys::NRT_RESOURCE);
    assert_eq!(
        raw.add(set, &"n".repeat(256), t),
        sys::NRT_INVALID,
        "name too long"
    );

    // === Tensor sets: unknown names ===
    let (s, got) = raw.get(set, "nope");
    assert_eq!(
        s,
        sys::NRT_FAILURE,
        "an unbound name is NRT_FAILURE, as in libnrt"
    );
    assert!(got.is_null());
    assert!(sim
        .counters()
        .last_error
        .unwrap()
        .contains("no tensor named `nope`"));
    assert_eq!(raw.add(set, "t", t), OK);
    assert_eq!(raw.get(set, "t"), (OK, t));

    // === Use after free: NRT_INVALID_HANDLE from every entry point ===
    let (s, view) = raw.slice(t, 0, 16);
    assert_eq!(s, OK);
    raw.free(t);
    let before = sim.counters();
    assert_eq!(raw.read(t, 0, &mut buf), sys::NRT_INVALID_HANDLE);
    assert_eq!(raw.write(t, 0, &[1]), sys::NRT_INVALID_HANDLE);
    assert_eq!(raw.size(t), 0, "get_size has no status: 0");
    assert_eq!(raw.slice(t, 0, 4).0, sys::NRT_INVALID_HANDLE);
    assert_eq!(raw.add(set, "again", t), sys::NRT_INVALID_HANDLE);
    let after = sim.counters();
    assert_eq!(after.invalid_handle_uses, before.invalid_handle_uses + 5);
    assert!(after.last_error.unwrap().contains("freed nrt_tensor_t"));
    // The slice keeps the storage: still fine.
    assert_eq!(raw.write(view, 0, &[5; 16]), OK);
    assert_eq!(raw.size(view), 16);

    // === Double free and double destroy: recorded, ignored ===
    let e = errors(&sim);
    raw.free(t);
    let c = sim.counters();
    assert_eq!(c.errors, e + 1);
    assert!(c
        .last_error
        .unwrap()
        .starts_with("nrt_tensor_free: NRT_INVALID_HANDLE"));
    raw.destroy_set(set);
    raw.destroy_set(set);
    let c = sim.counters();
    assert_eq!(c.errors, e + 2);
    assert!(c
        .last_error
        .unwrap()
        .starts_with("nrt_destroy_tensor_set: NRT_INVALID_HANDLE"));
    assert_eq!(raw.add(set, "t", view), sys::NRT_INVALID_HANDLE);
    assert_eq!(raw.get(set, "t").0, sys::NRT_INVALID_HANDLE);
    // Freeing a null handle is a no-op, like free(NULL).
    let e = errors(&sim);
    raw.free(std::ptr::null_mut());
    assert_eq!(errors(&sim), e);

    // === Foreign and mistyped handles ===
    let bogus = 0xdead_beef_usize as common::TensorPtr;
    assert_eq!(raw.read(bogus, 0, &mut buf), sys::NRT_INVALID_HANDLE);
    assert_eq!(
        raw.read(std::ptr::null_mut(), 0, &mut buf),
        sys::NRT_INVALID_HANDLE
    );
    let (s, set2) = raw.new_set();
    assert_eq!(s, OK);
    assert_eq!(
        raw.read(set2.cast(), 0, &mut buf),
        sys::NRT_INVALID_HANDLE,
        "a set is not a tensor"
    );
    assert_eq!(raw.add(view.cast(), "x", view), sys::NRT_INVALID_HANDLE);
    assert!(sim
        .counters()
        .last_error
        .unwrap()
        .contains("not a live nrt_tensor_set_t"));
    raw.destroy_set(set2);

    // A freed slot's next occupant gets a new handle; the stale one stays stale.
    let (s, t2) = raw.allocate(32, "reuse");
    assert_eq!(s, OK);
    assert_ne!(t2, t);
    assert_eq!(raw.size(t), 0);
    assert_eq!(raw.size(t2), 32);
    raw.free(t2);
    raw.free(view);
}

#[test]
fn close_releases_everything_and_later_calls_say_closed() {
    let _g = serial();
    let sim = Sim::open();
    let raw = sim.raw();
    let rt = sim.runtime();
    let (_, t) = raw.allocate(24, "leaked");
    let (_, set) = raw.new_set();
    let live = sim.counters().live;
    drop(rt); // the last handle: nrt_close

    let c = sim.counters();
    assert!(!c.initialized);
    let at_close = c.live_at_last_close.expect("recorded at nrt_close");
    assert_eq!(
        (at_close.tensors, at_close.tensor_sets),
        (live.tensors, live.tensor_sets)
    );
    assert_eq!(
        (c.live.tensors, c.live.tensor_sets, c.live.bytes),
        (0, 0, 0)
    );
    let mut buf = [0u8; 4];
    assert_eq!(raw.read(t, 0, &mut buf), sys::NRT_CLOSED);
    assert_eq!(raw.allocate(4, "late").0, sys::NRT_CLOSED);
    assert_eq!(raw.new_set().0, sys::NRT_CLOSED);
    assert!(c.errors < sim.counters().errors);

    // nrt_init again: the handles from before are stale, not revived.
    let _rt = sim.runtime();
    assert_eq!(raw.read(t, 0, &mut buf), sys::NRT_INVALID_HANDLE);
    assert_eq!(raw.add(set, "t", t), sys::NRT_INVALID_HANDLE);
    assert_eq!(
        raw.init(),
        sys::NRT_INVALID,
        "nrt_init twice without nrt_close"
    );
}
