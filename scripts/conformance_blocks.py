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
    c = Case(
        fam,
        "sampler_topk_topp_mask",
        "the sampler's mask: candidates by top-k, mass before each candidate by a triangular matmul, the threshold "
        "kept by top_k and top_p (each off in one row), logits below it set to -inf",
    )
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
