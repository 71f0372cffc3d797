//! The graph API's checks and the CPU backend's in-place cache update.

use candle_core::{Device, Tensor as CTensor};
use deepinfer::backend::cpu;
use deepinfer::graph::{
    BinaryOp, CmpOp, DType, GraphBuilder, InputRole, Op, ReduceOp, Tensor, UnaryOp,
};

#[test]
fn shape_mismatches_name_the_op_and_both_shapes() {
    let b = GraphBuilder::new("t");
    let x = b
        .input("x", InputRole::Metadata, [2, 3], DType::F32)
        .unwrap();
    let y = b
        .input("y", InputRole::Metadata, [3, 2], DType::F32)
        .unwrap();
    let err = x.add(&y).unwrap_err().to_string();
    assert!(
        err.contains("add") && err.contains("[2, 3]") && err.contains("[3, 2]"),
        "{err}"
    );
    let err = x.matmul(&x).unwrap_err().to_string();
    assert!(
        err.contains("matmul") && err.contains("[2, 3] f32 x [2, 3] f32"),
        "{err}"
    );
    let i = b.input("i", InputRole::Metadata, [2], DType::I32).unwrap();
    assert!(x.index_select(&i.to_dtype(DType::F32).unwrap(), 0).is_err());
    assert!(
        b.input("x", InputRole::Metadata, [1], DType::F32).is_err(),
        "duplicate input name"
    );
}

#[test]
fn only_cache_roots_of_the_same_shape_can_be_aliased() {
    let b = GraphBuilder::new("t");
    let w = b.input("w", InputRole::Weight, [4, 2], DType::F32).unwrap();
    let root = b
        .input("root", InputRole::CacheRoot, [4, 2], DType::F32)
        .unwrap();
    assert!(b.output_aliased("bad", &w, &w).is_err());
    assert!(b
        .output_aliased("bad", &w.narrow(0, 0, 2).unwrap(), &root)
        .is_err());
    b.output_aliased("root", &w, &root).unwrap();
    let g = b.finish().unwrap();
    assert_eq!(g.outputs()[0].aliases, Some(1));
    let dump = g.to_string();
    assert!(dump.contains("updates root in place"), "{dump}");
}

#[test]
fn cache_root_is_updated_in_place_not_copied() {
    let b = GraphBuilder::new("t");
    let root = b
        .input("root", InputRole::CacheRoot, [4, 3], DType::F32)
        .unwrap();
    let rows = b
        .input("rows", InputRole::Metadata, [2], DType::I32)
        .unwrap();
    let src = b
        .input("src", InputRole::Metadata, [2, 2], DType::F32)
        .unwrap();
    let updated = root.scatter_rows(&rows, 1, &src).unwrap();
    let read = updated
        .narrow(1, 1, 2)
        .unwrap()
        .index_select(&rows, 0)
        .unwrap();
    b.output("read", &read).unwrap();
    b.output_aliased("root", &updated, &root).unwrap();
    let g = b.finish().unwrap();

    let dev = &Device::Cpu;
    let root_t = CTensor::zeros((4, 3), candle_core::DType::F32, dev).unwrap();
    let rows_t = CTensor::new(&[3i32, 1], dev).unwrap();
    let src_t = CTensor::new(&[[1f32, 2.], [3., 4.]], dev).unwrap();
    let out = cpu::run(&g, &[root_t.clone(), rows_t, src_t]).unwrap();
    // The caller's own tensor holds the update: the root was written in place.
    let expect = vec![
        vec![0f32, 0., 0.],
        vec![0., 3., 4.],
        vec![0., 0., 0.],
        vec![0., 1., 2.],
    ];
    assert_eq!(root_t.to_vec2::<f32>().unwrap(), expect);
    assert_eq!(out[1].to_vec2::<f32>().unwrap(), expect);
    assert_eq!(
        out[0].to_vec2::<f32>().unwrap(),
        vec![vec![1f32, 2.], vec![3., 4.]]
    );
}

#[test]
fn a_cast_of_one_repeated_value_converts_the_value_not_every_element() {
    let b = GraphBuilder::new("t");
    let x = b
        .input("x", InputRole::Metadata, [2, 3], DType::I32)
        .unwrap();
    // A constant broadcast, cast: folded into a constant of the target dtype.
    let ones = b
        .full(1.0, [2, 3], DType::I32)
        .unwrap()
        .to_dtype(DType::F32)
        .unwrap();
    let third = b
        .full(1.0 / 3.0, [2, 3], DType::F32)
        .unwrap()
        .to_dtype(DType::BF16)
        .unwrap();
    let truncated = b.scalar_f32(-2.75).to_dtype(DType::I32).unwrap();
    // A value that varies stays a cast.
    let cast = x.to_dtype(DType::F32).unwrap();
    b.output("ones", &ones).unwrap();
    b.output("third", &third).unwrap();
    b.output("truncated", &truncated).unwrap();
    b.output("cast", &cast).unwrap();
    let g = b.finish().unwrap();
    let casts: Vec<_> = g
        .nodes()
        .iter()
        .filter(|n| matches!(n.op, Op::Cast(_)))
        .collect();
    assert_eq!(casts.len(), 1, "only the input's cast is left:\n{g}");

    let dev = &Device::Cpu;
    let x_t = CTensor::new(&[[1i32, -2, 3], [4, 5, -6]], dev).unwrap();
    let out = cpu::run(&g, &[x_t]).unwrap();
    assert_eq!(out[0].to_vec2::<f32>().unwrap(), vec![vec![1f32; 3]; 2]);
    // What a cast of each element computes: f32 1/3 rounded to the nearest bf16, and -2.75
    // truncated towards zero (HLO's convert, and Rust's `as`).
    let bf16_third = half::bf16::from_f32(1.0f32 / 3.0);
    assert_eq!(
        out[1].to_vec2::<half::bf16>().unwrap(),
        vec![vec![bf16_third; 3]; 2]
    );
    assert_eq!(out[2].to_scalar::<i32>().unwrap(), -2);
    assert_eq!(
        out[3].to_vec2::<f32>().unwrap(),
        vec![vec![1f32, -2., 3.], vec![4., 5., -6.]]
    );
}

#[test]
fn named_methods_build_their_families_op() {
    // The named methods are generated one line each (`forward!`): a line naming the wrong
    // variant would build another op under the right name.
    let b = GraphBuilder::new("t");
    let x = b
        .input("x", InputRole::Metadata, [2, 3], DType::F32)
        .unwrap();
    let y = b
        .input("y", InputRole::Metadata, [2, 3], DType::F32)
        .unwrap();
    let i = b
        .input("i", InputRole::Metadata, [2, 3], DType::I32)
        .unwrap();
    let j = b
        .input("j", InputRole::Metadata, [2, 3], DType::I32)
        .unwrap();
    type Build = fn(&Tensor, &Tensor) -> Tensor;
    let unary: [(Build, UnaryOp); 11] = [
        (|x, _| x.neg().unwrap(), UnaryOp::Neg),
        (|x, _| x.abs().unwrap(), UnaryOp::Abs),
        (|x, _| x.exp().unwrap(), UnaryOp::Exp),
        (|x, _| x.log().unwrap(), UnaryOp::Log),
        (|x, _| x.sqrt().unwrap(), UnaryOp::Sqrt),
        (|x, _| x.rsqrt().unwrap(), UnaryOp::Rsqrt),
        (|x, _| x.sin().unwrap(), UnaryOp::Sin),
        (|x, _| x.cos().unwrap(), UnaryOp::Cos),
        (|x, _| x.tanh().unwrap(), UnaryOp::Tanh),
        (|x, _| x.sigmoid().unwrap(), UnaryOp::Sigmoid),
        (|x, _| x.silu().unwrap(), UnaryOp::Silu),
    ];
    let binary: [(Build, BinaryOp); 16] = [
        (|x, y| x.add(y).unwrap(), BinaryOp::Add),
        (|x, y| x.sub(y).unwrap(), BinaryOp::Sub),
        (|x, y| x.mul(y).unwrap(), BinaryOp::Mul),
        (|x, y| x.div(y).unwrap(), BinaryOp::Div),
        (|x, y| x.rem(y).unwrap(), BinaryOp::Rem),
        (|x, y| x.maximum(y).unwrap(), BinaryOp::Max),
        (|x, y| x.minimum(y).unwrap(), BinaryOp::Min),
        (|x, y| x.bitxor(y).unwrap(), BinaryOp::BitXor),
        (|x, y| x.bitand(y).unwrap(), BinaryOp::BitAnd),
        (|x, y| x.shr(y).unwrap(), BinaryOp::Shr),
        (|x, y| x.shl(y).unwrap(), BinaryOp::Shl),
        (|x, y| x.broadcast_add(y).unwrap(), BinaryOp::Add),
        (|x, y| x.broadcast_sub(y).unwrap(), BinaryOp::Sub),
        (|x, y| x.broadcast_mul(y).unwrap(), BinaryOp::Mul),
        (|x, y| x.broadcast_div(y).unwrap(), BinaryOp::Div),
        (|x, y| x.broadcast_maximum(y).unwrap(), BinaryOp::Max),
    ];
    let compare: [(Build, CmpOp); 6] = [
        (|x, y| x.eq(y).unwrap(), CmpOp::Eq),
        (|x, y| x.ne(y).unwrap(), CmpOp::Ne),
        (|x, y| x.lt(y).unwrap(), CmpOp::Lt),
        (|x, y| x.le(y).unwrap(), CmpOp::Le),
        (|x, y| x.gt(y).unwrap(), CmpOp::Gt),
        (|x, y| x.ge(y).unwrap(), CmpOp::Ge),
    ];
    let reduce: [(Build, ReduceOp); 3] = [
        (|x, _| x.sum(1).unwrap(), ReduceOp::Sum),
        (|x, _| x.max(1).unwrap(), ReduceOp::Max),
        (|x, _| x.min(1).unwrap(), ReduceOp::Min),
    ];
    let op_of = |t: Tensor| {
        b.output(format!("o{}", t.id().0), &t).unwrap();
        t.id()
    };
    let mut want = Vec::new();
    for (f, u) in unary {
        want.push((op_of(f(&x, &y)), Op::Unary(u, x.id())));
    }
    for (f, op) in binary {
        let (l, r) = if op.int_only() { (&i, &j) } else { (&x, &y) };
        want.push((op_of(f(l, r)), Op::Binary(op, l.id(), r.id())));
    }
    for (f, c) in compare {
        want.push((op_of(f(&x, &y)), Op::Compare(c, x.id(), y.id())));
    }
    for (f, r) in reduce {
        want.push((op_of(f(&x, &y)), Op::Reduce(r, x.id(), 1)));
    }
    let g = b.finish().unwrap();
    for (id, op) in want {
        assert_eq!(g.node(id).op, op);
    }
}
