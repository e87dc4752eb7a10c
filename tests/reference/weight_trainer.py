"""An RL trainer's side of /update_weights_from_distributed, for the weight-update tests: rank 0
of a group with the server's ranks; it broadcasts every tensor of a checkpoint, in file order.
A module of its own, so a spawned process can import it without the test modules."""

from __future__ import annotations

from pathlib import Path

GROUP = "weight_update_group"


def broadcast_checkpoint(port: int, world_size: int, model_dir: str, delay_s: float = 0.0) -> None:
    """delay_s: a slow trainer, which joins that long after it starts."""
    import time

    import torch.distributed as dist
    from safetensors.torch import load_file

    from radixserve.distributed.weight_sync import init_custom_process_group

    time.sleep(delay_s)
    group = init_custom_process_group("gloo", f"tcp://127.0.0.1:{port}", world_size, 0, GROUP)
    for tensor in load_file(str(Path(model_dir) / "model.safetensors")).values():
        dist.broadcast(tensor.contiguous(), src=0, group=group)
    dist.destroy_process_group(group)
