"""Kernels chosen by measurement (layers/gemm_select.py, issue 54): every CPU path of a matrix in
GGUF blocks, forced, gives the float32 product of the dequantized weight (to its own numerics'
error), and the automatic choice follows the timings: a stubbed timer that makes each path the
fastest in turn gets that path chosen, per row count; timings are cached per machine."""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from radixserve.layers import cpu_kernels, gemm_select
from radixserve.layers.gemm_select import ROW_BUCKETS, GemmPlan, GemmShape, select_paths
from radixserve.layers.quantization import gguf as quant_gguf
from radixserve.layers.quantization.gguf import QuantizedWeight, quant_matmul

# The error each path's numerics allow against the float32 product (relative L2): 8-bit
# activations per block; x rounded to bf16 (8 bits of mantissa); float32 (summation order only).
REL_TOL = {"int8": 2e-2, "int8_fused": 2e-2, "int8_i16": 2e-2, "onednn_bf16": 1e-2, "f32": 1e-5}


def make_weight(qtype: Q, n: int, k: int, seed: int = 0) -> QuantizedWeight:
    rng = np.random.default_rng(seed)
    try:
        data = gguf.quants.quantize(rng.standard_normal((n, k)).astype(np.float32) * 0.05, qtype)
    except NotImplementedError:  # the K-quants: random blocks with valid fp16 scales (d, dmin)
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        data = rng.integers(0, 256, (n, k // block, size), dtype=np.uint8)
        fields = [208] if qtype == Q.Q6_K else [0, 2]
        for off in fields:
            data[..., off:off + 2] = rng.uniform(1e-3, 1e-2, (n, k // block, 1)).astype(np.float16).view(np.uint8)
        data = data.reshape(n, -1)
    return QuantizedWeight(int(qtype), torch.from_numpy(np.ascontiguousarray(data)), k)


@pytest.fixture
def plan():
    """The process's plan, restored after the test."""
    saved = gemm_select.current_plan()
    yield
    gemm_select.set_plan(saved)


@pytest.fixture
def calls(monkeypatch):
    """Which path each quant_matmul call took."""
    taken = []
    for name, fn in dict(quant_gguf.CPU_PATHS).items():
        def spy(x, w, out=None, _fn=fn, _name=name):
            taken.append(_name)
            return _fn(x, w, out)
        monkeypatch.setitem(quant_gguf.CPU_PATHS, name, spy)
    return taken


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q8_0, Q.Q4_K, Q.Q6_K], ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 16, 70])
def test_each_forced_path_gives_the_float32_product(qtype, rows, plan, calls):
    w = make_weight(qtype, 80, 512)
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows))
    ref = (x.double() @ w.dequantize().double().T)
    paths = quant_gguf.cpu_paths(int(qtype))
    assert "f32" in paths
    for path in paths:
        gemm_select.set_plan(GemmPlan(forced=path))
        calls.clear()
        y = quant_matmul(x, w)
        assert calls == [path]  # the forced path ran, and only it
        assert y.dtype == torch.float32 and y.shape == (rows, 80)
        err = ((y.double() - ref).norm() / ref.norm()).item()
        assert err < REL_TOL[path], (path, err)


SHAPES = [GemmShape("Q4_K", 1536, 8960), GemmShape("Q6_K", 8960, 1536)]


def fake_candidates(shape: GemmShape, rows: int):
    """Calls that do nothing; the stubbed timer reads which path and row count each one is."""
    return {p: functools.partial(lambda **_: None, path=p, rows=rows) for p in gemm_select.PATHS}


def stub_timer(fastest):
    """A timer under which fastest(rows) is the fastest path (1 ms; the others 2 ms)."""
    seen = []

    def timer(path, call, give_up_s):
        seen.append((path, call.keywords["rows"]))
        return 1e-3 if path == fastest(call.keywords["rows"]) else 2e-3

    timer.seen = seen
    return timer


@pytest.mark.parametrize("winner", gemm_select.PATHS)
def test_the_choice_follows_the_timings(winner):
    sel = select_paths(SHAPES, fake_candidates, "build", timer=stub_timer(lambda rows: winner))
    for shape in SHAPES:
        for rows in (1, 7, 16, 40, 256, 3000):
            assert sel.plan.path(shape, rows, gemm_select.PATHS) == winner


def test_each_row_count_takes_its_buckets_winner():
    # int8 fastest at 1 and 16 rows, its fused decode at 8, f32 at 64 rows, onednn_bf16 from 256 on
    table = {1: "int8", 8: "int8_fused", 16: "int8", 64: "f32", 256: "onednn_bf16"}
    timer = stub_timer(lambda rows: table[rows])
    sel = select_paths(SHAPES, fake_candidates, "build", timer=timer)
    assert sorted(set(timer.seen)) == sorted({(p, r) for p in gemm_select.PATHS for r in ROW_BUCKETS})
    shape = SHAPES[0]
    expect = {1: "int8", 2: "int8_fused", 8: "int8_fused", 9: "int8", 16: "int8", 17: "f32", 64: "f32",
              65: "onednn_bf16", 512: "onednn_bf16"}
    assert {r: sel.plan.path(shape, r, gemm_select.PATHS) for r in expect} == expect
    # a path this matrix cannot take is never returned; a shape never measured takes the default
    assert sel.plan.path(shape, 512, ("int8", "f32")) == "int8"
    assert sel.plan.path(GemmShape("Q8_0", 64, 64), 512, ("f32",)) == "f32"


def test_forced_path_wins_over_the_timings():
    sel = select_paths(SHAPES, fake_candidates, "build", forced="f32", timer=stub_timer(lambda rows: "int8"))
    assert sel.plan.path(SHAPES[0], 1, gemm_select.PATHS) == "f32"
    assert sel.plan.path(SHAPES[0], 1, ("int8",)) == "int8"  # where the matrix cannot take it: the choice


def test_a_far_slower_candidate_is_timed_once():
    taken = []

    def timer(path, call, give_up_s):
        taken.append((path, give_up_s))
        return {"int8": 1.0, "onednn_bf16": 50.0, "f32": 2.0}[path]

    gemm_select.measure({p: None for p in ("int8", "onednn_bf16", "f32")}, timer)
    # the first has no limit; the others may stop once GIVE_UP_RATIO x the best so far is exceeded
    assert taken == [("int8", float("inf")), ("onednn_bf16", 3.0), ("f32", 3.0)]
    slow = gemm_select.best_time("x", lambda: __import__("time").sleep(0.002), give_up_s=0.001)
    assert slow >= 0.002


def test_timings_are_cached_per_machine(tmp_path, monkeypatch):
    cache = tmp_path / "gemm_select.json"
    first = stub_timer(lambda rows: "f32")
    a = select_paths(SHAPES, fake_candidates, "build", timer=first, cache=cache)
    assert first.seen and a.measured_s > 0 and cache.is_file()
    again = stub_timer(lambda rows: "int8")  # would choose otherwise, if it were asked
    b = select_paths(SHAPES, fake_candidates, "build", timer=again, cache=cache)
    assert not again.seen and b.measured_s == 0 and b.plan.choices == a.plan.choices
    # another thread count (or CPU, or kernel build) is another machine: measured again
    monkeypatch.setattr(torch, "get_num_threads", lambda: 97)
    c = select_paths(SHAPES, fake_candidates, "build", timer=again, cache=cache)
    assert again.seen and set(c.plan.choices.values()) == {"int8"}
    c2 = select_paths(SHAPES, fake_candidates, "other-build", timer=stub_timer(lambda rows: "f32"), cache=cache)
    assert set(c2.plan.choices.values()) == {"f32"}


def test_real_timer_on_real_weights_logs_its_choice(tmp_path, monkeypatch, plan, caplog):
    """select_cpu_gemm_paths on a module holding blocks: every shape measured with the real timer,
    the plan installed, one line per row bucket logged with the paths' times."""
    monkeypatch.setenv("RADIXSERVE_CACHE_DIR", str(tmp_path))
    gemm_select.set_plan(GemmPlan())  # models loaded earlier in this process added their shapes
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(torch.empty(0), requires_grad=False)
    layer.weight.gguf_blocks = make_weight(Q.Q8_0, 64, 256)
    with caplog.at_level(logging.INFO, logger=quant_gguf.__name__):
        sel = quant_gguf.select_cpu_gemm_paths(layer)
    shape = GemmShape("Q8_0", 256, 64)
    if len(quant_gguf.cpu_paths(int(Q.Q8_0))) == 1:  # no C++ kernels: one path, nothing to time
        assert sel.times == {} and gemm_select.current_plan().path(shape, 1, ("f32",)) == "f32"
        return
    assert set(sel.times) == {(shape, b) for b in range(len(ROW_BUCKETS))}
    for (_, b), t in sel.times.items():  # int8_fused only where it is not int8's own code
        timed = {p for p in quant_gguf.cpu_paths(int(Q.Q8_0)) if p != "int8_fused" or 4 < ROW_BUCKETS[b] <= 16}
        assert set(t) == timed and min(t.values()) > 0
    plan = gemm_select.current_plan()
    assert all(plan.choices[key] == path for key, path in sel.plan.choices.items())
    # a second model (a STANDALONE draft) adds its shapes; the first model's choices stay
    other = torch.nn.Module()
    other.weight = torch.nn.Parameter(torch.empty(0), requires_grad=False)
    other.weight.gguf_blocks = make_weight(Q.Q8_0, 32, 128)
    quant_gguf.select_cpu_gemm_paths(other)
    both = gemm_select.current_plan().choices
    assert {s for s, _ in both} == {shape, GemmShape("Q8_0", 128, 32)}
    text = caplog.text
    assert "CPU GEMM paths" in text and "rows 1:" in text and "rows 65+:" in text
    assert (tmp_path / "gemm_select.json").is_file()
    with pytest.raises(ValueError, match="--cpu-gemm-path"):
        bare = torch.nn.Module()
        bare.weight = torch.nn.Parameter(torch.empty(0), requires_grad=False)
        bare.weight.gguf_blocks = make_weight(Q.Q8_0, 64, 256)
        quant_gguf.select_cpu_gemm_paths(bare, forced="bogus")


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q8_0, Q.Q4_K, Q.Q6_K], ids=lambda t: t.name)
def test_int8_fused_is_int8_at_another_speed(qtype, plan):
    """int8_fused (the AVX2 build's fused decode for up to 16 rows of x) gives int8's bits at every
    row count, so the measured choice between them changes the speed only; elsewhere it is not
    offered."""
    if "int8_fused" not in quant_gguf.cpu_paths(int(qtype)):
        ops = cpu_kernels.get()
        assert ops is None or ops.quant_gemm_isa() != "avx2"
        return
    w = make_weight(qtype, 40, 512)
    for rows in (1, 3, 5, 8, 13, 16, 17, 40):
        x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows))
        gemm_select.set_plan(GemmPlan(forced="int8"))
        want = quant_matmul(x, w)
        gemm_select.set_plan(GemmPlan(forced="int8_fused"))
        assert torch.equal(quant_matmul(x, w), want), rows


@pytest.mark.parametrize("k", [512, 2560])  # 2560: two K chunks of the tiles (2048 + 512)
def test_int8_i16_sums_int8s_integers_in_other_lanes(k, plan):
    """int8_i16 (Q4_K, AVX2): from I16_TILES_MIN_ROWS rows on, the int16-sum tiles, whose weights and
    activations are permuted alike, give int8's products up to float rounding (the same integers
    in other lanes), and not int8's own code; fewer rows are int8's decode, int8's bits. Only Q4_K
    offers the path."""
    for qtype in (Q.Q4_0, Q.Q8_0, Q.Q6_K):
        assert "int8_i16" not in quant_gguf.cpu_paths(int(qtype))
    if "int8_i16" not in quant_gguf.cpu_paths(int(Q.Q4_K)):
        ops = cpu_kernels.get()
        assert ops is None or ops.quant_gemm_isa() != "avx2"
        return
    w = make_weight(Q.Q4_K, 44, k)
    differs = []
    for rows in (1, 5, 12, 13, 16, 17, 70):
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
        gemm_select.set_plan(GemmPlan(forced="int8"))
        want = quant_matmul(x, w)
        gemm_select.set_plan(GemmPlan(forced="int8_i16"))
        got = quant_matmul(x, w)
        if rows < cpu_kernels.I16_TILES_MIN_ROWS:
            assert torch.equal(got, want), rows
        else:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
            differs.append(not torch.equal(got, want))
    assert any(differs)  # the tiles ran their own float order


def test_timed_calls_take_the_shapes_matrices_in_turn(calls, monkeypatch):
    """A timing reads the blocks from memory as a forward does: each call of a candidate takes the
    next of the model's matrices of that shape, not the one the previous call left in the cache."""
    seen = []
    monkeypatch.setitem(quant_gguf.CPU_PATHS, "f32", lambda x, w, out=None: seen.append(w.data.data_ptr()))
    ws = [make_weight(Q.Q8_0, 64, 256, seed=s) for s in range(3)]
    shapes, candidates = quant_gguf.gemm_candidates(ws + [make_weight(Q.Q8_0, 32, 256)])
    assert shapes == [GemmShape("Q8_0", 256, 64), GemmShape("Q8_0", 256, 32)]
    call = candidates(shapes[0], 1)["f32"]
    for _ in range(4):
        call()
    assert seen == [w.data.data_ptr() for w in ws + ws[:1]]
