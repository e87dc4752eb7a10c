"""radixserve sets libgomp's spin count at import (radixserve/__init__.py, issue 54), before torch
loads libgomp, unless the user chose a wait policy or spin count, or RADIXSERVE_OMP_DEFAULTS=0."""

import os
import subprocess
import sys

import pytest

import radixserve

PROBE = "import os, radixserve; print(os.environ.get('GOMP_SPINCOUNT'), os.environ.get('OMP_WAIT_POLICY'))"


def _probe(**env_over: str) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY", "RADIXSERVE_OMP_DEFAULTS")}
    env.update(env_over)
    return subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True).stdout.strip()


def test_import_sets_the_spin_count():
    assert _probe() == f"{radixserve.OMP_SPINCOUNT} None"


@pytest.mark.parametrize("user", [{"GOMP_SPINCOUNT": "12345"}, {"OMP_WAIT_POLICY": "PASSIVE"}, {"OMP_WAIT_POLICY": "active"}])
def test_a_users_setting_is_kept(user):
    out = _probe(**user)
    assert out == f"{user.get('GOMP_SPINCOUNT')} {user.get('OMP_WAIT_POLICY')}"


def test_opt_out():
    assert _probe(RADIXSERVE_OMP_DEFAULTS="0") == "None None"


def test_spawned_children_inherit_it():
    """The scheduler and detokenizer are spawned: a fresh interpreter gets the parent's environment."""
    code = ("import multiprocessing as mp, os, radixserve\n"
            "with mp.get_context('spawn').Pool(1) as pool: print(pool.apply(os.getenv, ('GOMP_SPINCOUNT',)))\n")
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY", "RADIXSERVE_OMP_DEFAULTS")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout.strip()
    assert out == radixserve.OMP_SPINCOUNT
