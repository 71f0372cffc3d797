#!/usr/bin/env bash
# DeepSeek-V2-Lite-shaped random-weight GGUF files, Q8_0 and Q4_K_M (issue 45), for
# scripts/bench_vs_llamacpp.sh's V2-Lite cases and, at 4 layers, tests/gguf_v2lite.rs.
#
#   scripts/make_v2lite_gguf.sh [--layers N] [--out DIR] [--llamacpp-work DIR] [--references]
#                               [--no-q4]
#
# 1. a venv (OUT/venv) with the gguf PyPI package and numpy, pinned as in
#    scripts/requirements-test.txt;
# 2. OUT/v2lite-q8_0.gguf (27 layers; `--layers N`: OUT/v2lite-Nl-q8_0.gguf, the first N
#    layers): fixtures/configs/deepseek-v2-lite.json with seeded random weights, written straight
#    to Q8_0 by scripts/v2lite_gguf.py (its docstring says how: no float32 or 16-bit copy, one
#    tensor in memory at a time, the tokenizer padded to 102,400 with unused tokens);
# 3. checks the file's metadata against what llama.cpp's convert_hf_to_gguf.py --vocab-only
#    writes for the same config and tokenizer, when LLAMACPP_WORK/venv has the converter's
#    packages (scripts/bench_vs_llamacpp.sh makes it; otherwise says it skipped the check);
# 4. OUT/v2lite-q4_k_m.gguf: `llama-quantize --allow-requantize Q8_0-FILE OUT Q4_K_M`, with a
#    llama-quantize built in LLAMACPP_WORK/build (scripts/bench_vs_llamacpp.sh's build of the
#    llama-cpp-python sdist's llama.cpp; the llama-quantize target is added to it when missing,
#    the sdist downloaded from PyPI when missing), then checks that scripts/v2lite_gguf.py's
#    Q4_K_M type table (the CI stand-in, `write --type q4_k_m`) is the one llama-quantize chose.
#    With --layers N < 27 the llama-quantize output is only that check's input and is deleted;
#    --no-q4 skips this step;
# 5. --references (with --layers 4): writes the CI files (the 4-layer Q8_0 and `write --type
#    q4_k_m`'s random-code Q4_K_M) and llama.cpp's greedy tokens and logits on each into
#    fixtures/gguf/v2lite-4l-{q8_0,q4_k_m}.reference.json (scripts/v2lite_gguf.py reference,
#    through the sdist's Python bindings over LLAMACPP_WORK/build's libllama); commit those.
#
# Each step reports its time and the generator's peak RSS (OUT/make-*.log). Measured on a
# 2-core VM shared with a Rust build: 27 layers, Q8_0 16.7 GB in ~2 min at 0.6 GB of RSS;
# Q4_K_M by llama-quantize (2 threads) in tens of minutes. Needs about 27 GB of free disk at
# 27 layers (the script refuses to start with less than that plus 8 GB).
#
# Not run in CI (CI runs `scripts/v2lite_gguf.py write --layers 4` only: scripts/test.sh).
# Options:
#   --layers N           keep the first N of the 27 layers (default 27)
#   --out DIR            where the files go (default target/v2lite-gguf, git-ignored)
#   --llamacpp-work DIR  scripts/bench_vs_llamacpp.sh's work directory (default
#                        target/llamacpp-bench): its sdist, build and venv are reused
#   --references         rewrite fixtures/gguf/v2lite-4l-*.reference.json (needs --layers 4)
#   --no-q4              the Q8_0 file only
set -euo pipefail
LLAMA_CPP_PYTHON=0.3.36
# gguf 0.19.0 is the gguf-py the sdist vendors; numpy as scripts/requirements-test.txt pins it.
PYTHON_PACKAGES=(gguf==0.19.0 numpy==2.4.6 pyyaml==6.0.4 tqdm==4.70.1 requests==2.34.2)
CMAKE_FLAGS=(-DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF
             -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF)  # scripts/bench_vs_llamacpp.sh's
MIN_FREE_GB=8

REPO=$(cd "$(dirname "$0")/.." && pwd)
OUT=$REPO/target/v2lite-gguf
LLAMA_WORK=$REPO/target/llamacpp-bench
LAYERS=27
REFERENCES=0
Q4=1

die() { echo "make_v2lite_gguf: error: $*" >&2; exit 1; }
say() { echo "== $*"; }
usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit "${1:-0}"; }
while [ $# -gt 0 ]; do
    case "$1" in
        --layers) LAYERS=${2:?--layers needs a number}; shift 2 ;;
        --out) OUT=${2:?--out needs a directory}; shift 2 ;;
        --llamacpp-work) LLAMA_WORK=${2:?--llamacpp-work needs a directory}; shift 2 ;;
        --references) REFERENCES=1; shift ;;
        --no-q4) Q4=0; shift ;;
        -h|--help) usage 0 ;;
        *) echo "make_v2lite_gguf: unknown option $1" >&2; usage 2 ;;
    esac
done
[[ $LAYERS =~ ^[1-9][0-9]*$ ]] && [ "$LAYERS" -le 27 ] || die "--layers must be 1..27, not '$LAYERS'"
[ "$REFERENCES" = 0 ] || [ "$LAYERS" = 4 ] || die "--references is for the 4-layer CI files (--layers 4)"
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
LLAMA_WORK=$(realpath -m "$LLAMA_WORK")
cd "$REPO"
TIME=/usr/bin/time
[ -x "$TIME" ] || die "/usr/bin/time is missing (Debian: apt-get install time); it measures peak RSS"

run_logged() {  # name command...: output in OUT/make-NAME.log, its end shown on failure
    local name=$1; shift
    if ! "$@" > "$OUT/make-$name.log" 2>&1; then
        tail -n 30 "$OUT/make-$name.log" >&2
        die "$name failed: \`$*\` (log: $OUT/make-$name.log)"
    fi
}
measured() {  # name command...: run_logged under /usr/bin/time -v; prints wall time and peak RSS
    local name=$1; shift
    run_logged "$name" "$TIME" -v "$@"
    awk -v n="$name" '/Elapsed \(wall clock\)/ {t = $NF} /Maximum resident set size/ {r = $NF}
        END { printf "  %s: %s wall, peak RSS %.2f GB\n", n, t, r / 1e6 }' "$OUT/make-$name.log"
}

# --- 1. venv ----------------------------------------------------------------------------------
PY=$OUT/venv/bin/python
if ! "$PY" -c "import gguf, numpy" 2> /dev/null; then
    say "creating $OUT/venv (${PYTHON_PACKAGES[*]})"
    rm -rf "$OUT/venv"
    python3 -m venv "$OUT/venv" || die "python3 -m venv failed (Debian: apt-get install python3-venv)"
    run_logged pip "$OUT/venv/bin/pip" install --quiet "${PYTHON_PACKAGES[@]}"
fi

# --- 2. Q8_0 ----------------------------------------------------------------------------------
tag=v2lite
[ "$LAYERS" = 27 ] || tag=v2lite-${LAYERS}l
Q8=$OUT/$tag-q8_0.gguf
Q4K=$OUT/$tag-q4_k_m.gguf
# The files still to write, in MB (measured: Q8_0 0.62 GB a layer + 0.45 GB, 16.7 GB at 27
# layers; Q4_K_M about 0.6 of that).
q8_mb=$(( LAYERS * 620 + 450 ))
need_mb=0
[ -f "$Q8" ] || need_mb=$(( need_mb + q8_mb ))
[ "$Q4" = 0 ] || [ -f "$Q4K" ] || need_mb=$(( need_mb + q8_mb * 6 / 10 ))
free_mb=$(df -P -BM "$OUT" | awk 'NR == 2 { sub("M", "", $4); print $4 }')
[ "$free_mb" -ge $(( need_mb + MIN_FREE_GB * 1000 )) ] \
    || die "$OUT has $(( free_mb / 1000 )) GB free; the files still to write need about $(( need_mb / 1000 )) GB and $MIN_FREE_GB GB must stay free"
if [ ! -f "$Q8" ]; then
    say "writing $Q8 ($LAYERS layers, Q8_0)"
    measured write-q8_0 "$PY" scripts/v2lite_gguf.py write --layers "$LAYERS" --type q8_0 --out "$Q8"
    grep '^{' "$OUT/make-write-q8_0.log" || true
else
    say "$Q8 is there (delete it to rewrite it)"
fi

# --- 3. the converter's metadata ---------------------------------------------------------------
SDIST=$LLAMA_WORK/sdist/llama_cpp_python-$LLAMA_CPP_PYTHON
SRC=$SDIST/vendor/llama.cpp
if [ ! -f "$SRC/convert_hf_to_gguf.py" ]; then
    say "downloading the llama-cpp-python $LLAMA_CPP_PYTHON sdist from PyPI into $LLAMA_WORK/sdist"
    mkdir -p "$LLAMA_WORK/sdist"
    run_logged sdist "$OUT/venv/bin/pip" download --no-deps --no-binary llama-cpp-python \
        "llama-cpp-python==$LLAMA_CPP_PYTHON" -d "$LLAMA_WORK/sdist"
    run_logged untar tar xzf "$LLAMA_WORK/sdist/llama_cpp_python-$LLAMA_CPP_PYTHON.tar.gz" -C "$LLAMA_WORK/sdist"
fi
CONVERTER_PY=$LLAMA_WORK/venv/bin/python
if "$CONVERTER_PY" -c "import torch, transformers" 2> /dev/null; then
    say "metadata against convert_hf_to_gguf.py --vocab-only"
    run_logged check-metadata "$PY" scripts/v2lite_gguf.py check-metadata --gguf "$Q8" \
        --llama-cpp "$SRC" --converter-python "$CONVERTER_PY"
    tail -n 1 "$OUT/make-check-metadata.log"
else
    echo "  (skipped: $CONVERTER_PY has no torch and transformers; scripts/bench_vs_llamacpp.sh makes that venv)"
fi

# --- 4. Q4_K_M --------------------------------------------------------------------------------
BUILD=$LLAMA_WORK/build
need_targets=()
[ -x "$BUILD/bin/llama-quantize" ] || need_targets+=(llama-quantize)
[ "$REFERENCES" = 0 ] || [ -f "$BUILD/bin/libllama.so" ] || need_targets+=(llama)
if [ "$Q4" = 1 ] || [ "$REFERENCES" = 1 ]; then
    if [ ${#need_targets[@]} -gt 0 ]; then
        say "building ${need_targets[*]} in $BUILD"
        command -v cmake > /dev/null || die "cmake is missing (Debian: apt-get install cmake build-essential)"
        [ -f "$BUILD/CMakeCache.txt" ] || run_logged cmake-configure cmake -S "$SRC" -B "$BUILD" "${CMAKE_FLAGS[@]}"
        run_logged cmake-build cmake --build "$BUILD" --config Release -j 2 --target "${need_targets[@]}"
    fi
fi
if [ "$Q4" = 1 ]; then
    quantized=$Q4K
    [ "$LAYERS" = 27 ] || quantized=$OUT/$tag-q4_k_m.llama-quantize.gguf
    if [ ! -f "$quantized" ]; then
        say "llama-quantize --allow-requantize to Q4_K_M: $quantized"
        measured quantize "$BUILD/bin/llama-quantize" --allow-requantize "$Q8" "$quantized.partial" Q4_K_M 2
        mv "$quantized.partial" "$quantized"
        grep -E 'model size|quant size' "$OUT/make-quantize.log" || true
    fi
    say "scripts/v2lite_gguf.py's Q4_K_M types against llama-quantize's"
    run_logged types "$PY" scripts/v2lite_gguf.py types --q4-k-m-layers "$LAYERS" --against "$quantized"
    tail -n 1 "$OUT/make-types.log"
    [ "$quantized" = "$Q4K" ] || rm -f "$quantized"
fi

# --- 5. references ----------------------------------------------------------------------------
if [ "$REFERENCES" = 1 ]; then
    [ -f "$Q4K" ] || run_logged write-q4_k_m "$PY" scripts/v2lite_gguf.py write --layers 4 --type q4_k_m --out "$Q4K"
    LLAMA_COMMIT=$(grep -m1 -o 'llama.cpp@[0-9a-f]*' "$SDIST/CHANGELOG.md" 2> /dev/null | cut -d@ -f2 || true)
    for t in q8_0 q4_k_m; do
        say "llama.cpp's greedy tokens and logits on $tag-$t.gguf"
        run_logged "reference-$t" "$CONVERTER_PY" scripts/v2lite_gguf.py reference --gguf "$OUT/$tag-$t.gguf" \
            --out "fixtures/gguf/$tag-$t.reference.json" --llama-cpp-python "$SDIST" --lib-dir "$BUILD/bin" \
            --llama-cpp-version "llama.cpp ${LLAMA_COMMIT:-unknown} (llama-cpp-python $LLAMA_CPP_PYTHON sdist)"
        tail -n 1 "$OUT/make-reference-$t.log"
    done
fi
ls -l "$OUT"/*.gguf
