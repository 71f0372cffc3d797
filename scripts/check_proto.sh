#!/usr/bin/env bash
# Checks that proto/xla_hlo_subset.proto agrees with XLA's own schema: every message, field
# (name, number, type, repeated or not, packed) and enum value the subset declares must be
# XLA's. The subset may omit what it does not use; it must never disagree. Exits 1 naming each
# mismatch (scripts/check_proto.py does the comparison).
#
#   scripts/check_proto.sh                                     # against jaxlib's XLA (pinned)
#   CHECK_PROTO_PACKAGE=xprof==2.24.2 scripts/check_proto.sh   # against another wheel's XLA
#
# When: in CI (.ci/run, after the bindings check), and by hand whenever the subset changes or
# XLA's version is bumped. The XLA checked against is the one scripts/xla_check.py runs our
# HLO on: jaxlib, pinned below to the version scripts/requirements-test.txt installs; bumping
# that pin without this one fails here, so the schema gets checked at each bump.
#
# Where XLA's schema comes from: jaxlib ships no hlo_pb2, but its libjax_common.so embeds the
# serialized FileDescriptorProtos of xla/service/hlo.proto and xla/xla_data.proto, which
# check_proto.py reads as data with google.protobuf (nothing from the wheel is imported or
# run). Wheels measured (2026-11, manylinux x86_64, cp311):
#   xprof 2.24.2                 32 MB  descriptors embedded in its .so (lightest carrier)
#   jaxlib 0.10.2                85 MB  descriptors embedded in libjax_common.so (used here)
#   tensorflow-cpu 2.21.0       274 MB  tensorflow/compiler/xla/service/hlo_pb2.py
#   tensorflow 2.21.0           572 MB  the same hlo_pb2.py
#   torch-xla 2.9.0              80 MB  descriptors embedded in its .so
#   tensorboard 2.21.0, tensorboard-plugin-profile 2.24.2, tf-keras 2.21.0,
#   tensorflow-serving-api 2.21.0: no XLA schema
# All four carriers gave the same result. jaxlib over xprof: it is the XLA our conformance
# check uses, and CI downloads it anyway for scripts/test.sh (pip's cache serves it twice).
#
# Cost: the first run makes a venv in target/check_proto (grpcio-tools, whose protoc compiles
# the subset, and protobuf: about 20 s) and downloads the jaxlib wheel (85 MB, a few seconds);
# then about 7 s a run (reading the 350 MB library out of the wheel).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"

JAXLIB_VERSION=0.10.2     # = scripts/requirements-test.txt
GRPCIO_TOOLS_VERSION=1.85.1
PROTOBUF_VERSION=7.36.2
package="${CHECK_PROTO_PACKAGE:-jaxlib==$JAXLIB_VERSION}"

if [ -z "${CHECK_PROTO_PACKAGE:-}" ]; then
  tested="$(sed -n 's/^jaxlib==\([^ ]*\).*/\1/p' scripts/requirements-test.txt)"
  if [ "$tested" != "$JAXLIB_VERSION" ]; then
    echo "check_proto: scripts/requirements-test.txt pins jaxlib==$tested, this script $JAXLIB_VERSION:" >&2
    echo "set JAXLIB_VERSION in scripts/check_proto.sh to $tested and rerun it (XLA's schema may have moved)" >&2
    exit 1
  fi
fi

work="$root/target/check_proto"
venv="$work/venv"
stamp="grpcio-tools==$GRPCIO_TOOLS_VERSION protobuf==$PROTOBUF_VERSION"
if [ "$(cat "$venv/.pins" 2>/dev/null)" != "$stamp" ]; then
  rm -rf "$venv"
  python3 -m venv "$venv"
  # shellcheck disable=SC2086 # the pins are separate words
  "$venv/bin/pip" install --quiet --disable-pip-version-check $stamp
  echo "$stamp" > "$venv/.pins"
fi

wheels="$work/wheels/${package//[^A-Za-z0-9._-]/_}"
wheel="$(ls "$wheels"/*.whl 2>/dev/null | head -n 1 || true)"
if [ -z "$wheel" ]; then
  "$venv/bin/pip" download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
    -d "$wheels" "$package"
  wheel="$(ls "$wheels"/*.whl | head -n 1)"
fi

"$venv/bin/python" scripts/check_proto.py --subset proto/xla_hlo_subset.proto \
  --wheel "$wheel" --label "$package"
