"""--quantization w8a8_int8 on a safetensors checkpoint (issue 38): the linear layers quantized to
ggml's Q8_0 as they load and multiplied on the GGUF path's integer kernel.

The reference is transformers on the same checkpoint with every linear weight replaced by its
Q8_0 round trip (quantize, dequantize): with the C++ kernel off the blocks are dequantized and
multiplied in float32, so the logits must be that model's to float32 error; with the kernel on
(8-bit activations) they stay close to it, closer than to the unquantized model's would allow a
wrong quantization to be."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from hf_utils import KVDriver, load_hf, make_hf_model_dir, make_runner

import radixserve.layers.quantization.gguf as quant_gguf
from radixserve import Engine
from radixserve.layers.linear import LinearBase
from radixserve.layers.quantization.w8a8_int8 import W8A8Int8LinearMethod, quantize_q8_0
from radixserve.models.model_config import LoadError

PROMPTS = [[5, 17, 200, 3, 99, 41, 7, 300, 12], [450, 2, 2, 61, 88, 130, 7, 9, 10, 11, 500, 42, 1, 77]]
LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def test_quantize_q8_0_is_ggml_byte_for_byte():
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((24, 96)) * np.linspace(0.01, 3, 96)).astype(np.float32)
    w[3, 32:64] = 0.0  # an all-zero block: d = 0, q = 0
    w[5, 5] = 0.5 * np.abs(w[5, :32]).max() * 2 / 127 * 63.5  # a value on a rounding edge somewhere
    got = quantize_q8_0(torch.from_numpy(w)).numpy()
    assert np.array_equal(got, gguf.quants.quantize(w, Q.Q8_0))


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory):
    return make_hf_model_dir("qwen2", str(tmp_path_factory.mktemp("w8a8")))


def q8_round_trip_model(model_dir: str):
    hf = load_hf(model_dir)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith(".weight") and name.rsplit(".", 2)[-2] in LINEAR:
                blocks = quantize_q8_0(p).numpy()
                p.copy_(torch.from_numpy(gguf.quants.dequantize(blocks, Q.Q8_0).reshape(p.shape)))
    return hf


def reference_logits(hf) -> torch.Tensor:
    with torch.no_grad():
        return torch.cat([hf(torch.tensor([p])).logits[0] for p in PROMPTS])


def runner_logits(model_dir: str, **kw) -> torch.Tensor:
    runner = make_runner(model_dir, max_total_tokens=1024, max_running_requests=4, quantization="w8a8_int8", **kw)
    layers = [m for m in runner.model.modules() if isinstance(m, LinearBase)]
    assert layers and all(isinstance(m.quant_method, W8A8Int8LinearMethod) and m.weight.numel() == 0 for m in layers)
    assert all(s.qtype == 8 and s.data.dtype == torch.uint8 for m in layers for s in m.quant_method.ordered)
    return KVDriver(runner).extend([0, 1], [0, 0], PROMPTS).all_logits


def test_weights_are_q8_0_blocks_and_the_logits_theirs(qwen2_dir, monkeypatch):
    want = reference_logits(q8_round_trip_model(qwen2_dir))
    exact = reference_logits(load_hf(qwen2_dir))
    monkeypatch.setattr(quant_gguf, "kernel_types", lambda: frozenset())  # dequantized, float32
    got = runner_logits(qwen2_dir)
    assert (got - want).abs().max().item() < 1e-4
    assert (exact - want).abs().max().item() > 1e-3  # the quantization is visible at this tolerance


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_integer_kernel_stays_close_to_the_quantized_model(qwen2_dir, dtype):
    if not quant_gguf.kernel_types():
        pytest.skip("the integer kernel is built only with AVX512-VNNI: the test above covers the fallback")
    want = reference_logits(q8_round_trip_model(qwen2_dir))
    got = runner_logits(qwen2_dir, dtype=dtype)
    rel = ((got - want).norm() / want.norm()).item()
    # 8-bit activations: on these random weights (logits sensitive by construction) their error is
    # the size of the weights' own Q8_0 rounding, ~2.2% (measured); a wrong scale or layout is 100%
    assert rel < 5e-2, rel


def test_refused_on_a_gguf_file(tmp_path):
    from radixserve.model_executor.model_loader import check_w8a8
    from radixserve.models.model_config import ModelConfig

    cfg = ModelConfig.from_pretrained(make_hf_model_dir("qwen2", str(tmp_path / "m")))
    cfg.gguf_file = str(tmp_path / "x.gguf")
    with pytest.raises(LoadError, match="GGUF file"):
        check_w8a8("w8a8_int8", cfg, "cpu")
    cfg.gguf_file = None
    assert check_w8a8("w8a8_int8", cfg, "cuda")  # Triton's Q8_0 kernel there (tests/unit/test_triton_gguf.py)
    assert check_w8a8("w8a8_int8", cfg, "cpu") and not check_w8a8("auto", cfg, "cpu")


def test_weight_update_from_disk_is_quantized_too(tmp_path):
    """A weight update from another checkpoint of the same model lands as Q8_0 blocks: the answers
    become that checkpoint's quantized answers."""
    a = make_hf_model_dir("qwen2", str(tmp_path / "a"), seed=0)
    b = make_hf_model_dir("qwen2", str(tmp_path / "b"), seed=1)
    prompt = PROMPTS[1]

    def greedy(engine):
        out = engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": 6, "temperature": 0},
                              return_logprob=True, progress=False)
        return out["output_ids"], [v for v, _, _ in out["meta_info"]["output_token_logprobs"]]

    kw = dict(dtype="float32", skip_tokenizer_init=True, max_total_tokens=1024, disable_overlap_schedule=True,
              quantization="w8a8_int8")
    with Engine(b, **kw) as engine:
        want_b = greedy(engine)
    with Engine(a, **kw) as engine:
        assert greedy(engine)[0] != want_b[0]
        ok, message = engine.update_weights_from_disk(b)
        assert ok, message
        got = greedy(engine)
    assert got[0] == want_b[0] and max(abs(x - y) for x, y in zip(got[1], want_b[1])) < 1e-4


def test_moe_routers_stay_as_loaded(tmp_path):
    """SGLang's rule: the routers are not quantized (a router's rounded logits would pick other
    experts); the attention projections of the same model are."""
    from test_qwen3_moe import make_moe_dir

    from radixserve.layers.moe import TopKRouter

    runner = make_runner(make_moe_dir(str(tmp_path / "moe")), max_total_tokens=1024, max_running_requests=4,
                         quantization="w8a8_int8")
    routers = [m for m in runner.model.modules() if isinstance(m, TopKRouter)]
    assert routers and not any(isinstance(m.quant_method, W8A8Int8LinearMethod) for m in routers)
    qkv = runner.model.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv.quant_method, W8A8Int8LinearMethod)
