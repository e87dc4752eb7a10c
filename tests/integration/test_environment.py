"""The environment the servers of these tests inherit is the one pytest was started with."""

import os

import conftest


def test_triton_interpreter_does_not_leak_into_the_servers():
    """The Triton unit tests run their kernels under TRITON_INTERPRET=1, set when their modules
    are imported at collection; the servers started here must not inherit it (on a GPU they
    would run interpreted kernels): tests/unit/conftest.py restores it after collection."""
    assert os.environ.get("TRITON_INTERPRET") == conftest.TRITON_INTERPRET_AT_START
