"""Write a V4 fixture's reference-bf16.json: transformers running it in bfloat16, the yardstick for deepinfer's
bf16 DeepSeek-V4 weights.

What: transformers 5.25's DeepseekV4ForCausalLM loads the fixture (fixtures/tiny-v4, or fixtures/tiny-v4-fp8,
whose FP8 and FP4 tensors it dequantizes as it loads) with dtype=torch.bfloat16 (eager attention and experts),
the way a transformers-bf16 user runs it: weights and activations in bfloat16, but for what the model class
itself keeps in float32 (listed in the notes). On the inputs the fixture's reference.json holds, it writes

  logits / logits_short   cache-free logits of token_ids and token_ids_short (float32 copies);
  logits_decode           row i: the logits at the position that predicts reference.json's greedy token i,
                          from one cache-free forward over its prompt + continuation (teacher-forced on the
                          float32 greedy tokens, as tests/v4.rs feeds them), row 0 the prompt's last;
  greedy                  reference.json's (the tokens fed), and greedy_bf16: the peer's own cached greedy
                          continuation of the same prompt;
  max_abs_diff_vs_f32     over every row above, against reference.json's float32 rows;
  argmax_agreement_vs_f32 the share of those rows whose argmax is float32's;
  greedy_agreement_vs_f32 leading tokens of greedy_bf16 equal to reference.json's.

Why: deepinfer issue 43 (DeepSeek-V4 in bf16). As for the MLA fixtures' reference-bf16.json
(scripts/make_precision_references.py), this is not a target for bit equality: it says how far a real bf16
peer drifts from float32 on this model, which deepinfer's bf16 weights must not exceed.

How: in the V4 reference venv (scripts/requirements-ref-v4.txt, transformers 5.25):

    python3 -m venv target/v4ref-venv && target/v4ref-venv/bin/pip install -r scripts/requirements-ref-v4.txt
    target/v4ref-venv/bin/python scripts/make_v4_bf16_reference.py --fixture fixtures/tiny-v4
    target/v4ref-venv/bin/python scripts/make_v4_bf16_reference.py --fixture fixtures/tiny-v4-fp8
"""

import argparse
import json
import sys
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_v4_fixture as base  # noqa: E402  (tiny-v4's loading, forwards and cached greedy decode)


def rows_of(model, reference):
    """The peer's float32 logits of every row the reference holds, by field."""
    prompt = reference["greedy"]["prompt_token_ids"]
    generated = reference["greedy"]["generated_token_ids"]
    teacher_forced = base.forward_logits(model, prompt + generated[:-1]).float()
    return {
        "logits": base.forward_logits(model, reference["token_ids"]).float(),
        "logits_short": base.forward_logits(model, reference["token_ids_short"]).float(),
        "logits_decode": teacher_forced[len(prompt) - 1:],
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fixture", default="fixtures/tiny-v4", type=Path)
    args = parser.parse_args()
    reference = json.loads((args.fixture / "reference.json").read_text())
    model = base.load_reference_model(args.fixture, dtype=torch.bfloat16)
    kept_f32 = sorted(
        name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.dtype != torch.bfloat16
    )
    rows = rows_of(model, reference)
    ours, theirs = [], []
    for field, got in rows.items():
        want = torch.tensor(reference[field], dtype=torch.float32)
        assert got.shape == want.shape, (field, got.shape, want.shape)
        ours.append(got)
        theirs.append(want)
    got, want = torch.cat(ours), torch.cat(theirs)
    assert torch.isfinite(got).all()
    prompt = reference["greedy"]["prompt_token_ids"]
    f32_generated = reference["greedy"]["generated_token_ids"]
    greedy_bf16, _, _ = base.greedy_with_cache(model, prompt)
    leading = 0
    while leading < len(f32_generated) and greedy_bf16[leading] == f32_generated[leading]:
        leading += 1
    kinds = sorted({name.split(".", 3)[-1] if name.startswith("model.layers.") else name for name in kept_f32})
    out = {
        "token_ids": reference["token_ids"],
        "token_ids_short": reference["token_ids_short"],
        "greedy": reference["greedy"],
        "greedy_bf16": greedy_bf16,
        **{field: value.tolist() for field, value in rows.items()},
        "max_abs_diff_vs_f32": (got - want).abs().max().item(),
        "argmax_agreement_vs_f32": (got.argmax(-1) == want.argmax(-1)).float().mean().item(),
        "greedy_agreement_vs_f32": {"leading_tokens_equal": leading, "total": len(f32_generated)},
        "dtype": "bfloat16",
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "notes": (
            f"transformers {transformers.__version__} DeepseekV4ForCausalLM on {args.fixture} loaded with "
            "dtype=torch.bfloat16, eager attention and experts: weights and activations in bfloat16, but for "
            f"what it keeps in float32 ({', '.join(kinds) or 'nothing'}). logits / logits_short: cache-free "
            "forwards of reference.json's token_ids / token_ids_short; logits_decode: one cache-free forward "
            "over reference.json's greedy prompt + continuation, from the prompt's last position (teacher-forced "
            "on the float32 greedy tokens); greedy_bf16: the peer's own cached greedy continuation. Statistics "
            "against reference.json's float32 rows over all three: a measure of a bf16 peer's drift, not a "
            "bit-exact target."
        ),
    }
    path = args.fixture / "reference-bf16.json"
    path.write_text(json.dumps(out) + "\n")
    print(
        f"{path}: max |logit - f32| {out['max_abs_diff_vs_f32']:.3e}, argmax agreement "
        f"{out['argmax_agreement_vs_f32']:.4f}, greedy {leading}/{len(f32_generated)}; kept f32: {kinds}"
    )


if __name__ == "__main__":
    main()
