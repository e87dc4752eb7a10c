"""A roofline cost model: how long one forward of a batch takes on a device.

Every forward (EXTEND, DECODE, MIXED) is described the same way, per request i:

    prefix_len p_i (KV already in the pool)   extend_len e_i (tokens computed now)
    DECODE is e_i = 1, p_i = seq_len - 1.

From the model config (per TP rank):

    linear FLOPs  = 2 * linear_params * sum(e_i)            (QKV, O, gate/up/down)
                  + 2 * lm_head_params * bs                  (logits of the last position only)
    attn FLOPs    = 4 * heads * head_dim * layers * sum(e_i * p_i + e_i * (e_i + 1) / 2)
                    (QK^T and PV of every new token against the tokens before it, causal)
    bytes         = weight bytes                             (read once per forward)
                  + kv_bytes_per_token * sum(p_i + e_i)      (KV read by attention, new KV written)

    step time = overhead + per_req * bs + per_token * sum(e_i)
              + combine(linear / (peak * flops_eff) + attn / (peak * attn_eff),  bytes / (bw * bw_eff))
              + TP all-reduce time

`combine` is max on GPUs (compute and memory traffic overlap: the roofline) and sum on the
CPU preset, whose torch-native kernels do not overlap them; its constants are fitted to
`radixserve bench one-batch` measurements on this machine (see `fit_cpu_device`).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

from radixserve.models.model_config import ModelConfig

GiB = 1024**3


@dataclass(frozen=True)
class DeviceSpec:
    name: str
    peak_flops: float  # dense matmul FLOP/s at the model dtype (bf16 on GPU, fp32 on CPU)
    mem_bandwidth: float  # bytes/s
    memory_bytes: float  # device memory (HBM): weights + KV pool must fit in mem_fraction_static of it
    flops_efficiency: float = 0.6  # achieved fraction of peak in the GEMMs (MFU)
    attn_efficiency: float = 0.4  # achieved fraction of peak in prefill attention
    bw_efficiency: float = 0.8  # achieved fraction of bandwidth when memory-bound
    step_overhead_s: float = 0.0  # per forward: launches, CPU scheduling left exposed, sampling
    per_req_overhead_s: float = 0.0  # per request in the batch (metadata, sampler rows)
    per_token_overhead_s: float = 0.0  # per computed token (embedding, norms, rotary: small kernels)
    combine: str = "max"  # "max": roofline (GPU); "sum": compute and memory do not overlap (CPU)
    dtype_bytes: int = 2  # bytes per weight / KV element

    @property
    def kind(self) -> str:
        """The device kind ServerArgs' by-device defaults take: the "sum" form is the CPU's."""
        return "cpu" if self.combine == "sum" else "cuda"
    link_bandwidth: float = 450e9  # bytes/s per GPU for TP all-reduce (NVLink)

    def with_overrides(self, **changes: Any) -> "DeviceSpec":
        return dataclasses.replace(self, **{k: v for k, v in changes.items() if v is not None})


# Public numbers: H100 SXM 989 TFLOP/s dense bf16, 3.35 TB/s HBM3, 80 GB; H200 the same compute
# with 4.8 TB/s HBM3e and 141 GB. Efficiencies are typical of SGLang with FlashInfer + CUDA graphs
# (about 60% MFU in large prefills, about 80% of bandwidth in decode; ~0.3 ms fixed per step).
DEVICE_PRESETS: Dict[str, DeviceSpec] = {
    "h100": DeviceSpec(
        name="h100", peak_flops=989e12, mem_bandwidth=3.35e12, memory_bytes=80e9,
        flops_efficiency=0.6, attn_efficiency=0.4, bw_efficiency=0.8,
        step_overhead_s=3e-4, per_req_overhead_s=2e-6, per_token_overhead_s=0.0, combine="max", dtype_bytes=2,
    ),
    "h200": DeviceSpec(
        name="h200", peak_flops=989e12, mem_bandwidth=4.8e12, memory_bytes=141e9,
        flops_efficiency=0.6, attn_efficiency=0.4, bw_efficiency=0.8,
        step_overhead_s=3e-4, per_req_overhead_s=2e-6, per_token_overhead_s=0.0, combine="max", dtype_bytes=2,
    ),
    # This machine (2 shared x86 cores, torch CPU, float32, the torch-native attention backend),
    # fitted with `radixserve simulate --fit-cpu` on bench one-batch runs (tiny model, batch
    # 1-64, input 128 and 512): benchmarks/simulate_cpu_calibration.json. peak_flops and
    # mem_bandwidth are effective rates (efficiency 1); attention runs at 18% of the GEMM rate
    # (one SDPA call per request); the fixed cost per step is the weights' bytes.
    "cpu": DeviceSpec(
        name="cpu", peak_flops=1.355e11, mem_bandwidth=4.217e9, memory_bytes=16 * GiB,
        flops_efficiency=1.0, attn_efficiency=0.181, bw_efficiency=1.0,
        step_overhead_s=0.0, per_req_overhead_s=1.70e-4, per_token_overhead_s=0.0, combine="sum", dtype_bytes=4,
    ),
}


def get_device(name: str) -> DeviceSpec:
    key = name.lower()
    if key not in DEVICE_PRESETS:
        raise ValueError(f"unknown device {name!r}: choose one of {', '.join(DEVICE_PRESETS)}")
    return DEVICE_PRESETS[key]


@dataclass(frozen=True)
class ModelShape:
    """The sizes the cost model needs, per TP rank."""

    layers: int
    hidden: int
    heads: int  # attention heads on this rank
    kv_heads: int  # KV heads on this rank
    head_dim: int
    linear_params: int  # QKV + O + MLP of all layers, on this rank
    lm_head_params: int  # on this rank
    embed_params: int  # the input embedding (0 extra bytes when tied to the LM head)
    dtype_bytes: int

    @classmethod
    def from_config(cls, cfg: ModelConfig, dtype_bytes: int, tp_size: int = 1) -> "ModelShape":
        h, hd, L = cfg.hidden_size, cfg.head_dim, cfg.num_hidden_layers
        heads = max(cfg.num_attention_heads // tp_size, 1)
        kv_heads = max(cfg.num_key_value_heads // tp_size, 1)
        q = h * heads * hd
        kv = 2 * h * kv_heads * hd
        o = heads * hd * h
        mlp = 3 * h * cfg.intermediate_size // tp_size
        lm_head = cfg.vocab_size * h // tp_size
        embed = 0 if cfg.tie_word_embeddings else cfg.vocab_size * h // tp_size
        return cls(L, h, heads, kv_heads, hd, L * (q + kv + o + mlp), lm_head, embed, dtype_bytes)

    @property
    def weight_bytes(self) -> int:
        return (self.linear_params + self.lm_head_params + self.embed_params) * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes


@dataclass
class StepCost:
    seconds: float
    linear_flops: float
    attn_flops: float
    bytes: float
    compute_s: float
    memory_s: float


class CostModel:
    def __init__(self, model_config: ModelConfig, device: DeviceSpec, tp_size: int = 1, dtype_bytes: Optional[int] = None):
        self.model_config = model_config
        self.device = device
        self.tp_size = tp_size
        self.shape = ModelShape.from_config(model_config, dtype_bytes or device.dtype_bytes, tp_size)

    def kv_pool_tokens(self, mem_fraction_static: float) -> int:
        """KV pool size from device memory: mem_fraction_static of it holds weights + KV (SGLang)."""
        budget = self.device.memory_bytes * mem_fraction_static - self.shape.weight_bytes
        return max(int(budget // self.shape.kv_bytes_per_token), 0)

    def step(self, extend_lens: Sequence[int], prefix_lens: Sequence[int]) -> StepCost:
        s, d = self.shape, self.device
        bs = len(extend_lens)
        tokens = sum(extend_lens)
        ctx_pairs = sum(e * p + e * (e + 1) / 2 for e, p in zip(extend_lens, prefix_lens))
        kv_tokens = sum(p + e for e, p in zip(extend_lens, prefix_lens))
        linear = 2.0 * s.linear_params * tokens + 2.0 * s.lm_head_params * bs
        attn = 4.0 * s.heads * s.head_dim * s.layers * ctx_pairs
        nbytes = float(s.linear_params + s.lm_head_params) * s.dtype_bytes + float(s.kv_bytes_per_token) * kv_tokens
        compute_s = linear / (d.peak_flops * d.flops_efficiency) + attn / (d.peak_flops * d.attn_efficiency)
        memory_s = nbytes / (d.mem_bandwidth * d.bw_efficiency)
        body = max(compute_s, memory_s) if d.combine == "max" else compute_s + memory_s
        t = d.step_overhead_s + d.per_req_overhead_s * bs + d.per_token_overhead_s * tokens + body
        if self.tp_size > 1:
            # Two all-reduces of the hidden states per layer (ring: 2 (n-1)/n of the data).
            ar_bytes = 2 * s.layers * tokens * s.hidden * s.dtype_bytes * 2 * (self.tp_size - 1) / self.tp_size
            t += ar_bytes / d.link_bandwidth
        return StepCost(t, linear, attn, nbytes, compute_s, memory_s)

    def decode_time(self, batch_size: int, seq_len: int) -> float:
        """A DECODE step of batch_size requests that each have seq_len tokens after it."""
        return self.step([1] * batch_size, [seq_len - 1] * batch_size).seconds

    def prefill_time(self, batch_size: int, input_len: int) -> float:
        return self.step([input_len] * batch_size, [0] * batch_size).seconds


# ---- calibration (CPU) -------------------------------------------------------------------------
def load_one_batch_points(paths: Sequence[str], stat: str = "median", keep_within: Optional[float] = None) -> List[Dict[str, float]]:
    """Measured points from `bench one-batch` JSON files: one prefill and one decode point per
    batch size and input length. The same point in several files keeps its fastest
    measurement (on a shared machine, load from others only ever adds time); with
    keep_within=f, every measurement within f times the fastest is kept (the fit then covers
    the spread of undisturbed runs). stat "min" uses decode_ms_per_step_min instead of the
    median step."""
    best: Dict[tuple, Dict[str, float]] = {}
    every: List[Dict[str, float]] = []
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        # A bench one-batch report, or a calibration file holding several ("reports").
        for rep in data.get("reports", [data]):
            n, steps = rep["input_len"], rep["decode_steps"]
            for r in rep["results"]:
                o, bs = r["ours"], r["batch_size"]
                dec = o["decode_ms_per_step_min"] if stat == "min" and "decode_ms_per_step_min" in o else o["decode_ms_per_step"]
                # The median decode step runs at about the middle of the timed context range.
                for p in (dict(kind="prefill", batch_size=bs, input_len=n, seq_len=n, seconds=o["prefill_ms"] / 1e3),
                          dict(kind="decode", batch_size=bs, input_len=n, seq_len=n + 2 + steps // 2, seconds=dec / 1e3)):
                    key = (p["kind"], bs, n)
                    every.append(p)
                    if key not in best or p["seconds"] < best[key]["seconds"]:
                        best[key] = p
    if keep_within is not None:
        return [p for p in every if p["seconds"] <= keep_within * best[(p["kind"], p["batch_size"], p["input_len"])]["seconds"]]
    return [best[k] for k in sorted(best)]


def points_to_one_batch_report(points: Sequence[Dict[str, float]], decode_steps: int = 8) -> List[Dict[str, Any]]:
    """Merged points back in bench one-batch's JSON shape, one report per input length."""
    reports = []
    for n in sorted({int(p["input_len"]) for p in points}):
        rows: Dict[int, Dict[str, Any]] = {}
        for p in points:
            if int(p["input_len"]) != n:
                continue
            o = rows.setdefault(int(p["batch_size"]), {"batch_size": int(p["batch_size"]), "ours": {}})["ours"]
            o["prefill_ms" if p["kind"] == "prefill" else "decode_ms_per_step"] = p["seconds"] * 1e3
        reports.append(dict(benchmark="one_batch", model_path="tiny (embedded)", device="cpu", input_len=n,
                            decode_steps=decode_steps, results=[rows[b] for b in sorted(rows)]))
    return reports


def predict_point(cm: CostModel, p: Dict[str, float]) -> float:
    if p["kind"] == "prefill":
        return cm.prefill_time(int(p["batch_size"]), int(p["input_len"]))
    return cm.decode_time(int(p["batch_size"]), int(p["seq_len"]))


def fit_cpu_device(model_config: ModelConfig, points: Sequence[Dict[str, float]], base: Optional[DeviceSpec] = None,
                   iterations: int = 200) -> DeviceSpec:
    """Fit t = c0 + c1*bs + c2*tokens + linear/F + attn/A + bytes/B (the "sum" form: linear in
    c0, c1, c2, 1/F, 1/A, 1/B) on relative error, minimizing the largest error. Negative
    coefficients are dropped and the rest refitted, so every fitted rate is physical."""
    import numpy as np

    base = base or DEVICE_PRESETS["cpu"]
    unit = dataclasses.replace(base, peak_flops=1.0, mem_bandwidth=1.0, flops_efficiency=1.0, attn_efficiency=1.0,
                               bw_efficiency=1.0, step_overhead_s=0.0, per_req_overhead_s=0.0, per_token_overhead_s=0.0,
                               combine="sum")
    cm = CostModel(model_config, unit)
    rows, ys = [], []
    for p in points:
        bs = int(p["batch_size"])
        if p["kind"] == "prefill":
            ext, pre = [int(p["input_len"])] * bs, [0] * bs
        else:
            ext, pre = [1] * bs, [int(p["seq_len"]) - 1] * bs
        c = cm.step(ext, pre)
        rows.append([1.0, bs, sum(ext), c.linear_flops, c.attn_flops, c.bytes])
        ys.append(p["seconds"])
    X, y = np.array(rows, dtype=float), np.array(ys, dtype=float)
    Xr = X / y[:, None]  # rows scaled so that the residual is the relative error

    def nonneg_lstsq(w: "np.ndarray") -> "np.ndarray":
        active = list(range(X.shape[1]))
        coef = np.zeros(X.shape[1])
        while active:
            sol, *_ = np.linalg.lstsq(Xr[:, active] * w[:, None], w, rcond=None)
            if (sol >= 0).all():
                coef[active] = sol
                break
            active.pop(int(np.argmin(sol)))
        return coef

    # Lawson's iteration: reweight toward the worst points, so the fit minimizes the largest
    # relative error (the test's criterion) rather than the mean square; keep the best seen.
    w = np.ones_like(y)
    coef = nonneg_lstsq(w)
    best, best_err = coef, np.abs(Xr @ coef - 1).max()
    for _ in range(iterations):
        err = np.abs(Xr @ coef - 1)
        w = w * (err + 1e-6)
        w = w / w.sum() * len(w)
        coef = nonneg_lstsq(np.sqrt(w))
        e = np.abs(Xr @ coef - 1).max()
        if e < best_err:
            best, best_err = coef, e
    coef = best
    c0, c1, c2, inv_f, inv_a, inv_b = coef.tolist()
    big = 1e30  # the rate of a dropped term: effectively free
    peak = 1 / inv_f if inv_f > 0 else (1 / inv_a if inv_a > 0 else big)
    return dataclasses.replace(
        base, peak_flops=peak, flops_efficiency=1.0 if inv_f > 0 else big,
        attn_efficiency=(1 / inv_a) / peak if inv_a > 0 else big,
        mem_bandwidth=1 / inv_b if inv_b > 0 else big, bw_efficiency=1.0,
        step_overhead_s=c0, per_req_overhead_s=c1, per_token_overhead_s=c2, combine="sum",
    )
