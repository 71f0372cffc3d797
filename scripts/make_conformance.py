"""Write the conformance cases under tests/conformance/ with expected values from numpy.

What: one JSON file per op family (unary.json, binary.json, ..., blocks.json). Each case is a
small program over the graph's ops (inputs, a list of ops whose arguments name earlier values,
outputs), its concrete inputs, the outputs numpy computes for it, and how each output is compared.
tests/conformance.rs runs every case on the CPU backend, on emit -> import -> CPU and through
nrt-sim; scripts/xla_conformance.py runs the same cases' HLO in XLA. The format is described in
tests/conformance/README.md.

Why: the expected values come from here, not from deepinfer, so every executor is checked against
an independent reference, and one set of cases serves all executors (the regex crate's testdata
idea). Everything below is plain numpy; nothing imports or runs deepinfer.

How the reference is computed: `evaluate` interprets a program with numpy, op by op. Floats are
evaluated in float64 and rounded to float32 only at the end (the best value an f32 implementation
could return); integers use the exact 32-bit semantics XLA documents (wrapping arithmetic,
truncating division, x / 0 = -1 (signed) or all ones (unsigned), x % 0 = x, shifts by 32 or more
give 0). Each case is also evaluated entirely in float32 and must pass its own comparison rule
against the reference: a tolerance is never tighter than an honest float32 implementation needs,
and integer or bool results that depend on float rounding (a near tie in top-k, say) are refused
as ill-conditioned instead of being written. Blocks also check the program against the textbook
numpy formula of the block, so the op program is known to express what its name says.

Inputs come from a numpy Generator seeded from the case's name (crc32), so adding or editing one
case never changes another's data. Re-running the script rewrites identical bytes.

    python3 -m venv .venv && .venv/bin/pip install -r scripts/requirements-test.txt
    .venv/bin/python scripts/make_conformance.py            # writes tests/conformance/*.json
    .venv/bin/python scripts/make_conformance.py --check    # fails if a file would change
"""

import argparse
import json
import sys
import zlib
from pathlib import Path

import numpy as np

OUT_DIR = Path(__file__).resolve().parent.parent / "tests" / "conformance"

F32, I32, U32, BOOL = "f32", "i32", "u32", "bool"
NP_DTYPE = {F32: np.float32, I32: np.int32, U32: np.uint32, BOOL: np.bool_}
I32_MIN, I32_MAX, U32_MAX = -(2**31), 2**31 - 1, 2**32 - 1
NAN, INF = float("nan"), float("inf")

# Executors, as named in `known_failures` (tests/conformance.rs and scripts/xla_conformance.py).
EXECUTORS = ("cpu", "hlo_cpu", "nrt_sim", "xla")

# Real disagreements found by this suite: case -> executor -> what goes wrong. The executors treat
# an entry as an expected failure and fail when the case passes after all (so an entry is removed
# when the bug is fixed). Each one is a bug to fix, not a tolerance.
CPU_NAN_MAX = "candle's maximum/minimum keep the first operand when the second is NaN (`if a < b {b} else {a}`); XLA and numpy propagate NaN"
CPU_NAN_REDUCE = "candle's max/min reduction skips a NaN unless it is the first element of the row; XLA's reduce and numpy propagate it"
CPU_EMPTY_REDUCE = "candle's max/min reduction refuses an empty dimension (EmptyTensor); XLA returns the reduction's init value (-inf / +inf)"
CPU_NAN_ARGMAX = "candle's argmax skips a NaN unless it is the row's first element; numpy and jnp.argmax return the first NaN"
CPU_INT_SUM = "candle sums integers with `+`, which panics on overflow when overflow checks are on (the test profile; nrt-sim reports the panic as NRT_FAILURE) and wraps only in release builds; HLO's add wraps"
HLO_CPU_NAN_ARGMAX = "emit lowers argmax to reduce-max, compare EQ, select(iota), reduce-min, and the importer keeps those ops: a row whose first element is NaN has a NaN maximum (candle), equal to nothing, so the index is i32::MAX; in the other rows candle's max skips the NaN"
HLO_NAN_ARGMAX = "the argmax lowering (reduce-max, compare EQ, select iota, reduce-min) finds no element equal to a NaN maximum and returns i32::MAX, an out-of-range index"
XLA_ONE_TUPLE = (
    "the harness path, not the module: jax's HLO -> StableHLO conversion (xla_computation_to_mlir_module) returns a "
    "one-element root tuple as a plain array but keeps the alias at output {0}, which XLA then rejects (RET_CHECK "
    "`Trying to set up alias at {0} which is an invalid index`); with a second output the same alias runs "
    "(mla_cache_write_read), and the model's graphs always have two or more outputs"
)
KNOWN_FAILURES = {}  # filled by `known()` below, next to the cases


def known(case, **executors):
    KNOWN_FAILURES[case] = executors


# === Encoding ===


def f32_json(v):
    """A float32 as JSON: NaN and the infinities as strings, finite values as the shortest decimal
    that reads back as the same float32. serde_json's default float parser may be one double ulp
    off, so the decimal is kept only if both neighbouring doubles round to the same float32 too;
    otherwise the exact double value of the float32 is written."""
    v = np.float32(v)
    if np.isnan(v):
        return "nan"
    if np.isinf(v):
        return "inf" if v > 0 else "-inf"
    d = float(str(v))
    ok = all(
        np.float32(x) == v and np.signbit(np.float32(x)) == np.signbit(v)
        for x in (d, np.nextafter(d, INF), np.nextafter(d, -INF))
    )
    return d if ok else float(v)


def encode(arr, dtype):
    flat = np.asarray(arr).reshape(-1)
    if dtype == F32:
        return [f32_json(v) for v in flat.astype(np.float32)]
    if dtype == BOOL:
        return [bool(v) for v in flat]
    return [int(v) for v in flat]


def dtype_of(arr):
    dt = np.asarray(arr).dtype
    if dt == np.bool_:
        return BOOL
    if dt == np.int32:
        return I32
    if dt == np.uint32:
        return U32
    if dt in (np.float32, np.float64):
        return F32
    raise TypeError(f"no graph dtype for {dt}")


# === The numpy interpreter ===

UNARY = {
    "neg": lambda x: np.negative(x),
    "abs": lambda x: np.abs(x),
    "exp": np.exp,
    "log": np.log,
    "sqrt": np.sqrt,
    "rsqrt": lambda x: 1 / np.sqrt(x),
    "sin": np.sin,
    "cos": np.cos,
    "tanh": np.tanh,
    "sigmoid": lambda x: 1 / (1 + np.exp(-x)),
    # The graph's definition (HLO `multiply(x, logistic(x))`), so silu(-inf) = -inf * 0 = NaN.
    "silu": lambda x: x * (1 / (1 + np.exp(-x))),
}
COMPARE = {
    "eq": np.equal,
    "ne": np.not_equal,
    "lt": np.less,
    "le": np.less_equal,
    "gt": np.greater,
    "ge": np.greater_equal,
}
REDUCE_INIT = {
    ("reduce_max", F32): -INF,
    ("reduce_min", F32): INF,
    ("reduce_max", I32): I32_MIN,
    ("reduce_min", I32): I32_MAX,
    ("reduce_max", U32): 0,
    ("reduce_min", U32): U32_MAX,
}


def int_div(a, b, signed):
    """XLA's integer division: truncating; x / 0 = -1 (all ones unsigned); MIN / -1 = MIN."""
    out = []
    for x, y in zip(a.reshape(-1).tolist(), b.reshape(-1).tolist()):
        if y == 0:
            q = -1 if signed else U32_MAX
        elif signed and x == I32_MIN and y == -1:
            q = I32_MIN
        else:
            q = abs(x) // abs(y) * (1 if (x >= 0) == (y >= 0) else -1)
        out.append(q)
    return np.array(out, dtype=a.dtype).reshape(a.shape)


def int_rem(a, b, signed):
    """XLA's integer remainder: the sign of the dividend; x % 0 = x; MIN % -1 = 0."""
    out = []
    for x, y in zip(a.reshape(-1).tolist(), b.reshape(-1).tolist()):
        if y == 0:
            r = x
        elif signed and x == I32_MIN and y == -1:
            r = 0
        else:
            r = abs(x) % abs(y) * (1 if x >= 0 else -1)
        out.append(r)
    return np.array(out, dtype=a.dtype).reshape(a.shape)


def shift(a, b, left):
    """XLA's shift-left / shift-right-logical: on the 32-bit pattern; an amount of 32 or more
    (a negative i32 amount is a large unsigned one) gives 0."""
    ua = a.view(np.uint32).astype(np.uint64)
    ub = b.view(np.uint32).astype(np.uint64)
    big = ub >= 32
    s = np.where(big, 0, ub)
    r = (ua << s) if left else (ua >> s)
    r = np.where(big, 0, r & 0xFFFFFFFF).astype(np.uint32)
    return r.view(a.dtype)


def cast(x, to, ftype):
    """Conversion as XLA (and Rust's `as`) define it: float to integer truncates toward zero and
    saturates, NaN becomes 0 (numpy's own cast of NaN or out-of-range values is undefined, so the
    rule is spelled out); integer to integer wraps; to f32 rounds to nearest even."""
    if to == F32:
        return x.astype(np.float32).astype(ftype)
    if x.dtype.kind == "f":
        lo, hi = (I32_MIN, I32_MAX) if to == I32 else (0, U32_MAX)
        t = np.trunc(np.nan_to_num(x.astype(np.float64), nan=0.0, posinf=hi, neginf=lo))
        return np.clip(t, lo, hi).astype(np.int64).astype(NP_DTYPE[to])
    return x.astype(np.int64).astype(NP_DTYPE[to]) if x.dtype != np.bool_ else x.astype(NP_DTYPE[to])


def topk(x, k):
    """Indices of the k largest along the last dim, largest first, ties to the lower index; NaN
    ranks above +inf (XLA's total order, numpy's sort order)."""
    rows = x.reshape(-1, x.shape[-1])
    out = []
    for row in rows:
        order = sorted(range(len(row)), key=lambda i: (not np.isnan(row[i]), -row[i] if not np.isnan(row[i]) else 0.0, i))
        out.append(order[:k])
    return np.array(out, dtype=np.int32).reshape(x.shape[:-1] + (k,))


def evaluate(case, ftype):
    """Runs a case's program with numpy, floats in `ftype`. Returns {output name: array}."""
    env = {}
    for inp in case.inputs:
        a = inp["array"]
        env[inp["name"]] = a.astype(ftype) if a.dtype == np.float32 else a.copy()
    with np.errstate(all="ignore"):
        for st in case.program:
            env[st["out"]] = run_op(st, [env[a] for a in st["args"]], ftype)
    return {o["name"]: env[o["value"]] for o in case.outputs}


def run_op(st, args, ftype):
    op = st["op"]
    x = args[0] if args else None
    if op == "constant":
        a = np.array(st["data_array"], dtype=NP_DTYPE[st["dtype"]]).reshape(st["shape"])
        return a.astype(ftype) if st["dtype"] == F32 else a
    if op == "iota":
        shape, dim = st["shape"], st["dim"]
        line = np.arange(shape[dim]).reshape([shape[dim] if d == dim else 1 for d in range(len(shape))])
        dt = ftype if st["dtype"] == F32 else NP_DTYPE[st["dtype"]]
        return np.broadcast_to(line, shape).astype(dt)
    if op in UNARY:
        return UNARY[op](x)
    if op in ("add", "sub", "mul", "div", "rem", "maximum", "minimum", "bitxor", "bitand", "shr", "shl"):
        y = args[1]
        assert x.shape == y.shape and x.dtype == y.dtype, st
        signed = x.dtype == np.int32
        if op == "add":
            return x + y
        if op == "sub":
            return x - y
        if op == "mul":
            return x * y
        if op == "div":
            return x / y if x.dtype.kind == "f" else int_div(x, y, signed)
        if op == "rem":
            return int_rem(x, y, signed)
        if op == "maximum":
            return np.maximum(x, y)
        if op == "minimum":
            return np.minimum(x, y)
        if op == "bitxor":
            return x ^ y
        if op == "bitand":
            return x & y
        return shift(x, y, left=(op == "shl"))
    if op in COMPARE:
        return COMPARE[op](x, args[1])
    if op == "where":
        return np.where(x, args[1], args[2])
    if op == "cast":
        return cast(x, st["dtype"], ftype)
    if op == "broadcast":
        return np.broadcast_to(x, st["shape"]).copy()
    if op == "reshape":
        return x.reshape(st["shape"])
    if op == "permute":
        return np.transpose(x, st["perm"])
    if op == "slice":
        idx = [slice(None)] * x.ndim
        idx[st["dim"]] = slice(st["start"], st["start"] + st["len"])
        return x[tuple(idx)]
    if op == "concat":
        return np.concatenate(args, axis=st["dim"])
    if op == "matmul":
        return np.matmul(x, args[1])
    if op in ("reduce_sum", "reduce_max", "reduce_min"):
        d = st["dim"]
        if op == "reduce_sum":
            return np.sum(x, axis=d, dtype=x.dtype)
        init = REDUCE_INIT[(op, dtype_of(x))]
        f = np.max if op == "reduce_max" else np.min
        return f(x, axis=d, initial=np.array(init).astype(x.dtype))
    if op == "argmax":
        return np.argmax(x, axis=st["dim"]).astype(np.int32)
    if op == "topk":
        return topk(x, st["k"])
    if op == "index_select":
        return np.take(x, args[1], axis=st["dim"])
    if op == "gather":
        return np.take_along_axis(x, args[1].astype(np.int64), axis=st["dim"])
    if op == "scatter_rows":
        root, rows, src = x.copy(), args[1], args[2]
        w = src.shape[1]
        for i, r in enumerate(rows.tolist()):
            root[r, st["col"] : st["col"] + w] = src[i]
        return root
    raise ValueError(f"unknown op {op}")


# === Comparison (the same rule the executors apply) ===


def passes(got, want, out):
    """Whether `got` satisfies output `out`'s rule against `want` (both numpy arrays)."""
    if got.shape != want.shape:
        return False
    if out["dtype"] != F32:
        return np.array_equal(got, want)
    g, w = got.astype(np.float64), want.astype(np.float64)
    if not np.array_equal(np.isnan(g), np.isnan(w)):
        return False
    inf = np.isinf(w) | np.isinf(g)
    if not np.array_equal(g[inf], w[inf]):
        return False
    fin = ~(np.isnan(w) | inf)
    return bool(np.all(np.abs(g[fin] - w[fin]) <= out["atol"] + out["rtol"] * np.abs(w[fin])))


# === Building cases ===


class Case:
    """One case under construction: `input`, then ops through `op`, then `output`."""

    def __init__(self, family, name, doc):
        self.family, self.name, self.doc = family, name, doc
        self.rng = np.random.default_rng(zlib.crc32(name.encode()))
        self.inputs, self.program, self.outputs = [], [], []
        self.counter = 0
        self.check = None

    def input(self, name, data, dtype=None, role="metadata"):
        a = np.asarray(data)
        dtype = dtype or dtype_of(a)
        a = a.astype(NP_DTYPE[dtype])
        self.inputs.append({"name": name, "dtype": dtype, "shape": list(a.shape), "role": role, "array": a})
        return name

    def op(self, op, *args, out=None, **attrs):
        self.counter += 1
        out = out or f"v{self.counter}"
        self.program.append({"out": out, "op": op, "args": list(args), **attrs})
        return out

    def const(self, data, dtype, shape=None):
        a = np.asarray(data, dtype=NP_DTYPE[dtype])
        shape = list(a.shape) if shape is None else shape
        return self.op("constant", dtype=dtype, shape=shape, data_array=a.reshape(-1))

    def output(self, value, name=None, aliases=None, atol=None, rtol=None):
        o = {"name": name or value, "value": value}
        if aliases:
            o["aliases"] = aliases
        if atol is not None:
            o["atol"], o["rtol"] = atol, rtol
        self.outputs.append(o)
        return o

    def finish(self):
        ref = evaluate(self, np.float64)
        low = evaluate(self, np.float32)
        for o in self.outputs:
            want = ref[o["name"]]
            o["dtype"] = dtype_of(want)
            o["shape"] = list(want.shape)
            if o["dtype"] == F32:
                assert "atol" in o, f"{self.name}.{o['name']}: a float output needs atol and rtol"
                with np.errstate(over="ignore"):
                    want = want.astype(np.float32)
            else:
                assert "atol" not in o, f"{self.name}.{o['name']}: integer and bool outputs are exact"
            o["array"] = want
            if not passes(low[o["name"]], want, o):
                raise SystemExit(
                    f"{self.name}.{o['name']}: the float32 evaluation fails the case's own rule "
                    f"(ill-conditioned inputs or a tolerance below float32 rounding):\n"
                    f"  f32: {low[o['name']].reshape(-1)[:16]}\n  ref: {want.reshape(-1)[:16]}"
                )
        if self.check is not None:
            self.check(ref)
        return self

    def to_json(self):
        case = {"name": self.name, "doc": self.doc}
        case["inputs"] = [
            {"name": i["name"], "dtype": i["dtype"], "shape": i["shape"], "role": i["role"], "data": encode(i["array"], i["dtype"])}
            for i in self.inputs
        ]
        prog = []
        for st in self.program:
            s = {k: v for k, v in st.items() if k != "data_array"}
            if st["op"] == "constant":
                s["data"] = encode(st["data_array"], st["dtype"])
            prog.append(s)
        case["program"] = prog
        outs = []
        for o in self.outputs:
            e = {"name": o["name"], "value": o["value"]}
            if "aliases" in o:
                e["aliases"] = o["aliases"]
            e["dtype"], e["shape"] = o["dtype"], o["shape"]
            if o["dtype"] == F32:
                e["atol"], e["rtol"] = o["atol"], o["rtol"]
            e["data"] = encode(o["array"], o["dtype"])
            outs.append(e)
        case["outputs"] = outs
        case["known_failures"] = KNOWN_FAILURES.get(self.name, {})
        assert set(case["known_failures"]) <= set(EXECUTORS), self.name
        return case


def close_to(formula, rtol=1e-12, atol=1e-12):
    """A block check: the program's float64 result equals the textbook formula's. The formula
    runs now, while the variables it closes over still hold this case's data."""
    with np.errstate(all="ignore"):
        wanted = formula()

    def check(ref):
        for name, want in wanted.items():
            got = ref[name]
            ok = np.allclose(got, want, rtol=rtol, atol=atol, equal_nan=True) if got.dtype.kind == "f" else np.array_equal(got, want)
            assert ok, f"the program does not compute the block's formula for {name}:\n{got}\n{want}"

    return check


# === Shared input patterns ===

# Float edge values every elementwise op sees.
F_EDGES = [NAN, INF, -INF, 0.0, -0.0, 1.0, -1.0, 0.5]
I_EDGES = [I32_MIN, I32_MIN + 1, -7, -1, 0, 1, 7, 31, 32, 33, I32_MAX]
U_EDGES = [0, 1, 2, 7, 31, 32, 33, 0x7FFFFFFF, 0x80000000, 0x85EBCA6B, U32_MAX]


def grid(edges, dtype):
    """Every ordered pair of edge values, as two flat arrays."""
    a = np.array([x for x in edges for _ in edges], dtype=NP_DTYPE[dtype])
    b = np.array([y for _ in edges for y in edges], dtype=NP_DTYPE[dtype])
    return a, b


def ints(rng, shape, dtype, lo=None, hi=None):
    if dtype == I32:
        lo, hi = (I32_MIN if lo is None else lo), (I32_MAX if hi is None else hi)
    else:
        lo, hi = (0 if lo is None else lo), (U32_MAX if hi is None else hi)
    return rng.integers(lo, hi, size=shape, endpoint=True, dtype=np.int64).astype(NP_DTYPE[dtype])


def floats(rng, shape, lo=-4.0, hi=4.0):
    return rng.uniform(lo, hi, size=shape).astype(np.float32)


# === Families ===

# Tolerances for the transcendental functions, as |got - want| <= atol + rtol * |want|.
# rtol 2e-6 (about 16 float32 ulps): candle calls libm (within 1-2 ulps) and then, for rsqrt and
# sigmoid, rounds once or twice more; XLA's CPU backend uses its own approximations of tanh and
# logistic (measured with jaxlib 0.10.2 on these cases: at most 2 ulps). A wrong function (a
# missing scale, the wrong branch of a special case) is off by far more.
# atol 1e-37: XLA's CPU backend flushes subnormal results to zero (exp(-100), sigmoid(-100)), an
# absolute error below the smallest normal float.
# sin/cos get atol 1e-6 instead, for the cancellation near their zeros (the absolute error follows
# the argument's magnitude, not the result's).
# neg, abs and sqrt are exact: IEEE sqrt is correctly rounded, and so is the float64 square root
# rounded to float32 (53 >= 2 * 24 + 2 bits, so the double rounding is harmless).
TRANSCENDENTAL = {"atol": 1e-37, "rtol": 2e-6}
EXACT = {"atol": 0.0, "rtol": 0.0}


def unary_cases():
    fam = "unary"
    domains = {
        "neg": (-4, 4, []),
        "abs": (-4, 4, []),
        "exp": (-10, 10, [88.0, 89.0, -87.0, -104.0, -100.0]),
        "log": (0.01, 100, [1e-30, 2.0, -1.0]),
        "sqrt": (0, 100, [2.0, 1e-30, -1.0, 4.0]),
        "rsqrt": (0.01, 100, [2.0, 1e-30, -1.0, 4.0]),
        "sin": (-10, 10, [3.1415927, -3.1415927]),
        "cos": (-10, 10, [1.5707964, -1.5707964]),
        "tanh": (-5, 5, [20.0, -20.0, 1e-4, -1e-4]),
        "sigmoid": (-10, 10, [100.0, -100.0, 30.0, -30.0]),
        "silu": (-10, 10, [100.0, -100.0, 30.0, -30.0]),
    }
    cases = []
    for op, (lo, hi, extra) in domains.items():
        c = Case(fam, f"{op}_f32", f"{op} on float32: a random sample of its domain, NaN, +-inf, +-0 and the op's own edges")
        x = np.concatenate([np.array(F_EDGES + extra, dtype=np.float32), floats(c.rng, 24, lo, hi)])
        c.input("x", x)
        c.output(c.op(op, "x"), "y", **(EXACT if op in ("neg", "abs", "sqrt") else TRANSCENDENTAL))
        if op in ("sin", "cos"):
            c.outputs[-1]["atol"] = 1e-6
        cases.append(c)
    for op in ("neg", "abs"):
        c = Case(fam, f"{op}_i32", f"{op} on i32 wraps: {op}(i32::MIN) = i32::MIN")
        c.input("x", np.concatenate([np.array(I_EDGES, dtype=np.int32), ints(c.rng, 5, I32)]))
        c.output(c.op(op, "x"), "y")
        cases.append(c)
    c = Case(fam, "exp_empty", "an elementwise op on a [0, 3] value gives a [0, 3] value")
    c.input("x", np.zeros((0, 3), dtype=np.float32))
    c.output(c.op("exp", "x"), "y", **TRANSCENDENTAL)
    cases.append(c)
    c = Case(fam, "tanh_scalar", "a rank-0 operand")
    c.input("x", np.float32(0.75))
    c.output(c.op("tanh", "x"), "y", **TRANSCENDENTAL)
    cases.append(c)
    return cases


def binary_cases():
    fam = "binary"
    cases = []
    for op in ("add", "sub", "mul", "div", "maximum", "minimum"):
        c = Case(fam, f"{op}_f32", f"{op} on float32: every pair of NaN, +-inf, +-0, +-1, 0.5, then random pairs")
        a, b = grid(F_EDGES, F32)
        c.input("a", np.concatenate([a, floats(c.rng, 16, -100, 100)]))
        c.input("b", np.concatenate([b, floats(c.rng, 16, -100, 100)]))
        # Exact: IEEE add, sub, mul and div are correctly rounded, and rounding the float64
        # result to float32 is the correctly rounded float32 result (53 >= 2 * 24 + 2 bits).
        c.output(c.op(op, "a", "b"), "y", **EXACT)
        cases.append(c)
    known("maximum_f32", cpu=CPU_NAN_MAX, hlo_cpu=CPU_NAN_MAX, nrt_sim=CPU_NAN_MAX)
    known("minimum_f32", cpu=CPU_NAN_MAX, hlo_cpu=CPU_NAN_MAX, nrt_sim=CPU_NAN_MAX)
    ops = ("add", "sub", "mul", "div", "rem", "maximum", "minimum", "bitxor", "bitand", "shr", "shl")
    for dtype, edges in ((I32, I_EDGES), (U32, U_EDGES)):
        for op in ops:
            c = Case(fam, f"{op}_{dtype}", f"{op} on {dtype}: every pair of edge values (wrapping, division by zero, shifts of 32 or more), then random pairs")
            a, b = grid(edges, dtype)
            hi = 40 if op in ("shr", "shl") else None
            c.input("a", np.concatenate([a, ints(c.rng, 8, dtype)]))
            c.input("b", np.concatenate([b, ints(c.rng, 8, dtype, lo=0 if hi else None, hi=hi)]))
            c.output(c.op(op, "a", "b"), "y")
            cases.append(c)
    c = Case(fam, "add_empty", "add of two [2, 0] values")
    c.input("a", np.zeros((2, 0), dtype=np.float32))
    c.input("b", np.zeros((2, 0), dtype=np.float32))
    c.output(c.op("add", "a", "b"), "y", **EXACT)
    cases.append(c)
    c = Case(fam, "mul_scalar", "mul of two rank-0 values")
    c.input("a", np.float32(1.5))
    c.input("b", np.float32(-2.25))
    c.output(c.op("mul", "a", "b"), "y", **EXACT)
    cases.append(c)
    c = Case(fam, "mul_u32_hash_constant", "the sampler's hash step: u32 multiply by murmur3's constant wraps")
    c.input("a", ints(c.rng, 16, U32))
    k = c.op("broadcast", c.const([0x85EBCA6B], U32, []), shape=[16])
    c.output(c.op("mul", "a", k), "y")
    cases.append(c)
    return cases


def compare_cases():
    fam = "compare"
    cases = []
    for op in COMPARE:
        c = Case(fam, f"{op}_f32", f"{op} on float32: NaN is unordered (only ne holds), -0 == 0, infinities compare")
        a, b = grid(F_EDGES, F32)
        c.input("a", np.concatenate([a, floats(c.rng, 8)]))
        c.input("b", np.concatenate([b, floats(c.rng, 8)]))
        c.output(c.op(op, "a", "b"), "y")
        cases.append(c)
    for dtype, edges in ((I32, I_EDGES), (U32, U_EDGES)):
        for op in COMPARE:
            c = Case(fam, f"{op}_{dtype}", f"{op} on {dtype} ({'signed' if dtype == I32 else 'unsigned: 0x80000000 > 1'})")
            a, b = grid(edges, dtype)
            c.input("a", a)
            c.input("b", b)
            c.output(c.op(op, "a", "b"), "y")
            cases.append(c)
    for op in COMPARE:
        c = Case(fam, f"{op}_bool", f"{op} on bool (false < true)")
        c.input("a", np.array([False, False, True, True]))
        c.input("b", np.array([False, True, False, True]))
        c.output(c.op(op, "a", "b"), "y")
        cases.append(c)
    c = Case(fam, "lt_broadcast", "compare broadcasts its operands ([3, 1] against [1, 4]), as the causal mask is built")
    c.input("q", np.array([[0], [1], [2]], dtype=np.int32))
    c.input("k", np.array([[0, 1, 2, 3]], dtype=np.int32))
    c.output(c.op("le", "k", "q"), "visible")
    cases.append(c)
    c = Case(fam, "gt_empty", "compare of [0] values")
    c.input("a", np.zeros(0, dtype=np.float32))
    c.input("b", np.zeros(0, dtype=np.float32))
    c.output(c.op("gt", "a", "b"), "y")
    cases.append(c)
    return cases


def select_cases():
    fam = "select"
    cases = []
    for dtype in (F32, I32, U32, BOOL):
        c = Case(fam, f"select_{dtype}", f"select on {dtype} branches; a NaN in the branch not taken does not leak")
        n = 12
        c.input("p", c.rng.integers(0, 2, n).astype(bool))
        if dtype == F32:
            t = np.array([NAN, INF, -INF, 1.0, -0.0, 2.5] * 2, dtype=np.float32)
            f = np.array([0.5, NAN, 3.0, -INF, INF, NAN] * 2, dtype=np.float32)
        elif dtype == BOOL:
            t, f = c.rng.integers(0, 2, n).astype(bool), c.rng.integers(0, 2, n).astype(bool)
        else:
            t, f = ints(c.rng, n, dtype), ints(c.rng, n, dtype)
        c.input("t", t, dtype)
        c.input("f", f, dtype)
        c.output(c.op("where", "p", "t", "f"), "y", **(EXACT if dtype == F32 else {}))
        cases.append(c)
    c = Case(fam, "select_broadcast_mask", "a [3, 1] predicate and a scalar -inf branch broadcast against [3, 4] scores (the attention mask)")
    c.input("p", np.array([[True], [False], [True]]))
    c.input("s", floats(c.rng, (3, 4)))
    ninf = c.const([-INF], F32, [])
    c.output(c.op("where", "p", "s", ninf), "y", **EXACT)
    cases.append(c)
    c = Case(fam, "select_empty", "select of [0, 2] values")
    c.input("p", np.zeros((0, 2), dtype=bool))
    c.input("t", np.zeros((0, 2), dtype=np.float32))
    c.input("f", np.zeros((0, 2), dtype=np.float32))
    c.output(c.op("where", "p", "t", "f"), "y", **EXACT)
    cases.append(c)
    return cases


def convert_cases():
    fam = "convert"
    cases = []
    fvals = [NAN, INF, -INF, 0.0, -0.0, 0.5, -0.5, 0.999, -0.999, 2.5, -2.5, 1e9, -1e9, 3e9, -3e9, 5e9, 16777217.0, 2147483520.0, -2147483648.0]
    for to in (I32, U32):
        c = Case(fam, f"f32_to_{to}", f"f32 -> {to}: truncates toward zero, saturates out of range, NaN -> 0")
        c.input("x", np.concatenate([np.array(fvals, dtype=np.float32), floats(c.rng, 8, -1000, 1000)]))
        c.output(c.op("cast", "x", dtype=to), "y")
        cases.append(c)
    c = Case(fam, "i32_to_f32", "i32 -> f32 rounds to nearest even above 2^24")
    c.input("x", np.array(I_EDGES + [16777217, 16777219, -16777217, 123456789], dtype=np.int32))
    c.output(c.op("cast", "x", dtype=F32), "y", **EXACT)
    cases.append(c)
    c = Case(fam, "u32_to_f32", "u32 -> f32: u32::MAX rounds to 2^32; the sampler's 24-bit draws are exact")
    c.input("x", np.array(U_EDGES + [16777215, 16777217, 0xFFFFFF00], dtype=np.uint32))
    c.output(c.op("cast", "x", dtype=F32), "y", **EXACT)
    cases.append(c)
    c = Case(fam, "i32_to_u32", "i32 -> u32 keeps the bit pattern (-1 -> u32::MAX)")
    c.input("x", np.array(I_EDGES, dtype=np.int32))
    c.output(c.op("cast", "x", dtype=U32), "y")
    cases.append(c)
    c = Case(fam, "u32_to_i32", "u32 -> i32 keeps the bit pattern (0x80000000 -> i32::MIN)")
    c.input("x", np.array(U_EDGES, dtype=np.uint32))
    c.output(c.op("cast", "x", dtype=I32), "y")
    cases.append(c)
    for to in (F32, I32, U32):
        c = Case(fam, f"bool_to_{to}", f"bool -> {to} is 0 or 1")
        c.input("x", np.array([True, False, True, True, False]))
        c.output(c.op("cast", "x", dtype=to), "y", **(EXACT if to == F32 else {}))
        cases.append(c)
    c = Case(fam, "f32_to_i32_empty", "a cast of a [0] value")
    c.input("x", np.zeros(0, dtype=np.float32))
    c.output(c.op("cast", "x", dtype=I32), "y")
    cases.append(c)
    return cases


def shape_cases():
    fam = "shape"
    cases = []

    def simple(name, doc, x, op, **attrs):
        c = Case(fam, name, doc)
        c.input("x", x)
        c.output(c.op(op, "x", **attrs), "y", **(EXACT if dtype_of(x) == F32 else {}))
        cases.append(c)
        return c

    r = np.random.default_rng(zlib.crc32(b"shape"))
    f = lambda *s: floats(r, s)  # noqa: E731
    simple("broadcast_size1", "[3, 1] -> [3, 4]: a size-1 dim expands", f(3, 1), "broadcast", shape=[3, 4])
    simple("broadcast_rank", "[4] -> [2, 3, 4]: dims align to the right", f(4), "broadcast", shape=[2, 3, 4])
    simple("broadcast_middle", "[2, 1, 4] -> [2, 3, 4]", f(2, 1, 4), "broadcast", shape=[2, 3, 4])
    simple("broadcast_scalar_i32", "a rank-0 i32 -> [2, 3]", np.int32(-5), "broadcast", shape=[2, 3])
    simple("broadcast_to_empty", "[1, 3] -> [0, 3]: a size-1 dim may expand to 0", f(1, 3), "broadcast", shape=[0, 3])
    simple("broadcast_bool", "a [2, 1] bool -> [2, 3]", np.array([[True], [False]]), "broadcast", shape=[2, 3])
    simple("broadcast_nan", "NaN and inf are copied, not computed on", np.array([NAN, -INF], dtype=np.float32), "broadcast", shape=[3, 2])
    simple("reshape_f32", "[2, 6] -> [3, 4], row-major", f(2, 6), "reshape", shape=[3, 4])
    simple("reshape_u32", "[12] -> [2, 2, 3] of u32", ints(r, 12, U32), "reshape", shape=[2, 2, 3])
    simple("reshape_scalar", "rank 0 -> [1, 1]", np.float32(7.0), "reshape", shape=[1, 1])
    simple("reshape_empty", "[0, 4] -> [2, 0, 3]", np.zeros((0, 4), dtype=np.float32), "reshape", shape=[2, 0, 3])
    simple("permute_3d", "perm [2, 0, 1] of a [2, 3, 4] value", f(2, 3, 4), "permute", perm=[2, 0, 1])
    simple("permute_4d_i32", "perm [0, 2, 1, 3] of a [2, 3, 2, 2] i32 value", ints(r, (2, 3, 2, 2), I32), "permute", perm=[0, 2, 1, 3])
    simple("transpose_2d", "the last two dims swapped (t())", f(3, 5), "permute", perm=[1, 0])
    simple("transpose_bool", "a bool [2, 3] transposed", r.integers(0, 2, (2, 3)).astype(bool), "permute", perm=[1, 0])
    simple("slice_middle", "narrow(1, 2, 3) of [3, 8]", f(3, 8), "slice", dim=1, start=2, len=3)
    simple("slice_dim0_i32", "narrow(0, 1, 2) of an i32 [4, 3]", ints(r, (4, 3), I32), "slice", dim=0, start=1, len=2)
    simple("slice_empty", "narrow(1, 3, 0): an empty slice", f(2, 5), "slice", dim=1, start=3, len=0)
    simple("slice_last", "narrow(2, 3, 1) of [2, 2, 4] (a rope pair's odd half)", f(2, 2, 4), "slice", dim=2, start=3, len=1)
    for name, doc, parts, dim in (
        ("concat_dim0", "three f32 operands along dim 0", [f(1, 3), f(2, 3), f(3, 3)], 0),
        ("concat_dim1", "two f32 operands along dim 1 (the cache row: latent then rope key)", [f(2, 4), f(2, 2)], 1),
        ("concat_with_empty", "an empty operand contributes nothing", [f(2, 2), np.zeros((2, 0), dtype=np.float32), f(2, 1)], 1),
        ("concat_i32_dim2", "i32 operands along the last of three dims (gather coordinates)", [ints(r, (2, 2, 1), I32), ints(r, (2, 2, 1), I32)], 2),
        ("concat_bool", "bool operands", [np.array([True, False]), np.array([False])], 0),
        ("concat_single", "one operand", [f(2, 2)], 0),
    ):
        c = Case(fam, name, doc)
        names = [c.input(f"x{i}", p) for i, p in enumerate(parts)]
        c.output(c.op("concat", *names, dim=dim), "y", **(EXACT if dtype_of(parts[0]) == F32 else {}))
        cases.append(c)
    for dtype in (I32, U32, BOOL):
        c = Case(fam, f"movement_{dtype}", f"reshape, permute, slice, broadcast and concat on a {dtype} value (data movement never looks at the values)")
        x = c.rng.integers(0, 2, (2, 3)).astype(bool) if dtype == BOOL else ints(c.rng, (2, 3), dtype)
        c.input("x", x)
        r_ = c.op("reshape", "x", shape=[3, 2, 1])
        p_ = c.op("permute", r_, perm=[2, 0, 1])
        s_ = c.op("slice", p_, dim=1, start=1, len=2)
        b_ = c.op("broadcast", s_, shape=[2, 2, 2])
        c.output(c.op("concat", b_, s_, dim=0), "y")
        cases.append(c)
    c = Case(fam, "unsqueeze_squeeze", "a size-1 dim inserted and removed (both reshapes), around a broadcast")
    c.input("x", floats(c.rng, (3,)))
    u = c.op("reshape", "x", shape=[3, 1])
    b = c.op("broadcast", u, shape=[3, 2])
    s = c.op("slice", b, dim=1, start=1, len=1)
    c.output(c.op("reshape", s, shape=[3]), "y", **EXACT)
    cases.append(c)
    return cases


def iota_cases():
    fam = "iota"
    cases = []
    for name, doc, dtype, shape, dim in (
        ("iota_i32_dim1", "indices along dim 1 of [3, 5]", I32, [3, 5], 1),
        ("iota_i32_dim0", "indices along dim 0 of [4, 2]", I32, [4, 2], 0),
        ("iota_i32_3d", "indices along the last dim of [2, 3, 4] (the MoE one-hot)", I32, [2, 3, 4], 2),
        ("iota_f32", "float indices along dim 0 of [6]", F32, [6], 0),
        ("iota_empty", "an empty [0, 3] iota", I32, [0, 3], 1),
    ):
        c = Case(fam, name, doc)
        v = c.op("iota", dtype=dtype, shape=shape, dim=dim)
        c.output(v, "y", **(EXACT if dtype == F32 else {}))
        cases.append(c)
    return cases


def constant_cases():
    fam = "constant"
    cases = []
    for name, doc, data, dtype, shape in (
        ("constant_f32_edges", "float literals including NaN, +-inf and -0", [NAN, INF, -INF, -0.0, 1e-30, 3.4028235e38, 0.1, -2.5], F32, [2, 4]),
        ("constant_i32", "i32 literals at both ends of the range", [I32_MIN, -1, 0, 1, I32_MAX, 7], I32, [3, 2]),
        ("constant_u32", "u32 literals, including values above i32::MAX", [0, 1, 0x80000000, U32_MAX], U32, [4]),
        ("constant_scalar", "a rank-0 literal", [0.25], F32, []),
        ("constant_empty", "an empty [0, 2] literal", [], F32, [0, 2]),
    ):
        c = Case(fam, name, doc)
        c.input("x", np.ones(shape, dtype=NP_DTYPE[dtype]))
        k = c.const(data, dtype, shape)
        # Added to an input, so the literal feeds a computation as well as being an output.
        c.output(k, "k", **(EXACT if dtype == F32 else {}))
        c.output(c.op("add", "x", k), "y", **(EXACT if dtype == F32 else {}))
        cases.append(c)
    return cases


def reduce_cases():
    fam = "reduce"
    cases = []
    # Sums: the executors add in different orders, so the error is a few ulps of the largest
    # partial sum: atol 1e-5 for inputs within [-4, 4] and at most 8 terms, rtol 1e-6.
    SUM = {"atol": 1e-5, "rtol": 1e-6}
    for op in ("reduce_sum", "reduce_max", "reduce_min"):
        for dim in (0, 1, 2):
            c = Case(fam, f"{op[7:]}_f32_dim{dim}", f"{op} over dim {dim} of a random [3, 4, 5] value")
            c.input("x", floats(c.rng, (3, 4, 5)))
            c.output(c.op(op, "x", dim=dim), "y", **(SUM if op == "reduce_sum" else EXACT))
            cases.append(c)
        c = Case(fam, f"{op[7:]}_f32_edges", f"{op} over rows holding NaN (first or later), +-inf, inf and -inf together, all -inf")
        x = np.array(
            [
                [NAN, 1.0, 2.0, 3.0],
                [1.0, NAN, 2.0, 3.0],
                [1.0, 2.0, 3.0, NAN],
                [INF, 1.0, 2.0, 3.0],
                [-INF, -1.0, -2.0, -3.0],
                [INF, -INF, 0.0, 1.0],
                [-INF, -INF, -INF, -INF],
                [-0.0, 0.0, -0.0, 0.0],
            ],
            dtype=np.float32,
        )
        c.input("x", x)
        c.output(c.op(op, "x", dim=1), "y", **(SUM if op == "reduce_sum" else EXACT))
        cases.append(c)
        if op != "reduce_sum":
            known(c.name, cpu=CPU_NAN_REDUCE, hlo_cpu=CPU_NAN_REDUCE, nrt_sim=CPU_NAN_REDUCE)
        c = Case(fam, f"{op[7:]}_f32_empty_dim", f"{op} over a dimension of size 0 gives the init value ({'0' if op == 'reduce_sum' else '-inf' if op == 'reduce_max' else '+inf'})")
        c.input("x", np.zeros((3, 0), dtype=np.float32))
        c.output(c.op(op, "x", dim=1), "y", **EXACT)
        cases.append(c)
        if op != "reduce_sum":
            known(c.name, cpu=CPU_EMPTY_REDUCE, hlo_cpu=CPU_EMPTY_REDUCE, nrt_sim=CPU_EMPTY_REDUCE)
        c = Case(fam, f"{op[7:]}_f32_empty_rest", f"{op} over a full dim of a [0, 4] value gives a [0] value")
        c.input("x", np.zeros((0, 4), dtype=np.float32))
        c.output(c.op(op, "x", dim=1), "y", **EXACT)
        cases.append(c)
        if op != "reduce_sum":
            why = "candle's max/min reduction refuses any empty input (EmptyTensor), even when only the kept dims are empty and the result is an empty value"
            known(c.name, cpu=why, hlo_cpu=why, nrt_sim=why)
        for dtype in (I32, U32):
            c = Case(fam, f"{op[7:]}_{dtype}", f"{op} on {dtype} over dim 1 (sums wrap on overflow)")
            x = ints(c.rng, (4, 3), dtype)
            c.input("x", x)
            c.output(c.op(op, "x", dim=1), "y")
            cases.append(c)
            if op == "reduce_sum":
                known(c.name, cpu=CPU_INT_SUM, hlo_cpu=CPU_INT_SUM, nrt_sim=CPU_INT_SUM)
    c = Case(fam, "sum_i32_small", "an i32 sum that does not overflow (the MoE hit count)")
    c.input("x", ints(c.rng, (3, 5), I32, -100, 100))
    c.output(c.op("reduce_sum", "x", dim=0), "y")
    cases.append(c)
    return cases


def argmax_cases():
    fam = "argmax"
    cases = []
    c = Case(fam, "argmax_ties", "the first maximum wins ties; -inf and all-equal rows")
    x = np.array([[1, 3, 3, 0], [-INF, -INF, -INF, -INF], [2, 2, 2, 2], [-INF, -5, -INF, -5], [INF, 1, INF, 0]], dtype=np.float32)
    c.input("x", x)
    c.output(c.op("argmax", "x", dim=1), "y")
    cases.append(c)
    for dim in (0, 1, 2):
        c = Case(fam, f"argmax_dim{dim}", f"argmax over dim {dim} of a random [3, 4, 5] value")
        c.input("x", floats(c.rng, (3, 4, 5)))
        c.output(c.op("argmax", "x", dim=dim), "y")
        cases.append(c)
    c = Case(fam, "argmax_rank1", "argmax of a [7] value is a rank-0 index")
    c.input("x", floats(c.rng, (7,)))
    c.output(c.op("argmax", "x", dim=0), "y")
    cases.append(c)
    c = Case(fam, "argmax_nan", "a NaN is the maximum (numpy, jnp.argmax): the first NaN's index")
    x = np.array([[NAN, 1, 2, 3], [1, NAN, 5, 3], [1, 2, 3, NAN], [NAN, NAN, 1, 0]], dtype=np.float32)
    c.input("x", x)
    c.output(c.op("argmax", "x", dim=1), "y")
    cases.append(c)
    known("argmax_nan", cpu=CPU_NAN_ARGMAX, hlo_cpu=HLO_CPU_NAN_ARGMAX, nrt_sim=HLO_CPU_NAN_ARGMAX, xla=HLO_NAN_ARGMAX)
    return cases


def matmul_cases():
    fam = "matmul"
    cases = []
    # Products of at most 16 terms of inputs within [-4, 4]: rtol 1e-5 and atol 2e-5 cover
    # summation-order differences (a few ulps of the largest partial sum, |sum| <= 256).
    MM = {"atol": 2e-5, "rtol": 1e-5}
    for name, doc, sa, sb in (
        ("matmul_2d", "[3, 4] x [4, 5]", (3, 4), (4, 5)),
        ("matmul_batched", "[2, 3, 4] x [2, 4, 5]", (2, 3, 4), (2, 4, 5)),
        ("matmul_4d", "[2, 2, 3, 4] x [2, 2, 4, 2]", (2, 2, 3, 4), (2, 2, 4, 2)),
        ("matmul_vector_rows", "[1, 16] x [16, 3]: one row, a 16-term dot", (1, 16), (16, 3)),
        ("matmul_k0", "[2, 0] x [0, 3] is a [2, 3] value of zeros (an empty sum)", (2, 0), (0, 3)),
        ("matmul_m0", "[0, 4] x [4, 3] is empty", (0, 4), (4, 3)),
    ):
        c = Case(fam, name, doc)
        c.input("a", floats(c.rng, sa))
        c.input("b", floats(c.rng, sb))
        c.output(c.op("matmul", "a", "b"), "y", **MM)
        cases.append(c)
    c = Case(fam, "matmul_transposed_rhs", "x @ w^T with w an HF-layout [out, in] weight (a permuted, strided operand)")
    c.input("x", floats(c.rng, (3, 6)))
    c.input("w", floats(c.rng, (4, 6)), role="weight")
    c.output(c.op("matmul", "x", c.op("permute", "w", perm=[1, 0])), "y", **MM)
    cases.append(c)
    c = Case(fam, "matmul_broadcast_batch", "a [3, 4] rhs broadcast to [2, 3, 4] (batch stride 0), as the dense MoE shares tokens")
    c.input("a", floats(c.rng, (2, 2, 3)))
    c.input("b", floats(c.rng, (3, 4)))
    c.output(c.op("matmul", "a", c.op("broadcast", "b", shape=[2, 3, 4])), "y", **MM)
    cases.append(c)
    c = Case(fam, "matmul_nonfinite", "inf * 0 is NaN, inf + finite is inf, NaN spreads along its row and column")
    a = np.array([[INF, 0, 1], [1, 2, 3], [NAN, 1, 1], [-INF, 1, 0]], dtype=np.float32)
    b = np.array([[0, 1], [1, 1], [1, 2]], dtype=np.float32)
    c.input("a", a)
    c.input("b", b)
    c.output(c.op("matmul", "a", "b"), "y", **MM)
    cases.append(c)
    return cases


def gather_cases():
    fam = "gather"
    cases = []
    c = Case(fam, "index_select_rows_f32", "rows of a [6, 4] f32 value (the embedding lookup), repeated and out of order")
    c.input("x", floats(c.rng, (6, 4)), role="weight")
    c.input("ids", np.array([5, 0, 0, 3, 2], dtype=np.int32))
    c.output(c.op("index_select", "x", "ids", dim=0), "y", **EXACT)
    cases.append(c)
    c = Case(fam, "index_select_strided_view", "rows of a column slice of a [5, 6] value (a layer's cache view: strided rows)")
    c.input("x", floats(c.rng, (5, 6)))
    c.input("ids", np.array([4, 1, 1], dtype=np.int32))
    view = c.op("slice", "x", dim=1, start=2, len=3)
    c.output(c.op("index_select", view, "ids", dim=0), "y", **EXACT)
    cases.append(c)
    c = Case(fam, "index_select_dim1", "columns of a [3, 5] value")
    c.input("x", floats(c.rng, (3, 5)))
    c.input("ids", np.array([4, 0, 2, 2], dtype=np.int32))
    c.output(c.op("index_select", "x", "ids", dim=1), "y", **EXACT)
    cases.append(c)
    c = Case(fam, "index_select_3d", "stacked expert weights: slices of dim 0 of a [4, 2, 3] value")
    c.input("x", floats(c.rng, (4, 2, 3)), role="weight")
    c.input("ids", np.array([3, 0, 3], dtype=np.int32))
    c.output(c.op("index_select", "x", "ids", dim=0), "y", **EXACT)
    cases.append(c)
    for dtype in (I32, U32, BOOL):
        c = Case(fam, f"index_select_{dtype}", f"rows of a [4, 3] {dtype} value")
        x = c.rng.integers(0, 2, (4, 3)).astype(bool) if dtype == BOOL else ints(c.rng, (4, 3), dtype)
        c.input("x", x)
        c.input("ids", np.array([2, 2, 0], dtype=np.int32))
        c.output(c.op("index_select", "x", "ids", dim=0), "y")
        cases.append(c)
    c = Case(fam, "index_select_no_ids", "zero ids give an empty result")
    c.input("x", floats(c.rng, (3, 2)))
    c.input("ids", np.zeros(0, dtype=np.int32))
    c.output(c.op("index_select", "x", "ids", dim=0), "y", **EXACT)
    cases.append(c)
    c = Case(fam, "index_select_nonfinite", "NaN and inf rows are copied as they are")
    c.input("x", np.array([[NAN, 1], [INF, -INF], [0, -0.0]], dtype=np.float32))
    c.input("ids", np.array([1, 0, 2], dtype=np.int32))
    c.output(c.op("index_select", "x", "ids", dim=0), "y", **EXACT)
    cases.append(c)
    c = Case(fam, "gather_dim1", "per-row picks along dim 1 (the sampler's candidate logits)")
    c.input("x", floats(c.rng, (3, 6)))
    c.input("ids", c.rng.integers(0, 6, (3, 4)).astype(np.int32))
    c.output(c.op("gather", "x", "ids", dim=1), "y", **EXACT)
    cases.append(c)
    c = Case(fam, "gather_dim0", "per-column picks along dim 0, more ids than rows")
    c.input("x", floats(c.rng, (3, 4)))
    c.input("ids", c.rng.integers(0, 3, (5, 4)).astype(np.int32))
    c.output(c.op("gather", "x", "ids", dim=0), "y", **EXACT)
    cases.append(c)
    c = Case(fam, "gather_3d_i32", "i32 data, along the middle of three dims")
    c.input("x", ints(c.rng, (2, 4, 3), I32))
    c.input("ids", c.rng.integers(0, 4, (2, 2, 3)).astype(np.int32))
    c.output(c.op("gather", "x", "ids", dim=1), "y")
    cases.append(c)
    for dtype in (U32, BOOL):
        c = Case(fam, f"gather_{dtype}", f"per-row picks of {dtype} data")
        x = c.rng.integers(0, 2, (3, 4)).astype(bool) if dtype == BOOL else ints(c.rng, (3, 4), dtype)
        c.input("x", x)
        c.input("ids", c.rng.integers(0, 4, (3, 2)).astype(np.int32))
        c.output(c.op("gather", "x", "ids", dim=1), "y")
        cases.append(c)
    c = Case(fam, "gather_empty", "zero picks per row")
    c.input("x", floats(c.rng, (2, 3)))
    c.input("ids", np.zeros((2, 0), dtype=np.int32))
    c.output(c.op("gather", "x", "ids", dim=1), "y", **EXACT)
    cases.append(c)
    return cases


def scatter_cases():
    fam = "scatter"
    cases = []
    c = Case(fam, "scatter_rows_copy", "rows written into a metadata value: the root is copied, not changed")
    c.input("root", floats(c.rng, (5, 6)))
    c.input("rows", np.array([3, 0], dtype=np.int32))
    c.input("src", floats(c.rng, (2, 2)))
    c.output(c.op("scatter_rows", "root", "rows", "src", col=2), "y", **EXACT)
    c.output("root", "root_after", **EXACT)
    cases.append(c)
    c = Case(fam, "scatter_rows_in_place", "a cache root updated in place: the output aliases the root input")
    c.input("kv", floats(c.rng, (6, 4)), role="cache_root")
    c.input("rows", np.array([5, 1, 2], dtype=np.int32))
    c.input("src", floats(c.rng, (3, 4)))
    c.output(c.op("scatter_rows", "kv", "rows", "src", col=0), "kv", aliases="kv", **EXACT)
    cases.append(c)
    known(c.name, xla=XLA_ONE_TUPLE)
    c = Case(fam, "scatter_rows_two_layers", "two layers' column ranges of one root, the second reading the first's result, with NaN and inf values")
    c.input("kv", floats(c.rng, (4, 6)), role="cache_root")
    c.input("rows", np.array([2, 0], dtype=np.int32))
    c.input("src", np.array([[NAN, INF, 1], [-INF, 0, -0.0]], dtype=np.float32))
    l0 = c.op("scatter_rows", "kv", "rows", "src", col=0)
    l1 = c.op("scatter_rows", l0, "rows", c.op("neg", "src"), col=3)
    c.output(l1, "kv", aliases="kv", **EXACT)
    cases.append(c)
    known(c.name, xla=XLA_ONE_TUPLE)
    c = Case(fam, "scatter_rows_root_still_read", "the old root is read after the update, so the update cannot happen in place and the aliased output is copied back")
    c.input("kv", floats(c.rng, (4, 3)), role="cache_root")
    c.input("rows", np.array([1], dtype=np.int32))
    c.input("src", floats(c.rng, (1, 2)))
    new = c.op("scatter_rows", "kv", "rows", "src", col=1)
    c.output(new, "kv", aliases="kv", **EXACT)
    c.output(c.op("slice", "kv", dim=0, start=1, len=1), "old_row", **EXACT)
    cases.append(c)
    why = (
        "the CPU backend copies the update back into the caller's root tensor after the run, and `old_row`, "
        "a slice of the root input, is a view of that same storage, so it returns the new row instead of the old one"
    )
    known(c.name, cpu=why, hlo_cpu=why, nrt_sim=why)
    c = Case(fam, "scatter_rows_no_rows", "zero rows leave the root as it was")
    c.input("root", floats(c.rng, (3, 2)))
    c.input("rows", np.zeros(0, dtype=np.int32))
    c.input("src", np.zeros((0, 2), dtype=np.float32))
    c.output(c.op("scatter_rows", "root", "rows", "src", col=0), "y", **EXACT)
    cases.append(c)
    for dtype in (I32, U32, BOOL):
        c = Case(fam, f"scatter_rows_{dtype}", f"a {dtype} root (the builder accepts any dtype equal to the source's)")
        r_ = (lambda s: c.rng.integers(0, 2, s).astype(bool)) if dtype == BOOL else (lambda s: ints(c.rng, s, dtype))
        c.input("root", r_((4, 3)))
        c.input("rows", np.array([0, 3], dtype=np.int32))
        c.input("src", r_((2, 2)))
        c.output(c.op("scatter_rows", "root", "rows", "src", col=1), "y")
        cases.append(c)
        why = "the CPU's scatter kernel handles f32 roots only (`scatter-rows into dtype ...`), though the builder accepts any dtype"
        known(c.name, cpu=why, hlo_cpu=why, nrt_sim=why)
    return cases


def topk_cases():
    fam = "topk"
    cases = []
    c = Case(fam, "topk_ties", "ties go to the lower index; -inf ranks last")
    x = np.array([[1, 3, 3, -1, 2, 0], [5, 5, 5, 5, 5, 5], [-INF, 0, -INF, 1, -INF, -1]], dtype=np.float32)
    c.input("x", x)
    c.output(c.op("topk", "x", k=4), "y")
    cases.append(c)
    for name, doc, shape, k in (
        ("topk_k1", "k = 1 is the argmax", (4, 9), 1),
        ("topk_full", "k = n is a full descending sort", (3, 7), 7),
        ("topk_3d", "the last dim of a [2, 3, 8] value", (2, 3, 8), 3),
        ("topk_wide", "8 of 64 (the MoE router's shape)", (2, 64), 8),
    ):
        c = Case(fam, name, doc)
        c.input("x", floats(c.rng, shape))
        c.output(c.op("topk", "x", k=k), "y")
        cases.append(c)
    c = Case(fam, "topk_nan", "NaN ranks above +inf (XLA's total order), ties among NaNs to the lower index")
    x = np.array([[1, NAN, 3, 2], [INF, NAN, 0, 1], [NAN, 0, NAN, INF]], dtype=np.float32)
    c.input("x", x)
    c.output(c.op("topk", "x", k=3), "y")
    cases.append(c)
    known(
        "topk_nan",
        cpu="the CPU's top-k ranks NaN equal to +inf (its sort key maps NaN to +inf), so a +inf before a NaN comes first",
        hlo_cpu="the CPU's top-k ranks NaN equal to +inf",
        nrt_sim="the CPU's top-k ranks NaN equal to +inf",
    )
    return cases


# === Blocks: the model's composites, written as op programs ===


def rms_norm(c, x, w, eps):
    n = c.inputs[[i["name"] for i in c.inputs].index(x)]["shape"][-1]
    rows = c.inputs[[i["name"] for i in c.inputs].index(x)]["shape"][0]
    sq = c.op("mul", x, x)
    ss = c.op("reshape", c.op("reduce_sum", sq, dim=1), shape=[rows, 1])
    var = c.op("add", c.op("mul", ss, c.op("broadcast", c.const([1.0 / n], F32, []), shape=[rows, 1])), c.op("broadcast", c.const([eps], F32, []), shape=[rows, 1]))
    r = c.op("rsqrt", var)
    y = c.op("mul", x, c.op("broadcast", r, shape=[rows, n]))
    return c.op("mul", y, c.op("broadcast", w, shape=[rows, n]))


def softmax(c, x, shape):
    rows, n = shape
    m = c.op("reshape", c.op("reduce_max", x, dim=1), shape=[rows, 1])
    e = c.op("exp", c.op("sub", x, c.op("broadcast", m, shape=shape)))
    s = c.op("reshape", c.op("reduce_sum", e, dim=1), shape=[rows, 1])
    return c.op("div", e, c.op("broadcast", s, shape=shape))


def np_softmax(x):
    m = np.max(x, axis=-1, keepdims=True)
    e = np.exp(x - m)
    return e / e.sum(axis=-1, keepdims=True)


def np_sigmoid(x):
    return 1 / (1 + np.exp(-x))


def fmix32(c, x, n):
    """murmur3's finalizer on a [n] u32 value, as model/sampling.rs writes it."""
    k = lambda v: c.op("broadcast", c.const([v], U32, []), shape=[n])  # noqa: E731
    h = c.op("bitxor", x, c.op("shr", x, k(16)))
    h = c.op("mul", h, k(0x85EBCA6B))
    h = c.op("bitxor", h, c.op("shr", h, k(13)))
    h = c.op("mul", h, k(0xC2B2AE35))
    return c.op("bitxor", h, c.op("shr", h, k(16)))


def np_fmix32(x):
    x = x.astype(np.uint64)
    x ^= x >> 16
    x = (x * 0x85EBCA6B) & 0xFFFFFFFF
    x ^= x >> 13
    x = (x * 0xC2B2AE35) & 0xFFFFFFFF
    x ^= x >> 16
    return x.astype(np.uint32)


def block_cases():
    fam = "blocks"
    cases = []
    # Blocks chain a dozen ops: rtol 1e-5 and atol 1e-5 (about 100 float32 ulps near 1) cover
    # the rounding of every step and the different summation orders, and are still far below
    # any real error (a wrong mask, a wrong pair in rope), which moves values by 1e-2 or more.
    BLOCK = {"atol": 1e-5, "rtol": 1e-5}

    # --- RMSNorm (model/ops.rs: rms_norm) ---
    c = Case(fam, "rms_norm", "x * rsqrt(mean(x^2) + eps) * w over the last dim; an all-zero row gives 0, not NaN")
    x = floats(c.rng, (4, 8))
    x[2] = 0.0
    w = floats(c.rng, (8,), 0.5, 1.5)
    c.input("x", x)
    c.input("w", w, role="weight")
    c.output(rms_norm(c, "x", "w", 1e-6), "y", **BLOCK)
    c.check = close_to(lambda: {"y": (x.astype(np.float64) / np.sqrt(np.mean(x.astype(np.float64) ** 2, axis=1, keepdims=True) + np.float64(np.float32(1e-6)))) * w})
    cases.append(c)

    # --- causal masked softmax (model/attention.rs: masked_softmax) ---
    c = Case(fam, "causal_softmax", "softmax over keys under a causal mask built from positions (where visible, else -inf); a query with no visible key gives a NaN row, as in numpy")
    q_pos = np.array([0, 1, 3, -1], dtype=np.int32)  # -1: sees no key
    c.input("scores", floats(c.rng, (4, 5)))
    c.input("q_pos", q_pos)
    kp = c.op("iota", dtype=I32, shape=[4, 5], dim=1)
    qp = c.op("broadcast", c.op("reshape", "q_pos", shape=[4, 1]), shape=[4, 5])
    vis = c.op("le", kp, qp)
    ninf = c.op("broadcast", c.const([-INF], F32, []), shape=[4, 5])
    masked = c.op("where", vis, "scores", ninf)
    c.output(softmax(c, masked, (4, 5)), "probs", **BLOCK)
    s = c.inputs[0]["array"].astype(np.float64)

    def causal():
        m = np.where(np.arange(5)[None, :] <= q_pos[:, None], s, -np.inf)
        with np.errstate(invalid="ignore"):
            return {"probs": np_softmax(m)}

    c.check = close_to(causal)
    cases.append(c)

    # --- log-softmax (the scheduler's logprobs: x - max - log(sum(exp(x - max)))) ---
    c = Case(fam, "log_softmax", "log-softmax of logits with a -inf entry (probability 0: log-prob -inf)")
    x = floats(c.rng, (3, 6), -8, 8)
    x[1, 2] = -INF
    c.input("x", x)
    m = c.op("broadcast", c.op("reshape", c.op("reduce_max", "x", dim=1), shape=[3, 1]), shape=[3, 6])
    z = c.op("sub", "x", m)
    lse = c.op("broadcast", c.op("reshape", c.op("log", c.op("reduce_sum", c.op("exp", z), dim=1)), shape=[3, 1]), shape=[3, 6])
    c.output(c.op("sub", z, lse), "logprobs", **BLOCK)
    xd = x.astype(np.float64)
    c.check = close_to(lambda: {"logprobs": xd - xd.max(1, keepdims=True) - np.log(np.exp(xd - xd.max(1, keepdims=True)).sum(1, keepdims=True))})
    cases.append(c)

    # --- SwiGLU MLP (model/ops.rs: mlp) ---
    c = Case(fam, "swiglu_mlp", "down(silu(x @ gate^T) * (x @ up^T)) with HF-layout weights")
    x, g, u, d = floats(c.rng, (3, 8), -1, 1), floats(c.rng, (6, 8), -0.5, 0.5), floats(c.rng, (6, 8), -0.5, 0.5), floats(c.rng, (8, 6), -0.5, 0.5)
    c.input("x", x)
    for n_, a_ in (("gate", g), ("up", u), ("down", d)):
        c.input(n_, a_, role="weight")
    lin = lambda a, w: c.op("matmul", a, c.op("permute", w, perm=[1, 0]))  # noqa: E731
    h = c.op("mul", c.op("silu", lin("x", "gate")), lin("x", "up"))
    c.output(lin(h, "down"), "y", **BLOCK)
    X, G, U, D = (a.astype(np.float64) for a in (x, g, u, d))
    c.check = close_to(lambda: {"y": ((X @ G.T) * np_sigmoid(X @ G.T) * (X @ U.T)) @ D.T})
    cases.append(c)

    # --- interleaved RoPE (model/rope.rs: cos_sin + apply) ---
    c = Case(fam, "rope_interleaved", "rotary embedding of [n, heads, 8] by positions, rotating pairs (x0, x1), (x2, x3), ... as complex numbers")
    n, heads, dim = 3, 2, 8
    pos = np.array([0, 5, 17], dtype=np.int32)
    inv = (1.0 / (10000.0 ** (np.arange(0, dim, 2, dtype=np.float32) / dim))).astype(np.float32)
    x = floats(c.rng, (n, heads, dim), -1, 1)
    c.input("x", x)
    c.input("positions", pos)
    invc = c.const(inv.reshape(1, dim // 2), F32)
    ang = c.op("mul", c.op("broadcast", c.op("reshape", c.op("cast", "positions", dtype=F32), shape=[n, 1]), shape=[n, dim // 2]), c.op("broadcast", invc, shape=[n, dim // 2]))
    cos, sin = c.op("cos", ang), c.op("sin", ang)
    pairs = c.op("reshape", "x", shape=[n, heads, dim // 2, 2])
    x0 = c.op("reshape", c.op("slice", pairs, dim=3, start=0, len=1), shape=[n, heads, dim // 2])
    x1 = c.op("reshape", c.op("slice", pairs, dim=3, start=1, len=1), shape=[n, heads, dim // 2])
    cb = c.op("broadcast", c.op("reshape", cos, shape=[n, 1, dim // 2]), shape=[n, heads, dim // 2])
    sb = c.op("broadcast", c.op("reshape", sin, shape=[n, 1, dim // 2]), shape=[n, heads, dim // 2])
    r0 = c.op("sub", c.op("mul", x0, cb), c.op("mul", x1, sb))
    r1 = c.op("add", c.op("mul", x0, sb), c.op("mul", x1, cb))
    both = c.op("concat", c.op("reshape", r0, shape=[n, heads, dim // 2, 1]), c.op("reshape", r1, shape=[n, heads, dim // 2, 1]), dim=3)
    c.output(c.op("reshape", both, shape=[n, heads, dim]), "y", **BLOCK)

    def rope_ref():
        a = pos.astype(np.float64)[:, None] * inv.astype(np.float64)[None, :]
        z = x.astype(np.float64).reshape(n, heads, dim // 2, 2)
        zc = (z[..., 0] + 1j * z[..., 1]) * np.exp(1j * a)[:, None, :]
        return {"y": np.stack([zc.real, zc.imag], axis=-1).reshape(n, heads, dim)}

    c.check = close_to(rope_ref)
    cases.append(c)

    # --- the sampler's counter-based uniforms (model/sampling.rs: uniform) ---
    c = Case(fam, "sampler_uniform", "uniforms in (0, 1) from fmix32(seed ^ fmix32(pos + golden)) ^ idx * 0x27d4eb2f: wrapping u32 multiply, xor, logical shift, u32 -> f32")
    rows, vocab = 3, 8
    seeds = np.array([0, 12345, U32_MAX], dtype=np.uint32)
    posn = np.array([0, 7, 2**31 - 1], dtype=np.int32)
    c.input("seeds", seeds)
    c.input("positions", posn)
    p = c.op("cast", "positions", dtype=U32)
    p = c.op("add", p, c.op("broadcast", c.const([0x9E3779B9], U32, []), shape=[rows]))
    key = fmix32(c, c.op("bitxor", "seeds", fmix32(c, p, rows)), rows)
    idx = c.op("cast", c.op("iota", dtype=I32, shape=[rows, vocab], dim=1), dtype=U32)
    mixed = c.op("mul", idx, c.op("broadcast", c.const([0x27D4EB2F], U32, []), shape=[rows, vocab]))
    keyb = c.op("broadcast", c.op("reshape", key, shape=[rows, 1]), shape=[rows, vocab])
    xb = c.op("reshape", c.op("bitxor", keyb, mixed), shape=[rows * vocab])
    h = c.op("reshape", fmix32(c, xb, rows * vocab), shape=[rows, vocab])
    bits = c.op("cast", c.op("shr", h, c.op("broadcast", c.const([8], U32, []), shape=[rows, vocab])), dtype=F32)
    scale = c.op("broadcast", c.const([1.0 / 2**24], F32, []), shape=[rows, vocab])
    half = c.op("broadcast", c.const([0.5 / 2**24], F32, []), shape=[rows, vocab])
    c.output(h, "hash")
    # Exact: a 24-bit integer times 2^-24 plus 2^-25 is exactly representable in float32.
    c.output(c.op("add", c.op("mul", bits, scale), half), "u", **EXACT)

    def uniform_ref():
        k = np_fmix32(seeds ^ np_fmix32((posn.view(np.uint32).astype(np.uint64) + 0x9E3779B9).astype(np.uint32)))
        i = np.arange(vocab, dtype=np.uint64)
        hh = np_fmix32(((k[:, None].astype(np.uint64) ^ ((i * 0x27D4EB2F) & 0xFFFFFFFF)[None, :]) & 0xFFFFFFFF).astype(np.uint32))
        return {"hash": hh, "u": ((hh >> 8).astype(np.float64) + 0.5) / 2**24}

    c.check = close_to(uniform_ref, rtol=0, atol=0)
    cases.append(c)

    # --- top-k / top-p threshold as the sampler computes it (model/sampling.rs: sample) ---
    c = Case(fam, "sampler_topk_topp_mask", "the sampler's mask: candidates by top-k, mass before each candidate by a triangular matmul, the threshold kept by top_k and top_p (each off in one row), logits below it set to -inf")
    rows, vocab, k = 3, 12, 6
    z = floats(c.rng, (rows, vocab), -3, 3)
    top_k = np.array([2, 0, 4], dtype=np.int32)
    top_p = np.array([1.0, 0.6, 0.5], dtype=np.float32)
    c.input("z", z)
    c.input("top_k", top_k)
    c.input("top_p", top_p)
    bc = lambda v, dt, shape: c.op("broadcast", c.const([v], dt, []), shape=shape)  # noqa: E731
    col = lambda v: c.op("reshape", v, shape=[rows, 1])  # noqa: E731
    cand = c.op("topk", "z", k=k)
    cz = c.op("gather", "z", cand, dim=1)
    zmax = c.op("slice", cz, dim=1, start=0, len=1)
    denom = c.op("reshape", c.op("reduce_sum", c.op("exp", c.op("sub", "z", c.op("broadcast", zmax, shape=[rows, vocab]))), dim=1), shape=[rows, 1])
    cp = c.op("div", c.op("exp", c.op("sub", cz, c.op("broadcast", zmax, shape=[rows, k]))), c.op("broadcast", denom, shape=[rows, k]))
    tri = c.const(np.triu(np.ones((k, k), dtype=np.float32), 1), F32)
    before = c.op("matmul", cp, tri)
    rank = c.op("iota", dtype=I32, shape=[rows, k], dim=1)
    k_on = c.op("gt", "top_k", bc(0, I32, [rows]))
    p_on = c.op("lt", "top_p", bc(1.0, F32, [rows]))
    k_eff = c.op("where", k_on, "top_k", bc(k, I32, [rows]))
    p_eff = c.op("where", p_on, "top_p", bc(2.0, F32, [rows]))
    within_k = c.op("lt", rank, c.op("broadcast", col(k_eff), shape=[rows, k]))
    within_p = c.op("lt", before, c.op("broadcast", col(p_eff), shape=[rows, k]))
    first = c.op("eq", rank, bc(0, I32, [rows, k]))
    both = c.op("where", within_k, c.op("cast", within_p, dtype=F32), bc(0.0, F32, [rows, k]))
    kept = c.op("gt", c.op("where", first, bc(1.0, F32, [rows, k]), both), bc(0.5, F32, [rows, k]))
    cut = c.op("reduce_min", c.op("where", kept, cz, bc(INF, F32, [rows, k])), dim=1)
    restricted = c.op("where", p_on, bc(1.0, F32, [rows]), c.op("cast", k_on, dtype=F32))
    restricted = c.op("gt", restricted, bc(0.5, F32, [rows]))
    thr = c.op("where", restricted, cut, bc(-INF, F32, [rows]))
    allowed = c.op("ge", "z", c.op("broadcast", col(thr), shape=[rows, vocab]))
    c.output(cand, "candidates")
    c.output(allowed, "allowed")
    c.output(c.op("where", allowed, "z", bc(-INF, F32, [rows, vocab])), "masked", **EXACT)

    def mask_ref():
        zd = z.astype(np.float64)
        allowed_ = np.zeros_like(zd, dtype=bool)
        for r in range(rows):
            order = np.argsort(-zd[r], kind="stable")
            probs = np.exp(zd[r] - zd[r].max()) / np.exp(zd[r] - zd[r].max()).sum()
            kk = top_k[r] if top_k[r] > 0 else vocab
            keep = set(order[:kk].tolist())
            if top_p[r] < 1:
                mass, nucleus = 0.0, set()
                for i in order[:k]:
                    if mass < top_p[r] or not nucleus:
                        nucleus.add(int(i))
                    mass += probs[i]
                keep &= nucleus
            allowed_[r, list(keep)] = True
        return {"allowed": allowed_, "masked": np.where(allowed_, zd, -np.inf)}

    c.check = close_to(mask_ref)
    cases.append(c)

    # --- Gumbel-max draw with greedy rows (model/sampling.rs: sample, last lines) ---
    c = Case(fam, "gumbel_argmax", "argmax(masked + -log(-log(u))) where temperature > 0, argmax(logits) where it is 0; -inf logits are never drawn")
    rows, vocab = 3, 10
    logits = floats(c.rng, (rows, vocab), -2, 2)
    logits[0, 3] = -INF
    u = c.rng.uniform(0.02, 0.98, (rows, vocab)).astype(np.float32)
    temp = np.array([1.0, 0.0, 0.7], dtype=np.float32)
    c.input("logits", logits)
    c.input("u", u)
    c.input("temperature", temp)
    greedy = c.op("argmax", "logits", dim=1)
    sampling = c.op("gt", "temperature", bc(0.0, F32, [rows]))
    t = c.op("where", sampling, "temperature", bc(1.0, F32, [rows]))
    zz = c.op("div", "logits", c.op("broadcast", col(t), shape=[rows, vocab]))
    gumbel = c.op("neg", c.op("log", c.op("neg", c.op("log", "u"))))
    drawn = c.op("argmax", c.op("add", zz, gumbel), dim=1)
    c.output(c.op("where", sampling, drawn, greedy), "next_tokens")
    tt = np.where(temp > 0, temp, 1).astype(np.float64)
    gum = -np.log(-np.log(u.astype(np.float64)))
    c.check = close_to(lambda: {"next_tokens": np.where(temp > 0, np.argmax(logits / tt[:, None] + gum, 1), np.argmax(logits, 1)).astype(np.int32)})
    cases.append(c)

    # --- MoE routing, noaux_tc with groups (model/moe.rs: route) ---
    c = Case(fam, "moe_route_grouped", "sigmoid scores + bias, group score = sum of each group's best two, keep the best groups, -inf elsewhere, top-k experts, weights gathered from the unbiased scores, normalized and scaled")
    t, e, groups, per, kg, kk, scale = 4, 8, 4, 2, 2, 2, 2.5
    logits = floats(c.rng, (t, e), -3, 3)
    bias = floats(c.rng, (e,), -0.1, 0.1)
    c.input("logits", logits)
    c.input("bias", bias, role="weight")
    scores = c.op("sigmoid", "logits")
    choice = c.op("add", scores, c.op("broadcast", "bias", shape=[t, e]))
    grouped = c.op("reshape", choice, shape=[t * groups, per])
    top2 = c.op("topk", grouped, k=2)
    gscore = c.op("reshape", c.op("reduce_sum", c.op("gather", grouped, top2, dim=1), dim=1), shape=[t, groups])
    kept_g = c.op("topk", gscore, k=kg)
    gid = c.op("iota", dtype=I32, shape=[t, kg, groups], dim=2)
    hit = c.op("reduce_sum", c.op("cast", c.op("eq", c.op("broadcast", c.op("reshape", kept_g, shape=[t, kg, 1]), shape=[t, kg, groups]), gid), dtype=F32), dim=1)
    keep = c.op("reshape", c.op("broadcast", c.op("reshape", c.op("gt", hit, bc(0.5, F32, [t, groups])), shape=[t, groups, 1]), shape=[t, groups, per]), shape=[t, e])
    choice = c.op("where", keep, choice, bc(-INF, F32, [t, e]))
    ids = c.op("topk", choice, k=kk)
    wts = c.op("gather", scores, ids, dim=1)
    den = c.op("add", c.op("reshape", c.op("reduce_sum", wts, dim=1), shape=[t, 1]), bc(1e-20, F32, [t, 1]))
    wts = c.op("div", wts, c.op("broadcast", den, shape=[t, kk]))
    c.output(ids, "ids")
    c.output(c.op("mul", wts, bc(scale, F32, [t, kk])), "weights", **BLOCK)

    def route_ref():
        sc = np_sigmoid(logits.astype(np.float64))
        ch = sc + bias
        gs = np.sort(ch.reshape(t, groups, per), axis=2)[:, :, ::-1][:, :, :2].sum(2)
        ids_, w_ = [], []
        for r in range(t):
            best_groups = np.argsort(-gs[r], kind="stable")[:kg]
            m = np.full(e, -np.inf)
            for g_ in best_groups:
                m[g_ * per : (g_ + 1) * per] = ch[r, g_ * per : (g_ + 1) * per]
            sel = np.argsort(-m, kind="stable")[:kk]
            ids_.append(sel)
            w = sc[r, sel]
            w_.append(w / (w.sum() + 1e-20) * scale)
        return {"ids": np.array(ids_, dtype=np.int32), "weights": np.array(w_)}

    c.check = close_to(route_ref)
    cases.append(c)

    # --- routed experts, gather strategy (model/moe.rs: gathered_experts) ---
    c = Case(fam, "moe_gathered_experts", "each token's chosen experts' weights picked by index_select, transposed and multiplied (the CPU fuses this into a grouped matmul), weighted and summed over choices")
    t, h, f, e, kk = 3, 4, 6, 5, 2
    x = floats(c.rng, (t, h), -1, 1)
    ids = np.array([[4, 1], [1, 1], [0, 4]], dtype=np.int32)
    wts = floats(c.rng, (t, kk), 0, 1)
    W = {n_: floats(c.rng, s_, -0.5, 0.5) for n_, s_ in (("gate", (e, f, h)), ("up", (e, f, h)), ("down", (e, h, f)))}
    c.input("x", x)
    c.input("ids", ids)
    c.input("weights", wts)
    for n_, a_ in W.items():
        c.input(n_, a_, role="weight")
    flat = c.op("reshape", "ids", shape=[t * kk])
    xs = c.op("reshape", c.op("broadcast", c.op("reshape", "x", shape=[t, 1, h]), shape=[t, kk, h]), shape=[t * kk, 1, h])
    sel = lambda w: c.op("permute", c.op("index_select", w, flat, dim=0), perm=[0, 2, 1])  # noqa: E731
    gg = c.op("silu", c.op("matmul", xs, sel("gate")))
    uu = c.op("matmul", xs, sel("up"))
    yy = c.op("matmul", c.op("mul", gg, uu), sel("down"))
    yw = c.op("mul", c.op("reshape", yy, shape=[t, kk, h]), c.op("broadcast", c.op("reshape", "weights", shape=[t, kk, 1]), shape=[t, kk, h]))
    c.output(c.op("reduce_sum", yw, dim=1), "y", **BLOCK)

    def experts_ref():
        X = x.astype(np.float64)
        out = np.zeros((t, h))
        for r in range(t):
            for j in range(kk):
                ex = ids[r, j]
                G, U, D = (W[n_][ex].astype(np.float64) for n_ in ("gate", "up", "down"))
                a = X[r] @ G.T
                out[r] += wts[r, j] * (((a * np_sigmoid(a)) * (X[r] @ U.T)) @ D.T)
        return {"y": out}

    c.check = close_to(experts_ref)
    cases.append(c)

    # --- routed experts, dense strategy (model/moe.rs: dense_experts) ---
    c = Case(fam, "moe_dense_experts", "every expert on every token, weighted by a routing matrix built from one-hot(ids) (iota, eq, where, sum); same values as the gather strategy")
    c.input("x", x)
    c.input("ids", ids)
    c.input("weights", wts)
    for n_, a_ in W.items():
        c.input(n_, a_, role="weight")
    onehot = c.op("eq", c.op("broadcast", c.op("reshape", "ids", shape=[t, kk, 1]), shape=[t, kk, e]), c.op("iota", dtype=I32, shape=[t, kk, e], dim=2))
    routing = c.op("reduce_sum", c.op("where", onehot, c.op("broadcast", c.op("reshape", "weights", shape=[t, kk, 1]), shape=[t, kk, e]), bc(0.0, F32, [t, kk, e])), dim=1)
    xs = c.op("broadcast", c.op("reshape", "x", shape=[1, t, h]), shape=[e, t, h])
    tr = lambda w: c.op("permute", w, perm=[0, 2, 1])  # noqa: E731
    gg = c.op("silu", c.op("matmul", xs, tr("gate")))
    uu = c.op("matmul", xs, tr("up"))
    yy = c.op("matmul", c.op("mul", gg, uu), tr("down"))
    rt = c.op("broadcast", c.op("reshape", c.op("permute", routing, perm=[1, 0]), shape=[e, t, 1]), shape=[e, t, h])
    c.output(c.op("reduce_sum", c.op("mul", yy, rt), dim=0), "y", **BLOCK)
    c.check = close_to(experts_ref)
    cases.append(c)

    # --- MLA cache write then read (model/attention.rs: write_cache, read_cache) ---
    c = Case(fam, "mla_cache_write_read", "new rows scattered into layer 1's columns of the cache root (in place, aliased), then the context gathered back through slots from that layer's column view")
    slots, layers, width, n = 6, 2, 3, 2
    kv = floats(c.rng, (slots, layers * width))
    new_slots = np.array([4, 1], dtype=np.int32)
    ctx_slots = np.array([1, 4, 0, 1], dtype=np.int32)
    rowsv = floats(c.rng, (n, width))
    c.input("kv_cache", kv, role="cache_root")
    c.input("slot_mapping", new_slots)
    c.input("ctx_slots", ctx_slots)
    c.input("rows", rowsv)
    root = c.op("scatter_rows", "kv_cache", "slot_mapping", "rows", col=1 * width)
    ctx = c.op("index_select", c.op("slice", root, dim=1, start=1 * width, len=width), "ctx_slots", dim=0)
    c.output(ctx, "context", **EXACT)
    c.output(root, "kv_cache", aliases="kv_cache", **EXACT)

    def cache_ref():
        k2 = kv.astype(np.float64).copy()
        k2[new_slots, width : 2 * width] = rowsv
        return {"kv_cache": k2, "context": k2[ctx_slots, width : 2 * width]}

    c.check = close_to(cache_ref, rtol=0, atol=0)
    cases.append(c)
    return cases


FAMILIES = {
    "unary": unary_cases,
    "binary": binary_cases,
    "compare": compare_cases,
    "select": select_cases,
    "convert": convert_cases,
    "shape": shape_cases,
    "iota": iota_cases,
    "constant": constant_cases,
    "reduce": reduce_cases,
    "argmax": argmax_cases,
    "matmul": matmul_cases,
    "gather": gather_cases,
    "scatter": scatter_cases,
    "topk": topk_cases,
    "blocks": block_cases,
}


def render(family, cases):
    """The file's text: one line per input, op and output, so diffs stay readable."""
    dump = lambda v: json.dumps(v, ensure_ascii=False, allow_nan=False)  # noqa: E731
    lines = ["{", f'  "family": {dump(family)},', '  "generated_by": "scripts/make_conformance.py",', '  "cases": [']
    for ci, case in enumerate(cases):
        lines.append("    {")
        lines.append(f'      "name": {dump(case["name"])},')
        lines.append(f'      "doc": {dump(case["doc"])},')
        for key in ("inputs", "program", "outputs"):
            lines.append(f'      "{key}": [')
            items = case[key]
            for i, item in enumerate(items):
                lines.append("        " + dump(item) + ("," if i + 1 < len(items) else ""))
            lines.append("      ],")
        lines.append(f'      "known_failures": {dump(case["known_failures"])}')
        lines.append("    }" + ("," if ci + 1 < len(cases) else ""))
    lines += ["  ]", "}", ""]
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="fail if any file would change")
    args = ap.parse_args()
    stale, seen = [], set()
    for family, make in FAMILIES.items():
        cases = [c.finish() for c in make()]
        names = [c.name for c in cases]
        dup = (set(names) & seen) | {n for n in names if names.count(n) > 1}
        assert not dup, f"duplicate case names {dup}"
        seen |= set(names)
        text = render(family, [c.to_json() for c in cases])
        path = OUT_DIR / f"{family}.json"
        if args.check:
            if not path.is_file() or path.read_text() != text:
                stale.append(path.name)
        else:
            path.write_text(text)
        print(f"{family}.json: {len(cases)} cases")
    unused = set(KNOWN_FAILURES) - seen
    assert not unused, f"known failures for cases that do not exist: {unused}"
    if stale:
        print("out of date:", ", ".join(stale), "(run scripts/make_conformance.py)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
