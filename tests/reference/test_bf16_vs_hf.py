"""bfloat16 on the CPU, judged as the GPU path is (benchmarks/gpu/gpu_checks.py): with
transformers in float32 as the reference, our bf16 logits (ragged prefill, then batched decode
through the paged KV pool) may be at most 2x as far from it as transformers' own bf16 run is,
and agree on the top-1 token as often (-1 point). Run with the C++ CPU kernels (the default
path) and with the torch path they fall back to."""

from __future__ import annotations

from typing import List

import pytest
import torch
import transformers

from hf_utils import KVDriver, make_hf_model_dir
from radixserve.layers import cpu_kernels
from radixserve.model_executor.model_runner import ModelRunner
from radixserve.models.model_config import ModelConfig
from radixserve.server_args import ServerArgs

PROMPT_LENS = (64, 5, 200, 1, 130)
DECODE_STEPS = 16


def _sequences(vocab: int) -> List[List[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (n + DECODE_STEPS,), generator=g).tolist() for n in PROMPT_LENS]


def _hf_logits(model_dir: str, seqs, dtype) -> List[torch.Tensor]:
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    with torch.no_grad():
        return [hf(torch.tensor([s])).logits[0].float() for s in seqs]


def _our_logits(model_dir: str, seqs) -> List[torch.Tensor]:
    args = ServerArgs(model_path=model_dir, dtype="bfloat16", device="cpu", max_total_tokens=4096, max_running_requests=8)
    drv = KVDriver(ModelRunner(ModelConfig.from_pretrained(model_dir), args), scatter_seed=1)
    rows = list(range(len(seqs)))
    prompts = [s[:n] for s, n in zip(seqs, PROMPT_LENS)]
    out = drv.extend(rows, [0] * len(rows), prompts).all_logits.float()
    per_seq = list(out.split(list(PROMPT_LENS)))
    for step in range(DECODE_STEPS - 1):  # teacher-forced: feed the sequence's own next token
        lens = [n + step for n in PROMPT_LENS]
        logits = drv.decode(rows, lens, [s[n] for s, n in zip(seqs, lens)]).next_token_logits.float()
        per_seq = [torch.cat([p, row[None]]) for p, row in zip(per_seq, logits)]
    return per_seq


def _errors(candidate, reference):
    ref = [r[: len(c)] for c, r in zip(candidate, reference)]
    diff = torch.cat([(c - r).abs().flatten() for c, r in zip(candidate, ref)])
    top1 = torch.cat([(c.argmax(-1) == r.argmax(-1)).float() for c, r in zip(candidate, ref)])
    return diff.max().item(), diff.mean().item(), top1.mean().item()


@pytest.mark.parametrize("name", ["llama", "qwen3"])
@pytest.mark.parametrize("kernels", [True, False], ids=["cpu_kernels", "torch_path"])
def test_bf16_error_within_2x_of_transformers_bf16(name, kernels, tmp_path, monkeypatch):
    monkeypatch.setattr(cpu_kernels, "ENABLED", kernels)
    model_dir = make_hf_model_dir(name, str(tmp_path / name))
    seqs = _sequences(ModelConfig.from_pretrained(model_dir).vocab_size)
    reference = _hf_logits(model_dir, seqs, torch.float32)
    hf_max, hf_mean, hf_top1 = _errors(_hf_logits(model_dir, seqs, torch.bfloat16), reference)
    ours_max, ours_mean, ours_top1 = _errors(_our_logits(model_dir, seqs), reference)
    assert ours_max > 0  # it really ran in bf16
    assert ours_max <= 2 * hf_max and ours_mean <= 2 * hf_mean, (ours_max, hf_max, ours_mean, hf_mean)
    assert ours_top1 >= hf_top1 - 0.01


def test_auto_dtype_picks_bf16_on_a_cpu_with_native_bf16(monkeypatch):
    import radixserve.models.model_config as mc

    cfg = ModelConfig.from_pretrained(make_hf_model_dir("llama", "/tmp/radixserve_dtype_llama"))
    cfg.torch_dtype = "bfloat16"
    monkeypatch.setattr(mc, "cpu_has_native_bf16", lambda: True)
    assert cfg.resolve_dtype("auto", "cpu") == torch.bfloat16
    assert cfg.resolve_dtype("float32", "cpu") == torch.float32
    monkeypatch.setattr(mc, "cpu_has_native_bf16", lambda: False)
    assert cfg.resolve_dtype("auto", "cpu") == torch.float32
    cfg.torch_dtype = "float32"  # a float32 checkpoint stays float32 only without native bf16
    assert cfg.resolve_dtype("auto", "cpu") == torch.float32
    monkeypatch.setattr(mc, "cpu_has_native_bf16", lambda: True)
    assert cfg.resolve_dtype("auto", "cpu") == torch.bfloat16
