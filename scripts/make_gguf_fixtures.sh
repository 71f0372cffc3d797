#!/usr/bin/env bash
# Writes fixtures/gguf/: tiny fixtures converted to GGUF by llama.cpp's own convert_hf_to_gguf.py,
# the files tests/gguf.rs loads and checks against the fixtures' transformers references.
#
#   scripts/make_gguf_fixtures.sh [--work DIR]
#
# Needs Python 3 and PyPI (the converter imports torch and transformers): a venv in WORK/venv
# with scripts/bench_vs_llamacpp.sh's pinned packages, and llama.cpp's sources from the PyPI
# sdist of llama-cpp-python (the version below), which vendors the converter and gguf-py.
# Nothing is compiled. The fixtures' tokenizers are new to the converter's pre-tokenizer table;
# scripts/llamacpp_bench.py's `convert` declares them as GPT-2's (see its docs). Not run in CI:
# its output is committed.
set -euo pipefail
LLAMA_CPP_PYTHON=0.3.36
PYTHON_PACKAGES=(torch==2.15.0 transformers==5.24.0 tokenizers==0.23.3 safetensors==0.8.0
                 numpy==2.4.6 sentencepiece==0.2.3 protobuf==7.36.2 pyyaml==6.0.4 tqdm==4.70.1
                 requests==2.34.2)
# fixture:outtype pairs.
CONVERSIONS=(tiny-v3:f32 tiny-v2-lite:f32 tiny-v2-lite:q8_0)
REPO=$(cd "$(dirname "$0")/.." && pwd)
WORK=$REPO/target/gguf-fixtures
if [ "${1:-}" = --work ]; then WORK=${2:?--work needs a directory}; fi
mkdir -p "$WORK"
WORK=$(cd "$WORK" && pwd)
cd "$REPO"
if [ ! -x "$WORK/venv/bin/python" ]; then
    python3 -m venv "$WORK/venv"
    "$WORK/venv/bin/pip" install --quiet "${PYTHON_PACKAGES[@]}"
fi
SRC=$WORK/llama_cpp_python-$LLAMA_CPP_PYTHON/vendor/llama.cpp
if [ ! -f "$SRC/convert_hf_to_gguf.py" ]; then
    "$WORK/venv/bin/pip" download --quiet --no-deps --no-binary llama-cpp-python \
        "llama-cpp-python==$LLAMA_CPP_PYTHON" -d "$WORK"
    tar xzf "$WORK/llama_cpp_python-$LLAMA_CPP_PYTHON.tar.gz" -C "$WORK"
fi
mkdir -p fixtures/gguf
for c in "${CONVERSIONS[@]}"; do
    fixture=${c%%:*}
    outtype=${c##*:}
    "$WORK/venv/bin/python" scripts/llamacpp_bench.py convert --llama-cpp "$SRC" \
        --model "fixtures/$fixture" --outtype "$outtype" \
        --outfile "fixtures/gguf/$fixture-$outtype.gguf" > "$WORK/convert-$fixture-$outtype.log" 2>&1 \
        || { tail -n 30 "$WORK/convert-$fixture-$outtype.log" >&2; exit 1; }
    echo "wrote fixtures/gguf/$fixture-$outtype.gguf"
done
