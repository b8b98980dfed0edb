"""Hatch build hook: generate the protobuf messages and Connect stubs before
every wheel, editable or sdist build (see scripts/generate.py)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from hatchling.builders.hooks.plugin.interface import BuildHookInterface


class GenerateProtosHook(BuildHookInterface):
    PLUGIN_NAME = "custom"

    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        if self.target_name == "sdist":
            # An sdist ships the protos, not generated code.
            return
        script = Path(self.root) / "scripts" / "generate.py"
        spec = importlib.util.spec_from_file_location("loam_jobs_generate", script)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        module.generate()
