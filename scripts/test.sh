#!/usr/bin/env bash
# The whole test suite, from a fresh clone.
#
# 0. Installs the Python test dependencies into .venv (below) and writes the 4-layer
#    V2-Lite-shaped GGUF files tests/gguf_v2lite.rs loads (scripts/v2lite_gguf.py).
# 1. `cargo test --release --workspace`: everything in Rust (parity with transformers on the committed
#    fixtures, the CLI, the graph, the compile driver, ...); then `scripts/check_links.py`,
#    every relative link and anchor in README.md, benches/ and docs/; then
#    `scripts/trn1-first-contact.sh --sim`, the trn1 first-contact command on nrt-sim.
# 2. XLA conformance: every graph we emit for every fixture (prefill, and decode at batch 1, 2, 4
#    and 8; tiny-v32's sparse attention included) runs in XLA itself (jaxlib on the CPU) and must match our CPU backend, and the decode
#    logits must match transformers' reference; then bf16 and int8-expert graphs against our
#    CPU backend. jax is installed into .venv from PyPI.
#    Then tensor parallelism: every fixture lowered for 2 and 4 ranks (`lower --tp N`: one HLO
#    module per graph, one inputs file per rank) runs in XLA with 2 and 4 replicas; every rank
#    must match our CPU backend and the decode logits transformers' reference. Then the split
#    decode graphs of --split-sampler (tiny-v3, --tp 1 and 2; tiny-v4, --tp 2), and speculative
#    decoding's verify and draft graphs (tiny-v3-mtp, --tp 1 and 2).
#    Then the conformance suite's cases (tests/conformance/*.json) run as our emitted HLO in XLA and
#    must match numpy's expected values, as they do on the CPU backend, emit -> import -> CPU and
#    nrt-sim in step 1 (scripts/xla_conformance.py).
# 3. `deepinfer lower --check neuron` on the published configs of DeepSeek-V2-Lite, V2, V3,
#    V3.2 and V4-Flash at the serve defaults (24 graphs each): every graph a Neuron capture compiles must pass
#    every rule (src/backend/neuron/check). `--neuron-runtime 2.30.50` is the runtime minimum
#    `deepinfer doctor` enforces (tensors of 4 GiB or more: the V2 and V3 KV roots at 2048
#    tokens x 32 sequences, and V3's stacked bf16 expert weights, 7.5 GB per layer and matrix).
#    V2-Lite is clean whole, at --tp 2, whole with int4 experts (what fits one core) and split
#    for --split-sampler (forward and sampling graphs).
#    V2 and V3 are checked as deployed, one rank's graph
#    at --tp 32: whole, a 236B/671B model in one NeuronCore's graph is over the instruction
#    budget estimate at the larger buckets. A run is `config:flags[:tp]` (`--tp`, default 1).
# 4. The server end to end (tests/server, pytest): the official `openai` client drives a live
#    `deepinfer serve` on the default model; transformers' tokenizer and `deepinfer generate`
#    are the references. Installed into .venv from PyPI with the rest. Twice: with automatic
#    prefix caching (the default) and with --no-prefix-caching; the structured-output
#    tests once more on nrt-sim with --split-sampler and with --speculative-tokens 2; and the
#    speculative-decoding tests on nrt-sim.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ ! -x .venv/bin/python ] || ! .venv/bin/python -c "import jax, ml_dtypes, safetensors, openai, pytest, httpx, transformers, jinja2, jsonschema, gguf, deepseek_recipe" 2>/dev/null; then
    python3 -m venv .venv
    .venv/bin/pip install --quiet -r scripts/requirements-test.txt
fi
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
status=0

# Every test binary first, so that nothing below shares the disk with a half-linked build. In
# release: the one build then serves the tests and the commands below (a debug test build and a
# release build took 11 minutes on CI's 2 cores), and the heavy tests run several times faster.
cargo test --release --workspace --no-run
# The 4-layer DeepSeek-V2-Lite-shaped GGUF files tests/gguf_v2lite.rs compares with llama.cpp's
# committed greedy tokens and logits (fixtures/gguf/v2lite-4l-*.reference.json): written from
# a seed by the gguf PyPI package (about 15 s each), tested and deleted one at a time, since
# together they are 3.9 GB of disk (CI once ran out of it with both present).
for type in q8_0 q4_k_m; do
    echo "== V2-Lite-shaped GGUF file $type (scripts/v2lite_gguf.py write --layers 4)"
    file="target/v2lite-gguf/v2lite-4l-$type.gguf"
    .venv/bin/python scripts/v2lite_gguf.py write --layers 4 --type "$type" --out "$file" > /dev/null
    cargo test --release --workspace --test gguf_v2lite -- "$type"
    rm -f "$file"
done
# Everything else in Rust (the GGUF tests, all named v2lite_4_layer_*, ran above).
cargo test --release --workspace -- --skip v2lite_4_layer_
# The conformance suite's cases as our emitted HLO, for XLA in step 2 (scripts/xla_conformance.py).
DEEPINFER_CONFORMANCE_OUT="$out/conformance" cargo test --release --workspace --quiet --test conformance
# A clean clone (CI) has no further use for clippy's and rustdoc's builds (.ci/run): disk the
# steps below may need.
if [ -n "${CI:-}" ]; then
    rm -rf target/debug
fi

# Every relative link and #anchor in README.md, benches/ and docs/ resolves (stdlib Python, no venv).
echo "== document links (scripts/check_links.py)"
python3 scripts/check_links.py

cargo build --release --workspace --quiet
# The trn1 first-contact command end to end on nrt-sim (what a fresh trn1 runs without --sim).
echo "== first contact (scripts/trn1-first-contact.sh --sim)"
scripts/trn1-first-contact.sh --sim --out "$out/first-contact" || status=1
for fixture in tiny-v3 tiny-v2-lite tiny-v2-group tiny-v32; do
    ids=$(.venv/bin/python -c "import json,sys; print(','.join(map(str, json.load(open(sys.argv[1]))['token_ids'])))" "fixtures/$fixture/reference.json")
    target/release/deepinfer lower --model "fixtures/$fixture" --out "$out/$fixture" --dtype f32 \
        --batch-sizes 1,2,4,8 --ctx 64 --inputs-from-token-ids "$ids" > /dev/null
    echo "== XLA conformance: $fixture"
    .venv/bin/python scripts/xla_check.py "$out/$fixture" --reference "fixtures/$fixture/reference.json" || status=1
done
# DeepSeek-V4's step graphs in f32 (`auto` would hold tiny-v4-fp8's bf16 checkpoint in bf16,
# below), every product in f32 (`--dots widen`): the unpacked and packed prefill and each decode
# batch, unsplit and split two ways, in XLA against our CPU backend and transformers.
# tiny-v4-fp8 is the same architecture stored as DeepSeek-V4-Flash is published (FP8 weights,
# FP4 experts): its experts' E2M1 codes are dequantized by the lowered HLO itself, which only
# XLA executes (nrt-sim and our importer read the tagged run back as one op). A device's graphs
# multiply those experts in bf16 (the default `--dots split`, which keeps about 16 of the
# activations' 24 bits: up to 1.04e-4 from transformers here, measured on an AMD EPYC host);
# the bf16 runs below check them.
for fixture in tiny-v4 tiny-v4-fp8; do
    ids=$(.venv/bin/python -c "import json,sys; print(','.join(map(str, json.load(open(sys.argv[1]))['token_ids'])))" "fixtures/$fixture/reference.json")
    for tp in 1 2; do
        target/release/deepinfer lower --model "fixtures/$fixture" --out "$out/$fixture-tp$tp" --tp "$tp" \
            --dtype f32 --dots widen --batch-sizes 1,2,4,8 --ctx 64 --inputs-from-token-ids "$ids" > /dev/null
        echo "== XLA conformance: $fixture --tp $tp"
        .venv/bin/python scripts/xla_check.py "$out/$fixture-tp$tp" --reference "fixtures/$fixture/reference.json" || status=1
    done
done
# DeepSeek-V4 with its matrices in bf16 (--dtype bf16, the device's split dots), in XLA against
# our CPU backend: tiny-v4 at --tp 1 with bf16 cache roots too, and tiny-v4-fp8 at --tp 2 also
# against transformers, since bf16 holds its FP8 (power-of-two block scales) and bf16 tensors
# exactly. The tolerance is 1e-3 (and a bf16 root's one ulp): where XLA's f32 activations and
# ours differ in their last bits, the split's bf16 high part, or a cache row, can round the
# other way (measured up to 2.2e-4 on the prefill logits; tests/v4.rs holds the runners to
# transformers' own bf16 drift).
for run in "tiny-v4:1:bf16" "tiny-v4-fp8:2:f32"; do
    IFS=: read -r fixture tp kv <<< "$run"
    ids=$(.venv/bin/python -c "import json,sys; print(','.join(map(str, json.load(open(sys.argv[1]))['token_ids'])))" "fixtures/$fixture/reference.json")
    target/release/deepinfer lower --model "fixtures/$fixture" --out "$out/$fixture-bf16-tp$tp" --tp "$tp" \
        --dtype bf16 --kv-dtype "$kv" --batch-sizes 1,2,4,8 --ctx 64 --inputs-from-token-ids "$ids" > /dev/null
    reference=()
    [ "$fixture" = tiny-v4-fp8 ] && reference=(--reference "fixtures/$fixture/reference.json")
    echo "== XLA conformance: $fixture --dtype bf16 --kv-dtype $kv --tp $tp"
    .venv/bin/python scripts/xla_check.py "$out/$fixture-bf16-tp$tp" --tol 1e-3 "${reference[@]}" || status=1
done
# Reduced precision, in XLA against our CPU backend and against transformers: bf16 weights and
# cache (bf16 literals, converts into f32 dots), whose decode logits may drift from
# transformers' f32 ones no more than transformers' own bf16 run does; and int8 and int4
# experts dequantized in the graph (int4: bytes unpacked with a mask and a shift), against
# transformers on the dequantized weights (f32 compute).
# bf16 weights are run twice: under the device's matmul policy (`lower`'s default, --dots split:
# bf16 dots of a two-part activation) with an f32 cache, and under the CPU's (--dots widen) with
# a bf16 cache. Split with a bf16 cache is not compared here: its XLA-vs-CPU difference is one
# ulp of a bf16 cache row that rounds the other way (measured 1.9e-3 on the prefill logits,
# 2.5e-5 with an f32 cache), which this tolerance is not for; nrt-sim and the CPU check that
# configuration against transformers (tests/runner_sim.rs, tests/precision.rs).
for run in "tiny-v2-lite:bf16:reference.json:1e-3:--dtype bf16 --kv-dtype f32" \
    "tiny-v2-lite:bf16-widen:reference.json:1e-3:--dtype bf16 --dots widen" \
    "tiny-v3:int8:reference-int8-experts.json:1e-4:--dtype f32 --quantize experts-int8" \
    "tiny-v2-lite:int4:reference-int4-experts.json:1e-4:--dtype f32 --quantize experts-int4"; do
    IFS=: read -r fixture tag ref tol flags <<< "$run"
    ids=$(.venv/bin/python -c "import json,sys; print(','.join(map(str, json.load(open(sys.argv[1]))['token_ids'])))" "fixtures/$fixture/$ref")
    # shellcheck disable=SC2086  # $flags is a list of flags
    target/release/deepinfer lower --model "fixtures/$fixture" --out "$out/$fixture-$tag" $flags \
        --batch-sizes 1,8 --ctx 64 --inputs-from-token-ids "$ids" > /dev/null
    peer=()
    case "$tag" in bf16*) peer=(--peer "fixtures/$fixture/reference-bf16.json") ;; esac
    echo "== XLA conformance: $fixture ($flags)"
    # bf16's --tol 1e-3 (XLA against our CPU): a prefill graph writes its cache rows in bf16 and
    # reads them back; where XLA's and our f32 results differ in their last bits, a row can round
    # to the neighbouring bf16 value (one ulp, ~0.4%), which moves that prefill's logits by ~2e-4
    # (measured). Decode graphs, whose cache comes in as an input, agree within 2e-6.
    .venv/bin/python scripts/xla_check.py "$out/$fixture-$tag" --tol "$tol" \
        --reference "fixtures/$fixture/$ref" "${peer[@]}" || status=1
done
# The device's graphs with bf16 weights and int8 or int4 experts (codes converted to bf16 for
# the dot and scaled after it; int4 dequantized straight to bf16), in XLA against our CPU
# backend: no transformers reference holds these weights in bf16.
for q in experts-int8 experts-int4; do
    fixture=tiny-v2-lite
    ids=$(.venv/bin/python -c "import json,sys; print(','.join(map(str, json.load(open(sys.argv[1]))['token_ids'])))" "fixtures/$fixture/reference.json")
    target/release/deepinfer lower --model "fixtures/$fixture" --out "$out/$fixture-bf16-$q" --dtype bf16 \
        --kv-dtype f32 --quantize "$q" --batch-sizes 1,8 --ctx 64 --inputs-from-token-ids "$ids" > /dev/null
    echo "== XLA conformance: $fixture (--dtype bf16 --quantize $q, the device's dots)"
    .venv/bin/python scripts/xla_check.py "$out/$fixture-bf16-$q" --tol 1e-3 || status=1
done
# Tensor parallelism: the prefill and batch-1 and batch-4 decode graphs of every fixture at --tp 2
# and 4 (between them both MoE strategies: at tp 2 decode gathers the selected experts, everything
# else runs its experts densely), run by XLA with that many replicas; batch 4's rows 1-3 draw
# sampled tokens from each rank's vocabulary slice. About 20 s per fixture and degree, nearly all
# of it XLA compiling the modules.
for tp in 2 4; do
    for fixture in tiny-v3 tiny-v2-lite tiny-v2-group tiny-v32; do
        ids=$(.venv/bin/python -c "import json,sys; print(','.join(map(str, json.load(open(sys.argv[1]))['token_ids'])))" "fixtures/$fixture/reference.json")
        target/release/deepinfer lower --model "fixtures/$fixture" --out "$out/$fixture-tp$tp" --dtype f32 \
            --tp "$tp" --batch-sizes 1,4 --ctx 64 --inputs-from-token-ids "$ids" > /dev/null
        echo "== XLA conformance: $fixture (--tp $tp, $tp replicas)"
        .venv/bin/python scripts/xla_check.py "$out/$fixture-tp$tp" --reference "fixtures/$fixture/reference.json" || status=1
    done
done
# Split sampling (--split-sampler): each decode batch as its forward graph (to the logits) and
# its sampling graph (reading them), tiny-v3 at --tp 1 and 2 and tiny-v4 at --tp 2; the sampled
# rows draw through the masks, biases and penalties as in the fused graph.
for run in tiny-v3:1 tiny-v3:2 tiny-v4:2; do
    IFS=: read -r fixture tp <<< "$run"
    ids=$(.venv/bin/python -c "import json,sys; print(','.join(map(str, json.load(open(sys.argv[1]))['token_ids'])))" "fixtures/$fixture/reference.json")
    target/release/deepinfer lower --model "fixtures/$fixture" --out "$out/$fixture-split-tp$tp" --dtype f32 \
        --tp "$tp" --batch-sizes 1,4 --ctx 64 --inputs-from-token-ids "$ids" --split-sampler > /dev/null
    echo "== XLA conformance: $fixture (--split-sampler --tp $tp)"
    .venv/bin/python scripts/xla_check.py "$out/$fixture-split-tp$tp" --reference "fixtures/$fixture/reference.json" || status=1
done
# Speculative decoding's graphs (--speculative-tokens): tiny-v3 with an MTP layer, at --tp 1
# and 2, its prefill and decode graphs (which then return their hidden states), each decode
# batch's verify graph (the rejection sampler over chunks of a last token and two drafts, one
# row a position) and draft graph, and the chunk's draft graph. The main model's logits
# against tiny-v3's reference (the MTP layer does not change them).
ids=$(.venv/bin/python -c "import json,sys; print(','.join(map(str, json.load(open(sys.argv[1]))['token_ids'])))" fixtures/tiny-v3/reference.json)
for tp in 1 2; do
    target/release/deepinfer lower --model fixtures/tiny-v3-mtp --out "$out/tiny-v3-mtp-tp$tp" --dtype f32 \
        --tp "$tp" --batch-sizes 1,4 --ctx 64 --inputs-from-token-ids "$ids" --speculative-tokens 2 > /dev/null
    echo "== XLA conformance: tiny-v3-mtp (--speculative-tokens 2 --tp $tp)"
    .venv/bin/python scripts/xla_check.py "$out/tiny-v3-mtp-tp$tp" --reference fixtures/tiny-v3/reference.json || status=1
done
# A vocabulary --tp does not divide is padded (src/model/shard.rs): tiny-v3 cut to 501 tokens
# (scripts/cut_vocab.py; its logits are the reference's first 501) at --tp 4, split sampling,
# so that the forward graphs return padded slices and the sampling graphs read them; the
# padding must be -inf on every rank and in the CPU backend's, and the real columns match.
.venv/bin/python scripts/cut_vocab.py fixtures/tiny-v3 501 "$out/tiny-v3-vocab501"
ids=$(.venv/bin/python -c "import json,sys; print(','.join(map(str, json.load(open(sys.argv[1]))['token_ids'])))" fixtures/tiny-v3/reference.json)
target/release/deepinfer lower --model "$out/tiny-v3-vocab501" --out "$out/tiny-v3-vocab501-tp4" --dtype f32 \
    --tp 4 --batch-sizes 1,4 --ctx 64 --inputs-from-token-ids "$ids" --split-sampler > /dev/null
echo "== XLA conformance: tiny-v3 cut to 501 tokens (--tp 4 --split-sampler, padded vocabulary)"
.venv/bin/python scripts/xla_check.py "$out/tiny-v3-vocab501-tp4" --reference fixtures/tiny-v3/reference.json || status=1
echo "== XLA conformance: tests/conformance"
.venv/bin/python scripts/make_conformance.py --check > /dev/null || status=1
.venv/bin/python scripts/xla_conformance.py tests/conformance "$out/conformance" || status=1
# V2, V3 and V4-Flash (as published: FP4 experts, dequantized to bf16 on the device; its other
# matrices and caches in bf16, `auto` for its bf16 checkpoint) as deployed: split over a trn1.32xlarge's 32 NeuronCores, each rank's graph is what neuronx-cc
# compiles (whole, they are over its instruction budget); V2-Lite whole and at --tp 2.
# V4-Flash again at 131,072 positions: CSA's selection over 32,768 compressed entries, which a
# sort would exceed neuronx-cc's 16,384 with (it masks by threshold instead); and as it fits one
# trn1.32xlarge (`deepinfer plan`): 16 sequences, with the split decode graphs of
# --split-sampler. V3 again with speculative decoding's graphs (its MTP layer's draft graphs
# per prefill and decode bucket, and each decode bucket's verify graph).
for run in deepseek-v2-lite:: deepseek-v2-lite::2 "deepseek-v2-lite:--quantize experts-int4:" \
    "deepseek-v2-lite:--split-sampler:" \
    deepseek-v2::32 deepseek-v3::32 deepseek-v3.2::32 deepseek-v4-flash::32 \
    "deepseek-v4-flash:--max-len 131072 --max-batch 1:32" \
    "deepseek-v4-flash:--max-batch 16 --split-sampler:32" \
    "deepseek-v3:--max-batch 8 --speculative-tokens 2:32"; do
    IFS=: read -r config allow tp <<< "$run"
    tp=${tp:-1}
    echo "== lower --check neuron: fixtures/configs/$config.json --tp $tp $allow"
    # shellcheck disable=SC2086  # $allow is a list of flags
    target/release/deepinfer lower --check neuron --model "fixtures/configs/$config.json" \
        --neuron-runtime 2.30.50 --tp "$tp" $allow || status=1
done
echo "== server end to end (tests/server)"
.venv/bin/python -m pytest tests/server -q || status=1
# Again with the prefix cache off: every output must be the same with and without it (each
# test checks its outputs against references that never cache). The connection-limit,
# backpressure and shutdown tests check no output and take a minute: not repeated.
# Structured outputs through nrt-sim with split sampling: the masks computed while each step's
# forward pass runs; every document must still validate (jsonschema). About 15 s.
echo "== server end to end, --backend sim --split-sampler (structured outputs)"
DEEPINFER_TEST_SERVE_ARGS="--backend sim --split-sampler" .venv/bin/python -m pytest -q \
    tests/server/test_structured_outputs.py || status=1
# Structured outputs with speculative decoding: each verify position masked by the grammar's
# state after the drafts before it; every document must still validate. A few seconds.
echo "== server end to end, --speculative-tokens 2 (structured outputs)"
DEEPINFER_TEST_SERVE_ARGS="--speculative-tokens 2" .venv/bin/python -m pytest -q \
    tests/server/test_structured_outputs.py || status=1
# Speculative decoding on nrt-sim: verify steps on the decode buckets' graphs, drafts on the
# draft graphs; greedy answers are the CLI's without drafting, sampled ones verify drafts.
echo "== server end to end, --backend sim (speculative decoding)"
DEEPINFER_TEST_SERVE_ARGS="--backend sim" .venv/bin/python -m pytest -q \
    tests/server/test_speculative.py || status=1
echo "== server end to end, --no-prefix-caching (tests/server)"
DEEPINFER_TEST_SERVE_ARGS=--no-prefix-caching .venv/bin/python -m pytest tests/server -q \
    --ignore=tests/server/test_backpressure.py --ignore=tests/server/test_connections.py \
    --ignore=tests/server/test_shutdown.py || status=1
exit $status
