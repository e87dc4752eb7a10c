"""--dtype auto on a float32 checkpoint: bf16 where the device has native bf16 math (issue 31, as
SGLang and vLLM downcast float32 checkpoints), with one log line; float32 where it has not;
--dtype float32 keeps float32."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest
import torch

import radixserve.models.model_config as mc
from radixserve.model_executor.model_runner import ModelRunner
from radixserve.models.model_config import ModelConfig
from radixserve.server_args import ServerArgs

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "reference"))
from hf_utils import make_hf_model_dir  # noqa: E402

LOGGER = "radixserve.models.model_config"


@pytest.fixture(scope="module")
def float32_dir(tmp_path_factory) -> str:
    return make_hf_model_dir("llama", str(tmp_path_factory.mktemp("fp32") / "llama"))


def _runner(model_dir: str, dtype: str) -> ModelRunner:
    args = ServerArgs(model_path=model_dir, dtype=dtype, device="cpu", max_total_tokens=512, max_running_requests=4)
    return ModelRunner(ModelConfig.from_pretrained(model_dir), args)


def _weight_dtype(runner: ModelRunner) -> torch.dtype:
    # The embedding table keeps the weights' dtype in the CPU's bf16 mode (the linears are packed).
    return runner.model.model.embed_tokens.weight.dtype


def _downcast_logs(caplog) -> list:
    return [r for r in caplog.records if r.name == LOGGER and "float32 checkpoint" in r.getMessage()]


def test_the_checkpoint_is_float32(float32_dir):
    assert ModelConfig.from_pretrained(float32_dir).torch_dtype == "float32"


def test_detection_matches_the_cpu_flags_or_the_bf16_gemm():
    flags = Path("/proc/cpuinfo").read_text().split() if Path("/proc/cpuinfo").exists() else []
    if not flags:
        pytest.skip("no /proc/cpuinfo to compare with")
    from radixserve.layers import cpu_kernels

    ops = cpu_kernels.get()
    gemm = ops is not None and bool(ops.has_bf16_gemm())  # the engine's bf16 GEMM (AVX2 + FMA too)
    assert mc.cpu_has_native_bf16() == ("avx512_bf16" in flags or "amx_bf16" in flags or "amx_tile" in flags or gemm)


def test_auto_runs_a_float32_checkpoint_in_bf16_with_native_bf16(float32_dir, monkeypatch, caplog):
    monkeypatch.setattr(mc, "cpu_has_native_bf16", lambda: True)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        runner = _runner(float32_dir, "auto")
    assert runner.dtype == torch.bfloat16
    assert _weight_dtype(runner) == torch.bfloat16
    logs = _downcast_logs(caplog)
    assert len(logs) == 1 and "bfloat16" in logs[0].getMessage()


def test_auto_keeps_float32_without_native_bf16(float32_dir, monkeypatch, caplog):
    monkeypatch.setattr(mc, "cpu_has_native_bf16", lambda: False)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        runner = _runner(float32_dir, "auto")
    assert runner.dtype == torch.float32
    assert _weight_dtype(runner) == torch.float32
    assert not _downcast_logs(caplog)


def test_dtype_float32_keeps_float32(float32_dir, monkeypatch, caplog):
    monkeypatch.setattr(mc, "cpu_has_native_bf16", lambda: True)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        runner = _runner(float32_dir, "float32")
    assert runner.dtype == torch.float32
    assert _weight_dtype(runner) == torch.float32
    assert not _downcast_logs(caplog)


def test_auto_on_other_checkpoints_and_devices(float32_dir, monkeypatch, caplog):
    cfg = ModelConfig.from_pretrained(float32_dir)
    native = {"cpu": True, "cuda": True}
    monkeypatch.setattr(mc, "has_native_bf16", lambda device: native[device])
    with caplog.at_level(logging.INFO, logger=LOGGER):
        for ckpt in ("bfloat16", "float16", None):
            cfg.torch_dtype = ckpt
            assert cfg.resolve_dtype("auto", "cpu") == torch.bfloat16
        assert not _downcast_logs(caplog)  # only a float32 checkpoint's downcast is logged
        cfg.torch_dtype = "float16"  # a GPU keeps a half checkpoint's dtype
        assert cfg.resolve_dtype("auto", "cuda") == torch.float16
        cfg.torch_dtype = "float32"
        assert cfg.resolve_dtype("auto", "cuda") == torch.bfloat16
        native["cuda"] = False  # a GPU without bf16 tensor cores keeps float32 exact
        assert cfg.resolve_dtype("auto", "cuda") == torch.float32
        native["cpu"] = False  # a CPU without native bf16 runs every checkpoint in float32
        for ckpt in ("float32", "bfloat16", "float16"):
            cfg.torch_dtype = ckpt
            assert cfg.resolve_dtype("auto", "cpu") == torch.float32
            assert cfg.resolve_dtype("bfloat16", "cpu") == torch.bfloat16  # an explicit dtype wins


def test_the_embedded_tiny_model_stays_float32(monkeypatch, tmp_path):
    """The tiny model served without --model-path gives the same bits on every machine; a copy of
    it elsewhere is an ordinary float32 checkpoint."""
    from radixserve.tiny_model import get_tiny_model_path, make_tiny_model

    monkeypatch.setattr(mc, "cpu_has_native_bf16", lambda: True)
    tiny = ModelConfig.from_pretrained(str(get_tiny_model_path()))
    assert tiny.torch_dtype == "float32" and tiny.resolve_dtype("auto", "cpu") == torch.float32
    copy = ModelConfig.from_pretrained(str(make_tiny_model(tmp_path / "tiny_copy")))
    assert copy.resolve_dtype("auto", "cpu") == torch.bfloat16
