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

# The test command checks the code with rustfmt and clippy, which a minimal
# rustup profile leaves out.
cargo fmt --version >/dev/null 2>&1 || rustup component add rustfmt
cargo clippy --version >/dev/null 2>&1 || rustup component add clippy

echo "install: rust crates"
cargo fetch
cargo build --workspace --all-targets

# The Node addon (a debug build; `pnpm bench` builds the release one), so the
# examples run right after install.
if [ -f packages/bullmq/package.json ]; then
  echo "install: @loam/bullmq"
  pnpm --filter @loam/bullmq run build:native
  pnpm --filter @loam/bullmq run build:ts
fi
if [ -f packages/python/pyproject.toml ]; then
  echo "install: python client (packages/python/.venv)"
  bash packages/python/scripts/install.sh
fi
echo "install: done"
