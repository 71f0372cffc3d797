#!/usr/bin/env bash
# The whole test suite, from a fresh clone: everything the tests need comes from the
# registries (crates through cargo). The fixtures the tests read are committed; regenerating
# them (scripts/make_fixtures.py) needs the reference venv, which the tests do not.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo test --workspace
