"""Tensor parallelism on CPU (gloo): tp=2 logits equal tp=1 within 1e-4 in float32, for a
Llama config (kv heads split) and a Qwen3 config (one kv head: replicated on both ranks)."""

from __future__ import annotations

import json
import multiprocessing as mp
import socket
import sys

import pytest
import torch

CONFIGS = {
    "llama": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=512, hidden_size=128,
        intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=512, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
    ),
    "qwen3": dict(
        architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=512, hidden_size=128,
        intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
        head_dim=32, max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=True,
    ),
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(model_dir: str, tp_rank: int, tp_size: int, addr: str, out_path: str) -> None:
    sys.path.insert(0, "tests/reference")
    from hf_utils import KVDriver

    from radixserve.distributed.parallel_state import destroy_distributed_environment
    from radixserve.model_executor.model_runner import ModelRunner
    from radixserve.models.model_config import ModelConfig
    from radixserve.server_args import ServerArgs

    args = ServerArgs(model_path=model_dir, load_format="dummy", dtype="float32", device="cpu",
                      max_total_tokens=2048, max_running_requests=8, tp_size=tp_size, dist_init_addr=addr)
    runner = ModelRunner(ModelConfig.from_pretrained(model_dir), args, tp_rank, tp_size)
    drv = KVDriver(runner, scatter_seed=1)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (9, 30, 4)]
    logits = [drv.extend([0, 1, 2], [0, 0, 0], prompts).all_logits]
    lens = [len(p) for p in prompts]
    for _ in range(4):
        toks = torch.randint(0, 512, (3,), generator=g).tolist()
        logits.append(drv.decode([0, 1, 2], lens, toks).next_token_logits)
        lens = [n + 1 for n in lens]
    if tp_rank == 0:
        torch.save(logits, out_path)
    destroy_distributed_environment()


@pytest.mark.parametrize("name", list(CONFIGS))
def test_tp2_logits_equal_tp1(name, tmp_path):
    model_dir = tmp_path / name
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(CONFIGS[name]))
    _run(str(model_dir), 0, 1, "", str(tmp_path / "tp1.pt"))
    ctx = mp.get_context("spawn")
    addr = f"127.0.0.1:{_free_port()}"
    procs = [ctx.Process(target=_run, args=(str(model_dir), r, 2, addr, str(tmp_path / "tp2.pt"))) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
        assert p.exitcode == 0
    ref, got = torch.load(tmp_path / "tp1.pt"), torch.load(tmp_path / "tp2.pt")
    for a, b in zip(ref, got):
        assert a.shape == b.shape
        assert (a - b).abs().max().item() <= 1e-4


def _run_scheduler(tp_rank: int, tp_size: int, addr: str, requests, out_path: str, overlap: bool) -> None:
    from radixserve.managers.scheduler import Scheduler
    from radixserve.protocol import BatchTokenIDOutput
    from radixserve.server_args import ServerArgs

    args = ServerArgs(max_total_tokens=4096, tp_size=tp_size, dist_init_addr=addr,
                      disable_overlap_schedule=not overlap, chunked_prefill_size=64)
    inbox = [list(requests)]
    outputs = {}

    def send(obj):
        if isinstance(obj, BatchTokenIDOutput):
            for rid, ids in zip(obj.rids, obj.decode_ids):
                outputs.setdefault(rid, []).extend(ids)

    sched = Scheduler(args, recv_fn=lambda: inbox.pop() if inbox else [], send_fn=send, tp_rank=tp_rank, tp_size=tp_size)
    for it in range(10_000):
        sched.process_input_requests(sched.recv_requests())
        sched.run_step()
        if it > 0 and not sched.has_work():
            break
    sched.check_memory()
    sched.shutdown()
    if tp_rank == 0:
        torch.save(outputs, out_path)


@pytest.mark.parametrize("overlap", [True, False])
def test_tp2_scheduler_matches_tp1(tmp_path, overlap):
    """Rank 0 receives the requests and broadcasts them; both ranks run the same batches."""
    from radixserve.protocol import TokenizedGenerateReqInput
    from radixserve.sampling_params import SamplingParams

    g = torch.Generator().manual_seed(0)
    reqs = []
    for i in range(12):
        sp = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)
        sp.normalize()
        ids = torch.randint(3, 8192, (int(torch.randint(5, 120, (1,), generator=g)),), generator=g).tolist()
        reqs.append(TokenizedGenerateReqInput(f"r{i}", None, ids, sp))
    _run_scheduler(0, 1, "", reqs, str(tmp_path / "tp1.pt"), overlap)
    ctx = mp.get_context("spawn")
    addr = f"127.0.0.1:{_free_port()}"
    procs = [ctx.Process(target=_run_scheduler, args=(r, 2, addr, reqs, str(tmp_path / "tp2.pt"), overlap)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=180)
        assert p.exitcode == 0
    ref, got = torch.load(tmp_path / "tp1.pt"), torch.load(tmp_path / "tp2.pt")
    assert set(ref) == {f"r{i}" for i in range(12)} and ref == got
