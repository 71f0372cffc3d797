"""The numpy reference of the conformance suite: the case format's encoding, an interpreter that
evaluates a case's op program with numpy, the comparison rule, and `Case`, which builds a case and
checks it before it is written. Used by scripts/make_conformance.py (which defines the cases) and
scripts/xla_conformance.py (which decodes and compares them). Nothing here imports deepinfer.

Floats are evaluated in float64 and rounded to float32 only at the end (the best value a float32
implementation could return), except `dequantize_int4` and `dequantize_e2m1`, which the graph
defines as float32 arithmetic (see `dequantize_int4`); integers use the exact 32-bit semantics XLA documents
(wrapping arithmetic, truncating division, x / 0 = -1 (signed) or all ones (unsigned), x % 0 = x,
shifts by 32 or more give 0).

The reduced-precision dtypes (bf16, f16, f8e4m3fn, from ml_dtypes, and i8) are held in their own
numpy types, and so are u8 values (the int4 experts' packed codes, numpy uint8). An arithmetic op
on the narrow floats (a reduction) is evaluated in float64 on the widened values and rounded once
to the op's dtype, since its result is a value of that dtype; the check evaluation computes it in
the dtype itself (ml_dtypes rounds every step), the way an HLO `reduce` whose combiner adds two
bf16 values may.
"""

import zlib

import ml_dtypes
import numpy as np

F32, I32, U32, BOOL = "f32", "i32", "u32", "bool"
BF16, F16, F8, I8 = "bf16", "f16", "f8e4m3fn", "i8"
U8 = "u8"
NP_DTYPE = {
    F32: np.float32,
    I32: np.int32,
    U32: np.uint32,
    BOOL: np.bool_,
    BF16: ml_dtypes.bfloat16,
    F16: np.float16,
    F8: ml_dtypes.float8_e4m3fn,
    I8: np.int8,
    U8: np.uint8,
}
# Float dtypes narrower than f32; every value of them is exactly a float32.
REDUCED = (BF16, F16, F8)
FLOATS = (F32,) + REDUCED
INTS = {I32: (-(2**31), 2**31 - 1), U32: (0, 2**32 - 1), I8: (-128, 127), U8: (0, 255)}
I32_MIN, I32_MAX, U32_MAX = -(2**31), 2**31 - 1, 2**32 - 1
NAN, INF = float("nan"), float("inf")

# Executors, as named in `known_failures` (tests/conformance.rs and scripts/xla_conformance.py).
EXECUTORS = ("cpu", "hlo_cpu", "nrt_sim", "xla")


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
    """A case's JSON values. A bf16, f16 or f8e4m3fn value is written as its float32 widening,
    which is exact (the Rust side refuses a number the dtype cannot hold)."""
    flat = np.asarray(arr).reshape(-1)
    if dtype in FLOATS:
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
    for name in (BF16, F16, F8, I8, U8):
        if dt == NP_DTYPE[name]:
            return name
    raise TypeError(f"no graph dtype for {dt}")


def decode(dtype, shape, data):
    """The inverse of `encode`: a case's JSON values as a numpy array."""
    if dtype in FLOATS:
        data = [{"nan": NAN, "inf": INF, "-inf": -INF}[v] if isinstance(v, str) else v for v in data]
        # Through float32, which holds every value exactly (ml_dtypes converts a float64 through
        # float32 anyway).
        return np.array(data, dtype=np.float32).astype(NP_DTYPE[dtype]).reshape(shape)
    return np.array(data, dtype=NP_DTYPE[dtype]).reshape(shape)


def is_float(arr):
    return dtype_of(arr) in FLOATS


def round_to(x, dt):
    """float64 values rounded once, to nearest even, to the narrow float type `dt` (bf16, f16,
    f8e4m3fn; out of range as ml_dtypes converts). ml_dtypes converts a float64 through float32,
    which can round twice (1 + 2^-8 + 2^-30 would become bf16 1.0 instead of 1 + 2^-7); rounding
    to float32 *to odd* first (truncate, then set the last bit if anything was cut off) makes
    the second rounding the correctly rounded one, as float32 has at least two more significand
    bits than each of these types."""
    x = np.asarray(x, dtype=np.float64)
    with np.errstate(over="ignore"):
        r = x.astype(np.float32)
        wide = r.astype(np.float64)
        inexact = np.isfinite(x) & (wide != x)
        r = np.where(inexact & (np.abs(wide) > np.abs(x)), np.nextafter(r, np.float32(0)), r).astype(np.float32)
        bits = np.where(inexact, r.view(np.uint32) | np.uint32(1), r.view(np.uint32)).astype(np.uint32)
        return bits.view(np.float32).astype(dt).reshape(x.shape)


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
    ("reduce_max", BF16): -INF,
    ("reduce_min", BF16): INF,
    ("reduce_max", F16): -INF,
    ("reduce_min", F16): INF,
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
    rule is spelled out; XLA's convert does the same for s8, measured with jaxlib 0.10.2);
    integer to integer wraps; to f32 rounds to nearest even, and a narrow float widens exactly.
    A float to bf16, f16 or f8e4m3fn rounds to nearest even from the float32 value (the graph's
    f32 values are float32; a narrow float is exactly one); ml_dtypes gives out-of-range values
    what the type has: +-inf for bf16 and f16, NaN for f8e4m3fn (it has no infinity; XLA's
    convert does the same)."""
    if to == F32:
        return x.astype(np.float32).astype(ftype)
    if to in REDUCED:
        assert is_float(x), f"{dtype_of(x)} -> {to}: only float sources have a single rounding here"
        return x.astype(np.float32).astype(NP_DTYPE[to])
    if is_float(x):
        lo, hi = INTS[to]
        t = np.trunc(np.nan_to_num(x.astype(np.float32).astype(np.float64), nan=0.0, posinf=hi, neginf=lo))
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


def mass_threshold(x, w, target):
    """Per row: the largest value t of x whose mass sum(w[x >= t]) reaches the target (summed in
    the evaluation's float type); +inf for a target <= 0, -inf for a NaN target or a row whose
    whole mass falls short. NaN values never count; a subnormal answer is 0 (engines that flush
    subnormals, XLA's CPU among them, cannot tell it from 0)."""
    out = []
    for row, wr, t in zip(x, w, target):
        if np.isnan(t):
            out.append(-np.inf)
            continue
        if t <= 0:
            out.append(np.inf)
            continue
        found = -np.inf
        for v in sorted({float(v) for v in row if not np.isnan(v)}, reverse=True):
            if np.sum(wr[row >= v], dtype=wr.dtype) >= t:
                found = v
                break
        out.append(0.0 if found != 0 and abs(found) < np.finfo(np.float32).tiny else found)
    return np.array(out, dtype=x.dtype)


def dequantize_int4(codes, scales, group, ftype):
    """4-bit codes two a byte (u8 `[.., half]`: value 2j in byte j's low nibble, `b & 15`, value
    2j + 1 in its high nibble, `b >> 4`), biased by 8, times the scale of their group of `group`
    values (f32 `[.., ceil(2 half / group)]`): f32 `[.., 2 half]`.

    Computed in float32 in both evaluations, not in float64 rounded once: the op is defined as
    float32 arithmetic, `(code - 8) * scale` with the subtraction exact and the product rounded
    once to float32, which is what the CPU kernel and the HLO lowering compute. (Here the two
    would agree anyway: a 4-bit integer times a 24-bit significand is exact in float64, so its
    rounding to float32 is the float32 product; the reference follows the definition.) The
    scales are float32 values (a graph f32), so their conversion from the float64 evaluation is
    exact."""
    half = codes.shape[-1]
    n = 2 * half
    assert codes.dtype == np.uint8 and group > 0, (codes.dtype, group)
    assert scales.shape == codes.shape[:-1] + (-(-n // group),), (codes.shape, scales.shape, group)
    low = (codes & 15).astype(np.int32) - 8
    high = (codes >> 4).astype(np.int32) - 8
    values = np.stack([low, high], axis=-1).reshape(codes.shape[:-1] + (n,)).astype(np.float32)
    per_value = np.repeat(scales.astype(np.float32), group, axis=-1)[..., :n]
    return (values * per_value).astype(np.float32).astype(ftype)


def dequantize_e2m1(codes, scales, group, ftype):
    """FP4 E2M1 codes two a byte (u8 `[.., half]`, the even value in the low nibble, as
    `dequantize_int4`), each code's value as ml_dtypes' `float4_e2m1fn` defines it (OCP MX: bit 3
    the sign, bits 2-1 the exponent with bias 1, bit 0 the mantissa), times the scale of its group
    of `group` values (f32 `[.., ceil(2 half / group)]`): f32 `[.., 2 half]`. As
    `dequantize_int4`, the op is float32 arithmetic: the code's value is exact in float32 and the
    product with the scale is rounded once."""
    half = codes.shape[-1]
    n = 2 * half
    assert codes.dtype == np.uint8 and group > 0, (codes.dtype, group)
    assert scales.shape == codes.shape[:-1] + (-(-n // group),), (codes.shape, scales.shape, group)
    nibbles = np.stack([codes & 15, codes >> 4], axis=-1).reshape(codes.shape[:-1] + (n,))
    values = nibbles.astype(np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    per_value = np.repeat(scales.astype(np.float32), group, axis=-1)[..., :n]
    return (values * per_value).astype(np.float32).astype(ftype)


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


# Ops that compute new values from their operands (not data movement): on a narrow float they
# round (see the module docs).
ARITHMETIC = set(UNARY) | {"add", "sub", "mul", "div", "maximum", "minimum", "reduce_sum", "reduce_max", "reduce_min"}


def run_op(st, args, ftype):
    op = st["op"]
    if op in ARITHMETIC and dtype_of(args[0]) in REDUCED and ftype == np.float64:
        dt = args[0].dtype
        return round_to(run_op(st, [a.astype(np.float64) for a in args], np.float64), dt)
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
            return x / y if is_float(x) else int_div(x, y, signed)
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
    if op == "matmul_to":
        # Narrow operands, an f32 result: the products and sums of the widened values (float64
        # for the reference, float32 for the check evaluation).
        assert st["dtype"] == F32, st
        return np.matmul(x.astype(ftype), args[1].astype(ftype))
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
    if op == "mass_threshold":
        return mass_threshold(x, args[1], args[2])
    if op == "dequantize_int4":
        return dequantize_int4(x, args[1], st["group"], ftype)
    if op == "dequantize_e2m1":
        return dequantize_e2m1(x, args[1], st["group"], ftype)
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


# === Comparison (the rule every executor applies; tests/conformance/case.rs has the Rust copy) ===


def mismatch(got, want, out):
    """None if `got` satisfies output `out`'s rule against `want` (numpy arrays), else what
    differs: NaN must meet NaN, an infinity the same infinity, a finite value a finite value within
    atol + rtol * |want|; integers and bools are exact."""
    if got.shape != want.shape or dtype_of(got) != dtype_of(want):
        return f"`{out['name']}`: got {got.dtype} {list(got.shape)}, want {want.dtype} {list(want.shape)}"
    if out["dtype"] in FLOATS:
        g, w = got.astype(np.float64).reshape(-1), want.astype(np.float64).reshape(-1)
        nan = np.isnan(w) | np.isnan(g)
        inf = ~nan & (np.isinf(w) | np.isinf(g))
        fin = ~(nan | inf)
        bad = np.zeros(g.shape, dtype=bool)
        bad[nan] = ~(np.isnan(w[nan]) & np.isnan(g[nan]))
        bad[inf] = g[inf] != w[inf]
        bad[fin] = ~(np.abs(g[fin] - w[fin]) <= out["atol"] + out["rtol"] * np.abs(w[fin]))
        rule = f"atol {out['atol']:e}, rtol {out['rtol']:e}"
    else:
        g, w = got.reshape(-1), want.reshape(-1)
        bad = g != w
        rule = "exact"
    if not bad.any():
        return None
    idx = np.flatnonzero(bad)
    shown = "; ".join(f"{[int(j) for j in np.unravel_index(i, want.shape)]}: got {g[i]}, want {w[i]}" for i in idx[:6])
    more = "; ..." if len(idx) > 6 else ""
    return f"`{out['name']}`: {len(idx)} of {w.size} elements differ ({rule}): {shown}{more}"


# === Building cases ===


class Case:
    """One case under construction: `input`, then ops through `op`, then `output`."""

    def __init__(self, family, name, doc):
        self.family, self.name, self.doc = family, name, doc
        self.rng = np.random.default_rng(zlib.crc32(name.encode()))
        self.inputs, self.program, self.outputs = [], [], []
        self.counter = 0
        self.check = None
        self.known_failures = {}

    def known(self, **executors):
        """Records that the case fails on these executors today, each with the reason: a real
        bug, reported as such by the executors (and a failure once the case passes)."""
        assert set(executors) <= set(EXECUTORS), executors
        self.known_failures.update(executors)

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
        if dtype in REDUCED:
            want = np.asarray(data, dtype=np.float64)
            assert np.array_equal(a.astype(np.float64), want, equal_nan=True), f"{self.name}: {data} is not exactly {dtype}"
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
            if o["dtype"] in FLOATS:
                assert "atol" in o, f"{self.name}.{o['name']}: a float output needs atol and rtol"
                if o["dtype"] == F32:
                    with np.errstate(over="ignore"):
                        want = want.astype(np.float32)
            else:
                assert "atol" not in o, f"{self.name}.{o['name']}: integer and bool outputs are exact"
            o["array"] = want
            bad = mismatch(low[o["name"]], want, o)
            if bad:
                raise SystemExit(
                    f"{self.name}: the float32 evaluation fails the case's own rule "
                    f"(ill-conditioned inputs or a tolerance below float32 rounding): {bad}"
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
            if o["dtype"] in FLOATS:
                e["atol"], e["rtol"] = o["atol"], o["rtol"]
            e["data"] = encode(o["array"], o["dtype"])
            outs.append(e)
        case["outputs"] = outs
        case["known_failures"] = dict(sorted(self.known_failures.items()))
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


# Exact comparison of a float output: for ops that compute nothing (data movement, selection) or
# whose IEEE result is correctly rounded (see each use).
EXACT = {"atol": 0.0, "rtol": 0.0}
