#!/usr/bin/env bash
# Runs every test of the project: Rust (unit, property, crash), then the
# TypeScript and Python packages that have tests. Ends with one total line.
set -euo pipefail
cd "$(dirname "$0")/.."
log=$(mktemp)
trap 'rm -f "$log"' EXIT

pnpm lint:proto
# One format for the Rust code (rustfmt.toml); a diff fails the run before the build.
cargo fmt --all --check
# The workspace's lint policy (Cargo.toml, [workspace.lints]), warnings as errors,
# over every feature (the addon's test hooks among them).
cargo clippy --workspace --all-targets --all-features -- -D warnings
cargo test --workspace 2>&1 | tee -a "$log"
# The remote tests of @loam/bullmq and the Python client run against the server
# that `cargo test` built for its own integration tests (a separate
# `cargo build -p` would resolve other features and build every crate again).
export LOAM_JOBS_BIN="${CARGO_TARGET_DIR:-$PWD/target}/debug/loam-jobs"
test -x "$LOAM_JOBS_BIN" || { echo "test: cargo test did not build $LOAM_JOBS_BIN" >&2; exit 1; }
if [ -n "$(ls packages/*/package.json test/*/package.json 2>/dev/null)" ]; then
  pnpm -r --if-present run test 2>&1 | tee -a "$log"
fi
if [ -f packages/python/pyproject.toml ]; then
  bash packages/python/scripts/test.sh -q 2>&1 | tee -a "$log"
fi

# cargo: "test result: ok. 12 passed; 0 failed; ..."; vitest: "Tests  12 passed (12)" or "Tests  1 failed | 11 passed (12)";
# pytest -q: "41 passed in 8.57s" or "1 failed, 40 passed, 2 skipped in 9.01s".
python3 - "$log" <<'PY'
import re, sys
text = open(sys.argv[1], errors="replace").read()
text = re.sub(r"\x1b\[[0-9;]*m", "", text)
passed = failed = 0
for m in re.finditer(r"test result: \w+\. (\d+) passed; (\d+) failed", text):
    passed += int(m.group(1)); failed += int(m.group(2))
# pnpm prefixes a package's output with "<dir> test: ".
for line in re.findall(r"^(?:\S+ test: )?\s*Tests\s+(.*)$", text, re.M):
    p = re.search(r"(\d+) passed", line); f = re.search(r"(\d+) failed", line)
    passed += int(p.group(1)) if p else 0
    failed += int(f.group(1)) if f else 0
for line in re.findall(r"^=*\s*((?:\d+ (?:passed|failed|errors?|skipped|xfailed|xpassed|warnings?|deselected)(?:, )?)+) in [\d.]+s", text, re.M):
    p = re.search(r"(\d+) passed", line); f = re.search(r"(\d+) failed", line); e = re.search(r"(\d+) errors?", line)
    passed += int(p.group(1)) if p else 0
    failed += (int(f.group(1)) if f else 0) + (int(e.group(1)) if e else 0)
print(f"total: {passed} passed, {failed} failed")
sys.exit(1 if failed else 0)
PY
