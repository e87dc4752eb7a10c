"""Weight updates without a restart, on one (TP rank of a) model (SGLang's model_runner
update_weights_from_disk / _from_tensor / _from_distributed and get_weights_by_name).

Every update is checked whole before the first parameter is written, so a bad one (a missing
path, another architecture, a tensor of another shape or name) changes nothing and the old
weights keep serving:

    checkpoint names + shapes --(1) table of the config's checkpoint shapes: a clear message
                              --(2) dry run of model.load_weights on a copy of the model on the
                                    "meta" device: the same loaders and TP slicing, no data
    every TP rank agrees (all_tp_ranks_ok) --> model.load_weights writes; the CPU's bf16 mode
                                               packs the linear weights again for its GEMM

Tensors are full checkpoint tensors; each rank's weight_loader takes its TP slice, as at start-up.
"""

from __future__ import annotations

import logging
import os
from datetime import timedelta
from typing import Any, Callable, Dict, FrozenSet, Iterable, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from safetensors import safe_open
from torch import nn

from radixserve.distributed.weight_sync import (
    all_gather_tp_objects,
    all_tp_ranks_ok,
    destroy_custom_process_group,
    init_custom_process_group,
)
from radixserve.layers.linear import unpack_cpu_weight
from radixserve.model_executor.gguf_loader import gguf_weights
from radixserve.model_executor.model_loader import checkpoint_shapes, iterate_safetensors, safetensors_files
from radixserve.models.model_config import LoadError, ModelConfig
from radixserve.models.registry import get_model_class
from radixserve.models.weight_utils import NamedWeight, call_weight_loader, param_name_for

logger = logging.getLogger(__name__)

# How long the server's ranks wait for the trainer to join a weights update group, and for each
# broadcast in it: a trainer that never comes fails the request instead of holding the scheduler.
WEIGHTS_UPDATE_GROUP_TIMEOUT = timedelta(seconds=120)
DISK_LOAD_FORMATS = ("auto", "safetensors", "gguf")


class ModelWeightUpdater:
    """Owned by the ModelRunner (`runner`: its model, model_config, dtype, device, weight_only,
    tp_rank), whose update_weights_* methods call these. Methods return (success, message)."""

    def __init__(self, runner: Any):
        self.runner = runner
        self.groups: Dict[str, Any] = {}  # group_name -> process group with a trainer
        self._meta_model: Optional[nn.Module] = None

    @property
    def model(self) -> nn.Module:
        return self.runner.model

    @property
    def config(self) -> ModelConfig:
        return self.runner.model_config

    # ---- the three sources ------------------------------------------------------------------
    def update_weights_from_disk(self, model_path: str, load_format: Optional[str]) -> Tuple[bool, str]:
        config: Optional[ModelConfig] = None

        def check() -> None:
            nonlocal config
            config = self._disk_config(model_path, load_format or "auto")
            self.validate(_disk_shapes(config, self.runner.dtype), require_all=True)

        return self._checked_write(check, lambda: _disk_weights(config, self.runner.dtype, self.runner.gguf_block_types), True,
                                   f"Succeeded to update model weights from {model_path}.")

    def update_weights_from_tensor(self, named_tensors: Sequence[Any], load_format: Optional[str] = None) -> Tuple[bool, str]:
        def check() -> None:
            if load_format is not None:
                raise LoadError(f"load_format {load_format!r} is not supported here; leave it unset (the model's loaders)")
            for item in named_tensors:
                if not (isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[0], str)
                        and isinstance(item[1], torch.Tensor)):
                    raise LoadError("named_tensors must be (name, torch.Tensor) pairs")
            self.validate(((n, t.shape, "named_tensors") for n, t in named_tensors), require_all=False)
            for name, t in named_tensors:  # a NaN or inf weight would silently poison every answer
                if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                    raise LoadError(f"named_tensors: tensor {name!r} holds NaN or infinite values")

        return self._checked_write(check, lambda: [(n, t, "named_tensors") for n, t in named_tensors], False,
                                   f"Succeeded to update {len(named_tensors)} tensor(s).")

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str, backend: str, timeout: float = 15.0) -> Tuple[bool, str]:
        """Join a trainer's group as rank rank_offset + tp_rank (the trainer is rank 0): the join,
        then every TP rank's agreement (the scheduler runs the two apart: the join on a thread of
        its own, so its loop keeps serving)."""
        error = self.join_update_group(master_address, master_port, rank_offset, world_size, group_name, backend, timeout)
        return self.finish_update_group_join(group_name, error)

    def join_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                          group_name: str, backend: str, timeout: float = 15.0) -> Optional[str]:
        """The join alone (no collective of the TP group: it may run on another thread). Returns
        why it failed, or None."""
        rank = rank_offset + self.runner.tp_rank
        if group_name in self.groups:
            return f"A weights update group named {group_name!r} already exists."
        if backend not in ("gloo", "nccl"):
            return f"backend must be gloo or nccl, got {backend!r}"
        if backend == "nccl" and self.runner.device != "cuda":
            return "backend nccl needs a GPU; this server runs on the CPU: use gloo"
        if not (rank_offset >= 1 and rank_offset + self.runner.tp_size <= world_size):
            return (f"rank_offset {rank_offset} and world_size {world_size} leave no room for this server's "
                    f"{self.runner.tp_size} rank(s) beside the trainer's rank 0")
        try:
            # The join waits at most `timeout` for the trainer; the group's later operations
            # (the broadcasts of an update) keep WEIGHTS_UPDATE_GROUP_TIMEOUT.
            self.groups[group_name] = init_custom_process_group(
                backend, f"tcp://{master_address}:{master_port}", world_size, rank, group_name,
                timedelta(seconds=timeout), op_timeout=WEIGHTS_UPDATE_GROUP_TIMEOUT)
        except Exception as e:  # the trainer did not come, or the address is wrong
            return f"Failed to initialize custom process group: {e}."
        return None

    def finish_update_group_join(self, group_name: str, error: Optional[str]) -> Tuple[bool, str]:
        """On the scheduler thread, every TP rank together: whether all joined; a group that only
        some ranks joined is left by those."""
        ok, message = all_tp_ranks_ok(error is None, error or "Succeeded to initialize custom process group.")
        if not ok and group_name in self.groups and error is None:  # another rank failed: leave it
            destroy_custom_process_group(self.groups.pop(group_name))
        return ok, message

    def update_weights_from_distributed(self, names: List[str], dtypes: List[str], shapes: List[List[int]],
                                        group_name: str) -> Tuple[bool, str]:
        """Receive the trainer's broadcasts (all of them, so the trainer never waits on us), then
        update as update_weights_from_tensor does."""
        group = self.groups.get(group_name)
        error = None
        if group is None:
            error = f"No weights update group named {group_name!r}; call /init_weights_update_group first."
        elif not len(names) == len(dtypes) == len(shapes):
            error = f"names, dtypes and shapes differ in length ({len(names)}, {len(dtypes)}, {len(shapes)})"
        else:
            try:
                specs = [(n, _torch_dtype(d), [int(x) for x in s]) for n, d, s in zip(names, dtypes, shapes)]
            except (ValueError, TypeError) as e:
                error = str(e)
        if error is not None:
            return all_tp_ranks_ok(False, error)
        device = "cpu" if dist.get_backend(group) == "gloo" else self.runner.device  # where the backend reads
        received = []
        try:
            for name, dtype, shape in specs:
                tensor = torch.empty(shape, dtype=dtype, device=device)
                dist.broadcast(tensor, src=0, group=group)
                received.append((name, tensor))
        except Exception as e:  # the trainer went away, or sent other sizes
            return all_tp_ranks_ok(False, f"Failed to receive the broadcast tensors: {e}")
        ok, message = self.update_weights_from_tensor(received)
        return ok, "Succeeded to update parameter online." if ok else message

    def destroy_weights_update_group(self, group_name: str) -> Tuple[bool, str]:
        group = self.groups.pop(group_name, None)
        if group is None:
            return False, f"The group to be destroyed does not exist: no weights update group named {group_name!r}."
        destroy_custom_process_group(group)
        return True, "Succeeded to destroy custom process group."

    # ---- reading ----------------------------------------------------------------------------
    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> Optional[List[Any]]:
        """The first `truncate_size` rows (elements of a vector) of checkpoint tensor `name`, whole
        (gathered over TP), as float lists; None if the model has no such tensor. Every TP rank
        takes part; rank 0's answer is the one sent."""
        piece = self._local_rows(name, truncate_size)
        pieces = all_gather_tp_objects(piece)
        if piece is None:
            return None
        shape, _, _ = piece
        out = torch.zeros((min(truncate_size, shape[0]), *shape[1:]), dtype=torch.float32)
        flat = out.view(-1)
        for _, index, values in pieces:
            flat[index] = values
        return out.tolist()

    def _local_rows(self, name: str, truncate_size: int) -> Optional[Tuple[Tuple[int, ...], torch.Tensor, torch.Tensor]]:
        """(full shape, flat positions in the first rows of the full tensor, values) of this
        rank's part. Which full-tensor element each local element holds is found by running the
        parameter's own weight_loader on per-dimension coordinate tensors (expanded views, no
        full-size copy), so it holds for every TP layout the loaders know."""
        shapes = checkpoint_shapes(self.config)
        if self.config.tie_word_embeddings and name == "lm_head.weight":
            name = "model.embed_tokens.weight"
        if name not in shapes:
            return None
        full = shapes[name]
        truncate_size = min(truncate_size, full[0])  # a huge one (2**70) would overflow the comparisons below
        target, shard_id = param_name_for(name, self.model.stacked_params_mapping)
        owner_name, attr = target.rsplit(".", 1)
        try:
            owner = self.model.get_submodule(owner_name)
        except AttributeError:  # a tensor the model holds stacked with others (an MoE expert's): not readable here
            return None
        values = getattr(owner, attr).data
        packed = getattr(owner, "weight_packed", None)
        if attr == "weight" and values.numel() == 0 and packed is not None:  # the CPU's bf16 mode
            values = unpack_cpu_weight(packed, owner.in_features)
        coords = []
        for dim, size in enumerate(full):
            view = [1] * len(full)
            view[dim] = size
            source = torch.arange(size).view(view).expand(full)
            local = torch.full(values.shape, -1, dtype=torch.int64, device=values.device)
            call_weight_loader(owner, local, source, shard_id)
            coords.append(local.cpu())
        keep = (coords[0] >= 0) & (coords[0] < truncate_size)
        flat = torch.zeros_like(coords[0][keep])
        rows = min(truncate_size, full[0])
        for coord, size in zip(coords, (rows, *full[1:])):  # row-major position in the first rows
            flat = flat * size + coord[keep]
        return full, flat, values.float().cpu()[keep]

    # ---- checking and writing ---------------------------------------------------------------
    def validate(self, shapes: Iterable[Tuple[str, Sequence[int], str]], require_all: bool) -> None:
        """Raises LoadError for a tensor the model would not take (unknown name, other shape) or,
        with require_all, a parameter the checkpoint leaves out. Writes nothing."""
        expected = checkpoint_shapes(self.config)
        metas: List[NamedWeight] = []
        for name, shape, where in shapes:
            shape = tuple(int(x) for x in shape)
            if name in expected and shape != expected[name]:
                raise LoadError(f"{where}: tensor {name!r} has shape {shape}; the model's is {expected[name]}")
            metas.append((name, torch.empty(shape, device="meta"), where))
        self._meta().load_weights(metas, require_all)

    def _meta(self) -> nn.Module:
        """The model's twin on the "meta" device: parameters with shapes and no data."""
        if self._meta_model is None:
            with torch.device("meta"):
                self._meta_model = get_model_class(self.config.architecture)(self.config)
        return self._meta_model

    def _disk_config(self, model_path: str, load_format: str) -> ModelConfig:
        if load_format not in DISK_LOAD_FORMATS:
            raise LoadError(f"Failed to get model loader: load_format {load_format!r} cannot update weights "
                            f"(use one of {', '.join(DISK_LOAD_FORMATS)})")
        if not os.path.exists(model_path):
            raise LoadError(f"{model_path}: no such file or directory")
        config = ModelConfig.from_pretrained(model_path)  # LoadError: no such path, no config.json
        if config.architecture != self.config.architecture:
            raise LoadError(f"{model_path}: architecture {config.architecture}, but this server runs "
                            f"{self.config.architecture}; a weight update keeps the architecture")
        if (load_format == "gguf") != bool(config.gguf_file) and load_format != "auto":
            raise LoadError(f"{model_path}: load_format {load_format!r} does not fit this path")
        return config

    def _checked_write(self, check: Callable[[], None], weights: Callable[[], Iterable[NamedWeight]],
                       require_all: bool, success: str) -> Tuple[bool, str]:
        error = None
        try:
            if any(p.numel() and p.untyped_storage().nbytes() == 0 for p in self.model.parameters()):
                raise LoadError("The weights are released (/release_memory_occupation); resume them first.")
            check()
        except LoadError as e:
            error = str(e)
        ok, message = all_tp_ranks_ok(error is None, error or success)
        if not ok:
            return False, message
        try:
            self._write(weights(), require_all)
        except Exception as e:  # after the checks only I/O can fail here: say so plainly
            logger.exception("Weight update failed while writing")
            return False, f"Failed to update weights after the checks passed ({e}); the weights may be partly updated."
        logger.info("Weights updated: %s", success)
        return True, success

    @torch.no_grad()
    def _write(self, weights: Iterable[NamedWeight], require_all: bool) -> None:
        """model.load_weights; in the CPU's bf16 mode the packed linear weights are unpacked for
        the loaders to write into and packed again after (else the GEMM would keep the old ones)."""
        repack = [m for m in self.model.modules() if getattr(m, "weight_packed", None) is not None] if self.runner.weight_only else []
        for m in repack:
            if hasattr(m, "unpack_cpu_weight"):
                m.unpack_cpu_weight()
        # Rounded to the weights' dtype first, as at start-up: in the bf16 mode the norms and biases
        # live in float32 but hold bf16 values, and an update must give the model a fresh load gives.
        dtype = self.runner.dtype
        weights = ((n, t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t, fn) for n, t, fn in weights)
        try:
            self.model.load_weights(weights, require_all)
        finally:
            for m in repack:
                m.pack_cpu_weight()


def _torch_dtype(name: Any) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} (e.g. float32, bfloat16)")
    return dtype


def _disk_weights(config: ModelConfig, dtype: torch.dtype, block_types: FrozenSet[int] = frozenset()) -> Iterator[NamedWeight]:
    return gguf_weights(config, dtype, block_types=block_types) if config.gguf_file else iterate_safetensors(config.model_path)


def _disk_shapes(config: ModelConfig, dtype: torch.dtype) -> Iterator[Tuple[str, Sequence[int], str]]:
    """Every tensor's name and shape; safetensors headers only (no data read)."""
    if config.gguf_file:
        for name, tensor, fn in gguf_weights(config, dtype):
            yield name, tuple(tensor.shape), fn
        return
    for fn in safetensors_files(config.model_path):
        with safe_open(fn, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_slice(name).get_shape(), fn

