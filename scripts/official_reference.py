"""Independent float64 forward pass of the official DeepSeek-V2/V3/V3.2 model math, for cross-checks.

What: a from-scratch implementation (torch, float64, no transformers) of the math of DeepSeek's
own code: DeepSeek-V3 `inference/model.py` (MLA, YaRN `precompute_freqs_cis`, sigmoid/noaux_tc
gate with -inf group masking, m^2 softmax scale), the DeepSeek-V2 `modeling_deepseek.py`
MoEGate (softmax, greedy / group_limited_greedy, normalise-or-scale rule) and, for configs with
`index_topk`, the DeepSeek Sparse Attention of DeepSeek-V3.2(-Exp) `inference/model.py` (class
`Indexer`, as fixed on 2025-11-17). It reads any checkpoint directory of the fixtures (either
config spelling, sharded or not, any float dtype).

V3.2 indexer, per layer, on the attention input x and the MLA query latent q_lat:
q = wq_b(q_lat) as index_n_heads heads of index_head_dim; k = LayerNorm(wk(x)) (k_norm weight and
bias, eps 1e-6), one head shared by all; non-interleaved (half-split: pairs i, i + rope/2) RoPE on
the first qk_rope_head_dim dims of q and k, with the same YaRN frequencies as MLA; score(s, t) =
sum_h weights_proj(x)[s, h] * index_n_heads^-0.5 * index_head_dim^-0.5 * relu(q[s, h] . k[t]);
causal mask; each query keeps its top-min(index_topk, seq) keys; MLA attention is then masked to
those keys (and causally). Left out, as they are not model math: the fp8 quantisation of q/k (and
the fp8 round trip of the MLA latent cache) and the Hadamard rotation of q and k (orthogonal, so
q . k is unchanged).

Where the official code and transformers 5 (models/deepseek_v32) differ, with no effect on the
result: the official code applies index_head_dim^-0.5 to the head weights after the relu,
transformers inside it (relu(a * c) = c * relu(a) for c > 0); the official code masks future keys
with -inf, transformers' eager path with the dtype's minimum. Rows with fewer visible keys than
index_topk select masked keys in both (top-k over the whole row); those stay masked, since the
causal mask is applied on top of the selection. The first release of the official inference code
applied the indexer RoPE interleaved (as in MLA); DeepSeek's 2025-11-17 fix made it half-split,
which transformers and this script follow (the tiny-v32 fixture tells the two layouts apart).

Why: reference.json files are produced with HF transformers; this script confirms that they
encode the official semantics rather than a transformers quirk (it is how the transformers 5
DeepseekV2 router's ignored `norm_topk_prob` was caught). It also documents, in ~150 lines,
exactly what the Rust engine must compute.

How to run (from the repository root, reference venv):

    /work/refenv/bin/python scripts/official_reference.py fixtures/tiny-v3 fixtures/tiny-v2-lite fixtures/tiny-v32

It prints, per fixture, the largest |logit difference| against reference.json and whether the
greedy continuation matches; scripts/make_fixtures.py runs the same check on every fixture it
writes.
"""

import argparse
import json
import math
from pathlib import Path

import safetensors.torch
import torch
import torch.nn.functional as F

DTYPE = torch.float64
LOGIT_TOLERANCE = 1e-4


def load_config(directory):
    """config.json with the rope settings normalised from either spelling.

    Published spelling: top-level `rope_theta` + `rope_scaling` ({"type": "yarn", ...} or absent).
    transformers 5 spelling: `rope_parameters` ({"rope_type": ..., "rope_theta": ..., ...}).
    """
    cfg = json.loads((directory / "config.json").read_text())
    rope = cfg.get("rope_parameters") or dict(cfg.get("rope_scaling") or {}, rope_theta=cfg.get("rope_theta", 10000.0))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    cfg["rope"] = dict(rope, rope_type=rope_type)
    return cfg


def load_weights(directory):
    weights = {}
    for path in sorted(directory.glob("*.safetensors")):
        weights.update((k, v.to(DTYPE)) for k, v in safetensors.torch.load_file(str(path)).items())
    if "lm_head.weight" not in weights:  # tie_word_embeddings
        weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
    return weights


def rope_frequencies(cfg, positions):
    """Complex rotations [positions, rope_dim/2] (official precompute_freqs_cis)."""
    rope, dim = cfg["rope"], cfg["qk_rope_head_dim"]
    base = rope["rope_theta"]
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=DTYPE) / dim))
    if rope["rope_type"] == "yarn":
        factor, original = rope["factor"], rope["original_max_position_embeddings"]

        def correction_dim(rotations):
            return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

        low = max(math.floor(correction_dim(rope["beta_fast"])), 0)
        high = min(math.ceil(correction_dim(rope["beta_slow"])), dim - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(dim // 2, dtype=DTYPE) - low) / (high - low)).clamp(0, 1)
        smooth = 1 - ramp
        freqs = freqs / factor * (1 - smooth) + freqs * smooth
        # cos/sin factor mscale(mscale) / mscale(mscale_all_dim) is 1.0 for every DeepSeek config.
        assert rope.get("mscale", 1.0) == rope.get("mscale_all_dim", 1.0)
    angles = torch.outer(torch.arange(positions, dtype=DTYPE), freqs)
    return torch.polar(torch.ones_like(angles), angles)


def apply_rope(x, rotations):
    """Interleaved-pair RoPE on the last dim of x [seq, ..., rope_dim]."""
    shape = x.shape
    pairs = torch.view_as_complex(x.reshape(*shape[:-1], -1, 2).contiguous())
    rot = rotations.view(shape[0], *([1] * (len(shape) - 2)), -1)
    return torch.view_as_real(pairs * rot).reshape(shape)


def apply_rope_half(x, rotations):
    """Non-interleaved (half-split) RoPE on the last dim of x [seq, ..., rope_dim]: pairs (i, i + rope_dim/2).

    Official V3.2 `apply_rotary_emb(x, freqs_cis, interleaved=False)`, used by the indexer only.
    """
    half = x.shape[-1] // 2
    rot = rotations.view(x.shape[0], *([1] * (x.dim() - 2)), -1)
    y = torch.complex(x[..., :half], x[..., half:]) * rot
    return torch.cat([y.real, y.imag], dim=-1)


def softmax_scale(cfg):
    """qk_head_dim^-0.5, times m^2 with m = 0.1 * mscale_all_dim * ln(factor) + 1 under YaRN."""
    scale = (cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]) ** -0.5
    rope = cfg["rope"]
    if rope["rope_type"] == "yarn" and rope.get("mscale_all_dim") and rope["factor"] > 1:
        m = 0.1 * rope["mscale_all_dim"] * math.log(rope["factor"]) + 1.0
        scale *= m * m
    return scale


def rms_norm(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def indexer_scores(cfg, w, p, x, q_lat, rotations):
    """Official V3.2 lightning-indexer scores [seq (query), seq (key)], -inf where causally masked.

    x is the attention input [seq, hidden], q_lat the MLA query latent (q_a_layernorm output).
    """
    seq, heads, dim, rope_dim = x.shape[0], cfg["index_n_heads"], cfg["index_head_dim"], cfg["qk_rope_head_dim"]
    q = (q_lat @ w[f"{p}.wq_b.weight"].T).view(seq, heads, dim)
    k = F.layer_norm(x @ w[f"{p}.wk.weight"].T, (dim,), w[f"{p}.k_norm.weight"], w[f"{p}.k_norm.bias"], 1e-6)
    q = torch.cat([apply_rope_half(q[..., :rope_dim], rotations), q[..., rope_dim:]], dim=-1)
    k = torch.cat([apply_rope_half(k[:, :rope_dim], rotations), k[:, rope_dim:]], dim=-1)
    # Official: the head weights carry both scales and multiply relu(q.k) (fp8_index).
    weights = (x @ w[f"{p}.weights_proj.weight"].T) * heads**-0.5 * dim**-0.5
    scores = torch.einsum("shd,td->sht", q, k).relu()
    causal = torch.ones(seq, seq, dtype=torch.bool).triu(1)
    return torch.einsum("sht,sh->st", scores, weights).masked_fill(causal, float("-inf"))


def index_mask(cfg, w, p, x, q_lat, rotations):
    """True at the keys each query may attend to: its top-min(index_topk, seq) indexer scores, causal."""
    scores = indexer_scores(cfg, w, p, x, q_lat, rotations)
    selected = scores.topk(min(cfg["index_topk"], x.shape[0]), dim=-1).indices
    # Rows with fewer visible keys than index_topk also select masked (-inf) keys, as in the official
    # code; they stay masked because the causal mask is applied on top.
    mask = torch.zeros_like(scores, dtype=torch.bool).scatter_(1, selected, True)
    return mask & ~torch.ones_like(mask).triu(1)


def mla(cfg, w, p, x, rotations):
    """Naive MLA over a whole causal sequence x [seq, hidden] (DSA-sparse when config has index_topk)."""
    seq, heads = x.shape[0], cfg["num_attention_heads"]
    nope, rope_dim, v_dim, rank = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"], cfg["kv_lora_rank"]
    if cfg["q_lora_rank"] is None:
        q = x @ w[f"{p}.q_proj.weight"].T
    else:
        q_lat = rms_norm(x @ w[f"{p}.q_a_proj.weight"].T, w[f"{p}.q_a_layernorm.weight"], cfg["rms_norm_eps"])
        q = q_lat @ w[f"{p}.q_b_proj.weight"].T
    q = q.view(seq, heads, nope + rope_dim)
    q_nope, q_pe = q.split([nope, rope_dim], dim=-1)
    q_pe = apply_rope(q_pe, rotations)
    kv = x @ w[f"{p}.kv_a_proj_with_mqa.weight"].T
    c_kv, k_pe = kv.split([rank, rope_dim], dim=-1)
    c_kv = rms_norm(c_kv, w[f"{p}.kv_a_layernorm.weight"], cfg["rms_norm_eps"])
    k_pe = apply_rope(k_pe, rotations)  # [seq, rope_dim], shared by every head
    kv = (c_kv @ w[f"{p}.kv_b_proj.weight"].T).view(seq, heads, nope + v_dim)
    k_nope, v = kv.split([nope, v_dim], dim=-1)
    scores = (torch.einsum("shd,thd->hst", q_nope, k_nope) + torch.einsum("shd,td->hst", q_pe, k_pe)) * softmax_scale(cfg)
    masked = torch.ones(seq, seq, dtype=torch.bool).triu(1)
    if cfg.get("index_topk") is not None:
        masked = ~index_mask(cfg, w, f"{p}.indexer", x, q_lat, rotations)
    probs = scores.masked_fill(masked, float("-inf")).softmax(-1)
    out = torch.einsum("hst,thd->shd", probs, v).reshape(seq, heads * v_dim)
    return out @ w[f"{p}.o_proj.weight"].T


def mlp(w, p, x):
    return (F.silu(x @ w[f"{p}.gate_proj.weight"].T) * (x @ w[f"{p}.up_proj.weight"].T)) @ w[f"{p}.down_proj.weight"].T


def route(cfg, w, p, x):
    """Expert indices and weights [seq, top_k] of the official V3 Gate / V2 MoEGate."""
    logits = x @ w[f"{p}.gate.weight"].T
    experts, top_k, groups = cfg["n_routed_experts"], cfg["num_experts_per_tok"], cfg["n_group"] or 1
    method = cfg.get("topk_method", "noaux_tc" if cfg["model_type"] == "deepseek_v3" else "greedy")
    if method == "noaux_tc":
        scores = logits.sigmoid()
        choice = scores + w[f"{p}.gate.e_score_correction_bias"]
        if groups > 1:
            group_scores = choice.view(-1, groups, experts // groups).topk(2, dim=-1).values.sum(-1)
            dropped = torch.ones_like(group_scores, dtype=torch.bool).scatter_(1, group_scores.topk(cfg["topk_group"], dim=-1).indices, False)
            choice = choice.masked_fill(dropped.repeat_interleave(experts // groups, dim=1), float("-inf"))
        indices = choice.topk(top_k, dim=-1).indices
        weights = scores.gather(1, indices)
        if cfg["norm_topk_prob"]:
            weights = weights / weights.sum(-1, keepdim=True)
        return indices, weights * cfg["routed_scaling_factor"]
    scores = logits.softmax(-1)
    choice = scores
    if method == "group_limited_greedy":
        group_scores = scores.view(-1, groups, experts // groups).amax(-1)
        dropped = torch.ones_like(group_scores, dtype=torch.bool).scatter_(1, group_scores.topk(cfg["topk_group"], dim=-1).indices, False)
        choice = scores.masked_fill(dropped.repeat_interleave(experts // groups, dim=1), float("-inf"))
    indices = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, indices)
    if top_k > 1 and cfg["norm_topk_prob"]:
        return indices, weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return indices, weights * cfg["routed_scaling_factor"]


def moe(cfg, w, p, x):
    indices, weights = route(cfg, w, p, x)
    out = mlp(w, f"{p}.shared_experts", x)
    for token in range(x.shape[0]):
        for e, g in zip(indices[token].tolist(), weights[token]):
            out[token] += g * mlp(w, f"{p}.experts.{e}", x[token])
    return out


def forward(cfg, w, token_ids):
    """Logits [seq, vocab] of one causal sequence."""
    x = w["model.embed_tokens.weight"][torch.tensor(token_ids)]
    rotations = rope_frequencies(cfg, len(token_ids))
    eps = cfg["rms_norm_eps"]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        x = x + mla(cfg, w, f"{p}.self_attn", rms_norm(x, w[f"{p}.input_layernorm.weight"], eps), rotations)
        h = rms_norm(x, w[f"{p}.post_attention_layernorm.weight"], eps)
        is_moe = i >= cfg["first_k_dense_replace"] and i % cfg.get("moe_layer_freq", 1) == 0
        x = x + (moe(cfg, w, f"{p}.mlp", h) if is_moe else mlp(w, f"{p}.mlp", h))
    return rms_norm(x, w["model.norm.weight"], eps) @ w["lm_head.weight"].T


def check_fixture(directory):
    """Max |logit diff| vs reference.json and whether the greedy continuation is reproduced."""
    cfg, weights = load_config(directory), load_weights(directory)
    reference = json.loads((directory / "reference.json").read_text())
    logits = forward(cfg, weights, reference["token_ids"])
    max_diff = (logits - torch.tensor(reference["logits"], dtype=DTYPE)).abs().max().item()
    tokens = list(reference["greedy"]["prompt_token_ids"])
    for _ in reference["greedy"]["generated_token_ids"]:
        tokens.append(int(forward(cfg, weights, tokens)[-1].argmax()))
    greedy_ok = tokens[len(reference["greedy"]["prompt_token_ids"]) :] == reference["greedy"]["generated_token_ids"]
    return max_diff, greedy_ok


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("fixtures", nargs="+", type=Path, help="fixture directories holding reference.json")
    args = parser.parse_args()
    failed = False
    for directory in args.fixtures:
        max_diff, greedy_ok = check_fixture(directory)
        ok = max_diff < LOGIT_TOLERANCE and greedy_ok
        failed |= not ok
        print(f"{directory}: max |logit diff| {max_diff:.2e}, greedy {'matches' if greedy_ok else 'DIFFERS'}"
              f" -> {'ok' if ok else 'MISMATCH'}")
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
