"""Writes a fixture cut to its first VOCAB tokens: config.json's vocab_size and the embedding's
and LM head's rows, every other file as it is (the shards of a sharded checkpoint merged into
one model.safetensors). For tokens below VOCAB its logits are the fixture's first VOCAB logits,
so the fixture's reference.json is its reference (scripts/xla_check.py compares the first
columns). Used by scripts/test.sh for a vocabulary --tp does not divide (the padded shards);
tests/common/mod.rs (`fixture_with_vocab`) does the same for the Rust tests.

    python scripts/cut_vocab.py FIXTURE_DIR VOCAB OUT_DIR
"""

import json
import shutil
import sys
from pathlib import Path

from safetensors.numpy import load_file, save_file


def main() -> int:
    src, vocab, out = Path(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
    cfg = json.loads((src / "config.json").read_text())
    if cfg["vocab_size"] <= vocab:
        print(f"cut_vocab: {src} has {cfg['vocab_size']} tokens, not more than {vocab}", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    cfg["vocab_size"] = vocab
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    tensors = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    for key in ("model.embed_tokens.weight", "lm_head.weight"):
        if key in tensors:
            tensors[key] = tensors[key][:vocab].copy()
    save_file(tensors, str(out / "model.safetensors"))
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy(f, out / f.name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
