#!/usr/bin/env bash
# CPU decode of deepinfer against llama.cpp, side by side, on one checkpoint (issue 18).
#
#   scripts/bench_vs_llamacpp.sh [--work DIR] [--deepinfer PATH] [--rounds N] [--skip-build]
#                                [--precisions f32,bf16,q8] [--batches 1,8] [--idle-wait SECS]
#
# On a fresh Debian machine with Rust and Python 3 (PyPI and Debian reachable), from the
# repository root after `cargo build --release`:
#
# 1. installs cmake (and build-essential) from Debian when cmake is missing, and a venv
#    (WORK/venv) with torch, transformers, safetensors, numpy, sentencepiece and protobuf;
# 2. takes llama.cpp from the PyPI sdist of llama-cpp-python (LLAMA_CPP_PYTHON below), which
#    vendors it under vendor/llama.cpp with its convert_hf_to_gguf.py and gguf-py, and builds
#    libllama, llama-bench and llama-batched-bench with cmake (Release, GGML_NATIVE, no network
#    code), once: a rerun with the same sources and flags reuses WORK/build;
# 3. writes the checkpoint: fixtures/configs/medium-bench.json (338M parameters) with
#    scripts/make_fixtures.py's seeded random float32 weights, the checkpoint
#    scripts/bench_vs_transformers.py benchmarks, and the tokenizer of fixtures/default-model
#    (scripts/llamacpp_bench.py says why the vocabulary stays 32,000 and how the
#    pre-tokenizer is declared to the converter);
# 4. converts it with llama.cpp's own convert_hf_to_gguf.py to F32, BF16 and Q8_0 GGUF;
# 5. checks parity in F32 before timing anything: llama.cpp's tokenization of a few texts
#    equals transformers', its greedy continuation of PARITY_PROMPT equals `deepinfer
#    generate`'s token for token, and every position's logits agree with `deepinfer score`
#    (llama.cpp run through the sdist's own Python ctypes bindings over the libllama built
#    here; F32 weights and KV cache). Any difference stops the script;
# 6. times decode at each batch size, 2 threads each, alternating engines within a round
#    (per precision: llama.cpp b1, deepinfer b1, llama.cpp b8, deepinfer b8), PROMPT_LEN
#    tokens of context per sequence before STEPS timed steps:
#      llama.cpp batch 1:  llama-bench -p 0 -n STEPS -d PROMPT_LEN -t 2 -o json (mean of its 5
#                          repetitions after a warm-up);
#      llama.cpp batch B:  llama-batched-bench -npp PROMPT_LEN -ntg STEPS -npl B -t 2 (S_TG:
#                          B*STEPS / time of the STEPS batched decode steps, B distinct prompts);
#      deepinfer:          deepinfer bench --batch B --prompt-len PROMPT_LEN --steps STEPS
#                          --tokens T with RAYON_NUM_THREADS=2, T the kind of token stream the
#                          llama.cpp tool of that batch size feeds, read from its source before
#                          timing (TOKEN STREAMS below): which routed experts a MoE step reads
#                          depends on its tokens, so both engines get the same kind;
#    and prints a markdown table (round x precision x batch: tok/s of both, ours / llama.cpp)
#    with /proc/loadavg at the start and end of each round. Results: WORK/results-*.{jsonl,md}.
#
# On a shared machine. Before each measurement the script waits (up to --idle-wait seconds)
# until other processes use less than a fifth of a core, and during it counts the CPU time the
# rest of the machine used (/proc/stat's busy time less our child's), printed in the table as
# "others" in cores; a measurement during which others used more than 0.25 cores is taken
# again (3 attempts in all, the last one kept). llama.cpp's threads wait for each other by
# spinning, and a core taken by another process slows it far more than deepinfer's (we saw
# 91 tok/s become 13 at batch 1 in F32, others using 1.0 core), so a row whose "others" is not
# near 0 compares contention, not engines.
#
# `--suite v2lite` (issue 45) benchmarks the DeepSeek-V2-Lite-shaped random-weight GGUF files of
# scripts/make_v2lite_gguf.sh instead (27 layers, 64 experts of 1408; Q4_K_M 10 GB and Q8_0
# 16.7 GB, made first when V2LITE_DIR lacks them: minutes for the Q8_0, tens for llama-quantize).
# Both engines load the same GGUF file. Steps 3-5 are skipped (no HF checkpoint: the 4-layer
# variant's parity with llama.cpp is tests/gguf_v2lite.rs, in CI). Per precision (q4_k_m, q8_0)
# and round, each cell alternates llama.cpp then deepinfer, both at 2 threads with a bf16 KV
# cache (llama.cpp -ctk bf16 -ctv bf16; deepinfer --kv-dtype bf16, its weights as the file stores
# them with --dtype bf16 for the rest), and llama.cpp's weight repacking off (--repack 0 /
# --no-repack, forced: with it this build aborts on this AMX CPU, see LLAMA_BENCH_EXTRA):
#   b1       decode, batch 1, PROMPT_LEN of context, STEPS steps:
#            llama-bench -p 0 -n STEPS -d PROMPT_LEN  |  deepinfer bench --batch 1 --tokens random
#   b8       decode, batch 8: llama-batched-bench -npp PROMPT_LEN -ntg STEPS -npl 8 (token 0)
#            |  deepinfer bench --batch 8 --tokens zeros
#   pp512    prefill of 512 tokens: llama-bench -p 512 -n 0 (mean of 5 repetitions after a
#            warm-up)  |  deepinfer bench --prompt-len 512 --steps 1, its prefill_tokens_per_s
#            (one prefill, in chunks of 64 as serve prefills, graphs built on first use included)
#   d4096, d16384  decode at batch 1 after that many tokens of context: llama-bench -p 0
#            -n LONG_STEPS -d N -r LONG_REPS  |  deepinfer bench --prompt-len N --steps LONG_STEPS
#   load     the wall time of a process that loads the file and decodes one token:
#            llama-bench -p 0 -n 1 -r 1 --no-warmup  |  deepinfer bench --prompt-len 1 --steps 1
#            (page cache warm: the file was just read by the previous cell)
# and every command runs under /usr/bin/time -v: the table gives each one's peak RSS (llama.cpp
# maps the file, so its RSS counts the mapped weights it touched).
#
# Not run in CI (tens of minutes, a 2 GB download). Options:
#   --work DIR         where everything downloaded, built and written goes
#                      (default target/llamacpp-bench, git-ignored)
#   --deepinfer PATH   the binary to benchmark (default target/release/deepinfer)
#   --rounds N         benchmark rounds (default 2)
#   --skip-build       use WORK/build as it is (fail if it is not there); never run cmake
#   --precisions LIST  among f32, bf16, q8 (default all three)
#   --batches LIST     batch sizes (default 1,8)
#   --idle-wait SECS   wait at most this long for an idle machine before each measurement
#                      (default 180; 0: do not wait)
#   --suite NAME       medium (default: the medium-bench checkpoint above) or v2lite
#   --v2lite-dir DIR   where scripts/make_v2lite_gguf.sh writes the V2-Lite files
#                      (default target/v2lite-gguf)
#   --cells LIST       v2lite cells (default b1,b8,pp512,d4096,d16384,load)
set -euo pipefail

# Per precision: GGUF --outtype | llama.cpp KV cache type (-ctk/-ctv) | deepinfer flags.
# The KV cache follows deepinfer's (`--kv-dtype auto`: the weights' dtype), except in F32:
# llama-bench accepts no f32 cache type, so llama.cpp keeps its default f16 there (at 16 + 64
# positions the cache is 0.5 MB per sequence in f32, against 1.35 GB of weights a step reads;
# parity, which needs the f32 cache, runs through the bindings, not llama-bench). "q8" compares
# llama.cpp's Q8_0 (every matrix, the embedding included, in 8-bit blocks of 32) with our
# `--quantize q8_0` (GGML's Q8_0 for every linear layer but kv_b_proj; the embedding, kv_b_proj
# and the cache in bf16).
declare -A GGUF_TYPE=([f32]=f32 [bf16]=bf16 [q8]=q8_0)
declare -A LLAMA_KV=([f32]=f16 [bf16]=bf16 [q8]=bf16)
# Q8_0 runs without the CPU backend's repacked weight layout (llama-bench --repack 0,
# llama-batched-bench --no-repack): with it, this build aborts at graph scheduling on this
# model (ggml-backend.cpp:1294, GGML_ASSERT(*cur_backend_id != -1)), at any KV cache type.
declare -A LLAMA_BENCH_EXTRA=([f32]="" [bf16]="" [q8]="--repack 0")
declare -A LLAMA_BATCHED_EXTRA=([f32]="" [bf16]="" [q8]="--no-repack")
declare -A DEEPINFER_FLAGS=(
    [f32]="--dtype f32"
    [bf16]="--dtype bf16"
    [q8]="--dtype bf16 --quantize q8_0"
)
declare -A LABEL=([f32]="F32 / f32" [bf16]="BF16 / bf16" [q8]="Q8_0 / q8_0")

LLAMA_CPP_PYTHON=0.3.36          # the PyPI package whose sdist vendors llama.cpp
# The converter's needs (torch, transformers, sentencepiece, protobuf, and gguf-py's numpy, pyyaml,
# tqdm, requests) and the llama_cpp bindings' (jinja2, diskcache, typing-extensions), at the
# versions scripts/requirements-ref.txt pins where it pins them.
PYTHON_PACKAGES=(torch==2.15.0 transformers==5.24.0 tokenizers==0.23.3 safetensors==0.8.0
                 numpy==2.4.6 sentencepiece==0.2.3 protobuf==7.36.2 pyyaml==6.0.4 tqdm==4.70.1
                 requests==2.34.2 jinja2==3.1.6 diskcache==5.6.3 typing-extensions==4.16.0)
THREADS=2
PROMPT_LEN=16
STEPS=64
PARITY_PROMPT=$'ROMEO:\nBut, soft! what light through yonder window breaks?\n'
PARITY_NEW_TOKENS=24
LLAMA_TARGETS=(llama llama-bench llama-batched-bench)
# --suite v2lite: the files' precisions, the KV cache both engines use, and the long cells' steps
# and llama-bench repetitions (a 16,384-token context is prefilled again for every repetition).
V2LITE_PRECISIONS=q4_k_m,q8_0
V2LITE_KV=bf16
LONG_STEPS=32
LONG_REPS=2
declare -A V2LITE_LABEL=([q4_k_m]="Q4_K_M" [q8_0]="Q8_0")

REPO=$(cd "$(dirname "$0")/.." && pwd)
WORK=$REPO/target/llamacpp-bench     # paths given as options are relative to the caller's directory
DEEPINFER=$REPO/target/release/deepinfer
ROUNDS=2
SKIP_BUILD=0
PRECISIONS=f32,bf16,q8
BATCHES=1,8
IDLE_WAIT=180
SUITE=medium
V2LITE_DIR=$REPO/target/v2lite-gguf
CELLS=b1,b8,pp512,d4096,d16384,load
PRECISIONS_GIVEN=0

die() { echo "bench_vs_llamacpp: error: $*" >&2; exit 1; }
say() { echo "== $*"; }
usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit "${1:-0}"; }

while [ $# -gt 0 ]; do
    case "$1" in
        --work) WORK=${2:?--work needs a directory}; shift 2 ;;
        --deepinfer) DEEPINFER=${2:?--deepinfer needs a path}; shift 2 ;;
        --rounds) ROUNDS=${2:?--rounds needs a number}; shift 2 ;;
        --skip-build) SKIP_BUILD=1; shift ;;
        --precisions) PRECISIONS=${2:?--precisions needs a list}; PRECISIONS_GIVEN=1; shift 2 ;;
        --suite) SUITE=${2:?--suite needs medium or v2lite}; shift 2 ;;
        --v2lite-dir) V2LITE_DIR=${2:?--v2lite-dir needs a directory}; shift 2 ;;
        --cells) CELLS=${2:?--cells needs a list}; shift 2 ;;
        --batches) BATCHES=${2:?--batches needs a list}; shift 2 ;;
        --idle-wait) IDLE_WAIT=${2:?--idle-wait needs seconds}; shift 2 ;;
        -h|--help) usage 0 ;;
        *) echo "bench_vs_llamacpp: unknown option $1" >&2; usage 2 ;;
    esac
done
[[ $ROUNDS =~ ^[1-9][0-9]*$ ]] || die "--rounds must be a positive integer, not '$ROUNDS'"
[[ $IDLE_WAIT =~ ^[0-9]+$ ]] || die "--idle-wait must be a number of seconds, not '$IDLE_WAIT'"
case "$SUITE" in
    medium|v2lite) ;;
    *) die "--suite must be medium or v2lite, not '$SUITE'" ;;
esac
[ "$SUITE" = medium ] || [ "$PRECISIONS_GIVEN" = 1 ] || PRECISIONS=$V2LITE_PRECISIONS
IFS=, read -r -a PRECISION_LIST <<< "$PRECISIONS"
IFS=, read -r -a BATCH_LIST <<< "$BATCHES"
IFS=, read -r -a CELL_LIST <<< "$CELLS"
for p in "${PRECISION_LIST[@]}"; do
    if [ "$SUITE" = medium ]; then
        [ -n "${GGUF_TYPE[$p]:-}" ] || die "unknown precision '$p' (known: ${!GGUF_TYPE[*]})"
    else
        [ -n "${V2LITE_LABEL[$p]:-}" ] || die "unknown --suite v2lite precision '$p' (known: ${!V2LITE_LABEL[*]})"
    fi
done
for c in "${CELL_LIST[@]}"; do
    case "$c" in b1|b8|pp512|d4096|d16384|load) ;; *) die "unknown cell '$c' (known: b1,b8,pp512,d4096,d16384,load)" ;; esac
done
[ "$SUITE" = medium ] || [ -x /usr/bin/time ] || die "/usr/bin/time is missing (Debian: apt-get install time): --suite v2lite records peak RSS with it"
for b in "${BATCH_LIST[@]}"; do
    [[ $b =~ ^[1-9][0-9]*$ ]] || die "batch sizes must be positive integers, not '$b'"
done

mkdir -p "$WORK"
WORK=$(cd "$WORK" && pwd)
DEEPINFER=$(realpath -m "$DEEPINFER")
V2LITE_DIR=$(realpath -m "$V2LITE_DIR")
cd "$REPO"
[ -x "$DEEPINFER" ] || die "deepinfer binary $DEEPINFER not found or not executable (build it with \`cargo build --release\`, or pass --deepinfer PATH)"
LOGS=$WORK/logs
mkdir -p "$LOGS"
BUILD=$WORK/build
built() {
    [ -x "$BUILD/bin/llama-bench" ] && [ -x "$BUILD/bin/llama-batched-bench" ] && [ -f "$BUILD/bin/libllama.so" ] \
        && { [ "$SUITE" = medium ] || [ -x "$BUILD/bin/llama-quantize" ]; }
}
[ "$SUITE" = medium ] || LLAMA_TARGETS+=(llama-quantize)
[ "$SKIP_BUILD" = 0 ] || built || die "--skip-build, but $BUILD has no llama-bench, llama-batched-bench and libllama.so"

# Runs a command with its output in $LOGS/NAME.log; on failure shows the log's end and stops.
run_logged() {
    local name=$1; shift
    if ! "$@" > "$LOGS/$name.log" 2>&1; then
        tail -n 40 "$LOGS/$name.log" >&2
        die "$name failed: \`$*\` (whole log: $LOGS/$name.log)"
    fi
}

# --- 1. tools ---------------------------------------------------------------------------------
if [ "$SKIP_BUILD" = 0 ] && { ! command -v cmake > /dev/null || ! command -v c++ > /dev/null || ! command -v make > /dev/null; }; then
    say "installing cmake and build-essential from Debian"
    command -v apt-get > /dev/null || die "cmake is missing and there is no apt-get to install it with"
    run_logged apt-get-update apt-get update
    run_logged apt-get-install env DEBIAN_FRONTEND=noninteractive apt-get install -y cmake build-essential
fi
VENV=$WORK/venv
PY=$VENV/bin/python
if [ ! -x "$PY" ]; then
    say "creating $VENV"
    if ! python3 -m venv "$VENV" > "$LOGS/venv.log" 2>&1; then
        command -v apt-get > /dev/null || die "python3 -m venv failed (see $LOGS/venv.log)"
        run_logged apt-get-update apt-get update
        run_logged apt-get-install-venv env DEBIAN_FRONTEND=noninteractive apt-get install -y python3-venv
        rm -rf "$VENV"
        run_logged venv python3 -m venv "$VENV"
    fi
fi
if ! "$PY" -c "import torch, transformers, safetensors, numpy, sentencepiece, google.protobuf, yaml, tqdm, requests, jinja2, diskcache" 2> /dev/null; then
    say "installing ${PYTHON_PACKAGES[*]} into $VENV (torch is large)"
    run_logged pip-install "$VENV/bin/pip" install --quiet "${PYTHON_PACKAGES[@]}"
fi

# --- 2. llama.cpp -----------------------------------------------------------------------------
SDIST=$WORK/sdist/llama_cpp_python-$LLAMA_CPP_PYTHON
SRC=$SDIST/vendor/llama.cpp
if [ ! -f "$SRC/convert_hf_to_gguf.py" ]; then
    say "downloading the llama-cpp-python $LLAMA_CPP_PYTHON sdist from PyPI"
    mkdir -p "$WORK/sdist"
    run_logged pip-download "$VENV/bin/pip" download --no-deps --no-binary llama-cpp-python \
        "llama-cpp-python==$LLAMA_CPP_PYTHON" -d "$WORK/sdist"
    run_logged untar tar xzf "$WORK/sdist/llama_cpp_python-$LLAMA_CPP_PYTHON.tar.gz" -C "$WORK/sdist"
    [ -f "$SRC/convert_hf_to_gguf.py" ] || die "the sdist has no vendor/llama.cpp/convert_hf_to_gguf.py"
fi
# The vendored commit: the sdist keeps the submodule's git HEAD; its CHANGELOG names it too.
LLAMA_COMMIT=$(git -C "$SRC" rev-parse HEAD 2> /dev/null || true)
if [ -z "$LLAMA_COMMIT" ]; then
    LLAMA_COMMIT=$(grep -m1 -o 'llama.cpp@[0-9a-f]*' "$SDIST/CHANGELOG.md" | cut -d@ -f2 || echo unknown)
fi

CMAKE_FLAGS=(-DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF
             -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF)
STAMP="llama-cpp-python $LLAMA_CPP_PYTHON, llama.cpp $LLAMA_COMMIT, ${CMAKE_FLAGS[*]}, ${LLAMA_TARGETS[*]}"
if [ "$SKIP_BUILD" = 1 ]; then
    say "llama.cpp: using $BUILD as it is (--skip-build)"
elif built && [ "$(sed 's/ llama-quantize$//' "$BUILD/.bench-stamp" 2> /dev/null)" = "${STAMP% llama-quantize}" ]; then
    say "llama.cpp: $BUILD is up to date ($LLAMA_COMMIT)"
else
    say "building llama.cpp $LLAMA_COMMIT (${LLAMA_TARGETS[*]}) in $BUILD: minutes (under 4 on 2 cores here)"
    rm -f "$BUILD/.bench-stamp"
    run_logged cmake-configure cmake -S "$SRC" -B "$BUILD" "${CMAKE_FLAGS[@]}"
    run_logged cmake-build cmake --build "$BUILD" --config Release -j 2 --target "${LLAMA_TARGETS[@]}"
    built || die "the build finished without llama-bench, llama-batched-bench or libllama.so in $BUILD/bin"
    echo "$STAMP" > "$BUILD/.bench-stamp"
fi

# TOKEN STREAMS. llama-bench's generation feeds `std::rand() % n_vocab` each step (one
# sequence): deepinfer gets `--tokens random` at batch 1. llama-batched-bench, in the sources
# read when this was written, feeds token 0 at every prompt and generated position of every
# sequence, so its B sequences are one sequence repeated and a step's rows route to the same
# experts: deepinfer then gets `--tokens zeros` at batch B; a source that draws random tokens
# instead gets `--tokens random`. Anything else stops the script rather than compare unlike
# streams.
token_stream() {  # tool source file -> greedy|random|zeros for deepinfer bench --tokens
    local src=$1
    [ -f "$src" ] || die "no $src: cannot tell which tokens its tool feeds"
    if grep -q 'common_batch_add(batch, 0, pp + i' "$src"; then echo zeros
    elif grep -Eq 'token = std::rand\(\) % n_vocab|get_token_rand\(\), pp \+ i' "$src"; then echo random
    else die "cannot tell which tokens $src feeds (read it and extend token_stream)"
    fi
}
tool_source() {  # tool directory name -> its .cpp in the sources built here
    local d
    for d in tools examples; do
        [ -f "$SRC/$d/$1/$1.cpp" ] && { echo "$SRC/$d/$1/$1.cpp"; return; }
    done
    die "no $1.cpp under $SRC/tools or $SRC/examples"
}
TOKENS_B1=$(token_stream "$(tool_source llama-bench)")
TOKENS_BN=$(token_stream "$(tool_source batched-bench)")
say "token streams: batch 1 (llama-bench) $TOKENS_B1, batch > 1 (llama-batched-bench) $TOKENS_BN"

if [ "$SUITE" = medium ]; then
# --- 3. checkpoint ----------------------------------------------------------------------------
CKPT=$WORK/medium-bench
if [ ! -f "$CKPT/.complete" ]; then
    say "writing the checkpoint $CKPT"
    rm -rf "$CKPT"
    run_logged checkpoint "$PY" scripts/llamacpp_bench.py checkpoint --out "$CKPT"
    touch "$CKPT/.complete"
fi
tail -n 1 "$LOGS/checkpoint.log" 2> /dev/null || true

# --- 4. GGUF ----------------------------------------------------------------------------------
gguf() { echo "$WORK/gguf/medium-bench-${GGUF_TYPE[$1]}.gguf"; }
for p in f32 "${PRECISION_LIST[@]}"; do
    if [ ! -f "$(gguf "$p")" ]; then
        say "converting to $(basename "$(gguf "$p")") with llama.cpp's convert_hf_to_gguf.py"
        run_logged "convert-${GGUF_TYPE[$p]}" "$PY" scripts/llamacpp_bench.py convert --llama-cpp "$SRC" \
            --model "$CKPT" --outtype "${GGUF_TYPE[$p]}" --outfile "$(gguf "$p")"
        grep '^convert: ' "$LOGS/convert-${GGUF_TYPE[$p]}.log" || true
    fi
done

# --- 5. parity --------------------------------------------------------------------------------
say "parity in F32: llama.cpp against deepinfer"
if ! "$PY" scripts/llamacpp_bench.py parity --llama-cpp-python "$SDIST" --lib-dir "$BUILD/bin" \
        --gguf "$(gguf f32)" --model "$CKPT" --deepinfer "$DEEPINFER" --prompt "$PARITY_PROMPT" \
        --new-tokens "$PARITY_NEW_TOKENS" --threads "$THREADS" --summary "$WORK/parity.json" \
        2>&1 | tee "$LOGS/parity.log"; then
    die "parity failed: llama.cpp and deepinfer disagree on the F32 checkpoint (log: $LOGS/parity.log); not benchmarking"
fi
else
# --- 3-5. the V2-Lite-shaped files (no checkpoint, conversion or F32 parity: tests/gguf_v2lite.rs) --
v2lite_file() { echo "$V2LITE_DIR/v2lite-$1.gguf"; }
for p in "${PRECISION_LIST[@]}"; do
    if [ ! -f "$(v2lite_file "$p")" ]; then
        say "making the V2-Lite-shaped GGUF files with scripts/make_v2lite_gguf.sh (tens of minutes)"
        run_logged make-v2lite scripts/make_v2lite_gguf.sh --out "$V2LITE_DIR" --llamacpp-work "$WORK"
        break
    fi
done
for p in "${PRECISION_LIST[@]}"; do
    [ -f "$(v2lite_file "$p")" ] || die "no $(v2lite_file "$p") after scripts/make_v2lite_gguf.sh"
    echo "  $(basename "$(v2lite_file "$p")"): $(du -hL "$(v2lite_file "$p")" | cut -f1)"
done
fi

# --- 6. benchmark -----------------------------------------------------------------------------
STAMP_TIME=$(date -u +%Y%m%dT%H%M%SZ)
RESULTS=$WORK/results-$STAMP_TIME.jsonl
: > "$RESULTS"
loadavg() { cut -d' ' -f1-3 /proc/loadavg; }
CLK_TCK=$(getconf CLK_TCK)
# The machine's busy CPU ticks (user, nice, system, irq, softirq, steal), and those of this
# shell's waited-for children (cutime + cstime, /proc/PID/stat fields 16 and 17).
busy_ticks() { awk '/^cpu /{print $2 + $3 + $4 + $7 + $8 + $9; exit}' /proc/stat; }
child_ticks() {
    local stat fields
    stat=$(< "/proc/$$/stat")
    read -r -a fields <<< "${stat##*) }"
    echo $(( fields[13] + fields[14] ))
}
wait_idle() {
    local deadline=$(( SECONDS + IDLE_WAIT )) b0 b1 others
    [ "$IDLE_WAIT" = 0 ] && return 0
    while :; do
        b0=$(busy_ticks); sleep 2; b1=$(busy_ticks)
        others=$(( (b1 - b0) * 100 / (2 * CLK_TCK) ))  # percent of one core
        [ "$others" -le 20 ] && return 0
        if [ "$SECONDS" -ge "$deadline" ]; then
            echo "  (still busy after ${IDLE_WAIT}s: others use ${others}% of a core; measuring anyway)"
            return 0
        fi
        sleep 3
    done
}

bench_llama() {  # precision batch output
    local model kv ctx extra
    model=$(gguf "$1")
    kv=${LLAMA_KV[$1]}
    if [ "$2" = 1 ]; then
        read -r -a extra <<< "${LLAMA_BENCH_EXTRA[$1]}"
        "$BUILD/bin/llama-bench" -m "$model" -t "$THREADS" -p 0 -n "$STEPS" -d "$PROMPT_LEN" \
            -ctk "$kv" -ctv "$kv" "${extra[@]}" -o json > "$3" 2> "$3.err"
    else
        ctx=$(( $2 * (PROMPT_LEN + STEPS) ))
        read -r -a extra <<< "${LLAMA_BATCHED_EXTRA[$1]}"
        "$BUILD/bin/llama-batched-bench" -m "$model" -t "$THREADS" -tb "$THREADS" -c "$ctx" \
            -npp "$PROMPT_LEN" -ntg "$STEPS" -npl "$2" -ctk "$kv" -ctv "$kv" "${extra[@]}" \
            --output-format jsonl > "$3" 2> "$3.err"
    fi
}

bench_deepinfer() {  # precision batch output
    local flags
    read -r -a flags <<< "${DEEPINFER_FLAGS[$1]}"
    RAYON_NUM_THREADS=$THREADS "$DEEPINFER" bench --model "$CKPT" --batch "$2" \
        --prompt-len "$PROMPT_LEN" --steps "$STEPS" --json "${flags[@]}" \
        --tokens "$([ "$2" = 1 ] && echo "$TOKENS_B1" || echo "$TOKENS_BN")" > "$3" 2> "$3.err"
}

# Runs one measurement ("$@" after the label) once the machine is idle, and again (up to
# ATTEMPTS times in all, the last attempt kept) while other processes used more than BUSY_CORES
# cores meanwhile. Sets ATTEMPT, OTHERS (those cores) and TOOK (seconds); returns the
# command's failure.
measure_quietly() {  # label command...
    local label=$1 t0 t1 busy0 busy1 mine0 mine1
    shift
    for ATTEMPT in $(seq 1 "$ATTEMPTS"); do
        wait_idle
        t0=$EPOCHREALTIME; busy0=$(busy_ticks); mine0=$(child_ticks)
        "$@" || return 1
        t1=$EPOCHREALTIME; busy1=$(busy_ticks); mine1=$(child_ticks)
        OTHERS=$(awk -v b="$(( busy1 - busy0 - (mine1 - mine0) ))" -v t0="$t0" -v t1="$t1" -v hz="$CLK_TCK" \
            'BEGIN { c = b / hz / (t1 - t0); printf "%.2f", c < 0 ? 0 : c }')
        TOOK=$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.1f", b - a }')
        if [ "$ATTEMPT" -lt "$ATTEMPTS" ] && awk -v o="$OTHERS" -v m="$BUSY_CORES" 'BEGIN { exit !(o > m) }'; then
            echo "  ($label: others used $OTHERS cores meanwhile; measuring again)"
            continue
        fi
        break
    done
}

# One v2lite cell's command line, timed by /usr/bin/time -v.
run_v2lite() {  # out command
    # shellcheck disable=SC2086  # the command is a line of plain words
    RAYON_NUM_THREADS=$THREADS /usr/bin/time -v -o "$1.time" $2 > "$1" 2> "$1.err"
}

# A measurement is retried (up to ATTEMPTS times in all) while others used more than BUSY_CORES.
ATTEMPTS=3
BUSY_CORES=0.25
# --suite v2lite: one cell's command for each engine (precision cell output). The flags are
# written out in the report.
v2lite_llama_cmd() {
    local model kv=$V2LITE_KV
    model=$(v2lite_file "$1")
    case "$2" in
        b1) echo "$BUILD/bin/llama-bench -m $model -t $THREADS -p 0 -n $STEPS -d $PROMPT_LEN -ctk $kv -ctv $kv --repack 0 -o json" ;;
        b8) echo "$BUILD/bin/llama-batched-bench -m $model -t $THREADS -tb $THREADS -c $(( 8 * (PROMPT_LEN + STEPS) )) -npp $PROMPT_LEN -ntg $STEPS -npl 8 -ctk $kv -ctv $kv --no-repack --output-format jsonl" ;;
        pp512) echo "$BUILD/bin/llama-bench -m $model -t $THREADS -p 512 -n 0 -ctk $kv -ctv $kv --repack 0 -o json" ;;
        d4096|d16384) echo "$BUILD/bin/llama-bench -m $model -t $THREADS -p 0 -n $LONG_STEPS -d ${2#d} -r $LONG_REPS -ctk $kv -ctv $kv --repack 0 -o json" ;;
        load) echo "$BUILD/bin/llama-bench -m $model -t $THREADS -p 0 -n 1 -r 1 --no-warmup -ctk $kv -ctv $kv --repack 0 -o json" ;;
    esac
}
v2lite_deepinfer_cmd() {
    local model common
    model=$(v2lite_file "$1")
    common="$DEEPINFER bench --model $model --dtype bf16 --kv-dtype $V2LITE_KV --json"
    case "$2" in
        b1) echo "$common --batch 1 --prompt-len $PROMPT_LEN --steps $STEPS --tokens $TOKENS_B1" ;;
        b8) echo "$common --batch 8 --prompt-len $PROMPT_LEN --steps $STEPS --tokens $TOKENS_BN" ;;
        pp512) echo "$common --batch 1 --prompt-len 512 --steps 1 --tokens random" ;;
        d4096|d16384) echo "$common --batch 1 --prompt-len ${2#d} --steps $LONG_STEPS --tokens random" ;;
        load) echo "$common --batch 1 --prompt-len 1 --steps 1 --tokens random" ;;
    esac
}
# One v2lite measurement (round precision cell engine), as measure() below: waits for an idle
# machine, runs under /usr/bin/time -v, retries while others were busy, records the figure
# (tok/s; seconds for `load`) with the peak RSS.
measure_v2lite() {
    local out="$LOGS/round$1-v2lite-$2-$3-$4.out" tool cmd metric
    if [ "$4" = llama ]; then
        cmd=$(v2lite_llama_cmd "$2" "$3")
        tool=$([ "$3" = b8 ] && echo llama-batched-bench || echo llama-bench)
    else
        cmd=$(v2lite_deepinfer_cmd "$2" "$3")
        tool=deepinfer
    fi
    metric=decode
    case "$3" in pp512) metric=prefill ;; load) metric=load ;; esac
    echo "$cmd" > "$out.cmd"
    measure_quietly "$tool, $2, $3" run_v2lite "$out" "$cmd" \
        || { tail -n 20 "$out.err" >&2; die "$tool ($2, $3) failed: $cmd (log: $out.err)"; }
    "$PY" scripts/llamacpp_bench.py parse --tool "$tool" --output "$out" --results "$RESULTS" \
        --round "$1" --precision "$2" --batch "$([ "$3" = b8 ] && echo 8 || echo 1)" --case "$3" \
        --metric "$metric" --time-file "$out.time" --command "$cmd" --others "$OTHERS" --attempts "$ATTEMPT" \
        --seconds "$TOOK" \
        || die "could not read $tool's output ($out)"
}

if [ "$SUITE" = v2lite ]; then
    say "benchmark (v2lite): $ROUNDS rounds, precisions ${PRECISION_LIST[*]}, cells ${CELL_LIST[*]}, $THREADS threads"
    for round in $(seq 1 "$ROUNDS"); do
        start_load=$(loadavg)
        echo "round $round (load $start_load)"
        for p in "${PRECISION_LIST[@]}"; do
            for c in "${CELL_LIST[@]}"; do
                measure_v2lite "$round" "$p" "$c" llama
                measure_v2lite "$round" "$p" "$c" deepinfer
            done
        done
        printf '{"kind": "load", "round": %d, "start": "%s", "end": "%s"}\n' "$round" "$start_load" "$(loadavg)" >> "$RESULTS"
    done
    REPORT=${RESULTS%.jsonl}.md
    labels=()
    for p in "${PRECISION_LIST[@]}"; do labels+=(--label "$p=${V2LITE_LABEL[$p]}"); done
    {
        echo "llama.cpp $LLAMA_COMMIT (llama-cpp-python $LLAMA_CPP_PYTHON sdist), deepinfer $DEEPINFER"
        echo "DeepSeek-V2-Lite-shaped random-weight GGUF files in $V2LITE_DIR (scripts/make_v2lite_gguf.sh)"
        echo "$(nproc) cores, $THREADS threads, KV cache $V2LITE_KV in both, llama.cpp repacking off (forced), $(date -u '+%Y-%m-%d %H:%M UTC')"
        echo
        "$PY" scripts/llamacpp_bench.py report --results "$RESULTS" --precisions "$PRECISIONS" --by-case "${labels[@]}"
    } > "$REPORT"
    echo
    cat "$REPORT"
    echo
    echo "(results: $RESULTS, $REPORT)"
    exit 0
fi

say "benchmark: $ROUNDS rounds, precisions ${PRECISION_LIST[*]}, batches ${BATCH_LIST[*]}, $THREADS threads, prompt $PROMPT_LEN, $STEPS decode steps"
# One measurement: the engine's bench (measure_quietly), its tok/s recorded with the cores
# other processes used meanwhile.
measure() {  # round precision batch engine
    local out="$LOGS/round$1-$2-b$3-$4.out" tool
    tool=deepinfer
    [ "$4" = llama ] && tool=$([ "$3" = 1 ] && echo llama-bench || echo llama-batched-bench)
    local bench=bench_deepinfer
    [ "$4" = llama ] && bench=bench_llama
    measure_quietly "$tool, $2, batch $3" "$bench" "$2" "$3" "$out" \
        || { tail -n 20 "$out.err" >&2; die "$tool ($2, batch $3) failed (log: $out.err)"; }
    "$PY" scripts/llamacpp_bench.py parse --tool "$tool" --output "$out" --results "$RESULTS" \
        --round "$1" --precision "$2" --batch "$3" --others "$OTHERS" --attempts "$ATTEMPT" \
        --seconds "$TOOK" \
        || die "could not read $tool's output ($out)"
}

for round in $(seq 1 "$ROUNDS"); do
    start_load=$(loadavg)
    echo "round $round (load $start_load)"
    for p in "${PRECISION_LIST[@]}"; do
        for b in "${BATCH_LIST[@]}"; do
            measure "$round" "$p" "$b" llama
            measure "$round" "$p" "$b" deepinfer
        done
    done
    printf '{"kind": "load", "round": %d, "start": "%s", "end": "%s"}\n' "$round" "$start_load" "$(loadavg)" >> "$RESULTS"
done

REPORT=${RESULTS%.jsonl}.md
labels=()
for p in "${PRECISION_LIST[@]}"; do labels+=(--label "$p=${LABEL[$p]}"); done
{
    echo "llama.cpp $LLAMA_COMMIT (llama-cpp-python $LLAMA_CPP_PYTHON sdist), deepinfer $DEEPINFER"
    echo "$(nproc) cores, $THREADS threads, prompt $PROMPT_LEN tokens per sequence, $STEPS decode steps, $(date -u '+%Y-%m-%d %H:%M UTC')"
    echo "token streams (both engines): batch 1 $TOKENS_B1, batch > 1 $TOKENS_BN"
    echo
    "$PY" scripts/llamacpp_bench.py report --results "$RESULTS" --precisions "$PRECISIONS" "${labels[@]}"
} > "$REPORT"
echo
cat "$REPORT"
echo
echo "(results: $RESULTS, $REPORT)"
