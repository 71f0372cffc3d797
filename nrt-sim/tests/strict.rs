//! The strict rules, each seen to fire: HBM capacity per NeuronCore (`NRT_RESOURCE` past it,
//! the peak in the counters), tensors bound to a model of another core, storage shared by an
//! input and an output without a declared alias, never-written memory visible as the fill
//! pattern, the NEFF names after each convention, and an aliased root read after its update
//! seeing the old value (XLA semantics) although it is updated in place.
//!
//! Capacity cases run in a child process (`NRT_SIM_HBM_BYTES` is read at `nrt_init`).

mod common;

use common::{f32_bytes, f32s, neff_of, serial, tiny_hlo, tiny_neff, Sim, TinyBindings, C_IN};
use deepinfer::backend::hlo::emit;
use deepinfer::backend::neuron::sim_neff::{NeffNames, SimNeff};
use deepinfer::graph::{DType, GraphBuilder, InputRole};
use neuron_sys::sys::{self, NRT_STATUS};
use neuron_sys::{Model, Tensor, TensorSet};
use nrt_sim::{is_fault_child as is_child, run_test_in_child as run_child, FILL_BYTE};

const OK: NRT_STATUS = sys::NRT_SUCCESS;

#[test]
fn device_memory_past_a_core_s_capacity_is_nrt_resource() {
    // The default: 16 GiB per core, so a 63 GB upload fails without allocating anything.
    {
        let _g = serial();
        let sim = Sim::open();
        let _rt = sim.runtime();
        let raw = sim.raw();
        let before = sim.counters();
        assert!(
            before.hbm.iter().all(|m| m.capacity == 16 << 30),
            "{:?}",
            before.hbm
        );
        let (s, t) = raw.allocate(63_000_000_000, "a 63 GB root");
        assert_eq!(s, sys::NRT_RESOURCE);
        assert!(t.is_null());
        let err = sim.counters().last_error.unwrap();
        assert!(
            err.contains("cannot allocate 63000000000 bytes on NeuronCore 0"),
            "{err}"
        );
        assert_eq!(sim.counters().hbm, before.hbm, "nothing was reserved");
    }
    run_child("child_capacity", &[(nrt_sim::ENV_HBM_BYTES, "1000")]);
    run_child("child_bad_capacity", &[(nrt_sim::ENV_HBM_BYTES, "16GiB")]);
}

#[test]
#[ignore = "runs in a child process started by its parent test"]
fn child_capacity() {
    if !is_child() {
        return;
    }
    let sim = Sim::open();
    let _rt = sim.runtime();
    let raw = sim.raw();
    let (s, a) = raw.allocate(600, "a");
    assert_eq!(s, OK);
    // A slice allocates nothing; host memory is not HBM.
    let (s, _) = raw.slice(a, 0, 600);
    assert_eq!(s, OK);
    let (s, _) = raw.allocate_on(sys::NRT_TENSOR_PLACEMENT_HOST, 0, 600, "host");
    assert_eq!(s, OK);
    let (s, b) = raw.allocate(401, "b");
    assert_eq!(s, sys::NRT_RESOURCE, "600 + 401 > 1000 on core 0");
    assert!(b.is_null());
    let err = sim.counters().last_error.unwrap();
    assert!(
        err.contains("600 of its 1000 bytes of device memory are in use"),
        "{err}"
    );
    // Per core: core 1 has its own 1000 bytes.
    let (s, c1) = raw.allocate_on(sys::NRT_TENSOR_PLACEMENT_DEVICE, 1, 1000, "c1");
    assert_eq!(s, OK);
    let (s, b) = raw.allocate(400, "b");
    assert_eq!(s, OK, "exactly full");
    let c = sim.counters();
    assert_eq!(
        (c.hbm[0].used, c.hbm[0].peak, c.hbm[0].capacity),
        (1000, 1000, 1000)
    );
    assert_eq!((c.hbm[1].used, c.hbm[1].peak), (1000, 1000));
    // Freeing gives the memory back (the storage goes with its last view), the peak stays.
    raw.free(b);
    raw.free(c1);
    let c = sim.counters();
    assert_eq!((c.hbm[0].used, c.hbm[0].peak), (600, 1000));
    assert_eq!((c.hbm[1].used, c.hbm_peak(1)), (0, 1000));
    sim.hooks.reset();
    assert_eq!(
        sim.counters().hbm_peak(0),
        600,
        "a reset restarts the peak at the use"
    );
}

#[test]
#[ignore = "runs in a child process started by its parent test"]
fn child_bad_capacity() {
    if !is_child() {
        return;
    }
    let sim = Sim::open();
    assert_eq!(sim.raw().init(), sys::NRT_INVALID);
    let err = sim.counters().last_error.unwrap();
    assert!(err.contains("NRT_SIM_HBM_BYTES=\"16GiB\""), "{err}");
}

#[test]
fn a_tensor_of_another_core_fails_the_execution() {
    let _g = serial();
    let sim = Sim::open();
    let _rt = sim.runtime();
    let raw = sim.raw();
    let (s, model) = raw.load(&tiny_neff()); // core 0
    assert_eq!(s, OK);
    let b = TinyBindings::new(&raw);
    let (s, x1) = raw.allocate_on(sys::NRT_TENSOR_PLACEMENT_DEVICE, 1, 16, "x on core 1");
    assert_eq!(s, OK);
    assert_eq!(raw.write(x1, 0, &f32_bytes(&[1.0; 4])), OK);
    assert_eq!(raw.add(b.inputs, "x", x1), OK);
    assert_eq!(raw.execute(model, b.inputs, b.outputs), sys::NRT_INVALID);
    let err = sim.counters().last_error.unwrap();
    assert!(
        err.contains(
            "input `x` is bound to tensor `x on core 1` allocated on NeuronCore 1; model `tiny` \
             is loaded on NeuronCore 0"
        ),
        "{err}"
    );
    assert_eq!(b.read_f32(&raw, b.c, 8), [0.0; 8], "nothing written");
    // A slice keeps its parent's core.
    let (_, part) = raw.slice(x1, 0, 16);
    assert_eq!(raw.add(b.inputs, "x", part), OK);
    assert_eq!(raw.execute(model, b.inputs, b.outputs), sys::NRT_INVALID);
    // Host memory has no core: it may be bound to any model.
    let (s, xh) = raw.allocate_on(sys::NRT_TENSOR_PLACEMENT_HOST, 0, 16, "x on the host");
    assert_eq!(s, OK);
    assert_eq!(raw.write(xh, 0, &f32_bytes(&[1.0, 2.0, 3.0, 4.0])), OK);
    assert_eq!(raw.add(b.inputs, "x", xh), OK);
    assert_eq!(raw.execute(model, b.inputs, b.outputs), OK);
    assert_eq!(b.read_f32(&raw, b.y, 4), [2.5, 4.5, 6.5, 8.5]);
    raw.free(part);
    raw.free(x1);
    raw.free(xh);
    b.free(&raw);
    assert_eq!(raw.unload(model), OK);
}

#[test]
fn storage_shared_without_a_declared_alias_is_an_error() {
    let _g = serial();
    let sim = Sim::open();
    let _rt = sim.runtime();
    let raw = sim.raw();
    let (_, model) = raw.load(&tiny_neff());
    let b = TinyBindings::new(&raw);
    let fails = |outputs, inputs, why: &str| {
        assert_eq!(
            raw.execute(model, inputs, outputs),
            sys::NRT_INVALID,
            "{why}"
        );
        let err = sim.counters().last_error.unwrap();
        assert!(err.contains(why), "{err}");
    };

    // Output `y` bound to input `x`'s tensor: no alias declares it.
    let (_, outs) = raw.new_set();
    assert_eq!(raw.add(outs, "y", b.x), OK);
    assert_eq!(raw.add(outs, "c", b.c), OK);
    fails(
        outs,
        b.inputs,
        "input `x` and output `y` of model `tiny` are bound to overlapping bytes (tensors `x` \
         and `x`) but the model declares no alias between them",
    );
    // ... or to a slice of the aliased root: overlap is overlap.
    let (_, y_in_c) = raw.slice(b.c, 16, 16);
    assert_eq!(raw.add(outs, "y", y_in_c), OK);
    fails(outs, b.inputs, "input `c.must_alias_input` and output `y`");

    // The declared alias bound to overlapping but different bytes.
    let (_, big) = raw.allocate(48, "big");
    assert_eq!(raw.write(big, 0, &[0u8; 48]), OK);
    let (_, c_in) = raw.slice(big, 0, 32);
    let (_, c_out) = raw.slice(big, 16, 32);
    let (_, ins) = raw.new_set();
    for (name, t) in [("x", b.x), ("h", b.h), (C_IN, c_in)] {
        assert_eq!(raw.add(ins, name, t), OK);
    }
    assert_eq!(raw.add(outs, "y", b.y), OK);
    assert_eq!(raw.add(outs, "c", c_out), OK);
    fails(outs, ins, "an aliased pair must be bound to the same bytes");

    // Two outputs overlapping.
    let (_, y_in_c_out) = raw.slice(c_out, 0, 16);
    assert_eq!(raw.add(outs, "c", b.c), OK);
    assert_eq!(raw.add(outs, "y", y_in_c_out), OK);
    let (_, other_c) = raw.allocate(32, "other c");
    assert_eq!(raw.add(outs, "c", other_c), OK);
    let (_, other_c_slice) = raw.slice(other_c, 0, 16);
    assert_eq!(raw.add(outs, "y", other_c_slice), OK);
    fails(
        outs,
        b.inputs,
        "outputs `y` and `c` of model `tiny` are bound to overlapping bytes",
    );

    // Nothing was written; the declared alias on the same bytes runs.
    assert_eq!(b.read_f32(&raw, b.c, 8), [0.0; 8]);
    assert_eq!(raw.execute(model, b.inputs, b.outputs), OK);
    for t in [y_in_c, big, c_in, c_out, y_in_c_out, other_c, other_c_slice] {
        raw.free(t);
    }
    raw.destroy_set(ins);
    raw.destroy_set(outs);
    b.free(&raw);
    assert_eq!(raw.unload(model), OK);
}

#[test]
fn never_written_memory_reads_as_the_fill_pattern() {
    let _g = serial();
    let sim = Sim::open();
    let rt = sim.runtime();
    let t = Tensor::device(&rt, 0, 24, "fresh").unwrap();
    assert_eq!(t.read_vec(0, 24).unwrap(), vec![FILL_BYTE; 24]);
    assert!(
        f32::from_le_bytes([FILL_BYTE; 4]).is_nan(),
        "an f32 of it is NaN"
    );

    // A root that was never cleared poisons the update: the uninitialised read is visible.
    let model = Model::load(&rt, &tiny_neff(), Some(0), None).unwrap();
    let x = Tensor::device(&rt, 0, 16, "x").unwrap();
    let h = Tensor::device(&rt, 0, 8, "h").unwrap();
    let c = Tensor::device(&rt, 0, 32, "c (never written)").unwrap();
    let y = Tensor::device(&rt, 0, 16, "y").unwrap();
    x.write(0, &f32_bytes(&[1.0, 2.0, 3.0, 4.0])).unwrap();
    h.write(0, &[0u8; 8]).unwrap();
    let mut ins = TensorSet::new(&rt).unwrap();
    let mut outs = TensorSet::new(&rt).unwrap();
    ins.add("x", &x).unwrap();
    ins.add("h", &h).unwrap();
    ins.add(C_IN, &c).unwrap();
    outs.add("y", &y).unwrap();
    outs.add("c", &c).unwrap();
    model.execute(&ins, &outs).unwrap();
    assert_eq!(f32s(&y.read_vec(0, 16).unwrap()), [2.0, 4.0, 6.0, 8.0]);
    assert!(f32s(&c.read_vec(0, 32).unwrap()).iter().all(|v| v.is_nan()));
}

#[test]
fn the_neff_reports_the_names_of_the_convention_it_was_compiled_with() {
    let _g = serial();
    let sim = Sim::open();
    let rt = sim.runtime();
    let hlo = tiny_hlo();
    let want = |n| match n {
        NeffNames::Ours | NeffNames::MustAlias => {
            (vec!["x", "h", "c.must_alias_input"], vec!["y", "c"])
        }
        NeffNames::Positional => (
            vec!["input0", "input1", "input2"],
            vec!["output0", "output1"],
        ),
    };
    for names in NeffNames::ALL {
        let neff = SimNeff::compile(&hlo, names).unwrap().encode();
        let model = Model::load(&rt, &neff, Some(0), None).unwrap();
        let io = model.io().unwrap();
        let got = (
            io.inputs().map(|t| t.name.as_str()).collect::<Vec<_>>(),
            io.outputs().map(|t| t.name.as_str()).collect::<Vec<_>>(),
        );
        assert_eq!(got, want(names), "{names:?}");
    }
    // The conventions differ on a module whose aliased parameter carries no suffix (a foreign
    // emitter's): ours keeps `c`, must-alias appends it once.
    let mut module =
        <deepinfer::backend::hlo::proto::HloModuleProto as prost::Message>::decode(hlo.as_slice())
            .unwrap();
    for i in module
        .computations
        .iter_mut()
        .flat_map(|c| c.instructions.iter_mut())
    {
        if let Some(n) = i
            .frontend_attributes
            .as_mut()
            .and_then(|a| a.map.get_mut("neff_input_names"))
        {
            *n = n.trim_end_matches(".must_alias_input").to_string();
        }
    }
    let plain = prost::Message::encode_to_vec(&module);
    let ours = SimNeff::compile(&plain, NeffNames::Ours).unwrap();
    let must = SimNeff::compile(&plain, NeffNames::MustAlias).unwrap();
    assert_eq!(
        (ours.inputs[2].as_str(), ours.outputs[1].as_str()),
        ("c", "c")
    );
    assert_eq!(must.inputs[2], "c.must_alias_input");
    // Executing binds by those names: a `c` input is unknown to the positional NEFF.
    let raw = sim.raw();
    let (_, m) = raw.load(
        &SimNeff::compile(&hlo, NeffNames::Positional)
            .unwrap()
            .encode(),
    );
    let b = TinyBindings::new(&raw);
    assert_eq!(raw.execute(m, b.inputs, b.outputs), sys::NRT_INVALID);
    let err = sim.counters().last_error.unwrap();
    assert!(
        err.contains("input `input0` of model `tiny` is not bound"),
        "{err}"
    );
    b.free(&raw);
    assert_eq!(raw.unload(m), OK);
}

/// `view = root[0..2]` taken before `root' = scatter_rows(root, rows, 0, src)` (aliased, in
/// place) and read after it, once by an op computed after the update and once returned as is:
/// XLA gives the old rows, whatever the order of the instructions. (Issue 11's hazard: the CPU
/// backend used to return the new rows through the view.)
#[test]
fn a_view_of_the_root_read_after_its_in_place_update_sees_the_old_value() {
    let _g = serial();
    let b = GraphBuilder::new("hazard");
    let root = b
        .input("root", InputRole::CacheRoot, vec![4, 2], DType::F32)
        .unwrap();
    let rows = b
        .input("rows", InputRole::Metadata, vec![1], DType::I32)
        .unwrap();
    let src = b
        .input("src", InputRole::Metadata, vec![1, 2], DType::F32)
        .unwrap();
    let view = root.narrow(0, 0, 2).unwrap();
    let updated = root.scatter_rows(&rows, 0, &src).unwrap();
    let twice = view.affine(2.0, 0.0).unwrap(); // computed after the update
    b.output("old", &view).unwrap();
    b.output("twice_old", &twice).unwrap();
    b.output_aliased("root", &updated, &root).unwrap();
    let g = b.finish().unwrap();

    let sim = Sim::open();
    let rt = sim.runtime();
    let model = Model::load(
        &rt,
        &neff_of(&emit::to_bytes(&emit::emit(&g).unwrap())),
        Some(0),
        None,
    )
    .unwrap();
    let r = Tensor::device(&rt, 0, 32, "root").unwrap();
    let rows_t = Tensor::device(&rt, 0, 4, "rows").unwrap();
    let src_t = Tensor::device(&rt, 0, 8, "src").unwrap();
    let old_t = Tensor::device(&rt, 0, 16, "old").unwrap();
    let twice_t = Tensor::device(&rt, 0, 16, "twice_old").unwrap();
    r.write(0, &f32_bytes(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]))
        .unwrap();
    rows_t.write(0, &0i32.to_le_bytes()).unwrap();
    src_t.write(0, &f32_bytes(&[-1.0, -2.0])).unwrap();
    let mut ins = TensorSet::new(&rt).unwrap();
    let mut outs = TensorSet::new(&rt).unwrap();
    ins.add("root.must_alias_input", &r).unwrap();
    ins.add("rows", &rows_t).unwrap();
    ins.add("src", &src_t).unwrap();
    outs.add("old", &old_t).unwrap();
    outs.add("twice_old", &twice_t).unwrap();
    outs.add("root", &r).unwrap();
    model.execute(&ins, &outs).unwrap();
    assert_eq!(
        f32s(&r.read_vec(0, 32).unwrap()),
        [-1.0, -2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0],
        "the root is updated in place"
    );
    assert_eq!(
        f32s(&old_t.read_vec(0, 16).unwrap()),
        [1.0, 2.0, 3.0, 4.0],
        "the view returned as an output holds the old rows"
    );
    assert_eq!(
        f32s(&twice_t.read_vec(0, 16).unwrap()),
        [2.0, 4.0, 6.0, 8.0],
        "an op reading the view after the update sees the old rows"
    );
}
