"""Weight updates without a restart (float32 unless named): after an update from disk, from tensors,
or from a trainer's broadcast over torch.distributed (gloo), the greedy outputs equal the new
checkpoint's under transformers and the old cache is gone; a refused update (a missing path,
another architecture, other shapes, a tensor of another shape or name) leaves the old weights
serving; TP 2 shards updates as the loaders do; the CPU's bf16 mode repacks its GEMM weights."""

from __future__ import annotations

import multiprocessing as mp
import shutil
import sys
from pathlib import Path
from typing import Dict, List, Tuple

import pytest
import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "reference"))
from hf_utils import hf_logits, load_hf, make_hf_model_dir  # noqa: E402
from weight_trainer import GROUP, broadcast_checkpoint  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from processes import free_port, run_processes  # noqa: E402

from radixserve import Engine  # noqa: E402

TOL = 1e-4
PROMPTS = [[1, 5, 9, 33, 100, 7, 8], [200, 3, 17, 250, 9, 11, 12, 40, 41]]
N_NEW = 8


# ---- fixtures and references ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> Dict[str, str]:
    """Two Llama checkpoints of one shape (other values), a Qwen3 one, and a Llama one whose
    up_proj has another shape."""
    root = tmp_path_factory.mktemp("ckpts")
    out = {
        "a": make_hf_model_dir("llama", str(root / "a"), seed=0),
        "b": make_hf_model_dir("llama", str(root / "b"), seed=1),
        "qwen3": make_hf_model_dir("qwen3", str(root / "qwen3"), seed=0),
    }
    bad = root / "bad_shape"
    shutil.copytree(out["b"], bad)
    tensors = load_file(str(bad / "model.safetensors"))
    tensors["model.layers.1.mlp.up_proj.weight"] = tensors["model.layers.1.mlp.up_proj.weight"][:-8].clone()
    save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
    out["bad_shape"] = str(bad)
    return out


@pytest.fixture(scope="module")
def hf(dirs):
    return {k: load_hf(dirs[k]) for k in ("a", "b")}


def hf_greedy(model, ids: List[int], n: int = N_NEW) -> Tuple[List[int], List[float]]:
    """transformers' greedy tokens and their logprobs (no EOS: the engine runs with ignore_eos)."""
    seq, toks, lps = list(ids), [], []
    for _ in range(n):
        logprobs = torch.log_softmax(hf_logits(model, seq)[-1], dim=-1)
        tok = int(logprobs.argmax())
        toks.append(tok)
        lps.append(float(logprobs[tok]))
        seq.append(tok)
    return toks, lps


def engine(model_dir: str, **kw) -> Engine:
    kw.setdefault("dtype", "float32")
    return Engine(model_dir, device="cpu", skip_tokenizer_init=True, max_total_tokens=4096, **kw)


def generate(e: Engine, ids: List[int]) -> dict:
    sp = {"max_new_tokens": N_NEW, "temperature": 0, "ignore_eos": True}
    return e.generate(input_ids=ids, sampling_params=sp, return_logprob=True)


def assert_serves(e: Engine, model) -> None:
    """Greedy tokens equal transformers' on `model`, their logprobs within TOL."""
    for ids in PROMPTS:
        out = generate(e, ids)
        toks, lps = hf_greedy(model, ids)
        assert out["output_ids"] == toks
        got = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
        assert max(abs(x - y) for x, y in zip(got, lps)) <= TOL


def checkpoint(model_dir: str) -> List[Tuple[str, torch.Tensor]]:
    return list(load_file(str(Path(model_dir) / "model.safetensors")).items())


# ---- from disk -------------------------------------------------------------------------------------
def test_update_from_disk_serves_the_new_checkpoint_and_flushes_the_cache(dirs, hf, loop):
    e = engine(dirs["a"], **loop)
    try:
        assert_serves(e, hf["a"])
        assert generate(e, PROMPTS[0])["meta_info"]["cached_tokens"] > 0  # the prompt is cached
        assert generate(e, PROMPTS[0])["meta_info"]["weight_version"] == "default"

        ok, message = e.update_weights_from_disk(dirs["b"], weight_version="step-1")
        assert ok, message
        first = generate(e, PROMPTS[0])["meta_info"]
        assert first["cached_tokens"] == 0  # the old KV is gone with the old weights
        assert first["weight_version"] == "step-1"
        assert_serves(e, hf["b"])
        assert e.server_args.weight_version == "step-1"
        e.scheduler.check_memory()
    finally:
        e.shutdown()


@pytest.mark.parametrize("bad", ["missing", "qwen3", "bad_shape", "dummy_format"])
def test_refused_update_from_disk_keeps_the_old_weights(dirs, hf, bad):
    e = engine(dirs["a"])
    try:
        before = [generate(e, ids)["output_ids"] for ids in PROMPTS]
        path = {"missing": dirs["a"] + "-missing", "dummy_format": dirs["b"]}.get(bad, dirs.get(bad))
        ok, message = e.update_weights_from_disk(path, load_format="dummy" if bad == "dummy_format" else None)
        assert not ok
        expected = {
            "missing": "no such file or directory",
            "qwen3": "architecture Qwen3ForCausalLM, but this server runs LlamaForCausalLM",
            "bad_shape": "'model.layers.1.mlp.up_proj.weight' has shape (248, 128); the model's is (256, 128)",
            "dummy_format": "load_format 'dummy' cannot update weights",
        }[bad]
        assert expected in message
        assert [generate(e, ids)["output_ids"] for ids in PROMPTS] == before
        assert_serves(e, hf["a"])
        assert e.server_args.weight_version == "default"
    finally:
        e.shutdown()


def test_update_while_the_weights_are_released_is_refused(dirs, hf):
    e = engine(dirs["a"])
    try:
        e.release_memory_occupation(["weights"])
        ok, message = e.update_weights_from_disk(dirs["b"])
        assert not ok and "The weights are released" in message
        e.resume_memory_occupation(["weights"])
        assert_serves(e, hf["a"])
        assert e.update_weights_from_disk(dirs["b"])[0]
        assert_serves(e, hf["b"])
    finally:
        e.shutdown()


# ---- from tensors ----------------------------------------------------------------------------------
def test_update_from_tensor_whole_and_in_part(dirs, hf):
    e = engine(dirs["a"])
    try:
        ok, message = e.update_weights_from_tensor(checkpoint(dirs["b"]), weight_version="v2")
        assert ok, message
        assert_serves(e, hf["b"])
        assert generate(e, PROMPTS[1])["meta_info"]["weight_version"] == "v2"

        # One tensor: it changes, the others keep their values.
        norm = torch.linspace(0.5, 1.5, 128)
        down_before = e.get_weights_by_name("model.layers.0.mlp.down_proj.weight", 4)
        ok, message = e.update_weights_from_tensor([("model.layers.1.post_attention_layernorm.weight", norm)])
        assert ok, message
        assert torch.allclose(torch.tensor(e.get_weights_by_name("model.layers.1.post_attention_layernorm.weight", 200)), norm)
        assert e.get_weights_by_name("model.layers.0.mlp.down_proj.weight", 4) == down_before
    finally:
        e.shutdown()


def test_refused_update_from_tensor_writes_nothing(dirs, hf):
    e = engine(dirs["a"])
    try:
        before = [generate(e, ids)["output_ids"] for ids in PROMPTS]
        good = checkpoint(dirs["b"])
        cases = {
            "shape": (good + [("model.layers.0.mlp.gate_proj.weight", torch.zeros(3, 3))],
                      "'model.layers.0.mlp.gate_proj.weight' has shape (3, 3); the model's is (256, 128)"),
            "name": (good + [("model.layers.0.mlp.nope.weight", torch.zeros(3))], "unexpected tensor 'model.layers.0.mlp.nope.weight'"),
            "format": (good, "load_format 'direct' is not supported"),
            "nan": (good + [("model.norm.weight", torch.full((128,), float("nan")))],
                    "tensor 'model.norm.weight' holds NaN or infinite values"),
        }
        for case, (tensors, expected) in cases.items():
            ok, message = e.update_weights_from_tensor(tensors, load_format="direct" if case == "format" else None)
            assert not ok and expected in message, (case, message)
        # Every good tensor came before the bad one: none of them was written.
        assert [generate(e, ids)["output_ids"] for ids in PROMPTS] == before
        assert_serves(e, hf["a"])
    finally:
        e.shutdown()


def test_get_weights_by_name_returns_the_checkpoint_rows(dirs, hf):
    e = engine(dirs["a"])
    try:
        params = dict(hf["a"].named_parameters())
        for name in ("model.layers.0.self_attn.k_proj.weight", "model.layers.1.mlp.up_proj.weight",
                     "model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"):
            got = torch.tensor(e.get_weights_by_name(name, 5))
            assert torch.equal(got, params[name][:5].detach()), name
        assert e.get_weights_by_name("model.layers.0.self_attn.qkv_proj.weight") is None  # a fused name, not a checkpoint's
        # More rows than the tensor has (2**70 once overflowed a comparison and killed the scheduler): all of them.
        norm = params["model.norm.weight"].detach()
        assert torch.equal(torch.tensor(e.get_weights_by_name("model.norm.weight", 2**70)), norm)
    finally:
        e.shutdown()


# ---- the CPU's bf16 mode: the GEMM's packed copies are updated too --------------------------------
def test_bf16_update_reaches_the_packed_weights(dirs):
    """A CPU with AVX512_BF16 or AVX2 runs a bf16 model on packed copies of its linear weights: an update
    repacks them (each now the new checkpoint's weight, still held once) and serves what a server
    started on the new checkpoint serves, to the bit."""
    from radixserve.layers.cpu_weight_only import weight_only_available
    from radixserve.layers.linear import unpack_cpu_weight

    if not weight_only_available(torch.bfloat16, "cpu"):
        pytest.skip("no C++ bf16 GEMM on this CPU (neither AVX512_BF16 nor AVX2): a bf16 model keeps no packed weights to update")
    e, fresh = engine(dirs["a"], dtype="bfloat16"), engine(dirs["b"], dtype="bfloat16")
    try:
        runner = e.scheduler.tp_worker.model_runner
        assert runner.weight_only
        down = runner.model.model.layers[0].mlp.down_proj
        packed_before = down.weight_packed.data.clone()
        before = [generate(e, ids) for ids in PROMPTS]
        ok, message = e.update_weights_from_disk(dirs["b"])
        assert ok, message
        # still packed once (the original layout freed again), now holding the new weight
        assert down.weight_packed is not None and down.weight.numel() == 0
        assert not torch.equal(down.weight_packed.data, packed_before)
        new = dict(checkpoint(dirs["b"]))["model.layers.0.mlp.down_proj.weight"].bfloat16()
        assert torch.equal(unpack_cpu_weight(down.weight_packed, down.in_features), new)
        for ids, old in zip(PROMPTS, before):
            got, ref = generate(e, ids), generate(fresh, ids)
            assert got["output_ids"] != old["output_ids"]
            # The same numerics as a server started on the new checkpoint, to the bit.
            assert got["output_ids"] == ref["output_ids"]
            assert got["meta_info"]["output_token_logprobs"] == ref["meta_info"]["output_token_logprobs"]
    finally:
        e.shutdown()
        fresh.shutdown()


def test_unpack_cpu_weight_inverts_pack():
    from radixserve.layers.linear import PackedWeight, unpack_cpu_weight

    # The layout of cpu_kernels.pack_bf16_weight: [N/16][K/2][16][2], N padded to 16.
    n, k = 40, 6
    w = torch.randn(n, k).bfloat16()
    padded = torch.cat([w, torch.zeros(8, k, dtype=w.dtype)])
    data = padded.view(3, 16, k // 2, 2).permute(0, 2, 1, 3).contiguous()
    assert torch.equal(unpack_cpu_weight(PackedWeight(data, n), k), w)


# ---- from a trainer over torch.distributed ----------------------------------------------------------
def _start_trainer(port: int, world_size: int, model_dir: str):
    proc = mp.get_context("spawn").Process(target=broadcast_checkpoint, args=(port, world_size, model_dir))
    proc.start()
    return proc


def test_update_from_distributed_trainer(dirs, hf):
    e = engine(dirs["a"])
    port = free_port()
    trainer = _start_trainer(port, 2, dirs["b"])
    try:
        ok, message = e.init_weights_update_group("127.0.0.1", port, 1, 2, GROUP, "gloo")
        assert ok, message
        ok2, message2 = e.init_weights_update_group("127.0.0.1", port, 1, 2, GROUP, "gloo")
        assert not ok2 and "already exists" in message2
        tensors = checkpoint(dirs["b"])
        ok, message = e.update_weights_from_distributed(
            [n for n, _ in tensors], [str(t.dtype).removeprefix("torch.") for _, t in tensors],
            [list(t.shape) for _, t in tensors], weight_version="rl-1")
        assert ok, message
        trainer.join(60)
        assert trainer.exitcode == 0
        assert_serves(e, hf["b"])
        assert generate(e, PROMPTS[0])["meta_info"]["weight_version"] == "rl-1"
        assert e.destroy_weights_update_group(GROUP)[0]
        assert e.destroy_weights_update_group(GROUP) == (False, f"The group to be destroyed does not exist: no weights update group named {GROUP!r}.")
    finally:
        trainer.join(5)
        if trainer.is_alive():
            trainer.kill()
        e.shutdown()


def test_update_from_distributed_without_a_group_is_refused(dirs, hf):
    e = engine(dirs["a"])
    try:
        ok, message = e.update_weights_from_distributed(["model.norm.weight"], ["float32"], [[128]])
        assert not ok and "call /init_weights_update_group first" in message
        ok, message = e.init_weights_update_group("127.0.0.1", free_port(), 1, 2, GROUP, "nccl")
        assert not ok and "nccl needs a GPU" in message
        assert_serves(e, hf["a"])
    finally:
        e.shutdown()


# ---- TP 2: every rank takes its slice of the full tensors ------------------------------------------
ROW_NAMES = ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
             "model.layers.0.self_attn.v_proj.weight", "model.layers.0.self_attn.o_proj.weight",
             "model.layers.1.mlp.gate_proj.weight", "model.layers.1.mlp.up_proj.weight",
             "model.layers.1.mlp.down_proj.weight", "model.layers.1.input_layernorm.weight", "lm_head.weight"]


def _tp_rank(tp_rank: int, addr: str, trainer_port: int, dirs: Dict[str, str], out_path: str) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "reference"))
    from hf_utils import KVDriver

    from radixserve.distributed.parallel_state import destroy_distributed_environment
    from radixserve.model_executor.model_runner import ModelRunner
    from radixserve.models.model_config import ModelConfig
    from radixserve.server_args import ServerArgs

    args = ServerArgs(model_path=dirs["a"], dtype="float32", device="cpu", max_total_tokens=2048,
                      max_running_requests=8, tp_size=2, dist_init_addr=addr)
    runner = ModelRunner(ModelConfig.from_pretrained(dirs["a"]), args, tp_rank, 2)
    replies, logits = {}, {}

    def forward(tag: str) -> None:
        runner.token_to_kv_pool_allocator.clear()
        logits[tag] = KVDriver(runner).extend([0, 1], [0, 0], PROMPTS).all_logits

    replies["refused"] = runner.update_weights_from_disk(dirs["bad_shape"])
    forward("refused")
    replies["disk"] = runner.update_weights_from_disk(dirs["b"])
    forward("disk")
    replies["tensor"] = runner.update_weights_from_tensor(checkpoint(dirs["a"]))
    forward("tensor")
    rows = {name: runner.get_weights_by_name(name, 7) for name in ROW_NAMES}
    replies["init"] = runner.init_weights_update_group("127.0.0.1", trainer_port, 1, 3, GROUP, "gloo")
    tensors = checkpoint(dirs["b"])
    replies["distributed"] = runner.update_weights_from_distributed(
        [n for n, _ in tensors], [str(t.dtype).removeprefix("torch.") for _, t in tensors],
        [list(t.shape) for _, t in tensors], GROUP)
    forward("distributed")
    replies["destroy"] = runner.destroy_weights_update_group(GROUP)
    if tp_rank == 0:
        torch.save({"replies": replies, "logits": logits, "rows": rows}, out_path)
    destroy_distributed_environment()


def test_tp2_updates_from_disk_tensor_and_distributed(dirs, hf, tmp_path):
    """Two ranks (gloo) and a trainer as rank 0 of a group of three: after each update the TP 2
    logits equal transformers' on that checkpoint; get_weights_by_name gathers whole tensors."""
    ctx = mp.get_context("spawn")
    addr, trainer_port = f"127.0.0.1:{free_port()}", free_port()
    out = tmp_path / "tp2.pt"
    procs = [ctx.Process(target=_tp_rank, args=(r, addr, trainer_port, dirs, str(out))) for r in range(2)]
    procs.append(ctx.Process(target=broadcast_checkpoint, args=(trainer_port, 3, dirs["b"])))
    run_processes(procs)
    res = torch.load(out)
    ok, message = res["replies"].pop("refused")
    assert not ok and "has shape (248, 128)" in message
    for tag, (ok, message) in res["replies"].items():
        assert ok, (tag, message)
    refs = {k: torch.cat([hf_logits(hf[k], ids) for ids in PROMPTS]) for k in ("a", "b")}
    for tag, ckpt in (("refused", "a"), ("disk", "b"), ("tensor", "a"), ("distributed", "b")):
        assert (res["logits"][tag] - refs[ckpt]).abs().max().item() <= TOL, tag
    params = dict(hf["a"].named_parameters())
    for name, rows in res["rows"].items():
        assert torch.equal(torch.tensor(rows), params[name][:7].detach()), name


def test_weight_updates_are_refused_with_pipeline_stages():
    """--pp-size > 1: the update would reach the first stage only (the later stages keep their
    old weights): refused with a reason, nothing updated."""
    from types import SimpleNamespace

    from radixserve.managers.scheduler_update_weights import SchedulerUpdateWeights
    from radixserve.protocol import UpdateWeightFromDiskReqInput, UpdateWeightsFromTensorReqInput

    updated = []
    worker = SimpleNamespace(update_weights_from_disk=updated.append, update_weights_from_tensor=updated.append)
    handler = SchedulerUpdateWeights(worker, loop=None, forward_thread=None, tree_cache=None, pp_size=2)
    for out in (handler.update_weights_from_disk(UpdateWeightFromDiskReqInput("/some/model")),
                handler.update_weights_from_tensor(UpdateWeightsFromTensorReqInput([]))):
        assert not out.success and "--pp-size" in out.message
    assert updated == []
