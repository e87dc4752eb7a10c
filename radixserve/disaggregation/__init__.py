"""Prefill-decode disaggregation (seed 001 §8): the KV transfer between a prefill server and a
decode server. The scheduler's side (PrefillBootstrapQueue, DecodePreallocQueue, ...) lives in
managers/disagg_prefill.py and managers/disagg_decode.py, beside the Scheduler it feeds."""
