"""Generates the loam.jobs.v1 messages and Connect stubs into src/loam_jobs/_gen/.

Runs offline: `buf` (from the `buf-bin` wheel) compiles the protos itself, and
both plugins (`protoc-gen-py` for messages, `protoc-gen-connectrpc` for the
stubs) are Python packages run as local plugins. The package build hook
(hatch_build.py) calls `generate()`; run this file to regenerate by hand.

The protos come from, in order: $LOAM_JOBS_PROTO_DIR, the `proto/` copy an
sdist carries, or the repository's `proto/` two levels up.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parent.parent
OUTPUT_DIR = PACKAGE_ROOT / "src" / "loam_jobs" / "_gen"
PROTO_FILES = ("events.proto", "jobs.proto", "types.proto")
PROTO_SUBDIR = Path("loam") / "jobs" / "v1"


class GenerationError(RuntimeError):
    pass


def find_proto_root() -> Path:
    candidates = []
    if env := os.environ.get("LOAM_JOBS_PROTO_DIR"):
        candidates.append(Path(env))
    candidates += [PACKAGE_ROOT / "proto", PACKAGE_ROOT.parent.parent / "proto"]
    for root in candidates:
        if all((root / PROTO_SUBDIR / name).is_file() for name in PROTO_FILES):
            return root
    raise GenerationError(
        "cannot find loam/jobs/v1/*.proto; looked in " + ", ".join(str(c) for c in candidates)
    )


def find_tool(name: str) -> str:
    # Inside pip's isolated build environment the build requirements' scripts
    # are on PATH; in a plain venv they sit beside the interpreter.
    found = shutil.which(name)
    if found:
        return found
    for scripts in (sysconfig.get_path("scripts"), str(Path(sys.executable).parent)):
        candidate = Path(scripts) / name
        if candidate.is_file():
            return str(candidate)
    raise GenerationError(
        f"cannot find `{name}`; install the build requirements "
        "(buf-bin, protoc-gen-py, protoc-gen-connectrpc) listed in pyproject.toml"
    )


def generate(output_dir: Path = OUTPUT_DIR) -> list[Path]:
    proto_root = find_proto_root()
    buf = find_tool("buf")
    template = (
        "version: v2\n"
        "plugins:\n"
        f"  - local: {find_tool('protoc-gen-py')!r}\n"
        "    out: out\n"
        f"  - local: {find_tool('protoc-gen-connectrpc')!r}\n"
        "    out: out\n"
    )
    with tempfile.TemporaryDirectory(prefix="loam-jobs-gen-") as work:
        work_dir = Path(work)
        (work_dir / "buf.gen.yaml").write_text(template)
        # A buf.yaml of our own, so a directory input never picks up another
        # configuration (lint rules, deps) from around it.
        module_dir = work_dir / "module"
        shutil.copytree(proto_root / PROTO_SUBDIR, module_dir / PROTO_SUBDIR)
        (module_dir / "buf.yaml").write_text("version: v2\n")
        result = subprocess.run(
            [buf, "generate", str(module_dir), "--template", str(work_dir / "buf.gen.yaml")],
            cwd=work_dir,
            capture_output=True,
            text=True,
            check=False,
        )
        if result.returncode != 0:
            raise GenerationError(f"buf generate failed:\n{result.stdout}{result.stderr}")
        generated = work_dir / "out"
        if output_dir.exists():
            shutil.rmtree(output_dir)
        shutil.copytree(generated, output_dir)
    return sorted(p for p in output_dir.rglob("*.py"))


if __name__ == "__main__":
    try:
        files = generate()
    except GenerationError as err:
        sys.exit(f"generate.py: {err}")
    for path in files:
        print(path.relative_to(PACKAGE_ROOT))
