"""PD disaggregation's parts of the Scheduler (seed 001 §8): the prefill server's bootstrap and
inflight queues, or the decode server's prealloc and transfer queues, over one KVManager."""

from __future__ import annotations

from typing import Optional, Tuple

from radixserve.disaggregation.conn import KVManager
from radixserve.disaggregation.transfer import create_transfer_backend
from radixserve.disaggregation.utils import DisaggregationMode, local_ip
from radixserve.managers.disagg_decode import DecodeDisaggregation
from radixserve.managers.disagg_prefill import PrefillDisaggregation
from radixserve.managers.output_processor import SchedulerOutputProcessor
from radixserve.mem_cache.kv_ledger import KVLedger
from radixserve.server_args import ServerArgs


def init_disaggregation(args: ServerArgs, ledger: KVLedger, output_processor: SchedulerOutputProcessor) -> Tuple[
        DisaggregationMode, Optional[PrefillDisaggregation], Optional[DecodeDisaggregation], Optional[KVManager]]:
    """(mode, prefill queues, decode queues, KVManager) over the scheduler's ledger and output
    processor; all None but the mode without --disaggregation-mode."""
    mode = DisaggregationMode(args.disaggregation_mode)
    if mode == DisaggregationMode.NULL:
        return mode, None, None, None
    kv_pool = ledger.kv_pool
    backend = create_transfer_backend(args.disaggregation_transfer_backend, kv_pool, local_ip(args.host))
    kv_manager = KVManager(mode, backend, args.host, args.disaggregation_bootstrap_port, args.disaggregation_timeout)
    if mode == DisaggregationMode.PREFILL:
        prefill = PrefillDisaggregation(kv_manager, ledger, output_processor, args.disaggregation_timeout)
        return mode, prefill, None, kv_manager
    decode = DecodeDisaggregation(kv_manager, ledger, output_processor, args.disaggregation_timeout)
    return mode, None, decode, kv_manager
