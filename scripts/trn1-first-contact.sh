#!/usr/bin/env bash
# First contact with a fresh trn1 (Neuron DLAMI): does deepinfer work here?
#
#   scripts/trn1-first-contact.sh [--sim] [--out DIR] [MODEL]
#
# MODEL is a checkpoint directory or a GGUF file (default: the embedded default model). Builds
# the workspace in release mode, then runs `deepinfer first-contact`: doctor, plan, `lower
# --check neuron`, compile, capture, parity against the CPU backend and a short bench, stopping
# at the first failure. Writes DIR/report.json and DIR/report.md (default DIR:
# first-contact-report). --sim runs it on nrt-sim and its stand-in compiler, without Trainium.
# Exit status: 0 every step passed, 1 a step failed, 2 no Neuron on this machine.
set -euo pipefail
# Not `cd`: a relative MODEL or --out DIR is the caller's, so the repository is named instead.
root=$(cd "$(dirname "$0")/.." && pwd)

args=()
model=()
while [ $# -gt 0 ]; do
    case "$1" in
        --sim) args+=(--sim) ;;
        --out)
            [ $# -ge 2 ] || { echo "--out needs a directory" >&2; exit 2; }
            args+=(--out "$2")
            shift
            ;;
        --out=*) args+=(--out "${1#--out=}") ;;
        -h|--help) sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        -*) echo "unknown option $1 (usage: $0 [--sim] [--out DIR] [MODEL])" >&2; exit 2 ;;
        *)
            [ ${#model[@]} -eq 0 ] || { echo "only one MODEL, got $1 too" >&2; exit 2; }
            model=(--model "$1")
            ;;
    esac
    shift
done

cargo build --manifest-path "$root/Cargo.toml" --release --workspace --quiet
exec "$root/target/release/deepinfer" first-contact "${args[@]}" "${model[@]}"
