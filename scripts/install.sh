#!/usr/bin/env bash
# Installs everything the project needs on a fresh machine (Debian, Node 20,
# Rust), then fetches and builds the workspace. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v pnpm >/dev/null 2>&1; then
  echo "install: pnpm"
  npm install -g pnpm@10.34.8 >/dev/null
fi

echo "install: node packages"
pnpm install --frozen-lockfile=false

echo "install: rust crates"
cargo fetch
cargo build --workspace --all-targets
echo "install: done"
