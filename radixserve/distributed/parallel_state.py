"""The tensor-parallel and pipeline-parallel groups of this process. A process holds one model
shard for its whole life, so the groups are process state (set once at start-up), not
per-batch context.

Ranks (SGLang's order): global rank = pp_rank * tp_size + tp_rank, so a stage's TP ranks are
neighbours. Stage s's TP rank j talks to stage s+1's TP rank j only (point to point, pickled
messages on a gloo group: hidden states are the same on every TP rank after the all-reduce)."""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist


@dataclass
class TPGroup:
    rank: int = 0
    size: int = 1
    group: Optional[Any] = None  # a torch.distributed ProcessGroup when size > 1
    # A second gloo group for the scheduler's control messages: the forward thread uses
    # `group` at the same time, and collectives of two threads must not share a group.
    cpu_group: Optional[Any] = None
    first_rank: int = 0  # the global rank of TP rank 0 (a stage's first rank with --pp-size)


_TP = TPGroup()


@dataclass
class PPGroup:
    """This process's pipeline stage. `partition`: decoder layers per stage (--pp-partition)."""

    rank: int = 0
    size: int = 1
    tp_rank: int = 0
    tp_size: int = 1
    partition: Optional[Tuple[int, ...]] = None
    group: Optional[Any] = None  # gloo, every rank: the stages' point-to-point messages
    world_cpu_group: Optional[Any] = None  # gloo, every rank: start-up agreement, shutdown barrier
    pending: List[Any] = field(default_factory=list)  # isend works (and their buffers) not yet done

    @property
    def is_first_rank(self) -> bool:
        return self.rank == 0

    @property
    def is_last_rank(self) -> bool:
        return self.rank == self.size - 1

    def global_rank(self, stage: int) -> int:
        return stage * self.tp_size + self.tp_rank


_PP = PPGroup()


def get_pp_group() -> PPGroup:
    return _PP


def get_pp_indices(num_layers: int, pp_rank: int, pp_size: int,
                   partition: Optional[Sequence[int]] = None) -> Tuple[int, int]:
    """[start, end) of the decoder layers stage pp_rank holds (SGLang's get_pp_indices): the
    given partition, or an even split whose remainder goes to the stages before the last (the
    last one also runs the norm, the LM head and the sampler)."""
    if partition is None:
        base, extra = divmod(num_layers, pp_size)
        partition = [base] * pp_size
        for i in range(2, extra + 2):
            partition[-i] += 1
    if len(partition) != pp_size or sum(partition) != num_layers or min(partition) < 1:
        raise ValueError(f"--pp-partition {','.join(map(str, partition))} must give each of the {pp_size} "
                         f"stages >= 1 layer, {num_layers} in all")
    start = sum(partition[:pp_rank])
    return start, start + partition[pp_rank]


def stage_layers(num_layers: int) -> Tuple[int, int]:
    """[start, end) of this process's stage (all layers without PP)."""
    return get_pp_indices(num_layers, _PP.rank, _PP.size, _PP.partition)


@dataclass(frozen=True)
class MoEParallel:
    """How this rank's MoE layers split their experts (SGLang's moe_ep / moe_tp groups, --ep-size).
    The TP ranks form ep_size groups of tp_size = TP size / ep_size neighbours; group g holds the
    whole experts [g * E / ep_size, (g + 1) * E / ep_size), and within a group each rank keeps a
    1 / tp_size slice of every one of them. Tokens need no exchange: hidden states are the same on
    every TP rank (after each all-reduce), so each rank runs its experts on the tokens routed to
    them and the TP all-reduce that follows sums the partial outputs (all-gather + reduce-scatter,
    with the gather already done)."""

    ep_size: int = 1
    ep_rank: int = 0
    tp_size: int = 1
    tp_rank: int = 0
    num_redundant_experts: int = 0  # --ep-num-redundant-experts: physical slots beyond the model's experts


_MOE_EP_SIZE = 1
_MOE_NUM_REDUNDANT = 0


def set_moe_ep_size(ep_size: int, num_redundant_experts: int = 0) -> None:
    """--ep-size (and --ep-num-redundant-experts), once at start-up (after the TP group), before
    the model is built."""
    global _MOE_EP_SIZE, _MOE_NUM_REDUNDANT
    if ep_size < 1 or _TP.size % ep_size:
        raise ValueError(f"--ep-size {ep_size} must divide --tp-size {_TP.size}")
    _MOE_EP_SIZE, _MOE_NUM_REDUNDANT = ep_size, num_redundant_experts


def get_moe_parallel() -> MoEParallel:
    moe_tp = _TP.size // _MOE_EP_SIZE
    return MoEParallel(_MOE_EP_SIZE, _TP.rank // moe_tp, moe_tp, _TP.rank % moe_tp, _MOE_NUM_REDUNDANT)


def set_tp_group(rank: int, size: int, group: Any = None) -> None:
    global _TP
    _TP = TPGroup(rank, size, group)


def get_tp_group() -> TPGroup:
    return _TP


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    if _TP.size == 1:
        return x
    dist.all_reduce(x, group=_TP.group)
    return x


def tensor_model_parallel_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    if _TP.size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_TP.size)]
    dist.all_gather(parts, x.contiguous(), group=_TP.group)
    return torch.cat(parts, dim=dim)


def init_distributed_environment(rank: int, world_size: int, dist_init_addr: str, device: str = "cpu",
                                 pp_rank: int = 0, pp_size: int = 1, pp_partition: Optional[Sequence[int]] = None,
                                 pp_timeout_s: float = 300.0) -> None:
    """Join the process group (gloo on CPU, NCCL on GPU) and make it this process's TP group.
    rank / world_size: the TP rank and size. With pp_size > 1 the world is pp_size x tp_size
    ranks: one TP group per stage, and a gloo group over all for the stages' messages, whose
    receives give up after pp_timeout_s (a dead or hung stage ends the server, never a hang)."""
    global _PP
    tp_rank, tp_size = rank, world_size
    _PP = PPGroup(pp_rank, pp_size, tp_rank, tp_size, tuple(pp_partition) if pp_partition else None)
    if pp_size > 1:
        return _init_pp(tp_rank, tp_size, dist_init_addr, device, pp_rank, pp_size, pp_timeout_s)
    if world_size > 1 and not dist.is_initialized():
        backend = "nccl" if device == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=f"tcp://{dist_init_addr}", rank=rank, world_size=world_size)
    set_tp_group(rank, world_size, dist.group.WORLD if world_size > 1 else None)
    if world_size > 1:
        _TP.cpu_group = dist.new_group(backend="gloo")


def _init_pp(tp_rank: int, tp_size: int, dist_init_addr: str, device: str, pp_rank: int, pp_size: int,
             timeout_s: float) -> None:
    backend = "nccl" if device == "cuda" else "gloo"
    world = pp_size * tp_size
    dist.init_process_group(backend, init_method=f"tcp://{dist_init_addr}", rank=pp_rank * tp_size + tp_rank,
                            world_size=world)
    # Every rank creates every group, in the same order (torch.distributed's rule).
    for stage in range(pp_size):
        ranks = list(range(stage * tp_size, (stage + 1) * tp_size))
        group = dist.new_group(ranks) if tp_size > 1 else None
        cpu_group = dist.new_group(ranks, backend="gloo") if tp_size > 1 else None
        if stage == pp_rank:
            set_tp_group(tp_rank, tp_size, group)
            _TP.cpu_group, _TP.first_rank = cpu_group, stage * tp_size
    _PP.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
    _PP.world_cpu_group = dist.new_group(backend="gloo")


def pp_send_pyobj(obj: Any, dst_stage: int) -> None:
    """Send a Python object to this TP rank of stage dst_stage without waiting (SGLang's
    async_send=True); the work is kept until pp_commit_sends (its buffers must live)."""
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    size = torch.tensor([data.numel()], dtype=torch.int64)
    dst = _PP.global_rank(dst_stage)
    _PP.pending.append((dist.isend(size, dst, group=_PP.group), size))
    _PP.pending.append((dist.isend(data, dst, group=_PP.group), data))


def pp_commit_sends(wait: bool = True) -> None:
    """Forget the sends that are done; wait=True: wait for all of them first (shutdown). The
    loop never waits on a send: only receives block, always for the stage before, so the
    stages cannot wait on each other in a cycle."""
    if wait:
        for work, _ in _PP.pending:
            work.wait()
    _PP.pending = [(w, buf) for w, buf in _PP.pending if not w.is_completed()]


def pp_recv_pyobj(src_stage: int) -> Any:
    """The next object this TP rank of stage src_stage sent; blocks up to the group's timeout."""
    src = _PP.global_rank(src_stage)
    size = torch.empty(1, dtype=torch.int64)
    dist.recv(size, src, group=_PP.group)
    data = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.recv(data, src, group=_PP.group)
    return pickle.loads(data.numpy().tobytes())


def broadcast_from_first_rank(x: torch.Tensor) -> torch.Tensor:
    """Every rank takes rank 0's copy (sampled tokens: ranks must never diverge)."""
    if _TP.size > 1:
        dist.broadcast(x, src=_TP.first_rank, group=_TP.group)
    return x


def all_reduce_min(value: int) -> int:
    """The smallest value over the TP group, or over every rank of every stage with PP (the
    stages index one KV pool's slots: the first stage's allocator hands them out)."""
    if _PP.size > 1:
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=_PP.world_cpu_group)
        return int(t.item())
    if _TP.size == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=_TP.group)
    return int(t.item())


def broadcast_pyobj(obj: Any) -> Any:
    """Rank 0's Python object on every rank (requests received by rank 0, each loop)."""
    if _TP.size == 1:
        return obj
    box = [obj if _TP.rank == 0 else None]
    dist.broadcast_object_list(box, src=_TP.first_rank, group=_TP.cpu_group)
    return box[0]


def destroy_distributed_environment() -> None:
    """Leave the group together (a rank exiting with the group alive aborts in gloo)."""
    global _PP
    if dist.is_initialized():
        dist.barrier(group=_PP.world_cpu_group if _PP.size > 1 else _TP.cpu_group)
        dist.destroy_process_group()
    set_tp_group(0, 1, None)
    _PP = PPGroup()
