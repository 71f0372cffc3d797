"""Write the reduced-precision references: transformers-bf16 peers, int8/int4 routed experts, FP8 checkpoints.

What: for each of the fixtures tiny-v3, tiny-v2-lite, tiny-v2-group and tiny-v32 (written by
scripts/make_fixtures.py, which deletes and rewrites those directories: run this script after it)
it writes

  fixtures/<f>/reference-bf16.json         HF transformers on the same checkpoint loaded with
                                           dtype=torch.bfloat16 (weights and activations in bf16,
                                           exactly what a transformers-bf16 user gets; transformers
                                           itself keeps the router weight mlp.gate.weight, V3's
                                           e_score_correction_bias and the RoPE buffers in
                                           float32): logits of reference.json's token_ids, the
                                           greedy continuation of reference.json's prompt, and its
                                           error statistics against the float32 reference.json.
                                           tiny-v32: the lightning indexer is bf16 as well
                                           (transformers applies _keep_in_fp32_modules, which
                                           lists indexer.weights_proj, to float16 loads only;
                                           it computes the index scores in float32 from the bf16
                                           q/k/head weights); the notes give how many index top-k
                                           selections differ from float32's (bf16 rounding exceeds
                                           some top-k gaps: the peer's own behaviour).
  fixtures/<f>/reference-int8-experts.json transformers float32 on the checkpoint whose routed
                                           experts' gate/up/down weights are replaced by their
                                           symmetric per-output-row int8 round trip (see
                                           `int8_round_trip`; shared experts, dense MLPs and
                                           attention untouched): logits + greedy as in reference.json.
                                           tiny-v32 also gets `min_index_topk_gap` (make_fixtures'
                                           selection check on this model, must be > 1e-3).
  fixtures/<f>/reference-int4-experts.json the same with the routed experts' gate/up/down weights
                                           replaced by their symmetric int4 round trip, one scale
                                           per group of INT4_GROUP (128) consecutive inputs of an
                                           output row (see `int4_round_trip`; the fixtures' experts
                                           are 64 or 32 inputs wide, one group a row); its logits
                                           must also differ from the int8 reference's (> 1e-3).
                                           Not for tiny-v32 (INT4_SKIPPED: with int4 experts its
                                           greedy continuation has an exact index top-k tie; the
                                           script checks that the tie is still there).

and two new fixture directories

  fixtures/tiny-v3-fp8/                    tiny-v3 in the FP8 layout DeepSeek publishes for V3/R1:
                                           config.json with "quantization_config" (fp8, e4m3,
                                           dynamic activations, weight_block_size FP8_BLOCK), every
                                           attention/MLP/expert `*_proj.weight` stored as F8_E4M3
                                           with a float32 `<name>_scale_inv` of one scale per
                                           block (see `fp8_block_quantize`), everything else float32
                                           as in tiny-v3; reference.json = transformers float32 on
                                           the dequantized weights.
  fixtures/tiny-v32-fp8/                   tiny-v32 in the FP8 layout DeepSeek publishes for V3.2:
                                           the same projections in fp8 plus the lightning
                                           indexer's wq_b and wk (F8_E4M3 + `_scale_inv`; wk has a
                                           single block row, as in DeepSeek-V3.2), its weights_proj
                                           and k_norm float32 as in tiny-v32; weight_block_size
                                           FP8_BLOCK_V32 (16 x 10: with FP8_BLOCK the dequantized
                                           model's greedy continuation has exact index top-k ties,
                                           see FP8_BLOCK_V32); reference.json as tiny-v3-fp8's, plus
                                           `min_index_topk_gap` (> 1e-3 on the dequantized model).

Why: deepinfer issue 12 (reduced-precision weights): these files say what "correct" means for
an engine running with bf16, int8, int4 or fp8 weights. reference-bf16.json is not a target for bit equality: it
shows how far a real bf16 peer (transformers) drifts from float32 on the same model, the yardstick
for the engine's own reduced-precision modes. The int8, int4 and fp8 references are exact targets: they
are float32 runs on weights whose dequantized values are defined bit for bit here, so an engine
that dequantizes the same way must match them to float32 accuracy.

How the references are computed: transformers 5 fuses the per-expert tensors into
`mlp.experts.gate_up_proj`/`down_proj` when it loads a checkpoint, so weights are not patched
inside the model. Instead the modified tensors, widened to float32, are written with the source
config.json to a temporary checkpoint that make_fixtures.load_reference_model loads (same loading
path, same official-V2-routing patch, same key checks as reference.json). Before that, the same
route with unmodified weights must reproduce reference.json bit for bit (for tiny-v32 also its
min_index_topk_gap). Every int8/int4/fp8 reference is cross-checked with scripts/official_reference.py
(independent float64 official math) and must differ from the float32 reference (its weights and its
logits) so that a test skipping the quantization fails; for tiny-v32 the k-th vs (k+1)-th indexer
score gap must stay > 1e-3 on the modified model (make_fixtures.index_topk_gaps), or an engine
computing the same scores in another order could select other keys. The fp8 references are computed
from the dequantization of what was written to tiny-v3(2)-fp8/model.safetensors, not from the
in-memory values, and never through transformers' own fp8 loader (with 5.24.0, from_pretrained on
that directory selects its FP8 quantizer and, in the reference venv, stops with "requires
accelerate"): the model is built from the source fixture's config.json, which the script checks is
the fp8 config minus quantization_config. Activations are not quantized (weight-only dequantization,
the default gemm_impl = "bf16" path of DeepSeek-V3's inference/model.py, here in float32; nor are
the V3.2 indexer's q and k, which DeepSeek's kernels quantize to fp8).

One CPU thread, no randomness: reruns reproduce every file byte for byte.

How to run (from the repository root, reference venv of scripts/requirements-ref.txt):

    /work/refenv/bin/python scripts/make_precision_references.py            # fixtures in ./fixtures
    /work/refenv/bin/python scripts/make_precision_references.py --fixtures /tmp/fx
    /work/refenv/bin/python scripts/make_precision_references.py --only int4  # just reference-int4-experts.json

--only int4 writes only fixtures/<f>/reference-int4-experts.json and leaves every other file alone.
It is for a machine whose float32 transformers run does not reproduce the committed reference.json
bit for bit (another CPU: its matmul kernels round differently in the last bits), where the full run
stops at the route check. There the route check becomes: the temporary-checkpoint route reproduces
a direct run on the fixture directory bit for bit (logits, greedy, index top-k gap), and that direct
run is within ENV_DRIFT_TOLERANCE (1e-5, a tenth of the engine's parity tolerance) of reference.json
with the same greedy continuation; the drift is printed and stated in the int4 notes. The int4
logits then carry that drift, and the int8-vs-int4 check uses the committed
reference-int8-experts.json.
"""

import argparse
import json
import math
import re
import shutil
import tempfile
from pathlib import Path

import safetensors.torch
import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM

import official_reference
from make_fixtures import (
    GREEDY_NEW_TOKENS,
    MIN_INDEX_TOPK_GAP,
    TINY,
    expected_tensors,
    greedy,
    greedy_steps,
    index_topk_gaps,
    indexer_modules,
    load_reference_model,
    use_official_v2_routing,
    write_json,
)

FIXTURES = ("tiny-v3", "tiny-v2-lite", "tiny-v2-group", "tiny-v32")

INT8_MAX = 127
INT4_MAX = 7
INT4_GROUP = 128  # inputs per int4 scale, along each output row (`--quantize experts-int4`)
# Fixtures without reference-int4-experts.json. tiny-v32: on the int4 model the greedy continuation
# of reference.json's (fixed) prompt reaches a query (layer 0, position 20) where only 5 keys score
# above 0 with index_topk 6, so the 6th and 7th largest indexer scores are both exactly 0.0 (relu in
# every head), an exact tie the KV-cache and cache-free paths break differently (their greedy tokens
# part at step 15), as FP8_BLOCK's does for tiny-v32-fp8. Unlike fp8's block size, the int4 group
# cannot be changed to avoid it: it is the engine's format, and the experts are one group a row anyway.
# check_int4_tie asserts on each run that the tie is still there.
INT4_SKIPPED = {"tiny-v32"}
ROUTED_EXPERT_WEIGHT = re.compile(r"model\.layers\.\d+\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight")

# tiny-v3's quantized shapes: 32 x 64 (q_a, expert/shared gate+up), 96 x 32 (q_b), 40 x 64
# (kv_a_proj_with_mqa), 128 x 32 (kv_b), 64 x 64 (o), 128 x 64 / 64 x 128 (dense MLP), 64 x 32
# (expert/shared down). 16 x 12 gives every tensor >= 2 blocks in both dims; no column count
# is a multiple of 12, so every tensor has a ragged last block column, and 40 rows give
# kv_a_proj_with_mqa a ragged last block row of 8 as well (as DeepSeek-V3's own
# kv_a_proj_with_mqa, 576 = 4.5 x 128 rows, has with its 128 x 128 blocks). Non-square blocks
# catch a loader that swaps the block's two dims.
FP8_BLOCK = (16, 12)
# tiny-v32-fp8: tiny-v3's shapes plus the indexer's wq_b 64 x 32 and wk 16 x 64. With FP8_BLOCK the
# dequantized model fails make_fixtures' selection check: its greedy continuation (from tiny-v32's
# fixed prompt) contains queries (layer 0 at position 26, layer 1 at 25) where fewer than index_topk
# keys score above 0, so the 6th and 7th largest indexer scores are both exactly 0.0 (relu in all 4
# heads), an exact tie the KV-cache and cache-free paths break differently. 16 x 10 keeps every
# property of FP8_BLOCK (non-square; no column count a multiple of 10, so a ragged last block column
# everywhere; kv_a_proj_with_mqa's ragged last block row of 8; >= 2 blocks in both dims except in
# wk's rows, a single block row as with FP8_BLOCK) and gives index top-k gaps > 1e-3 on both sequences.
FP8_BLOCK_V32 = (16, 10)
# FP8 fixture -> (its float32 source fixture, weight block size).
FP8_FIXTURES = {"tiny-v3-fp8": ("tiny-v3", FP8_BLOCK), "tiny-v32-fp8": ("tiny-v32", FP8_BLOCK_V32)}
FP8_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448.0
FP8_QUANTIZATION_CONFIG = {
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "weight_block_size": list(FP8_BLOCK),
}
# The projections DeepSeek-V3 stores in fp8 (tiny-v3 has q_lora, so no q_proj).
FP8_PROJECTIONS = {
    "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj", "up_proj", "down_proj"
}
# DeepSeek-V3.2 also stores its lightning indexer's query and key projections in fp8 (official
# inference/model.py: `Indexer.wq_b` and `Indexer.wk` are plain `Linear`s, fp8 with a block `scale`
# in an fp8 model), but not `weights_proj` (a `Linear` of the default dtype: bf16 in the published
# checkpoint) nor `k_norm` (a float32 LayerNorm). tiny-v32's wk is [16, 64]: with FP8_BLOCK_V32 it has
# a single block row (scale_inv [1, 7]), as DeepSeek-V3.2's wk [128, 7168] has (scale_inv [1, 56]).
FP8_INDEXER_PROJECTIONS = {"wq_b", "wk"}
FP8_KEPT_2D = {"weights_proj"}  # 2-D layer weights besides the router gate that stay as in the source
FP8_COPIED_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json")

# A reduced-precision reference must be this far from float32 somewhere, or a test comparing
# at the Rust parity tolerance (1e-4) could pass without applying the quantization at all.
MIN_DIFF_VS_F32 = 10 * official_reference.LOGIT_TOLERANCE
# --only int4: how far this machine's float32 run may be from the committed reference.json.
ENV_DRIFT_TOLERANCE = official_reference.LOGIT_TOLERANCE / 10


# --- weight transforms -------------------------------------------------------------------------


def int8_round_trip(w):
    """Symmetric per-output-row int8 quantize + dequantize of an [out, in] weight, in float32.

    scale[o] = max_i |w[o, i]| / 127 (1 if the row is zero); q = clamp(round_half_even(w / scale),
    -127, 127); result = q * scale.
    """
    w32 = w.to(torch.float32)  # exact widening of f32/bf16/f16
    amax = w32.abs().amax(dim=1)
    scale = amax / INT8_MAX
    scale = torch.where(amax == 0, torch.ones_like(scale), scale)
    q = torch.clamp(torch.round(w32 / scale[:, None]), -INT8_MAX, INT8_MAX)
    return q * scale[:, None]


def int4_round_trip(w, group=INT4_GROUP):
    """Symmetric int4 quantize + dequantize of an [out, in] weight in groups of `group` inputs, in float32.

    For each output row o, the inputs are split into groups of `group` consecutive columns
    [0:group], [group:2*group], ... (the last group of a row is shorter when in is not a multiple
    of `group`). Per (row, group), with w widened to float32 exactly: amax = max |w| over the group;
    scale = amax / 7 (float32 division); q = clamp(round_half_even(w / scale), -7, 7) (float32
    division); result = q * scale in float32. A group with amax == 0 has scale = 0 and every q = 0,
    so its result is 0. (deepinfer's `--quantize experts-int4`, model::params::quantize_rows_int4.)
    """
    w32 = w.to(torch.float32)  # exact widening of f32/bf16/f16
    assert w32.dim() == 2 and group > 0, (tuple(w32.shape), group)
    out = torch.empty_like(w32)
    for start in range(0, w32.shape[1], group):
        g = w32[:, start : start + group]
        amax = g.abs().amax(dim=1, keepdim=True)
        scale = amax / INT4_MAX
        q = torch.clamp(torch.round(g / scale), -INT4_MAX, INT4_MAX)
        q = torch.where(amax == 0, torch.zeros_like(q), q)  # 0 / 0 = nan in a zero group
        out[:, start : start + group] = q * scale
    return out


def fp8_block_quantize(w, block=FP8_BLOCK):
    """DeepSeek-V3 block fp8: (F8_E4M3 weight, float32 scale_inv [ceil(out/B0), ceil(in/B1)]).

    Per block (last ones may be partial): s = max|block| / 448 (1 if the block is zero);
    q = (block / s) cast to float8_e4m3fn (round to nearest even); scale_inv = s.
    """
    assert w.dtype == torch.float32 and w.dim() == 2
    (rows, cols), (b0, b1) = w.shape, block
    q = torch.empty(w.shape, dtype=torch.float8_e4m3fn)
    scale_inv = torch.empty((math.ceil(rows / b0), math.ceil(cols / b1)), dtype=torch.float32)
    for i in range(scale_inv.shape[0]):
        for j in range(scale_inv.shape[1]):
            rs, cs = slice(i * b0, (i + 1) * b0), slice(j * b1, (j + 1) * b1)
            amax = w[rs, cs].abs().max()
            s = amax / FP8_MAX if amax != 0 else torch.tensor(1.0)
            q[rs, cs] = (w[rs, cs] / s).to(torch.float8_e4m3fn)
            scale_inv[i, j] = s
    return q, scale_inv


def fp8_block_dequantize(q, scale_inv, block=FP8_BLOCK):
    """W = q (as float32) * scale_inv of its block, in float32."""
    (rows, cols), (b0, b1) = q.shape, block
    assert scale_inv.shape == (math.ceil(rows / b0), math.ceil(cols / b1)), (q.shape, scale_inv.shape)
    s = scale_inv.repeat_interleave(b0, dim=0)[:rows].repeat_interleave(b1, dim=1)[:, :cols]
    return q.to(torch.float32) * s


def is_fp8_quantized(name, tensor):
    """Every 2-D attention/MLP/expert `*_proj.weight` and the V3.2 indexer's wq_b/wk; not embeddings,
    lm_head, norms, router, indexer weights_proj."""
    parts = name.split(".")
    if parts[:2] == ["model", "layers"] and parts[-1] == "weight" and tensor.dim() == 2:
        if parts[-3] == "indexer":
            assert parts[-2] in FP8_INDEXER_PROJECTIONS | FP8_KEPT_2D, name
            return parts[-2] in FP8_INDEXER_PROJECTIONS
        assert parts[-2] in FP8_PROJECTIONS or parts[-3:] == ["mlp", "gate", "weight"], name
        return parts[-2] in FP8_PROJECTIONS
    assert name in ("model.embed_tokens.weight", "lm_head.weight") or tensor.dim() == 1, name
    return False


# --- checkpoints and runs ----------------------------------------------------------------------


def load_checkpoint(directory):
    """Tensor name -> tensor as stored, over every safetensors file of a checkpoint directory."""
    tensors = {}
    for path in sorted(directory.glob("*.safetensors")):
        tensors.update(safetensors.torch.load_file(str(path)))
    return tensors


def write_f32_checkpoint(directory, config_source, tensors):
    """config.json of `config_source` + one float32 model.safetensors holding `tensors`."""
    directory.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(config_source / "config.json", directory / "config.json")
    f32 = {name: t.to(torch.float32).contiguous() for name, t in tensors.items()}
    safetensors.torch.save_file(f32, str(directory / "model.safetensors"), metadata={"format": "pt"})


def logits_of(model, token_ids):
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0].to(torch.float32)


def greedy_bf16(model, prompt_ids, new_tokens):
    """Greedy continuation with the KV cache, as model.generate gives it (no cache-free cross-check:
    in bf16 the cached and cache-free forwards legitimately round differently)."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids]),
            do_sample=False,
            max_new_tokens=new_tokens,
            eos_token_id=None,
            pad_token_id=TINY["eos_token_id"],
        )
    generated = out[0, len(prompt_ids) :].tolist()
    assert len(generated) == new_tokens
    return generated


def stats_vs_f32(logits, generated, reference):
    """The peer's error statistics against reference.json's float32 logits and greedy."""
    f32_logits = torch.tensor(reference["logits"], dtype=torch.float32)
    f32_generated = reference["greedy"]["generated_token_ids"]
    argmax_equal = (logits.argmax(-1) == f32_logits.argmax(-1)).sum().item()
    leading = 0
    while leading < len(f32_generated) and generated[leading] == f32_generated[leading]:
        leading += 1
    return {
        "max_abs_diff_vs_f32": (logits - f32_logits).abs().max().item(),
        "argmax_agreement_vs_f32": argmax_equal / len(f32_logits),
        "greedy_agreement_vs_f32": {"leading_tokens_equal": leading, "total": len(f32_generated)},
    }


def f32_reference_run(directory, reference):
    """Logits + greedy of transformers float32 on a checkpoint directory (reference.json's inputs),
    the greedy's smallest top-2 gap and, for a sparse-attention (V3.2) model, the smallest index
    top-k gap (None otherwise)."""
    model = load_reference_model(directory)
    logits = logits_of(model, reference["token_ids"])
    prompt_ids = reference["greedy"]["prompt_token_ids"]
    with torch.no_grad():
        generated, min_gap = greedy(model, prompt_ids)
    index_gap = None
    if indexer_modules(model):
        index_gap = min_index_topk_gap(model, reference["token_ids"], logits, prompt_ids + generated)
    return logits, generated, min_gap, index_gap


def min_index_topk_gap(model, token_ids, logits, greedy_ids):
    """make_fixtures' selection check on this model: the smallest k-th vs (k+1)-th indexer score
    gap over every layer and every sparse query of cache-free forwards over the logits tokens and
    over the greedy prompt + continuation (which also confirms that transformers selected the top-k
    keys wherever that gap is above MIN_INDEX_TOPK_GAP)."""
    with torch.no_grad():
        text_gap, cache_free_logits, _ = index_topk_gaps(model, token_ids)
        assert torch.equal(cache_free_logits, logits), "cache-free logits differ"
        greedy_gap, _, _ = index_topk_gaps(model, greedy_ids)
    return min(text_gap, greedy_gap)


def check_route_reproduces_reference(tmp, source, reference):
    """The temporary-checkpoint route with unmodified weights gives reference.json bit for bit."""
    write_f32_checkpoint(tmp, source, load_checkpoint(source))
    logits, generated, _, index_gap = f32_reference_run(tmp, reference)
    assert torch.equal(logits, torch.tensor(reference["logits"], dtype=torch.float32)), source
    assert generated == reference["greedy"]["generated_token_ids"], source
    assert index_gap == reference.get("min_index_topk_gap"), (source, index_gap)


def check_route_within_drift(tmp, source, reference):
    """--only int4: the temporary-checkpoint route with unmodified weights gives a direct run on
    `source` bit for bit, and that run is within ENV_DRIFT_TOLERANCE of reference.json (same greedy).
    Returns the max |logit diff| of this machine's run vs reference.json (0.0 where it reproduces it)."""
    direct_logits, direct_generated, _, direct_gap = f32_reference_run(source, reference)
    write_f32_checkpoint(tmp, source, load_checkpoint(source))
    logits, generated, _, index_gap = f32_reference_run(tmp, reference)
    assert torch.equal(logits, direct_logits), source
    assert generated == direct_generated and index_gap == direct_gap, (source, index_gap, direct_gap)
    drift = (logits - torch.tensor(reference["logits"], dtype=torch.float32)).abs().max().item()
    assert drift < ENV_DRIFT_TOLERANCE, ("this machine's float32 run is too far from reference.json", drift)
    assert generated == reference["greedy"]["generated_token_ids"], source
    ref_gap = reference.get("min_index_topk_gap")
    assert (index_gap is None) == (ref_gap is None), (source, index_gap, ref_gap)
    assert index_gap is None or abs(index_gap - ref_gap) < ENV_DRIFT_TOLERANCE, (source, index_gap, ref_gap)
    return drift


def quantized_reference(tmp, config_source, tensors, reference, notes, extra):
    """reference.json-shaped dict for float32 transformers on `tensors`, cross-checked."""
    write_f32_checkpoint(tmp, config_source, tensors)
    logits, generated, min_gap, index_gap = f32_reference_run(tmp, reference)
    result = {
        "token_ids": reference["token_ids"],
        "logits": logits.tolist(),
        "greedy": {"prompt_token_ids": reference["greedy"]["prompt_token_ids"],
                   "generated_token_ids": generated},
        **extra,
        **stats_vs_f32(logits, generated, reference),
        "greedy_min_top2_gap": min_gap,
        **({} if index_gap is None else {"min_index_topk_gap": index_gap}),
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "notes": notes,
    }
    diff = result["max_abs_diff_vs_f32"]
    assert diff > MIN_DIFF_VS_F32, ("quantization does not show in the logits", diff)
    # The prompt is fixed by reference.json, so a near-tie cannot be avoided by another prompt;
    # it must still be far above the parity tolerance for the continuation to be a fair target.
    assert min_gap > MIN_DIFF_VS_F32, ("greedy continuation has a near-tie", min_gap)
    # Sparse attention: the indexer's top-k selection must be as robust as in reference.json, or an
    # engine computing the same float32 scores in another order could select other keys.
    assert index_gap is None or index_gap > MIN_INDEX_TOPK_GAP, ("index top-k near-tie", index_gap)
    write_json(tmp / "reference.json", result, indent=None)
    official_diff, official_greedy_ok = official_reference.check_fixture(tmp)
    ok = official_diff < official_reference.LOGIT_TOLERANCE and official_greedy_ok
    assert ok, ("official math disagrees", official_diff, official_greedy_ok)
    result["_official_diff"] = official_diff  # printed, not written
    return result


def write_reference(path, result):
    write_json(path, {k: v for k, v in result.items() if not k.startswith("_")}, indent=None)


# --- the three outputs -------------------------------------------------------------------------


def index_selections(model, token_ids):
    """(layer, query) -> the set of keys the indexer selected, in one cache-free forward, for every
    query that sees more than index_topk keys (shorter rows select all visible keys plus masked ones
    in an unspecified order)."""
    selected = {}

    def hook(module, args, output):
        for s in range(module.index_topk, output.shape[1]):
            selected[(module.layer_idx, s)] = frozenset(output[0, s].tolist())

    handles = [m.register_forward_hook(hook) for m in indexer_modules(model)]
    try:
        with torch.no_grad():
            model(torch.tensor([token_ids]), use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    assert selected
    return selected


def selection_differences(model, f32_model, token_ids):
    """(number of (layer, query) index top-k selections that differ from float32's, number compared)."""
    ours, theirs = index_selections(model, token_ids), index_selections(f32_model, token_ids)
    assert ours.keys() == theirs.keys()
    return sum(ours[k] != theirs[k] for k in ours), len(ours)


def make_bf16_reference(directory, reference):
    model, info = AutoModelForCausalLM.from_pretrained(
        directory, dtype=torch.bfloat16, attn_implementation="eager", output_loading_info=True
    )
    problems = {k: v for k, v in info.items() if v}
    assert not problems, f"{directory}: loading problems {problems}"
    use_official_v2_routing(model)
    model.eval()
    f32_kept = sorted(
        name
        for name, t in [*model.named_parameters(), *model.named_buffers()]
        if t.dtype != torch.bfloat16 and not name.startswith("model.rotary_emb.")
    )
    f32_kinds = sorted({re.sub(r"^model\.layers\.\d+\.", "", name) for name in f32_kept})
    assert set(f32_kinds) <= {"mlp.gate.weight", "mlp.gate.e_score_correction_bias"}, f32_kinds

    logits = logits_of(model, reference["token_ids"])
    prompt_ids = reference["greedy"]["prompt_token_ids"]
    generated = greedy_bf16(model, prompt_ids, len(reference["greedy"]["generated_token_ids"]))
    stored = sorted({str(t.dtype).removeprefix("torch.") for t in load_checkpoint(directory).values()})
    kept_f32 = " and ".join(filter(None, [", ".join(f32_kinds), "the RoPE inv_freq buffers"]))
    official_v2 = model.config.model_type == "deepseek_v2" and model.config.norm_topk_prob
    sparse_notes, selections = "", None
    if indexer_modules(model):
        # _keep_in_fp32_modules (indexer.weights_proj) is applied by transformers to float16 loads
        # only; a bfloat16 load keeps just _keep_in_fp32_modules_strict (router weight and bias).
        assert "indexer.weights_proj" in model._keep_in_fp32_modules, model._keep_in_fp32_modules
        assert all(m.weights_proj.weight.dtype == torch.bfloat16 for m in indexer_modules(model))
        f32_model = load_reference_model(directory)
        greedy_ids = prompt_ids + reference["greedy"]["generated_token_ids"]
        selections = {
            "token_ids": selection_differences(model, f32_model, reference["token_ids"]),
            "greedy": selection_differences(model, f32_model, greedy_ids),
        }
        (text_diff, text_total), (greedy_diff, greedy_total) = selections["token_ids"], selections["greedy"]
        sparse_notes = (
            "; the lightning indexer is bfloat16 too (wq_b, wk, k_norm and weights_proj: "
            "DeepseekV32PreTrainedModel lists indexer.weights_proj in _keep_in_fp32_modules, which "
            f"transformers {transformers.__version__} applies to float16 loads only), its scores are "
            "computed in float32 from the bfloat16 q, k and head weights (transformers' own upcast) and "
            "top-k taken over them; index top-k selections that differ from float32's (cache-free forwards, "
            "every layer, every query seeing more than index_topk keys): "
            f"{text_diff} of {text_total} on token_ids, {greedy_diff} of {greedy_total} on reference.json's "
            "greedy prompt + continuation (the bfloat16 rounding exceeds some float32 top-k gaps: "
            "a real property of this peer)"
        )
    notes = (
        f"transformers {transformers.__version__} on this directory's checkpoint (stored as {'/'.join(stored)}) "
        "loaded with dtype=torch.bfloat16, eager attention: weights and activations in bfloat16 "
        + f"(transformers keeps {kept_f32} in float32)"
        + sparse_notes
        + "; logits of token_ids converted to float32; greedy = model.generate with the KV cache, "
        "do_sample=False, reference.json's prompt and length"
        + (", with the official DeepSeek-V2 norm_topk_prob routing as in reference.json" if official_v2 else "")
        + ". Statistics are against reference.json (transformers float32): max |logit diff| over all "
        "positions and vocab, fraction of positions with the same argmax, number of leading greedy tokens "
        "equal. A measure of a bf16 peer's drift, not a bit-exact target."
    )
    return {
        "token_ids": reference["token_ids"],
        "logits": logits.tolist(),
        "greedy": {"prompt_token_ids": prompt_ids, "generated_token_ids": generated},
        **stats_vs_f32(logits, generated, reference),
        "dtype": "bfloat16",
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "notes": notes,
        "_selections": selections,  # printed, not written
    }


def round_trip_experts(directory, round_trip, label):
    """The checkpoint with every routed expert weight replaced by its `round_trip`, the number of
    those weights and the largest |w - w'| over them."""
    tensors = load_checkpoint(directory)
    names = sorted(n for n in tensors if ROUTED_EXPERT_WEIGHT.fullmatch(n))
    cfg = json.loads((directory / "config.json").read_text())
    moe_layers = cfg["num_hidden_layers"] - cfg["first_k_dense_replace"]
    assert len(names) == moe_layers * cfg["n_routed_experts"] * 3, len(names)
    max_change = 0.0
    for name in names:
        original = tensors[name].to(torch.float32)
        tensors[name] = round_trip(tensors[name])
        change = (tensors[name] - original).abs().max().item()
        assert change > 0, f"{name}: the {label} round trip left the weight unchanged"
        max_change = max(max_change, change)
    return tensors, len(names), max_change


def make_int8_reference(directory, reference, tmp):
    tensors, count, max_change = round_trip_experts(directory, int8_round_trip, "int8")
    notes = (
        "transformers float32 (eager) on this directory's checkpoint widened to float32, with every routed "
        "expert weight model.layers.L.mlp.experts.E.{gate,up,down}_proj.weight (not shared experts, not dense "
        "MLPs) replaced by its int8 round trip: scale[o] = max_i |w[o,i]| / 127 per output row o of the "
        "[out, in] weight (float32; 1 if the row is 0), q = clamp(round_half_even(w / scale[o]), -127, 127), "
        "w' = q * scale[o] in float32. Exact target for an engine doing that dequantization; "
        "max_abs_weight_diff = max |w - w'| over those weights; *_vs_f32 = against reference.json. "
        "Cross-checked with scripts/official_reference.py (float64 official math)."
    )
    extra = {
        "quantization": {
            "scheme": "int8 symmetric per output row",
            "tensors": count,
            "max_abs_weight_diff": max_change,
        }
    }
    return quantized_reference(tmp, directory, tensors, reference, notes, extra)


def check_int4_tie(directory, reference, tmp):
    """An INT4_SKIPPED fixture: its int4 model's greedy continuation (KV cache) still disagrees with the
    cache-free forward and has an exact index top-k tie. Returns (step where they part, the tie's gap)."""
    tensors, _, _ = round_trip_experts(directory, int4_round_trip, "int4")
    write_f32_checkpoint(tmp, directory, tensors)
    model = load_reference_model(tmp)
    prompt_ids = reference["greedy"]["prompt_token_ids"]
    with torch.no_grad():
        generated, _, cache_free_agrees = greedy_steps(model, prompt_ids)
        assert not cache_free_agrees, f"{directory}: no longer needs to be in INT4_SKIPPED"
        gap, _, _ = index_topk_gaps(model, prompt_ids + generated)
        assert gap == 0.0, (f"{directory}: no exact index top-k tie on the int4 model", gap)
        full = model(torch.tensor([prompt_ids + generated])).logits[0]
    cache_free = full[len(prompt_ids) - 1 : -1].argmax(-1).tolist()
    return next(i for i, (a, b) in enumerate(zip(generated, cache_free)) if a != b), gap


def make_int4_reference(directory, reference, tmp, drift=0.0):
    tensors, count, max_change = round_trip_experts(directory, int4_round_trip, "int4")
    notes = (
        "transformers float32 (eager) on this directory's checkpoint widened to float32, with every routed "
        "expert weight model.layers.L.mlp.experts.E.{gate,up,down}_proj.weight (not shared experts, not dense "
        "MLPs, not the router) replaced by its int4 round trip: each output row o of the [out, in] weight is "
        f"split into groups of {INT4_GROUP} consecutive inputs (the last group of a row shorter when in is not "
        f"a multiple of {INT4_GROUP}; these experts have in = 64 or 32, one group a row); per (row, group) "
        "amax = max |w| over the group, scale = amax / 7 (float32), q = clamp(round_half_even(w / scale), -7, 7) "
        "(float32 division), w' = q * scale in float32 (a group with amax = 0 has scale 0, q 0, w' 0). "
        "Exact target for an engine doing that dequantization; max_abs_weight_diff = max |w - w'| over those "
        "weights; *_vs_f32 = against reference.json. Its logits differ from reference-int8-experts.json's by "
        "more than 1e-3. Cross-checked with scripts/official_reference.py (float64 official math)."
    )
    if drift:
        notes += (
            " Written by make_precision_references.py --only int4 on a machine whose float32 transformers run "
            f"on the unmodified checkpoint differs from reference.json by up to {drift:.3e} in the logits (same "
            "greedy continuation; other CPU kernels): these logits may differ by as much from a run on the "
            "machine that wrote reference.json."
        )
    extra = {
        "quantization": {
            "scheme": f"int4 symmetric, groups of {INT4_GROUP} inputs per output row",
            "group_size": INT4_GROUP,
            "tensors": count,
            "max_abs_weight_diff": max_change,
        }
    }
    return quantized_reference(tmp, directory, tensors, reference, notes, extra)


def projection_kind(name):
    """`q_b_proj`, `down_proj`, ... or `indexer.wq_b` / `indexer.wk` for a quantized weight's name."""
    parts = name.split(".")
    return ".".join(parts[-3:-1]) if parts[-3] == "indexer" else parts[-2]


def make_fp8_fixture(fixtures, tmp, fixture):
    source_name, block = FP8_FIXTURES[fixture]
    source, out = fixtures / source_name, fixtures / fixture
    reference = json.loads((source / "reference.json").read_text())
    if out.exists():
        shutil.rmtree(out)
    out.mkdir()

    cfg = json.loads((source / "config.json").read_text())
    assert "quantization_config" not in cfg
    sparse = "index_topk" in cfg
    quantization_config = {**FP8_QUANTIZATION_CONFIG, "weight_block_size": list(block)}
    cfg = dict(sorted({**cfg, "quantization_config": quantization_config}.items()))
    write_json(out / "config.json", cfg)
    for name in FP8_COPIED_FILES:
        shutil.copyfile(source / name, out / name)
    # transformers reads the fp8 config.json as the source's plus quantization_config; the reference
    # model is therefore built from the source's config.json (its fp8 loader is not used, see above).
    fp8_cfg, f32_cfg = AutoConfig.from_pretrained(out).to_dict(), AutoConfig.from_pretrained(source).to_dict()
    differing = {k for k in fp8_cfg.keys() | f32_cfg.keys() if fp8_cfg.get(k) != f32_cfg.get(k)}
    assert differing == {"quantization_config", "_name_or_path"}, differing

    original = load_checkpoint(source)
    assert all(t.dtype == torch.float32 for t in original.values())
    stored = {}
    for name, w in original.items():
        if is_fp8_quantized(name, w):
            stored[name], stored[f"{name}_scale_inv"] = fp8_block_quantize(w, block)
        else:
            stored[name] = w
    kinds = {n.split(".")[-2] for n in original if is_fp8_quantized(n, original[n])}
    assert kinds == FP8_PROJECTIONS | (FP8_INDEXER_PROJECTIONS if sparse else set()), kinds
    safetensors.torch.save_file(stored, str(out / "model.safetensors"), metadata={"format": "pt"})

    # Read the file back: layout checks, then dequantize what is on disk.
    on_disk = load_checkpoint(out)
    expected = expected_tensors(cfg)
    quantized = sorted(n for n in expected if is_fp8_quantized(n, original[n]))
    layout = set(expected) | {f"{n}_scale_inv" for n in quantized}
    assert set(on_disk) == layout, sorted(set(on_disk) ^ layout)[:10]
    dequantized, ragged, ragged_dims, max_change = dict(original), [], set(), 0.0
    for name in quantized:
        q, scale_inv = on_disk[name], on_disk[f"{name}_scale_inv"]
        assert q.dtype == torch.float8_e4m3fn and scale_inv.dtype == torch.float32, name
        assert tuple(q.shape) == expected[name], name
        if name.endswith(".indexer.wk.weight"):  # one block row of index_head_dim rows, as published
            assert scale_inv.shape[0] == 1 and scale_inv.shape[1] >= 2, (name, tuple(scale_inv.shape))
        else:
            assert min(scale_inv.shape) >= 2, f"{name}: {tuple(q.shape)} has fewer than 2 blocks in some dim"
        partial = [dim for dim, (size, b) in enumerate(zip(q.shape, block)) if size % b]
        if partial:
            ragged.append(name)
            ragged_dims.update((projection_kind(name), ("rows", "columns")[dim]) for dim in partial)
        w = fp8_block_dequantize(q, scale_inv, block)
        assert torch.isfinite(w).all(), name
        change = (w - original[name]).abs().max().item()
        assert change > 0, f"{name}: fp8 dequantization reproduces the float32 weight exactly"
        dequantized[name], max_change = w, max(max_change, change)
    for name, t in on_disk.items():
        if name not in quantized and not name.endswith("_scale_inv"):
            assert torch.equal(t, original[name]) and t.dtype == torch.float32, name
    assert ragged, "no tensor has a partial last block"

    ragged_text = ", ".join(f"{kind} ({dim})" for kind, dim in sorted(ragged_dims))
    notes = fp8_notes_v32(block, ragged_text) if sparse else (
        f"tiny-v3 in DeepSeek-V3's published FP8 layout: config.json = tiny-v3's plus quantization_config "
        f"(fp8, e4m3, dynamic activations, weight_block_size {list(block)}); every attention, dense-MLP, "
        "routed-expert and shared-expert *_proj.weight [out, in] stored as F8_E4M3 with <name>_scale_inv "
        "float32 [ceil(out/B0), ceil(in/B1)]: per block s = max|W_block| / 448 (1 if 0), "
        "q = fp8_e4m3fn(W_block / s), scale_inv = s; embeddings, lm_head, norms, router gate and "
        "e_score_correction_bias stay float32. "
        f"Ragged last blocks: {ragged_text}. "
        "Logits/greedy: transformers float32 (eager) on tiny-v3's config.json with the quantized weights "
        "replaced by q.to(float32) * scale_inv of their block, dequantized from this directory's "
        "model.safetensors; activations are not quantized (weight-only dequantization). transformers' "
        f"own fp8 loading is not used (with {transformers.__version__}, from_pretrained on this directory "
        "selects its FP8 quantizer, which requires accelerate); the model is built from tiny-v3's "
        "config.json, checked equal to this one minus quantization_config. "
        "*_vs_f32 = against tiny-v3/reference.json. Cross-checked with scripts/official_reference.py."
    )
    extra = {
        "quantization": {
            "weight_block_size": list(block),
            "tensors": len(quantized),
            "ragged_tensors": ragged,
            "max_abs_weight_diff": max_change,
        }
    }
    result = quantized_reference(tmp, source, dequantized, reference, notes, extra)
    write_reference(out / "reference.json", result)
    return result, out


def fp8_notes_v32(block, ragged_text):
    return (
        "tiny-v32 in DeepSeek-V3.2's published FP8 layout: config.json = tiny-v32's plus quantization_config "
        f"(fp8, e4m3, dynamic activations, weight_block_size {list(block)}; as tiny-v3-fp8's except for the "
        f"block size: with tiny-v3-fp8's {list(FP8_BLOCK)} the dequantized model's greedy continuation has "
        "exact index top-k ties, two keys scoring 0.0 at the 6th/7th place; the published V3.2 config's extra "
        "scale_fmt \"ue8m0\" is left out, these scales are not powers of two); every attention, dense-MLP, "
        "routed-expert and shared-expert *_proj.weight and the lightning indexer's wq_b.weight and "
        "wk.weight [out, in] stored as F8_E4M3 with <name>_scale_inv "
        "float32 [ceil(out/B0), ceil(in/B1)]: per block s = max|W_block| / 448 (1 if 0), "
        "q = fp8_e4m3fn(W_block / s), scale_inv = s; embeddings, lm_head, norms, router gate, "
        "e_score_correction_bias and the indexer's weights_proj.weight and k_norm.weight/bias stay float32 "
        "as in tiny-v32 (the published checkpoint keeps weights_proj in bf16 and k_norm in float32, "
        "unquantized). indexer.wk.weight [index_head_dim, hidden] has a single block row, as DeepSeek-V3.2's "
        "[128, 7168] wk has (weight_scale_inv [1, 56]). "
        f"Ragged last blocks: {ragged_text}. "
        "Logits/greedy: transformers float32 (eager) on tiny-v32's config.json with the quantized weights "
        "replaced by q.to(float32) * scale_inv of their block, dequantized from this directory's "
        "model.safetensors; activations (including the indexer's q and k, which DeepSeek's own kernels "
        "quantize to fp8) are not quantized (weight-only dequantization). transformers' own fp8 loading is "
        f"not used (with {transformers.__version__}, from_pretrained on this directory selects its FP8 "
        "quantizer, which requires accelerate); the model is built from tiny-v32's config.json, checked "
        "equal to this one minus quantization_config. min_index_topk_gap: smallest k-th vs (k+1)-th "
        "indexer score gap over every layer and sparse query of cache-free forwards over token_ids and "
        "over the greedy prompt + continuation, on the dequantized weights (> 1e-3, as in tiny-v32). "
        "*_vs_f32 = against tiny-v32/reference.json. Cross-checked with scripts/official_reference.py."
    )


def describe(name, result):
    q = result.get("quantization")
    extra = f", max |w - deq| {q['max_abs_weight_diff']:.3e}" if q else ""
    official = f", official-math diff {result['_official_diff']:.1e}" if "_official_diff" in result else ""
    g = result["greedy_agreement_vs_f32"]
    index_gap = result.get("min_index_topk_gap")
    index_gap = "" if index_gap is None else f", min index top-k gap {index_gap:.2e}"
    selections = result.get("_selections")
    if selections:
        selections = ", index selections differing from f32: " + ", ".join(
            f"{diff}/{total} ({what})" for what, (diff, total) in selections.items()
        )
    print(f"{name}: max |logit diff| vs f32 {result['max_abs_diff_vs_f32']:.4e}, argmax agreement "
          f"{result['argmax_agreement_vs_f32']:.4f}, greedy {g['leading_tokens_equal']}/{g['total']}"
          f"{extra}{index_gap}{selections or ''}{official}")


def write_int4_reference(directory, reference, tmp, int8, name, drift=0.0):
    """reference-int4-experts.json, whose logits must also differ from the int8 reference's."""
    if name in INT4_SKIPPED:
        step, gap = check_int4_tie(directory, reference, tmp)
        print(f"{name} int4-experts: skipped (INT4_SKIPPED): greedy with the KV cache and cache-free part at "
              f"step {step}, min index top-k gap on the greedy sequence {gap}")
        return
    int4 = make_int4_reference(directory, reference, tmp, drift)
    vs_int8 = (torch.tensor(int4["logits"]) - torch.tensor(int8["logits"])).abs().max().item()
    assert vs_int8 > MIN_DIFF_VS_F32, ("int4 logits do not differ from int8's", name, vs_int8)
    write_reference(directory / "reference-int4-experts.json", int4)
    describe(f"{name} int4-experts", int4)
    print(f"{name} int4-experts: max |logit diff| vs int8-experts {vs_int8:.4e}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fixtures", default="fixtures", type=Path, help="fixtures root (default: fixtures)")
    parser.add_argument("--only", choices=["int4"], help="write only reference-int4-experts.json (see the docstring)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    transformers.utils.logging.disable_progress_bar()

    with tempfile.TemporaryDirectory() as tmp_root:
        tmp_root = Path(tmp_root)
        for i, name in enumerate(FIXTURES):
            directory = args.fixtures / name
            reference = json.loads((directory / "reference.json").read_text())
            assert len(reference["greedy"]["generated_token_ids"]) == GREEDY_NEW_TOKENS, name
            if args.only == "int4":
                drift = check_route_within_drift(tmp_root / f"route-{i}", directory, reference)
                print(f"{name}: this machine's float32 run vs reference.json: max |logit diff| {drift:.4e}")
                int8 = json.loads((directory / "reference-int8-experts.json").read_text())
                write_int4_reference(directory, reference, tmp_root / f"int4-{i}", int8, name, drift)
                continue
            check_route_reproduces_reference(tmp_root / f"route-{i}", directory, reference)

            bf16 = make_bf16_reference(directory, reference)
            write_reference(directory / "reference-bf16.json", bf16)
            describe(f"{name} bf16", bf16)

            int8 = make_int8_reference(directory, reference, tmp_root / f"int8-{i}")
            write_reference(directory / "reference-int8-experts.json", int8)
            describe(f"{name} int8-experts", int8)

            write_int4_reference(directory, reference, tmp_root / f"int4-{i}", int8, name)

        if args.only:
            return

        for fixture in FP8_FIXTURES:
            fp8, out = make_fp8_fixture(args.fixtures, tmp_root / fixture, fixture)
            ragged = ", ".join(fp8["quantization"]["ragged_tensors"])
            describe(f"{fixture} (block {fp8['quantization']['weight_block_size']}, ragged: {ragged})", fp8)
            size = sum(f.stat().st_size for f in out.iterdir())
            print(f"{fixture}: {size / 1024:.0f} KiB")


if __name__ == "__main__":
    main()
