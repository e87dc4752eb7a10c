"""Issue 15, "no layer breaks": `lint-imports` keeps the contracts in pyproject.toml
([tool.importlinter]). Layers, top to bottom: entrypoints / cli / engine / launch / bench / sim
> managers > model_executor > models > layers, mem_cache, sampling, constrained, distributed >
protocol, sampling_params, server_args, utils (pyproject.toml has the full lists); mem_cache,
layers and models import neither managers nor model_executor; no import cycles between the
modules of a package. Imports inside functions and under `if TYPE_CHECKING:` count."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


def _lint_imports_command() -> list:
    if importlib.util.find_spec("importlinter") is None:
        pytest.fail("import-linter is missing: it is a test dependency (bash scripts/install.sh --test)")
    # The console script installed beside this interpreter, else its entry point (no __main__).
    script = Path(sys.executable).with_name("lint-imports")
    if script.exists():
        return [str(script)]
    return [sys.executable, "-c", "from importlinter.cli import lint_imports_command as c; c()"]


def test_import_contracts_are_kept():
    env = dict(os.environ)
    # Analyse this checkout's radixserve, whichever copy the environment has installed.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    proc = subprocess.run(
        _lint_imports_command() + ["--no-cache", "--no-logo", "--config", str(REPO_ROOT / "pyproject.toml")],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, f"lint-imports failed (exit {proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    assert "0 broken" in proc.stdout, proc.stdout
