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


# ---- issue 40: KV has one owner, the worker is a protocol --------------------------------------
import ast  # noqa: E402

PKG = REPO_ROOT / "radixserve"


def _receiver(node: ast.AST) -> str:
    """The last name of what an attribute is read from: `self.ledger.x` -> "ledger"."""
    return node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else ""


def _attribute_uses(dirs: list, names: set, allowed_receivers: tuple = ()) -> list:
    """`x.<name>` and getattr(x, "<name>") for each name in `names`, in the .py files under `dirs`,
    unless x is one of `allowed_receivers`."""
    hits = []
    for d in dirs:
        for path in sorted((PKG / d).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                name = obj = None
                if isinstance(node, ast.Attribute) and node.attr in names:
                    name, obj = node.attr, node.value
                elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
                      and len(node.args) > 1 and isinstance(node.args[1], ast.Constant) and node.args[1].value in names):
                    name, obj = node.args[1].value, node.args[0]
                if name is not None and _receiver(obj) not in allowed_receivers:
                    hits.append(f"{path.relative_to(REPO_ROOT)}:{node.lineno} {name}")
    return hits


def test_managers_and_speculative_do_not_reach_into_the_model_runner():
    """What they need of the model is a method of the worker's protocol (model_executor/worker_protocol.py)."""
    assert _attribute_uses(["managers", "speculative"], {"model_runner"}) == []


def test_only_the_ledger_touches_kv_pools_outside_mem_cache():
    """Rows, slots and locks go through mem_cache/kv_ledger.py: the scheduler's side never names the
    pools, the allocator, the tree's locks or its cache-finishing calls except on a ledger (the
    Scheduler builds the ledger from the worker's pools: those two names are its own)."""
    kv_names = {"req_to_token_pool", "token_to_kv_pool", "token_to_kv_pool_allocator", "inc_lock_ref", "dec_lock_ref",
                "cache_finished_req", "cache_unfinished_req", "write_spans", "move_kv_cache", "free_group_begin",
                "evict_extra_key", "init_load_back"}  # (match_prefix locks nothing: the policy's ordering reads the tree)
    hits = [h for h in _attribute_uses(["managers", "speculative", "disaggregation", "lora", "entrypoints"], kv_names,
                                       allowed_receivers=("ledger",))
            if not (h.startswith("radixserve/managers/scheduler.py") and h.endswith(("req_to_token_pool", "token_to_kv_pool_allocator")))]
    assert hits == [], hits


def test_kv_rows_slots_and_lengths_are_written_in_mem_cache_only():
    """Issue 40's done-when: outside mem_cache/ (and the model executor, layers and models, which
    build and read the pools), nothing allocates, frees, locks or writes KV on a pool, the
    allocator or the tree, and nothing sets a request's KV lengths (the ledger's); the benchmarks
    and the speculative overlap view included. Req's own declaration of the lengths is exempt."""
    owners = {"req_to_token_pool", "token_to_kv_pool_allocator", "token_to_kv_pool", "allocator", "tree_cache"}
    ops = {"alloc", "alloc_extend", "free", "write", "write_spans", "inc_lock_ref", "dec_lock_ref",
           "cache_finished_req", "cache_unfinished_req", "move_kv_cache", "evict_extra_key"}
    lengths = {"kv_committed_len", "kv_allocated_len"}
    hits = []
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG)
        if rel.parts[0] in ("mem_cache", "model_executor", "layers", "models"):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ops \
                    and _receiver(node.func.value) in owners:
                hits.append(f"{rel}:{node.lineno} {node.func.attr}")
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                node, (ast.AugAssign, ast.AnnAssign)) else []
            for t in targets:
                if isinstance(t, ast.Attribute) and t.attr in lengths and not (
                        str(rel) == "managers/schedule_batch.py" and _receiver(t.value) == "self"):
                    hits.append(f"{rel}:{node.lineno} {t.attr}")
    assert hits == [], hits
