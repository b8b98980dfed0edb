#!/usr/bin/env bash
# Tests the Python client against real `loam-jobs serve` processes: installs
# it into its virtualenv (scripts/install.sh), builds the server unless
# LOAM_JOBS_BIN names one, lints, and runs pytest.
#
#   LOAM_PY_VENV      the virtualenv (default: packages/python/.venv)
#   LOAM_JOBS_BIN     a loam-jobs binary to test against (default: build one)
#   CARGO_TARGET_DIR  where cargo builds it (default: the repository's target/)
#
# Extra arguments go to pytest.
set -euo pipefail

package_dir="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
repo_root="$(cd "$package_dir/../.." && pwd)"
venv="${LOAM_PY_VENV:-$package_dir/.venv}"

bash "$package_dir/scripts/install.sh"

if [[ -z "${LOAM_JOBS_BIN:-}" ]]; then
  (cd "$repo_root" && cargo build --quiet -p loam-jobs-server)
  export LOAM_JOBS_BIN="${CARGO_TARGET_DIR:-$repo_root/target}/debug/loam-jobs"
fi

cd "$package_dir"
"$venv/bin/ruff" check src tests scripts hatch_build.py
"$venv/bin/ruff" format --check src tests scripts hatch_build.py
"$venv/bin/mypy"
"$venv/bin/python" -m pytest "$@"
