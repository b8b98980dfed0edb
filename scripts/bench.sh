#!/usr/bin/env bash
# Benchmarks (not timed tests): the core's own bench, then the packages' benches.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo run --release -p loam-jobs-bench -- "$@"
if [ -n "$(ls packages/*/package.json 2>/dev/null)" ]; then
  pnpm -r --if-present run bench
fi
