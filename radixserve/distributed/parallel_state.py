"""The tensor-parallel group of this process. A process holds one model shard for its whole
life, so the group is process state (set once at start-up), not per-batch context."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

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


_TP = TPGroup()


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


def init_distributed_environment(rank: int, world_size: int, dist_init_addr: str, device: str = "cpu") -> None:
    """Join the process group (gloo on CPU, NCCL on GPU) and make it this process's TP group."""
    if world_size > 1 and not dist.is_initialized():
        backend = "nccl" if device == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=f"tcp://{dist_init_addr}", rank=rank, world_size=world_size)
    set_tp_group(rank, world_size, dist.group.WORLD if world_size > 1 else None)
    if world_size > 1:
        _TP.cpu_group = dist.new_group(backend="gloo")


def broadcast_from_first_rank(x: torch.Tensor) -> torch.Tensor:
    """Every rank takes rank 0's copy (sampled tokens: ranks must never diverge)."""
    if _TP.size > 1:
        dist.broadcast(x, src=0, group=_TP.group)
    return x


def all_reduce_min(value: int) -> int:
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
    dist.broadcast_object_list(box, src=0, group=_TP.cpu_group)
    return box[0]


def destroy_distributed_environment() -> None:
    """Leave the group together (a rank exiting with the group alive aborts in gloo)."""
    if dist.is_initialized():
        dist.barrier(group=_TP.cpu_group)
        dist.destroy_process_group()
    set_tp_group(0, 1, None)
