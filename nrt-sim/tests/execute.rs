//! Loading and executing NEFFs (nrt-sim's container around deepinfer HLO) through the C ABI:
//! model I/O description, bindings by name, in-place cache roots, the lowered `fixtures/tiny-v3`
//! graphs against the CPU backend's outputs, and every binding and load error.

mod common;

use std::collections::HashMap;

use common::{
    bf16_bytes, f32_bytes, f32s, lowered_tiny_v3, max_abs_diff, neff_file, serial, tiny_hlo,
    tiny_neff, Sim, TinyBindings, C_IN,
};
use deepinfer::backend::hlo::neff_input_name;
use deepinfer::export::ManifestGraph;
use neuron_sys::sys::dtype::{hw, DtypeEncoding};
use neuron_sys::sys::{self, NRT_STATUS};
use neuron_sys::{Model, Runtime, Tensor, TensorSet, TensorUsage};
use safetensors::SafeTensors;

const OK: NRT_STATUS = sys::NRT_SUCCESS;

#[test]
fn max_abs_diff_refuses_nan_and_inf() {
    assert_eq!(max_abs_diff(&[1.0, 2.0], &[1.5, 2.0]), Ok(0.5));
    // All-NaN output against any reference: a fold with f32::max would report 0.
    assert!(max_abs_diff(&[f32::NAN; 3], &[0.0; 3]).is_err());
    assert!(max_abs_diff(&[0.0, 1.0], &[0.0, f32::NAN]).is_err());
    assert!(max_abs_diff(&[f32::INFINITY], &[f32::INFINITY]).is_err());
    assert!(max_abs_diff(&[0.0], &[f32::NEG_INFINITY]).is_err());
    assert!(max_abs_diff(&[0.0; 2], &[0.0; 3]).is_err(), "lengths");
}

#[test]
fn tiny_graph_reports_its_io_and_updates_the_root_in_place() {
    let _g = serial();
    let sim = Sim::open();
    let rt = sim.runtime();
    let model = Model::load(&rt, &tiny_neff(), Some(1), None).unwrap();

    // === nrt_get_model_tensor_info ===
    let io = model.io().unwrap();
    let row = |name: &str, usage| {
        let t = io
            .tensors
            .iter()
            .find(|t| t.name == name && t.usage == usage)
            .unwrap_or_else(|| panic!("{name} {usage:?} in {io:?}"));
        (t.size, t.dtype, t.shape.clone())
    };
    assert_eq!(row("x", TensorUsage::Input), (16, hw::FLOAT32, vec![4]));
    assert_eq!(row("h", TensorUsage::Input), (8, hw::BFLOAT16, vec![4]));
    assert_eq!(row(C_IN, TensorUsage::Input), (32, hw::FLOAT32, vec![2, 4]));
    assert_eq!(row("y", TensorUsage::Output), (16, hw::FLOAT32, vec![4]));
    assert_eq!(row("c", TensorUsage::Output), (32, hw::FLOAT32, vec![2, 4]));
    assert_eq!(io.inputs().count(), 3);
    assert_eq!(io.outputs().count(), 2);
    let names: Vec<_> = io.tensors.iter().map(|t| t.name.as_str()).collect();
    assert_eq!(
        names,
        ["x", "h", C_IN, "y", "c"],
        "inputs in order, then outputs"
    );

    // === Execute twice: the root accumulates in the one tensor bound as input and output ===
    let x = Tensor::device(&rt, 1, 16, "x").unwrap();
    let h = Tensor::device(&rt, 1, 8, "h").unwrap();
    let c = Tensor::device(&rt, 1, 32, "c").unwrap();
    let y = Tensor::device(&rt, 1, 16, "y").unwrap();
    x.write(0, &f32_bytes(&[1.0, 2.0, 3.0, 4.0])).unwrap();
    h.write(0, &bf16_bytes(&[0.5, -1.0, 0.25, 8.0])).unwrap();
    c.write(0, &f32_bytes(&[10.0, 20.0, 30.0, 40.0, 0.0, 0.0, 0.0, 0.0]))
        .unwrap();
    let mut inputs = TensorSet::new(&rt).unwrap();
    let mut outputs = TensorSet::new(&rt).unwrap();
    inputs.add("x", &x).unwrap();
    inputs.add("h", &h).unwrap();
    inputs.add(C_IN, &c).unwrap();
    outputs.add("y", &y).unwrap();
    outputs.add("c", &c).unwrap();
    let live = sim.counters().live;
    model.execute(&inputs, &outputs).unwrap();
    assert_eq!(f32s(&y.read_vec(0, 16).unwrap()), [2.5, 3.0, 6.25, 16.0]);
    assert_eq!(
        f32s(&c.read_vec(0, 32).unwrap()),
        [11.0, 22.0, 33.0, 44.0, 1.0, 2.0, 3.0, 4.0]
    );
    model.execute(&inputs, &outputs).unwrap();
    assert_eq!(
        f32s(&c.read_vec(0, 32).unwrap()),
        [12.0, 24.0, 36.0, 48.0, 2.0, 4.0, 6.0, 8.0]
    );
    assert!(outputs.get("c").unwrap().unwrap().same_as(&c));
    let counters = sim.counters();
    assert_eq!(
        counters.live, live,
        "execution allocates nothing the caller can see"
    );
    let m = counters
        .models
        .iter()
        .find(|m| m.handle == model.as_raw() as u64)
        .expect("the live model is listed by handle");
    assert_eq!((m.name.as_str(), m.executions), ("tiny", 2));
    assert!(counters.executions_of("tiny") >= 2);
}

/// Allocates and fills every input of `g` from its inputs file, binds every output
/// (aliased outputs to their input's tensor), and returns the sets and tensors.
fn bind_fixture(
    rt: &Runtime,
    dir: &std::path::Path,
    g: &ManifestGraph,
) -> (TensorSet, TensorSet, HashMap<String, Tensor>) {
    let file = std::fs::read(dir.join(g.inputs.as_ref().unwrap())).unwrap();
    let st = SafeTensors::deserialize(&file).unwrap();
    let mut inputs = TensorSet::new(rt).unwrap();
    let mut outputs = TensorSet::new(rt).unwrap();
    let mut by_param = HashMap::new();
    for p in &g.parameters {
        let data = st.tensor(&p.name).unwrap().data().to_vec();
        let t = Tensor::device(rt, 0, data.len(), &format!("{}/{}", g.name, p.name)).unwrap();
        t.write(0, &data).unwrap();
        let aliased = g.aliases.iter().any(|a| a.parameter == p.index);
        inputs.add(&neff_input_name(&p.name, aliased), &t).unwrap();
        by_param.insert(p.name.clone(), t);
    }
    let mut by_output = HashMap::new();
    for o in &g.outputs {
        let t = match g.aliases.iter().find(|a| a.output == o.index) {
            Some(a) => by_param[&g.parameters[a.parameter].name].clone(),
            None => {
                let size = o.shape.iter().product::<usize>() * 4;
                Tensor::device(rt, 0, size, &format!("{}/out/{}", g.name, o.name)).unwrap()
            }
        };
        outputs.add(&o.name, &t).unwrap();
        by_output.insert(o.name.clone(), t);
    }
    for (k, v) in by_param {
        by_output.insert(format!("in/{k}"), v);
    }
    (inputs, outputs, by_output)
}

#[test]
fn lowered_tiny_v3_graphs_match_the_cpu_backend() {
    let _g = serial();
    let (dir, manifest) = lowered_tiny_v3();
    assert_eq!(
        manifest.graphs.len(),
        4,
        "prefill, packed prefill, decode b1, decode b4"
    );
    let sim = Sim::open();
    let rt = sim.runtime();
    let v = sim.lib.version().unwrap().unwrap();
    let encoding = DtypeEncoding::for_runtime(v.major, v.minor);

    for g in &manifest.graphs {
        sim.hooks.reset();
        let base = sim.counters();
        let neff = neff_file(&dir.join(&g.hlo));
        let model = Model::load(&rt, &neff, Some(0), None).unwrap();

        // The I/O description matches the manifest, and decodes with neuron-sys's rule.
        let io = model.io().unwrap();
        assert_eq!(io.inputs().count(), g.parameters.len(), "{}", g.name);
        assert_eq!(io.outputs().count(), g.outputs.len(), "{}", g.name);
        let described = g
            .parameters
            .iter()
            .map(|p| {
                let aliased = g.aliases.iter().any(|a| a.parameter == p.index);
                let name = neff_input_name(&p.name, aliased);
                (&p.name, &p.shape, p.dtype, io.input(&name))
            })
            .chain(
                g.outputs
                    .iter()
                    .map(|o| (&o.name, &o.shape, o.dtype, io.output(&o.name))),
            );
        for (name, shape, dtype, info) in described {
            let info = info.unwrap_or_else(|| panic!("{}: {name} not described", g.name));
            let shape32: Vec<u32> = shape.iter().map(|&d| d as u32).collect();
            assert_eq!(info.shape, shape32, "{name}");
            let want = match dtype {
                "f32" => hw::FLOAT32,
                "i32" => hw::INT32,
                "u32" => hw::UINT32,
                other => panic!("unexpected dtype {other}"),
            };
            assert_eq!(info.dtype, want, "{name}");
            let elems: usize = shape.iter().product();
            assert_eq!(
                encoding.element_size(info.dtype).unwrap() * elems,
                info.size,
                "{name}: size / prod(shape) is the element size"
            );
        }

        let (inputs, outputs, tensors) = bind_fixture(&rt, dir, g);
        let after_bind = sim.counters();
        model.execute(&inputs, &outputs).unwrap();

        let file = std::fs::read(dir.join(g.cpu_outputs.as_ref().unwrap())).unwrap();
        let want = SafeTensors::deserialize(&file).unwrap();
        for o in &g.outputs {
            let expected = want.tensor(&o.name).unwrap().data().to_vec();
            let t = &tensors[&o.name];
            let got = t.read_vec(0, t.size()).unwrap();
            match o.name.as_str() {
                "next_tokens" => assert_eq!(got, expected, "{}: next_tokens", g.name),
                // The cache roots (latents; the sampling state's token counts), all f32 here.
                "logits" | "kv_cache" | "sampling_state" => {
                    let (a, b) = (f32s(&got), f32s(&expected));
                    let diff = max_abs_diff(&a, &b)
                        .unwrap_or_else(|e| panic!("{}: {}: {e}", g.name, o.name));
                    assert!(diff <= 1e-5, "{}: {} differs by {diff}", g.name, o.name);
                }
                other => panic!("unexpected output {other}"),
            }
        }
        // The cache root: the very tensor bound as input `kv_cache` holds the new value.
        let root = &tensors["in/kv_cache"];
        assert!(outputs.get("kv_cache").unwrap().unwrap().same_as(root));
        assert!(tensors["kv_cache"].same_as(root));
        let input_kv =
            SafeTensors::deserialize(&std::fs::read(dir.join(g.inputs.as_ref().unwrap())).unwrap())
                .unwrap()
                .tensor("kv_cache")
                .unwrap()
                .data()
                .to_vec();
        assert_ne!(
            root.read_vec(0, root.size()).unwrap(),
            input_kv,
            "{}: the step wrote the cache",
            g.name
        );

        // Counters: one execution of this model; every input written once, by name.
        let c = sim.counters();
        assert_eq!(c.executions_of(&g.name), 1, "{}", g.name);
        assert_eq!(c.execute_calls, 1);
        assert_eq!(c.execute_failures, 0);
        for p in &g.parameters {
            let size = tensors[&format!("in/{}", p.name)].size() as u64;
            assert_eq!(
                c.bytes_written(&format!("{}/{}", g.name, p.name)),
                size,
                "{}",
                p.name
            );
        }
        assert_eq!(
            c.live, after_bind.live,
            "execution allocated nothing visible"
        );
        let bound_bytes: u64 = g
            .parameters
            .iter()
            .map(|p| tensors[&format!("in/{}", p.name)].size() as u64)
            .sum::<u64>()
            + g.outputs
                .iter()
                // Updated cache roots are bound to their input's tensor.
                .filter(|o| o.name != "kv_cache" && o.name != "sampling_state")
                .map(|o| tensors[&o.name].size() as u64)
                .sum::<u64>();
        assert_eq!(
            c.total_bytes_allocated - base.total_bytes_allocated,
            bound_bytes
        );
        assert_eq!(c.errors, 0, "{:?}", c.last_error);
    }
}

#[test]
fn binding_errors_are_statuses_and_write_nothing() {
    let _g = serial();
    let sim = Sim::open();
    let _rt = sim.runtime();
    let raw = sim.raw();
    let (s, model) = raw.load(&tiny_neff());
    assert_eq!(s, OK);
    let b = TinyBindings::new(&raw);
    let y_before = b.read_f32(&raw, b.y, 4);

    // Missing input.
    let (_, partial) = raw.new_set();
    assert_eq!(raw.add(partial, "x", b.x), OK);
    assert_eq!(raw.add(partial, C_IN, b.c), OK);
    assert_eq!(raw.execute(model, partial, b.outputs), sys::NRT_INVALID);
    let err = sim.counters().last_error.unwrap();
    assert!(
        err.contains("input `h` of model `tiny` is not bound"),
        "{err}"
    );

    // Missing output.
    let (_, no_y) = raw.new_set();
    assert_eq!(raw.add(no_y, "c", b.c), OK);
    assert_eq!(raw.execute(model, b.inputs, no_y), sys::NRT_INVALID);
    assert!(sim.counters().last_error.unwrap().contains("output `y`"));

    // Size mismatch (an f32 tensor where the model wants bf16).
    let (_, wrong) = raw.allocate(16, "h as f32");
    assert_eq!(raw.add(partial, "h", wrong), OK);
    assert_eq!(raw.execute(model, partial, b.outputs), sys::NRT_INVALID);
    let err = sim.counters().last_error.unwrap();
    assert!(
        err.contains("input `h` is bound to a tensor of 16 bytes"),
        "{err}"
    );
    assert!(err.contains("needs 8 (bf16 [4])"), "{err}");

    // A bound tensor freed behind the set's back.
    raw.free(wrong);
    assert_eq!(
        raw.execute(model, partial, b.outputs),
        sys::NRT_INVALID_HANDLE
    );

    // Stale set and model handles.
    raw.destroy_set(no_y);
    assert_eq!(raw.execute(model, b.inputs, no_y), sys::NRT_INVALID_HANDLE);
    assert_eq!(
        raw.execute(b.x.cast(), b.inputs, b.outputs),
        sys::NRT_INVALID_HANDLE
    );

    // Nothing was written by any failed execution.
    assert_eq!(b.read_f32(&raw, b.y, 4), y_before);
    assert_eq!(b.read_f32(&raw, b.c, 8), [0.0; 8]);
    let c = sim.counters();
    assert!(c.execute_failures >= 6);

    // Extra names in a set are ignored; the correct bindings work.
    assert_eq!(raw.add(b.inputs, "unused", b.y), OK);
    assert_eq!(raw.execute(model, b.inputs, b.outputs), OK);
    assert_eq!(b.read_f32(&raw, b.y, 4), [2.5, 4.5, 6.5, 8.5]);
    assert_eq!(
        b.read_f32(&raw, b.c, 8),
        [1.0, 2.0, 3.0, 4.0, 1.0, 2.0, 3.0, 4.0]
    );

    // Unload: the handle goes stale; a second unload is NRT_INVALID_HANDLE.
    assert_eq!(raw.unload(model), OK);
    assert_eq!(raw.unload(model), sys::NRT_INVALID_HANDLE);
    assert_eq!(
        raw.execute(model, b.inputs, b.outputs),
        sys::NRT_INVALID_HANDLE
    );
    raw.destroy_set(partial);
    b.free(&raw);
}

#[test]
fn corrupt_neffs_and_bad_load_arguments_fail_to_load() {
    let _g = serial();
    let sim = Sim::open();
    let rt = sim.runtime();
    let raw = sim.raw();
    let failures = sim.counters().load_failures;
    let good = tiny_neff();
    let hlo = tiny_hlo();
    let mut other_version = good.clone();
    other_version[8] = 9;
    let cases: [(&str, &[u8], u32, &str); 6] = [
        (
            "garbage",
            b"definitely not a protobuf \xff\xff\xff",
            sys::NRT_INVALID,
            "not an nrt-sim NEFF",
        ),
        ("raw HLO", &hlo, sys::NRT_INVALID, "not an nrt-sim NEFF"),
        (
            "truncated",
            &good[..good.len() / 2],
            sys::NRT_INVALID,
            "truncated nrt-sim NEFF",
        ),
        (
            "cut short",
            &good[..good.len() - 3],
            sys::NRT_INVALID,
            "truncated nrt-sim NEFF",
        ),
        (
            "a NEFF from neuronx-cc",
            b"NEFF\x00\x01\x02\x03 not ours",
            sys::NRT_INVALID,
            "not an nrt-sim NEFF",
        ),
        (
            "another format version",
            &other_version,
            sys::NRT_UNSUPPORTED_NEFF_VERSION,
            "format version 9",
        ),
    ];
    for (what, bytes, status, why) in cases {
        let (s, m) = raw.load(bytes);
        assert_eq!(s, status, "{what}");
        assert!(m.is_null(), "{what}");
        let err = sim.counters().last_error.unwrap();
        assert!(err.starts_with("nrt_load: NRT_"), "{err}");
        assert!(err.contains(why), "{what}: {err}");
    }
    // SAFETY: a null NEFF with size 0 is rejected before any access.
    let s = unsafe { (sim.api().nrt_load)(std::ptr::null(), 0, -1, -1, &mut std::ptr::null_mut()) };
    assert_eq!(s, sys::NRT_INVALID, "empty");
    let mut m = std::ptr::null_mut();
    // SAFETY: `good` is readable for its length; valid out-pointer.
    let s = unsafe { (sim.api().nrt_load)(good.as_ptr().cast(), good.len(), 2, -1, &mut m) };
    assert_eq!(s, sys::NRT_LOAD_NOT_ENOUGH_NC, "core 2 of 2");
    assert_eq!(sim.counters().load_failures, failures + 8);

    // A collectives load checks its context and otherwise loads the same way.
    let f = sim.api().nrt_load_collectives.unwrap();
    // SAFETY: as above.
    let s = unsafe { f(good.as_ptr().cast(), good.len(), 0, -1, 3, 2, &mut m) };
    assert_eq!(s, sys::NRT_INVALID, "device 3 of 2");
    // SAFETY: as above.
    let s = unsafe { f(good.as_ptr().cast(), good.len(), 0, -1, 0, 1, &mut m) };
    assert_eq!(s, OK);

    // Tensor-info arrays: freed once; a second free or a foreign pointer is a status.
    let get = sim.api().nrt_get_model_tensor_info.unwrap();
    let free = sim.api().nrt_free_model_tensor_info.unwrap();
    let mut info = std::ptr::null_mut();
    // SAFETY: valid out-pointer; the array is read as the C layout describes.
    unsafe {
        assert_eq!(get(m, &mut info), OK);
        assert_eq!((*info).tensor_count, 5);
        assert_eq!(sim.counters().live.tensor_info_arrays, 1);
        assert_eq!(free(info), OK);
        assert_eq!(free(info), sys::NRT_INVALID_HANDLE, "double free");
        assert_eq!(free(0x1000 as *mut _), sys::NRT_INVALID_HANDLE, "foreign");
        assert_eq!(
            get(std::ptr::null_mut(), &mut info),
            sys::NRT_INVALID_HANDLE
        );
    }
    assert_eq!(sim.counters().live.tensor_info_arrays, 0);
    assert_eq!(raw.unload(m), OK);

    // Through the safe level, the same failure is a typed error naming the status.
    let err = Model::load(&rt, b"junk", None, None).unwrap_err();
    assert_eq!(err.status_code(), Some(sys::NRT_INVALID), "{err}");
}

#[test]
fn data_the_cpu_backend_rejects_is_a_status() {
    let _g = serial();
    let (dir, manifest) = lowered_tiny_v3();
    let g = manifest
        .graphs
        .iter()
        .find(|g| g.name.starts_with("decode_b1"))
        .unwrap();
    let sim = Sim::open();
    let rt = sim.runtime();
    let model = Model::load(&rt, &neff_file(&dir.join(&g.hlo)), None, None).unwrap();
    let (inputs, outputs, tensors) = bind_fixture(&rt, dir, g);
    let root = &tensors["in/kv_cache"];
    let kv_before = root.read_vec(0, root.size()).unwrap();
    // A token id far outside the 512-entry vocabulary.
    tensors["in/input_ids"]
        .write(0, &1_000_000i32.to_le_bytes())
        .unwrap();
    let err = model.execute(&inputs, &outputs).unwrap_err();
    assert_eq!(err.status_code(), Some(sys::NRT_EXEC_BAD_INPUT), "{err}");
    let last = sim.counters().last_error.unwrap();
    assert!(
        last.contains("row index 1000000 out of range 0..512"),
        "{last}"
    );
    assert_eq!(
        root.read_vec(0, root.size()).unwrap(),
        kv_before,
        "nothing written"
    );
}

/// A graph with an all-reduce over two ranks: `y = x(rank 0) + x(rank 1)`.
fn all_reduce_neff() -> Vec<u8> {
    use deepinfer::graph::{DType, GraphBuilder, InputRole, ReduceOp};
    let b = GraphBuilder::new("sum2");
    let x = b
        .input("x", InputRole::Metadata, vec![3], DType::F32)
        .unwrap();
    b.output("y", &x.all_reduce(ReduceOp::Sum, 2).unwrap())
        .unwrap();
    let g = b.finish().unwrap();
    common::neff_of(&deepinfer::backend::hlo::emit::to_bytes(
        &deepinfer::backend::hlo::emit::emit(&g).unwrap(),
    ))
}

#[test]
fn collectives_load_as_ranks_of_a_group_and_meet_at_execution() {
    let _g = serial();
    let sim = Sim::open();
    let rt = sim.runtime();
    let neff = all_reduce_neff();
    let load = |core: u32, id: u32, count: u32| {
        Model::load_collectives(&rt, &neff, Some(core), None, id, count)
    };
    let status = |r: Result<Model, neuron_sys::Error>| r.err().and_then(|e| e.status_code());

    // A graph with collectives needs nrt_load_collectives, as many devices as its replicas,
    // and the root communicator's address.
    assert_eq!(
        status(Model::load(&rt, &neff, Some(0), None)),
        Some(sys::NRT_INVALID)
    );
    std::env::remove_var("NEURON_RT_ROOT_COMM_ID");
    assert_eq!(status(load(0, 0, 2)), Some(sys::NRT_INVALID));
    let err = sim.counters().last_error.unwrap();
    assert!(err.contains("NEURON_RT_ROOT_COMM_ID"), "{err}");
    std::env::set_var("NEURON_RT_ROOT_COMM_ID", "localhost:61234");
    assert_eq!(status(load(0, 0, 3)), Some(sys::NRT_INVALID));

    // Both ranks load at once: each load returns only when the other has entered it.
    let (r0, r1) = std::thread::scope(|s| {
        let r1 = s.spawn(|| load(1, 1, 2));
        (load(0, 0, 2).unwrap(), r1.join().unwrap().unwrap())
    });
    // Device 0's seat is taken: refused at once, not after the bootstrap's wait.
    let t = std::time::Instant::now();
    assert_eq!(status(load(1, 0, 2)), Some(sys::NRT_INVALID));
    assert!(t.elapsed() < std::time::Duration::from_secs(5));

    let bind = |core: u32, vals: &[f32]| {
        let x = Tensor::device(&rt, core, 12, "x").unwrap();
        let y = Tensor::device(&rt, core, 12, "y").unwrap();
        x.write(0, &f32_bytes(vals)).unwrap();
        let mut i = TensorSet::new(&rt).unwrap();
        let mut o = TensorSet::new(&rt).unwrap();
        i.add("x", &x).unwrap();
        o.add("y", &y).unwrap();
        (i, o, y)
    };
    let (mut i0, mut o0, y0) = bind(0, &[1.0, 2.0, 3.0]);
    let (mut i1, mut o1, y1) = bind(1, &[10.0, 20.0, 30.0]);
    for _ in 0..3 {
        // A tensor set is Send, not Sync: each rank's thread gets its sets by `&mut`.
        let (s0, s1) = ((&mut i0, &mut o0), (&mut i1, &mut o1));
        let (r0, r1) = (&r0, &r1);
        std::thread::scope(|s| {
            let a = s.spawn(move || r0.execute(s0.0, s0.1));
            let b = s.spawn(move || r1.execute(s1.0, s1.1));
            a.join().unwrap().unwrap();
            b.join().unwrap().unwrap();
        });
        assert_eq!(f32s(&y0.read_vec(0, 12).unwrap()), [11.0, 22.0, 33.0]);
        assert_eq!(f32s(&y1.read_vec(0, 12).unwrap()), [11.0, 22.0, 33.0]);
    }
}

#[test]
fn a_collectives_load_waits_for_every_rank_and_times_out_naming_the_missing() {
    nrt_sim::run_test_in_child(
        "child_bootstrap_timeout",
        &[(nrt_sim::ENV_COLLECTIVE_TIMEOUT_MS, "300")],
    );
}

#[test]
#[ignore = "runs in a child process started by its parent test"]
fn child_bootstrap_timeout() {
    if !nrt_sim::is_fault_child() {
        return a_collectives_load_waits_for_every_rank_and_times_out_naming_the_missing();
    }
    let sim = Sim::open();
    let rt = sim.runtime();
    let neff = all_reduce_neff();
    std::env::set_var("NEURON_RT_ROOT_COMM_ID", "localhost:61234");
    let load = |core: u32, id: u32| Model::load_collectives(&rt, &neff, Some(core), None, id, 2);

    // One rank alone, as a runner loading its ranks one after another would: libnrt's
    // bootstrap waits for rank 1 (forever, aws-neuron-sdk#699); nrt-sim gives up.
    let t = std::time::Instant::now();
    let err = load(0, 0).unwrap_err();
    assert_eq!(err.status_code(), Some(sys::NRT_TIMEOUT), "{err}");
    assert!(t.elapsed() >= std::time::Duration::from_millis(300));
    let last = sim.counters().last_error.unwrap();
    assert!(
        last.contains("device(s) 1 ") && last.contains("localhost:61234"),
        "{last}"
    );
    // The same ranks loaded concurrently meet, and the group executes.
    let (r0, r1) = std::thread::scope(|s| {
        let r1 = s.spawn(|| load(1, 1));
        (load(0, 0).unwrap(), r1.join().unwrap().unwrap())
    });
    drop((r0, r1));

    // Four ranks of which one never comes: the three that did each name it.
    let neff4 = {
        use deepinfer::graph::{DType, GraphBuilder, InputRole, ReduceOp};
        let b = GraphBuilder::new("sum4");
        let x = b
            .input("x", InputRole::Metadata, vec![3], DType::F32)
            .unwrap();
        b.output("y", &x.all_reduce(ReduceOp::Sum, 4).unwrap())
            .unwrap();
        common::neff_of(&deepinfer::backend::hlo::emit::to_bytes(
            &deepinfer::backend::hlo::emit::emit(&b.finish().unwrap()).unwrap(),
        ))
    };
    let errs: Vec<String> = std::thread::scope(|s| {
        let ranks: Vec<_> = [0u32, 1, 3]
            .into_iter()
            .map(|id| {
                let (rt, neff4) = (&rt, &neff4);
                s.spawn(move || Model::load_collectives(rt, neff4, Some(id % 2), None, id, 4))
            })
            .collect();
        ranks
            .into_iter()
            .map(|h| h.join().unwrap().unwrap_err().to_string())
            .collect()
    });
    for e in errs {
        assert!(e.contains("NRT_TIMEOUT"), "{e}");
    }
    let last = sim.counters().last_error.unwrap();
    assert!(last.contains("device(s) 2 "), "{last}");
}
