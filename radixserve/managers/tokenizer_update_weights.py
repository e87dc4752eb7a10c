"""The TokenizerManager's side of weight updates (SGLang's tokenizer_manager /
tokenizer_communicator_mixin: update_weights_from_disk, ..., model_update_lock, weight_version).

    generate requests ----- model_update_lock.reader_lock() for their whole life
    a weight update ------- [abort_all_requests: AbortReq(abort_all)] -> writer_lock() -> the
                            scheduler(s) update -> reply; success sets weight_version if given

The writer waits for the requests in flight to end (abort_all_requests: they end now, aborted)
and holds back new ones until the update is done, so no response mixes old and new weights.
"""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Dict, List, Optional, Tuple

from radixserve.managers.request_frontend import RequestError
from radixserve.protocol import (
    AbortReq,
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

# A weight update may read a large checkpoint, or wait for a trainer to join its group (the
# scheduler gives up on a trainer after weight_updater.WEIGHTS_UPDATE_GROUP_TIMEOUT).
WEIGHT_UPDATE_RPC_TIMEOUT = 600.0
LORA_UNLOAD_POLL_S = 0.05  # unload: how often to ask whether the adapter's last requests are done
ABORT_MESSAGE = "Aborted: the server's weights are being updated (abort_all_requests)."


class RWLock:
    """An asyncio reader-writer lock that lets a waiting writer in first (SGLang's aio_rwlock):
    a steady stream of new requests cannot starve a weight update."""

    def __init__(self) -> None:
        self._cond = asyncio.Condition()
        self._readers = 0
        self._writer = False
        self._waiting_writers = 0

    @asynccontextmanager
    async def reader_lock(self) -> AsyncIterator[None]:
        async with self._cond:
            await self._cond.wait_for(lambda: not self._writer and not self._waiting_writers)
            self._readers += 1
        try:
            yield
        finally:
            async with self._cond:
                self._readers -= 1
                self._cond.notify_all()

    @asynccontextmanager
    async def writer_lock(self) -> AsyncIterator[None]:
        async with self._cond:
            self._waiting_writers += 1
            try:
                await self._cond.wait_for(lambda: not self._writer and self._readers == 0)
            finally:
                self._waiting_writers -= 1
                self._cond.notify_all()  # a cancelled writer lets the readers it held back go
            self._writer = True
        try:
            yield
        finally:
            async with self._cond:
                self._writer = False
                self._cond.notify_all()


class TokenizerUpdateWeights:
    """`tm`: the TokenizerManager (its communicator, abort, server_args, frontend). Methods
    return (success, message) as SGLang's do; the routes answer 200 or 400 from `success`."""

    def __init__(self, tm: Any):
        self.tm = tm
        self.model_update_lock = RWLock()
        self.loading_from_disk = False
        tm.frontend.weight_version = tm.server_args.weight_version

    def set_weight_version(self, version: str) -> None:
        """The one place the version changes: /server_info reads server_args, meta_info the frontend."""
        self.tm.server_args.weight_version = version
        self.tm.frontend.weight_version = version

    async def update_weights_from_disk(self, obj: UpdateWeightFromDiskReqInput) -> Tuple[bool, str, int]:
        self.loading_from_disk = True  # /health: the scheduler's loop is reading a checkpoint, not hung
        try:
            out = await self._locked_update(obj)
        finally:
            self.loading_from_disk = False
        if out.success:  # SGLang's: the server now serves this checkpoint
            self.tm.server_args.model_path = self.tm.model_path = obj.model_path
        return out.success, self._versioned(out, obj.weight_version), out.num_paused_requests

    async def update_weights_from_tensor(self, obj: UpdateWeightsFromTensorReqInput) -> Tuple[bool, str]:
        out = await self._locked_update(obj)
        return out.success, self._versioned(out, obj.weight_version)

    async def update_weights_from_distributed(self, obj: UpdateWeightsFromDistributedReqInput) -> Tuple[bool, str]:
        self._check_single_replica("update_weights_from_distributed")
        out = await self._locked_update(obj)
        return out.success, self._versioned(out, obj.weight_version)

    async def init_weights_update_group(self, obj: InitWeightsUpdateGroupReqInput) -> Tuple[bool, str]:
        self._check_single_replica("init_weights_update_group")
        out = await self._call(obj)
        return out.success, out.message

    async def destroy_weights_update_group(self, obj: DestroyWeightsUpdateGroupReqInput) -> Tuple[bool, str]:
        out = await self._call(obj)
        return out.success, out.message

    async def get_weights_by_name(self, obj: GetWeightsByNameReqInput) -> List[Any]:
        """The tensor's first rows; with --dp-size one list per replica (as SGLang)."""
        out = await self._call(obj)
        if out.parameter is None:
            raise RequestError(f"Get parameter by name failed: the model has no tensor named {obj.name!r} "
                               "(use checkpoint names, e.g. model.layers.0.self_attn.q_proj.weight).")
        return out.parameter

    def update_weight_version(self, obj: UpdateWeightVersionReqInput) -> Dict[str, Any]:
        if not obj.new_version:
            raise RequestError("new_version must be a non-empty string.")
        if obj.abort_all_requests:
            self._abort_all()
        self.set_weight_version(obj.new_version)
        return {"success": True, "message": f"Weight version updated to {obj.new_version}",
                "new_version": obj.new_version}

    # ---- LoRA adapters at run time (--enable-lora) -----------------------------------------------
    async def load_lora_adapter(self, obj: LoadLoRAAdapterReqInput) -> LoRAUpdateOutput:
        self._check_lora("load_lora_adapter")
        out = await self._call(obj)
        if out.success:
            self._set_lora_adapters(out.loaded_adapters)
        return out

    async def unload_lora_adapter(self, obj: UnloadLoRAAdapterReqInput) -> LoRAUpdateOutput:
        """New requests for the adapter get 400 from now on; the ones in flight finish first."""
        self._check_lora("unload_lora_adapter")
        names = self.tm.frontend.lora_names
        if obj.lora_name not in names:
            raise RequestError(f"LoRA adapter {obj.lora_name!r} is not loaded.")
        names.discard(obj.lora_name)
        deadline = asyncio.get_running_loop().time() + WEIGHT_UPDATE_RPC_TIMEOUT
        while True:
            out = await self._call(obj)
            if not out.in_use_by or asyncio.get_running_loop().time() > deadline:
                break
            await asyncio.sleep(LORA_UNLOAD_POLL_S)
        self._set_lora_adapters(out.loaded_adapters)
        return out

    def _check_lora(self, what: str) -> None:
        if not self.tm.server_args.enable_lora:
            raise RequestError(f"{what}: LoRA is not enabled: start the server with --enable-lora.")
        self._check_single_replica(what)

    def _set_lora_adapters(self, adapters: Dict[str, str]) -> None:
        """What requests may name and /v1/models lists."""
        self.tm.frontend.lora_names = set(adapters)
        self.tm.server_args.lora_paths = dict(adapters)

    # ---- plumbing ------------------------------------------------------------------------------
    async def _locked_update(self, obj: Any) -> Any:
        self.tm._check_alive()
        if obj.abort_all_requests:
            self._abort_all()
        async with self.model_update_lock.writer_lock():
            return await self._call(obj)

    async def _call(self, obj: Any) -> Any:
        self.tm._check_alive()
        return await self.tm.communicator(obj, timeout=WEIGHT_UPDATE_RPC_TIMEOUT)

    def _abort_all(self) -> None:
        self.tm._send(AbortReq(abort_all=True, abort_message=ABORT_MESSAGE))

    def _versioned(self, out: Any, weight_version: Optional[str]) -> str:
        if out.success and weight_version is not None:
            self.set_weight_version(weight_version)
            return f"{out.message} Weight version updated to {weight_version}."
        return out.message

    def _check_single_replica(self, what: str) -> None:
        if self.tm.server_args.dp_size > 1:  # each replica would need its own ranks in the group
            raise RequestError(f"{what} needs --dp-size 1 (this server runs {self.tm.server_args.dp_size} replicas).")
