"""DeepSeek-V2-Lite-shaped GGUF files with seeded random weights (issue 45).

Subcommands (scripts/make_v2lite_gguf.sh calls them; scripts/test.sh calls `write` for CI):

  write           write a GGUF straight from seeded random codes, one tensor at a time:
                  `--type q8_0` (what convert_hf_to_gguf.py --outtype q8_0 writes: every matrix
                  Q8_0, norms and the router F32), or `--type q4_k_m` (the tensor types
                  llama-quantize's Q4_K_M picks for this model, Q4_K / Q5_0 / Q6_K / Q8_0,
                  random codes in each: the CI stand-in for a llama-quantize output, see below);
  types           print a GGUF's tensor name -> type table as JSON, or compare two files' tables;
  check-metadata  compare a file's metadata with what llama.cpp's own convert_hf_to_gguf.py
                  writes for the same config and tokenizer (its --vocab-only mode; needs the
                  converter's venv with torch and transformers);
  reference       llama.cpp's greedy tokens and logits on a file (through the llama-cpp-python
                  sdist's ctypes bindings over a built libllama), as the JSON tests/gguf_v2lite.rs
                  compares deepinfer with;
  sha256          a file's sha256.

The shape. fixtures/configs/deepseek-v2-lite.json, DeepSeek-V2-Lite's published config: 27
layers (`--layers N` keeps the first N, same shapes: the CI variant has 4, one dense and three
MoE), hidden 2048, 16 heads, kv_lora_rank 512, no q-LoRA, layer 0 dense (10944), then 64 routed
experts of 1408 (6 per token) and 2 shared, vocabulary 102400. 15.7B parameters at 27 layers:
Q8_0 about 16.7 GB, Q4_K_M about 10 GB (llama-quantize --allow-requantize from the Q8_0).

The weights. Written as quantized codes directly, never as float32 or a 16-bit intermediate:
no 31 GB copy on disk, and the writer holds one tensor (at most ~0.45 GB) at a time. A Q8_0
block is a float16 scale d and 32 int8 codes uniform in [-127, 127], d random per block in
[0.75, 1.25] x sigma * sqrt(3) / 127, so that the weights have standard deviation ~sigma,
sigma = the config's initializer_range (0.02, the init transformers gives this config;
scripts/make_fixtures.py's N(0, 0.1) is sized for its hidden sizes of 64 to 1024; here it
would make every matmul's outputs 5x those of the config's own init). Each value is exactly representable in
the file's type, which is what the tests need: both engines read the same numbers. Norm weights
are 1 + N(0, 0.1) and the router N(0, sigma), in float32, as scripts/make_fixtures.py does.
Every tensor has its own generator, seeded from (--seed, the tensor's name), so a tensor's
bytes do not depend on the layer count: the 4-layer file's tensors are the full file's first
4 layers' (its metadata says 4 layers, and q_lora_rank 0: see needs_q_lora_rank_zero).

Q4_K_M for CI. llama.cpp is not built in CI, so its llama-quantize cannot requantize there.
`--type q4_k_m` writes what llama-quantize writes for this model (the same tensor types: Q4_K,
with Q6_K for the LM head and the ffn_down tensors its use_more_bits rule picks, and its
fallbacks where a row is not whole 256-blocks, Q5_0 for Q4_K and Q8_0 for Q6_K;
make_v2lite_gguf.sh checks the table against llama-quantize's output) but with random codes in
each block (Q4_K: d, dmin = 8 d, 6-bit scales in [32, 63] with mins that centre each
sub-block, random 4-bit codes; Q6_K: d, int8 scales of +-[4, 15], random 6-bit codes; Q5_0: d
of either sign, random 5-bit codes), each type's weights again of standard deviation ~sigma.
The full-size Q4_K_M is llama-quantize's own.

The tokenizer. The medium benchmark's (scripts/llamacpp_bench.py): fixtures/default-model's
4,096-token byte-level BPE, declared as llama.cpp's `gpt-2` pre-tokenizer (that docstring says
why). The vocabulary is V2-Lite's 102,400 (the same embedding and LM head bytes): ids 4,096 and
up are `[PAD{id}]` tokens of type UNUSED, exactly as convert_hf_to_gguf.py pads a tokenizer
smaller than the config's vocab_size. Random weights do generate those ids; tests compare ids.

The metadata is what convert_hf_to_gguf.py (llama-cpp-python 0.3.36's vendored llama.cpp)
writes for DeepseekV2ForCausalLM, key for key and in its order (`check-metadata` compares them),
with general.size_label computed from the tensors as the converter does and general.name
"DeepSeek-V2-Lite random".
"""

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
CONFIG = REPO / "fixtures" / "configs" / "deepseek-v2-lite.json"
TOKENIZER_DIR = REPO / "fixtures" / "default-model"
SEED = 45
NAME = "DeepSeek-V2-Lite random"
QK8_0 = 32
QK_K = 256


def gguf_module():
    import gguf  # the PyPI package (pinned by the callers), or gguf-py on sys.path

    return gguf


# ---------------------------------------------------------------------------------------------
# the model's tensors


def tensor_list(cfg):
    """(GGUF name, numpy-order shape, kind) for every tensor, in the converter's order within a
    layer (the HF names sorted, as the safetensors it reads list them). kind: "matrix", "norm",
    "router"."""
    h = cfg["hidden_size"]
    heads = cfg["num_attention_heads"]
    nope, rope, v = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    rank = cfg["kv_lora_rank"]
    if cfg.get("q_lora_rank") is not None:
        sys.exit("write: a q-LoRA config; this writer knows V2-Lite's plain q_proj only")
    experts, moe_ff = cfg["n_routed_experts"], cfg["moe_intermediate_size"]
    shared_ff = moe_ff * cfg["n_shared_experts"]
    out = [("output.weight", (cfg["vocab_size"], h), "matrix"),
           ("token_embd.weight", (cfg["vocab_size"], h), "matrix")]
    for i in range(cfg["num_hidden_layers"]):
        b = f"blk.{i}."
        out.append((b + "attn_norm.weight", (h,), "norm"))
        if i < cfg["first_k_dense_replace"]:
            ff = cfg["intermediate_size"]
            out += [(b + "ffn_down.weight", (h, ff), "matrix"),
                    (b + "ffn_gate.weight", (ff, h), "matrix"),
                    (b + "ffn_up.weight", (ff, h), "matrix")]
        else:
            out += [(b + "ffn_down_exps.weight", (experts, h, moe_ff), "matrix"),
                    (b + "ffn_gate_exps.weight", (experts, moe_ff, h), "matrix"),
                    (b + "ffn_up_exps.weight", (experts, moe_ff, h), "matrix"),
                    (b + "ffn_gate_inp.weight", (experts, h), "router"),
                    (b + "ffn_down_shexp.weight", (h, shared_ff), "matrix"),
                    (b + "ffn_gate_shexp.weight", (shared_ff, h), "matrix"),
                    (b + "ffn_up_shexp.weight", (shared_ff, h), "matrix")]
        out += [(b + "ffn_norm.weight", (h,), "norm"),
                (b + "attn_kv_a_norm.weight", (rank,), "norm"),
                (b + "attn_kv_a_mqa.weight", (rank + rope, h), "matrix"),
                # kv_b_proj split as the converter splits it: k_b transposed per head.
                (b + "attn_k_b.weight", (heads, rank, nope), "matrix"),
                (b + "attn_v_b.weight", (heads, v, rank), "matrix"),
                (b + "attn_output.weight", (h, heads * v), "matrix"),
                (b + "attn_q.weight", (heads * (nope + rope), h), "matrix")]
    out.append(("output_norm.weight", (h,), "norm"))
    return out


def use_more_bits(i_layer, n_layers):
    """llama-quantize's rule for the layers whose ffn_down / attn_v get more bits (llama-quant.cpp)."""
    return i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8 or (i_layer - n_layers // 8) % 3 == 2


def q4_k_m_type(name, shape, n_layers):
    """The type llama-quantize gives tensor `name` in a Q4_K_M of this model (checked against its
    output by make_v2lite_gguf.sh): Q6_K for the LM head and the use_more_bits layers' ffn_down
    (attn_v_b is not its attn_v), Q4_K elsewhere, and where a row is not whole 256-blocks (attn_k_b's
    128, the dense ffn_down's 10944, the experts' 1408) its fallback: Q5_0 for Q4_K, Q8_0 for Q6_K."""
    gguf = gguf_module()
    T = gguf.GGMLQuantizationType
    if name == "output.weight":
        t = T.Q6_K
    elif name.endswith(("ffn_down.weight", "ffn_down_exps.weight", "ffn_down_shexp.weight")):
        layer = int(name.split(".")[1])
        t = T.Q6_K if use_more_bits(layer, n_layers) else T.Q4_K
    else:
        t = T.Q4_K
    if shape[-1] % QK_K != 0:  # llama-quant.cpp's tensor_type_fallback
        t = {T.Q4_K: T.Q5_0, T.Q6_K: T.Q8_0}[t]
    return t


# ---------------------------------------------------------------------------------------------
# random codes


def rng_for(seed, name):
    digest = hashlib.sha256(name.encode()).digest()
    return np.random.default_rng(np.random.SeedSequence([seed, int.from_bytes(digest[:8], "little")]))


def f16_bytes(x):
    return np.asarray(x, dtype="<f2").view(np.uint8).reshape(-1, 2)


def random_q8_0(rng, n, sigma):
    blocks = n // QK8_0
    d = sigma * np.sqrt(3.0) / 127.0 * rng.uniform(0.75, 1.25, size=blocks)
    out = np.empty((blocks, 2 + QK8_0), dtype=np.uint8)
    out[:, :2] = f16_bytes(d)
    out[:, 2:] = rng.integers(-127, 128, size=(blocks, QK8_0), dtype=np.int8).view(np.uint8)
    return out


def random_q5_0(rng, n, sigma):
    # w = d * (q - 16), q in 0..31 (std 9.23), d of either sign (as llama.cpp's quantizer makes
    # it) so that q - 16's mean of -0.5 biases no tensor; qh: the 32 fifth bits, qs: the nibbles.
    blocks = n // QK8_0
    d = sigma / 9.23 * rng.uniform(0.75, 1.25, size=blocks) * rng.choice([-1.0, 1.0], size=blocks)
    out = np.empty((blocks, 22), dtype=np.uint8)
    out[:, :2] = f16_bytes(d)
    out[:, 2:] = np.frombuffer(rng.bytes(blocks * 20), dtype=np.uint8).reshape(blocks, 20)
    return out


def pack_q4_k_scales(sc, m):
    """sc, m: (blocks, 8) 6-bit values -> (blocks, 12) bytes, ggml's get_scale_min_k4 layout."""
    q = np.empty((sc.shape[0], 12), dtype=np.uint8)
    q[:, 0:4] = sc[:, 0:4] | ((sc[:, 4:8] >> 4) << 6)
    q[:, 4:8] = m[:, 0:4] | ((m[:, 4:8] >> 4) << 6)
    q[:, 8:12] = (sc[:, 4:8] & 0xF) | ((m[:, 4:8] & 0xF) << 4)
    return q


def random_q4_k(rng, n, sigma):
    # w = d * sc * q - dmin * m, q in 0..15; dmin = 8 d and m = round(15 sc / 16) centre a
    # sub-block on ~0; std ~ d * rms(sc) * 4.61, rms(sc) ~ 48.4 for sc uniform in [32, 63].
    blocks = n // QK_K
    d = sigma / (48.4 * 4.61) * rng.uniform(0.75, 1.25, size=blocks)
    sc = rng.integers(32, 64, size=(blocks, 8), dtype=np.uint8)
    m = np.rint(sc.astype(np.float32) * 15.0 / 16.0).astype(np.uint8)
    out = np.empty((blocks, 144), dtype=np.uint8)
    out[:, 0:2] = f16_bytes(d)
    out[:, 2:4] = f16_bytes(8.0 * d)
    out[:, 4:16] = pack_q4_k_scales(sc, m)
    out[:, 16:] = np.frombuffer(rng.bytes(blocks * 128), dtype=np.uint8).reshape(blocks, 128)
    return out


def random_q6_k(rng, n, sigma):
    # w = d * scale * (q - 32), q in 0..63 (std 18.5), int8 scales +-[4, 15] (rms ~10.3).
    blocks = n // QK_K
    d = sigma / (10.3 * 18.5) * rng.uniform(0.75, 1.25, size=blocks)
    scales = rng.integers(4, 16, size=(blocks, 16), dtype=np.int8)
    scales *= rng.choice(np.array([-1, 1], dtype=np.int8), size=(blocks, 16))
    out = np.empty((blocks, 210), dtype=np.uint8)
    out[:, :192] = np.frombuffer(rng.bytes(blocks * 192), dtype=np.uint8).reshape(blocks, 192)  # ql, qh
    out[:, 192:208] = scales.view(np.uint8)
    out[:, 208:210] = f16_bytes(d)
    return out


def tensor_bytes(gguf, qtype, rng, shape, kind, sigma):
    """(numpy array to write, its GGML type) for one tensor."""
    T = gguf.GGMLQuantizationType
    n = int(np.prod(shape))
    if kind == "norm":
        return (1.0 + 0.1 * rng.standard_normal(shape, dtype=np.float32)).astype(np.float32), T.F32
    if kind == "router":
        return (sigma * rng.standard_normal(shape, dtype=np.float32)).astype(np.float32), T.F32
    make = {T.Q8_0: random_q8_0, T.Q5_0: random_q5_0, T.Q4_K: random_q4_k, T.Q6_K: random_q6_k}[qtype]
    data = make(rng, n, sigma)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    return data.reshape(*shape[:-1], shape[-1] // block * size), qtype


# ---------------------------------------------------------------------------------------------
# metadata


def load_tokenizer(tok_dir, vocab_size):
    """tokens, token types, merges, and the special ids and flags, as the converter derives them
    from tokenizer.json and tokenizer_config.json (added tokens that are special: CONTROL)."""
    tok = json.loads((tok_dir / "tokenizer.json").read_text())
    tcfg = json.loads((tok_dir / "tokenizer_config.json").read_text())
    model = tok["model"]
    if model["type"] != "BPE":
        sys.exit(f"{tok_dir}: a {model['type']} tokenizer; expected byte-level BPE")
    by_id = {i: t for t, i in model["vocab"].items()}
    added = {a["id"]: a for a in tok.get("added_tokens", [])}
    for i, a in added.items():
        by_id[i] = a["content"]
    if max(by_id) >= vocab_size:
        sys.exit(f"{tok_dir}: token id {max(by_id)} is beyond the vocabulary of {vocab_size}")
    gguf = gguf_module()
    tokens, types = [], []
    for i in range(vocab_size):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        else:
            tokens.append(by_id[i])
            if i in added and not added[i].get("special", False):
                sys.exit(f"{tok_dir}: non-special added token {by_id[i]!r}: not handled")
            types.append(gguf.TokenType.CONTROL if i in added else gguf.TokenType.NORMAL)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    ids = {t: i for i, t in by_id.items()}
    special = {}
    for key in ("bos", "eos", "unk", "sep", "pad", "mask"):
        content = tcfg.get(f"{key}_token")
        if isinstance(content, dict):
            content = content.get("content")
        if content is not None and content in ids:
            special[key] = ids[content]
    return tokens, types, merges, special, tcfg


def needs_q_lora_rank_zero(cfg):
    """llama.cpp (src/models/deepseek2.cpp) takes a deepseek2 file without q-LoRA for
    "lite" only at 26 or 27 layers, and otherwise requires `attention.q_lora_rank`; 0 is how its
    own GGUF writer (llama-model-saver.cpp) says "none", and it then loads `attn_q`. The
    converter writes no key for V2-Lite (27 layers); a shorter variant gets q_lora_rank = 0."""
    return cfg.get("q_lora_rank") is None and cfg["num_hidden_layers"] not in (26, 27)


def add_metadata(w, cfg, tok_dir, file_type):
    """The converter's DeepseekV2Model metadata, in its order (conversion/base.py TextModel and
    conversion/deepseek.py DeepseekV2Model.set_gguf_parameters, SpecialVocab)."""
    gguf = gguf_module()
    w.add_type(gguf.GGUFType.MODEL)
    w.add_name(NAME)
    total, shared, expert, count = w.get_total_parameter_count()
    w.add_size_label(gguf.size_label(total, shared, expert, count))
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(1)  # MLA as MQA with one large head (the converter's note)
    rs = cfg["rope_scaling"]
    if rs.get("type", rs.get("rope_type")) != "yarn":
        sys.exit("write: this writer knows V2-Lite's YaRN rope scaling only")
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(rs["factor"])
    w.add_rope_scaling_orig_ctx_len(rs["original_max_position_embeddings"])
    w.add_rope_scaling_yarn_beta_fast(rs["beta_fast"])
    w.add_rope_scaling_yarn_beta_slow(rs["beta_slow"])
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_expert_count(cfg["n_routed_experts"])
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    w.add_expert_group_count(cfg["n_group"])
    w.add_expert_group_used_count(cfg["topk_group"])
    gating = {"softmax": gguf.ExpertGatingFuncType.SOFTMAX, "sigmoid": gguf.ExpertGatingFuncType.SIGMOID}
    w.add_expert_gating_func(gating[cfg["scoring_func"]])
    rank = cfg["kv_lora_rank"]
    w.add_key_length(rank + cfg["qk_rope_head_dim"])
    w.add_value_length(rank)
    w.add_file_type(file_type)
    w.add_leading_dense_block_count(cfg["first_k_dense_replace"])
    w.add_vocab_size(cfg["vocab_size"])
    if needs_q_lora_rank_zero(cfg):
        w.add_q_lora_rank(0)
    w.add_kv_lora_rank(rank)
    w.add_key_length_mla(cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"])
    w.add_value_length_mla(cfg["v_head_dim"])
    w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    w.add_expert_shared_count(cfg["n_shared_experts"])
    w.add_expert_weights_scale(cfg["routed_scaling_factor"])
    if cfg.get("norm_topk_prob"):
        w.add_expert_weights_norm(True)
    w.add_rope_dimension_count(cfg["qk_rope_head_dim"])
    if rs.get("mscale_all_dim") is not None:
        w.add_rope_scaling_yarn_log_mul(0.1 * rs["mscale_all_dim"])
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    tokens, types, merges, special, tcfg = load_tokenizer(tok_dir, cfg["vocab_size"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    for key, tid in special.items():
        getattr(w, f"add_{key}_token_id")(tid)
    for key in ("bos", "eos"):
        if (flag := tcfg.get(f"add_{key}_token")) is not None:
            getattr(w, f"add_add_{key}_token")(flag)
    if tcfg.get("chat_template"):
        w.add_chat_template(tcfg["chat_template"])


# ---------------------------------------------------------------------------------------------
# write


def load_config(path, layers):
    cfg = json.loads(path.read_text())
    if layers is not None:
        if not 1 <= layers <= cfg["num_hidden_layers"]:
            sys.exit(f"--layers must be in 1..{cfg['num_hidden_layers']}, not {layers}")
        cfg["num_hidden_layers"] = layers
    return cfg


def peak_rss_gb():
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # KiB on Linux


def cmd_write(args):
    gguf = gguf_module()
    T = gguf.GGMLQuantizationType
    cfg = load_config(args.config, args.layers)
    sigma = float(cfg["initializer_range"])
    n_layers = cfg["num_hidden_layers"]
    tensors = tensor_list(cfg)
    types = {}
    for name, shape, kind in tensors:
        if kind != "matrix":
            types[name] = T.F32
        elif args.type == "q8_0":
            types[name] = T.Q8_0
        else:
            types[name] = q4_k_m_type(name, shape, n_layers)
    file_type = {"q8_0": gguf.LlamaFileType.MOSTLY_Q8_0, "q4_k_m": gguf.LlamaFileType.MOSTLY_Q4_K_M}[args.type]

    args.out.parent.mkdir(parents=True, exist_ok=True)
    partial = args.out.with_name(args.out.name + ".partial")
    w = gguf.GGUFWriter(partial, "deepseek2")
    for name, shape, kind in tensors:
        t = types[name]
        block, size = gguf.GGML_QUANT_SIZES[t]
        nbytes = int(np.prod(shape)) // block * size
        raw_shape = (*shape[:-1], shape[-1] // block * size) if t != T.F32 else shape
        w.add_tensor_info(name, raw_shape, np.dtype(np.uint8 if t != T.F32 else np.float32), nbytes,
                          raw_dtype=t if t != T.F32 else None)
    add_metadata(w, cfg, args.tokenizer_dir, file_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    start = time.time()
    written = 0
    for i, (name, shape, kind) in enumerate(tensors):
        data, t = tensor_bytes(gguf, types[name], rng_for(args.seed, name), shape, kind, sigma)
        assert t == types[name]
        w.write_tensor_data(data)
        written += data.nbytes
        del data
        if args.progress and (i % 10 == 0 or i == len(tensors) - 1):
            print(f"  {i + 1}/{len(tensors)} tensors, {written / 1e9:.2f} GB, {time.time() - start:.0f} s",
                  file=sys.stderr, flush=True)
    w.close()
    os.replace(partial, args.out)
    params = sum(int(np.prod(s)) for _, s, _ in tensors)
    print(json.dumps({"file": str(args.out), "type": args.type, "layers": n_layers, "seed": args.seed,
                      "params": params, "bytes": args.out.stat().st_size,
                      "seconds": round(time.time() - start, 1), "peak_rss_gb": round(peak_rss_gb(), 2)}))


# ---------------------------------------------------------------------------------------------
# types, sha256


def type_table(path):
    gguf = gguf_module()
    r = gguf.GGUFReader(path)
    return {t.name: t.tensor_type.name for t in r.tensors}


def q4_k_m_table(layers, config):
    cfg = load_config(config, layers)
    return {name: (q4_k_m_type(name, shape, layers).name if kind == "matrix" else "F32")
            for name, shape, kind in tensor_list(cfg)}


def cmd_types(args):
    if (args.gguf is None) == (args.q4_k_m_layers is None):
        sys.exit("types: give --gguf or --q4-k-m-layers")
    if args.gguf is not None:
        ours, label = type_table(args.gguf), args.gguf.name
    else:
        ours, label = q4_k_m_table(args.q4_k_m_layers, args.config), "write --type q4_k_m"
    if args.against is None:
        print(json.dumps(ours, indent=1))
        return
    theirs = type_table(args.against)
    diff = {n: (ours.get(n), theirs.get(n)) for n in sorted(set(ours) | set(theirs)) if ours.get(n) != theirs.get(n)}
    counts = {}
    for t in theirs.values():
        counts[t] = counts.get(t, 0) + 1
    if diff:
        for n, (a, b) in diff.items():
            print(f"types: {n}: {label} {a}, {args.against.name} {b}")
        sys.exit(f"types: {len(diff)} tensors differ")
    print(f"types: {len(ours)} tensors, the same types in {label} and {args.against.name} ({counts})")


def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def cmd_sha256(args):
    print(sha256_file(args.gguf))


# ---------------------------------------------------------------------------------------------
# check-metadata


def field_value(field):
    try:
        return field.contents()
    except Exception:  # noqa: BLE001 - an unreadable field is compared by its raw parts
        return [bytes(p) for p in field.parts]


def cmd_check_metadata(args):
    """Runs convert_hf_to_gguf.py --vocab-only on a directory holding the config (with our layer
    count) and the tokenizer, declaring the pre-tokenizer as scripts/llamacpp_bench.py does, and
    compares every key but general.name (the converter's comes from the directory name) and
    general.size_label (it writes none without tensors)."""
    import subprocess
    import tempfile

    gguf = gguf_module()
    r = gguf.GGUFReader(args.gguf)
    ours = {k: (f.types, field_value(f)) for k, f in r.fields.items() if not k.startswith("GGUF.")}
    layers = ours["deepseek2.block_count"][1]
    ftype = ours["general.file_type"][1]
    outtype = {int(gguf.LlamaFileType.MOSTLY_Q8_0): "q8_0"}.get(ftype)
    with tempfile.TemporaryDirectory(prefix="v2lite-meta-") as tmp:
        model = Path(tmp) / "model"
        model.mkdir()
        cfg = json.loads(args.config.read_text())
        cfg["num_hidden_layers"] = layers
        (model / "config.json").write_text(json.dumps(cfg, indent=2))
        for name in ("tokenizer.json", "tokenizer_config.json"):
            (model / name).write_bytes((args.tokenizer_dir / name).read_bytes())
        out = Path(tmp) / "vocab.gguf"
        cmd = [str(args.converter_python), str(REPO / "scripts" / "llamacpp_bench.py"), "convert", "--llama-cpp",
               str(args.llama_cpp), "--model", str(model), "--outtype", outtype or "q8_0",
               "--outfile", str(out), "--vocab-only"]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            sys.exit(f"check-metadata: the converter failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
        t = gguf.GGUFReader(out)
        theirs = {k: (f.types, field_value(f)) for k, f in t.fields.items() if not k.startswith("GGUF.")}
    skip = {"general.name", "general.size_label"}
    if ours.get("deepseek2.attention.q_lora_rank", (None, None))[1] == 0 and layers not in (26, 27):
        skip.add("deepseek2.attention.q_lora_rank")  # see needs_q_lora_rank_zero
    if outtype is None:
        skip.add("general.file_type")  # the converter cannot write Q4_K_M; llama-quantize sets it
    order_ours = [k for k in ours if k not in skip]
    order_theirs = [k for k in theirs if k not in skip]
    bad = []
    for k in sorted(set(order_ours) | set(order_theirs)):
        if k not in ours or k not in theirs:
            bad.append(f"{k}: only in {'ours' if k in ours else 'the converter'}'s")
        elif ours[k] != theirs[k]:
            a, b = ours[k], theirs[k]
            bad.append(f"{k}: ours {a[0]} {str(a[1])[:120]}, the converter's {b[0]} {str(b[1])[:120]}")
    if not bad and order_ours != order_theirs:
        bad.append(f"the keys are in another order: ours {order_ours}, the converter's {order_theirs}")
    for line in bad:
        print(f"check-metadata: {line}")
    if bad:
        sys.exit(f"check-metadata: {args.gguf} differs from convert_hf_to_gguf.py's metadata")
    print(f"check-metadata: {len(order_ours)} keys, the same values and order as convert_hf_to_gguf.py "
          f"--vocab-only writes (general.name and general.size_label aside)")


# ---------------------------------------------------------------------------------------------
# reference


def g7(x):
    return float(f"{float(x):.7g}")


def cmd_reference(args):
    """llama.cpp's greedy continuation and logits through the sdist's own ctypes bindings: F32
    KV cache (as the parity gate), no flash attention, weight repacking off (the CPU backend's
    repacked layouts abort on this AMX machine for Q8_0, scripts/bench_vs_llamacpp.sh)."""
    os.environ["LLAMA_CPP_LIB_PATH"] = str(args.lib_dir.resolve())
    sys.path.insert(0, str(args.llama_cpp_python.resolve()))
    import llama_cpp
    import llama_cpp.llama_cpp as low

    default_params = low.llama_model_default_params

    def no_repack():
        p = default_params()
        p.use_extra_bufts = False
        return p

    low.llama_model_default_params = no_repack
    llm = llama_cpp.Llama(model_path=str(args.gguf), n_ctx=256, n_batch=256, n_ubatch=256,
                          n_threads=args.threads, n_threads_batch=args.threads, logits_all=True,
                          type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32,
                          flash_attn=False, verbose=False)
    prompt = llm.tokenize(args.prompt.encode("utf-8"), add_bos=True, special=False)
    llm.reset()
    llm.eval(prompt)
    generated = []
    while True:
        token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        generated.append(token)
        if len(generated) == args.new_tokens:
            break
        llm.eval([token])
    logits = np.array(llm.scores[: llm.n_tokens], dtype=np.float32)
    vocab = logits.shape[1]
    sampled = list(range(0, vocab, args.stride))
    rows = []
    for row in logits:
        top = np.argsort(-row, kind="stable")[: args.top]
        rows.append({
            "max_abs": g7(np.abs(row).max()),
            "mean": g7(row.mean(dtype=np.float64)),
            "std": g7(row.std(dtype=np.float64)),
            "top_ids": [int(i) for i in top],
            "top_logits": [g7(row[i]) for i in top],
            "sampled_logits": [g7(row[i]) for i in sampled],
        })
    ranked = np.sort(logits, axis=1)
    out = {
        "about": "llama.cpp's greedy tokens and logits on the V2-Lite-shaped GGUF written by "
                 "`scripts/v2lite_gguf.py write` (scripts/make_v2lite_gguf.sh --references); "
                 "tests/gguf_v2lite.rs compares deepinfer with them",
        "gguf": args.gguf.name,
        "gguf_sha256": sha256_file(args.gguf),
        "gguf_bytes": args.gguf.stat().st_size,
        "llama_cpp": args.llama_cpp_version,
        "settings": "llama-cpp-python bindings, F32 KV cache, no flash attention, no weight repacking, "
                    f"{args.threads} threads",
        "prompt": args.prompt,
        "prompt_token_ids": prompt,
        "generated_token_ids": generated,
        "sampled_ids_stride": args.stride,
        "min_top2_gap": float((ranked[:, -1] - ranked[:, -2]).min()),
        "positions": rows,
    }
    # One line per position; logits to 7 significant digits (f32's precision).
    body = json.dumps({k: v for k, v in out.items() if k != "positions"}, indent=1)[:-2]
    rows_text = ",\n  ".join(json.dumps(row, separators=(",", ":")) for row in rows)
    args.out.write_text(f'{body},\n "positions": [\n  {rows_text}\n ]\n}}\n')
    print(f"reference: {len(prompt)} prompt tokens, greedy {generated}, logits at {len(rows)} positions "
          f"x {vocab} (kept: top {args.top} and every {args.stride}th id); smallest top-2 gap "
          f"{out['min_top2_gap']:.3g} -> {args.out}")


# ---------------------------------------------------------------------------------------------


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("write")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--type", choices=["q8_0", "q4_k_m"], default="q8_0")
    p.add_argument("--layers", type=int, help="keep the first N layers (default: the config's 27)")
    p.add_argument("--seed", type=int, default=SEED)
    p.add_argument("--config", type=Path, default=CONFIG)
    p.add_argument("--tokenizer-dir", type=Path, default=TOKENIZER_DIR)
    p.add_argument("--progress", action="store_true")

    p = sub.add_parser("types")
    p.add_argument("--gguf", type=Path)
    p.add_argument("--q4-k-m-layers", type=int, help="instead of --gguf: `write --type q4_k_m`'s table")
    p.add_argument("--config", type=Path, default=CONFIG)
    p.add_argument("--against", type=Path, help="another GGUF whose types must be the same")

    p = sub.add_parser("sha256")
    p.add_argument("--gguf", type=Path, required=True)

    p = sub.add_parser("check-metadata")
    p.add_argument("--gguf", type=Path, required=True)
    p.add_argument("--llama-cpp", type=Path, required=True, help="llama.cpp source tree (the converter)")
    p.add_argument("--converter-python", type=Path, required=True,
                   help="a Python with the converter's packages (torch, transformers, ...)")
    p.add_argument("--config", type=Path, default=CONFIG)
    p.add_argument("--tokenizer-dir", type=Path, default=TOKENIZER_DIR)

    p = sub.add_parser("reference")
    p.add_argument("--gguf", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--llama-cpp-python", type=Path, required=True, help="the sdist's root (holds llama_cpp/)")
    p.add_argument("--lib-dir", type=Path, required=True, help="directory holding the built libllama.so")
    p.add_argument("--llama-cpp-version", default="unknown", help="recorded in the JSON")
    p.add_argument("--prompt", default="ROMEO:\nBut, soft! what light through yonder window breaks?\n")
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--top", type=int, default=16, help="keep each position's top-N logits")
    p.add_argument("--stride", type=int, default=397, help="and the logits of every N-th id")

    args = parser.parse_args()
    {"write": cmd_write, "types": cmd_types, "sha256": cmd_sha256, "check-metadata": cmd_check_metadata,
     "reference": cmd_reference}[args.cmd](args)


if __name__ == "__main__":
    main()
