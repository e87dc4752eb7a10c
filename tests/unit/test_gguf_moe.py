"""--model-path FILE.gguf for Qwen3-MoE (GGUF architecture qwen3moe, issue 41): a synthetic file
written as llama.cpp's converter writes one (each layer's experts stacked in ffn_gate_exps /
ffn_up_exps / ffn_down_exps [experts, rows, cols], the router in ffn_gate_inp, a dense layer with
ffn_gate / ffn_up / ffn_down among the sparse ones, experts in Q8_0, F16 and BF16) gives the
logits of transformers' Qwen3-MoE holding the same dequantized weights, and of transformers
reading the file itself."""

from __future__ import annotations

from pathlib import Path
from typing import List

import gguf
import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as Q

from radixserve.layers.moe import SparseMoeBlock
from radixserve.model_executor.gguf_loader import hf_name
from radixserve.models.model_config import ModelConfig

from test_gguf import TOL, KVDriver, check_update_from_disk_and_release_resume, make_runner, torch_fallback  # noqa: F401 (a fixture)

CONFIG = dict(vocab_size=320, hidden_size=128, intermediate_size=192, moe_intermediate_size=64, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=2,
              norm_topk_prob=True, max_position_embeddings=1024, rms_norm_eps=1e-6, rope_theta=1e6,
              tie_word_embeddings=False)
# per GGUF tensor part: the quant type written (llama.cpp keeps the router and the norms in F32)
QTYPES = {"ffn_gate_exps": Q.Q8_0, "ffn_up_exps": Q.F16, "ffn_down_exps": Q.BF16, "ffn_gate_inp": Q.F32,
          "ffn_gate": Q.Q8_0, "ffn_up": Q.Q8_0, "ffn_down": Q.Q8_0, "attn_q": Q.Q8_0, "attn_k": Q.F16, "attn_v": Q.F16,
          "attn_output": Q.Q8_0}
HF_PART = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
           "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
           "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "mlp.gate": "ffn_gate_inp",
           "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
       "lm_head.weight": "output.weight"}


def _round_trip(p: torch.Tensor, qtype: Q) -> np.ndarray:
    """What the file holds for p, and p set to it (the reference holds the file's weights)."""
    data = p.detach().numpy()
    if qtype == Q.F32:
        return np.ascontiguousarray(data, dtype=np.float32)
    if qtype == Q.F16:
        p.copy_(p.half().float())
        return p.detach().numpy().astype(np.float16)
    q = gguf.quants.quantize(data, qtype)
    p.copy_(torch.from_numpy(gguf.quants.dequantize(q, qtype)))
    return q


def write_qwen3moe(path: Path, mlp_only_layers: List[int], seed: int = 0) -> transformers.PreTrainedModel:
    cfg = transformers.Qwen3MoeConfig(**CONFIG, mlp_only_layers=mlp_only_layers)
    torch.manual_seed(seed)
    hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    w.add_name("synthetic-qwen3moe")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    w.add_expert_count(cfg.num_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_rope_freq_base(CONFIG["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    inter = cfg.moe_intermediate_size
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if p.dim() >= 2:  # the router's too: well-separated expert choices
                p.normal_(0, p.shape[-1] ** -0.5 * (2.0 if name.endswith("mlp.gate.weight") else 1.5))
            else:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            if name in TOP:
                w.add_tensor(TOP[name], _round_trip(p, Q.Q8_0 if p.dim() == 2 else Q.F32),
                             raw_dtype=Q.Q8_0 if p.dim() == 2 else None)
                continue
            layer, rest = name.split(".", 3)[2:]
            if rest == "mlp.experts.gate_up_proj":  # [E, 2I, H]: gate rows first, as transformers reads them
                parts = {"ffn_gate_exps": p[:, :inter], "ffn_up_exps": p[:, inter:]}
            elif rest == "mlp.experts.down_proj":
                parts = {"ffn_down_exps": p}
            else:
                parts = {HF_PART[rest.rsplit(".", 1)[0]]: p}
            for part, t in parts.items():
                qtype = QTYPES.get(part, Q.F32)
                data = _round_trip(t, qtype)
                w.add_tensor(f"blk.{layer}.{part}.weight", data, raw_dtype=qtype if qtype not in (Q.F32, Q.F16) else None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return hf


def _logits(runner, prompts) -> torch.Tensor:
    return KVDriver(runner).extend(list(range(len(prompts))), [0] * len(prompts), prompts).all_logits


PROMPTS = [[5, 17, 200, 3, 99, 41, 7], [250, 2, 2, 61, 88, 130, 7, 9, 10, 11, 300, 42, 1, 77, 8, 19, 23]]


def test_stacked_expert_names():
    assert hf_name("blk.3.ffn_gate_inp.weight") == "model.layers.3.mlp.gate.weight"
    assert hf_name("blk.3.ffn_down_exps.weight") == "model.layers.3.mlp.experts.<e>.down_proj.weight"


def test_qwen3moe_gguf_matches_transformers(tmp_path):
    path = tmp_path / "qwen3moe.gguf"
    hf = write_qwen3moe(path, mlp_only_layers=[1])
    cfg = ModelConfig.from_pretrained(str(path))
    assert cfg.architecture == "Qwen3MoeForCausalLM"
    assert {k: cfg.hf_config[k] for k in ("num_experts", "num_experts_per_tok", "moe_intermediate_size",
                                          "norm_topk_prob", "mlp_only_layers")} == dict(
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True, mlp_only_layers=[1])
    runner = make_runner(str(path), max_total_tokens=1024, max_running_requests=4, dtype="float32")
    assert [isinstance(layer.mlp, SparseMoeBlock) for layer in runner.model.model.layers] == [True, False, True]
    out = _logits(runner, PROMPTS)
    with torch.no_grad():
        ref = torch.cat([hf(torch.tensor([p])).logits[0] for p in PROMPTS])
    assert ref.std() > 1.0
    assert (out - ref).abs().max().item() <= TOL, (out - ref).abs().max().item()


def test_transformers_reads_the_same_file(tmp_path):
    """Our synthetic file is the layout transformers' GGUF loader expects for qwen3moe (all layers
    sparse: the GGUF metadata cannot say mlp_only_layers; moe_intermediate_size passed, as
    transformers does not map expert_feed_forward_length, and vocab_size, which it takes from a
    tokenizer this file lacks)."""
    path = tmp_path / "qwen3moe.gguf"
    write_qwen3moe(path, mlp_only_layers=[])
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file=path.name, dtype=torch.float32, moe_intermediate_size=64, vocab_size=320).eval()
    runner = make_runner(str(path), max_total_tokens=1024, max_running_requests=4, dtype="float32")
    out = _logits(runner, PROMPTS)
    with torch.no_grad():
        ref = torch.cat([theirs(torch.tensor([p])).logits[0] for p in PROMPTS])
    assert ref.std() > 1.0
    assert (out - ref).abs().max().item() <= TOL, (out - ref).abs().max().item()


def _expert_block_bytes(path: Path) -> int:
    """Bytes of the file's quantized stacked-expert tensors (what the MoE layers keep in blocks)."""
    from radixserve.models.model_config import GGUFIndex

    kept = {Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K}
    return sum(t.data.nbytes for t in GGUFIndex(str(path)).tensors if t.tensor_type in kept and "_exps." in t.name)


def test_qwen3moe_gguf_experts_kept_in_blocks_match_transformers(tmp_path, torch_fallback):
    """--quantization gguf on an MoE file: the experts stay in the file's blocks (the Q8_0 gate
    projections as QuantizedWeight, the F16 / BF16 ones as float32), the float stacks the layer
    was built with are never filled, the bytes held are the file's, and the logits are still
    transformers' on the dequantized weights."""
    from radixserve.layers.moe import FusedMoE
    from radixserve.layers.quantization import QuantizedWeight

    path = tmp_path / "qwen3moe.gguf"
    hf = write_qwen3moe(path, mlp_only_layers=[1])
    runner = make_runner(str(path), max_total_tokens=1024, max_running_requests=4, dtype="float32", quantization="gguf")
    moes = [m for m in runner.model.modules() if isinstance(m, FusedMoE)]
    assert len(moes) == 2 and all(m.w13_weight.numel() == 0 and m.w2_weight.numel() == 0 for m in moes)
    for m in moes:
        assert len(m.expert_blocks) == 8
        for e in m.expert_blocks:
            assert isinstance(e["w1"], QuantizedWeight) and e["w1"].qtype == Q.Q8_0
            assert isinstance(e["w3"], torch.Tensor) and isinstance(e["w2"], torch.Tensor)
    held = sum(e["w1"].data.nbytes for m in moes for e in m.expert_blocks)
    assert held == _expert_block_bytes(path)
    out = _logits(runner, PROMPTS)
    with torch.no_grad():
        ref = torch.cat([hf(torch.tensor([p])).logits[0] for p in PROMPTS])
    assert (out - ref).abs().max().item() <= TOL, (out - ref).abs().max().item()


def test_qwen3moe_gguf_experts_in_blocks_on_the_integer_kernel(tmp_path):
    """The CPU's default (bf16 mode, the C++ integer kernel with 8-bit activations, as llama.cpp):
    close to the float32 reference on the same file, not equal to it."""
    from radixserve.layers.quantization.gguf import kernel_types

    if Q.Q8_0 not in kernel_types():
        pytest.skip("no AVX512-VNNI kernel here: the blocks run on the torch fallback (the test above)")
    path = tmp_path / "qwen3moe.gguf"
    write_qwen3moe(path, mlp_only_layers=[1])
    blocks = make_runner(str(path), max_total_tokens=1024, max_running_requests=4, dtype="bfloat16")
    assert blocks.model.model.layers[0].mlp.experts.expert_blocks is not None
    ref = _logits(make_runner(str(path), max_total_tokens=1024, max_running_requests=4, dtype="float32"), PROMPTS)
    out = _logits(blocks, PROMPTS)
    rel = ((out - ref).norm() / ref.norm()).item()
    assert 0 < rel <= 0.05, rel


def test_qwen3moe_gguf_experts_in_blocks_update_from_disk_and_release_resume(tmp_path, torch_fallback):
    """A weight update from another GGUF of the same model replaces the experts' blocks, and
    release/resume frees and restores them (the experts' storage is among the weights released)."""
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    write_qwen3moe(a, mlp_only_layers=[1], seed=0)
    write_qwen3moe(b, mlp_only_layers=[1], seed=1)

    def first_expert_blocks(engine) -> torch.Tensor:
        return engine.scheduler.tp_worker.model_runner.model.model.layers[0].mlp.experts.expert_blocks[0]["w1"].data

    check_update_from_disk_and_release_resume(a, b, PROMPTS[1], first_expert_blocks)
