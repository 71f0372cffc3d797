"""Write the conformance cases under tests/conformance/ with expected values from numpy.

What: one JSON file per op family (unary.json, binary.json, ..., blocks.json). Each case is a
small program over the graph's ops (inputs, a list of ops whose arguments name earlier values,
outputs), its concrete inputs, the outputs numpy computes for it, and how each output is compared.
tests/conformance.rs runs every case on the CPU backend, on emit -> import -> CPU and through
nrt-sim; scripts/xla_conformance.py runs the same cases' HLO in XLA. The format is described in
tests/conformance/README.md.

Why: the expected values come from here, not from deepinfer, so every executor is checked against
an independent reference, and one set of cases serves all executors (the regex crate's testdata
idea). Everything here is plain numpy (with ml_dtypes for the bf16 and f8e4m3fn types); nothing
imports or runs deepinfer.

The cases of single ops are defined below, the blocks in conformance_blocks.py, and the reference
in conformance_reference.py: `evaluate` interprets a program with numpy, op by op. Floats are
evaluated in float64 and rounded to float32 only at the end (the best value an f32 implementation
could return), except dequantize_int4 and dequantize_e2m1, which the graph defines as float32
arithmetic; an op on
bf16, f16 or f8e4m3fn values is rounded once to its dtype; integers use the exact 32-bit
semantics XLA documents (wrapping arithmetic, truncating division, x / 0 = -1 (signed) or all
ones (unsigned), x % 0 = x, shifts by 32 or more give 0). Each case is also
evaluated entirely in float32 (narrow float types in their own type) and must pass its own
comparison rule against the reference: a tolerance is never tighter than an honest float32
implementation needs, and integer or bool results that depend on float rounding (a near tie in
top-k, say) are refused as ill-conditioned instead of being written. Blocks also check the program against the textbook
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

import ml_dtypes
import numpy as np

from conformance_blocks import block_cases
from conformance_reference import (
    BF16,
    BOOL,
    COMPARE,
    EXACT,
    F8,
    F16,
    F32,
    F_EDGES,
    FLOATS,
    I8,
    I32,
    I32_MAX,
    I32_MIN,
    I_EDGES,
    INF,
    NAN,
    NP_DTYPE,
    U32,
    U8,
    U32_MAX,
    U_EDGES,
    Case,
    dtype_of,
    floats,
    grid,
    ints,
)

OUT_DIR = Path(__file__).resolve().parent.parent / "tests" / "conformance"

# Edges of the narrow types (ml_dtypes.finfo): the largest finite bf16 ((2 - 2^-7) * 2^127), f16
# and f8e4m3fn values, and the f8e4m3fn smallest subnormal.
BF16_MAX = float(ml_dtypes.finfo(ml_dtypes.bfloat16).max)
F16_MAX = 65504.0
F8_MAX = 448.0
F8_TINY = 2.0**-9


def exact_for(dtype):
    """The comparison of an output that computes nothing (data movement, constants) or is
    correctly rounded: exact for every dtype (floats state a zero tolerance)."""
    return EXACT if dtype in FLOATS else {}


def narrow(rng, shape, dtype, lo=-4.0, hi=4.0):
    """Random values of a narrow float type: uniform float32 values rounded to `dtype`."""
    return floats(rng, shape, lo, hi).astype(NP_DTYPE[dtype])


def narrow_edges(dtype):
    """NaN, the infinities (f8e4m3fn has none: its largest finite values instead), the largest
    finite values, -0, a subnormal where it is a normal float32 (f16, f8e4m3fn), as `dtype`."""
    edges = {
        BF16: [NAN, INF, -INF, BF16_MAX, -BF16_MAX, 2.0**-126, -0.0, 1.0078125],
        F16: [NAN, INF, -INF, F16_MAX, -F16_MAX, 2.0**-24, -(2.0**-24), 2.0**-14, -0.0],
        F8: [NAN, F8_MAX, -F8_MAX, F8_TINY, -F8_TINY, 2.0**-6, -0.0, 1.125],
    }[dtype]
    return np.array(edges, dtype=np.float32).astype(NP_DTYPE[dtype])

# Real disagreements found by this suite, attached to their cases with `Case.known`: the executors
# report each as a known failure and fail once the case passes (so the entry goes when the bug is
# fixed). Each one is a bug to fix, not a tolerance.
CPU_NAN_MAX = "candle's maximum/minimum keep the first operand when the second is NaN (`if a < b {b} else {a}`); XLA and numpy propagate NaN"
CPU_NAN_REDUCE = "candle's max/min reduction skips a NaN unless it is the first element of the row; XLA's reduce and numpy propagate it"
XLA_ONE_TUPLE = (
    "the harness path, not the module: jax's HLO -> StableHLO conversion (xla_computation_to_mlir_module) returns a "
    "one-element root tuple as a plain array but keeps the alias at output {0}, which XLA then rejects (RET_CHECK "
    "`Trying to set up alias at {0} which is an invalid index`); with a second output the same alias runs "
    "(mla_cache_write_read), and the model's graphs always have two or more outputs"
)


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
        if op in ("maximum", "minimum"):
            c.known(cpu=CPU_NAN_MAX, hlo_cpu=CPU_NAN_MAX, nrt_sim=CPU_NAN_MAX)
        cases.append(c)
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
    cases += narrow_convert_cases(fam)
    c = Case(fam, "f32_to_i32_empty", "a cast of a [0] value")
    c.input("x", np.zeros(0, dtype=np.float32))
    c.output(c.op("cast", "x", dtype=I32), "y")
    cases.append(c)
    return cases


def narrow_convert_cases(fam):
    """Conversions to and from bf16, f16, f8e4m3fn and i8. Every one is exact or correctly
    rounded (to nearest even), so every output is compared exactly."""
    cases = []
    f32 = lambda *v: np.array(v, dtype=np.float32)  # noqa: E731
    below = lambda v: float(np.nextafter(np.float32(v), np.float32(0)))  # noqa: E731
    # (dtype, values that round (ties to even, the overflow threshold and its neighbour), range of
    # the random values). The overflow threshold is the largest finite value plus half an ulp:
    # a tie whose even neighbour is the next power of two, so it rounds to inf.
    bf16_over = (2 - 2.0**-8) * 2.0**127
    rounding = {
        BF16: (
            "1 + 2^-8 and 1 + 3 * 2^-8 are ties (to 1 and 1 + 2^-6), 1 + 2^-8 + 2^-23 rounds up; (2 - 2^-8) * 2^127 is the overflow tie (to inf), the float32 below it rounds to the largest bf16, f32::MAX and larger overflow",
            [1 + 2.0**-8, 1 + 3 * 2.0**-8, 1 + 2.0**-8 + 2.0**-23, bf16_over, -bf16_over, below(bf16_over), 3.4028235e38, BF16_MAX, 2.0**-126, 0.1],
            1e6,
        ),
        F16: (
            "1 + 2^-11 and 1 + 3 * 2^-11 are ties, 65520 is the overflow tie (to inf) and the float32 below it rounds to 65504, 1e5 overflows; 2^-25 and 1.5 * 2^-24 are subnormal ties (to 0 and 2^-23), 0.75 * 2^-24 rounds up to the smallest subnormal, 1e-8 to 0",
            [1 + 2.0**-11, 1 + 3 * 2.0**-11, 65520.0, -65520.0, below(65520.0), 1e5, -1e5, F16_MAX, 2.0**-25, 1.5 * 2.0**-24, 0.75 * 2.0**-24, 1e-8, 2.0**-14, 0.1],
            1e4,
        ),
        F8: (
            "1.0625 and 1.1875 are ties (to 1 and 1.25), 464 is the tie between 448 and the missing 480 (to 448, the even one), 2^-10 and 1.5 * 2^-9 are subnormal ties (to 0 and 2^-8), 2^-11 rounds to 0",
            [1.0625, 1.1875, -1.1875, 464.0, -464.0, below(464.0), 2.0**-10, 1.5 * 2.0**-9, 2.0**-11, 0.3, 240.5],
            400.0,
        ),
    }
    for dtype, (doc, vals, span) in rounding.items():
        c = Case(fam, f"f32_to_{dtype}", f"f32 -> {dtype} rounds to nearest even, keeps NaN, +-inf (bf16, f16), +-0: {doc}")
        specials = [NAN, -0.0, 0.0, 1.0] + ([INF, -INF] if dtype != F8 else [])
        c.input("x", np.concatenate([f32(*specials, *vals), floats(c.rng, 16, -span, span)]))
        c.output(c.op("cast", "x", dtype=dtype), "y", **EXACT)
        cases.append(c)
    c = Case(fam, "f32_to_f8e4m3fn_out_of_range", "f32 -> f8e4m3fn beyond its range: f8e4m3fn has no infinity, and XLA's convert and ml_dtypes give NaN for |x| above the 464 tie and for +-inf (not a saturated +-448)")
    c.input("x", f32(464.03125, -464.03125, 480.0, 1000.0, -1000.0, 1e9, 3.4028235e38, INF, -INF))
    c.output(c.op("cast", "x", dtype=F8), "y", **EXACT)
    cases.append(c)
    for dtype in (BF16, F16):
        c = Case(fam, f"{dtype}_to_f32", f"{dtype} -> f32 is exact: NaN, +-inf, the largest finite values, the smallest {'normal' if dtype == BF16 else 'subnormal and normal'}, -0, random values")
        c.input("x", np.concatenate([narrow_edges(dtype), narrow(c.rng, 16, dtype, -1000, 1000)]))
        c.output(c.op("cast", "x", dtype=F32), "y", **EXACT)
        cases.append(c)
    c = Case(fam, "f8e4m3fn_to_f32", "f8e4m3fn -> f32 is exact: all 256 bit patterns (the subnormals, +-448, both NaNs 0x7f and 0xff, -0)")
    c.input("x", np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).reshape(16, 16))
    c.output(c.op("cast", "x", dtype=F32), "y", **EXACT)
    cases.append(c)
    c = Case(fam, "f32_to_i8", "f32 -> i8 truncates toward zero (+-0.999 -> 0, +-2.5 -> +-2, 127.9 -> 127, -128.9 -> -128)")
    c.input("x", np.concatenate([f32(0.5, -0.5, 0.999, -0.999, 2.5, -2.5, -0.0, 127.0, 127.9, -128.0, -128.9, 126.5, -7.7), floats(c.rng, 12, -120, 120)]))
    c.output(c.op("cast", "x", dtype=I8), "y")
    cases.append(c)
    c = Case(fam, "f32_to_i8_out_of_range", "f32 -> i8 out of range saturates to -128 / 127 and NaN becomes 0, as XLA's convert does (measured with jaxlib 0.10.2) and as for i32")
    c.input("x", f32(128.0, -129.0, 300.0, -300.0, 1e10, -1e10, 3.4028235e38, INF, -INF, NAN))
    c.output(c.op("cast", "x", dtype=I8), "y")
    cases.append(c)
    i8_edges = np.array([-128, -127, -1, 0, 1, 7, 127], dtype=np.int8)
    for to in (F32, I32):
        c = Case(fam, f"i8_to_{to}", f"i8 -> {to} is exact and sign-extends (-128, -1 stay negative: the CPU holds i8 as u8 bytes)")
        c.input("x", np.concatenate([i8_edges, c.rng.integers(-128, 128, 9).astype(np.int8)]))
        c.output(c.op("cast", "x", dtype=to), "y", **exact_for(to))
        cases.append(c)
    c = Case(fam, "i32_to_i8", "i32 -> i8 keeps the low byte (wraps: 128 -> -128, 255 -> -1, 300 -> 44)")
    c.input("x", np.array([I32_MIN, -129, -128, -1, 0, 127, 128, 255, 256, 300, I32_MAX], dtype=np.int32))
    c.output(c.op("cast", "x", dtype=I8), "y")
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
    movement_data = {
        BF16: narrow_edges(BF16)[:6],
        F16: narrow_edges(F16)[:6],
        F8: narrow_edges(F8)[:6],
        I8: np.array([-128, 127, -1, 0, 1, 7], dtype=np.int8),
    }
    for dtype, x in movement_data.items():
        c = Case(fam, f"movement_{dtype}", f"reshape, permute, slice, broadcast and concat on a {dtype} value holding its edge values (copied bit for bit)")
        c.input("x", x.reshape(2, 3))
        r_ = c.op("reshape", "x", shape=[3, 2, 1])
        p_ = c.op("permute", r_, perm=[2, 0, 1])
        s_ = c.op("slice", p_, dim=1, start=1, len=2)
        b_ = c.op("broadcast", s_, shape=[2, 2, 2])
        c.output(c.op("concat", b_, s_, dim=0), "y", **exact_for(dtype))
        cases.append(c)
    c = Case(fam, "transpose_bf16_weight", "a bf16 [out, in] weight transposed and made contiguous by a concat (the layout change a bf16 weight goes through)")
    c.input("w", narrow(c.rng, (4, 6), BF16), role="weight")
    t = c.op("permute", "w", perm=[1, 0])
    c.output(c.op("concat", t, c.op("slice", t, dim=1, start=0, len=1), dim=1), "y", **EXACT)
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
    for name, doc, data, dtype, shape in (
        ("constant_bf16", "bf16 literals: +-inf, NaN, the largest finite bf16 (3.39e38) of both signs, the smallest normal (2^-126), -0, 0.1 as bf16, -256", [-INF, INF, NAN, BF16_MAX, -BF16_MAX, 2.0**-126, -0.0, 0.10009765625, 1.5, -256.0], BF16, [2, 5]),
        ("constant_f16", "f16 literals: 65504 (the largest finite) of both signs, +-inf, NaN, the smallest subnormal (2^-24) and normal (2^-14), -0, 0.1 as f16", [F16_MAX, -F16_MAX, INF, -INF, NAN, 2.0**-24, 2.0**-14, -0.0, 0.0999755859375, 1.0], F16, [2, 5]),
        ("constant_f8e4m3fn", "f8e4m3fn literals: 448 (the largest finite; there is no infinity) of both signs, NaN, the smallest subnormal (2^-9) of both signs, the smallest normal (2^-6), -0", [F8_MAX, -F8_MAX, NAN, F8_TINY, -F8_TINY, 2.0**-6, -0.0, 1.125, 240.0, -0.875], F8, [5, 2]),
        ("constant_i8", "i8 literals at both ends of the range", [-128, 127, -1, 0, 1, 7], I8, [3, 2]),
    ):
        c = Case(fam, name, doc)
        k = c.const(data, dtype, shape)
        # Widened as well, so the literal feeds a computation besides being an output (the graph
        # has no elementwise arithmetic on these types).
        wide = I32 if dtype == I8 else F32
        c.output(k, "k", **exact_for(dtype))
        c.output(c.op("cast", k, dtype=wide), "wide", **exact_for(wide))
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
            c.known(cpu=CPU_NAN_REDUCE, hlo_cpu=CPU_NAN_REDUCE, nrt_sim=CPU_NAN_REDUCE)
        c = Case(fam, f"{op[7:]}_f32_empty_dim", f"{op} over a dimension of size 0 gives the init value ({'0' if op == 'reduce_sum' else '-inf' if op == 'reduce_max' else '+inf'})")
        c.input("x", np.zeros((3, 0), dtype=np.float32))
        c.output(c.op(op, "x", dim=1), "y", **EXACT)
        cases.append(c)
        c = Case(fam, f"{op[7:]}_f32_empty_rest", f"{op} over a full dim of a [0, 4] value gives a [0] value")
        c.input("x", np.zeros((0, 4), dtype=np.float32))
        c.output(c.op(op, "x", dim=1), "y", **EXACT)
        cases.append(c)
        for dtype in (I32, U32):
            c = Case(fam, f"{op[7:]}_{dtype}", f"{op} on {dtype} over dim 1 (sums wrap on overflow)")
            x = ints(c.rng, (4, 3), dtype)
            c.input("x", x)
            c.output(c.op(op, "x", dim=1), "y")
            cases.append(c)
    for op, dtype, init in (("reduce_max", I32, "i32::MIN"), ("reduce_min", U32, "u32::MAX")):
        c = Case(fam, f"{op[7:]}_{dtype}_empty_dim", f"{op} over a {dtype} dimension of size 0 gives the init value, {init}")
        c.input("x", np.zeros((2, 0), dtype=NP_DTYPE[dtype]))
        c.output(c.op(op, "x", dim=1), "y")
        cases.append(c)
    c = Case(fam, "sum_i32_small", "an i32 sum that does not overflow (the MoE hit count)")
    c.input("x", ints(c.rng, (3, 5), I32, -100, 100))
    c.output(c.op("reduce_sum", "x", dim=0), "y")
    cases.append(c)
    cases += narrow_reduce_cases(fam)
    return cases


def narrow_reduce_cases(fam):
    """Sums, maxima and minima of bf16 and f16 values. An HLO reduce over bf16 adds in bf16 (its
    combiner returns bf16), in an order of the backend's choosing, so a sum of arbitrary values
    may round differently per executor; the values here are multiples of 1/8 within [-4, 4], so
    every partial sum of a row (at most 4 * 4 = 16 in magnitude, a multiple of 1/8) is exact in
    bf16 (8 significant bits) and f16, every order gives the one exact sum, and the comparison is
    exact. Overflow is tested with rows whose partial sums overflow in every order."""
    cases = []
    for dtype in (BF16, F16):
        big = 2.0**127 if dtype == BF16 else 40000.0
        for op in ("reduce_sum", "reduce_max", "reduce_min"):
            c = Case(fam, f"{op[7:]}_{dtype}", f"{op} over the middle dim of a [3, 4, 5] {dtype} value (multiples of 1/8 within [-4, 4]: exact sums)")
            c.input("x", (c.rng.integers(-32, 33, (3, 4, 5)) / 8).astype(NP_DTYPE[dtype]))
            c.output(c.op(op, "x", dim=1), "y", **EXACT)
            cases.append(c)
            c = Case(fam, f"{op[7:]}_{dtype}_edges", f"{op} over {dtype} rows holding +inf, -inf, both (the sum is NaN), all -inf, all +inf, +-0, and values whose sum overflows to +-inf in {dtype} ({big:g} + {big:g})")
            x = np.array(
                [
                    [INF, 1.0, 2.0, 3.0],
                    [-INF, -1.0, -2.0, -3.0],
                    [INF, -INF, 0.0, 1.0],
                    [-INF, -INF, -INF, -INF],
                    [INF, INF, INF, INF],
                    [-0.0, 0.0, -0.0, 0.0],
                    [big, big, 0.0, 1.0],
                    [-big, -big, -1.0, 0.0],
                ],
                dtype=np.float32,
            ).astype(NP_DTYPE[dtype])
            c.input("x", x)
            c.output(c.op(op, "x", dim=1), "y", **EXACT)
            cases.append(c)
            init = {"reduce_sum": "0", "reduce_max": "-inf", "reduce_min": "+inf"}[op]
            c = Case(fam, f"{op[7:]}_{dtype}_empty_dim", f"{op} over a {dtype} dimension of size 0 gives the {dtype} identity, {init} (the init value of the HLO reduce; an emitter that wrote the f32 identity's bits or a finite extreme fails here)")
            c.input("x", np.zeros((3, 0), dtype=NP_DTYPE[dtype]))
            c.output(c.op(op, "x", dim=1), "y", **EXACT)
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
    # Narrow operands, an f32 result (`matmul_to`, HLO's dot with an f32 result shape). The
    # expected value is numpy's float64 product of the widened values; the product of two bf16
    # (8-bit) or f16 (11-bit) significands is exact in float32, so only the f32 sums round, and
    # MM's reasoning holds as for f32 operands.
    for name, doc, dtype, sa, sb in (
        ("matmul_to_bf16", "bf16 [3, 5] x [5, 4] -> f32", BF16, (3, 5), (5, 4)),
        ("matmul_to_bf16_batched", "bf16 [2, 3, 4] x [2, 4, 5] -> f32", BF16, (2, 3, 4), (2, 4, 5)),
        ("matmul_to_bf16_k0", "bf16 [2, 0] x [0, 3] -> f32 zeros (an empty sum)", BF16, (2, 0), (0, 3)),
        ("matmul_to_f16", "f16 [3, 6] x [6, 2] -> f32", F16, (3, 6), (6, 2)),
    ):
        c = Case(fam, name, doc)
        c.input("a", narrow(c.rng, sa, dtype))
        c.input("b", narrow(c.rng, sb, dtype), role="weight")
        c.output(c.op("matmul_to", "a", "b", dtype=F32), "y", **MM)
        cases.append(c)
    c = Case(fam, "matmul_to_bf16_transposed_rhs", "bf16 x @ w^T -> f32 with w a bf16 HF-layout [out, in] weight (a permuted, strided operand)")
    c.input("x", narrow(c.rng, (3, 6), BF16))
    c.input("w", narrow(c.rng, (4, 6), BF16), role="weight")
    c.output(c.op("matmul_to", "x", c.op("permute", "w", perm=[1, 0]), dtype=F32), "y", **MM)
    cases.append(c)
    c = Case(fam, "matmul_to_bf16_nonfinite", "bf16 operands with inf and NaN -> f32: inf * 0 is NaN, inf + finite is inf, NaN spreads")
    c.input("a", np.array([[INF, 0, 1], [1, 2, 3], [NAN, 1, 1], [-INF, 1, 0]], dtype=np.float32).astype(NP_DTYPE[BF16]))
    c.input("b", np.array([[0, 1], [1, 1], [1, 2]], dtype=np.float32).astype(NP_DTYPE[BF16]))
    c.output(c.op("matmul_to", "a", "b", dtype=F32), "y", **MM)
    cases.append(c)
    c = Case(fam, "matmul_to_f16_beyond_f16", "f16 operands whose products and sums exceed f16's range (300 * 300 * 2 = 180000 > 65504): the f32 result is finite, where f16 accumulation would give inf")
    c.input("a", np.array([[300, 300], [-300, 255]], dtype=np.float16))
    c.input("b", np.array([[300, 1], [300, -2]], dtype=np.float16))
    c.output(c.op("matmul_to", "a", "b", dtype=F32), "y", **MM)
    cases.append(c)
    c = Case(fam, "matmul_widened_bf16_rhs", "x @ f32(w^T) with x f32 and w a bf16 [out, in] weight widened by a cast only the matmul reads (the model's bf16 weights; the CPU fuses the cast into the matmul)")
    c.input("x", floats(c.rng, (3, 6)))
    c.input("w", narrow(c.rng, (4, 6), BF16), role="weight")
    wt = c.op("cast", c.op("permute", "w", perm=[1, 0]), dtype=F32)
    c.output(c.op("matmul", "x", wt), "y", **MM)
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
    for dtype in (BF16, F16, F8, I8):
        c = Case(fam, f"index_select_{dtype}", f"rows of a [4, 3] {dtype} weight holding its edge values (the embedding lookup of a {dtype} table), repeated and out of order")
        x = np.array([-128, 127, -1, 0, 1, 7, 5, -5, 100, -100, 2, 3], dtype=np.int8) if dtype == I8 else np.concatenate([narrow_edges(dtype)[:6], narrow(c.rng, 6, dtype)])
        c.input("x", x.reshape(4, 3), role="weight")
        c.input("ids", np.array([3, 0, 0, 2, 1], dtype=np.int32))
        c.output(c.op("index_select", "x", "ids", dim=0), "y", **exact_for(dtype))
        cases.append(c)
    c = Case(fam, "index_select_bf16_3d", "stacked bf16 expert weights: slices of dim 0 of a [4, 2, 3] value")
    c.input("x", narrow(c.rng, (4, 2, 3), BF16), role="weight")
    c.input("ids", np.array([3, 0, 3], dtype=np.int32))
    c.output(c.op("index_select", "x", "ids", dim=0), "y", **EXACT)
    cases.append(c)
    c = Case(fam, "gather_bf16", "per-row picks of bf16 data along dim 1")
    c.input("x", narrow(c.rng, (3, 5), BF16))
    c.input("ids", c.rng.integers(0, 5, (3, 4)).astype(np.int32))
    c.output(c.op("gather", "x", "ids", dim=1), "y", **EXACT)
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
    c.known(xla=XLA_ONE_TUPLE)
    c = Case(fam, "scatter_rows_two_layers", "two layers' column ranges of one root, the second reading the first's result, with NaN and inf values")
    c.input("kv", floats(c.rng, (4, 6)), role="cache_root")
    c.input("rows", np.array([2, 0], dtype=np.int32))
    c.input("src", np.array([[NAN, INF, 1], [-INF, 0, -0.0]], dtype=np.float32))
    l0 = c.op("scatter_rows", "kv", "rows", "src", col=0)
    l1 = c.op("scatter_rows", l0, "rows", c.op("neg", "src"), col=3)
    c.output(l1, "kv", aliases="kv", **EXACT)
    cases.append(c)
    c.known(xla=XLA_ONE_TUPLE)
    c = Case(fam, "scatter_rows_root_still_read", "the old root is read after the update, so the update cannot happen in place and the aliased output is copied back")
    c.input("kv", floats(c.rng, (4, 3)), role="cache_root")
    c.input("rows", np.array([1], dtype=np.int32))
    c.input("src", floats(c.rng, (1, 2)))
    new = c.op("scatter_rows", "kv", "rows", "src", col=1)
    c.output(new, "kv", aliases="kv", **EXACT)
    c.output(c.op("slice", "kv", dim=0, start=1, len=1), "old_row", **EXACT)
    cases.append(c)
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
    for dtype in (BF16, F16, F8, I8):
        c = Case(fam, f"scatter_rows_{dtype}", f"rows written into a {dtype} root (a {dtype} KV cache), source rows holding the type's edge values")
        if dtype == I8:
            root, src = c.rng.integers(-128, 128, (4, 3)).astype(np.int8), np.array([[-128, 127], [-1, 0]], dtype=np.int8)
        else:
            root, src = narrow(c.rng, (4, 3), dtype), narrow_edges(dtype)[:4].reshape(2, 2)
        c.input("root", root)
        c.input("rows", np.array([0, 3], dtype=np.int32))
        c.input("src", src)
        c.output(c.op("scatter_rows", "root", "rows", "src", col=1), "y", **exact_for(dtype))
        cases.append(c)
    c = Case(fam, "scatter_rows_bf16_in_place", "a bf16 cache root updated in place (the output aliases the root), then read back widened to f32 as attention reads the cache")
    c.input("kv", narrow(c.rng, (5, 4), BF16), role="cache_root")
    c.input("rows", np.array([4, 1], dtype=np.int32))
    c.input("src", narrow(c.rng, (2, 3), BF16))
    new = c.op("scatter_rows", "kv", "rows", "src", col=1)
    c.output(new, "kv", aliases="kv", **EXACT)
    c.output(c.op("cast", new, dtype=F32), "read", **EXACT)
    cases.append(c)
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
    c.known(
        cpu="the CPU's top-k ranks NaN equal to +inf (its sort key maps NaN to +inf), so a +inf before a NaN comes first",
        hlo_cpu="the CPU's top-k ranks NaN equal to +inf",
        nrt_sim="the CPU's top-k ranks NaN equal to +inf",
    )
    return cases


def mass_threshold_cases():
    fam = "mass_threshold"
    cases = []
    bc = lambda c, v, shape: c.op("broadcast", c.const([v], F32, []), shape=shape)  # noqa: E731
    c = Case(fam, "mass_threshold_kth", "unit weights: the k-th largest value, ties counted once each (k = 3 lands on a tie), -0 and +0 equal, NaN never counted, infinities as values, a subnormal k-th value read as 0")
    x = np.array(
        [
            [1, 3, 3, -1, 2, 0, 3, -2],
            [-0.0, 0.0, -1, 1e-30, -1e-30, NAN, 5, NAN],
            [INF, 2, -INF, 7, NAN, -3, 0.5, 0.25],
            [4, 4, 4, 4, 4, 4, 4, 4],
            [1e-40, 2, 3, -1, -5e-40, 9, -2, -3],
        ],
        dtype=np.float32,
    )
    c.input("x", x)
    c.input("target", np.array([3, 3, 2, 5, 4], dtype=np.float32))
    c.output(c.op("mass_threshold", "x", bc(c, 1.0, [5, 8]), "target"), "t", **EXACT)
    cases.append(c)

    c = Case(fam, "mass_threshold_edges", "target <= 0 gives +inf; a NaN target, or one above the row's whole mass, gives -inf; a target met only by counting -inf gives -inf; an all-NaN row gives -inf")
    x = np.array([[1, 2, 3], [1, 2, 3], [1, 2, 3], [1, 2, 3], [1, -INF, 2], [NAN, NAN, NAN], [1, 2, 3]], dtype=np.float32)
    c.input("x", x)
    c.input("target", np.array([0, -1, NAN, 3.5, 3, 1, 3], dtype=np.float32))
    c.output(c.op("mass_threshold", "x", bc(c, 1.0, [7, 3]), "target"), "t", **EXACT)
    cases.append(c)

    c = Case(fam, "mass_threshold_weighted", "probability weights, targets a fraction of each row's mass (a nucleus's cut); zero weights count nothing")
    z = floats(c.rng, (4, 24), -3, 3)
    w = np.exp(z - z.max(1, keepdims=True)).astype(np.float32)
    w[1, :6] = 0.0
    c.input("x", z)
    c.input("w", w)
    c.input("frac", np.array([0.5, 0.9, 0.25, 0.99], dtype=np.float32))
    total = c.op("reduce_sum", "w", dim=1)
    # A value of x, so exact: the float32 evaluation (different rounding of the sums) must pick
    # the same value, or the script refuses the inputs as too close to a step of the mass.
    c.output(c.op("mass_threshold", "x", "w", c.op("mul", "frac", total)), "t", **EXACT)
    cases.append(c)

    c = Case(fam, "mass_threshold_inverse_cdf", "values -index, weights probabilities: the first index whose running mass reaches u * total, an inverse-CDF draw")
    rows, n = 4, 16
    w = np.exp(floats(c.rng, (rows, n), -2, 2)).astype(np.float32)
    w[2, 5:] = 0.0
    c.input("w", w)
    c.input("u", np.array([0.05, 0.5, 0.95, 0.999], dtype=np.float32))
    neg_index = c.op("neg", c.op("cast", c.op("iota", dtype=I32, shape=[rows, n], dim=1), dtype=F32))
    at = c.op("mass_threshold", neg_index, "w", c.op("mul", "u", c.op("reduce_sum", "w", dim=1)))
    c.output(c.op("cast", c.op("neg", at), dtype=I32), "index")
    cases.append(c)

    c = Case(fam, "mass_threshold_wide", "one row of 20,000 values (wider than neuronx-cc's 16,384-wide top-k): the 17,000th largest")
    c.input("x", floats(c.rng, (1, 20000), -8, 8))
    c.input("target", np.array([17000], dtype=np.float32))
    c.output(c.op("mass_threshold", "x", bc(c, 1.0, [1, 20000]), "target"), "t", **EXACT)
    cases.append(c)
    return cases


def dequantize_int4_cases():
    """The int4 experts' unpacking (`--quantize experts-int4`): u8 codes, two a byte (the even
    value in the low nibble), biased by 8, times one f32 scale per `group` values of a row. Each
    value is `(code - 8) * scale`, one float32 product of an exact integer and the scale: a
    correctly rounded result, so every output is compared exactly."""
    fam = "dequantize_int4"
    cases = []

    def codes(rng, shape):
        return rng.integers(0, 256, size=shape).astype(NP_DTYPE[U8])

    def every_nibble(rng):
        """16 bytes whose low nibbles are 0..15 and whose high nibbles are 0..15, each in a
        random order: every code in both positions of a byte."""
        return (rng.permutation(16) | (rng.permutation(16) << 4)).astype(NP_DTYPE[U8])

    c = Case(fam, "dequantize_int4_ragged_groups", "rows of 300 values (150 bytes) in groups of 128: two whole groups and a ragged last one of 44 values; each (row, group) holds every code 0..15 in both the low and the high nibble; scales 0, -0, negative, 1e30 and 1e-30 (products stay normal and finite) and random ones")
    q = codes(c.rng, (4, 150))
    for r in range(4):
        for start in (0, 64, 128):  # the first byte of each group (64 bytes a group)
            q[r, start : start + 16] = every_nibble(c.rng)
    s = np.array([[0.0, -0.75, 1e30], [1e-30, 0.0625, -3.0], [-1e-30, -1e30, -0.0]], dtype=np.float32)
    s = np.concatenate([s, floats(c.rng, (1, 3), -1, 1)])
    c.input("codes", q)
    c.input("scales", s)
    c.output(c.op("dequantize_int4", "codes", "scales", group=128), "w", **EXACT)
    cases.append(c)

    c = Case(fam, "dequantize_int4_fixture_shape", "stacked experts' codes [2, 3, 64] (128 values a row) in groups of 128, one scale a row ([2, 3, 1]): the default model's expert shape")
    c.input("codes", codes(c.rng, (2, 3, 64)), role="weight")
    c.input("scales", floats(c.rng, (2, 3, 1), 0.001, 0.05), role="weight")
    c.output(c.op("dequantize_int4", "codes", "scales", group=128), "w", **EXACT)
    cases.append(c)

    c = Case(fam, "dequantize_int4_selected_experts", "the gathered experts: index_select of the u8 codes and of their scales by the same expert ids (repeated, out of order), then dequantize_int4 of the selected ones")
    c.input("codes", codes(c.rng, (4, 3, 64)), role="weight")
    c.input("scales", floats(c.rng, (4, 3, 1), -0.05, 0.05), role="weight")
    c.input("ids", np.array([2, 0, 2, 3], dtype=np.int32))
    sel = c.op("index_select", "codes", "ids", dim=0)
    c.output(sel, "selected")
    c.output(c.op("dequantize_int4", sel, c.op("index_select", "scales", "ids", dim=0), group=128), "w", **EXACT)
    cases.append(c)

    for name, doc, shape, group in (
        ("dequantize_int4_group5", "an odd group (5, legal for the op): groups start in the middle of a byte, so a byte's two values take different scales; 14 values a row make groups of 5, 5 and 4", (3, 7), 5),
        ("dequantize_int4_group6", "an even group that is not a power of two (3 bytes a group), 16 values a row in groups of 6, 6 and 4", (2, 8), 6),
        ("dequantize_int4_group1_rank1", "rank 1, a group of one value: one scale per value, the two values of a byte with different scales", (8,), 1),
        ("dequantize_int4_group_wider_than_row", "a group (128) wider than the row (10 values): one ragged group a row", (2, 5), 128),
    ):
        c = Case(fam, name, doc)
        q = codes(c.rng, shape)
        groups = -(-2 * shape[-1] // group)
        c.input("codes", q)
        c.input("scales", floats(c.rng, shape[:-1] + (groups,), -2, 2))
        c.output(c.op("dequantize_int4", "codes", "scales", group=group), "w", **EXACT)
        cases.append(c)

    c = Case(fam, "dequantize_int4_no_rows", "zero rows: [0, 4] codes and [0, 1] scales give a [0, 8] value")
    c.input("codes", np.zeros((0, 4), dtype=np.uint8))
    c.input("scales", np.zeros((0, 1), dtype=np.float32))
    c.output(c.op("dequantize_int4", "codes", "scales", group=8), "w", **EXACT)
    cases.append(c)

    # The two expert strategies' matmuls of dequantized experts (x @ w^T, the form the CPU
    # backend fuses into its expert matmul kernel: the gathered one with the selection, the dense
    # one without). 256-term dots of x in [-1, 1] and weights |(code - 8) * scale| <= 8 / 64:
    # every partial sum is at most 32 in magnitude, and atol 1e-4 (26 float32 ulps of 32) with
    # rtol 1e-5 covers the summation order of any float32 implementation; a wrong nibble, group
    # or scale moves a value by a whole weight times x, far more.
    MM4 = {"atol": 1e-4, "rtol": 1e-5}
    c = Case(fam, "dequantize_int4_gathered_matmul", "the gathered experts' matmul: per (token, slot), x [1, 256] times the transposed dequantized expert its id selects (codes [3, 5, 128] and scales [3, 5, 2] selected by repeated ids), groups of 128")
    c.input("x", floats(c.rng, (4, 1, 256), -1, 1))
    c.input("codes", codes(c.rng, (3, 5, 128)), role="weight")
    c.input("scales", floats(c.rng, (3, 5, 2), 1 / 128, 1 / 64), role="weight")
    c.input("ids", np.array([1, 1, 0, 2], dtype=np.int32))
    w = c.op("dequantize_int4", c.op("index_select", "codes", "ids", dim=0), c.op("index_select", "scales", "ids", dim=0), group=128)
    c.output(c.op("matmul", "x", c.op("permute", w, perm=[0, 2, 1])), "y", **MM4)
    cases.append(c)

    c = Case(fam, "dequantize_int4_dense_matmul", "the dense experts' matmul: the tokens x [3, 256] broadcast to every expert, times each transposed dequantized expert (codes [3, 5, 128], scales [3, 5, 2]), groups of 128")
    c.input("x", floats(c.rng, (3, 256), -1, 1))
    c.input("codes", codes(c.rng, (3, 5, 128)), role="weight")
    c.input("scales", floats(c.rng, (3, 5, 2), 1 / 128, 1 / 64), role="weight")
    w = c.op("dequantize_int4", "codes", "scales", group=128)
    xs = c.op("broadcast", "x", shape=[3, 3, 256])
    c.output(c.op("matmul", xs, c.op("permute", w, perm=[0, 2, 1])), "y", **MM4)
    cases.append(c)
    return cases


def dequantize_e2m1_cases():
    """DeepSeek-V4's FP4 experts' unpacking: u8 codes, two a byte (the even value in the low
    nibble), each an E2M1 value (ml_dtypes' float4_e2m1fn in the reference), times one f32 scale
    per `group` values of a row (32 in the published checkpoints, each a power of two). Each value
    is one float32 product of an exactly representable half-integer and the scale: compared
    exactly."""
    fam = "dequantize_e2m1"
    cases = []

    def codes(rng, shape):
        return rng.integers(0, 256, size=shape).astype(NP_DTYPE[U8])

    c = Case(fam, "dequantize_e2m1_every_code", "rows of 96 values (48 bytes) in groups of 32; each (row, group) holds every code 0..15 (0 and -0 included) in both the low and the high nibble; power-of-two scales from 2^-120 to 2^100 (what F8_E8M0 holds; products stay finite), 0, -1 and random ones")
    q = codes(c.rng, (4, 48))
    for r in range(4):
        for start in (0, 16, 32):  # the first byte of each group (16 bytes a group)
            q[r, start : start + 16] = (c.rng.permutation(16) | (c.rng.permutation(16) << 4)).astype(NP_DTYPE[U8])
    s = np.array([[2.0**-120, 1.0, 2.0**100], [0.0, 0.5, -1.0], [2.0**-7, 2.0**3, 2.0**-1]], dtype=np.float32)
    s = np.concatenate([s, floats(c.rng, (1, 3), -1, 1)])
    c.input("codes", q)
    c.input("scales", s)
    c.output(c.op("dequantize_e2m1", "codes", "scales", group=32), "w", **EXACT)
    cases.append(c)

    c = Case(fam, "dequantize_e2m1_selected_experts", "the gathered experts: index_select of stacked codes [4, 3, 32] (64 values a row) and their scales [4, 3, 2] by the same expert ids (repeated, out of order), then dequantize_e2m1 of the selected ones in groups of 32")
    c.input("codes", codes(c.rng, (4, 3, 32)), role="weight")
    c.input("scales", (2.0 ** c.rng.integers(-8, 2, size=(4, 3, 2))).astype(np.float32), role="weight")
    c.input("ids", np.array([2, 0, 2, 3], dtype=np.int32))
    sel = c.op("index_select", "codes", "ids", dim=0)
    c.output(c.op("dequantize_e2m1", sel, c.op("index_select", "scales", "ids", dim=0), group=32), "w", **EXACT)
    cases.append(c)

    c = Case(fam, "dequantize_e2m1_group5", "an odd group (5, legal for the op): a byte's two values take different scales; 14 values a row in groups of 5, 5 and 4")
    c.input("codes", codes(c.rng, (3, 7)))
    c.input("scales", floats(c.rng, (3, 3), -2, 2))
    c.output(c.op("dequantize_e2m1", "codes", "scales", group=5), "w", **EXACT)
    cases.append(c)

    # The gathered experts' matmul, as the V4 MoE writes it: 64-term dots of x in [-1, 1] and
    # weights |e2m1 * scale| <= 6 / 64; partial sums stay below 6, and atol 2e-5 with rtol 1e-5
    # covers any float32 summation order, far below a wrong code's effect.
    c = Case(fam, "dequantize_e2m1_gathered_matmul", "per (token, slot), x [1, 64] times the transposed dequantized expert its id selects (codes [3, 5, 32], scales [3, 5, 2] of 2^-6), groups of 32")
    c.input("x", floats(c.rng, (4, 1, 64), -1, 1))
    c.input("codes", codes(c.rng, (3, 5, 32)), role="weight")
    c.input("scales", np.full((3, 5, 2), 2.0**-6, dtype=np.float32), role="weight")
    c.input("ids", np.array([1, 1, 0, 2], dtype=np.int32))
    w = c.op("dequantize_e2m1", c.op("index_select", "codes", "ids", dim=0), c.op("index_select", "scales", "ids", dim=0), group=32)
    c.output(c.op("matmul", "x", c.op("permute", w, perm=[0, 2, 1])), "y", atol=2e-5, rtol=1e-5)
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
    "mass_threshold": mass_threshold_cases,
    "dequantize_int4": dequantize_int4_cases,
    "dequantize_e2m1": dequantize_e2m1_cases,
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
    if stale:
        print("out of date:", ", ".join(stale), "(run scripts/make_conformance.py)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
