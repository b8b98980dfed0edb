#!/usr/bin/env bash
# Tests the Python client against real `loam-jobs serve` processes.
#
# Makes (or reuses) a virtualenv, installs the package with its test extras
# (the build generates the protobuf messages and Connect stubs), builds the
# server unless LOAM_JOBS_BIN names one, lints, and runs pytest.
#
#   LOAM_PY_VENV      the virtualenv (default: packages/python/.venv)
#   LOAM_JOBS_BIN     a loam-jobs binary to test against (default: build one)
#   CARGO_TARGET_DIR  where cargo builds it (default: the repository's target/)
#   PYTHON            the interpreter for a new virtualenv (default: python3, >= 3.11)
#
# Extra arguments go to pytest.
set -euo pipefail

package_dir="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
repo_root="$(cd "$package_dir/../.." && pwd)"
venv="${LOAM_PY_VENV:-$package_dir/.venv}"

if [[ ! -x "$venv/bin/python" ]]; then
  "${PYTHON:-python3}" -m venv "$venv"
fi
py="$venv/bin/python"

cd "$package_dir"
# The build requirements go into the venv itself and the package builds
# without isolation: after the first install, rebuilding needs no network.
mapfile -t build_requires < <("$py" -c 'import tomllib; print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["build-system"]["requires"]))')
"$py" -m pip install --quiet --disable-pip-version-check "${build_requires[@]}"
"$py" -m pip install --quiet --disable-pip-version-check --no-build-isolation ".[test]"

if [[ -z "${LOAM_JOBS_BIN:-}" ]]; then
  (cd "$repo_root" && cargo build --quiet -p loam-jobs-server)
  export LOAM_JOBS_BIN="${CARGO_TARGET_DIR:-$repo_root/target}/debug/loam-jobs"
fi

"$venv/bin/ruff" check src tests scripts hatch_build.py
"$venv/bin/ruff" format --check src tests scripts hatch_build.py
"$py" -m pytest "$@"
