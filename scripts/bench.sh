#!/usr/bin/env bash
# Benchmarks (not timed tests): the core's own bench, then the packages' benches.
set -euo pipefail
cd "$(dirname "$0")/.."

# The BullMQ comparison runs Redis beside Loam: install it where missing
# (Debian's package; the bench starts its own server on a loopback port).
if ! command -v redis-server >/dev/null 2>&1; then
  echo "bench: installing redis-server"
  SUDO=""
  if [ "$(id -u)" != "0" ]; then SUDO="sudo"; fi
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq redis-server >/dev/null
fi
cargo run --release -p loam-jobs-bench -- "$@"
# The BullMQ comparison also runs through loamBackend({ url }) on this server.
cargo build --release -p loam-jobs-server
if [ -n "$(ls packages/*/package.json 2>/dev/null)" ]; then
  pnpm -r --if-present run bench
fi
