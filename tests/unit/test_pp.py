"""Pipeline parallelism (--pp-size, managers/scheduler_pp.py) on CPU (gloo): the stage split,
the refusals, and pp=2 (and pp=2 x tp=2) schedulers giving the pp=1 greedy outputs for a
concurrent batch with shared prefixes, chunked prefill, retraction and an abort, with several
micro-batches in flight; on the tiny model (tied embeddings) and a 4-layer Llama checkpoint."""

from __future__ import annotations

import multiprocessing as mp
import socket
from typing import Any, Dict, List, Optional

import pytest
import torch

from radixserve.distributed.parallel_state import get_pp_indices
from radixserve.protocol import AbortReq, TokenizedGenerateReqInput
from radixserve.sampling_params import SamplingParams
from radixserve.server_args import ServerArgs

LLAMA_4_LAYERS = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=512, hidden_size=64,
    intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=1024, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
)
ABORTED = "r5"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_even_split_and_partition():
    assert [get_pp_indices(4, r, 2) for r in range(2)] == [(0, 2), (2, 4)]
    # the remainder goes to the stages before the last (SGLang's rule)
    assert [get_pp_indices(7, r, 3) for r in range(3)] == [(0, 2), (2, 5), (5, 7)]
    assert [get_pp_indices(4, r, 2, [3, 1]) for r in range(2)] == [(0, 3), (3, 4)]
    with pytest.raises(ValueError, match="--pp-partition"):
        get_pp_indices(4, 0, 2, [4, 0])


@pytest.mark.parametrize("flags, what", [
    (dict(disable_overlap_schedule=False), "--enable-overlap-schedule"),
    (dict(speculative_algorithm="NGRAM"), "--speculative-algorithm"),
    (dict(disaggregation_mode="prefill"), "--disaggregation-mode"),
    (dict(dp_size=2), "--dp-size"),
    (dict(enable_hierarchical_cache=True), "--enable-hierarchical-cache"),
    (dict(test_check_memory=True), "--test-check-memory"),
    (dict(enable_lora=True, lora_paths=None), "--enable-lora"),
    (dict(pp_partition="1,2,1"), "--pp-partition"),
    (dict(pp_partition="a,b"), "--pp-partition"),
])
def test_refused_at_start_with_one_line(flags, what):
    with pytest.raises(ValueError, match=what) as e:
        ServerArgs(pp_size=2, **flags)
    assert "\n" not in str(e.value)


def test_pp_loop_replaces_the_overlap_loop():
    assert ServerArgs(pp_size=2).overlap_schedule_enabled("cuda") is False


def _requests(vocab: int) -> List[TokenizedGenerateReqInput]:
    """Concurrent requests sharing prefixes; one asks for logprobs, the longest are chunked."""
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(3, vocab, (48,), generator=g).tolist()
    reqs = []
    for i in range(8):
        sp = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)
        sp.normalize()
        tail = torch.randint(3, vocab, (int(torch.randint(4, 80, (1,), generator=g)),), generator=g).tolist()
        req = TokenizedGenerateReqInput(f"r{i}", None, prefix[: 8 + 5 * i] + tail, sp)
        if i == 2:
            req.return_logprob, req.top_logprobs_num = True, 2
        reqs.append(req)
    return reqs


def _run(rank: int, tp: int, pp: int, addr: str, model: Dict[str, Any], out_path: Optional[str]) -> None:
    """One rank: the first stage's ranks run the Scheduler (the requests at step 0, the abort
    at step 6), the others a PPStage until the first stage shuts down."""
    from radixserve.hf_transformers_utils import resolve_model_path
    from radixserve.managers.scheduler import Scheduler
    from radixserve.managers.scheduler_pp import PPStage
    from radixserve.models.model_config import ModelConfig
    from radixserve.protocol import BatchTokenIDOutput

    flags = {k: v for k, v in model["args"].items() if pp > 1 or not k.startswith("pp_")}
    args = ServerArgs(**{**dict(max_total_tokens=4096, chunked_prefill_size=48, test_retract_interval=9, dtype="float32"),
                         **flags, **dict(tp_size=tp, pp_size=pp, dist_init_addr=addr, disable_overlap_schedule=True)})
    pp_rank, tp_rank = divmod(rank, tp)
    if pp_rank > 0:
        stage = PPStage(args, ModelConfig.from_pretrained(resolve_model_path(args)), tp_rank, pp_rank)
        stage.run()
        stage.shutdown()
        return
    inbox = {0: _requests(model["vocab"]), 6: [AbortReq(rid=ABORTED)]}
    out: Dict[str, Any] = {"ids": {}, "finish": {}, "logprobs": {}}

    def send(obj: Any) -> None:
        if isinstance(obj, BatchTokenIDOutput):
            for i, rid in enumerate(obj.rids):
                out["ids"].setdefault(rid, []).extend(obj.decode_ids[i])
                if obj.finished_reasons[i] is not None:
                    out["finish"][rid] = obj.finished_reasons[i]["type"]
                if obj.output_token_logprobs_val and obj.output_token_logprobs_val[i]:
                    out["logprobs"].setdefault(rid, []).extend(obj.output_token_logprobs_val[i])

    step = [0]
    sched = Scheduler(args, recv_fn=lambda: inbox.pop(step[0], []), send_fn=send, tp_rank=tp_rank, tp_size=tp)
    for it in range(10_000):
        step[0] = it
        sched.process_input_requests(sched.recv_requests())
        sched.run_step()
        if it > 6 and not sched.has_work():
            break
    sched.check_memory()  # every slot back: free or in the radix tree
    out["retractions"] = sched.stats.num_retractions
    out["max_inflight"] = sched.pp.max_inflight if sched.pp is not None else 1
    sched.shutdown()
    if tp_rank == 0 and out_path:
        torch.save(out, out_path)


def _run_ranks(tp: int, pp: int, model: Dict[str, Any], out_path: str) -> None:
    ctx = mp.get_context("spawn")
    addr = f"127.0.0.1:{_free_port()}"
    procs = [ctx.Process(target=_run, args=(r, tp, pp, addr, model, out_path)) for r in range(tp * pp)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=240)
        assert p.exitcode == 0


def _assert_same_greedy(ref: Dict[str, Any], got: Dict[str, Any]) -> None:
    done = {rid for rid in ref["ids"] if rid != ABORTED}
    assert len(done) == 7 and all(ref["finish"][rid] == "length" for rid in done)
    for rid in done:
        assert got["ids"][rid] == ref["ids"][rid], rid
        assert got["finish"][rid] == "length"
    # the aborted request: ended by the abort, its tokens the same as far as they went
    assert got["finish"][ABORTED] == "abort"
    n = len(got["ids"][ABORTED])
    assert got["ids"][ABORTED] == ref["ids"][ABORTED][:n]
    assert torch.allclose(torch.tensor(got["logprobs"]["r2"]), torch.tensor(ref["logprobs"]["r2"]), atol=1e-4)
    assert got["retractions"] > 0  # the retraction path ran under PP too
    assert got["max_inflight"] >= 2  # micro-batches were in flight on the stages at once


def _tiny() -> Dict[str, Any]:
    return {"args": dict(pp_max_micro_batch_size=3, pp_async_batch_depth=1), "vocab": 8192}


def _llama(tmp_path) -> Dict[str, Any]:
    """A 4-layer Llama checkpoint (safetensors, untied LM head), split 3 + 1."""
    import transformers

    model_dir = tmp_path / "llama4"
    cfg = transformers.AutoConfig.for_model(**LLAMA_4_LAYERS)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(model_dir)
    return {"args": dict(model_path=str(model_dir), skip_tokenizer_init=True, pp_partition="3,1",
                         pp_max_micro_batch_size=4), "vocab": 512}


def test_pp2_scheduler_matches_pp1_tiny_model(tmp_path):
    model = _tiny()
    _run(0, 1, 1, "", model, str(tmp_path / "pp1.pt"))
    _run_ranks(1, 2, model, str(tmp_path / "pp2.pt"))
    _assert_same_greedy(torch.load(tmp_path / "pp1.pt"), torch.load(tmp_path / "pp2.pt"))


def test_pp2_tp2_scheduler_matches_pp1_tiny_model(tmp_path):
    model = _tiny()
    _run(0, 1, 1, "", model, str(tmp_path / "pp1.pt"))
    _run_ranks(2, 2, model, str(tmp_path / "pp2tp2.pt"))
    _assert_same_greedy(torch.load(tmp_path / "pp1.pt"), torch.load(tmp_path / "pp2tp2.pt"))


def test_pp2_scheduler_matches_pp1_llama_checkpoint(tmp_path):
    model = _llama(tmp_path)
    _run(0, 1, 1, "", model, str(tmp_path / "pp1.pt"))
    _run_ranks(1, 2, model, str(tmp_path / "pp2.pt"))
    _assert_same_greedy(torch.load(tmp_path / "pp1.pt"), torch.load(tmp_path / "pp2.pt"))
