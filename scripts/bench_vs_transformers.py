"""Compare CPU decode throughput of deepinfer with HF transformers (eager, float32 and bfloat16).

What: builds a random float32 checkpoint for a deepseek config (default: the synthetic
~340M-parameter fixtures/configs/medium-bench.json; published config spelling, per-expert
tensor names, the same seeded scaled-up init as scripts/make_fixtures.py), then for each batch
size measures

  * transformers: a 16-token random prompt is prefilled, then `--steps` single-token greedy
    decode steps with the KV cache are timed (torch.set_num_threads(--threads)), with the model
    in float32 and then in bfloat16;
  * deepinfer: `<deepinfer> bench --model DIR --batch B --prompt-len 16 --steps N --json`
    with RAYON_NUM_THREADS=--threads, which prints one JSON line
    {"batch": B, "tokens_per_s": X, "ms_per_step": Y}, once per precision of --precisions
    (f32: `--dtype f32`; bf16: `--dtype bf16`; int8: `--dtype bf16 --quantize experts-int8`;
    q8_0 / q4_k: `--dtype bf16 --quantize q8_0|q4_k`, GGML block formats, CPU only);

and prints a table of tokens/s (batch * steps / seconds) and each deepinfer precision's ratio
to the faster of transformers' two. With --rounds N every cell is measured N times: a round
measures both engines at one batch size back to back (transformers f32 and bf16, then each
deepinfer precision), and each ratio is taken within its round, so that a machine whose speed
drifts over minutes (shared VMs do) slows both sides of a ratio alike.

Why: a like-for-like CPU baseline for the Rust engine's decode path (same weights, same
threads, same prompt length and step count).

How to run (from the repository root, reference venv of scripts/requirements-ref.txt):

    /work/refenv/bin/python scripts/bench_vs_transformers.py \\
        --config fixtures/configs/medium-bench.json --batch-sizes 1,8 --steps 32 --threads 2 \\
        --deepinfer target/release/deepinfer

The checkpoint (~1.4 GB for medium-bench) goes to a temporary directory that is deleted at the
end, unless --checkpoint-dir is given (then it is written there and kept). transformers runs on
the in-memory model that was saved (not a lazily memory-mapped reload, whose page faults would
distort the timings).
"""

import argparse
import copy
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM

from make_fixtures import SEED, init_weights

PROMPT_LEN = 16
# The bench prompt is random token ids; the tiny fixture tokenizer only makes DIR a complete checkpoint.
TOKENIZER_FILES = [Path(__file__).resolve().parent.parent / "fixtures" / "tiny-v3" / name
                   for name in ("tokenizer.json", "tokenizer_config.json")]


def build_checkpoint(config_path, directory):
    """Write config.json (verbatim) and random float32 weights; return the model in memory."""
    published = json.loads(Path(config_path).read_text())
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(published, indent=2) + "\n")
    hf_config = AutoConfig.from_pretrained(directory)
    hf_config._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32).eval()
    init_weights(model, SEED)
    model.save_pretrained(directory)  # transformers 5 writes per-expert (published) tensor names
    (directory / "config.json").write_text(json.dumps(published, indent=2) + "\n")
    (directory / "generation_config.json").unlink()
    for path in TOKENIZER_FILES:
        shutil.copy(path, directory)
    return model


@torch.inference_mode()
def transformers_tokens_per_s(model, batch, steps):
    """Prefill a random PROMPT_LEN-token prompt, then time `steps` cached greedy decode steps."""
    gen = torch.Generator().manual_seed(batch)
    prompt = torch.randint(2, model.config.vocab_size, (batch, PROMPT_LEN), generator=gen)
    out = model(prompt, use_cache=True)
    cache, token = out.cache, out.logits[:, -1:].argmax(-1)
    out = model(token, cache=cache, use_cache=True)  # one untimed warm-up step
    cache, token = out.cache, out.logits[:, -1:].argmax(-1)
    start = time.perf_counter()
    for _ in range(steps):
        out = model(token, cache=cache, use_cache=True)
        cache, token = out.cache, out.logits[:, -1:].argmax(-1)
    return batch * steps / (time.perf_counter() - start)


PRECISION_FLAGS = {
    "f32": ["--dtype", "f32"],
    "bf16": ["--dtype", "bf16"],
    "int8": ["--dtype", "bf16", "--quantize", "experts-int8"],
    "q8_0": ["--dtype", "bf16", "--quantize", "q8_0"],
    "q4_k": ["--dtype", "bf16", "--quantize", "q4_k"],
}


def deepinfer_tokens_per_s(binary, model_dir, batch, steps, threads, precision):
    """tokens/s reported by `deepinfer bench`, or None (with the reason printed) if unavailable."""
    cmd = [str(binary), "bench", "--model", str(model_dir), "--batch", str(batch),
           "--prompt-len", str(PROMPT_LEN), "--steps", str(steps), "--json", *PRECISION_FLAGS[precision]]
    env = dict(os.environ, RAYON_NUM_THREADS=str(threads))
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    except FileNotFoundError:
        print(f"deepinfer: {binary} not found (build it with `cargo build --release`)")
        return None
    if proc.returncode != 0:
        print(f"deepinfer: `{' '.join(cmd)}` exited with {proc.returncode}:\n{proc.stderr.strip()[-2000:]}")
        return None
    lines = [line for line in proc.stdout.splitlines() if line.strip().startswith("{")]
    try:
        return float(json.loads(lines[-1])["tokens_per_s"])
    except (IndexError, ValueError, KeyError, TypeError):
        print(f"deepinfer: no {{\"tokens_per_s\": ...}} JSON line in the output of `{' '.join(cmd)}`:\n"
              f"{proc.stdout.strip()[-2000:]}")
        return None


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=Path("fixtures/configs/medium-bench.json"))
    parser.add_argument("--batch-sizes", default="1,8", help="comma-separated batch sizes")
    parser.add_argument("--steps", type=int, default=32, help="timed decode steps per batch size")
    parser.add_argument("--threads", type=int, default=2, help="torch threads / RAYON_NUM_THREADS")
    parser.add_argument("--deepinfer", type=Path, default=Path("target/release/deepinfer"))
    parser.add_argument("--checkpoint-dir", type=Path, help="write the checkpoint here and keep it")
    parser.add_argument("--precisions", default="f32,bf16,int8", help="deepinfer precisions: f32, bf16, int8, q8_0, q4_k")
    parser.add_argument("--rounds", type=int, default=1,
                        help="measure every cell this many times; each round measures both engines at one "
                             "batch size back to back, so the machine's drift falls on both")
    args = parser.parse_args()
    precisions = args.precisions.split(",")
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    torch.set_num_threads(args.threads)
    transformers.utils.logging.disable_progress_bar()

    with tempfile.TemporaryDirectory(prefix="deepinfer-bench-") as tmp:
        model_dir = args.checkpoint_dir or Path(tmp) / "model"
        print(f"writing random float32 checkpoint for {args.config} to {model_dir} ...")
        model = build_checkpoint(args.config, model_dir)
        params = sum(p.numel() for p in model.parameters())
        print(f"{params / 1e6:.1f}M parameters; {args.threads} threads; prompt {PROMPT_LEN}; {args.steps} steps")
        # Both dtypes stay in memory, so rounds never convert back (bf16 -> f32 would round).
        models = {"float32": model, "bfloat16": copy.deepcopy(model).to(torch.bfloat16)}

        # (round, batch) -> ({transformers dtype: tok/s}, {our precision: tok/s or None})
        cells = {}
        for r in range(1, args.rounds + 1):
            for b in batch_sizes:
                hf = {name: transformers_tokens_per_s(m, b, args.steps) for name, m in models.items()}
                ours = {p: deepinfer_tokens_per_s(args.deepinfer, model_dir, b, args.steps, args.threads, p)
                        for p in precisions}
                cells[(r, b)] = (hf, ours)
                shown = ", ".join(f"{p} {v:.2f}" if v is not None else f"{p} n/a" for p, v in ours.items())
                print(f"round {r} batch {b}: transformers float32 {hf['float32']:.2f}, "
                      f"bfloat16 {hf['bfloat16']:.2f}; deepinfer {shown} tok/s")

    head = (f"{'round':>5}  {'batch':>5}  {'hf f32':>8}  {'hf bf16':>8}"
            + "".join(f"  {'ours ' + p:>10}  {'ratio':>6}" for p in precisions))
    print("\ntokens/s; ratio = ours / the faster transformers in the same round\n" + head)
    for (r, b), (hf, ours) in sorted(cells.items(), key=lambda cell: (cell[0][1], cell[0][0])):
        best = max(hf.values())
        row = f"{r:>5}  {b:>5}  {hf['float32']:>8.2f}  {hf['bfloat16']:>8.2f}"
        for p in precisions:
            mine = ours[p]
            row += f"  {mine:>10.2f}  {mine / best:>5.2f}x" if mine is not None else f"  {'n/a':>10}  {'n/a':>6}"
        print(row)


if __name__ == "__main__":
    main()
