#!/usr/bin/env bash
# Runs every test of the project: Rust (unit, property, crash), then the
# TypeScript and Python packages that have tests.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo test --workspace
if [ -n "$(ls packages/*/package.json test/*/package.json 2>/dev/null)" ]; then
  pnpm -r --if-present run test
fi
