"""Write fixtures/tiny-v4-mtp: tiny-v4 plus DeepSeek-V4's multi-token-prediction (MTP) layer, and reference values.

What: one checkpoint directory in the layout of the other fixtures:

  config.json              fixtures/tiny-v4/config.json with "num_nextn_predict_layers": 1 (nothing else changed).
  model.safetensors        every tensor of fixtures/tiny-v4/model.safetensors, bit for bit, plus the MTP layer under
                           the published DeepSeek-V4 prefix `mtp.0.` (DeepSeek-V4-Flash's last shard holds
                           `mtp.0.*`; no embedding or head of its own, the main model's `embed` and `head` are shared):
                             mtp.0.e_proj.weight, mtp.0.h_proj.weight       [hidden, hidden]
                             mtp.0.enorm.weight, mtp.0.hnorm.weight         [hidden]
                             mtp.0.norm.weight                              [hidden]
                             mtp.0.hc_head_fn / _base / _scale              [hc, hc * hidden] / [hc] / [1]
                           and a full V4 decoder block under the names of tiny-v4's layers (`attn_norm`, `ffn_norm`,
                           `hc_attn_*`, `hc_ffn_*`, `attn.wq_a` ..., `ffn.gate.weight`, `ffn.gate.bias`,
                           `ffn.experts.E.w1/w2/w3`, `ffn.shared_experts.*`): sliding-window attention only (its
                           `compress_ratios` entry is 0: no compressor, no indexer) and top-k routing (the gate's
                           bias; never hash-routed). Seeded with make_v4_fixture.py's init rules: the block is layer 5
                           of a 6-layer tiny-v4 initialised from MTP_SEED, the MTP's own tensors drawn after it.
  tokenizer.json, tokenizer_config.json, generation_config.json
                           copied byte for byte from fixtures/tiny-v4.
  reference-mtp.json       float32 values (each the JSON repr of its double), S = len(token_ids):
      token_ids              tiny-v4 reference.json's prompt
      streams                [S, hc * hidden] the main model's residual streams after its last layer, BEFORE its
                             hyper-head (`hc_head`) and final norm: what the MTP layer reads (vLLM's
                             deepseek_v4_mtp.py stashes `hidden_states.flatten(1)` before hc_head; SGLang's
                             deepseek_v4_nextn.py reads the same `pre_hc_head`)
      main_logits            [S, vocab] transformers' logits over the prompt (one cache-free forward)
      mtp_logits             [S-1, vocab] row i: the MTP layer's logits from (streams[i], token_ids[i+1]) at RoPE
                             position i, sliding-window causal attention over MTP rows 0..i (one forward). It
                             predicts token i+2.
      mtp_streams            [S-1, hc * hidden] the MTP block's output streams, before its hc_head: what vLLM and
                             SGLang feed back as the next chained draft's hidden state
      mtp_greedy             argmax of each mtp_logits row
      min_top2_gap           smallest top-1 minus top-2 logit over mtp_logits rows
      sensitivity            max |logit difference| against mtp_logits when one ingredient is changed (each but
                             the uniform position shift, which relative RoPE cancels, must exceed MIN_EFFECT, so a
                             test against mtp_logits tells them apart)
      checks                 measured facts: the main logits against fixtures/tiny-v4's reference (same weights,
                             same tokens), transformers' loading report for this directory (the mtp.* tensors
                             ignored), causality (rows recomputed from a shorter prefix)
      seed, transformers_version, torch_version, notes, sources

How the MTP layer computes (DeepSeek-V4's inference/model.py `MTPBlock.forward`, as published with the
checkpoints; vLLM's and SGLang's V4 MTP modules compute the same):

    e = enorm(embed(next_token))                        # [t, D]
    x = e_proj(e)[:, None, :] + h_proj(hnorm(streams))   # [t, hc, D]: hnorm and h_proj per stream
    x = Block(layer_id = num_hidden_layers)(x)           # a full V4 block: mHC, sliding attention, top-k MoE
    logits = head(norm(hc_head(x)))                      # its own hc_head and norm, the shared head

The block runs as transformers' DeepseekV4DecoderLayer (layer type sliding_attention, mlp type moe: the "main"
RoPE, base theta, no YaRN; the window is the model's sliding_window); the rest is written here from the
published code. transformers 5.25 itself drops `mtp.*` (`_keys_to_ignore_on_load_unexpected`).

How to run (the reference environment of scripts/requirements-ref-v4.txt):

    python3 -m venv target/v4ref-venv && target/v4ref-venv/bin/pip install -r scripts/requirements-ref-v4.txt
    target/v4ref-venv/bin/python scripts/make_v4_mtp_fixture.py
"""

import json
import shutil
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_v4_fixture as v4  # noqa: E402  (its config, init rules and published names)

from transformers import DeepseekV4ForCausalLM  # noqa: E402
from transformers.masking_utils import create_sliding_window_causal_mask  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SOURCE = ROOT / "fixtures" / "tiny-v4"
OUT = ROOT / "fixtures" / "tiny-v4-mtp"
MTP_SEED = 20261207
MIN_EFFECT = 1e-3
MIN_TOP2_GAP = 1e-4
PREFIX = "mtp.0"

SOURCES = [
    "DeepSeek-V4-Flash inference/model.py, MTPBlock.forward (e_proj + h_proj, hc_head, norm, shared head)",
    "vllm/model_executor/models/deepseek_v4_mtp.py (pre-hc_head streams as the hidden input; mtp.0. names)",
    "sglang/srt/models/deepseek_v4_nextn.py (compress ratio 0 for the next-n layer; pre_hc_head fed back)",
    "transformers 5.25 models/deepseek_v4/modeling_deepseek_v4.py (the decoder block; mtp.* ignored on load)",
]


def mtp_config(main_cfg):
    """tiny-v4's config with one more layer, the MTP block's kinds: sliding attention, top-k MoE."""
    raw = dict(v4.TINY_V4)
    raw["num_hidden_layers"] = main_cfg.num_hidden_layers + 1
    raw["layer_types"] = list(v4.TINY_V4["layer_types"]) + [v4.SLIDING]
    raw["mlp_layer_types"] = list(v4.TINY_V4["mlp_layer_types"]) + ["moe"]
    cfg = v4.DeepseekV4Config(**raw)
    cfg._attn_implementation = "eager"
    cfg._experts_implementation = "eager"
    return cfg


def mtp_tensors(main_cfg):
    """The MTP layer's published tensors ({name: tensor}), seeded."""
    cfg = mtp_config(main_cfg)
    torch.manual_seed(MTP_SEED)
    donor = DeepseekV4ForCausalLM(cfg).eval()
    v4.init_weights(donor, MTP_SEED)
    layer = main_cfg.num_hidden_layers
    out = {}
    for name, t in v4.published_tensors(donor).items():
        if name.startswith(f"layers.{layer}."):
            out[f"{PREFIX}.{name[len(f'layers.{layer}.'):]}"] = t
    gen = torch.Generator().manual_seed(MTP_SEED + 1)
    h, n = main_cfg.hidden_size, main_cfg.hc_mult

    def randn(shape, std):
        return std * torch.randn(shape, generator=gen)

    out[f"{PREFIX}.e_proj.weight"] = randn((h, h), v4.INIT_STD)
    out[f"{PREFIX}.h_proj.weight"] = randn((h, h), v4.INIT_STD)
    for norm in ("enorm", "hnorm", "norm"):
        out[f"{PREFIX}.{norm}.weight"] = 1.0 + randn((h,), v4.NORM_STD)
    out[f"{PREFIX}.hc_head_fn"] = randn((n, n * h), v4.HC_FN_STD)
    out[f"{PREFIX}.hc_head_base"] = randn((n,), v4.HC_BASE_STD)
    lo, hi = v4.HC_SCALE_RANGE
    out[f"{PREFIX}.hc_head_scale"] = lo + (hi - lo) * torch.rand((1,), generator=gen)
    return {k: v.contiguous() for k, v in sorted(out.items())}, donor.model.layers[layer]


def rms_norm(x, weight, eps):
    x = x.float()
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def hyper_head(streams, fn, base, scale, cfg):
    """DeepseekV4HyperHead with the MTP layer's own parameters: [.., hc, D] -> [.., D]."""
    flat = streams.flatten(-2).float()
    flat = flat * torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps)
    pre = torch.sigmoid(F.linear(flat, fn) * scale + base) + cfg.hc_eps
    return (pre.unsqueeze(-1) * streams).sum(dim=-2)


class MtpReference:
    """The MTP layer over the main model's streams (see the module docs), with switches for the sensitivity
    variants."""

    def __init__(self, main, block, tensors):
        self.main, self.block, self.t, self.cfg = main, block, tensors, main.config

    def __call__(self, streams, next_ids, positions, *, hnorm=True, enorm=True, own_head=True, shift=0):
        cfg, t = self.cfg, self.t
        eps = cfg.rms_norm_eps
        e = self.main.model.embed_tokens(next_ids)  # [1, t, D]
        if enorm:
            e = rms_norm(e, t[f"{PREFIX}.enorm.weight"], eps)
        h = rms_norm(streams, t[f"{PREFIX}.hnorm.weight"], eps) if hnorm else streams
        x = F.linear(h, t[f"{PREFIX}.h_proj.weight"]) + F.linear(e, t[f"{PREFIX}.e_proj.weight"]).unsqueeze(2)
        pos = positions + shift
        rope = self.main.model.rotary_emb
        embeddings = {kind: rope(e, position_ids=pos, layer_type=kind) for kind in ("main", "compress")}
        mask = create_sliding_window_causal_mask(
            config=self.block.self_attn.config, inputs_embeds=e, attention_mask=None, cache=None, position_ids=pos,
        )
        x = self.block(x, position_embeddings=embeddings, position_ids=pos, attention_mask=mask,
                       input_ids=next_ids, cache=None)
        if own_head:
            y = hyper_head(x, t[f"{PREFIX}.hc_head_fn"], t[f"{PREFIX}.hc_head_base"], t[f"{PREFIX}.hc_head_scale"], cfg)
            y = rms_norm(y, t[f"{PREFIX}.norm.weight"], eps)
        else:  # the main model's hc_head and norm instead of the MTP layer's
            y = self.main.model.norm(self.main.model.hc_head(x))
        return self.main.lm_head(y), x


def main_streams(model, ids):
    """The main model's logits over `ids` and its last layer's output streams ([1, S, hc, D])."""
    got = {}
    hook = model.model.layers[-1].register_forward_hook(lambda m, a, out: got.__setitem__("s", out))
    try:
        logits = model(input_ids=ids).logits
    finally:
        hook.remove()
    return logits, got["s"]


def floats(t):
    return [[float(v) for v in row] for row in t.reshape(t.shape[0], -1).tolist()]


def main():
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    OUT.mkdir(exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copyfile(SOURCE / name, OUT / name)
    config = json.loads((SOURCE / "config.json").read_text())
    config["num_nextn_predict_layers"] = 1
    (OUT / "config.json").write_text(json.dumps(config, indent=2) + "\n")

    main_tensors = load_file(str(SOURCE / "model.safetensors"))
    reference = json.loads((SOURCE / "reference.json").read_text())
    with torch.no_grad():
        source_model = v4.load_reference_model(SOURCE)
        tensors, block = mtp_tensors(source_model.config)
        save_file({**main_tensors, **tensors}, str(OUT / "model.safetensors"), metadata={"format": "pt"})
        model, info = DeepseekV4ForCausalLM.from_pretrained(
            OUT, dtype=torch.float32, attn_implementation="eager", experts_implementation="eager",
            output_loading_info=True,
        )
        model = model.eval()
        ignored = sorted(info.get("unexpected_keys", []))
        assert not info.get("missing_keys"), info
        block = block.eval()

        ids = torch.tensor([reference["token_ids"]])
        s = ids.shape[1]
        logits, streams = main_streams(model, ids)
        main_vs_fixture = float((logits[0] - torch.tensor(reference["logits"])).abs().max())
        assert main_vs_fixture < 1e-5, main_vs_fixture

        mtp = MtpReference(model, block, tensors)
        positions = torch.arange(s - 1).unsqueeze(0)
        rows, mtp_streams = mtp(streams[:, : s - 1], ids[:, 1:], positions)
        rows = rows[0]
        top2 = rows.topk(2, dim=-1).values
        gap = float((top2[:, 0] - top2[:, 1]).min())
        assert gap > MIN_TOP2_GAP, gap

        # Causality: the first half's rows from the first half alone.
        half = (s - 1) // 2
        prefix_rows, _ = mtp(streams[:, :half], ids[:, 1 : half + 1], positions[:, :half])
        causal = float((prefix_rows[0] - rows[:half]).abs().max())
        assert causal < 1e-5, causal

        def effect(**kw):
            other, _ = mtp(streams[:, : s - 1], ids[:, 1:], positions, **kw)
            return float((other[0] - rows).abs().max())

        sensitivity = {
            "hnorm_dropped": effect(hnorm=False),
            "enorm_dropped": effect(enorm=False),
            "main_hc_head_and_norm": effect(own_head=False),
            "positions_shifted_by_one": effect(shift=1),
        }
        # The hidden input: the streams after the final norm's hyper-head would be one vector, so the closest
        # wrong input is every stream replaced by the collapsed, normalised hidden state.
        collapsed = model.model.norm(model.model.hc_head(streams[:, : s - 1]))
        other, _ = mtp(collapsed.unsqueeze(2).expand_as(streams[:, : s - 1]), ids[:, 1:], positions)
        sensitivity["hidden_after_hc_head_and_norm"] = float((other[0] - rows).abs().max())
        # Shifting every position alike changes nothing (RoPE is relative, and the window is in positions),
        # so that one is recorded, not required.
        weak = {k: v for k, v in sensitivity.items() if not v > MIN_EFFECT and k != "positions_shifted_by_one"}
        assert not weak, weak

    out = {
        "token_ids": reference["token_ids"],
        "streams": floats(streams[0]),
        "main_logits": floats(logits[0]),
        "mtp_logits": floats(rows),
        "mtp_streams": floats(mtp_streams[0]),
        "mtp_greedy": [int(v) for v in rows.argmax(-1).tolist()],
        "min_top2_gap": gap,
        "sensitivity": sensitivity,
        "checks": {
            "main_logits_vs_tiny_v4_reference_max_abs_diff": main_vs_fixture,
            "causal_prefix_rows_max_abs_diff": causal,
            "transformers_unexpected_keys": ignored,
        },
        "seed": MTP_SEED,
        "transformers_version": __import__("transformers").__version__,
        "torch_version": torch.__version__,
        "notes": (
            "Row i of mtp_logits is the MTP layer at RoPE position i fed the main model's streams at i and the "
            "token at i + 1; it predicts token i + 2. No position-0 masking of the embedding (vLLM masks it; "
            "DeepSeek's MTPBlock and SGLang do not)."
        ),
        "sources": SOURCES,
    }
    (OUT / "reference-mtp.json").write_text(json.dumps(out) + "\n")
    print(f"wrote {OUT}: {len(tensors)} mtp tensors, min top-2 gap {gap:.3g}, sensitivity {sensitivity}")


if __name__ == "__main__":
    main()
