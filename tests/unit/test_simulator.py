"""The scheduler simulator (radixserve/sim): the real Scheduler over a simulated worker on a
virtual clock, its cost model, and the `radixserve simulate` command."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from radixserve.bench.datasets import DatasetRow, arrival_times, sample_generated_shared_prefix, sample_random
from radixserve.bench.metrics import RequestOutput, calculate_metrics
from radixserve.server_args import ServerArgs
from radixserve.sim.command import SWEEP_COLUMNS
from radixserve.sim.cost_model import CostModel, fit_cpu_device, get_device, load_one_batch_points, predict_point
from radixserve.sim.models import load_model_config
from radixserve.sim.simulator import simulate
from radixserve.sim.worker import SimModelWorker

REPO = Path(__file__).resolve().parents[2]
# Keep the req_to_token table small: the 8B config's context is 8192.
SMALL = dict(context_length=4096, max_running_requests=128)


@pytest.fixture(scope="module")
def llama8b():
    return load_model_config("llama-3-8b")


def gsp_rows(vocab: int, seed: int = 1):
    # 16 groups x 8 prompts sharing a 1024-token system prompt, interleaved: a queue in which
    # the order matters for the cache.
    return sample_generated_shared_prefix(16, 8, 1024, 64, 32, vocab, seed, shuffle=True)


def run(cfg, rows, device="h100", **server):
    return simulate(ServerArgs(**{**SMALL, **server}), cfg, get_device(device), rows)


# ---- scheduling outcomes -----------------------------------------------------------------------
def test_lpm_has_a_higher_cache_hit_rate_than_fcfs_on_shared_prefixes(llama8b):
    rows = gsp_rows(llama8b.vocab_size)
    # A pool that holds a few groups' prefixes at a time: the order of admission decides hits.
    fcfs = run(llama8b, rows, schedule_policy="fcfs", max_total_tokens=8000)
    lpm = run(llama8b, rows, schedule_policy="lpm", max_total_tokens=8000)
    for res in (fcfs, lpm):
        assert res.metrics["completed"] == len(rows)
        assert [o.output_len for o in res.outputs] == [r.output_len for r in rows]
    assert lpm.metrics["cache_hit_rate"] > fcfs.metrics["cache_hit_rate"] + 0.1
    # More hits, less prefill: the same work finishes sooner.
    assert lpm.metrics["duration"] < fcfs.metrics["duration"]


def test_deterministic_for_a_seed(llama8b):
    rows = gsp_rows(llama8b.vocab_size, seed=3)
    kw = dict(schedule_policy="lpm", max_total_tokens=12000, chunked_prefill_size=512, enable_mixed_chunk=True)

    def once():
        res = simulate(ServerArgs(**SMALL, **kw), llama8b, get_device("h100"), rows, request_rate=40.0, seed=3)
        return res.metrics, [(o.ttft, o.latency, tuple(o.itl)) for o in res.outputs]

    a, b = once(), once()
    assert a == b
    other = simulate(ServerArgs(**SMALL, **kw), llama8b, get_device("h100"), rows, request_rate=40.0, seed=4)
    assert other.metrics != a[0]  # the seed changes the arrival times


def test_every_request_finishes_and_memory_is_released(llama8b):
    rows = sample_random(60, 50, 600, 0.2, llama8b.vocab_size, seed=5)
    # Long outputs in a small pool: the running requests' decode outgrows it (retraction).
    res = run(llama8b, rows, max_total_tokens=4000, chunked_prefill_size=256)
    assert res.metrics["completed"] == 60 and not res.errors
    assert res.scheduler_stats["num_retracted_reqs"] > 0
    for o, r in zip(res.outputs, rows):
        assert o.output_len == r.output_len
        assert o.ttft > 0 and o.latency >= o.ttft
        assert len(o.itl) == r.output_len - 1
    # (Simulator.run ends with Scheduler.check_memory(): every slot is free or in the tree.)


def test_arrival_times_and_max_concurrency(llama8b):
    rows = [DatasetRow(None, list(range(10 + i, 110 + i)), 100, 20, arrival_time=0.5 * i) for i in range(8)]
    res = run(llama8b, rows)
    for o, r in zip(res.outputs, rows):
        assert o.start_time == pytest.approx(r.arrival_time)
    # Concurrency 2: never more than two requests between send and finish.
    rows2 = [DatasetRow(None, list(range(10 + i, 110 + i)), 100, 20) for i in range(10)]
    args = ServerArgs(**SMALL)
    res2 = simulate(args, llama8b, get_device("h100"), rows2, max_concurrency=2)
    spans = [(o.start_time, o.start_time + o.latency) for o in res2.outputs]
    for t, _ in spans:
        assert sum(1 for s, e in spans if s <= t < e) <= 2
    assert res2.metrics["concurrency"] <= 2.0 + 1e-9


def test_poisson_arrivals_have_the_requested_rate():
    times = arrival_times(2000, 10.0, 1.0, seed=1)
    assert times[0] == 0.0 and times == sorted(times)
    assert 2000 / times[-1] == pytest.approx(10.0, rel=0.1)
    assert arrival_times(5, float("inf"), 1.0, 1) == [0.0] * 5


def test_metrics_definitions():
    a = RequestOutput(success=True, prompt_len=10, output_len=5, ttft=0.1, latency=0.5, itl=[0.1] * 4)
    b = RequestOutput(success=False)
    m = calculate_metrics([a, b], duration=2.0)
    assert m["completed"] == 1 and m["failed"] == 1
    assert m["mean_tpot_ms"] == pytest.approx(100.0)
    assert m["output_throughput"] == pytest.approx(2.5)
    assert m["total_throughput"] == pytest.approx(7.5)
    assert m["p99_itl_ms"] == pytest.approx(100.0)


# ---- the simulated worker and the cost model -----------------------------------------------------
def test_pool_sized_from_device_memory(llama8b):
    worker = SimModelWorker(ServerArgs(**SMALL, mem_fraction_static=0.85), llama8b, get_device("h100"))
    weights = 8.03e9 * 2  # Llama-3-8B in bf16
    kv_per_token = 2 * 32 * 8 * 128 * 2
    assert worker.max_total_num_tokens == pytest.approx((80e9 * 0.85 - weights) / kv_per_token, rel=0.01)
    h200 = SimModelWorker(ServerArgs(**SMALL), llama8b, get_device("h200"))
    assert h200.max_total_num_tokens > 1.9 * worker.max_total_num_tokens  # 141 GB vs 80 GB, same weights
    assert worker.token_id not in llama8b.eos_token_ids


def test_roofline_shapes(llama8b):
    cm = CostModel(llama8b, get_device("h100"))
    assert cm.shape.weight_bytes == pytest.approx(16.06e9, rel=0.01)
    # Decode at batch 1 is memory-bound: about the weights it reads (all but the input
    # embedding, of which it reads one row) over the effective bandwidth.
    t1 = cm.decode_time(1, 1024)
    read = 16.06e9 - 128256 * 4096 * 2
    assert t1 == pytest.approx(read / (3.35e12 * 0.8) + 3e-4, rel=0.05)
    # Larger batches cost more per step but much less per token.
    t64 = cm.decode_time(64, 1024)
    assert t1 < t64 < 64 * t1 / 10
    # A long prefill is compute-bound: about 2 * params * tokens / effective FLOP/s.
    c = cm.step([8192], [0])
    assert c.compute_s > c.memory_s
    assert cm.prefill_time(1, 8192) > 8192 * 2 * 7e9 / 989e12 / 0.6 * 0.9
    # A cached prefix makes the same extend cheaper than computing it.
    assert cm.step([128], [4096]).seconds < cm.step([4224], [0]).seconds
    h200 = CostModel(llama8b, get_device("h200"))
    assert h200.decode_time(1, 1024) < t1


CALIBRATION = REPO / "benchmarks" / "simulate_cpu_calibration.json"


def calibration_points():
    """`bench one-batch` on this machine (tiny model, float32), batch sizes 1-64, input 128
    and 512, prefill and decode: the fastest of several runs of each point, kept in
    benchmarks/simulate_cpu_calibration.json (the cpu preset was fitted on these)."""
    if not CALIBRATION.exists():
        pytest.skip("no CPU calibration measurements")
    report = json.loads(CALIBRATION.read_text())
    if report.get("device") != "cpu" or report.get("model_path") not in (None, "tiny (embedded)"):
        pytest.skip("not a tiny-model CPU measurement")
    return load_one_batch_points([str(CALIBRATION)])


def ratio(pred: float, measured: float) -> float:
    return max(pred / measured, measured / pred)


def test_cpu_cost_model_predicts_held_out_batch_sizes():
    """The cost model's form, fitted as the cpu preset was (`fit_cpu_device`), predicts
    measurements it was not fitted on: for each batch size in turn, fit on the other six and
    predict that one's four points (prefill and decode, input 128 and 512), extrapolations to
    batch 1 and 64 included. (Checking the preset against the very points it was fitted on
    would show only that the fit converged.) Stored measurements, so this is deterministic;
    1.6x bounds every point (the worst is about 1.45x today), and the typical point is within
    25% (about 15%): an off term (say attention not growing with context) misses by more."""
    from statistics import median

    points = calibration_points()
    tiny = load_model_config("tiny")
    sizes = sorted({int(p["batch_size"]) for p in points})
    assert set(sizes) >= {1, 2, 4, 8, 16, 32, 64}
    errors, bad = [], []
    for held in sizes:
        device = fit_cpu_device(tiny, [p for p in points if int(p["batch_size"]) != held])
        cm = CostModel(tiny, device)
        for p in points:
            if int(p["batch_size"]) != held:
                continue
            pred = predict_point(cm, p)
            errors.append(ratio(pred, p["seconds"]))
            if errors[-1] > 1.6:
                bad.append(f"{p['kind']} bs={held} len={p['input_len']}: measured {p['seconds'] * 1e3:.1f} ms, "
                           f"predicted {pred * 1e3:.1f} ms")
    assert len(errors) == 4 * len(sizes)
    assert not bad, "\n".join(bad)
    assert median(errors) < 1.25, sorted(errors)


def test_cpu_preset_is_physical_and_monotonic():
    """The cpu preset's fitted rates are positive and its predictions grow with the work:
    more requests, longer prompts, longer contexts all cost more, and a cached prefix is
    cheaper than computing it."""
    d = get_device("cpu")
    assert d.peak_flops > 0 and d.mem_bandwidth > 0 and 0 < d.attn_efficiency and 0 < d.flops_efficiency
    assert min(d.step_overhead_s, d.per_req_overhead_s, d.per_token_overhead_s) >= 0
    assert d.combine == "sum"
    cm = CostModel(load_model_config("tiny"), d)
    sizes, lengths = [1, 2, 4, 8, 16, 32, 64, 128], [16, 128, 512, 1024, 2048]
    for n in lengths:
        for f in (cm.prefill_time, cm.decode_time):
            times = [f(bs, n) for bs in sizes]
            assert all(a < b for a, b in zip(times, times[1:])), (f.__name__, n, times)
            per_request = [t / bs for t, bs in zip(times, sizes)]
            assert per_request[-1] < per_request[0]  # batching amortizes the weight reads
    for bs in sizes:
        for f in (cm.prefill_time, cm.decode_time):
            times = [f(bs, n) for n in lengths]
            assert all(a < b for a, b in zip(times, times[1:])), (f.__name__, bs, times)
    assert cm.step([64], [1024]).seconds < cm.step([1088], [0]).seconds


# ---- the command -------------------------------------------------------------------------------------
def test_simulate_sweep_command(tmp_path, capsys):
    from radixserve.cli import main

    out, png = tmp_path / "sweep.json", tmp_path / "sweep.png"
    code = main([
        "simulate", "--model-config", "llama-3-8b", "--hardware", "h100", "--context-length", "4096",
        "--max-running-requests", "64", "--dataset-name", "generated-shared-prefix", "--gsp-num-groups", "4",
        "--gsp-prompts-per-group", "4", "--gsp-system-prompt-len", "256", "--gsp-question-len", "32",
        "--gsp-output-len", "16", "--max-total-tokens", "4000", "--sweep", "--sweep-policies", "fcfs", "lpm",
        "--sweep-chunked-prefill-sizes", "128", "--sweep-mixed-chunk", "on", "--sweep-pool-sizes", "0.5",
        "--output", str(out), "--plot", str(png), "--disable-tqdm",
    ])
    assert code == 0
    rep = json.loads(out.read_text())
    labels = [r["label"] for r in rep["results"]]
    # base, lpm, chunk 128, mixed on, half the H100 pool (one factor at a time)
    assert len(labels) == 5 and len(set(labels)) == 5
    assert all(r["metrics"]["completed"] == 16 for r in rep["results"])
    lines = rep["table"].splitlines()  # a markdown table: header, separator, one row per configuration
    assert [c.strip() for c in lines[0].strip("|").split("|")] == [name for name, _ in SWEEP_COLUMNS]
    assert len(lines) == 2 + len(labels) and "policy" in lines[0]
    assert png.stat().st_size > 10_000
    assert "cache hit" in capsys.readouterr().out


def test_simulate_trace_file(tmp_path):
    from radixserve.cli import main

    trace = tmp_path / "trace.jsonl"
    lines = [{"timestamp": 100.0 + i, "input_len": 200, "output_len": 8} for i in range(5)]
    lines.append({"timestamp": 106.0, "input_ids": list(range(5, 300)), "output_len": 4})
    trace.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    out = tmp_path / "one.json"
    code = main(["simulate", "--model-config", "tiny", "--hardware", "cpu", "--dataset-name", "trace",
                 "--dataset-path", str(trace), "--output", str(out), "--disable-tqdm"])
    assert code == 0
    m = json.loads(out.read_text())["results"][0]["metrics"]
    assert m["completed"] == 6 and m["total_output_tokens"] == 5 * 8 + 4
    assert m["duration"] >= 6.0  # the last request is sent 6 s after the first
