"""parallel_for_dynamic's worker pool (csrc/parallel.h, issue 54): a region ends when its chunks
are done, not when every thread has arrived, so a thread that lost its core (here: held by a
test hook) does not hold up the caller; the kernels give the same bits whichever division runs
them; exceptions reach the caller; the thread count follows torch.set_num_threads."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from typing import Callable, Iterator, List

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from radixserve.layers import cpu_kernels
from radixserve.model_executor.forward_batch import ForwardMode

from paged_kv import make_attention_batch

GENEROUS_S = 60.0  # a bound on calls that take well under a second; not a timing assertion


@pytest.fixture(scope="module")
def ops():
    mod = cpu_kernels.get()
    assert mod is not None, "the C++ CPU kernels did not build (see the warning logged by cpu_kernels.build)"
    return mod


@pytest.fixture
def threads_and_division(ops) -> Iterator[None]:
    """Restore the thread count, the division and the test hold after a test."""
    threads, division = torch.get_num_threads(), ops.parallel_division()
    yield
    ops.parallel_test_release()
    ops.set_parallel_division(division)
    torch.set_num_threads(threads)


def _in_thread(fn: Callable[[], object]) -> tuple[threading.Thread, list]:
    """fn() in a Python thread (the test kernels release the GIL): (thread, [its result])."""
    out: list = []
    t = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    t.start()
    return t, out


def _completes(ops, n: int) -> torch.Tensor:
    """parallel_for_visits(n, 1), which must return within GENEROUS_S (a region that waited for
    a held thread would not return until the test released it)."""
    t, out = _in_thread(lambda: ops.parallel_for_visits(n, 1))
    t.join(GENEROUS_S)
    assert not t.is_alive(), "the region waited for the stalled worker"
    return out[0]


def _wait_until(cond: Callable[[], bool], what: str, step: Callable[[], object] = lambda: None) -> None:
    deadline = time.monotonic() + GENEROUS_S
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        step()
        time.sleep(0.001)


def test_divisions_switch(ops, threads_and_division):
    for name in ("omp", "static", "pool"):
        ops.set_parallel_division(name)
        assert ops.parallel_division() == name
    with pytest.raises(RuntimeError, match="expected 'pool', 'omp' or 'static'"):
        ops.set_parallel_division("dynamic")


def _division_in_a_new_process(imports: str, **env: str) -> str:
    """The kernels' division right after `imports` in a fresh interpreter with `env` added."""
    code = f"{imports}\nfrom radixserve.layers import cpu_kernels\nprint(cpu_kernels.get().parallel_division())"
    clean = {k: v for k, v in os.environ.items()
             if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "RADIXSERVE_OMP_DEFAULTS", "RADIXSERVE_PARALLEL_DIVISION",
                          "RADIXSERVE_PARALLEL_STATIC")}
    out = subprocess.run([sys.executable, "-c", code], env={**clean, **env}, capture_output=True, text=True,
                         timeout=600, check=True)
    return out.stdout.split()[-1]


def test_the_pool_is_the_default_where_libgomp_waits_briefly():
    """radixserve imported before torch sets GOMP_SPINCOUNT in time: the pool. torch first keeps
    libgomp's default spin (ms after each torch op, on the core the pool's worker needs): OpenMP's
    own threads, unless the user's settings make the wait short or name a division."""
    assert _division_in_a_new_process("import radixserve, torch") == "pool"
    assert _division_in_a_new_process("import torch, radixserve") == "omp"
    assert _division_in_a_new_process("import torch, radixserve", GOMP_SPINCOUNT="1000") == "pool"
    assert _division_in_a_new_process("import torch, radixserve", OMP_WAIT_POLICY="passive") == "pool"
    assert _division_in_a_new_process("import torch, radixserve", GOMP_SPINCOUNT="300000") == "omp"
    assert _division_in_a_new_process("import torch, radixserve", RADIXSERVE_PARALLEL_DIVISION="pool") == "pool"
    assert _division_in_a_new_process("import radixserve, torch", RADIXSERVE_OMP_DEFAULTS="0") == "omp"
    assert _division_in_a_new_process("import torch, radixserve", RADIXSERVE_PARALLEL_STATIC="1") == "static"


def test_the_pool_is_left_only_under_a_long_wait_and_no_named_division():
    assert not cpu_kernels.leave_the_pool(True, {})
    assert cpu_kernels.leave_the_pool(False, {})
    assert not cpu_kernels.leave_the_pool(False, {"RADIXSERVE_PARALLEL_DIVISION": "pool"})


def test_caller_does_not_wait_for_a_stalled_worker(ops, threads_and_division):
    """Worker 1 is held (as if its core were taken) from the moment it wakes for a region; a
    region published while it is held still completes, the caller doing every chunk. On the
    OpenMP division the same hold blocks the call at the region's barrier (next test)."""
    torch.set_num_threads(2)
    ops.set_parallel_division("pool")
    ops.parallel_test_hold(1)
    # regions until worker 1 wakes for one and stalls; each must complete meanwhile
    _wait_until(ops.parallel_test_held, "worker 1 to stall", step=lambda: _completes(ops, 64))
    out = _completes(ops, 1000)
    assert ops.parallel_test_held()  # it completed while the worker was still held
    assert out.tolist() == [1] * 1000
    ops.parallel_test_release()
    # the late worker wakes into later regions: it must find nothing of the finished one to run
    for n in (7, 64, 1000) * 50:
        assert ops.parallel_for_visits(n, 1).tolist() == [1] * n
    _wait_until(lambda: not ops.parallel_test_held(), "worker 1 to be released")


def test_the_openmp_division_waits_for_a_stalled_thread(ops, threads_and_division):
    """What the pool fixes, and what makes the test above discriminate: the same hold on OpenMP
    thread 1 keeps the call in its region (the implicit barrier) until the thread is released."""
    torch.set_num_threads(2)
    ops.set_parallel_division("omp")
    ops.parallel_test_hold(1)
    t, out = _in_thread(lambda: ops.parallel_for_visits(1000, 1))
    _wait_until(ops.parallel_test_held, "OpenMP thread 1 to stall")
    t.join(1.0)
    assert t.is_alive()  # blocked on the hold, not on time: it cannot have returned
    ops.parallel_test_release()
    t.join(GENEROUS_S)
    assert not t.is_alive() and out[0].tolist() == [1] * 1000


@pytest.mark.parametrize("division", ["pool", "omp"])
def test_exceptions_reach_the_caller(ops, threads_and_division, division):
    torch.set_num_threads(2)
    ops.set_parallel_division(division)
    for bad in (0, 57, 99):
        with pytest.raises(RuntimeError, match=f"parallel_for_throw: item {bad}"):
            ops.parallel_for_throw(100, 1, bad)
        assert ops.parallel_for_visits(100, 1).tolist() == [1] * 100  # the pool still works


@pytest.mark.parametrize("division", ["pool", "omp"])
def test_thread_ids_follow_set_num_threads(ops, threads_and_division, division):
    """at::get_thread_num() in a chunk is a distinct id in [0, threads) per running thread (the
    kernel checks the range); every thread takes part (each waits for the others), and a smaller
    count after a larger one leaves the extra workers out."""
    ops.set_parallel_division(division)
    for threads in (1, 2, 3, 2, 1):
        torch.set_num_threads(threads)
        assert ops.parallel_thread_ids(8 * threads, threads, GENEROUS_S) == list(range(threads))


# ---- the kernels: the same bits with the pool and the OpenMP division, 1 and 2 threads ----------
def _quant_weight(qtype: Q, n: int, k: int) -> torch.Tensor:
    rng = np.random.default_rng(int(qtype))
    return torch.from_numpy(gguf.quants.quantize(rng.standard_normal((n, k)).astype(np.float32) * 0.05, qtype))


def _kernel_outputs(ops) -> List[torch.Tensor]:
    """Outputs of the kernels on inputs with enough work items for several chunks per thread."""
    from radixserve.layers.attention.torch_native_backend import TorchNativeAttnBackend

    outs: List[torch.Tensor] = []
    seq_lens = [5, 40, 130, 300, 700] * 3
    fb, q, k, v, layer = make_attention_batch(ForwardMode.DECODE, [s - 1 for s in seq_lens], [1] * len(seq_lens),
                                              8, 2, 64, 16, seed=5, dtype=torch.float32)
    be = TorchNativeAttnBackend("cpu")
    be.init_forward_metadata(fb)
    outs.append(be.forward(q, k, v, layer, fb))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, 576, generator=g)
    res = torch.randn(37, 576, generator=g)
    outs += list(ops.fused_add_rmsnorm(x, res.clone(), torch.rand(576, generator=g) + 0.5, 1e-5))
    outs.append(ops.silu_and_mul(torch.randn(37, 2 * 1536, generator=g)))
    if ops.has_bf16_gemm():
        w = torch.randn(1536, 576, generator=g).bfloat16()
        packed = ops.pack_bf16_weight(w)
        for m in (1, 16, 130):
            outs.append(ops.bf16_linear(torch.randn(m, 576, generator=g), packed, 1536))
    if ops.has_quant_gemm():
        for qtype in (Q.Q8_0, Q.Q4_0):
            data = _quant_weight(qtype, 512, 576)
            for m in (1, 5, 130):
                outs.append(ops.quant_linear(torch.randn(m, 576, generator=g), data, int(qtype), 576))
    return outs


def test_kernels_give_the_same_bits_in_every_division_and_thread_count(ops, threads_and_division):
    torch.set_num_threads(2)
    ops.set_parallel_division("omp")
    ref = _kernel_outputs(ops)
    for division in ("pool", "omp"):
        for threads in (1, 2):
            ops.set_parallel_division(division)
            torch.set_num_threads(threads)
            got = _kernel_outputs(ops)
            for i, (a, b) in enumerate(zip(got, ref)):
                assert torch.equal(a, b), f"output {i} differs with {division} at {threads} threads"
