"""How the C++ kernels' build is named and locked (radixserve/layers/cpu_kernels.py), without
compiling them: the name is a hash of the sources' bytes (and the headers they include), the
flags and the toolchain, so installs with other sources never share a build directory; a lock
left by a killed builder is removed at once, one held by a live builder is left alone."""

import os
import subprocess
import sys
import threading
from pathlib import Path

from radixserve.layers import cpu_kernels

FLAGS = (["-O3"], ["-fopenmp"], ["torch 1", "c++"], "avx2")


def _sources(tmp_path: Path) -> list[Path]:
    src = tmp_path / "csrc"
    src.mkdir()
    (src / "a.cpp").write_text('#include "common.h"\n#include <vector>\nint a() { return 1; }\n')
    (src / "b.cpp").write_text("int b() { return 2; }\n")
    (src / "common.h").write_text('#include "detail/inner.h"\n')
    (src / "detail").mkdir()
    (src / "detail" / "inner.h").write_text("#define X 1\n")
    (src / "unused.h").write_text("#define Y 1\n")
    return [src / "a.cpp", src / "b.cpp"]


def _key(sources, cflags=FLAGS[0], ldflags=FLAGS[1], toolchain=FLAGS[2], isa=FLAGS[3]) -> str:
    return cpu_kernels.build_key(cpu_kernels.build_inputs(sources), cflags, ldflags, toolchain, isa)


def test_the_inputs_are_the_sources_and_the_headers_they_include(tmp_path):
    sources = _sources(tmp_path)
    names = {p.name for p in cpu_kernels.build_inputs(sources)}
    assert names == {"a.cpp", "b.cpp", "common.h", "inner.h"}  # not unused.h, not <vector>


def test_the_key_changes_with_a_source_byte_a_header_byte_and_the_flags(tmp_path):
    sources = _sources(tmp_path)
    key = _key(sources)
    assert len(key) == cpu_kernels.KEY_HEX and key == _key(sources)  # stable

    a = sources[0].read_bytes()
    sources[0].write_bytes(a.replace(b"return 1", b"return 3"))
    assert _key(sources) != key
    sources[0].write_bytes(a)
    assert _key(sources) == key

    inner = tmp_path / "csrc" / "detail" / "inner.h"
    inner.write_text("#define X 2\n")
    assert _key(sources) != key
    inner.write_text("#define X 1\n")
    (tmp_path / "csrc" / "unused.h").write_text("#define Y 2\n")  # not an input
    assert _key(sources) == key

    assert _key(sources, cflags=["-O2"]) != key
    assert _key(sources, ldflags=[]) != key
    assert _key(sources, toolchain=["torch 2", "c++"]) != key
    assert _key(sources, isa="avx512") != key


def test_the_same_sources_elsewhere_have_the_same_key(tmp_path):
    """A second checkout (a clone, a worktree) of the same commit shares the build."""
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    assert _key(_sources(tmp_path / "one")) == _key(_sources(tmp_path / "two"))


def test_the_extension_name_carries_the_isa_and_the_key():
    name = cpu_kernels.extension_name()
    prefix = f"radixserve_cpu_kernels_{cpu_kernels.isa_tag()}_"
    assert name.startswith(prefix) and len(name) == len(prefix) + cpu_kernels.KEY_HEX
    assert name.isidentifier()  # it is the pybind11 module's name too


def test_staged_sources_keep_their_bytes_and_layout_and_are_not_rewritten(tmp_path):
    """The build compiles copies under the build directory (the same paths in build.ninja for
    every checkout); a copy already there is not rewritten (a newer mtime makes ninja rebuild)."""
    sources = _sources(tmp_path)
    files = cpu_kernels.build_inputs(sources)
    build_dir = tmp_path / "build"
    staged = cpu_kernels.stage_sources(build_dir, files)
    assert staged[sources[0]] == build_dir / "src" / "a.cpp"
    assert (build_dir / "src" / "detail" / "inner.h").read_text() == "#define X 1\n"
    for f in files:
        os.utime(staged[f], ns=(1, 1))
    cpu_kernels.stage_sources(build_dir, files)
    assert all(staged[f].stat().st_mtime_ns == 1 for f in files)


HOLDER = """
import fcntl, sys
f = open(sys.argv[1], "a")
fcntl.flock(f, fcntl.LOCK_EX)
print("held", flush=True)
sys.stdin.read()  # hold until told to go (or killed)
"""


def _live_builder(build_dir: Path) -> subprocess.Popen:
    """A process holding the build lock, as a builder in the middle of load() does."""
    build_dir.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(build_dir / cpu_kernels.BUILD_LOCK)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_lock_left_by_a_killed_build_is_removed_at_once(tmp_path):
    """torch's `lock` with no process holding our flock: its builder died; removed now, not
    after minutes."""
    assert not cpu_kernels.remove_stale_lock(tmp_path)  # no lock
    (tmp_path / "lock").touch()  # as a build killed midway leaves it (fresh mtime)
    assert cpu_kernels.remove_stale_lock(tmp_path)
    assert not (tmp_path / "lock").exists()


def test_a_lock_held_by_a_live_builder_stays_until_it_dies(tmp_path):
    lock = tmp_path / "lock"
    lock.touch()
    proc = _live_builder(tmp_path)
    try:
        assert not cpu_kernels.remove_stale_lock(tmp_path)
        assert lock.exists()
    finally:
        proc.kill()
        proc.wait()
    assert cpu_kernels.remove_stale_lock(tmp_path)  # killed mid-build: cleared at once
    assert not lock.exists()


def test_a_second_builder_waits_for_the_first(tmp_path):
    """build() holds build_lock for its whole load(): a second process waits on it and enters
    only once the first is done (or dead)."""
    proc = _live_builder(tmp_path)
    entered = threading.Event()

    def second():
        with cpu_kernels.build_lock(tmp_path) as held:
            assert held
            entered.set()

    t = threading.Thread(target=second)
    t.start()
    try:
        assert not entered.wait(0.5)  # blocked while the first holds the lock
    finally:
        proc.stdin.close()  # the first finishes
        proc.wait()
    t.join(timeout=30)
    assert entered.is_set()
