"""Write fixtures/tiny-v4-fp8: a tiny random DeepSeek-V4 checkpoint stored as DeepSeek-V4-Flash is published
(FP8 linear weights with power-of-two block scales, FP4 routed experts), and HF transformers' outputs for it.

What: tiny-v4's architecture (scripts/make_v4_fixture.py's TINY_V4, its weight init, its prompts and its
robustness checks), each seed's weights stored the way DeepSeek-V4-Flash's safetensors store them:

  * FP8: `attn.{wq_a,wq_b,wkv,wo_a,wo_b}`, `attn.indexer.wq_b` and `ffn.shared_experts.{w1,w2,w3}` as
    F8_E4M3 `X.weight` with one F8_E8M0 scale per BLOCK (rows x cols) in `X.scale`
    ([ceil(out / rows), ceil(in / cols)]); value = e4m3 x 2^(scale byte - 127).
  * FP4: every routed expert `ffn.experts.E.w{1,2,3}` as I8 `X.weight` of [out, in / 2] holding E2M1 codes two a
    byte, the even value in the low nibble, with one F8_E8M0 scale per 32 inputs in `X.scale` ([out, in / 32]);
    value = e2m1 x 2^(scale byte - 127), e2m1 codes 0..7 = 0, 0.5, 1, 1.5, 2, 3, 4, 6 and 8..15 their negatives.
  * BF16: the embedding, head, norms, compressors (wkv, wgate, norm), the indexer's weights_proj and the router's
    weight; F32: attn_sink, hc_*, compressor ape, the router's bias; I64: tid2eid. (The dtypes V4-Flash's files
    have, tensor for tensor.)
  * config.json: tiny-v4's, plus V4-Flash's `quantization_config` (fp8, e4m3, ue8m0, dynamic) with
    weight_block_size BLOCK and a top-level `expert_dtype: fp4`.

Each block's scale is the smallest power of two that brings its largest magnitude within the format's range (448
for e4m3, 6 for e2m1); the values are rounded to nearest by torch (e4m3) or to the nearest E2M1 value here.

The reference is transformers 5.25 itself reading that directory: on a machine without a GPU its
FineGrainedFP8 quantizer dequantizes every FP8 and FP4 tensor as it loads (`Fp8Dequantize`), so the model it
runs holds the values the stored bytes mean. The script checks that those values equal its own dequantization
from the format's definition above, bit for bit, then runs make_v4_fixture.compute_reference on that model
(cache-free logits of both prompts, cached greedy decode, and the robustness margins: index and router top-k
gaps, greedy top-2 gaps, cached = cache-free tokens); a seed whose quantized model is not robust is rejected.

reference.json holds what fixtures/tiny-v4's does for the tests (token_ids, logits, token_ids_short,
logits_short, greedy, logits_decode, min_gaps), plus `max_abs_logit_change_from_quantization`: how far the
quantized model's prompt logits are from the same seed's unquantized ones (the quantization matters).

How to run (from the repository root; the venv of scripts/requirements-ref-v4.txt):

    target/v4ref-venv/bin/python scripts/make_v4_fp8_fixture.py           # writes fixtures/tiny-v4-fp8

Reruns reproduce every file byte for byte (same versions, one CPU thread).
"""

import argparse
import json
import re
import shutil
import sys
from pathlib import Path

import safetensors.torch
import torch
import transformers
from transformers import DeepseekV4ForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_v4_fixture as base  # noqa: E402  (tiny-v4's config, init, prompts and reference)

NAME = "tiny-v4-fp8"
BLOCK = [16, 32]  # FP8 scale block [rows, cols]: not square, so a swapped axis fails; divides every weight
FP4_GROUP = 32
E4M3_MAX = 448.0
E2M1_MAGNITUDES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
QUANTIZATION_CONFIG = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                       "scale_fmt": "ue8m0", "weight_block_size": BLOCK}
MIN_QUANTIZATION_EFFECT = 1e-2

FP8 = re.compile(r"layers\.\d+\.(attn\.(wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)|ffn\.shared_experts\.w[123])\.weight")
FP4 = re.compile(r"layers\.\d+\.ffn\.experts\.\d+\.w[123]\.weight")
F32 = re.compile(r"(.*\.attn_sink|.*hc_(attn|ffn|head)_(fn|base|scale)|.*\.ape|.*\.gate\.bias)")


def power_of_two_scales(amax, top):
    """The smallest 2^e with amax / 2^e <= top, as (exponent, scale); e = 0 for an all-zero block."""
    exponent = torch.where(amax > 0, torch.ceil(torch.log2(amax / top)), torch.zeros_like(amax))
    return exponent, torch.exp2(exponent)


def e8m0(exponent):
    """F8_E8M0 bytes of power-of-two exponents: e + 127, as torch.float8_e8m0fnu."""
    assert exponent.min() >= -127 and exponent.max() <= 127, (exponent.min(), exponent.max())
    return (exponent + 127).to(torch.uint8).view(torch.float8_e8m0fnu)


def quantize_fp8(w):
    """[out, in] f32 -> (F8_E4M3 weight, F8_E8M0 scales [out / rows, in / cols], dequantized f32)."""
    rows, cols = BLOCK
    out, inputs = w.shape
    assert out % rows == 0 and inputs % cols == 0, (w.shape, BLOCK)
    blocks = w.reshape(out // rows, rows, inputs // cols, cols)
    exponent, scale = power_of_two_scales(blocks.abs().amax(dim=(1, 3)), E4M3_MAX)
    q = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn)
    value = (q.to(torch.float32) * scale[:, None, :, None]).reshape(out, inputs)
    return q.reshape(out, inputs), e8m0(exponent), value


def e2m1_values(codes):
    """The value of each E2M1 code (0..15), from the format's definition: bit 3 the sign, bits 2-1 the exponent
    (bias 1), bit 0 the mantissa; exponent 0 is subnormal (0.5 x mantissa)."""
    codes = codes.to(torch.int64)
    exponent, mantissa = (codes >> 1) & 3, (codes & 1).to(torch.float32)
    magnitude = torch.where(exponent == 0, 0.5 * mantissa,
                            torch.exp2(exponent.to(torch.float32) - 1) * (1 + 0.5 * mantissa))
    return torch.where(codes >= 8, -magnitude, magnitude)


def quantize_fp4(w):
    """[out, in] f32 -> (I8 codes [out, in / 2], F8_E8M0 scales [out, in / 32], dequantized f32)."""
    out, inputs = w.shape
    assert inputs % FP4_GROUP == 0, w.shape
    groups = w.reshape(out, inputs // FP4_GROUP, FP4_GROUP)
    exponent, scale = power_of_two_scales(groups.abs().amax(dim=2), 6.0)
    scaled = (groups / scale[:, :, None]).reshape(out, inputs)
    nearest = (scaled.abs()[..., None] - E2M1_MAGNITUDES).abs().argmin(dim=-1)  # ties: the smaller magnitude
    codes = nearest + 8 * (scaled < 0).to(torch.int64) * (nearest > 0).to(torch.int64)
    value = (e2m1_values(codes).reshape(out, inputs // FP4_GROUP, FP4_GROUP) * scale[:, :, None]).reshape(out, inputs)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8).view(torch.int8)
    return packed, e8m0(exponent), value


def store(tensors):
    """{published name: f32 tensor} -> ({stored name: tensor as V4-Flash stores it}, {name: dequantized f32})."""
    stored, values = {}, {}
    for name, t in tensors.items():
        if FP8.fullmatch(name) or FP4.fullmatch(name):
            q, scale, value = (quantize_fp8 if FP8.fullmatch(name) else quantize_fp4)(t)
            stored[name] = q.contiguous()
            stored[name.removesuffix(".weight") + ".scale"] = scale.contiguous()
            values[name] = value
        elif name.endswith("tid2eid"):
            stored[name] = t
            values[name] = t
        elif F32.fullmatch(name):
            stored[name] = t.to(torch.float32)
            values[name] = t.to(torch.float32)
        else:
            stored[name] = t.to(torch.bfloat16)
            values[name] = stored[name].to(torch.float32)
    return dict(sorted(stored.items())), values


def write_checkpoint(model, out, tokenizer_dir):
    stored, values = store(base.published_tensors(model))
    model.config.save_pretrained(out)  # config.json as save_pretrained writes it (as tiny-v4's)
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = QUANTIZATION_CONFIG
    config["expert_dtype"] = "fp4"
    base.write_json(out / "config.json", dict(sorted(config.items())))
    safetensors.torch.save_file(stored, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "model.safetensors").chmod(0o644)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(tokenizer_dir / name, out / name)
    return stored, values


def make_fixture(out_root, seed, tokenizer_dir):
    out = out_root / NAME
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    prompt_ids, short_ids = prompts(tokenizer_dir)

    torch.manual_seed(0)
    model = DeepseekV4ForCausalLM(base.build_config()).eval()
    base.init_weights(model, seed)
    stored, values = write_checkpoint(model, out, tokenizer_dir)

    # transformers reading the directory: on a CPU its FP8 quantizer dequantizes FP8 and FP4 as it loads.
    loaded = base.load_reference_model(out)
    read = base.published_tensors(loaded)
    assert set(read) == set(values), sorted(set(read) ^ set(values))[:10]
    for name, value in values.items():
        assert read[name].dtype == value.dtype and torch.equal(read[name], value), f"transformers read {name} differently"

    ref = base.compute_reference(loaded, prompt_ids, short_ids)  # NotRobust -> next seed
    with torch.no_grad():
        unquantized = base.forward_logits(model, prompt_ids)
    effect = (unquantized - ref["logits"]).abs().max().item()
    assert effect > MIN_QUANTIZATION_EFFECT, f"quantization changes nothing ({effect:.1e})"

    stats = ref["stats"]
    reference = base.test_reference(ref, prompt_ids, short_ids)
    reference.update({
        "decode_cached_vs_stateless_max_abs_diff": ref["decode_diff"],
        "min_gaps": {"index_topk": stats["index_gap"], "router_topk": stats["router_gap"],
                     "greedy_top2": ref["greedy_gap"]},
        "max_abs_logit_change_from_quantization": effect,
        "seed": seed,
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "notes": "scripts/make_v4_fp8_fixture.py: tiny-v4's architecture stored as DeepSeek-V4-Flash is published "
                 f"(FP8 block scales {BLOCK}, FP4 experts in groups of {FP4_GROUP}); logits from transformers "
                 "reading the directory (dequantized as loaded, float32, eager).",
    })
    base.write_json(out / "reference.json", reference, indent=None)

    kinds = {}
    for t in stored.values():
        kinds[str(t.dtype).removeprefix("torch.")] = kinds.get(str(t.dtype).removeprefix("torch."), 0) + 1
    size = sum(f.stat().st_size for f in out.iterdir())
    print(f"{NAME}: seed {seed}, {len(stored)} tensors {kinds}, {size / 1024:.0f} KiB")
    print(f"  generated {ref['generated']}; quantization moves the prompt logits by up to {effect:.3f}")
    print(f"  min gaps: index top-k {stats['index_gap']:.3e}, router top-k {stats['router_gap']:.3e}, "
          f"greedy top-2 {ref['greedy_gap']:.3e}; cached vs cache-free decode {ref['decode_diff']:.3e}")


def prompts(tokenizer_dir):
    import tokenizers
    tok = tokenizers.Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    prompt_ids = tok.encode(base.PROMPT_TEXT).ids[: base.PROMPT_LEN]
    short_ids = tok.encode(base.SHORT_TEXT).ids[: base.SHORT_LEN]
    assert len(prompt_ids) == base.PROMPT_LEN and len(short_ids) == base.SHORT_LEN
    return prompt_ids, short_ids


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="fixtures", type=Path, help="output root (default: fixtures)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    transformers.utils.logging.disable_progress_bar()
    assert transformers.__version__ == "5.25.0", transformers.__version__
    tokenizer_dir = Path(__file__).resolve().parent.parent / "fixtures" / base.TOKENIZER_SOURCE
    for seed in range(base.SEED, base.SEED + base.SEED_TRIES):
        try:
            make_fixture(args.out, seed, tokenizer_dir)
            return
        except base.NotRobust as reason:
            print(f"seed {seed} rejected: {reason}")
    raise SystemExit(f"no robust seed in {base.SEED}..{base.SEED + base.SEED_TRIES - 1}")


if __name__ == "__main__":
    main()
