"""Mixture of experts: the top-k router and the experts' weights stacked in one layer (SGLang's
FusedMoE names: w13_weight holds each expert's gate and up projections, w2_weight its down one).

The router picks each token's top-k experts from a softmax over all of them (in float32, as
transformers does; renormalized over the k when the config's norm_topk_prob says so). The experts
then run one at a time over the tokens routed to them (gathered, then scattered back weighted):
a Python loop over the experts the batch hits, never over tokens. That loop reads which experts
are hit on the host, so a model with experts runs without CUDA graphs. On a GPU the experts run as
one Triton grouped GEMM per projection instead (moe_triton.py, SGLang's fused_moe design).

In the CPU's bf16 mode each expert's matrices are packed for the C++ bf16 GEMM, as the linear
layers are (activations stay float32), and stacked, so that the C++ MoE kernel
(cpu_kernels.fused_moe_bf16) runs every used expert of a step in one call; the loop stays as its
reference and as the path everywhere else.

Tensor parallelism splits every expert's intermediate dimension (w13 by rows, w2 by columns) and
all-reduces the output, as RowParallelLinear does. With --ep-size the TP ranks are split into
groups that each hold whole experts instead (parallel_state.MoEParallel): a rank's expert ids are
local, the router's ids of other ranks' experts become -1 and are skipped, and the same all-reduce
sums the ranks' partial outputs.

A GGUF file's experts can stay in their blocks (--quantization gguf / auto in the CPU's bf16 mode:
keep_gguf_blocks before loading): each local expert then holds its gate, up and down matrices as
the file's QuantizedWeights (or float tensors for the file's F16/BF16 ones), multiplied by the
GGUF kernels (layers/quantization/gguf.py), and memory is about the file's size.

While /start_expert_distribution_record is on, each layer adds its routed (token, expert) pairs to
the model's ExpertDistributionRecorder (layers/expert_distribution.py), for EPLB.

EPLB (radixserve/eplb/): the layer holds physical expert slots, num_experts +
--ep-num-redundant-experts of them, rank r the slots [r * P/ep_size, (r+1) * P/ep_size), each
holding one logical expert (physical_to_logical_map); a hot expert may have several. The router's
logical ids are mapped to one of their copies, chosen by token index (deterministic, and spreads
an expert's tokens evenly over its copies), so outputs do not depend on the placement.
set_expert_location re-places the experts at a step boundary, moving their weights between ranks.

    physical slot:   0   1   2   3 | 4   5   6   7 | 8   9        (E = 8, 2 redundant, ep 2)
    logical expert:  0   1   2   3 | 4   5   6   7 | 0   1        (SGLang's trivial location)
    rank:            ---- ep rank 0 ----  |  ----- ep rank 1 -----
"""

from __future__ import annotations

from typing import Callable, Dict, Iterator, List, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.distributed.parallel_state import (
    get_moe_parallel,
    get_tp_group,
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)
from radixserve.eplb.eplb_algorithms import LayerPlacement, trivial_placement
from radixserve.layers import cpu_kernels
from radixserve.layers.expert_distribution import ExpertDistributionRecorder
from radixserve.layers.quantization import QuantizedWeight
from radixserve.layers.quantization.gguf import quant_matmul
from radixserve.layers.activation import SiluAndMul
from radixserve.layers.linear import (
    LinearBase,
    MergedColumnParallelLinear,
    PackedWeight,
    RowParallelLinear,
    WeightShapeError,
    linear,
    pack_cpu_weight,
    unpack_cpu_weight,
)


class TopKRouter(LinearBase):
    """The gate ([num_experts, hidden], replicated on every TP rank): each token's top-k expert
    ids and their weights."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, renormalize: bool):
        super().__init__(hidden_size, num_experts, bias=False)
        self.top_k, self.renormalize = top_k, renormalize

    def route(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        probs = torch.softmax(self.forward(x).float(), dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, ids


class FusedMoE(nn.Module):
    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int):
        super().__init__()
        moe = get_moe_parallel()
        num_physical = num_experts + moe.num_redundant_experts
        if num_physical % moe.ep_size:
            raise ValueError(f"{num_experts} experts + {moe.num_redundant_experts} redundant ones are not divisible by "
                             f"--ep-size {moe.ep_size}")
        if intermediate_size % moe.tp_size:
            raise ValueError(f"moe_intermediate_size {intermediate_size} is not divisible by --tp-size / --ep-size {moe.tp_size}")
        self.tp_rank, self.tp_size = moe.tp_rank, moe.tp_size  # the split of each expert
        self.reduce_results = get_tp_group().size > 1
        self.ep_size = moe.ep_size
        self.num_experts = num_experts  # the model's (logical) experts
        self.num_physical_experts = num_physical  # slots, copies of hot experts included
        self.num_local_experts = num_physical // moe.ep_size  # this rank's slots (all of them without EP)
        self.expert_start = moe.ep_rank * self.num_local_experts  # the physical id of local slot 0
        self.inter = intermediate_size // moe.tp_size  # this rank's share
        self.hidden_size = hidden_size
        self.w13_weight = nn.Parameter(torch.empty(self.num_local_experts, 2 * self.inter, hidden_size), requires_grad=False)
        self.w2_weight = nn.Parameter(torch.empty(self.num_local_experts, hidden_size, self.inter), requires_grad=False)
        # Where each logical expert lives (EPLB): set_expert_location keeps these
        self.placement: LayerPlacement = trivial_placement(1, num_experts, num_physical).layer(0)
        self.local_slots: List[List[int]] = []  # per logical expert: this rank's slots holding it
        self.dispatch_maps: Optional[Tuple[torch.Tensor, torch.Tensor]] = None  # None: ids are physical already
        self._set_maps(self.placement)
        # Set by the model runner: the recorder and this layer's row in it
        self.expert_recorder: Optional[ExpertDistributionRecorder] = None
        self.moe_layer_index = 0
        # The CPU's bf16 mode (pack_cpu_weights): each expert's two matrices packed for the C++ GEMM
        # (float32 activations), the stacked parameters freed.
        self.weight_packed: Optional[List[Tuple[PackedWeight, PackedWeight]]] = None
        # The same packed matrices stacked [E, N/16, K/2, 16, 2] (weight_packed holds views of
        # them): the MoE kernel's operands.
        self.w13_packed: Optional[torch.Tensor] = None
        self.w2_packed: Optional[torch.Tensor] = None
        # keep_gguf_blocks: each local expert's {"w1", "w3", "w2"} as the file gives them
        self.expert_blocks: Optional[List[Dict[str, ExpertMatrix]]] = None
        self.blocks_device: Optional[torch.device] = None

    def keep_gguf_blocks(self) -> None:
        """Before loading a GGUF file: the experts' tensors stay as the file's blocks; the float
        stacks the layer was built with are dropped (never filled, so never resident)."""
        self.expert_blocks = [{} for _ in range(self.num_local_experts)]
        self.blocks_device = device = self.w13_weight.device  # where the blocks live (GPU: the Triton kernels')
        self.w13_weight = nn.Parameter(torch.empty(0, device=device), requires_grad=False)
        self.w2_weight = nn.Parameter(torch.empty(0, device=device), requires_grad=False)

    def weight_storage(self) -> List[torch.Tensor]:
        """The tensors holding the experts beyond the layer's parameters (release/resume frees them
        too): the bf16 mode's packed stacks, or the GGUF blocks."""
        out = [t for t in (self.w13_packed, self.w2_packed) if t is not None]
        for blocks in self.expert_blocks or ():
            out += [w.data if isinstance(w, QuantizedWeight) else w for w in blocks.values()]
        return out

    def pack_cpu_weight(self) -> bool:
        if self.expert_blocks is not None:
            return False  # multiplied in the file's blocks
        packed = [(pack_cpu_weight(self.w13_weight.data[e]), pack_cpu_weight(self.w2_weight.data[e]))
                  for e in range(self.num_local_experts)]
        if any(p is None for pair in packed for p in pair):
            return False
        self.w13_packed = torch.stack([a.data for a, _ in packed])
        self.w2_packed = torch.stack([b.data for _, b in packed])
        self.weight_packed = [(PackedWeight(self.w13_packed[e], 2 * self.inter), PackedWeight(self.w2_packed[e], self.hidden_size))
                              for e in range(self.num_local_experts)]
        dtype = self.w13_weight.dtype
        self.w13_weight = nn.Parameter(torch.empty(0, dtype=dtype), requires_grad=False)
        self.w2_weight = nn.Parameter(torch.empty(0, dtype=dtype), requires_grad=False)
        return True

    def unpack_cpu_weight(self) -> None:
        """The stacked parameters back from the packed copies (a weight update writes into them)."""
        if self.weight_packed is not None and self.w13_weight.numel() == 0:
            self.w13_weight = nn.Parameter(torch.stack([unpack_cpu_weight(a, self.hidden_size) for a, _ in self.weight_packed]),
                                           requires_grad=False)
            self.w2_weight = nn.Parameter(torch.stack([unpack_cpu_weight(b, self.inter) for _, b in self.weight_packed]),
                                          requires_grad=False)

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: Tuple[int, str]) -> None:
        """shard_id: (expert, "w1" | "w3" | "w2"), a checkpoint's gate / up / down projection of
        that expert (its global id); this rank keeps its own experts, and its slice of their
        intermediate dimension."""
        expert, which = shard_id
        if not 0 <= expert < self.num_experts:
            raise WeightShapeError(f"expert {expert} {which}: the layer has {self.num_experts} experts")
        for slot in self.local_slots[expert]:  # none: another expert-parallel rank's
            self._load_slot(slot, which, param, loaded)

    def _load_slot(self, expert: int, which: str, param: torch.Tensor, loaded: torch.Tensor) -> None:
        """Local slot `expert`'s copy of the loaded matrix (this rank's slice of it)."""
        n, start = self.inter, self.tp_rank * self.inter
        if self.expert_blocks is not None:
            return self._load_expert_matrix(expert, which, loaded.narrow(1, start, n) if which == "w2" else loaded.narrow(0, start, n))
        if isinstance(loaded, QuantizedWeight):
            raise WeightShapeError(f"expert {expert} {which}: GGUF blocks for a layer built for float weights")
        if which == "w2":
            part, dst = loaded.narrow(1, start, n), param.data[expert]
        else:
            part = loaded.narrow(0, start, n)
            dst = param.data[expert].narrow(0, 0 if which == "w1" else n, n)
        if dst.shape != part.shape:
            raise WeightShapeError(f"expert {expert} {which}: expected shape {tuple(dst.shape)}, got {tuple(part.shape)}")
        dst.copy_(part)

    def _load_expert_matrix(self, expert: int, which: str, part: "ExpertMatrix") -> None:
        want = (self.hidden_size, self.inter) if which == "w2" else (self.inter, self.hidden_size)
        if tuple(part.shape) != want:
            raise WeightShapeError(f"expert {expert} {which}: expected shape {want}, got {tuple(part.shape)}")
        device = self.blocks_device
        if isinstance(part, QuantizedWeight):  # a rank's slice is a view: its own bytes, not the whole tensor's
            part = QuantizedWeight(part.qtype, part.data.to(device, copy=True).contiguous(), part.cols)
        else:  # the file's F16 / BF16 / F32 experts: float32, as the GGUF linear method keeps them
            part = part.detach().to(device, torch.float32, copy=True).contiguous()
        self.expert_blocks[expert][which] = part

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        if self.expert_recorder is not None:
            self.expert_recorder.record(self.moe_layer_index, topk_ids)  # logical ids: EPLB's load
        if self.dispatch_maps is not None:
            topk_ids = self.to_physical(topk_ids)
        if self.ep_size > 1:  # local ids; another rank's experts -1 (skipped)
            local = topk_ids - self.expert_start
            topk_ids = torch.where((local >= 0) & (local < self.num_local_experts), local, -1)
        ops = self._moe_kernel(x)
        gpu_moe = gpu_fused_moe(x) if self.expert_blocks is None else None
        if self.expert_blocks is not None:
            out = self.forward_blocks(x, topk_weights, topk_ids)
        elif gpu_moe is not None:
            out = gpu_moe(x, self.w13_weight, self.w2_weight, topk_weights, topk_ids)
        elif ops is not None:
            out = ops.fused_moe_bf16(x, self.w13_packed, self.w2_packed, topk_weights, topk_ids, self.inter)
        else:
            out = self.forward_loop(x, topk_weights, topk_ids)
        if self.reduce_results:
            out = tensor_model_parallel_all_reduce(out)
        return out

    # ---- EPLB: where the experts live -------------------------------------------------------------
    def to_physical(self, topk_ids: torch.Tensor) -> torch.Tensor:
        """The router's logical ids -> one physical copy each: copy (token index mod copies), so a
        hot expert's tokens spread evenly over its copies (SGLang dispatches among them too)."""
        log2phy, count = self.dispatch_maps
        ids = topk_ids.long()
        token = torch.arange(ids.shape[0], device=ids.device)[:, None]
        return log2phy[ids, token % count[ids]]

    def _set_maps(self, placement: LayerPlacement) -> None:
        self.placement = placement
        p2l = placement.physical_to_logical_map.tolist()
        self.local_slots = [[] for _ in range(self.num_experts)]
        for slot in range(self.num_local_experts):
            self.local_slots[p2l[self.expert_start + slot]].append(slot)
        device = self.w13_weight.device
        self.dispatch_maps = None if placement.is_identity() else (
            placement.logical_to_all_physical_map.to(device), placement.logical_count.to(device))

    def set_expert_location(self, placement: LayerPlacement) -> None:
        """Re-place the experts (EPLB, at a step boundary; a collective over the TP group with
        --ep-size > 1, so every rank calls it with the same placement): each local slot gets the
        weights of its new logical expert, from a copy on this rank where there is one, else from
        the rank holding it (an all-gather of the slots: simple, and the layer's experts pass
        through memory once)."""
        if tuple(placement.physical_to_logical_map.shape) != (self.num_physical_experts,):
            raise ValueError(f"a placement of {tuple(placement.physical_to_logical_map.shape)} slots for a layer "
                             f"with {self.num_physical_experts}")
        if self.expert_blocks is not None:
            raise ValueError("EPLB cannot move experts kept in GGUF blocks yet")
        old = self.placement.physical_to_logical_map.tolist()
        new = placement.physical_to_logical_map.tolist()
        if new == old:
            return  # every rank sees the same placements, so every rank skips the gather together
        n_local, mine = self.num_local_experts, range(self.expert_start, self.expert_start + self.num_local_experts)
        source: Dict[int, int] = {}  # logical expert -> a physical slot holding it, this rank's if any
        for slot, expert in enumerate(old):
            if expert not in source or (slot in mine and source[expert] not in mine):
                source[expert] = slot
        picks = [source[new[self.expert_start + s]] for s in range(n_local)]
        # the rank holding slot p with this rank's slice of the intermediate dimension
        rows = torch.tensor([((p // n_local) * self.tp_size + self.tp_rank) * n_local + p % n_local for p in picks])
        local_rows = torch.tensor([p - self.expert_start for p in picks]) if all(p in mine for p in picks) else None
        for name in self._expert_stack_names():
            stack = getattr(self, name)
            if self.ep_size > 1:  # every rank joins the gather, whatever it needs
                moved = tensor_model_parallel_all_gather(stack.data, dim=0).index_select(0, rows.to(stack.device))
            else:
                moved = stack.data.index_select(0, local_rows.to(stack.device))
            setattr(self, name, nn.Parameter(moved, requires_grad=False) if isinstance(stack, nn.Parameter) else moved)
        if self.weight_packed is not None:
            self.weight_packed = [(PackedWeight(self.w13_packed[e], 2 * self.inter), PackedWeight(self.w2_packed[e], self.hidden_size))
                                  for e in range(n_local)]
        self._set_maps(placement)

    def _expert_stack_names(self) -> List[str]:
        """The tensors whose rows are this rank's slots: the packed stacks in the CPU's bf16 mode."""
        return ["w13_packed", "w2_packed"] if self.w13_packed is not None else ["w13_weight", "w2_weight"]

    def _moe_kernel(self, x: torch.Tensor):
        """The C++ kernels when the MoE kernel can take this call: packed experts, float32
        activations (the CPU's bf16 mode), an even intermediate size; else None."""
        if self.w13_packed is None or x.dtype != torch.float32 or x.dim() != 2 or self.inter % 2:
            return None
        return cpu_kernels.kernels_for(x)

    def forward_loop(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """The experts one at a time over their tokens (this rank's partial sum, not all-reduced):
        the reference of the MoE kernel, and the path wherever that kernel cannot run."""
        out = torch.zeros_like(x)
        for expert, idx, weights in self._expert_groups(topk_weights, topk_ids):
            if self.weight_packed is not None:  # float32 activations, bf16 weights: the C++ GEMM
                p13, p2 = self.weight_packed[expert]
                gate, up = linear(x[idx], None, p13).chunk(2, dim=-1)
                y = linear(F.silu(gate) * up, None, p2)
            else:
                w13, w2 = self.w13_weight[expert], self.w2_weight[expert]
                gate, up = F.linear(x[idx].to(w13.dtype), w13).chunk(2, dim=-1)
                y = F.linear(F.silu(gate) * up, w2).to(x.dtype)
            out.index_add_(0, idx, y * weights[:, None].to(x.dtype))
        return out

    def forward_blocks(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """The experts in a GGUF file's blocks, one at a time over their tokens (float32 activations,
        as the GGUF linear layers)."""
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        x32 = x.float()
        for expert, idx, weights in self._expert_groups(topk_weights, topk_ids):
            m = self.expert_blocks[expert]
            xe = x32[idx].contiguous()
            h = (F.silu(_expert_matmul(xe, m["w1"])) * _expert_matmul(xe, m["w3"])).contiguous()
            out.index_add_(0, idx, _expert_matmul(h, m["w2"]) * weights[:, None])
        return out.to(x.dtype)

    def _expert_groups(self, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> Iterator[Tuple[int, torch.Tensor, torch.Tensor]]:
        """(local expert, its tokens, their routing weights) for each expert the batch hits: one
        sort of the (token, k) pairs, a Python step per expert, never per token. Pairs with
        expert id -1 (another expert-parallel rank's) are skipped."""
        flat_ids = topk_ids.flatten()
        order = torch.argsort(flat_ids, stable=True)  # (token, k) pairs grouped by expert, the -1s first
        counts = torch.bincount(flat_ids + 1, minlength=self.num_local_experts + 1).tolist()
        tokens = order // topk_ids.shape[1]
        weights = topk_weights.flatten()[order]
        start = counts[0]
        for expert, n in enumerate(counts[1:]):
            if n:
                yield expert, tokens[start : start + n], weights[start : start + n]
            start += n


ExpertMatrix = Union[QuantizedWeight, torch.Tensor]


def gpu_fused_moe(x: torch.Tensor) -> Optional[Callable[..., torch.Tensor]]:
    """Triton's fused MoE (moe_triton.py) for a CUDA tensor, unless RADIXSERVE_DISABLE_FUSED_KERNELS
    is set or triton is missing; None elsewhere (the C++ kernel or the loop)."""
    if not x.is_cuda:
        return None
    from radixserve.layers import fused

    if not fused.ENABLED:
        return None
    try:
        from radixserve.layers.moe_triton import fused_moe  # imports triton: GPUs only
    except ImportError:
        return None
    return fused_moe


def _expert_matmul(x: torch.Tensor, w: ExpertMatrix) -> torch.Tensor:
    return quant_matmul(x, w) if isinstance(w, QuantizedWeight) else F.linear(x, w)


class SharedExpert(nn.Module):
    """An expert every token goes through (Qwen2-MoE's and Qwen3-Next's shared_expert): a dense
    SiLU MLP, its checkpoint names gate_proj / up_proj / down_proj (gate_up_proj fused)."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj.forward(self.act_fn.forward(self.gate_up_proj.forward(x)))


class SparseMoeBlock(nn.Module):
    """A decoder layer's MLP when it is a mixture of experts (Qwen3-MoE's Qwen3MoeSparseMoeBlock).
    shared_intermediate_size > 0: plus a shared expert scaled by sigmoid(shared_expert_gate(x))
    (Qwen3-Next's Qwen3NextSparseMoeBlock)."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int, renormalize: bool,
                 shared_intermediate_size: int = 0):
        super().__init__()
        self.gate = TopKRouter(hidden_size, num_experts, top_k, renormalize)
        self.experts = FusedMoE(num_experts, hidden_size, intermediate_size)
        if shared_intermediate_size > 0:
            self.shared_expert = SharedExpert(hidden_size, shared_intermediate_size)
            self.shared_expert_gate = LinearBase(hidden_size, 1, bias=False)  # replicated on every TP rank
        else:
            self.shared_expert = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate.route(x)
        out = self.experts.forward(x, weights, ids)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate.forward(x)) * self.shared_expert.forward(x)
        return out
