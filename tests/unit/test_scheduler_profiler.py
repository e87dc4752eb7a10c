"""start_profile / stop_profile on the offline Engine (the scheduler's SchedulerProfiler): a run
writes a gzipped Chrome trace (what Perfetto opens: JSON with traceEvents) holding the model's
ops, also those of the overlap loop's forward thread; with num_steps it stops by itself; bad
input is refused."""

from __future__ import annotations

import gzip
import json
import os
from typing import Dict, List

import pytest
import torch

from radixserve.engine import Engine

SAMPLING = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}


def _traces(path) -> List[str]:
    return sorted(str(p) for p in path.glob("*-TP-0.trace.json.gz"))


def _events(trace: str) -> List[Dict]:
    with gzip.open(trace, "rt") as f:
        doc = json.load(f)
    assert isinstance(doc["traceEvents"], list)
    return doc["traceEvents"]


def test_profile_writes_a_chrome_trace_with_the_steps_ops(tmp_path, loop):
    engine = Engine(max_total_tokens=2048, dtype="float32", **loop)
    engine.start_profile(output_dir=str(tmp_path), activities=["CPU"])
    engine.generate(input_ids=[[5, 6, 7, 8], [9, 10, 11]], sampling_params=SAMPLING)
    assert _traces(tmp_path) == []  # written at the stop
    engine.stop_profile()
    (trace,) = _traces(tmp_path)
    events = _events(trace)
    names = {e.get("name") for e in events if e.get("ph") == "X"}
    assert names & {"aten::linear", "aten::mm", "aten::addmm", "aten::matmul"}, sorted(n for n in names if n)[:50]
    # Complete events carry what a trace viewer needs.
    assert all({"ts", "dur", "pid", "tid"} <= e.keys() for e in events if e.get("ph") == "X")


def test_num_steps_stops_by_itself(tmp_path):
    engine = Engine(max_total_tokens=2048, dtype="float32")
    engine.start_profile(output_dir=str(tmp_path), num_steps=3, activities=["CPU"], with_stack=False)
    start_ct = engine.scheduler.forward_ct
    engine.generate(input_ids=[5, 6, 7, 8], sampling_params=SAMPLING)  # 8 forwards
    assert engine.scheduler.forward_ct - start_ct > 3
    (trace,) = _traces(tmp_path)
    assert any(e.get("name") == "aten::mm" or e.get("name") == "aten::linear" for e in _events(trace))
    with pytest.raises(ValueError, match="Profiling is not in progress"):
        engine.stop_profile()  # it stopped already


def test_default_output_dir_is_sglangs_env_variable(tmp_path, monkeypatch):
    monkeypatch.setenv("SGLANG_TORCH_PROFILER_DIR", str(tmp_path / "traces"))
    engine = Engine(max_total_tokens=2048, dtype="float32")
    engine.start_profile(num_steps=1)
    engine.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 3})
    assert os.listdir(tmp_path / "traces")


def test_bad_input(tmp_path):
    engine = Engine(max_total_tokens=2048)
    with pytest.raises(ValueError, match="Profiling is not in progress. Call /start_profile first"):
        engine.stop_profile()
    with pytest.raises(ValueError, match="Unknown profiler activities \\['TPU'\\]"):
        engine.start_profile(activities=["TPU"])
    with pytest.raises(ValueError, match="num_steps must be a positive integer"):
        engine.start_profile(num_steps=0)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="needs a GPU"):
            engine.start_profile(activities=["GPU"])
    with pytest.raises(ValueError, match="cannot be made"):
        engine.start_profile(output_dir=os.devnull + "/traces")  # under a file
    engine.start_profile(output_dir=str(tmp_path), activities=["CPU"])
    with pytest.raises(ValueError, match="Profiling is already in progress"):
        engine.start_profile(output_dir=str(tmp_path))
    engine.stop_profile()
    assert len(_traces(tmp_path)) == 1
