"""Write a medium-size random DeepSeek-V4 checkpoint for CPU benchmarks (`deepinfer bench --model DIR`).

What: one checkpoint directory (config.json as transformers 5.25 writes it, model.safetensors in the published
DeepSeek-V4 naming, float32; the tokenizer files of fixtures/default-model), about 350M parameters: the medium
MLA benchmark config's sizes (`fixtures/configs/medium-bench.json`: hidden 1024, 6 layers, 64 routed experts of
width 256, 6 active, 1 shared, vocabulary 4096 here as the default model's tokenizer has) with V4-Flash's
per-head shapes (`fixtures/configs/deepseek-v4-flash.json`: one shared K=V head of 512, RoPE on 64 of it, a
sliding window of 128, CSA at rate 4 with 128-wide indexer heads and top-512 selection, HCA at rate 128, 4
hyper-connection streams, sqrtsoftplus routing, the first layers hash-routed) and V4-Flash's layer pattern cut
to 6 layers (sliding, CSA, HCA, CSA, HCA, sliding).

Why: issue 43 asks for V4's CPU decode speed on a checkpoint of medium size, beside the MLA medium config's;
the tiny fixture is too small to say anything about speed. The values are random (scaled as the tiny fixture's,
so activations stay O(1)); only the shapes matter for speed.

How: reuses scripts/make_v4_fixture.py's seeded init and published-name table, so the file is what a published
V4 checkpoint would hold at these sizes (that script's checks of the naming against transformers' own
save_pretrained and from_pretrained cover the table). Needs the V4 reference environment:

    target/v4ref-venv/bin/python scripts/make_v4_medium.py --out /work/v4-medium    # about 1.7 GB, 1-2 min
"""

import argparse
import shutil
import sys
from pathlib import Path

import safetensors.torch
import torch
import transformers
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_v4_fixture as tiny  # noqa: E402

CSA, HCA, SLIDING = tiny.CSA, tiny.HCA, tiny.SLIDING
MEDIUM_V4 = dict(
    tiny.TINY_V4,
    vocab_size=4096,
    hidden_size=1024,
    num_hidden_layers=6,
    layer_types=[SLIDING, CSA, HCA, CSA, HCA, SLIDING],
    mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe", "moe", "moe"],
    compress_rates={CSA: 4, HCA: 128},
    sliding_window=128,
    num_attention_heads=8,
    head_dim=512,
    partial_rotary_factor=0.125,  # qk_rope_head_dim 64
    q_lora_rank=384,
    o_groups=2,
    o_lora_rank=256,
    index_n_heads=16,
    index_head_dim=128,
    index_topk=512,
    n_routed_experts=64,
    num_experts_per_tok=6,
    moe_intermediate_size=256,
    swiglu_limit=10.0,
    rope_parameters={"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 4096,
                     "beta_fast": 32, "beta_slow": 1},
    max_position_embeddings=65536,
    initializer_range=0.02,
)
SEED = 43


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path, help="directory to write (outside the repository)")
    args = parser.parse_args()
    assert transformers.__version__ == "5.25.0", transformers.__version__
    repo = Path(__file__).resolve().parent.parent
    args.out.mkdir(parents=True, exist_ok=True)
    config = DeepseekV4Config(**MEDIUM_V4)
    with torch.device("meta"):
        shapes = DeepseekV4ForCausalLM(config)
    # Materialised without transformers' own init: init_weights overwrites every saved tensor, and the model
    # is never run here (its unsaved RoPE tables stay uninitialised).
    model = shapes.to_empty(device="cpu")
    tiny.init_weights(model, SEED)
    tensors = tiny.published_tensors(model)
    config.save_pretrained(args.out)
    safetensors.torch.save_file(tensors, str(args.out / "model.safetensors"), metadata={"format": "pt"})
    expected = tiny.expected_tensors(config.to_dict())
    assert set(expected) == set(tensors), sorted(set(expected) ^ set(tensors))[:10]
    for name, t in tensors.items():
        assert tuple(t.shape) == expected[name], (name, tuple(t.shape), expected[name])
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(repo / "fixtures" / "default-model" / name, args.out / name)
    params = sum(t.numel() for t in tensors.values())
    print(f"{args.out}: {len(tensors)} tensors, {params / 1e6:.1f}M parameters")


if __name__ == "__main__":
    main()
