#!/usr/bin/env bash
# Checks that neuron-sys/src/bindings.rs is bindgen's output for
# neuron-sys/include/nrt_deepinfer.h (the header we write from the published libnrt API).
#
#   neuron-sys/scripts/check_bindings.sh            # diff; exit 1 on drift
#   neuron-sys/scripts/check_bindings.sh --update   # rewrite src/bindings.rs
#
# bindgen runs as a library inside neuron-sys's build script (feature `bindgen`, with
# NEURON_SYS_BINDINGS_OUT naming the output file), so the options live in one place,
# neuron-sys/build.rs, and no bindgen-cli install is needed (cargo install bindgen-cli
# took 3m18s here, over budget). Needs libclang at run time: when it is missing and the
# script runs as root under CI (CI set), it installs libclang-dev with apt-get; elsewhere it
# says how to install it.
#
# Time: the first run compiles bindgen and its dependencies (about 2 minutes on 2 shared
# cores) plus ~15 s for apt-get when libclang is missing; a warm run takes a few seconds.
set -euo pipefail

here="$(cd "$(dirname "$0")/.." && pwd)"   # neuron-sys/
root="$(cd "$here/.." && pwd)"             # the workspace
update=0
case "${1:-}" in
  --update) update=1 ;;
  "") ;;
  *) echo "usage: $0 [--update]" >&2; exit 2 ;;
esac

have_libclang() {
  if [ -n "${LIBCLANG_PATH:-}" ] && ls "$LIBCLANG_PATH"/libclang*.so* >/dev/null 2>&1; then
    return 0
  fi
  # libclang.so / libclang-14.so.1, not libclang-cpp.so (a different library).
  ldconfig -p 2>/dev/null | grep -Eq '\blibclang(-[0-9.]+)?\.so' && return 0
  ls /usr/lib/llvm-*/lib/libclang.so* /usr/lib/*/libclang-*.so* >/dev/null 2>&1
}

if ! have_libclang; then
  if [ "$(id -u)" = 0 ] && [ -n "${CI:-}" ] && command -v apt-get >/dev/null; then
    echo "check_bindings: installing libclang-dev" >&2
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libclang-dev >/dev/null
  else
    echo "check_bindings: libclang not found. Install it (Debian/Ubuntu: apt-get install libclang-dev)" >&2
    echo "or set LIBCLANG_PATH to the directory holding libclang.so." >&2
    exit 1
  fi
fi

command -v rustfmt >/dev/null || { echo "check_bindings: rustfmt not found (rustup component add rustfmt)" >&2; exit 1; }

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
generated="$tmp/generated.rs"

# A fresh output path each run, so the build script (rerun-if-env-changed) always runs. The
# build script writes the file before the crate compiles, so the diff below is shown even
# when the crate itself no longer builds (e.g. sys.rs's constants disagree with the header).
set +e
(cd "$root" && NEURON_SYS_BINDINGS_OUT="$generated" cargo build --quiet -p neuron-sys --features bindgen)
build_rc=$?
set -e
[ -s "$generated" ] || { echo "check_bindings: the build script wrote no bindings (cargo exited $build_rc)" >&2; exit 1; }

# Normalise formatting on both sides (bindgen formats with whatever rustfmt it finds).
rustfmt --edition 2021 "$generated"
cp "$here/src/bindings.rs" "$tmp/committed.rs"
rustfmt --edition 2021 "$tmp/committed.rs"

if [ "$update" = 1 ]; then
  cp "$generated" "$here/src/bindings.rs"
  echo "check_bindings: wrote neuron-sys/src/bindings.rs"
  exit 0
fi

if ! diff -u --label committed/src/bindings.rs --label generated "$tmp/committed.rs" "$generated"; then
  echo "check_bindings: neuron-sys/src/bindings.rs is stale; run neuron-sys/scripts/check_bindings.sh --update" >&2
  exit 1
fi
if [ "$build_rc" != 0 ]; then
  echo "check_bindings: the bindings are current, but neuron-sys --features bindgen failed to build" >&2
  exit "$build_rc"
fi
echo "check_bindings: neuron-sys/src/bindings.rs matches include/nrt_deepinfer.h"
