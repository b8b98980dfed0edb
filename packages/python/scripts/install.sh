#!/usr/bin/env bash
# Makes (or reuses) a virtualenv and installs the Python client with its test
# extras into it. The build generates the protobuf messages and Connect stubs
# (scripts/generate.py); its requirements are installed into the venv first
# and the package is built without isolation, so that after the first install
# a rebuild needs no network.
#
#   LOAM_PY_VENV  the virtualenv (default: packages/python/.venv)
#   PYTHON        the interpreter for a new virtualenv (default: python3, >= 3.11)
set -euo pipefail

package_dir="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${LOAM_PY_VENV:-$package_dir/.venv}"

if [[ ! -x "$venv/bin/python" ]]; then
  python="${PYTHON:-python3}"
  # Debian ships `venv` without ensurepip, in a package of its own.
  # (Only for the system's python3, as root or through sudo; elsewhere venv
  # says itself what is missing.)
  sudo=""
  if [[ "$(id -u)" != "0" ]]; then sudo="sudo"; fi
  if [[ "$(command -v "$python")" == /usr/bin/python3* ]] && ! "$python" -c 'import ensurepip' 2>/dev/null \
    && command -v apt-get >/dev/null && { [[ -z "$sudo" ]] || command -v sudo >/dev/null; }; then
    echo "install: python3-venv"
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq python3-venv >/dev/null
  fi
  "$python" -m venv "$venv"
fi
py="$venv/bin/python"

cd "$package_dir"
mapfile -t build_requires < <("$py" -c 'import tomllib; print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["build-system"]["requires"]))')
"$py" -m pip install --quiet --disable-pip-version-check "${build_requires[@]}"
"$py" -m pip install --quiet --disable-pip-version-check --no-build-isolation ".[test]"
