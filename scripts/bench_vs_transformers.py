"""Compare CPU decode throughput of deepinfer with HF transformers (eager, float32).

What: builds a random float32 checkpoint for a deepseek config (default: the synthetic
~340M-parameter fixtures/configs/medium-bench.json; published config spelling, per-expert
tensor names, the same seeded scaled-up init as scripts/make_fixtures.py), then for each batch
size measures

  * transformers: a 16-token random prompt is prefilled, then `--steps` single-token greedy
    decode steps with the KV cache are timed (torch.set_num_threads(--threads));
  * deepinfer: `<deepinfer> bench --model DIR --batch B --prompt-len 16 --steps N --json`
    with RAYON_NUM_THREADS=--threads, which prints one JSON line
    {"batch": B, "tokens_per_s": X, "ms_per_step": Y};

and prints a table of tokens/s (batch * steps / seconds) and the deepinfer/transformers ratio.

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


def deepinfer_tokens_per_s(binary, model_dir, batch, steps, threads):
    """tokens/s reported by `deepinfer bench`, or None (with the reason printed) if unavailable."""
    cmd = [str(binary), "bench", "--model", str(model_dir), "--batch", str(batch),
           "--prompt-len", str(PROMPT_LEN), "--steps", str(steps), "--json"]
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
    args = parser.parse_args()
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    torch.set_num_threads(args.threads)
    transformers.utils.logging.disable_progress_bar()

    with tempfile.TemporaryDirectory(prefix="deepinfer-bench-") as tmp:
        model_dir = args.checkpoint_dir or Path(tmp) / "model"
        print(f"writing random float32 checkpoint for {args.config} to {model_dir} ...")
        model = build_checkpoint(args.config, model_dir)
        params = sum(p.numel() for p in model.parameters())
        print(f"{params / 1e6:.1f}M parameters; {args.threads} threads; prompt {PROMPT_LEN}; {args.steps} steps")

        hf = {}
        for batch in batch_sizes:
            hf[batch] = transformers_tokens_per_s(model, batch, args.steps)
            print(f"transformers batch {batch}: {hf[batch]:.2f} tok/s")
        del model

        ours = {b: deepinfer_tokens_per_s(args.deepinfer, model_dir, b, args.steps, args.threads) for b in batch_sizes}

    print(f"\n{'batch':>5}  {'transformers tok/s':>18}  {'deepinfer tok/s':>15}  {'ratio':>6}")
    for b in batch_sizes:
        theirs, mine = hf[b], ours[b]
        mine_s = f"{mine:.2f}" if mine is not None else "n/a"
        ratio_s = f"{mine / theirs:.2f}x" if mine is not None else "n/a"
        print(f"{b:>5}  {theirs:>18.2f}  {mine_s:>15}  {ratio_s:>6}")


if __name__ == "__main__":
    main()
