"""Weight updates without a restart, SGLang's routes, fields and replies (RL frameworks drive
them between rollouts):

    POST /update_weights_from_disk         {model_path, load_format, abort_all_requests, weight_version}
    POST /update_weights_from_tensor       {named_tensors: [[name, nested list], ...], flush_cache, ...}
    POST /init_weights_update_group        {master_address, master_port, rank_offset, world_size, group_name, backend}
    POST /update_weights_from_distributed  {names, dtypes, shapes, group_name, flush_cache, ...}
    POST /destroy_weights_update_group     {group_name}
    GET|POST /get_weights_by_name          {name, truncate_size}
    GET  /get_weight_version,  POST /update_weight_version {new_version, abort_all_requests}
    POST /load_lora_adapter {lora_name, lora_path},  POST /unload_lora_adapter {lora_name}  (--enable-lora)

An update answers {"success", "message"} with 200, or 400 when it was refused (the old weights
still serve). SGLang's /update_weights_from_tensor takes pickled tensors (serialized_named_tensors);
nothing from the network is unpickled here, so over HTTP the tensors come as JSON lists (small
ones; Engine.update_weights_from_tensor takes torch tensors).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch
from fastapi import FastAPI
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

from radixserve.managers.tokenizer_manager import RequestError, TokenizerManager
from radixserve.sampling_params import MAX_INT_PARAM
from radixserve.protocol import (
    DestroyWeightsUpdateGroupReqInput,
    GetWeightsByNameReqInput,
    InitWeightsUpdateGroupReqInput,
    LoadLoRAAdapterReqInput,
    LoRAUpdateOutput,
    UnloadLoRAAdapterReqInput,
    UpdateWeightFromDiskReqInput,
    UpdateWeightsFromDistributedReqInput,
    UpdateWeightsFromTensorReqInput,
    UpdateWeightVersionReqInput,
)

GROUP = "weight_update_group"
MAX_GROUP_SIZE = 65536  # ranks in a weight-update group: beyond any real cluster, within a TCP store's reach


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")  # SGLang's other fields (is_async, ...) do nothing here


class UpdateWeightsFromDiskRequest(_Body):
    model_path: StrictStr = Field(..., description="A checkpoint of the same architecture and shapes.")
    load_format: Optional[StrictStr] = Field(None, description="auto (default), safetensors or gguf.")
    abort_all_requests: StrictBool = Field(False, description="Abort the requests in flight instead of letting them finish.")
    weight_version: Optional[StrictStr] = Field(None, description="The weight_version after the update.")


class UpdateWeightsFromTensorRequest(_Body):
    named_tensors: List[Tuple[StrictStr, Any]] = Field(
        default_factory=list, description="[checkpoint tensor name, values as nested lists] pairs (full tensors).")
    serialized_named_tensors: Optional[Any] = Field(None, description="SGLang's pickled tensors: refused here.")
    load_format: Optional[StrictStr] = None
    flush_cache: StrictBool = True
    abort_all_requests: StrictBool = False
    weight_version: Optional[StrictStr] = None


class InitWeightsUpdateGroupRequest(_Body):
    master_address: StrictStr
    master_port: StrictInt = Field(..., ge=1, le=65535)
    rank_offset: StrictInt = Field(..., ge=1, le=MAX_GROUP_SIZE, description="This server's first rank in the group (the trainer is 0).")
    world_size: StrictInt = Field(..., ge=2, le=MAX_GROUP_SIZE)
    group_name: StrictStr = GROUP
    backend: StrictStr = Field("nccl", description="gloo on a CPU server, nccl on GPUs.")
    timeout: float = Field(15.0, gt=0, le=600, description="Seconds to wait for every member to join (generation "
                                                           "goes on meanwhile). A join that times out is a 400.")


class UpdateWeightsFromDistributedRequest(_Body):
    names: List[StrictStr]
    dtypes: List[StrictStr]
    shapes: List[List[StrictInt]]
    group_name: StrictStr = GROUP
    flush_cache: StrictBool = True
    abort_all_requests: StrictBool = False
    weight_version: Optional[StrictStr] = None
    load_format: Optional[StrictStr] = None


class DestroyWeightsUpdateGroupRequest(_Body):
    group_name: StrictStr = GROUP


class GetWeightsByNameRequest(_Body):
    name: StrictStr = Field(..., description="A checkpoint tensor name, e.g. model.layers.0.mlp.up_proj.weight.")
    truncate_size: StrictInt = Field(100, ge=1, le=MAX_INT_PARAM, description="How many rows (elements of a vector) to return.")


class UpdateWeightVersionRequest(_Body):
    new_version: StrictStr
    abort_all_requests: StrictBool = True


def _reply(success: bool, message: str, **extra: Any) -> JSONResponse:
    return JSONResponse({"success": success, "message": message, **extra}, status_code=200 if success else 400)


class LoadLoRAAdapterRequest(_Body):
    lora_name: StrictStr = Field(..., description="The name requests use in lora_path (or model).")
    lora_path: StrictStr = Field(..., description="A PEFT directory: adapter_config.json + adapter_model.safetensors.")


class UnloadLoRAAdapterRequest(_Body):
    lora_name: StrictStr


def _lora_reply(out: LoRAUpdateOutput) -> JSONResponse:
    body = {"success": out.success, "error_message": out.error_message, "loaded_adapters": out.loaded_adapters}
    return JSONResponse(body, status_code=200 if out.success else 400)


def _named_tensors(pairs: List[Tuple[str, Any]]) -> List[Tuple[str, torch.Tensor]]:
    out = []
    for name, values in pairs:
        try:
            out.append((name, torch.tensor(values, dtype=torch.float32)))
        except (TypeError, ValueError, RuntimeError) as e:  # ragged lists, strings, ...
            raise RequestError(f"named_tensors: the values of {name!r} are not a tensor of numbers: {e}") from None
    return out


def add_weight_update_routes(app: FastAPI, tm: TokenizerManager) -> None:
    weights = tm.weight_updates

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(body: UpdateWeightsFromDiskRequest) -> JSONResponse:
        """Load new weights of the same model from disk, without a restart; the cache is flushed."""
        success, message, num_paused = await weights.update_weights_from_disk(
            UpdateWeightFromDiskReqInput(**body.model_dump()))
        return _reply(success, message, num_paused_requests=num_paused)

    @app.post("/update_weights_from_tensor")
    async def update_weights_from_tensor(body: UpdateWeightsFromTensorRequest) -> JSONResponse:
        if body.serialized_named_tensors is not None:
            raise RequestError("serialized_named_tensors (pickled tensors) are not accepted over HTTP; send "
                               "named_tensors as [name, nested list] pairs, or use Engine.update_weights_from_tensor.")
        fields = body.model_dump(exclude={"named_tensors", "serialized_named_tensors"})
        obj = UpdateWeightsFromTensorReqInput(named_tensors=_named_tensors(body.named_tensors), **fields)
        return _reply(*await weights.update_weights_from_tensor(obj))

    @app.post("/init_weights_update_group")
    async def init_weights_update_group(body: InitWeightsUpdateGroupRequest) -> JSONResponse:
        """Join a trainer's torch.distributed group (as ranks rank_offset + tp_rank)."""
        return _reply(*await weights.init_weights_update_group(InitWeightsUpdateGroupReqInput(**body.model_dump())))

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(body: UpdateWeightsFromDistributedRequest) -> JSONResponse:
        """Receive the tensors the trainer broadcasts (from its rank 0), in this order."""
        return _reply(*await weights.update_weights_from_distributed(
            UpdateWeightsFromDistributedReqInput(**body.model_dump())))

    @app.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(body: DestroyWeightsUpdateGroupRequest) -> JSONResponse:
        return _reply(*await weights.destroy_weights_update_group(DestroyWeightsUpdateGroupReqInput(**body.model_dump())))

    @app.api_route("/get_weights_by_name", methods=["GET", "POST"])
    async def get_weights_by_name(body: GetWeightsByNameRequest) -> JSONResponse:
        """The first truncate_size rows of a checkpoint tensor, whole (gathered over TP ranks)."""
        return JSONResponse(await weights.get_weights_by_name(GetWeightsByNameReqInput(**body.model_dump())))

    @app.post("/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> JSONResponse:
        """Load a LoRA adapter into host memory; requests may name it from then on."""
        return _lora_reply(await weights.load_lora_adapter(LoadLoRAAdapterReqInput(**body.model_dump())))

    @app.post("/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> JSONResponse:
        """Unload an adapter once the requests that use it are done (new ones get 400 at once)."""
        return _lora_reply(await weights.unload_lora_adapter(UnloadLoRAAdapterReqInput(**body.model_dump())))

    @app.get("/get_weight_version")
    async def get_weight_version() -> Dict[str, Any]:
        return {"weight_version": tm.server_args.weight_version}

    @app.post("/update_weight_version")
    async def update_weight_version(body: UpdateWeightVersionRequest) -> Dict[str, Any]:
        return weights.update_weight_version(UpdateWeightVersionReqInput(**body.model_dump()))
