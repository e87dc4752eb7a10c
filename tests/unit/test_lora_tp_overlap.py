"""Multi-LoRA (issue 28) with tensor parallelism and in the overlap loop.

- tp=2 equals tp=1 with adapters: each rank keeps the slice of A and B its base layer keeps
  (q/k/v by heads, a replicated kv head on every rank, gate/up split, o/down along the input
  with the delta in the partial sums before the all-reduce). Two models: the tiny model (two kv
  heads: split over the ranks) and a config with one kv head (replicated on both ranks).
- The overlap loop gives the normal loop's outputs with more adapters than slots, and an
  adapter loaded and unloaded at run time between requests, in both loops; an unload waits for
  the forward in flight (the pool and the registry are the forward thread's while it runs).

The adapters are PEFT directories with random non-zero weights (tests/reference/lora_utils.py);
test_lora.py checks the tp=1 normal loop against the adapter merged into the weights."""

from __future__ import annotations

import json
import multiprocessing as mp
import shutil
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import pytest
import torch
from safetensors.torch import save_file

from radixserve.engine import Engine
from radixserve.tiny_model import get_tiny_model_path

sys.path.append(str(Path(__file__).resolve().parents[1] / "reference"))
sys.path.append(str(Path(__file__).resolve().parents[1]))
from processes import free_port, run_processes  # noqa: E402
from lora_utils import ADAPTERS, ENGINE_ARGS, PROMPTS, SAMPLING, base_weights, write_adapter  # noqa: E402

LOGPROB_ATOL = 1e-4


def _write_adapters(root: Path, base: Dict[str, torch.Tensor]) -> Dict[str, Path]:
    return {name: write_adapter(root / name, r, alpha, targets, base, seed=i + 1)
            for i, (name, (r, alpha, targets)) in enumerate(ADAPTERS.items())}


def _one_kv_head_model(out: Path) -> Tuple[Path, Dict[str, torch.Tensor]]:
    """The tiny model with its first kv head only (k_proj / v_proj rows of head 0): at tp=2 both
    ranks hold that head (QKVParallelLinear's kv_replicas). Its directory and its weights."""
    shutil.copytree(get_tiny_model_path(), out)
    config = json.loads((out / "config.json").read_text())
    head_dim = config["head_dim"]
    config["num_key_value_heads"] = 1
    (out / "config.json").write_text(json.dumps(config))
    weights = {name: (w[:head_dim].contiguous() if name.endswith(("k_proj.weight", "v_proj.weight")) else w)
               for name, w in base_weights().items()}
    save_file(weights, str(out / "model.safetensors"))
    return out, weights


# ---- tp=2 equals tp=1 -------------------------------------------------------------------------
def _requests() -> list:
    """Every prompt under the base model and each adapter, in one batch of requests."""
    from radixserve.protocol import TokenizedGenerateReqInput
    from radixserve.sampling_params import SamplingParams

    g = torch.Generator().manual_seed(0)
    reqs = []
    for i in range(3):
        ids = torch.randint(3, 8000, (int(torch.randint(5, 40, (1,), generator=g)),), generator=g).tolist()
        for name in [None, *ADAPTERS]:
            sp = SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True)
            sp.normalize()
            reqs.append(TokenizedGenerateReqInput(f"p{i}-{name}", None, ids, sp, return_logprob=True, lora_path=name))
    return reqs


def _run_scheduler(tp_rank: int, tp_size: int, addr: str, model_dir: str, lora_paths: List[str],
                   max_loras_per_batch: int, overlap: bool, out_path: str) -> None:
    """One rank's Scheduler over _requests(); rank 0 saves rid -> (output ids, logprobs) and how
    many adapters were copied into a slot."""
    from radixserve.managers.schedule_policy import configure_lora_admission
    from radixserve.managers.scheduler import Scheduler
    from radixserve.protocol import BatchTokenIDOutput
    from radixserve.server_args import ServerArgs

    args = ServerArgs(model_path=model_dir, dtype="float32", max_total_tokens=2048,
                      tp_size=tp_size, dist_init_addr=addr, disable_overlap_schedule=not overlap,
                      disable_radix_cache=True, lora_paths=lora_paths, max_loras_per_batch=max_loras_per_batch)
    inbox = [_requests()]
    outputs: Dict[str, Tuple[List[int], List[float]]] = {}

    def send(obj):
        if isinstance(obj, BatchTokenIDOutput):
            for rid, ids, lps in zip(obj.rids, obj.decode_ids, obj.output_token_logprobs_val):
                ids_so_far, lps_so_far = outputs.setdefault(rid, ([], []))
                ids_so_far.extend(ids)
                lps_so_far.extend(lps)

    sched = Scheduler(args, recv_fn=lambda: inbox.pop() if inbox else [], send_fn=send, tp_rank=tp_rank, tp_size=tp_size)
    configure_lora_admission(sched.policy, args)
    assert sched.enable_overlap == overlap
    for it in range(10_000):
        sched.process_input_requests(sched.recv_requests())
        sched.run_step()
        if it > 0 and not sched.has_work():
            break
    sched.check_memory()
    sched.shutdown()
    if tp_rank == 0:
        torch.save((outputs, sched.tp_worker.model_runner.lora_manager.pool.num_swaps), out_path)


@pytest.mark.parametrize("model,max_loras_per_batch,overlap", [
    ("tiny", 8, False),  # kv heads split over the ranks
    ("one_kv_head", 2, True),  # the kv head on both ranks; 2 slots for 3 adapters; the overlap loop
])
def test_tp2_with_adapters_equals_tp1(tmp_path, model, max_loras_per_batch, overlap):
    if model == "tiny":
        model_dir, base = get_tiny_model_path(), base_weights()
    else:
        model_dir, base = _one_kv_head_model(tmp_path / model)
    lora_paths = [f"{n}={p}" for n, p in _write_adapters(tmp_path / "adapters", base).items()]
    common = (str(model_dir), lora_paths)
    _run_scheduler(0, 1, "", *common, 8, False, str(tmp_path / "tp1.pt"))
    ctx = mp.get_context("spawn")
    addr = f"127.0.0.1:{free_port()}"
    procs = [ctx.Process(target=_run_scheduler, args=(r, 2, addr, *common, max_loras_per_batch, overlap,
                                                       str(tmp_path / "tp2.pt"))) for r in range(2)]
    run_processes(procs, timeout=180)
    (ref, _), (got, swaps) = torch.load(tmp_path / "tp1.pt"), torch.load(tmp_path / "tp2.pt")
    assert set(ref) == set(got) == {r.rid for r in _requests()}
    if max_loras_per_batch < len(ADAPTERS):
        assert swaps >= len(ADAPTERS)  # 3 adapters through fewer slots: a slot was reused
    for i in range(3):  # the adapters are applied: each changes the base model's output
        base_ids = ref[f"p{i}-None"][0]
        assert all(ref[f"p{i}-{name}"][0] != base_ids for name in ADAPTERS), i
    for rid, (ids, lps) in ref.items():
        assert got[rid][0] == ids, rid
        assert torch.allclose(torch.tensor(got[rid][1]), torch.tensor(lps), atol=LOGPROB_ATOL, rtol=0), rid


# ---- the overlap loop -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> Dict[str, Path]:
    return _write_adapters(tmp_path_factory.mktemp("lora"), base_weights())


def _lora_engine(adapters: Dict[str, Path], overlap: bool, **kwargs) -> Engine:
    engine = Engine(None, lora_paths=[f"{n}={p}" for n, p in adapters.items()], disable_overlap_schedule=not overlap,
                    **{**ENGINE_ARGS, **kwargs})
    assert engine.scheduler.enable_overlap == overlap
    return engine


@pytest.fixture(scope="module")
def references(adapters) -> Dict[Optional[str], List[dict]]:
    """Per adapter (None = base): the normal loop's outputs for PROMPTS, with every adapter in a
    slot of its own (test_lora.py checks these against the adapter merged into the weights)."""
    engine = _lora_engine(adapters, overlap=False)
    try:
        return {name: engine.generate(PROMPTS, dict(SAMPLING), return_logprob=True, lora_path=[name] * len(PROMPTS),
                                      progress=False) for name in [None, *ADAPTERS]}
    finally:
        engine.shutdown()


def _assert_matches(out: dict, ref: dict, what: str) -> None:
    assert out["output_ids"] == ref["output_ids"], what
    got = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
    want = [lp for lp, _, _ in ref["meta_info"]["output_token_logprobs"]]
    assert torch.allclose(torch.tensor(got), torch.tensor(want), atol=LOGPROB_ATOL, rtol=0), what


@pytest.mark.parametrize("max_loras_per_batch", [1, 2])
def test_overlap_loop_with_more_adapters_than_slots(adapters, references, max_loras_per_batch):
    """Base requests and all three adapters submitted at once to the overlap loop: adapters are
    swapped into the slots (on the forward thread, before the batch that needs them) while the
    previous batch may still run, and every request gets the normal loop's output."""
    engine = _lora_engine(adapters, overlap=True, max_loras_per_batch=max_loras_per_batch)
    try:
        pairs = [(i, name) for i in range(len(PROMPTS)) for name in [None, *ADAPTERS]]
        outs = engine.generate([PROMPTS[i] for i, _ in pairs], dict(SAMPLING), return_logprob=True,
                               lora_path=[name for _, name in pairs], progress=False)
        for (i, name), out in zip(pairs, outs):
            _assert_matches(out, references[name][i], f"prompt {i} adapter {name}")
        pool = engine.scheduler.tp_worker.model_runner.lora_manager.pool
        assert pool.num_swaps >= len(ADAPTERS)  # 3 adapters through fewer slots: slots were reused
    finally:
        engine.shutdown()


@pytest.mark.parametrize("overlap", [False, True])
def test_load_and_unload_between_requests(adapters, references, overlap, tmp_path):
    """Both loops, one slot: an adapter loaded at run time serves; unloading it right after its
    request's prefill waits for that request (it ends with its own output) and, in the overlap
    loop, for the forward in flight; the name is then refused; loaded again under the same name
    from another adapter's directory, it serves that adapter (the old slot is not reused)."""
    engine = _lora_engine({"a4": adapters["a4"]}, overlap, max_loras_per_batch=1, max_lora_rank=16,
                          lora_target_modules=["all"])
    runner = engine.scheduler.tp_worker.model_runner
    manager = runner.lora_manager
    forward = runner.forward

    slow = [False]

    def slow_forward(forward_batch):  # around the unload: a forward long enough to be in flight then
        if slow[0]:
            time.sleep(0.05)
        return forward(forward_batch)

    runner.forward = slow_forward
    in_flight_at_unload: List[bool] = []
    unload = manager.unload_lora_adapter

    def recording_unload(name: str) -> None:
        worker = engine.scheduler.overlap_worker
        pending = [p for _, p in worker.result_queue] if worker is not None else []
        in_flight_at_unload.append(any(not p.ready.is_set() for p in pending))
        unload(name)

    manager.unload_lora_adapter = recording_unload
    try:
        assert engine.load_lora_adapter("x", str(adapters["c16"])).success
        _assert_matches(engine.generate(PROMPTS[0], dict(SAMPLING), return_logprob=True, lora_path="x",
                                        progress=False), references["c16"][0], "loaded at run time")
        _assert_matches(engine.generate(PROMPTS[1], dict(SAMPLING), return_logprob=True, lora_path="a4",
                                        progress=False), references["a4"][1], "a4 (and no finished x request left)")

        # A base request keeps the batch running (a forward in flight in the overlap loop).
        long_base = engine.submit(text=PROMPTS[3], sampling_params={**SAMPLING, "max_new_tokens": 24})
        states = engine.submit(text=PROMPTS[2], sampling_params=dict(SAMPLING), return_logprob=True, lora_path="x")
        slow[0] = True
        engine.step()  # both admitted and prefilled: the x request is in the last batch only
        out = engine.unload_lora_adapter("x")
        slow[0] = False
        assert out.success and out.loaded_adapters == {"a4": str(adapters["a4"])}
        assert states[0].finished
        _assert_matches(engine.frontend.make_output(states[0]), references["c16"][2], "finished before the unload")
        assert in_flight_at_unload == [False]
        with pytest.raises(ValueError, match="'x' is not loaded"):
            engine.generate(PROMPTS[0], dict(SAMPLING), lora_path="x", progress=False)

        assert engine.load_lora_adapter("x", str(adapters["b8"])).success
        outs = engine.generate(PROMPTS[:2], dict(SAMPLING), return_logprob=True, lora_path=["x", "a4"], progress=False)
        _assert_matches(outs[0], references["b8"][0], "x again, now b8")
        _assert_matches(outs[1], references["a4"][1], "a4 beside it")
        engine.wait_until_idle()
        assert long_base[0].finished  # the base request beside them: its greedy tokens throughout
        assert long_base[0].output_ids[:SAMPLING["max_new_tokens"]] == references[None][3]["output_ids"]
    finally:
        engine.shutdown()
