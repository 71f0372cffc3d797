"""Write the reduced-precision references: transformers-bf16 peers, int8 routed experts, an FP8 checkpoint.

What: for each of the fixtures tiny-v3, tiny-v2-lite and tiny-v2-group (written by
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
  fixtures/<f>/reference-int8-experts.json transformers float32 on the checkpoint whose routed
                                           experts' gate/up/down weights are replaced by their
                                           symmetric per-output-row int8 round trip (see
                                           `int8_round_trip`; shared experts, dense MLPs and
                                           attention untouched): logits + greedy as in reference.json.

and one new fixture directory

  fixtures/tiny-v3-fp8/                    tiny-v3 in the FP8 layout DeepSeek publishes for V3/R1:
                                           config.json with "quantization_config" (fp8, e4m3,
                                           dynamic activations, weight_block_size FP8_BLOCK), every
                                           attention/MLP/expert `*_proj.weight` stored as F8_E4M3
                                           with a float32 `<name>_scale_inv` of one scale per
                                           block (see `fp8_block_quantize`), everything else float32
                                           as in tiny-v3; reference.json = transformers float32 on
                                           the dequantized weights.

Why: deepinfer issue 12 (reduced-precision weights): these files say what "correct" means for
an engine running with bf16, int8 or fp8 weights. reference-bf16.json is not a target for bit equality: it
shows how far a real bf16 peer (transformers) drifts from float32 on the same model, the yardstick
for the engine's own reduced-precision modes. The int8 and fp8 references are exact targets: they
are float32 runs on weights whose dequantized values are defined bit for bit here, so an engine
that dequantizes the same way must match them to float32 accuracy.

How the references are computed: transformers 5 fuses the per-expert tensors into
`mlp.experts.gate_up_proj`/`down_proj` when it loads a checkpoint, so weights are not patched
inside the model. Instead the modified tensors, widened to float32, are written with the source
config.json to a temporary checkpoint that make_fixtures.load_reference_model loads (same loading
path, same official-V2-routing patch, same key checks as reference.json). Before that, the same
route with unmodified weights must reproduce reference.json bit for bit. Every int8/fp8 reference
is cross-checked with scripts/official_reference.py (independent float64 official math) and must
differ from the float32 reference (its weights and its logits) so that a test skipping the
quantization fails. The fp8 reference is computed from the dequantization of what was written to
tiny-v3-fp8/model.safetensors, not from the in-memory values, and never through transformers' own
fp8 loader (with 5.24.0, from_pretrained on that directory selects its FP8 quantizer and, in the
reference venv, stops with "requires accelerate"): the model is built from tiny-v3's config.json,
which the script checks is the fp8 config minus quantization_config. Activations are not quantized
(weight-only dequantization, the default gemm_impl = "bf16" path of DeepSeek-V3's inference/model.py,
here in float32).

One CPU thread, no randomness: reruns reproduce every file byte for byte.

How to run (from the repository root, reference venv of scripts/requirements-ref.txt):

    /work/refenv/bin/python scripts/make_precision_references.py            # fixtures in ./fixtures
    /work/refenv/bin/python scripts/make_precision_references.py --fixtures /tmp/fx
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
    TINY,
    expected_tensors,
    greedy,
    load_reference_model,
    use_official_v2_routing,
    write_json,
)

FIXTURES = ("tiny-v3", "tiny-v2-lite", "tiny-v2-group")

INT8_MAX = 127
ROUTED_EXPERT_WEIGHT = re.compile(r"model\.layers\.\d+\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight")

FP8_SOURCE = "tiny-v3"
FP8_FIXTURE = "tiny-v3-fp8"
# tiny-v3's quantized shapes: 32 x 64 (q_a, expert/shared gate+up), 96 x 32 (q_b), 40 x 64
# (kv_a_proj_with_mqa), 128 x 32 (kv_b), 64 x 64 (o), 128 x 64 / 64 x 128 (dense MLP), 64 x 32
# (expert/shared down). 16 x 12 gives every tensor >= 2 blocks in both dims; no column count
# is a multiple of 12, so every tensor has a ragged last block column, and 40 rows give
# kv_a_proj_with_mqa a ragged last block row of 8 as well (as DeepSeek-V3's own
# kv_a_proj_with_mqa, 576 = 4.5 x 128 rows, has with its 128 x 128 blocks). Non-square blocks
# catch a loader that swaps the block's two dims.
FP8_BLOCK = (16, 12)
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
FP8_COPIED_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json")

# A reduced-precision reference must be this far from float32 somewhere, or a test comparing
# at the Rust parity tolerance (1e-4) could pass without applying the quantization at all.
MIN_DIFF_VS_F32 = 10 * official_reference.LOGIT_TOLERANCE


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
    """Every 2-D attention/MLP/expert `*_proj.weight`; not embeddings, lm_head, norms, router."""
    parts = name.split(".")
    if parts[:2] == ["model", "layers"] and parts[-1] == "weight" and tensor.dim() == 2:
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
    """Logits + greedy of transformers float32 on a checkpoint directory (reference.json's inputs)."""
    model = load_reference_model(directory)
    logits = logits_of(model, reference["token_ids"])
    with torch.no_grad():
        generated, min_gap = greedy(model, reference["greedy"]["prompt_token_ids"])
    return logits, generated, min_gap


def check_route_reproduces_reference(tmp, source, reference):
    """The temporary-checkpoint route with unmodified weights gives reference.json bit for bit."""
    write_f32_checkpoint(tmp, source, load_checkpoint(source))
    logits, generated, _ = f32_reference_run(tmp, reference)
    assert torch.equal(logits, torch.tensor(reference["logits"], dtype=torch.float32)), source
    assert generated == reference["greedy"]["generated_token_ids"], source


def quantized_reference(tmp, config_source, tensors, reference, notes, extra):
    """reference.json-shaped dict for float32 transformers on `tensors`, cross-checked."""
    write_f32_checkpoint(tmp, config_source, tensors)
    logits, generated, min_gap = f32_reference_run(tmp, reference)
    result = {
        "token_ids": reference["token_ids"],
        "logits": logits.tolist(),
        "greedy": {"prompt_token_ids": reference["greedy"]["prompt_token_ids"],
                   "generated_token_ids": generated},
        **extra,
        **stats_vs_f32(logits, generated, reference),
        "greedy_min_top2_gap": min_gap,
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "notes": notes,
    }
    diff = result["max_abs_diff_vs_f32"]
    assert diff > MIN_DIFF_VS_F32, ("quantization does not show in the logits", diff)
    # The prompt is fixed by reference.json, so a near-tie cannot be avoided by another prompt;
    # it must still be far above the parity tolerance for the continuation to be a fair target.
    assert min_gap > MIN_DIFF_VS_F32, ("greedy continuation has a near-tie", min_gap)
    write_json(tmp / "reference.json", result, indent=None)
    official_diff, official_greedy_ok = official_reference.check_fixture(tmp)
    ok = official_diff < official_reference.LOGIT_TOLERANCE and official_greedy_ok
    assert ok, ("official math disagrees", official_diff, official_greedy_ok)
    result["_official_diff"] = official_diff  # printed, not written
    return result


def write_reference(path, result):
    write_json(path, {k: v for k, v in result.items() if not k.startswith("_")}, indent=None)


# --- the three outputs -------------------------------------------------------------------------


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
    notes = (
        f"transformers {transformers.__version__} on this directory's checkpoint (stored as {'/'.join(stored)}) "
        "loaded with dtype=torch.bfloat16, eager attention: weights and activations in bfloat16 "
        + f"(transformers keeps {kept_f32} in float32)"
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
    }


def make_int8_reference(directory, reference, tmp):
    tensors = load_checkpoint(directory)
    names = sorted(n for n in tensors if ROUTED_EXPERT_WEIGHT.fullmatch(n))
    cfg = json.loads((directory / "config.json").read_text())
    moe_layers = cfg["num_hidden_layers"] - cfg["first_k_dense_replace"]
    assert len(names) == moe_layers * cfg["n_routed_experts"] * 3, len(names)
    max_change = 0.0
    for name in names:
        original = tensors[name].to(torch.float32)
        tensors[name] = int8_round_trip(tensors[name])
        change = (tensors[name] - original).abs().max().item()
        assert change > 0, f"{name}: the int8 round trip left the weight unchanged"
        max_change = max(max_change, change)
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
            "tensors": len(names),
            "max_abs_weight_diff": max_change,
        }
    }
    return quantized_reference(tmp, directory, tensors, reference, notes, extra)


def make_fp8_fixture(fixtures, tmp):
    source, out = fixtures / FP8_SOURCE, fixtures / FP8_FIXTURE
    reference = json.loads((source / "reference.json").read_text())
    if out.exists():
        shutil.rmtree(out)
    out.mkdir()

    cfg = json.loads((source / "config.json").read_text())
    assert "quantization_config" not in cfg
    cfg = dict(sorted({**cfg, "quantization_config": FP8_QUANTIZATION_CONFIG}.items()))
    write_json(out / "config.json", cfg)
    for name in FP8_COPIED_FILES:
        shutil.copyfile(source / name, out / name)
    # transformers reads the fp8 config.json as tiny-v3's plus quantization_config; the reference
    # model is therefore built from tiny-v3's config.json (its fp8 loader is not used, see above).
    fp8_cfg, f32_cfg = AutoConfig.from_pretrained(out).to_dict(), AutoConfig.from_pretrained(source).to_dict()
    differing = {k for k in fp8_cfg.keys() | f32_cfg.keys() if fp8_cfg.get(k) != f32_cfg.get(k)}
    assert differing == {"quantization_config", "_name_or_path"}, differing

    original = load_checkpoint(source)
    assert all(t.dtype == torch.float32 for t in original.values())
    stored = {}
    for name, w in original.items():
        if is_fp8_quantized(name, w):
            stored[name], stored[f"{name}_scale_inv"] = fp8_block_quantize(w)
        else:
            stored[name] = w
    assert {n.split(".")[-2] for n in original if is_fp8_quantized(n, original[n])} == FP8_PROJECTIONS
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
        assert min(scale_inv.shape) >= 2, f"{name}: {tuple(q.shape)} has fewer than 2 blocks in some dim"
        partial = [dim for dim, (size, block) in enumerate(zip(q.shape, FP8_BLOCK)) if size % block]
        if partial:
            ragged.append(name)
            ragged_dims.update((name.split(".")[-2], ("rows", "columns")[dim]) for dim in partial)
        w = fp8_block_dequantize(q, scale_inv)
        assert torch.isfinite(w).all(), name
        change = (w - original[name]).abs().max().item()
        assert change > 0, f"{name}: fp8 dequantization reproduces the float32 weight exactly"
        dequantized[name], max_change = w, max(max_change, change)
    for name, t in on_disk.items():
        if name not in quantized and not name.endswith("_scale_inv"):
            assert torch.equal(t, original[name]) and t.dtype == torch.float32, name
    assert ragged, "no tensor has a partial last block"

    notes = (
        f"tiny-v3 in DeepSeek-V3's published FP8 layout: config.json = tiny-v3's plus quantization_config "
        f"(fp8, e4m3, dynamic activations, weight_block_size {list(FP8_BLOCK)}); every attention, dense-MLP, "
        "routed-expert and shared-expert *_proj.weight [out, in] stored as F8_E4M3 with <name>_scale_inv "
        "float32 [ceil(out/B0), ceil(in/B1)]: per block s = max|W_block| / 448 (1 if 0), "
        "q = fp8_e4m3fn(W_block / s), scale_inv = s; embeddings, lm_head, norms, router gate and "
        "e_score_correction_bias stay float32. "
        f"Ragged last blocks: {', '.join(f'{kind} ({dim})' for kind, dim in sorted(ragged_dims))}. "
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
            "weight_block_size": list(FP8_BLOCK),
            "tensors": len(quantized),
            "ragged_tensors": ragged,
            "max_abs_weight_diff": max_change,
        }
    }
    result = quantized_reference(tmp, source, dequantized, reference, notes, extra)
    write_reference(out / "reference.json", result)
    return result, out


def describe(name, result):
    q = result.get("quantization")
    extra = f", max |w - deq| {q['max_abs_weight_diff']:.3e}" if q else ""
    official = f", official-math diff {result['_official_diff']:.1e}" if "_official_diff" in result else ""
    g = result["greedy_agreement_vs_f32"]
    print(f"{name}: max |logit diff| vs f32 {result['max_abs_diff_vs_f32']:.4e}, argmax agreement "
          f"{result['argmax_agreement_vs_f32']:.4f}, greedy {g['leading_tokens_equal']}/{g['total']}"
          f"{extra}{official}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fixtures", default="fixtures", type=Path, help="fixtures root (default: fixtures)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    transformers.utils.logging.disable_progress_bar()

    with tempfile.TemporaryDirectory() as tmp_root:
        tmp_root = Path(tmp_root)
        for i, name in enumerate(FIXTURES):
            directory = args.fixtures / name
            reference = json.loads((directory / "reference.json").read_text())
            assert len(reference["greedy"]["generated_token_ids"]) == GREEDY_NEW_TOKENS, name
            check_route_reproduces_reference(tmp_root / f"route-{i}", directory, reference)

            bf16 = make_bf16_reference(directory, reference)
            write_reference(directory / "reference-bf16.json", bf16)
            describe(f"{name} bf16", bf16)

            int8 = make_int8_reference(directory, reference, tmp_root / f"int8-{i}")
            write_reference(directory / "reference-int8-experts.json", int8)
            describe(f"{name} int8-experts", int8)

        fp8, out = make_fp8_fixture(args.fixtures, tmp_root / "fp8")
        ragged = ", ".join(fp8["quantization"]["ragged_tensors"])
        describe(f"{FP8_FIXTURE} (block {list(FP8_BLOCK)}, ragged: {ragged})", fp8)
        size = sum(f.stat().st_size for f in out.iterdir())
        print(f"{FP8_FIXTURE}: {size / 1024:.0f} KiB")


if __name__ == "__main__":
    main()
