"""Every third-party module that radixserve/ or tests/ imports is declared in pyproject.toml.

A module that is only present because the machine happened to have it (or because another
package pulled it in) passes on one machine and breaks a fresh virtualenv: CI once stayed
green while `scipy`, imported by four test files, was declared nowhere. This test reads the
imports of every file (inside functions and try blocks too) and the requirements written in
pyproject.toml now (not the installed metadata, which lags an edit until a reinstall)."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
from pathlib import Path
from typing import Dict, Iterable, Set

try:
    import tomllib
except ImportError:  # Python 3.10: pytest itself depends on tomli there
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ("radixserve", "tests")


def _normalize(dist: str) -> str:
    return re.sub(r"[-_.]+", "-", dist).lower()


def declared_distributions(pyproject: Path) -> Set[str]:
    """The distributions pyproject.toml names: its dependencies and every extra."""
    project = tomllib.loads(pyproject.read_text())["project"]
    reqs = list(project.get("dependencies", []))
    for extra in project.get("optional-dependencies", {}).values():
        reqs += extra
    return {_normalize(re.split(r"[\s;<>=!~\[(]", r, maxsplit=1)[0]) for r in reqs}


def imported_modules(files: Iterable[Path]) -> Dict[str, Set[str]]:
    """Top-level module name -> the files that import it (absolute imports only)."""
    found: Dict[str, Set[str]] = {}
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                found.setdefault(name.split(".")[0], set()).add(str(path.relative_to(ROOT)))
    return found


def undeclared_imports(pyproject: Path) -> Dict[str, str]:
    """Third-party modules imported under SCANNED whose distribution `pyproject` does not name:
    module -> why, naming a file that imports it."""
    files = [p for d in SCANNED for p in (ROOT / d).rglob("*.py")]
    # The project's own modules: the package, and the test helpers imported by path (siblings).
    local = {p.stem for p in files} | {p.parent.name for p in files} | {"radixserve"}
    declared = declared_distributions(pyproject)
    owners = importlib.metadata.packages_distributions()
    problems: Dict[str, str] = {}
    for module, where in sorted(imported_modules(files).items()):
        if module in sys.stdlib_module_names or module in local or _normalize(module) in declared:
            continue
        dists = owners.get(module)
        example = sorted(where)[0]
        if not dists:
            problems[module] = f"imported by {example}, but no installed distribution provides it"
        elif not {_normalize(d) for d in dists} & declared:
            problems[module] = f"imported by {example}, from {'/'.join(sorted(set(dists)))}, not declared in pyproject.toml"
    return problems


def test_every_imported_module_is_declared():
    problems = undeclared_imports(ROOT / "pyproject.toml")
    assert not problems, "undeclared imports:\n" + "\n".join(f"  {m}: {why}" for m, why in problems.items())


def test_removing_a_declared_dependency_is_caught(tmp_path):
    """The check itself: pyproject without scipy (imported by the speculative tests) fails naming it."""
    text = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'^\s*"scipy[^"]*",', text, flags=re.M), "scipy is no longer a declared test dependency"
    edited = tmp_path / "pyproject.toml"
    edited.write_text(re.sub(r'^\s*"scipy[^"]*",.*\n', "", text, flags=re.M))
    problems = undeclared_imports(edited)
    assert set(problems) == {"scipy"}, problems


def test_install_script_pins_the_sglang_frontend_extra():
    """scripts/install.sh --test installs SGLang's frontend with --no-deps (its requirements are
    its whole server); the version it installs is the one pyproject's sglang-frontend extra pins."""
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["sglang-frontend"]
    script = (ROOT / "scripts" / "install.sh").read_text()
    assert [f'--no-deps "{r}"' in script for r in extra] == [True] * len(extra), extra
