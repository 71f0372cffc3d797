"""The Python half of scripts/bench_vs_llamacpp.sh: checkpoint, conversion, parity and the table.

Subcommands (the shell script calls them in this order; each can be rerun on its own):

  checkpoint  write a random float32 HF checkpoint of a deepseek config (default
              fixtures/configs/medium-bench.json) with a real tokenizer (fixtures/default-model's);
  convert     run llama.cpp's own convert_hf_to_gguf.py on it (F32, BF16 or Q8_0), declaring the
              tokenizer's pre-tokenizer, which the converter's hash table cannot know (below);
  parity      greedy continuation and every position's logits, llama.cpp (through the
              llama-cpp-python sdist's own ctypes bindings over the libllama just built) against
              `deepinfer generate` / `deepinfer score`, in F32; exits 1 if any token differs;
  parse       turn one benchmark tool's output into a JSON line of the results file (decode or
              prefill tok/s; with --time-file, /usr/bin/time -v's peak RSS and wall time);
  report      print the results file as a markdown table (--by-case: one per --suite v2lite cell).

Why this checkpoint. The weights are the ones scripts/bench_vs_transformers.py benchmarks:
transformers' `DeepseekV3ForCausalLM` built from the config and filled by
scripts/make_fixtures.py's seeded init (`init_weights(model, SEED)`: N(0, 0.1) matrices,
1 + N(0, 0.1) norms, U[0, 0.1) router bias), so its figures sit beside benches/README.md's
medium-bench tables. The vocabulary stays the config's 32,000 (the same embedding and LM head,
the same bytes read per step as in those tables); the tokenizer has 4,096 tokens, and the
converter fills ids 4,096..31,999 with `[PAD{id}]` tokens of type UNUSED
(`TextModel.get_vocab_base`), which llama.cpp loads like any other vocabulary entry. Greedy
decoding may pick those ids (the weights are random); both engines then still agree on ids,
which is why parity compares ids, not text.

Why the pre-tokenizer is declared. convert_hf_to_gguf.py names a BPE tokenizer's pre-tokenizer
by hashing the tokens of a fixed text (`get_vocab_base_pre`) and looking the hash up in a table
generated from published models; a tokenizer trained for this repository is not in it, and the
converter refuses it. Its pre-tokenizer is `ByteLevel(add_prefix_space=false, use_regex=true)`
with no normalizer: GPT-2's, which llama.cpp implements as `gpt-2`. `convert` therefore
wraps `get_vocab_base_pre` (monkeypatched in the converter's own process, the converter file
untouched): when the original raises for an unknown hash, and only if the checkpoint's
tokenizer.json is byte for byte one of fixtures/*/tokenizer.json and declares that pre-tokenizer,
it answers "gpt-2"; any other unknown tokenizer still fails. `parity` checks the declaration:
llama.cpp's tokenization of several texts must equal transformers'.
"""

import argparse
import hashlib
import json
import logging
import os
import runpy
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TOKENIZER_DIR = REPO / "fixtures" / "default-model"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
# What llama.cpp calls the GPT-2 byte-level pre-tokenizer (LLAMA_VOCAB_PRE_TYPE_GPT2).
DECLARED_PRE_TOKENIZER = "gpt-2"
# Texts whose tokenization must agree between transformers and llama.cpp (`parity`): the
# Shakespeare the tokenizer was trained on, digits, runs of spaces and newlines, punctuation,
# contractions and non-ASCII.
TOKENIZER_TEXTS = (
    "ROMEO:\nBut, soft! what light through yonder window breaks?\n",
    "KING HENRY V:\nOnce more unto the breach, dear friends, once more;\n  Or close the wall up.",
    "  leading spaces,\ttabs\t\tand  double  spaces\n\n\nthree newlines, 1234567 digits; I'll, we've, 'tis.",
    "Ünïcödé — “quotes” and emoji 🦙 3.14159 ... !!! ??? ``` '''",
)


def sha256(path):
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


# ---------------------------------------------------------------------------------------------
# checkpoint


def cmd_checkpoint(args):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    sys.path.insert(0, str(REPO / "scripts"))
    from make_fixtures import SEED, init_weights

    out = args.out
    published = json.loads(args.config.read_text())
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(published, indent=2) + "\n")
    hf_config = AutoConfig.from_pretrained(out)
    model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32).eval()
    init_weights(model, SEED)
    params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(out)  # float32 safetensors, per-expert (published) tensor names
    # The published spelling of the config, not transformers' re-serialization of it.
    (out / "config.json").write_text(json.dumps(published, indent=2) + "\n")
    (out / "generation_config.json").unlink(missing_ok=True)
    for name in TOKENIZER_FILES:
        shutil.copy(TOKENIZER_DIR / name, out / name)
    print(f"checkpoint: {out}: {params / 1e6:.1f}M parameters, float32, seed {SEED}, "
          f"vocab {published['vocab_size']}, tokenizer of {TOKENIZER_DIR.relative_to(REPO)}")


# ---------------------------------------------------------------------------------------------
# convert


def declares_gpt2_pre_tokenizer(model_dir):
    """True if model_dir's tokenizer is one of this repository's fixtures' (byte for byte the
    tokenizer.json of a fixtures/ directory) and its pre-tokenizer is GPT-2's."""
    path = Path(model_dir) / "tokenizer.json"
    ours = {sha256(p) for p in (REPO / "fixtures").glob("*/tokenizer.json")}
    if not path.is_file() or sha256(path) not in ours:
        return False
    tok = json.loads(path.read_text())
    pre = tok.get("pre_tokenizer") or {}
    return (tok.get("normalizer") is None and tok["model"]["type"] == "BPE"
            and pre.get("type") == "ByteLevel" and pre.get("use_regex") is True
            and pre.get("add_prefix_space") is False)


def cmd_convert(args):
    llama_dir = args.llama_cpp.resolve()
    converter = llama_dir / "convert_hf_to_gguf.py"
    if not converter.is_file():
        sys.exit(f"convert: {converter} not found")
    sys.path.insert(0, str(llama_dir))  # the converter imports `conversion` from beside itself
    sys.path.insert(1, str(llama_dir / "gguf-py"))
    import conversion.base as base

    original = base.TextModel.get_vocab_base_pre

    def get_vocab_base_pre(self, tokenizer):
        quiet = logging.getLogger(base.logger.name)
        quiet.disabled = True  # the converter's banner for an unknown hash; we decide below
        try:
            return original(self, tokenizer)
        except NotImplementedError:
            if not declares_gpt2_pre_tokenizer(self.dir_model):
                raise
            print(f"convert: pre-tokenizer not in the converter's table; declared "
                  f"{DECLARED_PRE_TOKENIZER!r} (GPT-2 byte-level regex, no normalizer: a "
                  f"fixtures/*/tokenizer.json)")
            return DECLARED_PRE_TOKENIZER
        finally:
            quiet.disabled = False

    base.TextModel.get_vocab_base_pre = get_vocab_base_pre
    args.outfile.parent.mkdir(parents=True, exist_ok=True)
    partial = args.outfile.with_name(args.outfile.name + ".partial")
    sys.argv = [str(converter), str(args.model), "--outtype", args.outtype, "--outfile", str(partial)]
    if args.vocab_only:
        sys.argv.append("--vocab-only")
    runpy.run_path(str(converter), run_name="__main__")
    partial.replace(args.outfile)
    print(f"convert: wrote {args.outfile} ({args.outfile.stat().st_size / 1e6:.1f} MB)")


# ---------------------------------------------------------------------------------------------
# parity


def run_json(cmd, env=None):
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if proc.returncode != 0:
        sys.exit(f"parity: `{' '.join(map(str, cmd))}` exited with {proc.returncode}:\n{proc.stderr[-3000:]}")
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if not lines:
        sys.exit(f"parity: no JSON line in the output of `{' '.join(map(str, cmd))}`:\n{proc.stdout[-2000:]}")
    return json.loads(lines[-1])


def cmd_parity(args):
    import numpy as np
    from transformers import AutoTokenizer

    os.environ["LLAMA_CPP_LIB_PATH"] = str(args.lib_dir.resolve())
    sys.path.insert(0, str(args.llama_cpp_python.resolve()))
    import llama_cpp

    env = dict(os.environ, RAYON_NUM_THREADS=str(args.threads))
    hf_tok = AutoTokenizer.from_pretrained(args.model)
    llm = llama_cpp.Llama(model_path=str(args.gguf), n_ctx=256, n_batch=256, n_ubatch=256,
                          n_threads=args.threads, n_threads_batch=args.threads, logits_all=True,
                          type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32,
                          flash_attn=False, verbose=False)
    failed = False

    # 1. Tokenization (the pre-tokenizer declaration, and BOS: both add it per the tokenizer config).
    for text in TOKENIZER_TEXTS + (args.prompt,):
        ours = hf_tok.encode(text)
        theirs = llm.tokenize(text.encode("utf-8"), add_bos=True, special=False)
        if ours != theirs:
            failed = True
            print(f"parity: FAIL tokenization of {text!r}:\n  transformers {ours}\n  llama.cpp    {theirs}")
    prompt = llm.tokenize(args.prompt.encode("utf-8"), add_bos=True, special=False)
    print(f"parity: tokenization: {len(TOKENIZER_TEXTS) + 1} texts, transformers == llama.cpp: "
          f"{'no' if failed else 'yes'}; prompt {args.prompt!r} = {len(prompt)} tokens, bos {prompt[0]}")

    # 2. llama.cpp greedy: argmax of its own logits, token by token (F32 weights and KV cache).
    eos = llm.token_eos()
    llm.reset()
    llm.eval(prompt)
    generated = []
    while True:
        token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        generated.append(token)
        if token == eos or len(generated) == args.new_tokens:
            break
        llm.eval([token])
    llama_logits = np.array(llm.scores[: llm.n_tokens], dtype=np.float32)
    scored = prompt + generated[:-1]
    assert llama_logits.shape[0] == len(scored)

    # 3. deepinfer: greedy from the same ids (bos included), then every position's logits.
    # `generate` decodes its output to text whenever the checkpoint has a tokenizer.json, and
    # refuses ids beyond the tokenizer's 4,096 (the [PAD] ids, which random weights do pick), so
    # it runs on a view of the checkpoint without the tokenizer, given the ids llama.cpp and
    # transformers agreed on above.
    common = ["--dtype", "f32", "--backend", "cpu"]
    with tempfile.TemporaryDirectory(prefix="deepinfer-parity-") as view:
        for name in os.listdir(args.model):
            if name.endswith((".safetensors", ".json")) and not name.startswith("tokenizer"):
                os.symlink(Path(args.model).resolve() / name, Path(view) / name)
        ours = run_json([str(args.deepinfer), "generate", "--model", view, *common,
                         "--token-ids", ",".join(map(str, prompt)),
                         "--max-tokens", str(args.new_tokens), "--json"], env)["token_ids"]
    print(f"parity: llama.cpp greedy {generated}")
    print(f"parity: deepinfer greedy {ours}")
    if ours != generated:
        failed = True
        first = next((i for i, (a, b) in enumerate(zip(ours, generated)) if a != b), min(len(ours), len(generated)))
        print(f"parity: FAIL greedy continuations differ from generated token {first} on")
    else:
        print(f"parity: greedy: {len(generated)} generated tokens identical")
    logits = np.array(run_json([str(args.deepinfer), "score", "--model", str(args.model), *common, "--token-ids",
                                ",".join(map(str, scored))], env)["logits"], dtype=np.float32)
    if logits.shape != llama_logits.shape:
        sys.exit(f"parity: deepinfer score gave logits {logits.shape}, llama.cpp {llama_logits.shape}")
    diff = np.abs(logits - llama_logits)
    scale = np.abs(llama_logits).max(axis=1)
    top1 = (logits.argmax(axis=1) == llama_logits.argmax(axis=1)).mean()
    ranked = np.sort(llama_logits, axis=1)
    gap = (ranked[:, -1] - ranked[:, -2]).min()
    print(f"parity: logits at {logits.shape[0]} positions x {logits.shape[1]}: max |diff| "
          f"{diff.max():.3g} (largest |logit| {scale.max():.3g}; max |diff| / row's max |logit| "
          f"{(diff.max(axis=1) / scale).max():.3g}), mean |diff| {diff.mean():.3g}, "
          f"argmax agreement {top1:.0%}, smallest top-2 gap {gap:.3g}")
    if (diff.max(axis=1) / scale).max() > args.logit_tol:
        failed = True
        print(f"parity: FAIL logits differ by more than {args.logit_tol} of the row's largest |logit|")
    if args.summary:
        args.summary.write_text(json.dumps({
            "prompt": args.prompt, "prompt_tokens": len(prompt), "generated": generated,
            "deepinfer_generated": ours, "positions": int(logits.shape[0]), "vocab": int(logits.shape[1]),
            "max_abs_diff": float(diff.max()), "max_rel_diff": float((diff.max(axis=1) / scale).max()),
            "mean_abs_diff": float(diff.mean()), "argmax_agreement": float(top1), "min_top2_gap": float(gap),
            "ok": not failed}) + "\n")
    if failed:
        sys.exit("parity: FAILED (see above): the benchmark would compare different computations")
    print("parity: ok")


# ---------------------------------------------------------------------------------------------
# parse and report


def parse_llama_bench(text, metric="decode"):
    """`llama-bench -o json`: a list of tests; the one generation test's mean tokens/s, or with
    metric "prefill" the one prompt-processing test's (`-p N -n 0`)."""
    tests = json.loads(text[text.index("["):])
    if metric == "prefill":
        tg = [t for t in tests if t.get("n_prompt", 0) > 0 and t.get("n_gen", 0) == 0]
    else:
        tg = [t for t in tests if t.get("n_gen", 0) > 0 and t.get("n_prompt", 0) == 0]
    if len(tg) != 1:
        raise ValueError(f"expected one {'prompt' if metric == 'prefill' else 'generation'} test, found {len(tg)}")
    return float(tg[0]["avg_ts"]), {"stddev_ts": tg[0].get("stddev_ts"), "n_depth": tg[0].get("n_depth"),
                                    "type_k": tg[0].get("type_k"), "build_commit": tg[0].get("build_commit")}


def parse_batched_bench(text, metric="decode"):
    """`llama-batched-bench --output-format jsonl`: one line per (pp, tg, pl); its decode tokens/s."""
    rows = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
    if len(rows) != 1:
        raise ValueError(f"expected one JSON line, found {len(rows)}")
    row = rows[0]
    return float(row["speed_tg"]), {"pp": row.get("pp"), "tg": row.get("tg"), "pl": row.get("pl"),
                                    "t_tg": row.get("t_tg")}


def parse_deepinfer(text, metric="decode"):
    lines = [line for line in text.splitlines() if line.startswith("{")]
    row = json.loads(lines[-1])
    key = "prefill_tokens_per_s" if metric == "prefill" else "tokens_per_s"
    return float(row[key]), {"ms_per_step": row.get("ms_per_step")}


def parse_time_v(path):
    """/usr/bin/time -v's report: (peak RSS in GB, wall seconds)."""
    rss = wall = None
    for line in Path(path).read_text().splitlines():
        line = line.strip()
        if line.startswith("Maximum resident set size (kbytes):"):
            rss = int(line.rsplit(":", 1)[1]) / 1e6
        elif line.startswith("Elapsed (wall clock) time"):
            parts = [float(x) for x in line.rsplit(" ", 1)[1].split(":")]
            wall = sum(x * 60 ** i for i, x in enumerate(reversed(parts)))
    if rss is None or wall is None:
        raise ValueError(f"no peak RSS or wall time in {path}")
    return rss, wall


PARSERS = {"llama-bench": parse_llama_bench, "llama-batched-bench": parse_batched_bench,
           "deepinfer": parse_deepinfer}


def cmd_parse(args):
    text = args.output.read_text()
    extra = {}
    try:
        if args.time_file:
            extra["peak_rss_gb"], extra["wall_s"] = parse_time_v(args.time_file)
        if args.metric == "load":
            tok_s = None  # the figure is the process's wall time
        else:
            tok_s, more = PARSERS[args.tool](text, args.metric)
            extra.update(more)
    except (ValueError, KeyError, IndexError, TypeError) as err:
        sys.exit(f"parse: cannot read {args.tool}'s output in {args.output} ({err}):\n{text[-2000:]}")
    row = {"round": args.round, "precision": args.precision, "batch": args.batch,
           "engine": "deepinfer" if args.tool == "deepinfer" else "llama.cpp", "tool": args.tool,
           "tok_s": tok_s, "others_cores": args.others, "seconds": args.seconds,
           "attempts": args.attempts, **extra}
    if args.case:
        row.update(case=args.case, metric=args.metric, command=args.command)
    with args.results.open("a") as f:
        f.write(json.dumps(row) + "\n")
    what = f"batch {args.batch}" if not args.case else args.case
    figure = f"{tok_s:8.2f} tok/s" if tok_s is not None else f"{extra['wall_s']:8.2f} s"
    rss = f", peak RSS {extra['peak_rss_gb']:.2f} GB" if "peak_rss_gb" in extra else ""
    print(f"  {row['engine']:>9} {args.precision:>6} {what}: {figure} "
          f"({args.seconds:.1f} s{rss}; others used {args.others:.2f} cores meanwhile"
          f"{f'; attempt {args.attempts}' if args.attempts > 1 else ''})")


CASE_TITLES = {"b1": "decode, batch 1", "b8": "decode, batch 8", "pp512": "prefill of 512 tokens",
               "d4096": "decode at 4,096 tokens of context", "d16384": "decode at 16,384 tokens of context",
               "load": "load and one token (wall seconds; the ratio is llama.cpp's time / ours, above 1 "
                        "when ours is faster)"}


def report_by_case(args, rows):
    """--suite v2lite: one table per cell (precision x round), with both engines' figures, the
    ratio, each one's peak RSS, and the commands."""
    runs = [r for r in rows if "case" in r]
    loads = {r["round"]: r for r in rows if r.get("kind") == "load"}
    cases = [c for c in CASE_TITLES if any(r["case"] == c for r in runs)]
    for case in cases:
        print(f"### {CASE_TITLES[case]}\n")
        print("| precision | round | llama.cpp | deepinfer | ours / llama.cpp | peak RSS llama.cpp / deepinfer (GB) "
              "| others' CPU (cores) |")
        print("|---|---|---|---|---|---|---|")
        commands = {}
        for precision in args.precisions:
            for rnd in sorted({r["round"] for r in runs}):
                pair = {r["engine"]: r for r in runs
                        if r["case"] == case and r["precision"] == precision and r["round"] == rnd}
                if not pair:
                    continue
                theirs, ours = pair.get("llama.cpp", {}), pair.get("deepinfer", {})
                for r in (theirs, ours):
                    if r:
                        commands.setdefault((precision, r["engine"]), r.get("command"))
                if case == "load":
                    fig = lambda r: f"{r['wall_s']:.1f} s" if r else "-"  # noqa: E731
                    ratio = f"{theirs['wall_s'] / ours['wall_s']:.2f}x" if theirs and ours else "-"
                else:
                    fig = lambda r: f"{r['tok_s']:.2f} tok/s" if r else "-"  # noqa: E731
                    ratio = f"{ours['tok_s'] / theirs['tok_s']:.2f}x" if theirs and ours else "-"
                rss = " / ".join(f"{r['peak_rss_gb']:.2f}" if r else "-" for r in (theirs, ours))
                others = " / ".join(f"{r['others_cores']:.2f}" if r else "-" for r in (theirs, ours))
                print(f"| {args.labels.get(precision, precision)} | {rnd} | {fig(theirs)} | {fig(ours)} | {ratio} "
                      f"| {rss} | {others} |")
        print()
        for (precision, engine), cmd in commands.items():
            print(f"- {args.labels.get(precision, precision)}, {engine}: `{cmd}`")
        print()
    for rnd in sorted(loads):
        print(f"- round {rnd}: load average at start {loads[rnd]['start']}, at end {loads[rnd]['end']}")


def cmd_report(args):
    rows = [json.loads(line) for line in args.results.read_text().splitlines() if line.strip()]
    if args.by_case:
        report_by_case(args, rows)
        return
    loads = {r["round"]: r for r in rows if r.get("kind") == "load"}
    runs = {(r["round"], r["precision"], r["batch"], r["engine"]): r for r in rows if "engine" in r}
    print("| round | precision (llama.cpp / deepinfer) | batch | llama.cpp tok/s | deepinfer tok/s "
          "| ours / llama.cpp | others' CPU (cores) during llama.cpp / deepinfer |")
    print("|---|---|---|---|---|---|---|")
    keys = sorted({k[:3] for k in runs}, key=lambda k: (k[0], args.precisions.index(k[1]), k[2]))
    for rnd, precision, batch in keys:
        theirs = runs.get((rnd, precision, batch, "llama.cpp"), {})
        ours = runs.get((rnd, precision, batch, "deepinfer"), {})
        ratio = f"{ours['tok_s'] / theirs['tok_s']:.2f}x" if theirs and ours else "-"

        def fmt(row, key):
            return f"{row[key]:.2f}" if row.get(key) is not None else "-"

        print(f"| {rnd} | {args.labels.get(precision, precision)} | {batch} | {fmt(theirs, 'tok_s')} "
              f"| {fmt(ours, 'tok_s')} | {ratio} | {fmt(theirs, 'others_cores')} / {fmt(ours, 'others_cores')} |")
    print()
    for rnd in sorted(loads):
        print(f"- round {rnd}: load average at start {loads[rnd]['start']}, at end {loads[rnd]['end']}")


# ---------------------------------------------------------------------------------------------


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("checkpoint")
    p.add_argument("--config", type=Path, default=REPO / "fixtures/configs/medium-bench.json")
    p.add_argument("--out", type=Path, required=True)

    p = sub.add_parser("convert")
    p.add_argument("--llama-cpp", type=Path, required=True, help="llama.cpp source tree")
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--outtype", required=True, choices=["f32", "bf16", "q8_0"])
    p.add_argument("--outfile", type=Path, required=True)
    p.add_argument("--vocab-only", action="store_true",
                   help="metadata and vocabulary only, no tensors (scripts/v2lite_gguf.py check-metadata)")

    p = sub.add_parser("parity")
    p.add_argument("--llama-cpp-python", type=Path, required=True, help="the sdist's root (holds llama_cpp/)")
    p.add_argument("--lib-dir", type=Path, required=True, help="directory holding the built libllama.so")
    p.add_argument("--gguf", type=Path, required=True)
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--deepinfer", type=Path, required=True)
    p.add_argument("--prompt", required=True)
    p.add_argument("--new-tokens", type=int, default=24)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--logit-tol", type=float, default=1e-3,
                   help="largest allowed |logit difference| / the row's largest |logit|")
    p.add_argument("--summary", type=Path, help="write the comparison as one JSON line here")

    p = sub.add_parser("parse")
    p.add_argument("--tool", required=True, choices=sorted(PARSERS))
    p.add_argument("--output", type=Path, required=True)
    p.add_argument("--results", type=Path, required=True)
    p.add_argument("--round", type=int, required=True)
    p.add_argument("--precision", required=True)
    p.add_argument("--batch", type=int, required=True)
    p.add_argument("--others", type=float, required=True, help="cores other processes used meanwhile")
    p.add_argument("--seconds", type=float, required=True, help="wall time of the measurement")
    p.add_argument("--attempts", type=int, default=1, help="attempts this measurement took")
    p.add_argument("--case", help="the --suite v2lite cell (b1, b8, pp512, d4096, d16384, load)")
    p.add_argument("--metric", choices=["decode", "prefill", "load"], default="decode")
    p.add_argument("--time-file", type=Path, help="/usr/bin/time -v's report of the command")
    p.add_argument("--command", help="the command line, recorded")

    p = sub.add_parser("report")
    p.add_argument("--results", type=Path, required=True)
    p.add_argument("--precisions", type=lambda s: s.split(","), required=True)
    p.add_argument("--label", action="append", default=[], help="PRECISION=TEXT for the table")
    p.add_argument("--by-case", action="store_true", help="one table per cell (--suite v2lite)")

    args = parser.parse_args()
    if args.cmd == "report":
        args.labels = dict(item.split("=", 1) for item in args.label)
    {"checkpoint": cmd_checkpoint, "convert": cmd_convert, "parity": cmd_parity,
     "parse": cmd_parse, "report": cmd_report}[args.cmd](args)


if __name__ == "__main__":
    main()
