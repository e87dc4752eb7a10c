"""EPLB's rebalance request on the scheduler side (SGLang's EplbRebalanceReqInput, /eplb_rebalance):
every TP rank's scheduler receives it and re-places its experts between two forwards (the overlap
loop's forward thread drained first), so the ranks move the weights together."""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple, Type

from radixserve.managers.overlap import ForwardThread
from radixserve.protocol import EplbRebalanceReqInput, EplbRebalanceReqOutput


class SchedulerEPLB:
    def __init__(self, rebalance: Callable[[], Dict[str, float]], forward_thread: Optional[ForwardThread]):
        self.rebalance = rebalance  # the worker's eplb_rebalance
        self.forward_thread = forward_thread

    def dispatch_entries(self) -> List[Tuple[Type, Callable[[Any], Any]]]:
        return [(EplbRebalanceReqInput, self.handle)]

    def handle(self, recv: EplbRebalanceReqInput) -> EplbRebalanceReqOutput:
        if self.forward_thread is not None:
            self.forward_thread.synchronize()  # a step boundary: no forward reads the experts now
        try:
            stats = self.rebalance()
        except ValueError as e:  # EPLB off, nothing recorded: the user's to fix
            return EplbRebalanceReqOutput(False, str(e), query_id=recv.query_id)
        return EplbRebalanceReqOutput(True, "Experts rebalanced.", stats, recv.query_id)
