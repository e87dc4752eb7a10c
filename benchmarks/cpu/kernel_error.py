"""Each CPU kernel's error on real SmolLM2-135M-Instruct activations, against float64 math on the
checkpoint's own (unrounded) weights: the bf16 GEMM (q|k|v, down, LM head), fused add+RMSNorm,
rotary, SiLU-and-mul, decode attention and the KV store.

Activations come from transformers' float32 forward of the same GGUF (hooks on layers 0, 15 and
29) over a few chat prompts. Each kernel runs the way a mode runs it:

  torch-bf16    the layers' torch code with bf16 activations and weights (RADIXSERVE_DISABLE_CPU_KERNELS=1)
  cpp-bf16      the C++ kernels with bf16 activations (what --dtype bfloat16 ran before issue 25)
  cpp-wo        the C++ kernels as the CPU runs bf16 now: float32 activations, bf16 weights,
                the KV cache in --kv-cache-dtype (one row per KV dtype for attention); for the
                LM head also with refine_top_logits (its 64 largest logits again in float32)

Columns: relative L2 error ||y - ref|| / ||ref|| (median over layers and prompts) and the worst
absolute error over max|ref|. "floor" rows give the part no bf16-weight engine avoids: float64
math on the bf16-rounded weights.

    python benchmarks/cpu/kernel_error.py --out benchmarks/cpu/kernel_error.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Callable, Dict, List, Optional

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO))

from real_model import chat_prompt_ids, hf_from_gguf, smollm2_gguf  # noqa: E402
from radixserve.layers import cpu_kernels  # noqa: E402
from radixserve.layers.activation import SiluAndMul  # noqa: E402
from radixserve.layers.layernorm import RMSNorm  # noqa: E402
from radixserve.layers.rotary_embedding import RotaryEmbedding  # noqa: E402

LAYERS = (0, 15, 29)
PROMPTS = [
    "Explain in a few sentences why the sky is blue, and what changes at sunset.",
    "List five everyday uses of vinegar in a kitchen, with one sentence each.",
    "Write a short story, of about eight sentences, about a lighthouse keeper and a storm.",
]
BF16 = torch.bfloat16
F32 = torch.float32
F64 = torch.float64


def capture(model, ids: List[int]) -> Dict[int, Dict[str, torch.Tensor]]:
    """What each hooked layer saw during a float32 forward of `ids`."""
    got: Dict[int, Dict[str, torch.Tensor]] = {l: {} for l in LAYERS}
    hooks = []

    def save(layer, name, which):
        def hook(mod, args, out=None):
            got[layer][name] = (args[0] if which == "in" else out).detach()[0].clone()
        return hook

    for l in LAYERS:
        layer = model.model.layers[l]
        hooks.append(layer.register_forward_pre_hook(save(l, "layer_in", "in")))
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            mod = getattr(layer.self_attn, name)
            hooks.append(mod.register_forward_hook(save(l, name, "out")))
        hooks.append(layer.self_attn.q_proj.register_forward_hook(save(l, "attn_in", "in")))
        hooks.append(layer.mlp.gate_proj.register_forward_hook(save(l, "gate", "out")))
        hooks.append(layer.mlp.up_proj.register_forward_hook(save(l, "up", "out")))
        hooks.append(layer.mlp.down_proj.register_forward_hook(save(l, "down_in", "in")))
    hooks.append(model.model.norm.register_forward_hook(save(LAYERS[-1], "final", "out")))
    with torch.no_grad():
        model(torch.tensor([ids]))
    for h in hooks:
        h.remove()
    return got


def rel(y: Optional[torch.Tensor], ref: torch.Tensor):
    if y is None:
        return None
    d = y.double() - ref
    return (d.norm() / ref.norm()).item(), (d.abs().max() / ref.abs().max()).item()


def gemm(ops, x: torch.Tensor, w: torch.Tensor, mode: str) -> Optional[torch.Tensor]:
    wb = w.to(BF16)
    if mode == "torch-bf16":
        return torch.nn.functional.linear(x.to(BF16), wb)
    packed = ops.pack_bf16_weight(wb)
    try:
        return ops.bf16_linear(x.to(BF16 if mode == "cpp-bf16" else F32), packed, w.shape[0])
    except RuntimeError:  # a build whose GEMM takes bf16 activations only
        return None


def rope_ref(x: torch.Tensor, head_dim: int, theta: float) -> torch.Tensor:
    """neox rotary in float64: x [T, heads, D] at positions 0..T-1."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=F64) / head_dim))
    ang = torch.outer(torch.arange(x.shape[0], dtype=F64), inv)
    cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]
    half = head_dim // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x.double() * cos + rot.double() * sin


def attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """The last token's q [H, D] over k/v [T, Hkv, D], float64."""
    g = q.shape[0] // k.shape[1]
    kk, vv = k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1)
    s = torch.einsum("hd,thd->ht", q.double(), kk) * scale
    return torch.einsum("ht,thd->hd", s.softmax(-1), vv)


def decode_attention(ops, q, k, v, scale, q_dtype, kv_dtype):
    T = k.shape[0]
    k_buf = torch.zeros(T + 1, *k.shape[1:], dtype=kv_dtype)
    v_buf = torch.zeros_like(k_buf)
    k_buf[:T], v_buf[:T] = k.to(kv_dtype), v.to(kv_dtype)
    qq = q[None].to(q_dtype).contiguous()
    out = torch.empty_like(qq)
    r2t = torch.arange(T + 1, dtype=torch.int32)[None]
    try:
        ops.decode_attention(out, qq, k_buf, v_buf, r2t, torch.tensor([0]), torch.tensor([T]), scale)
    except RuntimeError:  # a build without mixed q / KV dtypes
        return None
    return out[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    ap.add_argument("--label", default="", help="a tag stored with the rows (e.g. the commit)")
    args = ap.parse_args()
    ops = cpu_kernels.build()
    assert ops is not None, "the C++ kernels did not build"
    path = smollm2_gguf()
    model = hf_from_gguf(path)
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    cfg = model.config
    H, Hkv, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
    scale = D**-0.5
    theta = float(cfg.rope_parameters["rope_theta"])
    rope = RotaryEmbedding(D, 4096, theta)
    silu = SiluAndMul()
    rows: Dict[str, List] = {}

    def add(name: str, y, ref):
        r = rel(y, ref)
        if r is not None:
            rows.setdefault(name, []).append(r)

    for prompt in PROMPTS:
        ids = chat_prompt_ids(tok, prompt)
        for l, a in capture(model, ids).items():
            layer = model.model.layers[l]
            wqkv = torch.cat([layer.self_attn.q_proj.weight, layer.self_attn.k_proj.weight, layer.self_attn.v_proj.weight])
            wdown = layer.mlp.down_proj.weight
            ln = layer.post_attention_layernorm
            # GEMMs: reference on the checkpoint's weights; floor: the same math on bf16 weights
            for name, x, w in (("GEMM q|k|v", a["attn_in"], wqkv), ("GEMM down", a["down_in"], wdown)):
                ref = x.double() @ w.double().T
                add(f"{name} [floor: bf16 weights]", x.double() @ w.to(BF16).double().T, ref)
                for mode in ("torch-bf16", "cpp-bf16", "cpp-wo"):
                    with torch.no_grad():
                        add(f"{name} [{mode}]", gemm(ops, x, w, mode), ref)
            # fused add + RMSNorm: attention output + the layer's input
            x, r = a["o_proj"], a["layer_in"]
            s = x.double() + r.double()
            ref = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + ln.variance_epsilon) * ln.weight.double()
            norm = RMSNorm(x.shape[-1], ln.variance_epsilon)
            for mode in ("torch-bf16", "cpp-bf16", "cpp-wo"):
                cpu_kernels.ENABLED = mode != "torch-bf16"
                dt = F32 if mode == "cpp-wo" else BF16
                norm.weight.data = ln.weight.detach().to(dt)
                out, res = norm.forward(x.to(dt), r.to(dt))
                add(f"add+RMSNorm out [{mode}]", out, ref)
                add(f"residual stream [{mode}]", res, s)
            # rotary on q and k
            q = a["q_proj"].view(-1, H, D)
            k = a["k_proj"].view(-1, Hkv, D)
            pos = torch.arange(q.shape[0])
            q_ref, k_ref = rope_ref(q, D, theta), rope_ref(k, D, theta)
            for mode in ("torch-bf16", "cpp-bf16", "cpp-wo"):
                cpu_kernels.ENABLED = mode != "torch-bf16"
                dt = F32 if mode == "cpp-wo" else BF16
                qo, ko = rope.forward(pos, q.to(dt), k.to(dt))
                add(f"rotary q [{mode}]", qo, q_ref)
                add(f"rotary k [{mode}]", ko, k_ref)
            # SiLU-and-mul
            gu = torch.cat([a["gate"], a["up"]], -1)
            ref = torch.nn.functional.silu(a["gate"].double()) * a["up"].double()
            for mode in ("torch-bf16", "cpp-bf16", "cpp-wo"):
                cpu_kernels.ENABLED = mode != "torch-bf16"
                add(f"SiLU-and-mul [{mode}]", silu.forward(gu.to(F32 if mode == "cpp-wo" else BF16)), ref)
            cpu_kernels.ENABLED = True
            # decode attention of the last token over the whole prompt, and the KV store itself
            v = a["v_proj"].view(-1, Hkv, D)
            qr, kr = q_ref.float(), k_ref.float()
            ref = attention_ref(q_ref[-1], k_ref, v, scale)
            qr_last = qr[-1]
            add("decode attention [torch-bf16]", torch.nn.functional.scaled_dot_product_attention(
                qr_last.to(BF16)[None, :, None], kr.to(BF16).transpose(0, 1)[None], v.to(BF16).transpose(0, 1)[None],
                scale=scale, enable_gqa=True)[0, :, 0], ref)
            add("decode attention [cpp-bf16]", decode_attention(ops, qr_last, kr, v, scale, BF16, BF16), ref)
            for kv_name, kv_dt in (("bf16", BF16), ("fp16", torch.float16), ("fp32", F32)):
                add(f"decode attention [cpp-wo, KV {kv_name}]", decode_attention(ops, qr_last, kr, v, scale, F32, kv_dt), ref)
                add(f"KV store, K [{kv_name}]", kr.to(kv_dt), k_ref)
        # the LM head on the final hidden states (tied to the embedding)
        hfin = a["final"] if "final" in a else None
        if hfin is not None:
            w = model.lm_head.weight
            ref = hfin.double() @ w.double().T
            add("GEMM LM head [floor: bf16 weights]", hfin.double() @ w.to(BF16).double().T, ref)
            top = ref.topk(64, dim=-1).indices  # the logits greedy choice, sampling and logprobs read
            for mode in ("torch-bf16", "cpp-bf16", "cpp-wo", "cpp-wo + refine"):
                y = gemm(ops, hfin, w, mode.split(" ")[0])
                if y is not None and mode.endswith("refine"):
                    y = y.contiguous()
                    ops.refine_top_logits(y, hfin, w.to(BF16).contiguous(), 64)
                if mode != "cpp-wo + refine":
                    add(f"GEMM LM head [{mode}]", y, ref)
                if y is not None:
                    add(f"LM head, each row's top 64 logits [{mode}]", y.gather(-1, top), ref.gather(-1, top))

    table = []
    print(f"{'kernel [mode]':52s} {'rel L2 (median)':>16s} {'max abs / max|ref|':>20s}")
    for name, vals in rows.items():
        l2 = statistics.median(v[0] for v in vals)
        mx = max(v[1] for v in vals)
        table.append({"kernel": name, "rel_l2_median": l2, "max_abs_over_max_ref": mx, "n": len(vals)})
        print(f"{name:52s} {l2:16.2e} {mx:20.2e}")
    if args.out:
        Path(args.out).write_text(json.dumps({"label": args.label, "rows": table}, indent=1) + "\n")


if __name__ == "__main__":
    main()
