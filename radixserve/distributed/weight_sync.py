"""Process groups for weight updates: a trainer and the server's ranks in a group of their own
(SGLang's `init_custom_process_group`), and the TP ranks agreeing on an update's outcome.

A process has one default torch.distributed group (here the TP group, when --tp-size > 1), so a
second group with other members cannot come from `init_process_group`: it gets its own store
(rendezvous at the trainer's address, keys under the group's name) and is registered beside the
default one. The trainer makes the same call with rank 0 and broadcasts from there:

    group = init_custom_process_group("gloo", "tcp://HOST:PORT", world_size=1 + tp_size,
                                      rank=0, group_name="weight_update_group")
    torch.distributed.broadcast(tensor, src=0, group=group)
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, List, Optional, Tuple

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from radixserve.distributed.parallel_state import get_tp_group


def init_custom_process_group(
    backend: str,
    init_method: str,
    world_size: int,
    rank: int,
    group_name: str,
    timeout: Optional[timedelta] = None,
    op_timeout: Optional[timedelta] = None,
) -> Any:
    """A process group of `world_size` members beside this process's default group (if any).
    Every member calls it; rank 0 hosts the store at `init_method` (tcp://host:port). timeout
    bounds the join (the store's connection and the members' rendezvous), op_timeout the group's
    collectives afterwards (default: timeout)."""
    timeout = timeout or c10d.default_pg_timeout
    store, rank, world_size = next(c10d.rendezvous(init_method, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = c10d.PrefixStore(group_name, store)  # the group's keys never meet another's
    pg, _ = c10d._new_process_group_helper(
        world_size, rank, [], c10d.Backend(backend), store, group_name=group_name, timeout=op_timeout or timeout,
    )
    # Group rank i is "global" rank i for this group, so broadcast(src=0, group=pg) names the trainer.
    c10d._world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def destroy_custom_process_group(group: Any) -> None:
    dist.destroy_process_group(group)


def all_tp_ranks_ok(ok: bool, message: str) -> Tuple[bool, str]:
    """Whether every TP rank succeeded, and the messages of those that did not (or `message`).
    Runs on the scheduler thread, over the TP group's control (gloo) group."""
    tp = get_tp_group()
    if tp.size == 1:
        return ok, message
    results: List[Any] = [None] * tp.size
    dist.all_gather_object(results, (ok, message), group=tp.cpu_group)
    failed = [f"TP rank {r}: {m}" for r, (good, m) in enumerate(results) if not good]
    return (False, "; ".join(failed)) if failed else (True, message)


def all_gather_tp_objects(obj: Any) -> List[Any]:
    """Every TP rank's `obj`, in rank order (over the control group)."""
    tp = get_tp_group()
    if tp.size == 1:
        return [obj]
    out: List[Any] = [None] * tp.size
    dist.all_gather_object(out, obj, group=tp.cpu_group)
    return out
