"""The conformance suite's blocks (tests/conformance/blocks.json): the model's composites, written
as op programs from the structure of src/model/*.rs (not by calling it), each checked against its
textbook numpy formula. Part of scripts/make_conformance.py.
"""

import numpy as np

from conformance_reference import EXACT, F32, I32, INF, U32, U32_MAX, Case, close_to, floats


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


# The limbs of model/sampling.rs: (shift, bits).
LIMBS = ((0, 11), (11, 11), (22, 10))


def wrapping_mul(c, x, const, n):
    """x * const modulo 2^32 on a [n] u32 value, as model/sampling.rs writes it: 11-bit limbs
    multiplied and summed in f32 (every coefficient below 2^24, so exact), carries by shifts."""
    k = lambda v: c.op("broadcast", c.const([v], U32, []), shape=[n])  # noqa: E731
    f = lambda v: c.op("broadcast", c.const([float(v)], F32, []), shape=[n])  # noqa: E731
    xs = [c.op("cast", c.op("bitand", c.op("shr", x, k(s)), k((1 << b) - 1)), dtype=F32) for s, b in LIMBS]
    cs = [(const >> s) & ((1 << b) - 1) for s, b in LIMBS]
    out = carry = None
    for i, (s, b) in enumerate(LIMBS):
        coef = c.op("mul", xs[0], f(cs[i]))
        for j in range(1, i + 1):
            coef = c.op("add", coef, c.op("mul", xs[j], f(cs[i - j])))
        if carry is not None:
            coef = c.op("add", coef, c.op("cast", carry, dtype=F32))
        coef = c.op("cast", coef, dtype=U32)
        digit = c.op("shl", c.op("bitand", coef, k((1 << b) - 1)), k(s))
        carry = c.op("shr", coef, k(b))
        out = digit if out is None else c.op("bitxor", out, digit)
    return out


def fmix32(c, x, n):
    """murmur3's finalizer on a [n] u32 value, as model/sampling.rs writes it."""
    k = lambda v: c.op("broadcast", c.const([v], U32, []), shape=[n])  # noqa: E731
    h = c.op("bitxor", x, c.op("shr", x, k(16)))
    h = wrapping_mul(c, h, 0x85EBCA6B, n)
    h = c.op("bitxor", h, c.op("shr", h, k(13)))
    h = wrapping_mul(c, h, 0xC2B2AE35, n)
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

    # --- the sampler's counter-based uniform (model/sampling.rs: uniform, wrapping_mul) ---
    c = Case(
        fam,
        "sampler_uniform",
        "one uniform per row from fmix32(seed ^ fmix32(pos ^ golden)), each u32 multiply done in 11-bit limbs "
        "whose products and sums stay below 2^24 in f32, reassembled with shifts, masks and xors: bit for bit "
        "the wrapping u32 hash; u = ((bits >> 9) + 0.5) / 2^23",
    )
    seeds = np.array([0, 1, 12345, U32_MAX, 0x80000000, 0x9E3779B9], dtype=np.uint32)
    posn = np.array([0, 1, 7, 2**31 - 1, 1 << 24, 65535], dtype=np.int32)
    rows = len(seeds)
    c.input("seeds", seeds)
    c.input("positions", posn)
    p = c.op("cast", "positions", dtype=U32)
    p = c.op("bitxor", p, c.op("broadcast", c.const([0x9E3779B9], U32, []), shape=[rows]))
    bits = fmix32(c, c.op("bitxor", "seeds", fmix32(c, p, rows)), rows)
    k = c.op("cast", c.op("shr", bits, c.op("broadcast", c.const([9], U32, []), shape=[rows])), dtype=F32)
    scale = c.op("broadcast", c.const([1.0 / 2**23], F32, []), shape=[rows])
    half = c.op("broadcast", c.const([0.5 / 2**23], F32, []), shape=[rows])
    c.output(bits, "bits")
    # Exact: a 23-bit integer times 2^-23 plus 2^-24 is exactly representable in float32.
    c.output(c.op("add", c.op("mul", k, scale), half), "u", **EXACT)

    def uniform_ref():
        bb = np_fmix32(seeds ^ np_fmix32(posn.view(np.uint32) ^ np.uint32(0x9E3779B9)))
        return {"bits": bb, "u": ((bb >> 9).astype(np.float64) + 0.5) / 2**23}

    c.check = close_to(uniform_ref, rtol=0, atol=0)
    cases.append(c)

    # --- top-k and top-p as the sampler cuts (model/sampling.rs: sample) ---
    c = Case(
        fam,
        "sampler_topk_topp_cut",
        "the sampler's cut: top-k as the k-th largest scaled logit (ties kept), top-p on the top-k survivors "
        "renormalised, both as mass thresholds, never above the best token; rows: top-k only, top-p only, both, "
        "neither, k = 1, top_p = 0, k = vocab (off), a tie at the k-th value",
    )
    rows, vocab = 8, 12
    z = floats(c.rng, (rows, vocab), -3, 3)
    z[7, [2, 5, 9]] = [2.5, 3.5, 2.5]
    z[7, [0, 1, 3, 4, 6, 7, 8, 10, 11]] = np.minimum(z[7, [0, 1, 3, 4, 6, 7, 8, 10, 11]], 2.0)
    top_k = np.array([3, 0, 5, 0, 1, 0, vocab, 2], dtype=np.int32)
    top_p = np.array([1.0, 0.7, 0.6, 1.0, 1.0, 0.0, 1.0, 1.0], dtype=np.float32)
    c.input("z", z)
    c.input("top_k", top_k)
    c.input("top_p", top_p)
    bc = lambda v, dt, shape: c.op("broadcast", c.const([v], dt, []), shape=shape)  # noqa: E731
    col = lambda v: c.op("broadcast", c.op("reshape", v, shape=[rows, 1]), shape=[rows, vocab])  # noqa: E731
    zmax = c.op("reduce_max", "z", dim=1)
    e = c.op("exp", c.op("sub", "z", col(zmax)))
    zero_r, ninf_r = bc(0.0, F32, [rows]), bc(-INF, F32, [rows])
    k_pos = c.op("gt", "top_k", bc(0, I32, [rows]))
    k_on = c.op("where", k_pos, c.op("lt", "top_k", bc(vocab, I32, [rows])), k_pos)
    t_k = c.op("mass_threshold", "z", bc(1.0, F32, [rows, vocab]), c.op("where", k_on, c.op("cast", "top_k", dtype=F32), zero_r))
    t_k = c.op("where", k_on, t_k, ninf_r)
    e_k = c.op("where", c.op("ge", "z", col(t_k)), e, bc(0.0, F32, [rows, vocab]))
    p_on = c.op("lt", "top_p", bc(1.0, F32, [rows]))
    p_target = c.op("where", p_on, c.op("mul", "top_p", c.op("reduce_sum", e_k, dim=1)), zero_r)
    t_p = c.op("where", p_on, c.op("mass_threshold", "z", e_k, p_target), ninf_r)
    cut = c.op("minimum", c.op("maximum", t_k, t_p), zmax)
    c.output(c.op("ge", "z", col(cut)), "kept")

    def cut_ref():
        zd = z.astype(np.float64)
        kept = np.zeros_like(zd, dtype=bool)
        for r in range(rows):
            order = np.argsort(-zd[r], kind="stable")
            keep = np.ones(vocab, dtype=bool)
            if 0 < top_k[r] < vocab:
                keep &= zd[r] >= zd[r][order[top_k[r] - 1]]  # ties with the k-th value stay
            if top_p[r] < 1:
                probs = np.where(keep, np.exp(zd[r] - zd[r].max()), 0.0)
                probs /= probs.sum()
                cum, cut_value = 0.0, zd[r].max()
                for i in order:
                    if not keep[i]:
                        break
                    cum += probs[i]
                    cut_value = zd[r][i]
                    if cum >= top_p[r]:
                        break
                keep &= zd[r] >= cut_value
            kept[r] = keep
        return {"kept": kept}

    c.check = close_to(cut_ref)
    cases.append(c)

    # --- the draw: inverse CDF, greedy rows (model/sampling.rs: sample, last lines) ---
    c = Case(
        fam,
        "sampler_inverse_cdf_draw",
        "the first token whose running mass of softmax(logits / T) reaches u * total (a -inf logit is never "
        "drawn); argmax where the temperature is 0",
    )
    rows, vocab = 4, 10
    logits = floats(c.rng, (rows, vocab), -2, 2)
    logits[0, 3] = -INF
    u = np.array([0.3, 0.5, 0.8, 0.1], dtype=np.float32)
    temp = np.array([1.0, 0.0, 0.7, 1.3], dtype=np.float32)
    c.input("logits", logits)
    c.input("u", u)
    c.input("temperature", temp)
    bc = lambda v, dt, shape: c.op("broadcast", c.const([v], dt, []), shape=shape)  # noqa: E731
    col = lambda v: c.op("broadcast", c.op("reshape", v, shape=[rows, 1]), shape=[rows, vocab])  # noqa: E731
    zero_r = bc(0.0, F32, [rows])
    greedy = c.op("argmax", "logits", dim=1)
    sampling = c.op("gt", "temperature", zero_r)
    t = c.op("where", sampling, "temperature", bc(1.0, F32, [rows]))
    zz = c.op("div", "logits", col(t))
    q = c.op("exp", c.op("sub", zz, col(c.op("reduce_max", zz, dim=1))))
    target = c.op("where", sampling, c.op("mul", "u", c.op("reduce_sum", q, dim=1)), zero_r)
    neg_index = c.op("neg", c.op("cast", c.op("iota", dtype=I32, shape=[rows, vocab], dim=1), dtype=F32))
    at = c.op("mass_threshold", neg_index, q, target)
    found = c.op("where", c.op("gt", at, bc(-INF, F32, [rows])), sampling, c.op("gt", zero_r, zero_r))
    token = c.op("cast", c.op("neg", c.op("where", found, at, zero_r)), dtype=I32)
    c.output(c.op("where", found, token, greedy), "next_tokens")

    def draw_ref():
        tt = np.where(temp > 0, temp, 1).astype(np.float64)
        p = np_softmax(logits.astype(np.float64) / tt[:, None])
        drawn = np.array([np.argmax(np.cumsum(p[r]) >= u[r]) for r in range(rows)])
        return {"next_tokens": np.where(temp > 0, drawn, np.argmax(logits, 1)).astype(np.int32)}

    c.check = close_to(draw_ref)
    cases.append(c)

    # --- MoE routing, noaux_tc with groups (model/moe.rs: route) ---
    c = Case(
        fam,
        "moe_route_grouped",
        "sigmoid scores + bias, group score = sum of each group's best two, keep the best groups, -inf elsewhere, "
        "top-k experts, weights gathered from the unbiased scores, normalized and scaled",
    )
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
    c = Case(
        fam,
        "moe_gathered_experts",
        "each token's chosen experts' weights picked by index_select, transposed and multiplied (the CPU fuses this "
        "into a grouped matmul), weighted and summed over choices",
    )
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
