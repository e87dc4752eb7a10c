"""PD disaggregation's parts of the Scheduler (seed 001 §8): the prefill server's bootstrap and
inflight queues, or the decode server's prealloc and transfer queues, over one KVManager."""

from __future__ import annotations

from typing import Any, Optional, Tuple

from radixserve.disaggregation.conn import KVManager
from radixserve.disaggregation.transfer import create_transfer_backend
from radixserve.disaggregation.utils import DisaggregationMode, local_ip
from radixserve.managers.disagg_decode import DecodeDisaggregation
from radixserve.managers.disagg_prefill import PrefillDisaggregation


def init_disaggregation(s: Any) -> Tuple[DisaggregationMode, Optional[PrefillDisaggregation],
                                         Optional[DecodeDisaggregation], Optional[KVManager]]:
    """(mode, prefill queues, decode queues, KVManager) of Scheduler `s`; all None but the mode
    without --disaggregation-mode."""
    args = s.server_args
    mode = DisaggregationMode(args.disaggregation_mode)
    if mode == DisaggregationMode.NULL:
        return mode, None, None, None
    kv_pool = s.ledger.kv_pool
    backend = create_transfer_backend(args.disaggregation_transfer_backend, kv_pool, local_ip(args.host))
    kv_manager = KVManager(mode, backend, args.host, args.disaggregation_bootstrap_port, args.disaggregation_timeout)
    if mode == DisaggregationMode.PREFILL:
        prefill = PrefillDisaggregation(kv_manager, s.ledger, s.output_processor, args.disaggregation_timeout)
        return mode, prefill, None, kv_manager
    decode = DecodeDisaggregation(kv_manager, s.ledger, s.output_processor, args.disaggregation_timeout)
    return mode, None, decode, kv_manager
