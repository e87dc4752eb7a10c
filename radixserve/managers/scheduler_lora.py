"""The Scheduler's handlers of LoRA adapters loaded and unloaded at run time (--enable-lora;
SGLang's load_lora_adapter / unload_lora_adapter). Its dispatch entries join the weight
updater's (scheduler_update_weights.py), so the Scheduler itself does not change.

An adapter is unloaded only when no request of the scheduler's (waiting, running, in the last
batch (a prefill not merged into the running batch yet, or in the overlap loop the batch in
flight), in the grammar queue or a chunked prefill) uses it; otherwise the reply says so and the
caller retries once those requests are done (the front end stopped admitting new ones for it
first).

The overlap loop: the LoRA slots are filled on the forward thread, by ModelRunner.forward right
before the batch that needs them (so in order with the forwards, and never under a forward still
reading a slot). Unloading changes the registry and the pool that thread reads, so it first waits
for the forwards in flight (one batch, the last launched): nothing then reads them meanwhile.
Loading only adds an adapter no batch can use before the reply, so it does not wait."""

from __future__ import annotations

from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

from radixserve.lora.lora_config import LoRAError
from radixserve.lora.lora_manager import LoRAManager
from radixserve.managers.overlap import ForwardThread
from radixserve.managers.schedule_batch import Req
from radixserve.mem_cache.kv_ledger import KVLedger
from radixserve.protocol import LoadLoRAAdapterReqInput, LoRAUpdateOutput, UnloadLoRAAdapterReqInput

NOT_ENABLED = "LoRA is not enabled: start the server with --enable-lora"


class SchedulerLoRA:
    def __init__(self, lora_manager: Optional[LoRAManager], ledger: KVLedger, forward_thread: Optional[ForwardThread],
                 live_reqs: Callable[[], Iterable[Req]]):
        self.lora_manager = lora_manager  # None: --enable-lora is off
        self.ledger = ledger  # an unloaded adapter's cached prefixes go
        self.forward_thread = forward_thread  # the overlap loop's: unloading waits for its forwards
        self.live_reqs = live_reqs  # every request the scheduler holds (Scheduler.live_reqs)

    def dispatch_entries(self) -> List[Tuple[type, Callable[[Any], Any]]]:
        return [(LoadLoRAAdapterReqInput, self.load_lora_adapter), (UnloadLoRAAdapterReqInput, self.unload_lora_adapter)]

    def _manager(self) -> Optional[Any]:
        return self.lora_manager

    def _reply(self, recv: Any, error: Optional[str], in_use_by: int = 0) -> LoRAUpdateOutput:
        manager = self._manager()
        loaded: Dict[str, str] = manager.loaded_adapters() if manager is not None else {}
        return LoRAUpdateOutput(error is None, error, loaded, recv.query_id, in_use_by)

    def load_lora_adapter(self, recv: LoadLoRAAdapterReqInput) -> LoRAUpdateOutput:
        manager = self._manager()
        if manager is None:
            return self._reply(recv, NOT_ENABLED)
        try:
            manager.load_lora_adapter(recv.lora_name, recv.lora_path)
        except LoRAError as e:
            return self._reply(recv, str(e))
        return self._reply(recv, None)

    def unload_lora_adapter(self, recv: UnloadLoRAAdapterReqInput) -> LoRAUpdateOutput:
        manager = self._manager()
        if manager is None:
            return self._reply(recv, NOT_ENABLED)
        # by id: the last batch may be the running batch itself
        users = len({id(r) for r in self.live_reqs() if r.lora_path == recv.lora_name})
        if users:
            return self._reply(recv, f"LoRA adapter {recv.lora_name!r} is in use by {users} request(s)", users)
        if self.forward_thread is not None:
            self.forward_thread.synchronize()
        try:
            manager.unload_lora_adapter(recv.lora_name)
        except LoRAError as e:
            return self._reply(recv, str(e))
        # The name may be loaded again with other weights: its cached prefixes must not match.
        self.ledger.evict_extra_key(recv.lora_name)
        return self._reply(recv, None)
