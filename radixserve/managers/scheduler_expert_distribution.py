"""The expert distribution recorder's requests on the scheduler side (SGLang's
expert_distribution_handle): start, stop and dump, answered from this rank's recorder (every TP
rank records the same counts). A model without experts refuses them with one line."""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Tuple, Type

from radixserve.layers.expert_distribution import ExpertDistributionRecorder
from radixserve.protocol import ExpertDistributionReq, ExpertDistributionReqOutput, ExpertDistributionReqType


class SchedulerExpertDistribution:
    def __init__(self, recorder: Optional[ExpertDistributionRecorder]):
        self.recorder = recorder

    def dispatch_entries(self) -> List[Tuple[Type, Callable[[Any], Any]]]:
        return [(ExpertDistributionReq, self.handle)]

    def handle(self, recv: ExpertDistributionReq) -> ExpertDistributionReqOutput:
        rec = self.recorder
        if rec is None:
            return ExpertDistributionReqOutput(False, "This model has no experts: there is no expert distribution to record.",
                                               query_id=recv.query_id)
        if recv.action == ExpertDistributionReqType.START_RECORD:
            rec.start()
            return ExpertDistributionReqOutput(True, "Expert distribution recording started.", query_id=recv.query_id)
        if recv.action == ExpertDistributionReqType.STOP_RECORD:
            rec.stop()
            return ExpertDistributionReqOutput(True, "Expert distribution recording stopped.", query_id=recv.query_id)
        try:
            record = rec.dump()
        except (ValueError, OSError) as e:
            return ExpertDistributionReqOutput(False, str(e), query_id=recv.query_id)
        return ExpertDistributionReqOutput(True, f"Expert distribution dumped to {record['path']}.", record, recv.query_id)
